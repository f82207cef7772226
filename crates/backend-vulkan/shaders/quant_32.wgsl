// The 32-element block types (two 16-element groups per block): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
// Contract in `quant_common.wgsl`. Layouts as the CPU oracle: a 4-bit element j < 16 is the low
// nibble of byte j, j >= 16 the high nibble of byte j - 16, so group g is nibble g of bytes
// 0 .. 16; a Q5 element's fifth bit is bit j of a 32-bit word.

// Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; d * (q - 8).
fn q4_0_qs(blk: u32, g: u32) -> vec2<f32> {
    return vec2<f32>(qh(blk), 0.0);
}
fn q4_0_qv(blk: u32, g: u32) -> mat4x4<f32> {
    return cols(qw4(blk + 2u), 4u * g, 15u, 8.0);
}

// Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; d * q + m.
fn q4_1_qs(blk: u32, g: u32) -> vec2<f32> {
    let dm = qw(blk);
    return vec2<f32>(q_f16(dm & 0xffffu), q_f16(dm >> 16u));
}
fn q4_1_qv(blk: u32, g: u32) -> mat4x4<f32> {
    return cols(qw4(blk + 4u), 4u * g, 15u, 0.0);
}

// The 16 five-bit values of group g: nibbles of the 16 bytes `w`, fifth bits from `qh`.
fn q5_vals(w: vec4<u32>, qh: u32, g: u32, bias: f32) -> mat4x4<f32> {
    let sh = 4u * g;
    let b = 16u * g;
    return mat4x4<f32>(
        vec4<f32>(lanes(w.x, sh, 15u) | (bit4(qh, b) << vec4<u32>(4u))) - bias,
        vec4<f32>(lanes(w.y, sh, 15u) | (bit4(qh, b + 4u) << vec4<u32>(4u))) - bias,
        vec4<f32>(lanes(w.z, sh, 15u) | (bit4(qh, b + 8u) << vec4<u32>(4u))) - bias,
        vec4<f32>(lanes(w.w, sh, 15u) | (bit4(qh, b + 12u) << vec4<u32>(4u))) - bias,
    );
}

// `q5_vals` through `u2f`: the whole-block readers' form.
fn q5_vals_f(w: vec4<u32>, qh: u32, g: u32, bias: f32) -> mat4x4<f32> {
    let sh = 4u * g;
    let b = 16u * g;
    return mat4x4<f32>(
        u2f(lanes(w.x, sh, 15u) | (bit4(qh, b) << vec4<u32>(4u)), bias),
        u2f(lanes(w.y, sh, 15u) | (bit4(qh, b + 4u) << vec4<u32>(4u)), bias),
        u2f(lanes(w.z, sh, 15u) | (bit4(qh, b + 8u) << vec4<u32>(4u)), bias),
        u2f(lanes(w.w, sh, 15u) | (bit4(qh, b + 12u) << vec4<u32>(4u)), bias),
    );
}

// Q5_0 (22 bytes): f16 d, 32 high bits, 16 bytes of nibbles; d * (q - 16).
fn q5_0_qs(blk: u32, g: u32) -> vec2<f32> {
    return vec2<f32>(qh(blk), 0.0);
}
fn q5_0_qv(blk: u32, g: u32) -> mat4x4<f32> {
    return q5_vals(qw4(blk + 6u), qw(blk + 2u), g, 16.0);
}

// Q5_1 (24 bytes): f16 d, f16 m, 32 high bits, 16 bytes of nibbles; d * q + m.
fn q5_1_qs(blk: u32, g: u32) -> vec2<f32> {
    return q4_1_qs(blk, g);
}
fn q5_1_qv(blk: u32, g: u32) -> mat4x4<f32> {
    return q5_vals(qw4(blk + 8u), qw(blk + 4u), g, 0.0);
}

// Q8_0 (34 bytes): f16 d, 32 int8; q * d. `b ^ 128` is the byte's i8 plus 128.
fn q8_0_qs(blk: u32, g: u32) -> vec2<f32> {
    return vec2<f32>(qh(blk), 0.0);
}
fn q8_0_qv(blk: u32, g: u32) -> mat4x4<f32> {
    let w = qw4(blk + 2u + 16u * g) ^ vec4<u32>(0x80808080u);
    return cols(w, 0u, 255u, 128.0);
}

