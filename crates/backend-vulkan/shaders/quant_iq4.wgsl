// The IQ4 types, 4-bit indices into one fixed non-linear code book: IQ4_NL (32-element
// blocks) and IQ4_XS (256-element super-blocks). Contract in `quant_common.wgsl`; layouts as
// the CPU oracle (`scalar.rs`, `IQ4_VALUES`).

// The code book's 16 int8 values, four per word, little-endian.
const IQ4_BOOK: vec4<u32> = vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);

fn iq4_value(i: u32) -> i32 {
    return extractBits(bitcast<i32>(IQ4_BOOK[i >> 2u]), (i & 3u) * 8u, 8u);
}

// The code-book values of four indices.
fn iq4_lanes(i: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(vec4<i32>(iq4_value(i.x), iq4_value(i.y), iq4_value(i.z), iq4_value(i.w)));
}

// The values of the 16 bytes `w`, nibble `sh / 4` of each.
fn iq4_vals(w: vec4<u32>, sh: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        iq4_lanes(lanes(w.x, sh, 15u)),
        iq4_lanes(lanes(w.y, sh, 15u)),
        iq4_lanes(lanes(w.z, sh, 15u)),
        iq4_lanes(lanes(w.w, sh, 15u)),
    );
}

// IQ4_NL (18 bytes): f16 d, 16 bytes of nibbles (as Q4_0); d * book[q].
fn iq4_nl_qs(blk: u32, g: u32) -> vec2<f32> {
    return vec2<f32>(qh(blk), 0.0);
}
fn iq4_nl_qv(blk: u32, g: u32) -> mat4x4<f32> {
    return iq4_vals(qw4(blk + 2u), 4u * g);
}

// IQ4_XS (136 bytes): f16 d, u16 of high scale bits (2 per sub-block), 4 bytes of low scale
// nibbles, then 16 bytes of nibbles per 32-element sub-block i (as IQ4_NL);
// (d * (sc - 32)) * book[q].
fn iq4_xs_qs(blk: u32, g: u32) -> vec2<f32> {
    let i = g / 2u;
    let lo = (qb(blk + 4u + i / 2u) >> (4u * (i % 2u))) & 15u;
    let hi = (qw(blk + 2u) >> (2u * i)) & 3u;
    return vec2<f32>(qh(blk) * (f32(lo | (hi << 4u)) - 32.0), 0.0);
}
fn iq4_xs_qv(blk: u32, g: u32) -> mat4x4<f32> {
    return iq4_vals(qw4(blk + 8u + (g / 2u) * 16u), 4u * (g % 2u));
}

// IQ4_NL as a whole block (`T_b32`, contract in `quant_common.wgsl`): Q4_0's layout.
fn iq4_nl_b32(blk: u32) -> Sub32 {
    let f = q_d16(blk);
    return Sub32(vec4<f32>(f.d, 0.0, f.d, 0.0), iq4_vals(f.w, 0u), iq4_vals(f.w, 4u));
}

// IQ4_NL quarter j (`T_q8`): Q4_0's layout.
fn iq4_nl_q8(blk: u32, j: u32) -> Quarter {
    let w = qw(blk + 2u + 4u * j);
    let sc = vec2<f32>(q_head_f16(q_buf[blk >> 2u], blk), 0.0);
    return Quarter(sc, iq4_lanes(lanes(w, 0u, 15u)), iq4_lanes(lanes(w, 4u, 15u)));
}

// IQ4_XS sub-block j (`T_s32`): its 16 bytes of nibbles are words 2 + 4j (136-byte blocks
// stay on words when the weight starts on one, which the host then requires).
fn iq4_xs_s32(blk: u32, j: u32) -> Sub32 {
    let i = (blk >> 2u) + 2u + 4u * j;
    let w = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let s = iq4_xs_qs(blk, 2u * j);
    return Sub32(vec4<f32>(s, s), iq4_vals(w, 0u), iq4_vals(w, 4u));
}
