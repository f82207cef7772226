//! Matrix products: `MulMat` (batched, broadcast batch axes) and `MulMatId` (mixture of
//! experts, with checked expert ids).
//!
//! Why: decode multiplies by a vector (one row per token), prefill by a matrix; the two want
//! different kernels, and the product is where nearly all of a step's device time goes.
//!
//! Strategy: one row with both operands contiguous along k (`x @ w.T`, every projection of a
//! decode step) takes the fast mat-vec kernel: vectorized loads, no stride math in the loop,
//! a subgroup reduction where the device has one; with subgroups and operands aligned to 8
//! elements, the 16-byte-load variant (`mul_mat_vec_v`, a pair of rows per subgroup).
//! Otherwise up to `MAT_VEC_MAX_M` rows use the generic matrix-vector kernel (split over k when
//! `b` is contiguous along k), more use the 64x64 tiled kernel (`mul_mat`, or `mul_mat8` with
//! 8x8 outputs per invocation under `LOWSYNC_VK_TILE=8`; split over k into partials that
//! `split_sum` adds under `LOWSYNC_VK_SPLIT_K`), or on a CPU-type device
//! (`LOWSYNC_VK_ROW_LANES`) one invocation per result column with x shared through the
//! subgroup (`mul_mat_s`, or `mul_mat_s1` where x's rows are not on 16 bytes), or with
//! `LOWSYNC_VK_COOPMAT` on a device with cooperative matrices `mul_mat_cm`. GGUF block
//! weights are dequantized in registers by their own kernels: the mat-vecs up to 16 rows of x
//! (8 rows per workgroup beyond one), the prefill products beyond (`mul_mat_q_s`/`mul_mat_q`
//! or the tiled `mul_mat_qt`/`mul_mat_qt8`, `LOWSYNC_VK_QMM`; `mul_mat_qcm` with
//! `LOWSYNC_VK_COOPMAT`).
//! Batch axes of extent 1 are dropped; at most two remain, each with its
//! broadcast ratio for either operand. The one-row mat-vec families also plan the fused pairs
//! `crate::fusion` finds: an `_e` flavour runs the residual add or SwiGLU consuming the product
//! in its store, an `_r` flavour stores the product into a KV-cache row.
//!
//! Invariant: products write f32 only (the reason `vulkan_supports_op` narrows the graph's
//! rule); only the fused `_r` flavour rounds into the cache's dtype, as `SetRows` would.

use lowsync_backend::Result;
use lowsync_graph::DType;

use super::layout::{dt, need_status, Ctx, Dispatch, Res, Status};
use crate::config::{QuantMatMul, QuantMatVec, SplitK, SPLIT_K_MAX};
use crate::pipelines::{Bind, Push};

/// Rows up to which `MulMat` uses the matrix-vector kernel.
const MAT_VEC_MAX_M: usize = 8;
/// Result columns per workgroup of the decode fast path (`ROWS` in `mul_mat_vec_head.wgsl`).
const MAT_VEC_K_ROWS: usize = 8;
/// Rows of w per workgroup of `mul_mat_vec_qw.wgsl` (its `QW_ROWS`).
const QW_ROWS: usize = 2;
/// The longest row of x the integer-dot products quantize into workgroup memory (`QD_KMAX` in
/// `mul_mat_vec_qd_body.wgsl`), and the workgroup memory that takes: 2.25 bytes an element
/// (its high and low bytes, and two f32 per block of 32).
const QD_KMAX: usize = 8192;
pub(crate) const QD_SHARED_BYTES: u32 = (QD_KMAX * 2 + QD_KMAX / 32 * 8) as u32;
/// Rows of w per workgroup of the integer-dot products: a workgroup quantizes x once for all
/// of them, so they take at least a row per subgroup (eight on a 32-lane device), and up to 64
/// on long products, which then start about 256 workgroups (2,048 rows: 256 of 8; 8,192: 256
/// of 32; a 32,000-row head: 500 of 64); `LOWSYNC_VK_QD_ROWS` sets it instead.
fn qd_rows(c: &Ctx, n: usize) -> usize {
    match c.lim.qd_rows {
        Some(r) => r as usize,
        None => (n / 256).clamp(8, 64).next_multiple_of(8),
    }
}
/// Rows of x per workgroup z of the multi-row quantized mat-vec (`MT` in `mul_mat_vec_qm.wgsl`).
const QUANT_ROWS_PER_GROUP: usize = 8;
/// Rows of w per workgroup of the prefill product over block weights (`BN` in
/// `mul_mat_q_body.wgsl`, one invocation each).
const QUANT_TILE_N: usize = 64;
/// Rows of x per workgroup of that product (`RB` in `mul_mat_q_body.wgsl`): each weight group is
/// decoded once for this many rows.
const QUANT_TILE_M: usize = 32;
/// Rows of x and of w per workgroup of the cooperative-matrix prefill products (`TM`, `TN` in
/// `mul_mat_cm_body.wgsl`).
const CM_TILE: usize = 64;
/// Rows of x per workgroup of the tiled prefill product over block weights (`mul_mat_qt.wgsl`,
/// the float product's tile).
const QT_TILE_M: usize = 64;
/// Rows of x from which block weights take the prefill product instead of the multi-row mat-vec.
const QUANT_TILE_MIN_M: usize = 16;

