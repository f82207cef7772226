//! AVX-512 bodies of dot products over float weight rows read in place: the decode products
//! (`gemv`), the prefill products over f16/bf16 weights (`matmul`) and the attention scores.
//!
//! Why: on a CPU with AVX-512 a 16-bit weight row is widened 16 elements per `vcvtph2ps`
//! straight into a multiply-add. A prefill product over an f16 weight then needs neither an
//! f32 copy of the weight nor gemm's packing: on the AVX2 path the conversion, gemm's
//! packing and the copies around them were over a third of an F16 prefill step, and gemm's
//! AVX2 microkernel the rest.
//!
//! Strategy: prefill runs tiles of 6 activation rows by 4 weight rows, one 16-lane f32
//! accumulator per pair (24 accumulators, 4 widened weight vectors and one activation vector
//! in registers), over the whole of `k` in steps of 16, the last `k % 16` elements read with
//! masked loads (the lanes past the row are zero on both sides, so they add +0); each
//! accumulator is reduced by a fixed tree of adds ([`hsum`]). A parallel job is a column
//! block of the weight sized for the L2, which every tile of activation rows passes over.
//! Decode reads one weight row at a time front to back with four accumulators per
//! activation row ([`row`]): with the weights in DRAM, tiles of 4 weight rows side by side
//! ran at 0.65x of one row at a time (the hardware prefetcher follows one stream, and a
//! software prefetch 512-4096 bytes ahead did not close the gap), while one row at a time
//! streams at the memory's speed. F16 decode is bound by memory bandwidth either way; one row
//! at a time with a software prefetch [`DECODE_PF`] bytes ahead of the stream read 1.15-1.2x
//! faster from DRAM on one thread of a Xeon VM (`dot512_speed`: 170-206 -> 141-174 ns per
//! row of 768 f16; 1 and 2 KiB ahead gained less), and F16 decode of the small model with
//! two threads gained about as much.
//!
//! Invariants: an output element's value depends only on its activation row, its weight
//! row, `k` and whether it is a decode ([`row`]) or a prefill ([`tile`]) product, never on
//! the tile shape, the job split or the thread count. An attention score is a decode
//! product's body, so a fused score has the bits of the unfused `q @ K.T` at decode.
//! [`available`] is the one switch: `LOWSYNC_CPU_FLOAT_ISA=avx2` turns these bodies off (the
//! AVX2 bodies of `gemv`, `attention` and `dot256` then run), for A/B measurements.
//!
//! The prefill driver ([`prefill`]: the column-block jobs, the order of tiles) is shared with
//! `dot256`, whose AVX2 tiles it runs when these bodies are off; the gemm path runs only on
//! a CPU with neither.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use half::{bf16, f16};
use lowsync_backend::env;
use rayon::prelude::*;

use super::view::{FloatRow, Strided};

/// Whether the AVX-512 bodies run: AVX-512 F/BW/VL, FMA and F16C detected, and
/// `LOWSYNC_CPU_FLOAT_ISA` not `avx2` (read once per process).
pub(in crate::kernels) fn available() -> bool {
    matches!(setting(), Ok(true))
}

/// A bad `LOWSYNC_CPU_FLOAT_ISA` value, as an error message naming the variable (the kernels
/// that read float rows report it; the bodies stay off).
pub(in crate::kernels) fn env_error() -> Option<&'static str> {
    setting().as_ref().err().map(String::as_str)
}

/// `LOWSYNC_CPU_FLOAT_ISA`: `auto` (the default) takes AVX-512 where the CPU has it, `avx2`
/// keeps the AVX2 bodies (for A/B measurements); with the detection, read once.
fn setting() -> &'static Result<bool, String> {
    static ON: OnceLock<Result<bool, String>> = OnceLock::new();
    ON.get_or_init(|| {
        env::choice("LOWSYNC_CPU_FLOAT_ISA", &["auto", "avx2"], "auto or avx2")
            .map(|c| c != Some("avx2") && detected())
            .map_err(|e| e.to_string())
    })
}

/// Whether this CPU has what the bodies use (whatever the environment says).
pub(in crate::kernels) fn detected() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

