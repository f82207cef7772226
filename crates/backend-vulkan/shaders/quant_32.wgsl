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
    return vec2<f32>(f16_bits_to_f32(dm & 0xffffu), f16_bits_to_f32(dm >> 16u));
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