pub(super) fn mul_mat(c: &Ctx, dst: &Res, a: &Res, b: &Res) -> Result<Vec<Dispatch>> {
    if dst.dtype != DType::F32 {
        return Err(c.err(format!("result must be f32, got {}", dst.dtype)));
    }
    c.float("a", a.dtype)?;
    if !b.dtype.is_quantized() {
        c.float("b", b.dtype)?;
    } else if a.dtype != DType::F32 {
        return Err(c.err(format!(
            "a {} weight multiplies f32 activations only on Vulkan, got {}",
            b.dtype, a.dtype
        )));
    }
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(c.err(format!(
            "needs at least 2-D operands, got {:?} @ {:?}",
            a.shape, b.shape
        )));
    }
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (k2, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    let nb = ra.max(rb) - 2;
    let bdim = |s: &[usize], i: usize| {
        let own = s.len() - 2;
        if i + own >= nb {
            s[i + own - nb]
        } else {
            1
        }
    };
    let bstride = |r: &Res, i: usize| {
        let own = r.rank() - 2;
        if i + own >= nb {
            r.strides[i + own - nb]
        } else {
            0
        }
    };
    let mut want = Vec::with_capacity(nb + 2);
    let mut ok = true;
    for i in 0..nb {
        let (da, db) = (bdim(&a.shape, i), bdim(&b.shape, i));
        let (lo, hi) = (da.min(db), da.max(db));
        ok &= lo == hi || hi.checked_rem(lo) == Some(0) || (lo == 0 && hi == 1);
        want.push(if lo == 0 { 0 } else { hi });
    }
    want.extend([m, n]);
    if k != k2 || !ok || dst.shape != want {
        return Err(c.err(format!(
            "cannot multiply {:?} @ {:?} into {:?}",
            a.shape, b.shape, dst.shape
        )));
    }
    // Batch axes of extent 1 in the result index nothing; at most two may remain.
    let axes: Vec<usize> = (0..nb).filter(|&i| want[i] != 1).collect();
    if axes.len() > 2 {
        return Err(c.err(format!(
            "more than two batch axes ({:?}) are not supported on Vulkan",
            &want[..nb]
        )));
    }
    let mut bd = [1usize; 2];
    let mut sd = [0usize; 2];
    let mut sa = [0usize; 2];
    let mut sb = [0usize; 2];
    let mut div = [1usize; 4];
    for (slot, &i) in (2 - axes.len()..2).zip(&axes) {
        let (da, db) = (bdim(&a.shape, i), bdim(&b.shape, i));
        bd[slot] = want[i];
        sd[slot] = dst.strides[i];
        sa[slot] = bstride(a, i);
        sb[slot] = bstride(b, i);
        div[slot] = want[i] / da.max(1);
        div[2 + slot] = want[i] / db.max(1);
    }
    let batches = bd[0] * bd[1];
    let (a_sm, a_sk) = (a.strides[ra - 2], a.strides[ra - 1]);
    let (b_sk, b_sn) = (b.strides[rb - 2], b.strides[rb - 1]);
    let (d_sm, d_sn) = (dst.strides[dst.rank() - 2], dst.strides[dst.rank() - 1]);
    let (bdd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(a, false)?;
    let (bb, ob) = c.bind(b, false)?;
    let push = Push {
        shape: c.u4(&[m, n, k, bd[1]], "extent")?,
        d_str: c.u4(&[sd[0], sd[1], d_sm, d_sn], "stride")?,
        a_str: c.u4(&[sa[0], sa[1], a_sm, a_sk], "stride")?,
        b_str: c.u4(&[sb[0], sb[1], b_sk, b_sn], "stride")?,
        offs: [od, oa, ob, c.u32(batches, "batch count")?],
        op: c.u4(&div, "batch ratio")?,
        prm: [
            u32::from(a_sk == 1 || k == 1),
            u32::from(b_sk == 1 || k == 1),
            0,
            0,
        ],
        pad: [0; 4],
    };
    let max = c.lim.max_groups;
    let suffix = format!("d_f32.a_{}.b_{}", dt(a.dtype), dt(b.dtype));
    if batches > max[1] as usize || batches > max[2] as usize {
        return Err(c.err(format!("{batches} batches exceed the dispatch limits")));
    }
    if b.dtype.is_quantized() {
        return quant_mat_vec(c, b, [bdd, ba, bb], push, [sa, sb, [b_sk, b_sn]]);
    }
    if fast_mat_vec(a, b, m, k, &push, &sa, &sb) {
        let gx = n.div_ceil(MAT_VEC_K_ROWS);
        if gx <= max[0] as usize {
            let flavour = if !c.lim.subgroups {
                "k_wg"
            } else if vec_aligned(a, k, &push, &sa, &sb) {
                "v"
            } else {
                "k"
            };
            return Ok(vec![Dispatch {
                kernel: format!("mul_mat_vec_{flavour}.{suffix}"),
                binds: vec![bdd, ba, bb],
                push,
                groups: [gx as u32, batches as u32, 1],
            }]);
        }
    }
    if m <= MAT_VEC_MAX_M {
        let ksplit = b_sk == 1 || k == 1;
        let gx = if ksplit {
            n.div_ceil(8)
        } else {
            n.div_ceil(256)
        };
        if gx <= max[0] as usize {
            let mut push = push;
            push.prm[2] = u32::from(ksplit);
            return Ok(vec![Dispatch {
                kernel: format!("mul_mat_vec.{suffix}"),
                binds: vec![bdd, ba, bb],
                push,
                groups: [gx as u32, batches as u32, 1],
            }]);
        }
    }
    // Cooperative matrices where asked for and present (`LOWSYNC_VK_COOPMAT`): 64x64 tiles of
    // f16 products, f32 sums.
    if c.lim.coopmat && a.dtype == DType::F32 {
        let (gx, gy) = (n.div_ceil(CM_TILE), m.div_ceil(CM_TILE));
        if gx <= max[0] as usize && gy <= max[1] as usize {
            return Ok(vec![Dispatch {
                kernel: format!("mul_mat_cm.{suffix}"),
                binds: vec![bdd, ba, bb],
                push,
                groups: [gx as u32, gy as u32, batches as u32],
            }]);
        }
    }
    // A CPU-type device's layout: one invocation per column, x (contiguous along k) shared
    // through the subgroup, 16 bytes a load where its rows allow.
    if c.lim.row_lanes && c.lim.shuffles && a.dtype == DType::F32 && push.prm[0] == 1 {
        let whole = k.is_multiple_of(4) && a_sm.is_multiple_of(4) && x_vec_aligned(&push, sa);
        let (gx, gy) = (n.div_ceil(QUANT_TILE_N), m.div_ceil(QUANT_TILE_M));
        if gx <= max[0] as usize && gy <= max[1] as usize {
            let kernel = if whole { "mul_mat_s" } else { "mul_mat_s1" };
            return Ok(vec![Dispatch {
                kernel: format!("{kernel}.{suffix}"),
                binds: vec![bdd, ba, bb],
                push,
                groups: [gx as u32, gy as u32, batches as u32],
            }]);
        }
    }
    let (gx, gy) = (n.div_ceil(64), m.div_ceil(64));
    if gx > max[0] as usize || gy > max[1] as usize {
        return Err(c.err(format!("a {m}x{n} product exceeds the dispatch limits")));
    }
    let kernel = if c.lim.tile == 8 {
        "mul_mat8"
    } else {
        "mul_mat"
    };
    split_k(
        c,
        Dispatch {
            kernel: format!("{kernel}.{suffix}"),
            binds: vec![bdd, ba, bb],
            push,
            groups: [gx as u32, gy as u32, batches as u32],
        },
    )
}

/// The shortest k `LOWSYNC_VK_SPLIT_K=auto` splits.
const SPLIT_K_MIN_K: usize = 1024;

/// The tiled product `d` (groups: tiles along n, tiles along m, batches) split over k where
/// `LOWSYNC_VK_SPLIT_K` asks for it: the same kernel with workgroup z taking batch b's split s
/// at `b * splits + s`, each summing its range of k (`prm.z` long, whole 16-element steps) into
/// split s's partials (`prm.w` elements apart, each [batch, m, n] contiguous), then
/// `split_sum` adding the splits in order into the result. `d` alone where the setting is
/// off or asks for one part, k is under two steps, or the partials do not fit their buffer.
fn split_k(c: &Ctx, mut d: Dispatch) -> Result<Vec<Dispatch>> {
    let Some(parts) = c.lim.split_parts else {
        return Ok(vec![d]);
    };
    let [m, n, k, b1] = d.push.shape.map(|v| v as usize);
    let batches = d.push.offs[3] as usize;
    let workgroups: usize = d.groups.iter().map(|&g| g as usize).product();
    let want = match c.lim.split_k {
        SplitK::Off => 1,
        SplitK::Fixed(s) => s as usize,
        SplitK::Auto => {
            let cores = c.lim.sm_count as usize;
            if k < SPLIT_K_MIN_K || workgroups == 0 || workgroups * 2 > cores {
                1
            } else {
                (cores / workgroups).min(SPLIT_K_MAX as usize)
            }
        }
    };
    if want < 2 || k < 32 {
        return Ok(vec![d]);
    }
    let chunk = k.div_ceil(want).next_multiple_of(16);
    let splits = k.div_ceil(chunk);
    let stride = batches * m * n;
    let bytes = (splits * stride * 4) as u64;
    let max = c.lim.max_groups;
    if splits < 2
        || bytes > parts.range
        || batches * splits > max[2] as usize
        || n.div_ceil(64) > max[0] as usize
        || m > max[1] as usize
    {
        return Ok(vec![d]);
    }
    let out = d.binds[0];
    let d_str = d.push.d_str;
    let od = d.push.offs[0];
    d.binds[0] = Bind {
        range: bytes,
        ..parts
    };
    d.push.offs[0] = 0;
    d.push.d_str = c.u4(&[b1 * m * n, m * n, n, 1], "stride")?;
    d.push.prm[2] = c.u32(chunk, "k per split")?;
    d.push.prm[3] = c.u32(stride, "partials stride")?;
    d.groups[2] = c.u32(batches * splits, "workgroup count")?;
    let sum = Dispatch {
        kernel: "split_sum.d_f32.a_f32".to_string(),
        binds: vec![
            out,
            Bind {
                range: bytes,
                write: false,
                ..parts
            },
        ],
        push: Push {
            shape: c.u4(&[m, n, splits, b1], "extent")?,
            d_str,
            offs: [od, 0, 0, d.push.offs[3]],
            prm: [0, 0, 0, d.push.prm[3]],
            ..Push::default()
        },
        groups: [n.div_ceil(64) as u32, m as u32, batches as u32],
    };
    Ok(vec![d, sum])
}

/// The product planned as a single dispatch, with its kernel family and the rest of the variant
/// name split off (`mul_mat_vec_qw`, `d_f32.a_f32.b_q4_0`): where the fused flavours start;
/// `None` where the product takes more than one dispatch.
fn one_dispatch(
    c: &Ctx,
    dst: &Res,
    a: &Res,
    b: &Res,
) -> Result<Option<(Dispatch, String, String)>> {
    let mut ds = mul_mat(c, dst, a, b)?;
    let (Some(d), None) = (ds.pop(), ds.pop()) else {
        return Ok(None);
    };
    let Some((family, rest)) = d.kernel.split_once('.') else {
        return Ok(None);
    };
    let (family, rest) = (family.to_string(), rest.to_string());
    Ok(Some((d, family, rest)))
}

/// Whether a planned product has one row of x and one batch: the fused flavours address rows
/// of w and of the result by offset and row stride alone.
fn single_row(d: &Dispatch) -> bool {
    d.push.shape[0] == 1 && d.push.offs[3] == 1
}

/// The element-wise op a decode product's store runs (`mul_mat_vec_out_e.wgsl`), with the op's
/// other operand `e`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// `e + s`: the residual add.
    Add,
    /// `silu(e) * s`: SwiGLU whose up half is the product.
    GluUp,
    /// `silu(s) * e`: SwiGLU whose gate half is the product.
    GluGate,
}

