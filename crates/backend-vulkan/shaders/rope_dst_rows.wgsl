// The fused `Rope -> SetRows` destination: token t's rotated row goes to row `ids[t]` of d (a
// KV cache [n, H * D]); `pc.epi` holds the ids' offset and stride, n, and the error tag. An id
// outside [0, n) is reported through the status words (as `set_rows` does) and nothing is
// written for it. The host fuses a single token only, so no two threads race for one row.

fn row_base(t: u32, h: u32, gi: u32) -> vec2<u32> {
    let id = ldi_ids(pc.epi.x + t * pc.epi.y);
    if id < 0 || u32(id) >= pc.epi.z {
        if gi == 0u {
            report_bad_index(pc.epi.w, t, id);
        }
        return vec2<u32>(0u, 0u);
    }
    return vec2<u32>(pc.offs.x + u32(id) * pc.d_str.x + h * pc.d_str.y, 1u);
}
