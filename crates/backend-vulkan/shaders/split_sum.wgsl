// The result of a product split over k (`mul_mat_body.wgsl` with `prm.z`): each element the
// sum of its splits' partials, d[b0, b1, r, c] = p[0][e] + p[1][e] + ... + p[S - 1][e] with
// e = ((b0 * B1 + b1) * M + r) * N + c, added in split order (so the result does not depend on
// timing). shape: M, N, S, B1; d_str: d's strides; offs.x: d's offset; prm.w: elements
// between two splits' partials. Workgroup x takes 64 columns of row y of batch z.

struct Pc {
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    b_str: vec4<u32>,
    offs: vec4<u32>,
    op: vec4<u32>,
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let c = wg.x * 64u + li;
    if c >= pc.shape.y {
        return;
    }
    let r = wg.y;
    let bz = wg.z;
    let e = (bz * pc.shape.x + r) * pc.shape.y + c;
    var acc = ld_a(e);
    for (var s = 1u; s < pc.shape.z; s++) {
        acc += ld_a(s * pc.prm.w + e);
    }
    let b0 = bz / pc.shape.w;
    let b1 = bz % pc.shape.w;
    st_d(pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y + r * pc.d_str.z + c * pc.d_str.w, acc);
}
