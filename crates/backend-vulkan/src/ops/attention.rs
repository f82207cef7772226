//! The fused decode attention's dispatch (`shaders/attn_dec.wgsl`): one query row per head,
//! scores, masked softmax and the product with V in one kernel.
//!
//! Why: `crate::fusion` proves from the graph that a chain may run fused; this planner checks
//! what the kernel itself needs (dtypes it was compiled for, a head dim it holds, 32-bit
//! offsets and strides) and fills its push constants, like every other kernel family.
//!
//! Strategy: q is `[heads, 1, dim]`, K `[kv_heads, dim, keys]` (K transposed, any strides), V
//! `[kv_heads, keys, dim]`, the mask broadcast onto `[heads, 1, keys]`; the result is bound as
//! the tensor the kernel writes (the permuting copy's destination, or the product's), addressed
//! by a head stride and a dim stride the caller derives from the copy's axes.
//!
//! Invariant: a refused shape is an error; the caller then plans the chain unfused.

use lowsync_backend::Result;
use lowsync_graph::DType;

use super::layout::{dt, Ctx, Dispatch, Res};
use crate::pipelines::Push;

/// The largest head dimension (one output dim per thread of a 256-wide workgroup).
pub(crate) const MAX_DIM: usize = 256;

/// The fused attention's operands.
pub(crate) struct Attn<'a> {
    pub q: &'a Res,
    pub k: &'a Res,
    pub v: &'a Res,
    pub mask: &'a Res,
    pub scale: f32,
    /// The tensor written, and the element strides of (head, dim) in it.
    pub out: &'a Res,
    pub out_strides: [usize; 2],
}

pub(super) fn attention(c: &Ctx, a: &Attn) -> Result<Dispatch> {
    let (q, k, v) = (a.q, a.k, a.v);
    let ok = q.rank() == 3
        && k.rank() == 3
        && v.rank() == 3
        && q.shape[1] == 1
        && k.shape[1] == q.shape[2]
        && v.shape == [k.shape[0], k.shape[2], q.shape[2]]
        && k.shape[0] > 0
        && q.shape[0] % k.shape[0] == 0
        && (1..=MAX_DIM).contains(&q.shape[2])
        && k.shape[2] > 0
        && q.dtype == DType::F32
        && a.mask.dtype == DType::F32
        && k.dtype.is_float()
        && v.dtype.is_float()
        && a.out.dtype.is_float();
    if !ok {
        return Err(c.err("not a decode attention the fused kernel takes"));
    }
    let (heads, dim, keys) = (q.shape[0], q.shape[2], k.shape[2]);
    let ms = a
        .mask
        .broadcast_to(&[heads, 1, keys])
        .ok_or_else(|| c.err("the mask does not broadcast onto the scores"))?;
    if heads > c.lim.max_groups[0] as usize {
        return Err(c.err("more heads than workgroups along x"));
    }
    let (bd, od) = c.bind(a.out, true)?;
    let (bq, oq) = c.bind(q, false)?;
    let (bk, ok_) = c.bind(k, false)?;
    let (bv, ov) = c.bind(v, false)?;
    let (bm, om) = c.bind(a.mask, false)?;
    let u = |x: usize, w: &str| c.u32(x, w);
    let push = Push {
        shape: [
            u(heads, "heads")?,
            u(dim, "head dim")?,
            u(keys, "keys")?,
            u(heads / k.shape[0], "heads per kv head")?,
        ],
        d_str: [
            u(a.out_strides[0], "stride")?,
            u(a.out_strides[1], "stride")?,
            od,
            0,
        ],
        a_str: [
            u(q.strides[0], "stride")?,
            u(q.strides[2], "stride")?,
            oq,
            0,
        ],
        b_str: [
            u(k.strides[0], "stride")?,
            u(k.strides[1], "stride")?,
            u(k.strides[2], "stride")?,
            ok_,
        ],
        offs: [
            u(v.strides[0], "stride")?,
            u(v.strides[1], "stride")?,
            u(v.strides[2], "stride")?,
            ov,
        ],
        op: [u(ms[0], "stride")?, u(ms[2], "stride")?, om, 0],
        prm: [a.scale.to_bits(), 0, 0, 0],
        ..Push::default()
    };
    Ok(Dispatch {
        kernel: format!(
            "attn_dec.d_{}.a_f32.k_{}.v_{}.m_f32",
            dt(a.out.dtype),
            dt(k.dtype),
            dt(v.dtype)
        ),
        binds: vec![bd, bq, bk, bv, bm],
        push,
        groups: [heads as u32, 1, 1],
    })
}
