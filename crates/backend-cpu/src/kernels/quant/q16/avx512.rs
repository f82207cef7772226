//! AVX-512 bodies of the q16 products: VNNI (`vpdpwssd`) over weight panels packed once per
//! product and reused by every activation row.
//!
//! Why: a prefill product (128 activation rows in the bench) spent most of its instructions in
//! the AVX2 tiles on per-pair work: two `pmaddwd`, an add, a conversion, a scale broadcast and
//! an FMA for every (weight block, activation row) pair, and an unpacking per weight block and
//! 4-8 rows. With AVX-512 the integer sums can sit in lanes that are weight rows: one
//! `vpdpwssd` multiplies a pair of 16-bit values of 16 weight rows by the same pair of one
//! activation row (broadcast from memory) and adds it, so a block of 32 takes 16 such
//! instructions for 16 weight rows, and the scale work (conversion, `d_w * d_x`, FMA) is one
//! vector operation for 16 rows instead of one per row.
//!
//! Strategy: a job's weight rows are taken 16 at a time (a panel). A panel is unpacked once
//! into 16-bit values laid out lane = weight row, pair of values by pair of values (a 16 x 16
//! transposition of 32-bit pairs per block), with each row's per-block scales (and mins, for
//! Q4_1 and Q4_K) as vectors of 16 lanes; it stays in the L1/L2 while every activation row runs
//! over it in groups of up to 8, each row's 16 integer sums and 16 float accumulators in
//! registers. Q4_0's offset is taken into the unpacked values (`q - 8`); Q6_K's sub-blocks of 16
//! keep their float scales (`d * scale`), so a block takes two scaled groups of 8 pairs (folding
//! the 8-bit scales into the weights would let a 32-product lane overflow i32). Products with
//! fewer than [`PANEL_MIN_ROWS`] activation rows (decode) keep the AVX2 bodies of `super::x86`:
//! there nothing is shared between rows, and packing would cost more than the product. The one
//! exception is Q4_1 with one activation row, which runs an 8-row tile of its own
//! ([`q4_1_dec8`]: two rows' nibbles in one 512-bit vector); the same idea for Q4_0, a 256-bit
//! VNNI Q4_0 tile and a 512-bit Q8_0 row each lost to the AVX2 bodies from DRAM.
//!
//! Invariants: every lane's arithmetic is independent of the other lanes and of the group of
//! activation rows it runs in, so an output's bits depend only on its weight row and its
//! activation row: per block, the exact integer sum `sum(q_w * q_x)` (|sum| < 2^31; below 2^24
//! for the 4-bit types), converted to f32, times `d_w * d_x`, added by one FMA in block order;
//! the mins `m_w * s_x` (Q4_1; Q4_K negated) in a second chain added at the end. That is the
//! order of the AVX2 4-row decode tiles of Q4_0, Q4_1 and Q4_K (and of `q4_1_dec8`), so for
//! those types a prefill row and a decode row give the same bits; the AVX2 prefill tiles sum 8 lanes of partial sums
//! instead, so this path's bits differ from theirs (within f32 rounding). The bodies run only
//! where `dot_fn`'s caller detected AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C.

use std::arch::x86_64::*;
use std::cell::RefCell;

use lowsync_graph::DType;

use super::{DotFn, QRows, PANEL_MIN_ROWS, QK};

/// Weight rows per panel: the 16 lanes of a 512-bit vector of i32.
const PW: usize = 16;

/// The VNNI body for weights of `dt`, if there is one. The caller has detected AVX-512 F, BW,
/// VL and VNNI besides AVX2, FMA and F16C.
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

/// A packed panel: `q[b * 16 + p]` holds pair `p` (values `2p`, `2p + 1`) of activation block
/// `b` for the panel's 16 weight rows, lane = row; `f[b * gpb + g]` the 16 rows' scales of
/// group `g` of block `b` (`gpb` groups a block); `mn[b]` their mins (types with one). Lanes
/// past the job's last row are zero.
#[derive(Default)]
struct Panel {
    q: Vec<__m512i>,
    f: Vec<__m512>,
    mn: Vec<__m512>,
}

thread_local! {
    /// Each pool thread's panel, kept between products (a k of 2048 packs to about 72 KiB).
    static PANEL: RefCell<Panel> = RefCell::new(Panel::default());
}

/// A weight type's layout for packing: `BB` bytes a weight block covering `PER` activation
/// blocks, `G` pairs a scale group (16: one scale per block of 32; 8: two), mins or not.
trait Kind {
    const BB: usize;
    const PER: usize;
    const G: usize;
    const MIN: bool;

    /// Activation block `b`'s 32 weight values of the row at `row` as i16, in element order.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C are available; the row holds block `b`.
    unsafe fn unpack(row: *const u8, b: usize) -> __m512i;

    /// Block `b`'s scales (`16 / G` of them) into `f` and its min into `mn`.
    ///
    /// # Safety
    /// As [`Kind::unpack`].
    unsafe fn scales(row: *const u8, b: usize, f: &mut [f32; 2], mn: &mut f32);
}

