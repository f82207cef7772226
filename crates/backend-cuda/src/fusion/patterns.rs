//! The patterns: node chains of a decode graph that one fused kernel computes.
//!
//! Why: each fused kernel computes an exact chain under exact preconditions (dtypes, ranks,
//! contiguity, sizes the kernel's shared memory and 32-bit offsets hold); the matchers here
//! check them all, so a node that misses one simply runs unfused.
//!
//! Strategy: one matcher per family, tried at a node not yet taken (`plan`): it looks for the
//! other members among the untaken nodes of the window after it, builds the [`Kind`] and keeps
//! it only if its footprint is safe (`safety::fits`). Where a larger group is refused, a
//! smaller one is tried (a product without its Add, a rope without the plain V row, attention
//! without its copy).
//!
//! Invariant: a returned group is well formed and proven safe; matchers never look at device
//! state, so `describe` and the launches agree.

use lowsync_backend::{ExecNode, TensorRef};
use lowsync_graph::{DType, Op, RopeMode};

use crate::exec::matmul;
use crate::fusion::group::{
    add_other, cpy_axes, has_tails, later, Group, Kind, Nodes, NormPro, Seg, MAX_SEGS,
};
use crate::fusion::safety::{dead_after, fits, is_safe, overlap};
use crate::layout::{broadcast_strides, lay};

/// Rows (tokens) up to which a fused Rope/SetRows runs: a SetRows row checks every later index
/// for a duplicate, so its cost grows with the square of the rows.
const MAX_ROWS: usize = 8;

/// The largest head dimension of the fused attention (`ATT_MAXD` in attention.cu).
const ATT_MAX_D: usize = 256;

/// The largest head dimension of the fused prefill attention (`AP_MAXD` in attention.cu).
pub(super) const PREFILL_MAX_D: usize = 128;

/// Query rows per block of the fused prefill attention (`AP_Q` in attention.cu).
pub(super) const PREFILL_ROWS: usize = 16;

