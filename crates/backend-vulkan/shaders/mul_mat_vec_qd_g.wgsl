// `mul_mat_vec_qd` over two weights at once, the gate and up projections that SwiGLU
// consumes: `silu(x @ gate.T) * (x @ up.T)` for one row of x, as one dispatch, x quantized once
// for both.
//
// Invariants (checked by the host): the two weights have one block type and row stride, both
// on an even byte; up's rows start at byte `pc.epi.x`; otherwise `mul_mat_vec_qd`'s.

// #include mul_mat_vec_qd_body.wgsl

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let at = qd_begin(wg.x, wg.y, sg * lanes + lane);
    let nb = pc.shape.z / 32u;
    for (var row = at.z + sg; row < at.w; row += nsg) {
        let wg_row = at.y + row * pc.b_str.w;
        let wu_row = pc.epi.x + row * pc.b_str.w;
        var g = 0.0;
        var u = 0.0;
        for (var i = lane; i < nb; i += lanes) {
            let bg = qd_piece(wg_row, i);
            let bu = q_qd_u(wu_row + (i / QD_PPB) * QB, i % QD_PPB);
            g += qd_dot(bg, i);
            u += qd_dot(bu, i);
        }
        let gs = subgroupAdd(g);
        let us = subgroupAdd(u);
        if lane == 0u {
            st_d(at.x + row * pc.d_str.w, silu(gs) * us);
        }
    }
}
