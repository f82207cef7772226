//! `MulMat` (numpy `a @ b` with GQA-style batch broadcast) and `MulMatId` (mixture of
//! experts), on top of the `gemm` crate.
//!
//! Strategy: `gemm` takes row and column strides, so strided f32 operands (transposed views
//! such as `x @ w.T`) are passed as they are. f16/bf16 operands (and unaligned f32 ones) are
//! converted once per call into an f32 copy that keeps the source's memory order, so the
//! conversion is one linear sweep and gemm still sees the transposed strides. Batches map to
//! operand batches by `i / (big / small)` per axis (GQA: 32 query heads over 8 kv heads use
//! kv head `q / 4`). Many small batches (attention) run in parallel over batches with a
//! single-threaded gemm each; big problems run gemm with rayon inside.
//!
//! Determinism: gemm never splits the k reduction across threads (its k blocking depends only
//! on the problem size), so results are bit-identical for any thread count; tests check this.
//!
//! `MulMatId` groups the `(token, slot)` pairs by expert, runs one gemm per used expert over
//! the gathered token rows, and adds `w * row` into the output in expert order, then slot
//! order: deterministic and independent of threading.

use gemm::Parallelism;
use lowsync_backend::{ExecNode, Result};
use rayon::prelude::*;

use super::copy::copy_strided;
use super::rows::checked_indices;
use super::view::Strided;
use super::{float_dst, float_src, kernel_err};

/// Below this many multiply-adds a gemm runs single-threaded.
const GEMM_PAR_MIN_WORK: usize = 1 << 15;
/// Batches with less work than this each run on one thread, batches in parallel.
const GEMM_BATCH_PAR_MAX_WORK: usize = 1 << 20;

/// A float operand as f32 that gemm can read.
struct F32Operand {
    view: Strided,
    /// Backing store of `view` when the source had to be converted.
    _owned: Vec<f32>,
}

impl F32Operand {
    /// The source itself when it is aligned f32, else an f32 copy in the source's memory order.
    fn new(src: &Strided) -> Option<Self> {
        if src.f32_base().is_some() {
            return Some(F32Operand { view: src.clone(), _owned: Vec::new() });
        }
        let rank = src.rank();
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.sort_by(|&x, &y| src.strides()[y].cmp(&src.strides()[x]));
        let mut strides = vec![0; rank];
        let mut acc = 1usize;
        for &ax in perm.iter().rev() {
            strides[ax] = acc;
            acc *= src.shape()[ax].max(1);
        }
        let mut owned = vec![0.0f32; src.numel()];
        let view = Strided::over_f32_strided(&mut owned, src.shape(), strides)?;
        copy_strided(src, &view);
        Some(F32Operand { view, _owned: owned })
    }

    fn base(&self) -> *const f32 {
        self.view.f32_base().unwrap_or(std::ptr::null_mut())
    }
}

/// A raw f32 address that may cross threads (each thread writes a disjoint block).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only for disjoint writes into memory that outlives the parallel loop.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// One matrix for gemm: address of `[0, 0]`, row stride, column stride (elements).
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

/// `dst[m, n] (row stride dst_rs, column stride 1) = lhs[m, k] @ rhs[k, n]`.
///
/// # Safety
/// `lhs` and `rhs` address valid f32 matrices of those shapes; `dst` is valid for writes of
/// `m x n` and overlaps neither. `k > 0`.
unsafe fn gemm_f32(m: usize, n: usize, k: usize, dst: *mut f32, dst_rs: isize, lhs: Mat, rhs: Mat, par: Parallelism) {
    gemm::gemm(
        m, n, k, dst, 1, dst_rs, false, lhs.ptr, lhs.cs, lhs.rs, rhs.ptr, rhs.cs, rhs.rs, 0.0, 1.0, false, false, false,
        par,
    );
}

