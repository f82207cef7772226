// MulMat, tiled (`mul_mat_body.wgsl`), over a block-dtype w: `x @ w.T` for many rows of x
// (prefill) on a GPU.
//
// Why: `mul_mat_q` gives each invocation a row of w against 32 rows of x, so a 2048-row
// weight runs in a few dozen workgroups of 64 invocations; a GPU with a hundred-odd
// multiprocessors idles (on the H200 a 128-token "1b" Q4_0 prompt ran at a seventh of the F16
// file's rate). The float kernel's 64x64 tiles over 256 invocations fill it, and a block type
// fits its k step: 16 elements are one group of every type.
//
// Strategy: for each k step, invocation c < 64 decodes group k0 / 16 of w's row col0 + c
// (`q_scale`, `q_vals`) into column c of B's tile; the rest of the kernel is the float one.
//
// Invariants (checked by the host): w's blocks run along k (row stride and offsets in bytes,
// `b_str.w` and `offs.z`), k a multiple of the block size.

// #include mul_mat_body.wgsl

fn load_b_tile(li: u32, k0: u32, col0: u32, b_base: u32) {
    if li >= 64u {
        return;
    }
    let gc = col0 + li;
    if gc >= pc.shape.y {
        for (var kb = 0u; kb < 16u; kb++) {
            Bs[kb * 64u + li] = 0.0;
        }
        return;
    }
    let blk = b_base + gc * pc.b_str.w + (k0 / QK) * QB;
    let g = (k0 % QK) / 16u;
    let sc = q_scale(blk, g);
    let v = q_vals(blk, g);
    for (var c = 0u; c < 4u; c++) {
        for (var r = 0u; r < 4u; r++) {
            var x = sc.x * v[c][r];
            if Q_MIN {
                x += sc.y;
            }
            Bs[(c * 4u + r) * 64u + li] = x;
        }
    }
}