/// Activation rows of a prefill tile.
const PREFILL_ROWS: usize = 6;

/// Weight rows of every tile.
const COLS: usize = 4;

/// Weight bytes of one prefill job's column block: it stays in the L2 while every tile of
/// activation rows passes over it.
const PREFILL_BLOCK_BYTES: usize = 256 * 1024;

/// A stored float type loaded 16 elements at a time as f32.
pub(in crate::kernels) trait Lanes16: Copy {
    /// Elements `p[0..16]` as f32.
    unsafe fn load16(p: *const Self) -> __m512;
    /// Elements `p[0..n]` (`n < 16`) as f32, zero above; nothing past `p[n - 1]` is read.
    unsafe fn load_tail(p: *const Self, n: usize) -> __m512;
}

/// The mask of the low `n < 16` lanes.
#[inline(always)]
fn low_lanes(n: usize) -> u16 {
    ((1u32 << n) - 1) as u16
}

impl Lanes16 for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_tail(p: *const Self, n: usize) -> __m512 {
        _mm512_maskz_loadu_ps(low_lanes(n), p)
    }
}

impl Lanes16 for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_tail(p: *const Self, n: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(low_lanes(n), p.cast()))
    }
}

impl Lanes16 for bf16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // bf16 is the high half of an f32.
        let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
    }
    #[inline(always)]
    unsafe fn load_tail(p: *const Self, n: usize) -> __m512 {
        let v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(low_lanes(n), p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
    }
}

/// The sum of the 16 lanes of `v` by a fixed tree: halves, then quarters, then pairs.
#[inline(always)]
pub(in crate::kernels) unsafe fn hsum(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    super::dot256::hsum(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
}

/// `out[r][c] = xs[r][..k] . ws[c][..k]`, one accumulator per pair (see the module header).
// The indices address several arrays in lockstep.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<T: Lanes16, const R: usize, const C: usize>(
    xs: [*const f32; R],
    ws: [*const T; C],
    k: usize,
) -> [[f32; C]; R] {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut wv = [_mm512_setzero_ps(); C];
    let mut e = 0;
    while e + 16 <= k {
        for c in 0..C {
            wv[c] = T::load16(ws[c].add(e));
        }
        for r in 0..R {
            let xv = _mm512_loadu_ps(xs[r].add(e));
            for c in 0..C {
                acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
        e += 16;
    }
    if e < k {
        let n = k - e;
        for c in 0..C {
            wv[c] = T::load_tail(ws[c].add(e), n);
        }
        for r in 0..R {
            let xv = f32::load_tail(xs[r].add(e), n);
            for c in 0..C {
                acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = hsum(acc[r][c]);
        }
    }
    out
}

/// `out[r] = xs[r][..k] . w[..k]` for one weight row read once, front to back: four
/// accumulators per activation row over steps of 64 elements, then steps of 16 and the
/// masked tail into the first, then `(a0 + a1) + (a2 + a3)` reduced by [`hsum`].
// The indices address several arrays in lockstep.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(in crate::kernels) unsafe fn row<T: Lanes16, const R: usize>(
    xs: [*const f32; R],
    w: *const T,
    k: usize,
) -> [f32; R] {
    row_ahead::<T, R, 0>(xs, w, k)
}

/// [`row`], with a software prefetch `PF` bytes ahead of each 64-element step (0: none).
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn row_ahead<T: Lanes16, const R: usize, const PF: usize>(
    xs: [*const f32; R],
    w: *const T,
    k: usize,
) -> [f32; R] {
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut e = 0;
    while e + 64 <= k {
        if PF > 0 {
            let p = w.add(e).cast::<i8>().wrapping_add(PF);
            let step = 64 * std::mem::size_of::<T>();
            let mut o = 0;
            while o < step {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o));
                o += 64;
            }
        }
        for u in 0..4 {
            let wv = T::load16(w.add(e + 16 * u));
            for r in 0..R {
                let xv = _mm512_loadu_ps(xs[r].add(e + 16 * u));
                acc[r][u] = _mm512_fmadd_ps(xv, wv, acc[r][u]);
            }
        }
        e += 64;
    }
    while e + 16 <= k {
        let wv = T::load16(w.add(e));
        for r in 0..R {
            acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[r].add(e)), wv, acc[r][0]);
        }
        e += 16;
    }
    if e < k {
        let wv = T::load_tail(w.add(e), k - e);
        for r in 0..R {
            acc[r][0] = _mm512_fmadd_ps(f32::load_tail(xs[r].add(e), k - e), wv, acc[r][0]);
        }
    }
    let mut out = [0.0f32; R];
    for r in 0..R {
        let a = &acc[r];
        out[r] = hsum(_mm512_add_ps(
            _mm512_add_ps(a[0], a[1]),
            _mm512_add_ps(a[2], a[3]),
        ));
    }
    out
}