/// Decode mat-vec families that have an `_e` flavour with the epilogue in their store and an
/// `_r` flavour storing into a KV-cache row.
const EPILOGUE_FAMILIES: &[&str] = &[
    "mul_mat_vec_v",
    "mul_mat_vec_k",
    "mul_mat_vec_k_wg",
    "mul_mat_vec_q",
    "mul_mat_vec_qv",
    "mul_mat_vec_qb",
    "mul_mat_vec_qw",
    "mul_mat_vec_qd",
    "mul_mat_vec_q_wg",
];

/// `x @ w.T` into `dst` with `epi` applied to each result element and the same element of `e`
/// in the store, as one dispatch; `None` when the product does not take a decode mat-vec with
/// such a flavour, or `e` is not f32 laid out as `dst` (the caller then runs the pair unfused).
pub(super) fn mul_mat_epilogue(
    c: &Ctx,
    dst: &Res,
    a: &Res,
    b: &Res,
    e: &Res,
    epi: Epilogue,
) -> Result<Option<Dispatch>> {
    // The `_e` flavours take f32 activations only.
    if a.dtype != DType::F32
        || e.dtype != DType::F32
        || e.shape != dst.shape
        || e.strides != dst.strides
    {
        return Ok(None);
    }
    let Some((mut d, family, suffix)) = one_dispatch(c, dst, a, b)? else {
        return Ok(None);
    };
    if !EPILOGUE_FAMILIES.contains(&family.as_str()) {
        return Ok(None);
    }
    let (be, oe) = c.bind(e, false)?;
    d.kernel = format!("{family}_e.{suffix}.e_f32");
    d.binds.push(be);
    let op = match epi {
        Epilogue::Add => 0,
        Epilogue::GluUp => 1,
        Epilogue::GluGate => 2,
    };
    d.push.pad = [oe, op, 0, 0];
    Ok(Some(d))
}

