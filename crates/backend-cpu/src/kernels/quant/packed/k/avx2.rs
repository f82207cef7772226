//! The AVX2 bodies of the packed K group products (Q4_K, Q6_K).
//!
//! Why: on CPUs with AVX2 but no AVX-512 VNNI, the in-place K products read 4 rows' super-blocks
//! side by side and unpack each row's scales per product; the packed group is one stream with
//! its scales already bytes lane by lane. These bodies read the same groups as `super::x86`.
//!
//! Strategy: each 64-byte vector of a group is two 256-bit halves, weight rows 0..8 and 8..16.
//! With 16-bit activations a half's operands come as in `super::x86` (Q4_K: a shift and a
//! mask; Q6_K: the low nibble and the sign-extended high bits merged by two masks and an or,
//! AVX2 having no bit select), each meeting its broadcast activation pair in `pmaddwd`, added by
//! `paddd`. 1 or 2 activation rows run both halves in one pass over the group (decode), 4 rows
//! one half per pass, so that their accumulators fit the 16 registers. With 8-bit activations
//! (prefill) each super-block is unpacked once per pass of up to [`PASS_ROWS`] rows into 8
//! `pmaddubsw` operands a block and half (unsigned bytes in `q8::PERM` order, as `super::x86`
//! builds them for `vpdpbusd`), and the pass's rows run over it 4 (2, 1) at a time, half by
//! half. `pmaddubsw` pair sums are added as i16 before one `pmaddwd` by ones: four of them for
//! Q4_K (`4 * 15 * 127 * 2 = 15240`), two for Q6_K (`2 * 63 * 127 * 2 = 32004`), so none
//! saturates.
//!
//! Invariants: every integer sum is exact and every output is computed in the order of
//! `super::x86` (16-bit: per block, or per sub-block of 16 for Q6_K, the sum converted, times
//! `(d * sc) * d_x`, added by one FMA in block order, Q4_K's mins in a second chain added at the
//! end; 8-bit Q6_K: `((d * sc0) * s0 + (d * sc1) * s1) * d_x` per block), so a packed AVX2
//! product has the bits of the AVX-512 one.

use std::arch::x86_64::*;

use super::super::avx2::{f16x8, nibble_sums, word};
use super::super::GROUP;
use super::x86::{shape, shape8};
use super::{K4_D, K4_DMIN, K4_MIN, K4_Q, K4_SB, K4_SC, K6_D, K6_QH, K6_QL, K6_SB, K6_SC};
use crate::kernels::quant::q16::{QRows, QK};
use crate::kernels::quant::q8::Q8Rows;

/// How far ahead of its reads a product prefetches the group's bytes (into the L1), as
/// `super::x86` does.
const PREFETCH_BYTES: usize = 16 << 10;

/// Prefetches `lines` cache lines from `at + PREFETCH_BYTES`.
#[inline(always)]
unsafe fn prefetch(at: *const u8, lines: usize) {
    for c in 0..lines {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES + 64 * c).cast());
    }
}

/// `v >> n` per 16-bit lane (logical), `n` a constant once inlined.
#[inline(always)]
unsafe fn srl16(v: __m256i, n: usize) -> __m256i {
    match n {
        0 => v,
        4 => _mm256_srli_epi16::<4>(v),
        8 => _mm256_srli_epi16::<8>(v),
        _ => _mm256_srli_epi16::<12>(v),
    }
}

/// The high bits of pair `i` (0..8) of a 2-bit vector as `16 * (hi - 2)` in bits 4..16 of
/// each 16-bit lane (bits 0..4 hold other pairs' bits), as `super::x86::high16`.
#[inline(always)]
unsafe fn high16(v: __m256i, i: usize) -> __m256i {
    let top = match i {
        0 => _mm256_slli_epi16::<14>(v),
        1 => _mm256_slli_epi16::<12>(v),
        2 => _mm256_slli_epi16::<10>(v),
        3 => _mm256_slli_epi16::<8>(v),
        4 => _mm256_slli_epi16::<6>(v),
        5 => _mm256_slli_epi16::<4>(v),
        6 => _mm256_slli_epi16::<2>(v),
        _ => v,
    };
    _mm256_srai_epi16::<10>(top)
}

