// Entry point shared by the subgroup flavours of the decode mat-vec (`mul_mat_vec_k`,
// `mul_mat_vec_q`): each subgroup computes whole rows of w in turn (rows sg, sg + nsg, ... of
// the workgroup's ROWS), its lanes splitting k and `subgroupAdd` summing them, so no barrier or
// shared memory is needed and any subgroup size works (8 lanes per row on lavapipe, 32 on
// NVIDIA, a 64-lane subgroup takes all 8 rows). The loop bound and the row test are uniform in
// the subgroup, so every lane reaches the add. Workgroup z is the row of x (0 for one row).

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let n = pc.shape.y;
    let base = batch_bases(wg.y);
    let a_base = base.y + wg.z * pc.a_str.z;
    let d_base = base.x + wg.z * pc.d_str.z;
    for (var r = sg; r < ROWS; r += nsg) {
        let row = wg.x * ROWS + r;
        var p = 0.0;
        if row < n {
            p = row_partial(a_base, base.z + row * pc.b_str.w, lane, lanes);
        }
        let s = subgroupAdd(p);
        if lane == 0u && row < n {
            st_d(d_base + row * pc.d_str.w, s);
        }
    }
}
