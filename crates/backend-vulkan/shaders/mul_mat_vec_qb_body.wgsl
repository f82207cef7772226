// The body of `mul_mat_vec_qb*`: `x @ w.T` for one row of f32 x over 32-element GGUF blocks,
// each lane taking whole blocks.
//
// Why: the group body (`mul_mat_vec_q_body.wgsl`) gives each lane a 16-element group, so the
// two lanes sharing a block each load its scale and all 16 bytes of its nibbles through
// byte-unaligned reads (several loads, funnel shifts) and use half of them; on an H200 that
// per-lane work, not memory, bounds it (a Q4_0 product reads a quarter of F16's bytes and takes
// longer).
//
// Strategy: lane i takes blocks i, i + lanes, ... of the row, so a subgroup reads a contiguous
// run of `lanes` blocks; `q_block` (the type's `T_b32`) loads each word of the block once,
// aligned, and decodes all 32 values; the lane dots them with 32 elements of x in eight
// 16-byte loads and applies the block's scale once (and its offset once, times the sum of x).
//
// Invariants: MT is 1 and x is contiguous along k with its offset a multiple of 4 elements
// (the host plans `mul_mat_vec_qb` only so, as `mul_mat_vec_qv`); a lane adds its blocks in
// row order and the subgroup reduction is fixed, so a result does not depend on timing.

// #include mul_mat_vec_head.wgsl

// This lane's part of x . w[row] (one row of x from element `a_base`; `nr` is 1): blocks
// `lane`, `lane + lanes`, ... of the row of w at byte `w_base`.
fn rows_partial(a_base: u32, w_base: u32, lane: u32, lanes: u32, nr: u32) -> array<f32, MT> {
    let nb = pc.shape.z / 32u;
    var acc: array<f32, MT>;
    for (var i = lane; i < nb; i += lanes) {
        let q = q_block(w_base + i * QB);
        let xa = a_base + i * 32u;
        let x0 = ld4_a(xa);
        let x1 = ld4_a(xa + 4u);
        let x2 = ld4_a(xa + 8u);
        let x3 = ld4_a(xa + 12u);
        let x4 = ld4_a(xa + 16u);
        let x5 = ld4_a(xa + 20u);
        let x6 = ld4_a(xa + 24u);
        let x7 = ld4_a(xa + 28u);
        let lo = (dot(x0, q.lo[0]) + dot(x1, q.lo[1])) + (dot(x2, q.lo[2]) + dot(x3, q.lo[3]));
        let hi = (dot(x4, q.hi[0]) + dot(x5, q.hi[1])) + (dot(x6, q.hi[2]) + dot(x7, q.hi[3]));
        var t = q.sc.x * (lo + hi);
        if Q_MIN {
            let sx = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7));
            t += q.sc.y * ((sx.x + sx.y) + (sx.z + sx.w));
        }
        acc[0] += t;
    }
    return acc;
}
