// The prefill product on cooperative matrices (`mul_mat_cm_body.wgsl`) over GGUF block weights:
// x @ w.T with w's blocks along k (k a whole number of blocks, so of 32; offsets and strides
// of w in bytes, checked by the host).

enable f16;
enable wgpu_cooperative_matrix;

// #include mul_mat_cm_body.wgsl

// w's 64 rows from col0 at k0 .. k0 + 32 into `Bs` [k][n], as f16: invocation i decodes
// group i % 2 (16 values, the type's own `q_scale` / `q_vals`) of row col0 + i / 2; rows past
// n are zeros.
fn load_b_tile(li: u32, b_base: u32, col0: u32, k0: u32) {
    let c = li / 2u;
    let g = li % 2u;
    let gc = col0 + c;
    let kg = k0 + 16u * g;
    if gc >= pc.shape.y {
        for (var j = 0u; j < 16u; j++) {
            Bs[(16u * g + j) * TN + c] = f16(0.0);
        }
        return;
    }
    let blk = b_base + gc * pc.b_str.w + (kg / QK) * QB;
    let gi = (kg % QK) / 16u;
    let sc = q_scale(blk, gi);
    let v = q_vals(blk, gi);
    let off = select(0.0, sc.y, Q_MIN);
    for (var q = 0u; q < 4u; q++) {
        let w = sc.x * v[q] + off;
        let kr = 16u * g + 4u * q;
        Bs[kr * TN + c] = f16(w.x);
        Bs[(kr + 1u) * TN + c] = f16(w.y);
        Bs[(kr + 2u) * TN + c] = f16(w.z);
        Bs[(kr + 3u) * TN + c] = f16(w.w);
    }
}
