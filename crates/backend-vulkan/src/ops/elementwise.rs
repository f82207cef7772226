//! Element-wise kernels: `Add`, `Mul`, `Scale`, `Silu`, `Gelu`, `SwiGlu`, `Cpy` and `Concat`
//! (two copies into slices of its destination).
//!
//! Why: these ops run on views of any layout (broadcast sources, strided slices of the KV
//! cache), so one 4-D kernel with per-view strides covers them all instead of one kernel per
//! layout.
//!
//! Strategy: the destination and both sources are coalesced together and padded to rank 4;
//! a broadcast axis has stride 0. Integer copies use the raw 32-bit copy kernel.
//!
//! Invariant: the shapes of sources and result are checked against the op's rule before any
//! stride reaches the kernel.

use lowsync_backend::Result;
use lowsync_graph::{DType, Op};

use super::layout::{coalesce, dt, pad, Ctx, Dispatch, Res};
use crate::pipelines::Push;

/// A 4-D element-wise dispatch of `kernel` over `dst` with sources `a` and `b` (strides
/// already broadcast to `dst`'s shape).
fn elementwise_dispatch(
    c: &Ctx,
    kernel: String,
    dst: &Res,
    a: (&Res, Vec<usize>),
    b: (&Res, Vec<usize>),
    op: u32,
    prm: u32,
) -> Result<Dispatch> {
    let (sh, st) = coalesce(&dst.shape, &[dst.strides.clone(), a.1, b.1]);
    let (sh, st) = pad(&sh, &st, 4).ok_or_else(|| {
        c.err(format!(
            "views of shape {:?} do not reduce to 4 dimensions",
            dst.shape
        ))
    })?;
    let n = dst.numel();
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(a.0, false)?;
    let (bb, ob) = c.bind(b.0, false)?;
    let push = Push {
        shape: c.u4(&sh, "extent")?,
        d_str: c.u4(&st[0], "stride")?,
        a_str: c.u4(&st[1], "stride")?,
        b_str: c.u4(&st[2], "stride")?,
        offs: [od, oa, ob, c.u32(n, "element count")?],
        op: [op, 0, 0, 0],
        prm: [prm, 0, 0, 0],
        pad: [0; 4],
    };
    Ok(Dispatch {
        kernel,
        binds: vec![bd, ba, bb],
        push,
        groups: c.spread(n, 256)?,
    })
}

pub(super) fn eltwise(c: &Ctx, dst: &Res, s: &[Res]) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    for x in s {
        c.float("sources", x.dtype)?;
    }
    let a = &s[0];
    c.same_shape("first source", a, dst)?;
    let (code, scale) = match c.node.op {
        Op::Add => (0, 0.0),
        Op::Mul => (1, 0.0),
        Op::Scale { scale } => (2, scale),
        Op::Silu => (3, 0.0),
        Op::Gelu => (4, 0.0),
        Op::SwiGlu => (5, 0.0),
        _ => return Err(c.err("is not element-wise")),
    };
    let b = match c.node.op {
        Op::Add | Op::Mul => {
            let b = &s[1];
            let st = b.broadcast_to(&dst.shape).ok_or_else(|| {
                c.err(format!(
                    "cannot broadcast {:?} onto {:?}",
                    b.shape, dst.shape
                ))
            })?;
            (b, st)
        }
        Op::SwiGlu => {
            c.same_shape("up", &s[1], dst)?;
            (&s[1], s[1].strides.clone())
        }
        _ => (a, a.strides.clone()),
    };
    let kernel = format!(
        "eltwise.d_{}.a_{}.b_{}",
        dt(dst.dtype),
        dt(a.dtype),
        dt(b.0.dtype)
    );
    let d = elementwise_dispatch(
        c,
        kernel,
        dst,
        (a, a.strides.clone()),
        b,
        code,
        scale.to_bits(),
    )?;
    Ok(vec![d])
}

pub(super) fn copy(c: &Ctx, dst: &Res, src: &Res) -> Result<Dispatch> {
    c.same_shape("source", src, dst)?;
    if src.dtype.is_float() != dst.dtype.is_float() {
        return Err(c.err(format!("cannot convert {} to {}", src.dtype, dst.dtype)));
    }
    let kernel = if dst.dtype == DType::I32 {
        "copy_raw.d_u32.a_u32".to_string()
    } else {
        format!(
            "eltwise.d_{}.a_{}.b_{}",
            dt(dst.dtype),
            dt(src.dtype),
            dt(src.dtype)
        )
    };
    let (d, s) = (dst.clone(), src.clone());
    let mut disp = elementwise_dispatch(
        c,
        kernel,
        &d,
        (&s, s.strides.clone()),
        (&s, s.strides.clone()),
        6,
        0,
    )?;
    if dst.dtype == DType::I32 {
        // copy_raw has two bindings.
        disp.binds.truncate(2);
    }
    Ok(disp)
}

pub(super) fn concat(c: &Ctx, dst: &Res, a: &Res, b: &Res, axis: usize) -> Result<Vec<Dispatch>> {
    let (sa, sb, sd) = (&a.shape, &b.shape, &dst.shape);
    let ok = sa.len() == sb.len()
        && sd.len() == sa.len()
        && axis < sa.len()
        && (0..sa.len()).all(|i| {
            if i == axis {
                sd[i] == sa[i] + sb[i]
            } else {
                sa[i] == sb[i] && sd[i] == sa[i]
            }
        });
    if !ok {
        return Err(c.err(format!(
            "cannot concatenate {sa:?} and {sb:?} along axis {axis} into {sd:?}"
        )));
    }
    let mut out = Vec::new();
    for (src, start) in [(a, 0), (b, sa[axis])] {
        if src.numel() > 0 {
            out.push(copy(c, &dst.slice_axis(axis, start, src.shape[axis]), src)?);
        }
    }
    Ok(out)
}