/// The little-endian f16 at `p` as f32.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// The 32 nibbles of the 16 bytes at `p` as i16: low nibbles (elements 0..16), then high.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m512i {
    let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast()));
    let lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    let hi = _mm256_srli_epi16::<4>(v);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

struct Q40;
impl Kind for Q40 {
    const BB: usize = 18;
    const PER: usize = 1;
    const G: usize = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(row: *const u8, b: usize) -> __m512i {
        _mm512_sub_epi16(nibbles(row.add(18 * b + 2)), _mm512_set1_epi16(8))
    }
    #[inline(always)]
    unsafe fn scales(row: *const u8, b: usize, f: &mut [f32; 2], _: &mut f32) {
        f[0] = f16_at(row.add(18 * b));
    }
}

struct Q41;
impl Kind for Q41 {
    const BB: usize = 20;
    const PER: usize = 1;
    const G: usize = 16;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(row: *const u8, b: usize) -> __m512i {
        nibbles(row.add(20 * b + 4))
    }
    #[inline(always)]
    unsafe fn scales(row: *const u8, b: usize, f: &mut [f32; 2], mn: &mut f32) {
        f[0] = f16_at(row.add(20 * b));
        *mn = f16_at(row.add(20 * b + 2));
    }
}

struct Q80;
impl Kind for Q80 {
    const BB: usize = 34;
    const PER: usize = 1;
    const G: usize = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(row: *const u8, b: usize) -> __m512i {
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(row.add(34 * b + 2).cast()))
    }
    #[inline(always)]
    unsafe fn scales(row: *const u8, b: usize, f: &mut [f32; 2], _: &mut f32) {
        f[0] = f16_at(row.add(34 * b));
    }
}

/// Q4_K: sub-block `j` of a super-block is activation block `8 * sb + j`: the low (`j` even)
/// or high nibbles of the 32 bytes at `16 + 32 * (j / 2)`; scale `d * sc_j`, min
/// `-(dmin * m_j)` (negated, so that the mins' chain is added like Q4_1's).
struct Q4K;
impl Kind for Q4K {
    const BB: usize = 144;
    const PER: usize = 8;
    const G: usize = 16;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(row: *const u8, b: usize) -> __m512i {
        let (sb, j) = (b / 8, b % 8);
        let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            row.add(144 * sb + 16 + 32 * (j / 2)).cast(),
        ));
        if j % 2 == 0 {
            _mm512_and_si512(v, _mm512_set1_epi16(0x0F))
        } else {
            _mm512_srli_epi16::<4>(v)
        }
    }
    #[inline(always)]
    unsafe fn scales(row: *const u8, b: usize, f: &mut [f32; 2], mn: &mut f32) {
        let p = row.add(144 * (b / 8));
        let sc = std::slice::from_raw_parts(p.add(4), 12);
        let (s, m) = super::super::scalar::k_scale_min(sc, b % 8);
        f[0] = f16_at(p) * f32::from(s);
        *mn = -(f16_at(p.add(2)) * f32::from(m));
    }
}

/// Q6_K: activation block `j` of a super-block (`half = j / 4`, `g = j % 4`) holds elements
/// `128 * half + 32 * g ..`: the low (`g < 2`) or high nibbles of the `ql` bytes at
/// `64 * half + 32 * (g % 2)` and bits `2g..2g + 2` of the `qh` bytes at `128 + 32 * half`,
/// minus 32; its two sub-blocks of 16 have the scales `d * sc`.
struct Q6K;
impl Kind for Q6K {
    const BB: usize = 210;
    const PER: usize = 8;
    const G: usize = 8;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(row: *const u8, b: usize) -> __m512i {
        let (p, j) = (row.add(210 * (b / 8)), b % 8);
        let (half, g) = (j / 4, j % 4);
        let ql = _mm256_loadu_si256(p.add(64 * half + 32 * (g % 2)).cast());
        let qh = _mm256_loadu_si256(p.add(128 + 32 * half).cast());
        let m4 = _mm256_set1_epi8(0x0F);
        let lo = if g < 2 {
            _mm256_and_si256(ql, m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4)
        };
        let hi = match g {
            0 => qh,
            1 => _mm256_srli_epi16::<2>(qh),
            2 => _mm256_srli_epi16::<4>(qh),
            _ => _mm256_srli_epi16::<6>(qh),
        };
        let hi = _mm256_and_si256(hi, _mm256_set1_epi8(0x03));
        let q = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi));
        _mm512_sub_epi16(_mm512_cvtepu8_epi16(q), _mm512_set1_epi16(32))
    }
    #[inline(always)]
    unsafe fn scales(row: *const u8, b: usize, f: &mut [f32; 2], _: &mut f32) {
        let (p, j) = (row.add(210 * (b / 8)), b % 8);
        let d = f16_at(p.add(208));
        // Elements 32 * j .. 32 * j + 32: sub-blocks 2j and 2j + 1.
        f[0] = d * f32::from(*p.add(192 + 2 * j) as i8);
        f[1] = d * f32::from(*p.add(193 + 2 * j) as i8);
    }
}

