// RmsNorm over the last axis, one invocation per row (`rms_norm_t_body.wgsl`).

// #include rms_norm_t_body.wgsl

fn row_count() -> u32 {
    return pc.offs.z;
}

fn weight(c: vec3<u32>, j: u32) -> f32 {
    return 1.0;
}
