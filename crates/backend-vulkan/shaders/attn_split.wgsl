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
// #include attn_split_main.wgsl

// The query row's loads, issued before the span scan so that their trip overlaps its mask
// loads (`attend` stores them).
fn chunk_begin(h: u32, li: u32) {
    query_early(h, li);
}

// This kernel's chunk: `attend` over the keys, then its groups' outputs added.
fn chunk_out(h: u32, lo: u32, hi: u32, li: u32) -> ChunkOut {
    let r = attend(h, lo, hi, li);
    let nan_seen = reduce_max(r.nan);
    return ChunkOut(r.mx, r.sum, group_sum(r.acc, li), nan_seen);
}
