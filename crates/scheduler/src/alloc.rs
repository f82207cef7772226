//! Graph allocator: where every scratch tensor of a step lives.
//!
//! Why: a decode step runs a few hundred nodes; giving each its own memory wastes most of it
//! and makes the worst case unknowable. ggml's answer, kept here: plan offsets once per graph
//! shape with liveness-based reuse, reserve the worst case once, and never touch memory that
//! outlives a step.
//!
//! Strategy: the scheduler turns each backend's share of a graph into [`Item`]s in execution
//! order — the results of its nodes and the copies of tensors it receives from other
//! backends — each with the step index where it is written (`def`) and the last index where it
//! is read (`last`). [`plan_items`] walks them in order over a best-fit free list: an item
//! takes a block when it is defined and returns it after its last reader; an element-wise node
//! whose first source dies at that node writes over it (in place). Pinned items (outputs,
//! pipelined copies) never return their block. Weights, persistent state, input arenas and
//! outputs live elsewhere (the scheduler's own buffers).
//!
//! Invariants: two items whose lifetimes overlap never share bytes, except a node and the
//! source it replaced in place ([`verify_items`], and the property tests).

/// Alignment of every tensor inside its buffer.
pub const TENSOR_ALIGN: usize = 64;

/// Rounds `n` up to [`TENSOR_ALIGN`].
pub fn align(n: usize) -> usize {
    n.div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN
}

/// One block of scratch memory to place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub size: usize,
    /// Step index of the writer.
    pub def: usize,
    /// Step index of the last reader (>= `def`).
    pub last: usize,
    /// Never released (outputs, pipelined copies).
    pub pinned: bool,
    /// An earlier item this one may overwrite if that item dies exactly at `def`.
    pub inplace_of: Option<usize>,
}

/// Where each item went and how much memory the plan needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ItemPlan {
    pub offsets: Vec<usize>,
    /// Items that took over their `inplace_of` source's block.
    pub took_over: Vec<bool>,
    pub bytes: usize,
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
        if let Some(i) = best {
            let (off, sz) = self.free[i];
            if sz == size {
                self.free.remove(i);
            } else {
                self.free[i] = (off + size, sz - size);
            }
            return off;
        }
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

/// Places `items` (given in execution order: non-decreasing `def`).
pub fn plan_items(items: &[Item]) -> ItemPlan {
    let n = items.len();
    let mut plan = ItemPlan {
        offsets: vec![0; n],
        took_over: vec![false; n],
        bytes: 0,
    };
    let mut fl = FreeList::default();
    let mut released = vec![false; n];
    let mut by_last: Vec<usize> = (0..n).filter(|&i| !items[i].pinned).collect();
    by_last.sort_by_key(|&i| (items[i].last, i));
    let mut next_release = 0;
    let mut i = 0;
    while i < n {
        let t = items[i].def;
        // Everything last read before `t` is free now.
        while next_release < by_last.len() && items[by_last[next_release]].last < t {
            let k = by_last[next_release];
            next_release += 1;
            if !released[k] {
                released[k] = true;
                fl.release(plan.offsets[k], items[k].size);
            }
        }
        // Allocate every item defined at `t`.
        while i < n && items[i].def == t {
            let it = &items[i];
            // A source that dies exactly here (its last reader is this node) hands its block over.
            let src = it.inplace_of.filter(|&s| {
                s < i
                    && !items[s].pinned
                    && !released[s]
                    && items[s].last == t
                    && items[s].size == it.size
            });
            match src {
                Some(s) => {
                    plan.offsets[i] = plan.offsets[s];
                    plan.took_over[i] = true;
                    released[s] = true; // the block now belongs to item i
                }
                None => plan.offsets[i] = fl.alloc(it.size),
            }
            i += 1;
        }
    }
    plan.bytes = fl.high_water;
    plan
}

/// Checks that no two items with overlapping lifetimes share bytes, except in-place chains.
pub fn verify_items(items: &[Item], plan: &ItemPlan) -> Result<(), String> {
    let chained = |a: usize, b: usize| {
        let follows = |mut x: usize, y: usize| {
            while plan.took_over[x] {
                match items[x].inplace_of {
                    Some(p) if p == y => return true,
                    Some(p) => x = p,
                    None => return false,
                }
            }
            false
        };
        follows(a, b) || follows(b, a)
    };
    for a in 0..items.len() {
        for b in a + 1..items.len() {
            let (ia, ib) = (&items[a], &items[b]);
            let end = |it: &Item| if it.pinned { usize::MAX } else { it.last };
            let time = ia.def <= end(ib) && ib.def <= end(ia);
            let (oa, ob) = (plan.offsets[a], plan.offsets[b]);
            let space = oa < ob + ib.size && ob < oa + ia.size && ia.size > 0 && ib.size > 0;
            if time && space && !chained(a, b) {
                return Err(format!(
                    "items {a} and {b} are live together and overlap: [{oa}, +{}) and [{ob}, +{})",
                    ia.size, ib.size
                ));
            }
        }
    }
    if plan
        .offsets
        .iter()
        .zip(items)
        .any(|(o, it)| o + it.size > plan.bytes)
    {
        return Err("an item lies beyond the planned size".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(size: usize, def: usize, last: usize) -> Item {
        Item {
            size,
            def,
            last,
            pinned: false,
            inplace_of: None,
        }
    }

    #[test]
    fn dead_blocks_are_reused_and_live_ones_are_not() {
        let items = vec![item(64, 0, 1), item(64, 1, 2), item(64, 2, 3)];
        let p = plan_items(&items);
        verify_items(&items, &p).unwrap();
        assert_eq!(
            p.offsets[2], p.offsets[0],
            "item 0 died at 1, so item 2 reuses it"
        );
        assert_eq!(p.bytes, 128);
    }

    #[test]
    fn in_place_takes_over_a_source_that_dies_here() {
        let mut b = item(64, 1, 2);
        b.inplace_of = Some(0);
        let items = vec![item(64, 0, 1), b];
        let p = plan_items(&items);
        verify_items(&items, &p).unwrap();
        assert!(p.took_over[1]);
        assert_eq!((p.offsets[1], p.bytes), (0, 64));
    }

    #[test]
    fn in_place_is_refused_when_the_source_lives_on() {
        let mut b = item(64, 1, 2);
        b.inplace_of = Some(0);
        let items = vec![item(64, 0, 3), b];
        let p = plan_items(&items);
        verify_items(&items, &p).unwrap();
        assert!(!p.took_over[1]);
    }

    #[test]
    fn pinned_items_are_never_reused() {
        let mut a = item(64, 0, 0);
        a.pinned = true;
        let items = vec![a, item(64, 1, 1)];
        let p = plan_items(&items);
        verify_items(&items, &p).unwrap();
        assert_ne!(p.offsets[0], p.offsets[1]);
    }
}
