//! The sampling algorithm of [`Op::Penalize`](crate::Op::Penalize) and
//! [`Op::Sample`](crate::Op::Sample), written once as the reference every backend follows.
//!
//! Why it is shaped this way: a seeded run must pick the same token on the CPU, CUDA and
//! Vulkan from the same logits, and a GPU cannot cheaply sort a 150k-entry row in one
//! workgroup. So every truncation is a *threshold on an order key* (an order-preserving map of
//! the f32 bits to u32), which a GPU finds by bisection over the key with exact integer counts
//! and a CPU by selection; both find the same key. The draw is the Gumbel-max trick with a
//! counter-based RNG (Philox4x32-10 keyed by the seed, counted by `(i, counter)`), so each
//! element's noise is a pure function of its index and no sum order decides the token.
//!
//! What may still differ between backends: `exp`/`ln` round differently by an ulp or two, which
//! moves a top-p, min-p or draw decision only when two candidates are within that rounding of
//! each other. Ties of equal keys are kept together (top-k keeps every value equal to the k-th
//! largest); a draw tie goes to the lowest index. `NaN` logits are never drawn.

/// Philox4x32 multipliers and key increments (Salmon et al., SC'11).
pub const PHILOX_M0: u32 = 0xD251_1F53;
/// Second Philox4x32 multiplier.
pub const PHILOX_M1: u32 = 0xCD9E_8D57;
/// First Philox key increment (golden ratio).
pub const PHILOX_W0: u32 = 0x9E37_79B9;
/// Second Philox key increment (sqrt(3) - 1).
pub const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: four counter words under a two-word key.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
        }
        let p0 = u64::from(PHILOX_M0) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The largest f32 below 1 (`1 - 2^-24`).
pub const UNIFORM_MAX: f32 = 1.0 - f32::EPSILON / 2.0;

/// The uniform in (0, 1) of element `i` of a row keyed `(seed, counter)`: the top 24 bits of
/// the first Philox word of counter `(i, counter, 0, 0)` under key `(seed, 0)`, centred in its
/// 2^-24 bucket, and at most [`UNIFORM_MAX`]: the top bucket's centre `1 - 2^-25` rounds to
/// 1.0 in f32, whose Gumbel noise would be `+inf` (that element would win whatever its logit).
pub fn uniform(seed: u32, counter: u32, i: u32) -> f32 {
    let w = philox4x32_10([i, counter, 0, 0], [seed, 0])[0];
    (((w >> 8) as f32 + 0.5) * (1.0 / 16_777_216.0)).min(UNIFORM_MAX)
}

/// Standard Gumbel noise of a uniform `u` in (0, 1): `-ln(-ln(u))`.
pub fn gumbel(u: f32) -> f32 {
    -(-u.ln()).ln()
}

/// An order-preserving map of f32 onto u32: `a < b` implies `order_key(a) < order_key(b)`;
/// `-0.0` sits just below `+0.0`; `NaN` (any sign) is 0, below everything, and only `NaN` is 0.
pub fn order_key(x: f32) -> u32 {
    if x.is_nan() {
        return 0;
    }
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Index of the largest value, lowest on ties, `NaN` below everything (the rule of
/// [`Op::Argmax`](crate::Op::Argmax)); 0 for an all-`NaN` row.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate().skip(1) {
        let b = v[best];
        if x > b || (b.is_nan() && !x.is_nan()) {
            best = i;
        }
    }
    best
}

/// [`Op::Penalize`](crate::Op::Penalize) on one row, in place: for each distinct id of `hist`
/// inside `[0, row.len())`, seen `c` times, `x = if x <= 0 { x * repeat } else { x / repeat }`,
/// then `x -= c * frequency + presence`.
pub fn penalize_row(row: &mut [f32], hist: &[i32], repeat: f32, frequency: f32, presence: f32) {
    let v = row.len();
    for (j, &t) in hist.iter().enumerate() {
        if t < 0 || t as usize >= v || hist[..j].contains(&t) {
            continue;
        }
        let c = hist[j..].iter().filter(|&&h| h == t).count() as f32;
        let x = &mut row[t as usize];
        *x = if *x <= 0.0 { *x * repeat } else { *x / repeat };
        *x -= c * frequency + presence;
    }
}