/// SwiGLU of two one-row products of the same x, `silu(x @ gate.T) * (x @ up.T)`, into `dst`
/// as one dispatch: the families whose workgroup or subgroup computes a pair of rows take the
/// gate row and its up row as the pair (`mul_mat_vec_qw_g`, `mul_mat_vec_v_g`). `None` when
/// the gate product takes another kernel, or the up weight differs from the gate's in dtype,
/// shape or strides or does not start where that kernel needs (the caller then runs the
/// products apart).
pub(super) fn mul_mat_glu(
    c: &Ctx,
    dst: &Res,
    x: &Res,
    gate: &Res,
    up: &Res,
) -> Result<Option<Dispatch>> {
    if gate.dtype != up.dtype || gate.shape != up.shape || gate.strides != up.strides {
        return Ok(None);
    }
    let Some((mut d, family, suffix)) = one_dispatch(c, dst, x, gate)? else {
        return Ok(None);
    };
    if !single_row(&d) {
        return Ok(None);
    }
    let n = d.push.shape[1] as usize;
    let (bu, ou) = c.bind(up, false)?;
    // The gate's own checks hold for up (same dtype, shape and strides) but for its offset:
    // an even byte for `T_q8`, 8 elements for 16-byte loads.
    let (kernel, gx) = match family.as_str() {
        "mul_mat_vec_qw" if ou.is_multiple_of(2) => ("mul_mat_vec_qw_g", n),
        // Q4_K's pieces are read on words (its blocks are 144 bytes), the rest on even bytes.
        "mul_mat_vec_qd" if ou.is_multiple_of(if gate.dtype == DType::Q4_K { 4 } else { 2 }) => {
            ("mul_mat_vec_qd_g", n.div_ceil(d.push.prm[3] as usize))
        }
        "mul_mat_vec_v" if ou.is_multiple_of(8) => {
            ("mul_mat_vec_v_g", n.div_ceil(MAT_VEC_K_ROWS / 2))
        }
        _ => return Ok(None),
    };
    if gx > c.lim.max_groups[0] as usize {
        return Ok(None);
    }
    d.kernel = format!("{kernel}.{suffix}.u_{}", dt(up.dtype));
    d.binds.push(bu);
    d.push.pad = [ou, 0, 0, 0];
    d.groups = [gx as u32, 1, 1];
    Ok(Some(d))
}

