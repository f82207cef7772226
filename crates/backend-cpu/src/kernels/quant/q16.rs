//! Fast products over quantized weights: activations quantized once per product to 16-bit
//! integer blocks, integer dot products per weight block with SIMD.
//!
//! Why: a decode step streams every weight once; dequantizing each value to f32 and
//! multiplying costs several instructions per weight, while integer dot products over the
//! weights' small integers (`pmaddwd`) do 16 weights an instruction, so the product runs near
//! memory speed. llama.cpp quantizes activations to 8 bits for `pmaddubsw`; measured here, that
//! moves SmolLM2-135M's logits by 4-6% of their range and derails its greedy chat answer, so
//! lowsync keeps 16 bits: the same structure at about 1.4x the instructions of the 8-bit
//! kernels, and logits within 1e-3 of the f32 path.
//!
//! Strategy: each activation row is split into blocks of 32 with an f32 scale
//! `d = max|x| / 32767`, 16-bit values `q = round(x / d)` and `s = d * sum(q)` (for the weight
//! types with a min). A weight block's contribution is then `d_w * d_x * sum(q_w * q_x)` (plus
//! `m_w * s_x` for types with a min), the integer sum exact. A kernel takes one weight row and
//! all activation rows: it unpacks each weight block once per group of up to 8 activation
//! rows, so prefill-sized products do not unpack the weights once per token. Kernels exist for
//! Q4_0, Q4_1, Q8_0, Q4_K and Q6_K with AVX2 (+FMA, F16C), chosen at run time; other types,
//! other CPUs (NEON included) and `LOWSYNC_CPU_QUANT_DOT=f32` use the exact path of `super`
//! (f32 activations against the scalar dequantization).
//!
//! Determinism: the integer sums are exact and each output is one job's fixed-order sum, so
//! results do not depend on the thread count.

use lowsync_graph::DType;

/// Elements per activation block.
pub(crate) const QK: usize = 32;

/// Activation rows quantized to 16-bit blocks: `d[b]`, `s[b]` and the 32 values of block `b`
/// at `q[32 * b..]`, for every block of every row (row `i` starts at block `i * k / 32`).
pub(crate) struct QRows {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub q: Vec<i16>,
}

impl QRows {
    /// Quantizes `x` (rows of `k` elements, `k` a multiple of 32).
    pub(crate) fn quantize(x: &[f32]) -> QRows {
        let nb = x.len() / QK;
        let mut out = QRows {
            d: vec![0.0; nb],
            s: vec![0.0; nb],
            q: vec![0; nb * QK],
        };
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 32767.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in out.q[b * QK..(b + 1) * QK].iter_mut().zip(blk) {
                // |v * id| <= 32767 up to rounding; NaN becomes 0 (`as` saturates).
                *q = (v * id).round().clamp(-32767.0, 32767.0) as i16;
                sum += i32::from(*q);
            }
            out.d[b] = d;
            // |sum| < 2^20: exact in f32.
            out.s[b] = d * sum as f32;
        }
        out
    }
}

/// Dot products of weight rows (raw blocks, `row_bytes` each, back to back) with `m`
/// quantized activation rows, `m = out.len() / rows`: activation row `i`'s blocks are
/// `d[i * nb..]`, `s[i * nb..]` and `q[32 * i * nb..]`, `nb` blocks of 32 per row;
/// `out[r * m + i]` receives weight row `r` times activation row `i`. One call serves a job's
/// run of weight rows, so a short row (a 576-wide weight has 18 blocks) pays no per-row call.
pub(crate) type DotFn = fn(&[u8], usize, &[f32], &[f32], &[i16], &mut [f32]);

