// The push constants and batch addressing shared by every decode mat-vec (`mul_mat_vec_k*`
// over float weights, `mul_mat_vec_q*` over GGUF blocks): `x @ w.T`, w's rows (result
// columns) split over workgroup x in ROWS, the batch in workgroup y.

struct Pc {
    // M, N, K, batch extent of axis 1
    shape: vec4<u32>,
    // batch strides 0/1, stride between rows of the result, between result columns
    d_str: vec4<u32>,
    // batch strides 0/1, stride between rows of x, along k
    a_str: vec4<u32>,
    // batch strides 0/1, -, stride between rows of w (columns of w.T); bytes for blocks
    b_str: vec4<u32>,
    // d, a offsets, b offset (elements; bytes for blocks); batch count
    offs: vec4<u32>,
    // batch divisors: a axis 0, a axis 1, b axis 0, b axis 1
    op: vec4<u32>,
    // x: x is contiguous along k
    prm: vec4<u32>,
    // the store's epilogue (`mul_mat_vec_out_e.wgsl`): e offset (elements), op; unused else
    epi: vec4<u32>,
}
var<immediate> pc: Pc;

// Rows of w (result columns) per workgroup.
const ROWS: u32 = 8u;

// Offsets of this batch in d, a and b.
fn batch_bases(bz: u32) -> vec3<u32> {
    let b0 = bz / pc.shape.w;
    let b1 = bz % pc.shape.w;
    return vec3<u32>(
        pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y,
        pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y,
        pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y,
    );
}
