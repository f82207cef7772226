// Sample: one token per row of logits [R, V] by the algorithm of `lowsync_graph::sampling`
// (the CPU kernels are the oracle). One workgroup per row; 256 invocations stride over it.
//
// Strategy: every truncation is a threshold `cut` on the order key (an order-preserving map of
// f32 onto u32, NaN at 0). Top-k's is the k-th largest key, the largest T with
// count(key >= T) >= k; top-p's the largest T >= cut with mass(key >= T) >= top_p * Z. Both
// are found by a radix descent over the key, four bits a pass (eight passes over the row, not
// a bisection's 32): a pass sums, per digit of the bucket chosen so far, the counts or the
// softmax masses of its entries (per invocation, then across the workgroup with atomics),
// and keeps the largest digit whose suffix still holds k entries or the target mass. Counts
// are exact, so top-k keeps exactly the CPU's set; masses are summed per invocation in f32
// and then exactly, as 64-bit fixed point, so they differ from the CPU's f32 sums only by
// rounding (theirs and `exp`'s). Min-p's cut is the key of max + ln(min_p). The draw is
// Gumbel-max with Philox4x32-10 noise, reduced over (score, index) pairs with ties to the
// lowest index; `ln` is computed here to within an ulp of the CPU's, because Vulkan bounds
// the builtin `log` near 1 only by an absolute error of 2^-21, no relative accuracy at all
// where the Gumbel noise of the likeliest tokens is formed (lavapipe's is accurate; GPUs'
// hardware logs are not). So a token differs from the CPU's only on a near-tie, and no sum
// depends on the order invocations add in: the same inputs draw the same token every run.
//
// Invariants: barriers stay in uniform control flow: every branch or loop around one depends
// only on push constants, on the row's parameters (read by every invocation) or on results
// of workgroup reductions, which every invocation holds. Rows are shorter than 2^24 entries
// (the host checks), so no fixed-point sum overflows. Few barriers and no private arrays
// indexed by data: lavapipe turns each barrier into a coroutine suspend point and such an
// array into a branch ladder, and their product makes its LLVM compile take minutes.

struct Pc {
    // x: rows R, y: row length V
    shape: vec4<u32>,
    // x: result stride
    d_str: vec4<u32>,
    // logits row and column strides
    a_str: vec4<u32>,
    // params row and column strides (xy), key row and column strides (zw)
    b_str: vec4<u32>,
    // d, logits, params, key element offsets
    offs: vec4<u32>,
    // x: radix passes, 8 (a push constant, not a literal, so that the compiler keeps the
    // loop rather than unrolling eight copies of its barriers)
    op: vec4<u32>,
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
// order_key(-inf): a row whose largest key is at most this has nothing finite to draw from.
const KEY_NEG_INF: u32 = 0x007fffffu;
// order_key(+inf).
const KEY_POS_INF: u32 = 0xff800000u;

// Scratch of the workgroup reductions (max, min, best pair).
var<workgroup> red_u: array<u32, 256>;
var<workgroup> red_i: array<u32, 256>;
var<workgroup> red_f: array<f32, 256>;
// Per-digit sums of a radix pass: entry counts (top-k), and softmax masses as 64-bit fixed
// point with 40 fractional bits in two words (top-p). Integer atomics make the sums exact and
// independent of the order the invocations add in, so a row draws the same token every run.
var<workgroup> digit_count: array<atomic<u32>, 16>;
var<workgroup> digit_mass_lo: array<atomic<u32>, 16>;
var<workgroup> digit_mass_hi: array<atomic<u32>, 16>;

// ---- the reference's building blocks -------------------------------------------------------

fn order_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if (b & 0x7fffffffu) > 0x7f800000u {
        return 0u;
    }
    if (b & 0x80000000u) != 0u {
        return ~b;
    }
    return b | 0x80000000u;
}

// The value of a non-zero key (the inverse of `order_key`).
fn key_value(k: u32) -> f32 {
    if (k & 0x80000000u) != 0u {
        return bitcast<f32>(k & 0x7fffffffu);
    }
    return bitcast<f32>(~k);
}

// (high, low) words of the 64-bit product a * b, from 16-bit halves (WGSL has only u32).
fn mulhilo(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return vec2<u32>(p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u), a * b);
}

