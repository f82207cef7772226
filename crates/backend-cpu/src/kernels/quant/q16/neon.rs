//! NEON bodies of the 16-bit-activation products ([`DotFn`]) for aarch64: Q4_0, Q4_1, Q8_0,
//! Q4_K and Q6_K weights read in place.
//!
//! Why: without them an ARM CPU ran every quantized product on the exact path (f32 activations
//! against the scalar dequantization of each weight row), several instructions per weight. The
//! integer form of `super` (weights' small integers times the activations' 16-bit blocks)
//! needs only widening multiply-adds, which NEON has on every aarch64 CPU: no run-time
//! detection, `super::dot_fn` hands these out wherever it is compiled for aarch64.
//!
//! Strategy: a body serves a tile of up to 4 weight rows by 1 or 2 activation rows. Per
//! activation block each weight row's block is unpacked once to four vectors of 8 i16 (nibbles
//! or bytes widened), and per activation row its 32 products are taken by `smull`/`smlal`
//! (`vmull_s16`, `vmlal_high_s16`) into 4 i32 lanes; the 4 rows' lanes are reduced together by
//! two levels of `addp` ([`sum4`]), so that lane `r` of one vector holds weight row `r`'s exact
//! integer sum, and one 4-lane FMA scales the 4 rows' sums by `d_w * d_x` (the 4 rows' f16
//! scales converted by one `fcvtl`). Q4_0's -8 offset comes off the 4 sums at once as `8 * n_x`
//! (the activation block's integer sum); the mins of Q4_1 (`m_w * s_x`) and Q4_K (`dmin * m_j *
//! s_x`) run in a second FMA chain per activation row, added (Q4_1) or taken off (Q4_K) at the
//! end. Q4_K's 8 sub-blocks are activation blocks; Q6_K's 16 sub-blocks of 16 each take their
//! own integer sum and FMA, sub-block by sub-block. A tile of fewer than 4 weight rows (a
//! job's leftover) pads the missing lanes with zeros.
//!
//! Invariants: each integer sum is exact (a lane adds 8 products of at most 128 * 32767 in
//! magnitude: below 2^31); each output is one chain of FMAs over its blocks in block order (for
//! Q6_K over its sub-blocks in order), `acc = fma(d_w * d_x, sum as f32, acc)`, plus the mins'
//! own chain `mins = fma(m_w, s_x, mins)` at the end, the same for every tile it may sit in. So
//! an output's bits depend only on its weight row and activation row, never on the tile, the
//! job split or the thread count; the unit tests below check them bit for bit against a scalar
//! computation of that formula. Q4_0, Q4_1 and Q4_K keep the order of the AVX2 4-row decode
//! tiles (`super::x86`, `*_dec4`).

use std::arch::aarch64::*;

use lowsync_graph::DType;

use super::{tile_shape, Act, DotFn, QRows, QK};

/// The NEON body for weights of `dt`, if there is one.
pub(super) fn dot_fn(dt: DType) -> Option<DotFn> {
    Some(match dt {
        DType::Q4_0 => dot::<Q40>,
        DType::Q4_1 => dot::<Q41>,
        DType::Q8_0 => dot::<Q80>,
        DType::Q4_K => dot::<Q4K>,
        DType::Q6_K => dot::<Q6K>,
        _ => return None,
    })
}

/// A weight type's tile body.
trait Body {
    /// Bytes of a weight block.
    const BB: usize;
    /// Activation blocks a weight block covers.
    const PER: usize;

    /// Lane `r` of element `i` is weight row `r` (of `W`, rows `rb` bytes apart in `w`) times
    /// activation row `i` (of `R` in `a`); lanes from `W` on are zero.
    ///
    /// # Safety
    /// `w` holds `W` rows of `rb` bytes, each `a.nb / PER` whole blocks; `a` holds `R` rows of
    /// `a.nb` blocks; `W <= 4`.
    unsafe fn tile<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [float32x4_t; R];
}

