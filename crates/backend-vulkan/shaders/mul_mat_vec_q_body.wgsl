// Shared by `mul_mat_vec_q` (subgroup reduction) and `mul_mat_vec_q_wg` (shared-memory
// reduction), and by `mul_mat_vec_qm*` (several rows of x): `x @ w.T` with w stored as raw
// GGUF blocks (binding `b`) and f32 x, MT rows of x per workgroup z (the template sets MT).
// The lanes of a group split a row of w by 16-element groups of its blocks (lane i takes
// groups i, i + lanes, ...), so a 256-element super-block still feeds 16 lanes;
// `q_scale`/`q_vals` (the block type's one statement in its family file) dequantize a group
// in registers once, and the lane takes its dot product with the matching 16 elements of each
// row of x as scale * (q . x) + offset * sum(x). Nothing is widened in memory.
//
// Units: d and a offsets and strides count elements; every offset and stride of b counts
// bytes (the host converts whole rows of blocks to bytes), so no element index of a large
// weight has to fit in 32 bits.

// #include mul_mat_vec_head.wgsl

// Elements k .. k + 3 of the row of x at element `a_base` (the branch is uniform; the
// multi-row templates set `X_CONTIGUOUS`, the host sending them only such an x, which keeps
// their 8-fold unrolled loop a third of the size: lavapipe compiles it 2-3x faster).
fn x4(a_base: u32, k: u32) -> vec4<f32> {
    if X_CONTIGUOUS || pc.prm.x == 1u {
        return ld4_a(a_base + k);
    }
    let s = pc.a_str.w;
    let i = a_base + k * s;
    return vec4<f32>(ld_a(i), ld_a(i + s), ld_a(i + 2u * s), ld_a(i + 3u * s));
}

// This lane's part of x . w[row] for rows 0 .. nr of x from element `a_base` (nr <= MT):
// groups `lane`, `lane + lanes`, ... of the row of w at byte `w_base`.
fn rows_partial(a_base: u32, w_base: u32, lane: u32, lanes: u32, nr: u32) -> array<f32, MT> {
    let ng = pc.shape.z / 16u;
    var acc: array<f32, MT>;
    for (var i = lane; i < ng; i += lanes) {
        let blk = w_base + (i / GPB) * QB;
        let g = i % GPB;
        let sc = q_scale(blk, g);
        let v = q_vals(blk, g);
        let k = i * 16u;
        for (var r = 0u; r < MT; r++) {
            if r < nr {
                let ab = a_base + r * pc.a_str.z;
                let x0 = x4(ab, k);
                let x1 = x4(ab, k + 4u);
                let x2 = x4(ab, k + 8u);
                let x3 = x4(ab, k + 12u);
                var t = sc.x * ((dot(x0, v[0]) + dot(x1, v[1])) + (dot(x2, v[2]) + dot(x3, v[3])));
                if Q_MIN {
                    let sx = (x0 + x1) + (x2 + x3);
                    t += sc.y * ((sx.x + sx.y) + (sx.z + sx.w));
                }
                acc[r] += t;
            }
        }
    }
    return acc;
}
