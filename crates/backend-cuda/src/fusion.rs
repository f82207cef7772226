//! Fused decode kernels: node patterns of a compute graph that run as one launch.
//!
//! Why: decode is a chain of small launches (~22 per llama layer); each costs a launch and a
//! pass over its operands. Replacing the common chains by one kernel each brings a layer to 7
//! or 8 launches and drops the passes over intermediates the fused kernel keeps in registers.
//!
//! Strategy: [`plan`] is a pure matcher over the graph's nodes (no device, nothing cached: it
//! runs on every [`run_graph`] call and looks at each node and a short window after it). At
//! each node not yet taken it tries the patterns below, every further member within [`WINDOW`]
//! nodes of an earlier one; a matched group runs as one kernel at the position of its first
//! node, every other node through [`Exec::run`] as before. The patterns (kernels in `kernels/fused.cu`):
//! - `RmsNorm -> Mul(norm, weight row)`: one block per row; or, for one f32 row feeding the
//!   products below, their decode kernel's prologue (each block computes the row in shared
//!   memory, block 0 also writes the norm and the product) when their blocks fit one wave.
//! - `MulMat`s of one activation (the same `TensorRef`) — q/k/v, gate/up — each optionally
//!   followed by an `Add` of its result and a bias row or a residual; or a gate/up pair feeding
//!   a `SwiGlu`: one matrix-vector launch over the concatenated output columns, epilogues
//!   included. A single `MulMat -> Add` is the one-product case.
//! - `Rope -> SetRows(cache, rope result reshaped)`, plus the next plain `SetRows` (the V
//!   row): rope, cache row write and V row write in one launch.
//! - `MulMat(q, K) -> SoftMax(mask, scale) -> MulMat(p, V) [-> Cpy of a permutation]` for one
//!   query row per head: one block per query head. `attn_fast` where it applies (f32 q, mask
//!   and copy, aligned rows, a power-of-two number of 16-byte pieces per head; see
//!   `CudaConfig::attn_fast`), else `attn_decode`. Both read the K/V rows of valid keys only,
//!   except that `attn_fast` reads a one-chunk window's rows together with its mask (one round
//!   trip instead of two; masked rows' values are never used). A window with a mask whose
//!   scores and p are dead (decode's) takes `attn_fast_long` at any length: it lists the valid
//!   keys first (2048 mask entries per round trip), so masked keys cost nothing.
//! - `MulMat` of one row -> `Argmax` of its whole result (decode's head): each block of the
//!   product folds the best (value, row) of its rows, as a 64-bit key, into one device word
//!   with an integer atomic max (order-independent, so deterministic); a one-thread
//!   `argmax_take` turns the word into the index and zeroes it. No kernel reads the logits back.
//!
//! Each kernel has exact preconditions (dtypes, ranks, contiguity, at most
//! [`matmul::mmv_max_m`] activation rows, head_dim <= [`ATT_MAX_D`], ...); nodes that miss one
//! run unfused. With `CudaConfig::fusion` off every node runs through [`Exec::run`].
//!
//! Invariants (checked per group by [`Footprint::safe`], so results equal the unfused chain's):
//! - A fused kernel writes every tensor its nodes write, in node order within the thread that
//!   owns an element — except the attention's raw scores, and for `attn_fast` also p and (beside
//!   its copy) o, when [`dead_after`] proves nothing reads them before they are overwritten
//!   (the scores of masked positions would need the K rows the kernel skips, and the allocator
//!   puts later tensors over them).
//!   Where the scheduler says which scratch bytes later splits read (`ExecGraph::scratch`),
//!   [`dead_after`] counts every other scratch byte as overwritten at the graph's end (the next
//!   graph writes it before reading), so results nothing reads after the graph are dead too.
//! - No member needs a private copy of a source (`ExecNode::src_needs_private_copy`).
//! - No write of the group overlaps a tensor the group reads, unless the same thread reads the
//!   element before writing it (an in-place residual) or, in the attention, the write belongs to
//!   the block that read those bytes first (results over q); writes overlap each other only as
//!   an in-place node over its own source.
//! - Running later members early is allowed only when no node in between writes bytes a moved
//!   member reads, or reads or writes bytes it writes (byte ranges of `TensorRef`s in one
//!   buffer: the allocator reuses memory).
//!
//! Kernels sum in fixed orders that depend only on shapes (no float atomics), so fused results
//! are deterministic run to run. Their orders differ from the unfused kernels' (decode's
//! products run one output unit per warp, `fused_gemv1`), so fused and unfused results agree
//! within the NMSE bounds of `tests/fused.rs`, not bit for bit; graph replay on and off are
//! bit-identical (same kernels), and so are streamed and unstreamed products (a streamed
//! grid's warps take several units each, every unit still one warp's, in the same order).

use std::sync::Arc;

use lowsync_backend::{ExecGraph, ExecNode, Result, ScratchLive, TensorRef};
use lowsync_graph::{DType, Op, RopeMode};

use crate::kernels::Kernel;
use crate::layout::{broadcast_strides, lay};
use crate::matmul;
use crate::ops::{dt, grid_for, kernel_err, rows_grid, Args, Exec, BLOCK};

/// How far after an earlier member of its group (the first, or the product of an epilogue, or
/// the attention's previous node) a member may lie.
const WINDOW: usize = 16;
/// Rows (tokens) up to which a fused Rope/SetRows runs: a SetRows row checks every later index
/// for a duplicate, so its cost grows with the square of the rows.
const MAX_ROWS: usize = 8;
/// The largest head dimension of the fused attention (`ATT_MAXD` in fused.cu).
const ATT_MAX_D: usize = 256;
/// Threads of an attention block (`ATT_T`, `AF_T`).
const ATT_THREADS: usize = 256;
/// Threads of a fused matrix-vector block (the kernels' launch bounds assume 128).
const GEMV_THREADS: usize = 128;
/// Products of one fused matrix-vector launch (`FG_MAXS`).
const MAX_SEGS: usize = 4;
/// Resident `fused_gemv1` blocks per multiprocessor (104 registers per thread on sm_90; its
/// streamed entry points `fused_gemv1_s16` and kin, 80) ...
const GEMV1_BLOCKS_PER_SM: usize = 2;
/// ... and `fused_gemv1_pair` blocks (at most 88 registers, `__maxnreg__`).
const GEMV1_PAIR_BLOCKS_PER_SM: usize = 2;
/// A device's shared memory limits, in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedLimits {
    /// Per multiprocessor (228 KiB on the H200).
    pub(crate) per_sm: usize,
    /// The most one block may ask for (opt-in; 227 KiB).
    pub(crate) per_block: usize,
    /// Taken by the system for each resident block (1 KiB).
    pub(crate) reserved: usize,
}

/// Bytes of shared memory each block of a streamed product asks for at least, so that its
/// `blocks` per multiprocessor fit and one more does not: the streamed entry points take 80
/// registers, so the register file alone would let a third block onto a multiprocessor, and a
/// grid of two per multiprocessor would then land unevenly and take the room the next kernel's
/// first blocks start in. `pad_kb` is `CudaConfig::stream_pad_kb`: `None` computes it (the
/// least that excludes one more block, rounded up to 8 KiB: 80 KiB on the H200, leaving 66 KiB
/// beside two blocks for the next kernel), `Some(0)` turns it off, `Some(n)` asks for n KiB,
/// capped at what a block may have less 1 KiB (the kernels' own static shared memory, 128
/// bytes, counts against the same limit). 0 where no pad holds exactly `blocks`.
pub(crate) fn stream_pad(pad_kb: Option<usize>, blocks: usize, lim: SharedLimits) -> usize {
    if let Some(kb) = pad_kb {
        return (kb << 10).min(lim.per_block.saturating_sub(1 << 10));
    }
    let blocks = blocks.max(1);
    let least = (lim.per_sm / (blocks + 1) + 1).saturating_sub(lim.reserved);
    let pad = least.div_ceil(8 << 10) * (8 << 10);
    if pad + (1 << 10) > lim.per_block || blocks * (pad + lim.reserved) > lim.per_sm {
        return 0;
    }
    pad
}

/// The lane chain of a fused norm prologue's writes (products use their segment index).
const NORM_CHAIN: usize = usize::MAX;

/// One unit of work of a graph: a node run as before, or a fused group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Node(usize),
    Fused(Group),
}

/// Nodes that run as one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) kind: Kind,
    /// Member node indices, ascending; the kernel runs at the first one's position.
    pub(crate) nodes: Vec<usize>,
}

impl Group {
    fn new(kind: Kind) -> Group {
        let nodes = kind.members();
        Group { kind, nodes }
    }
}

/// A fused pattern and its members (node indices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    NormMul {
        norm: usize,
        mul: usize,
    },
    /// Matrix-vector products of one activation; with `swiglu`, exactly a gate and an up
    /// product (in that order) and no Adds. With `norm`, the activation is the result of that
    /// `RmsNorm -> Mul` pair of one row, which the decode kernel computes itself.
    Gemv {
        segs: Vec<Seg>,
        swiglu: Option<usize>,
        norm: Option<NormPro>,
    },
    RopeRows {
        rope: usize,
        rows: usize,
        plain: Option<usize>,
    },
    /// Decode's output head: a one-row product (the `mul_mat_vec_1` shape) and the `Argmax`
    /// of its result: the argmax folded into the product's launch (`mul_mat_vec_1_argmax`),
    /// then a one-thread `argmax_take` instead of a kernel that reads the logits back.
    HeadArgmax {
        mm: usize,
        argmax: usize,
    },
    /// `scores`: the raw `q @ K^T` must be written (something may read it later).
    Attention {
        kq: usize,
        soft_max: usize,
        pv: usize,
        cpy: Option<usize>,
        scores: bool,
    },
}

/// The `RmsNorm -> Mul(norm, weight row)` in front of a fused matrix-vector launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NormPro {
    pub(crate) norm: usize,
    pub(crate) mul: usize,
}

/// One product of a fused matrix-vector launch and its epilogues: the Add, and (decode's
/// row-pair kernel) a `Rope` of the segment's value and a `SetRows` of that result — or of the
/// value itself — into a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seg {
    pub(crate) mm: usize,
    pub(crate) add: Option<usize>,
    pub(crate) rope: Option<usize>,
    pub(crate) rows: Option<usize>,
}

impl Seg {
    fn new(mm: usize, add: Option<usize>) -> Seg {
        Seg {
            mm,
            add,
            rope: None,
            rows: None,
        }
    }

    /// The node whose result is the segment's value (what its Rope or SetRows reads).
    fn value(&self) -> usize {
        self.add.unwrap_or(self.mm)
    }
}

/// Whether any product of the group has a Rope or SetRows epilogue (the row-pair kernel).
fn has_tails(segs: &[Seg]) -> bool {
    segs.iter().any(|s| s.rope.is_some() || s.rows.is_some())
}

impl Kind {
    fn members(&self) -> Vec<usize> {
        let mut v = match self {
            Kind::NormMul { norm, mul } => vec![*norm, *mul],
            Kind::Gemv { segs, swiglu, norm } => segs
                .iter()
                .flat_map(|s| [Some(s.mm), s.add, s.rope, s.rows].into_iter().flatten())
                .chain(*swiglu)
                .chain(norm.iter().flat_map(|n| [n.norm, n.mul]))
                .collect(),
            Kind::HeadArgmax { mm, argmax } => vec![*mm, *argmax],
            Kind::RopeRows { rope, rows, plain } => std::iter::once(*rope)
                .chain([*rows])
                .chain(*plain)
                .collect(),
            Kind::Attention {
                kq,
                soft_max,
                pv,
                cpy,
                ..
            } => [*kq, *soft_max, *pv].into_iter().chain(*cpy).collect(),
        };
        v.sort_unstable();
        v
    }
}

/// Queues every node of `graph`, fused where a pattern matches and fusion is on.
pub(crate) fn run_graph(exec: &mut Exec<'_>, graph: &Arc<ExecGraph>) -> Result<()> {
    let nodes = &graph.nodes;
    if exec.inner.pdl {
        // Before anything of this graph is queued: a weights buffer some node writes is no
        // longer safe to read ahead of `griddepcontrol.wait`.
        exec.inner
            .bufs
            .note_written(nodes.iter().map(|n| n.dst.buffer));
    }
    if !exec.inner.cfg.fusion {
        for node in nodes {
            exec.run(node)?;
        }
        return Ok(());
    }
    let nodes = Nodes {
        list: nodes,
        end: graph.scratch.as_ref(),
    };
    for step in plan(&nodes, exec.inner.cfg.mmv_max_m) {
        match step {
            Step::Node(i) => exec.run(&nodes[i])?,
            Step::Fused(g) => launch(exec, &nodes, &g.kind)?,
        }
    }
    Ok(())
}

