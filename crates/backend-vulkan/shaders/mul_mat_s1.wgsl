// MulMat over float weights for prefill on a CPU-type device (`mul_mat_s_body.wgsl`), x loaded
// one element at a time: any offset, row stride and k (an attention's p @ V over a window of
// n_kv keys), values past k's end read as zeros.

// #include mul_mat_s_body.wgsl

fn xq(i: u32, n: u32) -> vec4<f32> {
    var v = vec4<f32>(ld_a(i), 0.0, 0.0, 0.0);
    if n > 1u {
        v.y = ld_a(i + 1u);
    }
    if n > 2u {
        v.z = ld_a(i + 2u);
    }
    if n > 3u {
        v.w = ld_a(i + 3u);
    }
    return v;
}
