//! The safety proof of a fused group: running it as one kernel gives the unfused chain's results.
//!
//! Why: a fused kernel reorders work — later members run at the first one's position, results
//! are kept in registers, dead results are not written — and the allocator reuses memory, so a
//! group that looks right by its ops can still read bytes another member already overwrote, or
//! skip a write a later node reads. Every candidate group passes this proof before it is kept.
//!
//! Strategy: a group's [`Footprint`] lists what it reads (sources not produced inside it) and
//! writes, each with the [`Lane`] that touches it; [`Footprint::safe`] refuses private copies,
//! writes over reads (except the same element on the same thread, one attention head's own
//! slice, or a prefill attention's result over the very q element its block read),
//! overlapping writes (except an in-place node over its own source) and moves across a
//! conflicting node. [`dead_after`] proves a result is overwritten before anything reads it,
//! counting scratch no later split reads as overwritten at the graph's end.
//!
//! Invariants: the rules of the module docs of `fusion` — checked by byte ranges of
//! `TensorRef`s in one buffer, so they hold whatever the allocator reuses.

use lowsync_backend::{ExecNode, TensorRef};
use lowsync_graph::Op;

use crate::fusion::group::{add_other, cpy_axes, has_tails, Group, Kind, Nodes, NormPro, Seg};

/// The lane chain of a fused norm prologue's writes (products use their segment index).
const NORM_CHAIN: usize = usize::MAX;

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
    /// Prefill attention: element (h, i, d) of a `[heads, rows, dims]` tensor, touched only by
    /// the block of head h and row i's tile, reads before any write; the byte strides of the
    /// three axes.
    Tile([usize; 3]),
}