/// 8 unsigned bytes at `p` as f32.
#[inline(always)]
unsafe fn u8x8_ps(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())))
}

/// 8 signed bytes at `p` as f32.
#[inline(always)]
unsafe fn i8x8_ps(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// Pair `4t + i`'s operand of half `h` of a Q4_K block (256 packed bytes at `q`), lane = row.
/// The 4 loads of a vector are one once inlined.
#[inline(always)]
unsafe fn k4_operand(q: *const u8, h: usize, t: usize, i: usize) -> __m256i {
    let v = _mm256_loadu_si256(q.add(64 * t + 32 * h).cast());
    let s = srl16(v, 4 * i);
    // The top nibble needs no mask after its shift.
    if i == 3 {
        s
    } else {
        _mm256_and_si256(s, _mm256_set1_epi32(0x000F_000F))
    }
}

/// Pair `p`'s operand of half `h` of a Q6_K block (`ql`: 256 bytes, `qh`: 128), lane = row,
/// values `q - 32`.
#[inline(always)]
unsafe fn k6_operand(ql: *const u8, qh: *const u8, h: usize, p: usize) -> __m256i {
    let mask = _mm256_set1_epi32(0x000F_000F);
    let v = _mm256_loadu_si256(ql.add(64 * (p / 4) + 32 * h).cast());
    let hv = _mm256_loadu_si256(qh.add(64 * (p / 8) + 32 * h).cast());
    let lo = _mm256_and_si256(srl16(v, 4 * (p % 4)), mask);
    // Bits 0..4 from the low nibble, the rest from the sign-extended high bits.
    _mm256_or_si256(lo, _mm256_andnot_si256(mask, high16(hv, p % 8)))
}

/// A Q4_K super-block's `d` and `-dmin` of half `h`'s 8 rows.
#[inline(always)]
unsafe fn k4_d(p: *const u8, h: usize) -> (__m256, __m256) {
    let d = f16x8(p.add(K4_D + 16 * h));
    let dmin = f16x8(p.add(K4_DMIN + 16 * h));
    // `-dmin` by its sign bit, as `super::x86` negates (zeros included).
    let ndmin = _mm256_xor_ps(dmin, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN)));
    (d, ndmin)
}

/// Sub-block `j`'s scales `d * sc` and mins `-dmin * m` of half `h`'s 8 rows (exact
/// products).
#[inline(always)]
unsafe fn k4_scales(
    p: *const u8,
    (d, ndmin): (__m256, __m256),
    j: usize,
    h: usize,
) -> (__m256, __m256) {
    (
        _mm256_mul_ps(d, u8x8_ps(p.add(K4_SC + 16 * j + 8 * h))),
        _mm256_mul_ps(ndmin, u8x8_ps(p.add(K4_MIN + 16 * j + 8 * h))),
    )
}

/// Sub-block `t`'s (of 16) scales `d * sc` of half `h`'s 8 rows (exact products), `d` the
/// half's.
#[inline(always)]
unsafe fn k6_scale(p: *const u8, d: __m256, t: usize, h: usize) -> __m256 {
    _mm256_mul_ps(d, i8x8_ps(p.add(K6_SC + 16 * t + 8 * h)))
}

