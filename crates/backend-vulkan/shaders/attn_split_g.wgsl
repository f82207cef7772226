// Decode attention split over keys with the query heads of one KV head together: workgroup
// (kv, c) computes chunk c of the online softmax of query heads kv * G .. kv * G + G - 1 (G the
// heads per KV head, 2 to 4), so each K and V element it loads serves all G heads.
//
// Why: `attn_split.wgsl` gives every query head its own workgroups, so the K and V rows of a
// KV head are loaded once per query head sharing it (four times on a Llama 3.2-shaped model),
// and a step starts heads x C_max workgroups. Here a step starts KV heads x C_max, each doing
// the work of G heads per load.
//
// Strategy: as `attn_split` (the same span scan, chunk bounds, slots, ticket and merge; the
// ticket is the KV head's word), with the G heads' values in the lanes of a vec4: the queries
// as q4[x] = (q_0[x], .., q_3[x]) (lanes >= G zero), and the scores, maxima, sums and
// accumulators likewise. Keys go in passes of KB = 64: scores with P = 4 threads a key, thread
// (key, p) adding q4[x] * K[key, x] over x = p, p + P, ..; then the pass's maximum, weights and
// sum for every head at once; then p @ V, thread (kg, e) summing output dim e over keys kg,
// kg + WG / dim, .. of the pass for all G heads. A workgroup's chunk takes at least 32 keys
// (the planner's minimum), so a shallow step uses several workgroups per KV head.
//
// Invariants: as `attn_split`'s. The mask is one row for every head (the planner checks), so
// a key is admitted or masked for all G heads together: a masked key's K and V rows are never
// read, and its weight is -1 in every lane. An admitted NaN logit makes that head's row NaN.
// Lanes at or past G hold zeros and are never stored. G * dim <= WG.

// #include attn_body.wgsl
// #include attn_merge_head.wgsl

var<workgroup> q4: array<vec4<f32>, 256>;
var<workgroup> s4: array<vec4<f32>, 64>;
var<workgroup> part4: array<vec4<f32>, 256>;
var<workgroup> sg_part4: array<vec4<f32>, 256>;

// The workgroup's lane-wise maximum and sum of a vec4 (as `reduce_max` / `reduce_sum`).
fn reduce_max4(v: vec4<f32>) -> vec4<f32> {
    let m = subgroupMax(v);
    if sg_lane == 0u {
        sg_part4[sg_id] = m;
    }
    workgroupBarrier();
    var r = sg_part4[0];
    for (var i = 1u; i < sg_count; i++) {
        r = max(r, sg_part4[i]);
    }
    workgroupBarrier();
    return r;
}

fn reduce_sum4(v: vec4<f32>) -> vec4<f32> {
    let m = subgroupAdd(v);
    if sg_lane == 0u {
        sg_part4[sg_id] = m;
    }
    workgroupBarrier();
    var r = sg_part4[0];
    for (var i = 1u; i < sg_count; i++) {
        r += sg_part4[i];
    }
    workgroupBarrier();
    return r;
}

// Element `i` of q when `ok` (the head exists), else 0.
fn q_or_zero(i: u32, ok: bool) -> f32 {
    if ok {
        return ld_a(i);
    }
    return 0.0;
}