/// The RmsNorm (with `eps`, times its weight `g`) that feeds a planned decode product, folded
/// into it (`mul_mat_vec_x_norm.wgsl`): `d` was planned with the norm's source as x, and its
/// kernel, the 16-byte float mat-vec, becomes its flavour that normalises x as it reads it.
/// `None` where the family has no such flavour (the caller then runs the norm first), or `g`
/// is not a contiguous f32 vector of k elements starting where that kernel's loads need.
pub(super) fn with_norm(c: &Ctx, mut d: Dispatch, g: &Res, eps: f32) -> Result<Option<Dispatch>> {
    let Some((family, rest)) = d.kernel.split_once('.') else {
        return Ok(None);
    };
    // The float body only: the two-row block body took the fold too, and "1b" Q4_0 decoded
    // 1.5-4% slower on the H200 with it (its products are bound by decoding the blocks, and
    // the fold adds a load of g and a square per element), so the norm runs there.
    let normed = match family {
        "mul_mat_vec_v" => "mul_mat_vec_vn",
        "mul_mat_vec_v_r" => "mul_mat_vec_vn_r",
        "mul_mat_vec_v_g" => "mul_mat_vec_vn_g",
        _ => return Ok(None),
    };
    let k = d.push.shape[2] as usize;
    let contiguous = g.strides.last().is_none_or(|&s| s == 1 || g.numel() == 1);
    if !single_row(&d) || g.dtype != DType::F32 || g.numel() != k || !contiguous {
        return Ok(None);
    }
    let (bn, on) = c.bind(g, false)?;
    // 8 elements of g at a time, on 16 bytes.
    if !on.is_multiple_of(8) {
        return Ok(None);
    }
    d.kernel = format!("{normed}.{rest}.n_f32");
    d.binds.push(bn);
    d.push.prm[2] = on;
    d.push.prm[3] = eps.to_bits();
    Ok(Some(d))
}

