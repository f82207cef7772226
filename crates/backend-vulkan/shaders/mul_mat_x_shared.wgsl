// x shared through the subgroup, for the prefill products with one invocation per row of w
// (`mul_mat_rows.wgsl`): included by `mul_mat_q_s.wgsl` and `mul_mat_s.wgsl`.
//
// Why: every invocation of such a product needs the same x values. Lavapipe (Mesa 22.3) runs a
// storage-buffer load as one load per lane of its SIMD group whether or not the address is
// uniform, so x's loads were 95% of the block product's time ("small" Q4_0, a 64-token
// prompt: 6.6 s of device time against 0.3 s with x made up in registers).
//
// Strategy: for a group of 16 k, lane l of a subgroup of S lanes loads the l % 4-th vec4 of
// row l / 4 of a run of S / 4 rows, so one load serves S / 4 rows; each row's four vec4 then
// come from lanes 4j .. 4j + 3 by `subgroupShuffle`, summed by `row_sum`.
//
// Invariants (checked by the host): 4 <= S <= 64 and S divides the workgroup's 64 invocations
// (full subgroups); every invocation calls `share_group` (uniform loops around the shuffles). The including kernel's
// main sets `lane` and `sg_size` first.

var<private> lane: u32;
var<private> sg_size: u32;

// `add_group` over the group's first `left` values of k (all 16 unless k ends inside the group;
// past the end x is zeros, and `wq` holds zeros there too). The including kernel's `xq(i, n)`
// loads the vec4 of x at element i, of which the first n (1 to 4) are before k's end.
fn share_group(xk: u32, rows: u32, left: u32) {
    let s4 = 4u * pc.a_str.w;
    let run = sg_size / 4u;
    for (var r0 = 0u; r0 < rows; r0 += run) {
        let r = r0 + lane / 4u;
        var xv = vec4<f32>(0.0);
        let q = 4u * (lane % 4u);
        if r < rows && lane < 4u * run && q < left {
            xv = xq(xk + r * pc.a_str.z + (lane % 4u) * s4, min(4u, left - q));
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
