// The rotary embedding's push constants and entry point, shared by `rope`, `rope_f32` and the
// fused `rope_set_rows*`: one thread per rotated pair of a row of x [T, H, D], plus one per
// copied dim >= n_dims; `angle` (the template's) gives a pair's angle and `row_base` (its
// destination file's) where head h of token t is written, or that the thread writes nothing.

struct Pc {
    // T, H, D, n_dims
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    // x: position stride
    b_str: vec4<u32>,
    // d, a, pos offsets; thread count
    offs: vec4<u32>,
    // mode (0 normal, 1 neox), n_dims / 2, threads per row
    op: vec4<u32>,
    // f32 bits: ratio theta^(-2/n_dims) as hi + lo, theta
    prm: vec4<u32>,
    // the destination's own (`rope_dst*.wgsl`)
    epi: vec4<u32>,
}
var<immediate> pc: Pc;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let gi = group_id(wg, nwg) * 256u + li;
    if gi >= pc.offs.w {
        return;
    }
    let per = pc.op.z;
    let row = gi / per;
    let j = gi % per;
    let t = row / pc.shape.y;
    let h = row % pc.shape.y;
    let a0 = pc.offs.y + t * pc.a_str.x + h * pc.a_str.y;
    let dst = row_base(t, h, gi);
    if dst.y == 0u {
        return;
    }
    let d0 = dst.x;
    let half = pc.op.y;
    if j < half {
        var ia = 2u * j;
        var ib = 2u * j + 1u;
        if pc.op.x == 1u {
            ia = j;
            ib = j + half;
        }
        let p = ldi_pos(pc.offs.z + t * pc.b_str.x);
        let th = angle(p, j);
        let c = cos(th);
        let s = sin(th);
        let a = ld_a(a0 + ia * pc.a_str.z);
        let b = ld_a(a0 + ib * pc.a_str.z);
        st_d(d0 + ia * pc.d_str.z, a * c - b * s);
        st_d(d0 + ib * pc.d_str.z, a * s + b * c);
    } else {
        let jj = pc.shape.w + (j - half);
        st_d(d0 + jj * pc.d_str.z, ld_a(a0 + jj * pc.a_str.z));
    }
}
