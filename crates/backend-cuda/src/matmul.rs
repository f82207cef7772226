//! `MulMat` through cuBLAS (`cublasGemmStridedBatchedEx`, f32 accumulation).
//!
//! Why: matmul dominates a decoder's time; cuBLAS is the well-kept kernel for it. The op's
//! semantics (numpy `a @ b` with GQA batch broadcast, any strides, f32/f16/bf16 operands)
//! are wider than one cuBLAS call, so this module maps the general case onto as few calls as the
//! layout allows and falls back to copies where it must.
//!
//! Strategy: row-major `out[m, n] = a[m, k] @ b[k, n]` is column-major `out^T = b^T a^T`, so b
//! is cuBLAS's A and a its B. An operand whose matrices have a unit stride on either axis is read
//! in place (transposed views such as `x @ w.T` included); otherwise, or when the two operands
//! have different dtypes (compute in f32), it is copied to scratch first. Equal f16/bf16 operands
//! run with f16/bf16 inputs, f32 output and f32 compute. The output is written in place when it
//! is f32 with unit column stride, else to f32 scratch and copied (converting) into it. Output
//! batches are grouped into runs whose operand offsets advance by constant strides (stride 0 for
//! a broadcast operand), one strided-batched call per run — one call in the common cases, one
//! per kv head under GQA.
//!
//! Invariant: cuBLAS only ever sees the stream through [`TicketStream::lend`], so each call
//! takes a ticket and is counted as a kernel launch; math mode is the default (no TF32), so f32
//! results match the CPU oracle within the f32 NMSE bound.

use std::ffi::c_void;

use cudarc::cublas::{result as cbres, sys as cb};
use lowsync_backend::{ExecNode, Result};
use lowsync_graph::DType;

use crate::driver::CuDriver;
use crate::ops::{float_dst, float_src, kernel_err, packed, Dev, Exec};
use crate::tickets::{Counted, TicketStream};

/// A cuBLAS handle bound to the backend's stream. Used only inside a lend of that stream.
pub(crate) struct Blas(cb::cublasHandle_t);

// SAFETY: the handle is used under the backend's `blas` lock and the stream's ticket lock.
unsafe impl Send for Blas {}

