// The walk shared by the prefill products with one invocation per row of w (column of the
// result) and 32 rows of x per workgroup: `mul_mat_q_body.wgsl` (block weights) and
// `mul_mat_s_body.wgsl` (float weights). `prefill` walks k in groups of 16: the including
// kernel's `load_group(col, k0, left)` puts its row's group in `wq` (zeros past k's end:
// `left` values remain from k0), its `add_group(xk, rows, left)` adds the group's products with
// each row of x to that row's accumulator (`row_sum`), and the accumulators are stored at the
// end. Offsets and strides of d and x count elements; w's, as `load_group` reads them (block
// weights: bytes).

struct Pc {
    // M, N, K, batch extent of axis 1
    shape: vec4<u32>,
    // batch strides 0/1, stride between rows of the result, between result columns
    d_str: vec4<u32>,
    // batch strides 0/1, stride between rows of x, along k
    a_str: vec4<u32>,
    // batch strides 0/1, along k (float w), between rows of w
    b_str: vec4<u32>,
    // d, a, b offsets; batch count
    offs: vec4<u32>,
    // batch divisors: a axis 0, a axis 1, b axis 0, b axis 1
    op: vec4<u32>,
    // x: x is contiguous along k
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

// Rows of w per workgroup (`QUANT_TILE_N` in `src/ops/matmul.rs`) and rows of x per
// workgroup (`QUANT_TILE_M`).
const BN: u32 = 64u;
const RB: u32 = 32u;

// This invocation's accumulators (one per row of x) and its row's group: four runs of four
// consecutive k.
var<private> acc: array<f32, 32>;
var<private> wq: array<vec4<f32>, 4>;

// One row of x's products with the group (x0 .. x3: its four runs of four k), in the one order
// every such kernel uses. `add_group(xk, rows, left)` adds this for the tile's rows 0 .. rows
// (x elements from `xk`: the tile's first row at the group's first k) to `acc`.
fn row_sum(x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
    let p = dot(x0, wq[0]) + dot(x1, wq[1]);
    return p + (dot(x2, wq[2]) + dot(x3, wq[3]));
}

fn prefill(wg: vec3<u32>, lx: u32) {
    let M = pc.shape.x;
    let N = pc.shape.y;
    let K = pc.shape.z;
    let b0 = wg.z / pc.shape.w;
    let b1 = wg.z % pc.shape.w;
    let d_base = pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y;
    let a_base = pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y;
    let b_base = pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y;
    let n = wg.x * BN + lx;
    let row0 = wg.y * RB;
    // Rows of x this workgroup covers (the same for every invocation: uniform loops).
    let rows = min(RB, M - row0);
    let col = b_base + min(n, N - 1u) * pc.b_str.w;
    let x_row0 = a_base + row0 * pc.a_str.z;

    for (var r = 0u; r < RB; r++) {
        acc[r] = 0.0;
    }
    for (var k0 = 0u; k0 < K; k0 += 16u) {
        let left = min(16u, K - k0);
        load_group(col, k0, left);
        add_group(x_row0 + k0 * pc.a_str.w, rows, left);
    }
    if n < N {
        for (var r = 0u; r < rows; r++) {
            st_d(d_base + (row0 + r) * pc.d_str.z + n * pc.d_str.w, acc[r]);
        }
    }
}
