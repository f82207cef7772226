//! Fusion: node chains of a decode graph that one kernel computes, found from the graph alone
//! and proven safe before they are planned as one dispatch.
//!
//! Why: a decode step of a Llama graph is a few hundred small dispatches; its attention is
//! `MulMat(q, K) -> SoftMax(scale, mask) -> MulMat(p, V) -> Cpy` (a permutation to
//! `[tokens, heads, dim]`), whose scores and probabilities only ever pass from one member to the
//! next. One kernel (`ops::attention`) computes the chain and keeps them on chip, but only where
//! skipping their writes and running every member at the first one's position cannot change
//! any result the unfused graph gives.
//!
//! The same holds for shorter pairs whose middle result passes to one reader only:
//! `RmsNorm -> Mul` by the norm's weight (`rms_norm_mul`); a decode product and the residual
//! add or SwiGLU that consumes it (`mul_mat_vec_*_e`: the op runs in the product's store); one
//! token's `Rope` of K and the `SetRows` that writes it into the KV cache (`rope_set_rows`);
//! one token's V product and its `SetRows` (`mul_mat_vec_*_r`). On a Llama layer these take
//! five of the eighteen dispatches the attention and norm fusions leave. Three nodes go
//! further where a kernel computes a pair of rows: the gate and up products of one x and the
//! `SwiGlu` of their results run as one dispatch (`mul_mat_vec_*_g`), each load of x serving
//! a gate row and its up row, so a layer waits for one product fewer; where the planner
//! refuses the three, the up product still takes SwiGLU in its store. A fused norm goes
//! further still where every product reading its result normalises x itself
//! ([`norm_readers`]; the float mat-vec's `_vn` flavours): the norm runs no dispatch, and
//! runs just before the first reader whose kernel cannot.
//!
//! Strategy: [`groups`] tries each node as the start of a chain and finds its members as the
//! first later node reading each result. An attention chain is kept only when every check
//! holds:
//! - shapes and dtypes: one query row per head, `heads % kv_heads == 0`, K and V with the same
//!   kv heads, an f32 mask that broadcasts onto the scores, f32 scores, p and product;
//! - the scores and p are dead once their one reader inside the chain read them ([`dead_after`]:
//!   every byte is overwritten by a later node's whole result before anything else reads it,
//!   or the scheduler says nothing reads it after the graph), so they are never written;
//! - the copy joins only when the product is dead after it, and maps the product's elements to
//!   its destination axis by axis ([`cpy_axes`]);
//! - no member needs a private copy of a source, the one tensor written overlaps nothing the
//!   chain reads, and no node between the members conflicts with a member that now runs before
//!   it (same rule as moving a node: no shared byte with a write on either side).
//!
//! A pair needs the same deadness, overlap and conflict checks ([`norm_mul_at`], [`epilogue_at`],
//! [`rope_rows_at`], [`product_rows_at`], and [`glu_pair_at`] for the three); a pair writing a
//! cache row takes a single token only (so no two rows of one step race for a cache row, and a bad
//! index writes nothing, as `set_rows` does).
//!
//! Invariant: a returned group is proven safe by byte ranges of `TensorRef`s, so it holds
//! whatever the allocator reuses; the caller still falls back to the unfused nodes when the
//! kernel planner refuses the operands.

use lowsync_backend::{ExecGraph, ExecNode, TensorRef};
use lowsync_graph::{DType, Op};

use crate::ops::{Epilogue, ATTN_MAX_DIM};

/// A decode attention chain run as one kernel (node indices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttnGroup {
    pub kq: usize,
    pub soft_max: usize,
    pub pv: usize,
    pub cpy: Option<usize>,
}

impl AttnGroup {
    /// Every member, in node order.
    pub(crate) fn members(&self) -> Vec<usize> {
        let mut m = vec![self.kq, self.soft_max, self.pv];
        m.extend(self.cpy);
        m
    }

