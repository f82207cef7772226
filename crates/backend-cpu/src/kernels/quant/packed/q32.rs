//! Packed groups of the 32-value block types (Q4_0, Q4_1, Q8_0): see `super`.
//!
//! Why: the AVX-512 panel bodies (`super::super::q16::avx512`) spend a 16 x 16 transposition
//! per block of 16 rows before any `vpdpwssd`, and decode reads its rows side by side. Here
//! that transposition is done once, when the weight is packed, into a layout that one or a few
//! 64-byte loads per block turn into the `vpdpwssd` operands with a shift and a mask each.
//!
//! Strategy: a group stores its blocks two by two in chunks (so that every piece of a chunk
//! starts 64-byte aligned): the 16 rows' f16 scales `d` of both blocks (Q4_1: `d` then `m` of
//! the first block, then of the second), then both blocks' values. Block values, by type:
//! - Q4_0 / Q4_1 (256 bytes): four 64-byte vectors; in vector `j`, row `r`'s 32-bit lane holds
//!   the nibbles of pairs `p = 4j + s` (`s` = 0..4): element `2p` at bits `4s`, element `2p + 1`
//!   at bits `16 + 4s`, so pair `p`'s operand is `(v >> 4s) & 0x000F000F` per lane. The values
//!   are the unsigned nibbles; Q4_0's `-8` is taken off the integer sum as `8 * n_x` (`QRows::n`),
//!   by starting the sum at `-8 * n_x`.
//! - Q8_0 (512 bytes): for pair `p`, 32 bytes holding row `r`'s elements `2p`, `2p + 1` at byte
//!   `2r`: one sign extension (`vpmovsxbw`) is the operand.
//!
//! With 8-bit activation blocks (`dot8`, Q4_0 only: `super::super::q8`), the same four
//! vectors give 8 `vpdpbusd` operands, each byte a nibble: `v & 0x0F` holds elements
//! `8j + {0, 4, 1, 5}` of row `r` in lane `r`, `(v >> 4) & 0x0F` elements `8j + {2, 6, 3, 7}`,
//! the order in which `Q8Rows` stores its bytes, so each operand meets one broadcast 32-bit
//! word of the activation block: 8 instructions a block instead of 16. The sum starts at
//! `-8 * sum(q_x)` as above.
//!
//! Per group and block: up to 8 activation rows take each operand with their pair broadcast
//! (prefill unpacks a block once per 8 activation rows); a lone activation row (decode) splits
//! its 16 `vpdpwssd` into 4 independent chains so their latency overlaps. A job's groups are
//! one contiguous run of memory (one stream).
//!
//! The AVX2 bodies (`avx2`) read each 64-byte vector as two halves of 8 rows, the same
//! operands with 256-bit instructions (`pmaddwd` and `paddd`; `pmaddubsw` for 8 bits).
//!
//! Invariants: the integer sum of a block is exact (the same integer whatever the chains), so
//! every output has the bits of the panel bodies: `(d_w * d_x) * sum` added by one FMA in block
//! order, the mins `m_w * s_x` (Q4_1) in a second chain added at the end; the 8-bit Q4_0 body
//! adds its (equally exact) sums in the same order. Pad rows (past the matrix) are zero bytes:
//! scale 0, so they add nothing that a caller reads.
// Packing runs on x86-64 only (`lookup`); elsewhere the layout is compiled but unused.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use lowsync_graph::DType;

#[cfg(all(test, target_arch = "x86_64"))]
use super::{lines_as_bytes_mut, Line};
use super::{GroupRows, PackedType, GROUP};
use crate::kernels::quant::q16::{QRows, QK};
use crate::kernels::quant::q8::Q8Rows;

/// Q4_0 groups.
static Q4_0: PackedType = PackedType {
    group_bytes: group_bytes::<Q40>,
    pack: pack::<Q40>,
    dot: dot_q4_0,
    dot8: Some(dot8_q4_0),
    dot_avx2: dot_q4_0_avx2,
    dot8_avx2: Some(dot8_q4_0_avx2),
};

/// Q4_1 groups.
static Q4_1: PackedType = PackedType {
    group_bytes: group_bytes::<Q41>,
    pack: pack::<Q41>,
    dot: dot_q4_1,
    dot8: None,
    dot_avx2: dot_q4_1_avx2,
    dot8_avx2: None,
};

/// Q8_0 groups.
static Q8_0: PackedType = PackedType {
    group_bytes: group_bytes::<Q80>,
    pack: pack::<Q80>,
    dot: dot_q8_0,
    dot8: None,
    dot_avx2: dot_q8_0_avx2,
    dot8_avx2: None,
};

/// The packed layout of `dt`, if this file has one.
pub(super) fn lookup(dt: DType) -> Option<&'static PackedType> {
    match dt {
        DType::Q4_0 => Some(&Q4_0),
        DType::Q4_1 => Some(&Q4_1),
        DType::Q8_0 => Some(&Q8_0),
        _ => None,
    }
}

/// A 32-value block type's packed layout.
trait Kind {
    /// Bytes of a GGUF block.
    const RAW: usize;
    /// Bytes of a group's scales of one block (16 f16 `d`, and 16 f16 `m` where [`Kind::MIN`]).
    const SB: usize;
    /// Bytes of a group's values of one block.
    const QB: usize;
    /// Whether the block has a min (`d * q + m`).
    const MIN: bool;
    /// Whether the values are stored as unsigned nibbles of `q + 8` (Q4_0).
    const OFFSET8: bool;