/// A 16 x 16 matrix of 32-bit values, rows to columns (`m[r]` lane `c` to `m[c]` lane `r`):
/// pairs of 32-bit values, then of 64-bit, then 128-bit lanes twice.
#[inline(always)]
unsafe fn transpose16(m: &mut [__m512i; PW]) {
    let mut t = [_mm512_setzero_si512(); PW];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(m[2 * i], m[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(m[2 * i], m[2 * i + 1]);
    }
    // u[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i + 4.
    let mut u = [_mm512_setzero_si512(); PW];
    for i in 0..4 {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // Column 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j].
    for j in 0..4 {
        let v0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[j], u[4 + j]);
        let v1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[j], u[4 + j]);
        let v2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[8 + j], u[12 + j]);
        let v3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[8 + j], u[12 + j]);
        m[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v0, v2);
        m[4 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v0, v2);
        m[8 + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v1, v3);
        m[12 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v1, v3);
    }
}

/// Packs `rows` (at most 16) weight rows of `nb` activation blocks each into `pn`: each row
/// is unpacked whole in turn (one stream at a time, which the hardware prefetcher follows; 16
/// rows read side by side block by block ran up to 2x slower from DRAM), then each block's
/// 16 x 16 pairs are transposed in place.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn pack<K: Kind>(w: &[u8], rb: usize, rows: usize, nb: usize, pn: &mut Panel) {
    let gpb = 16 / K::G;
    let z = _mm512_setzero_si512();
    pn.q.clear();
    pn.q.resize(nb * PW, z);
    pn.f.clear();
    pn.f.resize(nb * gpb, _mm512_setzero_ps());
    pn.mn.clear();
    if K::MIN {
        pn.mn.resize(nb, _mm512_setzero_ps());
    }
    let (f, mn) = (
        pn.f.as_mut_ptr().cast::<f32>(),
        pn.mn.as_mut_ptr().cast::<f32>(),
    );
    for r in 0..rows {
        let row = w.as_ptr().add(r * rb);
        for b in 0..nb {
            *pn.q.get_unchecked_mut(b * PW + r) = K::unpack(row, b);
            let (mut fr, mut m) = ([0.0f32; 2], 0.0f32);
            K::scales(row, b, &mut fr, &mut m);
            for (g, v) in fr.iter().take(gpb).enumerate() {
                *f.add((b * gpb + g) * PW + r) = *v;
            }
            if K::MIN {
                *mn.add(b * PW + r) = m;
            }
        }
    }
    for blk in pn.q.chunks_exact_mut(PW) {
        let blk: &mut [__m512i; PW] = blk.try_into().expect("a block of 16 rows");
        transpose16(blk);
    }
}

/// `R` activation rows from row `r0` against a packed panel: for each row, the 16 weight rows'
/// results (lane = weight row). `G` pairs a scale group, `MIN` whether the panel has mins.
// Index loops: each row `i` addresses several arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn panel_rows<const R: usize, const G: usize, const MIN: bool>(
    pn: &Panel,
    x: &QRows,
    r0: usize,
    nb: usize,
) -> [__m512; R] {
    let gpb = 16 / G;
    let mut acc = [_mm512_setzero_ps(); R];
    let mut mins = [_mm512_setzero_ps(); R];
    let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
    for b in 0..nb {
        // Row i's block b: pair p at q[((r0 + i) * nb + b) * 32 + 2p].
        let xb: [*const i32; R] =
            std::array::from_fn(|i| xq.add(((r0 + i) * nb + b) * QK).cast::<i32>());
        for g in 0..gpb {
            let mut sum = [_mm512_setzero_si512(); R];
            for p in 0..G {
                let wv = *pn.q.get_unchecked(b * PW + g * G + p);
                for i in 0..R {
                    let xv = _mm512_set1_epi32(xb[i].add(g * G + p).read_unaligned());
                    sum[i] = if p == 0 {
                        _mm512_madd_epi16(wv, xv)
                    } else {
                        _mm512_dpwssd_epi32(sum[i], wv, xv)
                    };
                }
            }
            let fv = *pn.f.get_unchecked(b * gpb + g);
            for i in 0..R {
                let scale = _mm512_mul_ps(fv, _mm512_set1_ps(*xd.add((r0 + i) * nb + b)));
                acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum[i]), acc[i]);
            }
        }
        if MIN {
            let mv = *pn.mn.get_unchecked(b);
            for i in 0..R {
                let s = _mm512_set1_ps(*xs.add((r0 + i) * nb + b));
                mins[i] = _mm512_fmadd_ps(mv, s, mins[i]);
            }
        }
    }
    if MIN {
        for i in 0..R {
            acc[i] = _mm512_add_ps(acc[i], mins[i]);
        }
    }
    acc
}

/// Writes a group's results: weight row `j + lane` times activation row `r0 + i` to
/// `out[(r0 + i) * rows + j + lane]`, for the panel's `pr` lanes (one masked store a row).
#[inline(always)]
unsafe fn store<const R: usize>(
    res: &[__m512; R],
    out: &mut [f32],
    (j, pr, rows, r0): (usize, usize, usize, usize),
) {
    let mask: __mmask16 = if pr >= PW { !0 } else { (1u16 << pr) - 1 };
    for (i, v) in res.iter().enumerate() {
        let at = (r0 + i) * rows + j;
        debug_assert!(at + pr <= out.len());
        _mm512_mask_storeu_ps(out.as_mut_ptr().add(at), mask, *v);
    }
}

