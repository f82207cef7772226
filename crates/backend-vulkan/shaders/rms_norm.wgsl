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
// Elements per thread and round.
const U: u32 = 8u;

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
    // U elements per thread and round, loaded before any is used (U loads in flight); the sum
    // still runs over j in order, as `rms_norm_mul.wgsl`'s does.
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
        if j0 + 0u * 256u < len {
            st_d(d0 + (j0 + 0u * 256u) * pc.d_str.w, v[0] * inv);
        }
        if j0 + 1u * 256u < len {
            st_d(d0 + (j0 + 1u * 256u) * pc.d_str.w, v[1] * inv);
        }
        if j0 + 2u * 256u < len {
            st_d(d0 + (j0 + 2u * 256u) * pc.d_str.w, v[2] * inv);
        }
        if j0 + 3u * 256u < len {
            st_d(d0 + (j0 + 3u * 256u) * pc.d_str.w, v[3] * inv);
        }
        if j0 + 4u * 256u < len {
            st_d(d0 + (j0 + 4u * 256u) * pc.d_str.w, v[4] * inv);
        }
        if j0 + 5u * 256u < len {
            st_d(d0 + (j0 + 5u * 256u) * pc.d_str.w, v[5] * inv);
        }
        if j0 + 6u * 256u < len {
            st_d(d0 + (j0 + 6u * 256u) * pc.d_str.w, v[6] * inv);
        }
        if j0 + 7u * 256u < len {
            st_d(d0 + (j0 + 7u * 256u) * pc.d_str.w, v[7] * inv);
        }
    }
}
