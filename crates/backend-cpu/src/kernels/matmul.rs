//! `MulMat` (numpy `a @ b` with GQA-style batch broadcast) and `MulMatId` (mixture of
//! experts), on top of the `gemm` crate.
//!
//! Strategy: both ops reduce to a list of 2-D products `out[m, n] = lhs[m, k] @ b[k, n]` that
//! share one shape (one per output batch; one per used expert). `gemm` takes row and column
//! strides, so aligned f32 operands, transposed views such as `x @ w.T` included, are read in
//! place. The left operand (activations) is made f32 once per call when it is not already.
//! A right operand in f16/bf16 (weights, KV cache) whose columns are contiguous rows (`x @
//! w.T`) is read in place: up to `gemv::GEMV_MAX_M` rows by `gemv`, more by the prefill tiles
//! (`dot512`'s with AVX-512, `dot256`'s with AVX2, FMA and F16C). Otherwise, or on a CPU
//! with none of these, it is handled by size:
//! - small `m` (decode, up to [`STREAM_MAX_M`] rows): each job converts one cache-sized block
//!   of `b`'s columns and multiplies it straight away, so a 2048x2048 f16 weight is streamed
//!   once with no large allocation;
//! - larger `m` (prefill): each job converts a panel of `b`'s columns, all of k, about
//!   [`PANEL_ELEMS`] elements (in `b`'s own memory order: a transposed source stays
//!   transposed), and runs one full-k gemm over it, so no whole weight is ever held in f32.
//!
//! Batches map to operand batches by `i / (big / small)` per axis (GQA: 32 query heads over 8
//! kv heads use kv head `q / 4`). Jobs (products or column blocks) run in parallel with a
//! single-threaded gemm each when they are many and small (attention, decode); one big
//! product runs gemm with rayon inside.
//!
//! Determinism: every output element is produced by one job, whose gemm calls (and, when
//! streaming, the in-order accumulation of its runs of k) depend only on the problem's shapes
//! and dtypes; gemm itself never splits the k reduction across threads. Results are therefore
//! bit-identical for any thread count (tests check this).
//!
//! A block-dtype (quantized) right operand goes to `quant::matmul`, one product per output
//! batch (per used expert for `MulMatId`), with the activations as contiguous f32 rows.
//!
//! `MulMatId` groups the `(token, slot)` pairs by expert, runs one product per used expert
//! over the gathered token rows, and adds `w * row` into the output in expert order, then
//! slot order: deterministic and independent of threading.

use std::collections::BTreeMap;

use gemm::Parallelism;
use lowsync_backend::{ExecNode, Result};
use parking_lot::Mutex;
use rayon::prelude::*;

use super::copy::{copy_strided, copy_strided_on};
use super::gemv;
use super::par::Threads;
use super::quant;
use super::rows::checked_indices;
use super::view::Strided;
use super::{float_dst, float_src, kernel_err};

/// Below this many multiply-adds a gemm runs single-threaded.
const GEMM_PAR_MIN_WORK: usize = 1 << 15;
/// Jobs with less work than this each run on one thread, jobs in parallel.
const GEMM_JOB_PAR_MAX_WORK: usize = 1 << 20;
/// Up to this many rows, a non-f32 right operand is converted block by block.
const STREAM_MAX_M: usize = 32;
/// Elements of the right operand converted at a time when streaming (128 KiB of f32).
const STREAM_BLOCK_ELEMS: usize = 1 << 15;
/// Column block of a streamed row-major right operand (`x @ w` with `w [k, n]`, `p @ v`).
const STREAM_ROW_MAJOR_COLS: usize = 256;

/// Above [`STREAM_MAX_M`] rows, a non-f32 right operand is converted a panel of whole columns
/// (all of k) at a time, about this many elements (4 MiB of f32), and each panel multiplied
/// at once: the conversion never holds a whole weight in f32 (an F16 model's 32000 x 768
/// output head was 98 MiB of it at every prefill), and a panel stays in cache for the gemm.
const PANEL_ELEMS: usize = 1 << 20;

