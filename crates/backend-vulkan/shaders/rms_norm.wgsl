// RmsNorm over the last axis: one workgroup per row, a tree reduction of the sum of squares.

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

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = group_id(wg, nwg);
    if row >= pc.offs.z {
        return;
    }
    let c = coord3(row, pc.shape);
    let a0 = pc.offs.y + dot3(c, pc.a_str);
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
        st_d(d0 + j * pc.d_str.w, ld_a(a0 + j * pc.a_str.w) * inv);
    }
}
