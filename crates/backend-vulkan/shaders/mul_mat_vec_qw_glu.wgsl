// The rows of `mul_mat_vec_qw_g`: workgroup x takes row x of the gate weight (binding b) and
// row x of the up weight (binding u, of the same type and row stride, at byte `pc.epi.x`), and
// stores SwiGLU of the two products, `silu(gate) * up`.

// (row, byte offsets of its gate and up rows).
fn qw_rows(gx: u32, wb: u32, n: u32) -> vec3<u32> {
    return vec3<u32>(gx, wb + gx * pc.b_str.w, pc.epi.x + gx * pc.b_str.w);
}

// The second row's quarters: the up weight's.
fn q_quarter_1(blk: u32, j: u32) -> Quarter {
    return q_quarter_u(blk, j);
}

// Each product's subgroup sums added in subgroup order, as `mul_mat_vec_qw_rows.wgsl` adds a
// row's, so the result is the unfused products' and SwiGLU's bit for bit.
fn qw_store(d0: u32, row: u32, n: u32, li: u32, nsg: u32) {
    if li == 0u {
        var g = 0.0;
        var u = 0.0;
        for (var i = 0u; i < nsg; i++) {
            g += qw_part[i * QW_ROWS];
            u += qw_part[i * QW_ROWS + 1u];
        }
        st_d(d0 + row * pc.d_str.w, silu(g) * u);
    }
}