/// The f32 panels of converted (f16/bf16) right operands, kept between products: a fresh
/// multi-MiB buffer per product was fresh pages per product, whose faults and zeroing
/// (`clear_page`) were ~10% of an F16 prefill step. Taken with `try_lock`, so a product
/// running at the same time converts into its own buffer.
static B_SCRATCH: Mutex<Vec<f32>> = Mutex::new(Vec::new());

/// One matrix for gemm: address of `[0, 0]`, row stride, column stride (elements).
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

/// A row-major f32 output matrix: address of `[0, 0]` and row stride (column stride 1).
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    rs: isize,
}

/// Products `out_i = lhs_i @ b` sharing one right operand `b` (any float `[k, n]` view): the
/// query heads that read one kv head, or the tokens routed to one expert. Sharing lets a
/// converted block of `b` serve every product that reads it.
struct Group {
    b: Strided,
    parts: Vec<(Mat, Out)>,
}

// SAFETY: the addresses point into memory that outlives the kernel; every product writes its
// own output block and only reads its operands.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

/// `dst[m, n] (+)= lhs[m, k] @ rhs[k, n]` for `(m, n, k)`: overwrites `dst`, or adds to it
/// when `accumulate`.
///
/// # Safety
/// `lhs` and `rhs` address valid f32 matrices of those shapes; `dst` is valid for reads and
/// writes of `m x n` and overlaps neither.
unsafe fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: Out,
    lhs: Mat,
    rhs: Mat,
    par: Parallelism,
    accumulate: bool,
) {
    gemm::gemm(
        m, n, k, dst.ptr, 1, dst.rs, accumulate, lhs.ptr, lhs.cs, lhs.rs, rhs.ptr, rhs.cs, rhs.rs,
        1.0, 1.0, false, false, false, par,
    );
}

/// Strides of a 2-D f32 view for gemm. Axes of length 1 are never stepped along, so their
/// (possibly arbitrary) stride is replaced by 1; other strides lie inside a buffer and fit.
fn mat(v: &Strided) -> Option<Mat> {
    let stride = |ax: usize| -> Option<isize> {
        if v.shape()[ax] <= 1 {
            Some(1)
        } else {
            isize::try_from(v.strides()[ax]).ok()
        }
    };
    Some(Mat {
        ptr: v.f32_base()?,
        rs: stride(0)?,
        cs: stride(1)?,
    })
}

/// `src` as f32 in `buf`, laid out in `src`'s own memory order (largest stride first), so the
/// copy is a linear sweep and a transposed source stays transposed.
fn convert_into(threads: Threads, src: &Strided, buf: &mut Vec<f32>) -> Option<Strided> {
    let rank = src.rank();
    let mut perm: Vec<usize> = (0..rank).collect();
    perm.sort_by(|&x, &y| src.strides()[y].cmp(&src.strides()[x]));
    let mut strides = vec![0; rank];
    let mut acc = 1usize;
    for &ax in perm.iter().rev() {
        strides[ax] = acc;
        acc *= src.shape()[ax].max(1);
    }
    buf.clear();
    buf.resize(src.numel(), 0.0);
    let view = Strided::over_f32_strided(buf, src.shape(), strides)?;
    copy_strided_on(threads, src, &view);
    Some(view)
}

/// An f32 view of `src` that gemm can read: `src` itself when it is aligned f32, else a
/// converted copy kept alive in `buf`.
fn as_f32(node: &ExecNode, src: &Strided, buf: &mut Vec<f32>) -> Result<Strided> {
    if src.f32_base().is_some() {
        return Ok(src.clone());
    }
    convert_into(Threads::Auto, src, buf)
        .ok_or_else(|| kernel_err(node, format!("cannot convert operand {:?}", src.shape())))
}