// Whole blocks (`T_b32`, contract in `quant_common.wgsl`): r0, r1, ... are the words from the
// one holding the block's first byte; `h` is a block starting two bytes into r0. Values go to
// f32 through `u2f` (the same bits as the group readers' conversions, fewer slow instructions).

fn q4_0_b32(blk: u32) -> Sub32 {
    let f = q_d16(blk);
    let d = vec4<f32>(f.d, 0.0, f.d, 0.0);
    return Sub32(d, cols_f(f.w, 0u, 15u, 8.0), cols_f(f.w, 4u, 15u, 8.0));
}

// 20 bytes: dm is r0 and the nibbles r1 .. r4, or all cut two bytes in (then reaching r5, the
// word of the last byte, loaded only through that address so an aligned block loads r4 again).
fn q4_1_b32(blk: u32) -> Sub32 {
    let i = blk >> 2u;
    let r = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let b = vec4<u32>(r.yzw, q_buf[i + 4u]);
    let c = vec4<u32>(b.yzw, q_buf[(blk + 19u) >> 2u]);
    let w = select(b, q_mid4(b, c), (blk & 2u) != 0u);
    let dm = q_head_dm(r.x, r.y, blk);
    return Sub32(vec4<f32>(dm, dm), cols_f(w, 0u, 15u, 0.0), cols_f(w, 4u, 15u, 0.0));
}

// 22 bytes in r0 .. r5 either way: the high bits r1 and the nibbles r2 .. r5 when `h`, else
// both cut two bytes into r0 and r1.
fn q5_0_b32(blk: u32) -> Sub32 {
    let i = blk >> 2u;
    let a = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let b = vec4<u32>(a.yzw, q_buf[i + 4u]);
    let c = vec4<u32>(b.yzw, q_buf[i + 5u]);
    let h = (blk & 2u) != 0u;
    let qh = select(q_mid(a.x, a.y), a.y, h);
    let w = select(q_mid4(b, c), c, h);
    let d0 = q_head_f16(a.x, blk);
    let d = vec4<f32>(d0, 0.0, d0, 0.0);
    return Sub32(d, q5_vals_f(w, qh, 0u, 16.0), q5_vals_f(w, qh, 1u, 16.0));
}

// 24 bytes: dm r0, high bits r1, nibbles r2 .. r5, or all cut two bytes in (reaching r6, loaded
// through the last byte's address as in `q4_1_b32`).
fn q5_1_b32(blk: u32) -> Sub32 {
    let i = blk >> 2u;
    let a = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let b = vec4<u32>(a.yzw, q_buf[i + 4u]);
    let c = vec4<u32>(b.yzw, q_buf[i + 5u]);
    let e = vec4<u32>(c.yzw, q_buf[(blk + 23u) >> 2u]);
    let h = (blk & 2u) != 0u;
    let qh = select(a.y, q_mid(a.y, a.z), h);
    let w = select(c, q_mid4(c, e), h);
    let dm = q_head_dm(a.x, a.y, blk);
    return Sub32(vec4<f32>(dm, dm), q5_vals_f(w, qh, 0u, 0.0), q5_vals_f(w, qh, 1u, 0.0));
}

// 34 bytes in r0 .. r8 either way: the int8 values r1 .. r8 when `h`, else cut two bytes in.
fn q8_0_b32(blk: u32) -> Sub32 {
    let i = blk >> 2u;
    let a = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let b = vec4<u32>(a.yzw, q_buf[i + 4u]);
    let c = vec4<u32>(q_buf[i + 5u], q_buf[i + 6u], q_buf[i + 7u], q_buf[i + 8u]);
    let e = vec4<u32>(b.w, c.xyz);
    let h = (blk & 2u) != 0u;
    let flip = vec4<u32>(0x80808080u);
    let lo = select(q_mid4(a, b), b, h) ^ flip;
    let hi = select(q_mid4(e, c), c, h) ^ flip;
    let d0 = q_head_f16(a.x, blk);
    let d = vec4<f32>(d0, 0.0, d0, 0.0);
    return Sub32(d, cols_f(lo, 0u, 255u, 128.0), cols_f(hi, 0u, 255u, 128.0));
}

