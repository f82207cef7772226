// The online softmax over a range of one query head's keys, shared by `attn_dec.wgsl` (a head's
// whole window in one workgroup) and `attn_split.wgsl` (a chunk of its valid keys).
//
// Why: both kernels walk keys the same way; one copy of that walk keeps their numerics equal
// and a fix to one a fix to both.
//
// Strategy: `attend` caches the query row (loaded by `query_early`, which the kernel calls
// before its span scan) in shared memory, then goes over keys [lo, hi) by chunks of CH.
// Scores: P threads per key, KB keys per pass, each thread a strided quarter of the dot
// product, summed in a fixed order by the key's first thread; all P read the mask first and
// read the key's K row only where the mask admits it (-inf: the key is skipped, its score
// stays -inf); the chunk's scores live in shared memory. An online softmax keeps the running
// maximum M and sum S: a chunk with a larger maximum rescales S and the accumulators by
// exp(M_old - M_new). p @ V: the workgroup is G = WG / dim groups of dim threads, thread (g, e)
// summing output dim e over the keys j = g mod G, reading no V row of a masked key.
// `group_sum` adds the G partial outputs in group order. A key's work is spread over the
// workgroup, not walked by one thread: on a wide GPU a head's keys are latency, not bandwidth.
// For the same reason the loops over K and V rows take their loads eight at a time, written out
// so each round's loads are issued before any is used: a loop that uses each load before the
// next waits for every one in turn. Sums still run in order.
//
// Invariants: f32 accumulation. An admitted NaN logit is counted (`nan`) and weighs 0; a masked
// key contributes exactly nothing whatever its K and V rows hold. Every thread calls `attend`
// and `group_sum` with the same lo and hi (barriers in uniform control flow). d <= WG.

// #include attn_common.wgsl

// A workgroup's softmax state after its keys: M and S (the same in every thread), this thread's
// partial output (its group's share of dim e; 0 in threads past the groups), and whether this
// thread saw an admitted NaN logit.
struct Attended {
    mx: f32,
    sum: f32,
    acc: f32,
    nan: f32,
}

