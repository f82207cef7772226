//! `RmsNorm`: `x / sqrt(mean(x^2) + eps)` over the last axis.
//!
//! Strategy: one row per job (the sum of squares is accumulated sequentially in f32 within
//! the row, so the result does not depend on threading); rows run in parallel when large.

use lowsync_backend::{ExecNode, Result};

use super::par::for_each_row;
use super::view::Strided;
use super::{float_dst, float_src, same_shape};

pub(super) fn rms_norm(node: &ExecNode, dst: &Strided, x: &Strided, eps: f32) -> Result<()> {
    float_dst(node, dst)?;
    float_src(node, "x", x)?;
    same_shape(node, "x", x, dst)?;
    let (rows, len) = (x.rows(), x.last_len());
    if len == 0 {
        return Ok(());
    }
    for_each_row(
        rows,
        len,
        || vec![0.0f32; len],
        |buf, r| {
            x.read_row(r, 0..len, buf);
            let sum_sq: f32 = buf.iter().map(|v| v * v).sum();
            let inv = 1.0 / (sum_sq / len as f32 + eps).sqrt();
            buf.iter_mut().for_each(|v| *v *= inv);
            dst.write_row(r, 0..len, buf);
        },
    );
    Ok(())
}