/// What `run_graph` launches for `graph` with fusion on, worked out without a device: one line
/// per launch, `fused <kind>` (with its members' ops) or the op of a node run on its own.
pub(crate) fn describe(graph: &ExecGraph, mmv_max_m: Option<usize>) -> Vec<String> {
    let nodes = Nodes {
        list: &graph.nodes,
        end: graph.scratch.as_ref(),
    };
    let ops = |members: &[usize]| -> String {
        let names: Vec<&str> = members.iter().map(|&j| nodes[j].op.name()).collect();
        names.join(",")
    };
    plan(&nodes, mmv_max_m)
        .into_iter()
        .flat_map(|step| match step {
            Step::Node(i) => vec![nodes[i].op.name().to_string()],
            Step::Fused(g) => {
                let kind = match &g.kind {
                    Kind::NormMul { .. } => "norm_mul".to_string(),
                    Kind::Gemv {
                        segs, swiglu, norm, ..
                    } => format!(
                        "gemv{}{}{}",
                        if norm.is_some() { "+norm" } else { "" },
                        if swiglu.is_some() { "+swiglu" } else { "" },
                        if has_tails(segs) { "+tails" } else { "" },
                    ),
                    Kind::RopeRows { .. } => "rope_rows".to_string(),
                    Kind::HeadArgmax { .. } => "gemv+argmax".to_string(),
                    Kind::Attention { cpy, scores, .. } => format!(
                        "attention{}{}",
                        if cpy.is_some() { "+cpy" } else { "" },
                        if *scores { "+scores" } else { "" },
                    ),
                };
                let mut lines = vec![format!("fused {kind} [{}]", ops(&g.nodes))];
                if matches!(g.kind, Kind::HeadArgmax { .. }) {
                    // The one-thread take of the index the product's blocks folded.
                    lines.push("argmax_take".to_string());
                }
                lines
            }
        })
        .collect()
}

/// A graph's nodes and what is known of the scratch bytes read after it
/// (`ExecGraph::scratch`): at the graph's end, [`dead_after`] counts every other scratch byte
/// as overwritten (the next graph writes it before any read).
pub(crate) struct Nodes<'a> {
    list: &'a [ExecNode],
    end: Option<&'a ScratchLive>,
}

impl std::ops::Deref for Nodes<'_> {
    type Target = [ExecNode];
    fn deref(&self) -> &[ExecNode] {
        self.list
    }
}

/// The steps of `nodes`, in execution order. `mmv_max_m` is `CudaConfig::mmv_max_m` (fused
/// products take the matrix-vector kernels' rows limit).
pub(crate) fn plan(nodes: &Nodes<'_>, mmv_max_m: Option<usize>) -> Vec<Step> {
    let mut used = vec![false; nodes.len()];
    let mut steps = Vec::with_capacity(nodes.len());
    for i in 0..nodes.len() {
        if used[i] {
            continue;
        }
        let group = match nodes[i].op {
            Op::RmsNorm { .. } => {
                norm_gemv(nodes, i, &used, mmv_max_m).or_else(|| norm_mul(nodes, i, &used))
            }
            Op::MulMat => attention(nodes, i, &used)
                .or_else(|| gemv(nodes, i, &used, mmv_max_m))
                .or_else(|| head_argmax(nodes, i, &used, mmv_max_m)),
            Op::Rope { .. } => rope_rows(nodes, i, &used),
            _ => None,
        };
        match group {
            Some(g) => {
                for &j in &g.nodes {
                    used[j] = true;
                }
                steps.push(Step::Fused(g));
            }
            None => steps.push(Step::Node(i)),
        }
    }
    steps
}

/// Untaken nodes after `i` within the window.
fn later<'a>(nodes: &[ExecNode], i: usize, used: &'a [bool]) -> impl Iterator<Item = usize> + 'a {
    (i + 1..nodes.len().min(i + 1 + WINDOW)).filter(move |&j| !used[j])
}

// ---------------------------------------------------------------------------------------------
// Safety of a group.

/// Which thread of a fused kernel touches an element, for overlap exceptions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    /// Read by any thread at any time: no write may overlap it.
    Any,
    /// Element (i, j) read or written by the thread that computes element (i, j) of product
    /// (chain) `c`, in node order.
    Elem(usize),
    /// Attention: head h's slice (along this axis; `None`: one head) touched only by block h,
    /// reads of it before any write.
    Head(Option<usize>),
}

/// What a group reads (sources not produced inside the group) and writes.
struct Footprint<'a> {
    members: Vec<usize>,
    reads: Vec<(&'a TensorRef, Lane)>,
    writes: Vec<(usize, &'a TensorRef, Lane)>,
}

fn byte_range(t: &TensorRef) -> (usize, usize) {
    (t.byte_offset, t.byte_offset + t.byte_extent())
}

/// Whether two tensors share a byte.
fn overlap(a: &TensorRef, b: &TensorRef) -> bool {
    let ((a0, a1), (b0, b1)) = (byte_range(a), byte_range(b));
    a.buffer == b.buffer && a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
}

/// Whether node `n`, run after node `m` instead of before it, could change a result.
fn conflicts(n: &ExecNode, m: &ExecNode) -> bool {
    overlap(&n.dst, &m.dst)
        || m.srcs.iter().any(|s| overlap(&n.dst, s))
        || n.srcs.iter().any(|s| overlap(s, &m.dst))
}

/// Bytes of one head's slice of `t` (`ax` the head axis).
fn head_span(t: &TensorRef, ax: usize) -> usize {
    let last: usize = (0..t.shape.len())
        .filter(|&i| i != ax)
        .map(|i| t.shape[i].saturating_sub(1) * t.strides[i])
        .sum();
    (last + 1) * t.dtype.size_bytes()
}

/// Whether head h of `a` and head h' != h of `b` never share a byte: both start at the same
/// byte, advance by the same bytes per head and no head's slice reaches the next one.
fn head_aligned(a: &TensorRef, ax: Option<usize>, b: &TensorRef, bx: Option<usize>) -> bool {
    let heads = |t: &TensorRef, x: Option<usize>| x.map_or(1, |x| t.shape[x]);
    let stride =
        |t: &TensorRef, x: Option<usize>| x.map_or(0, |x| t.strides[x]) * t.dtype.size_bytes();
    match (ax, bx) {
        _ if heads(a, ax) != heads(b, bx) => false,
        _ if heads(a, ax) <= 1 => true,
        (Some(x), Some(y)) => {
            let s = stride(a, ax);
            a.byte_offset == b.byte_offset
                && s == stride(b, bx)
                && head_span(a, x) <= s
                && head_span(b, y) <= s
        }
        _ => false,
    }
}

impl Footprint<'_> {
    fn safe(&self, nodes: &[ExecNode]) -> bool {
        let private = self
            .members
            .iter()
            .any(|&m| (0..nodes[m].srcs.len()).any(|i| nodes[m].src_needs_private_copy(i)));
        if private {
            return false;
        }
        for &(_, w, wl) in &self.writes {
            for &(r, rl) in &self.reads {
                let excepted = match (wl, rl) {
                    (Lane::Elem(a), Lane::Elem(b)) => a == b && w == r,
                    (Lane::Head(x), Lane::Head(y)) => head_aligned(w, x, r, y),
                    _ => false,
                };
                if overlap(w, r) && !excepted {
                    return false;
                }
            }
        }
        for (x, &(na, wa, la)) in self.writes.iter().enumerate() {
            for &(nb, wb, lb) in &self.writes[x + 1..] {
                // Only an in-place node over an earlier member's result, on one thread's chain.
                let late = na.max(nb);
                let in_place = na != nb
                    && wa == wb
                    && matches!((la, lb), (Lane::Elem(p), Lane::Elem(q)) if p == q)
                    && nodes[late].srcs.contains(wa);
                if overlap(wa, wb) && !in_place {
                    return false;
                }
            }
        }
        let first = self.members[0];
        self.members[1..].iter().all(|&m| {
            (first + 1..m)
                .filter(|n| !self.members.contains(n))
                .all(|n| !conflicts(&nodes[n], &nodes[m]))
        })
    }
}

/// The footprint of a candidate group; `None` when it is not well formed.
fn footprint<'a>(nodes: &'a Nodes<'_>, kind: &Kind) -> Option<Footprint<'a>> {
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    match kind {
        Kind::NormMul { norm, mul } => {
            reads.push((nodes[*norm].srcs.first()?, Lane::Any));
            reads.push((nodes[*mul].srcs.get(1)?, Lane::Any));
            writes.push((*norm, &nodes[*norm].dst, Lane::Elem(0)));
            writes.push((*mul, &nodes[*mul].dst, Lane::Elem(0)));
        }
        Kind::Gemv { segs, swiglu, norm } => {
            let dead = Dead::of(nodes, segs, *norm);
            match norm {
                // The activation is computed inside; block 0 writes the norm and the product
                // with the weight row, one thread per element in node order.
                Some(n) => {
                    reads.push((nodes[n.norm].srcs.first()?, Lane::Any));
                    reads.push((nodes[n.mul].srcs.get(1)?, Lane::Any));
                    if !dead.norm {
                        writes.push((n.norm, &nodes[n.norm].dst, Lane::Elem(NORM_CHAIN)));
                        writes.push((n.mul, &nodes[n.mul].dst, Lane::Elem(NORM_CHAIN)));
                    }
                }
                None => reads.push((nodes[segs.first()?.mm].srcs.first()?, Lane::Any)),
            }
            for (s, seg) in segs.iter().enumerate() {
                let lane = Lane::Elem(if swiglu.is_some() { 0 } else { s });
                let mm = &nodes[seg.mm];
                reads.push((mm.srcs.get(1)?, Lane::Any));
                if !dead.products[s] {
                    writes.push((seg.mm, &mm.dst, lane));
                }
                if let Some(a) = seg.add {
                    reads.push((add_other(&nodes[a], &mm.dst)?, lane));
                    if !dead.sums[s] {
                        writes.push((a, &nodes[a].dst, lane));
                    }
                }
                // The Rope and SetRows read the value from the unit's registers; the rotary
                // pair (j, j + 1) of the Rope's result is written by the thread of product
                // element j, the cache row by many.
                if let Some(r) = seg.rope {
                    reads.push((nodes[r].srcs.get(1)?, Lane::Any));
                    writes.push((r, &nodes[r].dst, lane));
                }
                if let Some(w) = seg.rows {
                    reads.push((nodes[w].srcs.get(2)?, Lane::Any));
                    writes.push((w, &nodes[w].dst, Lane::Any));
                }
            }
            if let Some(s) = swiglu {
                writes.push((*s, &nodes[*s].dst, Lane::Elem(0)));
            }
        }
        Kind::HeadArgmax { mm, argmax } => {
            let m = &nodes[*mm];
            reads.push((m.srcs.first()?, Lane::Any));
            reads.push((m.srcs.get(1)?, Lane::Any));
            writes.push((*mm, &m.dst, Lane::Any));
            writes.push((*argmax, &nodes[*argmax].dst, Lane::Any));
        }
        Kind::RopeRows { rope, rows, plain } => {
            let r = &nodes[*rope];
            reads.extend(r.srcs.iter().map(|t| (t, Lane::Any)));
            reads.push((nodes[*rows].srcs.get(2)?, Lane::Any));
            writes.push((*rope, &r.dst, Lane::Any));
            writes.push((*rows, &nodes[*rows].dst, Lane::Any));
            if let Some(p) = plain {
                reads.extend(nodes[*p].srcs[1..].iter().map(|t| (t, Lane::Any)));
                writes.push((*p, &nodes[*p].dst, Lane::Any));
            }
        }
        Kind::Attention {
            kq,
            soft_max,
            pv,
            cpy,
            scores,
        } => {
            let head = Lane::Head(Some(0));
            reads.push((nodes[*kq].srcs.first()?, head));
            reads.push((nodes[*kq].srcs.get(1)?, Lane::Any));
            reads.push((nodes[*pv].srcs.get(1)?, Lane::Any));
            reads.extend(nodes[*soft_max].srcs.get(1).map(|m| (m, Lane::Any)));
            if *scores {
                writes.push((*kq, &nodes[*kq].dst, head));
            }
            writes.push((*soft_max, &nodes[*soft_max].dst, head));
            writes.push((*pv, &nodes[*pv].dst, head));
            if let Some(c) = cpy {
                let axes = cpy_axes(&nodes[*pv].dst, &nodes[*c])?;
                writes.push((*c, &nodes[*c].dst, Lane::Head(axes[0])));
            }
        }
    }
    Some(Footprint {
        members: kind.members(),
        reads,
        writes,
    })
}