    /// The last member: its result is the tensor the kernel writes.
    pub(crate) fn last(&self) -> usize {
        self.cpy.unwrap_or(self.pv)
    }
}

fn byte_range(t: &TensorRef) -> (usize, usize) {
    (t.byte_offset, t.byte_offset + t.byte_extent())
}

/// Whether two tensors share a byte.
pub(crate) fn overlap(a: &TensorRef, b: &TensorRef) -> bool {
    let ((a0, a1), (b0, b1)) = (byte_range(a), byte_range(b));
    a.buffer == b.buffer && a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
}

/// Whether node `n`, run after node `m` instead of before it, could change a result.
fn conflicts(n: &ExecNode, m: &ExecNode) -> bool {
    overlap(&n.dst, &m.dst)
        || m.srcs.iter().any(|s| overlap(&n.dst, s))
        || n.srcs.iter().any(|s| overlap(s, &m.dst))
}

/// Whether the bytes node `at` writes are dead once source `src` of node `reader` has read
/// them: in node order after `at`, every byte is overwritten by a node's whole contiguous
/// result before any other read of it; bytes still live at the graph's end must be scratch the
/// scheduler says nothing reads later.
fn dead_after(g: &ExecGraph, at: usize, reader: usize, src: usize) -> bool {
    let t = &g.nodes[at].dst;
    let mut live = vec![byte_range(t)];
    for (j, n) in g.nodes.iter().enumerate().skip(at + 1) {
        let reads_live = n.srcs.iter().enumerate().any(|(i, s)| {
            let (s0, s1) = byte_range(s);
            (j, i) != (reader, src)
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
    g.scratch
        .as_ref()
        .is_some_and(|sc| live.iter().all(|&(a, b)| !sc.read_after(t.buffer, a, b)))
}

/// For a `Cpy` of the whole product `o` (a view of it at the same bytes), the copy's axis
/// holding each axis of `o` (`None` for an axis of extent 1); `None` when it is not such a copy.
pub(crate) fn cpy_axes(o: &TensorRef, cpy: &ExecNode) -> Option<Vec<Option<usize>>> {
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
    // Equal element counts: once every axis of `o` longer than 1 is matched, the copy's
    // unmatched axes all have extent 1.
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

/// The element strides of (head, dim) of the product `o` in the tensor the kernel writes:
/// the copy's destination when the copy joins, else `o` itself.
pub(crate) fn out_strides(o: &TensorRef, cpy: Option<&ExecNode>) -> Option<[usize; 2]> {
    match cpy {
        None => Some([o.strides[0], o.strides[2]]),
        Some(c) => {
            let axes = cpy_axes(o, c)?;
            let st = |a: Option<usize>| a.map_or(0, |b| c.dst.strides[b]);
            Some([st(axes[0]), st(axes[2])])
        }
    }
}

/// The chain starting at node `i`, if it is a decode attention that may run fused.
fn attention_at(g: &ExecGraph, i: usize, taken: &[bool]) -> Option<AttnGroup> {
    let nodes = &g.nodes;
    let kq = &nodes[i];
    let [q, k] = kq.srcs.as_slice() else {
        return None;
    };
    if kq.op != Op::MulMat || q.shape.len() != 3 || k.shape.len() != 3 {
        return None;
    }
    let (hq, d, hk, l) = (q.shape[0], q.shape[2], k.shape[0], k.shape[2]);
    let ok = q.shape[1] == 1
        && k.shape[1] == d
        && q.dtype == DType::F32
        && k.dtype.is_float()
        && hk > 0
        && hq % hk == 0
        && (1..=ATTN_MAX_DIM).contains(&d)
        && l > 0
        && kq.dst.dtype == DType::F32
        && kq.dst.shape == [hq, 1, l];
    if !ok {
        return None;
    }
    // The first later node reading a result is the next member.
    let reader = |at: usize| {
        let t = &nodes[at].dst;
        (at + 1..nodes.len()).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, t)))
    };
    let soft_max = reader(i)?;
    let sm = &nodes[soft_max];
    let [scores, mask] = sm.srcs.as_slice() else {
        return None;
    };
    if !matches!(sm.op, Op::SoftMax { .. })
        || *scores != kq.dst
        || mask.dtype != DType::F32
        || mask.shape.len() > 3
        || sm.dst.dtype != DType::F32
        || sm.dst.shape != kq.dst.shape
        || !dead_after(g, i, soft_max, 0)
    {
        return None;
    }
    let pv = reader(soft_max)?;
    let n = &nodes[pv];
    let [p, v] = n.srcs.as_slice() else {
        return None;
    };
    if n.op != Op::MulMat
        || *p != sm.dst
        || v.shape != [hk, l, d]
        || !v.dtype.is_float()
        || n.dst.dtype != DType::F32
        || n.dst.shape != [hq, 1, d]
        || !dead_after(g, soft_max, pv, 0)
    {
        return None;
    }
    let cpy = reader(pv)
        .filter(|&c| cpy_axes(&n.dst, &nodes[c]).is_some() && dead_after(g, pv, c, 0) && !taken[c]);
    let with = |cpy| AttnGroup {
        kq: i,
        soft_max,
        pv,
        cpy,
    };
    cpy.map(|c| with(Some(c)))
        .filter(|grp| safe(g, grp))
        .or_else(|| Some(with(None)).filter(|grp| safe(g, grp)))
}

/// The footprint rules of the module docs for a well-formed chain.
fn safe(g: &ExecGraph, grp: &AttnGroup) -> bool {
    let nodes = &g.nodes;
    let members = grp.members();
    let private = members
        .iter()
        .any(|&m| (0..nodes[m].srcs.len()).any(|i| nodes[m].src_needs_private_copy(i)));
    if private {
        return false;
    }
    let (kq, sm, pv) = (&nodes[grp.kq], &nodes[grp.soft_max], &nodes[grp.pv]);
    let reads = [&kq.srcs[0], &kq.srcs[1], &sm.srcs[1], &pv.srcs[1]];
    let out = &nodes[grp.last()].dst;
    if reads.iter().any(|r| overlap(out, r)) {
        return false;
    }
    // Later members now run at the first one's position.
    members[1..].iter().all(|&m| {
        (grp.kq + 1..m)
            .filter(|n| !members.contains(n))
            .all(|n| !conflicts(&nodes[n], &nodes[m]))
    })
}

/// `RmsNorm -> Mul` by a weight at node `i`, if it may run as one kernel: an f32 norm (so the
/// fused product rounds as the unfused one), its result dead after the `Mul` reads it, the
/// weight broadcasting onto the row, the product overlapping neither the norm's source nor the
/// weight, and no node between them conflicting with the `Mul`.
fn norm_mul_at(g: &ExecGraph, i: usize, taken: &[bool]) -> Option<(usize, usize)> {
    let nodes = &g.nodes;
    let norm = &nodes[i];
    let [x] = norm.srcs.as_slice() else {
        return None;
    };
    if !matches!(norm.op, Op::RmsNorm { .. })
        || norm.dst.dtype != DType::F32
        || !x.dtype.is_float()
        || x.shape != norm.dst.shape
        || x.numel() == 0
    {
        return None;
    }
    let t = &norm.dst;
    let j = (i + 1..nodes.len()).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, t)))?;
    let mul = &nodes[j];
    let [a, w] = mul.srcs.as_slice() else {
        return None;
    };
    let broadcasts = w.shape.len() <= t.shape.len()
        && w.shape
            .iter()
            .rev()
            .zip(t.shape.iter().rev())
            .all(|(&d, &n)| d == n || d == 1);
    let ok = !taken[j]
        && mul.op == Op::Mul
        && a == t
        && w.dtype.is_float()
        && mul.dst.dtype.is_float()
        && mul.dst.shape == t.shape
        && broadcasts
        && !overlap(&mul.dst, x)
        && !overlap(&mul.dst, w)
        && !(0..2).any(|s| mul.src_needs_private_copy(s))
        && !norm.src_needs_private_copy(0)
        && dead_after(g, i, j, 0)
        && (i + 1..j).all(|n| !conflicts(&nodes[n], mul));
    ok.then_some((i, j))
}

