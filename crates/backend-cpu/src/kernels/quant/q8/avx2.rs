//! AVX2 products over 8-bit activation blocks ([`Q8Rows`] in element order), reading the GGUF
//! blocks of Q4_0, Q4_1, Q8_0, Q4_K and Q6_K in place, and the AVX2 quantizer of `super`.
//!
//! Why: on CPUs without AVX-512 VNNI every product over block weights took `super::super::q16`'s
//! AVX2 tiles, two `pmaddwd` (16 products of 16-bit values each) per weight block and activation
//! row. `pmaddubsw` multiplies 32 unsigned bytes by 32 signed bytes into 16 pair sums: one
//! instruction for the products of a block, and one `pmaddwd` by ones (or by Q6_K's sub-block
//! scales) to widen the pairs to 32-bit.
//!
//! Strategy: a tile is 4 weight rows by `R` activation rows (4, 2 or 1). Per block, each of the
//! 4 weight blocks is unpacked once to 32 unsigned bytes in element order (Q4_0, Q4_1, Q4_K:
//! nibbles; Q6_K: the 6-bit values, its `-32` taken off the pair sums as `pmaddubsw(32, x)`;
//! Q8_0: `|w|`, the signs moved onto the activations with `psignb`); per activation row the 4
//! rows' products are reduced together to 4 exact 32-bit sums (`phaddd`, as the q16 decode
//! tiles do), two activation rows' sums into one vector, scaled with one 8-lane FMA whose lanes
//! are the 4 weight rows of each of the 2 activation rows. The unsigned
//! operand keeps every pair sum inside i16: nibbles `15 * 127 * 2`, Q6_K's `63 * 127 * 2`,
//! Q8_0's `128 * 127 * 2 = 32512`, so `pmaddubsw` never saturates. A decode tile (one activation
//! row) prefetches each of its 4 rows far ahead, as the q16 decode tiles do (the hardware
//! prefetcher does not follow 4 rows side by side); a prefill tile prefetches on its first
//! activation rows only. Element order suits these bodies: one load and a nibble mask (or a
//! shift) give a block's 32 weights in element order, where the packed groups' [`super::PERM`]
//! order would need a shuffle per weight block.
//!
//! Determinism: each output is the sum, in block order, of `(d_w * d_x) * isum` (FMA into its
//! own lane; Q4_1 and Q4_K add their mins in a second chain, added or subtracted at the end),
//! with `isum` the block's exact integer sum; which tile and which lane compute it does not
//! change a bit, so an output is the same in decode and prefill, for any number of activation
//! rows and any thread count. The unit tests compare every body with a scalar model of this
//! arithmetic, bit for bit.

use std::arch::x86_64::*;

use lowsync_graph::DType;

use super::{Dot8Fn, Q8Rows, QK};
use crate::kernels::quant::q16::x86::{
    hsum_i32, k_scales8, round_block, transpose4x8, u16_at, PREFETCH_FAR,
};

/// The 8-bit body for weights of `dt`, where the CPU has AVX2, FMA and F16C.
pub(crate) fn dot_fn(dt: DType) -> Option<Dot8Fn> {
    let simd = std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c");
    if !simd {
        return None;
    }
    Some(match dt {
        DType::Q4_0 => q4_0,
        DType::Q4_1 => q4_1,
        DType::Q8_0 => q8_0,
        DType::Q4_K => q4_k,
        DType::Q6_K => q6_k,
        _ => return None,
    })
}

/// `super::quantize_blocks` with AVX2: every block by [`quantize_block`].
///
/// # Safety
/// AVX2 is available.
#[target_feature(enable = "avx2")]
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

/// `super::quantize_block` with AVX2, bit for bit (the rounding of `q16::x86::round_block`
/// with limit 127): the bytes in element order, or (where `perm`) permuted within each run of
/// 8 by one shuffle.
///
/// # Safety
/// AVX2 is available.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_block(
    blk: &[f32; QK],
    out: &mut [i8; QK],
    perm: bool,
) -> (f32, [i32; 2]) {
    let (d, qi) = round_block(blk, 127.0);
    let sums = [
        hsum_i32(_mm256_add_epi32(qi[0], qi[1])),
        hsum_i32(_mm256_add_epi32(qi[2], qi[3])),
    ];
    // Pack to bytes (in range, no saturation). The packs work per 128-bit lane: the 32-bit
    // groups come out as elements 0..4, 8..12, 16..20, 24..28, 4..8, 12..16, 20..24, 28..32.
    let a = _mm256_packs_epi32(qi[0], qi[1]);
    let b = _mm256_packs_epi32(qi[2], qi[3]);
    let bytes = _mm256_packs_epi16(a, b);
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let bytes = if perm {
        // Within each 8 bytes: stored byte j takes element PERM[j].
        let shuf = _mm256_setr_epi8(
            0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15, 0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9,
            13, 10, 14, 11, 15,
        );
        _mm256_shuffle_epi8(bytes, shuf)
    } else {
        bytes
    };
    _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes);
    (d, sums)
}

