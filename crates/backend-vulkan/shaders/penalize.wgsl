// Penalize, second pass: llama.cpp's repeat / frequency / presence penalties on the ids of
// each row's history (`lowsync_graph::sampling::penalize_row`). The result already holds a
// copy of the logits (the first dispatch of the node, a barrier apart), so this pass only
// rewrites the penalized elements, reading their original values from the logits.
//
// One invocation per history slot (r, j): it handles id t = hist[r, j] only when t lies in
// [0, V) and j is t's first slot in the row, so each distinct id is updated exactly once, by
// one invocation, and no two invocations write the same element. The arithmetic is the
// CPU's, operation for operation, so the result is the oracle's bit for bit where the driver
// divides exactly and does not fuse `count * frequency + presence` into one rounding
// (lavapipe; a GPU that does differs by an ulp).

struct Pc {
    // rows R, history length N, row length V
    shape: vec4<u32>,
    // result row and column strides
    d_str: vec4<u32>,
    // logits row and column strides
    a_str: vec4<u32>,
    // hist row and column strides (xy), params row and column strides (zw)
    b_str: vec4<u32>,
    // d, logits, hist, params element offsets
    offs: vec4<u32>,
    // x: invocations (R * N)
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
    if gi >= pc.op.x {
        return;
    }
    let n = pc.shape.y;
    let r = gi / n;
    let j = gi % n;
    let h0 = pc.offs.z + r * pc.b_str.x;
    let t = ldi_hist(h0 + j * pc.b_str.y);
    // Ids outside the row (e.g. -1, an empty slot) are ignored, as on the CPU.
    if t < 0 || u32(t) >= pc.shape.z {
        return;
    }
    for (var k = 0u; k < j; k++) {
        if ldi_hist(h0 + k * pc.b_str.y) == t {
            return;
        }
    }
    var count = 0u;
    for (var k = j; k < n; k++) {
        if ldi_hist(h0 + k * pc.b_str.y) == t {
            count += 1u;
        }
    }
    let p0 = pc.offs.w + r * pc.b_str.z;
    let repeat = ld_par(p0);
    let frequency = ld_par(p0 + pc.b_str.w);
    let presence = ld_par(p0 + 2u * pc.b_str.w);
    var x = ld_a(pc.offs.y + r * pc.a_str.x + u32(t) * pc.a_str.y);
    if x <= 0.0 {
        x = x * repeat;
    } else {
        x = x / repeat;
    }
    x = x - (f32(count) * frequency + presence);
    st_d(pc.offs.x + r * pc.d_str.x + u32(t) * pc.d_str.y, x);
}
