//! Packed groups of the K block types (Q4_K, Q6_K): see `super`.
//!
//! Why: a Q4_K or Q6_K product read in place pulls 16 weight rows' super-blocks from 16
//! places and unpacks each row's 6-bit scales, nibbles and high bits per block and per
//! product. Packed once, the 16 rows of a group lie super-block by super-block in one
//! contiguous run, their scales already unpacked to bytes lane by lane, and their quants
//! arranged so that a 64-byte load, a shift and a mask (for Q6_K, the high bits merged in by
//! one bit select) give a `vpdpwssd` operand whose 32-bit lane `r` is a pair of row `r`'s
//! values: the layout the AVX-512 panels of `super::super::q16::avx512` build per product.
//!
//! Strategy: a Q4_K super-block of a group is 2368 bytes: the 16 rows' `d` (f16), their
//! `dmin` (f16), the 8 sub-blocks' scales (one byte a row, sub-block by sub-block), their
//! mins likewise, then the 8 sub-blocks' quants, 256 bytes each: four 64-byte vectors, vector
//! `t` holding pairs `4t..4t + 4`, lane `r` = row `r`, pair `4t + i` in bits `4i..4i + 4` of
//! both 16-bit halves (the pair's first value in the low half). A Q6_K super-block is 3392
//! bytes: the low nibbles of its 8 blocks of 32 in that layout (2048 bytes), then their high
//! bits (1024 bytes: two vectors a block, vector `u` holding pairs `8u..8u + 8` in bits
//! `2i..2i + 2` of the halves, stored as `hi ^ 2` so that an arithmetic shift turns them into
//! `16 * (hi - 2)` and the value `lo + 16 * hi - 32` needs no offset), the 16 sub-blocks'
//! scales (one byte a row), the 16 rows' `d`, and 32 bytes of padding so that every
//! super-block starts a whole number of 64-byte lines after the group's start (the 64-byte
//! loads stay within a line where the caller aligns its groups). The dot product of fewer
//! than 8 activation rows (decode: one) runs them 4, 2 or 1 at a time over the whole group,
//! each block's 16 operands unpacked in registers and every row's pair broadcast into a
//! `vpdpwssd`; it reads the group as one stream, prefetched 16 KiB ahead, and with 1 or 2 rows
//! splits each integer sum over four accumulators so that the `vpdpwssd` latency is hidden.
//! A product of 8 rows or more (prefill) takes them in passes of up to 64: per pass, each
//! super-block is unpacked once into an 8 KiB buffer (in the L1) and the pass's rows run over
//! it 8 at a time, their float accumulators kept in memory between super-blocks. With 8-bit
//! activation blocks (`dot8`, `super::super::q8`; prefill only) the passes are the same, each
//! block unpacked into 8 `vpdpbusd` operands whose bytes are single values in the order
//! `Q8Rows` stores them (`v & 0x0F` and `(v >> 4) & 0x0F` of the nibble vectors; Q6_K's two
//! high bits moved into bits 4..6 of each byte by two shifts and masks, so a byte is the
//! unsigned `q`, its `-32` taken off the integer sum as `-32` times the activation half's sum).
//!
//! The AVX2 bodies (`avx2`) read each 64-byte vector as two halves of 8 rows, the same
//! operands with 256-bit instructions, in the same order of float operations.
//!
//! Invariants: each output is computed in the panels' order, so a packed product gives the
//! panels' bits: per activation block, the exact integer sum (Q6_K: per sub-block of 16, which
//! keeps its float scale), converted, times `(d * sc) * d_x`, added by one FMA in block order;
//! for Q4_K the mins `(-(dmin * m)) * s_x` in a second chain by FMA, added at the end. Every
//! product `d * sc` and `dmin * m` is exact in f32 (11-bit by 8-bit), so where it is computed
//! does not matter. The 8-bit passes keep that order for Q4_K; for Q6_K they add per block
//! `((d * sc0) * s0 + (d * sc1) * s1) * d_x` (a product, then FMAs), so their bits are the
//! same for a row whatever the pass and thread, not the 16-bit product's. A `None` row packs to
//! zero bytes: zero scales and, for Q6_K, the value 0 (with 8 bits, `q` 32 against its
//! activation sum's `-32`: zero as well).
// Packing runs on x86-64 only (`lookup`); elsewhere the layout is compiled but unused.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use lowsync_graph::DType;

use super::{GroupRows, PackedType};

/// Values per super-block.
const QK_K: usize = 256;

/// Bytes of a raw Q4_K / Q6_K super-block.
const Q4K_RAW: usize = 144;
const Q6K_RAW: usize = 210;

/// Bytes of one packed super-block of a group, and where its parts start.
const K4_SB: usize = 2368;
const K4_D: usize = 0;
const K4_DMIN: usize = 32;
const K4_SC: usize = 64;
const K4_MIN: usize = 192;
const K4_Q: usize = 320;
const K6_SB: usize = 3392;
const K6_QL: usize = 0;
const K6_QH: usize = 2048;
const K6_SC: usize = 3072;
const K6_D: usize = 3328;

/// The packed layout of `dt`, if this file has one.
pub(super) fn lookup(dt: DType) -> Option<&'static PackedType> {
    #[cfg(target_arch = "x86_64")]
    {
        match dt {
            DType::Q4_K => return Some(&Q4_K),
            DType::Q6_K => return Some(&Q6_K),
            _ => {}
        }
    }
    let _ = dt;
    None
}

#[cfg(target_arch = "x86_64")]
static Q4_K: PackedType = PackedType {
    group_bytes: group_bytes_q4_k,
    pack: pack_q4_k,
    dot: x86::dot_q4_k,
    dot8: Some(x86::dot8_q4_k),
    dot_avx2: avx2::dot_q4_k,
    dot8_avx2: Some(avx2::dot8_q4_k),
};

#[cfg(target_arch = "x86_64")]
static Q6_K: PackedType = PackedType {
    group_bytes: group_bytes_q6_k,
    pack: pack_q6_k,
    dot: x86::dot_q6_k,
    dot8: Some(x86::dot8_q6_k),
    dot_avx2: avx2::dot_q6_k,
    dot8_avx2: Some(avx2::dot8_q6_k),
};

fn group_bytes_q4_k(k: usize) -> usize {
    k / QK_K * K4_SB
}

fn group_bytes_q6_k(k: usize) -> usize {
    k / QK_K * K6_SB
}

/// Where value `l` (0..32) of an activation block's 16 rows goes in a nibble layout of 4
/// vectors of 64 bytes: `(byte offset, shift)` for row `r`.
fn nibble_at(r: usize, l: usize) -> (usize, u32) {
    let (p, h) = (l / 2, l % 2);
    let (t, i) = (p / 4, p % 4);
    (t * 64 + r * 4 + h * 2 + i / 2, 4 * (i % 2) as u32)
}

/// As [`nibble_at`] for the 2-bit layout of 2 vectors of 64 bytes.
fn crumb_at(r: usize, l: usize) -> (usize, u32) {
    let (p, h) = (l / 2, l % 2);
    let (u, i) = (p / 8, p % 8);
    (u * 64 + r * 4 + h * 2 + i / 4, 2 * (i % 4) as u32)
}

