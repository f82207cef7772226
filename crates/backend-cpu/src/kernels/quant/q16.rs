//! Fast products over quantized weights: activations quantized once per product to 16-bit
//! integer blocks, integer dot products per weight block with SIMD.
//!
//! Why: a decode step streams every weight once; dequantizing each value to f32 and
//! multiplying costs several instructions per weight, while integer dot products over the
//! weights' small integers (`pmaddwd`) do 16 weights an instruction, so the product runs near
//! memory speed. llama.cpp quantizes activations to 8 bits for `pmaddubsw`; measured here, that
//! moves SmolLM2-135M's logits by 4-6% of their range and derails its greedy chat answer, so
//! lowsync keeps 16 bits: the same structure at about 1.4x the instructions of the 8-bit
//! kernels, and logits within 1e-3 of the f32 path. (Prefill products take 8-bit blocks,
//! `super::q8`, where `LOWSYNC_CPU_PREFILL_ACT` allows: over packed Q4_0, Q4_K and Q6_K weights
//! with AVX-512 VNNI, and in place over all five types with AVX2 (`super::q8::avx2`), which
//! decode products take too with `LOWSYNC_CPU_DECODE_ACT=q8`. So on CPUs without AVX-512 VNNI
//! the bodies here serve the decode of weights read in place, and their prefill only with
//! `LOWSYNC_CPU_PREFILL_ACT=q16`.)
//!
//! Strategy: each activation row is split into blocks of 32 with an f32 scale `d = max|x| /
//! 32767`, 16-bit values `q = round(x / d)` and `s = d * sum(q)` (for the weight types with a
//! min). A weight block's contribution is then `d_w * d_x * sum(q_w * q_x)` (plus `m_w * s_x` for
//! types with a min), the integer sum exact. A kernel takes a job's weight rows and all activation
//! rows in tiles of a few weight rows by a few activation rows, each pair's accumulator in a
//! register: a decode product (one activation row) runs 4 weight rows at once for Q4_0, Q4_1 and
//! Q4_K, so independent FMA chains hide each other's latency (one chain left a decode step waiting
//! on it: 1.3-1.7x slower per block from cache), with a software prefetch per row (the hardware
//! prefetcher did not follow 4 side-by-side rows from DRAM: 1.4-6x slower without it). Those
//! decode tiles reduce the 4 rows' integer sums of a block together (`phaddd`) and scale them with
//! one 4-lane FMA, the 4 rows' f16 scales converted by one instruction; Q4_0's -8 offset is taken
//! off the 4 sums at once as 8 times the activation block's integer sum `n`, which the activation
//! rows carry. Q8_0 and Q6_K decode one row at a time (their 4-row tiles lost from DRAM even with
//! the prefetch). A prefill product unpacks each weight block once per 4-8 activation rows; there
//! Q6_K's 8-bit sub-block scales are multiplied into its weights as i16, so each activation block
//! takes one integer sum and one FMA. Kernels exist for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K with AVX2
//! (+FMA, F16C), chosen at run time, and with NEON on aarch64 (`neon`: tiles of up to 4 weight
//! rows by 2 activation rows, `smull`/`smlal` into i32 lanes); other types, other CPUs and
//! `LOWSYNC_CPU_QUANT_DOT=f32` use the exact path of `super` (f32 activations against the
//! scalar dequantization). Where the CPU also has AVX-512 F/BW/VL and VNNI, the bodies of
//! `avx512` take over for those five types (`LOWSYNC_CPU_QUANT_ISA=avx2` keeps the AVX2 ones,
//! for A/B measurements): products of 6 or more activation rows (prefill) run over weight
//! panels of 16 rows unpacked once per product with `vpdpwssd` (3-10x the AVX2 tiles per block
//! and activation row), and Q4_1 decodes 8 rows a tile; the other decode products keep the AVX2
//! tiles, which the AVX-512 variants did not beat from DRAM. Weights in weight memory do not
//! reach these bodies at all, with AVX-512 or AVX2: `super::packed` runs them over a packed copy
//! (`LOWSYNC_CPU_PACK`); the bodies here serve the rest (weights that are not weight memory,
//! `LOWSYNC_CPU_PACK=off`).
//!
//! Determinism: the integer sums are exact and each output is one fixed-order sum over its blocks.
//! Tiles of several pairs keep one chain per pair and give the same bits as each other, except the
//! 4-row decode tiles of Q4_0, Q4_1 and Q4_K: they add each block's whole integer sum, scaled, in
//! block order (the other tiles add 8 lanes of partial sums each and the lanes at the end), and
//! add the mins of Q4_1 and Q4_K in a chain of their own. A lone pair (one weight row by one
//! activation row) adds its even and odd blocks in two chains, so its bits can differ from the
//! same pair in a larger tile. Which tile computes an output depends only on the product's shape
//! and the output's position, never on the thread count, so results do not depend on the thread
//! count. The AVX-512 bodies compute every output in the order of the AVX2 4-row decode tiles
//! (each block's exact integer sum, scaled, added in block order; Q6_K per sub-block of 16),
//! whatever their tile: there a Q4_0, Q4_1 or Q4_K row gives the same bits in prefill and in
//! decode, and the bits differ from the AVX2 prefill tiles' (within f32 rounding). The NEON
//! bodies do the same for all five types (Q6_K per sub-block of 16), whatever their tile.

use lowsync_graph::DType;

/// Elements per activation block.
pub(crate) const QK: usize = 32;

/// Activation rows quantized to 16-bit blocks: `d[b]`, `s[b]`, the integer sum `n[b]` of the
/// block's values and the 32 values of block `b` at `q[32 * b..]`, for every block of every
/// row (row `i` starts at block `i * k / 32`).
pub(crate) struct QRows {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub n: Vec<i32>,
    pub q: Vec<i16>,
}

impl QRows {
    /// Quantizes `x` (rows of `k` elements, `k` a multiple of 32): with AVX2 where the CPU
    /// has it (bit-identical to the scalar code: a decode step quantizes ~100k values, and the
    /// scalar loop's `round` calls were ~7% of it), else scalar.
    pub(crate) fn quantize(x: &[f32]) -> QRows {
        let nb = x.len() / QK;
        let mut out = QRows {
            d: vec![0.0; nb],
            s: vec![0.0; nb],
            n: vec![0; nb],
            q: vec![0; nb * QK],
        };
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let q: &mut [i16; QK] = (&mut out.q[b * QK..(b + 1) * QK])
                .try_into()
                .expect("a block of 32");
            let blk: &[f32; QK] = blk.try_into().expect("a block of 32");
            let (d, n) = quantize_any(blk, q);
            // |n| < 2^20: exact in f32.
            (out.d[b], out.s[b], out.n[b]) = (d, d * n as f32, n);
        }
        out
    }
}

/// A tile's activations: `d`, `s`, `n` and `q` of its rows of `nb` blocks each (rows of a
/// [`QRows`], as [`QRows::act`] slices them).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(super) struct Act<'a> {
    pub d: &'a [f32],
    pub s: &'a [f32],
    pub n: &'a [i32],
    pub q: &'a [i16],
    pub nb: usize,
}

