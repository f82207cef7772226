//! Element-wise ops: `Add`, `Mul` (numpy broadcast of `b` onto `a`), `Scale`, `Silu`, `Gelu`,
//! `SwiGlu`.
//!
//! Strategy: the destination and the (broadcast) sources are coalesced together into long rows,
//! then processed in segments: read a run of `a` (and `b`) into f32 scratch, apply the op over
//! the slice (a tight loop the compiler vectorises), write the run converted to the
//! destination's dtype. A segment reads all its inputs before writing, and the destination has
//! the first source's layout when it runs in place, so in-place execution is safe.

use lowsync_backend::{ExecNode, Result};

use super::par::{for_each_segment, segment_buf, Threads};
use super::view::{coalesce, Strided};
use super::{float_dst, kernel_err, same_shape};

/// `x * sigmoid(x)`, written as `x / (1 + e^-x)` so that a large negative `x` (where `e^-x`
/// overflows to infinity) gives `-0` instead of `NaN`.
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
#[inline]
fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `dst = f(a)` element by element.
fn map1(dst: &Strided, a: &Strided, f: impl Fn(&mut [f32]) + Sync + Send) {
    let v = coalesce(&[dst, a]);
    let (d, a) = (&v[0], &v[1]);
    let (rows, len) = (d.rows(), d.last_len());
    for_each_segment(
        Threads::Auto,
        rows,
        len,
        || segment_buf(len),
        |buf, r, cols| {
            let buf = &mut buf[..cols.len()];
            a.read_row(r, cols.clone(), buf);
            f(buf);
            d.write_row(r, cols, buf);
        },
    );
}

/// `dst = f(a, b)` element by element; `b` already has `a`'s shape (possibly broadcast).
fn map2(dst: &Strided, a: &Strided, b: &Strided, f: impl Fn(&mut [f32], &[f32]) + Sync + Send) {
    let v = coalesce(&[dst, a, b]);
    let (d, a, b) = (&v[0], &v[1], &v[2]);
    let (rows, len) = (d.rows(), d.last_len());
    for_each_segment(
        Threads::Auto,
        rows,
        len,
        || (segment_buf(len), segment_buf(len)),
        |(x, y), r, cols| {
            let (x, y) = (&mut x[..cols.len()], &mut y[..cols.len()]);
            a.read_row(r, cols.clone(), x);
            b.read_row(r, cols.clone(), y);
            f(x, y);
            d.write_row(r, cols, x);
        },
    );
}

/// The element-wise op of `node`, on resolved views.
pub(super) fn run(node: &ExecNode, dst: &Strided, srcs: &[Strided]) -> Result<()> {
    use lowsync_graph::Op;
    float_dst(node, dst)?;
    for s in srcs {
        if !s.dtype().is_float() {
            return Err(kernel_err(
                node,
                format!("sources must be float tensors, got {}", s.dtype()),
            ));
        }
    }
    let a = &srcs[0];
    same_shape(node, "first source", a, dst)?;
    let broadcast_b = || -> Result<Strided> {
        let b = &srcs[1];
        b.broadcast_to(dst.shape()).ok_or_else(|| {
            kernel_err(
                node,
                format!("cannot broadcast {:?} onto {:?}", b.shape(), dst.shape()),
            )
        })
    };
    match node.op {
        Op::Add => map2(dst, a, &broadcast_b()?, |x, y| {
            x.iter_mut().zip(y).for_each(|(x, y)| *x += y)
        }),
        Op::Mul => map2(dst, a, &broadcast_b()?, |x, y| {
            x.iter_mut().zip(y).for_each(|(x, y)| *x *= y)
        }),
        Op::SwiGlu => {
            same_shape(node, "up", &srcs[1], dst)?;
            map2(dst, a, &srcs[1], |g, u| {
                g.iter_mut().zip(u).for_each(|(g, u)| *g = silu(*g) * u)
            })
        }
        Op::Scale { scale } => map1(dst, a, |x| x.iter_mut().for_each(|x| *x *= scale)),
        Op::Silu => map1(dst, a, |x| x.iter_mut().for_each(|x| *x = silu(*x))),
        Op::Gelu => map1(dst, a, |x| x.iter_mut().for_each(|x| *x = gelu(*x))),
        other => {
            return Err(kernel_err(
                node,
                format!("{} is not element-wise", other.name()),
            ))
        }
    }
    Ok(())
}
