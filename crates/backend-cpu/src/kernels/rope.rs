//! `Rope`: rotary position embedding of `x [T, H, D]` at positions `pos i32 [T]`.
//!
//! For pair `i < n_dims / 2` the angle is `pos * theta_base^(-2i / n_dims)`. `Normal` rotates
//! `(x[2i], x[2i+1])`, `Neox` rotates `(x[i], x[i + n_dims/2])`, each as
//! `(a, b) -> (a cos - b sin, a sin + b cos)`; dims `>= n_dims` are copied unchanged.
//!
//! Precision: angles, `cos` and `sin` are computed in f64 and then rounded to f32 (the
//! rotation itself is f32). This is slightly more accurate than ggml, which forms the angle by
//! repeated f32 multiplication; at large positions the two can differ by ~1e-4 relative.
//!
//! Strategy: a `[T, n_dims/2]` table of `(cos, sin)` is built once per call, then the `T * H`
//! rows are rotated independently (in parallel when large).

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::{DType, RopeMode};

use super::par::for_each_row;
use super::view::Strided;
use super::{float_dst, float_src, kernel_err, same_shape};

pub(super) fn rope(
    node: &ExecNode,
    dst: &Strided,
    x: &Strided,
    pos: &Strided,
    mode: RopeMode,
    n_dims: usize,
    theta_base: f32,
) -> Result<()> {
    float_dst(node, dst)?;
    float_src(node, "x", x)?;
    same_shape(node, "x", x, dst)?;
    if x.rank() != 3 || pos.dtype() != DType::I32 || pos.shape() != [x.shape()[0]] {
        return Err(kernel_err(
            node,
            format!(
                "expects x [T, H, D] and i32 positions [T]; got {:?} and {} {:?}",
                x.shape(),
                pos.dtype(),
                pos.shape()
            ),
        ));
    }
    let (t, h, d) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    if n_dims == 0 || n_dims % 2 == 1 || n_dims > d {
        return Err(kernel_err(
            node,
            format!("n_dims {n_dims} must be even, > 0 and <= head_dim {d}"),
        ));
    }
    if x.numel() == 0 {
        return Ok(());
    }
    let half = n_dims / 2;
    let positions = pos.read_all_i32();
    let freqs: Vec<f64> = (0..half)
        .map(|i| (theta_base as f64).powf(-2.0 * i as f64 / n_dims as f64))
        .collect();
    let table: Vec<(f32, f32)> = positions
        .iter()
        .flat_map(|&p| {
            freqs.iter().map(move |f| {
                let (s, c) = (p as f64 * f).sin_cos();
                (c as f32, s as f32)
            })
        })
        .collect();
    for_each_row(
        t * h,
        d,
        || vec![0.0f32; d],
        |buf, r| {
            let cs = &table[(r / h) * half..(r / h + 1) * half];
            x.read_row(r, 0..d, buf);
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (ia, ib) = match mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (a, b) = (buf[ia], buf[ib]);
                buf[ia] = a * c - b * s;
                buf[ib] = a * s + b * c;
            }
            dst.write_row(r, 0..d, buf);
        },
    );
    Ok(())
}