/// Whether a shape is one row: every axis but the last of extent 1.
fn one_row(shape: &[usize]) -> bool {
    shape.iter().rev().skip(1).all(|&d| d == 1)
}

/// The nodes that read the result of a fused `RmsNorm -> Mul` (nodes `norm`, `mul`) as the x
/// of a one-row product, if each may read the norm's source and the `Mul`'s weight instead
/// (the norm folded into the product, `mul_mat_vec_x_norm.wgsl`): an f32 source of the
/// result's shape, one row; every read of the result until it is dead is the x of a one-row
/// `MulMat` (none of whose other sources or result overlaps it, the source or the weight); no
/// node from the norm to the last of them writes the source, the weight or any byte of the
/// result; the result is dead after them (overwritten whole, or scratch nothing reads after
/// the graph). Then the norm need not run at all, and where a product's kernel takes no such
/// fold, running the fused norm just before that product gives what it gave at its own place.
pub(crate) fn norm_readers(g: &ExecGraph, norm: usize, mul: usize) -> Option<Vec<usize>> {
    let nodes = &g.nodes;
    let x = nodes[norm].srcs.first()?;
    let w = nodes[mul].srcs.get(1)?;
    let t = &nodes[mul].dst;
    if x.dtype != DType::F32 || t.dtype != DType::F32 || x.shape != t.shape || !one_row(&t.shape) {
        return None;
    }
    // Between the norm and the `Mul` only the source and weight matter (the `Mul` runs at the
    // norm's place, so nothing there reads its result).
    let mut frozen =
        (norm + 1..mul).all(|j| !overlap(&nodes[j].dst, x) && !overlap(&nodes[j].dst, w));
    let mut readers = Vec::new();
    let mut t_dead = false;
    for (j, n) in nodes.iter().enumerate().skip(mul + 1) {
        if n.srcs.iter().any(|s| overlap(s, t)) {
            let product = n.op == Op::MulMat
                && n.srcs.len() == 2
                && n.srcs[0] == *t
                && !overlap(&n.srcs[1], t)
                && n.dst.dtype == DType::F32
                && one_row(&n.dst.shape)
                && ![x, w, t].iter().any(|s| overlap(&n.dst, s))
                && !n.src_needs_private_copy(0)
                && !n.src_needs_private_copy(1);
            if !product || !frozen {
                return None;
            }
            readers.push(j);
        }
        if overlap(&n.dst, t) {
            // A whole overwrite ends the result's life; anything less writes into it.
            let ((w0, w1), (t0, t1)) = (byte_range(&n.dst), byte_range(t));
            if n.op == Op::SetRows || !n.dst.is_contiguous() || w0 > t0 || w1 < t1 {
                return None;
            }
            t_dead = true;
            break;
        }
        if overlap(&n.dst, x) || overlap(&n.dst, w) {
            frozen = false;
        }
    }
    if readers.is_empty() {
        return None;
    }
    if !t_dead {
        let (a, b) = byte_range(t);
        let unread = g
            .scratch
            .as_ref()
            .is_some_and(|sc| !sc.read_after(t.buffer, a, b));
        if !unread {
            return None;
        }
    }
    Some(readers)
}

