// Decode attention split over keys: workgroup (h, c) computes an online softmax over chunk c
// of query head h's valid keys; `attn_merge.wgsl` combines a head's chunks.
//
// Why: `attn_dec` gives a head one workgroup, so a decode step's attention keeps as many
// multiprocessors busy as the model has heads, and its time grows with depth while the rest of
// the GPU idles. Splitting a head's keys over several workgroups spreads them over the GPU. A
// recorded step is replayed at every depth, so the split cannot be chosen when recording: the
// grid is fixed at heads x C_max and the device picks the chunk count from the mask each time.
//
// Strategy: every workgroup first scans its head's mask row (the whole window, 256 keys a pass)
// for the first and one past the last admitted key, F and L. The span L - F is cut into
// nc = clamp(ceil((L - F) / KMIN), 1, C_max) chunks of equal length (the last shorter); a
// workgroup whose chunk is at or past nc exits. Over its chunk, a workgroup runs `attn_dec`'s
// scheme (scores P threads a key, KB keys a pass, masked keys skipped unread; the online
// softmax's maximum M and sum S; p @ V by key groups, four keys' V loads in flight) and ends
// with the unnormalised output of its keys. With nc = 1 chunk 0 normalises and writes the
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

struct Pc {
    // heads, head dim, keys (the window), query heads per kv head
    shape: vec4<u32>,
    // out: head stride, dim stride, offset
    d_str: vec4<u32>,
    // q: head stride, dim stride, offset
    a_str: vec4<u32>,
    // K: kv-head stride, dim stride, key stride, offset
    b_str: vec4<u32>,
    // V: kv-head stride, key stride, dim stride, offset
    offs: vec4<u32>,
    // mask: head stride (0 when broadcast), key stride, offset; partials offset
    op: vec4<u32>,
    // f32 bits: scale; C_max; KMIN
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const WG: u32 = 256u;
const CH: u32 = 512u;
// Threads per key in the scores, and keys per pass (WG / P).
const P: u32 = 4u;
const KB: u32 = 64u;
const NINF_BITS: u32 = 0xff800000u;

var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, 512>;
var<workgroup> part: array<f32, 256>;
var<workgroup> red: array<f32, 256>;
var<workgroup> first_key: atomic<u32>;
var<workgroup> end_key: atomic<u32>;

fn reduce_max(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] = max(red[li], red[li + w]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] += red[li + w];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// Whether the mask admits `key` (anything but -inf).
fn admitted(m0: u32, key: u32) -> bool {
    return bitcast<u32>(ld_m(m0 + key * pc.op.y)) != NINF_BITS;
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let h = wg.x;
    let c = wg.y;
    if h >= pc.shape.x {
        return;
    }
    let dim = pc.shape.y;
    let keys = pc.shape.z;
    let kv = h / pc.shape.w;
    let scale = bitcast<f32>(pc.prm.x);
    let cmax = pc.prm.y;
    let kmin = pc.prm.z;
    let ninf = bitcast<f32>(NINF_BITS);
    let q0 = pc.a_str.z + h * pc.a_str.x;
    let k0 = pc.b_str.w + kv * pc.b_str.x;
    let v0 = pc.offs.w + kv * pc.offs.x;
    let m0 = pc.op.z + h * pc.op.x;
    let slot = pc.op.w + (h * cmax + c) * (dim + 4u);

    // 1. The span of admitted keys, [F, L).
    if li == 0u {
        atomicStore(&first_key, 0xffffffffu);
        atomicStore(&end_key, 0u);
    }
    workgroupBarrier();
    var f = 0xffffffffu;
    var l = 0u;
    for (var j = li; j < keys; j += WG) {
        if admitted(m0, j) {
            f = min(f, j);
            l = j + 1u;
        }
    }
    atomicMin(&first_key, f);
    atomicMax(&end_key, l);
    workgroupBarrier();
    let kend = atomicLoad(&end_key);
    var kfirst = atomicLoad(&first_key);
    if kend == 0u {
        kfirst = 0u;
    }
    let span = kend - kfirst;

    // 2. This workgroup's chunk.
    let nc = clamp((span + kmin - 1u) / kmin, 1u, cmax);
    if c >= nc {
        return;
    }
    let per = (span + nc - 1u) / nc;
    let lo = kfirst + min(c * per, span);
    let hi = kfirst + min((c + 1u) * per, span);

    // 3. The online softmax over keys [lo, hi), as in `attn_dec`.
    let kk = li / P;
    let kp = li % P;
    let groups = WG / dim;
    let g = li / dim;
    let e = li % dim;

    if li < dim {
        qs[li] = ld_a(q0 + li * pc.a_str.y);
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
                for (var x = kp; x < dim; x += P) {
                    d += qs[x] * ld_k(kr + x * pc.b_str.y);
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
        let new_mx = max(mx, reduce_max(lm, li));
        // Nothing admitted so far: the sum and accumulators are 0 and stay 0 either way.
        var alpha = 0.0;
        if mx != ninf {
            alpha = exp(mx - new_mx);
        }
        var ls = 0.0;
        for (var j = li; j < n; j += WG) {
            // -1 marks a masked key: its V row is never read.
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
        let cs = reduce_sum(ls, li);
        sum = sum * alpha + cs;
        acc *= alpha;
        if g < groups {
            let ve = v0 + e * pc.offs.z;
            var j = g;
            // Four keys at a time: their V loads are independent, so all four are in flight.
            for (; j + 3u * groups < n; j += 4u * groups) {
                let p0 = sc[j];
                let p1 = sc[j + groups];
                let p2 = sc[j + 2u * groups];
                let p3 = sc[j + 3u * groups];
                var x0 = 0.0;
                var x1 = 0.0;
                var x2 = 0.0;
                var x3 = 0.0;
                if p0 >= 0.0 {
                    x0 = ld_v(ve + (c0 + j) * pc.offs.y);
                }
                if p1 >= 0.0 {
                    x1 = ld_v(ve + (c0 + j + groups) * pc.offs.y);
                }
                if p2 >= 0.0 {
                    x2 = ld_v(ve + (c0 + j + 2u * groups) * pc.offs.y);
                }
                if p3 >= 0.0 {
                    x3 = ld_v(ve + (c0 + j + 3u * groups) * pc.offs.y);
                }
                acc += p0 * x0;
                acc += p1 * x1;
                acc += p2 * x2;
                acc += p3 * x3;
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
    let nan_seen = reduce_max(nan, li);
    part[li] = acc;
    workgroupBarrier();

    // 4. The output (one chunk) or this chunk's partial slot.
    if li < dim {
        var o = 0.0;
        for (var q = 0u; q < groups; q++) {
            o += part[q * dim + li];
        }
        if nc == 1u {
            var inv = 0.0;
            if sum != 0.0 {
                inv = 1.0 / sum;
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
        st_p(slot, mx);
        st_p(slot + 1u, sum);
        st_p(slot + 2u, nan_seen);
        st_p(slot + 3u, f32(nc));
    }
}
