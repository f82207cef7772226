// Decode attention split over keys: workgroup (h, c) computes an online softmax over chunk c
// of query head h's valid keys; the head's last chunk to finish merges its chunks.
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
// (`attn_body.wgsl`, `attn_dec`'s walk) and ends with the unnormalised output of its keys.
// With nc = 1 chunk 0 normalises and writes the output itself, so a shallow step costs one
// pass over its valid keys instead of `attn_dec`'s walk over the whole window. Otherwise each
// chunk writes a partial slot, [M, S, NaN seen, unused, acc[0..dim]] at
// (h * C_max + c) * (dim + 4) from the slots' offset, then takes a ticket: one atomic add on
// the head's ticket word (word h of the partials buffer). The chunk that draws ticket nc - 1
// finished last; it merges the head's nc slots in chunk order (the overall maximum M, then
// S = sum s_c * exp(m_c - M) and o = sum acc_c[e] * exp(m_c - M), a chunk with no finite
// logit weighing 0), writes o / S, and puts the ticket word back to 0 for the next dispatch.
// The merge rides in the last chunk's workgroup instead of a second dispatch behind a
// barrier: on a GPU that barrier and launch cost more than the merge.
//
// Invariants: f32 accumulation. The chunk bounds depend only on the mask and push constants,
// and the merge reads the slots in chunk order, so a step's result does not depend on timing
// or on which chunk finished last. A masked key contributes exactly nothing (its K and V rows
// are never read); an admitted NaN logit makes the row NaN; a head whose keys are all masked
// gives zeros (nc = 1, empty chunk). The partials binding is `array<atomic<u32>>`: the slots
// are written and read with atomic stores and loads (device-coherent, never a stale cache
// line), and a storage barrier (device scope, acquire-release) orders a chunk's slot stores
// before its ticket and the last chunk's ticket before its loads. The ticket words are zero
// between dispatches (zero-filled when the buffer is made; the merging chunk resets its
// head's). Barriers are reached in uniform control flow: F, L, the chunk bounds and the
// ticket are read by every thread from the same shared words after a barrier. d <= WG.

// #include attn_body.wgsl
// #include attn_merge_head.wgsl

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

    // 2. This workgroup's chunk.
    let ch = chunk_of(fl, c, kmin, cmax);
    let nc = ch.x;
    if c >= nc {
        return;
    }
    let lo = ch.y;
    let hi = ch.z;

    // 3. The online softmax over keys [lo, hi).
    let r = attend(h, lo, hi, li);
    let nan_seen = reduce_max(r.nan);
    let o = group_sum(r.acc, li);

    // 4. The output (one chunk), or this chunk's partial slot and its ticket.
    if nc == 1u {
        if li < dim {
            var inv = 0.0;
            if r.sum != 0.0 {
                inv = 1.0 / r.sum;
            }
            if nan_seen != 0.0 {
                inv = bitcast<f32>(0x7fc00000u);
            }
            st_d(pc.d_str.z + h * pc.d_str.x + li * pc.d_str.y, o * inv);
        }
        return;
    }
    if li < dim {
        stc_p(slot + 4u + li, o);
    }
    if li == 0u {
        stc_p(slot, r.mx);
        stc_p(slot + 1u, r.sum);
        stc_p(slot + 2u, nan_seen);
    }
    if !last_to_finish(h, nc, li) {
        return;
    }
    if li < dim {
        merge_head(h, nc, li);
    }
}