/// `MulMat -> Add` (the residual add) or `MulMat -> SwiGlu` at node `i`, if the element-wise op
/// may run in the product's store: an f32 product read whole by the op (its first reader) and
/// dead after it, the op's other operand f32 with the op's own shape and strides (so element i
/// of it pairs with element i of the result), an f32 result, which overlaps neither of the
/// product's sources and either is the other operand exactly (an in-place add) or overlaps it
/// not at all, and no node between them conflicting with the op (which now runs at the
/// product's position).
fn epilogue_at(g: &ExecGraph, i: usize, taken: &[bool]) -> Option<(usize, usize, Epilogue)> {
    let nodes = &g.nodes;
    let mm = &nodes[i];
    if mm.op != Op::MulMat || mm.dst.dtype != DType::F32 || mm.dst.numel() == 0 {
        return None;
    }
    let t = &mm.dst;
    let j = (i + 1..nodes.len()).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, t)))?;
    let op = &nodes[j];
    let [s0, s1] = op.srcs.as_slice() else {
        return None;
    };
    let (slot, e) = if s0 == t { (0, s1) } else { (1, s0) };
    let epi = match (&op.op, slot) {
        (Op::Add, _) => Epilogue::Add,
        (Op::SwiGlu, 0) => Epilogue::GluGate,
        (Op::SwiGlu, _) => Epilogue::GluUp,
        _ => return None,
    };
    let d = &op.dst;
    let ok = !taken[j]
        && op.srcs[slot] == *t
        && !overlap(e, t)
        && e.dtype == DType::F32
        && d.dtype == DType::F32
        && d.shape == t.shape
        && e.shape == d.shape
        && e.strides == d.strides
        && (e == d || !overlap(e, d))
        && !mm.srcs.iter().any(|s| overlap(d, s))
        && !(0..mm.srcs.len()).any(|s| mm.src_needs_private_copy(s))
        && !(0..2).any(|s| op.src_needs_private_copy(s))
        && dead_after(g, i, j, slot)
        && (i + 1..j).all(|n| !conflicts(&nodes[n], op));
    ok.then_some((i, j, epi))
}