// Quarters (`T_q8`, contract in `quant_common.wgsl`): the word of nibbles (or two words of bytes)
// holding elements 4j .. 4j + 3 and 16 + 4j .. 16 + 4j + 3, and the block's scale.

fn q4_0_q8(blk: u32, j: u32) -> Quarter {
    let w = qw(blk + 2u + 4u * j);
    return Quarter(vec2<f32>(q_head_f16(q_buf[blk >> 2u], blk), 0.0), u2f(lanes(w, 0u, 15u), 8.0), u2f(lanes(w, 4u, 15u), 8.0));
}

fn q4_1_q8(blk: u32, j: u32) -> Quarter {
    let dm = qw(blk);
    let w = qw(blk + 4u + 4u * j);
    let sc = vec2<f32>(q_f16(dm & 0xffffu), q_f16(dm >> 16u));
    return Quarter(sc, u2f(lanes(w, 0u, 15u), 0.0), u2f(lanes(w, 4u, 15u), 0.0));
}

// Q5: element e's fifth bit is bit e of the block's 32 high bits `qh`.
fn q5_quarter(sc: vec2<f32>, qh: u32, w: u32, j: u32, bias: f32) -> Quarter {
    let lo = lanes(w, 0u, 15u) | (bit4(qh, 4u * j) << vec4<u32>(4u));
    let hi = lanes(w, 4u, 15u) | (bit4(qh, 16u + 4u * j) << vec4<u32>(4u));
    return Quarter(sc, u2f(lo, bias), u2f(hi, bias));
}

fn q5_0_q8(blk: u32, j: u32) -> Quarter {
    let sc = vec2<f32>(q_head_f16(q_buf[blk >> 2u], blk), 0.0);
    return q5_quarter(sc, qw(blk + 2u), qw(blk + 6u + 4u * j), j, 16.0);
}

fn q5_1_q8(blk: u32, j: u32) -> Quarter {
    let dm = qw(blk);
    let sc = vec2<f32>(q_f16(dm & 0xffffu), q_f16(dm >> 16u));
    return q5_quarter(sc, qw(blk + 4u), qw(blk + 8u + 4u * j), j, 0.0);
}

fn q8_0_q8(blk: u32, j: u32) -> Quarter {
    let flip = 0x80808080u;
    let lo = qw(blk + 2u + 4u * j) ^ flip;
    let hi = qw(blk + 18u + 4u * j) ^ flip;
    let sc = vec2<f32>(q_head_f16(q_buf[blk >> 2u], blk), 0.0);
    return Quarter(sc, u2f(lanes(lo, 0u, 255u), 128.0), u2f(lanes(hi, 0u, 255u), 128.0));
}

// Whole blocks for the integer-dot products (`T_qd`, contract in `quant_common.wgsl`).

fn q4_0_qd(blk: u32, j: u32) -> QdPiece {
    let s = q_d16(blk);
    let m = vec4<u32>(0x0f0f0f0fu);
    return QdPiece(vec2<f32>(s.d), -8.0 * s.d, s.w & m, (s.w >> vec4<u32>(4u)) & m);
}

fn q4_1_qd(blk: u32, j: u32) -> QdPiece {
    let dm = qw(blk);
    let w = qw4(blk + 4u);
    let m = vec4<u32>(0x0f0f0f0fu);
    let d = vec2<f32>(q_f16(dm & 0xffffu));
    return QdPiece(d, q_f16(dm >> 16u), w & m, (w >> vec4<u32>(4u)) & m);
}

fn q8_0_qd(blk: u32, j: u32) -> QdPiece {
    let s = q_d16(blk);
    return QdPiece(vec2<f32>(s.d), 0.0, s.w, qw4(blk + 18u));
}
