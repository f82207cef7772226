// Fused decode attention: out[h, :] = softmax(q[h] . K[kv]^T * scale + mask[h]) @ V[kv] for one
// query row per head, kv = h / (heads per kv head).
//
// Why: unfused, a decode step's attention is four dispatches (scores, soft_max, p @ V, the
// permuting copy) with the scores and probabilities round-tripping through memory, and every
// cache row is read even where the mask hides it. Here one workgroup per query head does it all.
//
// Strategy: the query row is cached in shared memory. Keys go by chunks of CH: each thread takes
// keys of the chunk, reads the mask first and reads the key's K row only where the mask admits
// it (-inf: the key is skipped, its score stays -inf); the chunk's scores live in shared memory.
// An online softmax keeps the running maximum M and sum S: a chunk with a larger maximum rescales
// S and the accumulators by exp(M_old - M_new). Each thread accumulates output dims li and
// li + WG over the chunk's admitted keys, reading no V row of a masked key.
//
// Invariants: f32 accumulation throughout. A NaN admitted logit (score * scale + mask) makes the
// whole row NaN, and a row with every key masked (and no NaN) gives zeros, as the unfused
// soft_max does. A masked key contributes exactly nothing whatever its K and V rows hold (the
// CPU backend's fused attention agrees; unfused, a NaN there would poison the row). Barriers are only reached in uniform control flow (loop bounds and M come from
// push constants and shared reductions). d <= 2 * WG (the planner checks).

struct Pc {
    // heads, head dim, keys, query heads per kv head
    shape: vec4<u32>,
    // out: head stride, dim stride, offset
    d_str: vec4<u32>,
    // q: head stride, dim stride, offset
    a_str: vec4<u32>,
    // K: kv-head stride, dim stride, key stride, offset
    b_str: vec4<u32>,
    // V: kv-head stride, key stride, dim stride, offset
    offs: vec4<u32>,
    // mask: head stride (0 when broadcast), key stride, offset
    op: vec4<u32>,
    // f32 bits: scale
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const WG: u32 = 128u;
const CH: u32 = 512u;

var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, 512>;
var<workgroup> red: array<f32, 128>;

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

@compute @workgroup_size(128)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let h = wg.x;
    if h >= pc.shape.x {
        return;
    }
    let dim = pc.shape.y;
    let keys = pc.shape.z;
    let kv = h / pc.shape.w;
    let scale = bitcast<f32>(pc.prm.x);
    let ninf = bitcast<f32>(0xff800000u);
    let q0 = pc.a_str.z + h * pc.a_str.x;
    let k0 = pc.b_str.w + kv * pc.b_str.x;
    let v0 = pc.offs.w + kv * pc.offs.x;
    let m0 = pc.op.z + h * pc.op.x;

    for (var e = li; e < dim; e += WG) {
        qs[e] = ld_a(q0 + e * pc.a_str.y);
    }
    workgroupBarrier();

    var mx = ninf;
    var sum = 0.0;
    var acc0 = 0.0;
    var acc1 = 0.0;
    var nan = 0.0;
    for (var c0 = 0u; c0 < keys; c0 += CH) {
        let n = min(CH, keys - c0);
        var lm = ninf;
        for (var j = li; j < n; j += WG) {
            let key = c0 + j;
            let mv = ld_m(m0 + key * pc.op.y);
            var s = ninf;
            if bitcast<u32>(mv) != 0xff800000u {
                let kr = k0 + key * pc.b_str.z;
                var dot = 0.0;
                for (var e = 0u; e < dim; e++) {
                    dot += qs[e] * ld_k(kr + e * pc.b_str.y);
                }
                s = dot * scale + mv;
                if is_nan(s) {
                    nan = 1.0;
                    s = ninf;
                }
            }
            sc[j] = s;
            lm = max(lm, s);
        }
        let new_mx = max(mx, reduce_max(lm, li));
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
            if bitcast<u32>(ld_m(m0 + (c0 + j) * pc.op.y)) != 0xff800000u {
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
        acc0 *= alpha;
        acc1 *= alpha;
        for (var j = 0u; j < n; j++) {
            let p = sc[j];
            if p >= 0.0 {
                let vr = v0 + (c0 + j) * pc.offs.y;
                if li < dim {
                    acc0 += p * ld_v(vr + li * pc.offs.z);
                }
                if li + WG < dim {
                    acc1 += p * ld_v(vr + (li + WG) * pc.offs.z);
                }
            }
        }
        mx = new_mx;
        // The next chunk overwrites the weights every thread has just read.
        workgroupBarrier();
    }
    let has_nan = reduce_max(nan, li) != 0.0;
    var inv = 0.0;
    if sum != 0.0 {
        inv = 1.0 / sum;
    }
    if has_nan {
        inv = bitcast<f32>(0x7fc00000u);
    }
    let o0 = pc.d_str.z + h * pc.d_str.x;
    if li < dim {
        st_d(o0 + li * pc.d_str.y, acc0 * inv);
    }
    if li + WG < dim {
        st_d(o0 + (li + WG) * pc.d_str.y, acc1 * inv);
    }
}