/// `kind` as a group, if its footprint is safe.
fn fits(nodes: &Nodes<'_>, kind: Kind) -> Option<Group> {
    footprint(nodes, &kind)?
        .safe(nodes)
        .then(|| Group::new(kind))
}

/// Whether the bytes node `at` writes are dead once `reader` (its one consumer inside the
/// group) has read them: in node order after `at`, every byte is overwritten by a node's whole
/// contiguous result before any node but `reader`'s first source reads it. Bytes never
/// overwritten count as live (a later split or the host may read them).
fn dead_after(nodes: &Nodes<'_>, at: usize, reader: usize) -> bool {
    dead_after_reads(nodes, at, &[(reader, 0)])
}

/// `dead_after` with several reads inside the group: (node, source index) pairs.
fn dead_after_reads(nodes: &Nodes<'_>, at: usize, inside: &[(usize, usize)]) -> bool {
    let t = &nodes[at].dst;
    let mut live = vec![byte_range(t)];
    for (j, n) in nodes.iter().enumerate().skip(at + 1) {
        let reads_live = n.srcs.iter().enumerate().any(|(i, s)| {
            let (s0, s1) = byte_range(s);
            !inside.contains(&(j, i))
                && s.buffer == t.buffer
                && s0 < s1
                && live.iter().any(|&(l0, l1)| s0 < l1 && l0 < s1)
        });
        if reads_live {
            return false;
        }
        // SetRows writes some rows of its (whole-cache) result; other ops all of theirs.
        if n.op != Op::SetRows && n.dst.buffer == t.buffer && n.dst.is_contiguous() {
            let (w0, w1) = byte_range(&n.dst);
            live = live
                .into_iter()
                .flat_map(|(l0, l1)| [(l0, l1.min(w0)), (l0.max(w1), l1)])
                .filter(|&(a, b)| a < b)
                .collect();
            if live.is_empty() {
                return true;
            }
        }
    }
    // The graph's end: bytes of the scratch no later split reads are written next.
    nodes
        .end
        .is_some_and(|sc| live.iter().all(|&(a, b)| !sc.read_after(t.buffer, a, b)))
}

/// The results a row-pair group (one with Rope or SetRows epilogues) does not write because
/// they are dead after it: the norm prologue's (read only by the products), each product its
/// Add consumes, and each value (product or sum) its Rope or SetRows consumes. Other groups
/// write everything. Not writing them is what lets a Rope's result lie over them (the
/// allocator reuses the norm's row for q's rotation, and q's product for k's).
struct Dead {
    norm: bool,
    products: Vec<bool>,
    sums: Vec<bool>,
}

impl Dead {
    fn of(nodes: &Nodes<'_>, segs: &[Seg], norm: Option<NormPro>) -> Dead {
        if !has_tails(segs) {
            return Dead {
                norm: false,
                products: vec![false; segs.len()],
                sums: vec![false; segs.len()],
            };
        }
        let norm = norm.is_some_and(|n| {
            let products: Vec<(usize, usize)> = segs.iter().map(|s| (s.mm, 0)).collect();
            dead_after_reads(nodes, n.norm, &[(n.mul, 0)])
                && dead_after_reads(nodes, n.mul, &products)
        });
        // The value's readers inside the group: its Rope, else its SetRows.
        let tail = |s: &Seg| match (s.rope, s.rows) {
            (Some(r), _) => vec![(r, 0)],
            (None, Some(w)) => vec![(w, 1)],
            (None, None) => Vec::new(),
        };
        let dead = |at: usize, inside: Vec<(usize, usize)>| {
            !inside.is_empty() && dead_after_reads(nodes, at, &inside)
        };
        let products = segs
            .iter()
            .map(|s| match s.add {
                Some(a) => {
                    let out = &nodes[s.mm].dst;
                    let srcs = &nodes[a].srcs;
                    let inside = (0..srcs.len()).filter(|&i| srcs[i] == *out);
                    dead(s.mm, inside.map(|i| (a, i)).collect())
                }
                None => dead(s.mm, tail(s)),
            })
            .collect();
        let sums = segs
            .iter()
            .map(|s| s.add.is_some_and(|a| dead(a, tail(s))))
            .collect();
        Dead {
            norm,
            products,
            sums,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Patterns.

fn norm_mul(nodes: &Nodes<'_>, i: usize, used: &[bool]) -> Option<Group> {
    let norm = &nodes[i];
    let [x] = norm.srcs.as_slice() else {
        return None;
    };
    let r = x.shape.len();
    if r == 0
        || x.numel() == 0
        || !x.dtype.is_float()
        || !norm.dst.dtype.is_float()
        || x.shape != norm.dst.shape
    {
        return None;
    }
    let j = later(nodes, i, used).find(|&j| {
        nodes[j].op == Op::Mul && nodes[j].srcs.len() == 2 && nodes[j].srcs[0] == norm.dst
    })?;
    let mul = &nodes[j];
    let w = &mul.srcs[1];
    let ws = broadcast_strides(&w.shape, &w.strides, &norm.dst.shape)?;
    let lead = |t: &TensorRef| t.strides[..r - 1].to_vec();
    let ok = w.dtype.is_float()
        && mul.dst.dtype.is_float()
        && mul.dst.shape == norm.dst.shape
        && ws[..r - 1].iter().all(|&s| s == 0)
        && lay(
            &x.shape[..r - 1],
            &[&lead(&norm.dst), &lead(x), &lead(&mul.dst)],
        )
        .is_some();
    if !ok {
        return None;
    }
    fits(nodes, Kind::NormMul { norm: i, mul: j })
}

/// `(m, k, n)` of a MulMat the fused matrix-vector kernel runs: a f32 `[m, k]` with k
/// contiguous and m within the matrix-vector rows limit, b `[k, n]` with k contiguous (a
/// weight seen as `w.T`), an f32 result `[m, n]`.
fn gemv_dims(node: &ExecNode, mmv_max_m: Option<usize>) -> Option<(usize, usize, usize)> {
    let [a, b] = node.srcs.as_slice() else {
        return None;
    };
    if node.op != Op::MulMat || a.shape.len() != 2 || b.shape.len() != 2 {
        return None;
    }
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    let ok = a.dtype == DType::F32
        && b.dtype.is_float()
        && node.dst.dtype == DType::F32
        && b.shape[0] == k
        && node.dst.shape == [m, n]
        && m > 0
        && k > 0
        && n > 0
        && (a.strides[1] == 1 || k == 1)
        && b.strides[0] == 1
        && m <= matmul::mmv_max_m(a.dtype, b.dtype, mmv_max_m);
    ok.then_some((m, k, n))
}

/// The other operand of `add` when it adds `out` (exactly that tensor) and something that
/// broadcasts onto it, giving a float result of `out`'s shape.
fn add_other<'a>(add: &'a ExecNode, out: &TensorRef) -> Option<&'a TensorRef> {
    let [a, b] = add.srcs.as_slice() else {
        return None;
    };
    if add.op != Op::Add {
        return None;
    }
    let other = if a == out {
        b
    } else if b == out {
        a
    } else {
        return None;
    };
    let ok = add.dst.shape == out.shape
        && add.dst.dtype.is_float()
        && other.dtype.is_float()
        && (a == out || other.shape == out.shape)
        && broadcast_strides(&other.shape, &other.strides, &out.shape).is_some();
    ok.then_some(other)
}

/// The epilogue Add of product `mm`: the first later node reading its result, if that is an
/// Add the epilogue computes.
fn epilogue_add(nodes: &[ExecNode], mm: usize, used: &[bool]) -> Option<usize> {
    let out = &nodes[mm].dst;
    let j = later(nodes, mm, used).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, out)))?;
    add_other(&nodes[j], out).map(|_| j)
}

fn gemv(nodes: &Nodes<'_>, i: usize, used: &[bool], mmv_max_m: Option<usize>) -> Option<Group> {
    gemv_kind(nodes, i, used, mmv_max_m, None).map(Group::new)
}

/// Decode's output head: a lone one-row product (no group of its own) whose result is read by
/// the `Argmax` after it (`Kind::HeadArgmax`). The argmax's row is the product's whole result
/// ([1, n], n below 2^31) and its result one i32.
fn head_argmax(
    nodes: &Nodes<'_>,
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
) -> Option<Group> {
    let j = argmax_of(nodes, i, used, mmv_max_m)?;
    fits(nodes, Kind::HeadArgmax { mm: i, argmax: j })
}

/// The `Argmax` that `head_argmax` would take with product `i`: the first later node reading
/// the product's result.
fn argmax_of(
    nodes: &[ExecNode],
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
) -> Option<usize> {
    let (m, _, n) = gemv_dims(&nodes[i], mmv_max_m)?;
    let out = &nodes[i].dst;
    if m != 1 || n > i32::MAX as usize || !out.is_contiguous() {
        return None;
    }
    let j = later(nodes, i, used).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, out)))?;
    let am = &nodes[j];
    let ok = am.op == Op::Argmax
        && am.srcs.len() == 1
        && am.srcs[0] == *out
        && am.dst.dtype == DType::I32
        && am.dst.numel() == 1;
    ok.then_some(j)
}

/// The products of `gemv` (with the norm prologue `norm`, whose nodes `used` marks, a single
/// product without an Add is a group too).
fn gemv_kind(
    nodes: &Nodes<'_>,
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
    norm: Option<NormPro>,
) -> Option<Kind> {
    gemv_dims(&nodes[i], mmv_max_m)?;
    let act = &nodes[i].srcs[0];
    let wdt = nodes[i].srcs[1].dtype;
    let cands: Vec<usize> = std::iter::once(i)
        .chain(later(nodes, i, used).filter(|&j| {
            nodes[j].srcs.first() == Some(act)
                && nodes[j].srcs.get(1).map(|b| b.dtype) == Some(wdt)
                && gemv_dims(&nodes[j], mmv_max_m).is_some()
        }))
        .collect();
    if let Some(g) = swiglu_pair(nodes, i, &cands, used, norm) {
        return Some(g);
    }
    let mut segs: Vec<Seg> = Vec::new();
    for &c in &cands {
        if segs.len() == MAX_SEGS {
            break;
        }
        let add = epilogue_add(nodes, c, used);
        let tries = [Seg::new(c, add), Seg::new(c, None)];
        for t in &tries[..if add.is_some() { 2 } else { 1 }] {
            let mut next = segs.clone();
            next.push(*t);
            let kind = Kind::Gemv {
                segs: next.clone(),
                swiglu: None,
                norm,
            };
            if footprint(nodes, &kind).is_some_and(|f| f.safe(nodes)) {
                segs = next;
                break;
            }
        }
        if segs.is_empty() {
            return None;
        }
    }
    if let Some(tailed) = tails(nodes, &segs, used) {
        let kind = Kind::Gemv {
            segs: tailed,
            swiglu: None,
            norm,
        };
        if footprint(nodes, &kind).is_some_and(|f| f.safe(nodes)) {
            return Some(kind);
        }
    }
    if segs.len() == 1 && segs[0].add.is_none() && norm.is_none() {
        return None;
    }
    Some(Kind::Gemv {
        segs,
        swiglu: None,
        norm,
    })
}

/// Decode's epilogues of `segs` (one row each, of an even number of columns), each product's
/// value being one contiguous row: a later normal-mode (adjacent pairs) `Rope` of the value viewed as `[1, heads,
/// head_dim]` at one position, and a later `SetRows` of that result (or, without a Rope, of
/// the value) into one cache row. `None` when no product has one.
fn tails(nodes: &[ExecNode], segs: &[Seg], used: &[bool]) -> Option<Vec<Seg>> {
    // The row-pair kernel splits every product (with an epilogue or not) into column pairs.
    let pairs = segs.iter().all(|s| {
        let out = &nodes[s.mm].dst;
        out.shape.len() == 2 && out.shape[0] == 1 && out.shape[1].is_multiple_of(2)
    });
    if !pairs {
        return None;
    }
    let mut taken = used.to_vec();
    for s in segs {
        taken[s.mm] = true;
        if let Some(a) = s.add {
            taken[a] = true;
        }
    }
    let mut out = segs.to_vec();
    for seg in &mut out {
        let at = seg.value();
        let v = &nodes[at].dst;
        let n = v.numel();
        if v.shape != [1, n] || !v.is_contiguous() || !n.is_multiple_of(2) || !v.dtype.is_float() {
            continue;
        }
        seg.rope = later(nodes, at, &taken).find(|&j| rope_tail(&nodes[j], v));
        if let Some(r) = seg.rope {
            taken[r] = true;
        }
        let src = seg.rope.map_or(v, |r| &nodes[r].dst);
        seg.rows = later(nodes, seg.rope.unwrap_or(at), &taken).find(|&j| {
            let w = &nodes[j];
            set_rows_ok(w) && w.srcs[2].numel() == 1 && same_bytes(&w.srcs[1], src)
        });
        if let Some(w) = seg.rows {
            taken[w] = true;
        }
    }
    has_tails(&out).then_some(out)
}