fn attend(h: u32, lo: u32, hi: u32, li: u32) -> Attended {
    let dim = pc.shape.y;
    let kv = h / pc.shape.w;
    let scale = bitcast<f32>(pc.prm.x);
    let ninf = bitcast<f32>(NINF_BITS);
    let k0 = pc.b_str.w + kv * pc.b_str.x;
    let v0 = pc.offs.w + kv * pc.offs.x;
    let m0 = pc.op.z + h * pc.op.x;
    // This thread's key and part of the dot product in the scores.
    let kk = li / P;
    let kp = li % P;
    // This thread's key group and output dim in p @ V (groups == 0: idle there).
    let groups = WG / dim;
    let g = li / dim;
    let e = li % dim;

    if li < dim {
        qs[li] = q_early;
    }
    workgroupBarrier();

    var mx = ninf;
    var sum = 0.0;
    var acc = 0.0;
    var nan = 0.0;
    for (var c0 = lo; c0 < hi; c0 += CH) {
        let n = min(CH, hi - c0);
        var lm = ninf;
        for (var sb = 0u; sb < n; sb += KB) {
            let j = sb + kk;
            var d = 0.0;
            if j < n && admitted(m0, c0 + j) {
                let kr = k0 + (c0 + j) * pc.b_str.z;
                // Eight elements of the K row a round, all loaded before any is used (a loop
                // that uses each load first waits for every one in turn); the sum runs over x
                // in order.
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
                    d += qs[x] * y0;
                    d += qs[x + P] * y1;
                    d += qs[x + 2u * P] * y2;
                    d += qs[x + 3u * P] * y3;
                    d += qs[x + 4u * P] * y4;
                    d += qs[x + 5u * P] * y5;
                    d += qs[x + 6u * P] * y6;
                    d += qs[x + 7u * P] * y7;
                }
                for (; x < dim; x += P) {
                    d += qs[x] * ld_k(kr + x * ks);
                }
            }
            part[li] = d;
            workgroupBarrier();
            if kp == 0u && j < n {
                let mv = ld_m(m0 + (c0 + j) * pc.op.y);
                var s = ninf;
                if bitcast<u32>(mv) != NINF_BITS {
                    let dot = (part[li] + part[li + 1u]) + (part[li + 2u] + part[li + 3u]);
                    s = dot * scale + mv;
                    if is_nan(s) {
                        nan = 1.0;
                        s = ninf;
                    }
                }
                sc[j] = s;
                lm = max(lm, s);
            }
            // The next pass overwrites the partial sums just read.
            workgroupBarrier();
        }
        let new_mx = max(mx, reduce_max(lm));
        // Nothing admitted so far: the sum and accumulators are 0 and stay 0 either way.
        var alpha = 0.0;
        if mx != ninf {
            alpha = exp(mx - new_mx);
        }
        var ls = 0.0;
        for (var j = li; j < n; j += WG) {
            // -1 marks a masked key: its V row is never read. An admitted key whose logit is
            // -inf (or whose NaN was counted above) weighs 0 and is read, as unfused.
            var p = -1.0;
            if admitted(m0, c0 + j) {
                p = 0.0;
                if sc[j] != ninf {
                    p = exp(sc[j] - new_mx);
                }
                ls += p;
            }
            sc[j] = p;
        }
        let cs = reduce_sum(ls);
        sum = sum * alpha + cs;
        acc *= alpha;
        if g < groups {
            let ve = v0 + e * pc.offs.z;
            var j = g;
            // Eight keys a round: their V loads are independent, so all eight are in flight.
            // A masked key's p is -1 and its value 0: it adds -0, which changes nothing. The
            // sum runs over the keys in order.
            let vs = pc.offs.y;
            for (; j + 7u * groups < n; j += 8u * groups) {
                var p: array<f32, 8>;
                var x: array<f32, 8>;
                p[0] = sc[j + 0u * groups];
                if p[0] >= 0.0 {
                    x[0] = ld_v(ve + (c0 + j + 0u * groups) * vs);
                }
                p[1] = sc[j + 1u * groups];
                if p[1] >= 0.0 {
                    x[1] = ld_v(ve + (c0 + j + 1u * groups) * vs);
                }
                p[2] = sc[j + 2u * groups];
                if p[2] >= 0.0 {
                    x[2] = ld_v(ve + (c0 + j + 2u * groups) * vs);
                }
                p[3] = sc[j + 3u * groups];
                if p[3] >= 0.0 {
                    x[3] = ld_v(ve + (c0 + j + 3u * groups) * vs);
                }
                p[4] = sc[j + 4u * groups];
                if p[4] >= 0.0 {
                    x[4] = ld_v(ve + (c0 + j + 4u * groups) * vs);
                }
                p[5] = sc[j + 5u * groups];
                if p[5] >= 0.0 {
                    x[5] = ld_v(ve + (c0 + j + 5u * groups) * vs);
                }
                p[6] = sc[j + 6u * groups];
                if p[6] >= 0.0 {
                    x[6] = ld_v(ve + (c0 + j + 6u * groups) * vs);
                }
                p[7] = sc[j + 7u * groups];
                if p[7] >= 0.0 {
                    x[7] = ld_v(ve + (c0 + j + 7u * groups) * vs);
                }
                acc += p[0] * x[0];
                acc += p[1] * x[1];
                acc += p[2] * x[2];
                acc += p[3] * x[3];
                acc += p[4] * x[4];
                acc += p[5] * x[5];
                acc += p[6] * x[6];
                acc += p[7] * x[7];
            }
            for (; j < n; j += groups) {
                let p = sc[j];
                if p >= 0.0 {
                    acc += p * ld_v(ve + (c0 + j) * pc.offs.y);
                }
            }
        }
        mx = new_mx;
        // The next chunk overwrites the weights every thread has just read.
        workgroupBarrier();
    }
    return Attended(mx, sum, acc, nan);
}

// Output dim `li` of the workgroup (threads li < dim): the groups' partial outputs added in
// group order.
fn group_sum(acc: f32, li: u32) -> f32 {
    let dim = pc.shape.y;
    part[li] = acc;
    workgroupBarrier();
    var o = 0.0;
    if li < dim {
        for (var q = 0u; q < WG / dim; q++) {
            o += part[q * dim + li];
        }
    }
    return o;
}
