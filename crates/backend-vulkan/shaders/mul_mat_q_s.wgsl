// MulMat over GGUF block weights for prefill (`mul_mat_q_body.wgsl`), x shared through the
// subgroup (`mul_mat_x_shared.wgsl`): what a CPU-type device runs. The sums are
// `mul_mat_q`'s, in its order, so both kernels give the same bits.

// #include mul_mat_q_body.wgsl
// #include mul_mat_x_shared.wgsl

fn add_group(xk: u32, rows: u32, left: u32) {
    share_group(xk, rows, left);
}

fn xq(i: u32, n: u32) -> vec4<f32> {
    return x4(i);
}

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(subgroup_invocation_id) sl: u32,
    @builtin(subgroup_size) ss: u32,
) {
    lane = sl;
    sg_size = ss;
    prefill(wg, lid.x);
}