#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
impl QRows {
    /// Activation rows `r0..r0 + rn`, of `nb` blocks each.
    pub(super) fn act(&self, r0: usize, rn: usize, nb: usize) -> Act<'_> {
        let (lo, hi) = (r0 * nb, (r0 + rn) * nb);
        Act {
            d: &self.d[lo..hi],
            s: &self.s[lo..hi],
            n: &self.n[lo..hi],
            q: &self.q[lo * QK..hi * QK],
            nb,
        }
    }
}

/// Checks a product's shapes for weights of `bb`-byte blocks each covering `per` activation
/// blocks (`w` rows of `row_bytes`, `out` rows by activation rows, `x` blocks that match) and
/// returns `(m, nb)`: activation rows and blocks per row; `None` on any mismatch (no rows
/// included).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(super) fn tile_shape(
    w: &[u8],
    row_bytes: usize,
    bb: usize,
    per: usize,
    x: &QRows,
    out: &[f32],
) -> Option<(usize, usize)> {
    let rows = w.len().checked_div(row_bytes)?;
    let m = out.len().checked_div(rows)?;
    let nb = row_bytes / bb * per;
    let ok = rows * row_bytes == w.len()
        && rows * m == out.len()
        && row_bytes.is_multiple_of(bb)
        && x.d.len() == nb * m
        && x.s.len() == x.d.len()
        && x.n.len() == x.d.len()
        && x.q.len() == x.d.len() * QK;
    ok.then_some((m, nb))
}

/// One block of 32 with AVX2 where the CPU has it, else scalar: its `q`, and `(d, sum(q))`.
fn quantize_any(blk: &[f32; QK], q: &mut [i16; QK]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected.
            return unsafe { x86::quantize_block(blk, q) };
        }
    }
    quantize_block(blk, q)
}

/// One block of 32: its `q`, and `(d, sum(q))`.
fn quantize_block(blk: &[f32; QK], out: &mut [i16; QK]) -> (f32, i32) {
    let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 32767.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in out.iter_mut().zip(blk) {
        // |v * id| <= 32767 up to rounding; NaN becomes 0 (`as` saturates).
        *q = (v * id).round().clamp(-32767.0, 32767.0) as i16;
        sum += i32::from(*q);
    }
    (d, sum)
}

/// Dot products of weight rows (raw blocks, `row_bytes` each, back to back) with `m`
/// quantized activation rows, `m = out.len() / rows`: activation row `i`'s blocks are
/// `d[i * nb..]`, `s[i * nb..]`, `n[i * nb..]` and `q[32 * i * nb..]`, `nb` blocks of 32 per row;
/// `out[i * rows + r]` receives weight row `r` times activation row `i` (activation row by
/// activation row, so that a job's results for one activation row are one contiguous run of
/// the product's output row). One call serves a job's run of weight rows, so a short row (a
/// 576-wide weight has 18 blocks) pays no per-row call.
pub(crate) type DotFn = fn(&[u8], usize, &QRows, &mut [f32]);

/// The instruction sets a product may use: [`Isa::Avx512`] where the CPU has it and
/// `LOWSYNC_CPU_QUANT_ISA` is not `avx2`, else [`Isa::Avx2`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// The AVX2 bodies (`x86`) only.
    Avx2,
    /// The AVX-512 VNNI bodies (`avx512`) where they exist, the AVX2 ones elsewhere.
    Avx512,
}

/// Whether this CPU has what the AVX-512 bodies need: AVX-512 F, BW, VL and VNNI.
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The fast dot product for weights of `dt` on this CPU, if there is one, using at most `isa`.
pub(crate) fn dot_fn(dt: DType, isa: Isa) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            if isa == Isa::Avx512 && has_avx512() {
                if let Some(f) = avx512::dot_fn(dt) {
                    return Some(f);
                }
            }
            return x86::dot_fn(dt);
        }
    }
    // NEON is baseline on aarch64: no detection, and no wider bodies for `isa` to pick.
    #[cfg(target_arch = "aarch64")]
    {
        let _ = isa;
        neon::dot_fn(dt)
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        let _ = (dt, isa);
        None
    }
}

/// Products with at least this many activation rows (a prefill) run over packed panels with
/// AVX-512, and over packed groups with 8-bit activations where `LOWSYNC_CPU_PREFILL_ACT` allows;
/// fewer take the AVX2 bodies (decode). Measured against them (`few_rows_speed`, k 2048, Q4_0 /
/// Q4_1 / Q4_K, weights in the cache and in DRAM): 0.34-1.01x with 2 rows, 0.85-1.56x with 3,
/// 0.84-1.32x with 4 and 1.14-1.92x with 6.
pub(crate) const PANEL_MIN_ROWS: usize = 6;

