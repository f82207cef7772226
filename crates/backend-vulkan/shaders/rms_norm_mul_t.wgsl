// RmsNorm over the last axis times a weight broadcast onto the rows, one invocation per row
// (`rms_norm_t_body.wgsl`): the fused `RmsNorm -> Mul` a Llama block starts each half with.

// #include rms_norm_t_body.wgsl

fn row_count() -> u32 {
    return pc.offs.w;
}

fn weight(c: vec3<u32>, j: u32) -> f32 {
    return ld_w(pc.offs.z + dot3(c, pc.b_str) + j * pc.b_str.w);
}
