//! The launchers of fused attention (attention.cu): `q @ K^T -> SoftMax -> p @ V`, optionally
//! with the copy of a permutation of o — decode's, one block per query head, and prefill's
//! (`launch_prefill`), one block per (head, tile of query rows).
//!
//! Why: a decode step waits on attention, and its K/V rows come from DRAM; as one kernel the
//! scores and p stay on chip, masked keys' rows are never read, and with programmatic
//! dependent launch the kernel starts (and rehearses) while q/k/v finishes.
//!
//! Strategy: `attn_fast` where its short path applies (f32 q, mask and copy, aligned rows, a
//! power-of-two number of 16-byte pieces per head, 32-bit offsets; `CudaConfig::attn_fast`),
//! `attn_fast_long` for a masked window whose scores and p are dead, else `attn_decode`. Such a
//! window longer than one round trip of keys runs split over its keys (`attn_split`, several
//! blocks per head and a merge by the head's last block; [`split_chunks`]) when
//! `CudaConfig::attn_split` is not 0 (1 by default: the chunks from the multiprocessors). The
//! [`Live`] flags say which intermediates must be written.
//!
//! Prefill's kernel, `attn_prefill`, is flash-attention style: K/V tiles in shared memory, an
//! online softmax, the scores and p never written (the matcher takes it only where both are
//! dead), key tiles the mask excludes for every row of a block skipped.
//!
//! Invariant: the raw scores, p and o are skipped only when `safety::dead_after` proved them
//! dead; the mask is read ahead of the dependency wait only when [`mask_ahead`] holds.

use lowsync_backend::{ExecNode, Result, TensorRef};
use lowsync_graph::{DType, Op};

use crate::exec::launch::{dt, kernel_err, Args, Exec};
use crate::exec::matmul::{self, moving};
use crate::fusion::group::cpy_axes;
use crate::fusion::patterns::PREFILL_ROWS;
use crate::fusion::safety::overlap;
use crate::kernels::Kernel;
use crate::layout::broadcast_strides;
use crate::memory::ATTN_SPLIT_SLOT_FLOATS;

/// Threads of an attention block (`ATT_T`, `AF_T`).
const ATT_THREADS: usize = 256;

/// Keys one listing of `attn_fast_long` / `attn_split` covers (`AF_LS`): the split takes
/// windows of at most one.
const LISTING_KEYS: usize = 2048;

/// Passes of a round trip of K/V loads in `attn_fast` (`AF_P`).
const ROUND_TRIP_PASSES: usize = 8;

/// The key chunks per query head `attn_split` is launched with, or `None` for one block per
/// head (`attn_fast_long`): `setting` is `CudaConfig::attn_split` (0 off; 1 multiprocessors /
/// heads; N at most N), `lanes` the lanes sharing a key (head size / elements in 16 bytes),
/// `slots` the blocks `AttnSplitWork` holds. A window of one round trip of keys or less, or
/// past one listing, keeps one block; so does a count below 2. The device takes fewer chunks
/// when fewer keys are valid (at most ceil(2 valid / round trip)); more than
/// ceil(2 window / round trip) would never run, so the grid stops there.
pub(super) fn split_chunks(
    setting: usize,
    heads: usize,
    window: usize,
    lanes: usize,
    sms: usize,
    slots: usize,
) -> Option<usize> {
    let round_trip = ATT_THREADS / lanes.max(1) * ROUND_TRIP_PASSES;
    if setting == 0 || heads == 0 || window <= round_trip || window > LISTING_KEYS {
        return None;
    }
    let want = if setting == 1 { sms / heads } else { setting };
    let chunks = want
        .min((2 * window).div_ceil(round_trip))
        .min(crate::config::ATTN_SPLIT_MAX)
        .min(slots / heads);
    (chunks >= 2).then_some(chunks)
}

/// The kernels' `rehearse` argument: 0 none, 1 the whole path, 2 (`CudaConfig::rehearse_list`)
/// only the listing of the valid keys where the real pass reuses it.
fn rehearse_mode(exec: &Exec<'_>) -> i32 {
    match (exec.rehearse(), exec.inner.cfg.rehearse_list) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    }
}

/// Whether attention's mask may be read before its dependency wait: no node of the graph
/// writes the mask's buffer (decode's mask is uploaded before the graph runs), and a node of
/// the graph writes q, so the launch just before the attention — the only kernel that may still
/// run while it rehearses — is this graph's.
pub(super) fn mask_ahead(nodes: &[ExecNode], kq: &ExecNode, sm: &ExecNode) -> bool {
    sm.srcs.get(1).is_some_and(|m| {
        !nodes.iter().any(|n| n.dst.buffer == m.buffer)
            && nodes.iter().any(|n| overlap(&n.dst, &kq.srcs[0]))
    })
}

