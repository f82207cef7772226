// GetRows of a float table: one element per thread.

const EPT: u32 = 1u;

// Element `col` of table row `id` to the result row at element `d_row`.
fn copy_elems(id: u32, col: u32, d_row: u32) {
    let v = ld_a(pc.offs.y + id * pc.a_str.x + col * pc.a_str.y);
    st_d(d_row + col * pc.d_str.w, v);
}

// #include get_rows_main.wgsl