// The first word of Philox4x32-10 of counter (c0, c1, 0, 0) under key (seed, 0).
fn philox_word0(c0: u32, c1: u32, seed: u32) -> u32 {
    var c = vec4<u32>(c0, c1, 0u, 0u);
    var k = vec2<u32>(seed, 0u);
    for (var round = 0u; round < 10u; round++) {
        if round > 0u {
            k += vec2<u32>(0x9E3779B9u, 0xBB67AE85u);
        }
        let p0 = mulhilo(0xD2511F53u, c.x);
        let p1 = mulhilo(0xCD9E8D57u, c.z);
        c = vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
    }
    return c.x;
}

fn uniform(seed: u32, counter: u32, i: u32) -> f32 {
    let w = philox_word0(i, counter, seed);
    // At most 1 - 2^-24: the top bucket's centre rounds to 1.0 (Gumbel +inf).
    return min((f32(w >> 8u) + 0.5) * 5.9604644775390625e-8, 0.99999994);
}

// Natural log within an ulp of glibc's `logf` (the CPU's `f32::ln`; checked on 47M inputs
// from 2^-26 to 32 and across the range), from + - * / only: x = 2^k * (1 + f)
// with 1 + f in [sqrt(1/2), sqrt(2)], ln(1 + f) = 2 atanh(s), s = f / (2 + f), written as
// f - f^2/2 + s (f^2/2 + R(s^2)) so the large terms carry no division error (R is the atanh
// series past its first term, exact to 2^-30 for |s| <= 0.172), and k ln 2 split in two so
// k * LN2_HI is exact. Special values as IEEE `log`: ln(+-0) = -inf, ln(x < 0) = NaN.
fn ln_f32(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    if (b & 0x7fffffffu) == 0u {
        return bitcast<f32>(0xff800000u);
    }
    if (b & 0x80000000u) != 0u || b > 0x7f800000u {
        return bitcast<f32>(0x7fc00000u);
    }
    if b == 0x7f800000u {
        return x;
    }
    var k: i32;
    var mbits: u32;
    if b < 0x00800000u {
        // Subnormal: normalized on the bits (a device may flush subnormal arithmetic).
        let sh = countLeadingZeros(b) - 8u;
        mbits = (b << sh) & 0x007fffffu;
        k = -126 - i32(sh);
    } else {
        mbits = b & 0x007fffffu;
        k = i32(b >> 23u) - 127;
    }
    var mant = bitcast<f32>(mbits | 0x3f800000u);
    if mant > 1.41421356 {
        mant = mant * 0.5;
        k += 1;
    }
    let f = mant - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let r = z * (0.6666666666666666 + z * (0.4 + z * (0.2857142857142857
        + z * (0.2222222222222222 + z * 0.18181818181818182))));
    let hfsq = 0.5 * f * f;
    let dk = f32(k);
    // ln 2 = LN2_HI + LN2_LO; LN2_HI has 16 significant bits, so dk * LN2_HI is exact.
    let ln2_hi = 0.693145751953125;
    let ln2_lo = 1.4286068203094173e-6;
    return (((s * (hfsq + r) + dk * ln2_lo) - hfsq) + f) + dk * ln2_hi;
}

fn gumbel(u: f32) -> f32 {
    return -ln_f32(-ln_f32(u));
}

// The k of top-k, or 0 when top-k keeps everything (`sampling::top_k_count`).
fn top_k_count(top_k: f32, v: u32) -> u32 {
    if is_nan(top_k) || top_k < 1.0 || top_k >= 4294967296.0 {
        return 0u;
    }
    let k = u32(top_k);
    if k >= v {
        return 0u;
    }
    return k;
}

// ---- workgroup reductions (each leaves the scratch arrays free for the next) ---------------

fn max_u32(li: u32, v: u32) -> u32 {
    red_u[li] = v;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if li < w {
            red_u[li] = max(red_u[li], red_u[li + w]);
        }
        workgroupBarrier();
    }
    let r = red_u[0];
    workgroupBarrier();
    return r;
}

fn min_u32(li: u32, v: u32) -> u32 {
    red_u[li] = v;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if li < w {
            red_u[li] = min(red_u[li], red_u[li + w]);
        }
        workgroupBarrier();
    }
    let r = red_u[0];
    workgroupBarrier();
    return r;
}

// Whether key pair (k2, i2) beats (k1, i1): the larger key, then the lower index.
fn key_beats(k1: u32, i1: u32, k2: u32, i2: u32) -> bool {
    if i2 == NONE {
        return false;
    }
    if i1 == NONE {
        return true;
    }
    return k2 > k1 || (k2 == k1 && i2 < i1);
}

