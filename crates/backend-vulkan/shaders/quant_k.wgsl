// The K-quant super-blocks (256 elements, 16 groups of 16): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
// Contract in `quant_common.wgsl`; layouts as the CPU oracle (`scalar.rs`). Group g of a
// block always reads 16 consecutive bytes of each bit plane, so values come 4 words at a time.

// Q2_K (84 bytes): 16 scale/min bytes (low/high nibble), 64 bytes of 2-bit values (32 bytes
// per 128 elements, shift 2 * ((e / 32) % 4)), f16 d at 80, f16 dmin at 82;
// (d * sc) * q - dmin * m.
fn q2_k_qs(blk: u32, g: u32) -> vec2<f32> {
    let sc = qb(blk + g);
    let dd = qw(blk + 80u);
    let d = q_f16(dd & 0xffffu);
    let dmin = q_f16(dd >> 16u);
    return vec2<f32>(d * f32(sc & 15u), -(dmin * f32(sc >> 4u)));
}
fn q2_k_qv(blk: u32, g: u32) -> mat4x4<f32> {
    let w = qw4(blk + 16u + (g / 8u) * 32u + (g % 2u) * 16u);
    return cols(w, 2u * ((g / 2u) % 4u), 3u, 0.0);
}

// Q3_K (110 bytes): 32 bytes of high-bit mask (bit e / 32 of byte e % 32; a clear bit
// subtracts 4), 64 bytes of 2-bit values (as Q2_K), 12 bytes of 6-bit scales (low 4 bits in
// bytes 0 .. 8, high 2 bits in bytes 8 .. 12), f16 d at 108; (d * (sc - 32)) * (q - 4 * !h).
fn q3_k_qs(blk: u32, g: u32) -> vec2<f32> {
    let s = blk + 96u;
    var lo: u32;
    if g < 8u {
        lo = qb(s + g) & 15u;
    } else {
        lo = qb(s + g - 8u) >> 4u;
    }
    let hi = (qb(s + 8u + g % 4u) >> (2u * (g / 4u))) & 3u;
    return vec2<f32>(qh(blk + 108u) * (f32(lo | (hi << 4u)) - 32.0), 0.0);
}
fn q3_k_qv(blk: u32, g: u32) -> mat4x4<f32> {
    let l0 = (g % 2u) * 16u;
    let q = qw4(blk + 32u + (g / 8u) * 32u + l0);
    let h = qw4(blk + l0);
    let sh = 2u * ((g / 2u) % 4u);
    let hb = g / 2u;
    return mat4x4<f32>(
        vec4<f32>(lanes(q.x, sh, 3u) + 4u * lanes(h.x, hb, 1u)) - 4.0,
        vec4<f32>(lanes(q.y, sh, 3u) + 4u * lanes(h.y, hb, 1u)) - 4.0,
        vec4<f32>(lanes(q.z, sh, 3u) + 4u * lanes(h.z, hb, 1u)) - 4.0,
        vec4<f32>(lanes(q.w, sh, 3u) + 4u * lanes(h.w, hb, 1u)) - 4.0,
    );
}

// (scale, min) of sub-block j (32 elements) of Q4_K / Q5_K: 6 bits each in the 12 bytes at
// `s`, as (d * sc, -(dmin * m)) with d, dmin the block's leading f16 pair.
fn k_scale_min(blk: u32, j: u32) -> vec2<f32> {
    let s = blk + 4u;
    var sc: u32;
    var m: u32;
    if j < 4u {
        sc = qb(s + j) & 63u;
        m = qb(s + j + 4u) & 63u;
    } else {
        let b = qb(s + j + 4u);
        sc = (b & 15u) | ((qb(s + j - 4u) >> 6u) << 4u);
        m = (b >> 4u) | ((qb(s + j) >> 6u) << 4u);
    }
    let dd = qw(blk);
    return vec2<f32>(
        q_f16(dd & 0xffffu) * f32(sc),
        -(q_f16(dd >> 16u) * f32(m)),
    );
}

// Q4_K (144 bytes): f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles (32 bytes per 64
// elements, low nibbles first); (d * sc) * q - dmin * m per 32 elements.
fn q4_k_qs(blk: u32, g: u32) -> vec2<f32> {
    return k_scale_min(blk, g / 2u);
}
fn q4_k_qv(blk: u32, g: u32) -> mat4x4<f32> {
    let w = qw4(blk + 16u + (g / 4u) * 32u + (g % 2u) * 16u);
    return cols(w, 4u * ((g / 2u) % 2u), 15u, 0.0);
}

