//! Analysis of a graph for a set of backends: placement, splits, and each backend's scratch
//! items with their planned offsets. Shared by `reserve` (which only needs the sizes) and
//! `compile` (which resolves every tensor to memory).

use std::collections::HashMap;
use std::sync::Arc;

use lowsync_backend::Backend;
use lowsync_graph::{Graph, Op};

use crate::alloc::{align, plan_items, Item, ItemPlan};
use crate::error::{Error, Result};
use crate::placement::{place, Placement};
use crate::split::{split_graph, SplitDef};

/// What a scratch item holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ItemKey {
    /// The result of a node (a root that owns memory).
    Node(usize),
    /// Copy `copy` of foreign root `root` received by split `split`.
    Copy {
        split: usize,
        root: usize,
        copy: usize,
    },
}

/// One backend's scratch memory plan.
#[derive(Clone, Debug, Default)]
pub struct BackendItems {
    pub items: Vec<Item>,
    pub keys: Vec<ItemKey>,
    pub plan: ItemPlan,
    pub index: HashMap<ItemKey, usize>,
}

impl BackendItems {
    /// Planned offset of `key`.
    pub fn offset(&self, key: ItemKey) -> Option<usize> {
        self.index.get(&key).map(|&i| self.plan.offsets[i])
    }
}

/// Everything `compile` needs to know about a graph before touching memory.
#[derive(Clone, Debug)]
pub struct Analysis {
    pub placement: Placement,
    pub splits: Vec<SplitDef>,
    /// Bytes of each root's storage (aligned), as planned (possibly raised to a reserved size).
    pub sizes: Vec<usize>,
    /// Bytes of each root's storage without alignment (what copies move).
    pub extent_bytes: Vec<usize>,
    /// Compute roots that are graph outputs (they live in the plan's own output buffers).
    pub output_roots: Vec<bool>,
    pub per_backend: Vec<BackendItems>,
}

/// The most bytes one allocation (a tensor, a backend's scratch, a plan's outputs or input
/// arena) may take; Rust's own allocation limit.
pub(crate) const MAX_BYTES: usize = isize::MAX as usize;

