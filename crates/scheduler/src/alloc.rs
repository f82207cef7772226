//! Graph allocator: where every tensor of a graph lives.
//!
//! Why: a decode step runs a few hundred nodes; giving each its own memory wastes most of it
//! and makes the worst case unknowable. ggml's answer, kept here: plan offsets once per graph
//! shape with liveness-based reuse, and never touch memory that outlives a step.
//!
//! Strategy: four regions. Weights and persistent tensors (state such as the KV cache) are
//! packed once and never reused. Inputs are packed contiguously in one input arena, so a step
//! can write them all with a single copy (the staged policy). Compute tensors get offsets from a
//! best-fit free list in creation (topological) order: a tensor is freed after the last node
//! that reads it, or anything viewing it; an element-wise op writes over its first source when
//! that source dies at this node and has the same size and layout (in-place). Outputs are never
//! freed.
//!
//! Invariants: two compute tensors whose lifetimes overlap never overlap in memory (checked by
//! [`AllocPlan::verify`], and by the property tests); persistent tensors are never reused.

use lowsync_graph::{Graph, Op, TensorId};

/// Alignment of every tensor inside its region.
pub const TENSOR_ALIGN: usize = 64;

fn align(n: usize) -> usize {
    n.div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN
}

/// The memory a tensor's storage lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Region {
    Weights,
    Persistent,
    Inputs,
    Compute,
}

/// Offsets of every storage-owning tensor and the size of each region.
#[derive(Clone, Debug, Default)]
pub struct AllocPlan {
    /// Per tensor id: where its *root* storage lives (views and aliases resolve to their root).
    pub slots: Vec<Option<(Region, usize)>>,
    pub weights_bytes: usize,
    pub persistent_bytes: usize,
    pub inputs_bytes: usize,
    pub compute_bytes: usize,
    /// Per tensor id: index of the node that defines it and of the last node that reads its
    /// storage (for verification).
    lifetimes: Vec<(usize, usize)>,
    inplace_of: Vec<Option<TensorId>>,
}

#[derive(Default)]
struct FreeList {
    /// Free blocks (offset, size), sorted by offset, never adjacent.
    free: Vec<(usize, usize)>,
    high_water: usize,
}

