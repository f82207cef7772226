// MulMatId (mixture of experts): dst[t, n] = sum_j w[t, j] * (x[t] @ experts[ids[t, j]])[n].
// One thread per output element; adjacent threads read adjacent columns of the expert. A bad
// expert id is reported through the status words and its slot skipped.

struct Pc {
    // T, n, k, slots K
    shape: vec4<u32>,
    // dst t, n strides
    d_str: vec4<u32>,
    // experts e, k, n strides; expert count
    a_str: vec4<u32>,
    // x t, k strides
    b_str: vec4<u32>,
    // d, experts, x, ids offsets
    offs: vec4<u32>,
    // ids t, j strides; weights t, j strides
    op: vec4<u32>,
    // weights offset, error tag, thread count
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let gi = group_id(wg, nwg) * 64u + li;
    if gi >= pc.prm.z {
        return;
    }
    let n = pc.shape.y;
    let t = gi / n;
    let col = gi % n;
    var acc = 0.0;
    for (var j = 0u; j < pc.shape.w; j++) {
        let e = ldi_ids(pc.offs.w + t * pc.op.x + j * pc.op.y);
        if e < 0 || u32(e) >= pc.a_str.w {
            if col == 0u {
                report_bad_index(pc.prm.y, t * pc.shape.w + j, e);
            }
            continue;
        }
        let e_base = pc.offs.y + u32(e) * pc.a_str.x + col * pc.a_str.z;
        let x_base = pc.offs.z + t * pc.b_str.x;
        var s = 0.0;
        for (var k = 0u; k < pc.shape.z; k++) {
            s += ld_b(x_base + k * pc.b_str.y) * ld_a(e_base + k * pc.a_str.y);
        }
        acc += ld_w(pc.prm.x + t * pc.op.z + j * pc.op.w) * s;
    }
    st_d(pc.offs.x + t * pc.d_str.x + col * pc.d_str.y, acc);
}