// Q5_K (176 bytes): Q4_K's header, 32 bytes of fifth bits at 16 (bit j of byte l for element
// l of sub-block j), nibbles at 48.
fn q5_k_qs(blk: u32, g: u32) -> vec2<f32> {
    return k_scale_min(blk, g / 2u);
}
fn q5_k_qv(blk: u32, g: u32) -> mat4x4<f32> {
    let l0 = (g % 2u) * 16u;
    let q = qw4(blk + 48u + (g / 4u) * 32u + l0);
    let h = qw4(blk + 16u + l0);
    return q5_k_cols(q, h, 4u * ((g / 2u) % 2u), g / 2u);
}

// 16 Q5_K values: nibbles of the 16 bytes `q` at shift `sh`, fifth bits bit `hb` of `h`.
fn q5_k_cols(q: vec4<u32>, h: vec4<u32>, sh: u32, hb: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        vec4<f32>(lanes(q.x, sh, 15u) | (lanes(h.x, hb, 1u) << vec4<u32>(4u))),
        vec4<f32>(lanes(q.y, sh, 15u) | (lanes(h.y, hb, 1u) << vec4<u32>(4u))),
        vec4<f32>(lanes(q.z, sh, 15u) | (lanes(h.z, hb, 1u) << vec4<u32>(4u))),
        vec4<f32>(lanes(q.w, sh, 15u) | (lanes(h.w, hb, 1u) << vec4<u32>(4u))),
    );
}

// `q5_k_cols` through `u2f`: the sub-block readers' form.
fn q5_k_cols_f(q: vec4<u32>, h: vec4<u32>, sh: u32, hb: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        u2f(lanes(q.x, sh, 15u) | (lanes(h.x, hb, 1u) << vec4<u32>(4u)), 0.0),
        u2f(lanes(q.y, sh, 15u) | (lanes(h.y, hb, 1u) << vec4<u32>(4u)), 0.0),
        u2f(lanes(q.z, sh, 15u) | (lanes(h.z, hb, 1u) << vec4<u32>(4u)), 0.0),
        u2f(lanes(q.w, sh, 15u) | (lanes(h.w, hb, 1u) << vec4<u32>(4u)), 0.0),
    );
}

// Q6_K (210 bytes): 128 bytes of low nibbles (64 per 128 elements), 64 bytes of high 2 bits
// (32 per 128 elements), 16 int8 scales at 192, f16 d at 208; (d * sc) * (q - 32).
fn q6_k_qs(blk: u32, g: u32) -> vec2<f32> {
    let sc = f32(qb(blk + 192u + g) ^ 128u) - 128.0;
    return vec2<f32>(qh(blk + 208u) * sc, 0.0);
}
fn q6_k_qv(blk: u32, g: u32) -> mat4x4<f32> {
    let half = g / 8u;
    let r = g % 8u;
    let lo = qw4(blk + half * 64u + (g % 4u) * 16u);
    let hi = qw4(blk + 128u + half * 32u + (g % 2u) * 16u);
    let sl = 4u * (r / 4u);
    let sh = 2u * (r / 2u);
    return mat4x4<f32>(
        vec4<f32>(lanes(lo.x, sl, 15u) | (lanes(hi.x, sh, 3u) << vec4<u32>(4u))) - 32.0,
        vec4<f32>(lanes(lo.y, sl, 15u) | (lanes(hi.y, sh, 3u) << vec4<u32>(4u))) - 32.0,
        vec4<f32>(lanes(lo.z, sl, 15u) | (lanes(hi.z, sh, 3u) << vec4<u32>(4u))) - 32.0,
        vec4<f32>(lanes(lo.w, sl, 15u) | (lanes(hi.w, sh, 3u) << vec4<u32>(4u))) - 32.0,
    );
}

// Sub-blocks (`T_s32`, contract in `quant_common.wgsl`): each reads its 32 elements' bytes as
// whole words. Q2_K (84 bytes), Q4_K (144) and Q5_K (176) blocks stay on words when the weight
// starts on one, which the host then requires; Q3_K (110) and Q6_K (210) blocks alternate
// between a word and two bytes into one, and read through `q_even16`. Sub-block j is groups
// 2j and 2j + 1; a type with a scale per 16 elements gives each half its own.

// (scale, offset) of sub-block j of Q4_K / Q5_K from the block's first four words (d and dmin,
// the 12 scale bytes), as `k_scale_min` computes them.
fn k_sub_scale_min(hdr: vec4<u32>, j: u32) -> vec4<f32> {
    let sh = 8u * (j % 4u);
    let a = (hdr.y >> sh) & 255u;
    let b = (hdr.z >> sh) & 255u;
    let c = (hdr.w >> sh) & 255u;
    let hi = j >= 4u;
    let sc = select(a & 63u, (c & 15u) | ((a >> 6u) << 4u), hi);
    let m = select(b & 63u, (c >> 4u) | ((b >> 6u) << 4u), hi);
    let s = q_f16(hdr.x & 0xffffu) * f32(sc);
    let o = -(q_f16(hdr.x >> 16u) * f32(m));
    return vec4<f32>(s, o, s, o);
}