/// Two one-row products of the same x at node `i` and a later node, and the `SwiGlu` that
/// consumes both, if they may run as one kernel: the `SwiGlu` is the first reader of node `i`'s
/// result and takes it and the other product's result (in either order) whole; the products
/// multiply the same x by weights of one dtype, shape and strides into f32 results of one
/// shape, each dead after the `SwiGlu`; the `SwiGlu`'s f32 result has that shape and overlaps
/// none of the products' sources; no member needs a private copy; and no node between them
/// conflicts with the second product or the `SwiGlu`, which now run at node `i`. Returns the
/// group, with the pair the second product and the `SwiGlu` would make on their own when the
/// kernel planner refuses the three.
fn glu_pair_at(g: &ExecGraph, i: usize, taken: &[bool]) -> Option<Group> {
    let nodes = &g.nodes;
    let first = &nodes[i];
    let one_row_product = |n: &ExecNode| {
        n.op == Op::MulMat
            && n.srcs.len() == 2
            && n.dst.dtype == DType::F32
            && n.dst.numel() > 0
            && one_row(&n.dst.shape)
    };
    if !one_row_product(first) {
        return None;
    }
    let t = &first.dst;
    let j = (i + 1..nodes.len()).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, t)))?;
    let glu = &nodes[j];
    let [s0, s1] = glu.srcs.as_slice() else {
        return None;
    };
    if taken[j] || glu.op != Op::SwiGlu || (s0 != t && s1 != t) || s0 == s1 {
        return None;
    }
    let (slot, other) = if s0 == t { (0, s1) } else { (1, s0) };
    // The other product: the last node before the `SwiGlu` writing its other source.
    let k = (i + 1..j).rev().find(|&k| overlap(&nodes[k].dst, other))?;
    let second = &nodes[k];
    let (x, w) = (&first.srcs[0], &first.srcs[1]);
    let ok = !taken[k]
        && one_row_product(second)
        && second.dst == *other
        && second.srcs[0] == *x
        && second.srcs[1].dtype == w.dtype
        && second.srcs[1].shape == w.shape
        && second.srcs[1].strides == w.strides
        && other.shape == t.shape
        && !overlap(other, t)
        && glu.dst.dtype == DType::F32
        && glu.dst.shape == t.shape
        && !first
            .srcs
            .iter()
            .chain(&second.srcs)
            .any(|s| overlap(&glu.dst, s))
        && ![first, second]
            .iter()
            .any(|n| (0..2).any(|s| n.src_needs_private_copy(s)))
        && !(0..2).any(|s| glu.src_needs_private_copy(s))
        && dead_after(g, i, j, slot)
        && dead_after(g, k, j, 1 - slot)
        && (i + 1..k).all(|n| !conflicts(&nodes[n], second))
        && (i + 1..j)
            .filter(|&n| n != k)
            .all(|n| !conflicts(&nodes[n], glu));
    if !ok {
        return None;
    }
    let (gate, up) = if slot == 0 { (i, k) } else { (k, i) };
    Some(Group::GluPair {
        gate,
        up,
        glu: j,
        alone: epilogue_at(g, k, taken)
            .filter(|&(_, op, _)| op == j)
            .map(|(_, _, epi)| epi),
    })
}

