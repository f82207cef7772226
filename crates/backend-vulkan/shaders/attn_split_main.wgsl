// The entry point of the split decode attentions that give each query head its own workgroups
// (`attn_split.wgsl`, `attn_split_v.wgsl`): the span scan, the chunk, the output or the
// partial slot and its ticket, and the merge by the head's last chunk (attn_split.wgsl says
// how). The including kernel supplies `chunk_begin` (loads issued before the span scan) and
// `chunk_out`, its online softmax over a chunk.

// A chunk's result: M and S (the same in every thread), output dim li (threads li < dim) of
// its unnormalised p @ V, and whether any thread saw an admitted NaN logit (1.0) or not (0.0).
struct ChunkOut {
    mx: f32,
    sum: f32,
    o: f32,
    nan: f32,
}

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

    // 1. The span of admitted keys, [F, L) (after `chunk_begin`, the including kernel's loads
    // that need no span).
    chunk_begin(h, li);
    let fl = admitted_span(m0, keys, li);

    // 2. This workgroup's chunk.
    let ch = chunk_of(fl, c, kmin, cmax);
    let nc = ch.x;
    if c >= nc {
        return;
    }
    let lo = ch.y;
    let hi = ch.z;

    // 3. The online softmax over keys [lo, hi) (`chunk_out`, the including kernel's).
    let r = chunk_out(h, lo, hi, li);
    let nan_seen = r.nan;
    let o = r.o;

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