/// Decode: every weight row in turn (one stream through memory, which the hardware
/// prefetcher follows), against the activation rows 4 at a time.
#[inline(always)]
unsafe fn decode_rows<T: Lanes16, const PF: usize>(
    x: *const f32,
    m: usize,
    ws: &[*const T],
    j0: usize,
    k: usize,
    sink: Sink,
) {
    for (jj, &w) in ws.iter().enumerate() {
        let j = j0 + jj;
        let mut i = 0;
        while i + 4 <= m {
            let xs: [*const f32; 4] = std::array::from_fn(|r| x.add((i + r) * k));
            sink.put::<4, 1>(i, j, row_ahead::<T, 4, PF>(xs, w, k).map(|v| [v]));
            i += 4;
        }
        while i < m {
            sink.put::<1, 1>(i, j, [row_ahead::<T, 1, PF>([x.add(i * k)], w, k)]);
            i += 1;
        }
    }
}

/// Weight rows of one stored type, as pointers (all `k` long).
#[derive(Clone, Copy)]
pub(in crate::kernels) enum Rows<'a> {
    F32(&'a [*const f32]),
    F16(&'a [*const f16]),
    BF16(&'a [*const bf16]),
}

/// Column `j` of `w` as a row pointer of each type, or `None` when the view cannot read it
/// or it is not `k` long.
fn row_of(w: &Strided, j: usize, k: usize) -> Option<FloatRow<'_>> {
    w.float_row(1, j).filter(|r| r.len() == k)
}

/// Output sink of a tile: element (activation row `i`, weight row `j`) at
/// `ptr + i * rs + j * cs`.
#[derive(Clone, Copy)]
pub(in crate::kernels) struct Sink {
    /// Element `[0, 0]`.
    pub ptr: *mut f32,
    /// Elements between activation rows.
    pub rs: usize,
    /// Elements between weight rows.
    pub cs: usize,
}

impl Sink {
    /// Writes the tile `v` at activation rows `i0..` and weight rows `j0..`.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn put<const R: usize, const C: usize>(
        &self,
        i0: usize,
        j0: usize,
        v: [[f32; C]; R],
    ) {
        for (r, row) in v.iter().enumerate() {
            for (c, &x) in row.iter().enumerate() {
                *self.ptr.add((i0 + r) * self.rs + (j0 + c) * self.cs) = x;
            }
        }
    }
}

/// Tiles of `R` activation rows starting at `i0` over the weight rows `ws` (columns
/// `j0..j0 + ws.len()`), `COLS` at a time and then one at a time.
#[inline(always)]
unsafe fn row_tiles<T: Lanes16, const R: usize>(
    x: *const f32,
    i0: usize,
    ws: &[*const T],
    j0: usize,
    k: usize,
    sink: Sink,
) {
    let xs: [*const f32; R] = std::array::from_fn(|r| x.add((i0 + r) * k));
    let mut quads = ws.chunks_exact(COLS);
    let mut j = j0;
    for q in &mut quads {
        let w4: [*const T; COLS] = std::array::from_fn(|c| q[c]);
        sink.put::<R, COLS>(i0, j, tile::<T, R, COLS>(xs, w4, k));
        j += COLS;
    }
    for &w in quads.remainder() {
        sink.put::<R, 1>(i0, j, tile::<T, R, 1>(xs, [w], k));
        j += 1;
    }
}