/// Checks the shapes, then runs `K`'s body over tiles of up to 4 weight rows by up to 2
/// activation rows; `out[i * rows + r]` receives weight row `r` times activation row `i`. A
/// mismatch writes zeros (and asserts in debug builds).
fn dot<K: Body>(w: &[u8], row_bytes: usize, x: &QRows, out: &mut [f32]) {
    if out.is_empty() {
        return;
    }
    let Some((m, nb)) = tile_shape(w, row_bytes, K::BB, K::PER, x, out) else {
        debug_assert!(
            false,
            "{} weight bytes, {row_bytes} a row, {} outputs, {} activation blocks",
            w.len(),
            out.len(),
            x.d.len()
        );
        out.fill(0.0);
        return;
    };
    let rows = w.len() / row_bytes;
    let mut j = 0;
    while j < rows {
        let wn = (rows - j).min(4);
        let wt = &w[j * row_bytes..(j + wn) * row_bytes];
        let mut r0 = 0;
        while r0 < m {
            let rn = (m - r0).min(2);
            let act = x.act(r0, rn, nb);
            let at = (j, wn, rows, r0);
            // SAFETY: NEON is baseline on aarch64; `wt` holds `wn <= 4` rows of `row_bytes`,
            // `nb / PER` whole blocks each (checked above), and `act` `rn` rows of `nb` blocks.
            unsafe {
                match (wn, rn) {
                    (4, 2) => store(&K::tile::<4, 2>(wt, row_bytes, &act), out, at),
                    (4, _) => store(&K::tile::<4, 1>(wt, row_bytes, &act), out, at),
                    (3, 2) => store(&K::tile::<3, 2>(wt, row_bytes, &act), out, at),
                    (3, _) => store(&K::tile::<3, 1>(wt, row_bytes, &act), out, at),
                    (2, 2) => store(&K::tile::<2, 2>(wt, row_bytes, &act), out, at),
                    (2, _) => store(&K::tile::<2, 1>(wt, row_bytes, &act), out, at),
                    (_, 2) => store(&K::tile::<1, 2>(wt, row_bytes, &act), out, at),
                    _ => store(&K::tile::<1, 1>(wt, row_bytes, &act), out, at),
                }
            }
            r0 += rn;
        }
        j += wn;
    }
}

/// Writes a tile's results: lane `r` of `t[i]` (weight row `j + r`, `r < wn`, times activation
/// row `r0 + i`) to `out[(r0 + i) * rows + j + r]`.
fn store<const R: usize>(
    t: &[float32x4_t; R],
    out: &mut [f32],
    (j, wn, rows, r0): (usize, usize, usize, usize),
) {
    for (i, v) in t.iter().enumerate() {
        let mut lanes = [0.0f32; 4];
        // SAFETY: 4 lanes into an array of 4.
        unsafe { vst1q_f32(lanes.as_mut_ptr(), *v) };
        let at = (r0 + i) * rows + j;
        out[at..at + wn].copy_from_slice(&lanes[..wn]);
    }
}

/// Weight row `r`'s block `b` (`bb` bytes a block, rows `rb` bytes apart).
#[inline(always)]
unsafe fn block_at(w: &[u8], rb: usize, r: usize, bb: usize, b: usize) -> *const u8 {
    w.as_ptr().add(r * rb + b * bb)
}

/// The little-endian u16 at `p`.
#[inline(always)]
unsafe fn u16_at(p: *const u8) -> u16 {
    u16::from_le_bytes([*p, *p.add(1)])
}

/// Four f16 bit patterns as four f32 (one `fcvtl`: exact, as every f16 is an f32).
#[inline(always)]
unsafe fn f16x4(h: &[u16; 4]) -> float32x4_t {
    vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h.as_ptr())))
}

/// The f16 at byte `o` of block `b` of each of the tile's `W` rows, as 4 f32 (zero past `W`).
#[inline(always)]
unsafe fn f16_rows<const W: usize>(
    w: &[u8],
    rb: usize,
    bb: usize,
    b: usize,
    o: usize,
) -> float32x4_t {
    let mut h = [0u16; 4];
    for (r, h) in h.iter_mut().enumerate().take(W) {
        *h = u16_at(block_at(w, rb, r, bb, b).add(o));
    }
    f16x4(&h)
}

/// Activation block `b` of tile row `i`: elements 0..8, 8..16, 16..24, 24..32.
#[inline(always)]
unsafe fn x_block(a: &Act<'_>, i: usize, b: usize) -> [int16x8_t; 4] {
    let p = a.q.as_ptr().add((i * a.nb + b) * QK);
    [
        vld1q_s16(p),
        vld1q_s16(p.add(8)),
        vld1q_s16(p.add(16)),
        vld1q_s16(p.add(24)),
    ]
}

