// The merge of `attn_split.wgsl`'s chunks: out[h, :] from a head's nc partial softmaxes.
//
// Why: the chunks of a head run in separate workgroups, so their partial results meet in
// memory; a second, small dispatch after a barrier combines them, in a fixed order, so the
// result never depends on which chunk finished first.
//
// Strategy: one workgroup per head reads nc from chunk 0's slot (nc = 1: chunk 0 wrote the
// output itself and this head is done). The overall maximum M is the largest chunk maximum;
// thread e then sums, in chunk order, S = sum s_c * exp(m_c - M) and o = sum acc_c[e] *
// exp(m_c - M), a chunk with no finite logit (m_c = -inf) weighing 0, and writes o / S.
//
// Invariants: the slots are laid out as `attn_split.wgsl` says, (h * C_max + c) * (dim + 4)
// floats from the partials offset; a NaN seen by any chunk makes the row NaN; S = 0 (every
// admitted logit -inf) gives zeros, as `attn_dec` does.

struct Pc {
    // heads, head dim, C_max
    shape: vec4<u32>,
    // out: head stride, dim stride, offset
    d_str: vec4<u32>,
    // partials offset
    a_str: vec4<u32>,
}
var<immediate> pc: Pc;

const NINF_BITS: u32 = 0xff800000u;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let h = wg.x;
    let dim = pc.shape.y;
    let cmax = pc.shape.z;
    if h >= pc.shape.x || li >= dim {
        return;
    }
    let stride = dim + 4u;
    let base = pc.a_str.x + h * cmax * stride;
    let nc = u32(ld_p(base + 3u));
    if nc <= 1u {
        return;
    }
    let ninf = bitcast<f32>(NINF_BITS);
    var m = ninf;
    for (var c = 0u; c < nc; c++) {
        m = max(m, ld_p(base + c * stride));
    }
    var s = 0.0;
    var o = 0.0;
    var nan = false;
    for (var c = 0u; c < nc; c++) {
        let slot = base + c * stride;
        let mc = ld_p(slot);
        var w = 0.0;
        if mc != ninf {
            w = exp(mc - m);
        }
        s += ld_p(slot + 1u) * w;
        o += ld_p(slot + 4u + li) * w;
        nan = nan || ld_p(slot + 2u) != 0.0;
    }
    var inv = 0.0;
    if s != 0.0 {
        inv = 1.0 / s;
    }
    if nan {
        inv = bitcast<f32>(0x7fc00000u);
    }
    st_d(pc.d_str.z + h * pc.d_str.x + li * pc.d_str.y, o * inv);
}
