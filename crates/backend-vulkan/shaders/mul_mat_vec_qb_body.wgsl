// The body of `mul_mat_vec_qb*`: `x @ w.T` for one row of f32 x over GGUF block weights, each
// lane taking 32 consecutive elements at a time: a whole block of a 32-element type, a
// 32-element sub-block of a super-block type.
//
// Why: the group body (`mul_mat_vec_q_body.wgsl`) gives each lane a 16-element group, so the
// two lanes sharing a block each load its scale and all 16 bytes of its nibbles through
// byte-unaligned reads (several loads, funnel shifts) and use half of them; on an H200 that
// per-lane work, not memory, bounds it (a Q4_0 product reads a quarter of F16's bytes and takes
// longer).
//
// Strategy: lane i takes 32-element pieces i, i + lanes, ... of the row, so a subgroup reads a
// contiguous run of `lanes` pieces; `q_sub` (the type's `T_b32` or `T_s32`) loads each word of
// a piece once, aligned, and decodes all 32 values; the lane dots them with 32 elements of x in
// eight 16-byte loads and applies the scale once per block of a 32-element type (once per
// 16-element half of a super-block's piece, whose halves may have scales of their own).
//
// Invariants: MT is 1 and x is contiguous along k with its offset a multiple of 4 elements
// (the host plans `mul_mat_vec_qb` only so, as `mul_mat_vec_qv`); a lane adds its pieces in
// row order and the subgroup reduction is fixed, so a result does not depend on timing.

// #include mul_mat_vec_head.wgsl

// 32-element pieces per block.
const SPB: u32 = QK / 32u;

fn hsum(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

// This lane's part of x . w[row] (one row of x from element `a_base`; `nr` is 1): pieces
// `lane`, `lane + lanes`, ... of the row of w at byte `w_base`.
fn rows_partial(a_base: u32, w_base: u32, lane: u32, lanes: u32, nr: u32) -> array<f32, MT> {
    let np = pc.shape.z / 32u;
    var acc: array<f32, MT>;
    for (var i = lane; i < np; i += lanes) {
        let q = q_sub(w_base + (i / SPB) * QB, i % SPB);
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
        var t: f32;
        if SPB == 1u {
            t = q.sc.x * (lo + hi);
        } else {
            t = q.sc.x * lo + q.sc.z * hi;
        }
        if Q_MIN {
            let s0 = hsum((x0 + x1) + (x2 + x3));
            let s1 = hsum((x4 + x5) + (x6 + x7));
            if SPB == 1u {
                t += q.sc.y * (s0 + s1);
            } else {
                t += q.sc.y * s0 + q.sc.w * s1;
            }
        }
        acc[0] += t;
    }
    return acc;
}
