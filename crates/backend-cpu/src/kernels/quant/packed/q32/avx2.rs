//! The AVX2 bodies of the packed 32-value block products (Q4_0, Q4_1, Q8_0).
//!
//! Why: CPUs with AVX2 but no AVX-512 VNNI read a weight in place with several row streams per
//! job and a horizontal sum per row and block; the packed group is one stream whose lanes are
//! already weight rows. These bodies read the same groups as `super::avx512`.
//!
//! Strategy: each 64-byte vector of a group is two 256-bit halves, weight rows 0..8 and 8..16.
//! A half gives its operands as the AVX-512 body does (Q4_0 / Q4_1: a shift and a mask per
//! pair; Q8_0: one sign extension of 16 bytes), and `pmaddwd` against the broadcast activation
//! pair, then `paddd`, accumulates the pair into the half's integer sum (its latency is one
//! cycle, so one chain a half is enough). A decode product (1 or 2 activation rows) runs both
//! halves in one pass over the group; 4 activation rows at a time run one half per pass (their
//! float accumulators would not fit the 16 registers with both), the second pass finding the
//! group in the cache. With 8-bit activation blocks (Q4_0), each half's 8 nibble operands meet
//! their broadcast activation words in `pmaddubsw`; four products' pair sums are added as i16
//! (`4 * 15 * 127 * 2 = 15240`, no saturation) before one `pmaddwd` by ones widens them.
//!
//! Invariants: the integer sum of a block is exact, and each output is `(d_w * d_x) * sum`
//! added by one FMA in block order (Q4_1's mins `m_w * s_x` in a second chain, added at the
//! end), exactly as `super::avx512`: a packed AVX2 product has the bits of the AVX-512 one.

use std::arch::x86_64::*;

use super::super::avx2::{f16x8, nibble_sums, word};
use super::{block_at, chunk_bytes, Kind, Q8Rows, QRows, GROUP, Q40, QK};

/// How far ahead the first pass over a group prefetches the stream of groups (bytes), into
/// the L2, as `super::avx512` does.
const PREFETCH_FAR: usize = 2048;

/// Prefetches the chunk (two blocks: scales and values) [`PREFETCH_FAR`] bytes after the one
/// at `at`, whole, into the L2: a prefetch of each block's values alone left a chunk's scale
/// lines to the hardware.
#[inline(always)]
unsafe fn prefetch_chunk<K: Kind>(at: *const u8) {
    for c in 0..chunk_bytes::<K>() / 64 {
        _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(PREFETCH_FAR + 64 * c).cast());
    }
}

/// Every activation row of `x` against group `g`: 4 rows at a time (a pass per half), then 2
/// and 1 (both halves in one pass).
///
/// # Safety
/// AVX2, FMA and F16C; shapes as `super::dot` checks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows<K: Kind>(g: &[u8], nb: usize, x: &QRows, out: &mut [f32], m: usize) {
    let mut r0 = 0;
    while r0 < m {
        r0 += match m - r0 {
            4.. => {
                body::<K, 4, 1>(g, nb, x, out, r0, 0);
                body::<K, 4, 1>(g, nb, x, out, r0, 1)
            }
            2 | 3 => body::<K, 2, 2>(g, nb, x, out, r0, 0),
            _ => body::<K, 1, 2>(g, nb, x, out, r0, 0),
        };
    }
}

/// Pair `p`'s operand of half `h` (weight rows `8h..8h + 8`, lane = row) of the block values
/// at `q`. Loads of the same vector for its 4 pairs are one load once inlined.
#[inline(always)]
unsafe fn operand<K: Kind>(q: *const u8, h: usize, p: usize, m4: __m256i) -> __m256i {
    if K::QB == 256 {
        let v = _mm256_loadu_si256(q.add(64 * (p / 4) + 32 * h).cast());
        match p % 4 {
            0 => _mm256_and_si256(v, m4),
            1 => _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
            2 => _mm256_and_si256(_mm256_srli_epi16::<8>(v), m4),
            _ => _mm256_srli_epi16::<12>(v),
        }
    } else {
        _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(32 * p + 16 * h).cast()))
    }
}