/// Runs every product of every group (all of shape `m x k @ k x n`, `k > 0`).
///
/// Jobs are column blocks of groups. With small `m`, a right operand whose k axis is
/// contiguous (`w.T`) is cut into cache-sized column blocks; a row-major one into blocks of at
/// most [`STREAM_ROW_MAJOR_COLS`] columns when it needs converting. A block that needs
/// converting is converted [`STREAM_BLOCK_ELEMS`] elements at a time (a run of k rows), and
/// each run is multiplied into every product of the group, accumulating in k order.
fn run_groups(node: &ExecNode, groups: &[Group], (m, n, k): (usize, usize, usize)) {
    let convert = groups.iter().any(|g| g.b.f32_base().is_none());
    let k_contiguous = k == 1 || groups.iter().all(|g| g.b.strides()[0] == 1);
    let cols = if m > STREAM_MAX_M {
        if convert {
            (PANEL_ELEMS / k).next_multiple_of(16).max(16).min(n)
        } else {
            n
        }
    } else if k_contiguous {
        (STREAM_BLOCK_ELEMS / k).next_multiple_of(16).max(16).min(n)
    } else if convert {
        n.min(STREAM_ROW_MAJOR_COLS)
    } else {
        n
    };
    let blocks = n.div_ceil(cols);
    let jobs = groups.len() * blocks;
    let per_group = groups.iter().map(|g| g.parts.len()).max().unwrap_or(0);
    // Work of one gemm call, and of one job (all products of a group over a block).
    let call_work = m.saturating_mul(cols).saturating_mul(k);
    let job_work = call_work.saturating_mul(per_group);
    // Streamed conversions make many small gemm calls: always spread jobs over threads.
    let streaming = convert && m <= STREAM_MAX_M;
    let job = |buf: &mut Vec<f32>, j: usize, threads: Threads, par: Parallelism| {
        let (g, c0) = (&groups[j / blocks], (j % blocks) * cols);
        let w = cols.min(n - c0);
        let Some(block) = g.b.slice_axis(1, c0, w) else {
            return;
        };
        let cols_of = |out: &Out| Out {
            ptr: out.ptr.wrapping_add(c0),
            rs: out.rs,
        };
        if let Some(rhs) = mat(&block) {
            for (lhs, out) in &g.parts {
                // SAFETY: `lhs` is a validated `m x k` f32 matrix, `rhs` an f32 `k x w` view
                // of the source, and the output columns `c0..c0 + w` of this product's own
                // block, which no other job touches and no operand overlaps.
                unsafe { gemm_f32((m, w, k), cols_of(out), *lhs, rhs, par, false) };
            }
            return;
        }
        if m > STREAM_MAX_M {
            // A panel: all of k converted at once, one full-k product per part.
            let rhs = convert_into(threads, &block, buf).as_ref().and_then(mat);
            let Some(rhs) = rhs else {
                debug_assert!(false, "{}: unusable operand {:?}", node.name, block.shape());
                return;
            };
            for (lhs, out) in &g.parts {
                // SAFETY: as above, with the block converted into `buf`.
                unsafe { gemm_f32((m, w, k), cols_of(out), *lhs, rhs, par, false) };
            }
            return;
        }
        let run_rows = (STREAM_BLOCK_ELEMS / w).max(1);
        for r0 in (0..k).step_by(run_rows) {
            let h = run_rows.min(k - r0);
            let rhs = block
                .slice_axis(0, r0, h)
                .and_then(|run| convert_into(threads, &run, buf))
                .as_ref()
                .and_then(mat);
            let Some(rhs) = rhs else {
                debug_assert!(false, "{}: unusable operand {:?}", node.name, block.shape());
                return;
            };
            for (lhs, out) in &g.parts {
                let lhs = Mat {
                    ptr: lhs.ptr.wrapping_offset(r0 as isize * lhs.cs),
                    ..*lhs
                };
                // SAFETY: as above, with `lhs` columns `r0..r0 + h` and the matching `h x w`
                // rows of `b` converted into `buf`; runs after the first add to the output.
                unsafe { gemm_f32((m, w, h), cols_of(out), lhs, rhs, par, r0 > 0) };
            }
        }
    };
    if jobs > 1
        && (streaming || call_work < GEMM_JOB_PAR_MAX_WORK)
        && jobs.saturating_mul(job_work) >= GEMM_PAR_MIN_WORK
    {
        (0..jobs).into_par_iter().for_each_init(Vec::new, |buf, j| {
            job(buf, j, Threads::Caller, Parallelism::None)
        });
    } else {
        let par = if !streaming && call_work >= GEMM_PAR_MIN_WORK {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
        let mut kept = B_SCRATCH.try_lock();
        let mut own = Vec::new();
        let buf = kept.as_deref_mut().unwrap_or(&mut own);
        (0..jobs).for_each(|j| job(buf, j, Threads::Auto, par));
    }
}

/// The size of batch axis `i` of `nb` (right-aligned) for an operand of the given shape.
fn batch_dim(shape: &[usize], nb: usize, i: usize) -> usize {
    let own = shape.len() - 2;
    if i + own >= nb {
        shape[i + own - nb]
    } else {
        1
    }
}

/// The batch index of `op` used by output batch `idx` (multi-index over `batch`): each batch
/// axis of size `d` is indexed by `idx / (batch / d)`.
fn batch_index(op: &Strided, batch: &[usize], idx: &[usize]) -> Vec<usize> {
    let own = op.rank() - 2;
    (0..own)
        .map(|j| {
            let i = j + batch.len() - own;
            idx[i] / (batch[i] / op.shape()[j].max(1)).max(1)
        })
        .collect()
}

/// The 2-D matrix of `op` at batch index `at`.
fn matrix_at(op: &Strided, at: &[usize]) -> Option<Strided> {
    at.iter().try_fold(op.clone(), |v, &i| v.index_axis(0, i))
}

/// Writes zeros over every element of `dst`.
fn fill_zero(dst: &Strided) {
    let (rows, len) = (dst.rows(), dst.last_len());
    let zeros = vec![0.0f32; len];
    for r in 0..rows {
        dst.write_row(r, 0..len, &zeros);
    }
}

/// `dst = a @ b`.
pub(super) fn mul_mat(node: &ExecNode, dst: &Strided, a: &Strided, b: &Strided) -> Result<()> {
    float_dst(node, dst)?;
    float_src(node, "a", a)?;
    if !b.dtype().is_quantized() {
        float_src(node, "b", b)?;
        #[cfg(target_arch = "x86_64")]
        if let Some(e) = super::dot512::env_error() {
            return Err(kernel_err(node, e));
        }
    }
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(kernel_err(
            node,
            format!(
                "needs at least 2-D operands, got {:?} @ {:?}",
                a.shape(),
                b.shape()
            ),
        ));
    }
    let (m, k) = (a.shape()[ra - 2], a.shape()[ra - 1]);
    let (k2, n) = (b.shape()[rb - 2], b.shape()[rb - 1]);
    let nb = ra.max(rb) - 2;
    let mut want = Vec::with_capacity(nb + 2);
    let mut batch_ok = true;
    for i in 0..nb {
        let (da, db) = (batch_dim(a.shape(), nb, i), batch_dim(b.shape(), nb, i));
        let (lo, hi) = (da.min(db), da.max(db));
        // numpy also broadcasts an empty batch against 1 (the result is empty); the graph
        // builder rejects that pair, but accepting it here costs nothing.
        batch_ok &= lo == hi || hi.checked_rem(lo) == Some(0) || (lo == 0 && hi == 1);
        want.push(if lo == 0 { 0 } else { hi });
    }
    want.extend([m, n]);
    if k != k2 || !batch_ok || dst.shape() != want {
        return Err(kernel_err(
            node,
            format!(
                "cannot multiply {:?} @ {:?} into {:?}",
                a.shape(),
                b.shape(),
                dst.shape()
            ),
        ));
    }
    if dst.numel() == 0 {
        return Ok(());
    }
    if k == 0 {
        fill_zero(dst);
        return Ok(());
    }
    if b.dtype().is_quantized() {
        return mul_mat_quant(node, dst, a, b, &want[..nb], (m, n, k));
    }
    if m <= gemv::GEMV_MAX_M && mul_mat_gemv(node, dst, a, b, &want[..nb], (m, n, k))? {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let sixteen_bit = matches!(
            b.dtype(),
            lowsync_graph::DType::F16 | lowsync_graph::DType::BF16
        );
        if sixteen_bit && mul_mat_prefill(node, dst, a, b, &want[..nb], (m, n, k))? {
            return Ok(());
        }
    }
    let mut a_buf = Vec::new();
    let a32 = as_f32(node, a, &mut a_buf)?;
    // A non-f32 `b` is converted inside the jobs: block by block for small m, a panel of
    // columns at a time for larger m (`run_groups`).
    let b_src = b.clone();

    let direct = dst.is_contiguous() && dst.f32_base().is_some();
    let mut owned = if direct {
        Vec::new()
    } else {
        vec![0.0f32; dst.numel()]
    };
    let out_base = dst
        .f32_base()
        .filter(|_| direct)
        .unwrap_or(owned.as_mut_ptr());
    let dst_rs = isize::try_from(n).map_err(|_| kernel_err(node, format!("{n} columns")))?;
    let batch = &want[..nb];
    let n_batches: usize = batch.iter().product();
    // Products reading the same (to be converted) matrix of `b` share a group; f32 ones get
    // a group each, for more parallel jobs.
    let share = b_src.f32_base().is_none();
    let mut groups: Vec<Group> = Vec::new();
    let mut group_of: BTreeMap<Vec<usize>, usize> = BTreeMap::new();
    for bi in 0..n_batches {
        let mut idx = vec![0; nb];
        let mut rem = bi;
        for i in (0..nb).rev() {
            idx[i] = rem % batch[i];
            rem /= batch[i];
        }
        let bidx = batch_index(&b_src, batch, &idx);
        let am = matrix_at(&a32, &batch_index(&a32, batch, &idx)).and_then(|v| mat(&v));
        let bm = matrix_at(&b_src, &bidx);
        let (Some(lhs), Some(b)) = (am, bm) else {
            return Err(kernel_err(node, format!("batch {idx:?} out of range")));
        };
        let out = Out {
            ptr: out_base.wrapping_add(bi * m * n),
            rs: dst_rs,
        };
        let slot = share.then(|| group_of.get(&bidx).copied()).flatten();
        match slot {
            Some(g) => groups[g].parts.push((lhs, out)),
            None => {
                if share {
                    group_of.insert(bidx, groups.len());
                }
                groups.push(Group {
                    b,
                    parts: vec![(lhs, out)],
                });
            }
        }
    }
    run_groups(node, &groups, (m, n, k));
    if !direct {
        if let Some(v) = Strided::over_f32(&mut owned, dst.shape()) {
            copy_strided(&v, dst);
        }
    }
    Ok(())
}

