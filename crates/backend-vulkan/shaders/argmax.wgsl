// Argmax over the last axis: one workgroup per row. The order is total (NaN below every
// number, ties to the lowest index), so the tree reduction gives the CPU oracle's answer.

struct Pc {
    // leading row dims in xyz, row length in w
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    b_str: vec4<u32>,
    // d, a offsets; rows
    offs: vec4<u32>,
    op: vec4<u32>,
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const NONE: u32 = 0xffffffffu;

var<workgroup> rv: array<f32, 256>;
var<workgroup> ri: array<u32, 256>;

// Whether (v2, i2) beats (v1, i1).
fn beats(v1: f32, i1: u32, v2: f32, i2: u32) -> bool {
    if i2 == NONE {
        return false;
    }
    if i1 == NONE {
        return true;
    }
    let n1 = is_nan(v1);
    let n2 = is_nan(v2);
    if n1 != n2 {
        return n1;
    }
    if n1 {
        return i2 < i1;
    }
    if v2 > v1 {
        return true;
    }
    if v2 < v1 {
        return false;
    }
    return i2 < i1;
}

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
    let len = pc.shape.w;
    var bv = 0.0;
    var bi = NONE;
    for (var j = li; j < len; j += 256u) {
        let v = ld_a(a0 + j * pc.a_str.w);
        if beats(bv, bi, v, j) {
            bv = v;
            bi = j;
        }
    }
    rv[li] = bv;
    ri[li] = bi;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w && beats(rv[li], ri[li], rv[li + w], ri[li + w]) {
            rv[li] = rv[li + w];
            ri[li] = ri[li + w];
        }
        workgroupBarrier();
    }
    if li == 0u {
        sti_d(pc.offs.x + dot3(c, pc.d_str), i32(ri[0]));
    }
}