    /// Writes row `r`'s values of one raw block into a group's block values `dst`.
    fn pack_values(raw: &[u8], r: usize, dst: &mut [u8]);

    /// The inverse: row `r`'s values from a group's block values `src` into a raw block.
    fn unpack_values(src: &[u8], r: usize, raw: &mut [u8]);
}

struct Q40;
struct Q41;
struct Q80;

/// Packs 32 nibbles (element order) of row `r` into the four-vector nibble layout.
fn pack_nibbles(q: &[u8; QK], r: usize, dst: &mut [u8]) {
    for j in 0..4 {
        let mut lane = 0u32;
        for s in 0..4 {
            let p = 4 * j + s;
            lane |= u32::from(q[2 * p]) << (4 * s);
            lane |= u32::from(q[2 * p + 1]) << (16 + 4 * s);
        }
        let at = 64 * j + 4 * r;
        dst[at..at + 4].copy_from_slice(&lane.to_le_bytes());
    }
}

/// The 32 nibbles of row `r` in the four-vector nibble layout, packed back into a block's 16
/// bytes `qs` (low nibbles elements 0..16, high nibbles 16..32).
fn unpack_nibbles(src: &[u8], r: usize, qs: &mut [u8]) {
    let mut q = [0u8; QK];
    for j in 0..4 {
        let at = 64 * j + 4 * r;
        let lane = u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]);
        for s in 0..4 {
            let p = 4 * j + s;
            q[2 * p] = ((lane >> (4 * s)) & 0xF) as u8;
            q[2 * p + 1] = ((lane >> (16 + 4 * s)) & 0xF) as u8;
        }
    }
    for (j, b) in qs[..16].iter_mut().enumerate() {
        *b = q[j] | (q[j + 16] << 4);
    }
}

/// The 32 nibbles of a block's 16 bytes `qs`, in element order.
fn nibbles(qs: &[u8]) -> [u8; QK] {
    let mut q = [0u8; QK];
    for (j, &b) in qs[..16].iter().enumerate() {
        q[j] = b & 0x0F;
        q[j + 16] = b >> 4;
    }
    q
}

impl Kind for Q40 {
    const RAW: usize = 18;
    const SB: usize = 32;
    const QB: usize = 256;
    const MIN: bool = false;
    const OFFSET8: bool = true;
    fn pack_values(raw: &[u8], r: usize, dst: &mut [u8]) {
        pack_nibbles(&nibbles(&raw[2..18]), r, dst);
    }
    fn unpack_values(src: &[u8], r: usize, raw: &mut [u8]) {
        unpack_nibbles(src, r, &mut raw[2..18]);
    }
}

impl Kind for Q41 {
    const RAW: usize = 20;
    const SB: usize = 64;
    const QB: usize = 256;
    const MIN: bool = true;
    const OFFSET8: bool = false;
    fn pack_values(raw: &[u8], r: usize, dst: &mut [u8]) {
        pack_nibbles(&nibbles(&raw[4..20]), r, dst);
    }
    fn unpack_values(src: &[u8], r: usize, raw: &mut [u8]) {
        unpack_nibbles(src, r, &mut raw[4..20]);
    }
}

impl Kind for Q80 {
    const RAW: usize = 34;
    const SB: usize = 32;
    const QB: usize = 512;
    const MIN: bool = false;
    const OFFSET8: bool = false;
    fn pack_values(raw: &[u8], r: usize, dst: &mut [u8]) {
        for p in 0..16 {
            let at = 32 * p + 2 * r;
            dst[at..at + 2].copy_from_slice(&raw[2 + 2 * p..4 + 2 * p]);
        }
    }
    fn unpack_values(src: &[u8], r: usize, raw: &mut [u8]) {
        for p in 0..16 {
            let at = 32 * p + 2 * r;
            raw[2 + 2 * p..4 + 2 * p].copy_from_slice(&src[at..at + 2]);
        }
    }
}

/// Bytes of a chunk of two blocks.
const fn chunk_bytes<K: Kind>() -> usize {
    2 * (K::SB + K::QB)
}

/// Where block `b`'s scales and values start in a group.
#[inline(always)]
const fn block_at<K: Kind>(b: usize) -> (usize, usize) {
    let (c, h) = (b / 2, b % 2);
    let base = c * chunk_bytes::<K>();
    (base + h * K::SB, base + 2 * K::SB + h * K::QB)
}

fn group_bytes<K: Kind>(k: usize) -> usize {
    (k / QK).div_ceil(2) * chunk_bytes::<K>()
}

fn pack<K: Kind>(rows: &GroupRows<'_>, k: usize, dst: &mut [u8]) {
    let nb = k / QK;
    debug_assert_eq!(dst.len(), group_bytes::<K>(k));
    dst.fill(0);
    for (r, row) in rows.iter().enumerate() {
        let Some(row) = row else { continue };
        debug_assert_eq!(row.len(), nb * K::RAW);
        for (b, raw) in row.chunks_exact(K::RAW).enumerate() {
            let (s, q) = block_at::<K>(b);
            dst[s + 2 * r..s + 2 * r + 2].copy_from_slice(&raw[0..2]);
            if K::MIN {
                dst[s + 32 + 2 * r..s + 34 + 2 * r].copy_from_slice(&raw[2..4]);
            }
            K::pack_values(raw, r, &mut dst[q..q + K::QB]);
        }
    }
}