/// Whether `a` reads exactly the contiguous elements `b` holds, in the same dtype.
fn same_bytes(a: &TensorRef, b: &TensorRef) -> bool {
    a.buffer == b.buffer
        && a.byte_offset == b.byte_offset
        && a.dtype == b.dtype
        && a.numel() == b.numel()
        && a.is_contiguous()
        && b.is_contiguous()
}

/// A Rope the row-pair kernel computes over value row `v`: normal mode, `[1, heads, hd]`
/// over v's elements, even hd and n_dims, one i32 position, a contiguous float result.
fn rope_tail(node: &ExecNode, v: &TensorRef) -> bool {
    let Op::Rope {
        mode: RopeMode::Normal,
        n_dims,
        ..
    } = node.op
    else {
        return false;
    };
    let [x, pos] = node.srcs.as_slice() else {
        return false;
    };
    x.shape.len() == 3
        && x.shape[0] == 1
        && x.shape[2].is_multiple_of(2)
        && same_bytes(x, v)
        && node.dst.shape == x.shape
        && node.dst.is_contiguous()
        && node.dst.dtype.is_float()
        && pos.dtype == DType::I32
        && pos.shape == [1]
        && n_dims > 0
        && n_dims.is_multiple_of(2)
        && n_dims <= x.shape[2]
}

/// `RmsNorm -> Mul(norm, weight row)` of one f32 row whose result is the activation of a
/// following matrix-vector group: the group with the norm as its prologue (decode's kernel
/// stages the row in shared memory, so it fits there).
fn norm_gemv(
    nodes: &Nodes<'_>,
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
) -> Option<Group> {
    let Kind::NormMul { norm, mul } = norm_mul(nodes, i, used)?.kind else {
        return None;
    };
    let x = &nodes[norm].srcs[0];
    let (nd, md) = (&nodes[norm].dst, &nodes[mul].dst);
    let w = &nodes[mul].srcs[1];
    let k = *x.shape.last()?;
    let row = |t: &TensorRef| {
        t.shape.len() == 2 && t.shape[0] == 1 && t.shape[1] == k && (t.strides[1] == 1 || k == 1)
    };
    let ok = row(x)
        && row(nd)
        && row(md)
        && x.dtype == DType::F32
        && md.dtype == DType::F32
        && w.shape.last() == Some(&k)
        && w.numel() == k
        && (w.strides.last() == Some(&1) || k == 1)
        && k * 4 <= matmul::GEMV1_MAX_SHARED;
    if !ok {
        return None;
    }
    let mut taken = used.to_vec();
    taken[norm] = true;
    taken[mul] = true;
    let first = later(nodes, mul, &taken)
        .find(|&j| nodes[j].op == Op::MulMat && nodes[j].srcs.first() == Some(md))?;
    let pro = NormPro { norm, mul };
    let kind = gemv_kind(nodes, first, &taken, mmv_max_m, Some(pro))?;
    if let Kind::Gemv {
        segs, swiglu: None, ..
    } = &kind
    {
        // A lone product whose argmax follows (decode's head): the product takes its argmax
        // rather than the norm (`head_argmax`), which saves the same launch and keeps the
        // head on the one-row kernel.
        let lone = segs.len() == 1 && segs[0].add.is_none() && !has_tails(segs);
        if lone && argmax_of(nodes, first, &taken, mmv_max_m).is_some() {
            return None;
        }
    }
    fits(nodes, kind)
}

/// Gate and up products among `cands` (one of them `i`) feeding a SwiGlu, as one group.
fn swiglu_pair(
    nodes: &Nodes<'_>,
    i: usize,
    cands: &[usize],
    used: &[bool],
    norm: Option<NormPro>,
) -> Option<Kind> {
    for s in later(nodes, i, used) {
        let sw = &nodes[s];
        if sw.op != Op::SwiGlu || sw.srcs.len() != 2 {
            continue;
        }
        let find = |t: &TensorRef| cands.iter().copied().find(|&c| nodes[c].dst == *t);
        let (Some(g), Some(u)) = (find(&sw.srcs[0]), find(&sw.srcs[1])) else {
            continue;
        };
        let ok = g != u
            && (g == i || u == i)
            && s > g.max(u)
            && sw.dst.dtype.is_float()
            && sw.dst.shape == nodes[g].dst.shape
            && nodes[u].dst.shape == nodes[g].dst.shape;
        if ok {
            let kind = Kind::Gemv {
                segs: vec![Seg::new(g, None), Seg::new(u, None)],
                swiglu: Some(s),
                norm,
            };
            return fits(nodes, kind).map(|g| g.kind);
        }
    }
    None
}

/// A SetRows the fused kernel can write: dst `[n, d]` (its first source), src `[m, d]`, i32
/// indices `[m]`, m <= [`MAX_ROWS`].
fn set_rows_ok(n: &ExecNode) -> bool {
    let [target, src, idx] = n.srcs.as_slice() else {
        return false;
    };
    let d = &n.dst;
    n.op == Op::SetRows
        && d.shape.len() == 2
        && src.shape.len() == 2
        && target == d
        && d.dtype.is_float()
        && src.dtype.is_float()
        && src.shape[1] == d.shape[1]
        && idx.dtype == DType::I32
        && idx.shape == [src.shape[0]]
        && src.numel() > 0
        && src.shape[0] <= MAX_ROWS
        && d.shape[0] > 0
}

fn rope_rows(nodes: &Nodes<'_>, i: usize, used: &[bool]) -> Option<Group> {
    let rope = &nodes[i];
    let Op::Rope { n_dims, .. } = rope.op else {
        return None;
    };
    let [x, pos] = rope.srcs.as_slice() else {
        return None;
    };
    let r = &rope.dst;
    let ok = x.shape.len() == 3
        && x.numel() > 0
        && x.dtype.is_float()
        && r.dtype.is_float()
        && r.shape == x.shape
        && r.is_contiguous()
        && pos.dtype == DType::I32
        && pos.shape == [x.shape[0]]
        && x.shape[0] <= MAX_ROWS
        && n_dims > 0
        && n_dims.is_multiple_of(2)
        && n_dims <= x.shape[2];
    if !ok {
        return None;
    }
    let (t, hd) = (x.shape[0], x.shape[1] * x.shape[2]);
    let rows = later(nodes, i, used).find(|&j| {
        let s = nodes[j].srcs.get(1);
        set_rows_ok(&nodes[j])
            && s.is_some_and(|s| {
                s.buffer == r.buffer
                    && s.byte_offset == r.byte_offset
                    && s.dtype == r.dtype
                    && s.is_contiguous()
                    && s.shape == [t, hd]
            })
    })?;
    let plain = later(nodes, i, used).find(|&j| j != rows && set_rows_ok(&nodes[j]));
    let with = |plain| Kind::RopeRows {
        rope: i,
        rows,
        plain,
    };
    plain
        .and_then(|p| fits(nodes, with(Some(p))))
        .or_else(|| fits(nodes, with(None)))
}

/// For the Cpy of a view of `o` that only permutes o's axes (size-1 axes anywhere), the Cpy
/// axis holding each axis of `o` (`None` for an axis of extent 1).
fn cpy_axes(o: &TensorRef, cpy: &ExecNode) -> Option<Vec<Option<usize>>> {
    let [src] = cpy.srcs.as_slice() else {
        return None;
    };
    if cpy.op != Op::Cpy
        || src.buffer != o.buffer
        || src.byte_offset != o.byte_offset
        || src.dtype != o.dtype
        || src.numel() != o.numel()
        || o.numel() == 0
        || cpy.dst.shape != src.shape
        || !cpy.dst.dtype.is_float()
    {
        return None;
    }
    // With equal element counts, the axes left unmatched all have extent 1.
    let mut taken = vec![false; src.shape.len()];
    o.shape
        .iter()
        .zip(&o.strides)
        .map(|(&d, &s)| {
            if d == 1 {
                return Some(None);
            }
            let b = (0..src.shape.len())
                .find(|&b| !taken[b] && src.shape[b] == d && src.strides[b] == s)?;
            taken[b] = true;
            Some(Some(b))
        })
        .collect()
}

fn attention(nodes: &Nodes<'_>, i: usize, used: &[bool]) -> Option<Group> {
    let kq = &nodes[i];
    let [q, k] = kq.srcs.as_slice() else {
        return None;
    };
    if q.shape.len() != 3 || k.shape.len() != 3 {
        return None;
    }
    let (hq, d, l, hk) = (q.shape[0], q.shape[2], k.shape[2], k.shape[0]);
    let ok = q.shape[1] == 1
        && k.shape[1] == d
        && q.dtype.is_float()
        && k.dtype.is_float()
        && k.strides[1] == 1
        && hq > 0
        && hk > 0
        && hq % hk == 0
        && (1..=ATT_MAX_D).contains(&d)
        && l > 0
        && kq.dst.dtype == DType::F32
        && kq.dst.shape == [hq, 1, l];
    if !ok {
        return None;
    }
    let soft_max = later(nodes, i, used).find(|&j| {
        matches!(nodes[j].op, Op::SoftMax { .. }) && nodes[j].srcs.first() == Some(&kq.dst)
    })?;
    let sm = &nodes[soft_max];
    let mask_ok = match sm.srcs.as_slice() {
        [_] => true,
        [_, m] => {
            m.dtype.is_float() && broadcast_strides(&m.shape, &m.strides, &kq.dst.shape).is_some()
        }
        _ => false,
    };
    if !mask_ok || sm.dst.dtype != DType::F32 || sm.dst.shape != kq.dst.shape {
        return None;
    }
    let pv = later(nodes, soft_max, used).find(|&j| {
        let n = &nodes[j];
        let [p, v] = n.srcs.as_slice() else {
            return false;
        };
        n.op == Op::MulMat
            && *p == sm.dst
            && v.shape.len() == 3
            && v.shape[1..] == [l, d]
            && v.dtype == k.dtype
            && v.strides[2] == 1
            && v.shape[0] > 0
            && hq % v.shape[0] == 0
            && n.dst.dtype == DType::F32
            && n.dst.shape == [hq, 1, d]
    })?;
    let cpy = later(nodes, pv, used).find(|&j| cpy_axes(&nodes[pv].dst, &nodes[j]).is_some());
    let scores = !dead_after(nodes, i, soft_max);
    let with = |cpy| Kind::Attention {
        kq: i,
        soft_max,
        pv,
        cpy,
        scores,
    };
    cpy.and_then(|c| fits(nodes, with(Some(c))))
        .or_else(|| fits(nodes, with(None)))
}

// ---------------------------------------------------------------------------------------------
// Launches.

/// One product of `fused_gemv[8]` (`struct FgSeg` in fused.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FgSeg {
    n: i64,
    w: u64,
    w_rs: i64,
    out: u64,
    o_rs: i64,
    o_cs: i64,
    add: u64,
    add_dt: i64,
    a_rs: i64,
    a_cs: i64,
    sum: u64,
    sum_dt: i64,
    s_rs: i64,
    s_cs: i64,
    wout: i64,
    wsum: i64,
    r: u64,
    r_dt: i64,
    hd: i64,
    n_dims: i64,
    l2theta: f64,
    pos: u64,
    c: u64,
    c_dt: i64,
    c_rs: i64,
    c_cs: i64,
    c_n: i64,
    idx: u64,
    tag: i64,
}

/// The products of one launch (`struct FgSet` in fused.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FgSet {
    nseg: i64,
    seg: [FgSeg; MAX_SEGS],
    pair: i64,
    sw: u64,
    sw_dt: i64,
    sw_rs: i64,
    sw_cs: i64,
    wnorm: i64,
    err: u64,
}

/// A stride that moves a vector's start (extent-1 axes never do).
fn moving(extent: usize, stride: usize) -> i64 {
    if extent > 1 {
        stride as i64
    } else {
        0
    }
}

