// Entry point of the one-row flavours of `mul_mat_vec_qd` (plain, `_e`, `_r`): the workgroup
// quantizes x, then its subgroups take its rows of w in turn and store each through `out_d`.

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let at = qd_begin(wg.x, wg.y, sg * lanes + lane);
    for (var row = at.z + sg; row < at.w; row += nsg) {
        let s = subgroupAdd(qd_row(at.y + row * pc.b_str.w, lane, lanes));
        if lane == 0u {
            out_d(at.x + row * pc.d_str.w, s);
        }
    }
}