/// Writes row `r`'s raw GGUF blocks (`k` values) from group `g` into `out`: the inverse of
/// `pack`, so a table read from its packed copy dequantizes to the same values.
fn raw_row<K: Kind>(g: &[u8], k: usize, r: usize, out: &mut [u8]) {
    for (b, raw) in out[..k / QK * K::RAW].chunks_exact_mut(K::RAW).enumerate() {
        let (s, q) = block_at::<K>(b);
        raw[0..2].copy_from_slice(&g[s + 2 * r..s + 2 * r + 2]);
        if K::MIN {
            raw[2..4].copy_from_slice(&g[s + 32 + 2 * r..s + 34 + 2 * r]);
        }
        K::unpack_values(&g[q..q + K::QB], r, raw);
    }
}

/// Row `r`'s raw blocks from a group of `dt`, where `dt` has a layout here (`false` otherwise).
pub(super) fn raw_row_of(dt: DType, g: &[u8], k: usize, r: usize, out: &mut [u8]) -> bool {
    match dt {
        DType::Q4_0 => raw_row::<Q40>(g, k, r, out),
        DType::Q4_1 => raw_row::<Q41>(g, k, r, out),
        DType::Q8_0 => raw_row::<Q80>(g, k, r, out),
        _ => return false,
    }
    true
}

fn dot_q4_0(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    dot::<Q40>(g, k, x, out)
}

fn dot_q4_1(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    dot::<Q41>(g, k, x, out)
}

fn dot_q8_0(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    dot::<Q80>(g, k, x, out)
}

fn dot_q4_0_avx2(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    dot_isa::<Q40, true>(g, k, x, out)
}

fn dot_q4_1_avx2(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    dot_isa::<Q41, true>(g, k, x, out)
}

fn dot_q8_0_avx2(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    dot_isa::<Q80, true>(g, k, x, out)
}

/// Checks the shapes, then runs the AVX-512 body over every activation row.
#[inline(always)]
fn dot<K: Kind>(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    dot_isa::<K, false>(g, k, x, out)
}

/// Checks the shapes, then runs the AVX2 (`AVX2`) or AVX-512 body over every activation row.
#[inline(always)]
fn dot_isa<K: Kind, const AVX2: bool>(g: &[u8], k: usize, x: &QRows, out: &mut [f32]) {
    let nb = k / QK;
    let m = out.len() / GROUP;
    let ok = k.is_multiple_of(QK)
        && g.len() == group_bytes::<K>(k)
        && out.len() == m * GROUP
        && x.d.len() == m * nb
        && x.s.len() == x.d.len()
        && x.n.len() == x.d.len()
        && x.q.len() == x.d.len() * QK;
    assert!(ok, "packed dot: shapes do not match");
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: the caller promised AVX2, FMA and F16C (the `PackedType::dot_avx2`
        // contract); the shapes were checked above.
        unsafe { avx2::rows::<K>(g, nb, x, out, m) }
    } else {
        // SAFETY: the caller promised AVX-512 F/BW/VL and VNNI, AVX2, FMA and F16C (the
        // `PackedType::dot` contract); the shapes were checked above.
        unsafe { avx512::rows::<K>(g, nb, x, out, m) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("packed products run only on x86_64 with AVX-512 or AVX2")
}

/// The Q4_0 group product with 8-bit activation blocks (`PackedType::dot8`).
fn dot8_q4_0(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]) {
    dot8_isa::<false>(g, k, x, out)
}

/// The Q4_0 group product with 8-bit activation blocks and AVX2 (`PackedType::dot8_avx2`).
fn dot8_q4_0_avx2(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]) {
    dot8_isa::<true>(g, k, x, out)
}