/// One tile's activations: `d`, `s`, `n` and `q` of its rows, `nb` blocks each.
struct Act8<'a> {
    d: &'a [f32],
    s: &'a [f32],
    n: &'a [[i32; 2]],
    q: &'a [i8],
    nb: usize,
}

/// A tile's 4 weight rows: each row's first byte (a tile past the last row repeats the last
/// row, whose results are then not stored).
type Rows4 = [*const u8; 4];

/// Calls `$body::<R>` over tiles of 4 weight rows by 8, 4, 2 or 1 activation rows. The results
/// do not depend on the tile (see the module's Determinism).
macro_rules! wrapper {
    ($name:ident, $body:ident, $bb:expr, $per:expr) => {
        fn $name(w: &[u8], row_bytes: usize, x: &Q8Rows, out: &mut [f32]) {
            let rows = w.len().checked_div(row_bytes).unwrap_or(0);
            let m = out.len().checked_div(rows).unwrap_or(0);
            let nb = row_bytes / $bb * $per;
            let ok = rows > 0
                && rows * row_bytes == w.len()
                && rows * m == out.len()
                && row_bytes.is_multiple_of($bb)
                && !x.perm
                && x.blocks_per_row(m) == Some(nb);
            if !ok {
                debug_assert!(false, "{} weight bytes, {row_bytes} a row", w.len());
                out.fill(0.0);
                return;
            }
            for j in (0..rows).step_by(4) {
                let mut p: Rows4 = [w.as_ptr(); 4];
                for (r, p) in p.iter_mut().enumerate() {
                    *p = w[(j + r).min(rows - 1) * row_bytes..].as_ptr();
                }
                let mut i0 = 0;
                while i0 < m {
                    let rn = match m - i0 {
                        8.. => 8,
                        4..8 => 4,
                        2 | 3 => 2,
                        _ => 1,
                    };
                    let act = Act8 {
                        d: &x.d[i0 * nb..(i0 + rn) * nb],
                        s: &x.s[i0 * nb..(i0 + rn) * nb],
                        n: &x.n[i0 * nb..(i0 + rn) * nb],
                        q: &x.q[i0 * nb * QK..(i0 + rn) * nb * QK],
                        nb,
                    };
                    let pf = i0 == 0;
                    let wn = (rows - j).min(4);
                    // SAFETY: `dot_fn` hands these out only after detecting AVX2, FMA and
                    // F16C; each of `p` starts a whole row of `nb` activation blocks' weight
                    // blocks and `act` holds `rn` rows of `nb` blocks, so every load is in
                    // bounds (prefetches may point past the weights; they never fault).
                    unsafe {
                        match rn {
                            8 => store(&$body::<8>(&p, &act, pf), out, (j, wn, rows, i0)),
                            4 => store(&$body::<4>(&p, &act, pf), out, (j, wn, rows, i0)),
                            2 => store(&$body::<2>(&p, &act, pf), out, (j, wn, rows, i0)),
                            _ => store(&$body::<1>(&p, &act, pf), out, (j, wn, rows, i0)),
                        }
                    }
                    i0 += rn;
                }
            }
        }
    };
}
wrapper!(q4_0, q4_0_body, 18, 1);
wrapper!(q4_1, q4_1_body, 20, 1);
wrapper!(q8_0, q8_0_body, 34, 1);
wrapper!(q4_k, q4_k_body, 144, 8);
wrapper!(q6_k, q6_k_body, 210, 8);

/// Writes a tile's results: weight row `j + r` (`r < wn`) times activation row `i0 + i` to
/// `out[(i0 + i) * rows + j + r]`.
#[inline(always)]
fn store<const R: usize>(
    t: &[[f32; 4]; R],
    out: &mut [f32],
    (j, wn, rows, i0): (usize, usize, usize, usize),
) {
    for (i, t) in t.iter().enumerate() {
        let at = (i0 + i) * rows + j;
        out[at..at + wn].copy_from_slice(&t[..wn]);
    }
}