/// The multi-index of output batch `bi` over `batch`.
fn unravel_batch(batch: &[usize], mut bi: usize) -> Vec<usize> {
    let mut idx = vec![0; batch.len()];
    for i in (0..batch.len()).rev() {
        idx[i] = bi % batch[i];
        bi /= batch[i];
    }
    idx
}

/// Each batch's matrix of `b` and of `a`, or `None` where some matrix of `b` is not one that
/// `gemv` reads (the callers then take another path).
fn gemv_operands(
    node: &ExecNode,
    a: &Strided,
    b: &Strided,
    batch: &[usize],
) -> Result<Option<(Vec<Strided>, Vec<Strided>)>> {
    let n_batches: usize = batch.iter().product();
    let mut ws = Vec::with_capacity(n_batches);
    let mut ams = Vec::with_capacity(n_batches);
    for bi in 0..n_batches {
        let idx = unravel_batch(batch, bi);
        let Some(w) = matrix_at(b, &batch_index(b, batch, &idx)).filter(gemv::reads) else {
            return Ok(None);
        };
        let am = matrix_at(a, &batch_index(a, batch, &idx))
            .ok_or_else(|| kernel_err(node, format!("batch {idx:?} out of range")))?;
        ws.push(w);
        ams.push(am);
    }
    Ok(Some((ws, ams)))
}

