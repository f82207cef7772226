// Entry point shared by the shared-memory flavours of the decode mat-vec (`mul_mat_vec_k_wg`,
// `mul_mat_vec_q_wg`), for a device without subgroup arithmetic: 8 lanes per row of w, 8 rows
// per workgroup, and a 3-step tree over 64 floats of shared memory. Workgroup z is the row of
// x (0 for one row).

const LANES: u32 = 8u;

var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let n = pc.shape.y;
    let base = batch_bases(wg.y);
    let a_base = base.y + wg.z * pc.a_str.z;
    let d_base = base.x + wg.z * pc.d_str.z;
    let lane = li % LANES;
    let row = wg.x * ROWS + li / LANES;
    var p = 0.0;
    if row < n {
        p = row_partial(a_base, base.z + row * pc.b_str.w, lane, LANES);
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
        st_d(d_base + row * pc.d_str.w, red[li]);
    }
}