/// Which of the attention's intermediate results must be written: the raw scores, p, and o
/// (when it has a copy); and whether its mask may be read ahead.
#[derive(Clone, Copy, Debug)]
pub(super) struct Live {
    pub(super) scores: bool,
    pub(super) probs: bool,
    pub(super) out: bool,
    /// See [`mask_ahead`].
    pub(super) mask_ahead: bool,
}

pub(super) fn launch_attention(
    exec: &Exec<'_>,
    [kq, sm, pv]: [&ExecNode; 3],
    cpy: Option<&ExecNode>,
    live: Live,
) -> Result<()> {
    let Op::SoftMax { scale } = sm.op else {
        return Err(kernel_err(sm, "fused as a softmax but is not one"));
    };
    let q = exec.resolve(&kq.srcs[0])?;
    let k = exec.resolve(&kq.srcs[1])?;
    let s = exec.resolve(&kq.dst)?;
    let p = exec.resolve(&sm.dst)?;
    let v = exec.resolve(&pv.srcs[1])?;
    let o = exec.resolve(&pv.dst)?;
    let (hq, d, l) = (q.shape[0], q.shape[2], k.shape[2]);
    let esz = k.dtype.size_bytes();
    let vw = 16 / esz;
    let kvec = matmul::aligned(
        k.ptr,
        esz,
        &[moving(k.shape[0], k.strides[0]), moving(l, k.strides[2])],
        16,
    );
    let vvec = d % vw == 0
        && matmul::aligned(
            v.ptr,
            esz,
            &[moving(v.shape[0], v.strides[0]), moving(l, v.strides[1])],
            16,
        );
    let g = d.div_ceil(vw).next_power_of_two().min(32);
    let tc = (if vvec { d / vw } else { d }).next_power_of_two();
    let (mask, m_hs, m_ls) = match sm.srcs.get(1) {
        Some(m) => {
            let m = exec.resolve(m)?;
            let bs = broadcast_strides(&m.shape, &m.strides, &s.shape)
                .ok_or_else(|| kernel_err(sm, "mask does not broadcast"))?;
            (Some(m), bs[0] as i64, bs[2] as i64)
        }
        None => (None, 0, 0),
    };
    let (c, c_hs, c_ds) = match cpy {
        Some(node) => {
            let axes = cpy_axes(&pv.dst, node)
                .ok_or_else(|| kernel_err(node, "fused as a copy of the attention but is not"))?;
            let c = exec.resolve(&node.dst)?;
            let st = |ax: Option<usize>| ax.map_or(0, |b| c.strides[b] as i64);
            let (hs, ds) = (st(axes[0]), st(axes[2]));
            (Some(c), hs, ds)
        }
        None => (None, 0, 0),
    };
    // The kernel's short paths compute offsets in 32 bits: every tensor it touches must span
    // fewer than 2^31 bytes.
    let small = |t: &TensorRef| t.byte_extent() < i32::MAX as usize;
    let narrow = [
        &kq.srcs[0],
        &kq.srcs[1],
        &kq.dst,
        &sm.dst,
        &pv.srcs[1],
        &pv.dst,
    ]
    .into_iter()
    .chain(sm.srcs.get(1))
    .chain(cpy.map(|c| &c.dst))
    .all(small);
    let grid = hq.clamp(1, i32::MAX as usize) as u32;
    let f32io = q.dtype == DType::F32
        && mask.as_ref().is_none_or(|m| m.dtype == DType::F32)
        && c.as_ref().is_none_or(|c| c.dtype == DType::F32);
    if exec.inner.cfg.attn_fast
        && narrow
        && f32io
        && kvec
        && vvec
        && d % vw == 0
        && matches!(d / vw, 4 | 8 | 16 | 32)
    {
        let i = |v: usize| v as i32;
        let args = Args::new()
            .arg(i(l))
            .arg(i(d))
            .arg(scale)
            .arg(q.ptr)
            .arg(i(q.strides[0]))
            .arg(i(q.strides[2]))
            .arg(dt(k.dtype))
            .arg(k.ptr)
            .arg(i(k.strides[0]))
            .arg(i(k.strides[2]))
            .arg(i(hq / k.shape[0]))
            .arg(v.ptr)
            .arg(i(v.strides[0]))
            .arg(i(v.strides[1]))
            .arg(i(hq / v.shape[0]))
            .arg(mask.as_ref().map_or(0, |m| m.ptr))
            .arg(m_hs as i32)
            .arg(m_ls as i32)
            .arg(mask.is_some() as i32)
            .arg(s.ptr)
            .arg(i(s.strides[0]))
            .arg(i(s.strides[2]))
            .arg(live.scores as i32)
            .arg(p.ptr)
            .arg(i(p.strides[0]))
            .arg(i(p.strides[2]))
            .arg(live.probs as i32)
            .arg(o.ptr)
            .arg(i(o.strides[0]))
            .arg(i(o.strides[2]))
            .arg(live.out as i32)
            .arg(c.as_ref().map_or(0, |c| c.ptr))
            .arg(c_hs as i32)
            .arg(c_ds as i32)
            .arg(cpy.is_some() as i32)
            .arg(rehearse_mode(exec))
            .arg(live.mask_ahead as i32);
        // A window with a mask, and neither the scores nor p written (decode's): its valid keys
        // are listed first (`attn_fast_long`), so masked keys cost no memory round trips. Also
        // within one chunk of keys, where `attn_fast` would read every row with the mask in
        // one round trip: on the H200 ("1b", one process) the listing took 695.4 µs per token
        // against 708.3 over 128 tokens filling a 165-row window, and 699.0 against 694.3 in
        // a 78-row window 88-97% full; a decode window is about half empty on average.
        let kernel = if mask.is_some() && !live.scores && !live.probs {
            Kernel::AttnFastLong
        } else {
            Kernel::AttnFast
        };
        let work = &exec.inner.attn_split_work;
        let split = split_chunks(
            exec.inner.cfg.attn_split,
            hq,
            l,
            d / vw,
            exec.inner.sms,
            work.slots(),
        );
        if let (Kernel::AttnFastLong, Some(chunks)) = (kernel, split) {
            debug_assert!(d + 4 <= ATTN_SPLIT_SLOT_FLOATS);
            let args = args
                .arg(chunks as i32)
                .arg(work.partials())
                .arg(work.tickets());
            let grid = u32::try_from(hq * chunks)
                .map_err(|_| kernel_err(kq, "too many split attention blocks"))?;
            return exec.launch(kq, Kernel::AttnSplit, grid, ATT_THREADS as u32, args);
        }
        return exec.launch(kq, kernel, grid, ATT_THREADS as u32, args);
    }
    let args = Args::new()
        .arg(l as i64)
        .arg(d as i64)
        .arg(scale)
        .arg(q.ptr)
        .arg(dt(q.dtype))
        .arg(q.strides[0] as i64)
        .arg(q.strides[2] as i64)
        .arg(dt(k.dtype))
        .arg(k.ptr)
        .arg(k.strides[0] as i64)
        .arg(k.strides[2] as i64)
        .arg((hq / k.shape[0]) as i64)
        .arg(kvec as i32)
        .arg(g as i32)
        .arg(v.ptr)
        .arg(v.strides[0] as i64)
        .arg(v.strides[1] as i64)
        .arg((hq / v.shape[0]) as i64)
        .arg(vvec as i32)
        .arg(tc as i32)
        .arg(mask.as_ref().map_or(0, |m| m.ptr))
        .arg(mask.as_ref().map_or(0, |m| dt(m.dtype)))
        .arg(m_hs)
        .arg(m_ls)
        .arg(mask.is_some() as i32)
        .arg(s.ptr)
        .arg(s.strides[0] as i64)
        .arg(s.strides[2] as i64)
        .arg(live.scores as i32)
        .arg(p.ptr)
        .arg(p.strides[0] as i64)
        .arg(p.strides[2] as i64)
        .arg(o.ptr)
        .arg(o.strides[0] as i64)
        .arg(o.strides[2] as i64)
        .arg(c.as_ref().map_or(0, |c| c.ptr))
        .arg(c.as_ref().map_or(0, |c| dt(c.dtype)))
        .arg(c_hs)
        .arg(c_ds)
        .arg(cpy.is_some() as i32)
        .arg(narrow as i32);
    exec.launch(kq, Kernel::AttnDecode, grid, ATT_THREADS as u32, args)
}

