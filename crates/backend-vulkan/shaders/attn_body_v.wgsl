// The online softmax over a range of one query head's keys with 16-byte loads of K and V and a
// round of several keys per thread (`attn_split_v.wgsl`); `attn_common.wgsl` gives the push
// constants, reductions, span scan and chunk bounds.
//
// Why: on a GPU a decode step's attention is a chain of dependent trips to memory, not a
// stream of bytes: `attend` (attn_body.wgsl) loads a K row as 16 scalars a thread in two
// rounds, a V row's 16 keys a thread in two more, and re-reads the mask before each use. Each
// round waits for the one before. Here a thread's whole share of a chunk of keys is one round
// of K loads and one of V loads where it fits (RK keys a thread), each element group one
// 16-byte load, and the mask is read once, beside the K rows.
//
// Strategy: the workgroup is G = WG / T key slots of T = dim / 8 threads; thread (slot, part)
// owns 8 consecutive dims (`ld8`). Scores: a round takes keys j = base + slot + r * G,
// r < RK, loading every key's mask value and its K part before any is used (a key past the
// chunk is clamped to its last key and dropped), and writes the T partial dots of each key to
// shared memory, which the key's first thread adds in part order. A masked key's score is
// MASKED (a NaN pattern no logit leaves, since an admitted NaN logit is counted and stored as
// -inf); its K row is loaded but never used. Softmax as `attend`. p @ V: thread (slot, part)
// sums its 8 dims over the keys j = slot + r * G in key order, a round's V loads issued
// together, skipping masked keys (p < 0) so a masked key contributes exactly nothing whatever
// its V row holds. `group_sum_v` adds the G slots' partial outputs in slot order.
//
// Invariants: f32 accumulation, sums in fixed orders (results do not depend on timing). Every
// thread calls `attend_v` and `group_sum_v` with the same lo and hi (barriers in uniform
// control flow), after `query_early`. dim a multiple of 8, at most WG; K and V rows 16-byte
// aligned with unit dim strides (the planner checks).

// #include attn_common.wgsl

// Keys a thread takes per round.
const RK: u32 = 4u;
// A masked key's score (a quiet NaN with a payload; never a logit's value).
const MASKED: u32 = 0x7fc0a5a5u;

// RK rounds' partial dots; later the G slots' partial outputs (8 floats a thread).
var<workgroup> part_v: array<f32, 2048>;

// A workgroup's softmax state after its keys (`Attended` with this thread's 8 output dims).
struct AttendedV {
    mx: f32,
    sum: f32,
    acc: mat2x4<f32>,
    nan: f32,
}

