//! `Argmax` over the last axis, as i32.
//!
//! Ties keep the lowest index (only a strictly larger value replaces the best). `NaN` is
//! treated as smaller than every number: it is never picked while the row has a number, and a
//! row of only `NaN`s gives index 0. One row per job.

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::DType;

use super::par::for_each_row;
use super::view::Strided;
use super::{float_src, kernel_err};

pub(super) fn argmax(node: &ExecNode, dst: &Strided, x: &Strided) -> Result<()> {
    float_src(node, "x", x)?;
    if dst.dtype() != DType::I32 {
        return Err(kernel_err(
            node,
            format!("result must be i32, got {}", dst.dtype()),
        ));
    }
    let want = &x.shape()[..x.rank().saturating_sub(1)];
    if x.rank() == 0 || dst.shape() != want {
        return Err(kernel_err(
            node,
            format!(
                "x {:?} needs a result of shape {want:?}, got {:?}",
                x.shape(),
                dst.shape()
            ),
        ));
    }
    let (rows, len) = (x.rows(), x.last_len());
    if rows == 0 {
        return Ok(());
    }
    if len == 0 {
        return Err(kernel_err(
            node,
            format!("argmax of an empty last axis ({:?})", x.shape()),
        ));
    }
    for_each_row(
        rows,
        len,
        || vec![0.0f32; len],
        |buf, r| {
            x.read_row(r, 0..len, buf);
            dst.write_i32(r, argmax_row(buf) as i32);
        },
    );
    Ok(())
}

/// Index of the largest value, lowest on ties, `NaN` below everything.
pub(crate) fn argmax_row(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate().skip(1) {
        let b = v[best];
        if x > b || (b.is_nan() && !x.is_nan()) {
            best = i;
        }
    }
    best
}