/// Threads of a prefill attention block (`AP_T`).
const PREFILL_THREADS: u32 = 128;

/// Launches `attn_prefill` for the chain (several query rows per head): one block per (head,
/// tile of `PREFILL_ROWS` query rows). The scores and p are dead (the matcher's condition) and
/// never written; o is written when `write_o` (something reads it besides the copy).
pub(super) fn launch_prefill(
    exec: &Exec<'_>,
    [kq, sm, pv]: [&ExecNode; 3],
    cpy: Option<&ExecNode>,
    write_o: bool,
) -> Result<()> {
    let Op::SoftMax { scale } = sm.op else {
        return Err(kernel_err(sm, "fused as a softmax but is not one"));
    };
    let q = exec.resolve(&kq.srcs[0])?;
    let k = exec.resolve(&kq.srcs[1])?;
    let v = exec.resolve(&pv.srcs[1])?;
    let o = exec.resolve(&pv.dst)?;
    let (hq, nq, d, l) = (q.shape[0], q.shape[1], q.shape[2], k.shape[2]);
    let (mask, m) = match sm.srcs.get(1) {
        Some(t) => {
            let m = exec.resolve(t)?;
            let bs = broadcast_strides(&m.shape, &m.strides, &kq.dst.shape)
                .ok_or_else(|| kernel_err(sm, "mask does not broadcast"))?;
            (Some(m), [bs[0] as i64, bs[1] as i64, bs[2] as i64])
        }
        None => (None, [0; 3]),
    };
    let (c, cs) = match cpy {
        Some(node) => {
            let axes = cpy_axes(&pv.dst, node)
                .ok_or_else(|| kernel_err(node, "fused as a copy of the attention but is not"))?;
            let c = exec.resolve(&node.dst)?;
            let st = |ax: Option<usize>| ax.map_or(0, |b| c.strides[b] as i64);
            let cs = [st(axes[0]), st(axes[1]), st(axes[2])];
            (Some(c), cs)
        }
        None => (None, [0; 3]),
    };
    // 16-byte K/V loads: every row start of every kv head aligned, D whole 16-byte pieces.
    let esz = k.dtype.size_bytes();
    let kvec = d.is_multiple_of(16 / esz)
        && [
            (&k, k.strides[0], k.strides[2]),
            (&v, v.strides[0], v.strides[1]),
        ]
        .iter()
        .all(|(t, hs, ls)| {
            matmul::aligned(t.ptr, esz, &[moving(t.shape[0], *hs), moving(l, *ls)], 16)
        });
    let tiles = nq.div_ceil(PREFILL_ROWS);
    let grid = u32::try_from(hq * tiles)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| kernel_err(kq, "too many prefill attention blocks"))?;
    let s = |i: usize| q.strides[i] as i64;
    let args = Args::new()
        .arg(l as i64)
        .arg(nq as i64)
        .arg(d as i64)
        .arg(scale)
        .arg(q.ptr)
        .arg(dt(q.dtype))
        .arg(s(0))
        .arg(s(1))
        .arg(s(2))
        .arg(dt(k.dtype))
        .arg(k.ptr)
        .arg(k.strides[0] as i64)
        .arg(k.strides[2] as i64)
        .arg((hq / k.shape[0]) as i64)
        .arg(v.ptr)
        .arg(v.strides[0] as i64)
        .arg(v.strides[1] as i64)
        .arg((hq / v.shape[0]) as i64)
        .arg(kvec as i32)
        .arg(mask.as_ref().map_or(0, |m| m.ptr))
        .arg(mask.as_ref().map_or(0, |m| dt(m.dtype)))
        .arg(m[0])
        .arg(m[1])
        .arg(m[2])
        .arg(mask.is_some() as i32)
        .arg(o.ptr)
        .arg(o.strides[0] as i64)
        .arg(o.strides[1] as i64)
        .arg(o.strides[2] as i64)
        .arg(write_o as i32)
        .arg(c.as_ref().map_or(0, |c| c.ptr))
        .arg(c.as_ref().map_or(0, |c| dt(c.dtype)))
        .arg(cs[0])
        .arg(cs[1])
        .arg(cs[2])
        .arg(cpy.is_some() as i32);
    exec.launch(kq, Kernel::AttnPrefill, grid, PREFILL_THREADS, args)
}

