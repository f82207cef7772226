//! Fast products over quantized weights: activations quantized once per product to 8-bit
//! blocks, integer dot products per weight block with SIMD (llama.cpp's approach).
//!
//! Why: a decode step streams every weight once; dequantizing each value to f32 and
//! multiplying costs several instructions per weight, while an 8-bit integer dot product does
//! 32 weights in a handful (`maddubs`), so the product runs at memory speed, not conversion
//! speed.
//!
//! Strategy: each activation row is split into blocks of 32 with an f32 scale
//! `d = max|x| / 127`, 8-bit values `q = round(x / d)` and `s = d * sum(q)` (for the weight
//! types with a min or an offset). A weight block's contribution is then
//! `d_w * d_x * sum(q_w * q_x)` (plus `m_w * s_x` for types with a min), the integer sum exact.
//! A kernel takes one weight row and up to all activation rows: it unpacks each weight block
//! once per group of `ROWS` (8) activation rows, so prefill-sized products do not unpack the
//! weights once per token.
//! Kernels exist for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K with AVX2 (+FMA, F16C), chosen at run
//! time; other types, other CPUs (NEON included) and `LOWSYNC_CPU_QUANT_DOT=f32` use the exact
//! path of `super` (f32 activations against the scalar dequantization).
//!
//! Accuracy: quantizing activations adds a relative error of about 2^-8 per value (as in
//! llama.cpp); logits stay within a few 1e-3 of the f32 path. The integer sums are exact and
//! each output is one job's fixed-order sum, so results do not depend on the thread count.

use lowsync_graph::DType;

/// Elements per activation block.
pub(crate) const QK: usize = 32;

/// Activation rows quantized to 8-bit blocks: `d[b]`, `s[b]` and the 32 values of block `b`
/// at `q[32 * b..]`, for every block of every row (row `i` starts at block `i * k / 32`).
pub(crate) struct Q8Rows {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub q: Vec<i8>,
}

impl Q8Rows {
    /// Quantizes `x` (rows of `k` elements, `k` a multiple of 32).
    pub(crate) fn quantize(x: &[f32]) -> Q8Rows {
        let nb = x.len() / QK;
        let mut out = Q8Rows {
            d: vec![0.0; nb],
            s: vec![0.0; nb],
            q: vec![0; nb * QK],
        };
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in out.q[b * QK..(b + 1) * QK].iter_mut().zip(blk) {
                // |v * id| <= 127 up to rounding; NaN becomes 0 (`as` saturates, NaN -> 0).
                *q = (v * id).round().clamp(-127.0, 127.0) as i8;
                sum += i32::from(*q);
            }
            out.d[b] = d;
            out.s[b] = d * sum as f32;
        }
        out
    }
}

/// Activation rows a kernel serves per unpacking of a weight block (accumulators in registers).
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 8;

