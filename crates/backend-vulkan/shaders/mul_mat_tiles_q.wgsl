// B's side of the tiled MulMat (`mul_mat_body.wgsl`) over a block-dtype w: `x @ w.T` for many
// rows of x (prefill) on a GPU (`mul_mat_qt.wgsl`, `mul_mat_qt8.wgsl`).
//
// Why: `mul_mat_q` gives each invocation a row of w against 32 rows of x, so a 2048-row
// weight runs in a few dozen workgroups of 64 invocations; a GPU with a hundred-odd
// multiprocessors idles (on the H200 a 128-token "1b" Q4_0 prompt ran at a seventh of the F16
// file's rate). The float kernel's 64x64 tiles over 256 invocations fill it, and a block type
// fits its k step: 16 elements are one group of every type.
//
// Strategy: for each k step, invocation c < 64 (every invocation of the 8x8 flavour) loads
// group k0 / 16 of w's row col0 + c (`q_scale`, `q_vals`, a step ahead) and decodes it into
// column c of B's tile; the rest of the kernel is the float one.
//
// Invariants (checked by the host): w's blocks run along k (row stride and offsets in bytes,
// `b_str.w` and `offs.z`), k a multiple of the block size.

// #include mul_mat_body.wgsl

// Invocation c < 64's group of w's row col0 + c at k0: the type's scale pair and 16 values
// (`q_scale`, `q_vals`); all zeros past N or K, so the column decodes to zeros. Invocations
// from 64 load nothing.
struct BTile {
    sc: vec2<f32>,
    v: mat4x4<f32>,
}

fn fetch_b_tile(li: u32, k0: u32, col0: u32, b_base: u32) -> BTile {
    var t = BTile(vec2<f32>(), mat4x4<f32>());
    let gc = col0 + li;
    if li < 64u && gc < pc.shape.y && k0 < pc.shape.z {
        let blk = b_base + gc * pc.b_str.w + (k0 / QK) * QB;
        let g = (k0 % QK) / 16u;
        t = BTile(q_scale(blk, g), q_vals(blk, g));
    }
    return t;
}

fn put_b_tile(li: u32, t: BTile) {
    if li >= 64u {
        return;
    }
    for (var c = 0u; c < 4u; c++) {
        for (var r = 0u; r < 4u; r++) {
            var x = t.sc.x * t.v[c][r];
            if Q_MIN {
                x += t.sc.y;
            }
            Bs[(c * 4u + r) * 16u + li / 4u][li % 4u] = x;
        }
    }
}
