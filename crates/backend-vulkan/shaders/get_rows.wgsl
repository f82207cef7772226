// GetRows: dst[ids..., :] = table[ids[...], :]. One thread per destination element. A bad id
// is reported through the status words (surfacing as an error at the next wait) and its row
// is not written.

struct Pc {
    // ids shape in xyz, row length d in w
    shape: vec4<u32>,
    // dst strides of the ids axes in xyz, of the row in w
    d_str: vec4<u32>,
    // table row stride, column stride, row count
    a_str: vec4<u32>,
    // ids strides
    b_str: vec4<u32>,
    // d, table, ids offsets; thread count
    offs: vec4<u32>,
    // x: error tag
    op: vec4<u32>,
    prm: vec4<u32>,
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
    let r = gi / pc.shape.w;
    let col = gi % pc.shape.w;
    let ci = coord3(r, pc.shape);
    let id = ldi_ids(pc.offs.z + dot3(ci, pc.b_str));
    if id < 0 || u32(id) >= pc.a_str.z {
        if col == 0u {
            report_bad_index(pc.op.x, r, id);
        }
        return;
    }
    let v = ld_a(pc.offs.y + u32(id) * pc.a_str.x + col * pc.a_str.y);
    st_d(pc.offs.x + dot3(ci, pc.d_str) + col * pc.d_str.w, v);
}
