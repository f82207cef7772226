//! `Penalize` and `Sample`: the sampler after the output head, one row per output token.
//!
//! The algorithm is `lowsync_graph::sampling`, written once; these kernels only read the rows
//! and call it, so the CPU backend is the oracle the CUDA and Vulkan kernels are checked
//! against. Shapes are checked here as well as in the builder: a backend never trusts a graph.

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::sampling::{penalize_row, sample_row, SampleParams};
use lowsync_graph::DType;

use super::kernel_err;
use super::par::for_each_row;
use super::view::Strided;

fn expect(node: &ExecNode, what: &str, t: &Strided, dtype: DType, shape: &[usize]) -> Result<()> {
    if t.dtype() != dtype || t.shape() != shape {
        return Err(kernel_err(
            node,
            format!(
                "{what} must be {dtype} {shape:?}, got {} {:?}",
                t.dtype(),
                t.shape()
            ),
        ));
    }
    Ok(())
}

/// Reads row `r` of an i32 matrix (small: histories and keys).
fn i32_row(all: &[i32], cols: usize, r: usize) -> &[i32] {
    &all[r * cols..(r + 1) * cols]
}

/// `dst = logits` with llama.cpp's repeat / frequency / presence penalties on the ids of `hist`.
pub(super) fn penalize(
    node: &ExecNode,
    dst: &Strided,
    logits: &Strided,
    hist: &Strided,
    params: &Strided,
) -> Result<()> {
    if logits.rank() != 2 {
        return Err(kernel_err(
            node,
            format!("logits must be [R, V], got {:?}", logits.shape()),
        ));
    }
    let (rows, v) = (logits.shape()[0], logits.shape()[1]);
    expect(node, "logits", logits, DType::F32, &[rows, v])?;
    expect(node, "result", dst, DType::F32, &[rows, v])?;
    if hist.rank() != 2 {
        return Err(kernel_err(
            node,
            format!("hist must be [R, N], got {:?}", hist.shape()),
        ));
    }
    let n = hist.shape()[1];
    expect(node, "hist", hist, DType::I32, &[rows, n])?;
    expect(node, "params", params, DType::F32, &[rows, 3])?;
    let hist_all = hist.read_all_i32();
    let mut p = vec![0.0f32; 3 * rows];
    for r in 0..rows {
        params.read_row(r, 0..3, &mut p[3 * r..3 * r + 3]);
    }
    for_each_row(
        rows,
        v,
        || vec![0.0f32; v],
        |buf, r| {
            logits.read_row(r, 0..v, buf);
            let q = &p[3 * r..3 * r + 3];
            penalize_row(buf, i32_row(&hist_all, n, r), q[0], q[1], q[2]);
            dst.write_row(r, 0..v, buf);
        },
    );
    Ok(())
}

/// `dst[r]` = the token drawn from row `r` of `logits` (see `lowsync_graph::sampling`).
pub(super) fn sample(
    node: &ExecNode,
    dst: &Strided,
    logits: &Strided,
    params: &Strided,
    key: &Strided,
) -> Result<()> {
    if logits.rank() != 2 || logits.shape()[1] == 0 {
        return Err(kernel_err(
            node,
            format!("logits must be [R, V] with V > 0, got {:?}", logits.shape()),
        ));
    }
    let (rows, v) = (logits.shape()[0], logits.shape()[1]);
    expect(node, "logits", logits, DType::F32, &[rows, v])?;
    expect(node, "result", dst, DType::I32, &[rows])?;
    expect(node, "params", params, DType::F32, &[rows, 4])?;
    expect(node, "key", key, DType::I32, &[rows, 2])?;
    let keys = key.read_all_i32();
    let mut p = vec![0.0f32; 4 * rows];
    for r in 0..rows {
        params.read_row(r, 0..4, &mut p[4 * r..4 * r + 4]);
    }
    for_each_row(
        rows,
        v,
        || vec![0.0f32; v],
        |buf, r| {
            logits.read_row(r, 0..v, buf);
            let k = i32_row(&keys, 2, r);
            let t = sample_row(
                buf,
                SampleParams::from_row(&p[4 * r..4 * r + 4]),
                k[0] as u32,
                k[1] as u32,
            );
            dst.write_i32(r, t as i32);
        },
    );
    Ok(())
}
