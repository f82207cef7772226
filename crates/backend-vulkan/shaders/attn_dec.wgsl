// Fused decode attention: out[h, :] = softmax(q[h] . K[kv]^T * scale + mask[h]) @ V[kv] for one
// query row per head, kv = h / (heads per kv head).
//
// Why: unfused, a decode step's attention is four dispatches (scores, soft_max, p @ V, the
// permuting copy) with the scores and probabilities round-tripping through memory, and every
// cache row is read even where the mask hides it. Here one workgroup per query head does it all,
// over the span of keys its mask admits (a short sequence in a long window costs its length).
// (`LOWSYNC_VK_ATTN_SPLIT` runs `attn_split.wgsl` instead: a head's keys over several workgroups.)
//
// Strategy: `admitted_span` (`attn_body.wgsl`) finds the first and one past the last key the
// head's mask admits; `attend` walks that span with an online softmax; the sum S then
// normalises the groups' summed outputs.
//
// Invariants: f32 accumulation throughout. A NaN admitted logit (score * scale + mask) makes the
// whole row NaN, and a row with every key masked (and no NaN) gives zeros, as the unfused
// soft_max does. A masked key contributes exactly nothing whatever its K and V rows hold (the
// CPU backend's fused attention agrees; unfused, a NaN there would poison the row). Barriers
// are only reached in uniform control flow (loop bounds and M come from push constants and
// shared reductions). d <= WG (the planner checks).

// #include attn_body.wgsl

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
) {
    sg_begin(lane, sg, nsg);
    let h = wg.x;
    if h >= pc.shape.x {
        return;
    }
    query_early(h, li);
    let span = admitted_span(pc.op.z + h * pc.op.x, pc.shape.z, li);
    let r = attend(h, span.x, span.y, li);
    let has_nan = reduce_max(r.nan) != 0.0;
    var inv = 0.0;
    if r.sum != 0.0 {
        inv = 1.0 / r.sum;
    }
    if has_nan {
        inv = bitcast<f32>(0x7fc00000u);
    }
    let o = group_sum(r.acc, li);
    if li < pc.shape.y {
        st_d(pc.d_str.z + h * pc.d_str.x + li * pc.d_str.y, o * inv);
    }
}
