//! Attention that reads only the KV cells its mask lets through: the chain
//! `p = soft_max(q @ K.T, mask, scale)`, `out = p @ V` run as one kernel.
//!
//! Why: a graph's shape never depends on positions, so attention spans all `n_ctx` cells of
//! the cache and validity travels in the mask (0 or -inf). Run node by node, a decode step
//! with a short sequence in a large context scores, normalises and sums over every cell: at
//! 8192 cells, most of the step's time goes to cells whose weight is exactly zero.
//!
//! Strategy: [`fusable`] recognises the three nodes when they are consecutive in the graph
//! (`MulMat`, `SoftMax` of its result, `MulMat` of that with the values), with keys and values
//! whose head rows are contiguous, and proves it safe to run them as one: no source needs a
//! private copy, the result overlaps neither keys nor values (queries or mask under it are
//! copied first), and the scores and probabilities are dead after the chain (overwritten
//! before anything reads them, or scratch no later split reads), since the fused kernel never
//! writes them. [`run`] then works per (query head, query row): it
//! lists the cells whose mask is not -inf (once per mask row shared by heads), scores only
//! those (`gemv::dot`), applies `softmax_in_place` to them and sums their value rows in cell
//! order. With AVX2, FMA and F16C the scores and the sum run in `x86`'s bodies, which read
//! key and value rows in place (the same score bits; the sum with one FMA per element). With
//! AVX-512, when the query heads of a KV head share its value head and the mask, a job is one
//! query row of up to 4 of those heads (`x86::Grouped`): each key row is read once and scored
//! against all of them, each value row is widened once and added into all of their sums, with
//! the bits of one head at a time.
//!
//! Semantics: identical to the unfused chain except that a masked cell contributes exactly
//! zero whatever its key or value holds (unfused, a NaN or infinite key or value in a masked
//! cell would poison the row). A NaN in a valid cell still makes the row NaN, a row with no
//! valid cell gives zeros, as `soft_max` does. Each output row is one job's fixed-order sum, so
//! results do not depend on the thread count or on how many masked cells there are.

use lowsync_backend::{ExecNode, Result, ScratchLive, TensorRef};
use lowsync_graph::Op;

use super::gemv;
use super::par::for_each_row;
use super::softmax::softmax_in_place;
use super::view::Strided;
use super::{float_dst, float_src, kernel_err};
use crate::memory::Mem;

/// Whether nodes `i`, `i + 1`, `i + 2` are a `q @ K.T -> soft_max -> @ V` chain that [`run`]
/// computes with the same results, given what is read after the graph (`scratch`).
pub(crate) fn fusable(nodes: &[ExecNode], i: usize, scratch: Option<&ScratchLive>) -> bool {
    let (Some(kq), Some(sm), Some(pv)) = (nodes.get(i), nodes.get(i + 1), nodes.get(i + 2)) else {
        return false;
    };
    let (Op::MulMat, Op::SoftMax { .. }, Op::MulMat) = (kq.op, sm.op, pv.op) else {
        return false;
    };
    let ([q, k], [p, v]) = (kq.srcs.as_slice(), pv.srcs.as_slice()) else {
        return false;
    };
    let Some((x, mask)) = sm.srcs.split_first() else {
        return false;
    };
    if q.shape.len() != 3 || k.shape.len() != 3 || v.shape.len() != 3 {
        return false;
    }
    let (hq, t, d) = (q.shape[0], q.shape[1], q.shape[2]);
    let (hk, l, hv) = (k.shape[0], k.shape[2], v.shape[0]);
    let shapes = hq > 0
        && hk > 0
        && hv > 0
        && hq % hk == 0
        && hq % hv == 0
        && k.shape[1] == d
        && v.shape[1..] == [l, d]
        && kq.dst.shape == [hq, t, l]
        && sm.dst.shape == kq.dst.shape
        && pv.dst.shape == [hq, t, d];
    let layout = [q, k, v, &kq.dst, &sm.dst, &pv.dst]
        .iter()
        .all(|r| r.dtype.is_float())
        && mask.iter().all(|m| m.dtype.is_float())
        && (k.strides[1] == 1 || d == 1)
        && (v.strides[2] == 1 || d == 1);
    let chain = x == &kq.dst && p == &sm.dst;
    if !(shapes && layout && chain) {
        return false;
    }
    let private = [kq, sm, pv]
        .iter()
        .any(|n| (0..n.srcs.len()).any(|s| n.src_needs_private_copy(s)));
    // The result is written head by head while other heads' inputs are still being read:
    // queries and mask under it are read from private copies (the allocator reuses the
    // queries' bytes for the result, as they are dead after the first product); the cache
    // is too big to copy.
    let clobbers = [k, v].into_iter().any(|s| overlap(&pv.dst, s));
    !private && !clobbers && dead_after(nodes, i, scratch)
}