/// Packs 16 rows of Q4_K (`k` values each) into the layout of the module header.
fn pack_q4_k(rows: &GroupRows<'_>, k: usize, dst: &mut [u8]) {
    let nsb = k / QK_K;
    assert_eq!(dst.len(), nsb * K4_SB, "a Q4_K group of {k} values");
    dst.fill(0);
    for (r, row) in rows.iter().enumerate() {
        let Some(row) = row else { continue };
        assert_eq!(row.len(), nsb * Q4K_RAW, "a Q4_K row of {k} values");
        for (blk, out) in row.chunks_exact(Q4K_RAW).zip(dst.chunks_exact_mut(K4_SB)) {
            out[K4_D + 2 * r..K4_D + 2 * r + 2].copy_from_slice(&blk[0..2]);
            out[K4_DMIN + 2 * r..K4_DMIN + 2 * r + 2].copy_from_slice(&blk[2..4]);
            for j in 0..8 {
                let (sc, m) = crate::kernels::quant::scalar::k_scale_min(&blk[4..16], j);
                out[K4_SC + 16 * j + r] = sc;
                out[K4_MIN + 16 * j + r] = m;
                for l in 0..32 {
                    let q = (blk[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
                    let (at, shift) = nibble_at(r, l);
                    out[K4_Q + 256 * j + at] |= q << shift;
                }
            }
        }
    }
}

/// Packs 16 rows of Q6_K (`k` values each) into the layout of the module header.
fn pack_q6_k(rows: &GroupRows<'_>, k: usize, dst: &mut [u8]) {
    let nsb = k / QK_K;
    assert_eq!(dst.len(), nsb * K6_SB, "a Q6_K group of {k} values");
    dst.fill(0);
    for (r, row) in rows.iter().enumerate() {
        let Some(row) = row else { continue };
        assert_eq!(row.len(), nsb * Q6K_RAW, "a Q6_K row of {k} values");
        for (blk, out) in row.chunks_exact(Q6K_RAW).zip(dst.chunks_exact_mut(K6_SB)) {
            let (ql, qh) = (&blk[0..128], &blk[128..192]);
            for j in 0..8 {
                // Activation block j: elements 128 * half + 32 * g + l.
                let (half, g) = (j / 4, j % 4);
                for l in 0..32 {
                    let lo = (ql[64 * half + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0x0F;
                    let hi = (qh[32 * half + l] >> (2 * g)) & 3;
                    let (at, shift) = nibble_at(r, l);
                    out[K6_QL + 256 * j + at] |= lo << shift;
                    let (at, shift) = crumb_at(r, l);
                    out[K6_QH + 128 * j + at] |= (hi ^ 2) << shift;
                }
            }
            for s in 0..16 {
                out[K6_SC + 16 * s + r] = blk[192 + s];
            }
            out[K6_D + 2 * r..K6_D + 2 * r + 2].copy_from_slice(&blk[208..210]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512 VNNI dot products of packed K groups (see the parent module's header).

    use std::arch::x86_64::*;

    use super::super::GROUP;
    use super::*;
    use crate::kernels::quant::q16::{QRows, QK};
    use crate::kernels::quant::q8::Q8Rows;

    /// Checks `g`, `x` and `out` against `k` and returns `(super-blocks, activation rows)`.
    pub(super) fn shape(
        g: &[u8],
        sb: usize,
        k: usize,
        x: &QRows,
        out: &[f32],
    ) -> Option<(usize, usize)> {
        let (nsb, nb) = (k / QK_K, k / QK);
        let m = out.len() / GROUP;
        let ok = k.is_multiple_of(QK_K)
            && g.len() == nsb * sb
            && out.len() == m * GROUP
            && x.d.len() == m * nb
            && x.s.len() == x.d.len()
            && x.n.len() == x.d.len()
            && x.q.len() == x.d.len() * QK;
        debug_assert!(ok, "{} group bytes, k {k}, {} outputs", g.len(), out.len());
        ok.then_some((nsb, m))
    }

    /// `v >> n` per 16-bit lane (logical), `n` a constant once inlined.
    #[inline(always)]
    unsafe fn srl16(v: __m512i, n: usize) -> __m512i {
        match n {
            0 => v,
            4 => _mm512_srli_epi16::<4>(v),
            8 => _mm512_srli_epi16::<8>(v),
            _ => _mm512_srli_epi16::<12>(v),
        }
    }

    /// The high bits of pair `i` (0..8) of a 2-bit vector as `16 * (hi - 2)` in bits 4..16 of
    /// each 16-bit lane (bits 0..4 hold other pairs' bits): the field shifted to the top,
    /// then arithmetically down by 10.
    #[inline(always)]
    unsafe fn high16(v: __m512i, i: usize) -> __m512i {
        let top = match i {
            0 => _mm512_slli_epi16::<14>(v),
            1 => _mm512_slli_epi16::<12>(v),
            2 => _mm512_slli_epi16::<10>(v),
            3 => _mm512_slli_epi16::<8>(v),
            4 => _mm512_slli_epi16::<6>(v),
            5 => _mm512_slli_epi16::<4>(v),
            6 => _mm512_slli_epi16::<2>(v),
            _ => v,
        };
        _mm512_srai_epi16::<10>(top)
    }

    /// The 16 operands of a Q4_K block (256 packed bytes at `q`): pair `p`, lane = row.
    #[inline(always)]
    unsafe fn k4_block(q: *const u8) -> [__m512i; 16] {
        let mask = _mm512_set1_epi32(0x000F_000F);
        let mut w = [_mm512_setzero_si512(); 16];
        for t in 0..4 {
            let v = _mm512_loadu_si512(q.add(64 * t).cast());
            for i in 0..4 {
                let s = srl16(v, 4 * i);
                // The top nibble needs no mask after its shift.
                w[4 * t + i] = if i == 3 { s } else { _mm512_and_si512(s, mask) };
            }
        }
        w
    }

    /// The 16 operands of a Q6_K block (`ql`: 256 bytes, `qh`: 128): pair `p`, lane = row,
    /// values `q - 32`.
    #[inline(always)]
    unsafe fn k6_block(ql: *const u8, qh: *const u8) -> [__m512i; 16] {
        let mask = _mm512_set1_epi32(0x000F_000F);
        let hv = [
            _mm512_loadu_si512(qh.cast()),
            _mm512_loadu_si512(qh.add(64).cast()),
        ];
        let mut w = [_mm512_setzero_si512(); 16];
        for t in 0..4 {
            let v = _mm512_loadu_si512(ql.add(64 * t).cast());
            for i in 0..4 {
                let p = 4 * t + i;
                let lo = srl16(v, 4 * i);
                let hi = high16(hv[p / 8], p % 8);
                // Bits 0..4 from the low nibble, the rest from the sign-extended high bits.
                w[p] = _mm512_ternarylogic_epi32::<0xE4>(lo, hi, mask);
            }
        }
        w
    }

    /// The exact integer sums of pairs `p0..p0 + np` of the operands `w` against `R`
    /// activation rows' block (`xb[i]`: the block's pairs). With 4 rows or more, one sum per
    /// row; with fewer, 4 partial sums per row (integer, so the split changes no bit) hide the
    /// `vpdpwssd` latency. Every array index is a constant once the inner loops unroll, so the
    /// sums stay in registers.
    // Index loops: each pair `p` and row `i` address several arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn sums<const R: usize>(
        w: &[__m512i; 16],
        xb: &[*const i32; R],
        p0: usize,
        np: usize,
    ) -> [__m512i; R] {
        // No intrinsic sits in a closure here: a closure does not inherit the caller's target
        // features, and its intrinsics became calls (a product 4x slower).
        let mut part = [[_mm512_setzero_si512(); 4]; R];
        if R >= 4 {
            let mut sum = [_mm512_setzero_si512(); R];
            for i in 0..R {
                sum[i] = _mm512_madd_epi16(w[p0], pair(xb[i], p0));
            }
            for p in p0 + 1..p0 + np {
                for i in 0..R {
                    sum[i] = _mm512_dpwssd_epi32(sum[i], w[p], pair(xb[i], p));
                }
            }
            return sum;
        }
        for i in 0..R {
            for c in 0..4 {
                part[i][c] = _mm512_madd_epi16(w[p0 + c], pair(xb[i], p0 + c));
            }
        }
        for q in (p0 + 4..p0 + np).step_by(4) {
            for i in 0..R {
                for c in 0..4 {
                    part[i][c] = _mm512_dpwssd_epi32(part[i][c], w[q + c], pair(xb[i], q + c));
                }
            }
        }
        let mut sum = [_mm512_setzero_si512(); R];
        for i in 0..R {
            let [a, b, c, d] = part[i];
            sum[i] = _mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d));
        }
        sum
    }

    /// Pair `p` of an activation block (`xb`: its pairs) in every lane.
    #[inline(always)]
    unsafe fn pair(xb: *const i32, p: usize) -> __m512i {
        _mm512_set1_epi32(xb.add(p).read_unaligned())
    }

    /// 16 bytes at `p` as 16 lanes of f32 (unsigned).
    #[inline(always)]
    unsafe fn bytes_ps(p: *const u8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())))
    }

    /// How far ahead of its reads a product prefetches the group's bytes (into the L1). The
    /// hardware prefetcher alone left a decode from DRAM at 0.35-0.5x of the same product from
    /// the cache; measured one thread, k 768 and 2048 (`ns` per weight row and block from DRAM,
    /// Q4_K / Q6_K): none 0.95-1.0 / 1.2-1.4, 8 KiB 0.40-0.42 / 0.60-0.63, 16 KiB 0.33-0.35 /
    /// 0.52-0.53, 20 KiB 0.33-0.34 / 0.50-0.52, 32 KiB 0.36-0.38 / 0.53-0.55; into the L2
    /// (`T1`) 0.45-0.50 / 0.72-0.84 at 8-32 KiB. A run of groups is one stream, so the bytes
    /// ahead are the next group's where a group is shorter.
    const PREFETCH_BYTES: usize = 16 << 10;

    /// Prefetches `lines` cache lines from `at + PREFETCH_BYTES`.
    #[inline(always)]
    unsafe fn prefetch(at: *const u8, lines: usize) {
        for c in 0..lines {
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES + 64 * c).cast());
        }
    }

    /// `R` (at most 4) activation rows from `r0` against a Q4_K group of `nsb` super-blocks,
    /// each block unpacked in registers: for each row, the 16 weight rows' results (lane =
    /// weight row). The decode body (`R` = 1) and the tail of a product of fewer than
    /// [`PASS_ROWS`] rows.
    // Index loops: each row `i` addresses several arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn k4_rows<const R: usize>(g: &[u8], nsb: usize, x: &QRows, r0: usize) -> [__m512; R] {
        let nb = nsb * 8;
        let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        let mut mins = [_mm512_setzero_ps(); R];
        for s in 0..nsb {
            let p = g.as_ptr().add(s * K4_SB);
            let (d, ndmin) = k4_d(p);
            for j in 0..8 {
                let b = 8 * s + j;
                // 8 x 5 lines cover the super-block's 37.
                prefetch(p.add(5 * 64 * j), 5);
                let (fv, mv) = k4_scales(p, d, ndmin, j);
                let w = k4_block(p.add(K4_Q + 256 * j));
                let xb: [*const i32; R] =
                    std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
                let sum = sums::<R>(&w, &xb, 0, 16);
                for i in 0..R {
                    let row = (r0 + i) * nb + b;
                    let scale = _mm512_mul_ps(fv, _mm512_set1_ps(*xd.add(row)));
                    acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum[i]), acc[i]);
                    mins[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(*xs.add(row)), mins[i]);
                }
            }
        }
        for i in 0..R {
            acc[i] = _mm512_add_ps(acc[i], mins[i]);
        }
        acc
    }

    /// A Q4_K super-block's `d` and `-dmin` of the 16 rows.
    #[inline(always)]
    unsafe fn k4_d(p: *const u8) -> (__m512, __m512) {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(K4_D).cast()));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(K4_DMIN).cast()));
        // `-dmin` by its sign bit, as the panels' `-(dmin * m)` negates (zeros included).
        let ndmin = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(dmin),
            _mm512_set1_epi32(i32::MIN),
        ));
        (d, ndmin)
    }

    /// Sub-block `j`'s scales `d * sc` and mins `-dmin * m` of the 16 rows (exact products).
    #[inline(always)]
    unsafe fn k4_scales(p: *const u8, d: __m512, ndmin: __m512, j: usize) -> (__m512, __m512) {
        (
            _mm512_mul_ps(d, bytes_ps(p.add(K4_SC + 16 * j))),
            _mm512_mul_ps(ndmin, bytes_ps(p.add(K4_MIN + 16 * j))),
        )
    }

    /// As [`k4_rows`] for a Q6_K group: two sub-blocks of 16 a block, each with its scale.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn k6_rows<const R: usize>(g: &[u8], nsb: usize, x: &QRows, r0: usize) -> [__m512; R] {
        let nb = nsb * 8;
        let (xq, xd) = (x.q.as_ptr(), x.d.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        for s in 0..nsb {
            let p = g.as_ptr().add(s * K6_SB);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(K6_D).cast()));
            for j in 0..8 {
                let b = 8 * s + j;
                // 8 x 7 lines cover the super-block's 53.
                prefetch(p.add(7 * 64 * j), 7);
                let w = k6_block(p.add(K6_QL + 256 * j), p.add(K6_QH + 128 * j));
                let xb: [*const i32; R] =
                    std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
                for h in 0..2 {
                    let fv = k6_scale(p, d, 2 * j + h);
                    let sum = sums::<R>(&w, &xb, 8 * h, 8);
                    for i in 0..R {
                        let scale = _mm512_mul_ps(fv, _mm512_set1_ps(*xd.add((r0 + i) * nb + b)));
                        acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum[i]), acc[i]);
                    }
                }
            }
        }
        acc
    }

    /// Sub-block `t`'s (of 16) scales `d * sc` of the 16 rows (exact products).
    #[inline(always)]
    unsafe fn k6_scale(p: *const u8, d: __m512, t: usize) -> __m512 {
        let sc = _mm_loadu_si128(p.add(K6_SC + 16 * t).cast());
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)))
    }

    /// Activation rows that one unpacking of a super-block serves in a product of many rows:
    /// their accumulators (and mins) wait in memory between super-blocks, 8 KiB for 64 rows.
    const PASS_ROWS: usize = 64;

    /// A super-block unpacked for a pass of rows: `w[j]` block `j`'s 16 operands, `f[t]` the
    /// scales of its scale groups (Q4_K: one a block; Q6_K: two), `mn[j]` Q4_K's mins.
    struct Unpacked {
        w: [[__m512i; 16]; 8],
        f: [__m512; 16],
        mn: [__m512; 8],
    }

    impl Unpacked {
        fn new() -> Unpacked {
            // SAFETY: all-zero bits are valid vectors.
            unsafe { std::mem::zeroed() }
        }
    }

    /// Unpacks Q4_K super-block `p` (and prefetches ahead of it).
    #[inline(always)]
    unsafe fn k4_unpack(p: *const u8, u: &mut Unpacked) {
        prefetch(p, K4_SB.div_ceil(64));
        let (d, ndmin) = k4_d(p);
        for j in 0..8 {
            (u.f[j], u.mn[j]) = k4_scales(p, d, ndmin, j);
            u.w[j] = k4_block(p.add(K4_Q + 256 * j));
        }
    }

    /// Unpacks Q6_K super-block `p` (and prefetches ahead of it).
    #[inline(always)]
    unsafe fn k6_unpack(p: *const u8, u: &mut Unpacked) {
        prefetch(p, K6_SB.div_ceil(64));
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(K6_D).cast()));
        for j in 0..8 {
            u.w[j] = k6_block(p.add(K6_QL + 256 * j), p.add(K6_QH + 128 * j));
        }
        for t in 0..16 {
            u.f[t] = k6_scale(p, d, t);
        }
    }

    /// `R` activation rows from `r0` over an unpacked super-block whose first activation
    /// block is `b0`: the rows' accumulators from `acc` (and mins from `mins`, `MIN`) and back.
    /// `G` pairs a scale group (16: Q4_K; 8: Q6_K).
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn pass<const R: usize, const G: usize, const MIN: bool>(
        u: &Unpacked,
        x: &QRows,
        r0: usize,
        nb: usize,
        b0: usize,
        acc: &mut [__m512],
        mins: &mut [__m512],
    ) {
        let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
        let mut a: [__m512; R] = std::array::from_fn(|i| acc[i]);
        let mut m: [__m512; R] = std::array::from_fn(|i| if MIN { mins[i] } else { a[i] });
        for j in 0..8 {
            let b = b0 + j;
            let xb: [*const i32; R] =
                std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
            for h in 0..16 / G {
                let sum = sums::<R>(&u.w[j], &xb, G * h, G);
                let fv = u.f[j * (16 / G) + h];
                for i in 0..R {
                    let scale = _mm512_mul_ps(fv, _mm512_set1_ps(*xd.add((r0 + i) * nb + b)));
                    a[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum[i]), a[i]);
                }
            }
            if MIN {
                for i in 0..R {
                    let sx = _mm512_set1_ps(*xs.add((r0 + i) * nb + b));
                    m[i] = _mm512_fmadd_ps(u.mn[j], sx, m[i]);
                }
            }
        }
        acc[..R].copy_from_slice(&a);
        if MIN {
            mins[..R].copy_from_slice(&m);
        }
    }

    /// A product of many activation rows: passes of up to [`PASS_ROWS`] rows; per pass, each
    /// super-block unpacked once and every row of the pass run over it 8 (4, 2, 1) at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn many_rows<const G: usize, const MIN: bool>(
        g: &[u8],
        nsb: usize,
        m: usize,
        x: &QRows,
        out: &mut [f32],
    ) {
        let nb = nsb * 8;
        let mut u = Unpacked::new();
        let mut acc = [_mm512_setzero_ps(); PASS_ROWS];
        let mut mins = [_mm512_setzero_ps(); PASS_ROWS];
        for c0 in (0..m).step_by(PASS_ROWS) {
            let cn = PASS_ROWS.min(m - c0);
            acc[..cn].fill(_mm512_setzero_ps());
            mins[..cn].fill(_mm512_setzero_ps());
            for s in 0..nsb {
                // Called directly, not through a pointer: an `inline(always)` body taken as a
                // pointer is compiled without the caller's target features.
                if MIN {
                    k4_unpack(g.as_ptr().add(s * K4_SB), &mut u);
                } else {
                    k6_unpack(g.as_ptr().add(s * K6_SB), &mut u);
                }
                let mut r = 0;
                while r < cn {
                    let (a, mn) = (&mut acc[r..cn], &mut mins[r..cn]);
                    let (r0, b0) = (c0 + r, 8 * s);
                    r += match cn - r {
                        8.. => {
                            pass::<8, G, MIN>(&u, x, r0, nb, b0, a, mn);
                            8
                        }
                        4..=7 => {
                            pass::<4, G, MIN>(&u, x, r0, nb, b0, a, mn);
                            4
                        }
                        2 | 3 => {
                            pass::<2, G, MIN>(&u, x, r0, nb, b0, a, mn);
                            2
                        }
                        _ => {
                            pass::<1, G, MIN>(&u, x, r0, nb, b0, a, mn);
                            1
                        }
                    };
                }
            }
            for i in 0..cn {
                let v = if MIN {
                    _mm512_add_ps(acc[i], mins[i])
                } else {
                    acc[i]
                };
                _mm512_storeu_ps(out.as_mut_ptr().add((c0 + i) * GROUP), v);
            }
        }
    }

    /// A group's body over `R` activation rows from `r0`.
    type Rows<const R: usize> = unsafe fn(&[u8], usize, &QRows, usize) -> [__m512; R];

    /// Every activation row of `x` against a group: [`many_rows`] from 8 rows, else the
    /// register bodies 4, 2 and 1 rows at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn few_rows(
        g: &[u8],
        nsb: usize,
        m: usize,
        x: &QRows,
        out: &mut [f32],
        bodies: (Rows<4>, Rows<2>, Rows<1>),
    ) {
        let o = out.as_mut_ptr();
        let put = |r0: usize, res: &[__m512]| {
            for (i, v) in res.iter().enumerate() {
                // SAFETY: `shape` checked `out.len() == GROUP * m` and `r0 + i < m`.
                unsafe { o.add((r0 + i) * GROUP).cast::<__m512>().write_unaligned(*v) };
            }
        };
        let mut r0 = 0;
        while r0 < m {
            let rn = match m - r0 {
                4.. => 4,
                2 | 3 => 2,
                _ => 1,
            };
            match rn {
                4 => put(r0, &(bodies.0)(g, nsb, x, r0)),
                2 => put(r0, &(bodies.1)(g, nsb, x, r0)),
                _ => put(r0, &(bodies.2)(g, nsb, x, r0)),
            }
            r0 += rn;
        }
    }

    /// The Q4_K group product (`PackedType::dot`).
    ///
    /// # Safety
    /// As `PackedType::dot`.
    pub(super) unsafe fn dot_q4_k(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
        let Some((nsb, m)) = shape(g, K4_SB, k, x, out) else {
            out.fill(0.0);
            return;
        };
        if m >= 8 {
            return many_rows::<16, true>(g, nsb, m, x, out);
        }
        let bodies = (
            k4_rows::<4> as Rows<4>,
            k4_rows::<2> as Rows<2>,
            k4_rows::<1> as Rows<1>,
        );
        few_rows(g, nsb, m, x, out, bodies);
    }

    /// The Q6_K group product (`PackedType::dot`).
    ///
    /// # Safety
    /// As `PackedType::dot`.
    pub(super) unsafe fn dot_q6_k(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
        let Some((nsb, m)) = shape(g, K6_SB, k, x, out) else {
            out.fill(0.0);
            return;
        };
        if m >= 8 {
            return many_rows::<8, false>(g, nsb, m, x, out);
        }
        let bodies = (
            k6_rows::<4> as Rows<4>,
            k6_rows::<2> as Rows<2>,
            k6_rows::<1> as Rows<1>,
        );
        few_rows(g, nsb, m, x, out, bodies);
    }

    /// A super-block unpacked for a pass of rows with 8-bit activations: `w[j]` block `j`'s 8
    /// `vpdpbusd` operands (lane = weight row, 4 unsigned values a lane in `q8::PERM` order:
    /// Q4_K's nibbles, Q6_K's 6-bit `q` without its `-32`), `f[t]` the scales of its scale
    /// groups (Q4_K: one a block; Q6_K: two), `mn[j]` Q4_K's mins.
    struct Unpacked8 {
        w: [[__m512i; 8]; 8],
        f: [__m512; 16],
        mn: [__m512; 8],
    }

    impl Unpacked8 {
        fn new() -> Unpacked8 {
            // SAFETY: all-zero bits are valid vectors.
            unsafe { std::mem::zeroed() }
        }
    }

    /// The low (`h` 0) or high (`h` 1) nibble of every byte of `v`.
    #[inline(always)]
    unsafe fn nibble8(v: __m512i, h: usize) -> __m512i {
        let mask = _mm512_set1_epi8(0x0F);
        if h == 0 {
            _mm512_and_si512(v, mask)
        } else {
            _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask)
        }
    }

    /// `v` shifted left by `n` bits per 32-bit lane (right by `-n` where `n` is negative), `n`
    /// a constant once inlined.
    #[inline(always)]
    unsafe fn shift32(v: __m512i, n: i32) -> __m512i {
        match n {
            8 => _mm512_slli_epi32::<8>(v),
            6 => _mm512_slli_epi32::<6>(v),
            4 => _mm512_slli_epi32::<4>(v),
            2 => _mm512_slli_epi32::<2>(v),
            0 => v,
            -2 => _mm512_srli_epi32::<2>(v),
            -4 => _mm512_srli_epi32::<4>(v),
            _ => _mm512_srli_epi32::<6>(v),
        }
    }

    /// Unpacks Q4_K super-block `p` for 8-bit activations (and prefetches ahead of it).
    #[inline(always)]
    unsafe fn k4_unpack8(p: *const u8, u: &mut Unpacked8) {
        prefetch(p, K4_SB.div_ceil(64));
        let (d, ndmin) = k4_d(p);
        for j in 0..8 {
            (u.f[j], u.mn[j]) = k4_scales(p, d, ndmin, j);
            for t in 0..4 {
                let v = _mm512_loadu_si512(p.add(K4_Q + 256 * j + 64 * t).cast());
                u.w[j][2 * t] = nibble8(v, 0);
                u.w[j][2 * t + 1] = nibble8(v, 1);
            }
        }
    }

    /// Unpacks Q6_K super-block `p` for 8-bit activations (and prefetches ahead of it). The
    /// operand of nibble half `h` of vector `t` holds, in byte `c` of a lane, pair
    /// `4t + 2 (c % 2) + h`'s value `c / 2`: its low nibble comes from the same nibble layout
    /// as Q4_K's; its high bits from the 2-bit vector `t / 2`, where that pair's field sits at
    /// bit `16 (c / 2) + 2 (4 (t % 2) + 2 (c % 2) + h)`. Bytes 0 and 2 take one shift, 1 and 3
    /// another (4 bits more), each into bits 4..6 of the byte; the stored `hi ^ 2` is undone by
    /// an xor.
    #[inline(always)]
    unsafe fn k6_unpack8(p: *const u8, u: &mut Unpacked8) {
        prefetch(p, K6_SB.div_ceil(64));
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(K6_D).cast()));
        let (m02, m13) = (
            _mm512_set1_epi32(0x0030_0030),
            _mm512_set1_epi32(0x3000_3000),
        );
        let flip = _mm512_set1_epi8(0x20);
        for j in 0..8 {
            let qh = p.add(K6_QH + 128 * j);
            let hv = [
                _mm512_loadu_si512(qh.cast()),
                _mm512_loadu_si512(qh.add(64).cast()),
            ];
            for t in 0..4 {
                let v = _mm512_loadu_si512(p.add(K6_QL + 256 * j + 64 * t).cast());
                for h in 0..2 {
                    let a = 4 - 8 * (t % 2) as i32 - 2 * h as i32;
                    let hi02 = _mm512_and_si512(shift32(hv[t / 2], a), m02);
                    let hi13 = _mm512_and_si512(shift32(hv[t / 2], a + 4), m13);
                    let hi = _mm512_xor_si512(_mm512_or_si512(hi02, hi13), flip);
                    u.w[j][2 * t + h] = _mm512_or_si512(nibble8(v, h), hi);
                }
            }
        }
        for t in 0..16 {
            u.f[t] = k6_scale(p, d, t);
        }
    }

    /// `R` activation rows from `r0` (8-bit blocks) over an unpacked super-block whose first
    /// activation block is `b0`, as [`pass`]: per block, the exact integer sum of each scale
    /// group by `vpdpbusd` (Q4_K: the block; Q6_K: each half, from `-32` times the half's
    /// activation sum), converted; Q4_K's times `f * d_x` added by one FMA, its mins in a second
    /// chain; Q6_K's two as `(f0 * s0 + f1 * s1) * d_x` by one product and two FMAs (two
    /// products and FMAs fewer than a scaled FMA per half: 1.42-1.45x -> 1.56-1.60x the 16-bit
    /// body per block in `packed8_k_speed`).
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn pass8<const R: usize, const MIN: bool>(
        u: &Unpacked8,
        x: &Q8Rows,
        r0: usize,
        nb: usize,
        b0: usize,
        acc: &mut [__m512],
        mins: &mut [__m512],
    ) {
        let (xq, xd, xs, xn) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr(), x.n.as_ptr());
        let mut a: [__m512; R] = std::array::from_fn(|i| acc[i]);
        let mut m: [__m512; R] = std::array::from_fn(|i| if MIN { mins[i] } else { a[i] });
        for j in 0..8 {
            let b = b0 + j;
            let xb: [*const i32; R] =
                std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
            if MIN {
                // Q4_K: the block is one scale group.
                let mut sum = [_mm512_setzero_si512(); R];
                for o in 0..8 {
                    let w = u.w[j][o];
                    for i in 0..R {
                        let xv = _mm512_set1_epi32(xb[i].add(o).read_unaligned());
                        sum[i] = _mm512_dpbusd_epi32(sum[i], w, xv);
                    }
                }
                for i in 0..R {
                    let scale = _mm512_mul_ps(u.f[j], _mm512_set1_ps(*xd.add((r0 + i) * nb + b)));
                    a[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum[i]), a[i]);
                }
            } else {
                // Q6_K: both halves' sums (operands 0..4 and 4..8), each from -32 times its
                // activation sum, then `(f0 * s0 + f1 * s1) * d_x` by one product and two FMAs.
                let mut sum: [[__m512i; 2]; R] = std::array::from_fn(|i| {
                    let [n0, n1] = *xn.add((r0 + i) * nb + b);
                    [_mm512_set1_epi32(-32 * n0), _mm512_set1_epi32(-32 * n1)]
                });
                for o in 0..8 {
                    let w = u.w[j][o];
                    for i in 0..R {
                        let xv = _mm512_set1_epi32(xb[i].add(o).read_unaligned());
                        sum[i][o / 4] = _mm512_dpbusd_epi32(sum[i][o / 4], w, xv);
                    }
                }
                let (f0, f1) = (u.f[2 * j], u.f[2 * j + 1]);
                for i in 0..R {
                    let t = _mm512_mul_ps(f0, _mm512_cvtepi32_ps(sum[i][0]));
                    let t = _mm512_fmadd_ps(f1, _mm512_cvtepi32_ps(sum[i][1]), t);
                    let dx = _mm512_set1_ps(*xd.add((r0 + i) * nb + b));
                    a[i] = _mm512_fmadd_ps(t, dx, a[i]);
                }
            }
            if MIN {
                for i in 0..R {
                    let sx = _mm512_set1_ps(*xs.add((r0 + i) * nb + b));
                    m[i] = _mm512_fmadd_ps(u.mn[j], sx, m[i]);
                }
            }
        }
        acc[..R].copy_from_slice(&a);
        if MIN {
            mins[..R].copy_from_slice(&m);
        }
    }

    /// As [`many_rows`] with 8-bit activation blocks, for any number of rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn many_rows8<const MIN: bool>(
        g: &[u8],
        nsb: usize,
        m: usize,
        x: &Q8Rows,
        out: &mut [f32],
    ) {
        let nb = nsb * 8;
        let mut u = Unpacked8::new();
        let mut acc = [_mm512_setzero_ps(); PASS_ROWS];
        let mut mins = [_mm512_setzero_ps(); PASS_ROWS];
        for c0 in (0..m).step_by(PASS_ROWS) {
            let cn = PASS_ROWS.min(m - c0);
            acc[..cn].fill(_mm512_setzero_ps());
            mins[..cn].fill(_mm512_setzero_ps());
            for s in 0..nsb {
                // Called directly, not through a pointer (see `many_rows`).
                if MIN {
                    k4_unpack8(g.as_ptr().add(s * K4_SB), &mut u);
                } else {
                    k6_unpack8(g.as_ptr().add(s * K6_SB), &mut u);
                }
                let mut r = 0;
                while r < cn {
                    let (a, mn) = (&mut acc[r..cn], &mut mins[r..cn]);
                    let (r0, b0) = (c0 + r, 8 * s);
                    r += match cn - r {
                        8.. => {
                            pass8::<8, MIN>(&u, x, r0, nb, b0, a, mn);
                            8
                        }
                        4..=7 => {
                            pass8::<4, MIN>(&u, x, r0, nb, b0, a, mn);
                            4
                        }
                        2 | 3 => {
                            pass8::<2, MIN>(&u, x, r0, nb, b0, a, mn);
                            2
                        }
                        _ => {
                            pass8::<1, MIN>(&u, x, r0, nb, b0, a, mn);
                            1
                        }
                    };
                }
            }
            for i in 0..cn {
                let v = if MIN {
                    _mm512_add_ps(acc[i], mins[i])
                } else {
                    acc[i]
                };
                _mm512_storeu_ps(out.as_mut_ptr().add((c0 + i) * GROUP), v);
            }
        }
    }

    /// Checks `g`, `x` and `out` against `k` for an 8-bit product: `(super-blocks, rows)`.
    pub(super) fn shape8(
        g: &[u8],
        sb: usize,
        k: usize,
        x: &Q8Rows,
        out: &[f32],
    ) -> Option<(usize, usize)> {
        let nsb = k / QK_K;
        let m = out.len() / GROUP;
        let ok = k.is_multiple_of(QK_K)
            && g.len() == nsb * sb
            && out.len() == m * GROUP
            && x.blocks_per_row(m) == Some(k / QK);
        debug_assert!(ok, "{} group bytes, k {k}, {} outputs", g.len(), out.len());
        ok.then_some((nsb, m))
    }

    /// The Q4_K group product with 8-bit activations (`PackedType::dot8`).
    ///
    /// # Safety
    /// As `PackedType::dot`.
    pub(super) unsafe fn dot8_q4_k(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]) {
        match shape8(g, K4_SB, k, x, out) {
            Some((nsb, m)) => many_rows8::<true>(g, nsb, m, x, out),
            None => out.fill(0.0),
        }
    }

    /// The Q6_K group product with 8-bit activations (`PackedType::dot8`).
    ///
    /// # Safety
    /// As `PackedType::dot`.
    pub(super) unsafe fn dot8_q6_k(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]) {
        match shape8(g, K6_SB, k, x, out) {
            Some((nsb, m)) => many_rows8::<false>(g, nsb, m, x, out),
            None => out.fill(0.0),
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    //! Packed groups against the AVX-512 panels (bit for bit, through `q16::dot_fn` with at
    //! least `PANEL_MIN_ROWS` activation rows) and against an f64 product over the scalar
    //! dequantization. The `#[ignore]`d benchmark times the packed product against today's
    //! bodies (`cargo test --release -p lowsync-cpu packed_k_speed -- --ignored --nocapture`).

    use half::f16;

    use super::super::q32::tests::have_avx2;
    use super::super::GROUP;
    use super::*;
    use crate::kernels::quant::q16::{self, Isa, QRows, QK};
    use crate::kernels::quant::q8::Q8Rows;
    use crate::kernels::quant::scalar;

    /// Whether this CPU runs the packed products and the panels. libtest cannot mark a test
    /// skipped at run time, so a test that finds them missing says so on stderr.
    fn have() -> bool {
        let ok = q16::has_avx512()
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if !ok {
            eprintln!("skipped: this CPU lacks AVX-512 F/BW/VL + VNNI (or AVX2/FMA/F16C)");
        }
        ok
    }

    /// A xorshift generator: the tests' data is reproducible without a crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// How a test picks the f16 scales of its super-blocks.
    #[derive(Clone, Copy)]
    enum Scales {
        /// Small positive values, as a quantizer writes them.
        Plain,
        /// Drawn from both ends of f16's range, signs, subnormals and zero.
        Extreme,
    }

    fn f16_scale(rng: &mut Rng, how: Scales) -> [u8; 2] {
        let v = match how {
            Scales::Plain => 1e-3 + 1e-2 * rng.unit(),
            Scales::Extreme => {
                const PICK: [f32; 8] = [65504.0, -65504.0, 6.1e-5, 6.0e-8, 0.0, 1.0, -3.5, 1e4];
                PICK[(rng.next() % 8) as usize]
            }
        };
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    /// `n` random raw rows of `k` values of `dt`, back to back.
    fn weights(dt: DType, n: usize, k: usize, seed: u64, how: Scales) -> Vec<u8> {
        let rb = dt.row_bytes(k).expect("whole super-blocks");
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut w: Vec<u8> = (0..n * rb).map(|_| rng.next() as u8).collect();
        for blk in w.chunks_exact_mut(dt.block_bytes()) {
            match dt {
                DType::Q4_K => {
                    blk[0..2].copy_from_slice(&f16_scale(&mut rng, how));
                    blk[2..4].copy_from_slice(&f16_scale(&mut rng, how));
                }
                _ => blk[208..210].copy_from_slice(&f16_scale(&mut rng, how)),
            }
        }
        w
    }

    /// `m` activation rows of `k`: blocks of magnitudes from 1e-3 to 1e3, some all zero.
    fn activations(m: usize, k: usize, seed: u64) -> QRows {
        let mut rng = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
        let mut x = vec![0.0f32; m * k];
        for blk in x.chunks_exact_mut(QK) {
            let mag = match rng.next() % 8 {
                0 => 0.0,
                e => 10f32.powi(e as i32 - 4),
            };
            for v in blk {
                *v = (2.0 * rng.unit() - 1.0) * mag;
            }
        }
        QRows::quantize(&x)
    }

    /// The activation rows `idx` of `x` (`nb` blocks a row) as rows of their own.
    fn pick(x: &QRows, nb: usize, idx: &[usize]) -> QRows {
        let mut out = QRows {
            d: Vec::new(),
            s: Vec::new(),
            n: Vec::new(),
            q: Vec::new(),
        };
        for &i in idx {
            out.d.extend_from_slice(&x.d[i * nb..(i + 1) * nb]);
            out.s.extend_from_slice(&x.s[i * nb..(i + 1) * nb]);
            out.n.extend_from_slice(&x.n[i * nb..(i + 1) * nb]);
            out.q
                .extend_from_slice(&x.q[i * nb * QK..(i + 1) * nb * QK]);
        }
        out
    }

    /// Packs the `n` rows of `w` into groups (the last one padded with `None` rows) and runs
    /// the packed product: `out[i * n + j]` = weight row `j` times activation row `i`.
    /// Padding lanes must come out zero.
    fn packed_product(dt: DType, w: &[u8], n: usize, k: usize, x: &QRows, avx2: bool) -> Vec<f32> {
        let pt = super::super::packed_type(dt).expect("a packed layout");
        let rb = w.len() / n;
        let m = x.d.len() / (k / QK);
        let mut out = vec![0.0f32; n * m];
        let mut g = vec![0u8; (pt.group_bytes)(k)];
        let mut res = vec![0.0f32; GROUP * m];
        for j0 in (0..n).step_by(GROUP) {
            let rows: GroupRows<'_> =
                std::array::from_fn(|r| (j0 + r < n).then(|| &w[(j0 + r) * rb..(j0 + r + 1) * rb]));
            (pt.pack)(&rows, k, &mut g);
            let dot = if avx2 { pt.dot_avx2 } else { pt.dot };
            // SAFETY: the caller checked the instruction sets (`have`: AVX-512 F/BW/VL, VNNI,
            // AVX2, FMA and F16C; `have_avx2`); `g` is a whole group of `k`.
            unsafe { dot(&g, k, x, &mut res) };
            for i in 0..m {
                for r in 0..GROUP {
                    let v = res[i * GROUP + r];
                    if j0 + r < n {
                        out[i * n + j0 + r] = v;
                    } else {
                        assert_eq!(v.to_bits(), 0, "{dt} padding lane {r} of row {i}: {v}");
                    }
                }
            }
        }
        out
    }

    /// The panels' product of the same rows: `q16::dot_fn` runs them from `PANEL_MIN_ROWS`
    /// activation rows, so fewer rows are repeated up to 8 (a row's bits do not depend on
    /// its group).
    fn panel_product(dt: DType, w: &[u8], n: usize, k: usize, x: &QRows) -> Vec<f32> {
        let nb = k / QK;
        let m = x.d.len() / nb;
        let mr = m.max(8);
        let idx: Vec<usize> = (0..mr).map(|i| i % m).collect();
        let xr = pick(x, nb, &idx);
        let mut out = vec![0.0f32; n * mr];
        let f = q16::dot_fn(dt, Isa::Avx512).expect("a q16 body");
        f(w, w.len() / n, &xr, &mut out);
        out.truncate(n * m);
        out
    }

    /// Runs the packed product for `dt` over `n` rows and `m` activation rows of `k` and
    /// checks it against the panels (bits) and the f64 reference (tolerance).
    fn check(dt: DType, k: usize, n: usize, m: usize, seed: u64, how: Scales) {
        let w = weights(dt, n, k, seed, how);
        let x = activations(m, k, seed + 1);
        let got = packed_product(dt, &w, n, k, &x, false);
        let want = panel_product(dt, &w, n, k, &x);
        assert_same_bits(dt, k, n, &got, &want);
        check_f64(dt, k, n, m, &w, &x, &got);
    }

    /// As [`check`] for the AVX2 body: the bits of the AVX-512 body where this CPU runs both,
    /// and the f64 reference anywhere.
    fn check_avx2(dt: DType, k: usize, n: usize, m: usize, seed: u64, how: Scales) {
        let w = weights(dt, n, k, seed, how);
        let x = activations(m, k, seed + 1);
        let got = packed_product(dt, &w, n, k, &x, true);
        if q16::has_avx512() {
            let want = packed_product(dt, &w, n, k, &x, false);
            assert_same_bits(dt, k, n, &got, &want);
        }
        check_f64(dt, k, n, m, &w, &x, &got);
    }

    fn assert_same_bits(dt: DType, k: usize, n: usize, got: &[f32], want: &[f32]) {
        for (at, (a, b)) in got.iter().zip(want).enumerate() {
            let (i, j) = (at / n, at % n);
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{dt} k {k}: row {j} x {i}: {a} vs {b}"
            );
        }
    }

    /// `got` (`[i * n + j]`) against an f64 product over the scalar dequantization of `w` and
    /// the activations as read, within f32 rounding of the sum of magnitudes.
    fn check_f64(dt: DType, k: usize, n: usize, m: usize, w: &[u8], x: &QRows, got: &[f32]) {
        let rb = w.len() / n;
        let nb = k / QK;
        let mut wf = vec![0.0f32; k];
        for j in 0..n {
            scalar::dequantize_row(dt, &w[j * rb..(j + 1) * rb], &mut wf);
            for i in 0..m {
                let (mut exact, mut bound) = (0.0f64, 0.0f64);
                for (e, &wv) in wf.iter().enumerate() {
                    let b = i * nb + e / QK;
                    let xv = f64::from(x.d[b]) * f64::from(x.q[i * k + e]);
                    exact += f64::from(wv) * xv;
                    bound += (f64::from(wv) * xv).abs();
                }
                let v = f64::from(got[i * n + j]);
                assert!(
                    (v - exact).abs() <= 4e-5 * bound,
                    "{dt} k {k}: row {j} x {i}: {v} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn packed_groups_give_the_panels_bits() {
        if !have() {
            return;
        }
        // 37 weight rows: two full groups and one of 5 rows and 11 `None` rows.
        for dt in [DType::Q4_K, DType::Q6_K] {
            for (s, k) in [256, 768, 2048, 5632].into_iter().enumerate() {
                for m in [1, 2, 3, 4, 8, 11, 70] {
                    check(dt, k, 37, m, 10 * s as u64 + m as u64, Scales::Plain);
                }
            }
        }
    }

    #[test]
    fn packed_groups_keep_the_bits_with_extreme_scales() {
        if !have() {
            return;
        }
        for dt in [DType::Q4_K, DType::Q6_K] {
            for (s, k) in [256, 2048, 5632].into_iter().enumerate() {
                for m in [1, 9] {
                    check(
                        dt,
                        k,
                        21,
                        m,
                        100 + 10 * s as u64 + m as u64,
                        Scales::Extreme,
                    );
                }
            }
        }
    }

    #[test]
    fn avx2_groups_give_the_bits_of_the_avx512_groups_and_match_f64() {
        if !have_avx2() {
            return;
        }
        // 37 weight rows: two full groups and one of 5 rows and 11 `None` rows; m 1..9 (the
        // bodies of 4, 2 and 1 rows and their leftovers) and 70.
        for dt in [DType::Q4_K, DType::Q6_K] {
            for (s, k) in [256, 768, 2048, 5632].into_iter().enumerate() {
                for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 70] {
                    check_avx2(dt, k, 37, m, 10 * s as u64 + m as u64, Scales::Plain);
                }
            }
            for (s, k) in [256, 2048, 5632].into_iter().enumerate() {
                for m in [1, 9] {
                    let seed = 100 + 10 * s as u64 + m as u64;
                    check_avx2(dt, k, 21, m, seed, Scales::Extreme);
                }
            }
        }
    }

    #[test]
    fn a_group_of_none_rows_is_zero() {
        if !have() {
            return;
        }
        for dt in [DType::Q4_K, DType::Q6_K] {
            let pt = super::super::packed_type(dt).expect("a packed layout");
            let k = 512;
            let mut g = vec![0xAAu8; (pt.group_bytes)(k)];
            (pt.pack)(&[None; GROUP], k, &mut g);
            let x = activations(3, k, 5);
            let mut out = vec![1.0f32; GROUP * 3];
            // SAFETY: `have()` detected the features; `g` is a whole group of `k`.
            unsafe { (pt.dot)(&g, k, &x, &mut out) };
            assert!(out.iter().all(|v| v.to_bits() == 0), "{dt}: {out:?}");
        }
    }

    /// `m` activation rows of `k` as 8-bit blocks, from the same values as [`activations`].
    fn activations8(m: usize, k: usize, seed: u64) -> Q8Rows {
        let mut rng = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
        let mut x = vec![0.0f32; m * k];
        for blk in x.chunks_exact_mut(QK) {
            let mag = match rng.next() % 8 {
                0 => 0.0,
                e => 10f32.powi(e as i32 - 4),
            };
            for v in blk {
                *v = (2.0 * rng.unit() - 1.0) * mag;
            }
        }
        Q8Rows::quantize(&x)
    }

    /// The unsigned values of a raw super-block (Q4_K: 0..16; Q6_K: 0..64, offset 32 not taken
    /// off) in element order, with each value's float scale `d * sc` and Q4_K's sub-block
    /// mins `-(dmin * m)` (one per 32).
    fn raw_values(dt: DType, blk: &[u8]) -> ([i32; QK_K], [f32; QK_K], [f32; 8]) {
        let (mut q, mut f, mut mn) = ([0i32; QK_K], [0f32; QK_K], [0f32; 8]);
        let f16 = |at: usize| f16::from_le_bytes([blk[at], blk[at + 1]]).to_f32();
        if dt == DType::Q4_K {
            let (d, dmin) = (f16(0), f16(2));
            for j in 0..8 {
                let (sc, m) = scalar::k_scale_min(&blk[4..16], j);
                mn[j] = -dmin * f32::from(m);
                for l in 0..32 {
                    q[32 * j + l] = i32::from((blk[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F);
                    f[32 * j + l] = d * f32::from(sc);
                }
            }
        } else {
            let d = f16(208);
            for j in 0..8 {
                let (half, g) = (j / 4, j % 4);
                for l in 0..32 {
                    let lo = (blk[64 * half + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0x0F;
                    let hi = (blk[128 + 32 * half + l] >> (2 * g)) & 3;
                    let e = 32 * j + l;
                    q[e] = i32::from(lo) + 16 * i32::from(hi);
                    f[e] = d * f32::from(blk[192 + e / 16] as i8);
                }
            }
        }
        (q, f, mn)
    }

    /// The 8-bit product of Q4_K / Q6_K rows against an exact reference in the kernel's order
    /// (bits) and an f64 product (tolerance): per block, the exact integer sum of each scale
    /// group, converted; Q4_K: times `(d * sc) * d_x`, added by one FMA in block order, the mins
    /// `-(dmin * m) * s_x` by FMA in a chain of their own, added at the end; Q6_K: `(f0 * s0 +
    /// f1 * s1)` (a product and an FMA over its two sub-blocks of 16) times `d_x`, added by one
    /// FMA in block order.
    fn check8(dt: DType, k: usize, n: usize, m: usize, seed: u64, how: Scales, avx2: bool) {
        let w = weights(dt, n, k, seed, how);
        let x = activations8(m, k, seed + 1);
        let pt = super::super::packed_type(dt).expect("a packed layout");
        let dot8 = if avx2 { pt.dot8_avx2 } else { pt.dot8 }.expect("an 8-bit body");
        let rb = w.len() / n;
        let nb = k / QK;
        let mut g = vec![0u8; (pt.group_bytes)(k)];
        let mut res = vec![0.0f32; GROUP * m];
        let (gs, off) = if dt == DType::Q4_K { (32, 0) } else { (16, 32) };
        for j0 in (0..n).step_by(GROUP) {
            let rows: GroupRows<'_> =
                std::array::from_fn(|r| (j0 + r < n).then(|| &w[(j0 + r) * rb..(j0 + r + 1) * rb]));
            (pt.pack)(&rows, k, &mut g);
            // SAFETY: the caller checked the instruction sets (`have`: AVX-512 F/BW/VL, VNNI,
            // AVX2, FMA and F16C; `have_avx2`); `g` is a whole group of `k`.
            unsafe { dot8(&g, k, &x, &mut res) };
            for i in 0..m {
                for r in 0..GROUP {
                    let (j, v) = (j0 + r, res[i * GROUP + r]);
                    if j >= n {
                        assert_eq!(v.to_bits(), 0, "{dt} padding lane {r} of row {i}: {v}");
                        continue;
                    }
                    let (mut acc, mut mins, mut exact, mut bound) = (0f32, 0f32, 0f64, 0f64);
                    for (s, blk) in w[j * rb..(j + 1) * rb]
                        .chunks_exact(rb / (k / QK_K))
                        .enumerate()
                    {
                        let (q, f, mn) = raw_values(dt, blk);
                        for e0 in (0..QK_K).step_by(QK) {
                            let b = i * nb + (s * QK_K + e0) / QK;
                            // The block's sums per scale group (Q4_K: one; Q6_K: two of 16).
                            let mut sums = [0i32; 2];
                            for e in e0..e0 + QK {
                                let xv = i32::from(x.value(b, (s * QK_K + e) % QK));
                                sums[(e - e0) / gs] += (q[e] - off) * xv;
                                let t = f64::from(f[e]) * f64::from(x.d[b]) * f64::from(q[e] - off);
                                bound += (t * f64::from(xv)).abs();
                            }
                            if dt == DType::Q4_K {
                                acc = (f[e0] * x.d[b]).mul_add(sums[0] as f32, acc);
                                mins = mn[e0 / 32].mul_add(x.s[b], mins);
                                let t = f64::from(mn[e0 / 32]) * f64::from(x.s[b]);
                                exact += t;
                                bound += t.abs();
                            } else {
                                let t = f[e0] * sums[0] as f32;
                                let t = f[e0 + 16].mul_add(sums[1] as f32, t);
                                acc = t.mul_add(x.d[b], acc);
                            }
                            for (h, &sum) in sums.iter().enumerate().take(QK / gs) {
                                exact +=
                                    f64::from(f[e0 + h * gs]) * f64::from(x.d[b]) * f64::from(sum);
                            }
                        }
                    }
                    let want = if dt == DType::Q4_K { acc + mins } else { acc };
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "{dt} k {k} m {m}: row {j} x {i}: {v} vs {want}"
                    );
                    assert!(
                        (f64::from(v) - exact).abs() <= 1e-5 * bound,
                        "{dt} k {k} m {m}: row {j} x {i}: {v} vs {exact} (bound {bound})"
                    );
                }
            }
        }
    }

    #[test]
    fn k_groups_with_8bit_activations_match_an_exact_reference() {
        // The AVX-512 bodies, then the AVX2 ones, each where this CPU runs them.
        for avx2 in [false, true] {
            if !(if avx2 { have_avx2() } else { have() }) {
                continue;
            }
            // n 37 (a group of 5 rows and 11 `None` rows last), k of 1 to 22 super-blocks, m
            // from 1 (leftover bodies) across passes of 64 rows.
            for dt in [DType::Q4_K, DType::Q6_K] {
                for (s, k) in [256, 512, 768, 5632].into_iter().enumerate() {
                    for m in [1, 2, 3, 5, 6, 7, 9, 16, 40, 70] {
                        let seed = 10 * s as u64 + m as u64;
                        check8(dt, k, 37, m, seed, Scales::Plain, avx2);
                    }
                }
                for m in [6, 13] {
                    check8(dt, 2048, 21, m, 300 + m as u64, Scales::Extreme, avx2);
                }
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn packed8_k_speed() {
        if !have() {
            return;
        }
        for k in [768, 2048] {
            for dt in [DType::Q4_K, DType::Q6_K] {
                let pt = super::super::packed_type(dt).expect("a packed layout");
                let dot8 = pt.dot8.expect("an 8-bit body");
                let rb = dt.row_bytes(k).expect("whole super-blocks");
                let gb = (pt.group_bytes)(k);
                let m = 128;
                let (x16, x8) = (activations(m, k, 3), activations8(m, k, 3));
                for (label, bytes) in [("cache 256 KiB", 256 << 10), ("DRAM 48 MiB", 48 << 20)] {
                    let n = (bytes / rb).next_multiple_of(GROUP);
                    let w = weights(dt, n, k, 9, Scales::Plain);
                    let mut packed = vec![0u8; n / GROUP * gb];
                    for (j, g) in packed.chunks_exact_mut(gb).enumerate() {
                        let rows: GroupRows<'_> = std::array::from_fn(|r| {
                            let at = (j * GROUP + r) * rb;
                            Some(&w[at..at + rb])
                        });
                        (pt.pack)(&rows, k, g);
                    }
                    let mut tmp = vec![0.0f32; GROUP * m];
                    let per = (n * (k / QK) * m) as f64;
                    let (mut best16, mut best8) = (f64::MAX, f64::MAX);
                    for round in 0..9 {
                        for v in 0..2 {
                            let eight = (v + round) % 2 == 1;
                            let t = std::time::Instant::now();
                            for g in packed.chunks_exact(gb) {
                                // SAFETY: `have()` detected the features; `g` is a whole group.
                                unsafe {
                                    if eight {
                                        dot8(g, k, &x8, &mut tmp);
                                    } else {
                                        (pt.dot)(g, k, &x16, &mut tmp);
                                    }
                                }
                                std::hint::black_box(&mut tmp);
                            }
                            let ns = t.elapsed().as_secs_f64() * 1e9 / per;
                            if eight {
                                best8 = best8.min(ns);
                            } else {
                                best16 = best16.min(ns);
                            }
                        }
                    }
                    eprintln!(
                        "{dt} k {k} m {m} {label}: 16-bit {best16:.4} ns, 8-bit {best8:.4} ns \
                         per (weight row, block of 32, activation row), {:.2}x",
                        best16 / best8
                    );
                }
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn packed_k_speed() {
        if !have() {
            return;
        }
        for k in [768, 2048] {
            for dt in [DType::Q4_K, DType::Q6_K] {
                let pt = super::super::packed_type(dt).expect("a packed layout");
                let rb = dt.row_bytes(k).expect("whole super-blocks");
                let gb = (pt.group_bytes)(k);
                let old = q16::dot_fn(dt, Isa::Avx512).expect("a q16 body");
                for m in [1, 128] {
                    let x = activations(m, k, 3);
                    let mut cases = vec![
                        ("cache 256 KiB", 256 << 10, if m == 1 { 64 } else { 4 }, 1),
                        ("DRAM 48 MiB", 48 << 20, if m == 1 { 2 } else { 1 }, 1),
                    ];
                    if m == 1 {
                        // A decode step's products run on 2 threads that share the DRAM.
                        cases.push(("DRAM 48 MiB, 2 threads", 48 << 20, 2, 2));
                    }
                    for (label, bytes, reps, threads) in cases {
                        let n = (bytes / rb).next_multiple_of(2 * GROUP);
                        let w = weights(dt, n, k, 9, Scales::Plain);
                        let mut packed = vec![0u8; n / GROUP * gb];
                        for (j, g) in packed.chunks_exact_mut(gb).enumerate() {
                            let rows: GroupRows<'_> = std::array::from_fn(|r| {
                                let at = (j * GROUP + r) * rb;
                                Some(&w[at..at + rb])
                            });
                            (pt.pack)(&rows, k, g);
                        }
                        let mut out = vec![0.0f32; n * m];
                        // One thread's share: `rows` weight rows from `j0`.
                        let share = |new: bool, j0: usize, rows: usize, out: &mut [f32]| {
                            if new {
                                let gs = &packed[j0 / GROUP * gb..(j0 + rows) / GROUP * gb];
                                for (g, o) in
                                    gs.chunks_exact(gb).zip(out.chunks_exact_mut(GROUP * m))
                                {
                                    // SAFETY: `have()` detected the features; `g` is a whole
                                    // group of `k`.
                                    unsafe { (pt.dot)(g, k, &x, o) };
                                }
                            } else {
                                old(&w[j0 * rb..(j0 + rows) * rb], rb, &x, out);
                            }
                        };
                        let per = (n * (k / QK) * m * reps) as f64;
                        let (mut best_old, mut best_new) = (f64::MAX, f64::MAX);
                        for round in 0..9 {
                            for v in 0..2 {
                                let new = (v + round) % 2 == 1;
                                let t = std::time::Instant::now();
                                for _ in 0..reps {
                                    if threads == 1 {
                                        share(new, 0, n, &mut out);
                                    } else {
                                        let (a, b) = out.split_at_mut(n / 2 * m);
                                        std::thread::scope(|sc| {
                                            sc.spawn(|| share(new, 0, n / 2, a));
                                            share(new, n / 2, n / 2, b);
                                        });
                                    }
                                    std::hint::black_box(&mut out);
                                }
                                let ns = t.elapsed().as_secs_f64() * 1e9 / per;
                                if new {
                                    best_new = best_new.min(ns);
                                } else {
                                    best_old = best_old.min(ns);
                                }
                            }
                        }
                        let what = if m == 1 { "decode body" } else { "panels" };
                        eprintln!(
                            "{dt} k {k} m {m} {label}: {what} {best_old:.4} ns, packed \
                             {best_new:.4} ns per (weight row, block of 32, activation row), \
                             {:.2}x",
                            best_old / best_new
                        );
                    }
                }
            }
        }
    }
}
