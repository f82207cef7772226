//! Decode products over float weights: `x @ W.T` (and `q @ K.T`) for a few activation rows,
//! each weight row read once in its stored type (f32, f16, bf16) and dotted in registers.
//!
//! Why: a decode step multiplies one activation row by every weight matrix once. Going
//! through `gemm` means converting each f16/bf16 weight block to an f32 buffer first (a write
//! and a re-read of every weight) and paying gemm's packing for a 1-row problem; reading the
//! weight row straight into a fused multiply-add runs at the speed of reading the weights.
//!
//! Strategy: applies when the right operand, per batch, is a 2-D `[k, n]` view whose column
//! `j` is a contiguous row of memory (`W.T` of a row-major weight, or the keys of a KV cache
//! seen as `K.T`) and there are at most [`GEMV_MAX_M`] activation rows. The activations are
//! made contiguous f32 once. Jobs are blocks of output columns (weight rows) of one batch,
//! about [`JOB_WORK`] multiply-adds each, run in parallel on the rayon pool only when the
//! whole product is worth a fork ([`PAR_MIN_WORK`]). With AVX-512 (detected at run time,
//! `dot512`) a weight row is read 16 elements a step into four accumulators per activation
//! row (four activation rows at a time). With AVX2, FMA and F16C (or AVX-512 turned
//! off) a weight row is loaded 8 elements at a time, widened in registers and multiplied into
//! four accumulators per activation row (two rows at a time), over a job's weight rows
//! gathered once (`dot256::decode_block`, through `dot512::decode_columns`; a row at a time
//! where they cannot be gathered); elsewhere the row is converted
//! to f32 and dotted with `quant::dot_f32`, the portable reference.
//!
//! Determinism: each output element is one dot product in a fixed order (per body: lanes,
//! then the accumulators, then the tail) computed by one job, so results do not depend on the
//! thread count.

use rayon::prelude::*;

use super::quant::dot_f32;
use super::view::{FloatRow, Strided};

/// Up to this many activation rows a float product takes this path.
pub(super) const GEMV_MAX_M: usize = 8;

/// Multiply-adds of one parallel job (about).
const JOB_WORK: usize = 1 << 16;

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 18;

/// Whether `b` (a 2-D `[k, n]` matrix of one batch) can be read here: a float view whose
/// columns are contiguous rows of aligned memory.
pub(super) fn reads(b: &Strided) -> bool {
    b.rank() == 2 && b.shape()[1] > 0 && b.float_row(1, 0).is_some()
}

/// One product of a batch: contiguous f32 activations `x [m, k]` and a weight view `w [k, n]`
/// that [`reads`] accepts.
pub(super) struct Product<'a> {
    pub x: &'a [f32],
    pub w: Strided,
}