/// Every activation row `0..m` of `x` (`m x k`, contiguous) against the weight rows `ws`,
/// `RT` activation rows per tile, then the rest in one smaller tile.
#[inline(always)]
unsafe fn all_rows<T: Lanes16, const RT: usize>(
    x: *const f32,
    m: usize,
    ws: &[*const T],
    j0: usize,
    k: usize,
    sink: Sink,
) {
    let mut i = 0;
    while i + RT <= m {
        row_tiles::<T, RT>(x, i, ws, j0, k, sink);
        i += RT;
    }
    match m - i {
        0 => {}
        1 => row_tiles::<T, 1>(x, i, ws, j0, k, sink),
        2 => row_tiles::<T, 2>(x, i, ws, j0, k, sink),
        3 => row_tiles::<T, 3>(x, i, ws, j0, k, sink),
        4 => row_tiles::<T, 4>(x, i, ws, j0, k, sink),
        _ => row_tiles::<T, 5>(x, i, ws, j0, k, sink),
    }
}

/// Decode: tiles of up to 4 activation rows, with the prefetch.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn decode_block(x: *const f32, m: usize, rows: Rows<'_>, j0: usize, k: usize, sink: Sink) {
    decode_block_ahead::<DECODE_PF>(x, m, rows, j0, k, sink)
}

/// Bytes ahead of the weight stream that decode prefetches (into L1: `_MM_HINT_T0`).
const DECODE_PF: usize = 4096;

/// [`decode_block`] with a prefetch `PF` bytes ahead.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn decode_block_ahead<const PF: usize>(
    x: *const f32,
    m: usize,
    rows: Rows<'_>,
    j0: usize,
    k: usize,
    sink: Sink,
) {
    match rows {
        Rows::F32(ws) => decode_rows::<f32, PF>(x, m, ws, j0, k, sink),
        Rows::F16(ws) => decode_rows::<f16, PF>(x, m, ws, j0, k, sink),
        Rows::BF16(ws) => decode_rows::<bf16, PF>(x, m, ws, j0, k, sink),
    }
}

/// Prefill: 6 x 4 tiles, no prefetch (a block's weight rows are reread from the L2).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn prefill_block(x: *const f32, m: usize, rows: Rows<'_>, j0: usize, k: usize, sink: Sink) {
    match rows {
        Rows::F32(ws) => all_rows::<f32, PREFILL_ROWS>(x, m, ws, j0, k, sink),
        Rows::F16(ws) => all_rows::<f16, PREFILL_ROWS>(x, m, ws, j0, k, sink),
        Rows::BF16(ws) => all_rows::<bf16, PREFILL_ROWS>(x, m, ws, j0, k, sink),
    }
}

/// Pointers to the weight rows `j0..j0 + len` of `w`, all of one stored type and `k` long;
/// `None` when one is not. The view's rows are one stride apart, so when its first and last
/// are readable every row between them is, at that stride: two lookups per block, not one
/// per row (a lookup per row was about 3% of an F16 decode step).
fn gather<'v>(
    w: &'v Strided,
    j0: usize,
    len: usize,
    k: usize,
    bufs: &'v mut RowBufs,
) -> Option<Rows<'v>> {
    bufs.f32.clear();
    bufs.f16.clear();
    bufs.bf16.clear();
    if len == 0 {
        return Some(Rows::F32(&bufs.f32));
    }
    let (first, _) = (row_of(w, j0, k)?, row_of(w, j0 + len - 1, k)?);
    let step = w.strides()[1];
    fn fill<T>(out: &mut Vec<*const T>, p: *const T, step: usize, len: usize) {
        out.extend((0..len).map(|i| p.wrapping_add(i * step)));
    }
    Some(match first {
        FloatRow::F32(r) => {
            fill(&mut bufs.f32, r.as_ptr(), step, len);
            Rows::F32(&bufs.f32)
        }
        FloatRow::F16(r) => {
            fill(&mut bufs.f16, r.as_ptr(), step, len);
            Rows::F16(&bufs.f16)
        }
        FloatRow::BF16(r) => {
            fill(&mut bufs.bf16, r.as_ptr(), step, len);
            Rows::BF16(&bufs.bf16)
        }
    })
}