impl FreeList {
    fn alloc(&mut self, size: usize) -> usize {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.1 >= size)
            .min_by_key(|(_, b)| b.1)
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let (off, sz) = self.free[i];
                if sz == size {
                    self.free.remove(i);
                } else {
                    self.free[i] = (off + size, sz - size);
                }
                off
            }
            None => {
                // Grow, absorbing a free block that ends at the high-water mark.
                if let Some(&(off, sz)) = self.free.last() {
                    if off + sz == self.high_water {
                        self.free.pop();
                        self.high_water = off + size;
                        return off;
                    }
                }
                let off = self.high_water;
                self.high_water += size;
                off
            }
        }
    }

    fn release(&mut self, off: usize, size: usize) {
        let i = self.free.partition_point(|b| b.0 < off);
        self.free.insert(i, (off, size));
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// Bytes the storage of root `id` needs: the furthest element any of its views reaches is
/// inside the root's own contiguous extent, so the root's size suffices.
fn root_bytes(g: &Graph, id: TensorId) -> usize {
    let t = g.tensor(id);
    align(t.layout.extent() * t.dtype.size_bytes())
}

impl AllocPlan {
    /// Plans the memory of `graph`.
    pub fn plan(graph: &Graph) -> AllocPlan {
        let tensors = graph.tensors();
        let n = tensors.len();
        // Last reader of each root, through views and aliases.
        let mut last_use: Vec<usize> = (0..n).collect();
        for (i, t) in tensors.iter().enumerate() {
            for s in &t.srcs {
                let r = tensors[s.index()].root.index();
                last_use[r] = last_use[r].max(i);
            }
            let r = t.root.index();
            last_use[r] = last_use[r].max(i);
        }
        let mut pinned = vec![false; n];
        for (_, o) in graph.outputs() {
            pinned[tensors[o.index()].root.index()] = true;
        }
        // Roots freed after node i.
        let mut dies_at: Vec<Vec<usize>> = vec![Vec::new(); n];
        for r in 0..n {
            if tensors[r].root.index() == r && !pinned[r] && !tensors[r].op.is_leaf() {
                dies_at[last_use[r]].push(r);
            }
        }

        let mut plan = AllocPlan {
            slots: vec![None; n],
            lifetimes: (0..n).map(|i| (i, last_use[i])).collect(),
            inplace_of: vec![None; n],
            ..Default::default()
        };
        let mut compute = FreeList::default();
        let mut freed = vec![false; n];
        for (i, t) in tensors.iter().enumerate() {
            let id = TensorId(i as u32);
            if t.root != id {
                continue; // a view or alias: lives in its root
            }
            let size = root_bytes(graph, id);
            let slot = match t.op {
                Op::Weight => {
                    let off = plan.weights_bytes;
                    plan.weights_bytes += size;
                    (Region::Weights, off)
                }
                Op::Persistent => {
                    let off = plan.persistent_bytes;
                    plan.persistent_bytes += size;
                    (Region::Persistent, off)
                }
                Op::Input => {
                    let off = plan.inputs_bytes;
                    plan.inputs_bytes += size;
                    (Region::Inputs, off)
                }
                _ => match inplace_source(graph, i, &last_use, &pinned, &plan) {
                    Some(src) => {
                        // Take over the dying source's block; it is not released on its own.
                        freed[src.index()] = true;
                        plan.inplace_of[i] = Some(src);
                        plan.slots[src.index()].expect("source planned")
                    }
                    None => (Region::Compute, compute.alloc(size)),
                },
            };
            plan.slots[i] = Some(slot);
            for &r in &dies_at[i] {
                if !freed[r] {
                    if let Some((Region::Compute, off)) = plan.slots[r] {
                        compute.release(off, root_bytes(graph, TensorId(r as u32)));
                    }
                    freed[r] = true;
                }
            }
            // An in-place node inherits the block; it is freed when the node dies.
        }
        plan.compute_bytes = compute.high_water;
        plan
    }

    /// Checks that no two compute tensors with overlapping lifetimes share bytes, except a node
    /// and the source it was computed in place of.
    pub fn verify(&self, graph: &Graph) -> std::result::Result<(), String> {
        let mut live: Vec<(usize, usize, usize, usize, usize)> = Vec::new(); // (def, end, off, size, id)
        for (i, t) in graph.tensors().iter().enumerate() {
            if t.root.index() != i {
                continue;
            }
            if let Some((Region::Compute, off)) = self.slots[i] {
                let (def, end) = self.lifetimes[i];
                live.push((def, end, off, root_bytes(graph, TensorId(i as u32)), i));
            }
        }
        let chained = |a: usize, b: usize| {
            let follows = |x: usize, y: usize| {
                let mut cur = self.inplace_of[x];
                while let Some(c) = cur {
                    if c.index() == y {
                        return true;
                    }
                    cur = self.inplace_of[c.index()];
                }
                false
            };
            follows(a, b) || follows(b, a)
        };
        for (k, a) in live.iter().enumerate() {
            for b in &live[k + 1..] {
                let time = a.0 <= b.1 && b.0 <= a.1;
                let space = a.2 < b.2 + b.3 && b.2 < a.2 + a.3;
                if time && space && !chained(a.4, b.4) {
                    return Err(format!(
                        "tensors {} and {} are live together and overlap: [{}, +{}) and [{}, +{})",
                        a.4, b.4, a.2, a.3, b.2, b.3
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The source node `i` may overwrite: an element-wise op's first source that is a compute root,
/// dies at `i`, is not an output, and has the same dtype and contiguous layout as the node.
fn inplace_source(
    graph: &Graph,
    i: usize,
    last_use: &[usize],
    pinned: &[bool],
    plan: &AllocPlan,
) -> Option<TensorId> {
    let t = &graph.tensors()[i];
    if !t.op.can_inplace() {
        return None;
    }
    let src = *t.srcs.first()?;
    let s = graph.tensor(src);
    let ok = s.root == src
        && !pinned[src.index()]
        && last_use[src.index()] == i
        && matches!(plan.slots[src.index()], Some((Region::Compute, _)))
        && s.dtype == t.dtype
        && s.layout == t.layout
        // No other source of this node may alias the memory being overwritten.
        && t.srcs[1..].iter().all(|o| graph.tensor(*o).root != src);
    ok.then_some(src)
}
