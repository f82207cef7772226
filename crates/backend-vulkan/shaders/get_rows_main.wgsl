// Shared by `get_rows` (float table) and `get_rows_q` (GGUF block table):
// dst[ids..., :] = table[ids[...], :]. One thread per `EPT` consecutive elements of a result
// row (the template's `copy_elems` reads and writes them). A bad id is reported through the
// status words (surfacing as an error at the next wait) and its row is not written.

struct Pc {
    // ids shape in xyz, row length d in w (a multiple of EPT)
    shape: vec4<u32>,
    // dst strides of the ids axes in xyz, of the row in w
    d_str: vec4<u32>,
    // table row stride (elements; bytes for a block table), column stride (float table
    // only), row count
    a_str: vec4<u32>,
    // ids strides
    b_str: vec4<u32>,
    // d offset, table offset (elements; bytes for a block table), ids offset; thread count
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
    let per_row = pc.shape.w / EPT;
    let r = gi / per_row;
    let col = (gi % per_row) * EPT;
    let ci = coord3(r, pc.shape);
    let id = ldi_ids(pc.offs.z + dot3(ci, pc.b_str));
    if id < 0 || u32(id) >= pc.a_str.z {
        if col == 0u {
            report_bad_index(pc.op.x, r, id);
        }
        return;
    }
    copy_elems(u32(id), col, pc.offs.x + dot3(ci, pc.d_str));
}
