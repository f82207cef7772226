// GetRows of a table stored as raw GGUF blocks (binding `a`): one 16-element group of a block
// per thread, dequantized (`q_scale`/`q_vals`, the block type's one statement in its family
// file) exactly as the CPU oracle does. The table's row stride and offset count bytes.

const EPT: u32 = 16u;

// Elements `col` .. `col + 15` of table row `id` to the result row at element `d_row`.
fn copy_elems(id: u32, col: u32, d_row: u32) {
    let blk = pc.offs.y + id * pc.a_str.x + (col / QK) * QB;
    let g = (col % QK) / 16u;
    let s = q_scale(blk, g);
    var v = q_vals(blk, g);
    for (var c = 0u; c < 4u; c++) {
        for (var e = 0u; e < 4u; e++) {
            let p = s.x * v[c][e];
            st_d(d_row + (col + 4u * c + e) * pc.d_str.w, select(p, p + s.y, Q_MIN));
        }
    }
}

// #include get_rows_main.wgsl
