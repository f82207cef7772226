//! `SoftMax`: `softmax(x * scale + mask)` over the last axis.
//!
//! Strategy: the optional mask is broadcast onto `x` (stride-0 axes) and read row by row next
//! to `x`. Each row subtracts its maximum before `exp` for stability. A row whose entries are
//! all `-inf` (fully masked, or empty) has no maximum to subtract and gives zeros instead of
//! `NaN`. A `NaN` in a row makes its maximum `NaN` (the fold does not skip it, unlike
//! `f32::max`), so the whole row comes out `NaN`: one bad weight shows in the logits instead
//! of vanishing into finite values. One row per job, so sums never depend on threading.

use lowsync_backend::{ExecNode, Result};

use super::par::for_each_row;
use super::view::Strided;
use super::{float_dst, float_src, kernel_err, same_shape};

pub(super) fn soft_max(
    node: &ExecNode,
    dst: &Strided,
    x: &Strided,
    mask: Option<&Strided>,
    scale: f32,
) -> Result<()> {
    float_dst(node, dst)?;
    float_src(node, "x", x)?;
    same_shape(node, "x", x, dst)?;
    let mask = match mask {
        None => None,
        Some(m) => {
            float_src(node, "mask", m)?;
            Some(m.broadcast_to(x.shape()).ok_or_else(|| {
                kernel_err(
                    node,
                    format!(
                        "mask {:?} does not broadcast onto {:?}",
                        m.shape(),
                        x.shape()
                    ),
                )
            })?)
        }
    };
    let (rows, len) = (x.rows(), x.last_len());
    if len == 0 {
        return Ok(());
    }
    for_each_row(
        rows,
        len,
        || (vec![0.0f32; len], vec![0.0f32; len]),
        |(v, m), r| {
            x.read_row(r, 0..len, v);
            match &mask {
                Some(mask) => {
                    mask.read_row(r, 0..len, m);
                    v.iter_mut()
                        .zip(m.iter())
                        .for_each(|(v, m)| *v = *v * scale + m);
                }
                None => v.iter_mut().for_each(|v| *v *= scale),
            }
            softmax_in_place(v);
            dst.write_row(r, 0..len, v);
        },
    );
    Ok(())
}

/// Softmax of one row in place; an all `-inf` row becomes zeros, a row with a `NaN` all `NaN`.
pub(super) fn softmax_in_place(v: &mut [f32]) {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, nan_max);
    if max == f32::NEG_INFINITY {
        v.fill(0.0);
        return;
    }
    let mut sum = 0.0f32;
    for x in v.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    v.iter_mut().for_each(|x| *x *= inv);
}

/// The larger of two values, `NaN` when either is `NaN` (`f32::max` returns the other one).
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}
