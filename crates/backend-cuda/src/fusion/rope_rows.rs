//! The launcher of `rope_rows` (rope_rows.cu): `Rope -> SetRows` of its result into the K
//! cache, plus the plain `SetRows` of the V row.
//!
//! Why: decode rotates k and writes it and v into the caches every layer: three launches of a
//! few hundred bytes each, where one does.
//!
//! Strategy: the rope kernel's own leading parameters (`exec::ops::rope_args`), then the cache
//! row of the rope's result, then the plain copy (zeros when there is none); one work item per
//! rotary pair or copied dim, then one per element of the plain row.
//!
//! Invariant: SetRows' rules hold for both writes (a row whose index a later row repeats is
//! skipped; a bad index is reported with its node's tag through the error word).

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::Op;

use crate::exec::launch::{dt, grid_for, kernel_err, Exec, BLOCK};
use crate::exec::ops::rope_args;
use crate::kernels::Kernel;

pub(super) fn launch_rope_rows(
    exec: &Exec<'_>,
    rope: &ExecNode,
    rows: &ExecNode,
    plain: Option<&ExecNode>,
) -> Result<()> {
    let Op::Rope {
        mode,
        n_dims,
        theta_base,
    } = rope.op
    else {
        return Err(kernel_err(rope, "fused as a rope but is not one"));
    };
    let x = exec.resolve(&rope.srcs[0])?;
    let pos = exec.resolve(&rope.srcs[1])?;
    let r = exec.resolve(&rope.dst)?;
    let c = exec.resolve(&rows.dst)?;
    let idx = exec.resolve(&rows.srcs[2])?;
    let (t, h, d) = (x.shape[0], x.shape[1], x.shape[2]);
    let args = rope_args(&r, &x, &pos, mode, n_dims, theta_base)
        .arg(c.ptr)
        .arg(dt(c.dtype))
        .arg(c.strides[0] as i64)
        .arg(c.strides[1] as i64)
        .arg(c.shape[0] as i64)
        .arg(idx.ptr)
        .arg(idx.strides[0] as i64)
        .arg(exec.tag(rows));
    let mut n2 = 0usize;
    let args = match plain {
        Some(p) => {
            let c2 = exec.resolve(&p.dst)?;
            let s2 = exec.resolve(&p.srcs[1])?;
            let idx2 = exec.resolve(&p.srcs[2])?;
            n2 = s2.numel();
            args.arg(s2.shape[0] as i64)
                .arg(s2.shape[1] as i64)
                .arg(c2.ptr)
                .arg(dt(c2.dtype))
                .arg(c2.strides[0] as i64)
                .arg(c2.strides[1] as i64)
                .arg(c2.shape[0] as i64)
                .arg(s2.ptr)
                .arg(dt(s2.dtype))
                .arg(s2.strides[0] as i64)
                .arg(s2.strides[1] as i64)
                .arg(idx2.ptr)
                .arg(idx2.strides[0] as i64)
                .arg(exec.tag(p))
        }
        None => args
            .arg(0i64)
            .arg(0i64)
            .arg(0u64)
            .arg(0i32)
            .arg(0i64)
            .arg(0i64)
            .arg(0i64)
            .arg(0u64)
            .arg(0i32)
            .arg(0i64)
            .arg(0i64)
            .arg(0u64)
            .arg(0i64)
            .arg(0u32),
    };
    let args = args.arg(exec.inner.err_word.dev());
    let n1 = t * h * (n_dims / 2 + (d - n_dims));
    exec.launch(rope, Kernel::RopeRows, grid_for(n1 + n2), BLOCK, args)
}
