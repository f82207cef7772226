// RmsNorm over the last axis with one invocation per row, times a weight where the including
// kernel has one: what a CPU-type device runs (`LOWSYNC_VK_ROW_LANES`; `rms_norm.wgsl` and
// `rms_norm_mul.wgsl` give a row a workgroup, whose barriers lavapipe runs as switches between
// its SIMD groups). `rms_norm_t.wgsl` is the norm, `rms_norm_mul_t.wgsl` the fused norm-mul.
//
// Strategy: the sum of squares over j in order, then each element x * inv rounded to f32, as
// the unfused f32 norm stores it, times the weight (`weight`: 1.0 for the plain norm, which
// changes no bit).
//
// Invariant: the fused norm-mul is bit-identical to `rms_norm_t` followed by the f32 `Mul`;
// against the workgroup kernels (a tree) the sums agree to rounding.

struct Pc {
    // leading row dims in xyz, row length in w
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    // weight strides (0 on broadcast axes)
    b_str: vec4<u32>,
    // d, a offsets, then (the norm) rows, or (the fused norm-mul) the weight's offset, rows
    offs: vec4<u32>,
    op: vec4<u32>,
    // f32 bits: eps
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = group_id(wg, nwg) * 64u + li;
    if row >= row_count() {
        return;
    }
    let c = coord3(row, pc.shape);
    let a0 = pc.offs.y + dot3(c, pc.a_str);
    let d0 = pc.offs.x + dot3(c, pc.d_str);
    let len = pc.shape.w;
    var s = 0.0;
    for (var j = 0u; j < len; j++) {
        let v = ld_a(a0 + j * pc.a_str.w);
        s += v * v;
    }
    let inv = 1.0 / sqrt(s / f32(len) + bitcast<f32>(pc.prm.x));
    for (var j = 0u; j < len; j++) {
        let v = ld_a(a0 + j * pc.a_str.w);
        st_d(d0 + j * pc.d_str.w, (v * inv) * weight(c, j));
    }
}