/// `dst = a @ b` on the decode path of `gemv` when every matrix of `b` is one it reads;
/// `Ok(false)` (nothing written) otherwise.
fn mul_mat_gemv(
    node: &ExecNode,
    dst: &Strided,
    a: &Strided,
    b: &Strided,
    batch: &[usize],
    (m, n, k): (usize, usize, usize),
) -> Result<bool> {
    let Some((ws, ams)) = gemv_operands(node, a, b, batch)? else {
        return Ok(false);
    };
    let n_batches = ws.len();
    let xs: Vec<Vec<f32>> = ams.iter().map(quant::rows_f32).collect();
    let products: Vec<gemv::Product<'_>> = xs
        .iter()
        .zip(ws)
        .map(|(x, w)| gemv::Product { x, w })
        .collect();
    let mut out_t = vec![0.0f32; n_batches * n * m];
    gemv::run(&products, (m, n, k), &mut out_t);
    let mut row = vec![0.0f32; if m == 1 { 0 } else { n }];
    for (bi, per) in out_t.chunks_exact(n * m).enumerate() {
        if m == 1 {
            dst.write_row(bi, 0..n, per);
            continue;
        }
        for i in 0..m {
            row.iter_mut()
                .zip(per.chunks_exact(m))
                .for_each(|(r, res)| *r = res[i]);
            dst.write_row(bi * m + i, 0..n, &row);
        }
    }
    Ok(true)
}

