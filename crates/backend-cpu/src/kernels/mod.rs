//! CPU reference kernels: [`run_node`] runs one [`ExecNode`] on host memory.
//!
//! Why: every other backend is checked against these kernels, and the `cpu` / `cpu-async`
//! backends run them directly, so they favour clear, exact semantics (those of
//! `lowsync_graph::Op`) over peak speed, while keeping decode-sized work cheap.
//!
//! Strategy: tensors are resolved through the bounds-checked [`Mem::ptr`] into strided views
//! (`view`), the only code that dereferences raw memory. All arithmetic is f32: f16/bf16
//! inputs are widened, results are rounded to the destination's dtype. Kernels validate the
//! shapes they rely on and return [`Error::Kernel`] instead of panicking, and bad indices
//! (`GetRows`, `SetRows`, `MulMatId`) are reported before anything is written. Threads are
//! used only above a size threshold and never split a reduction (`par`), so results are
//! bit-identical run to run and for any thread count.
//!
//! Aliasing: a destination may share memory with its first source only in the two ways the
//! graph allows (an in-place element-wise op with the same layout, and `SetRows` writing the
//! tensor it aliases). Any other source that overlaps the destination is first copied to
//! private memory, so a kernel never reads what it already overwrote.
//!
//! Fusion: `plan` turns a graph into `Step`s, each a node or an attention chain that
//! `attention` runs as one kernel reading only the cells its mask lets through.
//!
//! Modules: `elementwise` (add, mul, scale, silu, gelu, swiglu), `norm` (rms_norm),
//! `softmax`, `rope`, `argmax`, `rows` (get_rows, set_rows), `copy` (cpy, concat and
//! the strided copy engine), `matmul` (mul_mat, mul_mat_id), `gemv` (decode products over
//! float weights), `dot512` (the AVX-512 tiles of decode, prefill and attention-score dot
//! products over float rows), `dot256` (the AVX2 prefill tiles), `attention` (the fused attention chain), `quant` (block-dtype weights:
//! the scalar dequantization oracle, get_rows and the products over quantized weights).

mod argmax;
mod attention;
mod copy;
#[cfg(target_arch = "x86_64")]
mod dot256;
#[cfg(target_arch = "x86_64")]
mod dot512;
mod elementwise;
mod gemv;
mod matmul;
mod norm;
mod par;
mod quant;
mod rope;
mod rows;
mod sample;
mod softmax;
mod view;

#[cfg(test)]
mod tests;

use lowsync_backend::{Error, ExecGraph, ExecNode, Result};
use lowsync_graph::Op;

use crate::memory::Mem;
use view::Strided;

/// Dequantizes `bytes`, whole blocks of the block dtype `dt`, into the `out.len()` values
/// they hold, with the scalar reference every quantized kernel is checked against
/// (bit-exact with `gguf.quants.dequantize`); in parallel over rows of blocks above a size
/// threshold. An error (nothing written) when `dt` is not a block dtype or the byte count
/// is not exactly that of `out.len()` elements.
pub fn dequantize(
    dt: lowsync_graph::DType,
    bytes: &[u8],
    out: &mut [f32],
) -> std::result::Result<(), String> {
    if !dt.is_quantized() {
        return Err(format!("{dt} is not a block (quantized) dtype"));
    }
    if dt.checked_bytes(out.len()) != Some(bytes.len()) {
        return Err(format!(
            "{} bytes do not hold {} elements of {dt} ({} elements of {} bytes per block)",
            bytes.len(),
            out.len(),
            dt.block_size(),
            dt.block_bytes()
        ));
    }
    // Chunks of whole blocks: about par::JOB_ELEMS elements each.
    let blocks = (par::JOB_ELEMS / dt.block_size()).max(1);
    let (elems, nbytes) = (blocks * dt.block_size(), blocks * dt.block_bytes());
    let job = |(o, b): (&mut [f32], &[u8])| quant::scalar::dequantize_row(dt, b, o);
    if out.len() <= par::PAR_MIN_ELEMS {
        out.chunks_mut(elems)
            .zip(bytes.chunks(nbytes))
            .for_each(job);
    } else {
        use rayon::prelude::*;
        out.par_chunks_mut(elems)
            .zip(bytes.par_chunks(nbytes))
            .for_each(job);
    }
    Ok(())
}

/// One step of a graph run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Node `i`, by itself.
    Node(usize),
    /// Nodes `i..i + 3`, an attention chain, as one kernel (`attention`).
    Attention(usize),
}

