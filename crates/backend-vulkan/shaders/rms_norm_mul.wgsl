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
    var s = 0.0;
    for (var j = li; j < len; j += 256u) {
        let v = ld_a(a0 + j * pc.a_str.w);
        s += v * v;
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
    for (var j = li; j < len; j += 256u) {
        let n = ld_a(a0 + j * pc.a_str.w) * inv;
        st_d(d0 + j * pc.d_str.w, n * ld_w(w0 + j * pc.b_str.w));
    }
}