/// 16 bytes widened to two vectors of 8 i16 (all values fit: 0..=63 or -128..=127 read as
/// signed where the caller says so).
#[inline(always)]
unsafe fn widen_u8(v: uint8x16_t) -> [int16x8_t; 2] {
    [
        vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(v))),
        vreinterpretq_s16_u16(vmovl_high_u8(v)),
    ]
}

/// 16 signed bytes widened to two vectors of 8 i16.
#[inline(always)]
unsafe fn widen_s8(v: int8x16_t) -> [int16x8_t; 2] {
    [vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v)]
}

/// The 32 nibbles of the 16 bytes at `p` in element order (Q4_0, Q4_1): low nibbles are
/// elements 0..16, high nibbles 16..32.
#[inline(always)]
unsafe fn nibbles16(p: *const u8) -> [int16x8_t; 4] {
    let v = vld1q_u8(p);
    let [a, b] = widen_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
    let [c, d] = widen_u8(vshrq_n_u8::<4>(v));
    [a, b, c, d]
}

/// The low (`high` false) or high nibbles of the 32 bytes at `p`, in byte order (a Q4_K
/// sub-block).
#[inline(always)]
unsafe fn nibbles32(p: *const u8, high: bool) -> [int16x8_t; 4] {
    let (v0, v1) = (vld1q_u8(p), vld1q_u8(p.add(16)));
    let (v0, v1) = if high {
        (vshrq_n_u8::<4>(v0), vshrq_n_u8::<4>(v1))
    } else {
        let m = vdupq_n_u8(0x0F);
        (vandq_u8(v0, m), vandq_u8(v1, m))
    };
    let [a, b] = widen_u8(v0);
    let [c, d] = widen_u8(v1);
    [a, b, c, d]
}

/// `sum(w[e] * x[e])` over the 16 elements of two vector pairs, in 4 i32 lanes (each adds 4
/// products; exact).
#[inline(always)]
unsafe fn dot16(w0: int16x8_t, w1: int16x8_t, x0: int16x8_t, x1: int16x8_t) -> int32x4_t {
    let p = vmlal_high_s16(vmull_s16(vget_low_s16(w0), vget_low_s16(x0)), w0, x0);
    vmlal_high_s16(vmlal_s16(p, vget_low_s16(w1), vget_low_s16(x1)), w1, x1)
}

/// `sum(w[e] * x[e])` over a block of 32, in 4 i32 lanes (two independent chains, each lane
/// adding 8 products; exact).
#[inline(always)]
unsafe fn dot32(w: &[int16x8_t; 4], x: &[int16x8_t; 4]) -> int32x4_t {
    vaddq_s32(dot16(w[0], w[1], x[0], x[1]), dot16(w[2], w[3], x[2], x[3]))
}

/// The 4 row sums of `p` (each the sum of its 4 lanes), row `r` in lane `r`: two levels of
/// pairwise adds for the 4 rows (integer: exact in any order).
#[inline(always)]
unsafe fn sum4(p: &[int32x4_t; 4]) -> int32x4_t {
    vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3]))
}

/// Each activation row's 4 weight rows' exact integer sums over block `b`, lane `r` for row
/// `r` (zero past `W`).
#[inline(always)]
unsafe fn row_sums<const W: usize>(
    qw: &[[int16x8_t; 4]; W],
    a: &Act<'_>,
    i: usize,
    b: usize,
) -> int32x4_t {
    let x = x_block(a, i, b);
    let mut p = [vdupq_n_s32(0); 4];
    for (p, qw) in p.iter_mut().zip(qw) {
        *p = dot32(qw, &x);
    }
    sum4(&p)
}

/// Q4_0: 18-byte blocks, `d` (f16) and 32 nibbles `q`, value `d * (q - 8)`.
struct Q40;

impl Body for Q40 {
    const BB: usize = 18;
    const PER: usize = 1;

