//! Row gathers and scatters: `GetRows` (`table[ids]`) and `SetRows` (KV-cache writes).
//!
//! Strategy: indices are read and range-checked up front, so a bad id is reported (naming the
//! id, its position and the table size) before anything is written. `GetRows` then copies
//! rows in parallel when large; `SetRows` writes rows in index order on one thread, so with
//! duplicate indices the last write wins, as in sequential numpy assignment. A table read in
//! place from a file mapping (a token embedding) has the pages around the rows it gave
//! released afterwards (`crate::derived::release_rows_read`), so that the rows a session has
//! read do not pile up in its resident memory.

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::DType;

use super::par::for_each_row;
use super::view::Strided;
use super::{float_dst, float_src, kernel_err};
use crate::derived::release_rows_read;

/// Reads i32 indices and checks each against `n`.
pub(super) fn checked_indices(
    node: &ExecNode,
    what: &str,
    ids: &Strided,
    n: usize,
    rows_of: &str,
) -> Result<Vec<usize>> {
    if ids.dtype() != DType::I32 {
        return Err(kernel_err(
            node,
            format!("{what} must be i32, got {}", ids.dtype()),
        ));
    }
    ids.read_all_i32()
        .into_iter()
        .enumerate()
        .map(|(i, id)| {
            usize::try_from(id).ok().filter(|&u| u < n).ok_or_else(|| {
                kernel_err(
                    node,
                    format!("{what}[{i}] = {id} is out of range for {rows_of} with {n} rows"),
                )
            })
        })
        .collect()
}

/// `dst[i, :] = table[ids[i], :]` for every id (flattened).
pub(super) fn get_rows(
    node: &ExecNode,
    dst: &Strided,
    table: &Strided,
    ids: &Strided,
) -> Result<()> {
    float_dst(node, dst)?;
    if !table.dtype().is_quantized() {
        float_src(node, "table", table)?;
    }
    let want: Vec<usize> = ids
        .shape()
        .iter()
        .copied()
        .chain(table.shape().get(1).copied())
        .collect();
    if table.rank() != 2 || dst.shape() != want {
        return Err(kernel_err(
            node,
            format!(
                "table {:?} and ids {:?} need a result of shape ids.shape + [d], got {:?}",
                table.shape(),
                ids.shape(),
                dst.shape()
            ),
        ));
    }
    let (n, d) = (table.shape()[0], table.shape()[1]);
    let rows = checked_indices(node, "ids", ids, n, "a table")?;
    if d == 0 {
        return Ok(());
    }
    if table.dtype().is_quantized() {
        return super::quant::get_rows(node, dst, table, &rows, d);
    }
    for_each_row(
        rows.len(),
        d,
        || vec![0.0f32; d],
        |buf, r| {
            table.read_row(rows[r], 0..d, buf);
            dst.write_row(r, 0..d, buf);
        },
    );
    let spans: Vec<(usize, usize)> = rows
        .iter()
        .filter_map(|&r| table.float_row(0, r).map(|row| row.byte_span()))
        .collect();
    release_rows_read(&spans);
    Ok(())
}

/// `dst[idx[j], :] = src[j, :]`; `dst` is the node's destination (aliasing `srcs[0]`).
pub(super) fn set_rows(
    node: &ExecNode,
    dst: &Strided,
    target: &Strided,
    src: &Strided,
    idx: &Strided,
) -> Result<()> {
    float_dst(node, dst)?;
    float_src(node, "src", src)?;
    let (sd, ss, si) = (dst.shape(), src.shape(), idx.shape());
    if sd.len() != 2 || ss.len() != 2 || ss[1] != sd[1] || si != [ss[0]] || target.shape() != sd {
        return Err(kernel_err(
            node,
            format!("expects dst [n, d], src [m, d], indices [m]; got {sd:?} (target {:?}), {ss:?}, {si:?}", target.shape()),
        ));
    }
    let (n, d) = (sd[0], sd[1]);
    let rows = checked_indices(node, "indices", idx, n, "a destination")?;
    let mut buf = vec![0.0f32; d];
    for (j, &row) in rows.iter().enumerate() {
        src.read_row(j, 0..d, &mut buf);
        dst.write_row(row, 0..d, &buf);
    }
    Ok(())
}
