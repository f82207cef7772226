// Shared by `mul_mat_vec_k` (subgroup reduction) and `mul_mat_vec_k_wg` (shared-memory
// reduction): the decode product `x @ w.T` with one row of x, both operands contiguous along k,
// k a multiple of 4 and 16-bit operands starting on a whole word (the host checks all of it).
// A row's dot product is split over the lanes of a group, each lane reading 4 consecutive
// elements per step (`ld4_*`: one vec4 or two packed words), so adjacent lanes read adjacent
// memory and nothing indexes by stride inside the loop.

struct Pc {
    // M (1), N, K, batch extent of axis 1
    shape: vec4<u32>,
    // batch strides 0/1, -, stride between result columns
    d_str: vec4<u32>,
    // batch strides 0/1, -, -
    a_str: vec4<u32>,
    // batch strides 0/1, -, stride between rows of w (columns of w.T)
    b_str: vec4<u32>,
    // d, a, b element offsets; batch count
    offs: vec4<u32>,
    // batch divisors: a axis 0, a axis 1, b axis 0, b axis 1
    op: vec4<u32>,
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

// Rows of w (result columns) per workgroup.
const ROWS: u32 = 8u;

// Element offsets of this batch in d, a and b.
fn batch_bases(bz: u32) -> vec3<u32> {
    let b0 = bz / pc.shape.w;
    let b1 = bz % pc.shape.w;
    return vec3<u32>(
        pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y,
        pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y,
        pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y,
    );
}

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