/// The weight rows a product's jobs should come in multiples of, with `m` activation rows:
/// the AVX-512 bodies' panels of 16 where they run, else the decode tiles' 4.
pub(crate) fn row_granule(isa: Isa, m: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 && has_avx512() && m >= PANEL_MIN_ROWS {
            return 16;
        }
    }
    let _ = (isa, m);
    4
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! AVX2 kernels. Each wrapper checks lengths (a mismatch writes zeros and asserts in
    //! debug) and calls its `#[target_feature]` body, which `dot_fn` selects only after
    //! detecting AVX2, FMA and F16C. A body serves a tile of `W` weight rows (4, 2 or 1) by `R`
    //! activation rows (8, 4, 2 or 1): per block, each of the `W` weight blocks is unpacked
    //! once to two vectors of 16 i16 (elements 0..16 and 16..32) and each of the `R`
    //! activation blocks loaded once, then per pair two `pmaddwd` and one FMA per scale into
    //! the pair's own accumulator. The decode tiles of 4 weight rows of Q4_0, Q4_1 and Q4_K
    //! have bodies of their own (`*_dec4`), which scale the 4 rows' sums of a block at once.

    use std::arch::x86_64::*;

    use lowsync_graph::DType;

    use super::{Act, DotFn, QRows, QK};

    /// `super::quantize_block` with AVX2, bit for bit (see [`round_block`]).
    ///
    /// # Safety
    /// AVX2 is available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(blk: &[f32; QK], out: &mut [i16; QK]) -> (f32, i32) {
        let (d, qi) = round_block(blk, 32767.0);
        // Pack to i16 (in range, no saturation); packs works per 128-bit lane, so restore the
        // element order with a 64-bit permute.
        let a = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0b11_01_10_00);
        let b = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0b11_01_10_00);
        _mm256_storeu_si256(out.as_mut_ptr().cast(), a);
        _mm256_storeu_si256(out.as_mut_ptr().add(16).cast(), b);
        let sum = _mm256_add_epi32(
            _mm256_add_epi32(qi[0], qi[1]),
            _mm256_add_epi32(qi[2], qi[3]),
        );
        (d, hsum_i32(sum))
    }

    /// The shared step of the AVX2 activation quantizers (16-bit here, 8-bit in
    /// `quant::q8::avx2`), bit for bit the scalar ones with `limit` 32767 or 127: `d = amax /
    /// limit` with the same max (NaN ignored), the same `v * id` products, rounding half away
    /// from zero (truncate, then step away from zero where the dropped part is at least one
    /// half; exact below 2^23), the same clamp to `±limit`, NaN to 0. Returns `d` and the 32
    /// integers as four vectors of 8 i32 in element order.
    ///
    /// # Safety
    /// AVX2 is available.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels::quant) unsafe fn round_block(
        blk: &[f32; QK],
        limit: f32,
    ) -> (f32, [__m256i; 4]) {
        let p = blk.as_ptr();
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let mut m = _mm256_setzero_ps();
        for c in 0..4 {
            // `max(a, b)` returns `b` when `a` is NaN: NaN lanes are skipped, as `f32::max` does.
            m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(p.add(8 * c)), abs_mask), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let d = amax / limit;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let (lo, hi) = (_mm256_set1_ps(-limit), _mm256_set1_ps(limit));
        let mut qi = [_mm256_setzero_si256(); 4];
        for (c, qi) in qi.iter_mut().enumerate() {
            let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(8 * c)), idv);
            let t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let frac = _mm256_and_ps(_mm256_sub_ps(v, t), abs_mask);
            let step = _mm256_or_ps(_mm256_and_ps(v, sign), one);
            let r = _mm256_add_ps(
                t,
                _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), step),
            );
            // Clamp (the scalar clamp keeps NaN; the cast to an integer then makes it 0): NaN
            // lanes zeroed.
            let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            let r = _mm256_and_ps(r, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
            *qi = _mm256_cvttps_epi32(r);
        }
        (d, qi)
    }

    /// The sum of the 8 i32 lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels::quant) unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
        _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b10_11_00_01)))
    }

    pub(super) fn dot_fn(dt: DType) -> Option<DotFn> {
        Some(match dt {
            DType::Q4_0 => q4_0,
            DType::Q4_1 => q4_1,
            DType::Q8_0 => q8_0,
            DType::Q4_K => q4_k,
            DType::Q6_K => q6_k,
            _ => return None,
        })
    }

    /// Activation blocks per row when a weight row of `bb`-byte blocks, each covering `per`
    /// activation blocks, meets `rows` activation rows; `None` on any mismatch.
    fn blocks_per_row(w: &[u8], bb: usize, per: usize, x: &QRows, rows: usize) -> Option<usize> {
        let nb = w.len() / bb * per;
        let d = &x.d;
        let ok = w.len().is_multiple_of(bb)
            && d.len() == nb * rows
            && x.s.len() == d.len()
            && x.n.len() == d.len()
            && x.q.len() == d.len() * QK;
        debug_assert!(
            ok,
            "weight row {} bytes, {} activation blocks",
            w.len(),
            d.len()
        );
        ok.then_some(nb)
    }

    /// Calls `$body::<W, R>` over tiles of `W` weight rows by `R` activation rows, each tile's
    /// accumulators in registers. A decode product (one activation row) takes its weight rows
    /// `$decode_w` (4 or 1) at a time: independent accumulator chains (one chain waited on
    /// each FMA's latency) and each activation block loaded once for all of them. A product of
    /// more rows takes `$prefill_w` weight rows: 2 by up to 4 activation rows (each unpacked
    /// weight block serves 4 rows, each activation block 2 weight rows), or 1 by up to 8 for
    /// the K types, whose unpacking needs more registers (two weight rows spilled, measured
    /// slower). Leftovers go in smaller tiles. The tile of an output depends only on `rows`,
    /// `m` and its position (see `Acc` for the one tile whose sum is ordered differently).
    macro_rules! wrapper {
        ($name:ident, $body:ident, $dec4:expr, $bb:expr, $per:expr, $decode_w:expr, $prefill_w:expr) => {
            fn $name(w: &[u8], row_bytes: usize, x: &QRows, out: &mut [f32]) {
                let rows = w.len().checked_div(row_bytes).unwrap_or(0);
                let m = out.len().checked_div(rows).unwrap_or(0);
                let ok = rows * row_bytes == w.len() && rows * m == out.len();
                let nb = w
                    .get(..row_bytes)
                    .filter(|_| ok)
                    .and_then(|w0| blocks_per_row(w0, $bb, $per, x, m));
                let Some(nb) = nb else {
                    debug_assert!(false, "{} weight bytes, {row_bytes} a row", w.len());
                    out.fill(0.0);
                    return;
                };
                let mut j = 0;
                while j < rows {
                    let wn = match (rows - j, m) {
                        (4.., 1) if $decode_w == 4 => 4,
                        (2.., 1) if $decode_w >= 2 => 2,
                        (2.., 2..) if $prefill_w >= 2 => 2,
                        _ => 1,
                    };
                    let wt = &w[j * row_bytes..(j + wn) * row_bytes];
                    let mut r0 = 0;
                    while r0 < m {
                        let rn = match (wn, m - r0) {
                            (1, 8..) => 8,
                            (_, 4..) => 4,
                            (_, 2 | 3) => 2,
                            _ => 1,
                        };
                        let act = x.act(r0, rn, nb);
                        let at = (j, rows, r0);
                        // SAFETY: `dot_fn` hands these out only after detecting AVX2, FMA and
                        // F16C; `wt` holds `wn` rows of `nb` activation blocks' weight blocks
                        // and `act` `rn` rows of `nb` blocks, so every load is in bounds.
                        unsafe {
                            match (wn, rn) {
                                (4, _) => store(&$dec4(wt, row_bytes, &act), out, at),
                                (2, 4) => store(&$body::<2, 4>(wt, row_bytes, &act), out, at),
                                (2, 2) => store(&$body::<2, 2>(wt, row_bytes, &act), out, at),
                                (2, _) => store(&$body::<2, 1>(wt, row_bytes, &act), out, at),
                                (_, 8) => store(&$body::<1, 8>(wt, row_bytes, &act), out, at),
                                (_, 4) => store(&$body::<1, 4>(wt, row_bytes, &act), out, at),
                                (_, 2) => store(&$body::<1, 2>(wt, row_bytes, &act), out, at),
                                _ => store(&$body::<1, 1>(wt, row_bytes, &act), out, at),
                            }
                        }
                        r0 += rn;
                    }
                    j += wn;
                }
            }
        };
    }
    wrapper!(q4_0, q4_0_avx2, q4_0_dec4, 18, 1, 4, 2);
    wrapper!(q4_1, q4_1_avx2, q4_1_dec4, 20, 1, 4, 2);
    wrapper!(q8_0, q8_0_avx2, q8_0_avx2::<4, 1>, 34, 1, 1, 2);
    wrapper!(q4_k, q4_k_avx2, q4_k_dec4, 144, 8, 4, 1);
    wrapper!(q6_k, q6_k_avx2, q6_k_avx2::<4, 1>, 210, 8, 1, 1);

    /// Writes a tile's results: weight row `j + r` times activation row `r0 + i` to
    /// `out[(r0 + i) * rows + j + r]`.
    #[inline(always)]
    fn store<const W: usize, const R: usize>(
        t: &[[f32; R]; W],
        out: &mut [f32],
        (j, rows, r0): (usize, usize, usize),
    ) {
        for (r, row) in t.iter().enumerate() {
            for (i, &v) in row.iter().enumerate() {
                out[(r0 + i) * rows + j + r] = v;
            }
        }
    }

    /// The little-endian f16 at `p` as f32.
    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// The sum of the 8 lanes, in a fixed order.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The 32 nibbles of 16 bytes as i16: low nibbles (elements 0..16), high nibbles (16..32).
    /// The bytes are widened first (one load-and-widen), then one `and` gives the low half and
    /// an `andnot` and a shift the high one. `m` is [`nibble_mask`]: opaque to the compiler,
    /// which otherwise rewrote the 16-bit `and` and shift as 8-bit work before two widenings
    /// (six instructions instead of four per weight block and row).
    #[inline(always)]
    unsafe fn nibbles16(p: *const u8, m: __m256i) -> (__m256i, __m256i) {
        let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast()));
        (
            _mm256_and_si256(v, m),
            _mm256_srli_epi16(_mm256_andnot_si256(m, v), 4),
        )
    }

    /// `0x000F` in every 16-bit lane, hidden from the optimiser (see [`nibbles16`]); taken once
    /// per kernel call, before its loops.
    #[inline(always)]
    unsafe fn nibble_mask() -> __m256i {
        std::hint::black_box(_mm256_set1_epi16(0x0F))
    }

    /// The low (`high` false) or high nibbles of the 32 bytes at `p`, in byte order, as two
    /// vectors of 16 i16 (Q4_K's sub-blocks); `m` is [`nibble_mask`], as in [`nibbles16`].
    #[inline(always)]
    unsafe fn nibbles32(p: *const u8, high: bool, m: __m256i) -> (__m256i, __m256i) {
        let v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast()));
        let v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(16).cast()));
        if high {
            (
                _mm256_srli_epi16(_mm256_andnot_si256(m, v0), 4),
                _mm256_srli_epi16(_mm256_andnot_si256(m, v1), 4),
            )
        } else {
            (_mm256_and_si256(v0, m), _mm256_and_si256(v1, m))
        }
    }

    /// 32 bytes (0..=255) in element order as two vectors of 16 i16.
    #[inline(always)]
    unsafe fn widen_u8(v: __m256i) -> (__m256i, __m256i) {
        (
            _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)),
            _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)),
        )
    }

    // The helpers below carry no `target_feature` of their own: they are always inlined into
    // a body that enables AVX2, FMA and F16C, so their intrinsics and accumulators live in
    // that body's registers (an out-of-line call kept the accumulators in memory).

    /// Elements 0..16 and 16..32 of activation block `b` of group row `i`.
    #[inline(always)]
    unsafe fn x_block(a: &Act<'_>, i: usize, b: usize) -> (__m256i, __m256i) {
        let p = a.q.as_ptr().add((i * a.nb + b) * QK);
        (
            _mm256_loadu_si256(p.cast()),
            _mm256_loadu_si256(p.add(16).cast()),
        )
    }

    /// A tile's accumulators: one chain of FMAs per (weight row, activation row) pair, except
    /// in a lone pair (`W == R == 1`: Q8_0 and Q6_K decoding one row at a time, and leftover
    /// tiles), whose even and odd blocks go to two chains added at the end. With one chain
    /// every block waited on the previous block's FMA (about 4 cycles): Q8_0 decoded at
    /// 2.4 ns a block, with two chains at 1.6 (a 4-row Q4_0 tile: 1.4); Q6_K's unpacking, not
    /// the chain, bounds it (2.1 either way). Which chain a block takes depends only on its
    /// index, so results stay deterministic.
    struct Acc<const W: usize, const R: usize> {
        c: [[[__m256; R]; W]; 2],
    }

    impl<const W: usize, const R: usize> Acc<W, R> {
        const SPLIT: bool = W == 1 && R == 1;

        #[inline(always)]
        unsafe fn new() -> Self {
            Acc {
                c: [[[_mm256_setzero_ps(); R]; W]; 2],
            }
        }

        /// The chain that block `b` adds to.
        #[inline(always)]
        fn chain(&mut self, b: usize) -> &mut [[__m256; R]; W] {
            &mut self.c[if Self::SPLIT { b & 1 } else { 0 }]
        }

        /// Each pair's sum of its chains.
        #[inline(always)]
        unsafe fn merged(&self) -> [[__m256; R]; W] {
            let mut out = self.c[0];
            if Self::SPLIT {
                for (o, c) in out.iter_mut().zip(&self.c[1]) {
                    for (o, c) in o.iter_mut().zip(c) {
                        *o = _mm256_add_ps(*o, *c);
                    }
                }
            }
            out
        }
    }

    /// `acc[r][i] += f[r] * d_x * sum(w[r] * x_i)` over one block for every weight row `r` and
    /// activation row `i` of the tile; each activation block is loaded once for all `W` rows.
    // Index loops: each pair `(r, i)` addresses two arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn tile_fma<const W: usize, const R: usize>(
        acc: &mut [[__m256; R]; W],
        w: &[(__m256i, __m256i); W],
        f: &[f32; W],
        a: &Act<'_>,
        b: usize,
    ) {
        for i in 0..R {
            let (x0, x1) = x_block(a, i, b);
            let dx = a.d[i * a.nb + b];
            for r in 0..W {
                let p =
                    _mm256_add_epi32(_mm256_madd_epi16(w[r].0, x0), _mm256_madd_epi16(w[r].1, x1));
                let scale = _mm256_set1_ps(f[r] * dx);
                acc[r][i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc[r][i]);
            }
        }
    }

    /// `tile_fma` with scale `f[r].0` for elements 0..16 and `f[r].1` for 16..32 (Q6_K's
    /// halves).
    // Index loops: each pair `(r, i)` addresses two arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn tile_fma2<const W: usize, const R: usize>(
        acc: &mut [[__m256; R]; W],
        w: &[(__m256i, __m256i); W],
        f: &[(f32, f32); W],
        a: &Act<'_>,
        b: usize,
    ) {
        for i in 0..R {
            let (x0, x1) = x_block(a, i, b);
            let dx = a.d[i * a.nb + b];
            for r in 0..W {
                let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w[r].0, x0));
                let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w[r].1, x1));
                acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(f[r].0 * dx), p0, acc[r][i]);
                acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(f[r].1 * dx), p1, acc[r][i]);
            }
        }
    }

    /// `mins[r][i] += m[r] * s_x` for every pair of the tile (types with a min).
    // Index loops: each pair `(r, i)` addresses two arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    fn tile_min<const W: usize, const R: usize>(
        mins: &mut [[f32; R]; W],
        m: &[f32; W],
        a: &Act<'_>,
        b: usize,
    ) {
        for i in 0..R {
            let s = a.s[i * a.nb + b];
            for r in 0..W {
                mins[r][i] += m[r] * s;
            }
        }
    }

    /// The tile's sums (`hsum` of each accumulator) plus `sign` times its mins.
    #[inline(always)]
    unsafe fn tile_out<const W: usize, const R: usize>(
        acc: &[[__m256; R]; W],
        mins: Option<(&[[f32; R]; W], f32)>,
    ) -> [[f32; R]; W] {
        let mut out = [[0.0f32; R]; W];
        for r in 0..W {
            for i in 0..R {
                out[r][i] = match mins {
                    Some((mn, sign)) => hsum(acc[r][i]) + sign * mn[r][i],
                    None => hsum(acc[r][i]),
                };
            }
        }
        out
    }

    /// Weight row `r`'s block `b` (`bb` bytes a block, rows `rb` bytes apart).
    #[inline(always)]
    unsafe fn block_at(w: &[u8], rb: usize, r: usize, bb: usize, b: usize) -> *const u8 {
        w.as_ptr().add(r * rb + b * bb)
    }

    /// How far ahead of the block being read each weight row is prefetched (bytes).
    const PREFETCH_AHEAD: usize = 512;

    /// Prefetches what each of the tile's `W` weight rows will read [`PREFETCH_AHEAD`] bytes
    /// from block `b`. A tile reads `W` rows `rb` bytes apart side by side, streams that the
    /// hardware prefetcher did not follow: with weights in DRAM (not the cache), 4 rows at once
    /// ran 1.4-6x slower per block than one row, and with this as fast as one row or faster.
    /// A prefetch past the weights is harmless (it never faults). A lone row is one stream the
    /// hardware follows by itself: no prefetch there (it only cost time).
    /// How far ahead the 4-row decode tiles prefetch (bytes).
    pub(in crate::kernels::quant) const PREFETCH_FAR: usize = 4096;

    /// [`prefetch_rows`] for the 4-row decode tiles: [`PREFETCH_FAR`] bytes ahead, into the
    /// L2 (`T1`). Those tiles read a block in fewer instructions, so 512 bytes ahead no longer
    /// covered the DRAM latency: from DRAM they ran 0.4-0.7x as fast as with 4096 (k 768 and
    /// 2048). Into the L1 (`T0`) as far ahead, Q4_0 and Q4_K rows of 2048 ran up to 1.8x slower
    /// from the cache than with `T1` (the lines waited in the L1 and evicted each other).
    #[inline(always)]
    unsafe fn prefetch_far(w: &[u8], rb: usize, bb: usize, b: usize) {
        for r in 0..4 {
            let p = w.as_ptr().wrapping_add(r * rb + b * bb + PREFETCH_FAR);
            _mm_prefetch::<_MM_HINT_T1>(p.cast());
        }
    }

    #[inline(always)]
    unsafe fn prefetch_rows<const W: usize>(w: &[u8], rb: usize, bb: usize, b: usize) {
        if W < 2 {
            return;
        }
        for r in 0..W {
            let p = w.as_ptr().wrapping_add(r * rb + b * bb + PREFETCH_AHEAD);
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0_avx2<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [[f32; R]; W] {
        let mut acc = Acc::<W, R>::new();
        let eight = _mm256_set1_epi16(8);
        let m4 = nibble_mask();
        for b in 0..a.nb {
            prefetch_rows::<W>(w, rb, 18, b);
            let (mut qw, mut f) = (
                [(_mm256_setzero_si256(), _mm256_setzero_si256()); W],
                [0.0f32; W],
            );
            for r in 0..W {
                let p = block_at(w, rb, r, 18, b);
                let (lo, hi) = nibbles16(p.add(2), m4);
                qw[r] = (_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight));
                f[r] = f16_at(p);
            }
            tile_fma(acc.chain(b), &qw, &f, a, b);
        }
        tile_out(&acc.merged(), None)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_avx2<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [[f32; R]; W] {
        let mut acc = Acc::<W, R>::new();
        let mut mins = [[0.0f32; R]; W];
        let m4 = nibble_mask();
        for b in 0..a.nb {
            prefetch_rows::<W>(w, rb, 20, b);
            let (mut qw, mut f, mut mn) = (
                [(_mm256_setzero_si256(), _mm256_setzero_si256()); W],
                [0.0f32; W],
                [0.0f32; W],
            );
            for r in 0..W {
                let p = block_at(w, rb, r, 20, b);
                qw[r] = nibbles16(p.add(4), m4);
                f[r] = f16_at(p);
                mn[r] = f16_at(p.add(2));
            }
            tile_fma(acc.chain(b), &qw, &f, a, b);
            tile_min(&mut mins, &mn, a, b);
        }
        tile_out(&acc.merged(), Some((&mins, 1.0)))
    }

    /// The four row sums of `p` (each the sum of its 8 lanes), in lanes 0..4: three `phaddd`
    /// and one add for four rows instead of a scale broadcast, a conversion and an FMA per row
    /// and block.
    #[inline(always)]
    pub(in crate::kernels::quant) unsafe fn sum4(p: &[__m256i; 4]) -> __m128i {
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
    }

    /// The little-endian u16 at `p`, as i32.
    #[inline(always)]
    pub(in crate::kernels::quant) unsafe fn u16_at(p: *const u8) -> i32 {
        i32::from(u16::from_le_bytes([*p, *p.add(1)]))
    }

    /// The little-endian u32 at `p`, as i32 bits.
    #[inline(always)]
    unsafe fn u32_at(p: *const u8) -> i32 {
        i32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)])
    }

    /// The f16 at byte `o` of block `b` of each of the tile's 4 weight rows, as 4 f32: one
    /// conversion for the 4 rows.
    #[inline(always)]
    unsafe fn f16x4(w: &[u8], rb: usize, bb: usize, b: usize, o: usize) -> __m128 {
        let at = |r| u16_at(block_at(w, rb, r, bb, b).add(o));
        let v = _mm_cvtsi32_si128(at(0) | (at(1) << 16));
        _mm_cvtph_ps(_mm_insert_epi32::<1>(v, at(2) | (at(3) << 16)))
    }

    /// The tile's 4 results from a 4-lane accumulator.
    #[inline(always)]
    unsafe fn out4(acc: __m128) -> [[f32; 1]; 4] {
        let mut o = [0.0f32; 4];
        _mm_storeu_ps(o.as_mut_ptr(), acc);
        o.map(|v| [v])
    }

    /// Q4_0, a decode tile of 4 weight rows by one activation row. Per block the 4 rows'
    /// integer sums `sum(q_w * q_x)` (nibbles 0..15, without the -8 offset) are reduced
    /// together by [`sum4`], the offset taken off all 4 at once as `8 * n_x` (the activation
    /// block's integer sum), and the 4 scales converted by one `vcvtph2ps`: one FMA per block
    /// for the 4 rows. Each row's per-block sum is exact (|sum| <= 8 * 32767 * 32 < 2^24), so a
    /// row's result is the sum over blocks of `(d_w * d_x) * sum`, in block order.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0_dec4(w: &[u8], rb: usize, a: &Act<'_>) -> [[f32; 1]; 4] {
        let m4 = nibble_mask();
        let mut acc = _mm_setzero_ps();
        for b in 0..a.nb {
            prefetch_far(w, rb, 18, b);
            let (x0, x1) = x_block(a, 0, b);
            let mut p = [_mm256_setzero_si256(); 4];
            for (r, p) in p.iter_mut().enumerate() {
                let (lo, hi) = nibbles16(block_at(w, rb, r, 18, b).add(2), m4);
                *p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
            }
            let sum = _mm_sub_epi32(sum4(&p), _mm_set1_epi32(8 * a.n[b]));
            let scale = _mm_mul_ps(f16x4(w, rb, 18, b, 0), _mm_set1_ps(a.d[b]));
            acc = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(sum), acc);
        }
        out4(acc)
    }

    /// Q4_1, a decode tile of 4 weight rows by one activation row: as [`q4_0_dec4`] (no
    /// offset), the 4 rows' `d` and `m` converted by one `vcvtph2ps` of 8 halves, and the mins
    /// `m_w * s_x` in a second 4-lane FMA chain added at the end.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_dec4(w: &[u8], rb: usize, a: &Act<'_>) -> [[f32; 1]; 4] {
        let m4 = nibble_mask();
        let (mut acc, mut mins) = (_mm_setzero_ps(), _mm_setzero_ps());
        // d0 m0 d1 m1 .. -> d0 d1 d2 d3 m0 m1 m2 m3.
        let split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        for b in 0..a.nb {
            prefetch_far(w, rb, 20, b);
            let (x0, x1) = x_block(a, 0, b);
            let mut p = [_mm256_setzero_si256(); 4];
            for (r, p) in p.iter_mut().enumerate() {
                let (lo, hi) = nibbles16(block_at(w, rb, r, 20, b).add(4), m4);
                *p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
            }
            let at = |r| u32_at(block_at(w, rb, r, 20, b));
            let dm = _mm_insert_epi32::<1>(_mm_cvtsi32_si128(at(0)), at(1));
            let dm = _mm_insert_epi32::<3>(_mm_insert_epi32::<2>(dm, at(2)), at(3));
            let dm = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(dm), split);
            let scale = _mm_mul_ps(_mm256_castps256_ps128(dm), _mm_set1_ps(a.d[b]));
            acc = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(sum4(&p)), acc);
            mins = _mm_fmadd_ps(_mm256_extractf128_ps(dm, 1), _mm_set1_ps(a.s[b]), mins);
        }
        out4(_mm_add_ps(acc, mins))
    }

    /// A Q4_K super-block's 8 sub-block scales times `d` and 8 mins times `dmin` (the values
    /// of `scalar::k_scale_min`, bit for bit), decoded from the 12 packed bytes with 32-bit
    /// integer masks and shifts (4 sub-blocks a word) and converted 8 at a time.
    #[inline(always)]
    pub(in crate::kernels::quant) unsafe fn k_scales8(p: *const u8) -> (__m256, __m256) {
        let (a, b, c) = (
            u32_at(p.add(4)) as u32,
            u32_at(p.add(8)) as u32,
            u32_at(p.add(12)) as u32,
        );
        // Sub-blocks 0..4: the low 6 bits of bytes 0..4 (scales) and 4..8 (mins). 4..8: the
        // nibbles of bytes 8..12 below the top 2 bits of bytes 0..4 (scales) and 4..8 (mins).
        let (lo6, lo4, lo2) = (0x3F3F_3F3F, 0x0F0F_0F0F, 0x0303_0303);
        let sc_hi = (c & lo4) | (((a >> 6) & lo2) << 4);
        let mn_hi = ((c >> 4) & lo4) | (((b >> 6) & lo2) << 4);
        let widen = |lo: u32, hi: u32| {
            let v = _mm_cvtsi64_si128(((u64::from(hi) << 32) | u64::from(lo)) as i64);
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
        };
        (
            _mm256_mul_ps(widen(a & lo6, sc_hi), _mm256_set1_ps(f16_at(p))),
            _mm256_mul_ps(widen(b & lo6, mn_hi), _mm256_set1_ps(f16_at(p.add(2)))),
        )
    }

    /// Rows `v[0..4]` of 8 values to columns: lanes 0..4 of `t[j]` are `v[0..4][j]` and lanes
    /// 4..8 `v[0..4][j + 4]`, for `j < 4`.
    #[inline(always)]
    pub(in crate::kernels::quant) unsafe fn transpose4x8(v: &[__m256; 4]) -> [__m256; 4] {
        let (l01, h01) = (
            _mm256_unpacklo_ps(v[0], v[1]),
            _mm256_unpackhi_ps(v[0], v[1]),
        );
        let (l23, h23) = (
            _mm256_unpacklo_ps(v[2], v[3]),
            _mm256_unpackhi_ps(v[2], v[3]),
        );
        [
            _mm256_shuffle_ps::<0b01_00_01_00>(l01, l23),
            _mm256_shuffle_ps::<0b11_10_11_10>(l01, l23),
            _mm256_shuffle_ps::<0b01_00_01_00>(h01, h23),
            _mm256_shuffle_ps::<0b11_10_11_10>(h01, h23),
        ]
    }

    /// Q4_K, a decode tile of 4 weight rows by one activation row: per super-block the 8
    /// sub-block scales and mins of the 4 rows decoded once ([`k_scales8`]) and transposed so
    /// that each sub-block's 4 rows sit side by side, then per sub-block the 4 rows' exact integer sums reduced by
    /// [`sum4`] (|sum| <= 15 * 32767 * 32 < 2^24), one FMA for the scales and one for the mins.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_dec4(w: &[u8], rb: usize, a: &Act<'_>) -> [[f32; 1]; 4] {
        let m4 = nibble_mask();
        let (mut acc, mut mins) = (_mm_setzero_ps(), _mm_setzero_ps());
        for sb in 0..a.nb / 8 {
            let z = _mm256_setzero_ps();
            let (mut sc, mut mn) = ([z; 4], [z; 4]);
            for r in 0..4 {
                (sc[r], mn[r]) = k_scales8(block_at(w, rb, r, 144, sb));
            }
            let (f, mn) = (transpose4x8(&sc), transpose4x8(&mn));
            for j in 0..8 {
                let b = sb * 8 + j;
                prefetch_far(w, rb, 18, b);
                let (x0, x1) = x_block(a, 0, b);
                let mut p = [_mm256_setzero_si256(); 4];
                for (r, p) in p.iter_mut().enumerate() {
                    let q = block_at(w, rb, r, 144, sb).add(16 + 32 * (j / 2));
                    let (lo, hi) = nibbles32(q, j % 2 == 1, m4);
                    *p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
                }
                let (fj, mj) = if j < 4 {
                    (_mm256_castps256_ps128(f[j]), _mm256_castps256_ps128(mn[j]))
                } else {
                    (
                        _mm256_extractf128_ps(f[j - 4], 1),
                        _mm256_extractf128_ps(mn[j - 4], 1),
                    )
                };
                let scale = _mm_mul_ps(fj, _mm_set1_ps(a.d[b]));
                acc = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(sum4(&p)), acc);
                mins = _mm_fmadd_ps(mj, _mm_set1_ps(a.s[b]), mins);
            }
        }
        out4(_mm_sub_ps(acc, mins))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_avx2<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [[f32; R]; W] {
        let mut acc = Acc::<W, R>::new();
        for b in 0..a.nb {
            prefetch_rows::<W>(w, rb, 34, b);
            let (mut qw, mut f) = (
                [(_mm256_setzero_si256(), _mm256_setzero_si256()); W],
                [0.0f32; W],
            );
            for r in 0..W {
                let p = block_at(w, rb, r, 34, b);
                qw[r] = (
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(2).cast())),
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(18).cast())),
                );
                f[r] = f16_at(p);
            }
            tile_fma(acc.chain(b), &qw, &f, a, b);
        }
        tile_out(&acc.merged(), None)
    }

    /// Q4_K: 8 sub-blocks of 32, each exactly one activation block. Per super-block and
    /// weight row the 8 scales and mins are decoded once, before the sub-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_avx2<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [[f32; R]; W] {
        let mut acc = Acc::<W, R>::new();
        let mut mins = [[0.0f32; R]; W];
        let m4 = nibble_mask();
        for sb in 0..a.nb / 8 {
            let (mut f, mut mn) = ([[0.0f32; 8]; W], [[0.0f32; 8]; W]);
            for r in 0..W {
                let p = block_at(w, rb, r, 144, sb);
                let sc = std::slice::from_raw_parts(p.add(4), 12);
                let (dw, dmin) = (f16_at(p), f16_at(p.add(2)));
                for j in 0..8 {
                    let (scale, min) = super::super::scalar::k_scale_min(sc, j);
                    f[r][j] = dw * f32::from(scale);
                    mn[r][j] = dmin * f32::from(min);
                }
            }
            for j in 0..8 {
                prefetch_rows::<W>(w, rb, 18, sb * 8 + j);
                // Sub-block j: the low (j even) or high (j odd) nibbles of the 32 bytes at
                // 16 + 32 * (j / 2).
                let z = _mm256_setzero_si256();
                let mut qw = [(z, z); W];
                for (r, qw) in qw.iter_mut().enumerate() {
                    *qw = nibbles32(
                        block_at(w, rb, r, 144, sb).add(16 + 32 * (j / 2)),
                        j % 2 == 1,
                        m4,
                    );
                }
                let fj: [f32; W] = std::array::from_fn(|r| f[r][j]);
                let mj: [f32; W] = std::array::from_fn(|r| mn[r][j]);
                tile_fma(acc.chain(j), &qw, &fj, a, sb * 8 + j);
                tile_min(&mut mins, &mj, a, sb * 8 + j);
            }
        }
        tile_out(&acc.merged(), Some((&mins, -1.0)))
    }

    /// Q6_K: 16 sub-blocks of 16 (two per activation block); values are `q - 32`, `q` 6 bits.
    /// With several activation rows (`R > 1`) the sub-blocks' 8-bit integer scales are
    /// multiplied into the weights as i16 once (`|(q - 32) * scale| <= 4096`), so each row's
    /// activation block makes one integer sum (`pmaddwd` pairs at most 2 * 4096 * 32767 each,
    /// two of them per lane: below 2^31) and one FMA with `d_w * d_x`. A decode tile (`R == 1`)
    /// keeps the two float scales per block instead: there the multiplies are not shared and
    /// cost more than they save (measured 0.8x).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k_avx2<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [[f32; R]; W] {
        let mut acc = Acc::<W, R>::new();
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        let off = _mm256_set1_epi16(32);
        for sb in 0..a.nb / 8 {
            // Per weight row: `d` and, for a decode tile, the 16 sub-block scales times `d`,
            // converted once per super-block with vectors (per block and half, the scalar
            // conversions were about a fifth of the kernel's instructions).
            let mut dw = [0.0f32; W];
            let mut fs = [[0.0f32; 16]; W];
            for r in 0..W {
                let p = block_at(w, rb, r, 210, sb);
                dw[r] = f16_at(p.add(208));
                if R == 1 {
                    let sc = _mm_loadu_si128(p.add(192).cast());
                    let d = _mm256_set1_ps(dw[r]);
                    let s0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
                    let s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)));
                    _mm256_storeu_ps(fs[r].as_mut_ptr(), _mm256_mul_ps(d, s0));
                    _mm256_storeu_ps(fs[r].as_mut_ptr().add(8), _mm256_mul_ps(d, s1));
                }
            }
            for half in 0..2 {
                for g in 0..4 {
                    // 210 bytes per 8 activation blocks: about 26 per block.
                    prefetch_rows::<W>(w, rb, 26, sb * 8 + half * 4 + g);
                    // Elements half*128 + 32g .. +32: the nibbles of ql bytes
                    // half*64 + (g%2)*32 .. (low for g < 2, high after), and the 2 bits of the
                    // qh bytes at shift 2g.
                    let e = half * 128 + 32 * g;
                    let z = _mm256_setzero_si256();
                    let (mut qw, mut f, mut f2) = ([(z, z); W], [0.0f32; W], [(0.0f32, 0.0f32); W]);
                    for (r, qw) in qw.iter_mut().enumerate() {
                        let p = block_at(w, rb, r, 210, sb);
                        let qh = _mm256_loadu_si256(p.add(128 + 32 * half).cast());
                        let ql = _mm256_loadu_si256(p.add(64 * half + 32 * (g % 2)).cast());
                        let lo = if g < 2 {
                            _mm256_and_si256(ql, m4)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
                        };
                        let hi = match g {
                            0 => _mm256_and_si256(qh, m2),
                            1 => _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                            2 => _mm256_and_si256(_mm256_srli_epi16(qh, 4), m2),
                            _ => _mm256_and_si256(_mm256_srli_epi16(qh, 6), m2),
                        };
                        let (q0, q1) = widen_u8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
                        let (q0, q1) = (_mm256_sub_epi16(q0, off), _mm256_sub_epi16(q1, off));
                        if R == 1 {
                            *qw = (q0, q1);
                            f2[r] = (fs[r][e / 16], fs[r][e / 16 + 1]);
                        } else {
                            let sc = p.add(192 + e / 16);
                            let (s0, s1) = (i16::from(*sc as i8), i16::from(*sc.add(1) as i8));
                            *qw = (
                                _mm256_mullo_epi16(q0, _mm256_set1_epi16(s0)),
                                _mm256_mullo_epi16(q1, _mm256_set1_epi16(s1)),
                            );
                            f[r] = dw[r];
                        }
                    }
                    let b = sb * 8 + half * 4 + g;
                    if R == 1 {
                        tile_fma2(acc.chain(b), &qw, &f2, a, b);
                    } else {
                        tile_fma(acc.chain(b), &qw, &f, a, b);
                    }
                }
            }
        }
        tile_out(&acc.merged(), None)
    }

    #[cfg(test)]
    pub(crate) mod tests {
        //! The 4-row decode tiles against the general tile body (`W = 4`, `R = 1`), which
        //! sums in another order: equal within f32 rounding. The `#[ignore]`d benchmark times
        //! both in one process (`cargo test --release -p lowsync-cpu dec4_speed -- --ignored
        //! --nocapture`).

        use super::*;

        /// Random rows of blocks of `bb` bytes, with every f16 at `halves` a small positive
        /// scale (random bits there would give infinities and NaN).
        pub(crate) fn rows(
            n: usize,
            row_bytes: usize,
            bb: usize,
            halves: &[usize],
            seed: u64,
        ) -> Vec<u8> {
            let mut st = seed;
            let mut w: Vec<u8> = (0..n * row_bytes)
                .map(|_| {
                    st = st
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    (st >> 56) as u8
                })
                .collect();
            for (i, blk) in w.chunks_exact_mut(bb).enumerate() {
                for &o in halves {
                    // 0x2C00 + small mantissa: about 0.0625.
                    blk[o..o + 2].copy_from_slice(&(0x2C00u16 + (i % 97) as u16).to_le_bytes());
                }
            }
            w
        }

        fn activations(k: usize) -> QRows {
            let x: Vec<f32> = (0..k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            QRows::quantize(&x)
        }

        type Body = unsafe fn(&[u8], usize, &Act<'_>) -> [[f32; 1]; 4];

        /// `(name, block bytes, f16 offsets, old body, new body)` of the three tiles.
        fn cases() -> [(&'static str, usize, &'static [usize], Body, Body); 3] {
            [
                ("q4_0", 18, &[0], q4_0_avx2::<4, 1>, q4_0_dec4),
                ("q4_1", 20, &[0, 2], q4_1_avx2::<4, 1>, q4_1_dec4),
                ("q4_k", 144, &[0, 2], q4_k_avx2::<4, 1>, q4_k_dec4),
            ]
        }

        /// Runs `body` over every 4-row tile of `w` into `out`.
        fn run(body: Body, w: &[u8], row_bytes: usize, x: &QRows, out: &mut [f32]) {
            let act = Act {
                d: &x.d,
                s: &x.s,
                n: &x.n,
                q: &x.q,
                nb: x.d.len(),
            };
            for (t, o) in w.chunks_exact(4 * row_bytes).zip(out.chunks_exact_mut(4)) {
                // SAFETY: the tests run only where AVX2, FMA and F16C are detected; `t` holds
                // 4 rows of `act.nb` blocks' weights.
                let r = unsafe { body(t, row_bytes, &act) };
                for (o, r) in o.iter_mut().zip(r) {
                    *o = r[0];
                }
            }
        }

        fn have_simd() -> bool {
            std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
        }

        #[test]
        fn k_scales8_matches_the_scalar_decoding() {
            if !have_simd() {
                return;
            }
            for blk in rows(64, 144, 144, &[0, 2], 13).chunks_exact(144) {
                // SAFETY: AVX2 was detected; `blk` holds a whole super-block.
                let (f, m) = unsafe { k_scales8(blk.as_ptr()) };
                let (mut fv, mut mv) = ([0.0f32; 8], [0.0f32; 8]);
                // SAFETY: 8 lanes into arrays of 8.
                unsafe {
                    _mm256_storeu_ps(fv.as_mut_ptr(), f);
                    _mm256_storeu_ps(mv.as_mut_ptr(), m);
                }
                // SAFETY: F16C was detected.
                let (d, dmin) = unsafe { (f16_at(blk.as_ptr()), f16_at(blk[2..].as_ptr())) };
                for j in 0..8 {
                    let (sc, mn) = super::super::super::scalar::k_scale_min(&blk[4..16], j);
                    assert_eq!(fv[j].to_bits(), (d * f32::from(sc)).to_bits(), "scale {j}");
                    assert_eq!(mv[j].to_bits(), (dmin * f32::from(mn)).to_bits(), "min {j}");
                }
            }
        }

        #[test]
        fn decode_tiles_agree_with_the_general_tile() {
            if !have_simd() {
                return;
            }
            let k = 768;
            let x = activations(k);
            for (name, bb, halves, old, new) in cases() {
                let row_bytes = if bb == 144 {
                    k / 256 * 144
                } else {
                    k / QK * bb
                };
                let w = rows(16, row_bytes, bb, halves, 5);
                let (mut a, mut b) = (vec![0.0f32; 16], vec![0.0f32; 16]);
                run(old, &w, row_bytes, &x, &mut a);
                run(new, &w, row_bytes, &x, &mut b);
                let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!(scale > 0.0, "{name}: all zero");
                for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                    assert!((a - b).abs() <= 1e-5 * scale, "{name} row {i}: {a} vs {b}");
                }
            }
        }

        #[test]
        #[ignore = "a benchmark: run with --release --ignored --nocapture"]
        fn dec4_speed() {
            if !have_simd() {
                return;
            }
            for k in [768, 2048] {
                let x = activations(k);
                for (name, bb, halves, old, new) in cases() {
                    let row_bytes = if bb == 144 {
                        k / 256 * 144
                    } else {
                        k / QK * bb
                    };
                    for (label, bytes, reps) in
                        [("cache 1 MiB", 1 << 20, 64), ("DRAM 96 MiB", 96 << 20, 2)]
                    {
                        let n = (bytes / row_bytes) / 4 * 4;
                        let w = rows(n, row_bytes, bb, halves, 9);
                        let mut out = vec![0.0f32; n];
                        let blocks = (n * (k / QK) * reps) as f64;
                        let (mut best_old, mut best_new) = (f64::MAX, f64::MAX);
                        for round in 0..11 {
                            let mut order = [(old, &mut best_old), (new, &mut best_new)];
                            // Each goes first in every other round.
                            order.rotate_left(round % 2);
                            for (body, best) in order {
                                let t = std::time::Instant::now();
                                for _ in 0..reps {
                                    run(body, &w, row_bytes, &x, &mut out);
                                    std::hint::black_box(&mut out);
                                }
                                *best = best.min(t.elapsed().as_secs_f64() * 1e9 / blocks);
                            }
                        }
                        eprintln!(
                        "{name} k {k} {label}: old {best_old:.3} ns/block, new {best_new:.3} ns/block, \
                         {:.2}x",
                        best_old / best_new
                    );
                    }
                }
            }
        }
    }
}

