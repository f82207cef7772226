//! Splits: runs of consecutive nodes on one backend, with the inputs each must receive.
//!
//! Why: each backend change in the node order is a point where the host may have to wait or
//! copy. Making the splits explicit, with their user inputs (host-written) and foreign inputs
//! (tensors that live in another backend's memory) listed once, is what lets the compute loop
//! apply a [`SyncPolicy`](crate::SyncPolicy) and what lets tests count waits as a function of
//! the graph.
//!
//! Strategy: walk nodes in order (views run no kernel and are skipped); start a new split when
//! the backend changes. A source whose root is a user input is a user input of the split; a
//! source whose root lives on another backend is a foreign input (copied into the split's
//! backend each step); everything else is local.
//!
//! Invariants: splits cover every node exactly once, in order; inputs are listed once per
//! split, in first-use order (deterministic).

use lowsync_graph::{Graph, Op};

/// One split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitDef {
    pub backend: usize,
    /// Node indices (compute nodes only), in order.
    pub nodes: Vec<usize>,
    /// Roots of user inputs read by the split.
    pub user_inputs: Vec<usize>,
    /// Roots living on another backend read by the split.
    pub foreign: Vec<usize>,
}

impl SplitDef {
    /// Index of the split's first node (its copies are written "at" this step).
    pub fn first(&self) -> usize {
        self.nodes[0]
    }
}

/// Splits `graph` under `placement`.
pub fn split_graph(graph: &Graph, placement: &[usize]) -> Vec<SplitDef> {
    let ts = graph.tensors();
    let mut splits: Vec<SplitDef> = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        if t.op.is_leaf() || t.op.is_view() {
            continue;
        }
        let b = placement[i];
        if splits.last().is_none_or(|s| s.backend != b) {
            splits.push(SplitDef {
                backend: b,
                nodes: Vec::new(),
                user_inputs: Vec::new(),
                foreign: Vec::new(),
            });
        }
        let s = splits.last_mut().expect("just pushed");
        s.nodes.push(i);
        for src in &t.srcs {
            let r = ts[src.index()].root.index();
            if ts[r].op == Op::Input {
                if !s.user_inputs.contains(&r) {
                    s.user_inputs.push(r);
                }
            } else if placement[r] != b && !s.foreign.contains(&r) {
                s.foreign.push(r);
            }
        }
    }
    splits
}