/// `R` activation rows from `r0` against halves `h0..h0 + HN` of a Q4_K group of `nsb`
/// super-blocks, results into `out` (row `i`'s 16 lanes at `(r0 + i) * GROUP`).
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn k4_rows<const R: usize, const HN: usize>(
    g: &[u8],
    nsb: usize,
    x: &QRows,
    out: &mut [f32],
    r0: usize,
    h0: usize,
) {
    let nb = nsb * 8;
    let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); HN]; R];
    let mut mins = [[_mm256_setzero_ps(); HN]; R];
    for s in 0..nsb {
        let p = g.as_ptr().add(s * K4_SB);
        let dd: [(__m256, __m256); HN] = std::array::from_fn(|hh| k4_d(p, h0 + hh));
        for j in 0..8 {
            let b = 8 * s + j;
            if h0 == 0 {
                // 8 x 5 lines cover the super-block's 37.
                prefetch(p.add(5 * 64 * j), 5);
            }
            let xb: [*const i32; R] =
                std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
            let q = p.add(K4_Q + 256 * j);
            let mut sum = [[_mm256_setzero_si256(); HN]; R];
            if R == 1 {
                // Decode: the nibbles masked in place (see `super::super::avx2::nibble_sums`).
                for hh in 0..HN {
                    sum[0][hh] = nibble_sums(q, h0 + hh, xb[0]);
                }
            } else {
                for t in 0..4 {
                    for i4 in 0..4 {
                        for hh in 0..HN {
                            let w = k4_operand(q, h0 + hh, t, i4);
                            for i in 0..R {
                                let prod = _mm256_madd_epi16(w, word(xb[i], 4 * t + i4));
                                sum[i][hh] = _mm256_add_epi32(sum[i][hh], prod);
                            }
                        }
                    }
                }
            }
            for hh in 0..HN {
                let (fv, mv) = k4_scales(p, dd[hh], j, h0 + hh);
                for i in 0..R {
                    let row = (r0 + i) * nb + b;
                    let scale = _mm256_mul_ps(fv, _mm256_set1_ps(*xd.add(row)));
                    acc[i][hh] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum[i][hh]), acc[i][hh]);
                    mins[i][hh] = _mm256_fmadd_ps(mv, _mm256_set1_ps(*xs.add(row)), mins[i][hh]);
                }
            }
        }
    }
    for i in 0..R {
        for hh in 0..HN {
            let at = (r0 + i) * GROUP + 8 * (h0 + hh);
            _mm256_storeu_ps(
                out.as_mut_ptr().add(at),
                _mm256_add_ps(acc[i][hh], mins[i][hh]),
            );
        }
    }
}

/// As [`k4_rows`] for a Q6_K group: two sub-blocks of 16 a block, each with its scale.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn k6_rows<const R: usize, const HN: usize>(
    g: &[u8],
    nsb: usize,
    x: &QRows,
    out: &mut [f32],
    r0: usize,
    h0: usize,
) {
    let nb = nsb * 8;
    let (xq, xd) = (x.q.as_ptr(), x.d.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); HN]; R];
    for s in 0..nsb {
        let p = g.as_ptr().add(s * K6_SB);
        let d: [__m256; HN] = std::array::from_fn(|hh| f16x8(p.add(K6_D + 16 * (h0 + hh))));
        for j in 0..8 {
            let b = 8 * s + j;
            if h0 == 0 {
                // 8 x 7 lines cover the super-block's 53.
                prefetch(p.add(7 * 64 * j), 7);
            }
            let xb: [*const i32; R] =
                std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
            let (ql, qh) = (p.add(K6_QL + 256 * j), p.add(K6_QH + 128 * j));
            for sub in 0..2 {
                let mut sum = [[_mm256_setzero_si256(); HN]; R];
                for pp in 8 * sub..8 * sub + 8 {
                    for hh in 0..HN {
                        let w = k6_operand(ql, qh, h0 + hh, pp);
                        for i in 0..R {
                            let prod = _mm256_madd_epi16(w, word(xb[i], pp));
                            sum[i][hh] = _mm256_add_epi32(sum[i][hh], prod);
                        }
                    }
                }
                for hh in 0..HN {
                    let fv = k6_scale(p, d[hh], 2 * j + sub, h0 + hh);
                    for i in 0..R {
                        let scale = _mm256_mul_ps(fv, _mm256_set1_ps(*xd.add((r0 + i) * nb + b)));
                        acc[i][hh] =
                            _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum[i][hh]), acc[i][hh]);
                    }
                }
            }
        }
    }
    for i in 0..R {
        for hh in 0..HN {
            let at = (r0 + i) * GROUP + 8 * (h0 + hh);
            _mm256_storeu_ps(out.as_mut_ptr().add(at), acc[i][hh]);
        }
    }
}

/// The Q4_K group product with AVX2 (`PackedType::dot_avx2`): 4 activation rows at a time
/// (a pass per half), then 2 and 1 (both halves in one pass).
///
/// # Safety
/// As `PackedType::dot_avx2`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_k(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    let Some((nsb, m)) = shape(g, K4_SB, k, x, out) else {
        out.fill(0.0);
        return;
    };
    let mut r0 = 0;
    while r0 < m {
        r0 += match m - r0 {
            4.. => {
                k4_rows::<4, 1>(g, nsb, x, out, r0, 0);
                k4_rows::<4, 1>(g, nsb, x, out, r0, 1);
                4
            }
            2 | 3 => {
                k4_rows::<2, 2>(g, nsb, x, out, r0, 0);
                2
            }
            _ => {
                k4_rows::<1, 2>(g, nsb, x, out, r0, 0);
                1
            }
        };
    }
}