fn k_header(i: u32) -> vec4<u32> {
    return vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
}

// Q4_K: sub-block j's 32 bytes of nibbles are words 4 + 8 * (j / 2) .., nibble j % 2.
fn q4_k_s32(blk: u32, j: u32) -> Sub32 {
    let i = blk >> 2u;
    let q = i + 4u + (j / 2u) * 8u;
    let lo = vec4<u32>(q_buf[q], q_buf[q + 1u], q_buf[q + 2u], q_buf[q + 3u]);
    let hi = vec4<u32>(q_buf[q + 4u], q_buf[q + 5u], q_buf[q + 6u], q_buf[q + 7u]);
    let sh = 4u * (j % 2u);
    let sc = k_sub_scale_min(k_header(i), j);
    return Sub32(sc, cols_f(lo, sh, 15u, 0.0), cols_f(hi, sh, 15u, 0.0));
}

// Q5_K: nibbles as Q4_K's from word 12, fifth bits bit j of words 4 .. 11.
fn q5_k_s32(blk: u32, j: u32) -> Sub32 {
    let i = blk >> 2u;
    let q = i + 12u + (j / 2u) * 8u;
    let lo = vec4<u32>(q_buf[q], q_buf[q + 1u], q_buf[q + 2u], q_buf[q + 3u]);
    let hi = vec4<u32>(q_buf[q + 4u], q_buf[q + 5u], q_buf[q + 6u], q_buf[q + 7u]);
    let h0 = vec4<u32>(q_buf[i + 4u], q_buf[i + 5u], q_buf[i + 6u], q_buf[i + 7u]);
    let h1 = vec4<u32>(q_buf[i + 8u], q_buf[i + 9u], q_buf[i + 10u], q_buf[i + 11u]);
    let sh = 4u * (j % 2u);
    let sc = k_sub_scale_min(k_header(i), j);
    return Sub32(sc, q5_k_cols_f(lo, h0, sh, j), q5_k_cols_f(hi, h1, sh, j));
}

// Q2_K: sub-block j's 2-bit values are words 4 + 8 * (j / 4) .., shift 2 * (j % 4).
fn q2_k_s32(blk: u32, j: u32) -> Sub32 {
    let q = (blk >> 2u) + 4u + (j / 4u) * 8u;
    let lo = vec4<u32>(q_buf[q], q_buf[q + 1u], q_buf[q + 2u], q_buf[q + 3u]);
    let hi = vec4<u32>(q_buf[q + 4u], q_buf[q + 5u], q_buf[q + 6u], q_buf[q + 7u]);
    let sh = 2u * (j % 4u);
    let sc = vec4<f32>(q2_k_qs(blk, 2u * j), q2_k_qs(blk, 2u * j + 1u));
    return Sub32(sc, cols_f(lo, sh, 3u, 0.0), cols_f(hi, sh, 3u, 0.0));
}

// 16 Q3_K values: 2-bit values of `q` at shift `sh`, high bits bit `hb` of `h`.
fn q3_k_cols_f(q: vec4<u32>, h: vec4<u32>, sh: u32, hb: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        u2f(lanes(q.x, sh, 3u) + 4u * lanes(h.x, hb, 1u), 4.0),
        u2f(lanes(q.y, sh, 3u) + 4u * lanes(h.y, hb, 1u), 4.0),
        u2f(lanes(q.z, sh, 3u) + 4u * lanes(h.z, hb, 1u), 4.0),
        u2f(lanes(q.w, sh, 3u) + 4u * lanes(h.w, hb, 1u), 4.0),
    );
}

// Q3_K: 2-bit values at byte 32 + 32 * (j / 4), shift 2 * (j % 4); high bits bit j of bytes
// 0 .. 32.
fn q3_k_s32(blk: u32, j: u32) -> Sub32 {
    let q = blk + 32u + (j / 4u) * 32u;
    let sh = 2u * (j % 4u);
    let sc = vec4<f32>(q3_k_qs(blk, 2u * j), q3_k_qs(blk, 2u * j + 1u));
    let lo = q3_k_cols_f(q_even16(q), q_even16(blk), sh, j);
    let hi = q3_k_cols_f(q_even16(q + 16u), q_even16(blk + 16u), sh, j);
    return Sub32(sc, lo, hi);
}