pub(super) fn norm_mul(nodes: &Nodes<'_>, i: usize, used: &[bool]) -> Option<Group> {
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
/// `quant`: b may also be a quantized weight (see [`fused_dims`] for the fused products).
fn gemv_dims(
    node: &ExecNode,
    mmv_max_m: Option<usize>,
    quant: bool,
) -> Option<(usize, usize, usize)> {
    let [a, b] = node.srcs.as_slice() else {
        return None;
    };
    if node.op != Op::MulMat || a.shape.len() != 2 || b.shape.len() != 2 {
        return None;
    }
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    let ok = a.dtype == DType::F32
        && (b.dtype.is_float() || (quant && b.dtype.is_quantized()))
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

/// `gemv_dims` of a product the fused matrix-vector kernels take: a plain-dtype weight, or a
/// quantized one for decode's `fused_gemv1_q` — one row of a, staged in shared memory, k a
/// whole number of blocks and every row of w a block start.
fn fused_dims(node: &ExecNode, mmv_max_m: Option<usize>) -> Option<(usize, usize, usize)> {
    let (m, k, n) = gemv_dims(node, mmv_max_m, true)?;
    let b = &node.srcs[1];
    let bs = b.dtype.block_size();
    let ok = !b.dtype.is_quantized()
        || (m == 1
            && k.is_multiple_of(bs)
            && (n == 1 || b.strides[1].is_multiple_of(bs))
            && k * 4 <= matmul::GEMV1_MAX_SHARED);
    ok.then_some((m, k, n))
}

/// Whether weights of dtypes `a` and `b` share one fused launch: the same plain dtype, or both
/// quantized (`fused_gemv1_q` decodes each segment's own block type).
fn same_weights(a: DType, b: DType) -> bool {
    a == b || (a.is_quantized() && b.is_quantized())
}

/// The epilogue Add of product `mm`: the first later node reading its result, if that is an
/// Add the epilogue computes.
fn epilogue_add(nodes: &[ExecNode], mm: usize, used: &[bool]) -> Option<usize> {
    let out = &nodes[mm].dst;
    let j = later(nodes, mm, used).find(|&j| nodes[j].srcs.iter().any(|s| overlap(s, out)))?;
    add_other(&nodes[j], out).map(|_| j)
}

pub(super) fn gemv(
    nodes: &Nodes<'_>,
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
) -> Option<Group> {
    gemv_kind(nodes, i, used, mmv_max_m, None).map(Group::new)
}

/// Decode's output head: a lone one-row product (no group of its own) whose result is read by
/// the `Argmax` after it (`Kind::HeadArgmax`). The argmax's row is the product's whole result
/// ([1, n], n below 2^31) and its result one i32.
pub(super) fn head_argmax(
    nodes: &Nodes<'_>,
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
) -> Option<Group> {
    let j = argmax_of(nodes, i, used, mmv_max_m)?;
    fits(
        nodes,
        Kind::HeadArgmax {
            mm: i,
            argmax: j,
            norm: None,
        },
    )
}

/// The `Argmax` that `head_argmax` would take with product `i`: the first later node reading
/// the product's result.
pub(super) fn argmax_of(
    nodes: &[ExecNode],
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
) -> Option<usize> {
    let (m, _, n) = gemv_dims(&nodes[i], mmv_max_m, true)?;
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
    fused_dims(&nodes[i], mmv_max_m)?;
    let act = &nodes[i].srcs[0];
    let wdt = nodes[i].srcs[1].dtype;
    let cands: Vec<usize> = std::iter::once(i)
        .chain(later(nodes, i, used).filter(|&j| {
            nodes[j].srcs.first() == Some(act)
                && nodes[j]
                    .srcs
                    .get(1)
                    .is_some_and(|b| same_weights(b.dtype, wdt))
                && fused_dims(&nodes[j], mmv_max_m).is_some()
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
            if is_safe(nodes, &kind) {
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
        if is_safe(nodes, &kind) {
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
/// stages the row in shared memory, so it fits there). `head_fold` (`CudaConfig::q_head` and
/// `q_head_fold`): decode's head on a quantized weight takes the norm too, with its argmax.
pub(super) fn norm_gemv(
    nodes: &Nodes<'_>,
    i: usize,
    used: &[bool],
    mmv_max_m: Option<usize>,
    head_fold: bool,
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
        // head on the one-row kernel; a quantized one under `head_fold` takes both.
        let lone = segs.len() == 1 && segs[0].add.is_none() && !has_tails(segs);
        if let Some(argmax) = lone
            .then(|| argmax_of(nodes, first, &taken, mmv_max_m))
            .flatten()
        {
            if !(head_fold && nodes[first].srcs[1].dtype.is_quantized()) {
                return None;
            }
            let norm = Some(pro);
            return fits(
                nodes,
                Kind::HeadArgmax {
                    mm: first,
                    argmax,
                    norm,
                },
            );
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

pub(super) fn rope_rows(nodes: &Nodes<'_>, i: usize, used: &[bool]) -> Option<Group> {
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

/// `MulMat(q, K) -> SoftMax -> MulMat(p, V) [-> Cpy of a permutation]`: decode's (one query
/// row per head, `Kind::Attention`) or, with `prefill` (`CudaConfig::attn_prefill`), several
/// rows per head (`Kind::Prefill`) where the scores and p are dead and head_dim is a multiple
/// of 4 up to [`PREFILL_MAX_D`].
pub(super) fn attention(
    nodes: &Nodes<'_>,
    i: usize,
    used: &[bool],
    prefill: bool,
) -> Option<Group> {
    let kq = &nodes[i];
    let [q, k] = kq.srcs.as_slice() else {
        return None;
    };
    if q.shape.len() != 3 || k.shape.len() != 3 {
        return None;
    }
    let (hq, nq, d, l, hk) = (q.shape[0], q.shape[1], q.shape[2], k.shape[2], k.shape[0]);
    let rows = nq > 1;
    let max_d = if rows { PREFILL_MAX_D } else { ATT_MAX_D };
    let ok = (nq == 1 || (prefill && nq > 1))
        && k.shape[1] == d
        && q.dtype.is_float()
        && k.dtype.is_float()
        && k.strides[1] == 1
        && hq > 0
        && hk > 0
        && hq % hk == 0
        && (1..=max_d).contains(&d)
        && (!rows || d.is_multiple_of(4))
        && l > 0
        && kq.dst.dtype == DType::F32
        && kq.dst.shape == [hq, nq, l];
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
            && n.dst.shape == [hq, nq, d]
    })?;
    let cpy = later(nodes, pv, used).find(|&j| cpy_axes(&nodes[pv].dst, &nodes[j]).is_some());
    let scores = !dead_after(nodes, i, soft_max);
    if rows {
        // The kernel keeps the scores and p on chip: both must be dead.
        let tiles = nq.div_ceil(PREFILL_ROWS);
        if scores
            || !dead_after(nodes, soft_max, pv)
            || hq.saturating_mul(tiles) > i32::MAX as usize
        {
            return None;
        }
        let with = |cpy: Option<usize>| Kind::Prefill {
            kq: i,
            soft_max,
            pv,
            cpy,
            out: cpy.is_none_or(|c| !dead_after(nodes, pv, c)),
        };
        return cpy
            .and_then(|c| fits(nodes, with(Some(c))))
            .or_else(|| fits(nodes, with(None)));
    }
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