    #[inline(always)]
    unsafe fn tile<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [float32x4_t; R] {
        let mut acc = [vdupq_n_f32(0.0); R];
        for b in 0..a.nb {
            let mut qw = [[vdupq_n_s16(0); 4]; W];
            for (r, qw) in qw.iter_mut().enumerate() {
                *qw = nibbles16(block_at(w, rb, r, 18, b).add(2));
            }
            let dw = f16_rows::<W>(w, rb, 18, b, 0);
            for (i, acc) in acc.iter_mut().enumerate() {
                let ib = i * a.nb + b;
                // sum((q - 8) * x) = sum(q * x) - 8 * sum(x): |sum| <= 15 * 32767 * 32.
                let sum = vsubq_s32(row_sums(&qw, a, i, b), vdupq_n_s32(8 * a.n[ib]));
                let scale = vmulq_n_f32(dw, a.d[ib]);
                *acc = vfmaq_f32(*acc, scale, vcvtq_f32_s32(sum));
            }
        }
        acc
    }
}

/// Q4_1: 20-byte blocks, `d` and `m` (f16) and 32 nibbles `q`, value `d * q + m`.
struct Q41;

impl Body for Q41 {
    const BB: usize = 20;
    const PER: usize = 1;

    #[inline(always)]
    unsafe fn tile<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [float32x4_t; R] {
        let mut acc = [vdupq_n_f32(0.0); R];
        let mut mins = [vdupq_n_f32(0.0); R];
        for b in 0..a.nb {
            let mut qw = [[vdupq_n_s16(0); 4]; W];
            for (r, qw) in qw.iter_mut().enumerate() {
                *qw = nibbles16(block_at(w, rb, r, 20, b).add(4));
            }
            let dw = f16_rows::<W>(w, rb, 20, b, 0);
            let mw = f16_rows::<W>(w, rb, 20, b, 2);
            for (i, (acc, mins)) in acc.iter_mut().zip(&mut mins).enumerate() {
                let ib = i * a.nb + b;
                let sum = row_sums(&qw, a, i, b);
                *acc = vfmaq_f32(*acc, vmulq_n_f32(dw, a.d[ib]), vcvtq_f32_s32(sum));
                *mins = vfmaq_f32(*mins, mw, vdupq_n_f32(a.s[ib]));
            }
        }
        std::array::from_fn(|i| vaddq_f32(acc[i], mins[i]))
    }
}

/// Q8_0: 34-byte blocks, `d` (f16) and 32 i8 `q`, value `d * q`.
struct Q80;

impl Body for Q80 {
    const BB: usize = 34;
    const PER: usize = 1;

    #[inline(always)]
    unsafe fn tile<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [float32x4_t; R] {
        let mut acc = [vdupq_n_f32(0.0); R];
        for b in 0..a.nb {
            let mut qw = [[vdupq_n_s16(0); 4]; W];
            for (r, qw) in qw.iter_mut().enumerate() {
                let p = block_at(w, rb, r, 34, b);
                let [e0, e1] = widen_s8(vld1q_s8(p.add(2).cast()));
                let [e2, e3] = widen_s8(vld1q_s8(p.add(18).cast()));
                *qw = [e0, e1, e2, e3];
            }
            let dw = f16_rows::<W>(w, rb, 34, b, 0);
            for (i, acc) in acc.iter_mut().enumerate() {
                let ib = i * a.nb + b;
                // |sum| <= 128 * 32767 * 32 < 2^28: exact in i32, rounded once to f32.
                let sum = row_sums(&qw, a, i, b);
                *acc = vfmaq_f32(*acc, vmulq_n_f32(dw, a.d[ib]), vcvtq_f32_s32(sum));
            }
        }
        acc
    }
}

/// Q4_K: 144-byte super-blocks of 8 sub-blocks of 32 (each one activation block): `d`, `dmin`
/// (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; value `d * sc_j * q - dmin
/// * m_j`.
struct Q4K;

impl Body for Q4K {
    const BB: usize = 144;
    const PER: usize = 8;