/// The sampler's parameters of one row (`params[r]` of [`Op::Sample`](crate::Op::Sample)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// `<= 0` (or `NaN`) draws nothing: the row's argmax.
    pub temperature: f32,
    /// Keep the `top_k` largest values (and any equal to the smallest of them); `<= 0` or
    /// `>= V` keeps all. Truncated toward zero.
    pub top_k: f32,
    /// Keep the smallest set of largest values whose softmax mass reaches `top_p` of the
    /// (top-k) total; `>= 1` keeps all, `<= 0` only the maximum.
    pub top_p: f32,
    /// Keep values whose probability is at least `min_p` times the largest one's; `<= 0`
    /// keeps all.
    pub min_p: f32,
}

impl SampleParams {
    /// From one row of the op's `params` source.
    pub fn from_row(p: &[f32]) -> Self {
        SampleParams {
            temperature: p[0],
            top_k: p[1],
            top_p: p[2],
            min_p: p[3],
        }
    }
}

/// The `k` of top-k for a row of `v` entries, or `None` when top-k keeps everything.
pub fn top_k_count(top_k: f32, v: usize) -> Option<usize> {
    // NaN and negatives truncate to 0 (`as` saturates), which keeps everything.
    let k = top_k as i64;
    (k >= 1 && (k as u64) < v as u64).then_some(k as usize)
}

/// [`Op::Sample`](crate::Op::Sample) on one row: the drawn index. `x` must not be empty.
pub fn sample_row(x: &[f32], p: SampleParams, seed: u32, counter: u32) -> usize {
    let key_max = x.iter().map(|&v| order_key(v)).max().unwrap_or(0);
    let m = f32::from_bits(if key_max & 0x8000_0000 != 0 {
        key_max & 0x7FFF_FFFF
    } else {
        !key_max
    });
    // No draw: greedy, or nothing finite to draw from (all NaN or -inf).
    if p.temperature.is_nan() || p.temperature <= 0.0 || key_max == 0 || m == f32::NEG_INFINITY {
        return argmax(x);
    }
    // Every cut is a key threshold; `1` admits every non-NaN value.
    let mut cut = 1u32;
    if let Some(k) = top_k_count(p.top_k, x.len()) {
        let mut keys: Vec<u32> = x.iter().map(|&v| order_key(v)).collect();
        let (_, kth, _) = keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        cut = cut.max(*kth);
    }
    if p.top_p < 1.0 {
        cut = cut.max(top_p_cut(x, cut, m, p.top_p));
    }
    if p.min_p > 0.0 {
        cut = cut.max(order_key(m + p.min_p.ln()));
    }
    // The maximum is always kept (min_p > 1 would otherwise cut above it).
    cut = cut.min(key_max);
    let mut best = (usize::MAX, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if order_key(v) < cut {
            continue;
        }
        let s = (v - m) / p.temperature + gumbel(uniform(seed, counter, i as u32));
        if best.0 == usize::MAX || s > best.1 {
            best = (i, s);
        }
    }
    // The maximum always passes every cut, so something was kept.
    best.0
}

