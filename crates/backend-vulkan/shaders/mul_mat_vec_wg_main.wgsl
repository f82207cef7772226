// Entry point shared by the shared-memory flavours of the mat-vec (`mul_mat_vec_k_wg`,
// `mul_mat_vec_q_wg`, `mul_mat_vec_qm_wg`), for a device without subgroup arithmetic: 8 lanes
// per row of w, 8 rows per workgroup, and a 3-step tree over 64 floats of shared memory per
// row of x. Workgroup z covers rows z * MT .. of x (MT of them, fewer in the last).

const LANES: u32 = 8u;

var<workgroup> red: array<f32, 64u * MT>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let n = pc.shape.y;
    let base = batch_bases(wg.y);
    let r0 = wg.z * MT;
    let nr = min(MT, pc.shape.x - r0);
    let a_base = base.y + r0 * pc.a_str.z;
    let d_base = base.x + r0 * pc.d_str.z;
    let lane = li % LANES;
    let row = wg.x * ROWS + li / LANES;
    var p: array<f32, MT>;
    if row < n {
        p = rows_partial(a_base, base.z + row * pc.b_str.w, lane, LANES, nr);
    }
    for (var r = 0u; r < MT; r++) {
        red[r * 64u + li] = p[r];
    }
    workgroupBarrier();
    for (var w = LANES / 2u; w > 0u; w >>= 1u) {
        if lane < w {
            for (var r = 0u; r < MT; r++) {
                red[r * 64u + li] += red[r * 64u + li + w];
            }
        }
        workgroupBarrier();
    }
    if lane == 0u && row < n {
        for (var r = 0u; r < MT; r++) {
            if r < nr {
                out_d(d_base + r * pc.d_str.z + row * pc.d_str.w, red[r * 64u + li]);
            }
        }
    }
}