    #[inline(always)]
    unsafe fn tile<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [float32x4_t; R] {
        let mut acc = [vdupq_n_f32(0.0); R];
        let mut mins = [vdupq_n_f32(0.0); R];
        for sb in 0..a.nb / 8 {
            // Per sub-block `j`, the 4 rows' `d * sc_j` and `dmin * m_j` side by side (the
            // values of `scalar::k_scale_min`, times the f16 scales in f32).
            let (mut f, mut mn) = ([[0.0f32; 4]; 8], [[0.0f32; 4]; 8]);
            let dw = f16_rows::<W>(w, rb, 144, sb, 0);
            let dmin = f16_rows::<W>(w, rb, 144, sb, 2);
            let (mut dv, mut mv) = ([0.0f32; 4], [0.0f32; 4]);
            vst1q_f32(dv.as_mut_ptr(), dw);
            vst1q_f32(mv.as_mut_ptr(), dmin);
            for r in 0..W {
                let p = block_at(w, rb, r, 144, sb);
                let sc = std::slice::from_raw_parts(p.add(4), 12);
                for j in 0..8 {
                    let (s, m) = super::super::scalar::k_scale_min(sc, j);
                    f[j][r] = dv[r] * f32::from(s);
                    mn[j][r] = mv[r] * f32::from(m);
                }
            }
            for j in 0..8 {
                let b = sb * 8 + j;
                let mut qw = [[vdupq_n_s16(0); 4]; W];
                for (r, qw) in qw.iter_mut().enumerate() {
                    let q = block_at(w, rb, r, 144, sb).add(16 + 32 * (j / 2));
                    *qw = nibbles32(q, j % 2 == 1);
                }
                let (fj, mj) = (vld1q_f32(f[j].as_ptr()), vld1q_f32(mn[j].as_ptr()));
                for (i, (acc, mins)) in acc.iter_mut().zip(&mut mins).enumerate() {
                    let ib = i * a.nb + b;
                    // |sum| <= 15 * 32767 * 32 < 2^24.
                    let sum = row_sums(&qw, a, i, b);
                    *acc = vfmaq_f32(*acc, vmulq_n_f32(fj, a.d[ib]), vcvtq_f32_s32(sum));
                    *mins = vfmaq_f32(*mins, mj, vdupq_n_f32(a.s[ib]));
                }
            }
        }
        std::array::from_fn(|i| vsubq_f32(acc[i], mins[i]))
    }
}

/// Q6_K: 210-byte super-blocks of 16 sub-blocks of 16 (two per activation block): 128 bytes of
/// low nibbles, 64 bytes of 2 high bits, 16 i8 scales, `d` (f16); value `d * sc * (q - 32)`.
struct Q6K;

impl Body for Q6K {
    const BB: usize = 210;
    const PER: usize = 8;

