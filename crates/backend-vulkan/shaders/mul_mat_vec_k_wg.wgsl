// Decode mat-vec (`x @ w.T`, one row) for a device without subgroup arithmetic: 8 lanes per row
// of w, 8 rows per workgroup, and a 3-step tree over 64 floats of shared memory.

// #include mul_mat_vec_k_body.wgsl

const LANES: u32 = 8u;

var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let n = pc.shape.y;
    let base = batch_bases(wg.y);
    let lane = li % LANES;
    let row = wg.x * ROWS + li / LANES;
    var p = 0.0;
    if row < n {
        p = row_partial(base.y, base.z + row * pc.b_str.w, lane, LANES);
    }
    red[li] = p;
    workgroupBarrier();
    for (var w = LANES / 2u; w > 0u; w >>= 1u) {
        if lane < w {
            red[li] += red[li + w];
        }
        workgroupBarrier();
    }
    if lane == 0u && row < n {
        st_d(base.x + row * pc.d_str.w, red[li]);
    }
}
