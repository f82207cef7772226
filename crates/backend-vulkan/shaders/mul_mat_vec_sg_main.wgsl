// Entry point shared by the subgroup flavours of the mat-vec (`mul_mat_vec_k`, `mul_mat_vec_q`,
// `mul_mat_vec_qm`): each subgroup computes whole rows of w in turn (rows sg, sg + nsg, ... of
// the workgroup's ROWS), its lanes splitting k and `subgroupAdd` summing them, so no barrier or
// shared memory is needed and any subgroup size works (8 lanes per row on lavapipe, 32 on
// NVIDIA, a 64-lane subgroup takes all 8 rows). Workgroup z covers rows z * MT .. of x (MT of
// them, fewer in the last); `rows_partial` reads each weight group once for all of them. The
// loop bounds and the row tests are uniform in the subgroup, so every lane reaches the adds;
// the loops over x's rows have a constant trip count, so the accumulators stay in registers.
// The template sets the workgroup size (`SG_WORKGROUP`, a multiple of 64).

@compute @workgroup_size(SG_WORKGROUP)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let n = pc.shape.y;
    let base = batch_bases(wg.y);
    let r0 = wg.z * MT;
    let nr = min(MT, pc.shape.x - r0);
    let a_base = base.y + r0 * pc.a_str.z;
    let d_base = base.x + r0 * pc.d_str.z;
    for (var rw = sg; rw < ROWS; rw += nsg) {
        let row = wg.x * ROWS + rw;
        var p: array<f32, MT>;
        if row < n {
            p = rows_partial(a_base, base.z + row * pc.b_str.w, lane, lanes, nr);
        }
        for (var r = 0u; r < MT; r++) {
            if r < nr {
                let s = subgroupAdd(p[r]);
                if lane == 0u && row < n {
                    out_d(d_base + r * pc.d_str.z + row * pc.d_str.w, s);
                }
            }
        }
    }
}
