//! Row kernels: `RmsNorm`, `SoftMax` (with an optional broadcast mask), `Argmax`, `Rope`, and
//! the fused `RmsNorm -> Mul` by a broadcast weight and `Rope -> SetRows` of one token into a
//! KV cache (`crate::fusion`).
//!
//! Why: these ops reduce or rotate along the last axis, so a workgroup (or thread group) owns a
//! row and the leading axes only select rows; coalescing the leading axes to at most three lets
//! one kernel take any batch layout.
//!
//! Strategy: the leading axes of every view are coalesced by `rows3`; the last axis' length and
//! strides travel in the fourth slot of the push constants. RoPE forms its angles in f64 where
//! the device has it, else from a two-float split of the frequency ratio.
//!
//! Invariant: a row of length 0 dispatches nothing, except `Argmax`, where it is an error (no
//! index to return).

use lowsync_backend::Result;
use lowsync_graph::{DType, RopeMode};

use super::layout::{dt, need_status, rows3, Ctx, Dispatch, Res, Status};
use crate::pipelines::Push;

/// RmsNorm, SoftMax and the fused `rms_norm_mul` (its weight in `mask`'s place): one workgroup
/// per row of the last axis, or under `LOWSYNC_VK_ROW_LANES` one invocation per row (`_t`).
pub(super) fn row_kernel(
    c: &Ctx,
    kernel: &str,
    dst: &Res,
    x: &Res,
    mask: Option<&Res>,
    prm: f32,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    c.float("x", x.dtype)?;
    c.same_shape("x", x, dst)?;
    let r = x.rank();
    if r == 0 {
        return Err(c.err("needs at least one axis"));
    }
    let len = x.shape[r - 1];
    if len == 0 {
        return Ok(Vec::new());
    }
    let m = match mask {
        None => None,
        Some(m) => {
            c.float("mask", m.dtype)?;
            let st = m.broadcast_to(&x.shape).ok_or_else(|| {
                c.err(format!(
                    "mask {:?} does not broadcast onto {:?}",
                    m.shape, x.shape
                ))
            })?;
            Some((m, st))
        }
    };
    let lead = &x.shape[..r - 1];
    let mut strides = vec![dst.strides[..r - 1].to_vec(), x.strides[..r - 1].to_vec()];
    if let Some((_, st)) = &m {
        strides.push(st[..r - 1].to_vec());
    }
    let (mut shape, st) = rows3(c, lead, &strides)?;
    shape[3] = c.u32(len, "row length")?;
    let rows: usize = lead.iter().product();
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(x, false)?;
    let mut d_str = st[0];
    d_str[3] = c.u32(dst.strides[r - 1], "stride")?;
    let mut a_str = st[1];
    a_str[3] = c.u32(x.strides[r - 1], "stride")?;
    let mut push = Push {
        shape,
        d_str,
        a_str,
        prm: [prm.to_bits(), 0, 0, 0],
        ..Push::default()
    };
    let name;
    let mut binds = vec![bd, ba];
    // Rows per workgroup: one (a workgroup of 256 per row), or 64 (`_t`: an invocation each).
    let (per_group, sfx) = if c.lim.row_lanes { (64, "_t") } else { (1, "") };
    if kernel == "soft_max" {
        let (mres, mst) = match &m {
            Some((mres, full)) => {
                let mut s = st[2];
                s[3] = c.u32(full[r - 1], "stride")?;
                (*mres, s)
            }
            None => (x, [0; 4]),
        };
        let (bm, om) = c.bind(mres, false)?;
        binds.push(bm);
        push.b_str = mst;
        push.offs = [od, oa, om, c.u32(rows, "row count")?];
        push.op = [u32::from(m.is_some()), 0, 0, 0];
        name = format!(
            "soft_max{sfx}.d_{}.a_{}.m_{}",
            dt(dst.dtype),
            dt(x.dtype),
            dt(mres.dtype)
        );
    } else if let (Some((w, full)), "rms_norm_mul") = (&m, kernel) {
        // The fused norm's weight rides in the mask's slot.
        let mut s = st[2];
        s[3] = c.u32(full[r - 1], "stride")?;
        let (bw, ow) = c.bind(w, false)?;
        binds.push(bw);
        push.b_str = s;
        push.offs = [od, oa, ow, c.u32(rows, "row count")?];
        name = format!(
            "rms_norm_mul{sfx}.d_{}.a_{}.w_{}",
            dt(dst.dtype),
            dt(x.dtype),
            dt(w.dtype)
        );
    } else {
        push.offs = [od, oa, c.u32(rows, "row count")?, 0];
        name = format!("{kernel}{sfx}.d_{}.a_{}", dt(dst.dtype), dt(x.dtype));
    }
    Ok(vec![Dispatch {
        kernel: name,
        binds,
        push,
        groups: c.spread(rows, per_group)?,
    }])
}

