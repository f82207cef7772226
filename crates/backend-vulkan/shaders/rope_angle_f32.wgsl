// The rotary angle formed in f32, for devices without shaderFloat64: at large positions it
// drifts from the CPU oracle by up to ~1e-4 relative (as ggml).

fn angle(p: i32, i: u32) -> f32 {
    let freq = pow(bitcast<f32>(pc.prm.z), -2.0 * f32(i) / f32(pc.shape.w));
    return f32(p) * freq;
}