/// The fast dot product for weights of `dt` on this CPU, if there is one.
pub(crate) fn dot_fn(dt: DType) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            return x86::dot_fn(dt);
        }
    }
    let _ = dt;
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 kernels. Each wrapper checks lengths (a mismatch writes zeros and asserts in
    //! debug) and calls its `#[target_feature]` body, which `dot_fn` selects only after
    //! detecting AVX2, FMA and F16C. A body serves a group of `R` (8, 4, 2 or 1) activation rows,
    //! and for each group every weight block once: unpack to two vectors of 16 i16 (elements
    //! 0..16 and 16..32), then per row two `pmaddwd` and one FMA per scale.

    use std::arch::x86_64::*;

    use lowsync_graph::DType;

    use super::{DotFn, QK};

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
    fn blocks_per_row(
        w: &[u8],
        bb: usize,
        per: usize,
        (d, s, q): (&[f32], &[f32], &[i16]),
        rows: usize,
    ) -> Option<usize> {
        let nb = w.len() / bb * per;
        let ok = w.len().is_multiple_of(bb)
            && d.len() == nb * rows
            && s.len() == d.len()
            && q.len() == d.len() * QK;
        debug_assert!(
            ok,
            "weight row {} bytes, {} activation blocks",
            w.len(),
            d.len()
        );
        ok.then_some(nb)
    }

    /// One group's activations: `d`, `s` and `q` of `R` rows of `nb` blocks each.
    struct Act<'a> {
        d: &'a [f32],
        s: &'a [f32],
        q: &'a [i16],
        nb: usize,
    }

    /// Calls `$body::<R>` for groups of `R` activation rows: 8 while at least 8 are left, then
    /// 4, 2 and 1, so that a decode product (one row) has its accumulators in registers and a
    /// prefill product unpacks each weight block once per 8 rows.
    macro_rules! wrapper {
        ($name:ident, $body:ident, $bb:expr, $per:expr) => {
            fn $name(w: &[u8], row_bytes: usize, d: &[f32], s: &[f32], q: &[i16], out: &mut [f32]) {
                let rows = w.len().checked_div(row_bytes).unwrap_or(0);
                let m = out.len().checked_div(rows).unwrap_or(0);
                let ok = rows * row_bytes == w.len() && rows * m == out.len();
                let nb = w
                    .get(..row_bytes)
                    .filter(|_| ok)
                    .and_then(|w0| blocks_per_row(w0, $bb, $per, (d, s, q), m));
                let Some(nb) = nb else {
                    debug_assert!(false, "{} weight bytes, {row_bytes} a row", w.len());
                    out.fill(0.0);
                    return;
                };
                for (w, res) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(m)) {
                    row(w, nb, (d, s, q), res);
                }
                /// One weight row against every activation row.
                #[inline(always)]
                fn row(w: &[u8], nb: usize, (d, s, q): (&[f32], &[f32], &[i16]), out: &mut [f32]) {
                    let mut r0 = 0;
                    while r0 < out.len() {
                        let left = out.len() - r0;
                        let rows = match left {
                            8.. => 8,
                            4..=7 => 4,
                            2 | 3 => 2,
                            _ => 1,
                        };
                        let act = Act {
                            d: &d[r0 * nb..(r0 + rows) * nb],
                            s: &s[r0 * nb..(r0 + rows) * nb],
                            q: &q[r0 * nb * QK..(r0 + rows) * nb * QK],
                            nb,
                        };
                        let res = &mut out[r0..r0 + rows];
                        // SAFETY: `dot_fn` hands these out only after detecting AVX2, FMA and
                        // F16C; the lengths were checked, so every load below is in bounds.
                        unsafe {
                            match rows {
                                8 => $body::<8>(w, &act, res),
                                4 => $body::<4>(w, &act, res),
                                2 => $body::<2>(w, &act, res),
                                _ => $body::<1>(w, &act, res),
                            }
                        }
                        r0 += rows;
                    }
                }
            }
        };
    }
    wrapper!(q4_0, q4_0_avx2, 18, 1);
    wrapper!(q4_1, q4_1_avx2, 20, 1);
    wrapper!(q8_0, q8_0_avx2, 34, 1);
    wrapper!(q4_k, q4_k_avx2, 144, 8);
    wrapper!(q6_k, q6_k_avx2, 210, 8);

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
    #[inline(always)]
    unsafe fn nibbles16(p: *const u8) -> (__m256i, __m256i) {
        let v = _mm_loadu_si128(p.cast());
        let m4 = _mm_set1_epi8(0x0F);
        (
            _mm256_cvtepu8_epi16(_mm_and_si128(v, m4)),
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m4)),
        )
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

    /// `acc[i] += f * d_x * sum(w * x_i)` over one block for every row `i` of the group.
    #[inline(always)]
    unsafe fn rows_fma<const R: usize>(
        acc: &mut [__m256; R],
        w: (__m256i, __m256i),
        f: f32,
        a: &Act<'_>,
        b: usize,
    ) {
        for (i, acc) in acc.iter_mut().enumerate() {
            let (x0, x1) = x_block(a, i, b);
            let p = _mm256_add_epi32(_mm256_madd_epi16(w.0, x0), _mm256_madd_epi16(w.1, x1));
            let scale = _mm256_set1_ps(f * a.d[i * a.nb + b]);
            *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), *acc);
        }
    }

    /// `rows_fma` with scale `f.0` for elements 0..16 and `f.1` for 16..32 (Q6_K's halves).
    #[inline(always)]
    unsafe fn rows_fma2<const R: usize>(
        acc: &mut [__m256; R],
        w: (__m256i, __m256i),
        f: (f32, f32),
        a: &Act<'_>,
        b: usize,
    ) {
        for (i, acc) in acc.iter_mut().enumerate() {
            let (x0, x1) = x_block(a, i, b);
            let dx = a.d[i * a.nb + b];
            let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w.0, x0));
            let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w.1, x1));
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(f.0 * dx), p0, *acc);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(f.1 * dx), p1, *acc);
        }
    }

    /// `mins[i] += m * s_x` for every row of the group (types with a min).
    #[inline(always)]
    fn rows_min<const R: usize>(mins: &mut [f32; R], m: f32, a: &Act<'_>, b: usize) {
        for (i, mn) in mins.iter_mut().enumerate() {
            *mn += m * a.s[i * a.nb + b];
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0_avx2<const R: usize>(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); R];
        let eight = _mm256_set1_epi16(8);
        for (b, blk) in w.chunks_exact(18).enumerate() {
            let p = blk.as_ptr();
            let (lo, hi) = nibbles16(p.add(2));
            let qw = (_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight));
            rows_fma(&mut acc, qw, f16_at(p), a, b);
        }
        for (r, acc) in res.iter_mut().zip(acc) {
            *r = hsum(acc);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_avx2<const R: usize>(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut mins = [0.0f32; R];
        for (b, blk) in w.chunks_exact(20).enumerate() {
            let p = blk.as_ptr();
            rows_fma(&mut acc, nibbles16(p.add(4)), f16_at(p), a, b);
            rows_min(&mut mins, f16_at(p.add(2)), a, b);
        }
        for ((r, acc), mn) in res.iter_mut().zip(acc).zip(mins) {
            *r = hsum(acc) + mn;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_avx2<const R: usize>(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, blk) in w.chunks_exact(34).enumerate() {
            let p = blk.as_ptr();
            let qw = (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(2).cast())),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(18).cast())),
            );
            rows_fma(&mut acc, qw, f16_at(p), a, b);
        }
        for (r, acc) in res.iter_mut().zip(acc) {
            *r = hsum(acc);
        }
    }

    /// Q4_K: 8 sub-blocks of 32, each exactly one activation block.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_avx2<const R: usize>(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut mins = [0.0f32; R];
        let m4 = _mm256_set1_epi8(0x0F);
        for (sb, blk) in w.chunks_exact(144).enumerate() {
            let p = blk.as_ptr();
            let (dw, dmin) = (f16_at(p), f16_at(p.add(2)));
            let sc = &blk[4..16];
            for c in 0..4 {
                // Sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles) of 32 bytes.
                let v = _mm256_loadu_si256(p.add(16 + 32 * c).cast());
                let halves = [
                    _mm256_and_si256(v, m4),
                    _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                ];
                for (h, qw) in halves.into_iter().enumerate() {
                    let j = 2 * c + h;
                    let b = sb * 8 + j;
                    let (scale, min) = super::super::scalar::k_scale_min(sc, j);
                    rows_fma(&mut acc, widen_u8(qw), dw * f32::from(scale), a, b);
                    rows_min(&mut mins, dmin * f32::from(min), a, b);
                }
            }
        }
        for ((r, acc), mn) in res.iter_mut().zip(acc).zip(mins) {
            *r = hsum(acc) - mn;
        }
    }

    /// Q6_K: 16 sub-blocks of 16 (two per activation block); values are `q - 32`, `q` 6 bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k_avx2<const R: usize>(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); R];
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        let off = _mm256_set1_epi16(32);
        for (sb, blk) in w.chunks_exact(210).enumerate() {
            let p = blk.as_ptr();
            let dw = f16_at(p.add(208));
            let scales = &blk[192..208];
            for half in 0..2 {
                let qh = _mm256_loadu_si256(p.add(128 + 32 * half).cast());
                for g in 0..4 {
                    // Elements half*128 + 32g .. +32: the nibbles of ql bytes
                    // half*64 + (g%2)*32 .. (low for g < 2, high after), and the 2 bits of the
                    // qh bytes at shift 2g.
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
                    let qw = (_mm256_sub_epi16(q0, off), _mm256_sub_epi16(q1, off));
                    let b = sb * 8 + half * 4 + g;
                    let e = half * 128 + 32 * g;
                    let f = (
                        dw * f32::from(scales[e / 16] as i8),
                        dw * f32::from(scales[e / 16 + 1] as i8),
                    );
                    rows_fma2(&mut acc, qw, f, a, b);
                }
            }
        }
        for (r, acc) in res.iter_mut().zip(acc) {
            *r = hsum(acc);
        }
    }
}