fn attend_v(h: u32, lo: u32, hi: u32, li: u32) -> AttendedV {
    let dim = pc.shape.y;
    let kv = h / pc.shape.w;
    let scale = bitcast<f32>(pc.prm.x);
    let ninf = bitcast<f32>(NINF_BITS);
    let k0 = pc.b_str.w + kv * pc.b_str.x;
    let v0 = pc.offs.w + kv * pc.offs.x;
    let m0 = pc.op.z + h * pc.op.x;
    let t = dim / 8u;
    let slots = WG / t;
    let slot = li / t;
    let part = li % t;
    // Threads past the last whole slot (WG not a multiple of t) take no keys.
    let takes_keys = slot < slots;

    if li < dim {
        qs[li] = q_early;
    }
    workgroupBarrier();
    var qa = mat2x4<f32>();
    if takes_keys {
        let e = 8u * part;
        qa = mat2x4<f32>(
            vec4<f32>(qs[e], qs[e + 1u], qs[e + 2u], qs[e + 3u]),
            vec4<f32>(qs[e + 4u], qs[e + 5u], qs[e + 6u], qs[e + 7u]),
        );
    }

    var mx = ninf;
    var sum = 0.0;
    var acc = mat2x4<f32>();
    var nan = 0.0;
    for (var c0 = lo; c0 < hi; c0 += CH) {
        let n = min(CH, hi - c0);
        var lm = ninf;
        for (var sb = 0u; sb < n; sb += slots * RK) {
            // Every key's mask value and K part of the round, loaded before any is used.
            var mv: array<f32, RK>;
            var kr: array<mat2x4<f32>, RK>;
            for (var r = 0u; r < RK; r++) {
                let j = min(sb + slot + r * slots, n - 1u);
                mv[r] = ld_m(m0 + (c0 + j) * pc.op.y);
                kr[r] = ld8_k(k0 + (c0 + j) * pc.b_str.z + 8u * part);
            }
            for (var r = 0u; r < RK; r++) {
                let y = kr[r];
                part_v[r * WG + li] = dot(qa[0], y[0]) + dot(qa[1], y[1]);
            }
            workgroupBarrier();
            if takes_keys && part == 0u {
                for (var r = 0u; r < RK; r++) {
                    let j = sb + slot + r * slots;
                    if j < n {
                        var s = bitcast<f32>(MASKED);
                        if bitcast<u32>(mv[r]) != NINF_BITS {
                            var d = 0.0;
                            for (var x = 0u; x < t; x++) {
                                d += part_v[r * WG + li + x];
                            }
                            s = d * scale + mv[r];
                            if is_nan(s) {
                                nan = 1.0;
                                s = ninf;
                            }
                            lm = max(lm, s);
                        }
                        sc[j] = s;
                    }
                }
            }
            // The next round overwrites the partial dots just read.
            workgroupBarrier();
        }
        let new_mx = max(mx, reduce_max(lm));
        var alpha = 0.0;
        if mx != ninf {
            alpha = exp(mx - new_mx);
        }
        var ls = 0.0;
        for (var j = li; j < n; j += WG) {
            // -1 marks a masked key (its V row is not used); an admitted key whose logit is
            // -inf (or whose NaN was counted) weighs 0, as unfused.
            let s = sc[j];
            var p = -1.0;
            if bitcast<u32>(s) != MASKED {
                p = 0.0;
                if s != ninf {
                    p = exp(s - new_mx);
                }
                ls += p;
            }
            sc[j] = p;
        }
        let cs = reduce_sum(ls);
        sum = sum * alpha + cs;
        acc = acc * alpha;
        if takes_keys {
            let e = v0 + 8u * part * pc.offs.z;
            for (var sb = 0u; sb < n; sb += slots * RK) {
                var p: array<f32, RK>;
                var x: array<mat2x4<f32>, RK>;
                for (var r = 0u; r < RK; r++) {
                    let j = sb + slot + r * slots;
                    p[r] = -1.0;
                    if j < n {
                        p[r] = sc[j];
                    }
                    x[r] = ld8_v(e + (c0 + min(j, n - 1u)) * pc.offs.y);
                }
                for (var r = 0u; r < RK; r++) {
                    if p[r] >= 0.0 {
                        acc += x[r] * p[r];
                    }
                }
            }
        }
        mx = new_mx;
        // The next chunk overwrites the weights every thread has just read.
        workgroupBarrier();
    }
    return AttendedV(mx, sum, acc, nan);
}

// Output dim `li` of the workgroup (threads li < dim): the slots' partial outputs added in slot
// order.
fn group_sum_v(acc: mat2x4<f32>, li: u32) -> f32 {
    let dim = pc.shape.y;
    let t = dim / 8u;
    let slots = WG / t;
    if li < slots * t {
        for (var i = 0u; i < 4u; i++) {
            part_v[8u * li + i] = acc[0][i];
            part_v[8u * li + 4u + i] = acc[1][i];
        }
    }
    workgroupBarrier();
    var o = 0.0;
    if li < dim {
        // Slot s's thread of part li / 8 stored dim li at 8 t s + li.
        for (var s = 0u; s < slots; s++) {
            o += part_v[8u * t * s + li];
        }
    }
    return o;
}
