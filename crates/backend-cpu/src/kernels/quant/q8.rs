//! Activations quantized to 8-bit blocks for the prefill products over packed Q4_0, Q4_K and
//! Q6_K groups (`super::packed`, AVX-512 VNNI) and for the AVX2 products over Q4_0, Q4_1, Q8_0,
//! Q4_K and Q6_K weights read in place (`avx2`).
//!
//! Why: a prefill product over packed groups runs one `vpdpwssd` (16 lanes x 2 products of
//! 16-bit values) per pair of values of a block, for 16 weight rows and one activation row, and
//! that instruction count bounds it (about one a cycle on this CPU). `vpdpbusd` multiplies 4
//! unsigned bytes by 4 signed bytes per lane: with 8-bit activations a block of 32 takes 8
//! instructions instead of 16. Q4_0, Q4_K and Q6_K store unsigned small integers with an offset
//! or a min, so the weights are the unsigned operand as they lie in the packed group and the
//! activations the signed one. On CPUs without AVX-512 VNNI, `avx2` does the same with
//! `pmaddubsw` (32 byte products an instruction against `pmaddwd`'s 16). 8 bits move logits
//! more than 16 (SmolLM2-135M's greedy chat answer derailed with 8-bit activations in decode),
//! so prefill products take them on the types where the `LOWSYNC_CPU_PREFILL_ACT` switch allows
//! it, and decode keeps `super::q16` unless `LOWSYNC_CPU_DECODE_ACT=q8` (AVX2 bodies only).
//!
//! Strategy: each activation row is split into blocks of 32 with an f32 scale `d = max|x| /
//! 127`, values `q = round(x / d)` (half away from zero) as i8, the integer sums of the block's
//! two halves (Q6_K's sub-blocks of 16 take their `-32` offset from them, Q4_0's `-8` from
//! their total) and `s = d * sum(q)` (Q4_K's mins). The packed 4-bit layouts give, with one
//! shift and a `0x0F` byte mask, 32-bit lanes holding elements `{0, 4, 1, 5}` or `{2, 6, 3, 7}`
//! of each run of 8 values, so the bytes of a block are stored in that order ([`PERM`]): word
//! `w` (4 bytes) of a block is then the broadcast operand of the `w`-th `vpdpbusd`. The AVX2
//! bodies read the GGUF blocks in place, where one load and a nibble mask give a block's
//! weights in element order, so their activations keep element order
//! ([`Q8Rows::quantize_elements`]). A large product's blocks are quantized in parallel, in runs
//! of blocks.
//!
//! Invariants: the values and sums depend only on the row's values (no state across blocks or
//! rows); the AVX-512 and AVX2 quantizers give the bits of the scalar one in both orders (unit
//! tests), so the thread count and the CPU's path change nothing. |q| <= 127, so a lane of `vpdpbusd` (4 products of
//! at most 63 x 127) and a block's integer sum stay far inside i32 and exact in f32.

use rayon::prelude::*;

/// Elements per activation block.
pub(crate) const QK: usize = 32;