// The index of the best (key, index) pair of the workgroup.
fn best_key(li: u32, k: u32, i: u32) -> u32 {
    red_u[li] = k;
    red_i[li] = i;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if li < w && key_beats(red_u[li], red_i[li], red_u[li + w], red_i[li + w]) {
            red_u[li] = red_u[li + w];
            red_i[li] = red_i[li + w];
        }
        workgroupBarrier();
    }
    let r = red_i[0];
    workgroupBarrier();
    return r;
}

// Whether score pair (s2, i2) beats (s1, i1): a number beats NaN, then the larger score,
// then the lower index.
fn score_beats(s1: f32, i1: u32, s2: f32, i2: u32) -> bool {
    if i2 == NONE {
        return false;
    }
    if i1 == NONE {
        return true;
    }
    let n1 = is_nan(s1);
    let n2 = is_nan(s2);
    if n1 != n2 {
        return n1;
    }
    if n1 {
        return i2 < i1;
    }
    return s2 > s1 || (s2 == s1 && i2 < i1);
}

// The index of the best (score, index) pair of the workgroup.
fn best_score(li: u32, s: f32, i: u32) -> u32 {
    red_f[li] = s;
    red_i[li] = i;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if li < w && score_beats(red_f[li], red_i[li], red_f[li + w], red_i[li + w]) {
            red_f[li] = red_f[li + w];
            red_i[li] = red_i[li + w];
        }
        workgroupBarrier();
    }
    let r = red_i[0];
    workgroupBarrier();
    return r;
}

// ---- 64-bit fixed-point masses (units of 2^-40, as (low, high) words) ----------------------

// A mass in [0, 2^24) to fixed point, truncated: its bits below 2^-40 are dropped, at most
// V * 2^-40 over a row (rows are shorter than 2^24 entries, so no sum overflows).
fn to_fixed(e: f32) -> vec2<u32> {
    let f = e * 256.0;
    let hi = floor(f);
    // f - hi is exact, and so is the scaling by 2^32.
    return vec2<u32>(u32((f - hi) * 4294967296.0), u32(hi));
}

fn fixed_to_f32(a: vec2<u32>) -> f32 {
    return f32(a.y) * 0.00390625 + f32(a.x) * 9.094947017729282e-13;
}

fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

fn ge64(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.y > b.y || (a.y == b.y && a.x >= b.x);
}

// Adds a mass to digit d's sum: the low word's wrap is seen by the one invocation whose add
// wrapped it, which carries into the high word.
fn add_mass(d: u32, e: f32) {
    let q = to_fixed(e);
    let old = atomicAdd(&digit_mass_lo[d], q.x);
    let hi = q.y + select(0u, 1u, old + q.x < old);
    if hi != 0u {
        atomicAdd(&digit_mass_hi[d], hi);
    }
}

// An invocation sums its entries per digit in four vec4s (digits 4i..4i+3 in the i-th), added
// to through lane masks: a private array indexed by the digit would be lowered by lavapipe to
// a branch ladder (see the header), and one shared atomic per entry would serialize on a GPU,
// where most entries of a pass share a digit. The sums go to shared memory once per pass.
fn digit_lanes(d: u32, first: u32) -> vec4<bool> {
    return vec4<u32>(d) == vec4<u32>(first, first + 1u, first + 2u, first + 3u);
}

fn flush_counts(first: u32, c: vec4<u32>) {
    if c.x != 0u {
        atomicAdd(&digit_count[first], c.x);
    }
    if c.y != 0u {
        atomicAdd(&digit_count[first + 1u], c.y);
    }
    if c.z != 0u {
        atomicAdd(&digit_count[first + 2u], c.z);
    }
    if c.w != 0u {
        atomicAdd(&digit_count[first + 3u], c.w);
    }
}

// An invocation's masses are summed in f32 (in a fixed order: its entries are fixed), then
// added to the workgroup's exactly.
fn flush_masses(first: u32, s: vec4<f32>) {
    if s.x != 0.0 {
        add_mass(first, s.x);
    }
    if s.y != 0.0 {
        add_mass(first + 1u, s.y);
    }
    if s.z != 0.0 {
        add_mass(first + 2u, s.z);
    }
    if s.w != 0.0 {
        add_mass(first + 3u, s.w);
    }
}

