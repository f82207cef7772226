// The accumulators of the prefill products with one invocation per row of w (column of the
// result) and 32 rows of x per workgroup: `mul_mat_q_body.wgsl` (block weights) and
// `mul_mat_s.wgsl` (float weights). Each walks k in groups of 16: it puts its row's group in
// `wq`, then adds the group's products with each row of x to that row's accumulator.

// This invocation's accumulators (one per row of x) and its row's group: four runs of four
// consecutive k.
var<private> acc: array<f32, 32>;
var<private> wq: array<vec4<f32>, 4>;

// One row of x's products with the group (x0 .. x3: its four runs of four k), in the one order
// every such kernel uses. The kernel's `add_group(xk, rows)` adds this for the tile's rows
// 0 .. rows (x elements from `xk`: the tile's first row at the group's first k) to `acc`.
fn row_sum(x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
    let p = dot(x0, wq[0]) + dot(x1, wq[1]);
    return p + (dot(x2, wq[2]) + dot(x3, wq[3]));
}
