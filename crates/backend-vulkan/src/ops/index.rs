//! Index kernels: `GetRows` (token embedding) and `SetRows` (KV-cache writes).
//!
//! Why: their indices come from the device (written by the host as graph inputs or computed by
//! kernels), so they cannot be checked on the host before the dispatch; a bad index must still
//! be an error and never an out-of-bounds access.
//!
//! Strategy: the kernel checks every index against the row count and, on the first bad one,
//! records `[count, tag, position, value]` in the status words instead of accessing memory;
//! the stream reports it as `Error::Kernel` at the next wait (`stream::State::check_status`).
//!
//! Invariant: an index-checking kernel is never planned without its status slot.

use lowsync_backend::Result;
use lowsync_graph::DType;

use super::layout::{dt, need_status, rows3, Ctx, Dispatch, Res, Status};
use crate::pipelines::Push;

pub(super) fn get_rows(
    c: &Ctx,
    dst: &Res,
    table: &Res,
    ids: &Res,
    status: Option<Status>,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    if !table.dtype.is_quantized() {
        c.float("table", table.dtype)?;
    }
    let want: Vec<usize> = ids
        .shape
        .iter()
        .copied()
        .chain(table.shape.get(1).copied())
        .collect();
    if table.rank() != 2 || dst.shape != want {
        return Err(c.err(format!(
            "table {:?} and ids {:?} need a result of shape ids.shape + [d], got {:?}",
            table.shape, ids.shape, dst.shape
        )));
    }
    if ids.dtype != DType::I32 {
        return Err(c.err(format!("ids must be i32, got {}", ids.dtype)));
    }
    let (n, d) = (table.shape[0], table.shape[1]);
    let n_ids = ids.numel();
    if d == 0 || n_ids == 0 {
        return Ok(Vec::new());
    }
    let s = need_status(c, status)?;
    let r = ids.rank();
    let (mut shape, sts) = rows3(
        c,
        &ids.shape,
        &[dst.strides[..r].to_vec(), ids.strides.clone()],
    )?;
    shape[3] = c.u32(d, "row length")?;
    let mut d_str = sts[0];
    d_str[3] = c.u32(dst.strides[r], "stride")?;
    let (bd, od) = c.bind(dst, true)?;
    let (bt, ot) = c.bind(table, false)?;
    let (bi, oi) = c.bind(ids, false)?;
    // A block-dtype table (`get_rows_q.wgsl`): its rows are whole blocks along the last axis
    // (the graph builder admits no other view), its row stride goes in bytes, and each thread
    // dequantizes a 16-element group (every block size is a multiple of 16).
    let (kernel, a_str, per_thread) = if table.dtype.is_quantized() {
        if table.strides[1] != 1 || !d.is_multiple_of(table.dtype.block_size()) {
            return Err(c.err(format!(
                "a {} table must be read by whole rows of blocks, got shape {:?} strides {:?}",
                table.dtype, table.shape, table.strides
            )));
        }
        let row = c.block_bytes(table.dtype, table.strides[0], "row stride")?;
        ("get_rows_q", [row, 0, c.u32(n, "row count")?, 0], 16)
    } else {
        let st = c.u4(&[table.strides[0], table.strides[1], n, 0], "stride")?;
        ("get_rows", st, 1)
    };
    // Element indices of the result are u32 in the kernel.
    c.u32(n_ids * d, "element count")?;
    let threads = n_ids * (d / per_thread);
    Ok(vec![Dispatch {
        kernel: format!(
            "{kernel}.d_{}.a_{}.ids_i32.status_u32",
            dt(dst.dtype),
            dt(table.dtype)
        ),
        binds: vec![bd, bt, bi, s.bind],
        push: Push {
            shape,
            d_str,
            a_str,
            b_str: sts[1],
            offs: [od, ot, oi, c.u32(threads, "thread count")?],
            op: [s.tag, 0, 0, 0],
            ..Push::default()
        },
        groups: c.spread(threads, 256)?,
    }])
}

/// Rows a `set_rows` workgroup writes where the indices strictly increase.
const SET_ROWS_CHUNK: usize = 32;

pub(super) fn set_rows(
    c: &Ctx,
    dst: &Res,
    src: &Res,
    idx: &Res,
    status: Option<Status>,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    c.float("src", src.dtype)?;
    let (sd, ss, si) = (&dst.shape, &src.shape, &idx.shape);
    if sd.len() != 2 || ss.len() != 2 || ss[1] != sd[1] || si[..] != [ss[0]] {
        return Err(c.err(format!(
            "expects dst [n, d], src [m, d], indices [m]; got {sd:?}, {ss:?}, {si:?}"
        )));
    }
    if idx.dtype != DType::I32 {
        return Err(c.err(format!("indices must be i32, got {}", idx.dtype)));
    }
    let (n, d, m) = (sd[0], sd[1], ss[0]);
    if m == 0 || d == 0 {
        return Ok(Vec::new());
    }
    let s = need_status(c, status)?;
    let (bd, od) = c.bind(dst, true)?;
    let (bs, os) = c.bind(src, false)?;
    let (bi, oi) = c.bind(idx, false)?;
    // Chunks of rows along z (`shaders/set_rows.wgsl`): used where the indices turn out to
    // strictly increase; otherwise chunk 0 writes every row.
    let chunks = m
        .div_ceil(SET_ROWS_CHUNK)
        .min(c.lim.max_groups[2].max(1) as usize);
    let rows = m.div_ceil(chunks);
    let mut groups = c.spread(d, 64)?;
    groups[2] = chunks as u32;
    Ok(vec![Dispatch {
        kernel: format!(
            "set_rows.d_{}.a_{}.ids_i32.status_u32",
            dt(dst.dtype),
            dt(src.dtype)
        ),
        binds: vec![bd, bs, bi, s.bind],
        push: Push {
            shape: c.u4(&[n, d, m, rows], "extent")?,
            d_str: c.u4(&dst.strides, "stride")?,
            a_str: c.u4(&src.strides, "stride")?,
            b_str: c.u4(&idx.strides, "stride")?,
            offs: [od, os, oi, 0],
            op: [s.tag, 0, 0, 0],
            ..Push::default()
        },
        groups,
    }])
}