/// Checks the shapes, then runs the AVX2 (`AVX2`) or AVX-512 8-bit Q4_0 body.
#[inline(always)]
fn dot8_isa<const AVX2: bool>(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]) {
    let nb = k / QK;
    let m = out.len() / GROUP;
    let ok = k.is_multiple_of(QK)
        && g.len() == group_bytes::<Q40>(k)
        && out.len() == m * GROUP
        && x.blocks_per_row(m) == Some(nb);
    assert!(ok, "packed 8-bit dot: shapes do not match");
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: the caller promised AVX2, FMA and F16C (the `PackedType::dot8_avx2`
        // contract); the shapes were checked above.
        unsafe { avx2::rows8(g, nb, x, out, m) }
    } else {
        // SAFETY: the caller promised AVX-512 F/BW/VL and VNNI, AVX2, FMA and F16C (the
        // `PackedType::dot8` contract); the shapes were checked above.
        unsafe { avx512::rows8(g, nb, x, out, m) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("packed products run only on x86_64 with AVX-512 or AVX2")
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512 VNNI bodies of the packed products.

    use std::arch::x86_64::*;

    use super::{block_at, Kind, Q8Rows, QRows, GROUP, Q40, QK};

    /// How far ahead the first activation rows' pass over a group prefetches the stream of
    /// groups (bytes), into the L2.
    const PREFETCH_FAR: usize = 2048;

    /// Every activation row of `x` against group `g`: groups of 8 activation rows, then 4,
    /// 2 and 1.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and VNNI, AVX2, FMA and F16C; shapes as `super::dot` checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows<K: Kind>(g: &[u8], nb: usize, x: &QRows, out: &mut [f32], m: usize) {
        let mut r0 = 0;
        while r0 < m {
            r0 += match m - r0 {
                8.. => body::<K, 8, 1>(g, nb, x, out, r0),
                4.. => body::<K, 4, 1>(g, nb, x, out, r0),
                2 | 3 => body::<K, 2, 2>(g, nb, x, out, r0),
                _ => body::<K, 1, 4>(g, nb, x, out, r0),
            };
        }
    }

    /// Hands pair `p`'s operand (lane = weight row) of the block values at `q` to `f`, for
    /// `p` = 0..16 in an order fixed per type.
    #[inline(always)]
    unsafe fn operands<K: Kind>(q: *const u8, mut f: impl FnMut(usize, __m512i)) {
        if K::QB == 256 {
            let m4 = _mm512_set1_epi16(0x0F);
            for j in 0..4 {
                let v = _mm512_loadu_si512(q.add(64 * j).cast());
                f(4 * j, _mm512_and_si512(v, m4));
                f(4 * j + 1, _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4));
                f(4 * j + 2, _mm512_and_si512(_mm512_srli_epi16::<8>(v), m4));
                f(4 * j + 3, _mm512_srli_epi16::<12>(v));
            }
        } else {
            for p in 0..16 {
                f(
                    p,
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256(q.add(32 * p).cast())),
                );
            }
        }
    }

    /// `R` activation rows from `r0` against the group, each row's block sum split into `NC`
    /// independent chains (by pair); returns `R`.
    // Index loops: each row `i` addresses several arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn body<K: Kind, const R: usize, const NC: usize>(
        g: &[u8],
        nb: usize,
        x: &QRows,
        out: &mut [f32],
        r0: usize,
    ) -> usize {
        let gp = g.as_ptr();
        let (xq, xd, xs, xn) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr(), x.n.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        let mut mins = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let (so, qo) = block_at::<K>(b);
            // The first activation rows read the group from memory; the others find it in
            // the L1 or L2.
            if r0 == 0 {
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR).cast());
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR + 64).cast());
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR + 128).cast());
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR + 192).cast());
            }
            // Row i's block b: pair p at xb[i] + p (two i16 as one i32).
            let xb: [*const i32; R] =
                std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
            let mut sum = [[_mm512_setzero_si512(); NC]; R];
            if K::OFFSET8 {
                for i in 0..R {
                    sum[i][0] = _mm512_set1_epi32(-8 * *xn.add((r0 + i) * nb + b));
                }
            }
            operands::<K>(gp.add(qo), |p, w| {
                for i in 0..R {
                    let xv = _mm512_set1_epi32(xb[i].add(p).read_unaligned());
                    sum[i][p % NC] = _mm512_dpwssd_epi32(sum[i][p % NC], w, xv);
                }
            });
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(gp.add(so).cast()));
            for i in 0..R {
                let s = match NC {
                    1 => sum[i][0],
                    2 => _mm512_add_epi32(sum[i][0], sum[i][1]),
                    _ => _mm512_add_epi32(
                        _mm512_add_epi32(sum[i][0], sum[i][1]),
                        _mm512_add_epi32(sum[i][2], sum[i][3]),
                    ),
                };
                let scale = _mm512_mul_ps(dv, _mm512_set1_ps(*xd.add((r0 + i) * nb + b)));
                acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc[i]);
            }
            if K::MIN {
                let mv = _mm512_cvtph_ps(_mm256_loadu_si256(gp.add(so + 32).cast()));
                for i in 0..R {
                    let s = _mm512_set1_ps(*xs.add((r0 + i) * nb + b));
                    mins[i] = _mm512_fmadd_ps(mv, s, mins[i]);
                }
            }
        }
        for i in 0..R {
            let v = if K::MIN {
                _mm512_add_ps(acc[i], mins[i])
            } else {
                acc[i]
            };
            _mm512_storeu_ps(out.as_mut_ptr().add((r0 + i) * GROUP), v);
        }
        R
    }

    /// Every activation row of `x` (8-bit blocks) against Q4_0 group `g`: groups of 8
    /// activation rows, then 4, 2 and 1.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and VNNI, AVX2, FMA and F16C; shapes as `super::dot8_q4_0` checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows8(g: &[u8], nb: usize, x: &Q8Rows, out: &mut [f32], m: usize) {
        let mut r0 = 0;
        while r0 < m {
            r0 += match m - r0 {
                8.. => body8::<8>(g, nb, x, out, r0),
                4.. => body8::<4>(g, nb, x, out, r0),
                2 | 3 => body8::<2>(g, nb, x, out, r0),
                _ => body8::<1>(g, nb, x, out, r0),
            };
        }
    }

    /// `R` activation rows from `r0` against a Q4_0 group with `vpdpbusd`: per block, the
    /// four 64-byte vectors give 8 operands (low and high nibble of each byte, lane = weight
    /// row, bytes in `q8::PERM` order), each multiplied by the matching 4 activation bytes
    /// broadcast; the sum starts at `-8 * sum(q_x)` for Q4_0's offset. Returns `R`.
    // Index loops: each row `i` addresses several arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn body8<const R: usize>(
        g: &[u8],
        nb: usize,
        x: &Q8Rows,
        out: &mut [f32],
        r0: usize,
    ) -> usize {
        let gp = g.as_ptr();
        let (xq, xd, xn) = (x.q.as_ptr(), x.d.as_ptr(), x.n.as_ptr());
        let mask = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let (so, qo) = block_at::<Q40>(b);
            if r0 == 0 {
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR).cast());
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR + 64).cast());
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR + 128).cast());
                _mm_prefetch::<_MM_HINT_T1>(gp.wrapping_add(qo + PREFETCH_FAR + 192).cast());
            }
            // Row i's block b: word w (4 bytes) at xb[i] + w.
            let xb: [*const i32; R] =
                std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
            let mut sum: [__m512i; R] = std::array::from_fn(|i| {
                let [lo, hi] = *xn.add((r0 + i) * nb + b);
                _mm512_set1_epi32(-8 * (lo + hi))
            });
            for j in 0..4 {
                let v = _mm512_loadu_si512(gp.add(qo + 64 * j).cast());
                let w = [
                    _mm512_and_si512(v, mask),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask),
                ];
                for h in 0..2 {
                    for i in 0..R {
                        let xv = _mm512_set1_epi32(xb[i].add(2 * j + h).read_unaligned());
                        sum[i] = _mm512_dpbusd_epi32(sum[i], w[h], xv);
                    }
                }
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(gp.add(so).cast()));
            for i in 0..R {
                let scale = _mm512_mul_ps(dv, _mm512_set1_ps(*xd.add((r0 + i) * nb + b)));
                acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum[i]), acc[i]);
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(out.as_mut_ptr().add((r0 + i) * GROUP), acc[i]);
        }
        R
    }
}

