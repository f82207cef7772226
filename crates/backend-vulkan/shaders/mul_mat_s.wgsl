// MulMat over float weights for prefill on a CPU-type device (`mul_mat_s_body.wgsl`), x loaded
// 16 bytes at a time: x's offset and strides are multiples of 4 elements and k is a multiple
// of 4 (checked by the host), so every vec4 of x is whole and aligned.

// #include mul_mat_s_body.wgsl

fn xq(i: u32, n: u32) -> vec4<f32> {
    return ld4_a(i);
}
