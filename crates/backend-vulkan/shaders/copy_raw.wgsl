// Exact copy of 32-bit elements (i32 `Cpy` / `Concat`) between 4-D strided views.

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

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_id(wg, nwg) * 256u + li;
    if i >= pc.offs.w {
        return;
    }
    let c = coord4(i, pc.shape);
    str_d(pc.offs.x + dot4(c, pc.d_str), ldr_a(pc.offs.y + dot4(c, pc.a_str)));
}