// The helpers below carry no `target_feature` of their own: they are always inlined into a
// body that enables AVX2, FMA and F16C.

/// Activation block `b` of tile row `i`: 32 bytes in element order.
#[inline(always)]
unsafe fn x_block(a: &Act8<'_>, i: usize, b: usize) -> __m256i {
    _mm256_loadu_si256(a.q.as_ptr().add((i * a.nb + b) * QK).cast())
}

/// The f16 at byte `o` of each of the 4 rows, as 4 f32: one conversion for the 4 rows.
#[inline(always)]
unsafe fn f16x4(p: &Rows4, o: usize) -> __m128 {
    let v = _mm_cvtsi32_si128(u16_at(p[0].add(o)) | (u16_at(p[1].add(o)) << 16));
    let v = _mm_insert_epi32::<1>(v, u16_at(p[2].add(o)) | (u16_at(p[3].add(o)) << 16));
    _mm_cvtph_ps(v)
}

/// Prefetches what each of the 4 rows reads `PREFETCH_FAR` bytes past byte `o` (as the q16
/// decode tiles do, into the L2).
#[inline(always)]
unsafe fn prefetch4(p: &Rows4, o: usize) {
    for p in p {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o + PREFETCH_FAR).cast());
    }
}

/// The 32 nibbles of the 16 bytes at `q` in element order (low nibbles 0..16, high 16..32).
#[inline(always)]
unsafe fn nibbles(q: *const u8, m4: __m256i) -> __m256i {
    let v = _mm_loadu_si128(q.cast());
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(v), v), m4)
}

/// Accumulators of a tile of `R` activation rows: `acc[k]` holds activation row `2k` in its
/// low 4 lanes and row `2k + 1` in its high 4 lanes, lane `r` of a half being weight row `r`
/// (one 8-lane FMA for 8 outputs; where `R == 1`, the high half stays zero).
type Acc = [__m256; 4];

/// The two activation rows of accumulator `k` (the second the first again where `R == 1`).
#[inline(always)]
fn rows_of<const R: usize>(k: usize) -> (usize, usize) {
    (2 * k, (2 * k + 1).min(R - 1))
}

/// `[x; 4]` for row `i0` in the low half and `[y; 4]` for row `i1` in the high half.
#[inline(always)]
unsafe fn halves(x: f32, y: f32) -> __m256 {
    _mm256_set_m128(_mm_set1_ps(y), _mm_set1_ps(x))
}

/// The exact integer sums of accumulator `k`'s two activation rows (see [`Acc`]), from
/// `prods(i)`: row `i`'s 4 product vectors (weight row `r`'s sum is the sum of the 8 lanes of
/// `prods(i)[r]`). Each row's 4 vectors are transposed and added within 128-bit halves by
/// 6 unpacks and 3 adds (3 `phaddd` do the same work in more micro-ops: a Q4_0 tile took
/// 0.99 ns per block and pair with them, 0.94 with the unpacks, one loaded run each), then the
/// halves of the two rows meet in 2 lane permutes and one add.
#[inline(always)]
unsafe fn pair_sums<const R: usize>(
    k: usize,
    mut prods: impl FnMut(usize) -> [__m256i; 4],
) -> __m256i {
    let lane_sums = |p: [__m256i; 4]| {
        let a = _mm256_add_epi32(
            _mm256_unpacklo_epi32(p[0], p[1]),
            _mm256_unpackhi_epi32(p[0], p[1]),
        );
        let b = _mm256_add_epi32(
            _mm256_unpacklo_epi32(p[2], p[3]),
            _mm256_unpackhi_epi32(p[2], p[3]),
        );
        _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
    };
    let (i0, i1) = rows_of::<R>(k);
    let h0 = lane_sums(prods(i0));
    if R == 1 {
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(h0),
            _mm256_extracti128_si256::<1>(h0),
        );
        return _mm256_zextsi128_si256(s);
    }
    let h1 = lane_sums(prods(i1));
    // Each 128-bit half of h0 holds the 4 rows' sums over half of the lanes.
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(h0, h1),
        _mm256_permute2x128_si256::<0x31>(h0, h1),
    )
}