fn launch(exec: &mut Exec<'_>, nodes: &Nodes<'_>, kind: &Kind) -> Result<()> {
    match kind {
        Kind::NormMul { norm, mul } => launch_norm_mul(exec, &nodes[*norm], &nodes[*mul]),
        Kind::Gemv { segs, swiglu, norm } => launch_gemv(exec, nodes, segs, *swiglu, *norm),
        Kind::HeadArgmax { mm, argmax } => {
            let (mm, argmax) = (&nodes[*mm], &nodes[*argmax]);
            if !matmul::run_vec1_argmax(exec, mm, argmax)? {
                exec.run(mm)?;
                exec.run(argmax)?;
            }
            Ok(())
        }
        Kind::RopeRows { rope, rows, plain } => {
            launch_rope_rows(exec, &nodes[*rope], &nodes[*rows], plain.map(|p| &nodes[p]))
        }
        Kind::Attention {
            kq,
            soft_max,
            pv,
            cpy,
            scores,
        } => {
            // p and (beside its copy) o are written only when something reads them later.
            let live = Live {
                scores: *scores,
                probs: !dead_after(nodes, *soft_max, *pv),
                out: cpy.is_none_or(|c| !dead_after(nodes, *pv, c)),
                mask_ahead: mask_ahead(nodes, &nodes[*kq], &nodes[*soft_max]),
            };
            launch_attention(
                exec,
                [&nodes[*kq], &nodes[*soft_max], &nodes[*pv]],
                cpy.map(|c| &nodes[c]),
                live,
            )
        }
    }
}

/// The norm prologue's arguments of `fused_gemv1` (its product with the weight row is the
/// kernel's activation `a`).
struct NormArgs {
    x: u64,
    eps: f32,
    nd: u64,
    dtn: i32,
    w: u64,
    dtw: i32,
}

fn norm_args(exec: &Exec<'_>, norm: &ExecNode, mul: &ExecNode) -> Result<NormArgs> {
    let Op::RmsNorm { eps } = norm.op else {
        return Err(kernel_err(norm, "fused as a norm but is not one"));
    };
    let nd = exec.resolve(&norm.dst)?;
    let w = exec.resolve(&mul.srcs[1])?;
    Ok(NormArgs {
        x: exec.resolve(&norm.srcs[0])?.ptr,
        eps,
        nd: nd.ptr,
        dtn: dt(nd.dtype),
        w: w.ptr,
        dtw: dt(w.dtype),
    })
}