/// Dot products of one weight row (raw blocks) with `out.len()` quantized activation rows:
/// row `i`'s blocks are `d[i * nb..]`, `s[i * nb..]` and `q[32 * i * nb..]`, `nb` blocks of 32
/// per row; `out[i]` receives row `i`'s result.
pub(crate) type DotFn = fn(&[u8], &[f32], &[f32], &[i8], &mut [f32]);

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
    //! detecting AVX2, FMA and F16C. A body walks the activation rows in groups of `ROWS`,
    //! and for each group every weight block once: unpack, then one integer dot product and
    //! one FMA per row of the group.

    use std::arch::x86_64::*;

    use lowsync_graph::DType;

    use super::{DotFn, QK, ROWS};

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
    /// activation blocks, meets `out.len()` activation rows; `None` on any mismatch.
    fn blocks_per_row(
        w: &[u8],
        bb: usize,
        per: usize,
        (d, s, q): (&[f32], &[f32], &[i8]),
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

    macro_rules! wrapper {
        ($name:ident, $body:ident, $bb:expr, $per:expr) => {
            fn $name(w: &[u8], d: &[f32], s: &[f32], q: &[i8], out: &mut [f32]) {
                let Some(nb) = blocks_per_row(w, $bb, $per, (d, s, q), out.len()) else {
                    out.fill(0.0);
                    return;
                };
                for (g, res) in out.chunks_mut(ROWS).enumerate() {
                    let r0 = g * ROWS;
                    let rows = r0..r0 + res.len();
                    let act = Act {
                        d: &d[rows.start * nb..rows.end * nb],
                        s: &s[rows.start * nb..rows.end * nb],
                        q: &q[rows.start * nb * QK..rows.end * nb * QK],
                        nb,
                        rows: res.len(),
                    };
                    // SAFETY: `dot_fn` hands these out only after detecting AVX2, FMA and
                    // F16C; the lengths were checked, so every load below is in bounds.
                    unsafe { $body(w, &act, res) }
                }
            }
        };
    }
    wrapper!(q4_0, q4_0_avx2, 18, 1);
    wrapper!(q4_1, q4_1_avx2, 20, 1);
    wrapper!(q8_0, q8_0_avx2, 34, 1);
    wrapper!(q4_k, q4_k_avx2, 144, 8);
    wrapper!(q6_k, q6_k_avx2, 210, 8);

    /// One group's activations: `d`, `s` and `q` of `rows` (at most `ROWS`) rows of `nb`
    /// blocks each.
    struct Act<'a> {
        d: &'a [f32],
        s: &'a [f32],
        q: &'a [i8],
        nb: usize,
        rows: usize,
    }

    /// The little-endian f16 at `p` as f32.
    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// The sum of the 8 lanes, in a fixed order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The 32 nibbles of 16 bytes as bytes: low nibbles (elements 0..16) in the low lane, high
    /// nibbles (16..32) in the high lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let v = _mm_loadu_si128(p.cast());
        let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// Sums of 4 adjacent products `u[i] * s[i]` (u unsigned 0..=255, s signed) as 8 i32.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot_us(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// The 32 activation values of block `b` of group row `i`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn x_block(q: &[i8], nb: usize, i: usize, b: usize) -> __m256i {
        _mm256_loadu_si256(q.as_ptr().add((i * nb + b) * QK).cast())
    }

    /// `acc[i] += f * d[i * nb + b] * dot(qw, x_i)` for every row `i` of the group; `qw`
    /// unsigned (`signed` false) or signed.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_fma(
        acc: &mut [__m256; ROWS],
        qw: __m256i,
        signed: bool,
        f: f32,
        a: &Act<'_>,
        b: usize,
    ) {
        // The sign trick: |qw| * (x with qw's sign) equals qw * x, with an unsigned left side.
        let u = if signed { _mm256_sign_epi8(qw, qw) } else { qw };
        for (i, acc) in acc.iter_mut().enumerate().take(a.rows) {
            let x = x_block(a.q, a.nb, i, b);
            let x = if signed { _mm256_sign_epi8(x, qw) } else { x };
            let scale = _mm256_set1_ps(f * a.d[i * a.nb + b]);
            *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot_us(u, x)), *acc);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0_avx2(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        for (b, blk) in w.chunks_exact(18).enumerate() {
            let p = blk.as_ptr();
            let qw = _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8));
            rows_fma(&mut acc, qw, true, f16_at(p), a, b);
        }
        for (r, acc) in res.iter_mut().zip(acc) {
            *r = hsum(acc);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_avx2(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        let mut mins = [0.0f32; ROWS];
        for (b, blk) in w.chunks_exact(20).enumerate() {
            let p = blk.as_ptr();
            rows_fma(&mut acc, nibbles(p.add(4)), false, f16_at(p), a, b);
            let m = f16_at(p.add(2));
            for (i, mn) in mins.iter_mut().enumerate().take(a.rows) {
                *mn += m * a.s[i * a.nb + b];
            }
        }
        for ((r, acc), mn) in res.iter_mut().zip(acc).zip(mins) {
            *r = hsum(acc) + mn;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_avx2(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        for (b, blk) in w.chunks_exact(34).enumerate() {
            let p = blk.as_ptr();
            let qw = _mm256_loadu_si256(p.add(2).cast());
            rows_fma(&mut acc, qw, true, f16_at(p), a, b);
        }
        for (r, acc) in res.iter_mut().zip(acc) {
            *r = hsum(acc);
        }
    }

    /// Q4_K: 8 sub-blocks of 32, each exactly one activation block.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_avx2(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        let mut mins = [0.0f32; ROWS];
        let m4 = _mm256_set1_epi8(0x0F);
        for (sb, blk) in w.chunks_exact(144).enumerate() {
            let p = blk.as_ptr();
            let (dw, dmin) = (f16_at(p), f16_at(p.add(2)));
            let sc = &blk[4..16];
            for c in 0..4 {
                let v = _mm256_loadu_si256(p.add(16 + 32 * c).cast());
                let halves = [
                    _mm256_and_si256(v, m4),
                    _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                ];
                for (h, qw) in halves.into_iter().enumerate() {
                    let j = 2 * c + h;
                    let b = sb * 8 + j;
                    let (scale, min) = super::super::scalar::k_scale_min(sc, j);
                    rows_fma(&mut acc, qw, false, dw * f32::from(scale), a, b);
                    let m = dmin * f32::from(min);
                    for (i, mn) in mins.iter_mut().enumerate().take(a.rows) {
                        *mn += m * a.s[i * a.nb + b];
                    }
                }
            }
        }
        for ((r, acc), mn) in res.iter_mut().zip(acc).zip(mins) {
            *r = hsum(acc) - mn;
        }
    }

    /// Q6_K: 16 sub-blocks of 16 (two per activation block); values are `q - 32`, `q` 6 bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k_avx2(w: &[u8], a: &Act<'_>, res: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        let off = _mm256_set1_epi8(32);
        let ones = _mm256_set1_epi16(1);
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
                    let qw = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                    let b = sb * 8 + half * 4 + g;
                    let e = half * 128 + 32 * g;
                    let (s0, s1) = (
                        dw * f32::from(scales[e / 16] as i8),
                        dw * f32::from(scales[e / 16 + 1] as i8),
                    );
                    // Lanes 0..4 hold elements 0..16 (scale s0), lanes 4..8 elements 16..32.
                    let fs = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                    for (i, acc) in acc.iter_mut().enumerate().take(a.rows) {
                        let x = x_block(a.q, a.nb, i, b);
                        // sum((q - 32) * x) = sum(q * x) - 32 * sum(x), both exact in i16 pairs.
                        let p16 = _mm256_sub_epi16(
                            _mm256_maddubs_epi16(qw, x),
                            _mm256_maddubs_epi16(off, x),
                        );
                        let p32 = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                        let f = _mm256_mul_ps(fs, _mm256_set1_ps(a.d[i * a.nb + b]));
                        *acc = _mm256_fmadd_ps(f, p32, *acc);
                    }
                }
            }
        }
        for (r, acc) in res.iter_mut().zip(acc) {
            *r = hsum(acc);
        }
    }
}