/// `dst = a @ b` with `dot512`'s prefill tiles (or `dot256`'s where AVX-512 is off or
/// absent), reading a 16-bit `b` in place (no f32 copy, no packing), when either body set
/// runs and every matrix of `b` is one `gemv` reads; `Ok(false)` (nothing written) otherwise.
#[cfg(target_arch = "x86_64")]
fn mul_mat_prefill(
    node: &ExecNode,
    dst: &Strided,
    a: &Strided,
    b: &Strided,
    batch: &[usize],
    (m, n, k): (usize, usize, usize),
) -> Result<bool> {
    use super::dot512;
    if !dot512::prefill_available() {
        return Ok(false);
    }
    let Some((ws, ams)) = gemv_operands(node, a, b, batch)? else {
        return Ok(false);
    };
    // Packed f32 activations are read in place; others are made contiguous f32 once.
    let xs: Vec<std::borrow::Cow<'_, [f32]>> = ams
        .iter()
        .map(|am| {
            am.f32_slice().map_or_else(
                || std::borrow::Cow::Owned(quant::rows_f32(am)),
                std::borrow::Cow::Borrowed,
            )
        })
        .collect();
    let direct = dst.is_contiguous() && dst.f32_base().is_some();
    let mut owned = if direct {
        Vec::new()
    } else {
        vec![0.0f32; dst.numel()]
    };
    let out_base = dst
        .f32_base()
        .filter(|_| direct)
        .unwrap_or(owned.as_mut_ptr());
    let products: Vec<dot512::Prefill<'_>> = xs
        .iter()
        .zip(ws)
        .enumerate()
        .map(|(bi, (x, w))| dot512::Prefill {
            x: x.as_ref(),
            w,
            out: out_base.wrapping_add(bi * m * n),
            out_rs: n,
        })
        .collect();
    // SAFETY: product `bi` writes the `m x n` block `bi` of the contiguous output (`dst`'s
    // own memory or `owned`), which no operand overlaps (the destination is never a source
    // here: the graph gives a product its own result tensor).
    if !unsafe { dot512::prefill(&products, (m, n, k)) } {
        return Ok(false);
    }
    if !direct {
        if let Some(v) = Strided::over_f32(&mut owned, dst.shape()) {
            copy_strided(&v, dst);
        }
    }
    Ok(true)
}

/// `dst = a @ b` for a block-dtype `b`: one `quant::matmul` per output batch.
fn mul_mat_quant(
    node: &ExecNode,
    dst: &Strided,
    a: &Strided,
    b: &Strided,
    batch: &[usize],
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    let nb = batch.len();
    let n_batches: usize = batch.iter().product();
    let mut out = vec![0.0f32; m * n];
    for bi in 0..n_batches {
        let mut idx = vec![0; nb];
        let mut rem = bi;
        for i in (0..nb).rev() {
            idx[i] = rem % batch[i];
            rem /= batch[i];
        }
        let am = matrix_at(a, &batch_index(a, batch, &idx));
        let bm = matrix_at(b, &batch_index(b, batch, &idx));
        let (Some(am), Some(bm)) = (am, bm) else {
            return Err(kernel_err(node, format!("batch {idx:?} out of range")));
        };
        let x = quant::rows_f32(&am);
        quant::matmul(node, &x, (m, n, k), &bm, &mut out)?;
        for (r, row) in out.chunks_exact(n).enumerate() {
            dst.write_row(bi * m + r, 0..n, row);
        }
    }
    Ok(())
}

