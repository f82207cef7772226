// x through the RmsNorm (times its weight) that feeds the product: the float decode mat-vec
// body (`mul_mat_vec_v_body.wgsl`) reads the norm's source x and its weight g (binding n, f32, element `pc.prm.z` for x's first;
// eps in `pc.prm.w` as f32 bits) instead of the norm's result, which is never written.
//
// Why: a decode step runs a norm before each layer's q/k/v products and its gate/up products,
// a dispatch of its own between two that wait for it; every product workgroup reads the whole
// row of x anyway, so it can normalise it itself.
//
// Strategy: w . (x * inv * g) = inv * (w . (x * g)) with inv = 1 / sqrt(mean(x^2) + eps), so
// a lane multiplies each x by g as it loads it and adds x^2 to its sum of squares; the
// squares are added over the subgroup with the products, and each product is scaled by inv.
// A subgroup's lanes cover the whole row, so it sees every x once. (The two-row block body
// took the same fold, and "1b" Q4_0 decoded slower with it on the H200: its products are bound
// by decoding blocks, not by waiting for the norm.)
//
// Invariant: the result differs from the unfused norm and product only in f32 rounding (inv
// applied after the sum instead of to each element).

var<private> x_ss: f32;

fn x8_a(i: u32) -> mat2x4<f32> {
    let v = ld8_a(i);
    let g = ld8_n(i - pc.offs.y + pc.prm.z);
    x_ss += dot(v[0], v[0]) + dot(v[1], v[1]);
    return mat2x4<f32>(v[0] * g[0], v[1] * g[1]);
}

fn x_inv(ss: f32) -> f32 {
    return 1.0 / sqrt(ss / f32(pc.shape.z) + bitcast<f32>(pc.prm.w));
}

// A subgroup's two row sums, scaled; the sum of squares starts again for its next pair.
fn x_sum2(p: vec2<f32>) -> vec2<f32> {
    let ss = subgroupAdd(x_ss);
    x_ss = 0.0;
    return subgroupAdd(p) * x_inv(ss);
}
