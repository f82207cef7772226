// softmax(x * scale + mask) over the last axis: one workgroup per row. A row whose entries are
// all -inf (fully masked) gives zeros, as the CPU oracle; a row holding a NaN gives NaNs (the
// NaNs are counted on their own: `max` may drop a NaN, and an all-NaN row must not look masked).

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

var<workgroup> red: array<f32, 256>;

fn value(a0: u32, m0: u32, j: u32) -> f32 {
    var v = ld_a(a0 + j * pc.a_str.w) * bitcast<f32>(pc.prm.x);
    if pc.op.x == 1u {
        v += ld_m(m0 + j * pc.b_str.w);
    }
    return v;
}

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
    let m0 = pc.offs.z + dot3(c, pc.b_str);
    let d0 = pc.offs.x + dot3(c, pc.d_str);
    let len = pc.shape.w;
    let ninf = bitcast<f32>(0xff800000u);

    var mx = ninf;
    var nans = 0.0;
    for (var j = li; j < len; j += 256u) {
        let v = value(a0, m0, j);
        mx = max(mx, v);
        // A NaN by its bits: a float `v != v` may compile to an ordered compare, false for NaN.
        if (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u {
            nans = 1.0;
        }
    }
    red[li] = nans;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] = max(red[li], red[li + w]);
        }
        workgroupBarrier();
    }
    let has_nan = red[0] != 0.0;
    workgroupBarrier();
    red[li] = mx;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] = max(red[li], red[li + w]);
        }
        workgroupBarrier();
    }
    mx = red[0];
    workgroupBarrier();

    // Barriers stay in uniform control flow: a fully masked row only selects zeros below.
    // With a NaN in the row the sum below is NaN, so every entry comes out NaN.
    let all_masked = mx == ninf && !has_nan;
    var s = 0.0;
    if !all_masked {
        for (var j = li; j < len; j += 256u) {
            s += exp(value(a0, m0, j) - mx);
        }
    }
    red[li] = s;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] += red[li + w];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / red[0];
    for (var j = li; j < len; j += 256u) {
        var r = 0.0;
        if !all_masked {
            r = exp(value(a0, m0, j) - mx) * inv;
        }
        st_d(d0 + j * pc.d_str.w, r);
    }
}
