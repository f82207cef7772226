// RmsNorm over the last axis with one invocation per row: what a CPU-type device runs
// (`LOWSYNC_VK_ROW_LANES`; `rms_norm.wgsl` gives a row a workgroup, whose barriers lavapipe
// runs as switches between its SIMD groups).
//
// Strategy: the sum of squares over j in order, then each x * inv. The sum's order is
// `rms_norm_mul_t.wgsl`'s, so the fused norm stays bit for bit the unfused one under either
// layout; against the workgroup kernel (a tree) the results agree to rounding.

struct Pc {
    // leading row dims in xyz, row length in w
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    b_str: vec4<u32>,
    // d, a offsets; rows
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
    if row >= pc.offs.z {
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
        st_d(d0 + j * pc.d_str.w, ld_a(a0 + j * pc.a_str.w) * inv);
    }
}
