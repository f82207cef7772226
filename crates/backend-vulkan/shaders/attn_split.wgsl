// Decode attention split over keys: workgroup (h, c) computes an online softmax over chunk c
// of query head h's valid keys; `attn_merge.wgsl` combines a head's chunks.
//
// Why: `attn_dec` gives a head one workgroup, so a decode step's attention keeps as many
// multiprocessors busy as the model has heads, and its time grows with depth while the rest of
// the GPU idles. Splitting a head's keys over several workgroups spreads them over the GPU. A
// recorded step is replayed at every depth, so the split cannot be chosen when recording: the
// grid is fixed at heads x C_max and the device picks the chunk count from the mask each time.
//
// Strategy: every workgroup first scans its head's mask row (`admitted_span`) for the first and
// one past the last admitted key, F and L. The span L - F is cut into
// nc = clamp(ceil((L - F) / KMIN), 1, C_max) chunks of equal length (the last shorter); a
// workgroup whose chunk is at or past nc exits. Over its chunk, a workgroup runs `attend`
// (`attn_body.wgsl`, `attn_dec`'s walk) and ends with the unnormalised output of its keys. With nc = 1 chunk 0 normalises and writes the
// output itself (the merge then does nothing for that head), so a shallow step costs one pass
// over its valid keys instead of `attn_dec`'s walk over the whole window. Otherwise each chunk
// writes a partial slot: [M, S, NaN seen, nc, acc[0..dim]] at (h * C_max + c) * (dim + 4).
// Chunk 0 always writes nc into its slot; that is how the merge learns the split.
//
// Invariants: f32 accumulation. The chunk bounds depend only on the mask and push constants,
// so a step's result does not depend on timing. A masked key contributes exactly nothing (its K
// and V rows are never read); an admitted NaN logit makes the row NaN; a head whose keys are
// all masked gives zeros (nc = 1, empty chunk). Barriers are reached in uniform control flow:
// F, L and the chunk bounds are read by every thread from the same shared words after a
// barrier. d <= WG (the planner checks).

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
    let c = wg.y;
    if h >= pc.shape.x {
        return;
    }
    let dim = pc.shape.y;
    let keys = pc.shape.z;
    let cmax = pc.prm.y;
    let kmin = pc.prm.z;
    let m0 = pc.op.z + h * pc.op.x;
    let slot = pc.op.w + (h * cmax + c) * (dim + 4u);

    // 1. The span of admitted keys, [F, L).
    let fl = admitted_span(m0, keys, li);
    let kfirst = fl.x;
    let span = fl.y - fl.x;

    // 2. This workgroup's chunk.
    let nc = clamp((span + kmin - 1u) / kmin, 1u, cmax);
    if c >= nc {
        return;
    }
    let per = (span + nc - 1u) / nc;
    let lo = kfirst + min(c * per, span);
    let hi = kfirst + min((c + 1u) * per, span);

    // 3. The online softmax over keys [lo, hi).
    let r = attend(h, lo, hi, li);
    let nan_seen = reduce_max(r.nan);
    let o = group_sum(r.acc, li);

    // 4. The output (one chunk) or this chunk's partial slot.
    if li < dim {
        if nc == 1u {
            var inv = 0.0;
            if r.sum != 0.0 {
                inv = 1.0 / r.sum;
            }
            if nan_seen != 0.0 {
                inv = bitcast<f32>(0x7fc00000u);
            }
            st_d(pc.d_str.z + h * pc.d_str.x + li * pc.d_str.y, o * inv);
        } else {
            st_p(slot + 4u + li, o);
        }
    }
    if li == 0u {
        st_p(slot, r.mx);
        st_p(slot + 1u, r.sum);
        st_p(slot + 2u, nan_seen);
        st_p(slot + 3u, f32(nc));
    }
}