/// Runs every product (all `[m, k] @ [k, n]`) into `out_t`, product-major then j-major:
/// `out_t[(p * n + j) * m + i] = x_p[i] . w_p[:, j]`.
pub(super) fn run(products: &[Product<'_>], (m, n, k): (usize, usize, usize), out_t: &mut [f32]) {
    debug_assert_eq!(out_t.len(), products.len() * n * m);
    if m == 0 || n == 0 {
        return;
    }
    let cols = (JOB_WORK / (k * m).max(1)).clamp(8, n.max(8)).min(n);
    let job = |p: usize, c0: usize, chunk: &mut [f32], scratch: &mut Scratch| {
        let pr = &products[p];
        #[cfg(target_arch = "x86_64")]
        {
            if super::dot512::decode_columns(&pr.w, c0, pr.x, (m, k), chunk, &mut scratch.rows) {
                return;
            }
        }
        let buf = &mut scratch.buf;
        for (jj, res) in chunk.chunks_exact_mut(m).enumerate() {
            match pr.w.float_row(1, c0 + jj) {
                Some(w) => dots(w, pr.x, k, res, buf),
                None => debug_assert!(false, "column {} not readable", c0 + jj),
            }
        }
    };
    let work = products
        .len()
        .saturating_mul(n)
        .saturating_mul(k)
        .saturating_mul(m);
    let mut jobs: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (p, per) in out_t.chunks_mut(n * m).enumerate() {
        for (b, chunk) in per.chunks_mut(cols * m).enumerate() {
            jobs.push((p, b * cols, chunk));
        }
    }
    if work < PAR_MIN_WORK || jobs.len() < 2 {
        let mut scratch = Scratch::default();
        for (p, c0, chunk) in jobs {
            job(p, c0, chunk, &mut scratch);
        }
    } else {
        jobs.into_par_iter()
            .for_each_init(Scratch::default, |s, (p, c0, chunk)| job(p, c0, chunk, s));
    }
}

/// Per-job scratch: a converted weight row (portable path), the row pointers of a block
/// (AVX-512 path).
#[derive(Default)]
struct Scratch {
    buf: Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    rows: super::dot512::RowBufs,
}

/// `x . w` for one f32 row `x` as long as `w`, in the same order as this module's products.
pub(super) fn dot(w: FloatRow<'_>, x: &[f32], buf: &mut Vec<f32>) -> f32 {
    let mut r = [0.0f32];
    dots(w, x, x.len(), &mut r, buf);
    r[0]
}

/// `res[i] = x[i * k..][..k] . w` for every activation row `i < res.len()`.
fn dots(w: FloatRow<'_>, x: &[f32], k: usize, res: &mut [f32], buf: &mut Vec<f32>) {
    if w.len() != k || x.len() < res.len() * k {
        debug_assert!(false, "row of {} for k = {k}", w.len());
        res.fill(f32::NAN);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if x86::available() {
            // SAFETY: AVX2, FMA and F16C were detected; lengths were checked above.
            unsafe { x86::dots(w, x, k, res) };
            return;
        }
    }
    buf.resize(k, 0.0);
    w.to_f32(buf);
    for (i, r) in res.iter_mut().enumerate() {
        *r = dot_f32(&x[i * k..(i + 1) * k], buf);
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! AVX2 + FMA + F16C bodies: a weight row's elements are widened to f32 in registers
    //! (`Lanes::load8`) and multiplied into four accumulators per activation row.

    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::FloatRow;

    /// Whether the bodies may run on this CPU (std caches the detection).
    #[inline]
    pub(in crate::kernels) fn available() -> bool {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }

    /// A stored float type loaded 8 elements at a time as f32.
    pub(in crate::kernels) trait Lanes: Copy {
        /// Elements `p[0..8]` as f32. Inlined into a body that enables AVX2 and F16C.
        unsafe fn load8(p: *const Self) -> __m256;
        fn to_f32(self) -> f32;
    }

    impl Lanes for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            self
        }
    }

    impl Lanes for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            f16::to_f32(self)
        }
    }

    impl Lanes for bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            // bf16 is the high half of an f32.
            let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            bf16::to_f32(self)
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C are available; `w.len() == k` and `x` holds `res.len()` rows of `k`.
    pub(in crate::kernels) unsafe fn dots(w: FloatRow<'_>, x: &[f32], k: usize, res: &mut [f32]) {
        match w {
            FloatRow::F32(w) => rows(w, x, k, res),
            FloatRow::F16(w) => rows(w, x, k, res),
            FloatRow::BF16(w) => rows(w, x, k, res),
        }
    }

    /// Activation rows two at a time, then the last one alone.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows<T: Lanes>(w: &[T], x: &[f32], k: usize, res: &mut [f32]) {
        let mut pairs = res.chunks_exact_mut(2);
        let mut r = 0;
        for out in &mut pairs {
            let xs = [x.as_ptr().add(r * k), x.as_ptr().add((r + 1) * k)];
            let v = body::<T, 2>(w, xs, k);
            out.copy_from_slice(&v);
            r += 2;
        }
        if let [out] = pairs.into_remainder() {
            *out = body::<T, 1>(w, [x.as_ptr().add(r * k)], k)[0];
        }
    }

    /// `R` dot products of `w` with the rows at `xs` (each `k` long). Inlined into bodies that
    /// enable AVX2, FMA and F16C (here and in `attention`, whose scores are these dot products).
    #[inline(always)]
    pub(in crate::kernels) unsafe fn body<T: Lanes, const R: usize>(
        w: &[T],
        xs: [*const f32; R],
        k: usize,
    ) -> [f32; R] {
        let wp = w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let mut e = 0;
        while e + 32 <= k {
            for (u, _) in [(); 4].iter().enumerate() {
                let wv = T::load8(wp.add(e + 8 * u));
                for r in 0..R {
                    let xv = _mm256_loadu_ps(xs[r].add(e + 8 * u));
                    acc[r][u] = _mm256_fmadd_ps(wv, xv, acc[r][u]);
                }
            }
            e += 32;
        }
        while e + 8 <= k {
            let wv = T::load8(wp.add(e));
            for r in 0..R {
                acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[r].add(e)), acc[r][0]);
            }
            e += 8;
        }
        let mut out = [0.0f32; R];
        for r in 0..R {
            let a = &acc[r];
            let v = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let mut sum = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
            for t in e..k {
                sum += (*wp.add(t)).to_f32() * *xs[r].add(t);
            }
            out[r] = sum;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    //! The `#[ignore]`d benchmark times one decode step's float products of a 12-layer,
    //! d 768, ff 2048, vocab 32000 F16 model (weights in DRAM) on the rayon pool
    //! (`RAYON_NUM_THREADS=2 cargo test --release -p lowsync-cpu gemv_decode_speed --
    //! --ignored --nocapture`).

    use half::f16;
    use lowsync_graph::DType;

    use super::*;

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn gemv_decode_speed() {
        let k = 768;
        let mut shapes = Vec::new();
        for _ in 0..12 {
            shapes.extend([(768, k); 4]);
            shapes.extend([(2048, k), (2048, k), (768, 2048)]);
        }
        shapes.push((32000, k));
        let weights: Vec<Vec<f16>> = shapes
            .iter()
            .map(|&(n, k)| {
                (0..n * k)
                    .map(|i| f16::from_f32((i % 7) as f32 * 0.01))
                    .collect()
            })
            .collect();
        let xs: Vec<Vec<f32>> = shapes.iter().map(|&(_, k)| vec![0.5; k]).collect();
        let bytes: usize = shapes.iter().map(|&(n, k)| n * k * 2).sum();
        let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(n, _)| vec![0.0; n]).collect();
        let mut best = f64::MAX;
        for _ in 0..30 {
            let t = std::time::Instant::now();
            for (((&(n, k), w), x), out) in shapes.iter().zip(&weights).zip(&xs).zip(&mut outs) {
                // SAFETY: `w` holds `n` rows of `k`: column `j` of this `[k, n]` view is row `j`.
                let w = unsafe {
                    Strided::from_raw(w.as_ptr() as *mut u8, DType::F16, vec![k, n], vec![1, k])
                };
                run(&[Product { x, w }], (1, n, k), out);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "decode step: {:.2} ms, {:.1} GB/s on {} threads",
            best * 1e3,
            bytes as f64 / best / 1e9,
            rayon::current_num_threads()
        );
    }
}