    #[inline(always)]
    unsafe fn tile<const W: usize, const R: usize>(
        w: &[u8],
        rb: usize,
        a: &Act<'_>,
    ) -> [float32x4_t; R] {
        let mut acc = [vdupq_n_f32(0.0); R];
        let (m4, m2, off) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x03), vdupq_n_s8(32));
        for sb in 0..a.nb / 8 {
            // Per sub-block, the 4 rows' `d * sc` side by side.
            let mut f = [[0.0f32; 4]; 16];
            let mut dv = [0.0f32; 4];
            vst1q_f32(dv.as_mut_ptr(), f16_rows::<W>(w, rb, 210, sb, 208));
            for r in 0..W {
                let sc = block_at(w, rb, r, 210, sb).add(192);
                for (s, f) in f.iter_mut().enumerate() {
                    f[r] = dv[r] * f32::from(*sc.add(s) as i8);
                }
            }
            for half in 0..2 {
                for g in 0..4 {
                    // Elements half*128 + 32g .. +32: the nibbles of the ql bytes
                    // half*64 + (g%2)*32 .. +32 (low for g < 2, high after) and the 2 bits at
                    // shift 2g of the qh bytes half*32 .. +32.
                    let e = half * 128 + 32 * g;
                    let mut qw = [[vdupq_n_s16(0); 4]; W];
                    for (r, qw) in qw.iter_mut().enumerate() {
                        let p = block_at(w, rb, r, 210, sb);
                        let ql = p.add(64 * half + 32 * (g % 2));
                        let qh = p.add(128 + 32 * half);
                        let six = |o: usize| {
                            let l = vld1q_u8(ql.add(o));
                            let l = if g < 2 {
                                vandq_u8(l, m4)
                            } else {
                                vshrq_n_u8::<4>(l)
                            };
                            let h = vld1q_u8(qh.add(o));
                            let h = match g {
                                0 => vandq_u8(h, m2),
                                1 => vandq_u8(vshrq_n_u8::<2>(h), m2),
                                2 => vandq_u8(vshrq_n_u8::<4>(h), m2),
                                _ => vshrq_n_u8::<6>(h),
                            };
                            let q = vorrq_u8(l, vshlq_n_u8::<4>(h));
                            widen_s8(vsubq_s8(vreinterpretq_s8_u8(q), off))
                        };
                        let ([e0, e1], [e2, e3]) = (six(0), six(16));
                        *qw = [e0, e1, e2, e3];
                    }
                    let b = sb * 8 + half * 4 + g;
                    let (f0, f1) = (
                        vld1q_f32(f[e / 16].as_ptr()),
                        vld1q_f32(f[e / 16 + 1].as_ptr()),
                    );
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let ib = i * a.nb + b;
                        let x = x_block(a, i, b);
                        // Per sub-block of 16: |sum| <= 32 * 32767 * 16 < 2^24.
                        let (mut p0, mut p1) = ([vdupq_n_s32(0); 4], [vdupq_n_s32(0); 4]);
                        for ((p0, p1), q) in p0.iter_mut().zip(&mut p1).zip(&qw) {
                            *p0 = dot16(q[0], q[1], x[0], x[1]);
                            *p1 = dot16(q[2], q[3], x[2], x[3]);
                        }
                        let dx = a.d[ib];
                        *acc = vfmaq_f32(*acc, vmulq_n_f32(f0, dx), vcvtq_f32_s32(sum4(&p0)));
                        *acc = vfmaq_f32(*acc, vmulq_n_f32(f1, dx), vcvtq_f32_s32(sum4(&p1)));
                    }
                }
            }
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    //! Every body against a scalar computation of the same formula (per block the exact integer
    //! sum of the weights' values times the activations' 16-bit values, `acc = fma(d_w * d_x,
    //! sum as f32, acc)` in block order, the mins in a chain of their own): the same f32
    //! operations in the same order, so the results must be equal bit for bit. Random blocks
    //! with extreme values (activations at ±32767, weights at the ends of their ranges, f16
    //! scales of both signs, zero blocks), tiles of 1-4 weight rows by 1-2 activation rows,
    //! rows of one block (or super-block) up to 64.

    use super::*;
    use crate::kernels::quant::scalar::k_scale_min;
    use half::f16;

    /// A small LCG: the test data is the same on every run.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            self.0 >> 33
        }

        fn byte(&mut self) -> u8 {
            self.next() as u8
        }
    }

    /// `(type, block bytes, offsets of the f16 scales)` of every type with a body.
    const TYPES: [(DType, usize, &[usize]); 5] = [
        (DType::Q4_0, 18, &[0]),
        (DType::Q4_1, 20, &[0, 2]),
        (DType::Q8_0, 34, &[0]),
        (DType::Q4_K, 144, &[0, 2]),
        (DType::Q6_K, 210, &[208]),
    ];

    /// A finite f16 of either sign, magnitude in [2^-14, 2^4), sometimes zero or the largest.
    fn scale(rng: &mut Lcg) -> u16 {
        match rng.next() % 16 {
            0 => 0,
            1 => 0x7BFF,
            2 => 0xFBFF,
            _ => {
                let (sign, exp, man) = (rng.next() & 1, 1 + rng.next() % 18, rng.next() & 0x3FF);
                ((sign << 15) | (exp << 10) | man) as u16
            }
        }
    }

    /// `n` rows of `row_bytes` of `bb`-byte blocks: random bytes, some blocks all zero bits,
    /// some all one bits (the ends of every value range), with f16 scales at `halves`.
    fn weights(n: usize, row_bytes: usize, bb: usize, halves: &[usize], rng: &mut Lcg) -> Vec<u8> {
        let mut w = vec![0u8; n * row_bytes];
        for blk in w.chunks_exact_mut(bb) {
            let fill = match rng.next() % 8 {
                0 => Some(0x00),
                1 => Some(0xFF),
                2 => Some(0x88),
                _ => None,
            };
            for v in blk.iter_mut() {
                *v = fill.unwrap_or_else(|| rng.byte());
            }
            for &o in halves {
                blk[o..o + 2].copy_from_slice(&scale(rng).to_le_bytes());
            }
        }
        w
    }

    /// `m` activation rows of `nb` blocks built directly: values random, at ±32767 or zero per
    /// block, scales `d` of either sign (zero for zero blocks), `s = d * n`.
    fn activations(m: usize, nb: usize, rng: &mut Lcg) -> QRows {
        let blocks = m * nb;
        let mut x = QRows {
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
            n: vec![0; blocks],
            q: vec![0; blocks * QK],
        };
        for b in 0..blocks {
            let kind = rng.next() % 6;
            let q = &mut x.q[b * QK..(b + 1) * QK];
            for v in q.iter_mut() {
                *v = match kind {
                    0 => 0,
                    1 => 32767,
                    2 => -32767,
                    3 => {
                        if rng.next() & 1 == 0 {
                            32767
                        } else {
                            -32767
                        }
                    }
                    _ => ((rng.next() % 65535) as i32 - 32767) as i16,
                };
            }
            let n: i32 = q.iter().map(|&v| i32::from(v)).sum();
            let d = if kind == 0 {
                0.0
            } else {
                let mag = (rng.next() % 1000 + 1) as f32 * 1e-6;
                if rng.next() & 1 == 0 {
                    mag
                } else {
                    -mag
                }
            };
            (x.d[b], x.s[b], x.n[b]) = (d, d * n as f32, n);
        }
        x
    }

    fn f16_at(b: &[u8], o: usize) -> f32 {
        f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
    }

    /// Weight row `w` (raw blocks) times activation row `i` of `x` by the formula, in scalar
    /// code.
    fn reference(dt: DType, w: &[u8], x: &QRows, i: usize, nb: usize) -> f32 {
        let xq = |b: usize, e: usize| i64::from(x.q[(i * nb + b) * QK + e]);
        let (dx, sx) = (|b: usize| x.d[i * nb + b], |b: usize| x.s[i * nb + b]);
        let (mut acc, mut mins) = (0.0f32, 0.0f32);
        match dt {
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
                let bb = [18, 20, 34][[DType::Q4_0, DType::Q4_1, DType::Q8_0]
                    .iter()
                    .position(|&t| t == dt)
                    .unwrap()];
                for (b, blk) in w.chunks_exact(bb).enumerate() {
                    let val = |e: usize| -> i64 {
                        match dt {
                            DType::Q4_0 => i64::from((blk[2 + e % 16] >> (4 * (e / 16))) & 15) - 8,
                            DType::Q4_1 => i64::from((blk[4 + e % 16] >> (4 * (e / 16))) & 15),
                            _ => i64::from(blk[2 + e] as i8),
                        }
                    };
                    let sum: i64 = (0..QK).map(|e| val(e) * xq(b, e)).sum();
                    let sum = i32::try_from(sum).unwrap() as f32;
                    acc = (f16_at(blk, 0) * dx(b)).mul_add(sum, acc);
                    if dt == DType::Q4_1 {
                        mins = f16_at(blk, 2).mul_add(sx(b), mins);
                    }
                }
                if dt == DType::Q4_1 {
                    acc + mins
                } else {
                    acc
                }
            }
            DType::Q4_K => {
                for (sb, blk) in w.chunks_exact(144).enumerate() {
                    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                    for j in 0..8 {
                        let b = sb * 8 + j;
                        let (sc, mn) = k_scale_min(&blk[4..16], j);
                        let sum: i64 = (0..QK)
                            .map(|l| {
                                let q = (blk[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                                i64::from(q) * xq(b, l)
                            })
                            .sum();
                        let f = d * f32::from(sc);
                        acc = (f * dx(b)).mul_add(sum as f32, acc);
                        mins = (dmin * f32::from(mn)).mul_add(sx(b), mins);
                    }
                }
                acc - mins
            }
            _ => {
                for (sb, blk) in w.chunks_exact(210).enumerate() {
                    let d = f16_at(blk, 208);
                    for sub in 0..16 {
                        let b = sb * 8 + sub / 2;
                        let sum: i64 = (0..16)
                            .map(|l| {
                                let e = sub * 16 + l;
                                let (half, r) = (e / 128, e % 128);
                                let lo = (blk[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
                                let hi = (blk[128 + half * 32 + r % 32] >> (2 * (r / 32))) & 3;
                                (i64::from(lo | (hi << 4)) - 32) * xq(b, e % QK)
                            })
                            .sum();
                        let f = d * f32::from(blk[192 + sub] as i8);
                        acc = (f * dx(b)).mul_add(sum as f32, acc);
                    }
                }
                acc
            }
        }
    }

    #[test]
    fn every_neon_body_gives_the_bits_of_the_scalar_formula() {
        let mut rng = Lcg(17);
        let mut checked = 0usize;
        for (dt, bb, halves) in TYPES {
            let body = dot_fn(dt).expect("a NEON body");
            let per = if bb >= 144 { 8 } else { 1 };
            let blocks: &[usize] = if per == 8 { &[1, 2, 8] } else { &[1, 2, 7, 64] };
            for &wb in blocks {
                let (row_bytes, nb) = (wb * bb, wb * per);
                for rows in [1, 2, 3, 4, 5, 7, 8, 13] {
                    for m in 1..=3 {
                        let w = weights(rows, row_bytes, bb, halves, &mut rng);
                        let x = activations(m, nb, &mut rng);
                        let mut out = vec![f32::NAN; rows * m];
                        body(&w, row_bytes, &x, &mut out);
                        for i in 0..m {
                            for r in 0..rows {
                                let row = &w[r * row_bytes..(r + 1) * row_bytes];
                                let want = reference(dt, row, &x, i, nb);
                                let got = out[i * rows + r];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{dt} {wb} blocks, {rows} rows, m {m}: row {r} act {i}: \
                                     {got} vs {want}"
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked} outputs");
    }

    /// The NEON bodies against the exact path they replace here (each weight row dequantized by
    /// `scalar` and dotted in f32 with `dot_f32`), decode (one activation row), one thread,
    /// alternated in one process; ns per weight block of 32 values. Meant for an aarch64 CPU:
    /// under qemu the figures say nothing about one.
    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture on an aarch64 CPU"]
    fn neon_speed() {
        use crate::kernels::quant::{dot_f32, scalar::dequantize_row};
        let k = 2048;
        let mut rng = Lcg(5);
        let xf: Vec<f32> = (0..k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let x = QRows::quantize(&xf);
        for (dt, bb, halves) in TYPES {
            let row_bytes = k / QK / if bb >= 144 { 8 } else { 1 } * bb;
            for (label, bytes, reps) in [("cache 1 MiB", 1 << 20, 16), ("DRAM 64 MiB", 64 << 20, 1)]
            {
                let n = bytes / row_bytes / 4 * 4;
                let w = weights(n, row_bytes, bb, halves, &mut rng);
                let body = dot_fn(dt).expect("a NEON body");
                let (mut out, mut buf) = (vec![0.0f32; n], vec![0.0f32; k]);
                let exact = |out: &mut [f32], buf: &mut [f32]| {
                    for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                        dequantize_row(dt, row, buf);
                        *o = dot_f32(&xf, buf);
                    }
                };
                let blocks = (n * k / QK * reps) as f64;
                let (mut best_exact, mut best_neon) = (f64::MAX, f64::MAX);
                for round in 0..5 {
                    for which in [round % 2, 1 - round % 2] {
                        let t = std::time::Instant::now();
                        for _ in 0..reps {
                            if which == 0 {
                                exact(&mut out, &mut buf);
                            } else {
                                body(&w, row_bytes, &x, &mut out);
                            }
                            std::hint::black_box(&mut out);
                        }
                        let ns = t.elapsed().as_secs_f64() * 1e9 / blocks;
                        let best = if which == 0 {
                            &mut best_exact
                        } else {
                            &mut best_neon
                        };
                        *best = best.min(ns);
                    }
                }
                eprintln!(
                    "{dt} k {k} {label}: exact {best_exact:.3} ns/block, neon {best_neon:.3} \
                     ns/block, {:.2}x",
                    best_exact / best_neon
                );
            }
        }
    }

    #[test]
    fn the_f16_conversion_is_exact_for_every_finite_half() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            if !want.is_finite() {
                continue;
            }
            let mut got = [0.0f32; 4];
            // SAFETY: NEON is baseline on aarch64; 4 lanes into an array of 4.
            unsafe { vst1q_f32(got.as_mut_ptr(), f16x4(&[h, 0, h, 0])) };
            assert_eq!(got[0].to_bits(), want.to_bits(), "{h:#06x}");
            assert_eq!(got[2].to_bits(), want.to_bits(), "{h:#06x}");
        }
    }
}
