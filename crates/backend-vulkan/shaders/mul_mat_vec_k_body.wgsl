// Shared by `mul_mat_vec_k` (subgroup reduction) and `mul_mat_vec_k_wg` (shared-memory
// reduction): the decode product `x @ w.T` with one row of x, both operands contiguous along k,
// k a multiple of 4 and 16-bit operands starting on a whole word (the host checks all of it).
// A row's dot product is split over the lanes of a group, each lane reading 4 consecutive
// elements per step (`ld4_*`: one vec4 or two packed words), so adjacent lanes read adjacent
// memory and nothing indexes by stride inside the loop.

// #include mul_mat_vec_head.wgsl

// Rows of x per workgroup z: one (the host sends only one).
const MT: u32 = 1u;

// This lane's part of x . w[row]: lanes `lane`, `lane + lanes`, ... of the k axis in steps of 4.
fn row_partial(a_base: u32, w_base: u32, lane: u32, lanes: u32) -> f32 {
    let k_len = pc.shape.z;
    let step = lanes * 4u;
    var s = vec4<f32>(0.0);
    for (var k = lane * 4u; k < k_len; k += step) {
        s = fma(ld4_a(a_base + k), ld4_b(w_base + k), s);
    }
    return (s.x + s.y) + (s.z + s.w);
}

// The entry points' interface: the partial sums for MT rows of x.
fn rows_partial(a_base: u32, w_base: u32, lane: u32, lanes: u32, nr: u32) -> array<f32, MT> {
    return array<f32, MT>(row_partial(a_base, w_base, lane, lanes));
}
