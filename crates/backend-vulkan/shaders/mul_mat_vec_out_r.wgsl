// The decode mat-vec's store straight into a KV-cache row: the `SetRows` that consumed the
// product in the graph (`crate::fusion` proved the product dead after it) runs in the store, so
// the product is never written and the copy is no dispatch of its own.
//
// Strategy: the host plans the product as if d were the cache's row 0 (offset and column
// stride the cache's), and `pc.epi` holds the id's offset, the cache's row count, its row
// stride and the error tag; the store adds row `ids[0]` and rounds to the cache's dtype as
// `set_rows` does. An id outside [0, n) is reported through the status words by the thread of
// result column 0 and nothing is written. The host fuses a single token only.

fn out_d(i: u32, s: f32) {
    let id = ldi_ids(pc.epi.x);
    if id < 0 || u32(id) >= pc.epi.y {
        if i == pc.offs.x {
            report_bad_index(pc.epi.w, 0u, id);
        }
        return;
    }
    st_d(i + u32(id) * pc.epi.z, s);
}