impl Blas {
    /// Creates the handle (probing libcublas first) and binds it to the stream.
    pub(crate) fn new(stream: &TicketStream<CuDriver>) -> std::result::Result<Self, String> {
        crate::probe::cublas()?;
        crate::probe::guarded("creating a cuBLAS handle", || {
            let h = cbres::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
            let blas = Blas(h);
            stream
                .lend(Counted::NotASubmit, |s| {
                    // SAFETY: a live handle and the backend's live stream.
                    unsafe { cbres::set_stream(blas.0, s.as_raw() as cb::cudaStream_t) }
                })
                .map_err(|e| format!("cublasSetStream: {e:?}"))?;
            Ok(blas)
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once (the backend drained its stream).
        let _ = unsafe { cbres::destroy_handle(self.0) };
    }
}

/// How an operand's 2-D matrices are stored for cuBLAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    RowMajor,
    ColMajor,
}

/// `(order, leading dimension)` of an `r x c` matrix with strides `(rs, cs)`, if cuBLAS can
/// read it in place.
fn blas_layout(r: usize, c: usize, rs: usize, cs: usize) -> Option<(Order, usize)> {
    let fits = |ld: usize| i32::try_from(ld).is_ok();
    if c <= 1 || cs == 1 {
        let ld = if r <= 1 { c.max(1) } else { rs };
        if ld >= c.max(1) && fits(ld) {
            return Some((Order::RowMajor, ld));
        }
    }
    if r <= 1 || rs == 1 {
        let ld = if c <= 1 { r.max(1) } else { cs };
        if ld >= r.max(1) && fits(ld) {
            return Some((Order::ColMajor, ld));
        }
    }
    None
}

fn mat_layout(t: &Dev) -> Option<(Order, usize)> {
    let r = t.rank();
    blas_layout(
        t.shape[r - 2],
        t.shape[r - 1],
        t.strides[r - 2],
        t.strides[r - 1],
    )
}

/// What a matmul needs before it can be queued.
pub(crate) struct Plan {
    m: usize,
    n: usize,
    k: usize,
    /// Output batch shape.
    batch: Vec<usize>,
    /// Compute dtype of the operands (both converted to it when they differ).
    compute: DType,
    convert_a: bool,
    convert_b: bool,
    out_scratch: bool,
}

impl Plan {
    /// Scratch bytes: converted a, converted b, f32 output (0 where not needed).
    pub(crate) fn scratch_sizes(&self) -> Vec<usize> {
        let nb: usize = self.batch.iter().product();
        let sz = self.compute.size_bytes();
        vec![
            if self.convert_a {
                nb.max(1) * self.m * self.k * sz
            } else {
                0
            },
            if self.convert_b {
                nb.max(1) * self.k * self.n * sz
            } else {
                0
            },
            if self.out_scratch {
                nb.max(1) * self.m * self.n * 4
            } else {
                0
            },
        ]
    }
}

fn batch_dim(shape: &[usize], nb: usize, i: usize) -> usize {
    let own = shape.len() - 2;
    if i + own >= nb {
        shape[i + own - nb]
    } else {
        1
    }
}

/// Validates `dst = a @ b` (the CPU oracle's rules) and decides conversions.
pub(crate) fn plan(node: &ExecNode, dst: &Dev, a: &Dev, b: &Dev) -> Result<Plan> {
    float_dst(node, dst)?;
    float_src(node, "a", a)?;
    float_src(node, "b", b)?;
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(kernel_err(
            node,
            format!(
                "needs at least 2-D operands, got {:?} @ {:?}",
                a.shape, b.shape
            ),
        ));
    }
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (k2, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    let nb = ra.max(rb) - 2;
    let mut want = Vec::with_capacity(nb + 2);
    let mut batch_ok = true;
    for i in 0..nb {
        let (da, db) = (batch_dim(&a.shape, nb, i), batch_dim(&b.shape, nb, i));
        let (lo, hi) = (da.min(db), da.max(db));
        batch_ok &= lo == hi || hi.checked_rem(lo) == Some(0) || (lo == 0 && hi == 1);
        want.push(if lo == 0 { 0 } else { hi });
    }
    want.extend([m, n]);
    if k != k2 || !batch_ok || dst.shape != want {
        return Err(kernel_err(
            node,
            format!(
                "cannot multiply {:?} @ {:?} into {:?}",
                a.shape, b.shape, dst.shape
            ),
        ));
    }
    let compute = if a.dtype == b.dtype {
        a.dtype
    } else {
        DType::F32
    };
    let out_ok = dst.dtype == DType::F32 && matches!(mat_layout(dst), Some((Order::RowMajor, _)));
    Ok(Plan {
        m,
        n,
        k,
        batch: want[..nb].to_vec(),
        compute,
        convert_a: a.dtype != compute || mat_layout(a).is_none(),
        convert_b: b.dtype != compute || mat_layout(b).is_none(),
        out_scratch: !out_ok,
    })
}

/// Element offset of operand `op`'s matrix for output batch index `idx` (GQA: axis of size
/// `d` is indexed by `idx / (batch / d)`).
fn batch_offset(op: &Dev, batch: &[usize], idx: &[usize]) -> usize {
    let own = op.rank() - 2;
    (0..own)
        .map(|j| {
            let i = j + batch.len() - own;
            let d = op.shape[j].max(1);
            let at = idx[i] / (batch[i] / d).max(1);
            at * op.strides[j]
        })
        .sum()
}

/// Consecutive output batches whose three offsets advance by constant strides.
#[derive(Debug, PartialEq, Eq)]
struct Run {
    start: [usize; 3],
    stride: [i64; 3],
    count: usize,
}

fn runs(offsets: &[[usize; 3]]) -> Vec<Run> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < offsets.len() {
        let start = offsets[i];
        let mut count = 1;
        let mut stride = [0i64; 3];
        if i + 1 < offsets.len() {
            for t in 0..3 {
                stride[t] = offsets[i + 1][t] as i64 - start[t] as i64;
            }
            while i + count < offsets.len()
                && (0..3).all(|t| {
                    offsets[i + count][t] as i64 - offsets[i + count - 1][t] as i64 == stride[t]
                })
                && count < i32::MAX as usize
            {
                count += 1;
            }
        }
        if count == 1 {
            stride = [0; 3];
        }
        out.push(Run {
            start,
            stride,
            count,
        });
        i += count;
    }
    out
}

fn cuda_type(d: DType) -> cb::cudaDataType {
    match d {
        DType::F16 => cb::cudaDataType::CUDA_R_16F,
        DType::BF16 => cb::cudaDataType::CUDA_R_16BF,
        _ => cb::cudaDataType::CUDA_R_32F,
    }
}

