//! The launcher of `rms_norm_mul` (norm_mul.cu): `RmsNorm -> Mul(norm, weight row)`.
//!
//! Why: every llama layer normalizes twice and multiplies by a weight row right after; as one
//! kernel each row is read once and the norm's result never makes a round trip before the Mul.
//!
//! Strategy: one block per row, four values per thread (a decode row in one round trip); the
//! rows iterate a coalesced `Lay` over the leading axes of the norm, x and the product.
//!
//! Invariant: the norm's result is written and read back rounded to its dtype before the
//! product, as the unfused Mul reads it (the matcher checked the shapes and broadcast).

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::Op;

use crate::exec::launch::{dt, kernel_err, rows_grid, Args, Exec};
use crate::kernels::Kernel;
use crate::layout::{broadcast_strides, lay};

pub(super) fn launch_norm_mul(exec: &Exec<'_>, norm: &ExecNode, mul: &ExecNode) -> Result<()> {
    let Op::RmsNorm { eps } = norm.op else {
        return Err(kernel_err(norm, "fused as a norm but is not one"));
    };
    let nd = exec.resolve(&norm.dst)?;
    let x = exec.resolve(&norm.srcs[0])?;
    let od = exec.resolve(&mul.dst)?;
    let w = exec.resolve(&mul.srcs[1])?;
    let r = x.rank();
    let len = x.shape[r - 1];
    let rows = x.numel() / len;
    let ws = broadcast_strides(&w.shape, &w.strides, &nd.shape)
        .ok_or_else(|| kernel_err(mul, "weight does not broadcast"))?;
    let l = lay(
        &x.shape[..r - 1],
        &[
            &nd.strides[..r - 1],
            &x.strides[..r - 1],
            &od.strides[..r - 1],
        ],
    )
    .ok_or_else(|| kernel_err(norm, "too many axes"))?;
    let args = Args::new()
        .arg(rows as i64)
        .arg(len as i64)
        .arg(l)
        .arg(nd.ptr)
        .arg(dt(nd.dtype))
        .arg(nd.strides[r - 1] as i64)
        .arg(x.ptr)
        .arg(dt(x.dtype))
        .arg(x.strides[r - 1] as i64)
        .arg(eps)
        .arg(od.ptr)
        .arg(dt(od.dtype))
        .arg(od.strides[r - 1] as i64)
        .arg(w.ptr)
        .arg(dt(w.dtype))
        .arg(ws[r - 1] as i64);
    // Four values per thread (the kernel's RN_V): a decode row is read in one round trip.
    let block = len.div_ceil(4).next_power_of_two().clamp(32, 1024) as u32;
    exec.launch(norm, Kernel::RmsNormMul, rows_grid(rows), block, args)
}
