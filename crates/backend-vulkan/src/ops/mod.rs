//! Planning one compute node as dispatches: shape checks, kernel variant, bindings, push
//! constants and workgroup counts.
//!
//! Why: kernels index memory with 32-bit element offsets and strides and trust them; every
//! check that keeps a dispatch in bounds happens here, on the host, before anything is
//! recorded, and a bad node becomes `Error::Kernel` (the CPU oracle's wording where it has
//! one) instead of a device fault.
//!
//! Strategy: each source and the destination arrive resolved to a `VkBuffer` and a byte
//! offset ([`Res`]). `layout` turns them into bindings, element offsets and strides (the
//! hazard tracker and the synchronization validation layer see the same byte ranges); one
//! module per kernel family checks its op's shapes and fills the push constants:
//! `elementwise` (4-D strided, `Cpy`, `Concat`), `rows` (norms, softmax, argmax, RoPE),
//! `index` (`GetRows`, `SetRows`), `matmul` (`MulMat`, `MulMatId`), `sample` (`Penalize`,
//! `Sample`), and `attention` for the fused decode attention `crate::fusion` finds (the other
//! fused pairs are planned by their families: `rows` for the norm and rope ones, `matmul` for
//! the products with an op or a cache write in their store). This module only dispatches on
//! the op.
//!
//! Invariants: every element index a kernel can form lies inside its binding; every count a
//! kernel divides by is at least 1; dispatch sizes respect `maxComputeWorkGroupCount`.

mod attention;
mod elementwise;
mod index;
mod layout;
mod matmul;
mod rows;
mod sample;

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::Op;

pub(crate) use attention::{Attn, Split as AttnSplit, MAX_DIM as ATTN_MAX_DIM};
use layout::Ctx;
pub(crate) use layout::{kernel_err, Dispatch, Limits, Res, Status};
pub(crate) use matmul::{Epilogue, QD_SHARED_BYTES};

/// Plans `node` with its resolved destination and sources.
pub(crate) fn plan(
    node: &ExecNode,
    dst: &Res,
    srcs: &[Res],
    status: Option<Status>,
    lim: Limits,
) -> Result<Vec<Dispatch>> {
    let c = Ctx { node, lim };
    if dst.numel() == 0 {
        return Ok(Vec::new());
    }
    match node.op {
        Op::Add | Op::Mul | Op::SwiGlu | Op::Scale { .. } | Op::Silu | Op::Gelu => {
            elementwise::eltwise(&c, dst, srcs)
        }
        Op::Cpy => elementwise::copy(&c, dst, &srcs[0]).map(|d| vec![d]),
        Op::Concat { axis } => elementwise::concat(&c, dst, &srcs[0], &srcs[1], axis),
        Op::RmsNorm { eps } => rows::row_kernel(&c, "rms_norm", dst, &srcs[0], None, eps),
        Op::SoftMax { scale } => {
            rows::row_kernel(&c, "soft_max", dst, &srcs[0], srcs.get(1), scale)
        }
        Op::Argmax => rows::argmax(&c, dst, &srcs[0]),
        Op::Rope {
            mode,
            n_dims,
            theta_base,
        } => rows::rope(&c, dst, &srcs[0], &srcs[1], mode, n_dims, theta_base),
        Op::GetRows => index::get_rows(&c, dst, &srcs[0], &srcs[1], status),
        Op::SetRows => index::set_rows(&c, dst, &srcs[1], &srcs[2], status),
        Op::MulMat => matmul::mul_mat(&c, dst, &srcs[0], &srcs[1]),
        Op::MulMatId => matmul::mul_mat_id(&c, dst, &srcs[0], &srcs[1], &srcs[2], &srcs[3], status),
        Op::Penalize => sample::penalize(&c, dst, &srcs[0], &srcs[1], &srcs[2]),
        Op::Sample => sample::sample(&c, dst, &srcs[0], &srcs[1], &srcs[2]),
        Op::Input | Op::Weight | Op::Persistent | Op::View => {
            Err(c.err("has no kernel (leaves and views are not executed)"))
        }
    }
}