/// `Rope -> SetRows` at node `i`, if one token's rotated row may go straight into its cache row:
/// an f32 rope of x [1, H, D] into a contiguous result that the `SetRows` (its first reader)
/// takes whole as its source [1, H * D] and that is dead after it, the cache overlapping none of
/// rope's sources nor the indices, and no node between them conflicting with the `SetRows`.
fn rope_rows_at(g: &ExecGraph, i: usize, taken: &[bool]) -> Option<(usize, usize)> {
    let nodes = &g.nodes;
    let rope = &nodes[i];
    let t = &rope.dst;
    let ([x, pos], [1, h, d]) = (rope.srcs.as_slice(), t.shape.as_slice()) else {
        return None;
    };
    if !matches!(rope.op, Op::Rope { .. })
        || t.dtype != DType::F32
        || x.dtype != DType::F32
        || !t.is_contiguous()
        || h * d == 0
    {
        return None;
    }
    let j = (i + 1..nodes.len()).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, t)))?;
    let w = &nodes[j];
    let [cache_in, src, ids] = w.srcs.as_slice() else {
        return None;
    };
    let cache = &w.dst;
    let ok = !taken[j]
        && w.op == Op::SetRows
        && src.buffer == t.buffer
        && src.byte_offset == t.byte_offset
        && src.dtype == DType::F32
        && src.is_contiguous()
        && src.shape == [1, h * d]
        && !overlap(cache_in, t)
        && !overlap(ids, t)
        && ids.shape == [1]
        && cache.shape.len() == 2
        && cache.shape[1] == h * d
        && ![x, pos, ids].iter().any(|s| overlap(cache, s))
        && !(0..2).any(|s| rope.src_needs_private_copy(s))
        && !(0..3).any(|s| w.src_needs_private_copy(s))
        && dead_after(g, i, j, 1)
        && (i + 1..j).all(|n| !conflicts(&nodes[n], w));
    ok.then_some((i, j))
}

/// `MulMat -> SetRows` at node `i`, if one token's product may be stored straight into its
/// cache row: an f32 product [1, n], contiguous, that the `SetRows` (its first reader) takes
/// whole as its source and that is dead after it, the cache overlapping neither of the
/// product's sources nor the indices, and no node between them conflicting with the `SetRows`.
fn product_rows_at(g: &ExecGraph, i: usize, taken: &[bool]) -> Option<(usize, usize)> {
    let nodes = &g.nodes;
    let mm = &nodes[i];
    let t = &mm.dst;
    if mm.op != Op::MulMat
        || t.dtype != DType::F32
        || !t.is_contiguous()
        || t.shape.len() != 2
        || t.shape[0] != 1
        || t.numel() == 0
    {
        return None;
    }
    let j = (i + 1..nodes.len()).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, t)))?;
    let w = &nodes[j];
    let [cache_in, src, ids] = w.srcs.as_slice() else {
        return None;
    };
    let cache = &w.dst;
    let ok = !taken[j]
        && w.op == Op::SetRows
        && src == t
        && !overlap(cache_in, t)
        && !overlap(ids, t)
        && ids.shape == [1]
        && cache.shape.len() == 2
        && cache.shape[1] == t.shape[1]
        && !mm.srcs.iter().chain([ids]).any(|s| overlap(cache, s))
        && !(0..mm.srcs.len()).any(|s| mm.src_needs_private_copy(s))
        && !(0..3).any(|s| w.src_needs_private_copy(s))
        && dead_after(g, i, j, 1)
        && (i + 1..j).all(|n| !conflicts(&nodes[n], w));
    ok.then_some((i, j))
}