// V element `i` weighted by p (every lane's weight is -1 for a masked key: not read).
fn v_or_zero(p: vec4<f32>, i: u32) -> f32 {
    if p.x >= 0.0 {
        return ld_v(i);
    }
    return 0.0;
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
    let kv = wg.x;
    let c = wg.y;
    let gq = pc.shape.w;
    let h0 = kv * gq;
    if h0 >= pc.shape.x {
        return;
    }
    let dim = pc.shape.y;
    let keys = pc.shape.z;
    let cmax = pc.prm.y;
    let kmin = pc.prm.z;
    let m0 = pc.op.z;
    let scale = bitcast<f32>(pc.prm.x);
    let ninf = bitcast<f32>(NINF_BITS);
    let ninf4 = vec4<f32>(ninf);

    // 1. The G query rows, lane g of q4 (read while the mask is scanned), and the span of
    // admitted keys, [F, L).
    if li < dim {
        let qa = pc.a_str.z + h0 * pc.a_str.x + li * pc.a_str.y;
        let hs = pc.a_str.x;
        q4[li] = vec4<f32>(
            ld_a(qa),
            q_or_zero(qa + hs, 1u < gq),
            q_or_zero(qa + 2u * hs, 2u < gq),
            q_or_zero(qa + 3u * hs, 3u < gq),
        );
    }
    let fl = admitted_span(m0, keys, li);

    // 2. This workgroup's chunk.
    let ch = chunk_of(fl, c, kmin, cmax);
    let nc = ch.x;
    if c >= nc {
        return;
    }
    let lo = ch.y;
    let hi = ch.z;

    // 3. The online softmax over keys [lo, hi), KB keys a pass.
    let k0 = pc.b_str.w + kv * pc.b_str.x;
    let v0 = pc.offs.w + kv * pc.offs.x;
    let kk = li / P;
    let kp = li % P;
    let kgs = WG / dim;
    let kg = li / dim;
    let e = li % dim;
    var mx = ninf4;
    var sum = vec4<f32>(0.0);
    var acc = vec4<f32>(0.0);
    var nan = vec4<f32>(0.0);
    for (var c0 = lo; c0 < hi; c0 += KB) {
        let n = min(KB, hi - c0);
        // Scores: eight elements of the K row a round, all loaded before any is used; the
        // sum runs over x in order.
        let adm = kk < n && admitted(m0, c0 + kk);
        var d = vec4<f32>(0.0);
        if adm {
            let kr = k0 + (c0 + kk) * pc.b_str.z;
            let ks = pc.b_str.y;
            var x = kp;
            for (; x + 7u * P < dim; x += 8u * P) {
                let y0 = ld_k(kr + x * ks);
                let y1 = ld_k(kr + (x + P) * ks);
                let y2 = ld_k(kr + (x + 2u * P) * ks);
                let y3 = ld_k(kr + (x + 3u * P) * ks);
                let y4 = ld_k(kr + (x + 4u * P) * ks);
                let y5 = ld_k(kr + (x + 5u * P) * ks);
                let y6 = ld_k(kr + (x + 6u * P) * ks);
                let y7 = ld_k(kr + (x + 7u * P) * ks);
                d += q4[x] * y0;
                d += q4[x + P] * y1;
                d += q4[x + 2u * P] * y2;
                d += q4[x + 3u * P] * y3;
                d += q4[x + 4u * P] * y4;
                d += q4[x + 5u * P] * y5;
                d += q4[x + 6u * P] * y6;
                d += q4[x + 7u * P] * y7;
            }
            for (; x < dim; x += P) {
                d += q4[x] * ld_k(kr + x * ks);
            }
        }
        part4[li] = d;
        workgroupBarrier();
        var lm = ninf4;
        if kp == 0u && kk < n {
            var s = ninf4;
            if adm {
                let mv = ld_m(m0 + (c0 + kk) * pc.op.y);
                let dot = (part4[li] + part4[li + 1u]) + (part4[li + 2u] + part4[li + 3u]);
                s = dot * scale + vec4<f32>(mv);
                let bad = vec4<bool>(is_nan(s.x), is_nan(s.y), is_nan(s.z), is_nan(s.w));
                nan = select(nan, vec4<f32>(1.0), bad);
                s = select(s, ninf4, bad);
            }
            s4[kk] = s;
            lm = s;
        }
        let new_mx = max(mx, reduce_max4(lm));
        // A head with nothing admitted so far has S = acc = 0, which stay 0 either way.
        let alpha = select(vec4<f32>(0.0), exp(mx - new_mx), mx != ninf4);
        // Weights, one key a thread: -1 in every lane marks a masked key.
        var ls = vec4<f32>(0.0);
        if li < n {
            var p = vec4<f32>(-1.0);
            if admitted(m0, c0 + li) {
                let s = s4[li];
                p = select(vec4<f32>(0.0), exp(s - new_mx), s != ninf4);
                ls = p;
            }
            s4[li] = p;
        }
        let cs = reduce_sum4(ls);
        sum = sum * alpha + cs;
        acc *= alpha;
        // p @ V: keys kg, kg + kgs, .. of the pass, eight a round.
        if kg < kgs {
            let ve = v0 + e * pc.offs.z;
            let vs = pc.offs.y;
            var j = kg;
            for (; j + 7u * kgs < n; j += 8u * kgs) {
                let p0 = s4[j];
                let p1 = s4[j + kgs];
                let p2 = s4[j + 2u * kgs];
                let p3 = s4[j + 3u * kgs];
                let p4 = s4[j + 4u * kgs];
                let p5 = s4[j + 5u * kgs];
                let p6 = s4[j + 6u * kgs];
                let p7 = s4[j + 7u * kgs];
                let x0 = v_or_zero(p0, ve + (c0 + j) * vs);
                let x1 = v_or_zero(p1, ve + (c0 + j + kgs) * vs);
                let x2 = v_or_zero(p2, ve + (c0 + j + 2u * kgs) * vs);
                let x3 = v_or_zero(p3, ve + (c0 + j + 3u * kgs) * vs);
                let x4 = v_or_zero(p4, ve + (c0 + j + 4u * kgs) * vs);
                let x5 = v_or_zero(p5, ve + (c0 + j + 5u * kgs) * vs);
                let x6 = v_or_zero(p6, ve + (c0 + j + 6u * kgs) * vs);
                let x7 = v_or_zero(p7, ve + (c0 + j + 7u * kgs) * vs);
                acc += p0 * x0;
                acc += p1 * x1;
                acc += p2 * x2;
                acc += p3 * x3;
                acc += p4 * x4;
                acc += p5 * x5;
                acc += p6 * x6;
                acc += p7 * x7;
            }
            for (; j < n; j += kgs) {
                let p = s4[j];
                acc += p * v_or_zero(p, ve + (c0 + j) * vs);
            }
        }
        mx = new_mx;
        // The next pass overwrites the scores and weights every thread has just read.
        workgroupBarrier();
    }
    let nan_seen = reduce_max4(nan);
    // Output dim e of every head: the key groups' partial sums in group order.
    part4[li] = acc;
    workgroupBarrier();
    var o = vec4<f32>(0.0);
    if li < dim {
        for (var q = 0u; q < kgs; q++) {
            o += part4[q * dim + li];
        }
    }

    // 4. The outputs (one chunk), or this chunk's G partial slots and the KV head's ticket.
    if nc == 1u {
        if li < dim {
            for (var g = 0u; g < gq; g++) {
                var inv = 0.0;
                if sum[g] != 0.0 {
                    inv = 1.0 / sum[g];
                }
                if nan_seen[g] != 0.0 {
                    inv = bitcast<f32>(0x7fc00000u);
                }
                st_d(pc.d_str.z + (h0 + g) * pc.d_str.x + li * pc.d_str.y, o[g] * inv);
            }
        }
        return;
    }
    let stride = dim + 4u;
    if li < dim {
        for (var g = 0u; g < gq; g++) {
            stc_p(pc.op.w + ((h0 + g) * cmax + c) * stride + 4u + li, o[g]);
        }
    }
    if li < gq {
        let slot = pc.op.w + ((h0 + li) * cmax + c) * stride;
        stc_p(slot, mx[li]);
        stc_p(slot + 1u, sum[li]);
        stc_p(slot + 2u, nan_seen[li]);
    }
    if !last_to_finish(kv, nc, li) {
        return;
    }
    if li < gq * dim {
        merge_head(h0 + li / dim, nc, li % dim);
    }
}