/// Analyses `graph`. `size_floor`, when given, raises each root's planned size to at least the
/// reserved worst case, so the offsets equal the reserve's.
pub fn analyze(
    graph: &Graph,
    backends: &[Arc<dyn Backend>],
    host: Option<usize>,
    n_copies: usize,
    size_floor: Option<&[usize]>,
) -> Result<Analysis> {
    let ts = graph.tensors();
    let n = ts.len();
    let placement = place(graph, backends, host)?;
    let splits = split_graph(graph, &placement);

    let extent_bytes: Vec<usize> = ts
        .iter()
        .map(|t| {
            t.layout
                .checked_extent()
                .and_then(|e| t.dtype.checked_bytes(e))
                .filter(|&b| b <= MAX_BYTES)
                .ok_or_else(|| {
                    Error::TooLarge(format!(
                        "tensor `{}` of shape {:?} ({}) is too large to address",
                        t.name.as_deref().unwrap_or(t.op.name()),
                        t.layout.shape,
                        t.dtype
                    ))
                })
        })
        .collect::<Result<_>>()?;
    let sizes: Vec<usize> = (0..n)
        .map(|i| {
            let own = if ts[i].root.index() == i {
                align(extent_bytes[i])
            } else {
                0
            };
            own.max(size_floor.and_then(|f| f.get(i).copied()).unwrap_or(0))
        })
        .collect();
    let mut output_roots = vec![false; n];
    for (_, o) in graph.outputs() {
        let r = ts[o.index()].root.index();
        if !ts[r].op.is_leaf() {
            output_roots[r] = true;
        }
    }

    // Last step at which each root is read on its own backend (a foreign reader's copy is
    // made when its split starts), and the last reader of each foreign root per split.
    let mut split_of = vec![usize::MAX; n];
    for (s, sp) in splits.iter().enumerate() {
        for &j in &sp.nodes {
            split_of[j] = s;
        }
    }
    let mut last_local: Vec<usize> = (0..n).collect();
    let mut last_in_split: HashMap<(usize, usize), usize> = HashMap::new();
    for (j, t) in ts.iter().enumerate() {
        if split_of[j] == usize::MAX {
            continue;
        }
        for src in &t.srcs {
            let r = ts[src.index()].root.index();
            if placement[r] == placement[j] || ts[r].op == Op::Input {
                last_local[r] = last_local[r].max(j);
            } else {
                let first = splits[split_of[j]].first();
                last_local[r] = last_local[r].max(first);
                let e = last_in_split.entry((split_of[j], r)).or_insert(j);
                *e = (*e).max(j);
            }
        }
    }

    let mut per_backend: Vec<BackendItems> = vec![BackendItems::default(); backends.len()];
    for (s, sp) in splits.iter().enumerate() {
        let bi = &mut per_backend[sp.backend];
        for &r in &sp.foreign {
            for copy in 0..n_copies {
                bi.index.insert(
                    ItemKey::Copy {
                        split: s,
                        root: r,
                        copy,
                    },
                    bi.items.len(),
                );
                bi.keys.push(ItemKey::Copy {
                    split: s,
                    root: r,
                    copy,
                });
                bi.items.push(Item {
                    size: sizes[r],
                    def: sp.first(),
                    last: last_in_split[&(s, r)],
                    // Pipelined copies are read by a split that may still run while the next
                    // evaluation writes the other copies: never reuse them.
                    pinned: n_copies > 1,
                    inplace_of: None,
                });
            }
        }
        for &j in &sp.nodes {
            if ts[j].root.index() != j || output_roots[j] {
                continue;
            }
            let inplace_of = inplace_source(graph, j, &last_local, &output_roots)
                .and_then(|r| bi.index.get(&ItemKey::Node(r)).copied());
            bi.index.insert(ItemKey::Node(j), bi.items.len());
            bi.keys.push(ItemKey::Node(j));
            bi.items.push(Item {
                size: sizes[j],
                def: j,
                last: last_local[j],
                pinned: false,
                inplace_of,
            });
        }
    }
    for (b, bi) in per_backend.iter_mut().enumerate() {
        // The plan never exceeds the sum of its items, so bounding the sum keeps every offset
        // the free list computes in range.
        let total = bi
            .items
            .iter()
            .try_fold(0usize, |acc, it| acc.checked_add(it.size))
            .filter(|&t| t <= MAX_BYTES);
        if total.is_none() {
            return Err(Error::TooLarge(format!(
                "the scratch memory of this graph on backend `{}` exceeds {MAX_BYTES} bytes",
                backends[b].name()
            )));
        }
        bi.plan = plan_items(&bi.items);
    }
    Ok(Analysis {
        placement,
        splits,
        sizes,
        extent_bytes,
        output_roots,
        per_backend,
    })
}

/// The source node `j` may overwrite: an element-wise op's first source that is a node root
/// on the same backend, dies at `j`, is not an output, and has the node's dtype and layout.
fn inplace_source(
    graph: &Graph,
    j: usize,
    last_local: &[usize],
    output_roots: &[bool],
) -> Option<usize> {
    let t = &graph.tensors()[j];
    if !t.op.can_inplace() {
        return None;
    }
    let src = t.srcs.first()?.index();
    let s = &graph.tensors()[src];
    let ok = s.root.index() == src
        && !s.op.is_leaf()
        && !output_roots[src]
        && last_local[src] == j
        && s.dtype == t.dtype
        && s.layout == t.layout
        // No other source of this node may alias the memory being overwritten.
        && t.srcs[1..].iter().all(|o| graph.tensor(*o).root.index() != src);
    ok.then_some(src)
}