/// The steps that run `graph`'s nodes in order, each attention chain that `attention` proves
/// safe to fuse as one step.
pub(crate) fn plan(graph: &ExecGraph) -> Vec<Step> {
    let nodes = &graph.nodes;
    let mut steps = Vec::with_capacity(nodes.len());
    let mut i = 0;
    while i < nodes.len() {
        if attention::fusable(nodes, i, graph.scratch.as_ref()) {
            steps.push(Step::Attention(i));
            i += 3;
        } else {
            steps.push(Step::Node(i));
            i += 1;
        }
    }
    tracing::debug!(
        nodes = nodes.len(),
        attention = steps
            .iter()
            .filter(|s| matches!(s, Step::Attention(_)))
            .count(),
        "cpu graph plan"
    );
    steps
}

/// Runs one step of `graph` (from [`plan`] of the same graph).
pub(crate) fn run_step(graph: &ExecGraph, step: Step, mem: &dyn Mem) -> Result<()> {
    match step {
        Step::Node(i) => run_node(&graph.nodes[i], mem),
        Step::Attention(i) => {
            for n in &graph.nodes[i..i + 3] {
                n.op.check_arity(n.srcs.len())
                    .map_err(|m| kernel_err(n, m))?;
            }
            attention::run(&graph.nodes, i, mem)
        }
    }
}

/// Runs one compute node: reads `node.srcs`, writes `node.dst`.
///
/// Leaves (`Input`, `Weight`, `Persistent`) and `View` have no kernel and are an error here.
pub fn run_node(node: &ExecNode, mem: &dyn Mem) -> Result<()> {
    node.op
        .check_arity(node.srcs.len())
        .map_err(|m| kernel_err(node, m))?;
    let dst = Strided::resolve(node, &node.dst, mem)?;
    let mut private = Vec::new();
    let mut srcs = Vec::with_capacity(node.srcs.len());
    for (i, t) in node.srcs.iter().enumerate() {
        let v = Strided::resolve(node, t, mem)?;
        if node.src_needs_private_copy(i) {
            let (buf, copy) = v.detach();
            private.push(buf);
            srcs.push(copy);
        } else {
            srcs.push(v);
        }
    }
    let result = dispatch(node, &dst, &srcs);
    drop(private);
    result
}

fn dispatch(node: &ExecNode, dst: &Strided, s: &[Strided]) -> Result<()> {
    match node.op {
        Op::Add | Op::Mul | Op::Scale { .. } | Op::Silu | Op::Gelu | Op::SwiGlu => {
            elementwise::run(node, dst, s)
        }
        Op::RmsNorm { eps } => norm::rms_norm(node, dst, &s[0], eps),
        Op::SoftMax { scale } => softmax::soft_max(node, dst, &s[0], s.get(1), scale),
        Op::Rope {
            mode,
            n_dims,
            theta_base,
        } => rope::rope(node, dst, &s[0], &s[1], mode, n_dims, theta_base),
        Op::Argmax => argmax::argmax(node, dst, &s[0]),
        Op::GetRows => rows::get_rows(node, dst, &s[0], &s[1]),
        Op::SetRows => rows::set_rows(node, dst, &s[0], &s[1], &s[2]),
        Op::Cpy => copy::cpy(node, dst, &s[0]),
        Op::Concat { axis } => copy::concat(node, dst, &s[0], &s[1], axis),
        Op::MulMat => matmul::mul_mat(node, dst, &s[0], &s[1]),
        Op::MulMatId => matmul::mul_mat_id(node, dst, &s[0], &s[1], &s[2], &s[3]),
        Op::Penalize => sample::penalize(node, dst, &s[0], &s[1], &s[2]),
        Op::Sample => sample::sample(node, dst, &s[0], &s[1], &s[2]),
        Op::Input | Op::Weight | Op::Persistent | Op::View => Err(kernel_err(
            node,
            "has no kernel (leaves and views are not executed)",
        )),
    }
}

/// An [`Error::Kernel`] for `node`.
pub(crate) fn kernel_err(node: &ExecNode, msg: impl Into<String>) -> Error {
    node.kernel_error(msg)
}

/// `src` must have the destination's shape.
fn same_shape(node: &ExecNode, what: &str, src: &Strided, dst: &Strided) -> Result<()> {
    if src.shape() != dst.shape() {
        return Err(kernel_err(
            node,
            format!(
                "{what} has shape {:?} but the result has {:?}",
                src.shape(),
                dst.shape()
            ),
        ));
    }
    Ok(())
}

/// The destination must be a float tensor.
fn float_dst(node: &ExecNode, dst: &Strided) -> Result<()> {
    if !dst.dtype().is_float() {
        return Err(kernel_err(
            node,
            format!("result must be a float tensor, got {}", dst.dtype()),
        ));
    }
    Ok(())
}

/// A source that must be a float tensor.
fn float_src(node: &ExecNode, what: &str, s: &Strided) -> Result<()> {
    if !s.dtype().is_float() {
        return Err(kernel_err(
            node,
            format!("{what} must be a float tensor, got {}", s.dtype()),
        ));
    }
    Ok(())
}