/// The Q6_K group product with AVX2 (`PackedType::dot_avx2`), as [`dot_q4_k`].
///
/// # Safety
/// As `PackedType::dot_avx2`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q6_k(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    let Some((nsb, m)) = shape(g, K6_SB, k, x, out) else {
        out.fill(0.0);
        return;
    };
    let mut r0 = 0;
    while r0 < m {
        r0 += match m - r0 {
            4.. => {
                k6_rows::<4, 1>(g, nsb, x, out, r0, 0);
                k6_rows::<4, 1>(g, nsb, x, out, r0, 1);
                4
            }
            2 | 3 => {
                k6_rows::<2, 2>(g, nsb, x, out, r0, 0);
                2
            }
            _ => {
                k6_rows::<1, 2>(g, nsb, x, out, r0, 0);
                1
            }
        };
    }
}

/// Activation rows that one unpacking of a super-block serves with 8-bit activations: their
/// accumulators (and mins) wait in memory between super-blocks, 4 KiB for 64 rows.
const PASS_ROWS: usize = 64;

/// A super-block unpacked for a pass of rows with 8-bit activations: `w[j][h]` block `j`'s 8
/// `pmaddubsw` operands of half `h` (lane = weight row, 4 unsigned values a lane in `q8::PERM`
/// order: Q4_K's nibbles, Q6_K's 6-bit `q` without its `-32`), `f[t][h]` the scales of its
/// scale groups (Q4_K: one a block; Q6_K: two), `mn[j][h]` Q4_K's mins.
struct Unpacked8 {
    w: [[[__m256i; 8]; 2]; 8],
    f: [[__m256; 2]; 16],
    mn: [[__m256; 2]; 8],
}

impl Unpacked8 {
    fn new() -> Unpacked8 {
        // SAFETY: all-zero bits are valid vectors.
        unsafe { std::mem::zeroed() }
    }
}

/// The low (`n` 0) or high (`n` 1) nibble of every byte of `v`.
#[inline(always)]
unsafe fn nibble8(v: __m256i, n: usize) -> __m256i {
    let mask = _mm256_set1_epi8(0x0F);
    if n == 0 {
        _mm256_and_si256(v, mask)
    } else {
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask)
    }
}

/// `v` shifted left by `n` bits per 32-bit lane (right by `-n` where `n` is negative), `n` a
/// constant once inlined.
#[inline(always)]
unsafe fn shift32(v: __m256i, n: i32) -> __m256i {
    match n {
        8 => _mm256_slli_epi32::<8>(v),
        6 => _mm256_slli_epi32::<6>(v),
        4 => _mm256_slli_epi32::<4>(v),
        2 => _mm256_slli_epi32::<2>(v),
        0 => v,
        -2 => _mm256_srli_epi32::<2>(v),
        -4 => _mm256_srli_epi32::<4>(v),
        _ => _mm256_srli_epi32::<6>(v),
    }
}

/// Unpacks Q4_K super-block `p` for 8-bit activations (and prefetches ahead of it).
#[inline(always)]
unsafe fn k4_unpack8(p: *const u8, u: &mut Unpacked8) {
    prefetch(p, K4_SB.div_ceil(64));
    for h in 0..2 {
        let dd = k4_d(p, h);
        for j in 0..8 {
            (u.f[j][h], u.mn[j][h]) = k4_scales(p, dd, j, h);
            for t in 0..4 {
                let v = _mm256_loadu_si256(p.add(K4_Q + 256 * j + 64 * t + 32 * h).cast());
                u.w[j][h][2 * t] = nibble8(v, 0);
                u.w[j][h][2 * t + 1] = nibble8(v, 1);
            }
        }
    }
}

