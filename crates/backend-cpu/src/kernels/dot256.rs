//! AVX2 bodies of the products over float weight rows read in place: the counterpart of
//! `dot512`'s prefill tiles on CPUs without AVX-512 (or with it turned off), and its decode
//! driver for `gemv`'s AVX2 body.
//!
//! Why: without these bodies an f16 weight of a prefill product was converted to f32 panels
//! and handed to the `gemm` crate, whose packing, the conversion and the copies around them
//! were over half of an F16 prefill step on an AVX2-only machine (Zen 3). Widening the f16
//! weight 8 elements per `vcvtph2ps` straight into a multiply-add needs neither.
//!
//! Strategy: tiles of 4 activation rows by 3 weight rows, one 8-lane f32 accumulator per
//! pair (12 accumulators and 3 widened weight vectors in the 16 ymm registers; the
//! activation vector is a load folded into the multiply-add), over the whole of `k` in steps
//! of 8; the last `k % 8` elements of both rows are copied into zeroed 8-lane buffers (the
//! lanes past the row add +0). Each accumulator is reduced by a fixed tree of adds
//! ([`hsum`]). The jobs (L2-sized column blocks of the weight) and the order of tiles are
//! `dot512::prefill`'s, which calls [`prefill_block`] when the AVX-512 bodies are off.
//! Decode ([`decode_block`], through `dot512::decode_columns`) runs `gemv`'s AVX2 body over a
//! block of weight rows gathered once, one row at a time front to back.
//!
//! Invariants / determinism: an output element's value depends only on its activation row,
//! its weight row and `k`, never on the tile shape (edge tiles are smaller tiles of the same
//! body), the job split or the thread count. These are prefill bits; the decode products
//! ([`decode_block`]: `gemv`'s AVX2 body, at most `GEMV_MAX_M` rows) sum in another order,
//! the same as `gemv`'s per-row fallback and the attention scores.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::dot512::{Rows, Sink};
use super::gemv::x86::{body, Lanes};

/// Activation rows of a tile.
const ROWS: usize = 4;

/// Weight rows of a tile.
pub(in crate::kernels) const COLS: usize = 3;

/// Whether the bodies may run on this CPU: AVX2, FMA and F16C (std caches the detection).
pub(in crate::kernels) fn available() -> bool {
    super::gemv::x86::available()
}

/// Elements `p[0..n]` (`n < 8`) as f32, zero above; nothing past `p[n - 1]` is read.
#[inline(always)]
unsafe fn load_tail<T: Lanes>(p: *const T, n: usize) -> __m256 {
    // SAFETY (zeroed): all-zero bits are +0.0 in f32, f16 and bf16.
    let mut buf: [T; 8] = std::mem::zeroed();
    std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
    T::load8(buf.as_ptr())
}