/// Per-job scratch: the row pointers of a block.
#[derive(Default)]
pub(in crate::kernels) struct RowBufs {
    f32: Vec<*const f32>,
    f16: Vec<*const f16>,
    bf16: Vec<*const bf16>,
}

// SAFETY: the pointers are only used by the job that gathered them, while the views they
// come from are borrowed.
unsafe impl Send for RowBufs {}

/// Decode: `out_t[jj * m + i] = x[i] . w[:, c0 + jj]` for the columns of `out_t` (j-major,
/// `gemv`'s layout), `x` holding `m` rows of `k`. False (nothing written) when a column
/// cannot be read in place.
pub(in crate::kernels) fn decode_columns(
    w: &Strided,
    c0: usize,
    x: &[f32],
    (m, k): (usize, usize),
    out_t: &mut [f32],
    bufs: &mut RowBufs,
) -> bool {
    let cols = out_t.len() / m.max(1);
    let body: Block = if available() {
        decode_block
    } else if env_error().is_none() && super::dot256::available() {
        super::dot256::decode_block
    } else {
        return false;
    };
    if x.len() < m * k || cols * m != out_t.len() {
        return false;
    }
    let Some(rows) = gather(w, c0, cols, k, bufs) else {
        return false;
    };
    let sink = Sink {
        ptr: out_t.as_mut_ptr(),
        rs: 1,
        cs: m,
    };
    // SAFETY: the features were detected (`available`); every row is `k` long and `x` holds
    // `m` rows of `k`; the sink addresses `out_t`, `cols x m` elements.
    unsafe { body(x.as_ptr(), m, rows, 0, k, sink) };
    true
}

/// The attention score `q . k_row` with the bits `decode_columns` gives for the same rows
/// (a 1 x 1 tile). Inlined into a body that enables the AVX-512 features.
#[inline(always)]
pub(in crate::kernels) unsafe fn score(k_row: FloatRow<'_>, q: &[f32]) -> f32 {
    let (d, x) = (q.len(), [q.as_ptr()]);
    match k_row {
        FloatRow::F32(k) if k.len() == d => row::<f32, 1>(x, k.as_ptr(), d)[0],
        FloatRow::F16(k) if k.len() == d => row::<f16, 1>(x, k.as_ptr(), d)[0],
        FloatRow::BF16(k) if k.len() == d => row::<bf16, 1>(x, k.as_ptr(), d)[0],
        _ => f32::NAN,
    }
}

/// A prefill body: every activation row of `x` (`m x k`) against the weight rows of a
/// block (columns `j0..`), into the sink.
pub(in crate::kernels) type Block = unsafe fn(*const f32, usize, Rows<'_>, usize, usize, Sink);

/// The prefill body that runs here and the weight rows of its tiles: these AVX-512 tiles,
/// else `dot256`'s AVX2 tiles, else none (the gemm path runs).
fn prefill_body() -> Option<(Block, usize)> {
    if available() {
        Some((prefill_block, COLS))
    } else if env_error().is_none() && super::dot256::available() {
        Some((super::dot256::prefill_block, super::dot256::COLS))
    } else {
        None
    }
}

/// Whether [`prefill`] runs (with either body) on this CPU.
pub(in crate::kernels) fn prefill_available() -> bool {
    prefill_body().is_some()
}

/// One prefill product: activations `x` (`m x k`, contiguous f32), a weight view `w`
/// (`[k, n]`, every column a row `gemv::reads` accepts) and its row-major output at `out`
/// with row stride `out_rs`.
pub(in crate::kernels) struct Prefill<'a> {
    pub x: &'a [f32],
    pub w: Strided,
    pub out: *mut f32,
    pub out_rs: usize,
}

// SAFETY: each product's output block is written by the jobs of that product only, each job
// its own columns; the operands are only read.
unsafe impl Send for Prefill<'_> {}
unsafe impl Sync for Prefill<'_> {}