// 16 Q6_K values: nibbles of `lo` at shift `sl`, high 2 bits of `hi` at shift `sh`.
fn q6_k_cols_f(lo: vec4<u32>, hi: vec4<u32>, sl: u32, sh: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        u2f(lanes(lo.x, sl, 15u) | (lanes(hi.x, sh, 3u) << vec4<u32>(4u)), 32.0),
        u2f(lanes(lo.y, sl, 15u) | (lanes(hi.y, sh, 3u) << vec4<u32>(4u)), 32.0),
        u2f(lanes(lo.z, sl, 15u) | (lanes(hi.z, sh, 3u) << vec4<u32>(4u)), 32.0),
        u2f(lanes(lo.w, sl, 15u) | (lanes(hi.w, sh, 3u) << vec4<u32>(4u)), 32.0),
    );
}

// Q6_K: nibbles at byte 64 * (j / 4) + 32 * (j % 2), shift 4 * ((j % 4) / 2); high bits at
// byte 128 + 32 * (j / 4), shift 2 * (j % 4); the halves' int8 scales at 192 + 2j.
fn q6_k_s32(blk: u32, j: u32) -> Sub32 {
    let at = q6_k_sub(blk, j);
    let lo = q6_k_cols_f(q_even16(at.x), q_even16(at.y), at.z, at.w);
    let hi = q6_k_cols_f(q_even16(at.x + 16u), q_even16(at.y + 16u), at.z, at.w);
    let sc = q6_k_sub_scales(blk, j);
    return Sub32(vec4<f32>(sc.x, 0.0, sc.y, 0.0), lo, hi);
}

// Where sub-block j of the Q6_K block at `blk` lies: (byte of its low nibbles, byte of its
// high bits, the nibbles' shift, the high bits' shift).
fn q6_k_sub(blk: u32, j: u32) -> vec4<u32> {
    let ql = blk + (j / 4u) * 64u + (j % 2u) * 32u;
    let qh = blk + 128u + (j / 4u) * 32u;
    return vec4<u32>(ql, qh, 4u * ((j % 4u) / 2u), 2u * (j % 4u));
}

// The (d * sc) of sub-block j's two halves.
fn q6_k_sub_scales(blk: u32, j: u32) -> vec2<f32> {
    let s = q_even_u16(blk + 192u + 2u * j);
    let d = q_f16(q_even_u16(blk + 208u));
    return vec2<f32>(d * (f32((s & 255u) ^ 128u) - 128.0), d * (f32((s >> 8u) ^ 128u) - 128.0));
}

// Pieces for the integer-dot products (`T_qd`, contract in `quant_common.wgsl`): the words of
// `T_s32`, kept as integers.

// Q4_K: nibbles of sub-block j as bytes; (d * sc) per element, -(dmin * m) added.
fn q4_k_qd(blk: u32, j: u32) -> QdPiece {
    let i = blk >> 2u;
    let q = i + 4u + (j / 2u) * 8u;
    let lo = vec4<u32>(q_buf[q], q_buf[q + 1u], q_buf[q + 2u], q_buf[q + 3u]);
    let hi = vec4<u32>(q_buf[q + 4u], q_buf[q + 5u], q_buf[q + 6u], q_buf[q + 7u]);
    let sh = vec4<u32>(4u * (j % 2u));
    let m = vec4<u32>(0x0f0f0f0fu);
    let sc = k_sub_scale_min(k_header(i), j);
    return QdPiece(sc.xz, sc.y, (lo >> sh) & m, (hi >> sh) & m);
}

// Q6_K's 6-bit values (nibbles of `lo` at shift `sl`, high 2 bits of `hi` at shift `sh`) minus
// 32, as signed bytes: q + 96 per byte (no carry: q < 64), then the top bit flipped.
fn q6_k_signed(lo: vec4<u32>, hi: vec4<u32>, sl: u32, sh: u32) -> vec4<u32> {
    let q = ((lo >> vec4<u32>(sl)) & vec4<u32>(0x0f0f0f0fu))
        | (((hi >> vec4<u32>(sh)) & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    return ((q | vec4<u32>(0x80808080u)) - vec4<u32>(0x20202020u)) ^ vec4<u32>(0x80808080u);
}

// Q6_K: sub-block j's values minus 32, signed; each half's (d * sc).
fn q6_k_qd(blk: u32, j: u32) -> QdPiece {
    let at = q6_k_sub(blk, j);
    let w0 = q6_k_signed(q_even16(at.x), q_even16(at.y), at.z, at.w);
    let w1 = q6_k_signed(q_even16(at.x + 16u), q_even16(at.y + 16u), at.z, at.w);
    return QdPiece(q6_k_sub_scales(blk, j), 0.0, w0, w1);
}