/// `x @ w.T` for one row of x (`product` [1, n], the product's own result) written into row
/// `ids[0]` of `cache` [rows, n] instead, as the `SetRows` that consumed it would, as one
/// dispatch (`mul_mat_vec_out_r.wgsl`); `None` when the product does not take a decode mat-vec
/// with an `_r` flavour (the caller then runs the pair unfused).
pub(super) fn mul_mat_set_rows(
    c: &Ctx,
    [product, a, b, cache, ids]: [&Res; 5],
    status: Option<Status>,
) -> Result<Option<Dispatch>> {
    let n = match product.shape[..] {
        [1, n] => n,
        _ => return Ok(None),
    };
    // The `_r` flavours take f32 activations only.
    let ok = a.dtype == DType::F32
        && cache.dtype.is_float()
        && cache.shape.len() == 2
        && cache.shape[1] == n
        && ids.dtype == DType::I32
        && ids.shape == [1];
    if !ok {
        return Ok(None);
    }
    let Some((mut d, family, rest)) = one_dispatch(c, product, a, b)? else {
        return Ok(None);
    };
    // The planned one-row product indexes d only by column (batch and row strides unused).
    if !EPILOGUE_FAMILIES.contains(&family.as_str()) || !single_row(&d) {
        return Ok(None);
    }
    let s = need_status(c, status)?;
    let operands = rest.strip_prefix("d_f32.").unwrap_or(&rest);
    let (bd, od) = c.bind(cache, true)?;
    let (bi, oi) = c.bind(ids, false)?;
    d.kernel = format!(
        "{family}_r.d_{}.{operands}.ids_i32.status_u32",
        dt(cache.dtype)
    );
    d.binds[0] = bd;
    d.binds.extend([bi, s.bind]);
    d.push.offs[0] = od;
    d.push.d_str[3] = c.u32(cache.strides[1], "stride")?;
    d.push.pad = [
        oi,
        c.u32(cache.shape[0], "row count")?,
        c.u32(cache.strides[0], "stride")?,
        s.tag,
    ];
    Ok(Some(d))
}

