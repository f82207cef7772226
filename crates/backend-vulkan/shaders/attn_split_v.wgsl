// Decode attention split over keys with 16-byte K and V loads: `attn_split.wgsl`'s kernel (the
// same span scan, chunks, slots, ticket and merge) whose chunks run `attend_v`
// (`attn_body_v.wgsl`): a thread's share of a chunk's keys in one round of K loads and one of V
// loads where it fits, 8 dims a load.
//
// Why: on a GPU the attention of a decode step is a chain of dependent trips to memory; fewer,
// fuller rounds shorten it. The planner gives this kernel longer chunks than `attn_split`'s
// (a chunk's round trips are cheaper than the merge's), so a shallow step runs one workgroup
// per head with no slots.
//
// Invariants: as `attn_split.wgsl`, except that a masked key's K row may be loaded (never used)
// and the sums run in `attend_v`'s order. dim a multiple of 8; K and V rows 16-byte aligned with
// unit dim strides (the planner checks).

// #include attn_body_v.wgsl
// #include attn_merge_head.wgsl
// #include attn_split_main.wgsl

// The query row's loads, issued before the span scan so that their trip overlaps its mask
// loads (`attend_v` stores them).
fn chunk_begin(h: u32, li: u32) {
    query_early(h, li);
}

// This kernel's chunk: `attend_v` over the keys, then its slots' outputs added.
fn chunk_out(h: u32, lo: u32, hi: u32, li: u32) -> ChunkOut {
    let r = attend_v(h, lo, hi, li);
    let nan_seen = reduce_max(r.nan);
    return ChunkOut(r.mx, r.sum, group_sum_v(r.acc, li), nan_seen);
}
