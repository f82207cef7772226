// The body of the float prefill product on a CPU-type device (`LOWSYNC_VK_ROW_LANES`;
// `mul_mat_s.wgsl` with 16-byte loads of x, `mul_mat_s1.wgsl` with any k):
// dst[.., m, n] = sum_k x[.., m, k] * b[.., k, n], one invocation per column n of the result
// (64 a workgroup) and 32 rows of x per workgroup y, batches in z (GQA broadcast by division),
// x shared through the subgroup (`mul_mat_x_shared.wgsl`).
//
// Why: the tiled product (`mul_mat_body.wgsl`) stages both tiles in workgroup memory between
// barriers; lavapipe runs a barrier as a switch between a workgroup's SIMD groups and every
// workgroup-memory access as one load per lane. Here nothing waits and each x value is loaded
// once per subgroup.
//
// Strategy: the invocation walks k in groups of 16: it loads its column's 16 values of b (zeros
// past k's end) into `wq`, then adds their products with each row of x (`row_sum`, in
// `mul_mat_rows.wgsl`'s order).
//
// Invariants (checked by the host): x f32 and contiguous along k; b any float dtype and
// strides. Columns past n read column n - 1 and store nothing. The including kernel defines
// `xq` (`mul_mat_x_shared.wgsl`).

// #include mul_mat_rows.wgsl
// #include mul_mat_x_shared.wgsl

// b[k0 + kk] of the column at `col`, or 0 at and past `left` values.
fn bv(col: u32, k0: u32, kk: u32, left: u32) -> f32 {
    if kk < left {
        return ld_b(col + (k0 + kk) * pc.b_str.z);
    }
    return 0.0;
}

fn b4(col: u32, k0: u32, q: u32, left: u32) -> vec4<f32> {
    let kk = 4u * q;
    return vec4<f32>(
        bv(col, k0, kk, left),
        bv(col, k0, kk + 1u, left),
        bv(col, k0, kk + 2u, left),
        bv(col, k0, kk + 3u, left),
    );
}

fn load_group(col: u32, k0: u32, left: u32) {
    wq[0] = b4(col, k0, 0u, left);
    wq[1] = b4(col, k0, 1u, left);
    wq[2] = b4(col, k0, 2u, left);
    wq[3] = b4(col, k0, 3u, left);
}

fn add_group(xk: u32, rows: u32, left: u32) {
    share_group(xk, rows, left);
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
