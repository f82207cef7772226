//! The fused decode attention's dispatch (`shaders/attn_dec.wgsl`): one query row per head,
//! scores, masked softmax and the product with V in one kernel.
//!
//! Why: `crate::fusion` proves from the graph that a chain may run fused; this planner checks
//! what the kernel itself needs (dtypes it was compiled for, a head dim it holds, 32-bit
//! offsets and strides, subgroup arithmetic for its reductions) and fills its push constants, like every other kernel family.
//!
//! Strategy: q is `[heads, 1, dim]`, K `[kv_heads, dim, keys]` (K transposed, any strides), V
//! `[kv_heads, keys, dim]`, the mask broadcast onto `[heads, 1, keys]`; the result is bound as
//! the tensor the kernel writes (the permuting copy's destination, or the product's), addressed
//! by a head stride and a dim stride the caller derives from the copy's axes.
//!
//! Split over keys (`LOWSYNC_VK_ATTN_SPLIT`, `shaders/attn_split.wgsl`): a grid of heads x
//! C_max workgroups writes partial softmaxes into the backend's partials buffer, and a head's
//! last chunk to finish (by a ticket word per head at the buffer's start) merges them in the
//! same dispatch; the device picks how many of the C_max chunks a step uses from the mask, so
//! a recorded plan stays valid at every depth. C_max is lowered to what the partials buffer
//! holds for this head count and dim after the tickets; below 2 the head runs unsplit.
//!
//! Invariant: a refused shape is an error; the caller then plans the chain unfused.

use lowsync_backend::Result;
use lowsync_graph::DType;

use super::layout::{dt, Ctx, Dispatch, Res};
use crate::pipelines::{Bind, Push};

/// The largest head dimension (one output dim per thread of a 256-wide workgroup).
pub(crate) const MAX_DIM: usize = 256;

/// The fewest keys a chunk of a split head gets: below this the device uses fewer chunks, so
/// a shallow step runs one workgroup per head (one pass of `attn_split`'s score loop).
const SPLIT_MIN_KEYS: u32 = 64;

/// The same for the grouped split (`attn_split_g`), which starts a G-th of the workgroups and
/// so can afford shorter chunks, up to twice as many a head.
const GROUP_MIN_KEYS: u32 = 32;

/// The same for the split with 16-byte loads (`attn_split_v`): a thread takes 4 keys a round
/// (128 keys a round at head dim 64), and a chunk's extra round costs less than the merge's
/// trips, so a head splits only past 256 valid keys.
const VEC_MIN_KEYS: u32 = 256;

/// The most query heads per KV head the grouped split takes (the lanes of a vec4).
const GROUP_MAX_HEADS: usize = 4;

/// Where a split attention keeps its chunks' partials, and the most chunks a head may use.
pub(crate) struct Split {
    /// The partials buffer (32-bit words, zero-filled when made), bound whole: a ticket word
    /// per head, then the chunks' slots.
    pub parts: Bind,
    pub max_chunks: u32,
    /// Query heads of one KV head in one workgroup where the kernel takes them
    /// (`attn_split_g`, `LOWSYNC_VK_ATTN_GROUP`); with `max_chunks` 1, unsplit (one
    /// workgroup per KV head, the buffer bound but unused).
    pub grouped: bool,
    /// K and V read 16 bytes at a time, several keys a thread per round, where the layout
    /// allows (`attn_split_v`, `LOWSYNC_VK_ATTN_VEC`); with `max_chunks` 1, unsplit.
    pub vec: bool,
}

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
    /// Split over keys or grouped (`None`: one workgroup per head, `attn_dec`).
    pub split: Option<Split>,
}

pub(super) fn attention(c: &Ctx, a: &Attn) -> Result<Vec<Dispatch>> {
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
    if !c.lim.subgroups {
        // Its reductions go through subgroup operations (`shaders/attn_body.wgsl`).
        return Err(c.err("the fused attention needs subgroup arithmetic"));
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
    let names = format!(
        "d_{}.a_f32.k_{}.v_{}.m_f32",
        dt(a.out.dtype),
        dt(k.dtype),
        dt(v.dtype)
    );
    // Slot floats of one chunk: [max, sum, NaN seen, unused, acc[dim]]; the slots start after
    // the heads' ticket words, on a 16-byte boundary.
    let slot = dim as u64 + 4;
    let slots_at = (heads as u64).next_multiple_of(4);
    let mut split_push = push;
    split_push.op[3] = u(slots_at as usize, "partials offset")?;
    // Chunks of `want` a head that the partials buffer and the grid hold.
    let fitting = |parts: &Bind, want: u64| {
        let fit = (parts.range / 4).saturating_sub(slots_at) / (slot * heads as u64);
        want.min(fit).min(u64::from(c.lim.max_groups[1])) as u32
    };
    // A split kernel's one dispatch: `chunks` workgroups along y for each of `rows` (heads or
    // KV heads), chunks of at least `min_keys`.
    let split = |kernel: &str, parts: &Bind, rows: usize, chunks: u32, min_keys: u32| {
        let mut push = split_push;
        push.prm[1] = chunks;
        push.prm[2] = min_keys;
        vec![Dispatch {
            kernel: format!("{kernel}.{names}.p_f32"),
            binds: vec![bd, bq, bk, bv, bm, *parts],
            push,
            groups: [rows as u32, chunks, 1],
        }]
    };
    let per_kv = heads / k.shape[0];
    let groupable =
        (2..=GROUP_MAX_HEADS).contains(&per_kv) && per_kv * dim <= MAX_DIM && ms[0] == 0;
    if let Some(s) = a.split.as_ref().filter(|s| s.grouped && groupable) {
        // Unsplit (one chunk, no slots) where asked, else twice the chunks a head where they
        // fit: each workgroup does G heads' work.
        let chunks = if s.max_chunks <= 1 {
            1
        } else {
            fitting(&s.parts, 2 * u64::from(s.max_chunks)).max(1)
        };
        return Ok(split(
            "attn_split_g",
            &s.parts,
            k.shape[0],
            chunks,
            GROUP_MIN_KEYS,
        ));
    }
    // 8 dims a load: unit dim strides, and every row start on 16 bytes of its binding.
    let eights = |v: &[usize]| v.iter().all(|x| x.is_multiple_of(8));
    let vec_ok = eights(&[dim, k.strides[0], k.strides[2], ok_ as usize])
        && eights(&[v.strides[0], v.strides[1], ov as usize])
        && k.strides[1] == 1
        && v.strides[2] == 1;
    if let Some(s) = a.split.as_ref().filter(|s| s.vec && vec_ok) {
        let chunks = if s.max_chunks <= 1 {
            1
        } else {
            fitting(&s.parts, u64::from(s.max_chunks)).max(1)
        };
        return Ok(split("attn_split_v", &s.parts, heads, chunks, VEC_MIN_KEYS));
    }
    let chunks = a
        .split
        .as_ref()
        .map_or(0, |s| fitting(&s.parts, u64::from(s.max_chunks)));
    let Some(s) = a.split.as_ref().filter(|_| chunks >= 2) else {
        return Ok(vec![Dispatch {
            kernel: format!("attn_dec.{names}"),
            binds: vec![bd, bq, bk, bv, bm],
            push,
            groups: [heads as u32, 1, 1],
        }]);
    };
    Ok(split("attn_split", &s.parts, heads, chunks, SPLIT_MIN_KEYS))
}