// The SIMD quantizer exists on x86-64 only; elsewhere the scalar one is the only one.
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Blocks that probe every branch of the rounding: exact halves of both signs, values
    /// next to them, zeros of both signs, NaN, infinities, subnormals, and random values.
    fn blocks() -> Vec<[f32; QK]> {
        let mut out = Vec::new();
        // Scaled so that `v * id` lands on k + 0.5 and its neighbours: amax 32767 gives id 1.
        let mut halves = [0.0f32; QK];
        for (i, v) in halves.iter_mut().enumerate() {
            let h = (i as f32 - 16.0) + 0.5;
            *v = match i % 3 {
                0 => h,
                1 => f32::from_bits(h.to_bits() + 1),
                _ => f32::from_bits(h.to_bits() - 1),
            };
        }
        halves[31] = 32767.0;
        out.push(halves);
        let mut neg = halves.map(|v| -v);
        neg[0] = -0.0;
        out.push(neg);
        let mut special = [1.0f32; QK];
        special[1] = f32::NAN;
        special[2] = -0.0;
        special[3] = f32::MIN_POSITIVE / 4.0;
        out.push(special);
        let mut inf = [0.5f32; QK];
        inf[5] = f32::INFINITY;
        inf[6] = f32::NEG_INFINITY;
        out.push(inf);
        out.push([0.0; QK]);
        out.push([f32::MIN_POSITIVE / 8.0; QK]);
        let mut tiny = [0.0f32; QK];
        tiny[0] = f32::from_bits(1);
        tiny[1] = -f32::from_bits(3);
        out.push(tiny);
        let mut seed = 7u64;
        for _ in 0..200 {
            let mut b = [0.0f32; QK];
            for v in &mut b {
                seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                *v = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0;
            }
            out.push(b);
        }
        out
    }

    #[test]
    fn simd_quantization_is_bit_identical_to_scalar() {
        if !std::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        for (n, blk) in blocks().iter().enumerate() {
            let (mut a, mut b) = ([0i16; QK], [0i16; QK]);
            let want = quantize_block(blk, &mut a);
            // SAFETY: AVX2 was detected.
            let got = unsafe { x86::quantize_block(blk, &mut b) };
            assert_eq!(a, b, "block {n}: values");
            assert_eq!(want.0.to_bits(), got.0.to_bits(), "block {n}: d");
            assert_eq!(want.1, got.1, "block {n}: sum");
        }
    }
}
