//! `MulMat` through cuBLAS (`cublasGemmStridedBatchedEx`, f32 accumulation).
//!
//! Why: matmul dominates a decoder's time; cuBLAS is the well-kept kernel for it. The op's
//! semantics (numpy `a @ b` with GQA batch broadcast, any strides, f32/f16/bf16 operands)
//! are wider than one cuBLAS call, so this module maps the general case onto as few calls as the
//! layout allows and falls back to copies where it must.
//!
//! Strategy: row-major `out[m, n] = a[m, k] @ b[k, n]` is column-major `out^T = b^T a^T`, so b
//! is cuBLAS's A and a its B. An operand whose matrices have a unit stride on either axis is read
//! in place (transposed views such as `x @ w.T` included); otherwise, or when its dtype is not
//! the compute dtype ([`blas_compute`]), it is copied to scratch first. Operands compute in their
//! own dtype when they agree; an f32 operand beside an f16 one is rounded to f16 (in a model:
//! the activations, m x k, beside the weight, k x n), as llama.cpp's cuBLAS path does, so
//! prefill reads the weight in place and runs on tensor cores; other mixes (bf16 beside f32
//! included: 8 bits of mantissa would leave the f32 bound) compute in f32. 16-bit inputs run with f32 output and f32 compute. The output is written in place when it
//! is f32 with unit column stride, else to f32 scratch and copied (converting) into it. Output
//! batches are grouped into runs whose operand offsets advance by constant strides (stride 0 for
//! a broadcast operand), one strided-batched call per run — one call in the common cases, one
//! per kv head under GQA.
//!
//! Invariant: cuBLAS only ever sees the stream through `TicketStream::lend`, so each call
//! takes a ticket and is counted as a kernel launch; math mode is the default (no TF32), so f32
//! results match the CPU oracle within the f32 NMSE bound (16-bit products within the bound of
//! their activations' rounding).
//!
//! Small m (decode) does not go to cuBLAS: a matrix-vector product is bound by reading the
//! weight, and one launch of a kernel that reads it once in its own dtype is the floor. When the result
//! is f32, b's matrices have a unit stride on k (`x @ w.T`, `q @ K^T`) or on n (`x @ w`,
//! `p @ V`), and there are at most four batch axes, one launch of a matrix-vector kernel
//! (`kernels/matmul.cu`) reads b once, in place, in its own dtype, with a (converted to packed
//! f32 first only when it is not f32, or strided along k for the k-contiguous kernel) read
//! from L1. All batches, GQA broadcast included, are one launch. Its threshold: m <=
//! [`MMV_MAX_M`], or m <= [`MMV_MAX_M_CONVERTING`] when cuBLAS would have to convert b (a
//! bf16 weight beside f32 activations; `LOWSYNC_CUDA_TUNE=mmv_max_m=N` overrides both; 0 sends everything to cuBLAS). Its results are
//! bit-identical run to run: the summation order depends only on the shapes.
//!
//! Quantized (GGUF block) weights, read as `x @ w.T` (b's k axis contiguous, whole rows): up to
//! [`MMV_MAX_M_QUANT`] rows of a, `mul_mat_vec_q[8]` (`kernels/quant.cu`) reads the blocks in
//! place and dequantizes them in registers; above it (prefill) the weight is dequantized to an
//! f16 scratch copy (`dequant_rows`), a converted to f16, and cuBLAS multiplies the two with f32
//! accumulation — the simplest correct prefill; a weight without batch axes is dequantized a
//! slice of columns at a time ([`QUANT_SCRATCH_BYTES`]).

use std::ffi::c_void;

use cudarc::cublas::{result as cbres, sys as cb};
use lowsync_backend::{ExecNode, Result};
use lowsync_graph::DType;

use crate::config::DecodeGemv;
use crate::device::Blas;
use crate::exec::launch::{
    dt, float_dst, float_src, grid_for, kernel_err, packed, qt, quant_row_bytes, Args, Dev, Exec,
    BLOCK,
};
use crate::fusion::gemv::{launch_head_q, HeadNorm};
use crate::kernels::Kernel;
use crate::tickets::Counted;

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
#[derive(Clone, Debug)]
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
    /// cuBLAS or one of the matrix-vector kernels.
    route: Route,
    /// A quantized b without batch axes on cuBLAS: dequantized this many columns at a time.
    quant_cols: Option<usize>,
}

/// Where a matmul runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Blas,
    /// `mul_mat_vec_k[4]`: b's k axis is contiguous.
    VecK,
    /// `mul_mat_vec_n[8]`: b's n axis is contiguous.
    VecN,
    /// `mul_mat_vec_q[8]`: b is a quantized weight read in place.
    VecQ,
}

/// Rows of a up to which the matrix-vector kernels run (above it cuBLAS reads every operand
/// in place, so only the kernel's efficiency matters).
pub(crate) const MMV_MAX_M: usize = 8;
/// Rows of a up to which they run when cuBLAS would first convert all of b to f32 (f16/bf16 b
/// under an a of another dtype): that conversion costs about three reads of b.
pub(crate) const MMV_MAX_M_CONVERTING: usize = 32;
/// Rows of a up to which a quantized weight is read in place by `mul_mat_vec_q[8]`: one pass
/// of `mul_mat_vec_q8` (`MVQ_MT`), so every such product reads the weight once. Above it the
/// weight is dequantized for cuBLAS. Not tuned on hardware yet.
pub(crate) const MMV_MAX_M_QUANT: usize = 8;
/// Bytes of f16 a quantized weight is dequantized into at a time for cuBLAS (prefill): a large
/// output head (128k rows of 4,096: 1 GB in f16) goes in slices of columns, so the scratch
/// block — which keeps its largest size — stays small.
const QUANT_SCRATCH_BYTES: usize = 64 << 20;
/// Warps of a `mul_mat_vec_q[8]` block (`MVQ_WARPS` in quant.cu).
const MVQ_WARPS: usize = 4;
/// Columns per warp of the one-row kernels `mul_mat_vec_q` and `mul_mat_vec_q_argmax`
/// (`MVQ_R`); `mul_mat_vec_q8` takes one.
const MVQ_R: usize = 4;
/// Dynamic shared memory the one-row quantized kernels may take for the q16 or q8 row (records
/// of 32 values, `QDot::record_bytes`): the default
/// 48 KiB less their static shared memory (16 staged segments of 1,120 bytes, and the argmax's
/// block maxima: 18,688 bytes for `mul_mat_vec_q_argmax` with NVRTC 13.0, sm_90) with about
/// 1 KiB to spare, so rows up to 11,456 values take the q16 path (19,104 the q8 one).
const MVQ_Q16_MAX_SHARED: usize = 28 << 10;
/// Batch axes the matrix-vector kernels index (`MB_MAXD` in common.cuh).
const MB_MAXD: usize = 4;
/// Rows (one per warp) of a `mul_mat_vec_1` block (`GV_WARPS` in matmul.cu; `FG1_WARPS` in
/// fusion/gemv.cu for `fused_gemv1`).
pub(crate) const GEMV1_WARPS: usize = 8;
/// Shared memory `mul_mat_vec_1` and `fused_gemv1` may stage an activation row in (the
/// default 48 KB limit).
pub(crate) const GEMV1_MAX_SHARED: usize = 48 << 10;