/// A tile's results from its accumulators (see [`Acc`]).
#[inline(always)]
unsafe fn out<const R: usize>(acc: &Acc) -> [[f32; 4]; R] {
    let mut o = [[0.0f32; 4]; R];
    for (k, a) in acc.iter().enumerate().take(R.div_ceil(2)) {
        let mut v = [0.0f32; 8];
        _mm256_storeu_ps(v.as_mut_ptr(), *a);
        o[2 * k].copy_from_slice(&v[..4]);
        if 2 * k + 1 < R {
            o[2 * k + 1].copy_from_slice(&v[4..]);
        }
    }
    o
}

/// `acc[k] += (dw * d_x) * sums` for accumulator `k` of block `b`.
#[inline(always)]
unsafe fn fma_block<const R: usize>(
    acc: &mut __m256,
    k: usize,
    dw: __m256,
    a: &Act8<'_>,
    b: usize,
    sums: __m256i,
) {
    let (i0, i1) = rows_of::<R>(k);
    let dx = halves(a.d[i0 * a.nb + b], a.d[i1 * a.nb + b]);
    *acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sums), *acc);
}

/// `mins[k] += mw * s_x` for accumulator `k` of block `b` (types with a min).
#[inline(always)]
unsafe fn fma_mins<const R: usize>(
    mins: &mut __m256,
    k: usize,
    mw: __m256,
    a: &Act8<'_>,
    b: usize,
) {
    let (i0, i1) = rows_of::<R>(k);
    let s = halves(a.s[i0 * a.nb + b], a.s[i1 * a.nb + b]);
    *mins = _mm256_fmadd_ps(mw, s, *mins);
}

/// The 4 rows' f16 at byte `o` in both halves (see [`Acc`]).
#[inline(always)]
unsafe fn f16x4x2(p: &Rows4, o: usize) -> __m256 {
    let v = f16x4(p, o);
    _mm256_set_m128(v, v)
}

/// The 4 rows' nibble products with activation row `i` of block `b`, `pmaddubsw` widened by
/// `pmaddwd` with ones.
#[inline(always)]
unsafe fn prods_u8(wq: &[__m256i; 4], a: &Act8<'_>, i: usize, b: usize) -> [__m256i; 4] {
    let (x, ones) = (x_block(a, i, b), _mm256_set1_epi16(1));
    let mut p = [_mm256_setzero_si256(); 4];
    for (p, w) in p.iter_mut().zip(wq) {
        *p = _mm256_madd_epi16(_mm256_maddubs_epi16(*w, x), ones);
    }
    p
}

/// Q4_0: nibbles `q` (0..15), values `q - 8`: the offset comes off the 4 sums at once as
/// `8 * n_x`, the activation block's integer sum.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_body<const R: usize>(p: &Rows4, a: &Act8<'_>, pf: bool) -> [[f32; 4]; R] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc: Acc = [_mm256_setzero_ps(); 4];
    for b in 0..a.nb {
        let o = b * 18;
        if pf {
            prefetch4(p, o);
        }
        let mut wq = [_mm256_setzero_si256(); 4];
        for (wq, p) in wq.iter_mut().zip(p) {
            *wq = nibbles(p.add(o + 2), m4);
        }
        let dw = f16x4x2(p, o);
        for (k, acc) in acc.iter_mut().enumerate().take(R.div_ceil(2)) {
            let (i0, i1) = rows_of::<R>(k);
            let off = |i: usize| {
                let n = a.n[i * a.nb + b];
                _mm_set1_epi32(8 * (n[0] + n[1]))
            };
            let off = _mm256_set_m128i(off(i1), off(i0));
            let sums = _mm256_sub_epi32(pair_sums::<R>(k, |i| prods_u8(&wq, a, i, b)), off);
            fma_block::<R>(acc, k, dw, a, b, sums);
        }
    }
    out(&acc)
}