#[cfg(test)]
mod tests {
    use super::split_chunks;

    #[test]
    fn split_chunks_fill_the_device_only_past_one_round_trip_of_keys() {
        // "1b" on an H200: 32 heads, head size 64 in f16 (8 lanes a key: 256 keys a round
        // trip), 132 multiprocessors, the bench's 640-cell window: four blocks a head.
        assert_eq!(split_chunks(1, 32, 640, 8, 132, 528), Some(4));
        // One round trip or less, past one listing, or switched off: one block a head.
        assert_eq!(split_chunks(1, 32, 256, 8, 132, 528), None);
        assert_eq!(split_chunks(1, 32, 2049, 8, 132, 528), None);
        assert_eq!(split_chunks(0, 32, 640, 8, 132, 528), None);
        // Few heads: bounded by what the window can use (ceil(2 * 640 / 256) = 5).
        assert_eq!(split_chunks(1, 4, 640, 8, 132, 528), Some(5));
        // Asked for: as given, within the window, the cap and the partial slots.
        assert_eq!(split_chunks(3, 32, 2048, 8, 132, 528), Some(3));
        assert_eq!(split_chunks(32, 4, 2048, 8, 132, 528), Some(16));
        assert_eq!(split_chunks(32, 64, 2048, 4, 132, 528), Some(8));
        // More heads than multiprocessors hold twice over: one block a head.
        assert_eq!(split_chunks(1, 96, 640, 8, 132, 528), None);
    }
}
