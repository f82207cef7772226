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
// Elements per thread and round.
const U: u32 = 8u;

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
    // U elements per thread and round, loaded before any is compared (written out), so a
    // thread has U loads in flight (a vocabulary row is 100+ loads a thread; one at a time,
    // each waits for the last). `beats` is a total order: the order of comparisons is free.
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
        if j0 + 0u * 256u < len && beats(bv, bi, v[0], j0 + 0u * 256u) {
            bv = v[0];
            bi = j0 + 0u * 256u;
        }
        if j0 + 1u * 256u < len && beats(bv, bi, v[1], j0 + 1u * 256u) {
            bv = v[1];
            bi = j0 + 1u * 256u;
        }
        if j0 + 2u * 256u < len && beats(bv, bi, v[2], j0 + 2u * 256u) {
            bv = v[2];
            bi = j0 + 2u * 256u;
        }
        if j0 + 3u * 256u < len && beats(bv, bi, v[3], j0 + 3u * 256u) {
            bv = v[3];
            bi = j0 + 3u * 256u;
        }
        if j0 + 4u * 256u < len && beats(bv, bi, v[4], j0 + 4u * 256u) {
            bv = v[4];
            bi = j0 + 4u * 256u;
        }
        if j0 + 5u * 256u < len && beats(bv, bi, v[5], j0 + 5u * 256u) {
            bv = v[5];
            bi = j0 + 5u * 256u;
        }
        if j0 + 6u * 256u < len && beats(bv, bi, v[6], j0 + 6u * 256u) {
            bv = v[6];
            bi = j0 + 6u * 256u;
        }
        if j0 + 7u * 256u < len && beats(bv, bi, v[7], j0 + 7u * 256u) {
            bv = v[7];
            bi = j0 + 7u * 256u;
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