/// Q4_1: nibbles times `d`, plus `m * s_x` in a chain of their own.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_body<const R: usize>(p: &Rows4, a: &Act8<'_>, pf: bool) -> [[f32; 4]; R] {
    let m4 = _mm256_set1_epi8(0x0F);
    let (mut acc, mut mins): (Acc, Acc) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
    for b in 0..a.nb {
        let o = b * 20;
        if pf {
            prefetch4(p, o);
        }
        let mut wq = [_mm256_setzero_si256(); 4];
        for (wq, p) in wq.iter_mut().zip(p) {
            *wq = nibbles(p.add(o + 4), m4);
        }
        let (dw, mw) = (f16x4x2(p, o), f16x4x2(p, o + 2));
        for k in 0..R.div_ceil(2) {
            let sums = pair_sums::<R>(k, |i| prods_u8(&wq, a, i, b));
            fma_block::<R>(&mut acc[k], k, dw, a, b, sums);
            fma_mins::<R>(&mut mins[k], k, mw, a, b);
        }
    }
    for (acc, mins) in acc.iter_mut().zip(&mins) {
        *acc = _mm256_add_ps(*acc, *mins);
    }
    out(&acc)
}

/// Q8_0: signed bytes; `|w|` is the unsigned operand and each activation takes the sign of its
/// weight (`psignb`; a zero weight zeroes its product either way).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_body<const R: usize>(p: &Rows4, a: &Act8<'_>, pf: bool) -> [[f32; 4]; R] {
    let ones = _mm256_set1_epi16(1);
    let mut acc: Acc = [_mm256_setzero_ps(); 4];
    for b in 0..a.nb {
        let o = b * 34;
        if pf {
            prefetch4(p, o);
        }
        let (mut wr, mut wa) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
        for r in 0..4 {
            wr[r] = _mm256_loadu_si256(p[r].add(o + 2).cast());
            wa[r] = _mm256_abs_epi8(wr[r]);
        }
        let dw = f16x4x2(p, o);
        for (k, acc) in acc.iter_mut().enumerate().take(R.div_ceil(2)) {
            let sums = pair_sums::<R>(k, |i| {
                let x = x_block(a, i, b);
                let mut s = [_mm256_setzero_si256(); 4];
                for r in 0..4 {
                    let prod = _mm256_maddubs_epi16(wa[r], _mm256_sign_epi8(x, wr[r]));
                    s[r] = _mm256_madd_epi16(prod, ones);
                }
                s
            });
            fma_block::<R>(acc, k, dw, a, b, sums);
        }
    }
    out(&acc)
}

/// Q4_K: 8 sub-blocks of 32 a super-block, each one activation block; per super-block the 4
/// rows' scales and mins are decoded once (`k_scales8`) and transposed so that each
/// sub-block's 4 rows sit side by side.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_body<const R: usize>(p: &Rows4, a: &Act8<'_>, pf: bool) -> [[f32; 4]; R] {
    let m4 = _mm256_set1_epi8(0x0F);
    let (mut acc, mut mins): (Acc, Acc) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
    for sb in 0..a.nb / 8 {
        let o = sb * 144;
        let z = _mm256_setzero_ps();
        let (mut sc, mut mn) = ([z; 4], [z; 4]);
        for r in 0..4 {
            (sc[r], mn[r]) = k_scales8(p[r].add(o));
        }
        let (f, mn) = (transpose4x8(&sc), transpose4x8(&mn));
        for j in 0..8 {
            let b = sb * 8 + j;
            if pf {
                prefetch4(p, o + 18 * j);
            }
            // Sub-block j: the low (j even) or high (j odd) nibbles of the 32 bytes at
            // 16 + 32 * (j / 2).
            let mut wq = [_mm256_setzero_si256(); 4];
            for (wq, p) in wq.iter_mut().zip(p) {
                let v = _mm256_loadu_si256(p.add(o + 16 + 32 * (j / 2)).cast());
                let v = if j % 2 == 1 {
                    _mm256_srli_epi16::<4>(v)
                } else {
                    v
                };
                *wq = _mm256_and_si256(v, m4);
            }
            // Sub-block j's 4 scales (mins) in both halves.
            let (fj, mj) = if j < 4 {
                (
                    _mm256_permute2f128_ps::<0x00>(f[j], f[j]),
                    _mm256_permute2f128_ps::<0x00>(mn[j], mn[j]),
                )
            } else {
                (
                    _mm256_permute2f128_ps::<0x11>(f[j - 4], f[j - 4]),
                    _mm256_permute2f128_ps::<0x11>(mn[j - 4], mn[j - 4]),
                )
            };
            for k in 0..R.div_ceil(2) {
                let sums = pair_sums::<R>(k, |i| prods_u8(&wq, a, i, b));
                fma_block::<R>(&mut acc[k], k, fj, a, b, sums);
                fma_mins::<R>(&mut mins[k], k, mj, a, b);
            }
        }
    }
    for (acc, mins) in acc.iter_mut().zip(&mins) {
        *acc = _mm256_sub_ps(*acc, *mins);
    }
    out(&acc)
}

