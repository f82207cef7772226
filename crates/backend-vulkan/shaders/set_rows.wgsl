// SetRows: dst[idx[j], :] = src[j, :]. One thread per column walks the rows in order, so with
// duplicate indices the last write wins (as sequential numpy assignment). Every index is
// checked before anything is written; the first bad one is reported through the status words.

struct Pc {
    // dst rows n, row length d, source rows m
    shape: vec4<u32>,
    // dst row stride, column stride
    d_str: vec4<u32>,
    // src row stride, column stride
    a_str: vec4<u32>,
    // x: index stride
    b_str: vec4<u32>,
    // d, src, idx offsets
    offs: vec4<u32>,
    // x: error tag
    op: vec4<u32>,
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let col = group_id(wg, nwg) * 64u + li;
    if col >= pc.shape.y {
        return;
    }
    let n = pc.shape.x;
    let m = pc.shape.z;
    for (var j = 0u; j < m; j++) {
        let id = ldi_ids(pc.offs.z + j * pc.b_str.x);
        if id < 0 || u32(id) >= n {
            if col == 0u {
                report_bad_index(pc.op.x, j, id);
            }
            return;
        }
    }
    for (var j = 0u; j < m; j++) {
        let row = u32(ldi_ids(pc.offs.z + j * pc.b_str.x));
        let v = ld_a(pc.offs.y + j * pc.a_str.x + col * pc.a_str.y);
        st_d(pc.offs.x + row * pc.d_str.x + col * pc.d_str.y, v);
    }
}
