// The decode mat-vec's store with an element-wise epilogue: the op that consumed the product in
// the graph (`crate::fusion` proved the product dead after it) runs in the store instead, so
// the product is never written and the op is no dispatch of its own.
//
// Strategy: binding `e` is the op's other operand, laid out as d (same shape and strides, the
// host checks it), at element offset `pc.epi.x`; `pc.epi.y` names the op: 0 the residual add
// `e + s`, 1 SwiGLU with the product as the up half `silu(e) * s`, 2 with the product as the
// gate half `silu(s) * e`. The expressions are the element-wise kernel's (`eltwise.wgsl`), so
// a result rounds as the unfused pair's.
//
// Invariant: the thread that stores element i is the only one reading element i of `e`, and it
// reads before it stores, so `e` may be the same bytes as d (an in-place add).

fn out_d(i: u32, s: f32) {
    let e = ld_e(i - pc.offs.x + pc.epi.x);
    var r = e + s;
    if pc.epi.y == 1u {
        r = silu(e) * s;
    } else if pc.epi.y == 2u {
        r = silu(s) * e;
    }
    st_d(i, r);
}