/// Byte shuffles that spread i16 scale `2g` over the low 128-bit half and `2g + 1` over the
/// high half of a vector holding 8 scales in each half ([`q6_k_body`]).
const SCALE_PICK: [[u8; 32]; 4] = {
    let mut t = [[0u8; 32]; 4];
    let mut g = 0;
    while g < 4 {
        let mut l = 0;
        while l < 32 {
            let s = (2 * g + l / 16) as u8;
            t[g][l] = 2 * s + (l % 2) as u8;
            l += 1;
        }
        g += 1;
    }
    t
};

/// Q6_K: 16 sub-blocks of 16 a super-block (two per activation block), values `q - 32` with
/// `q` 6 bits. `pmaddubsw(q, x) - pmaddubsw(32, x)` gives the pair sums of `(q - 32) * x`
/// (at most `32 * 127 * 2` in magnitude), and `pmaddwd` by the sub-blocks' 8-bit scales (one
/// per 16-bit half of the vector: 8 pairs, 16 elements) multiplies them in, so each block's
/// sum over both sub-blocks is one exact integer scaled by `d_w * d_x`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_body<const R: usize>(p: &Rows4, a: &Act8<'_>, pf: bool) -> [[f32; 4]; R] {
    let (m4, m2, c32) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(0x03),
        _mm256_set1_epi8(32),
    );
    let mut acc: Acc = [_mm256_setzero_ps(); 4];
    for sb in 0..a.nb / 8 {
        let o = sb * 210;
        let dw = f16x4x2(p, o + 208);
        // Per row, the 16 sub-block scales as i16, sub-blocks 0..8 in both 128-bit halves
        // (`scl`) and 8..16 (`sch`): block j's two scales are then one byte shuffle away.
        let z = _mm256_setzero_si256();
        let (mut scl, mut sch) = ([z; 4], [z; 4]);
        for r in 0..4 {
            let s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p[r].add(o + 192).cast()));
            scl[r] = _mm256_permute2x128_si256::<0x00>(s16, s16);
            sch[r] = _mm256_permute2x128_si256::<0x11>(s16, s16);
        }
        for half in 0..2 {
            for (g, pick) in SCALE_PICK.iter().enumerate() {
                let b = sb * 8 + half * 4 + g;
                if pf {
                    prefetch4(p, o + 26 * (half * 4 + g));
                }
                // Elements half*128 + 32g .. +32: the nibbles of ql bytes
                // half*64 + (g%2)*32 .. (low for g < 2, high after), and the 2 bits of the qh
                // bytes at shift 2g; sub-blocks 8 * half + 2g and + 1.
                let (mut wq, mut sc) = ([z; 4], [z; 4]);
                for r in 0..4 {
                    let q = p[r].add(o);
                    let ql = _mm256_loadu_si256(q.add(64 * half + 32 * (g % 2)).cast());
                    let qh = _mm256_loadu_si256(q.add(128 + 32 * half).cast());
                    let lo = if g < 2 {
                        _mm256_and_si256(ql, m4)
                    } else {
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4)
                    };
                    let hi = match g {
                        0 => _mm256_and_si256(qh, m2),
                        1 => _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                        2 => _mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2),
                        _ => _mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2),
                    };
                    wq[r] = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi));
                    let s = if half == 0 { scl[r] } else { sch[r] };
                    sc[r] = _mm256_shuffle_epi8(s, _mm256_loadu_si256(pick.as_ptr().cast()));
                }
                for (k, acc) in acc.iter_mut().enumerate().take(R.div_ceil(2)) {
                    let sums = pair_sums::<R>(k, |i| {
                        let x = x_block(a, i, b);
                        let x32 = _mm256_maddubs_epi16(c32, x);
                        let mut s = [_mm256_setzero_si256(); 4];
                        for r in 0..4 {
                            let prod = _mm256_sub_epi16(_mm256_maddubs_epi16(wq[r], x), x32);
                            s[r] = _mm256_madd_epi16(prod, sc[r]);
                        }
                        s
                    });
                    fma_block::<R>(acc, k, dw, a, b, sums);
                }
            }
        }
    }
    out(&acc)
}