pub(super) fn argmax(c: &Ctx, dst: &Res, x: &Res) -> Result<Vec<Dispatch>> {
    c.float("x", x.dtype)?;
    if dst.dtype != DType::I32 {
        return Err(c.err(format!("result must be i32, got {}", dst.dtype)));
    }
    let r = x.rank();
    let want = &x.shape[..r.saturating_sub(1)];
    if r == 0 || dst.shape != want {
        return Err(c.err(format!(
            "x {:?} needs a result of shape {want:?}, got {:?}",
            x.shape, dst.shape
        )));
    }
    let len = x.shape[r - 1];
    let rows: usize = want.iter().product();
    if rows == 0 {
        return Ok(Vec::new());
    }
    if len == 0 {
        return Err(c.err(format!("argmax of an empty last axis ({:?})", x.shape)));
    }
    let (mut shape, st) = rows3(c, want, &[dst.strides.clone(), x.strides[..r - 1].to_vec()])?;
    shape[3] = c.u32(len, "row length")?;
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(x, false)?;
    let mut a_str = st[1];
    a_str[3] = c.u32(x.strides[r - 1], "stride")?;
    Ok(vec![Dispatch {
        kernel: format!("argmax.d_i32.a_{}", dt(x.dtype)),
        binds: vec![bd, ba],
        push: Push {
            shape,
            d_str: st[0],
            a_str,
            offs: [od, oa, c.u32(rows, "row count")?, 0],
            ..Push::default()
        },
        groups: c.spread(rows, 1)?,
    }])
}

pub(super) fn rope(
    c: &Ctx,
    dst: &Res,
    x: &Res,
    pos: &Res,
    mode: RopeMode,
    n_dims: usize,
    theta_base: f32,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    c.float("x", x.dtype)?;
    c.same_shape("x", x, dst)?;
    if x.rank() != 3 || pos.dtype != DType::I32 || pos.shape != [x.shape[0]] {
        return Err(c.err(format!(
            "expects x [T, H, D] and i32 positions [T]; got {:?} and {} {:?}",
            x.shape, pos.dtype, pos.shape
        )));
    }
    let (t, h, d) = (x.shape[0], x.shape[1], x.shape[2]);
    if n_dims == 0 || n_dims % 2 == 1 || n_dims > d {
        return Err(c.err(format!(
            "n_dims {n_dims} must be even, > 0 and <= head_dim {d}"
        )));
    }
    let half = n_dims / 2;
    let per = half + (d - n_dims);
    let threads = t * h * per;
    let ratio = (theta_base as f64).powf(-2.0 / n_dims as f64);
    let hi = ratio as f32;
    let lo = (ratio - hi as f64) as f32;
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(x, false)?;
    let (bp, op) = c.bind(pos, false)?;
    let kernel = if c.lim.has_f64 { "rope" } else { "rope_f32" };
    Ok(vec![Dispatch {
        kernel: format!("{kernel}.d_{}.a_{}.pos_i32", dt(dst.dtype), dt(x.dtype)),
        binds: vec![bd, ba, bp],
        push: Push {
            shape: c.u4(&[t, h.max(1), d, n_dims], "extent")?,
            d_str: c.u4(&dst.strides, "stride")?,
            a_str: c.u4(&x.strides, "stride")?,
            b_str: c.u4(&pos.strides, "stride")?,
            offs: [od, oa, op, c.u32(threads, "thread count")?],
            op: [
                u32::from(mode == RopeMode::Neox),
                c.u32(half, "n_dims")?,
                c.u32(per.max(1), "row threads")?,
                0,
            ],
            prm: [hi.to_bits(), lo.to_bits(), theta_base.to_bits(), 0],
            pad: [0; 4],
        },
        groups: c.spread(threads, 256)?,
    }])
}

/// `Rope` of one token's x [1, H, D] written into row `ids[0]` of `cache` [n, H * D] (the
/// `SetRows` that consumed the rotated row): rope's own dispatch with its destination replaced
/// by the cache row (`rope_dst_rows.wgsl`), the id checked on the device as `set_rows` checks
/// it. `None` when the operands are not such a pair (the caller runs them unfused).
#[allow(clippy::too_many_arguments)]
pub(super) fn rope_set_rows(
    c: &Ctx,
    cache: &Res,
    x: &Res,
    pos: &Res,
    ids: &Res,
    (mode, n_dims, theta_base): (RopeMode, usize, f32),
    status: Option<Status>,
) -> Result<Option<Dispatch>> {
    let (h, d) = match x.shape[..] {
        [1, h, d] => (h, d),
        _ => return Ok(None),
    };
    let ok = x.dtype == DType::F32
        && cache.dtype.is_float()
        && cache.rank() == 2
        && cache.shape[1] == h * d
        && ids.dtype == DType::I32
        && ids.shape == [1];
    if !ok || h * d == 0 {
        return Ok(None);
    }
    let s = need_status(c, status)?;
    // Planned as a rope over x itself, then pointed at the cache: shapes, angles, thread count
    // and x's binding are rope's; the destination binding, offset and strides the cache's.
    let [mut dsp] = <[Dispatch; 1]>::try_from(rope(c, x, x, pos, mode, n_dims, theta_base)?)
        .map_err(|_| c.err("rope planned other than one dispatch"))?;
    let (bd, od) = c.bind(cache, true)?;
    let (bi, oi) = c.bind(ids, false)?;
    let (row, col) = (cache.strides[0], cache.strides[1]);
    let flavour = dsp.kernel.split_once('.').map_or("rope", |(k, _)| k);
    let f32_angle = if flavour == "rope_f32" { "_f32" } else { "" };
    dsp.kernel = format!(
        "rope_set_rows{f32_angle}.d_{}.a_f32.pos_i32.ids_i32.status_u32",
        dt(cache.dtype)
    );
    dsp.binds[0] = bd;
    dsp.binds.extend([bi, s.bind]);
    dsp.push.d_str = c.u4(&[row, d * col, col, 0], "stride")?;
    dsp.push.offs[0] = od;
    dsp.push.pad = [
        oi,
        c.u32(ids.strides[0], "stride")?,
        c.u32(cache.shape[0], "row count")?,
        s.tag,
    ];
    Ok(Some(dsp))
}
