// The rows of `mul_mat_vec_v_g`: a subgroup's pair is row r of the gate weight (binding b) and
// row r of the up weight (binding u, of the same dtype and row stride, at element `pc.epi.x`),
// r = ROWS / 2 rows per workgroup, stored as SwiGLU, `silu(gate) * up`.

// (row, element offsets of its gate and up rows, 1 if the row is within n).
fn v_rows(gx: u32, rw: u32, n: u32, wb: u32) -> vec4<u32> {
    let row = gx * (ROWS / 2u) + rw / 2u;
    return vec4<u32>(row, wb + row * pc.b_str.w, pc.epi.x + row * pc.b_str.w, u32(row < n));
}

// The second row's elements: the up weight's.
fn ld8_w1(i: u32) -> mat2x4<f32> {
    return ld8_u(i);
}

fn v_store(d0: u32, rows: vec4<u32>, s: vec2<f32>) {
    if rows.w > 0u {
        st_d(d0 + rows.x * pc.d_str.w, silu(s.x) * s.y);
    }
}