fn digit_mass(b: u32) -> vec2<u32> {
    return vec2<u32>(atomicLoad(&digit_mass_lo[b]), atomicLoad(&digit_mass_hi[b]));
}

// ---- the kernel ----------------------------------------------------------------------------

fn logit(a0: u32, j: u32) -> f32 {
    return ld_a(a0 + j * pc.a_str.y);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = group_id(wg, nwg);
    if row >= pc.shape.x {
        return;
    }
    let v = pc.shape.y;
    let a0 = pc.offs.y + row * pc.a_str.x;
    let p0 = pc.offs.z + row * pc.b_str.x;
    let temperature = ld_par(p0);
    let top_k = ld_par(p0 + pc.b_str.y);
    let top_p = ld_par(p0 + 2u * pc.b_str.y);
    let min_p = ld_par(p0 + 3u * pc.b_str.y);
    let k0 = pc.offs.w + row * pc.b_str.z;
    let seed = bitcast<u32>(ldi_key(k0));
    let counter = bitcast<u32>(ldi_key(k0 + pc.b_str.w));
    let out = pc.offs.x + row * pc.d_str.x;

    // 1. The largest key (its value is m), and the argmax for greedy rows: Argmax's order,
    //    where -0 and +0 are equal, so -0 ranks with +0's key.
    var kmax = 0u;
    var arg_k = 0u;
    var arg_i = NONE;
    for (var j = li; j < v; j += WG) {
        let x = logit(a0, j);
        let k = order_key(x);
        kmax = max(kmax, k);
        var ka = k;
        if bitcast<u32>(x) == 0x80000000u {
            ka = 0x80000000u;
        }
        if arg_i == NONE || ka > arg_k {
            arg_k = ka;
            arg_i = j;
        }
    }
    kmax = max_u32(li, kmax);
    let arg = best_key(li, arg_k, arg_i);
    if is_nan(temperature) || temperature <= 0.0 || kmax <= KEY_NEG_INF {
        if li == 0u {
            sti_d(out, bitcast<i32>(arg));
        }
        return;
    }
    let m = key_value(kmax);

    // 2. top-k: the k-th largest key, digit by digit from the top. `need` is how many of the
    //    k still lie in the bucket `prefix` (entries above it are already counted), so the
    //    bucket always holds at least `need` entries and the digit below always exists.
    var cut = 1u;
    let kk = top_k_count(top_k, v);
    if kk != 0u {
        var prefix = 0u;
        var need = kk;
        for (var level = 0u; level < min(pc.op.x, 8u); level++) {
            let shift = 28u - 4u * level;
            let high = select(0xffffffffu << (shift + 4u), 0u, level == 0u);
            if li < 16u {
                atomicStore(&digit_count[li], 0u);
            }
            workgroupBarrier();
            var c0 = vec4<u32>();
            var c1 = vec4<u32>();
            var c2 = vec4<u32>();
            var c3 = vec4<u32>();
            let one = vec4<u32>(1u);
            let none = vec4<u32>(0u);
            for (var j = li; j < v; j += WG) {
                let k = order_key(logit(a0, j));
                if (k & high) == prefix {
                    let d = (k >> shift) & 15u;
                    c0 += select(none, one, digit_lanes(d, 0u));
                    c1 += select(none, one, digit_lanes(d, 4u));
                    c2 += select(none, one, digit_lanes(d, 8u));
                    c3 += select(none, one, digit_lanes(d, 12u));
                }
            }
            flush_counts(0u, c0);
            flush_counts(4u, c1);
            flush_counts(8u, c2);
            flush_counts(12u, c3);
            workgroupBarrier();
            var above = 0u;
            var digit = 0u;
            for (var b = 15i; b >= 0; b--) {
                let c = atomicLoad(&digit_count[b]);
                if above + c >= need {
                    digit = u32(b);
                    break;
                }
                above += c;
            }
            // Everyone has read the counts before the next pass clears them.
            workgroupBarrier();
            need -= above;
            prefix |= digit << shift;
        }
        cut = max(cut, prefix);
    }

    // 3. top-p: the largest T whose kept entries at or above it hold `goal` = top_p of the
    //    kept mass Z, digit by digit; `above` is the kept mass above the bucket `prefix`, and Z
    //    the first pass's total. Only keys of kept entries can be that largest T (for a goal
    //    above 0), so the answer is at least `cut`. An infinite maximum makes the CPU's Z NaN,
    //    which keeps `cut`; so does a goal that even the whole mass misses by rounding (top_p
    //    just below 1). A goal of 0 or less keeps the maximum alone.
    if !is_nan(top_p) && top_p < 1.0 && kmax != KEY_POS_INF {
        var prefix = 0u;
        var above = vec2<u32>(0u);
        var goal = vec2<u32>(0u);
        var complete = true;
        for (var level = 0u; level < min(pc.op.x, 8u); level++) {
            let shift = 28u - 4u * level;
            let high = select(0xffffffffu << (shift + 4u), 0u, level == 0u);
            if li < 16u {
                atomicStore(&digit_mass_lo[li], 0u);
                atomicStore(&digit_mass_hi[li], 0u);
            }
            workgroupBarrier();
            var s0 = vec4<f32>();
            var s1 = vec4<f32>();
            var s2 = vec4<f32>();
            var s3 = vec4<f32>();
            let none = vec4<f32>(0.0);
            for (var j = li; j < v; j += WG) {
                let x = logit(a0, j);
                let k = order_key(x);
                if k >= cut && (k & high) == prefix {
                    let d = (k >> shift) & 15u;
                    let e = vec4<f32>(exp(x - m));
                    // The other digits' lanes add +0 to non-negative sums: no change.
                    s0 += select(none, e, digit_lanes(d, 0u));
                    s1 += select(none, e, digit_lanes(d, 4u));
                    s2 += select(none, e, digit_lanes(d, 8u));
                    s3 += select(none, e, digit_lanes(d, 12u));
                }
            }
            flush_masses(0u, s0);
            flush_masses(4u, s1);
            flush_masses(8u, s2);
            flush_masses(12u, s3);
            workgroupBarrier();
            if level == 0u {
                var z = vec2<u32>(0u);
                for (var b = 0u; b < 16u; b++) {
                    z = add64(z, digit_mass(b));
                }
                let g = top_p * fixed_to_f32(z);
                if g > 0.0 {
                    goal = to_fixed(g);
                }
            }
            // After the search `run` is the mass above the chosen digit's bucket.
            var run = above;
            var digit = -1i;
            let keep_max = goal.x == 0u && goal.y == 0u;
            if !keep_max {
                for (var b = 15i; b >= 0; b--) {
                    let t = add64(run, digit_mass(u32(b)));
                    if ge64(t, goal) {
                        digit = b;
                        break;
                    }
                    if b == 0i {
                        break;
                    }
                    run = t;
                }
            }
            // Everyone has read the sums before the next pass clears them.
            workgroupBarrier();
            if keep_max {
                // Every key qualifies; the largest kept one is the maximum's.
                cut = max(cut, kmax);
                complete = false;
                break;
            }
            if digit < 0i {
                if level == 0u {
                    complete = false;
                    break;
                }
                // The sums are exact, so a pass cannot disagree with the one before; stay
                // inside the bucket that one chose all the same.
                digit = 0i;
            }
            above = run;
            prefix |= u32(digit) << shift;
        }
        if complete {
            cut = max(cut, prefix);
        }
    }

    // 4. min-p.
    if !is_nan(min_p) && min_p > 0.0 {
        cut = max(cut, order_key(m + ln_f32(min_p)));
    }
    // The maximum is always kept (min_p > 1 would otherwise cut above it).
    cut = min(cut, kmax);

    // 5. The Gumbel-max draw over the kept entries. The CPU takes the first kept entry
    //    unconditionally and then only strictly larger scores, so a NaN score (an infinite
    //    logit or temperature) wins only as the first kept entry, and otherwise never.
    var first = NONE;
    var best_s = 0.0;
    var best_i = NONE;
    for (var j = li; j < v; j += WG) {
        let x = logit(a0, j);
        if order_key(x) >= cut {
            let s = (x - m) / temperature + gumbel(uniform(seed, counter, j));
            if first == NONE {
                first = j;
            }
            if score_beats(best_s, best_i, s, j) {
                best_s = s;
                best_i = j;
            }
        }
    }
    let f = min_u32(li, first);
    let best = best_score(li, best_s, best_i);
    if li == 0u {
        var token = best;
        if f != NONE {
            let s = (logit(a0, f) - m) / temperature + gumbel(uniform(seed, counter, f));
            if is_nan(s) {
                token = f;
            }
        }
        // Nothing kept (min_p > 1) gives -1, as the CPU's `usize::MAX as i32`.
        sti_d(out, bitcast<i32>(token));
    }
}
