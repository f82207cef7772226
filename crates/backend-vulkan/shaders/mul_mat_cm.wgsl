// The prefill product on cooperative matrices (`mul_mat_cm_body.wgsl`) over float weights
// (f32, f16, bf16; any strides): b[.., k, n].

enable f16;
enable wgpu_cooperative_matrix;

// #include mul_mat_cm_body.wgsl

// b's value at element `flat` (0 .. 2048) of its 32x64 tile at (k0, col0), 0 outside b:
// consecutive invocations take consecutive k of one column (w's rows run along k in
// `x @ w.T`). As `a_tile_val`, branch-free.
fn b_tile_val(flat: u32, b_base: u32, col0: u32, k0: u32) -> f32 {
    let gk = k0 + flat % TK;
    let gc = col0 + flat / TK;
    let ok = gk < pc.shape.z && gc < pc.shape.y;
    let v = ld_b(select(0u, b_base + gk * pc.b_str.z + gc * pc.b_str.w, ok));
    return select(0.0, v, ok);
}

fn b_tile_put(flat: u32, v: f32) {
    Bs[(flat % TK) * TN + flat / TK] = f16(v);
}

// b's 32x64 tile at (k0, col0) into `Bs` [k][n], as f16; zeros outside b. Sixteen elements an
// invocation in two written-out rounds of eight, as `load_a_tile`.
fn load_b_tile(li: u32, b_base: u32, col0: u32, k0: u32) {
    for (var e = 0u; e < TK * TN / WG; e += 8u) {
        let f = li + e * WG;
        let v0 = b_tile_val(f, b_base, col0, k0);
        let v1 = b_tile_val(f + WG, b_base, col0, k0);
        let v2 = b_tile_val(f + 2u * WG, b_base, col0, k0);
        let v3 = b_tile_val(f + 3u * WG, b_base, col0, k0);
        let v4 = b_tile_val(f + 4u * WG, b_base, col0, k0);
        let v5 = b_tile_val(f + 5u * WG, b_base, col0, k0);
        let v6 = b_tile_val(f + 6u * WG, b_base, col0, k0);
        let v7 = b_tile_val(f + 7u * WG, b_base, col0, k0);
        b_tile_put(f, v0);
        b_tile_put(f + WG, v1);
        b_tile_put(f + 2u * WG, v2);
        b_tile_put(f + 3u * WG, v3);
        b_tile_put(f + 4u * WG, v4);
        b_tile_put(f + 5u * WG, v5);
        b_tile_put(f + 6u * WG, v6);
        b_tile_put(f + 7u * WG, v7);
    }
}
