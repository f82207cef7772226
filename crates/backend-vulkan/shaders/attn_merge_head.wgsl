// The merge of a split decode attention's chunks, shared by `attn_split.wgsl` and
// `attn_split_g.wgsl`: the ticket that finds a head's last chunk to finish, and element e of
// query head h's output from its nc partial slots, which that chunk computes.
//
// Why: both split kernels lay out and combine the slots the same way; one copy keeps them so.
//
// Strategy: slots [M, S, NaN seen, unused, acc[0..dim]] at (h * C_max + c) * (dim + 4) from
// the slots' offset (`pc.op.w`, C_max = `pc.prm.y`). The overall maximum M is the largest
// chunk maximum; then S = sum s_c * exp(m_c - M) and o = sum acc_c[e] * exp(m_c - M) in chunk
// order, a chunk with no finite logit (m_c = -inf) weighing 0; the output is o / S.
//
// Invariants: the slots are read with atomic loads (`ldc_p`); a NaN seen by any chunk makes
// the row NaN; S = 0 (every admitted logit -inf) gives zeros, as `attn_dec` does.

var<workgroup> last_chunk: u32;

// After a chunk's slot stores: takes its ticket on word `word` of the partials buffer and says
// whether it was the last of the nc chunks to finish; that chunk, and only it, has the
// others' slots visible and has put the word back to 0. The storage barriers (device scope,
// acquire-release) order the slot stores before the ticket and the ticket before the merge's
// loads. Called by every thread, in uniform control flow.
fn last_to_finish(word: u32, nc: u32, li: u32) -> bool {
    storageBarrier();
    if li == 0u {
        last_chunk = u32(atomicAdd(&p_buf[word], 1u) == nc - 1u);
    }
    if workgroupUniformLoad(&last_chunk) == 0u {
        return false;
    }
    storageBarrier();
    if li == 0u {
        atomicStore(&p_buf[word], 0u);
    }
    return true;
}

fn merge_head(h: u32, nc: u32, e: u32) {
    let dim = pc.shape.y;
    let stride = dim + 4u;
    let base = pc.op.w + h * pc.prm.y * stride;
    let ninf = bitcast<f32>(NINF_BITS);
    var m = ninf;
    for (var c = 0u; c < nc; c++) {
        m = max(m, ldc_p(base + c * stride));
    }
    var s = 0.0;
    var o = 0.0;
    var nan = false;
    for (var c = 0u; c < nc; c++) {
        let slot = base + c * stride;
        let mc = ldc_p(slot);
        var w = 0.0;
        if mc != ninf {
            w = exp(mc - m);
        }
        s += ldc_p(slot + 1u) * w;
        o += ldc_p(slot + 4u + e) * w;
        nan = nan || ldc_p(slot + 2u) != 0.0;
    }
    var inv = 0.0;
    if s != 0.0 {
        inv = 1.0 / s;
    }
    if nan {
        inv = bitcast<f32>(0x7fc00000u);
    }
    st_d(pc.d_str.z + h * pc.d_str.x + e * pc.d_str.y, o * inv);
}
