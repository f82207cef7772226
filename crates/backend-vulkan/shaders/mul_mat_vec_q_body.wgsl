// Shared by `mul_mat_vec_q` (subgroup reduction) and `mul_mat_vec_q_wg` (shared-memory
// reduction): `x @ w.T` with w stored as raw GGUF blocks (binding `b`) and f32 x, one row of x
// per workgroup z. The lanes of a group split a row of w by 16-element groups of its blocks
// (lane i takes groups i, i + lanes, ...), so a 256-element super-block still feeds 16 lanes;
// `q_scale`/`q_vals` (the block type's one statement in its family file) dequantize a group
// in registers and the lane takes its dot product with the matching 16 elements of x as
// scale * (q . x) + offset * sum(x). Nothing is widened in memory.
//
// Units: d and a offsets and strides count elements; every offset and stride of b counts
// bytes (the host converts whole rows of blocks to bytes), so no element index of a large
// weight has to fit in 32 bits.

// #include mul_mat_vec_head.wgsl

// Elements k .. k + 3 of the row of x at element `a_base` (the branch is uniform).
fn x4(a_base: u32, k: u32) -> vec4<f32> {
    if pc.prm.x == 1u {
        return ld4_a(a_base + k);
    }
    let s = pc.a_str.w;
    let i = a_base + k * s;
    return vec4<f32>(ld_a(i), ld_a(i + s), ld_a(i + 2u * s), ld_a(i + 3u * s));
}

// This lane's part of x . w[row]: groups `lane`, `lane + lanes`, ... of the row at byte `w_base`.
fn row_partial(a_base: u32, w_base: u32, lane: u32, lanes: u32) -> f32 {
    let ng = pc.shape.z / 16u;
    var s = 0.0;
    for (var i = lane; i < ng; i += lanes) {
        let blk = w_base + (i / GPB) * QB;
        let g = i % GPB;
        let sc = q_scale(blk, g);
        let v = q_vals(blk, g);
        let k = i * 16u;
        let x0 = x4(a_base, k);
        let x1 = x4(a_base, k + 4u);
        let x2 = x4(a_base, k + 8u);
        let x3 = x4(a_base, k + 12u);
        s += sc.x * ((dot(x0, v[0]) + dot(x1, v[1])) + (dot(x2, v[2]) + dot(x3, v[3])));
        if Q_MIN {
            let sx = (x0 + x1) + (x2 + x3);
            s += sc.y * ((sx.x + sx.y) + (sx.z + sx.w));
        }
    }
    return s;
}