/// The sum of the 8 lanes of `v` by a fixed tree: halves, then pairs, then the last two.
#[inline(always)]
pub(in crate::kernels) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `out[r][c] = xs[r][..k] . ws[c][..k]`, one accumulator per pair (see the module header).
// The indices address several arrays in lockstep.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<T: Lanes, const R: usize, const C: usize>(
    xs: [*const f32; R],
    ws: [*const T; C],
    k: usize,
) -> [[f32; C]; R] {
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut wv = [_mm256_setzero_ps(); C];
    let mut e = 0;
    while e + 8 <= k {
        for c in 0..C {
            wv[c] = T::load8(ws[c].add(e));
        }
        for r in 0..R {
            let xv = _mm256_loadu_ps(xs[r].add(e));
            for c in 0..C {
                acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
        e += 8;
    }
    if e < k {
        let n = k - e;
        for c in 0..C {
            wv[c] = load_tail(ws[c].add(e), n);
        }
        for r in 0..R {
            let xv = load_tail(xs[r].add(e), n);
            for c in 0..C {
                acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
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

/// Tiles of `R` activation rows starting at `i0` over the weight rows `ws` (columns
/// `j0..j0 + ws.len()`), [`COLS`] at a time and then the rest in one narrower tile.
#[inline(always)]
unsafe fn row_tiles<T: Lanes, const R: usize>(
    x: *const f32,
    i0: usize,
    ws: &[*const T],
    j0: usize,
    k: usize,
    sink: Sink,
) {
    let xs: [*const f32; R] = std::array::from_fn(|r| x.add((i0 + r) * k));
    let mut groups = ws.chunks_exact(COLS);
    let mut j = j0;
    for g in &mut groups {
        let w: [*const T; COLS] = std::array::from_fn(|c| g[c]);
        sink.put::<R, COLS>(i0, j, tile::<T, R, COLS>(xs, w, k));
        j += COLS;
    }
    match *groups.remainder() {
        [w0, w1] => sink.put::<R, 2>(i0, j, tile::<T, R, 2>(xs, [w0, w1], k)),
        [w0] => sink.put::<R, 1>(i0, j, tile::<T, R, 1>(xs, [w0], k)),
        _ => {}
    }
}

/// Every activation row `0..m` of `x` (`m x k`, contiguous) against the weight rows `ws`,
/// [`ROWS`] activation rows per tile, then the rest in one smaller tile.
#[inline(always)]
unsafe fn all_rows<T: Lanes>(
    x: *const f32,
    m: usize,
    ws: &[*const T],
    j0: usize,
    k: usize,
    sink: Sink,
) {
    let mut i = 0;
    while i + ROWS <= m {
        row_tiles::<T, ROWS>(x, i, ws, j0, k, sink);
        i += ROWS;
    }
    match m - i {
        0 => {}
        1 => row_tiles::<T, 1>(x, i, ws, j0, k, sink),
        2 => row_tiles::<T, 2>(x, i, ws, j0, k, sink),
        _ => row_tiles::<T, 3>(x, i, ws, j0, k, sink),
    }
}

/// Prefill: `x` (`m x k`) against the weight rows of a block (columns `j0..`), 4 x 3 tiles.
///
/// # Safety
/// AVX2, FMA and F16C are available ([`available`]); every row is `k` long, `x` holds `m`
/// rows of `k`, and `sink` is valid for writes of those rows and columns.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn prefill_block(
    x: *const f32,
    m: usize,
    rows: Rows<'_>,
    j0: usize,
    k: usize,
    sink: Sink,
) {
    match rows {
        Rows::F32(ws) => all_rows::<f32>(x, m, ws, j0, k, sink),
        Rows::F16(ws) => all_rows::<f16>(x, m, ws, j0, k, sink),
        Rows::BF16(ws) => all_rows::<bf16>(x, m, ws, j0, k, sink),
    }
}

/// Decode: every weight row in turn (one stream through memory), against the activation
/// rows two at a time and then the last alone, with `gemv`'s AVX2 body (so the bits are
/// `gemv`'s and the attention scores' on this path). The rows come gathered for the whole
/// block: no per-row view lookup, feature check or call.
///
/// # Safety
/// As [`prefill_block`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn decode_block(
    x: *const f32,
    m: usize,
    rows: Rows<'_>,
    j0: usize,
    k: usize,
    sink: Sink,
) {
    match rows {
        Rows::F32(ws) => decode_rows::<f32>(x, m, ws, j0, k, sink),
        Rows::F16(ws) => decode_rows::<f16>(x, m, ws, j0, k, sink),
        Rows::BF16(ws) => decode_rows::<bf16>(x, m, ws, j0, k, sink),
    }
}

/// Bytes ahead of the weight stream that decode prefetches (as `dot512`'s decode).
const DECODE_PF: usize = 4096;

#[inline(always)]
unsafe fn decode_rows<T: Lanes>(
    x: *const f32,
    m: usize,
    ws: &[*const T],
    j0: usize,
    k: usize,
    sink: Sink,
) {
    let row_bytes = k * std::mem::size_of::<T>();
    for (jj, &w) in ws.iter().enumerate() {
        // The stream DECODE_PF bytes ahead, a row's worth per row (the rows of a weight are
        // one run of memory, so this runs ahead of the rows still to come).
        let ahead = w.cast::<i8>().wrapping_add(DECODE_PF);
        let mut o = 0;
        while o < row_bytes {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(o));
            o += 64;
        }
        let (j, w) = (j0 + jj, std::slice::from_raw_parts(w, k));
        let mut i = 0;
        while i + 2 <= m {
            let xs = [x.add(i * k), x.add((i + 1) * k)];
            sink.put::<2, 1>(i, j, body::<T, 2>(w, xs, k).map(|v| [v]));
            i += 2;
        }
        if i < m {
            sink.put::<1, 1>(i, j, [body::<T, 1>(w, [x.add(i * k)], k)]);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The tiles against an f64 reference for every stored type and edge shape, and every
    //! tile shape giving the bits of a 1 x 1 tile over the same rows.

    use super::super::view::FloatRow;
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

    /// The `Rows` variant of a stored type.
    type AsRows<T> = for<'a> fn(&'a [*const T]) -> Rows<'a>;

    /// `out[i * n + j] = x[i] . w[j]` through [`prefill_block`], weight rows `k` apart in `w`.
    fn run<T: Copy>(
        rows: AsRows<T>,
        x: &[f32],
        w: &[T],
        (m, n, k): (usize, usize, usize),
    ) -> Vec<f32> {
        let ptrs: Vec<*const T> = (0..n).map(|j| w[j * k..].as_ptr()).collect();
        let mut out = vec![f32::NAN; m * n];
        let sink = Sink {
            ptr: out.as_mut_ptr(),
            rs: n,
            cs: 1,
        };
        // SAFETY: only called where `available()`; rows are `k` long, `x` holds `m` rows,
        // the sink addresses `out`.
        unsafe { prefill_block(x.as_ptr(), m, rows(&ptrs), 0, k, sink) };
        out
    }

    /// Checks one stored type: `to` stores an f32, `back` reads it as f64.
    fn check<T: Copy>(rows: AsRows<T>, to: impl Fn(f32) -> T, back: impl Fn(T) -> f64) {
        let mut shapes: Vec<(usize, usize, usize)> = (1..=13).map(|m| (m, 7, 37)).collect();
        shapes.extend((1..=70).map(|k| (5, 4, k)));
        shapes.extend([(9, 11, 768), (4, 3, 2048 + 5), (13, 10, 1003), (6, 1, 8)]);
        for (m, n, k) in shapes {
            let x = values(m * k, (m * 131 + k) as u64);
            let w: Vec<T> = values(n * k, (n * 17 + k) as u64)
                .into_iter()
                .map(&to)
                .collect();
            let got = run(rows, &x, &w, (m, n, k));
            for i in 0..m {
                let xi = &x[i * k..(i + 1) * k];
                for j in 0..n {
                    let wj = &w[j * k..(j + 1) * k];
                    let want: f64 = xi.iter().zip(wj).map(|(a, b)| *a as f64 * back(*b)).sum();
                    let bound = 1e-6 * (k as f64).sqrt().max(1.0);
                    let g = got[i * n + j] as f64;
                    assert!(
                        (g - want).abs() < bound,
                        "{m}x{n}x{k} [{i},{j}]: {g} {want}"
                    );
                    let alone = run(rows, xi, wj, (1, 1, k))[0];
                    assert_eq!(
                        got[i * n + j].to_bits(),
                        alone.to_bits(),
                        "{m}x{n}x{k} [{i},{j}]"
                    );
                }
            }
        }
    }

    #[test]
    fn prefill_tiles_match_a_reference_and_keep_their_bits_for_every_shape() {
        if !available() {
            // libtest cannot mark a test skipped at run time: say so, check nothing.
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C");
            return;
        }
        check(|p| Rows::F16(p), f16::from_f32, f16::to_f64);
        check(|p| Rows::BF16(p), bf16::from_f32, bf16::to_f64);
        check(|p| Rows::F32(p), |v| v, |v| v as f64);
    }

    #[test]
    fn decode_rows_keep_the_bits_of_gemvs_body_for_every_row_count() {
        if !available() {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C");
            return;
        }
        for (m, n, k) in [(1, 5, 37), (2, 4, 768), (3, 7, 5), (5, 3, 70), (8, 2, 1003)] {
            let x = values(m * k, (m * 7 + k) as u64);
            let w: Vec<f16> = values(n * k, k as u64)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let ptrs: Vec<*const f16> = (0..n).map(|j| w[j * k..].as_ptr()).collect();
            let mut out = vec![f32::NAN; m * n];
            let sink = Sink {
                ptr: out.as_mut_ptr(),
                rs: n,
                cs: 1,
            };
            // SAFETY: the features were detected; rows are `k` long, `x` holds `m` rows.
            unsafe { decode_block(x.as_ptr(), m, Rows::F16(&ptrs), 0, k, sink) };
            for j in 0..n {
                let wj = &w[j * k..(j + 1) * k];
                let mut want = vec![0.0f32; m];
                // SAFETY: as above.
                unsafe { super::super::gemv::x86::dots(FloatRow::F16(wj), &x, k, &mut want) };
                for i in 0..m {
                    let xi = &x[i * k..(i + 1) * k];
                    let exact: f64 = xi.iter().zip(wj).map(|(a, b)| *a as f64 * b.to_f64()).sum();
                    let got = out[i * n + j];
                    assert_eq!(got.to_bits(), want[i].to_bits(), "{m}x{n}x{k} [{i},{j}]");
                    assert!((got as f64 - exact).abs() < 1e-5, "{m}x{n}x{k} [{i},{j}]");
                }
            }
        }
    }

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn dot256_prefill_speed() {
        if !available() {
            return;
        }
        let m = 128;
        for (n, k) in [(768, 768), (2048, 768), (768, 2048)] {
            let x = values(m * k, 5);
            let w: Vec<f16> = values(n * k, 6).into_iter().map(f16::from_f32).collect();
            let mut out = vec![0.0f32; m * n];
            let products = [super::super::dot512::Prefill {
                x: &x,
                // SAFETY: `w` holds `n` rows of `k`: column `j` of this `[k, n]` view is row `j`.
                w: unsafe {
                    super::super::view::Strided::from_raw(
                        w.as_ptr() as *mut u8,
                        lowsync_graph::DType::F16,
                        vec![k, n],
                        vec![1, k],
                    )
                },
                out: out.as_mut_ptr(),
                out_rs: n,
            }];
            let mut best = f64::MAX;
            for _ in 0..20 {
                let t = std::time::Instant::now();
                // SAFETY: `out` holds `m x n`.
                assert!(unsafe { super::super::dot512::prefill(&products, (m, n, k)) });
                best = best.min(t.elapsed().as_secs_f64());
            }
            let threads = rayon::current_num_threads();
            println!(
                "m {m} n {n} k {k}: {:.2} ms, {:.1} GMAC/s on {threads} threads",
                best * 1e3,
                (m * n * k) as f64 / best / 1e9
            );
        }
    }
}