// The packed layouts exist on x86_64 only (elsewhere `lookup` has none).
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) mod tests {
    //! Packed groups against the AVX-512 panel bodies (bit for bit, through
    //! `q16::dot_fn` with at least `PANEL_MIN_ROWS` activation rows) and against an f64
    //! reference over the scalar dequantization (within f32 rounding), at odd shapes.

    use super::*;
    use crate::kernels::quant::q16::{self, Isa};
    use crate::kernels::quant::scalar;

    /// Whether this CPU runs the packed bodies; a test that finds it cannot says so on stderr
    /// and checks nothing (libtest cannot skip at run time).
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

    /// Whether this CPU runs the AVX2 packed bodies (said on stderr where not, as [`have`]).
    pub(crate) fn have_avx2() -> bool {
        let ok = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if !ok {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C");
        }
        ok
    }

    /// `(type, raw block bytes, offsets of the f16 scales in a block)`.
    pub(crate) const TYPES: [(DType, usize, &[usize]); 3] = [
        (DType::Q4_0, 18, &[0]),
        (DType::Q4_1, 20, &[0, 2]),
        (DType::Q8_0, 34, &[0]),
    ];

    /// `n` random rows of `k / 32` blocks of `bb` bytes, with small positive f16 scales at
    /// `halves` (Q4_1's mins too).
    pub(crate) fn weights(n: usize, k: usize, bb: usize, halves: &[usize], seed: u64) -> Vec<u8> {
        crate::kernels::quant::q16::x86::tests::rows(n, k / QK * bb, bb, halves, seed)
    }

    /// `m` activation rows of `k`, up to both ends of the 16-bit range.
    pub(crate) fn activations(m: usize, k: usize, seed: usize) -> QRows {
        let x: Vec<f32> = (0..m * k)
            .map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        QRows::quantize(&x)
    }

    /// Packs `n` rows (`rb` bytes each) into groups.
    pub(crate) fn pack_all(t: &PackedType, w: &[u8], n: usize, rb: usize, k: usize) -> Vec<u8> {
        let gb = (t.group_bytes)(k);
        let mut out = vec![0u8; n.div_ceil(GROUP) * gb];
        for (gi, dst) in out.chunks_exact_mut(gb).enumerate() {
            let rows: GroupRows<'_> = std::array::from_fn(|r| {
                let j = gi * GROUP + r;
                (j < n).then(|| &w[j * rb..(j + 1) * rb])
            });
            (t.pack)(&rows, k, dst);
        }
        out
    }

    /// The packed product of every group by the AVX2 (`avx2`) or AVX-512 body: `out[i * n +
    /// j]`, a 64-byte aligned copy of the groups (as the cache keeps them). Pad lanes must come
    /// out zero.
    fn packed_product(
        t: &PackedType,
        g: &[u8],
        n: usize,
        k: usize,
        x: &QRows,
        m: usize,
        avx2: bool,
    ) -> Vec<f32> {
        let gb = (t.group_bytes)(k);
        let mut aligned = vec![Line([0; 64]); g.len().div_ceil(64)];
        let bytes = &mut lines_as_bytes_mut(&mut aligned)[..g.len()];
        bytes.copy_from_slice(g);
        let dot = if avx2 { t.dot_avx2 } else { t.dot };
        let mut res = vec![0.0f32; n * m];
        let mut tmp = vec![0.0f32; GROUP * m];
        for (gi, grp) in bytes.chunks_exact(gb).enumerate() {
            // SAFETY: the caller checked the instruction sets (`have`, `have_avx2`); `grp` is
            // one group of `k`.
            unsafe { dot(grp, k, x, &mut tmp) };
            for i in 0..m {
                for r in 0..GROUP {
                    let j = gi * GROUP + r;
                    if j < n {
                        res[i * n + j] = tmp[i * GROUP + r];
                    } else {
                        assert_eq!(tmp[i * GROUP + r].to_bits(), 0, "pad lane {r}");
                    }
                }
            }
        }
        res
    }

    /// An f64 product over the scalar dequantization of `w` (`n` rows) and the activations as
    /// read, `[i * n + j]`, and the largest magnitude among its values.
    fn f64_product(
        dt: DType,
        w: &[u8],
        n: usize,
        k: usize,
        x: &QRows,
        m: usize,
    ) -> (Vec<f64>, f64) {
        let (nb, rb) = (k / QK, w.len() / n);
        let mut wf = vec![0.0f32; k];
        let mut scale = 0.0f64;
        let mut want = vec![0.0f64; n * m];
        for j in 0..n {
            scalar::dequantize_row(dt, &w[j * rb..(j + 1) * rb], &mut wf);
            for i in 0..m {
                let mut s = 0.0f64;
                for (l, &wv) in wf.iter().enumerate() {
                    let xv = f64::from(x.d[i * nb + l / QK]) * f64::from(x.q[i * k + l]);
                    s += f64::from(wv) * xv;
                }
                want[i * n + j] = s;
                scale = scale.max(s.abs());
            }
        }
        (want, scale)
    }

    #[test]
    fn avx2_groups_give_the_bits_of_the_avx512_groups_and_match_an_f64_reference() {
        if !have_avx2() {
            return;
        }
        // Both bodies where this CPU has AVX-512 VNNI too (bits); the f64 reference anywhere.
        let both = have();
        for (dt, bb, halves) in TYPES {
            let t = packed_type_of(dt);
            // k of 1, 18 and 176 blocks, n not a multiple of 16 (pad rows), m 1..9 (the
            // bodies of 4, 2 and 1 rows and their leftovers).
            for (k, n, ms) in [
                (32, 5, &[1, 2, 3][..]),
                (576, 37, &[1, 4, 5, 6, 7, 8, 9]),
                (5632, 20, &[1, 3]),
                (768, 16, &[1, 2]),
                (256, 33, &[9]),
            ] {
                let rb = k / QK * bb;
                let w = weights(n, k, bb, halves, 11 + k as u64);
                let g = pack_all(t, &w, n, rb, k);
                for &m in ms {
                    let x = activations(m, k, 3 + m);
                    let got = packed_product(t, &g, n, k, &x, m, true);
                    if both {
                        let want = packed_product(t, &g, n, k, &x, m, false);
                        for (at, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(a.to_bits(), b.to_bits(), "{dt} k {k} m {m} at {at}");
                        }
                    }
                    let (want, scale) = f64_product(dt, &w, n, k, &x, m);
                    assert!(scale > 0.0, "{dt}: all zero");
                    for (at, (&a, &e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(a) - e).abs() <= 1e-5 * scale,
                            "{dt} k {k} m {m} at {at}: {a} vs {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn packed_groups_give_the_bits_of_the_panels_and_match_an_f64_reference() {
        if !have() {
            return;
        }
        for (dt, bb, halves) in TYPES {
            let t = packed_type_of(dt);
            for (k, n, m) in [
                (32, 5, 1),
                (576, 37, 9),
                (5632, 20, 8),
                (768, 16, 1),
                (256, 33, 3),
            ] {
                let rb = k / QK * bb;
                let w = weights(n, k, bb, halves, 5 + k as u64);
                let g = pack_all(t, &w, n, rb, k);
                // The panels need at least PANEL_MIN_ROWS activation rows: run 8 or more and
                // compare the first `m`; a row's bits do not depend on the others.
                let mp = m.max(8);
                let xp = activations(mp, k, 3);
                let mut pan = vec![0.0f32; n * mp];
                let body = q16::dot_fn(dt, Isa::Avx512).expect("a body");
                body(&w, rb, &xp, &mut pan);
                let nb = k / QK;
                let x = QRows {
                    d: xp.d[..m * nb].to_vec(),
                    s: xp.s[..m * nb].to_vec(),
                    n: xp.n[..m * nb].to_vec(),
                    q: xp.q[..m * k].to_vec(),
                };
                let got = packed_product(t, &g, n, k, &x, m, false);
                // f64 reference over the scalar dequantization and the activations as read.
                let mut wf = vec![0.0f32; k];
                let mut scale = 0.0f64;
                let mut want = vec![0.0f64; n * m];
                for j in 0..n {
                    scalar::dequantize_row(dt, &w[j * rb..(j + 1) * rb], &mut wf);
                    for i in 0..m {
                        let mut s = 0.0f64;
                        for (l, &wv) in wf.iter().enumerate() {
                            let xv = f64::from(x.d[i * nb + l / QK]) * f64::from(x.q[i * k + l]);
                            s += f64::from(wv) * xv;
                        }
                        want[i * n + j] = s;
                        scale = scale.max(s.abs());
                    }
                }
                assert!(scale > 0.0, "{dt}: all zero");
                for i in 0..m {
                    for j in 0..n {
                        let (a, p) = (got[i * n + j], pan[i * n + j]);
                        assert_eq!(
                            a.to_bits(),
                            p.to_bits(),
                            "{dt} k {k} ({i}, {j}): {a} vs {p}"
                        );
                        let e = (f64::from(a) - want[i * n + j]).abs();
                        assert!(
                            e <= 1e-5 * scale,
                            "{dt} k {k} ({i}, {j}): {a} vs {}",
                            want[i * n + j]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn pad_rows_pack_to_zero_and_rows_pack_in_place() {
        for (dt, bb, halves) in TYPES {
            let t = packed_type_of(dt);
            let k = 64;
            let w = weights(3, k, bb, halves, 1);
            let g = pack_all(t, &w, 3, k / QK * bb, k);
            assert_eq!(g.len(), (t.group_bytes)(k));
            assert!(
                g.len().is_multiple_of(64),
                "{dt}: groups stay 64-byte aligned"
            );
            // Rows 3..16 are padding: their scale bytes are zero.
            let (s, _) = match dt {
                DType::Q4_1 => block_at::<Q41>(1),
                DType::Q8_0 => block_at::<Q80>(1),
                _ => block_at::<Q40>(1),
            };
            assert!(g[s + 6..s + 32].iter().all(|&b| b == 0), "{dt}");
            assert_eq!(&g[s..s + 2], &w[bb..bb + 2], "{dt}: row 0's second scale");
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn packed_speed() {
        if !have() {
            return;
        }
        for (dt, bb, halves) in TYPES {
            let t = packed_type_of(dt);
            let in_place = q16::dot_fn(dt, Isa::Avx512).expect("a body");
            for k in [768, 2048] {
                let rb = k / QK * bb;
                for (m, label, bytes, reps) in [
                    (1, "cache 1 MiB", 1 << 20, 64),
                    (1, "DRAM 96 MiB", 96 << 20, 2),
                    (128, "cache 256 KiB", 256 << 10, 4),
                    (128, "DRAM 48 MiB", 48 << 20, 1),
                ] {
                    let n = (bytes / rb).next_multiple_of(GROUP);
                    let w = weights(n, k, bb, halves, 9);
                    let g = pack_all(t, &w, n, rb, k);
                    let mut lines = vec![Line([0; 64]); g.len().div_ceil(64)];
                    lines_as_bytes_mut(&mut lines)[..g.len()].copy_from_slice(&g);
                    drop(g);
                    let gb = (t.group_bytes)(k);
                    let x = activations(m, k, 0);
                    let mut out = vec![0.0f32; n * m];
                    let mut tmp = vec![0.0f32; GROUP * m];
                    let units = (n * (k / QK) * m * reps) as f64;
                    let (mut best_old, mut best_new) = (f64::MAX, f64::MAX);
                    for round in 0..7 {
                        for v in 0..2 {
                            let t0 = std::time::Instant::now();
                            for _ in 0..reps {
                                if (v + round) % 2 == 0 {
                                    in_place(&w, rb, &x, &mut out);
                                } else {
                                    let bytes =
                                        &super::super::lines_as_bytes(&lines)[..n / GROUP * gb];
                                    for grp in bytes.chunks_exact(gb) {
                                        // SAFETY: `have()` checked the instruction sets.
                                        unsafe { (t.dot)(grp, k, &x, &mut tmp) };
                                        std::hint::black_box(&mut tmp);
                                    }
                                }
                                std::hint::black_box(&mut out);
                            }
                            let ns = t0.elapsed().as_secs_f64() * 1e9 / units;
                            if (v + round) % 2 == 0 {
                                best_old = best_old.min(ns);
                            } else {
                                best_new = best_new.min(ns);
                            }
                        }
                    }
                    eprintln!(
                        "{dt} k {k} m {m} {label}: in place {best_old:.3} ns, packed \
                         {best_new:.3} ns per (block, weight row, activation row), {:.2}x",
                        best_old / best_new
                    );
                }
            }
        }
    }

    /// `m` activation rows of `k` as 8-bit blocks: blocks of magnitudes 1e-3 to 1e3, some
    /// all zero, some with a lone large value.
    pub(crate) fn activations8(m: usize, k: usize, seed: u64) -> Q8Rows {
        let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let mut x = vec![0.0f32; m * k];
        for blk in x.chunks_exact_mut(QK) {
            let mag = match next() % 8 {
                0 => 0.0,
                e => 10f32.powi(e as i32 - 4),
            };
            for v in blk.iter_mut() {
                *v = ((next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * mag;
            }
            if next() % 4 == 0 {
                blk[(next() % 32) as usize] = 50.0 * mag;
            }
        }
        Q8Rows::quantize(&x)
    }

    /// The 8-bit product of every packed group: `out[i * n + j]`, the groups in 64-byte
    /// aligned memory (as the cache keeps them).
    fn packed_product8(
        t: &PackedType,
        g: &[u8],
        n: usize,
        k: usize,
        x: &Q8Rows,
        avx2: bool,
    ) -> Vec<f32> {
        let gb = (t.group_bytes)(k);
        let m = x.d.len() / (k / QK);
        let mut aligned = vec![Line([0; 64]); g.len().div_ceil(64)];
        let bytes = &mut lines_as_bytes_mut(&mut aligned)[..g.len()];
        bytes.copy_from_slice(g);
        let dot8 = if avx2 { t.dot8_avx2 } else { t.dot8 }.expect("an 8-bit body");
        let mut res = vec![0.0f32; n * m];
        let mut tmp = vec![0.0f32; GROUP * m];
        for (gi, grp) in bytes.chunks_exact(gb).enumerate() {
            // SAFETY: the caller checked the instruction sets (`have`, `have_avx2`); `grp` is
            // one group of `k`.
            unsafe { dot8(grp, k, x, &mut tmp) };
            for i in 0..m {
                for r in 0..GROUP {
                    let j = gi * GROUP + r;
                    if j < n {
                        res[i * n + j] = tmp[i * GROUP + r];
                    } else {
                        assert_eq!(tmp[i * GROUP + r].to_bits(), 0, "pad lane {r}");
                    }
                }
            }
        }
        res
    }

    #[test]
    fn q4_0_with_8bit_activations_matches_an_exact_reference() {
        for avx2 in [false, true] {
            if if avx2 { have_avx2() } else { have() } {
                q4_0_8bit_against_an_exact_reference(avx2);
            }
        }
    }

    /// The 8-bit Q4_0 body (AVX2 or AVX-512) against the kernel's order (bits) and an f64
    /// product (tolerance).
    fn q4_0_8bit_against_an_exact_reference(avx2: bool) {
        let t = packed_type_of(DType::Q4_0);
        // k of 1 to 176 blocks, n not a multiple of 16, m from 1 (a leftover body) to 40.
        for (k, n, ms) in [
            (32, 5, &[1, 6, 9][..]),
            (64, 16, &[2, 7, 40]),
            (96, 37, &[3, 6, 8, 13]),
            (576, 21, &[4, 6, 16, 23]),
            (5632, 17, &[5, 11]),
        ] {
            let nb = k / QK;
            let rb = nb * 18;
            for &m in ms {
                let w = weights(n, k, 18, &[0], 7 + k as u64 + m as u64);
                let g = pack_all(t, &w, n, rb, k);
                let x = activations8(m, k, k as u64 + m as u64);
                let got = packed_product8(t, &g, n, k, &x, avx2);
                for j in 0..n {
                    for i in 0..m {
                        // The kernel's order: per block, the exact integer sum, times
                        // `d_w * d_x` (f32), added by one FMA in block order.
                        let (mut acc, mut exact, mut bound) = (0.0f32, 0.0f64, 0.0f64);
                        for b in 0..nb {
                            let blk = &w[j * rb + b * 18..j * rb + (b + 1) * 18];
                            let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                            let q = nibbles(&blk[2..18]);
                            let xb = i * nb + b;
                            let mut sum = 0i32;
                            for (l, &qv) in q.iter().enumerate() {
                                let p = (i32::from(qv) - 8) * i32::from(x.value(xb, l));
                                sum += p;
                                let v = f64::from(dw) * f64::from(x.d[xb]) * f64::from(p);
                                bound += v.abs();
                            }
                            acc = (dw * x.d[xb]).mul_add(sum as f32, acc);
                            exact += f64::from(dw) * f64::from(x.d[xb]) * f64::from(sum);
                        }
                        let v = got[i * n + j];
                        assert_eq!(
                            v.to_bits(),
                            acc.to_bits(),
                            "avx2 {avx2} k {k} m {m} ({i}, {j})"
                        );
                        assert!(
                            (f64::from(v) - exact).abs() <= 1e-5 * bound,
                            "k {k} m {m} ({i}, {j}): {v} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn packed8_speed() {
        if !have() {
            return;
        }
        let t = packed_type_of(DType::Q4_0);
        let dot8 = t.dot8.expect("an 8-bit body");
        for k in [768, 2048] {
            let rb = k / QK * 18;
            for (label, bytes) in [("cache 256 KiB", 256 << 10), ("DRAM 48 MiB", 48 << 20)] {
                let m = 128;
                let n = (bytes / rb).next_multiple_of(GROUP);
                let w = weights(n, k, 18, &[0], 9);
                let g = pack_all(t, &w, n, rb, k);
                let mut lines = vec![Line([0; 64]); g.len().div_ceil(64)];
                lines_as_bytes_mut(&mut lines)[..g.len()].copy_from_slice(&g);
                drop(g);
                let gb = (t.group_bytes)(k);
                let all = &super::super::lines_as_bytes(&lines)[..n / GROUP * gb];
                let x16 = activations(m, k, 0);
                let x8 = activations8(m, k, 0);
                let mut tmp = vec![0.0f32; GROUP * m];
                let units = (n * (k / QK) * m) as f64;
                let (mut best16, mut best8) = (f64::MAX, f64::MAX);
                for round in 0..9 {
                    for v in 0..2 {
                        let eight = (v + round) % 2 == 1;
                        let t0 = std::time::Instant::now();
                        for grp in all.chunks_exact(gb) {
                            // SAFETY: `have()` checked the instruction sets.
                            unsafe {
                                if eight {
                                    dot8(grp, k, &x8, &mut tmp);
                                } else {
                                    (t.dot)(grp, k, &x16, &mut tmp);
                                }
                            }
                            std::hint::black_box(&mut tmp);
                        }
                        let ns = t0.elapsed().as_secs_f64() * 1e9 / units;
                        if eight {
                            best8 = best8.min(ns);
                        } else {
                            best16 = best16.min(ns);
                        }
                    }
                }
                eprintln!(
                    "Q4_0 k {k} m {m} {label}: 16-bit {best16:.4} ns, 8-bit {best8:.4} ns per \
                     (block, weight row, activation row), {:.2}x",
                    best16 / best8
                );
            }
        }
    }

    #[test]
    fn a_row_comes_back_from_its_group_byte_for_byte() {
        for (dt, bb, halves) in TYPES {
            let t = packed_type_of(dt);
            let (n, k) = (21, 96);
            let rb = k / QK * bb;
            let w = weights(n, k, bb, halves, 4);
            let g = pack_all(t, &w, n, rb, k);
            let gb = (t.group_bytes)(k);
            let mut raw = vec![0u8; rb];
            for j in 0..n {
                let grp = &g[j / GROUP * gb..(j / GROUP + 1) * gb];
                assert!(raw_row_of(dt, grp, k, j % GROUP, &mut raw));
                assert_eq!(raw, &w[j * rb..(j + 1) * rb], "{dt} row {j}");
            }
        }
    }

    fn packed_type_of(dt: DType) -> &'static PackedType {
        lookup(dt).expect("a packed type")
    }
}