/// All activation rows of `x` against every panel of `w` (`rows` weight rows, `rb` bytes
/// apart, `nb` activation blocks each).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn panels<K: Kind>(w: &[u8], rb: usize, x: &QRows, out: &mut [f32], m: usize, nb: usize) {
    panels_by::<K, GROUP_ROWS>(w, rb, x, out, m, nb);
}

/// Activation rows per group over a panel: with 8, a group's integer sums, accumulators and
/// mins take 24 of the 32 vector registers.
const GROUP_ROWS: usize = 8;

/// [`panels`] with groups of at most `RMAX` (4, 8 or 12) activation rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn panels_by<K: Kind, const RMAX: usize>(
    w: &[u8],
    rb: usize,
    x: &QRows,
    out: &mut [f32],
    m: usize,
    nb: usize,
) {
    let rows = w.len() / rb;
    PANEL.with_borrow_mut(|pn| {
        for j in (0..rows).step_by(PW) {
            let pr = (rows - j).min(PW);
            pack::<K>(&w[j * rb..], rb, pr, nb, pn);
            let mut r0 = 0;
            while r0 < m {
                let at = (j, pr, rows, r0);
                let rn = match m - r0 {
                    12.. if RMAX >= 12 => 12,
                    8.. if RMAX >= 8 => 8,
                    4.. => 4,
                    2 | 3 => 2,
                    _ => 1,
                };
                match (rn, K::G, K::MIN) {
                    (12, 16, false) => store(&panel_rows::<12, 16, false>(pn, x, r0, nb), out, at),
                    (12, 16, true) => store(&panel_rows::<12, 16, true>(pn, x, r0, nb), out, at),
                    (12, _, _) => store(&panel_rows::<12, 8, false>(pn, x, r0, nb), out, at),
                    (8, 16, false) => store(&panel_rows::<8, 16, false>(pn, x, r0, nb), out, at),
                    (4, 16, false) => store(&panel_rows::<4, 16, false>(pn, x, r0, nb), out, at),
                    (2, 16, false) => store(&panel_rows::<2, 16, false>(pn, x, r0, nb), out, at),
                    (_, 16, false) => store(&panel_rows::<1, 16, false>(pn, x, r0, nb), out, at),
                    (8, 16, true) => store(&panel_rows::<8, 16, true>(pn, x, r0, nb), out, at),
                    (4, 16, true) => store(&panel_rows::<4, 16, true>(pn, x, r0, nb), out, at),
                    (2, 16, true) => store(&panel_rows::<2, 16, true>(pn, x, r0, nb), out, at),
                    (_, 16, true) => store(&panel_rows::<1, 16, true>(pn, x, r0, nb), out, at),
                    (8, _, _) => store(&panel_rows::<8, 8, false>(pn, x, r0, nb), out, at),
                    (4, _, _) => store(&panel_rows::<4, 8, false>(pn, x, r0, nb), out, at),
                    (2, _, _) => store(&panel_rows::<2, 8, false>(pn, x, r0, nb), out, at),
                    _ => store(&panel_rows::<1, 8, false>(pn, x, r0, nb), out, at),
                }
                r0 += rn;
            }
        }
    });
}

/// [`super::tile_shape`] for weights of `K`.
fn shape<K: Kind>(w: &[u8], row_bytes: usize, x: &QRows, out: &[f32]) -> Option<(usize, usize)> {
    super::tile_shape(w, row_bytes, K::BB, K::PER, x, out)
}

/// How far ahead the 8-row decode tile prefetches each row (bytes), into the L2, as the AVX2
/// 4-row tiles do (1024 to 8192 measured within a few percent of each other from DRAM).
const PREFETCH_FAR: usize = 4096;

