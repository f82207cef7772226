//! `Cpy` and `Concat`, and the strided copy engine other kernels reuse (converting a gemm
//! operand to f32, storing a scratch result into the destination).
//!
//! Strategy: the axes of both views are ordered by the destination's strides (largest first)
//! and coalesced, so a copy between two layouts with the same memory order becomes a few long
//! unit-stride runs; equal dtypes copy bytes (exact, i32 included), float dtypes convert
//! through f32. Concatenation is two copies into the two slices of the destination.

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::DType;

use super::par::{for_each_segment, segment_buf, Threads};
use super::view::{coalesce, Strided};
use super::{kernel_err, same_shape};

/// Copies every element of `src` into `dst` (equal shapes; equal dtypes or both float).
/// Mismatches are the caller's to reject; here they copy nothing (and assert in debug).
pub(crate) fn copy_strided(src: &Strided, dst: &Strided) {
    copy_strided_on(Threads::Auto, src, dst);
}

/// [`copy_strided`], choosing whether it may fork onto the rayon pool.
pub(crate) fn copy_strided_on(threads: Threads, src: &Strided, dst: &Strided) {
    let ok = src.shape() == dst.shape()
        && (src.dtype() == dst.dtype() || (src.dtype().is_float() && dst.dtype().is_float()));
    debug_assert!(
        ok,
        "copy {} {:?} -> {} {:?}",
        src.dtype(),
        src.shape(),
        dst.dtype(),
        dst.shape()
    );
    if !ok || dst.numel() == 0 {
        return;
    }
    let mut perm: Vec<usize> = (0..dst.rank()).collect();
    perm.sort_by(|&x, &y| dst.strides()[y].cmp(&dst.strides()[x]));
    let (Some(d), Some(s)) = (dst.permuted(&perm), src.permuted(&perm)) else {
        return;
    };
    let v = coalesce(&[&d, &s]);
    let (d, s) = (&v[0], &v[1]);
    let (rows, len) = (d.rows(), d.last_len());
    if d.dtype() == s.dtype() {
        for_each_segment(
            threads,
            rows,
            len,
            || (),
            |_, r, cols| d.copy_row_raw(r, s, r, cols),
        );
    } else {
        for_each_segment(
            threads,
            rows,
            len,
            || segment_buf(len),
            |buf, r, cols| {
                let buf = &mut buf[..cols.len()];
                s.read_row(r, cols.clone(), buf);
                d.write_row(r, cols, buf);
            },
        );
    }
}

/// Float views must stay float and i32 must stay i32.
fn check_kinds(node: &ExecNode, src: DType, dst: DType) -> Result<()> {
    if src.is_float() != dst.is_float() {
        return Err(kernel_err(node, format!("cannot convert {src} to {dst}")));
    }
    Ok(())
}

/// `dst = src` converted to `dst`'s dtype.
pub(super) fn cpy(node: &ExecNode, dst: &Strided, src: &Strided) -> Result<()> {
    same_shape(node, "source", src, dst)?;
    check_kinds(node, src.dtype(), dst.dtype())?;
    copy_strided(src, dst);
    Ok(())
}

/// `dst = concat(a, b, axis)`.
pub(super) fn concat(
    node: &ExecNode,
    dst: &Strided,
    a: &Strided,
    b: &Strided,
    axis: usize,
) -> Result<()> {
    let (sa, sb, sd) = (a.shape(), b.shape(), dst.shape());
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
        return Err(kernel_err(
            node,
            format!("cannot concatenate {sa:?} and {sb:?} along axis {axis} into {sd:?}"),
        ));
    }
    check_kinds(node, a.dtype(), dst.dtype())?;
    check_kinds(node, b.dtype(), dst.dtype())?;
    let parts = dst
        .slice_axis(axis, 0, sa[axis])
        .zip(dst.slice_axis(axis, sa[axis], sb[axis]));
    let Some((da, db)) = parts else {
        return Err(kernel_err(
            node,
            format!("axis {axis} out of range for {sd:?}"),
        ));
    };
    copy_strided(a, &da);
    copy_strided(b, &db);
    Ok(())
}