/// Runs every prefill product (`m x k @ k x n`) in parallel jobs of column blocks, with the
/// AVX-512 tiles or else `dot256`'s AVX2 tiles. False (nothing written) when neither runs
/// or a weight row cannot be read in place.
///
/// # Safety
/// Every product's `out` is valid for writes of `m` rows of `n` at stride `out_rs`, and no
/// two products' outputs overlap each other or any operand.
pub(in crate::kernels) unsafe fn prefill(
    products: &[Prefill<'_>],
    (m, n, k): (usize, usize, usize),
) -> bool {
    let Some((body, tile_cols)) = prefill_body() else {
        return false;
    };
    if products.iter().any(|p| p.x.len() < m * k) {
        return false;
    }
    if products
        .iter()
        .any(|p| (0..n).any(|j| row_of(&p.w, j, k).is_none()))
    {
        return false;
    }
    let elem_bytes = match row_of(&products[0].w, 0, k) {
        Some(FloatRow::F32(_)) => 4,
        _ => 2,
    };
    // Blocks of at most PREFILL_BLOCK_BYTES, as many per product as a multiple of the
    // thread count, so the last round of jobs leaves no thread idle (the split never
    // changes a result).
    let threads = rayon::current_num_threads().max(1);
    let per_product = (k * n * elem_bytes)
        .div_ceil(PREFILL_BLOCK_BYTES)
        .max(1)
        .next_multiple_of(threads);
    let cols = n
        .div_ceil(per_product)
        .next_multiple_of(tile_cols)
        .clamp(tile_cols, n.next_multiple_of(tile_cols));
    let blocks = n.div_ceil(cols);
    let job = |bufs: &mut RowBufs, t: usize| {
        let (p, c0) = (&products[t / blocks], (t % blocks) * cols);
        let len = cols.min(n - c0);
        let Some(rows) = gather(&p.w, c0, len, k, bufs) else {
            debug_assert!(false, "weight rows checked above");
            return;
        };
        let sink = Sink {
            ptr: p.out,
            rs: p.out_rs,
            cs: 1,
        };
        // SAFETY: the features were detected; rows are `k` long, `x` holds `m` rows of `k`,
        // and this job writes only columns `c0..c0 + len` of its product's output.
        unsafe { body(p.x.as_ptr(), m, rows, c0, k, sink) };
    };
    let jobs = products.len() * blocks;
    if jobs > 1
        && m.saturating_mul(n)
            .saturating_mul(k)
            .saturating_mul(products.len())
            >= 1 << 18
    {
        (0..jobs)
            .into_par_iter()
            .for_each_init(RowBufs::default, job);
    } else {
        let mut bufs = RowBufs::default();
        (0..jobs).for_each(|t| job(&mut bufs, t));
    }
    true
}

#[cfg(test)]
mod tests {
    //! The bodies against an f64 reference; a decode product and an attention score over the
    //! same rows give the same bits, and so does every prefill tile shape. The `#[ignore]`d
    //! benchmark times the decode bodies against `gemv`'s AVX2 body in one process
    //! (`cargo test --release -p lowsync-cpu dot512_speed -- --ignored --nocapture`).

    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut st = seed;
        (0..n)
            .map(|_| {
                st = st
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((st >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// `out[i * n + j] = x[i] . w[j]` through `block`, weight rows `k` apart in `w`.
    fn run_block(block: Block, x: &[f32], w: &[f16], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
        let ptrs: Vec<*const f16> = (0..n).map(|j| w[j * k..].as_ptr()).collect();
        let mut out = vec![f32::NAN; m * n];
        let sink = Sink {
            ptr: out.as_mut_ptr(),
            rs: n,
            cs: 1,
        };
        // SAFETY: only called where `detected()`; rows are `k` long, `x` holds `m` rows.
        unsafe { block(x.as_ptr(), m, Rows::F16(&ptrs), 0, k, sink) };
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn score_here(k_row: FloatRow<'_>, q: &[f32]) -> f32 {
        score(k_row, q)
    }

    #[test]
    fn decode_prefill_and_score_bodies_match_a_reference_and_keep_their_bits() {
        if !detected() {
            // libtest cannot mark a test skipped at run time: say so, check nothing.
            eprintln!("skipped: this CPU lacks the AVX-512 float bodies' features");
            return;
        }
        for (m, n, k) in [
            (1, 5, 16),
            (3, 9, 37),
            (7, 13, 768),
            (13, 6, 100),
            (8, 4, 15),
        ] {
            let x = values(m * k, 1);
            let w: Vec<f16> = values(n * k, 2).into_iter().map(f16::from_f32).collect();
            let dec = run_block(decode_block, &x, &w, (m, n, k));
            let pre = run_block(prefill_block, &x, &w, (m, n, k));
            for i in 0..m {
                let xi = &x[i * k..(i + 1) * k];
                let alone = run_block(prefill_block, xi, &w, (1, n, k));
                for j in 0..n {
                    let wj = &w[j * k..(j + 1) * k];
                    let want: f64 = xi.iter().zip(wj).map(|(a, b)| *a as f64 * b.to_f64()).sum();
                    for got in [dec[i * n + j], pre[i * n + j]] {
                        assert!((got as f64 - want).abs() < 1e-5, "{m}x{n}x{k} [{i},{j}]");
                    }
                    // SAFETY: the features were detected.
                    let s = unsafe { score_here(FloatRow::F16(wj), xi) };
                    assert_eq!(dec[i * n + j].to_bits(), s.to_bits(), "score [{i},{j}]");
                    assert_eq!(
                        pre[i * n + j].to_bits(),
                        alone[j].to_bits(),
                        "tile [{i},{j}]"
                    );
                }
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn dot512_speed() {
        if !detected() || !super::super::gemv::x86::available() {
            return;
        }
        let k = 768;
        let x = values(k, 3);
        for (label, bytes, reps) in [("cache 1 MiB", 1 << 20, 64), ("DRAM 96 MiB", 96 << 20, 2)] {
            let n = bytes / (2 * k) / 4 * 4;
            let w: Vec<f16> = values(n * k, 4).into_iter().map(f16::from_f32).collect();
            let ptrs: Vec<*const f16> = (0..n).map(|j| w[j * k..].as_ptr()).collect();
            let mut out = vec![0.0f32; n];
            let mut best = [f64::MAX; 7];
            for round in 0..9 {
                for which in (0..7).map(|i| (i + round) % 7) {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        let sink = Sink {
                            ptr: out.as_mut_ptr(),
                            rs: 1,
                            cs: 1,
                        };
                        let (xp, r) = (x.as_ptr(), Rows::F16(&ptrs));
                        // SAFETY: the features were detected; rows are `k` long.
                        unsafe {
                            match which {
                                0 => {
                                    for (j, o) in out.iter_mut().enumerate() {
                                        let row = FloatRow::F16(&w[j * k..(j + 1) * k]);
                                        let mut res = [0.0f32];
                                        super::super::gemv::x86::dots(row, &x, k, &mut res);
                                        *o = res[0];
                                    }
                                }
                                1 => decode_block(xp, 1, r, 0, k, sink),
                                2 => prefill_block(xp, 1, r, 0, k, sink),
                                3 => decode_block_ahead::<1024>(xp, 1, r, 0, k, sink),
                                4 => decode_block_ahead::<2048>(xp, 1, r, 0, k, sink),
                                5 => decode_block_ahead::<4096>(xp, 1, r, 0, k, sink),
                                _ => decode_block_ahead::<8192>(xp, 1, r, 0, k, sink),
                            }
                        }
                    }
                    let ns = t.elapsed().as_secs_f64() * 1e9 / (n * reps) as f64;
                    best[which] = best[which].min(ns);
                }
            }
            println!(
                "f16 k {k} {label}, ns per weight row: avx2 {:.1}, avx512 rows {:.1}, \
                 avx512 4-row tiles {:.1}, rows ahead 1/2/4/8 KiB {:.1} {:.1} {:.1} {:.1}",
                best[0], best[1], best[2], best[3], best[4], best[5], best[6]
            );
        }
    }
}