/// The order of the 8 rows of a decode tile in its vectors of results, the order the sums come
/// out of the reduction in [`q4_1_dec8`].
const DEC8_LANES: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Q4_1, a decode tile of 8 weight rows by one activation row. Two rows' 16 bytes of nibbles
/// are widened in one 512-bit vector (row `2t` in the low half, `2t + 1` in the high), so one
/// `pmaddwd` and one `vpdpwssd` take a block of 2 rows against the activation block's two
/// halves (each broadcast to both halves); the 8 rows' sums are reduced together (12 shuffles
/// and adds for 8 rows), the 8 rows' `d` and `m` come from one gather (the blocks' first 4
/// bytes, at multiples of 4: no element crosses a cache line) and two conversions, and one
/// 8-lane FMA adds the block for the 8 rows, a second one the mins. The arithmetic per row is
/// that of the AVX2 4-row tile and of the panels: exact integer sums, `(d_w * d_x) * sum`
/// added in block order, the mins in a chain of their own.
///
/// The same tile for Q4_0 (its `d` by 8 loads of 2 bytes, the offset as `8 * n_x`) was 1.3x
/// faster than the AVX2 4-row tile with the weights in the cache but 0.7-0.9x from DRAM (k 2048
/// and 768, every prefetch distance from 1024 to 8192 bytes), and lost end to end; Q4_0 keeps
/// the AVX2 tile.
///
/// # Safety
/// AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C are available; `w` holds 8 rows, `rb` bytes apart,
/// of `nb` blocks of 20 bytes, and `x` one row of `nb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_dec8(w: &[u8], rb: usize, x: &QRows, nb: usize) -> [f32; 8] {
    const BB: usize = 20;
    let base = w.as_ptr();
    // Gather offsets: rows in the lane order of the reduction.
    let off = |l: usize| (DEC8_LANES[l] * rb) as i32;
    let idx = _mm256_setr_epi32(
        off(0),
        off(1),
        off(2),
        off(3),
        off(4),
        off(5),
        off(6),
        off(7),
    );
    // Lanes 0 and 1 of each 128-bit lane.
    let pick = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    // Opaque to the optimiser, as `super::x86::nibble_mask` (it rewrote the 16-bit `and` and
    // shift as byte work before the widening).
    let m4 = std::hint::black_box(_mm512_set1_epi16(0x0F));
    let (mut acc, mut mins) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..nb {
        for r in 0..8 {
            let p = base.wrapping_add(r * rb + b * BB + PREFETCH_FAR);
            _mm_prefetch::<_MM_HINT_T1>(p.cast());
        }
        let xp = x.q.as_ptr().add(b * QK);
        let x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(xp.cast()));
        let x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(xp.add(16).cast()));
        let mut z = [_mm512_setzero_si512(); 4];
        for (t, z) in z.iter_mut().enumerate() {
            let pa = base.add(2 * t * rb + b * BB + 4);
            let v = _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(pa.cast())),
                _mm_loadu_si128(pa.add(rb).cast()),
            );
            let v = _mm512_cvtepu8_epi16(v);
            let lo = _mm512_and_si512(v, m4);
            let hi = _mm512_srli_epi16::<4>(_mm512_andnot_si512(m4, v));
            *z = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, x0), hi, x1);
        }
        // Rows 4t .. 4t + 4 with 4 lanes each (128-bit lane c: row 4t + c).
        let half = |a: __m512i, b: __m512i| {
            _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0b10_00_10_00>(a, b),
                _mm512_shuffle_i64x2::<0b11_01_11_01>(a, b),
            )
        };
        let (a, c) = (half(z[0], z[1]), half(z[2], z[3]));
        // 128-bit lane c: rows c and c + 4, twice.
        let u = _mm512_add_epi32(_mm512_unpacklo_epi32(a, c), _mm512_unpackhi_epi32(a, c));
        let u = _mm512_add_epi32(u, _mm512_shuffle_epi32::<0b01_00_11_10>(u));
        let sum = _mm512_castsi512_si256(_mm512_permutexvar_epi32(pick, u));
        let g = _mm256_i32gather_epi32::<1>(base.add(b * BB).cast(), idx);
        let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(g));
        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*x.d.get_unchecked(b)));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum), acc);
        let mn = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(g)));
        mins = _mm256_fmadd_ps(mn, _mm256_set1_ps(*x.s.get_unchecked(b)), mins);
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc, mins));
    let mut out = [0.0f32; 8];
    for (l, &r) in DEC8_LANES.iter().enumerate() {
        out[r] = lanes[l];
    }
    out
}

/// A decode product (one activation row) over a type with an 8-row tile: 8 rows at a time by
/// `tile`, the last `rows % 8` by the AVX2 body `avx2`.
fn decode8(
    w: &[u8],
    rb: usize,
    x: &QRows,
    out: &mut [f32],
    nb: usize,
    tile: unsafe fn(&[u8], usize, &QRows, usize) -> [f32; 8],
    avx2: DotFn,
) {
    let full = out.len() / 8 * 8;
    for (j, o) in out[..full].chunks_exact_mut(8).enumerate() {
        // SAFETY: `dot_fn`'s caller detected AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C;
        // `shape` checked that the 8 rows from `8 * j` hold `nb` blocks and `x` one row.
        o.copy_from_slice(&unsafe { tile(&w[8 * j * rb..], rb, x, nb) });
    }
    if full < out.len() {
        avx2(&w[full * rb..], rb, x, &mut out[full..]);
    }
}

/// The product over `K`: packed panels from [`PANEL_MIN_ROWS`] activation rows, an 8-row
/// decode tile `dec` for one row where the type has one, else the AVX2 body `avx2`.
fn product<K: Kind>(
    w: &[u8],
    row_bytes: usize,
    x: &QRows,
    out: &mut [f32],
    avx2: DotFn,
    dec: Dec8,
) {
    let Some((m, nb)) = shape::<K>(w, row_bytes, x, out) else {
        debug_assert!(false, "{} weight bytes, {row_bytes} a row", w.len());
        out.fill(0.0);
        return;
    };
    if m == 1 {
        if let Some(tile) = dec {
            return decode8(w, row_bytes, x, out, nb, tile, avx2);
        }
    }
    if m < PANEL_MIN_ROWS {
        return avx2(w, row_bytes, x, out);
    }
    // SAFETY: `dot_fn`'s caller detected AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C; `shape`
    // checked that every row holds `nb` blocks' weights and `x` `m` rows of `nb` blocks.
    unsafe { panels::<K>(w, row_bytes, x, out, m, nb) }
}