/// Threads of a `mul_mat_vec_k[4]` block (the kernels' launch bounds assume 128).
const MMV_K_THREADS: usize = 128;
/// Threads of a `mul_mat_vec_n[8]` block (`MMN_T`) and columns per thread (`MMN_C`).
const MMN_T: usize = 256;
const MMN_C: usize = 4;
/// Blocks a launch should have to fill the device (about two per SM of a large GPU).
const MMV_TARGET_BLOCKS: usize = 256;

/// Output batch axes of a matrix-vector launch (`struct MmBatch` in common.cuh, field for
/// field): `st[t]` and `div[t]` are the element strides and GQA divisors of dst, a and b.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct MmBatch {
    nd: i64,
    shape: [i64; MB_MAXD],
    st: [[i64; MB_MAXD]; 3],
    div: [[i64; MB_MAXD]; 3],
}

/// The batch axes of `dst = a @ b` over the output batch shape `batch`, leaving out axes of
/// extent 1; `None` when more than [`MB_MAXD`] remain.
fn mm_batch(batch: &[usize], ops: [&Dev; 3]) -> Option<MmBatch> {
    let axes: Vec<usize> = (0..batch.len()).filter(|&i| batch[i] != 1).collect();
    if axes.len() > MB_MAXD {
        return None;
    }
    let mut mb = MmBatch {
        nd: axes.len() as i64,
        ..MmBatch::default()
    };
    for (slot, &i) in axes.iter().enumerate() {
        mb.shape[slot] = batch[i] as i64;
        for (t, op) in ops.iter().enumerate() {
            let own = op.rank() - 2;
            let (d, stride) = if i + own >= batch.len() {
                let j = i + own - batch.len();
                (op.shape[j], op.strides[j])
            } else {
                (1, 0)
            };
            mb.div[t][slot] = (batch[i] / d.max(1)).max(1) as i64;
            mb.st[t][slot] = if d == 1 { 0 } else { stride as i64 };
        }
    }
    Some(mb)
}

/// The dtype cuBLAS computes `a @ b` in: the operands' own when they agree; f16 when one is
/// f16 and the other f32 (the f32 operand, in a model the activations, is rounded to f16: a
/// copy of m x k elements, where f32 compute would copy the k x n weight to f32 and run without
/// tensor cores, at a third of the speed in prefill; f16's 11 bits keep the product within the
/// f32 NMSE bound); f32 otherwise (bf16's 8 bits would not: its weights are converted).
pub(crate) fn blas_compute(a: DType, b: DType) -> DType {
    if a == b {
        a
    } else if matches!((a, b), (DType::F32, DType::F16) | (DType::F16, DType::F32)) {
        DType::F16
    } else {
        DType::F32
    }
}

/// The rows threshold of the matrix-vector kernels for these operand dtypes: higher where
/// cuBLAS would have to convert b.
pub(crate) fn mmv_max_m(a: DType, b: DType, over: Option<usize>) -> usize {
    over.unwrap_or(if b.is_quantized() {
        MMV_MAX_M_QUANT
    } else if blas_compute(a, b) != b {
        MMV_MAX_M_CONVERTING
    } else {
        MMV_MAX_M
    })
}

/// Lanes per column of `mul_mat_vec_k`: a power of two up to 32 covering the k / vw vectors.
pub(crate) fn mmv_group(k: usize, vw: usize) -> usize {
    (k / vw).max(1).next_power_of_two().min(32)
}

/// Column threads of a `mul_mat_vec_n` block (a power of two <= 32): enough to cover n, then
/// halved while the launch has too few blocks and k enough rows for the extra slices, down to
/// the threads whose loads still fill a 32-byte sector per row of b (`esz`: b's element size).
fn mmv_n_threads(n: usize, nbatch: usize, k: usize, esz: usize) -> usize {
    let min = (32 / (MMN_C * esz)).max(1);
    let mut tc = n.div_ceil(MMN_C).next_power_of_two().clamp(1, 32);
    while tc > min && n.div_ceil(MMN_C * tc) * nbatch < MMV_TARGET_BLOCKS && MMN_T / tc < k {
        tc /= 2;
    }
    tc
}

/// Whether `ptr` and every stride (in elements of `esz` bytes) are multiples of `align` bytes.
pub(crate) fn aligned(ptr: u64, esz: usize, strides: &[i64], align: usize) -> bool {
    ptr.is_multiple_of(align as u64)
        && strides
            .iter()
            .all(|&s| (s as usize * esz).is_multiple_of(align))
}