/// A chain of nodes run as one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Group {
    Attn(AttnGroup),
    /// `RmsNorm` then the `Mul` by its weight.
    NormMul {
        norm: usize,
        mul: usize,
    },
    /// One token's `Rope` written straight into its KV-cache row by the `SetRows` after it.
    RopeRows {
        rope: usize,
        set_rows: usize,
    },
    /// One token's product stored straight into its KV-cache row by the `SetRows` after it.
    ProductRows {
        mm: usize,
        set_rows: usize,
    },
    /// A product and the element-wise op that consumes it, run in the product's store.
    Epilogue {
        mm: usize,
        op: usize,
        epi: Epilogue,
    },
    /// Two products of one x and the `SwiGlu` of their results, run as one kernel; `alone`:
    /// the epilogue the later product and the `SwiGlu` may run as when no kernel takes all
    /// three (the earlier product then runs by itself).
    GluPair {
        gate: usize,
        up: usize,
        glu: usize,
        alone: Option<Epilogue>,
    },
}

impl Group {
    /// The first member: where the fused kernel runs.
    pub(crate) fn first(&self) -> usize {
        match self {
            Group::Attn(a) => a.kq,
            Group::NormMul { norm, .. } => *norm,
            Group::Epilogue { mm, .. } => *mm,
            Group::RopeRows { rope, .. } => *rope,
            Group::ProductRows { mm, .. } => *mm,
            Group::GluPair { gate, up, .. } => *gate.min(up),
        }
    }

    pub(crate) fn members(&self) -> Vec<usize> {
        match self {
            Group::Attn(a) => a.members(),
            Group::NormMul { norm, mul } => vec![*norm, *mul],
            Group::Epilogue { mm, op, .. } => vec![*mm, *op],
            Group::RopeRows { rope, set_rows } => vec![*rope, *set_rows],
            Group::ProductRows { mm, set_rows } => vec![*mm, *set_rows],
            Group::GluPair { gate, up, glu, .. } => {
                vec![*gate.min(up), *gate.max(up), *glu]
            }
        }
    }
}

/// Every chain of `g` that may run as one kernel, by first member, no node in two chains.
pub(crate) fn groups(g: &ExecGraph) -> Vec<Group> {
    let mut taken = vec![false; g.nodes.len()];
    let mut out = Vec::new();
    for i in 0..g.nodes.len() {
        if taken[i] {
            continue;
        }
        let grp = attention_at(g, i, &taken)
            .map(Group::Attn)
            .or_else(|| norm_mul_at(g, i, &taken).map(|(norm, mul)| Group::NormMul { norm, mul }))
            .or_else(|| glu_pair_at(g, i, &taken))
            .or_else(|| {
                epilogue_at(g, i, &taken).map(|(mm, op, epi)| Group::Epilogue { mm, op, epi })
            })
            .or_else(|| {
                rope_rows_at(g, i, &taken)
                    .map(|(rope, set_rows)| Group::RopeRows { rope, set_rows })
            })
            .or_else(|| {
                product_rows_at(g, i, &taken)
                    .map(|(mm, set_rows)| Group::ProductRows { mm, set_rows })
            });
        if let Some(grp) = grp {
            let members = grp.members();
            if members.iter().any(|&m| taken[m]) {
                continue;
            }
            for m in members {
                taken[m] = true;
            }
            out.push(grp);
        }
    }
    out
}