fn parallelism(work: usize) -> Parallelism {
    if work >= GEMM_PAR_MIN_WORK {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

fn to_isize(node: &ExecNode, s: usize) -> Result<isize> {
    isize::try_from(s).map_err(|_| kernel_err(node, format!("stride {s} is too large")))
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

/// Element offset of the operand's matrix used by output batch `idx` (multi-index).
fn batch_offset(op: &Strided, batch: &[usize], idx: &[usize]) -> usize {
    let nb = batch.len();
    let own = op.rank() - 2;
    (0..own)
        .map(|j| {
            let i = j + nb - own;
            let d = op.shape()[j];
            (idx[i] / (batch[i] / d.max(1)).max(1)) * op.strides()[j]
        })
        .sum()
}

/// Writes zeros over every element of `dst`.
fn fill_zero(dst: &Strided) {
    let (rows, len) = (dst.rows(), dst.last_len());
    let zeros = vec![0.0f32; len];
    for r in 0..rows {
        dst.write_row(r, 0..len, &zeros);
    }
}

/// An f32 operand, or a kernel error when it cannot be prepared.
fn operand(node: &ExecNode, v: &Strided) -> Result<F32Operand> {
    F32Operand::new(v).ok_or_else(|| kernel_err(node, format!("cannot prepare operand {:?}", v.shape())))
}

/// Row and column strides of the last two axes of an f32 operand.
fn mat_strides(node: &ExecNode, v: &Strided) -> Result<(isize, isize)> {
    let r = v.rank();
    Ok((to_isize(node, v.strides()[r - 2])?, to_isize(node, v.strides()[r - 1])?))
}

/// `dst = a @ b`.
pub(super) fn mul_mat(node: &ExecNode, dst: &Strided, a: &Strided, b: &Strided) -> Result<()> {
    float_dst(node, dst)?;
    float_src(node, "a", a)?;
    float_src(node, "b", b)?;
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(kernel_err(node, format!("needs at least 2-D operands, got {:?} @ {:?}", a.shape(), b.shape())));
    }
    let (m, k) = (a.shape()[ra - 2], a.shape()[ra - 1]);
    let (k2, n) = (b.shape()[rb - 2], b.shape()[rb - 1]);
    let nb = ra.max(rb) - 2;
    let mut want = Vec::with_capacity(nb + 2);
    let mut batch_ok = true;
    for i in 0..nb {
        let (da, db) = (batch_dim(a.shape(), nb, i), batch_dim(b.shape(), nb, i));
        let (lo, hi) = (da.min(db), da.max(db));
        batch_ok &= lo == hi || (lo > 0 && hi % lo == 0);
        want.push(hi);
    }
    want.extend([m, n]);
    if k != k2 || !batch_ok || dst.shape() != want {
        return Err(kernel_err(
            node,
            format!("cannot multiply {:?} @ {:?} into {:?}", a.shape(), b.shape(), dst.shape()),
        ));
    }
    if dst.numel() == 0 {
        return Ok(());
    }
    if k == 0 {
        fill_zero(dst);
        return Ok(());
    }
    let (a32, b32) = (operand(node, a)?, operand(node, b)?);
    let (a_rs, a_cs) = mat_strides(node, &a32.view)?;
    let (b_rs, b_cs) = mat_strides(node, &b32.view)?;
    let batch = &want[..nb];
    let n_batches: usize = batch.iter().product();
    let offsets: Vec<(usize, usize)> = (0..n_batches)
        .map(|bi| {
            let mut idx = vec![0; nb];
            let mut rem = bi;
            for i in (0..nb).rev() {
                idx[i] = rem % batch[i];
                rem /= batch[i];
            }
            (batch_offset(&a32.view, batch, &idx), batch_offset(&b32.view, batch, &idx))
        })
        .collect();

    let direct = dst.is_contiguous() && dst.f32_base().is_some();
    let mut owned = if direct { Vec::new() } else { vec![0.0f32; dst.numel()] };
    let out = SendPtr(dst.f32_base().filter(|_| direct).unwrap_or(owned.as_mut_ptr()));
    let dst_rs = to_isize(node, n)?;
    let run = |bi: usize, par: Parallelism| {
        let (oa, ob) = offsets[bi];
        let lhs = Mat { ptr: a32.base().wrapping_add(oa), rs: a_rs, cs: a_cs };
        let rhs = Mat { ptr: b32.base().wrapping_add(ob), rs: b_rs, cs: b_cs };
        let o = out;
        // SAFETY: the offsets address in-shape matrices of the validated operands (whose
        // views are f32 and aligned); batch `bi` writes its own `m x n` block of the output,
        // which is a fresh buffer or the destination (never a source: see `run_node`).
        unsafe { gemm_f32(m, n, k, o.0.wrapping_add(bi * m * n), dst_rs, lhs, rhs, par) };
    };
    let work = m.saturating_mul(n).saturating_mul(k);
    if n_batches > 1 && work < GEMM_BATCH_PAR_MAX_WORK && n_batches.saturating_mul(work) >= GEMM_PAR_MIN_WORK {
        (0..n_batches).into_par_iter().for_each(|bi| run(bi, Parallelism::None));
    } else {
        (0..n_batches).for_each(|bi| run(bi, parallelism(work)));
    }
    if !direct {
        if let Some(v) = Strided::over_f32(&mut owned, dst.shape()) {
            copy_strided(&v, dst);
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
    float_src(node, "experts", experts)?;
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
                "expects experts [E, k, n], x [T, k], ids [T, K], weights [T, K], result [T, n]; got {se:?}, {sx:?}, {si:?}, {sw:?}, {:?}",
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
        for (e, group) in groups.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            let c = group.len();
            let mut xe = vec![0.0f32; c * k];
            for (row, &(t, _)) in xe.chunks_exact_mut(k).zip(group) {
                x.read_row(t, 0..k, row);
            }
            let we = experts.index_axis(0, e).ok_or_else(|| kernel_err(node, format!("expert {e} out of range")))?;
            let we32 = operand(node, &we)?;
            let (w_rs, w_cs) = mat_strides(node, &we32.view)?;
            let mut ye = vec![0.0f32; c * n];
            let lhs = Mat { ptr: xe.as_ptr(), rs: to_isize(node, k)?, cs: 1 };
            let rhs = Mat { ptr: we32.base(), rs: w_rs, cs: w_cs };
            let work = c.saturating_mul(n).saturating_mul(k);
            // SAFETY: `xe` is `c x k`, `we32` a validated f32 `k x n` view, `ye` a fresh
            // `c x n` buffer.
            unsafe { gemm_f32(c, n, k, ye.as_mut_ptr(), to_isize(node, n)?, lhs, rhs, parallelism(work)) };
            for (y, &(t, j)) in ye.chunks_exact(n).zip(group) {
                let wt = weights[t * slots + j];
                out[t * n..(t + 1) * n].iter_mut().zip(y).for_each(|(o, y)| *o += wt * y);
            }
        }
    }
    if let Some(v) = Strided::over_f32(&mut out, dst.shape()) {
        copy_strided(&v, dst);
    }
    Ok(())
}
