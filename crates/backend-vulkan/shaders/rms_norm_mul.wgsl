// RmsNorm over the last axis times a weight broadcast onto the rows, in one pass: the fused
// `RmsNorm -> Mul` a Llama block starts each half with.
//
// Why: unfused, the normalised row goes to memory and an element-wise dispatch reads it back to
// multiply it by the norm's weight; the chain is fused only where that row is dead after the
// product (`crate::fusion`), so it never needs writing.
//
// Strategy: as `rms_norm.wgsl` (one workgroup per row, a tree reduction of the sum of squares),
// then each element x * inv rounded to f32, as the unfused f32 norm stores it, times the weight.
//
// Invariant: the result is bit-identical to the unfused f32 `RmsNorm` and `Mul`.

struct Pc {
    // leading row dims in xyz, row length in w
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    // weight strides (0 on broadcast axes)
    b_str: vec4<u32>,
    // d, a, weight offsets; rows
    offs: vec4<u32>,
    op: vec4<u32>,
    // f32 bits: eps
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

var<workgroup> red: array<f32, 256>;
// Elements per thread and round.
const U: u32 = 8u;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = group_id(wg, nwg);
    if row >= pc.offs.w {
        return;
    }
    let c = coord3(row, pc.shape);
    let a0 = pc.offs.y + dot3(c, pc.a_str);
    let w0 = pc.offs.z + dot3(c, pc.b_str);
    let d0 = pc.offs.x + dot3(c, pc.d_str);
    let len = pc.shape.w;
    // U elements per thread and round, loaded before any is used (written out: a loop that uses
    // each load first waits for every one in turn); the sum still runs over j in order.
    var s = 0.0;
    for (var j0 = li; j0 < len; j0 += 256u * U) {
        var v: array<f32, U>;
        if j0 + 0u * 256u < len {
            v[0] = ld_a(a0 + (j0 + 0u * 256u) * pc.a_str.w);
        }
        if j0 + 1u * 256u < len {
            v[1] = ld_a(a0 + (j0 + 1u * 256u) * pc.a_str.w);
        }
        if j0 + 2u * 256u < len {
            v[2] = ld_a(a0 + (j0 + 2u * 256u) * pc.a_str.w);
        }
        if j0 + 3u * 256u < len {
            v[3] = ld_a(a0 + (j0 + 3u * 256u) * pc.a_str.w);
        }
        if j0 + 4u * 256u < len {
            v[4] = ld_a(a0 + (j0 + 4u * 256u) * pc.a_str.w);
        }
        if j0 + 5u * 256u < len {
            v[5] = ld_a(a0 + (j0 + 5u * 256u) * pc.a_str.w);
        }
        if j0 + 6u * 256u < len {
            v[6] = ld_a(a0 + (j0 + 6u * 256u) * pc.a_str.w);
        }
        if j0 + 7u * 256u < len {
            v[7] = ld_a(a0 + (j0 + 7u * 256u) * pc.a_str.w);
        }
        s += v[0] * v[0];
        s += v[1] * v[1];
        s += v[2] * v[2];
        s += v[3] * v[3];
        s += v[4] * v[4];
        s += v[5] * v[5];
        s += v[6] * v[6];
        s += v[7] * v[7];
    }
    red[li] = s;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] += red[li + w];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(len) + bitcast<f32>(pc.prm.x));
    for (var j0 = li; j0 < len; j0 += 256u * U) {
        var v: array<f32, U>;
        var g: array<f32, U>;
        if j0 + 0u * 256u < len {
            v[0] = ld_a(a0 + (j0 + 0u * 256u) * pc.a_str.w);
            g[0] = ld_w(w0 + (j0 + 0u * 256u) * pc.b_str.w);
        }
        if j0 + 1u * 256u < len {
            v[1] = ld_a(a0 + (j0 + 1u * 256u) * pc.a_str.w);
            g[1] = ld_w(w0 + (j0 + 1u * 256u) * pc.b_str.w);
        }
        if j0 + 2u * 256u < len {
            v[2] = ld_a(a0 + (j0 + 2u * 256u) * pc.a_str.w);
            g[2] = ld_w(w0 + (j0 + 2u * 256u) * pc.b_str.w);
        }
        if j0 + 3u * 256u < len {
            v[3] = ld_a(a0 + (j0 + 3u * 256u) * pc.a_str.w);
            g[3] = ld_w(w0 + (j0 + 3u * 256u) * pc.b_str.w);
        }
        if j0 + 4u * 256u < len {
            v[4] = ld_a(a0 + (j0 + 4u * 256u) * pc.a_str.w);
            g[4] = ld_w(w0 + (j0 + 4u * 256u) * pc.b_str.w);
        }
        if j0 + 5u * 256u < len {
            v[5] = ld_a(a0 + (j0 + 5u * 256u) * pc.a_str.w);
            g[5] = ld_w(w0 + (j0 + 5u * 256u) * pc.b_str.w);
        }
        if j0 + 6u * 256u < len {
            v[6] = ld_a(a0 + (j0 + 6u * 256u) * pc.a_str.w);
            g[6] = ld_w(w0 + (j0 + 6u * 256u) * pc.b_str.w);
        }
        if j0 + 7u * 256u < len {
            v[7] = ld_a(a0 + (j0 + 7u * 256u) * pc.a_str.w);
            g[7] = ld_w(w0 + (j0 + 7u * 256u) * pc.b_str.w);
        }
        if j0 + 0u * 256u < len {
            st_d(d0 + (j0 + 0u * 256u) * pc.d_str.w, (v[0] * inv) * g[0]);
        }
        if j0 + 1u * 256u < len {
            st_d(d0 + (j0 + 1u * 256u) * pc.d_str.w, (v[1] * inv) * g[1]);
        }
        if j0 + 2u * 256u < len {
            st_d(d0 + (j0 + 2u * 256u) * pc.d_str.w, (v[2] * inv) * g[2]);
        }
        if j0 + 3u * 256u < len {
            st_d(d0 + (j0 + 3u * 256u) * pc.d_str.w, (v[3] * inv) * g[3]);
        }
        if j0 + 4u * 256u < len {
            st_d(d0 + (j0 + 4u * 256u) * pc.d_str.w, (v[4] * inv) * g[4]);
        }
        if j0 + 5u * 256u < len {
            st_d(d0 + (j0 + 5u * 256u) * pc.d_str.w, (v[5] * inv) * g[5]);
        }
        if j0 + 6u * 256u < len {
            st_d(d0 + (j0 + 6u * 256u) * pc.d_str.w, (v[6] * inv) * g[6]);
        }
        if j0 + 7u * 256u < len {
            st_d(d0 + (j0 + 7u * 256u) * pc.d_str.w, (v[7] * inv) * g[7]);
        }
    }
}
