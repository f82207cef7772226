// The prefill product on cooperative matrices (`mul_mat_cm_body.wgsl`) over float weights
// (f32, f16, bf16; any strides): b[.., k, n].

enable f16;
enable wgpu_cooperative_matrix;

// #include mul_mat_cm_body.wgsl

// b's 32x64 tile at (k0, col0) into `Bs` [k][n], as f16; zeros outside b. Consecutive
// invocations take consecutive k of one column (w's rows run along k in `x @ w.T`).
fn load_b_tile(li: u32, b_base: u32, col0: u32, k0: u32) {
    for (var e = 0u; e < TK * TN / WG; e++) {
        let flat = li + e * WG;
        let kk = flat % TK;
        let c = flat / TK;
        let gk = k0 + kk;
        let gc = col0 + c;
        var v = 0.0;
        if gk < pc.shape.z && gc < pc.shape.y {
            v = ld_b(b_base + gk * pc.b_str.z + gc * pc.b_str.w);
        }
        Bs[kk * TN + c] = f16(v);
    }
}