/// Unpacks Q6_K super-block `p` for 8-bit activations (and prefetches ahead of it), as
/// `super::x86::k6_unpack8` per half: the low nibbles from the nibble layout, the high bits
/// from the 2-bit vectors by two shifts and masks into bits 4..6 of each byte, the stored
/// `hi ^ 2` undone by an xor.
#[inline(always)]
unsafe fn k6_unpack8(p: *const u8, u: &mut Unpacked8) {
    prefetch(p, K6_SB.div_ceil(64));
    let (m02, m13) = (
        _mm256_set1_epi32(0x0030_0030),
        _mm256_set1_epi32(0x3000_3000),
    );
    let flip = _mm256_set1_epi8(0x20);
    for h in 0..2 {
        let d = f16x8(p.add(K6_D + 16 * h));
        for j in 0..8 {
            let qh = p.add(K6_QH + 128 * j + 32 * h);
            let hv = [
                _mm256_loadu_si256(qh.cast()),
                _mm256_loadu_si256(qh.add(64).cast()),
            ];
            for t in 0..4 {
                let v = _mm256_loadu_si256(p.add(K6_QL + 256 * j + 64 * t + 32 * h).cast());
                for n in 0..2 {
                    let a = 4 - 8 * (t % 2) as i32 - 2 * n as i32;
                    let hi02 = _mm256_and_si256(shift32(hv[t / 2], a), m02);
                    let hi13 = _mm256_and_si256(shift32(hv[t / 2], a + 4), m13);
                    let hi = _mm256_xor_si256(_mm256_or_si256(hi02, hi13), flip);
                    u.w[j][h][2 * t + n] = _mm256_or_si256(nibble8(v, n), hi);
                }
            }
        }
        for t in 0..16 {
            u.f[t][h] = k6_scale(p, d, t, h);
        }
    }
}

/// `R` activation rows from `r0` (8-bit blocks) over an unpacked super-block whose first
/// activation block is `b0`, half `h`: the rows' accumulators from `acc` (and mins from
/// `mins`, `MIN`) and back. Per block, the exact integer sum of each scale group (Q4_K: the
/// block, four `pmaddubsw` added as i16 per `pmaddwd`; Q6_K: each half, two per `pmaddwd`, from
/// `-32` times the half's activation sum), converted; Q4_K's times `f * d_x` added by one FMA,
/// its mins in a second chain; Q6_K's two as `(f0 * s0 + f1 * s1) * d_x`.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pass8<const R: usize, const MIN: bool>(
    u: &Unpacked8,
    x: &Q8Rows,
    r0: usize,
    nb: usize,
    b0: usize,
    h: usize,
    acc: &mut [[__m256; 2]],
    mins: &mut [[__m256; 2]],
) {
    let (xq, xd, xs, xn) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr(), x.n.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let mut a: [__m256; R] = std::array::from_fn(|i| acc[i][h]);
    let mut m: [__m256; R] = std::array::from_fn(|i| if MIN { mins[i][h] } else { a[i] });
    for j in 0..8 {
        let b = b0 + j;
        let xb: [*const i32; R] =
            std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
        let w = &u.w[j][h];
        if MIN {
            // Q4_K: the block is one scale group.
            let mut sum = [_mm256_setzero_si256(); R];
            for o4 in [0, 4] {
                for i in 0..R {
                    let p01 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[o4], word(xb[i], o4)),
                        _mm256_maddubs_epi16(w[o4 + 1], word(xb[i], o4 + 1)),
                    );
                    let p23 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[o4 + 2], word(xb[i], o4 + 2)),
                        _mm256_maddubs_epi16(w[o4 + 3], word(xb[i], o4 + 3)),
                    );
                    let p = _mm256_madd_epi16(_mm256_add_epi16(p01, p23), ones);
                    sum[i] = _mm256_add_epi32(sum[i], p);
                }
            }
            for i in 0..R {
                let scale = _mm256_mul_ps(u.f[j][h], _mm256_set1_ps(*xd.add((r0 + i) * nb + b)));
                a[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum[i]), a[i]);
            }
            for i in 0..R {
                let sx = _mm256_set1_ps(*xs.add((r0 + i) * nb + b));
                m[i] = _mm256_fmadd_ps(u.mn[j][h], sx, m[i]);
            }
        } else {
            // Q6_K: both halves' sums (operands 0..4 and 4..8), each from -32 times its
            // activation sum, then `(f0 * s0 + f1 * s1) * d_x` by one product and two FMAs.
            let (f0, f1) = (u.f[2 * j][h], u.f[2 * j + 1][h]);
            for i in 0..R {
                let [n0, n1] = *xn.add((r0 + i) * nb + b);
                let mut s = [_mm256_set1_epi32(-32 * n0), _mm256_set1_epi32(-32 * n1)];
                for o2 in [0, 2, 4, 6] {
                    let pr = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[o2], word(xb[i], o2)),
                        _mm256_maddubs_epi16(w[o2 + 1], word(xb[i], o2 + 1)),
                    );
                    s[o2 / 4] = _mm256_add_epi32(s[o2 / 4], _mm256_madd_epi16(pr, ones));
                }
                let t = _mm256_mul_ps(f0, _mm256_cvtepi32_ps(s[0]));
                let t = _mm256_fmadd_ps(f1, _mm256_cvtepi32_ps(s[1]), t);
                let dx = _mm256_set1_ps(*xd.add((r0 + i) * nb + b));
                a[i] = _mm256_fmadd_ps(t, dx, a[i]);
            }
        }
    }
    for i in 0..R {
        acc[i][h] = a[i];
        if MIN {
            mins[i][h] = m[i];
        }
    }
}