/// `x @ w.T` over a block-dtype `w`, dequantized in registers: one row of x takes the decode
/// mat-vec (`mul_mat_vec_q*.wgsl`, workgroup z a row of x; `mul_mat_vec_qv` where subgroups
/// and 256-invocation workgroups exist and x is contiguous and 16-byte aligned, or there
/// `mul_mat_vec_qb` under `LOWSYNC_VK_QV=block`), a few rows of an x contiguous along k take
/// `mul_mat_vec_qm*.wgsl`, whose workgroup z covers `QUANT_ROWS_PER_GROUP` rows of x so that
/// each group of w is read and dequantized once for all of them, and `QUANT_TILE_MIN_M` rows or
/// more (prefill) take `mul_mat_q_body.wgsl` (`LOWSYNC_VK_QMM=rows`; `mul_mat_qt.wgsl` for
/// `tiles`), which decodes each group of w once per `QUANT_TILE_M` rows of x. The graph builder admits such a `b` only with its blocks along k
/// (stride 1, whole rows: `b_sk == 1`, every other stride a whole number of rows); b's offset
/// and strides go to the kernel in bytes.
fn quant_mat_vec(
    c: &Ctx,
    b: &Res,
    binds: [crate::pipelines::Bind; 3],
    mut push: Push,
    [sa, sb, [b_sk, b_sn]]: [[usize; 2]; 3],
) -> Result<Vec<Dispatch>> {
    let [m, n, k, _] = push.shape.map(|v| v as usize);
    let bs = b.dtype.block_size();
    if b_sk != 1 || !k.is_multiple_of(bs) {
        return Err(c.err(format!(
            "a {} weight must have its blocks along k (x @ w.T), got shape {:?} strides {:?}",
            b.dtype, b.shape, b.strides
        )));
    }
    let max = c.lim.max_groups;
    push.b_str = [
        c.block_bytes(b.dtype, sb[0], "batch stride")?,
        c.block_bytes(b.dtype, sb[1], "batch stride")?,
        0,
        c.block_bytes(b.dtype, b_sn, "row stride")?,
    ];
    // The prefill kernels, batches in z: on cooperative matrices where asked for and present,
    // 128 invocations per 64 x 64 tile; else `rows`, 64 invocations (one per row of w) per 64 x
    // 32 tile of the result, x shared through the subgroup where shuffles allow; `tiles`, 256
    // invocations per 64 x 64 tile.
    let x_vec4 = push.prm[0] == 1 && x_vec_aligned(&push, sa) && push.a_str[2].is_multiple_of(4);
    let (kernel, rows_per_tile) = match c.lim.qmm {
        _ if c.lim.coopmat => ("mul_mat_qcm", CM_TILE),
        QuantMatMul::Rows if c.lim.shuffles && x_vec4 => ("mul_mat_q_s", QUANT_TILE_M),
        QuantMatMul::Rows => ("mul_mat_q", QUANT_TILE_M),
        QuantMatMul::Tiles if c.lim.tile == 8 => ("mul_mat_qt8", QT_TILE_M),
        QuantMatMul::Tiles => ("mul_mat_qt", QT_TILE_M),
    };
    let (tx, ty) = (n.div_ceil(QUANT_TILE_N), m.div_ceil(rows_per_tile));
    let batches = push.offs[3] as usize;
    if m >= QUANT_TILE_MIN_M
        && tx <= max[0] as usize
        && ty <= max[1] as usize
        && batches <= max[2] as usize
    {
        let d = Dispatch {
            kernel: format!("{kernel}.d_f32.a_f32.b_{}", dt(b.dtype)),
            binds: binds.to_vec(),
            push,
            groups: [tx as u32, ty as u32, push.offs[3]],
        };
        // The tiled kernels (`mul_mat_body.wgsl`) split over k; the others do not.
        return if kernel.starts_with("mul_mat_qt") {
            split_k(c, d)
        } else {
            Ok(vec![d])
        };
    }
    let gx = n.div_ceil(MAT_VEC_K_ROWS);
    // The multi-row kernel reads x contiguous along k only (`X_CONTIGUOUS`); any other x
    // takes the one-row kernel once per row.
    let (kernel, gz) = if m == 1 || push.prm[0] != 1 {
        ("mul_mat_vec_q", m)
    } else {
        ("mul_mat_vec_qm", m.div_ceil(QUANT_ROWS_PER_GROUP))
    };
    if gx > max[0] as usize || gz > max[2] as usize {
        return Err(c.err(format!("a {m}x{n} product exceeds the dispatch limits")));
    }
    let (flavour, gx) = if !c.lim.subgroups {
        ("_wg", gx)
    } else if m == 1 && push.prm[0] == 1 && c.lim.wide_groups && x_vec_aligned(&push, sa) {
        // `LOWSYNC_VK_QV=block`: 32 elements per lane instead, where w starts on an even byte
        // (blocks are an even number of bytes, so each then starts on a word or two bytes into
        // one: `T_b32`, and Q3_K's and Q6_K's `T_s32`, read both), and on a word for the other
        // super-block types (whole words per block, read only on words). `rows`: a
        // 32-element type's rows two to a workgroup, w on an even byte (`T_q8`), where that
        // many workgroups fit the dispatch limit (a vocabulary past 131,070 rows does not).
        let either = bs == 32 || matches!(b.dtype, DType::Q3_K | DType::Q6_K);
        let align = if either { 2 } else { 4 };
        let even = push.offs[2].is_multiple_of(align);
        let gw = n.div_ceil(QW_ROWS);
        let idot = c.lim.idot
            && (matches!(b.dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
                || (c.lim.idot_k && matches!(b.dtype, DType::Q4_K | DType::Q6_K)))
            && k <= QD_KMAX
            && even
            && n.div_ceil(qd_rows(c, n)) <= max[0] as usize;
        match c.lim.qv {
            QuantMatVec::Block if even => ("b", gx),
            QuantMatVec::Idot if idot => {
                let rows = qd_rows(c, n);
                push.prm[3] = rows as u32;
                ("d", n.div_ceil(rows))
            }
            QuantMatVec::Rows | QuantMatVec::Idot if bs == 32 && even && gw <= max[0] as usize => {
                ("w", gw)
            }
            _ => ("v", gx),
        }
    } else {
        ("", gx)
    };
    Ok(vec![Dispatch {
        kernel: format!("{kernel}{flavour}.d_f32.a_f32.b_{}", dt(b.dtype)),
        binds: binds.to_vec(),
        push,
        groups: [gx as u32, push.offs[3], gz as u32],
    }])
}

/// Whether the decode fast path (`mul_mat_vec_k*.wgsl`) applies: one row, both operands
/// contiguous along k, k a multiple of 4, and every 16-bit operand's element offset, row
/// stride and batch strides even, so its 4-element loads are two whole words.
fn fast_mat_vec(
    a: &Res,
    b: &Res,
    m: usize,
    k: usize,
    push: &Push,
    sa: &[usize; 2],
    sb: &[usize; 2],
) -> bool {
    let contiguous = push.prm[0] == 1 && push.prm[1] == 1;
    let words = |r: &Res, off: u32, strides: &[usize]| {
        r.dtype.size_bytes() != 2
            || (off.is_multiple_of(2) && strides.iter().all(|s| s.is_multiple_of(2)))
    };
    m == 1
        && k > 0
        && k.is_multiple_of(4)
        && contiguous
        && words(a, push.offs[1], sa)
        && words(b, push.offs[2], &[sb[0], sb[1], push.b_str[3] as usize])
}

/// Whether the one-row quantized mat-vec may read x 16 bytes at a time
/// (`mul_mat_vec_qv.wgsl`): x's offset and batch strides a multiple of 4 elements (k is a
/// multiple of the block size, so every group of x starts on 16 bytes of its binding).
fn x_vec_aligned(push: &Push, sa: [usize; 2]) -> bool {
    [push.offs[1] as usize, sa[0], sa[1]]
        .iter()
        .all(|x| x.is_multiple_of(4))
}

/// Whether the fast mat-vec may load 16 bytes at a time (`mul_mat_vec_v.wgsl`): f32 x, k a
/// multiple of 8, and x's offset, w's offset and every stride between rows or batches of x and
/// w a multiple of 8 elements, so each 8-element load starts on 16 bytes of its binding.
fn vec_aligned(a: &Res, k: usize, push: &Push, sa: &[usize; 2], sb: &[usize; 2]) -> bool {
    let eights = |v: &[usize]| v.iter().all(|x| x.is_multiple_of(8));
    a.dtype == DType::F32
        && k.is_multiple_of(8)
        && eights(&[push.offs[1] as usize, push.offs[2] as usize])
        && eights(&[sa[0], sa[1], sb[0], sb[1], push.b_str[3] as usize])
}

pub(super) fn mul_mat_id(
    c: &Ctx,
    dst: &Res,
    experts: &Res,
    x: &Res,
    ids: &Res,
    w: &Res,
    status: Option<Status>,
) -> Result<Vec<Dispatch>> {
    if dst.dtype != DType::F32 {
        return Err(c.err(format!("result must be f32, got {}", dst.dtype)));
    }
    c.float("experts", experts.dtype)?;
    c.float("x", x.dtype)?;
    c.float("weights", w.dtype)?;
    let (se, sx, si, sw) = (&experts.shape, &x.shape, &ids.shape, &w.shape);
    let ok = se.len() == 3
        && sx.len() == 2
        && sx[1] == se[1]
        && si.len() == 2
        && si[0] == sx[0]
        && sw == si
        && dst.shape == [sx[0], se[2]];
    if !ok {
        return Err(c.err(format!(
            "expects experts [E, k, n], x [T, k], ids [T, K], weights [T, K], result [T, n]; \
             got {se:?}, {sx:?}, {si:?}, {sw:?}, {:?}",
            dst.shape
        )));
    }
    if ids.dtype != DType::I32 {
        return Err(c.err(format!("ids must be i32, got {}", ids.dtype)));
    }
    let (n_exp, k, n) = (se[0], se[1], se[2]);
    let (t, slots) = (si[0], si[1]);
    let s = need_status(c, status)?;
    let threads = t * n;
    let (bd, od) = c.bind(dst, true)?;
    let (be, oe) = c.bind(experts, false)?;
    let (bx, ox) = c.bind(x, false)?;
    // An empty ids/weights view still needs a binding; its kernel loop runs zero times.
    let (bi, oi) = c.bind(ids, false)?;
    let (bw, ow) = c.bind(w, false)?;
    Ok(vec![Dispatch {
        kernel: format!(
            "mul_mat_id.d_f32.a_{}.b_{}.ids_i32.w_{}.status_u32",
            dt(experts.dtype),
            dt(x.dtype),
            dt(w.dtype)
        ),
        binds: vec![bd, be, bx, bi, bw, s.bind],
        push: Push {
            shape: c.u4(&[t, n, k, slots], "extent")?,
            d_str: c.u4(&dst.strides, "stride")?,
            a_str: c.u4(
                &[
                    experts.strides[0],
                    experts.strides[1],
                    experts.strides[2],
                    n_exp,
                ],
                "stride",
            )?,
            b_str: c.u4(&x.strides, "stride")?,
            offs: [od, oe, ox, oi],
            op: c.u4(
                &[ids.strides[0], ids.strides[1], w.strides[0], w.strides[1]],
                "stride",
            )?,
            prm: [ow, s.tag, c.u32(threads, "thread count")?, 0],
            pad: [0; 4],
        },
        groups: c.spread(threads, 64)?,
    }])
}