/// Plans the fused decode attention of the chain that starts at `node` (its q @ K^T product).
pub(crate) fn attention(node: &ExecNode, a: &Attn, lim: Limits) -> Result<Vec<Dispatch>> {
    attention::attention(&Ctx { node, lim }, a)
}

/// Plans the fused `RmsNorm -> Mul` that starts at `node` (the norm): `x` normalised with `eps`
/// times `w` broadcast onto it, into `dst`.
pub(crate) fn norm_mul(
    node: &ExecNode,
    dst: &Res,
    x: &Res,
    w: &Res,
    eps: f32,
    lim: Limits,
) -> Result<Vec<Dispatch>> {
    let c = Ctx { node, lim };
    rows::row_kernel(&c, "rms_norm_mul", dst, x, Some(w), eps)
}

/// Plans the decode product at `node` with the element-wise op that consumes it in its store
/// (`crate::fusion` proved the product dead): `epi` of each element of `a @ b` and the same
/// element of `e`, into `dst`; `None` when no fused kernel takes the operands.
pub(crate) fn mul_mat_epilogue(
    node: &ExecNode,
    dst: &Res,
    [a, b, e]: [&Res; 3],
    epi: Epilogue,
    lim: Limits,
) -> Result<Option<Dispatch>> {
    matmul::mul_mat_epilogue(&Ctx { node, lim }, dst, a, b, e, epi)
}

/// Plans SwiGLU of the two decode products at `node` (the first of them) as one dispatch:
/// `silu(x @ gate.T) * (x @ up.T)` into `dst` (`crate::fusion` proved both products dead);
/// `None` when no two-weight kernel takes the operands.
pub(crate) fn mul_mat_glu(
    node: &ExecNode,
    dst: &Res,
    [x, gate, up]: [&Res; 3],
    lim: Limits,
) -> Result<Option<Dispatch>> {
    matmul::mul_mat_glu(&Ctx { node, lim }, dst, x, gate, up)
}

/// Folds the RmsNorm (`eps`, times its weight `g`) that feeds the decode product at `node`
/// into its planned dispatch `d` (planned with the norm's source as x); `None` when no kernel
/// flavour takes it.
pub(crate) fn with_norm(
    node: &ExecNode,
    d: Dispatch,
    g: &Res,
    eps: f32,
    lim: Limits,
) -> Result<Option<Dispatch>> {
    matmul::with_norm(&Ctx { node, lim }, d, g, eps)
}

/// Plans the fused `Rope -> SetRows` of one token (`crate::fusion` proved the rotated row dead):
/// `x` [1, H, D] rotated at `pos` as `rope` (mode, n_dims, theta) gives, into row `ids[0]` of
/// `cache`; `None` when the fused kernel does not take the operands.
pub(crate) fn rope_set_rows(
    node: &ExecNode,
    [cache, x, pos, ids]: [&Res; 4],
    rope: (lowsync_graph::RopeMode, usize, f32),
    status: Option<Status>,
    lim: Limits,
) -> Result<Option<Dispatch>> {
    rows::rope_set_rows(&Ctx { node, lim }, cache, x, pos, ids, rope, status)
}

/// Plans the decode product at `node` (one row, its own result `product`) written into row
/// `ids[0]` of `cache` by the `SetRows` that consumed it (`crate::fusion` proved the product
/// dead); `None` when no fused kernel takes the operands.
pub(crate) fn mul_mat_set_rows(
    node: &ExecNode,
    operands: [&Res; 5],
    status: Option<Status>,
    lim: Limits,
) -> Result<Option<Dispatch>> {
    matmul::mul_mat_set_rows(&Ctx { node, lim }, operands, status)
}