/// Whether the scores (`nodes[i].dst`) and probabilities (`nodes[i + 1].dst`) are never read
/// after the chain: every later read of their bytes comes after a full overwrite, and what is
/// left at the graph's end is scratch no later split reads (`scratch`; `None` knows nothing).
fn dead_after(nodes: &[ExecNode], i: usize, scratch: Option<&ScratchLive>) -> bool {
    let mut live: Vec<(lowsync_backend::BufferId, usize, usize)> = [i, i + 1]
        .iter()
        .map(|&n| {
            let (a, b) = byte_range(&nodes[n].dst);
            (nodes[n].dst.buffer, a, b)
        })
        .filter(|&(_, a, b)| a < b)
        .collect();
    // The chain's own reads of the scores and probabilities.
    let inside = [(i + 1, 0), (i + 2, 0)];
    for (j, n) in nodes.iter().enumerate().skip(i + 1) {
        let reads_live = n.srcs.iter().enumerate().any(|(si, s)| {
            let (s0, s1) = byte_range(s);
            !inside.contains(&(j, si))
                && s0 < s1
                && live
                    .iter()
                    .any(|&(buf, l0, l1)| buf == s.buffer && s0 < l1 && l0 < s1)
        });
        if reads_live {
            return false;
        }
        // The soft_max's write is the one skipped; SetRows writes only some rows of its result.
        if j >= i + 2 && n.op != Op::SetRows && n.dst.is_contiguous() {
            let (w0, w1) = byte_range(&n.dst);
            live = live
                .into_iter()
                .flat_map(|(buf, l0, l1)| {
                    if buf == n.dst.buffer {
                        vec![(buf, l0, l1.min(w0)), (buf, l0.max(w1), l1)]
                    } else {
                        vec![(buf, l0, l1)]
                    }
                })
                .filter(|&(_, a, b)| a < b)
                .collect();
            if live.is_empty() {
                return true;
            }
        }
    }
    scratch.is_some_and(|sc| live.iter().all(|&(buf, a, b)| !sc.read_after(buf, a, b)))
}

fn byte_range(t: &TensorRef) -> (usize, usize) {
    (t.byte_offset, t.byte_offset.saturating_add(t.byte_extent()))
}

fn overlap(a: &TensorRef, b: &TensorRef) -> bool {
    let ((a0, a1), (b0, b1)) = (byte_range(a), byte_range(b));
    a.buffer == b.buffer && a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
}

/// The cells of one mask row that are not -inf, with their mask values, in cell order.
struct Cells {
    idx: Vec<usize>,
    add: Vec<f32>,
}

