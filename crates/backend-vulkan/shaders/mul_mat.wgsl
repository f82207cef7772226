// MulMat, tiled (`mul_mat_body.wgsl`) over float operands: any strided views; B's tiles are
// loaded along whichever axis is contiguous in memory (`prm.y`) so the loads coalesce for
// `x @ w` and `x @ w.T` alike.

// #include mul_mat_body.wgsl

// Bs[kb * 64 + c] = b[k0 + kb, col0 + c] (0 past N or K), four elements per invocation.
fn load_b_tile(li: u32, k0: u32, col0: u32, b_base: u32) {
    for (var e = 0u; e < 4u; e++) {
        let flat = li + e * 256u;
        var c = flat % 64u;
        var kb = flat / 64u;
        if pc.prm.y == 1u {
            c = flat / 16u;
            kb = flat % 16u;
        }
        let gc = col0 + c;
        let gkb = k0 + kb;
        var vb = 0.0;
        if gc < pc.shape.y && gkb < pc.shape.z {
            vb = ld_b(b_base + gkb * pc.b_str.z + gc * pc.b_str.w);
        }
        Bs[kb * 64u + c] = vb;
    }
}
