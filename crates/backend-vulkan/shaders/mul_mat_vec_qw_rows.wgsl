// The rows of `mul_mat_vec_qw`, `_e` and `_r`: workgroup x takes rows 2x and 2x + 1 of w and
// stores each product through `out_d`.

// (first row, byte offsets of the two rows). A row past n reads the first again (uniform, so
// every lane reaches the reductions) and stores nothing.
fn qw_rows(gx: u32, wb: u32, n: u32) -> vec3<u32> {
    let row0 = gx * QW_ROWS;
    let w0 = wb + row0 * pc.b_str.w;
    return vec3<u32>(row0, w0, select(w0, w0 + pc.b_str.w, row0 + 1u < n));
}

// The second row's quarters: the same weight.
fn q_quarter_1(blk: u32, j: u32) -> Quarter {
    return q_quarter(blk, j);
}

// The first QW_ROWS invocations add their row's subgroup sums in subgroup order and store.
fn qw_store(d0: u32, row0: u32, n: u32, li: u32, nsg: u32) {
    if li < QW_ROWS && row0 + li < n {
        var t = 0.0;
        for (var i = 0u; i < nsg; i++) {
            t += qw_part[i * QW_ROWS + li];
        }
        out_d(d0 + (row0 + li) * pc.d_str.w, t);
    }
}