/// Runs the chain at `nodes[i..i + 3]` (checked by [`fusable`]): writes only the last node's
/// result.
pub(crate) fn run(nodes: &[ExecNode], i: usize, mem: &dyn Mem) -> Result<()> {
    let (kq, sm, pv) = (&nodes[i], &nodes[i + 1], &nodes[i + 2]);
    let Op::SoftMax { scale } = sm.op else {
        return Err(kernel_err(sm, "is not a soft_max"));
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(e) = super::dot512::env_error() {
        return Err(kernel_err(kq, e));
    }
    // Sources under the result are copied first (`fusable` allows it for queries and mask).
    let mut private = Vec::new();
    let mut resolve = |n: &ExecNode, t: &TensorRef| -> Result<Strided> {
        let s = Strided::resolve(n, t, mem)?;
        if !overlap(&pv.dst, t) {
            return Ok(s);
        }
        let (buf, copy) = s.detach();
        private.push(buf);
        Ok(copy)
    };
    let q = resolve(kq, &kq.srcs[0])?;
    let k = Strided::resolve(kq, &kq.srcs[1], mem)?;
    let v = Strided::resolve(pv, &pv.srcs[1], mem)?;
    let out = Strided::resolve(pv, &pv.dst, mem)?;
    float_dst(pv, &out)?;
    for (what, s) in [("q", &q), ("keys", &k), ("values", &v)] {
        float_src(pv, what, s)?;
    }
    let (hq, t, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (hk, l, hv) = (k.shape()[0], k.shape()[2], v.shape()[0]);
    let mask = match sm.srcs.get(1) {
        None => None,
        Some(m) => {
            let m = resolve(sm, m)?;
            float_src(sm, "mask", &m)?;
            Some(m.broadcast_to(&[hq, t, l]).ok_or_else(|| {
                kernel_err(
                    sm,
                    format!(
                        "mask {:?} does not broadcast onto {:?}",
                        m.shape(),
                        [hq, t, l]
                    ),
                )
            })?)
        }
    };
    // One list of cells per distinct mask row: per query row when the mask is shared by heads.
    let per_head = mask.as_ref().is_some_and(|m| m.strides()[0] != 0) && hq > 1;
    let lists = if per_head { hq * t } else { t };
    let mut cells = Vec::with_capacity(lists);
    let mut row = vec![0.0f32; l];
    for r in 0..lists {
        let (idx, add) = match &mask {
            Some(m) => {
                m.read_row(r, 0..l, &mut row);
                row.iter()
                    .enumerate()
                    .filter(|&(_, &a)| a != f32::NEG_INFINITY)
                    .map(|(c, &a)| (c, a))
                    .unzip()
            }
            None => ((0..l).collect(), vec![0.0; l]),
        };
        cells.push(Cells { idx, add });
    }
    let heads = |h: usize| -> Option<(Strided, Strided)> {
        Some((
            k.index_axis(0, h / (hq / hk))?,
            v.index_axis(0, h / (hq / hv))?,
        ))
    };
    // Check every head's rows once, so the jobs below cannot meet an unreadable one.
    for h in 0..hq {
        let ok = heads(h).is_some_and(|(kh, vh)| {
            l == 0 || (kh.float_row(1, l - 1).is_some() && vh.float_row(0, l - 1).is_some())
        });
        if !ok {
            return Err(kernel_err(
                pv,
                "keys or values are not rows of contiguous memory",
            ));
        }
    }
    let most = cells.iter().map(|c| c.idx.len()).max().unwrap_or(0);
    #[cfg(target_arch = "x86_64")]
    if let Some(layout) = x86::Grouped::new(&k, &v, (hq, hk, hv), per_head) {
        let per_job = layout.heads;
        let jobs = hk * (hq / hk / per_job) * t;
        for_each_row(
            jobs,
            (most * d * 2 * per_job).max(1),
            || {
                (
                    vec![0.0f32; per_job * d],
                    Vec::new(),
                    vec![0.0f32; per_job * d],
                )
            },
            |(qs, p, acc), job| {
                // Job `job` is query row `ti` of the heads `h0..h0 + per_job`, which share
                // one key and value head and (the mask not being per head) one list of cells.
                let (h0, ti) = ((job / t) * per_job, job % t);
                for (j, qr) in qs.chunks_exact_mut(d).enumerate() {
                    q.read_row((h0 + j) * t + ti, 0..d, qr);
                }
                // SAFETY: `Grouped::new` checked the features and that every key and value
                // row of every head is readable at its stride; `qs` and `acc` hold
                // `per_job` rows of `d`.
                unsafe { layout.run(h0 / (hq / hk), &cells[ti], scale, qs, p, acc) };
                for (j, a) in acc.chunks_exact(d).enumerate() {
                    out.write_row((h0 + j) * t + ti, 0..d, a);
                }
            },
        );
        return Ok(());
    }
    for_each_row(
        hq * t,
        (most * d * 2).max(1),
        || {
            (
                vec![0.0f32; d],
                vec![0.0f32; d],
                Vec::new(),
                Vec::new(),
                vec![0.0f32; d],
            )
        },
        |(qrow, acc, p, buf, vrow), r| {
            let (h, ti) = (r / t, r % t);
            let c = &cells[if per_head { r } else { ti }];
            let Some((kh, vh)) = heads(h) else {
                return;
            };
            q.read_row(r, 0..d, qrow);
            p.clear();
            acc.fill(0.0);
            #[cfg(target_arch = "x86_64")]
            {
                if gemv::x86::available() {
                    // SAFETY: AVX2, FMA and F16C were detected; `qrow` and `acc` hold `d`
                    // elements, the length of every key and value row (checked above).
                    unsafe {
                        if super::dot512::available() {
                            // SAFETY: the AVX-512 features were detected (`available`).
                            x86::scores512(&kh, c, scale, qrow, p);
                        } else {
                            x86::scores(&kh, c, scale, qrow, p);
                        }
                        softmax_in_place(p);
                        x86::values(&vh, &c.idx, p, acc);
                    }
                    out.write_row(r, 0..d, acc);
                    return;
                }
            }
            for (&cell, &add) in c.idx.iter().zip(&c.add) {
                let s = kh
                    .float_row(1, cell)
                    .map_or(f32::NAN, |kr| gemv::dot(kr, qrow, buf));
                p.push(s * scale + add);
            }
            softmax_in_place(p);
            for (&cell, &w) in c.idx.iter().zip(p.iter()) {
                if let Some(vr) = vh.float_row(0, cell) {
                    vr.to_f32(vrow);
                    acc.iter_mut()
                        .zip(vrow.iter())
                        .for_each(|(a, x)| *a += w * x);
                }
            }
            out.write_row(r, 0..d, acc);
        },
    );
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 + FMA + F16C bodies of one (query head, query row) job, for f32, f16 and bf16
    //! caches: the key and value rows are read in their stored type and widened in registers.
    //!
    //! Why: at a depth of a few hundred cells, scoring one cell through `gemv::dot` (a view
    //! lookup, a dispatch and an out-of-line call per cell) and summing values by converting
    //! each value row into a buffer, then a loop built for SSE2, took about 60 ns per cell and
    //! head: 15% of a small model's decode step at depth 200.
    //!
    //! Strategy: a score is `gemv`'s own dot product body (`gemv::x86::body`, or `dot512`'s
    //! tile where AVX-512 runs), inlined here, so it gives the bits the unfused `q @ K.T`
    //! gives. The weighted sum of values runs over column chunks of up to 64 (8 vectors, each an accumulator in a register): for each chunk
    //! the cells are visited in order and each value row's chunk is multiplied into the
    //! accumulators with one FMA per vector; columns past the last multiple of 8 are summed
    //! in the same cell order with scalar FMAs.

    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::super::dot512::{row, Lanes16};
    use super::super::gemv::x86::{body, Lanes};
    use super::super::softmax::softmax_in_place;
    use super::super::view::{FloatRow, Strided};
    use super::Cells;

    /// Appends `q . K[cell] * scale + add` for every cell of `c` to `p` (NaN for a row the view
    /// cannot read).
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; every key row is `q.len()` long.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores(kh: &Strided, c: &Cells, scale: f32, q: &[f32], p: &mut Vec<f32>) {
        let (d, x) = (q.len(), [q.as_ptr()]);
        for (&cell, &add) in c.idx.iter().zip(&c.add) {
            let s = match kh.float_row(1, cell) {
                Some(FloatRow::F32(k)) if k.len() == d => body::<f32, 1>(k, x, d)[0],
                Some(FloatRow::F16(k)) if k.len() == d => body::<f16, 1>(k, x, d)[0],
                Some(FloatRow::BF16(k)) if k.len() == d => body::<bf16, 1>(k, x, d)[0],
                _ => f32::NAN,
            };
            p.push(s * scale + add);
        }
    }

    /// [`scores`] with `dot512`'s body, the bits of the unfused `q @ K.T` when AVX-512 runs.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, FMA and F16C are available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn scores512(
        kh: &Strided,
        c: &Cells,
        scale: f32,
        q: &[f32],
        p: &mut Vec<f32>,
    ) {
        for (&cell, &add) in c.idx.iter().zip(&c.add) {
            let s = kh
                .float_row(1, cell)
                .map_or(f32::NAN, |k| super::super::dot512::score(k, q));
            p.push(s * scale + add);
        }
    }

    /// `acc += sum over cells, in order, of p[i] * V[idx[i]]` (`acc` zeroed by the caller);
    /// a row the view cannot read contributes nothing.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; every value row is `acc.len()` long.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn values(vh: &Strided, idx: &[usize], p: &[f32], acc: &mut [f32]) {
        let d = acc.len();
        let mut c0 = 0;
        while c0 + 64 <= d {
            chunk::<8>(vh, idx, p, acc, c0);
            c0 += 64;
        }
        while c0 + 8 <= d {
            chunk::<1>(vh, idx, p, acc, c0);
            c0 += 8;
        }
        if c0 < d {
            for (&cell, &w) in idx.iter().zip(p) {
                let row = vh.float_row(0, cell);
                for (j, a) in acc.iter_mut().enumerate().skip(c0) {
                    let v = match row {
                        Some(FloatRow::F32(v)) if v.len() == d => v[j],
                        Some(FloatRow::F16(v)) if v.len() == d => v[j].to_f32(),
                        Some(FloatRow::BF16(v)) if v.len() == d => v[j].to_f32(),
                        _ => continue,
                    };
                    *a = w.mul_add(v, *a);
                }
            }
        }
    }

    /// Columns `c0..c0 + 8 * N` of the weighted sum, `N` accumulators in registers.
    #[inline(always)]
    unsafe fn chunk<const N: usize>(
        vh: &Strided,
        idx: &[usize],
        p: &[f32],
        acc: &mut [f32],
        c0: usize,
    ) {
        let d = acc.len();
        let mut a = [_mm256_setzero_ps(); N];
        for (&cell, &w) in idx.iter().zip(p) {
            let wv = _mm256_set1_ps(w);
            match vh.float_row(0, cell) {
                Some(FloatRow::F32(v)) if v.len() == d => fma_row(&mut a, wv, v, c0),
                Some(FloatRow::F16(v)) if v.len() == d => fma_row(&mut a, wv, v, c0),
                Some(FloatRow::BF16(v)) if v.len() == d => fma_row(&mut a, wv, v, c0),
                _ => {}
            }
        }
        for (u, v) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.as_mut_ptr().add(c0 + 8 * u), *v);
        }
    }

    /// `a[u] += w * row[c0 + 8u..][..8]` for every accumulator.
    #[inline(always)]
    unsafe fn fma_row<T: Lanes, const N: usize>(
        a: &mut [__m256; N],
        w: __m256,
        row: &[T],
        c0: usize,
    ) {
        for (u, a) in a.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(w, T::load8(row.as_ptr().add(c0 + 8 * u)), *a);
        }
    }

    /// The AVX-512 bodies of a job over several query heads that share a key and value head:
    /// each key row is scored against all of them at once (`dot512::row` with one activation
    /// row per head, which gives each head the bits of a lone score), and each value row is
    /// widened once and multiplied into every head's sum.
    ///
    /// Why: one query head at a time, the 3 heads of a small model's KV head read every key
    /// and value row 3 times and paid a view lookup, a dispatch and a 256-bit body per row.
    /// Here a row is found by its cell times the cache's stride.
    pub(super) struct Grouped {
        /// Query heads per job: the largest of 4, 3, 2, 1 that divides the heads per KV head.
        pub(super) heads: usize,
        kv: Kv,
    }

    /// The first key and value row of every KV head, with the element strides between two
    /// cells' rows and between two heads, in their stored type.
    #[derive(Clone, Copy)]
    enum Kv {
        F32(Base<f32>),
        F16(Base<f16>),
        BF16(Base<bf16>),
    }

    #[derive(Clone, Copy)]
    struct Base<T> {
        k: *const T,
        v: *const T,
        k_cell: usize,
        v_cell: usize,
        k_head: usize,
        v_head: usize,
        d: usize,
    }

    // SAFETY: the pointers address the cache, which no job writes while the kernel runs.
    unsafe impl Send for Grouped {}
    unsafe impl Sync for Grouped {}

    impl Grouped {
        /// The layout when the bodies can run: AVX-512 detected, one value head per key head,
        /// one list of cells for all heads, keys and values of one float type whose rows are
        /// contiguous at a fixed stride per cell and per head, at least one cell.
        pub(super) fn new(
            k: &Strided,
            v: &Strided,
            (hq, hk, hv): (usize, usize, usize),
            per_head: bool,
        ) -> Option<Grouped> {
            if !super::super::dot512::available() || hk != hv || per_head {
                return None;
            }
            let (d, l) = (k.shape()[1], k.shape()[2]);
            if l == 0 || d == 0 || k.dtype() != v.dtype() {
                return None;
            }
            // Keys [hk, d, l] with a row per cell along axis 2; values [hk, l, d].
            let (k0, v0) = (k.index_axis(0, 0)?, v.index_axis(0, 0)?);
            let (kr, vr) = (k0.float_row(1, 0)?, v0.float_row(0, 0)?);
            let (k_cell, v_cell) = (k.strides()[2], v.strides()[1]);
            let (k_head, v_head) = (k.strides()[0], v.strides()[0]);
            // Every head's last row is readable (checked by the caller for each head).
            let g = hq / hk;
            let heads = (1..=4).rev().find(|s| g % s == 0).unwrap_or(1);
            let kv = match (kr, vr) {
                (FloatRow::F32(a), FloatRow::F32(b)) => {
                    Kv::F32(base(a, b, k_cell, v_cell, k_head, v_head, d))
                }
                (FloatRow::F16(a), FloatRow::F16(b)) => {
                    Kv::F16(base(a, b, k_cell, v_cell, k_head, v_head, d))
                }
                (FloatRow::BF16(a), FloatRow::BF16(b)) => {
                    Kv::BF16(base(a, b, k_cell, v_cell, k_head, v_head, d))
                }
                _ => return None,
            };
            Some(Grouped { heads, kv })
        }

        /// Query row `qs` (`heads` rows of `d`) of KV head `kv` over the cells `c`: the scores
        /// (`p`, `heads` rows of the cells), their softmax, and the weighted sums of the
        /// values into `acc` (`heads` rows of `d`).
        ///
        /// # Safety
        /// `new` accepted the layout; `kv` is a KV head; `qs` and `acc` hold `heads * d`.
        pub(super) unsafe fn run(
            &self,
            kv: usize,
            c: &Cells,
            scale: f32,
            qs: &[f32],
            p: &mut Vec<f32>,
            acc: &mut [f32],
        ) {
            p.clear();
            p.resize(self.heads * c.idx.len(), 0.0);
            match (self.kv, self.heads) {
                (Kv::F32(b), n) => dispatch(b, n, kv, c, scale, qs, p, acc),
                (Kv::F16(b), n) => dispatch(b, n, kv, c, scale, qs, p, acc),
                (Kv::BF16(b), n) => dispatch(b, n, kv, c, scale, qs, p, acc),
            }
        }
    }

    fn base<T>(
        k: &[T],
        v: &[T],
        k_cell: usize,
        v_cell: usize,
        k_head: usize,
        v_head: usize,
        d: usize,
    ) -> Base<T> {
        Base {
            k: k.as_ptr(),
            v: v.as_ptr(),
            k_cell,
            v_cell,
            k_head,
            v_head,
            d,
        }
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn dispatch<T: Lanes16>(
        b: Base<T>,
        heads: usize,
        kv: usize,
        c: &Cells,
        scale: f32,
        qs: &[f32],
        p: &mut [f32],
        acc: &mut [f32],
    ) {
        let (q, a) = (qs.as_ptr(), acc.as_mut_ptr());
        match heads {
            4 => group::<T, 4>(b, kv, c, scale, q, p, a),
            3 => group::<T, 3>(b, kv, c, scale, q, p, a),
            2 => group::<T, 2>(b, kv, c, scale, q, p, a),
            _ => group::<T, 1>(b, kv, c, scale, q, p, a),
        }
    }

    /// See [`Grouped`]: `R` query heads of KV head `kv`.
    // The indices address several arrays in lockstep.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn group<T: Lanes16, const R: usize>(
        b: Base<T>,
        kv: usize,
        c: &Cells,
        scale: f32,
        q: *const f32,
        p: &mut [f32],
        acc: *mut f32,
    ) {
        let (d, n) = (b.d, c.idx.len());
        let (kh, vh) = (b.k.add(kv * b.k_head), b.v.add(kv * b.v_head));
        let xs: [*const f32; R] = std::array::from_fn(|r| q.add(r * d));
        let row_bytes = d * std::mem::size_of::<T>();
        for &cell in c.idx.iter().take(PREFETCH_CELLS) {
            prefetch(kh.add(cell * b.k_cell).cast(), row_bytes);
        }
        for (i, (&cell, &add)) in c.idx.iter().zip(&c.add).enumerate() {
            // The cache is in DRAM (the weights streamed since it was last read): ask for the
            // key row `PREFETCH_CELLS` cells ahead, and for this cell's value row, which the
            // sums read after the softmax.
            if let Some(&ahead) = c.idx.get(i + PREFETCH_CELLS) {
                prefetch(kh.add(ahead * b.k_cell).cast(), row_bytes);
            }
            prefetch(vh.add(cell * b.v_cell).cast(), row_bytes);
            let s = row::<T, R>(xs, kh.add(cell * b.k_cell), d);
            for r in 0..R {
                p[r * n + i] = s[r] * scale + add;
            }
        }
        for r in 0..R {
            softmax_in_place(&mut p[r * n..(r + 1) * n]);
        }
        let mut c0 = 0;
        while c0 < d {
            match (d - c0).div_ceil(16) {
                1 => columns::<T, R, 1>(vh, b.v_cell, c, p, acc, d, c0),
                2 => columns::<T, R, 2>(vh, b.v_cell, c, p, acc, d, c0),
                3 => columns::<T, R, 3>(vh, b.v_cell, c, p, acc, d, c0),
                _ => columns::<T, R, 4>(vh, b.v_cell, c, p, acc, d, c0),
            }
            c0 += 64;
        }
    }

    /// Cells between a key row's prefetch and its use.
    const PREFETCH_CELLS: usize = 16;

    /// Asks for the cache lines of `bytes` bytes at `p` (into the L1), the last one too when
    /// `p` is not on a line's start.
    #[inline(always)]
    unsafe fn prefetch(p: *const i8, bytes: usize) {
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o));
            o += 64;
        }
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(bytes - 1));
    }

    /// Columns `c0..min(c0 + 16 * N, d)` of the `R` heads' weighted sums of the values, in
    /// cell order with one FMA per element (the bits of the AVX2 body), the last vector
    /// masked to the row's end.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn columns<T: Lanes16, const R: usize, const N: usize>(
        vh: *const T,
        v_cell: usize,
        c: &Cells,
        p: &[f32],
        acc: *mut f32,
        d: usize,
        c0: usize,
    ) {
        let n = c.idx.len();
        let last = (d - c0 - 16 * (N - 1)).min(16);
        let mut a = [[_mm512_setzero_ps(); N]; R];
        for (i, &cell) in c.idx.iter().enumerate() {
            let row = vh.add(cell * v_cell + c0);
            let vv: [__m512; N] = std::array::from_fn(|u| {
                if u + 1 < N || last == 16 {
                    T::load16(row.add(16 * u))
                } else {
                    T::load_tail(row.add(16 * u), last)
                }
            });
            for r in 0..R {
                let w = _mm512_set1_ps(p[r * n + i]);
                for u in 0..N {
                    a[r][u] = _mm512_fmadd_ps(w, vv[u], a[r][u]);
                }
            }
        }
        for r in 0..R {
            for u in 0..N {
                let dst = acc.add(r * d + c0 + 16 * u);
                if u + 1 < N || last == 16 {
                    _mm512_storeu_ps(dst, a[r][u]);
                } else {
                    _mm512_mask_storeu_ps(dst, ((1u32 << last) - 1) as __mmask16, a[r][u]);
                }
            }
        }
    }
}