#[cfg(test)]
mod tests {
    //! Every body against a scalar model of its arithmetic (exact integer sums per block,
    //! `(d_w * d_x) * isum` fused into a chain in block order, mins in a chain of their own),
    //! bit for bit, over odd shapes: weight rows not a multiple of the tile, 1..17 activation
    //! rows, 1..9 blocks (1..3 super-blocks).

    use super::*;
    use crate::kernels::quant::q16::x86::tests::rows;
    use crate::kernels::quant::scalar::{f16_at as f16s, k_scale_min};

    fn have_simd() -> bool {
        dot_fn(DType::Q4_0).is_some()
    }

    /// Activations with blocks of every size, zeros and a lone large value included.
    fn activations(m: usize, k: usize, seed: u64) -> (Vec<f32>, Q8Rows) {
        let mut st = seed;
        let x: Vec<f32> = (0..m * k)
            .map(|i| {
                st = st
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let u = (st >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                match (i / QK) % 7 {
                    0 => 0.0,
                    1 if i % QK == 5 => 300.0,
                    _ => u * 10f32.powi((i / QK % 5) as i32 - 2),
                }
            })
            .collect();
        let q = Q8Rows::quantize_elements(&x);
        (x, q)
    }

    /// Weight row `row` times activation row `xr` (`nb` blocks) as the bodies compute it: per
    /// block the exact integer sum of the weights' integers (offsets applied, Q6_K's sub-block
    /// scales multiplied in) and the activation values, scaled by `d_w * d_x` (Q4_K: `d * sc`)
    /// and fused into one chain in block order; Q4_1's and Q4_K's mins in a second chain.
    fn reference(dt: DType, row: &[u8], x: &Q8Rows, xr: usize, nb: usize) -> f32 {
        let xv = |b: usize, l: usize| i32::from(x.value(xr * nb + b, l));
        let xd = |b: usize| x.d[xr * nb + b];
        let xs = |b: usize| x.s[xr * nb + b];
        let (mut acc, mut mins) = (0.0f32, 0.0f32);
        for b in 0..nb {
            match dt {
                DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
                    let bb = dt.block_bytes();
                    let blk = &row[b * bb..(b + 1) * bb];
                    let w = |l: usize| -> i32 {
                        match dt {
                            DType::Q4_0 => i32::from((blk[2 + l % 16] >> (4 * (l / 16))) & 15) - 8,
                            DType::Q4_1 => i32::from((blk[4 + l % 16] >> (4 * (l / 16))) & 15),
                            _ => i32::from(blk[2 + l] as i8),
                        }
                    };
                    let isum: i32 = (0..QK).map(|l| w(l) * xv(b, l)).sum();
                    acc = (f16s(blk, 0) * xd(b)).mul_add(isum as f32, acc);
                    if dt == DType::Q4_1 {
                        mins = f16s(blk, 2).mul_add(xs(b), mins);
                    }
                }
                DType::Q4_K => {
                    let blk = &row[b / 8 * 144..(b / 8 + 1) * 144];
                    let j = b % 8;
                    let (sc, mn) = k_scale_min(&blk[4..16], j);
                    let w =
                        |l: usize| i32::from((blk[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15);
                    let isum: i32 = (0..QK).map(|l| w(l) * xv(b, l)).sum();
                    let f = f16s(blk, 0) * f32::from(sc);
                    acc = (f * xd(b)).mul_add(isum as f32, acc);
                    mins = (f16s(blk, 2) * f32::from(mn)).mul_add(xs(b), mins);
                }
                DType::Q6_K => {
                    let blk = &row[b / 8 * 210..(b / 8 + 1) * 210];
                    let (half, g) = ((b % 8) / 4, b % 4);
                    let w = |l: usize| -> i32 {
                        let ql = blk[64 * half + 32 * (g % 2) + l];
                        let lo = if g < 2 { ql & 15 } else { ql >> 4 };
                        let hi = (blk[128 + 32 * half + l] >> (2 * g)) & 3;
                        i32::from(lo | (hi << 4)) - 32
                    };
                    let e = half * 128 + 32 * g;
                    let isum: i32 = (0..QK)
                        .map(|l| i32::from(blk[192 + (e + l) / 16] as i8) * w(l) * xv(b, l))
                        .sum();
                    acc = (f16s(blk, 208) * xd(b)).mul_add(isum as f32, acc);
                }
                _ => unreachable!(),
            }
        }
        match dt {
            DType::Q4_1 => acc + mins,
            DType::Q4_K => acc - mins,
            _ => acc,
        }
    }

    /// `(block bytes, f16 offsets, activation blocks per weight block)` of each type.
    fn layout(dt: DType) -> (usize, &'static [usize], usize) {
        match dt {
            DType::Q4_0 => (18, &[0], 1),
            DType::Q4_1 => (20, &[0, 2], 1),
            DType::Q8_0 => (34, &[0], 1),
            DType::Q4_K => (144, &[0, 2], 8),
            _ => (210, &[208], 8),
        }
    }

    #[test]
    fn every_body_gives_the_bits_of_the_scalar_model() {
        if !have_simd() {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C");
            return;
        }
        for dt in [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            let (bb, halves, per) = layout(dt);
            let dot = dot_fn(dt).expect("a body");
            let blocks: &[usize] = if per == 1 { &[1, 2, 5, 9] } else { &[1, 2, 3] };
            for &nw in blocks {
                let (row_bytes, nb) = (nw * bb, nw * per);
                for n in [1, 3, 4, 5, 7, 9] {
                    let w = rows(n, row_bytes, bb, halves, 17 + n as u64);
                    for m in 1..=17 {
                        let (_, x) = activations(m, nb * QK, m as u64);
                        let mut got = vec![f32::NAN; m * n];
                        dot(&w, row_bytes, &x, &mut got);
                        for i in 0..m {
                            for r in 0..n {
                                let row = &w[r * row_bytes..(r + 1) * row_bytes];
                                let want = reference(dt, row, &x, i, nb);
                                assert_eq!(
                                    got[i * n + r].to_bits(),
                                    want.to_bits(),
                                    "{dt} blocks {nb} n {n} m {m}: row {r} x {i}: {} vs {want}",
                                    got[i * n + r]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn q8_0_extremes_do_not_saturate() {
        if !have_simd() {
            return;
        }
        // Weights of -128 and 127 against activations of +-127: the largest pair sums.
        let mut blk = vec![0u8; 34];
        blk[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
        for l in 0..32 {
            blk[2 + l] = if l % 2 == 0 { 0x80 } else { 0x7F };
        }
        let x: Vec<f32> = (0..32)
            .map(|l| if l % 4 < 2 { -1.0 } else { 1.0 })
            .collect();
        let xq = Q8Rows::quantize_elements(&x);
        let mut out = [0.0f32];
        dot_fn(DType::Q8_0).expect("a body")(&blk, 34, &xq, &mut out);
        let want: i32 = (0..32)
            .map(|l| i32::from(blk[2 + l] as i8) * i32::from(xq.value(0, l)))
            .sum();
        assert_eq!(out[0], xq.d[0] * want as f32);
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn q8_speed() {
        // The 8-bit bodies against q16's AVX2 bodies in one process, alternated: ns per block,
        // weight row and activation row (`cargo test --release -p lowsync-cpu q8_speed --
        // --ignored --nocapture`).
        use crate::kernels::quant::q16::{dot_fn as dot16, Isa, QRows};
        if !have_simd() {
            return;
        }
        let k = 2048;
        for dt in [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            let (bb, halves, per) = layout(dt);
            let row_bytes = k / QK / per * bb;
            for (m, n, reps) in [(128usize, 64usize, 4usize), (1, 4096, 8)] {
                let w = rows(n, row_bytes, bb, halves, 3);
                let (x, x8) = activations(m, k, 5);
                let x16 = QRows::quantize(&x);
                let (d8, d16) = (dot_fn(dt).expect("8"), dot16(dt, Isa::Avx2).expect("16"));
                let mut out = vec![0.0f32; m * n];
                let units = (n * m * (k / QK) * reps) as f64;
                let (mut b8, mut b16) = (f64::MAX, f64::MAX);
                for _ in 0..7 {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        d16(&w, row_bytes, &x16, &mut out);
                        std::hint::black_box(&mut out);
                    }
                    b16 = b16.min(t.elapsed().as_secs_f64() * 1e9 / units);
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        d8(&w, row_bytes, &x8, &mut out);
                        std::hint::black_box(&mut out);
                    }
                    b8 = b8.min(t.elapsed().as_secs_f64() * 1e9 / units);
                }
                eprintln!(
                    "{dt} m {m} n {n} k {k}: q16 {b16:.3} ns, q8 {b8:.3} ns, {:.2}x",
                    b16 / b8
                );
            }
        }
    }
}
