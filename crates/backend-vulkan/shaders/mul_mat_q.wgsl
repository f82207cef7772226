// MulMat over GGUF block weights for prefill (`mul_mat_q_body.wgsl`), x read by every
// invocation: the kernel for a device without subgroup shuffles (`mul_mat_q_s.wgsl` is the
// one a CPU-type device runs).
//
// Strategy: each invocation loads the four vec4 of each row of x it needs itself (the same
// addresses in every invocation of the workgroup).

// #include mul_mat_q_body.wgsl

fn add_group(xk: u32, rows: u32, left: u32) {
    let s4 = 4u * pc.a_str.w;
    for (var r = 0u; r < rows; r++) {
        let i = xk + r * pc.a_str.z;
        acc[r] += row_sum(x4(i), x4(i + s4), x4(i + 2u * s4), x4(i + 3u * s4));
    }
}

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    prefill(wg, lid.x);
}
