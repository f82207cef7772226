// softmax(x * scale + mask) over the last axis with one invocation per row: what a CPU-type
// device runs (`LOWSYNC_VK_ROW_LANES`). Results as `soft_max.wgsl`: a fully masked row gives
// zeros, a row holding a NaN gives NaNs.
//
// Why: `soft_max` gives a row a workgroup of 256 invocations and reduces through 24
// workgroup barriers. Lavapipe runs a workgroup's invocations as SIMD groups of 8 that switch
// at every barrier, so a prefill's attention rows (64 keys long at a 64-token prompt: three
// quarters of the invocations idle) took 45 ms a call on "small". Here the eight lanes of a
// SIMD group are eight rows, and nothing waits on anything.
//
// Strategy: three passes over the row, in order: the maximum (and whether a NaN is there), the
// sum of exp(v - max), then each exp(v - max) / sum. The sums run over j in order (not the
// workgroup kernel's tree), so the two kernels agree to rounding, not bit for bit.

struct Pc {
    // leading row dims in xyz, row length in w
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    // mask strides (0 on broadcast axes)
    b_str: vec4<u32>,
    // d, a, mask offsets; rows
    offs: vec4<u32>,
    // x: 1 when a mask is bound
    op: vec4<u32>,
    // f32 bits: scale
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

fn value(a0: u32, m0: u32, j: u32) -> f32 {
    var v = ld_a(a0 + j * pc.a_str.w) * bitcast<f32>(pc.prm.x);
    if pc.op.x == 1u {
        v += ld_m(m0 + j * pc.b_str.w);
    }
    return v;
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = group_id(wg, nwg) * 64u + li;
    if row >= pc.offs.w {
        return;
    }
    let c = coord3(row, pc.shape);
    let a0 = pc.offs.y + dot3(c, pc.a_str);
    let m0 = pc.offs.z + dot3(c, pc.b_str);
    let d0 = pc.offs.x + dot3(c, pc.d_str);
    let len = pc.shape.w;
    let ninf = bitcast<f32>(0xff800000u);

    var mx = ninf;
    var has_nan = false;
    for (var j = 0u; j < len; j++) {
        let v = value(a0, m0, j);
        mx = max(mx, v);
        // A NaN by its bits: a float `v != v` may compile to an ordered compare, false for NaN.
        if (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u {
            has_nan = true;
        }
    }
    // With a NaN in the row the sum is NaN, so every entry comes out NaN.
    if mx == ninf && !has_nan {
        for (var j = 0u; j < len; j++) {
            st_d(d0 + j * pc.d_str.w, 0.0);
        }
        return;
    }
    var s = 0.0;
    for (var j = 0u; j < len; j++) {
        s += exp(value(a0, m0, j) - mx);
    }
    let inv = 1.0 / s;
    for (var j = 0u; j < len; j++) {
        st_d(d0 + j * pc.d_str.w, exp(value(a0, m0, j) - mx) * inv);
    }
}