/// Queues `dst = a @ b` under `plan`, using `regions` (from [`Plan::scratch_sizes`]).
pub(crate) fn run(
    ex: &Exec<'_>,
    node: &ExecNode,
    plan: &Plan,
    dst: &Dev,
    a: &Dev,
    b: &Dev,
    regions: &[u64],
) -> Result<()> {
    if dst.numel() == 0 {
        return Ok(());
    }
    if plan.k == 0 {
        return ex.fill(node, dst, 0.0);
    }
    let a = if plan.convert_a {
        let c = packed(regions[0], plan.compute, &a.shape);
        ex.copy(node, a, &c)?;
        c
    } else {
        a.clone()
    };
    let b = if plan.convert_b {
        let c = packed(regions[1], plan.compute, &b.shape);
        ex.copy(node, b, &c)?;
        c
    } else {
        b.clone()
    };
    let out = if plan.out_scratch {
        packed(regions[2], DType::F32, &dst.shape)
    } else {
        dst.clone()
    };
    // Leading dimensions of the lowsync operands (a is cuBLAS's B, b is cuBLAS's A).
    let (Some((a_ord, ld_a)), Some((b_ord, ld_b)), Some((_, ldc))) =
        (mat_layout(&a), mat_layout(&b), mat_layout(&out))
    else {
        return Err(kernel_err(node, "operand layout not usable by cuBLAS"));
    };
    let n_batches: usize = plan.batch.iter().product();
    let mut offsets = Vec::with_capacity(n_batches);
    let mut idx = vec![0usize; plan.batch.len()];
    for bi in 0..n_batches {
        let mut rem = bi;
        for i in (0..plan.batch.len()).rev() {
            idx[i] = rem % plan.batch[i];
            rem /= plan.batch[i];
        }
        offsets.push([
            batch_offset(&a, &plan.batch, &idx),
            batch_offset(&b, &plan.batch, &idx),
            batch_offset(&out, &plan.batch, &idx),
        ]);
    }
    let op = |o: Order| match o {
        Order::RowMajor => cb::cublasOperation_t::CUBLAS_OP_N,
        Order::ColMajor => cb::cublasOperation_t::CUBLAS_OP_T,
    };
    let (ta, tb) = (op(b_ord), op(a_ord));
    let esz = plan.compute.size_bytes() as u64;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let inner = ex.inner;
    let mut blas = inner.blas.lock();
    if blas.is_none() {
        *blas = Some(Blas::new(&inner.stream).map_err(|m| kernel_err(node, m))?);
    }
    let Some(h) = blas.as_ref().map(|b| b.0) else {
        return Err(kernel_err(node, "no cuBLAS handle"));
    };
    for r in runs(&offsets) {
        let to_i32 = |v: usize| {
            i32::try_from(v)
                .map_err(|_| kernel_err(node, format!("dimension {v} exceeds cuBLAS's int range")))
        };
        let (m_, n_, k_) = (to_i32(plan.n)?, to_i32(plan.m)?, to_i32(plan.k)?);
        let count = to_i32(r.count)?;
        let a_ptr = b.ptr + r.start[1] as u64 * esz;
        let b_ptr = a.ptr + r.start[0] as u64 * esz;
        let c_ptr = out.ptr + r.start[2] as u64 * 4;
        let status = inner.stream.lend(Counted::Kernel, |_s| {
            // SAFETY: every matrix of the run lies inside its checked tensor (offsets come from
            // in-range batch indices), leading dimensions satisfy cuBLAS's bounds
            // (`blas_layout`), and the handle is bound to this stream, lent for this call.
            unsafe {
                cbres::gemm_strided_batched_ex(
                    h,
                    ta,
                    tb,
                    m_,
                    n_,
                    k_,
                    (&alpha as *const f32).cast::<c_void>(),
                    a_ptr as *const c_void,
                    cuda_type(plan.compute),
                    ld_b as i32,
                    r.stride[1],
                    b_ptr as *const c_void,
                    cuda_type(plan.compute),
                    ld_a as i32,
                    r.stride[0],
                    (&beta as *const f32).cast::<c_void>(),
                    c_ptr as *mut c_void,
                    cb::cudaDataType::CUDA_R_32F,
                    ldc as i32,
                    r.stride[2],
                    count,
                    cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        });
        status
            .map_err(|e| kernel_err(node, format!("cublasGemmStridedBatchedEx failed: {e:?}")))?;
    }
    drop(blas);
    if plan.out_scratch {
        ex.copy(node, &out, dst)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_major_col_major_and_odd_layouts() {
        assert_eq!(blas_layout(4, 3, 3, 1), Some((Order::RowMajor, 3)));
        assert_eq!(blas_layout(4, 3, 1, 4), Some((Order::ColMajor, 4)));
        assert_eq!(blas_layout(1, 3, 999, 1), Some((Order::RowMajor, 3)));
        assert_eq!(blas_layout(4, 3, 6, 2), None);
        assert_eq!(blas_layout(4, 3, 2, 1), None, "rows overlap");
    }

    #[test]
    fn uniform_batches_make_one_run_and_gqa_one_run_per_kv_head() {
        let plain: Vec<[usize; 3]> = (0..8).map(|i| [i * 10, i * 20, i * 30]).collect();
        assert_eq!(runs(&plain).len(), 1);
        // 8 query heads over 2 kv heads: b index = q / 4.
        let gqa: Vec<[usize; 3]> = (0..8).map(|q| [q * 10, (q / 4) * 20, q * 30]).collect();
        let r = runs(&gqa);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].stride, [10, 0, 30]);
        assert_eq!((r[1].start, r[1].count), ([40, 20, 120], 4));
        assert_eq!(
            runs(&[[5, 6, 7]]),
            vec![Run {
                start: [5, 6, 7],
                stride: [0; 3],
                count: 1
            }]
        );
    }

    #[test]
    fn gqa_batch_offsets_follow_the_oracle() {
        let kv = Dev {
            ptr: 0,
            dtype: DType::F32,
            shape: vec![2, 5, 3],
            strides: vec![15, 3, 1],
        };
        let batch = [8];
        assert_eq!(batch_offset(&kv, &batch, &[3]), 0);
        assert_eq!(batch_offset(&kv, &batch, &[4]), 15);
    }
}
