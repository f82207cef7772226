//! The sampler kernels: `Penalize` and `Sample` (`lowsync_graph::sampling`, the CPU kernels
//! the oracle).
//!
//! Why: sampling on the device keeps the logits there, so a sampled step reads back 4 bytes
//! like a greedy one. Both kernels must pick what the CPU picks, so they follow the reference
//! step for step: thresholds on order keys found by exact counts, Philox noise per index.
//!
//! Strategy: `Penalize` is two dispatches: the existing element-wise copy of the logits into
//! the result, then one invocation per history slot that rewrites the penalized elements (the
//! hazard tracker puts a barrier between the two, since both write the result). `Sample` is
//! one workgroup per row (`shaders/sample.wgsl`); the row's parameters and key are device data,
//! so every decision on them is taken in the kernel.
//!
//! Invariant: shapes and dtypes are checked as the CPU kernels check them (the same wording)
//! before anything is bound; every element a kernel reaches lies in a binding `Ctx::bind`
//! proved in range; history ids are data and are range-checked by the kernel, which skips bad
//! ones as the reference does.

use lowsync_backend::Result;
use lowsync_graph::DType;

use super::elementwise;
use super::layout::{Ctx, Dispatch, Res};
use crate::pipelines::Push;

/// Passes of the sample kernel's radix descent over a 32-bit key, four bits each. A push
/// constant rather than a literal in the shader, so that the shader compiler keeps the loop
/// instead of unrolling eight copies of a pass's barriers (lavapipe lowers each barrier to a
/// coroutine suspend point, and its compile time grows fast with their number).
const RADIX_PASSES: u32 = 8;

/// The longest row `Sample` takes: its top-p masses are summed as 64-bit fixed point with 40
/// fractional bits, which holds any sum of fewer than 2^24 masses of at most 1.
const MAX_ROW: usize = (1 << 24) - 1;

/// Fails unless `t` is `dtype` of exactly `shape` (the CPU kernels' message).
fn expect(c: &Ctx, what: &str, t: &Res, dtype: DType, shape: &[usize]) -> Result<()> {
    if t.dtype != dtype || t.shape != shape {
        return Err(c.err(format!(
            "{what} must be {dtype} {shape:?}, got {} {:?}",
            t.dtype, t.shape
        )));
    }
    Ok(())
}

/// Row and column strides of a rank-2 view.
fn strides2(c: &Ctx, t: &Res) -> Result<[u32; 2]> {
    Ok([
        c.u32(t.strides[0], "stride")?,
        c.u32(t.strides[1], "stride")?,
    ])
}

/// `dst = logits` with the repeat / frequency / presence penalties on the ids of `hist`.
pub(super) fn penalize(
    c: &Ctx,
    dst: &Res,
    logits: &Res,
    hist: &Res,
    params: &Res,
) -> Result<Vec<Dispatch>> {
    if logits.rank() != 2 {
        return Err(c.err(format!("logits must be [R, V], got {:?}", logits.shape)));
    }
    let (rows, v) = (logits.shape[0], logits.shape[1]);
    expect(c, "logits", logits, DType::F32, &[rows, v])?;
    expect(c, "result", dst, DType::F32, &[rows, v])?;
    if hist.rank() != 2 {
        return Err(c.err(format!("hist must be [R, N], got {:?}", hist.shape)));
    }
    let n = hist.shape[1];
    expect(c, "hist", hist, DType::I32, &[rows, n])?;
    expect(c, "params", params, DType::F32, &[rows, 3])?;
    if rows == 0 || v == 0 {
        return Ok(Vec::new());
    }
    let mut out = vec![elementwise::copy(c, dst, logits)?];
    if n == 0 {
        return Ok(out);
    }
    let threads = rows
        .checked_mul(n)
        .ok_or_else(|| c.err("history slots overflow"))?;
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(logits, false)?;
    let (bh, oh) = c.bind(hist, false)?;
    let (bp, op) = c.bind(params, false)?;
    let [hs0, hs1] = strides2(c, hist)?;
    let [ps0, ps1] = strides2(c, params)?;
    let [ds0, ds1] = strides2(c, dst)?;
    let [as0, as1] = strides2(c, logits)?;
    out.push(Dispatch {
        kernel: "penalize.d_f32.a_f32.hist_i32.par_f32".into(),
        binds: vec![bd, ba, bh, bp],
        push: Push {
            shape: c.u4(&[rows, n, v], "extent")?,
            d_str: [ds0, ds1, 0, 0],
            a_str: [as0, as1, 0, 0],
            b_str: [hs0, hs1, ps0, ps1],
            offs: [od, oa, oh, op],
            op: [c.u32(threads, "history slot count")?, 0, 0, 0],
            ..Push::default()
        },
        groups: c.spread(threads, 256)?,
    });
    Ok(out)
}

/// `dst[r]` = the token drawn from row `r` of `logits` under `params[r]` and `key[r]`.
pub(super) fn sample(
    c: &Ctx,
    dst: &Res,
    logits: &Res,
    params: &Res,
    key: &Res,
) -> Result<Vec<Dispatch>> {
    if logits.rank() != 2 || logits.shape[1] == 0 {
        return Err(c.err(format!(
            "logits must be [R, V] with V > 0, got {:?}",
            logits.shape
        )));
    }
    let (rows, v) = (logits.shape[0], logits.shape[1]);
    expect(c, "logits", logits, DType::F32, &[rows, v])?;
    expect(c, "result", dst, DType::I32, &[rows])?;
    expect(c, "params", params, DType::F32, &[rows, 4])?;
    expect(c, "key", key, DType::I32, &[rows, 2])?;
    if v > MAX_ROW {
        return Err(c.err(format!(
            "rows of {v} logits exceed the {MAX_ROW} whose masses the Vulkan sampler sums \
             exactly"
        )));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(logits, false)?;
    let (bp, op) = c.bind(params, false)?;
    let (bk, ok) = c.bind(key, false)?;
    let [as0, as1] = strides2(c, logits)?;
    let [ps0, ps1] = strides2(c, params)?;
    let [ks0, ks1] = strides2(c, key)?;
    Ok(vec![Dispatch {
        kernel: "sample.d_i32.a_f32.par_f32.key_i32".into(),
        binds: vec![bd, ba, bp, bk],
        push: Push {
            shape: [c.u32(rows, "row count")?, c.u32(v, "row length")?, 0, 0],
            d_str: [c.u32(dst.strides[0], "stride")?, 0, 0, 0],
            a_str: [as0, as1, 0, 0],
            b_str: [ps0, ps1, ks0, ks1],
            offs: [od, oa, op, ok],
            op: [RADIX_PASSES, 0, 0, 0],
            ..Push::default()
        },
        groups: c.spread(rows, 1)?,
    }])
}
