// The rows of `mul_mat_vec_v`, `_e` and `_r`: a subgroup's pair is rows r and r + 1 of w's
// workgroup block of ROWS, each product stored through `out_d`.

// (first row, element offsets of the two rows, rows of the pair within n). An odd last row
// reads its pair's first row twice and stores once.
fn v_rows(gx: u32, rw: u32, n: u32, wb: u32) -> vec4<u32> {
    let row0 = gx * ROWS + rw;
    let w0 = wb + row0 * pc.b_str.w;
    let w1 = select(w0, w0 + pc.b_str.w, row0 + 1u < n);
    return vec4<u32>(row0, w0, w1, min(n - min(row0, n), 2u));
}

// The second row's elements: the same weight.
fn ld8_w1(i: u32) -> mat2x4<f32> {
    return ld8_b(i);
}

fn v_store(d0: u32, rows: vec4<u32>, s: vec2<f32>) {
    if rows.w > 0u {
        out_d(d0 + rows.x * pc.d_str.w, s.x);
    }
    if rows.w > 1u {
        out_d(d0 + (rows.x + 1u) * pc.d_str.w, s.y);
    }
}
