// MulMat over GGUF block weights for prefill (`mul_mat_q_body.wgsl`), x shared through the
// subgroup: what a CPU-type device runs.
//
// Why: every invocation of `mul_mat_q` loads the same x values. Lavapipe (Mesa 22.3) runs a
// storage-buffer load as one load per lane of its SIMD group whether or not the address is
// uniform, so those loads were 95% of the product's time ("small" Q4_0, a 64-token prompt:
// 6.6 s of device time against 0.3 s with x made up in registers).
//
// Strategy: for a group of 16 k, lane l of a subgroup of S lanes loads the l % 4-th vec4 of
// row l / 4 of a run of S / 4 rows, so one load serves S / 4 rows; each row's four vec4 then
// come from lanes 4j .. 4j + 3 by `subgroupShuffle`. The sums are `mul_mat_q`'s, in its order,
// so both kernels give the same bits.
//
// Invariants (checked by the host): 4 <= S <= 64 and S divides the workgroup's 64 invocations
// (full subgroups); every invocation runs `add_group` (uniform loops around the shuffles).

// #include mul_mat_q_body.wgsl

var<private> lane: u32;
var<private> sg_size: u32;

fn add_group(xk: u32, rows: u32) {
    let s4 = 4u * pc.a_str.w;
    let run = sg_size / 4u;
    for (var r0 = 0u; r0 < rows; r0 += run) {
        let r = r0 + lane / 4u;
        var xv = vec4<f32>(0.0);
        if r < rows && lane < 4u * run {
            xv = x4(xk + r * pc.a_str.z + (lane % 4u) * s4);
        }
        let nr = min(run, rows - r0);
        for (var j = 0u; j < nr; j++) {
            acc[r0 + j] += row_sum(
                subgroupShuffle(xv, 4u * j),
                subgroupShuffle(xv, 4u * j + 1u),
                subgroupShuffle(xv, 4u * j + 2u),
                subgroupShuffle(xv, 4u * j + 3u),
            );
        }
    }
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