/// `dst[t] = sum_j w[t, j] * (x[t] @ experts[ids[t, j]])`.
pub(super) fn mul_mat_id(
    node: &ExecNode,
    dst: &Strided,
    experts: &Strided,
    x: &Strided,
    ids: &Strided,
    w: &Strided,
) -> Result<()> {
    float_dst(node, dst)?;
    if !experts.dtype().is_quantized() {
        float_src(node, "experts", experts)?;
    }
    float_src(node, "x", x)?;
    float_src(node, "weights", w)?;
    let (se, sx, si, sw) = (experts.shape(), x.shape(), ids.shape(), w.shape());
    let ok = se.len() == 3
        && sx.len() == 2
        && sx[1] == se[1]
        && si.len() == 2
        && si[0] == sx[0]
        && sw == si
        && dst.shape() == [sx[0], se[2]];
    if !ok {
        return Err(kernel_err(
            node,
            format!(
                "expects experts [E, k, n], x [T, k], ids [T, K], weights [T, K], result [T, n]; \
                 got {se:?}, {sx:?}, {si:?}, {sw:?}, {:?}",
                dst.shape()
            ),
        ));
    }
    let (n_exp, k, n) = (se[0], se[1], se[2]);
    let (t_len, slots) = (si[0], si[1]);
    let expert_of = checked_indices(node, "ids", ids, n_exp, "experts")?;
    if dst.numel() == 0 {
        return Ok(());
    }
    let mut out = vec![0.0f32; t_len * n];
    if k > 0 && slots > 0 {
        let mut weights = vec![0.0f32; t_len * slots];
        for (t, row) in weights.chunks_exact_mut(slots).enumerate() {
            w.read_row(t, 0..slots, row);
        }
        let mut groups: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n_exp];
        for (i, &e) in expert_of.iter().enumerate() {
            groups[e].push((i / slots, i % slots));
        }
        let (k_is, n_is) = (
            isize::try_from(k).map_err(|_| kernel_err(node, format!("k = {k}")))?,
            isize::try_from(n).map_err(|_| kernel_err(node, format!("n = {n}")))?,
        );
        let mut b_buf = Vec::new();
        for (e, group) in groups.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            let c = group.len();
            let mut xe = vec![0.0f32; c * k];
            for (row, &(t, _)) in xe.chunks_exact_mut(k).zip(group) {
                x.read_row(t, 0..k, row);
            }
            let we = experts
                .index_axis(0, e)
                .ok_or_else(|| kernel_err(node, format!("expert {e} out of range")))?;
            let mut ye = vec![0.0f32; c * n];
            if we.dtype().is_quantized() {
                quant::matmul(node, &xe, (c, n, k), &we, &mut ye)?;
            } else {
                let b = if c <= STREAM_MAX_M {
                    we
                } else {
                    as_f32(node, &we, &mut b_buf)?
                };
                let expert = Group {
                    b,
                    parts: vec![(
                        Mat {
                            ptr: xe.as_ptr(),
                            rs: k_is,
                            cs: 1,
                        },
                        Out {
                            ptr: ye.as_mut_ptr(),
                            rs: n_is,
                        },
                    )],
                };
                run_groups(node, std::slice::from_ref(&expert), (c, n, k));
            }
            for (y, &(t, j)) in ye.chunks_exact(n).zip(group) {
                let wt = weights[t * slots + j];
                out[t * n..(t + 1) * n]
                    .iter_mut()
                    .zip(y)
                    .for_each(|(o, y)| *o += wt * y);
            }
        }
    }
    if let Some(v) = Strided::over_f32(&mut out, dst.shape()) {
        copy_strided(&v, dst);
    }
    Ok(())
}
