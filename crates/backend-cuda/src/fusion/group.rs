//! What a fused group is: its kinds, its members, and the operand relations that define them.
//!
//! Why: the matcher (`patterns`), the safety proof (`safety`), the launchers and `describe`
//! all speak of the same groups; their vocabulary lives here, below all of them, so none of
//! them needs another's internals.
//!
//! Strategy: a [`Kind`] names a pattern with its member node indices; a [`Group`] is a kind
//! with its members sorted; a [`Step`] is either a node run alone or a group. [`Nodes`] is a
//! graph's node list with what is known of the scratch read after it.
//!
//! Invariants: a group's members are distinct nodes in ascending order, the kernel running at
//! the first one's position; every later member lies within [`WINDOW`] nodes of an earlier one.

use lowsync_backend::{ExecNode, ScratchLive, TensorRef};
use lowsync_graph::Op;

use crate::layout::broadcast_strides;

/// How far after an earlier member of its group (the first, or the product of an epilogue, or
/// the attention's previous node) a member may lie.
pub(super) const WINDOW: usize = 16;

/// Products of one fused matrix-vector launch (`FG_MAXS`).
pub(super) const MAX_SEGS: usize = 4;

/// One unit of work of a graph: a node run as before, or a fused group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Step {
    Node(usize),
    Fused(Group),
}

/// Nodes that run as one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Group {
    pub(super) kind: Kind,
    /// Member node indices, ascending; the kernel runs at the first one's position.
    pub(super) nodes: Vec<usize>,
}

impl Group {
    pub(super) fn new(kind: Kind) -> Group {
        let nodes = kind.members();
        Group { kind, nodes }
    }
}

/// A fused pattern and its members (node indices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Kind {
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
    /// then a one-thread `argmax_take` instead of a kernel that reads the logits back. With
    /// `norm` (a quantized weight under `CudaConfig::q_head_fold`), the activation is that
    /// `RmsNorm -> Mul` pair's result, computed in the product's prologue, and the product's
    /// launch takes the index itself (`fused_gemv1_q`'s `fq_take`): one launch in all.
    HeadArgmax {
        mm: usize,
        argmax: usize,
        norm: Option<NormPro>,
    },
    /// `scores`: the raw `q @ K^T` must be written (something may read it later).
    Attention {
        kq: usize,
        soft_max: usize,
        pv: usize,
        cpy: Option<usize>,
        scores: bool,
    },
    /// Prefill attention (several query rows per head), `attn_prefill`: the same chain, whose
    /// raw scores and p are dead (the kernel never writes them). `out`: o must be written
    /// besides the copy (something may read it later; always with no copy).
    Prefill {
        kq: usize,
        soft_max: usize,
        pv: usize,
        cpy: Option<usize>,
        out: bool,
    },
}

/// The `RmsNorm -> Mul(norm, weight row)` in front of a fused matrix-vector launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NormPro {
    pub(super) norm: usize,
    pub(super) mul: usize,
}

/// One product of a fused matrix-vector launch and its epilogues: the Add, and (decode's
/// row-pair kernel) a `Rope` of the segment's value and a `SetRows` of that result — or of the
/// value itself — into a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Seg {
    pub(super) mm: usize,
    pub(super) add: Option<usize>,
    pub(super) rope: Option<usize>,
    pub(super) rows: Option<usize>,
}

impl Seg {
    pub(super) fn new(mm: usize, add: Option<usize>) -> Seg {
        Seg {
            mm,
            add,
            rope: None,
            rows: None,
        }
    }

    /// The node whose result is the segment's value (what its Rope or SetRows reads).
    pub(super) fn value(&self) -> usize {
        self.add.unwrap_or(self.mm)
    }
}

/// Whether any product of the group has a Rope or SetRows epilogue (the row-pair kernel).
pub(super) fn has_tails(segs: &[Seg]) -> bool {
    segs.iter().any(|s| s.rope.is_some() || s.rows.is_some())
}

impl Kind {
    pub(super) fn members(&self) -> Vec<usize> {
        let mut v = match self {
            Kind::NormMul { norm, mul } => vec![*norm, *mul],
            Kind::Gemv { segs, swiglu, norm } => segs
                .iter()
                .flat_map(|s| [Some(s.mm), s.add, s.rope, s.rows].into_iter().flatten())
                .chain(*swiglu)
                .chain(norm.iter().flat_map(|n| [n.norm, n.mul]))
                .collect(),
            Kind::HeadArgmax { mm, argmax, norm } => [*mm, *argmax]
                .into_iter()
                .chain(norm.iter().flat_map(|n| [n.norm, n.mul]))
                .collect(),
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
            }
            | Kind::Prefill {
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

/// A graph's nodes and what is known of the scratch bytes read after it
/// (`ExecGraph::scratch`): at the graph's end, [`dead_after`] counts every other scratch byte
/// as overwritten (the next graph writes it before any read).
pub(super) struct Nodes<'a> {
    pub(super) list: &'a [ExecNode],
    pub(super) end: Option<&'a ScratchLive>,
}

impl std::ops::Deref for Nodes<'_> {
    type Target = [ExecNode];
    fn deref(&self) -> &[ExecNode] {
        self.list
    }
}

/// Untaken nodes after `i` within the window.
pub(super) fn later<'a>(
    nodes: &[ExecNode],
    i: usize,
    used: &'a [bool],
) -> impl Iterator<Item = usize> + 'a {
    (i + 1..nodes.len().min(i + 1 + WINDOW)).filter(move |&j| !used[j])
}

/// The other operand of `add` when it adds `out` (exactly that tensor) and something that
/// broadcasts onto it, giving a float result of `out`'s shape.
pub(super) fn add_other<'a>(add: &'a ExecNode, out: &TensorRef) -> Option<&'a TensorRef> {
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

/// For the Cpy of a view of `o` that only permutes o's axes (size-1 axes anywhere), the Cpy
/// axis holding each axis of `o` (`None` for an axis of extent 1).
pub(super) fn cpy_axes(o: &TensorRef, cpy: &ExecNode) -> Option<Vec<Option<usize>>> {
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