/// The AVX2 body for `dt`, which [`dot_fn`]'s types all have.
fn avx2(dt: DType) -> DotFn {
    super::x86::dot_fn(dt).expect("an AVX2 body for every VNNI type")
}

/// An 8-row decode tile: `(weight rows, row bytes, activation row, blocks)` to 8 results.
type Dec8 = Option<unsafe fn(&[u8], usize, &QRows, usize) -> [f32; 8]>;

fn q4_0(w: &[u8], rb: usize, x: &QRows, out: &mut [f32]) {
    product::<Q40>(w, rb, x, out, avx2(DType::Q4_0), None);
}

fn q4_1(w: &[u8], rb: usize, x: &QRows, out: &mut [f32]) {
    product::<Q41>(w, rb, x, out, avx2(DType::Q4_1), Some(q4_1_dec8));
}

fn q8_0(w: &[u8], rb: usize, x: &QRows, out: &mut [f32]) {
    product::<Q80>(w, rb, x, out, avx2(DType::Q8_0), None);
}

fn q4_k(w: &[u8], rb: usize, x: &QRows, out: &mut [f32]) {
    product::<Q4K>(w, rb, x, out, avx2(DType::Q4_K), None);
}

fn q6_k(w: &[u8], rb: usize, x: &QRows, out: &mut [f32]) {
    product::<Q6K>(w, rb, x, out, avx2(DType::Q6_K), None);
}

#[cfg(test)]
mod tests {
    //! The packed-panel bodies against the AVX2 bodies (within f32 rounding), against the AVX2
    //! 4-row decode tiles (bit for bit, for the types whose sum order they share), and against
    //! themselves in other groupings (bit for bit); the Q4_1 decode tile against the AVX2 one
    //! (bit for bit). The `#[ignore]`d benchmarks time the AVX2 and the AVX-512 product in one
    //! process, alternated (`cargo test --release -p lowsync-cpu _speed -- --ignored
    //! --nocapture --test-threads 1`).

    use super::*;
    // Random rows of blocks with small positive f16 scales: the AVX2 kernels' test data.
    use super::super::x86::tests::rows as weights;

    /// `(type, block bytes, offsets of the f16 scales in a block)` of every VNNI type.
    const TYPES: [(DType, usize, &[usize]); 5] = [
        (DType::Q4_0, 18, &[0]),
        (DType::Q4_1, 20, &[0, 2]),
        (DType::Q8_0, 34, &[0]),
        (DType::Q4_K, 144, &[0, 2]),
        (DType::Q6_K, 210, &[208]),
    ];

    /// Whether this CPU runs both bodies. libtest cannot mark a test skipped at run time, so
    /// a test that finds them missing says so on stderr and checks nothing.
    fn have() -> bool {
        let ok = super::super::has_avx512()
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if !ok {
            eprintln!("skipped: this CPU lacks AVX-512 F/BW/VL + VNNI (or AVX2/FMA/F16C)");
        }
        ok
    }

    /// `m` activation rows of `k`, with values up to both ends of the 16-bit range.
    fn activations(m: usize, k: usize, seed: usize) -> QRows {
        let x: Vec<f32> = (0..m * k)
            .map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        QRows::quantize(&x)
    }

    fn row_bytes(bb: usize, k: usize) -> usize {
        if bb >= 144 {
            k / 256 * bb
        } else {
            k / QK * bb
        }
    }

    fn vnni(dt: DType) -> DotFn {
        dot_fn(dt).expect("a VNNI body")
    }