/// What a group reads (sources not produced inside the group) and writes.
struct Footprint<'a> {
    members: Vec<usize>,
    reads: Vec<(&'a TensorRef, Lane)>,
    writes: Vec<(usize, &'a TensorRef, Lane)>,
}

pub(super) fn byte_range(t: &TensorRef) -> (usize, usize) {
    (t.byte_offset, t.byte_offset + t.byte_extent())
}

/// Whether two tensors share a byte.
pub(super) fn overlap(a: &TensorRef, b: &TensorRef) -> bool {
    let ((a0, a1), (b0, b1)) = (byte_range(a), byte_range(b));
    a.buffer == b.buffer && a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
}

/// Whether node `n`, run after node `m` instead of before it, could change a result.
pub(super) fn conflicts(n: &ExecNode, m: &ExecNode) -> bool {
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
pub(super) fn head_aligned(
    a: &TensorRef,
    ax: Option<usize>,
    b: &TensorRef,
    bx: Option<usize>,
) -> bool {
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
    pub(super) fn safe(&self, nodes: &[ExecNode]) -> bool {
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
                    // The same element at the same bytes: read by its block before it writes.
                    (Lane::Tile(a), Lane::Tile(b)) => {
                        a == b
                            && w.byte_offset == r.byte_offset
                            && w.dtype.size_bytes() == r.dtype.size_bytes()
                    }
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
        Kind::HeadArgmax { mm, argmax, norm } => {
            let m = &nodes[*mm];
            match norm {
                // As a `Gemv` group's prologue: every block computes the activation, block 0
                // writes the norm and its product unless they are dead.
                Some(n) => {
                    reads.push((nodes[n.norm].srcs.first()?, Lane::Any));
                    reads.push((nodes[n.mul].srcs.get(1)?, Lane::Any));
                    if !norm_dead(nodes, *n, &[*mm]) {
                        writes.push((n.norm, &nodes[n.norm].dst, Lane::Elem(NORM_CHAIN)));
                        writes.push((n.mul, &nodes[n.mul].dst, Lane::Elem(NORM_CHAIN)));
                    }
                }
                None => reads.push((m.srcs.first()?, Lane::Any)),
            }
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
        Kind::Prefill {
            kq,
            soft_max,
            pv,
            cpy,
            out,
        } => {
            let q = nodes[*kq].srcs.first()?;
            reads.push((q, Lane::Tile(tile_strides(q, [0, 1, 2])?)));
            reads.push((nodes[*kq].srcs.get(1)?, Lane::Any));
            reads.push((nodes[*pv].srcs.get(1)?, Lane::Any));
            reads.extend(nodes[*soft_max].srcs.get(1).map(|m| (m, Lane::Any)));
            let o = &nodes[*pv].dst;
            if *out {
                writes.push((*pv, o, Lane::Tile(tile_strides(o, [0, 1, 2])?)));
            }
            if let Some(c) = cpy {
                let axes = cpy_axes(o, &nodes[*c])?;
                let dst = &nodes[*c].dst;
                // An axis of extent 1 has no Cpy axis: stride 0, as its only index is 0.
                let st =
                    |a: Option<usize>| a.map_or(0, |b| dst.strides[b] * dst.dtype.size_bytes());
                writes.push((*c, dst, Lane::Tile([st(axes[0]), st(axes[1]), st(axes[2])])));
            }
        }
    }
    Some(Footprint {
        members: kind.members(),
        reads,
        writes,
    })
}

/// The byte strides of `t`'s axes `axes` (a rank-3 tensor), for [`Lane::Tile`]; an axis of
/// extent 1 counts as stride 0 (its only index is 0), as in a Cpy's axes.
fn tile_strides(t: &TensorRef, axes: [usize; 3]) -> Option<[usize; 3]> {
    if t.shape.len() != 3 {
        return None;
    }
    let st = |a: usize| {
        if t.shape[a] == 1 {
            0
        } else {
            t.strides[a] * t.dtype.size_bytes()
        }
    };
    Some([st(axes[0]), st(axes[1]), st(axes[2])])
}

/// Whether `kind`'s footprint is well formed and safe.
pub(super) fn is_safe(nodes: &Nodes<'_>, kind: &Kind) -> bool {
    footprint(nodes, kind).is_some_and(|f| f.safe(nodes))
}

/// `kind` as a group, if its footprint is safe.
pub(super) fn fits(nodes: &Nodes<'_>, kind: Kind) -> Option<Group> {
    footprint(nodes, &kind)?
        .safe(nodes)
        .then(|| Group::new(kind))
}

/// Whether the bytes node `at` writes are dead once `reader` (its one consumer inside the
/// group) has read them: in node order after `at`, every byte is overwritten by a node's whole
/// contiguous result before any node but `reader`'s first source reads it. Bytes never
/// overwritten count as live (a later split or the host may read them).
pub(super) fn dead_after(nodes: &Nodes<'_>, at: usize, reader: usize) -> bool {
    dead_after_reads(nodes, at, &[(reader, 0)])
}

/// Whether the results of the norm prologue `n` are dead after its group: nothing but its Mul
/// reads the norm, nothing but the group's `products` (their activation, source 0) read the
/// Mul's result.
pub(super) fn norm_dead(nodes: &Nodes<'_>, n: NormPro, products: &[usize]) -> bool {
    let reads: Vec<(usize, usize)> = products.iter().map(|&p| (p, 0)).collect();
    dead_after_reads(nodes, n.norm, &[(n.mul, 0)]) && dead_after_reads(nodes, n.mul, &reads)
}

/// `dead_after` with several reads inside the group: (node, source index) pairs.
pub(super) fn dead_after_reads(nodes: &Nodes<'_>, at: usize, inside: &[(usize, usize)]) -> bool {
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
pub(super) struct Dead {
    pub(super) norm: bool,
    pub(super) products: Vec<bool>,
    pub(super) sums: Vec<bool>,
}

impl Dead {
    pub(super) fn of(nodes: &Nodes<'_>, segs: &[Seg], norm: Option<NormPro>) -> Dead {
        if !has_tails(segs) {
            return Dead {
                norm: false,
                products: vec![false; segs.len()],
                sums: vec![false; segs.len()],
            };
        }
        let products: Vec<usize> = segs.iter().map(|s| s.mm).collect();
        let norm = norm.is_some_and(|n| norm_dead(nodes, n, &products));
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