/// The top-p threshold among values with key >= `cut`: the largest key whose group and every
/// larger one together hold at least `top_p` of the softmax mass (at most the maximum's key).
fn top_p_cut(x: &[f32], cut: u32, m: f32, top_p: f32) -> u32 {
    let mut kept: Vec<(u32, f32)> = x
        .iter()
        .filter(|&&v| order_key(v) >= cut)
        .map(|&v| (order_key(v), (v - m).exp()))
        .collect();
    let z: f32 = kept.iter().map(|e| e.1).sum();
    let target = top_p * z;
    kept.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
    let mut mass = 0.0f32;
    let mut i = 0;
    while i < kept.len() {
        let key = kept[i].0;
        while i < kept.len() && kept[i].0 == key {
            mass += kept[i].1;
            i += 1;
        }
        if mass >= target {
            return key;
        }
    }
    // Rounding left the whole mass short of a target near 1: keep everything.
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_random123_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn order_key_preserves_order_and_puts_nan_lowest() {
        let xs = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{w:?}");
        }
        assert_eq!(order_key(f32::NAN), 0);
        assert_eq!(order_key(-f32::NAN), 0);
        assert!(order_key(f32::NEG_INFINITY) > 0);
    }

    #[test]
    fn uniforms_are_inside_the_open_unit_interval_and_roughly_flat() {
        let n = 100_000;
        let mut buckets = [0u32; 10];
        for i in 0..n {
            let u = uniform(7, 3, i);
            assert!(u > 0.0 && u < 1.0);
            buckets[(u * 10.0) as usize] += 1;
        }
        for b in buckets {
            assert!((9_500..10_500).contains(&b), "{buckets:?}");
        }
    }

    #[test]
    fn penalties_follow_llama_cpp_and_skip_ids_outside_the_row() {
        let mut row = vec![2.0, -2.0, 1.0, 0.0];
        penalize_row(&mut row, &[0, 1, 1, -1, 9, 0, 0], 2.0, 0.5, 0.25);
        // id 0: 3 times, positive: 2/2 - 1.5 - 0.25; id 1: twice, negative: -2*2 - 1 - 0.25.
        assert_eq!(row, vec![-0.75, -5.25, 1.0, 0.0]);
    }

    #[test]
    fn zero_temperature_and_rows_without_numbers_are_the_argmax() {
        let p = SampleParams {
            temperature: 0.0,
            top_k: 0.0,
            top_p: 1.0,
            min_p: 0.0,
        };
        assert_eq!(sample_row(&[1.0, 3.0, 3.0, 2.0], p, 1, 1), 1);
        let hot = SampleParams {
            temperature: 1.0,
            ..p
        };
        assert_eq!(sample_row(&[f32::NAN, f32::NAN], hot, 1, 1), 0);
        assert_eq!(
            sample_row(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY], hot, 1, 1),
            1
        );
    }

    #[test]
    fn truncations_keep_what_they_promise() {
        let x: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let mut order: Vec<usize> = (0..x.len()).collect();
        order.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
        let p = SampleParams {
            temperature: 1.5,
            top_k: 3.0,
            top_p: 1.0,
            min_p: 0.0,
        };
        for seed in 0..200 {
            let t = sample_row(&x, p, seed, 0);
            assert!(order[..3].contains(&t));
        }
        // top_p 0 keeps only the maximum; min_p 1 as well.
        for (top_p, min_p) in [(0.0, 0.0), (1.0, 1.0)] {
            let q = SampleParams {
                temperature: 1.0,
                top_k: 0.0,
                top_p,
                min_p,
            };
            for seed in 0..50 {
                assert_eq!(sample_row(&x, q, seed, 9), order[0]);
            }
        }
    }

    #[test]
    fn the_top_uniform_bucket_stays_below_one() {
        // Under key (seed 5, counter 33670) element 428's Philox word has its top 24 bits set.
        let w = philox4x32_10([428, 33670, 0, 0], [5, 0])[0];
        assert_eq!(w >> 8, (1 << 24) - 1);
        let u = uniform(5, 33670, 428);
        assert_eq!(u, UNIFORM_MAX);
        assert!(gumbel(u).is_finite());
    }

    #[test]
    fn min_p_above_one_keeps_the_maximum() {
        let p = SampleParams {
            temperature: 1.0,
            top_k: 0.0,
            top_p: 1.0,
            min_p: 1.5,
        };
        assert_eq!(sample_row(&[1.0, 2.0, 3.0, 0.0, -1.0], p, 1, 2), 2);
    }

    #[test]
    fn nan_is_never_drawn() {
        let x = [f32::NAN, 0.0, f32::NAN, 0.0];
        let p = SampleParams {
            temperature: 100.0,
            top_k: 0.0,
            top_p: 1.0,
            min_p: 0.0,
        };
        for seed in 0..100 {
            let t = sample_row(&x, p, seed, 0);
            assert!(t == 1 || t == 3);
        }
    }
}