fn launch_norm_mul(exec: &Exec<'_>, norm: &ExecNode, mul: &ExecNode) -> Result<()> {
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

fn launch_gemv(
    exec: &mut Exec<'_>,
    nodes: &Nodes<'_>,
    segs: &[Seg],
    swiglu: Option<usize>,
    norm: Option<NormPro>,
) -> Result<()> {
    let first = &nodes[segs[0].mm];
    let a = exec.resolve(&first.srcs[0])?;
    let (m, k) = (a.shape[0], a.shape[1]);
    let wdt = first.srcs[1].dtype;
    let esz = wdt.size_bytes();
    let tails = has_tails(segs);
    let dead = Dead::of(nodes, segs, norm);
    let mut set = FgSet {
        nseg: segs.len() as i64,
        pair: if tails { 2 } else { swiglu.is_some() as i64 },
        wnorm: (!dead.norm) as i64,
        err: exec.inner.err_word.dev(),
        ..FgSet::default()
    };
    let mut vec = matmul::aligned(a.ptr, 4, &[moving(m, a.strides[0])], 16);
    let mut units = 0usize;
    for (si, (slot, seg)) in set.seg.iter_mut().zip(segs).enumerate() {
        let skip = dead.products[si];
        let mm = &nodes[seg.mm];
        let w = exec.resolve(&mm.srcs[1])?;
        let out = exec.resolve(&mm.dst)?;
        let n = w.shape[1];
        vec &= matmul::aligned(w.ptr, esz, &[moving(n, w.strides[1])], 16);
        *slot = FgSeg {
            n: n as i64,
            w: w.ptr,
            w_rs: w.strides[1] as i64,
            out: out.ptr,
            o_rs: out.strides[0] as i64,
            o_cs: out.strides[1] as i64,
            wout: (!skip) as i64,
            wsum: (!dead.sums[si]) as i64,
            ..FgSeg::default()
        };
        if let Some(ri) = seg.rope {
            let rope = &nodes[ri];
            let Op::Rope {
                n_dims, theta_base, ..
            } = rope.op
            else {
                return Err(kernel_err(rope, "fused as a rope but is not one"));
            };
            let r = exec.resolve(&rope.dst)?;
            slot.r = r.ptr;
            slot.r_dt = dt(r.dtype) as i64;
            slot.hd = r.shape[2] as i64;
            slot.n_dims = n_dims as i64;
            slot.l2theta = (theta_base as f64).log2();
            slot.pos = exec.resolve(&rope.srcs[1])?.ptr;
        }
        if let Some(wi) = seg.rows {
            let rows = &nodes[wi];
            let c = exec.resolve(&rows.dst)?;
            slot.c = c.ptr;
            slot.c_dt = dt(c.dtype) as i64;
            slot.c_rs = c.strides[0] as i64;
            slot.c_cs = c.strides[1] as i64;
            slot.c_n = c.shape[0] as i64;
            slot.idx = exec.resolve(&rows.srcs[2])?.ptr;
            slot.tag = exec.tag(rows) as i64;
        }
        if let Some(ai) = seg.add {
            let add = &nodes[ai];
            let other = add_other(add, &mm.dst).ok_or_else(|| {
                kernel_err(add, "fused as an epilogue but does not add the product")
            })?;
            let other = exec.resolve(other)?;
            let sum = exec.resolve(&add.dst)?;
            let bs = broadcast_strides(&other.shape, &other.strides, &out.shape)
                .ok_or_else(|| kernel_err(add, "operand does not broadcast"))?;
            slot.add = other.ptr;
            slot.add_dt = dt(other.dtype) as i64;
            slot.a_rs = bs[0] as i64;
            slot.a_cs = bs[1] as i64;
            slot.sum = sum.ptr;
            slot.sum_dt = dt(sum.dtype) as i64;
            slot.s_rs = sum.strides[0] as i64;
            slot.s_cs = sum.strides[1] as i64;
        }
        units = if swiglu.is_some() { n } else { units + n };
    }
    if tails {
        units /= 2;
    }
    if let Some(s) = swiglu {
        let sw = exec.resolve(&nodes[s].dst)?;
        set.sw = sw.ptr;
        set.sw_dt = dt(sw.dtype) as i64;
        set.sw_rs = sw.strides[0] as i64;
        set.sw_cs = sw.strides[1] as i64;
    }
    // Decode: one output unit per warp (or streamed, below), a staged in shared memory when it
    // fits.
    let staged = k * 4 <= matmul::GEMV1_MAX_SHARED;
    let blocks1 = units.div_ceil(matmul::GEMV1_WARPS);
    // Every block computes the norm before its products start; past one wave of blocks that
    // serial prologue costs more than the launch it saves (measured on the H200: gate/up of
    // "1b", 1024 blocks, 26 µs with it against 18.5 + 3.4 without).
    let per_sm = if set.pair != 0 {
        GEMV1_PAIR_BLOCKS_PER_SM
    } else {
        GEMV1_BLOCKS_PER_SM
    };
    // Streamed (`fg1_stream`; not row pairs): a grid of at most `stream_blocks` per
    // multiprocessor whose warps stride over the units, so the prologue always runs once per
    // resident block.
    let stream = exec.inner.cfg.gemv_stream && !tails;
    let stream_grid = exec.inner.sms * exec.inner.cfg.stream_blocks.max(1);
    // With Rope epilogues the prologue is kept past one wave: it costs less than the launches
    // the epilogues save, and a separate norm would leave its row under q's rotation.
    let prologue_fits = stream || blocks1 <= exec.inner.sms * per_sm || tails;
    // The decode kernel computes offsets in 32 bits.
    let narrow = k < i32::MAX as usize && units < i32::MAX as usize;
    let vec = vec && narrow;
    if tails && !(m == 1 && vec && staged) {
        // The row-pair kernel does not apply after all (alignment, a long row): the norm, the
        // products with their Adds, then the Ropes and SetRows — node order, at the group's
        // position — writing every result.
        if let Some(n) = norm {
            launch_norm_mul(exec, &nodes[n.norm], &nodes[n.mul])?;
        }
        let plain: Vec<Seg> = segs.iter().map(|s| Seg::new(s.mm, s.add)).collect();
        launch_gemv(exec, nodes, &plain, swiglu, None)?;
        let mut rest: Vec<usize> = segs
            .iter()
            .flat_map(|s| [s.rope, s.rows].into_iter().flatten())
            .collect();
        rest.sort_unstable();
        for i in rest {
            exec.run(&nodes[i])?;
        }
        return Ok(());
    }
    let pro = match norm {
        Some(n) if m == 1 && vec && staged && prologue_fits => {
            Some(norm_args(exec, &nodes[n.norm], &nodes[n.mul])?)
        }
        Some(n) => {
            // Not the decode kernel's prologue after all (alignment, or more than one wave):
            // the norm runs first, on its own.
            launch_norm_mul(exec, &nodes[n.norm], &nodes[n.mul])?;
            None
        }
        None => None,
    };
    if m == 1 && vec {
        let ahead = segs.iter().all(|s| exec.read_ahead(&nodes[s.mm].srcs[1]));
        let blocks = if stream {
            blocks1.min(stream_grid)
        } else {
            blocks1
        };
        let blocks = blocks.clamp(1, i32::MAX as usize) as u32;
        let args = Args::new()
            .arg(k as i64)
            .arg(a.ptr)
            .arg(set)
            .arg(dt(wdt))
            .arg(staged as i32)
            .arg(ahead as i32)
            .arg(stream as i32);
        let args = match pro {
            Some(p) => args
                .arg(p.x)
                .arg(p.eps)
                .arg(p.nd)
                .arg(p.dtn)
                .arg(p.w)
                .arg(p.dtw),
            None => args
                .arg(0u64)
                .arg(0f32)
                .arg(0u64)
                .arg(0i32)
                .arg(0u64)
                .arg(0i32),
        };
        // A streamed, staged product without pairs takes its dtype's own entry point (80
        // registers, so that the next kernel's first blocks fit beside its two per
        // multiprocessor), its blocks padded to hold them to that many (`stream_pad`).
        // Staged, a pair mode's decode path takes its own entry point (`gemv_split`): q/k/v's
        // row pairs, or gate/up streamed.
        let split = exec.inner.cfg.gemv_split && staged;
        let (own, shared_kernel) = match (set.pair != 0, stream && staged) {
            (true, _) if split && tails => (Some(Kernel::ROW_PAIRS), Kernel::FusedGemv1Pair),
            (true, true) if split => (Some(Kernel::GATE_UP), Kernel::FusedGemv1Pair),
            (true, _) => (None, Kernel::FusedGemv1Pair),
            (false, true) => (Some(Kernel::STREAMED), Kernel::FusedGemv1),
            (false, false) => (None, Kernel::FusedGemv1),
        };
        let kernel = own
            .and_then(|list| Kernel::for_weights(list, wdt))
            .unwrap_or(shared_kernel);
        let shared = match (staged, Kernel::STREAMED.contains(&kernel)) {
            (false, _) => 0,
            (true, false) => k * 4,
            (true, true) => (k * 4).max(exec.inner.stream_shared),
        };
        return exec.launch_shared(
            first,
            kernel,
            blocks,
            (matmul::GEMV1_WARPS * 32) as u32,
            shared as u32,
            args,
        );
    }
    let g = matmul::mmv_group(k, 16 / esz);
    let blocks = units.div_ceil(GEMV_THREADS / g).clamp(1, i32::MAX as usize) as u32;
    let kernel = if m <= 2 {
        Kernel::FusedGemv
    } else {
        Kernel::FusedGemv8
    };
    let args = Args::new()
        .arg(m as i64)
        .arg(k as i64)
        .arg(a.ptr)
        .arg(a.strides[0] as i64)
        .arg(set)
        .arg(dt(wdt))
        .arg(g as i32)
        .arg(vec as i32);
    exec.launch(first, kernel, blocks, GEMV_THREADS as u32, args)
}

fn launch_rope_rows(
    exec: &Exec<'_>,
    rope: &ExecNode,
    rows: &ExecNode,
    plain: Option<&ExecNode>,
) -> Result<()> {
    let Op::Rope {
        mode,
        n_dims,
        theta_base,
    } = rope.op
    else {
        return Err(kernel_err(rope, "fused as a rope but is not one"));
    };
    let x = exec.resolve(&rope.srcs[0])?;
    let pos = exec.resolve(&rope.srcs[1])?;
    let r = exec.resolve(&rope.dst)?;
    let c = exec.resolve(&rows.dst)?;
    let idx = exec.resolve(&rows.srcs[2])?;
    let (t, h, d) = (x.shape[0], x.shape[1], x.shape[2]);
    let args = crate::ops::rope_args(&r, &x, &pos, mode, n_dims, theta_base)
        .arg(c.ptr)
        .arg(dt(c.dtype))
        .arg(c.strides[0] as i64)
        .arg(c.strides[1] as i64)
        .arg(c.shape[0] as i64)
        .arg(idx.ptr)
        .arg(idx.strides[0] as i64)
        .arg(exec.tag(rows));
    let mut n2 = 0usize;
    let args = match plain {
        Some(p) => {
            let c2 = exec.resolve(&p.dst)?;
            let s2 = exec.resolve(&p.srcs[1])?;
            let idx2 = exec.resolve(&p.srcs[2])?;
            n2 = s2.numel();
            args.arg(s2.shape[0] as i64)
                .arg(s2.shape[1] as i64)
                .arg(c2.ptr)
                .arg(dt(c2.dtype))
                .arg(c2.strides[0] as i64)
                .arg(c2.strides[1] as i64)
                .arg(c2.shape[0] as i64)
                .arg(s2.ptr)
                .arg(dt(s2.dtype))
                .arg(s2.strides[0] as i64)
                .arg(s2.strides[1] as i64)
                .arg(idx2.ptr)
                .arg(idx2.strides[0] as i64)
                .arg(exec.tag(p))
        }
        None => args
            .arg(0i64)
            .arg(0i64)
            .arg(0u64)
            .arg(0i32)
            .arg(0i64)
            .arg(0i64)
            .arg(0i64)
            .arg(0u64)
            .arg(0i32)
            .arg(0i64)
            .arg(0i64)
            .arg(0u64)
            .arg(0i64)
            .arg(0u32),
    };
    let args = args.arg(exec.inner.err_word.dev());
    let n1 = t * h * (n_dims / 2 + (d - n_dims));
    exec.launch(rope, Kernel::RopeRows, grid_for(n1 + n2), BLOCK, args)
}

/// Whether attention's mask may be read before its dependency wait: no node of the graph
/// writes the mask's buffer (decode's mask is uploaded before the graph runs), and a node of
/// the graph writes q, so the launch just before the attention — the only kernel that may still
/// run while it rehearses — is this graph's.
fn mask_ahead(nodes: &[ExecNode], kq: &ExecNode, sm: &ExecNode) -> bool {
    sm.srcs.get(1).is_some_and(|m| {
        !nodes.iter().any(|n| n.dst.buffer == m.buffer)
            && nodes.iter().any(|n| overlap(&n.dst, &kq.srcs[0]))
    })
}

/// Which of the attention's intermediate results must be written: the raw scores, p, and o
/// (when it has a copy); and whether its mask may be read ahead.
#[derive(Clone, Copy, Debug)]
struct Live {
    scores: bool,
    probs: bool,
    out: bool,
    /// See [`mask_ahead`].
    mask_ahead: bool,
}

fn launch_attention(
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
            .arg(exec.rehearse() as i32)
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

#[cfg(test)]
mod tests {
    use super::*;
    use lowsync_backend::BufferId;

    /// Nodes with nothing known of what is read after them.
    fn bare(nodes: &[ExecNode]) -> Nodes<'_> {
        Nodes {
            list: nodes,
            end: None,
        }
    }

    fn plan(nodes: &[ExecNode], mmv_max_m: Option<usize>) -> Vec<Step> {
        super::plan(&bare(nodes), mmv_max_m)
    }

    fn dead_after(nodes: &[ExecNode], at: usize, reader: usize) -> bool {
        super::dead_after(&bare(nodes), at, reader)
    }

    const H200: SharedLimits = SharedLimits {
        per_sm: 228 << 10,
        per_block: 227 << 10,
        reserved: 1 << 10,
    };

    #[test]
    fn stream_pad_holds_the_streamed_grid_to_its_blocks_per_multiprocessor() {
        assert_eq!(
            stream_pad(None, 2, H200),
            80 << 10,
            "the H200, two per multiprocessor"
        );
        for blocks in 1..=8 {
            let pad = stream_pad(None, blocks, H200);
            if pad == 0 {
                continue;
            }
            let fit = H200.per_sm / (pad + H200.reserved);
            assert_eq!(fit, blocks, "{blocks} per multiprocessor: pad {pad}");
            assert_eq!(pad % (8 << 10), 0);
        }
        // An A100 (164 KiB per multiprocessor, 163 per block).
        let a100 = SharedLimits {
            per_sm: 164 << 10,
            per_block: 163 << 10,
            reserved: 1 << 10,
        };
        assert_eq!(stream_pad(None, 2, a100), 56 << 10);
        assert_eq!(a100.per_sm / ((56 << 10) + a100.reserved), 2);
        // Asked for: off, as given, capped at what a block may have.
        assert_eq!(stream_pad(Some(0), 2, H200), 0);
        assert_eq!(stream_pad(Some(96), 2, H200), 96 << 10);
        assert_eq!(stream_pad(Some(227), 2, a100), 162 << 10);
        assert_eq!(stream_pad(Some(227), 2, H200), 226 << 10);
        // Nothing fits exactly: no pad rather than a launch the device refuses.
        let tiny = SharedLimits {
            per_sm: 48 << 10,
            per_block: 48 << 10,
            reserved: 1 << 10,
        };
        assert_eq!(stream_pad(None, 8, tiny), 0);
    }

    const ACT: u64 = 1;
    const INPUTS: u64 = 2;
    const K_CACHE: u64 = 3;
    const V_CACHE: u64 = 4;

    fn view(
        buf: u64,
        byte_offset: usize,
        dtype: DType,
        shape: &[usize],
        strides: &[usize],
    ) -> TensorRef {
        TensorRef {
            buffer: BufferId(buf),
            byte_offset,
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }

    fn packed(buf: u64, byte_offset: usize, dtype: DType, shape: &[usize]) -> TensorRef {
        view(
            buf,
            byte_offset,
            dtype,
            shape,
            &lowsync_graph::contiguous_strides(shape),
        )
    }

    /// An f32 activation of `ACT`.
    fn act(byte_offset: usize, shape: &[usize]) -> TensorRef {
        packed(ACT, byte_offset, DType::F32, shape)
    }

    /// GGUF weight `[out, in]` seen as `w.T`, alone in buffer `id`.
    fn wt(id: u64, dtype: DType, inp: usize, out: usize) -> TensorRef {
        view(id, 0, dtype, &[inp, out], &[1, inp])
    }

    fn node(op: Op, dst: TensorRef, srcs: Vec<TensorRef>) -> ExecNode {
        ExecNode {
            op,
            name: op.name().into(),
            dst,
            srcs,
        }
    }

    const NORM: Op = Op::RmsNorm { eps: 1e-5 };
    const ROPE: Op = Op::Rope {
        mode: RopeMode::Normal,
        n_dims: 16,
        theta_base: 1e4,
    };
    const SOFT_MAX: Op = Op::SoftMax { scale: 0.25 };

    /// One decode layer of llama.py's graph (T = 1, d 64, 4 query heads over 2 kv heads of 16,
    /// ffn 128, 32 cache rows) with the byte offsets the scheduler's allocator gives it: rope q
    /// over h, rope k over the raw q, the scores over k and v, p @ V over q, its Cpy over the
    /// scores, in-place bias and residual adds, SwiGlu in place over gate.
    fn layer(bias: bool, kv: DType) -> Vec<ExecNode> {
        let (x, h) = (act(0, &[1, 64]), act(256, &[1, 64]));
        let pos = packed(INPUTS, 64, DType::I32, &[1]);
        let kv_idx = packed(INPUTS, 128, DType::I32, &[1]);
        let mask = packed(INPUTS, 192, DType::F32, &[1, 32]);
        let k_cache = packed(K_CACHE, 0, kv, &[32, 32]);
        let v_cache = packed(V_CACHE, 0, kv, &[32, 32]);
        let mut v = Vec::new();
        let linear = |v: &mut Vec<ExecNode>, w: u64, a: &TensorRef, dst: TensorRef| {
            let (inp, out) = (a.shape[1], dst.shape[1]);
            v.push(node(
                Op::MulMat,
                dst.clone(),
                vec![a.clone(), wt(w, DType::F32, inp, out)],
            ));
            if bias {
                let b = packed(w + 1, 0, DType::F32, &[out]);
                v.push(node(Op::Add, dst.clone(), vec![dst, b]));
            }
        };
        v.push(node(NORM, h.clone(), vec![x.clone()]));
        v.push(node(
            Op::Mul,
            h.clone(),
            vec![h.clone(), packed(10, 0, DType::F32, &[64])],
        ));
        linear(&mut v, 20, &h, act(512, &[1, 64]));
        linear(&mut v, 30, &h, act(768, &[1, 32]));
        linear(&mut v, 40, &h, act(896, &[1, 32]));
        v.push(node(
            ROPE,
            act(256, &[1, 4, 16]),
            vec![act(512, &[1, 4, 16]), pos.clone()],
        ));
        v.push(node(
            ROPE,
            act(512, &[1, 2, 16]),
            vec![act(768, &[1, 2, 16]), pos],
        ));
        v.push(node(
            Op::SetRows,
            k_cache.clone(),
            vec![k_cache, act(512, &[1, 32]), kv_idx.clone()],
        ));
        v.push(node(
            Op::SetRows,
            v_cache.clone(),
            vec![v_cache, act(896, &[1, 32]), kv_idx],
        ));
        let q = view(ACT, 256, DType::F32, &[4, 1, 16], &[16, 64, 1]);
        let keys = view(K_CACHE, 0, kv, &[2, 16, 32], &[16, 1, 32]);
        let values = view(V_CACHE, 0, kv, &[2, 32, 16], &[16, 32, 1]);
        v.push(node(Op::MulMat, act(512, &[4, 1, 32]), vec![q, keys]));
        v.push(node(
            SOFT_MAX,
            act(1024, &[4, 1, 32]),
            vec![act(512, &[4, 1, 32]), mask],
        ));
        v.push(node(
            Op::MulMat,
            act(256, &[4, 1, 16]),
            vec![act(1024, &[4, 1, 32]), values],
        ));
        let o_t = view(ACT, 256, DType::F32, &[1, 4, 16], &[16, 16, 1]);
        v.push(node(Op::Cpy, act(512, &[1, 4, 16]), vec![o_t]));
        v.push(node(
            Op::MulMat,
            act(256, &[1, 64]),
            vec![act(512, &[1, 64]), wt(50, DType::F32, 64, 64)],
        ));
        v.push(node(
            Op::Add,
            x.clone(),
            vec![x.clone(), act(256, &[1, 64])],
        ));
        v.push(node(NORM, h.clone(), vec![x.clone()]));
        v.push(node(
            Op::Mul,
            h.clone(),
            vec![h.clone(), packed(11, 0, DType::F32, &[64])],
        ));
        let (gate, up) = (act(512, &[1, 128]), act(1024, &[1, 128]));
        v.push(node(
            Op::MulMat,
            gate.clone(),
            vec![h.clone(), wt(60, DType::F32, 64, 128)],
        ));
        v.push(node(
            Op::MulMat,
            up.clone(),
            vec![h.clone(), wt(61, DType::F32, 64, 128)],
        ));
        v.push(node(Op::SwiGlu, gate.clone(), vec![gate.clone(), up]));
        v.push(node(
            Op::MulMat,
            act(256, &[1, 64]),
            vec![gate, wt(62, DType::F32, 128, 64)],
        ));
        v.push(node(Op::Add, x.clone(), vec![x, act(256, &[1, 64])]));
        v
    }

    fn seg(mm: usize, add: Option<usize>) -> Seg {
        Seg::new(mm, add)
    }

    fn fused(kind: Kind) -> Step {
        Step::Fused(Group::new(kind))
    }

    fn tailed(mm: usize, add: Option<usize>, rope: Option<usize>, rows: Option<usize>) -> Seg {
        Seg {
            mm,
            add,
            rope,
            rows,
        }
    }

    #[test]
    fn a_decode_layer_runs_in_five_steps() {
        for kv in [DType::F32, DType::F16, DType::BF16] {
            let want = vec![
                fused(Kind::Gemv {
                    segs: vec![
                        tailed(2, Some(3), Some(8), None),
                        tailed(4, Some(5), Some(9), Some(10)),
                        tailed(6, Some(7), None, Some(11)),
                    ],
                    swiglu: None,
                    norm: Some(NormPro { norm: 0, mul: 1 }),
                }),
                fused(Kind::Attention {
                    kq: 12,
                    soft_max: 13,
                    pv: 14,
                    cpy: Some(15),
                    scores: false,
                }),
                fused(Kind::Gemv {
                    segs: vec![seg(16, Some(17))],
                    swiglu: None,
                    norm: None,
                }),
                fused(Kind::Gemv {
                    segs: vec![seg(20, None), seg(21, None)],
                    swiglu: Some(22),
                    norm: Some(NormPro { norm: 18, mul: 19 }),
                }),
                fused(Kind::Gemv {
                    segs: vec![seg(23, Some(24))],
                    swiglu: None,
                    norm: None,
                }),
            ];
            assert_eq!(plan(&layer(true, kv), None), want, "{kv}");
            let steps = plan(&layer(false, kv), None);
            assert_eq!(steps.len(), 5, "{kv}: {steps:?}");
            assert_eq!(
                steps[0],
                fused(Kind::Gemv {
                    segs: vec![
                        tailed(2, None, Some(5), None),
                        tailed(3, None, Some(6), Some(7)),
                        tailed(4, None, None, Some(8)),
                    ],
                    swiglu: None,
                    norm: Some(NormPro { norm: 0, mul: 1 }),
                })
            );
            // A norm whose row is not the products' activation stays a NormMul of its own.
            let mut other = layer(false, kv);
            other[1].dst.byte_offset += 4096;
            assert_eq!(
                plan(&other, None)[0],
                fused(Kind::NormMul { norm: 0, mul: 1 })
            );
            // So does one whose prologue writes would clobber the row it reads (the product
            // of the norm over x itself).
            let mut clobber = layer(false, kv);
            let x = clobber[0].srcs[0].clone();
            clobber[1].dst = x.clone();
            for n in &mut clobber[2..5] {
                n.srcs[0] = x.clone();
            }
            assert!(
                !plan(&clobber, None).iter().any(|s| matches!(
                    s,
                    Step::Fused(Group {
                        kind: Kind::Gemv {
                            norm: Some(NormPro { norm: 0, .. }),
                            ..
                        },
                        ..
                    })
                )),
                "{kv}"
            );
        }
    }

    /// llama.py's head at one token: the final norm (its own launch: the head is many waves),
    /// the product with the output weight, its argmax.
    fn head(rows: usize) -> Vec<ExecNode> {
        let (x, h) = (act(0, &[rows, 64]), act(1024, &[rows, 64]));
        vec![
            node(NORM, h.clone(), vec![x]),
            node(
                Op::Mul,
                h.clone(),
                vec![h.clone(), packed(10, 0, DType::F32, &[64])],
            ),
            node(
                Op::MulMat,
                act(4096, &[rows, 300]),
                vec![h, wt(20, DType::F16, 64, 300)],
            ),
            node(
                Op::Argmax,
                packed(INPUTS, 0, DType::I32, &[rows]),
                vec![act(4096, &[rows, 300])],
            ),
        ]
    }

    #[test]
    fn the_head_and_its_argmax_are_one_launch() {
        let want = vec![
            fused(Kind::NormMul { norm: 0, mul: 1 }),
            fused(Kind::HeadArgmax { mm: 2, argmax: 3 }),
        ];
        assert_eq!(plan(&head(1), None), want);
        // Otherwise the argmax runs on its own (the product may still take the norm).
        let alone = |steps: &[Step], am: usize| {
            steps.contains(&Step::Node(am))
                && !steps.iter().any(|s| {
                    matches!(
                        s,
                        Step::Fused(Group {
                            kind: Kind::HeadArgmax { .. },
                            ..
                        })
                    )
                })
        };
        // Two rows: two indices, not the one-row kernel's.
        assert!(alone(&plan(&head(2), None), 3));
        // cuBLAS for the product (no matrix-vector kernel at all).
        assert!(alone(&plan(&head(1), Some(0)), 3));
        // The argmax of something else, or of a part of the logits.
        let mut other = head(1);
        other[3].srcs[0].byte_offset += 4;
        other[3].srcs[0].shape = vec![1, 299];
        assert!(alone(&plan(&other, None), 3));
        // A node between them that writes the logits runs between them.
        let mut between = head(1);
        let fill = node(
            Op::Scale { scale: 2.0 },
            act(4096, &[1, 300]),
            vec![act(4096, &[1, 300])],
        );
        between.insert(3, fill);
        let steps = plan(&between, None);
        assert!(
            alone(&steps, 4) && steps.ends_with(&[Step::Node(3), Step::Node(4)]),
            "{steps:?}"
        );
        // The index overlapping the activation the product reads.
        let mut clobber = head(1);
        clobber[3].dst = packed(ACT, 1024, DType::I32, &[1]);
        assert!(alone(&plan(&clobber, None), 3));
    }

    #[test]
    fn each_node_is_run_once() {
        let nodes = layer(true, DType::F16);
        let mut seen: Vec<usize> = plan(&nodes, None)
            .iter()
            .flat_map(|s| match s {
                Step::Node(i) => vec![*i],
                Step::Fused(g) => g.nodes.clone(),
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..nodes.len()).collect::<Vec<_>>());
    }

    #[test]
    fn matrix_vector_limit_and_config_decide_the_products() {
        let nodes = layer(false, DType::F16);
        // cuBLAS for every product: no fused matrix-vector launch.
        let steps = plan(&nodes, Some(0));
        assert!(steps.iter().all(|s| !matches!(
            s,
            Step::Fused(Group {
                kind: Kind::Gemv { .. },
                ..
            })
        )));
        // Nine rows over f32 weights exceed the limit.
        let a = act(0, &[9, 64]);
        let mm = |w, off| {
            node(
                Op::MulMat,
                act(off, &[9, 32]),
                vec![a.clone(), wt(w, DType::F32, 64, 32)],
            )
        };
        let nodes = vec![mm(20, 4096), mm(21, 8192)];
        assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
        // With f16 weights the limit is 32 rows.
        let mm = |w, off| {
            node(
                Op::MulMat,
                act(off, &[9, 32]),
                vec![a.clone(), wt(w, DType::F16, 64, 32)],
            )
        };
        let nodes = vec![mm(20, 4096), mm(21, 8192)];
        assert_eq!(
            plan(&nodes, None),
            vec![fused(Kind::Gemv {
                segs: vec![seg(0, None), seg(1, None)],
                swiglu: None,
                norm: None,
            })]
        );
    }

    /// Two projections of `h` at 0 with `between` in the middle.
    fn two_products(between: ExecNode) -> Vec<ExecNode> {
        let h = act(0, &[1, 64]);
        vec![
            node(
                Op::MulMat,
                act(256, &[1, 64]),
                vec![h.clone(), wt(20, DType::F16, 64, 64)],
            ),
            between,
            node(
                Op::MulMat,
                act(512, &[1, 64]),
                vec![h, wt(21, DType::F16, 64, 64)],
            ),
        ]
    }

    #[test]
    fn reordering_is_refused_over_an_overlapping_node() {
        let scale = |dst, src| node(Op::Scale { scale: 2.0 }, dst, vec![src]);
        // Unrelated: the second product moves before it.
        let ok = two_products(scale(act(2048, &[1, 64]), act(1024, &[1, 64])));
        assert_eq!(
            plan(&ok, None),
            vec![
                fused(Kind::Gemv {
                    segs: vec![seg(0, None), seg(2, None)],
                    swiglu: None,
                    norm: None,
                }),
                Step::Node(1)
            ]
        );
        let unfused = vec![Step::Node(0), Step::Node(1), Step::Node(2)];
        // It writes the activation the moved product reads.
        let writes_src = two_products(scale(act(0, &[1, 16]), act(1024, &[1, 16])));
        assert_eq!(plan(&writes_src, None), unfused);
        // It reads what the moved product writes.
        let reads_dst = two_products(scale(act(2048, &[1, 8]), act(540, &[1, 8])));
        assert_eq!(plan(&reads_dst, None), unfused);
        // It writes what the moved product writes.
        let writes_dst = two_products(scale(act(600, &[1, 8]), act(1024, &[1, 8])));
        assert_eq!(plan(&writes_dst, None), unfused);
    }

    #[test]
    fn groups_whose_writes_clobber_their_reads_are_refused() {
        let h = act(0, &[1, 64]);
        // The second product would overwrite the activation the first still reads.
        let nodes = vec![
            node(
                Op::MulMat,
                act(256, &[1, 64]),
                vec![h.clone(), wt(20, DType::F32, 64, 64)],
            ),
            node(
                Op::MulMat,
                act(0, &[1, 16]),
                vec![h.clone(), wt(21, DType::F32, 64, 16)],
            ),
        ];
        assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
        // A residual Add in place over the activation of its own product: other blocks still
        // read the activation while one writes the sum.
        let nodes = vec![
            node(
                Op::MulMat,
                act(256, &[1, 64]),
                vec![h.clone(), wt(20, DType::F32, 64, 64)],
            ),
            node(Op::Add, h.clone(), vec![h.clone(), act(256, &[1, 64])]),
        ];
        assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
        // A shifted, overlapping residual needs a private copy.
        let nodes = vec![
            node(
                Op::MulMat,
                act(256, &[1, 64]),
                vec![h.clone(), wt(20, DType::F32, 64, 64)],
            ),
            node(
                Op::Add,
                act(256, &[1, 64]),
                vec![act(256, &[1, 64]), act(260, &[1, 64])],
            ),
        ];
        assert!(nodes[1].src_needs_private_copy(1));
        assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    }

    #[test]
    fn mismatched_dtypes_and_shapes_stay_unfused() {
        let h = act(0, &[1, 64]);
        let w16 = wt(20, DType::F16, 64, 64);
        let unfused = |nodes: &[ExecNode]| (0..nodes.len()).map(Step::Node).collect::<Vec<_>>();
        let cases: Vec<(&str, Vec<ExecNode>)> = vec![
            (
                "f16 activation",
                vec![
                    node(
                        Op::MulMat,
                        act(256, &[1, 64]),
                        vec![packed(ACT, 0, DType::F16, &[1, 64]), w16.clone()],
                    ),
                    node(
                        Op::Add,
                        act(256, &[1, 64]),
                        vec![act(256, &[1, 64]), act(1024, &[1, 64])],
                    ),
                ],
            ),
            (
                "weights of two dtypes",
                vec![
                    node(Op::MulMat, act(256, &[1, 64]), vec![h.clone(), w16.clone()]),
                    node(
                        Op::MulMat,
                        act(512, &[1, 64]),
                        vec![h.clone(), wt(21, DType::F32, 64, 64)],
                    ),
                ],
            ),
            (
                "row-major weight (n contiguous)",
                vec![
                    node(
                        Op::MulMat,
                        act(256, &[1, 64]),
                        vec![h.clone(), packed(20, 0, DType::F16, &[64, 64])],
                    ),
                    node(
                        Op::MulMat,
                        act(512, &[1, 64]),
                        vec![h.clone(), packed(21, 0, DType::F16, &[64, 64])],
                    ),
                ],
            ),
            (
                "add broadcasting the product",
                vec![
                    node(Op::MulMat, act(256, &[1, 64]), vec![h.clone(), w16.clone()]),
                    node(
                        Op::Add,
                        act(1024, &[3, 64]),
                        vec![act(2048, &[3, 64]), act(256, &[1, 64])],
                    ),
                ],
            ),
            (
                "norm weight that is not a row",
                vec![
                    node(NORM, act(256, &[2, 64]), vec![act(0, &[2, 64])]),
                    node(
                        Op::Mul,
                        act(256, &[2, 64]),
                        vec![act(256, &[2, 64]), packed(10, 0, DType::F32, &[2, 64])],
                    ),
                ],
            ),
            (
                "rope of nine rows",
                vec![
                    node(
                        ROPE,
                        act(512, &[9, 2, 16]),
                        vec![act(0, &[9, 2, 16]), packed(INPUTS, 0, DType::I32, &[9])],
                    ),
                    node(
                        Op::SetRows,
                        packed(K_CACHE, 0, DType::F16, &[32, 32]),
                        vec![
                            packed(K_CACHE, 0, DType::F16, &[32, 32]),
                            act(512, &[9, 32]),
                            packed(INPUTS, 64, DType::I32, &[9]),
                        ],
                    ),
                ],
            ),
        ];
        for (name, nodes) in cases {
            assert_eq!(plan(&nodes, None), unfused(&nodes), "{name}");
        }
    }

    /// Attention nodes over 2 kv heads of `d` dims (K and V caches of `kv` / `vdt`), 8 query
    /// heads, 40 cache rows, at fresh offsets, plus `tail`.
    fn attention_nodes(d: usize, kv: DType, vdt: DType, tail: Vec<ExecNode>) -> Vec<ExecNode> {
        let q = view(ACT, 0, DType::F32, &[8, 1, d], &[d, 8 * d, 1]);
        let keys = view(K_CACHE, 0, kv, &[2, d, 40], &[d, 1, 2 * d]);
        let values = view(V_CACHE, 0, vdt, &[2, 40, d], &[d, 2 * d, 1]);
        let mask = packed(INPUTS, 0, DType::F32, &[1, 40]);
        let mut v = vec![
            node(Op::MulMat, act(8192, &[8, 1, 40]), vec![q, keys]),
            node(
                SOFT_MAX,
                act(16384, &[8, 1, 40]),
                vec![act(8192, &[8, 1, 40]), mask],
            ),
            node(
                Op::MulMat,
                act(24576, &[8, 1, d]),
                vec![act(16384, &[8, 1, 40]), values],
            ),
        ];
        v.extend(tail);
        v
    }

    #[test]
    fn scratch_no_later_split_reads_ends_the_life_of_what_is_left_there() {
        // Nothing after the attention overwrites its scores: without knowing what is read
        // after the graph they are written; with the scheduler's word that no later split
        // reads those bytes, they are dead.
        let f = DType::F32;
        let nodes = attention_nodes(64, f, f, vec![]);
        let scores = nodes[0].dst.clone();
        let (s0, _) = byte_range(&scores);
        let written =
            |end: Option<&ScratchLive>| match &super::plan(&Nodes { list: &nodes, end }, None)[0] {
                Step::Fused(Group {
                    kind: Kind::Attention { scores, .. },
                    ..
                }) => *scores,
                s => panic!("not an attention: {s:?}"),
            };
        let live = |kept: Vec<(usize, usize)>| ScratchLive {
            buffer: scores.buffer,
            kept,
        };
        assert!(written(None), "nothing known");
        assert!(
            !written(Some(&live(vec![]))),
            "no later split reads the scratch"
        );
        assert!(
            written(Some(&live(vec![(s0 + 4, s0 + 8)]))),
            "a later split reads some"
        );
        assert!(
            !written(Some(&live(vec![(0, s0)]))),
            "a later split reads other bytes"
        );
        let other = ScratchLive {
            buffer: BufferId(999),
            kept: vec![],
        };
        assert!(
            written(Some(&other)),
            "another buffer's scratch says nothing of this one"
        );
    }

    fn attention_kind(cpy: Option<usize>, scores: bool) -> Step {
        fused(Kind::Attention {
            kq: 0,
            soft_max: 1,
            pv: 2,
            cpy,
            scores,
        })
    }

    #[test]
    fn raw_scores_are_written_unless_overwritten_before_any_read() {
        let f = DType::F16;
        // Nothing overwrites them: a later split or the host may read them.
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![]), None),
            vec![attention_kind(None, true)]
        );
        // Overwritten whole.
        let over = node(
            Op::Scale { scale: 1.0 },
            act(8192, &[8, 40]),
            vec![act(60000, &[8, 40])],
        );
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![over.clone()]), None),
            vec![attention_kind(None, false), Step::Node(3)]
        );
        // Read first, or only half overwritten.
        let read = node(
            Op::Scale { scale: 1.0 },
            act(60000, &[8]),
            vec![act(8192 + 600, &[8])],
        );
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![read, over]), None)[0],
            attention_kind(None, true)
        );
        let half = node(
            Op::Scale { scale: 1.0 },
            act(8192, &[4, 40]),
            vec![act(60000, &[4, 40])],
        );
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![half]), None)[0],
            attention_kind(None, true)
        );
    }

    #[test]
    fn the_copy_joins_unless_it_overwrites_live_scores() {
        let f = DType::BF16;
        let o_t = view(ACT, 24576, DType::F32, &[1, 8, 64], &[64, 64, 1]);
        // Into fresh memory.
        let cpy = node(Op::Cpy, act(40000, &[1, 8, 64]), vec![o_t.clone()]);
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![cpy]), None),
            vec![attention_kind(Some(3), true)]
        );
        // Over part of the scores, the rest of which nothing overwrites: other blocks may still
        // be writing scores where one writes its copy.
        let cpy = node(Op::Cpy, act(7168, &[1, 8, 64]), vec![o_t.clone()]);
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![cpy.clone()]), None),
            vec![attention_kind(None, true), Step::Node(3)]
        );
        // ... unless the rest of them is overwritten too: then the scores are not written.
        let rest = node(
            Op::Scale { scale: 1.0 },
            act(9216, &[64]),
            vec![act(60000, &[64])],
        );
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![cpy, rest]), None),
            vec![attention_kind(Some(3), false), Step::Node(4)]
        );
        // A copy of another layout is not the attention's.
        let other = node(
            Op::Cpy,
            act(40000, &[8, 64]),
            vec![view(ACT, 24576, DType::F32, &[8, 64], &[1, 8])],
        );
        assert_eq!(
            plan(&attention_nodes(64, f, f, vec![other]), None),
            vec![attention_kind(None, true), Step::Node(3)]
        );
    }

    #[test]
    fn attention_preconditions() {
        let f = DType::F16;
        let unfused = vec![Step::Node(0), Step::Node(1), Step::Node(2)];
        assert_eq!(
            plan(&attention_nodes(512, f, f, vec![]), None),
            unfused,
            "head_dim > 256"
        );
        assert_eq!(
            plan(&attention_nodes(64, f, DType::F32, vec![]), None),
            unfused,
            "K and V dtypes differ"
        );
        assert_eq!(
            plan(&attention_nodes(80, f, f, vec![]), None),
            vec![attention_kind(None, true)],
            "head_dim 80"
        );
        // Results over q, per head: head h of p @ V lies over head h of q.
        let q_over = |o_stride: usize| {
            let mut v = attention_nodes(64, f, f, vec![]);
            v[0].srcs[0] = view(ACT, 24576, DType::F32, &[8, 1, 64], &[64, 512, 1]);
            v[2].dst = view(
                ACT,
                24576,
                DType::F32,
                &[8, 1, 64],
                &[o_stride, o_stride, 1],
            );
            v
        };
        assert_eq!(plan(&q_over(64), None)[0], attention_kind(None, true));
        // Shifted heads would overwrite another block's q before it is read.
        let mut shifted = q_over(64);
        shifted[2].dst.byte_offset += 256;
        assert_eq!(plan(&shifted, None), unfused);
    }

    #[test]
    fn rope_and_cache_epilogues_skip_only_dead_results() {
        // In the layer the norm row lies under q's rotation and q's product under k's: the
        // row-pair group writes neither (nothing outside reads them before they are
        // overwritten), nor the products its Rope or SetRows consume.
        // The skipped results of the first step (the q/k/v group) of a layer.
        let dead_of = |nodes: &[ExecNode]| match &plan(nodes, None)[0] {
            Step::Fused(Group {
                kind: Kind::Gemv { segs, norm, .. },
                ..
            }) => Dead::of(&bare(nodes), segs, *norm),
            other => panic!("no fused products: {other:?}"),
        };
        let dead = dead_of(&layer(false, DType::F16));
        assert!(dead.norm);
        assert_eq!(dead.products, [true, true, true]);
        assert_eq!(dead.sums, [false, false, false]);
        // With biases the products are consumed by their Adds and the sums by the tails.
        let dead = dead_of(&layer(true, DType::F16));
        assert!(dead.norm);
        assert_eq!(dead.products, [true, true, true]);
        assert_eq!(dead.sums, [true, true, true]);

        // Something outside that reads q's product keeps it live: its write would then
        // overlap k's rotation, so the epilogues are refused and the ropes run as before.
        let mut live = layer(false, DType::F16);
        let q_out = live[2].dst.clone();
        live.insert(
            9,
            node(
                Op::Cpy,
                packed(ACT, 4096, DType::F32, &[1, 64]),
                vec![q_out],
            ),
        );
        let steps = plan(&live, None);
        assert!(
            matches!(&steps[0], Step::Fused(Group { kind: Kind::Gemv { segs, .. }, .. }) if !has_tails(segs)),
            "{steps:?}"
        );
        assert_eq!(steps[1], Step::Node(5));
        // A product of an odd number of columns cannot be split into row pairs: no epilogues
        // for the group.
        let mut odd = layer(false, DType::F16);
        odd[4].dst.shape = vec![1, 31];
        odd[4].srcs[1].shape = vec![64, 31];
        let steps = plan(&odd, None);
        assert!(
            matches!(&steps[0], Step::Fused(Group { kind: Kind::Gemv { segs, .. }, .. }) if !has_tails(segs)),
            "{steps:?}"
        );
        // A neox rope (halves, not adjacent pairs) is no epilogue either; the cache writes
        // still are.
        let mut neox = layer(false, DType::F16);
        for n in &mut neox[5..7] {
            n.op = Op::Rope {
                mode: RopeMode::Neox,
                n_dims: 16,
                theta_base: 10000.0,
            };
        }
        let steps = plan(&neox, None);
        let Step::Fused(Group {
            kind: Kind::Gemv { segs, .. },
            ..
        }) = &steps[0]
        else {
            panic!("{steps:?}");
        };
        assert!(segs.iter().all(|s| s.rope.is_none()), "{steps:?}");
    }

    #[test]
    fn the_q_rope_is_not_fused_over_a_hazard() {
        // Without the products' epilogues (here: matrix-vector fusion off by a rows limit of
        // 0), the k rope writes over the raw q the q rope reads.
        let steps = plan(&layer(false, DType::F16), Some(0));
        assert!(steps.contains(&Step::Node(5)), "{steps:?}");
        // Without a cache write the k rope stays alone too.
        let pos = packed(INPUTS, 0, DType::I32, &[1]);
        let nodes = vec![node(
            ROPE,
            act(512, &[1, 2, 16]),
            vec![act(0, &[1, 2, 16]), pos],
        )];
        assert_eq!(plan(&nodes, None), vec![Step::Node(0)]);
    }

    #[test]
    fn head_alignment_needs_one_start_and_stride_and_disjoint_heads() {
        let q = view(ACT, 256, DType::F32, &[4, 1, 16], &[16, 64, 1]);
        let o = view(ACT, 256, DType::F32, &[4, 1, 16], &[16, 16, 1]);
        assert!(head_aligned(&q, Some(0), &o, Some(0)));
        let wide = view(ACT, 256, DType::F32, &[4, 1, 32], &[16, 16, 1]);
        assert!(
            !head_aligned(&q, Some(0), &wide, Some(0)),
            "heads reach the next one"
        );
        let half = view(ACT, 256, DType::F16, &[4, 1, 16], &[32, 32, 1]);
        assert!(
            head_aligned(&q, Some(0), &half, Some(0)),
            "same bytes per head"
        );
        let one = view(ACT, 300, DType::F32, &[1, 1, 16], &[16, 16, 1]);
        let q1 = view(ACT, 256, DType::F32, &[1, 1, 16], &[16, 16, 1]);
        assert!(head_aligned(&q1, Some(0), &one, None), "one block");
    }

    #[test]
    fn dead_bytes_need_a_covering_write_before_any_read() {
        let scale = |dst, src| node(Op::Scale { scale: 1.0 }, dst, vec![src]);
        let nodes = vec![
            scale(act(0, &[64]), act(1024, &[64])),
            scale(act(2048, &[64]), act(0, &[64])),
            scale(act(0, &[32]), act(1024, &[32])),
            scale(act(128, &[32]), act(1024, &[32])),
        ];
        assert!(dead_after(&nodes, 0, 1), "its reader is skipped");
        assert!(!dead_after(&nodes, 0, 3), "read by node 1");
        assert!(!dead_after(&nodes[..3], 0, 1), "half never overwritten");
    }

    #[test]
    fn the_mask_is_read_ahead_only_when_no_node_writes_it_and_q_is_the_graphs() {
        // A decode layer: the mask is an input no node writes, q comes from its q/k/v group.
        let l = layer(true, DType::F16);
        assert!(mask_ahead(&l, &l[12], &l[13]));
        // A node writing anything in the mask's buffer (a mask built on the device).
        let mut built = l.clone();
        let mask = built[13].srcs[1].clone();
        built.insert(0, node(Op::Cpy, mask.clone(), vec![act(0, &[1, 32])]));
        assert!(!mask_ahead(&built, &built[13], &built[14]));
        // No mask, or q from outside the graph (the attention could be its first launch).
        let mut bare = l.clone();
        bare[13].srcs.truncate(1);
        assert!(!mask_ahead(&bare, &bare[12], &bare[13]));
        let alone = attention_nodes(64, DType::F16, DType::F16, vec![]);
        assert!(!mask_ahead(&alone, &alone[0], &alone[1]));
    }

    #[test]
    fn fg_structs_match_the_cuda_layout() {
        assert_eq!(std::mem::size_of::<FgSeg>(), 8 * 29);
        assert_eq!(std::mem::size_of::<FgSet>(), 8 * (1 + 29 * MAX_SEGS + 7));
    }
}