/// A product with 8-bit activation blocks: passes of up to [`PASS_ROWS`] rows; per pass, each
/// super-block unpacked once and every row of the pass run over it 4 (2, 1) at a time, half by
/// half.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn many_rows8<const MIN: bool>(g: &[u8], nsb: usize, m: usize, x: &Q8Rows, out: &mut [f32]) {
    let nb = nsb * 8;
    let mut u = Unpacked8::new();
    let z = _mm256_setzero_ps();
    let mut acc = [[z; 2]; PASS_ROWS];
    let mut mins = [[z; 2]; PASS_ROWS];
    for c0 in (0..m).step_by(PASS_ROWS) {
        let cn = PASS_ROWS.min(m - c0);
        acc[..cn].fill([z; 2]);
        mins[..cn].fill([z; 2]);
        for s in 0..nsb {
            // Called directly, not through a pointer: an `inline(always)` body taken as a
            // pointer is compiled without the caller's target features.
            if MIN {
                k4_unpack8(g.as_ptr().add(s * K4_SB), &mut u);
            } else {
                k6_unpack8(g.as_ptr().add(s * K6_SB), &mut u);
            }
            let mut r = 0;
            while r < cn {
                let (a, mn) = (&mut acc[r..cn], &mut mins[r..cn]);
                let (r0, b0) = (c0 + r, 8 * s);
                let step = match cn - r {
                    4.. => 4,
                    2 | 3 => 2,
                    _ => 1,
                };
                for h in 0..2 {
                    match step {
                        4 => pass8::<4, MIN>(&u, x, r0, nb, b0, h, a, mn),
                        2 => pass8::<2, MIN>(&u, x, r0, nb, b0, h, a, mn),
                        _ => pass8::<1, MIN>(&u, x, r0, nb, b0, h, a, mn),
                    }
                }
                r += step;
            }
        }
        for i in 0..cn {
            for h in 0..2 {
                let v = if MIN {
                    _mm256_add_ps(acc[i][h], mins[i][h])
                } else {
                    acc[i][h]
                };
                _mm256_storeu_ps(out.as_mut_ptr().add((c0 + i) * GROUP + 8 * h), v);
            }
        }
    }
}

/// The Q4_K group product with 8-bit activations and AVX2 (`PackedType::dot8_avx2`).
///
/// # Safety
/// As `PackedType::dot_avx2`.
pub(super) unsafe fn dot8_q4_k(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]) {
    match shape8(g, K4_SB, k, x, out) {
        // SAFETY: as the caller promised; the shapes were checked.
        Some((nsb, m)) => unsafe { many_rows8::<true>(g, nsb, m, x, out) },
        None => out.fill(0.0),
    }
}

/// The Q6_K group product with 8-bit activations and AVX2 (`PackedType::dot8_avx2`).
///
/// # Safety
/// As `PackedType::dot_avx2`.
pub(super) unsafe fn dot8_q6_k(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]) {
    match shape8(g, K6_SB, k, x, out) {
        // SAFETY: as the caller promised; the shapes were checked.
        Some((nsb, m)) => unsafe { many_rows8::<false>(g, nsb, m, x, out) },
        None => out.fill(0.0),
    }
}