    #[test]
    fn panels_agree_with_the_avx2_bodies() {
        if !have() {
            return;
        }
        let k = 512;
        // 37 weight rows: two full panels and a partial one; 11 activation rows: groups of
        // 8, 2 and 1.
        let (n, m) = (37, 11);
        for (dt, bb, halves) in TYPES {
            let rb = row_bytes(bb, k);
            let w = weights(n, rb, bb, halves, 5);
            let x = activations(m, k, 3);
            let (mut a, mut b) = (vec![0.0f32; n * m], vec![0.0f32; n * m]);
            avx2(dt)(&w, rb, &x, &mut a);
            vnni(dt)(&w, rb, &x, &mut b);
            let scale = a.iter().fold(0.0f32, |s, v| s.max(v.abs()));
            assert!(scale > 0.0, "{dt}: all zero");
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert!((a - b).abs() <= 1e-5 * scale, "{dt} output {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn a_row_gives_the_same_bits_in_every_group_and_panel() {
        if !have() {
            return;
        }
        let (k, n, m) = (512, 21, 13);
        for (dt, bb, halves) in TYPES {
            let rb = row_bytes(bb, k);
            let w = weights(n, rb, bb, halves, 7);
            let x = activations(m, k, 1);
            let mut all = vec![0.0f32; n * m];
            vnni(dt)(&w, rb, &x, &mut all);
            // Each activation row on its own (a group of 1), each weight row in a panel of
            // its own.
            for i in 0..m {
                let nb = k / QK;
                let xi = QRows {
                    d: x.d[i * nb..(i + 1) * nb].to_vec(),
                    s: x.s[i * nb..(i + 1) * nb].to_vec(),
                    n: x.n[i * nb..(i + 1) * nb].to_vec(),
                    q: x.q[i * k..(i + 1) * k].to_vec(),
                };
                for j in 0..n {
                    let mut one = [0.0f32];
                    let wj = &w[j * rb..(j + 1) * rb];
                    // SAFETY: AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C were detected.
                    unsafe {
                        match dt {
                            DType::Q4_0 => panels::<Q40>(wj, rb, &xi, &mut one, 1, nb),
                            DType::Q4_1 => panels::<Q41>(wj, rb, &xi, &mut one, 1, nb),
                            DType::Q8_0 => panels::<Q80>(wj, rb, &xi, &mut one, 1, nb),
                            DType::Q4_K => panels::<Q4K>(wj, rb, &xi, &mut one, 1, nb),
                            _ => panels::<Q6K>(wj, rb, &xi, &mut one, 1, nb),
                        }
                    }
                    let want = all[i * n + j];
                    assert_eq!(one[0].to_bits(), want.to_bits(), "{dt} ({j}, {i})");
                }
            }
        }
    }

    #[test]
    fn panels_give_the_bits_of_the_4_row_decode_tiles() {
        if !have() {
            return;
        }
        let (k, n) = (768, 32);
        for (dt, bb, halves) in TYPES {
            if !matches!(dt, DType::Q4_0 | DType::Q4_1 | DType::Q4_K) {
                continue;
            }
            let rb = row_bytes(bb, k);
            let w = weights(n, rb, bb, halves, 11);
            let x = activations(1, k, 0);
            let (mut dec, mut pan) = (vec![0.0f32; n], vec![0.0f32; n]);
            // One activation row: the AVX2 4-row decode tiles.
            avx2(dt)(&w, rb, &x, &mut dec);
            // SAFETY: AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C were detected.
            unsafe {
                match dt {
                    DType::Q4_0 => panels::<Q40>(&w, rb, &x, &mut pan, 1, k / QK),
                    DType::Q4_1 => panels::<Q41>(&w, rb, &x, &mut pan, 1, k / QK),
                    _ => panels::<Q4K>(&w, rb, &x, &mut pan, 1, k / QK),
                }
            }
            // And the product itself with one row: the 8-row decode tiles where the type has
            // them.
            let mut own = vec![0.0f32; n];
            vnni(dt)(&w, rb, &x, &mut own);
            for (j, ((a, b), c)) in dec.iter().zip(&pan).zip(&own).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{dt} row {j}: {a} vs {b}");
                assert_eq!(a.to_bits(), c.to_bits(), "{dt} row {j}: {a} vs {c}");
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn dec8_speed() {
        if !have() {
            return;
        }
        let (dt, bb, halves) = TYPES[1];
        for k in [768, 2048] {
            let x = activations(1, k, 0);
            let rb = row_bytes(bb, k);
            for (label, bytes, reps) in [("cache 1 MiB", 1 << 20, 64), ("DRAM 96 MiB", 96 << 20, 2)]
            {
                let n = (bytes / rb).next_multiple_of(8);
                let w = weights(n, rb, bb, halves, 9);
                let mut out = vec![0.0f32; n];
                let blocks = (n * (k / QK) * reps) as f64;
                let (old, new) = (avx2(dt), vnni(dt));
                let (mut best_old, mut best_new) = (f64::MAX, f64::MAX);
                for round in 0..11 {
                    let mut order = [(old, &mut best_old), (new, &mut best_new)];
                    order.rotate_left(round % 2);
                    for (f, best) in order {
                        let t = std::time::Instant::now();
                        for _ in 0..reps {
                            f(&w, rb, &x, &mut out);
                            std::hint::black_box(&mut out);
                        }
                        *best = best.min(t.elapsed().as_secs_f64() * 1e9 / blocks);
                    }
                }
                eprintln!(
                    "{dt} k {k} m 1 {label}: avx2 {best_old:.3} ns, avx512 {best_new:.3} ns per \
                     (block, weight row), {:.2}x",
                    best_old / best_new
                );
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn group_rows_speed() {
        if !have() {
            return;
        }
        type Run = unsafe fn(&[u8], usize, &QRows, &mut [f32], usize, usize);
        let m = 128;
        for k in [768, 2048] {
            let x = activations(m, k, 0);
            let cases: [(DType, usize, &[usize], [Run; 3]); 3] = [
                (
                    DType::Q4_0,
                    18,
                    &[0],
                    [
                        panels_by::<Q40, 4>,
                        panels_by::<Q40, 8>,
                        panels_by::<Q40, 12>,
                    ],
                ),
                (
                    DType::Q4_K,
                    144,
                    &[0, 2],
                    [
                        panels_by::<Q4K, 4>,
                        panels_by::<Q4K, 8>,
                        panels_by::<Q4K, 12>,
                    ],
                ),
                (
                    DType::Q6_K,
                    210,
                    &[208],
                    [
                        panels_by::<Q6K, 4>,
                        panels_by::<Q6K, 8>,
                        panels_by::<Q6K, 12>,
                    ],
                ),
            ];
            for (dt, bb, halves, runs) in cases {
                let rb = row_bytes(bb, k);
                let n = ((256 << 10) / rb).next_multiple_of(16);
                let w = weights(n, rb, bb, halves, 9);
                let mut out = vec![0.0f32; n * m];
                let pairs = (n * (k / QK) * m * 4) as f64;
                let mut best = [f64::MAX; 3];
                for round in 0..7 {
                    for v in 0..3 {
                        let v = (v + round) % 3;
                        let t = std::time::Instant::now();
                        for _ in 0..4 {
                            // SAFETY: AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C were detected.
                            unsafe { runs[v](&w, rb, &x, &mut out, m, k / QK) };
                            std::hint::black_box(&mut out);
                        }
                        best[v] = best[v].min(t.elapsed().as_secs_f64() * 1e9 / pairs);
                    }
                }
                eprintln!(
                    "{dt} k {k} m {m}: groups of 4 {:.4} ns, 8 {:.4} ns, 12 {:.4} ns per (block, activation row)",
                    best[0], best[1], best[2]
                );
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn few_rows_speed() {
        if !have() {
            return;
        }
        type Run = unsafe fn(&[u8], usize, &QRows, &mut [f32], usize, usize);
        let k = 2048;
        let cases: [(DType, usize, &[usize], Run); 3] = [
            (DType::Q4_0, 18, &[0], panels::<Q40>),
            (DType::Q4_1, 20, &[0, 2], panels::<Q41>),
            (DType::Q4_K, 144, &[0, 2], panels::<Q4K>),
        ];
        for m in [2, 3, 4, 6] {
            let x = activations(m, k, 0);
            for (dt, bb, halves, pan) in cases {
                let rb = row_bytes(bb, k);
                for (label, bytes, reps) in
                    [("cache 1 MiB", 1 << 20, 16), ("DRAM 48 MiB", 48 << 20, 1)]
                {
                    let n = (bytes / rb).next_multiple_of(16);
                    let w = weights(n, rb, bb, halves, 9);
                    let mut out = vec![0.0f32; n * m];
                    let pairs = (n * (k / QK) * m * reps) as f64;
                    let old = avx2(dt);
                    let (mut best_old, mut best_new) = (f64::MAX, f64::MAX);
                    for round in 0..7 {
                        for v in 0..2 {
                            let t = std::time::Instant::now();
                            for _ in 0..reps {
                                if (v + round) % 2 == 0 {
                                    old(&w, rb, &x, &mut out);
                                } else {
                                    // SAFETY: AVX-512 F/BW/VL, VNNI, AVX2, FMA and F16C were
                                    // detected.
                                    unsafe { pan(&w, rb, &x, &mut out, m, k / QK) };
                                }
                                std::hint::black_box(&mut out);
                            }
                            let ns = t.elapsed().as_secs_f64() * 1e9 / pairs;
                            if (v + round) % 2 == 0 {
                                best_old = best_old.min(ns);
                            } else {
                                best_new = best_new.min(ns);
                            }
                        }
                    }
                    eprintln!(
                        "{dt} k {k} m {m} {label}: avx2 {best_old:.3} ns, panels {best_new:.3} ns \
                         per (block, activation row), {:.2}x",
                        best_old / best_new
                    );
                }
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn vnni_speed() {
        if !have() {
            return;
        }
        let m = 128;
        for k in [768, 2048] {
            let x = activations(m, k, 0);
            for (dt, bb, halves) in TYPES {
                let rb = row_bytes(bb, k);
                for (label, bytes, reps) in [
                    ("cache 256 KiB", 256 << 10, 4),
                    ("DRAM 48 MiB", 48 << 20, 1),
                ] {
                    let n = (bytes / rb).next_multiple_of(16);
                    let w = weights(n, rb, bb, halves, 9);
                    let mut out = vec![0.0f32; n * m];
                    let pairs = (n * (k / QK) * m * reps) as f64;
                    let (old, new) = (avx2(dt), vnni(dt));
                    let (mut best_old, mut best_new) = (f64::MAX, f64::MAX);
                    for round in 0..7 {
                        let mut order = [(old, &mut best_old), (new, &mut best_new)];
                        order.rotate_left(round % 2);
                        for (f, best) in order {
                            let t = std::time::Instant::now();
                            for _ in 0..reps {
                                f(&w, rb, &x, &mut out);
                                std::hint::black_box(&mut out);
                            }
                            *best = best.min(t.elapsed().as_secs_f64() * 1e9 / pairs);
                        }
                    }
                    eprintln!(
                        "{dt} k {k} m {m} {label}: avx2 {best_old:.4} ns, avx512 {best_new:.4} ns \
                         per (block, activation row), {:.2}x",
                        best_old / best_new
                    );
                }
            }
        }
    }
}