/// A stride that moves a vector's start (extent-1 axes never do), for [`aligned`].
pub(crate) fn moving(extent: usize, stride: usize) -> i64 {
    if extent > 1 {
        stride as i64
    } else {
        0
    }
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
                // (A dequantized weight keeps b's own batch axes, at most the output's, or is
                // dequantized a slice of columns at a time: `quant_cols`.)
                self.quant_cols
                    .map_or(nb.max(1) * self.n, |c| c.min(self.n))
                    * self.k
                    * sz
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

/// Validates `dst = a @ b` (the CPU oracle's rules), picks the route and decides conversions.
/// `mmv_override` replaces the rows thresholds of the matrix-vector kernels.
pub(crate) fn plan(
    node: &ExecNode,
    dst: &Dev,
    a: &Dev,
    b: &Dev,
    mmv_override: Option<usize>,
) -> Result<Plan> {
    float_dst(node, dst)?;
    float_src(node, "a", a)?;
    if !b.dtype.is_quantized() {
        float_src(node, "b", b)?;
    }
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
    let batch = want[..nb].to_vec();
    if b.dtype.is_quantized() {
        return plan_quant(node, dst, a, b, (m, n, k), batch, mmv_override);
    }
    let route = if dst.dtype == DType::F32
        && m <= mmv_max_m(a.dtype, b.dtype, mmv_override)
        && mm_batch(&batch, [dst, a, b]).is_some()
    {
        if b.strides[rb - 2] == 1 || k == 1 {
            Route::VecK
        } else if b.strides[rb - 1] == 1 || n == 1 {
            Route::VecN
        } else {
            Route::Blas
        }
    } else {
        Route::Blas
    };
    if route != Route::Blas {
        // Only a may need a copy: to packed f32 when it is not f32 (or, for the k-contiguous
        // kernel, when its k axis is strided).
        let a_ok =
            a.dtype == DType::F32 && (route == Route::VecN || a.strides[ra - 1] == 1 || k == 1);
        return Ok(Plan {
            m,
            n,
            k,
            batch,
            compute: DType::F32,
            convert_a: !a_ok,
            convert_b: false,
            out_scratch: false,
            route,
            quant_cols: None,
        });
    }
    let compute = blas_compute(a.dtype, b.dtype);
    let out_ok = dst.dtype == DType::F32 && matches!(mat_layout(dst), Some((Order::RowMajor, _)));
    Ok(Plan {
        m,
        n,
        k,
        batch,
        compute,
        convert_a: a.dtype != compute || mat_layout(a).is_none(),
        convert_b: b.dtype != compute || mat_layout(b).is_none(),
        out_scratch: !out_ok,
        route,
        quant_cols: None,
    })
}

/// The plan of a product on a quantized weight b (`plan`'s checks done): `Route::VecQ` for few
/// rows, else cuBLAS on f16 copies of both operands (b dequantized).
fn plan_quant(
    node: &ExecNode,
    dst: &Dev,
    a: &Dev,
    b: &Dev,
    (m, n, k): (usize, usize, usize),
    batch: Vec<usize>,
    mmv_override: Option<usize>,
) -> Result<Plan> {
    let (ra, rb) = (a.rank(), b.rank());
    // Rows of w (columns of b) must be whole blocks of contiguous values, every row start a
    // block start: the layouts the graph admits for `x @ w.T`.
    let rows_whole = (b.strides[rb - 2] == 1 || k == 1)
        && (0..rb)
            .filter(|&i| i != rb - 2 && b.shape[i] > 1)
            .all(|i| quant_row_bytes(b.dtype, b.strides[i]).is_some());
    if !rows_whole {
        return Err(kernel_err(
            node,
            format!(
                "a {} weight is read as `x @ w.T` (its k axis contiguous, whole rows of blocks); \
                 got shape {:?} with strides {:?}",
                b.dtype, b.shape, b.strides
            ),
        ));
    }
    if dst.dtype == DType::F32
        && m <= mmv_max_m(a.dtype, b.dtype, mmv_override)
        && mm_batch(&batch, [dst, a, b]).is_some()
    {
        return Ok(Plan {
            m,
            n,
            k,
            batch,
            compute: DType::F32,
            convert_a: !(a.dtype == DType::F32 && (a.strides[ra - 1] == 1 || k == 1)),
            convert_b: false,
            out_scratch: false,
            route: Route::VecQ,
            quant_cols: None,
        });
    }
    let out_ok = dst.dtype == DType::F32 && matches!(mat_layout(dst), Some((Order::RowMajor, _)));
    let batched = batch.iter().product::<usize>() > 1;
    Ok(Plan {
        m,
        n,
        k,
        batch,
        compute: DType::F16,
        convert_a: a.dtype != DType::F16 || mat_layout(a).is_none(),
        convert_b: true,
        out_scratch: !out_ok,
        route: Route::Blas,
        quant_cols: (!batched).then(|| (QUANT_SCRATCH_BYTES / (2 * k)).max(1)),
    })
}

/// b (quantized) dequantized into f16 scratch at `ptr`: its matrices keep b's batch axes, each
/// column of b (row of w) k contiguous values, columns back to back.
fn dequant_b(ex: &Exec<'_>, node: &ExecNode, b: &Dev, ptr: u64) -> Result<Dev> {
    let rb = b.rank();
    let (k, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    let Some(code) = qt(b.dtype) else {
        return Err(kernel_err(node, "dequant_b: b is not quantized"));
    };
    // Rows of w: b's batch axes, then n.
    let mut rows_shape = b.shape[..rb - 2].to_vec();
    rows_shape.push(n);
    let mut rows_strides = b.strides[..rb - 2].to_vec();
    rows_strides.push(b.strides[rb - 1]);
    let rows: usize = rows_shape.iter().product();
    let mut out_strides = vec![0usize; rb];
    out_strides[rb - 2] = 1;
    out_strides[rb - 1] = k;
    let mut acc = k * n;
    for i in (0..rb - 2).rev() {
        out_strides[i] = acc;
        acc *= b.shape[i];
    }
    let out = Dev {
        ptr,
        dtype: DType::F16,
        shape: b.shape.clone(),
        strides: out_strides,
    };
    if rows * k == 0 {
        return Ok(out);
    }
    let l = ex.lay(node, &rows_shape, &[&rows_strides])?;
    let args = Args::new()
        .arg(rows as i64)
        .arg(k as i64)
        .arg(l)
        .arg(ptr)
        .arg(b.ptr)
        .arg(code);
    ex.launch(
        node,
        Kernel::DequantRows(code),
        grid_for(rows * k / 16),
        BLOCK,
        args,
    )?;
    Ok(out)
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
    if plan.route == Route::VecQ {
        return run_vec_q(ex, node, plan, dst, a, b, regions);
    }
    if plan.route != Route::Blas {
        return run_vec(ex, node, plan, dst, a, b, regions);
    }
    let a = if plan.convert_a {
        let c = packed(regions[0], plan.compute, &a.shape);
        ex.copy(node, a, &c)?;
        c
    } else {
        a.clone()
    };
    if let Some(cols) = plan.quant_cols {
        // A quantized weight without batch axes: slices of its columns (rows of w) dequantized
        // in turn, each multiplied into its slice of the result. a is converted once above.
        let (rb, rd) = (b.rank(), dst.rank());
        let col_bytes = if plan.n > 1 {
            quant_row_bytes(b.dtype, b.strides[rb - 1]).ok_or_else(|| {
                kernel_err(node, format!("{} stride is not whole blocks", b.dtype))
            })?
        } else {
            0
        };
        let out_all = if plan.out_scratch {
            packed(regions[2], DType::F32, &dst.shape)
        } else {
            dst.clone()
        };
        let mut n0 = 0;
        while n0 < plan.n {
            let len = cols.min(plan.n - n0);
            let mut bs = b.clone();
            bs.shape[rb - 1] = len;
            bs.ptr += (n0 * col_bytes) as u64;
            let bq = dequant_b(ex, node, &bs, regions[1])?;
            let part = Plan {
                n: len,
                convert_a: false,
                convert_b: false,
                out_scratch: false,
                quant_cols: None,
                ..plan.clone()
            };
            blas(
                ex,
                node,
                &part,
                &a,
                &bq,
                &out_all.slice_axis(rd - 1, n0, len),
            )?;
            n0 += len;
        }
        if plan.out_scratch {
            ex.copy(node, &out_all, dst)?;
        }
        return Ok(());
    }
    let b = if b.dtype.is_quantized() {
        dequant_b(ex, node, b, regions[1])?
    } else if plan.convert_b {
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
    blas(ex, node, plan, &a, &b, &out)?;
    if plan.out_scratch {
        ex.copy(node, &out, dst)?;
    }
    Ok(())
}

/// `out = a @ b` through cuBLAS, the operands as cuBLAS reads them (`plan.compute`, layouts
/// `mat_layout` accepts; out f32).
fn blas(ex: &Exec<'_>, node: &ExecNode, plan: &Plan, a: &Dev, b: &Dev, out: &Dev) -> Result<()> {
    let (a, b, out) = (a.clone(), b.clone(), out.clone());
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
            .map_err(|e| kernel_err(node, format!("launching the pending copies: {e:?}")))?
            .map_err(|e| kernel_err(node, format!("cublasGemmStridedBatchedEx failed: {e:?}")))?;
    }
    drop(blas);
    Ok(())
}

/// A launch of `mul_mat_vec_1` (or its argmax variant, which takes the same first arguments).
struct Vec1 {
    grid: u32,
    shared: u32,
    args: Args,
}

/// Decode's product — one f32 activation row (`a` as run, after any conversion) against a
/// weight with contiguous, 16-byte aligned rows — as a `mul_mat_vec_1` launch; `None` when the
/// product does not take that kernel.
fn vec1(ex: &Exec<'_>, node: &ExecNode, plan: &Plan, dst: &Dev, a: &Dev, b: &Dev) -> Option<Vec1> {
    let (m, n, k) = (plan.m, plan.n, plan.k);
    let (ra, rb, rd) = (a.rank(), b.rank(), dst.rank());
    let a_ks = a.strides[ra - 1];
    let b_ns = b.strides[rb - 1];
    let d_cs = dst.strides[rd - 1];
    let cfg = &ex.inner.cfg;
    let ok = plan.route == Route::VecK
        && m == 1
        && cfg.decode_gemv != DecodeGemv::Off
        && plan.batch.iter().product::<usize>() == 1
        && dst.dtype == DType::F32
        && a.dtype == DType::F32
        && (k * 4 <= GEMV1_MAX_SHARED || cfg.decode_gemv == DecodeGemv::GlobalX)
        && aligned(b.ptr, b.dtype.size_bytes(), &[b_ns as i64], 16)
        && a.ptr.is_multiple_of(16)
        && (a_ks == 1 || k == 1);
    if !ok {
        return None;
    }
    let staged = cfg.decode_gemv == DecodeGemv::SharedX;
    let args = Args::new()
        .arg(n as i64)
        .arg(k as i64)
        .arg(dst.ptr)
        .arg(d_cs as i64)
        .arg(a.ptr)
        .arg(b.ptr)
        .arg(dt(b.dtype))
        .arg(b_ns as i64)
        .arg(staged as i32)
        .arg(ex.read_ahead(&node.srcs[1]) as i32);
    Some(Vec1 {
        grid: n.div_ceil(GEMV1_WARPS).clamp(1, i32::MAX as usize) as u32,
        shared: if staged { (k * 4) as u32 } else { 0 },
        args,
    })
}

/// Decode's output head: product `mm` and the `Argmax` node `am` of its result as a
/// `mul_mat_vec_1_argmax` launch (`mul_mat_vec_q_argmax` for a quantized weight) (the argmax
/// folded into the product's blocks) and a one-thread `argmax_take`; a quantized weight under
/// `CudaConfig::q_head` as `fused_gemv1_q` (`launch_head_q`), which with `norm` (the final norm,
/// whose product is `mm`'s activation) takes the norm as its prologue and the index itself, one
/// launch in all. Where the head does not take `norm`, it runs first on its own. `Ok(false)`
/// (nothing queued) when the product does not take `mul_mat_vec_1` as it stands; the caller
/// then runs the norm and both nodes on their own.
pub(crate) fn run_vec1_argmax(
    ex: &Exec<'_>,
    mm: &ExecNode,
    am: &ExecNode,
    norm: Option<&HeadNorm<'_>>,
) -> Result<bool> {
    let dst = ex.resolve(&mm.dst)?;
    let a = ex.resolve(&mm.srcs[0])?;
    let b = ex.resolve(&mm.srcs[1])?;
    let idx = ex.resolve(&am.dst)?;
    let plan = plan(mm, &dst, &a, &b, ex.inner.cfg.mmv_max_m)?;
    let fits = !plan.convert_a
        && plan.k > 0
        && plan.n <= i32::MAX as usize
        && idx.dtype == DType::I32
        && idx.numel() == 1;
    let key = ex.inner.head_work.key();
    let one_q = fits
        && plan.route == Route::VecQ
        && plan.m == 1
        && plan.batch.iter().product::<usize>() == 1;
    let fold = norm.map(|n| (n, idx.ptr));
    if one_q && ex.inner.cfg.q_head && launch_head_q(ex, mm, [&a, &b, &dst], key, fold)? {
        // A quantized head as decode's other quantized products, the argmax folded in; with
        // the final norm as its prologue, the index too.
        if norm.is_some() {
            return Ok(true);
        }
    } else if one_q {
        if let Some(n) = norm {
            n.launch_alone(ex)?;
        }
        // A quantized head: `mul_mat_vec_q` with the argmax folded in.
        let (grid, args) = vec_q_args(ex, mm, &plan, &dst, &a, &b)?;
        let code = qt(b.dtype).ok_or_else(|| kernel_err(mm, "the head's b is not quantized"))?;
        let (shared, qm) = vec_q_int(ex, &plan);
        ex.launch_shared(
            mm,
            Kernel::MulMatVecQArgmax(code),
            grid,
            (MVQ_WARPS * 32) as u32,
            shared as u32,
            args.arg(key).arg(qm),
        )?;
    } else {
        let Some(v1) = fits.then(|| vec1(ex, mm, &plan, &dst, &a, &b)).flatten() else {
            return Ok(false);
        };
        if let Some(n) = norm {
            n.launch_alone(ex)?;
        }
        ex.launch_shared(
            mm,
            Kernel::MulMatVec1Argmax,
            v1.grid,
            (GEMV1_WARPS * 32) as u32,
            v1.shared,
            v1.args.arg(key),
        )?;
    }
    let take = Args::new().arg(key).arg(idx.ptr);
    if let Err(e) = ex.launch(am, Kernel::ArgmaxTake, 1, 32, take) {
        // The key holds this launch's maximum: zero it (best effort), or the next head would
        // count it.
        // SAFETY: the key word is this backend's device memory, 8 bytes of its 256.
        let _ = unsafe { ex.inner.stream.memset_d8(key, 0, 8) };
        return Err(e);
    }
    Ok(true)
}

/// a as the matrix-vector kernels read it: itself, or (`plan.convert_a`) a packed f32 copy in
/// scratch region 0.
fn a_for_kernel(
    ex: &Exec<'_>,
    node: &ExecNode,
    plan: &Plan,
    a: &Dev,
    regions: &[u64],
) -> Result<Dev> {
    if !plan.convert_a {
        return Ok(a.clone());
    }
    let c = packed(regions[0], DType::F32, &a.shape);
    ex.copy(node, a, &c)?;
    Ok(c)
}

/// Queues `dst = a @ b` on a quantized b as one launch of `mul_mat_vec_q[8]` (`Route::VecQ`).
fn run_vec_q(
    ex: &Exec<'_>,
    node: &ExecNode,
    plan: &Plan,
    dst: &Dev,
    a: &Dev,
    b: &Dev,
    regions: &[u64],
) -> Result<()> {
    let a = a_for_kernel(ex, node, plan, a, regions)?;
    let code = qt(b.dtype).ok_or_else(|| kernel_err(node, "run_vec_q: b is not quantized"))?;
    let (grid, args) = vec_q_args(ex, node, plan, dst, &a, b)?;
    if plan.m != 1 {
        let kernel = Kernel::MulMatVecQ8(code);
        return ex.launch(node, kernel, grid, (MVQ_WARPS * 32) as u32, args);
    }
    let kernel = Kernel::MulMatVecQ(code);
    let (shared, qm) = vec_q_int(ex, plan);
    ex.launch_shared(
        node,
        kernel,
        grid,
        (MVQ_WARPS * 32) as u32,
        shared as u32,
        args.arg(qm),
    )
}

/// Dynamic shared memory and `qm` argument of a one-row quantized product (quant.cu: the row
/// as q16 or q8 records, `CudaConfig::qdot`), or (0, 0) where it takes the f32 path:
/// `qdot=f32`, more than one row or batch, or a row too long for the records beside the
/// kernel's static staging.
fn vec_q_int(ex: &Exec<'_>, plan: &Plan) -> (usize, i32) {
    let qdot = ex.inner.cfg.qdot;
    let one = plan.m == 1 && plan.batch.iter().product::<usize>() == 1;
    match qdot.record_bytes() {
        Some(rec) if one && plan.k / 32 * rec <= MVQ_Q16_MAX_SHARED => {
            (plan.k / 32 * rec, qdot.kernel_mode())
        }
        _ => (0, 0),
    }
}

/// The grid and arguments of `mul_mat_vec_q[8]` (and the first arguments of
/// `mul_mat_vec_q_argmax`) for `dst = a @ b`, a as the kernel reads it (f32, k contiguous).
fn vec_q_args(
    ex: &Exec<'_>,
    node: &ExecNode,
    plan: &Plan,
    dst: &Dev,
    a: &Dev,
    b: &Dev,
) -> Result<(u32, Args)> {
    let Some(mut mb) = mm_batch(&plan.batch, [dst, a, b]) else {
        return Err(kernel_err(
            node,
            "too many batch axes for the matrix-vector kernels",
        ));
    };
    let code = qt(b.dtype).ok_or_else(|| kernel_err(node, "vec_q_args: b is not quantized"))?;
    // The kernel addresses b in bytes: whole rows, checked by `plan_quant`.
    let bytes = |s: usize| {
        quant_row_bytes(b.dtype, s)
            .map(|v| v as i64)
            .ok_or_else(|| kernel_err(node, format!("{} stride {s} is not whole blocks", b.dtype)))
    };
    for st in mb.st[2].iter_mut().take(mb.nd as usize) {
        *st = bytes(*st as usize)?;
    }
    let (m, n, k) = (plan.m, plan.n, plan.k);
    let nbatch: usize = plan.batch.iter().product();
    let (ra, rb, rd) = (a.rank(), b.rank(), dst.rank());
    let b_cs = if n > 1 { bytes(b.strides[rb - 1])? } else { 0 };
    let per_block = if m == 1 { MVQ_WARPS * MVQ_R } else { MVQ_WARPS };
    let blocks = (n.div_ceil(per_block) * nbatch).clamp(1, i32::MAX as usize) as u32;
    let args = Args::new()
        .arg(m as i64)
        .arg(n as i64)
        .arg(k as i64)
        .arg(nbatch as i64)
        .arg(mb)
        .arg(dst.ptr)
        .arg(dst.strides[rd - 2] as i64)
        .arg(dst.strides[rd - 1] as i64)
        .arg(a.ptr)
        .arg(a.strides[ra - 2] as i64)
        .arg(b.ptr)
        .arg(code)
        .arg(b_cs)
        .arg(ex.read_ahead(&node.srcs[1]) as i32);
    Ok((blocks, args))
}

/// Queues `dst = a @ b` as one launch of a matrix-vector kernel (`plan.route` is not Blas).
fn run_vec(
    ex: &Exec<'_>,
    node: &ExecNode,
    plan: &Plan,
    dst: &Dev,
    a: &Dev,
    b: &Dev,
    regions: &[u64],
) -> Result<()> {
    let a = a_for_kernel(ex, node, plan, a, regions)?;
    let Some(mb) = mm_batch(&plan.batch, [dst, &a, b]) else {
        return Err(kernel_err(
            node,
            "too many batch axes for the matrix-vector kernels",
        ));
    };
    let (m, n, k) = (plan.m, plan.n, plan.k);
    let nbatch: usize = plan.batch.iter().product();
    let (ra, rb, rd) = (a.rank(), b.rank(), dst.rank());
    let (a_rs, a_ks) = (a.strides[ra - 2], a.strides[ra - 1]);
    let (b_ks, b_ns) = (b.strides[rb - 2], b.strides[rb - 1]);
    let (d_rs, d_cs) = (dst.strides[rd - 2], dst.strides[rd - 1]);
    let esz = b.dtype.size_bytes();
    let nd = mb.nd as usize;
    // Strides that move a vector's start (extent-1 axes never do).
    let row = |extent: usize, s: usize| if extent > 1 { s as i64 } else { 0 };
    let grid = |blocks: usize| blocks.clamp(1, i32::MAX as usize) as u32;
    let args = Args::new()
        .arg(m as i64)
        .arg(n as i64)
        .arg(k as i64)
        .arg(nbatch as i64)
        .arg(mb)
        .arg(dst.ptr)
        .arg(d_rs as i64)
        .arg(d_cs as i64)
        .arg(a.ptr)
        .arg(a_rs as i64);
    if let Some(v1) = vec1(ex, node, plan, dst, &a, b) {
        return ex.launch_shared(
            node,
            Kernel::MulMatVec1,
            v1.grid,
            (GEMV1_WARPS * 32) as u32,
            v1.shared,
            v1.args,
        );
    }
    match plan.route {
        Route::VecK => {
            let g = mmv_group(k, 16 / esz);
            let mut bs: Vec<i64> = mb.st[2][..nd].to_vec();
            bs.push(row(n, b_ns));
            let mut as_: Vec<i64> = mb.st[1][..nd].to_vec();
            as_.push(row(m, a_rs));
            let vec = aligned(b.ptr, esz, &bs, 16) && aligned(a.ptr, 4, &as_, 16);
            let (kernel, nc) = if m <= 2 {
                (Kernel::MulMatVecK, 1)
            } else {
                (Kernel::MulMatVecK4, 4)
            };
            let cols_per_block = MMV_K_THREADS / 32 * (32 / g) * nc;
            let blocks = n.div_ceil(cols_per_block) * nbatch;
            let args = args
                .arg(b.ptr)
                .arg(dt(b.dtype))
                .arg(b_ns as i64)
                .arg(g as i32)
                .arg(vec as i32);
            ex.launch(node, kernel, grid(blocks), MMV_K_THREADS as u32, args)
        }
        _ => {
            let tc = mmv_n_threads(n, nbatch, k, esz);
            let mut bs: Vec<i64> = mb.st[2][..nd].to_vec();
            bs.push(row(k, b_ks));
            let vec = aligned(b.ptr, esz, &bs, MMN_C * esz);
            let kernel = if m <= 2 {
                Kernel::MulMatVecN
            } else {
                Kernel::MulMatVecN8
            };
            let blocks = n.div_ceil(MMN_C * tc) * nbatch;
            let args = args
                .arg(a_ks as i64)
                .arg(b.ptr)
                .arg(dt(b.dtype))
                .arg(b_ks as i64)
                .arg(tc as i32)
                .arg(vec as i32);
            ex.launch(node, kernel, grid(blocks), MMN_T as u32, args)
        }
    }
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

    fn dev(dtype: DType, shape: &[usize], strides: &[usize]) -> Dev {
        Dev {
            ptr: 0x1000,
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }

    fn node() -> ExecNode {
        let t = lowsync_backend::TensorRef {
            buffer: lowsync_backend::BufferId(1),
            byte_offset: 0,
            dtype: DType::F32,
            shape: vec![1],
            strides: vec![1],
        };
        ExecNode {
            op: lowsync_graph::Op::MulMat,
            name: "mm".into(),
            dst: t.clone(),
            srcs: vec![t.clone(), t],
        }
    }

    fn route(dst: &Dev, a: &Dev, b: &Dev, over: Option<usize>) -> (Route, bool) {
        let p = plan(&node(), dst, a, b, over).expect("a valid matmul");
        (p.route, p.convert_a)
    }

    /// Against `struct MmBatch` of common.cuh (the kernel's source, not a restatement of the
    /// Rust struct): the same fields in order, size and bound.
    #[test]
    fn mm_batch_matches_the_cuda_struct() {
        use crate::abi::{c_define, c_struct, debug_fields};
        let src = include_str!("../../kernels/common.cuh");
        assert_eq!(c_define(src, "MB_MAXD"), MB_MAXD);
        let c = c_struct(src, "MmBatch");
        assert_eq!(
            c.names(),
            debug_fields(&format!("{:?}", MmBatch::default()))
        );
        assert_eq!(
            (c.size, c.align),
            (
                std::mem::size_of::<MmBatch>(),
                std::mem::align_of::<MmBatch>()
            )
        );
    }

    #[test]
    fn decode_projections_take_the_k_contiguous_kernel() {
        let x = dev(DType::F32, &[1, 2048], &[2048, 1]);
        let out = dev(DType::F32, &[1, 4096], &[4096, 1]);
        for wdt in [DType::F32, DType::F16, DType::BF16] {
            // x @ w.T with w [4096, 2048] row-major.
            let wt = dev(wdt, &[2048, 4096], &[1, 2048]);
            assert_eq!(route(&out, &x, &wt, None), (Route::VecK, false), "{wdt}");
            // x @ w with w [2048, 4096] row-major.
            let w = dev(wdt, &[2048, 4096], &[4096, 1]);
            assert_eq!(route(&out, &x, &w, None), (Route::VecN, false), "{wdt}");
            // Every other column: neither axis contiguous.
            let odd = dev(wdt, &[2048, 4096], &[8192, 2]);
            assert_eq!(route(&out, &x, &odd, None).0, Route::Blas, "{wdt}");
        }
    }

    #[test]
    fn thresholds_depend_on_whether_cublas_would_convert_b() {
        let wt = |d| dev(d, &[64, 96], &[1, 64]);
        // f32 activations with f16 weights: cuBLAS rounds the activations to f16 and reads
        // the weights in place, so the same threshold as f32 weights.
        for (m, want_f32, want_f16) in [
            (1, Route::VecK, Route::VecK),
            (8, Route::VecK, Route::VecK),
            (9, Route::Blas, Route::Blas),
            (33, Route::Blas, Route::Blas),
        ] {
            let x = dev(DType::F32, &[m, 64], &[64, 1]);
            let out = dev(DType::F32, &[m, 96], &[96, 1]);
            assert_eq!(route(&out, &x, &wt(DType::F32), None).0, want_f32, "m={m}");
            assert_eq!(route(&out, &x, &wt(DType::F16), None).0, want_f16, "m={m}");
            // Equal f16 operands: cuBLAS reads them in place, so only up to 8.
            let xh = dev(DType::F16, &[m, 64], &[64, 1]);
            let want = if m <= 8 {
                (Route::VecK, true)
            } else {
                (Route::Blas, false)
            };
            assert_eq!(route(&out, &xh, &wt(DType::F16), None), want, "m={m}");
        }
        let x = dev(DType::F32, &[1, 64], &[64, 1]);
        let out = dev(DType::F32, &[1, 96], &[96, 1]);
        assert_eq!(route(&out, &x, &wt(DType::F16), Some(0)).0, Route::Blas);
        let x = dev(DType::F32, &[40, 64], &[64, 1]);
        let out = dev(DType::F32, &[40, 96], &[96, 1]);
        assert_eq!(route(&out, &x, &wt(DType::F32), Some(64)).0, Route::VecK);
        // bf16 weights (beside f32 or f16 activations): cuBLAS would convert them to f32.
        for adt in [DType::F32, DType::F16] {
            let x = dev(adt, &[32, 64], &[64, 1]);
            let out = dev(DType::F32, &[32, 96], &[96, 1]);
            assert_eq!(
                route(&out, &x, &wt(DType::BF16), None).0,
                Route::VecK,
                "{adt}"
            );
            let x = dev(adt, &[33, 64], &[64, 1]);
            let out = dev(DType::F32, &[33, 96], &[96, 1]);
            assert_eq!(
                route(&out, &x, &wt(DType::BF16), None).0,
                Route::Blas,
                "{adt}"
            );
        }
    }

    #[test]
    fn blas_rounds_the_f32_operand_to_an_f16_one() {
        use DType::{BF16, F16, F32};
        for (a, b, want) in [
            (F32, F32, F32),
            (F16, F16, F16),
            (F32, F16, F16),
            (F16, F32, F16),
            (F32, BF16, F32),
            (BF16, F32, F32),
            (F16, BF16, F32),
        ] {
            assert_eq!(blas_compute(a, b), want, "{a} @ {b}");
        }
        // Prefill's x @ w.T: the activations are copied, the weight is read in place.
        let x = dev(F32, &[512, 64], &[64, 1]);
        let w = dev(F16, &[64, 96], &[1, 64]);
        let out = dev(F32, &[512, 96], &[96, 1]);
        let p = plan(&node(), &out, &x, &w, None).unwrap();
        assert_eq!(p.route, Route::Blas);
        assert_eq!((p.compute, p.convert_a, p.convert_b), (F16, true, false));
        assert_eq!(p.scratch_sizes(), vec![512 * 64 * 2, 0, 0]);
    }

    #[test]
    fn quantized_weights_are_read_in_place_up_to_eight_rows_then_dequantized_for_cublas() {
        for wdt in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            let k = 2 * wdt.block_size();
            // x @ w.T with w [96, k] row-major.
            let wt = dev(wdt, &[k, 96], &[1, k]);
            for m in [1, 3, 8] {
                let x = dev(DType::F32, &[m, k], &[k, 1]);
                let out = dev(DType::F32, &[m, 96], &[96, 1]);
                assert_eq!(
                    route(&out, &x, &wt, None),
                    (Route::VecQ, false),
                    "{wdt} m={m}"
                );
            }
            // f16 activations are converted to f32 for the in-place kernel.
            let xh = dev(DType::F16, &[1, k], &[k, 1]);
            let out = dev(DType::F32, &[1, 96], &[96, 1]);
            assert_eq!(route(&out, &xh, &wt, None), (Route::VecQ, true), "{wdt}");
            // Prefill: both operands to f16 (b dequantized), cuBLAS.
            let x = dev(DType::F32, &[9, k], &[k, 1]);
            let out = dev(DType::F32, &[9, 96], &[96, 1]);
            let p = plan(&node(), &out, &x, &wt, None).expect("a valid matmul");
            assert_eq!(
                (p.route, p.compute, p.convert_a, p.convert_b),
                (Route::Blas, DType::F16, true, true),
                "{wdt}"
            );
            assert_eq!(p.scratch_sizes(), vec![9 * k * 2, k * 96 * 2, 0]);
            // A large head is dequantized a slice of columns at a time.
            let (kh, nh) = (16 * wdt.block_size(), 128_256);
            let head = dev(wdt, &[kh, nh], &[1, kh]);
            let x = dev(DType::F32, &[9, kh], &[kh, 1]);
            let out = dev(DType::F32, &[9, nh], &[nh, 1]);
            let p = plan(&node(), &out, &x, &head, None).expect("a valid matmul");
            let cols = QUANT_SCRATCH_BYTES / (2 * kh);
            assert_eq!(p.quant_cols, Some(cols), "{wdt}");
            assert!(
                cols < nh && p.scratch_sizes()[1] <= QUANT_SCRATCH_BYTES,
                "{wdt}"
            );
            // An f16 result, or the override at 0, sends even one row to cuBLAS.
            let x = dev(DType::F32, &[1, k], &[k, 1]);
            let out16 = dev(DType::F16, &[1, 96], &[96, 1]);
            assert_eq!(route(&out16, &x, &wt, None).0, Route::Blas, "{wdt}");
            let out = dev(DType::F32, &[1, 96], &[96, 1]);
            assert_eq!(route(&out, &x, &wt, Some(0)).0, Route::Blas, "{wdt}");
        }
    }

    #[test]
    fn a_quantized_weight_whose_k_axis_is_strided_is_a_clear_error() {
        // x @ w with w [64, 96] Q4_0 read along its strided axis.
        let w = dev(DType::Q4_0, &[96, 64], &[64, 1]);
        let x = dev(DType::F32, &[1, 96], &[96, 1]);
        let out = dev(DType::F32, &[1, 64], &[64, 1]);
        let err = plan(&node(), &out, &x, &w, None)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("x @ w.T"), "{err}");
    }

    #[test]
    fn other_results_and_strided_activations_are_handled() {
        let wt = dev(DType::F16, &[64, 96], &[1, 64]);
        let x = dev(DType::F32, &[2, 64], &[64, 1]);
        // An f16 result stays on cuBLAS (the kernels write f32).
        let out16 = dev(DType::F16, &[2, 96], &[96, 1]);
        assert_eq!(route(&out16, &x, &wt, None).0, Route::Blas);
        // A transposed f32 result is written in place through its strides.
        let out_t = dev(DType::F32, &[2, 96], &[1, 2]);
        assert_eq!(route(&out_t, &x, &wt, None), (Route::VecK, false));
        // a strided along k is packed first for the k kernel, not for the n kernel.
        let xs = dev(DType::F32, &[2, 64], &[1, 2]);
        let out = dev(DType::F32, &[2, 96], &[96, 1]);
        assert_eq!(route(&out, &xs, &wt, None), (Route::VecK, true));
        let w = dev(DType::F16, &[64, 96], &[96, 1]);
        assert_eq!(route(&out, &xs, &w, None), (Route::VecN, false));
    }

    #[test]
    fn attention_shapes_are_one_launch_with_gqa_divisors() {
        // 8 query heads over 2 kv heads, T = 1, head_dim 64, 100 cache rows; the cache is
        // [n_ctx, n_kv * hd] seen as keys [n_kv, hd, n_ctx] and values [n_kv, n_ctx, hd].
        let q = dev(DType::F32, &[8, 1, 64], &[64, 512, 1]);
        let keys = dev(DType::F16, &[2, 64, 100], &[64, 1, 128]);
        let kq = dev(DType::F32, &[8, 1, 100], &[100, 100, 1]);
        assert_eq!(route(&kq, &q, &keys, None), (Route::VecK, false));
        let values = dev(DType::F16, &[2, 100, 64], &[64, 128, 1]);
        let o = dev(DType::F32, &[8, 1, 64], &[64, 64, 1]);
        assert_eq!(route(&o, &kq, &values, None), (Route::VecN, false));
        let mb = mm_batch(&[8], [&kq, &q, &keys]).unwrap();
        assert_eq!(mb.nd, 1);
        assert_eq!(mb.shape[0], 8);
        assert_eq!([mb.st[0][0], mb.st[1][0], mb.st[2][0]], [100, 64, 64]);
        assert_eq!([mb.div[0][0], mb.div[1][0], mb.div[2][0]], [1, 1, 4]);
        // A broadcast axis of extent 1 gets stride 0; axes of extent 1 are left out.
        let a = dev(DType::F32, &[2, 3, 4, 16], &[192, 64, 16, 1]);
        let b = dev(DType::F32, &[1, 3, 16, 8], &[384, 128, 1, 16]);
        let d = dev(DType::F32, &[2, 3, 4, 8], &[96, 32, 8, 1]);
        let mb = mm_batch(&[2, 3], [&d, &a, &b]).unwrap();
        assert_eq!((mb.nd, mb.shape[0], mb.shape[1]), (2, 2, 3));
        assert_eq!(mb.st[2][0], 0);
        assert_eq!(mb.div[2][0], 2);
        assert_eq!(mm_batch(&[1, 5, 1], [&d, &a, &b]).map(|m| m.nd), Some(1));
        assert!(mm_batch(&[2; 5], [&d, &a, &b]).is_none());
    }

    #[test]
    fn launch_shapes_follow_the_shapes_only() {
        assert_eq!(mmv_group(2048, 8), 32);
        assert_eq!(mmv_group(2050, 8), 32);
        assert_eq!(mmv_group(64, 8), 8);
        assert_eq!(mmv_group(64, 4), 16);
        assert_eq!(mmv_group(3, 8), 1);
        // Attention's p @ V (n = head_dim 64, 32 heads): 32-byte runs per row of V.
        assert_eq!(mmv_n_threads(64, 32, 2048, 2), 4);
        assert_eq!(mmv_n_threads(64, 32, 2048, 4), 2);
        assert_eq!(mmv_n_threads(8192, 1, 2048, 4), 8);
        assert_eq!(mmv_n_threads(4096 * 8, 1, 2048, 2), 32);
        assert_eq!(mmv_n_threads(1, 1, 2048, 2), 1);
        assert_eq!(
            mmv_n_threads(64, 1, 11, 2),
            16,
            "few k rows: keep the columns wide"
        );
        for tc in [mmv_n_threads(33, 3, 100, 2), mmv_n_threads(5000, 7, 3, 4)] {
            assert!(tc.is_power_of_two() && MMN_T.is_multiple_of(tc));
        }
    }

    #[test]
    fn alignment_covers_pointer_and_strides() {
        assert!(aligned(256, 2, &[2048, 0], 16));
        assert!(!aligned(258, 2, &[2048], 16));
        assert!(!aligned(256, 2, &[2050], 16), "k = 2050 f16 columns");
        assert!(aligned(256, 4, &[2050 * 2], 8));
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