/// Stored position `j` of each run of 8 values holds element `PERM[j]` of the run: the order
/// in which the packed 4-bit layouts present a run's values in the bytes of a 32-bit lane
/// (low nibbles `{0, 4, 1, 5}`, high nibbles `{2, 6, 3, 7}`).
pub(crate) const PERM: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Activation rows quantized to 8-bit blocks: for block `b` of every row (row `i` starts at
/// block `i * k / 32`), the scale `d[b]`, `s[b] = d[b] * sum(q)`, the integer sums `n[b]` of its
/// elements 0..16 and 16..32, and its 32 values at `q[32 * b..]`, in [`PERM`] order (`perm`,
/// for the packed groups) or in element order (for the AVX2 bodies of `avx2`, which read the
/// GGUF blocks in place, where element order is what one load and a nibble mask give).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // `perm` is read by x86 bodies only
pub(crate) struct Q8Rows {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub n: Vec<[i32; 2]>,
    pub q: Vec<i8>,
    pub perm: bool,
}

impl Q8Rows {
    /// Quantizes `x` (rows of `k` elements, `k` a multiple of 32), values in [`PERM`] order:
    /// with AVX-512 or AVX2 where the CPU has it (bit-identical to the scalar code), else scalar.
    pub(crate) fn quantize(x: &[f32]) -> Q8Rows {
        Self::quantize_ordered(x, true)
    }

    /// [`Q8Rows::quantize`] with the values of each block in element order.
    pub(crate) fn quantize_elements(x: &[f32]) -> Q8Rows {
        Self::quantize_ordered(x, false)
    }

    fn quantize_ordered(x: &[f32], perm: bool) -> Q8Rows {
        let nb = x.len() / QK;
        let mut out = Q8Rows {
            d: vec![0.0; nb],
            s: vec![0.0; nb],
            n: vec![[0; 2]; nb],
            q: vec![0; nb * QK],
            perm,
        };
        if nb > PAR_BLOCKS {
            // A 128-row prefill product quantizes 3k-8k blocks on the calling thread otherwise,
            // while the other threads wait for its jobs.
            let run = |((((d, s), n), q), x): Part<'_>| quantize_blocks(x, d, s, n, q, perm);
            out.d
                .par_chunks_mut(PAR_BLOCKS)
                .zip(out.s.par_chunks_mut(PAR_BLOCKS))
                .zip(out.n.par_chunks_mut(PAR_BLOCKS))
                .zip(out.q.par_chunks_mut(PAR_BLOCKS * QK))
                .zip(x.par_chunks(PAR_BLOCKS * QK))
                .for_each(run);
        } else {
            quantize_blocks(x, &mut out.d, &mut out.s, &mut out.n, &mut out.q, perm);
        }
        out
    }

    /// Activation blocks per row for `m` rows: `None` where the lengths disagree.
    pub(crate) fn blocks_per_row(&self, m: usize) -> Option<usize> {
        let nb = self.d.len().checked_div(m)?;
        let ok = nb * m == self.d.len()
            && self.s.len() == self.d.len()
            && self.n.len() == self.d.len()
            && self.q.len() == self.d.len() * QK;
        ok.then_some(nb)
    }

    /// Value `l` (element order) of block `b`.
    #[cfg(test)]
    pub(crate) fn value(&self, b: usize, l: usize) -> i8 {
        if !self.perm {
            return self.q[b * QK + l];
        }
        let at = l / 8 * 8 + PERM.iter().position(|&e| e == l % 8).expect("0..8");
        self.q[b * QK + at]
    }
}

/// Dot products of weight rows (raw blocks, `row_bytes` each, back to back) with `m` 8-bit
/// activation rows in element order ([`Q8Rows::quantize_elements`]), `m = out.len() / rows`;
/// `out[i * rows + r]` receives weight row `r` times activation row `i` (as `q16::DotFn`).
pub(crate) type Dot8Fn = fn(&[u8], usize, &Q8Rows, &mut [f32]);

/// The AVX2 body over 8-bit activations for weights of `dt` reading them in place (`avx2`),
/// where the CPU has AVX2, FMA and F16C.
pub(crate) fn avx2_dot_fn(dt: lowsync_graph::DType) -> Option<Dot8Fn> {
    #[cfg(target_arch = "x86_64")]
    {
        avx2::dot_fn(dt)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dt;
        None
    }
}

/// Blocks quantized by one job when a product quantizes its activations in parallel.
const PAR_BLOCKS: usize = 512;

/// One job's share: `(((d, s), n), q)` of its blocks, and their values `x`.
type Part<'a> = (
    (
        ((&'a mut [f32], &'a mut [f32]), &'a mut [[i32; 2]]),
        &'a mut [i8],
    ),
    &'a [f32],
);

/// Quantizes the blocks of `x` into `d`, `s`, `n`, `q` (one entry, or 32 values, a block),
/// values in [`PERM`] order where `perm`, else in element order: with AVX-512 or AVX2 where the
/// CPU has it, else scalar.
fn quantize_blocks(
    x: &[f32],
    d: &mut [f32],
    s: &mut [f32],
    n: &mut [[i32; 2]],
    q: &mut [i8],
    perm: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::q16::has_avx512() {
            // SAFETY: AVX-512 F/BW/VL were detected.
            return unsafe { avx512::quantize_blocks(x, d, s, n, q, perm) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected.
            return unsafe { avx2::quantize_blocks(x, d, s, n, q, perm) };
        }
    }
    for (b, blk) in x.chunks_exact(QK).enumerate() {
        let qb: &mut [i8; QK] = (&mut q[b * QK..(b + 1) * QK])
            .try_into()
            .expect("a block of 32");
        let (db, nb) = quantize_block(blk.try_into().expect("a block of 32"), qb, perm);
        // |sum| <= 32 * 127: exact in f32.
        (d[b], s[b], n[b]) = (db, db * (nb[0] + nb[1]) as f32, nb);
    }
}

/// One block of 32: its values in [`PERM`] order (`perm`) or element order, and `(d, [sum of
/// elements 0..16, sum of 16..32])`.
fn quantize_block(blk: &[f32; QK], out: &mut [i8; QK], perm: bool) -> (f32, [i32; 2]) {
    let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = [0i32; 2];
    let mut q = [0i8; QK];
    for (l, (q, &v)) in q.iter_mut().zip(blk).enumerate() {
        // |v * id| <= 127 up to rounding; NaN becomes 0 (`as` saturates).
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
        sum[l / 16] += i32::from(*q);
    }
    if !perm {
        *out = q;
        return (d, sum);
    }
    for (run, src) in out.chunks_exact_mut(8).zip(q.chunks_exact(8)) {
        for (o, &e) in run.iter_mut().zip(&PERM) {
            *o = src[e];
        }
    }
    (d, sum)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512 quantizer.

    use std::arch::x86_64::*;

    use super::QK;

    /// `super::quantize_blocks` with AVX-512: every block by [`quantize_block`].
    ///
    /// # Safety
    /// AVX-512 F, BW and VL are available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize_blocks(
        x: &[f32],
        d: &mut [f32],
        s: &mut [f32],
        n: &mut [[i32; 2]],
        q: &mut [i8],
        perm: bool,
    ) {
        for (b, (blk, qb)) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).enumerate() {
            let (blk, qb) = (blk.try_into().expect("32"), qb.try_into().expect("32"));
            // SAFETY: as the caller promised.
            let (db, nb) = unsafe { quantize_block(blk, qb, perm) };
            (d[b], s[b], n[b]) = (db, db * (nb[0] + nb[1]) as f32, nb);
        }
    }

    /// `super::quantize_block` with AVX-512, bit for bit: the same max (NaN ignored), the same
    /// `v * id` products, rounding half away from zero (truncate, then step away from zero
    /// where the dropped part is at least one half; exact below 2^23), the same clamp, NaN to
    /// 0, and (where `perm`) the bytes permuted within each run of 8 by one shuffle.
    ///
    /// # Safety
    /// AVX-512 F, BW and VL are available.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize_block(
        blk: &[f32; QK],
        out: &mut [i8; QK],
        perm: bool,
    ) -> (f32, [i32; 2]) {
        let p = blk.as_ptr();
        let v = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
        let abs_mask = _mm512_set1_epi32(0x7FFF_FFFF);
        let abs =
            |x: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), abs_mask));
        // `max(a, b)` returns `b` when `a` is NaN: NaN lanes are skipped, as `f32::max` does.
        let m = _mm512_max_ps(abs(v[1]), _mm512_max_ps(abs(v[0]), _mm512_setzero_ps()));
        // The reduction's order does not matter: max is exact and NaN-free here.
        let amax = _mm512_reduce_max_ps(m);
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let idv = _mm512_set1_ps(id);
        let (half, one) = (_mm512_set1_ps(0.5), _mm512_set1_ps(1.0));
        let sign = _mm512_set1_epi32(i32::MIN);
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        // Within each 8 bytes: stored byte j takes element PERM[j].
        let shuf = if perm {
            _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
        } else {
            _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
        };
        let mut sums = [0i32; 2];
        for h in 0..2 {
            let x = _mm512_mul_ps(v[h], idv);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
            let frac = abs(_mm512_sub_ps(x, t));
            let step = _mm512_castsi512_ps(_mm512_or_si512(
                _mm512_and_si512(_mm512_castps_si512(x), sign),
                _mm512_castps_si512(one),
            ));
            let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
            let r = _mm512_mask_add_ps(t, up, t, step);
            let r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            // NaN lanes (unordered with themselves) become 0.
            let ord = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x);
            let qi = _mm512_maskz_cvttps_epi32(ord, r);
            sums[h] = _mm512_reduce_add_epi32(qi);
            let bytes = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(qi), shuf);
            _mm_storeu_si128(out.as_mut_ptr().add(16 * h).cast(), bytes);
        }
        (d, sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks that reach the rounding's corners: halves, both ends of the range, zeros,
    /// denormals, infinities and NaN.
    fn blocks() -> Vec<f32> {
        let mut x = Vec::new();
        let mut st = 7u64;
        for b in 0..64 {
            for l in 0..QK {
                st = st
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let u = (st >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let v = match b % 8 {
                    0 => 0.0,
                    // Exact halves after scaling by 127 / amax (amax 127).
                    1 => (l as f32 - 16.0) + 0.5,
                    2 if l == 0 => 127.0,
                    2 => (l as f32 * 4.0 - 64.0) + 0.5,
                    3 => u * 1e-40,
                    4 if l == 3 => f32::NAN,
                    5 if l == 7 => f32::INFINITY,
                    _ => u * 10f32.powi(b % 7 - 3),
                };
                x.push(v);
            }
        }
        x
    }

    #[test]
    fn the_simd_quantizer_gives_the_scalar_bits() {
        if !super::super::q16::has_avx512() {
            eprintln!("skipped: this CPU lacks AVX-512 F/BW/VL + VNNI");
            return;
        }
        // Enough blocks for the parallel runs (`PAR_BLOCKS`), the last one partial.
        let x = blocks().repeat(20);
        assert!(x.len() / QK > 2 * PAR_BLOCKS && !(x.len() / QK).is_multiple_of(PAR_BLOCKS));
        let simd = Q8Rows::quantize(&x);
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let mut q = [0i8; QK];
            let (d, n) = quantize_block(blk.try_into().expect("32"), &mut q, true);
            assert_eq!(d.to_bits(), simd.d[b].to_bits(), "block {b}");
            assert_eq!(n, simd.n[b], "block {b}");
            assert_eq!(q[..], simd.q[b * QK..(b + 1) * QK], "block {b}");
        }
    }

    #[test]
    fn the_avx2_quantizer_gives_the_scalar_bits_in_both_orders() {
        #[cfg(target_arch = "x86_64")]
        {
            if !std::is_x86_feature_detected!("avx2") {
                eprintln!("skipped: this CPU lacks AVX2");
                return;
            }
            for perm in [true, false] {
                for (b, blk) in blocks().chunks_exact(QK).enumerate() {
                    let blk: &[f32; QK] = blk.try_into().expect("32");
                    let (mut a, mut s) = ([0i8; QK], [0i8; QK]);
                    let want = quantize_block(blk, &mut a, perm);
                    // SAFETY: AVX2 was detected.
                    let got = unsafe { avx2::quantize_block(blk, &mut s, perm) };
                    assert_eq!(a, s, "block {b} perm {perm}: values");
                    assert_eq!(
                        want.0.to_bits(),
                        got.0.to_bits(),
                        "block {b} perm {perm}: d"
                    );
                    assert_eq!(want.1, got.1, "block {b} perm {perm}: sums");
                }
            }
        }
    }

    #[test]
    fn element_order_holds_the_values_of_perm_order() {
        let x = blocks();
        let (p, e) = (Q8Rows::quantize(&x), Q8Rows::quantize_elements(&x));
        assert_eq!(
            p.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            e.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(p.n, e.n);
        for b in 0..x.len() / QK {
            for l in 0..QK {
                assert_eq!(p.value(b, l), e.value(b, l), "block {b} value {l}");
            }
        }
    }

    #[test]
    fn values_round_half_away_from_zero_and_keep_their_sums() {
        let x = blocks();
        let r = Q8Rows::quantize(&x);
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let mut sums = [0i32; 2];
            for (l, &v) in blk.iter().enumerate() {
                let q = r.value(b, l);
                sums[l / 16] += i32::from(q);
                let want = if r.d[b] > 0.0 && v.is_finite() {
                    (f64::from(v) * f64::from(1.0 / r.d[b])).clamp(-127.0, 127.0)
                } else {
                    0.0
                };
                // f32's `v * id` may round across a half; never by more than that.
                assert!(
                    (f64::from(q) - want).abs() <= 0.5 + 1e-4 || !v.is_finite(),
                    "block {b} value {l}: {v} -> {q} (want {want})"
                );
            }
            assert_eq!(sums, r.n[b], "block {b}");
            // (An infinite value makes `d` infinite and `s` NaN: compare bits.)
            let s = r.d[b] * (sums[0] + sums[1]) as f32;
            assert_eq!(r.s[b].to_bits(), s.to_bits(), "block {b}");
        }
        // amax 127 gives d = 1 and id = 1 exactly: halves round away from zero.
        let mut blk = [0.0f32; QK];
        blk[0] = 127.0;
        for (l, v) in blk.iter_mut().enumerate().skip(1) {
            *v = (l as f32 - 16.0) + 0.5;
        }
        let q = Q8Rows::quantize(&blk);
        assert_eq!(q.d[0], 1.0);
        for (l, &v) in blk.iter().enumerate().skip(1) {
            let want = if v > 0.0 { v + 0.5 } else { v - 0.5 };
            assert_eq!(f32::from(q.value(0, l)), want, "{v}");
        }
    }
}