/// `R` activation rows from `r0` against halves `h0..h0 + HN` of the group; returns `R`.
// Index loops: each row `i` and half `h` address several arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn body<K: Kind, const R: usize, const HN: usize>(
    g: &[u8],
    nb: usize,
    x: &QRows,
    out: &mut [f32],
    r0: usize,
    h0: usize,
) -> usize {
    let gp = g.as_ptr();
    let (xq, xd, xs, xn) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr(), x.n.as_ptr());
    let m4 = _mm256_set1_epi16(0x0F);
    let mut acc = [[_mm256_setzero_ps(); HN]; R];
    let mut mins = [[_mm256_setzero_ps(); HN]; R];
    for b in 0..nb {
        let (so, qo) = block_at::<K>(b);
        if r0 == 0 && h0 == 0 && b % 2 == 0 {
            prefetch_chunk::<K>(gp.wrapping_add(so));
        }
        // Row i's block b: pair p at xb[i] + p (two i16 as one i32).
        let xb: [*const i32; R] =
            std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
        let mut sum = [[_mm256_setzero_si256(); HN]; R];
        if K::OFFSET8 {
            for i in 0..R {
                let start = _mm256_set1_epi32(-8 * *xn.add((r0 + i) * nb + b));
                sum[i] = [start; HN];
            }
        }
        if R == 1 && K::QB == 256 {
            // Decode over nibbles: see `super::super::avx2::nibble_sums`.
            for hh in 0..HN {
                let s = nibble_sums(gp.add(qo), h0 + hh, xb[0]);
                sum[0][hh] = _mm256_add_epi32(sum[0][hh], s);
            }
        } else {
            for p in 0..16 {
                for hh in 0..HN {
                    let w = operand::<K>(gp.add(qo), h0 + hh, p, m4);
                    for i in 0..R {
                        let xv = word(xb[i], p);
                        sum[i][hh] = _mm256_add_epi32(sum[i][hh], _mm256_madd_epi16(w, xv));
                    }
                }
            }
        }
        for hh in 0..HN {
            let h = h0 + hh;
            let dv = f16x8(gp.add(so + 16 * h));
            for i in 0..R {
                let scale = _mm256_mul_ps(dv, _mm256_set1_ps(*xd.add((r0 + i) * nb + b)));
                acc[i][hh] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum[i][hh]), acc[i][hh]);
            }
            if K::MIN {
                let mv = f16x8(gp.add(so + 32 + 16 * h));
                for i in 0..R {
                    let s = _mm256_set1_ps(*xs.add((r0 + i) * nb + b));
                    mins[i][hh] = _mm256_fmadd_ps(mv, s, mins[i][hh]);
                }
            }
        }
    }
    for i in 0..R {
        for hh in 0..HN {
            let v = if K::MIN {
                _mm256_add_ps(acc[i][hh], mins[i][hh])
            } else {
                acc[i][hh]
            };
            let at = (r0 + i) * GROUP + 8 * (h0 + hh);
            _mm256_storeu_ps(out.as_mut_ptr().add(at), v);
        }
    }
    R
}

/// Every activation row of `x` (8-bit blocks) against Q4_0 group `g`: 4 rows at a time (a
/// pass per half), then 2 and 1.
///
/// # Safety
/// AVX2, FMA and F16C; shapes as `super::dot8_q4_0` checks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows8(g: &[u8], nb: usize, x: &Q8Rows, out: &mut [f32], m: usize) {
    let mut r0 = 0;
    while r0 < m {
        r0 += match m - r0 {
            4.. => {
                body8::<4, 1>(g, nb, x, out, r0, 0);
                body8::<4, 1>(g, nb, x, out, r0, 1)
            }
            2 | 3 => body8::<2, 2>(g, nb, x, out, r0, 0),
            _ => body8::<1, 2>(g, nb, x, out, r0, 0),
        };
    }
}

/// `R` activation rows from `r0` (8-bit blocks) against halves `h0..h0 + HN` of a Q4_0 group:
/// per block and half, the 4 32-byte vectors give 8 operands (low and high nibble of each
/// byte, lane = weight row, bytes in `q8::PERM` order), operand `o` meeting activation word
/// `o` broadcast in `pmaddubsw`; the sum starts at `-8 * sum(q_x)` for Q4_0's offset. Returns
/// `R`.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn body8<const R: usize, const HN: usize>(
    g: &[u8],
    nb: usize,
    x: &Q8Rows,
    out: &mut [f32],
    r0: usize,
    h0: usize,
) -> usize {
    let gp = g.as_ptr();
    let (xq, xd, xn) = (x.q.as_ptr(), x.d.as_ptr(), x.n.as_ptr());
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); HN]; R];
    for b in 0..nb {
        let (so, qo) = block_at::<Q40>(b);
        if r0 == 0 && h0 == 0 && b % 2 == 0 {
            prefetch_chunk::<Q40>(gp.wrapping_add(so));
        }
        // Row i's block b: word o (4 bytes) at xb[i] + o.
        let xb: [*const i32; R] =
            std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
        for hh in 0..HN {
            let h = h0 + hh;
            let mut sum: [__m256i; R] = std::array::from_fn(|i| {
                let [lo, hi] = *xn.add((r0 + i) * nb + b);
                _mm256_set1_epi32(-8 * (lo + hi))
            });
            // Vectors 0, 1 (words 0..4), then 2, 3 (words 4..8): four pair sums a group.
            for jj in 0..2 {
                let mut w = [_mm256_setzero_si256(); 4];
                for t in 0..2 {
                    let v = _mm256_loadu_si256(gp.add(qo + 64 * (2 * jj + t) + 32 * h).cast());
                    w[2 * t] = _mm256_and_si256(v, mask);
                    w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                }
                for i in 0..R {
                    let xw = xb[i].add(4 * jj);
                    let p01 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[0], word(xw, 0)),
                        _mm256_maddubs_epi16(w[1], word(xw, 1)),
                    );
                    let p23 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[2], word(xw, 2)),
                        _mm256_maddubs_epi16(w[3], word(xw, 3)),
                    );
                    let p = _mm256_madd_epi16(_mm256_add_epi16(p01, p23), ones);
                    sum[i] = _mm256_add_epi32(sum[i], p);
                }
            }
            let dv = f16x8(gp.add(so + 16 * h));
            for i in 0..R {
                let scale = _mm256_mul_ps(dv, _mm256_set1_ps(*xd.add((r0 + i) * nb + b)));
                acc[i][hh] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum[i]), acc[i][hh]);
            }
        }
    }
    for i in 0..R {
        for hh in 0..HN {
            let at = (r0 + i) * GROUP + 8 * (h0 + hh);
            _mm256_storeu_ps(out.as_mut_ptr().add(at), acc[i][hh]);
        }
    }
    R
}
