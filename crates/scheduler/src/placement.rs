//! Placement: which backend runs each node (ggml's assignment passes, one function each).
//!
//! Why: a graph spans devices — weights on the GPU, token ids written by the host, an op only
//! the CPU has. Every node needs exactly one backend, chosen deterministically, so the splits
//! and their copies are the same every time the graph is compiled (invariant 13).
//!
//! Strategy (ggml-backend.cpp's `split_graph`, passes 1–5): (1) leaves: user inputs start on
//! the host, weights and persistent tensors where the user put them or on the highest-priority
//! backend; (2) nodes that read a weight or persistent tensor go to its backend (`set_rows` must);
//! (3) expand assignments down and up the graph, device backends first with the host as a
//! barrier, then all; (4) upgrade to a higher-priority backend with the same buffer type;
//! (5) give every remaining node the first backend that supports it, and views their root's.
//!
//! Invariants: deterministic (a function of the graph and the backend list only); every node
//! ends on a backend that supports it, or compile fails naming the op.

use std::sync::Arc;

use lowsync_backend::Backend;
use lowsync_graph::{DType, Graph, Op, TensorId, TensorInfo};

use crate::error::{Error, Result};

/// The backend index of every tensor.
pub type Placement = Vec<usize>;

fn supports(be: &dyn Backend, g: &Graph, t: &TensorInfo) -> bool {
    let srcs: Vec<DType> = t.srcs.iter().map(|s| g.tensor(*s).dtype).collect();
    be.supports_op(&t.op, t.dtype, &srcs)
}

fn is_node(t: &TensorInfo) -> bool {
    !t.op.is_leaf() && !t.op.is_view()
}

fn name_of(g: &Graph, i: usize) -> String {
    let t = &g.tensors()[i];
    t.name
        .clone()
        .unwrap_or_else(|| format!("{}#{i}", t.op.name()))
}

/// Places every tensor of `graph` on one of `backends` (priority order). `host` is the index
/// of the host backend (`cpu`), where user inputs start.
pub fn place(
    graph: &Graph,
    backends: &[Arc<dyn Backend>],
    host: Option<usize>,
) -> Result<Placement> {
    let mut at: Vec<Option<usize>> = vec![None; graph.tensors().len()];
    pass1_leaves(graph, backends, host, &mut at)?;
    pass2_weight_consumers(graph, backends, &mut at)?;
    pass3_expand(graph, backends, host, &mut at);
    pass4_upgrade(graph, backends, &mut at);
    pass5_remaining(graph, backends, &mut at)
}

fn backend_index(backends: &[Arc<dyn Backend>], name: &str) -> Option<usize> {
    backends.iter().position(|b| b.name() == name)
}

/// Pass 1: leaves. User inputs start on the host; weights (and persistent tensors) go where
/// the user pinned them, else to the highest-priority backend.
fn pass1_leaves(
    graph: &Graph,
    backends: &[Arc<dyn Backend>],
    host: Option<usize>,
    at: &mut [Option<usize>],
) -> Result<()> {
    for (i, t) in graph.tensors().iter().enumerate() {
        at[i] = match t.op {
            Op::Input => Some(host.unwrap_or(0)),
            Op::Weight | Op::Persistent => match graph.pinned_backend(TensorId(i as u32)) {
                Some(name) => Some(backend_index(backends, name).ok_or_else(|| {
                    let known: Vec<&str> = backends.iter().map(|b| b.name()).collect();
                    Error::Placement(format!(
                        "`{}` is pinned to backend `{name}`, which is not in this context (backends: {known:?})",
                        name_of(graph, i)
                    ))
                })?),
                None => Some(0),
            },
            _ => None,
        };
    }
    Ok(())
}

/// Pass 2: a node reading a weight or persistent tensor runs where that tensor lives, if the
/// backend supports it. `set_rows` must run where its destination lives.
fn pass2_weight_consumers(
    graph: &Graph,
    backends: &[Arc<dyn Backend>],
    at: &mut [Option<usize>],
) -> Result<()> {
    let ts = graph.tensors();
    for (i, t) in ts.iter().enumerate() {
        if !is_node(t) {
            continue;
        }
        if t.op == Op::SetRows {
            let b = at[ts[t.srcs[0].index()].root.index()].expect("leaves are placed");
            if !supports(&*backends[b], graph, t) {
                return Err(Error::Placement(format!(
                    "set_rows `{}` must run on `{}`, where its destination lives, which does not support it",
                    name_of(graph, i),
                    backends[b].name()
                )));
            }
            at[i] = Some(b);
            continue;
        }
        let owner = t
            .srcs
            .iter()
            .map(|s| ts[s.index()].root.index())
            .find(|&r| matches!(ts[r].op, Op::Weight | Op::Persistent));
        if let Some(r) = owner {
            let b = at[r].expect("leaves are placed");
            if supports(&*backends[b], graph, t) {
                at[i] = Some(b);
            }
        }
    }
    Ok(())
}

/// Pass 3: expansion. Unplaced nodes take the backend of the nearest placed node before them
/// (down) or after them (up): first only device backends spread (the host is a barrier), then
/// any backend.
fn pass3_expand(
    graph: &Graph,
    backends: &[Arc<dyn Backend>],
    host: Option<usize>,
    at: &mut [Option<usize>],
) {
    let ts = graph.tensors();
    let nodes: Vec<usize> = (0..ts.len()).filter(|&i| is_node(&ts[i])).collect();
    for devices_only in [true, false] {
        for reverse in [false, true] {
            let mut cur: Option<usize> = None;
            let order: Vec<usize> = if reverse {
                nodes.iter().rev().copied().collect()
            } else {
                nodes.clone()
            };
            for i in order {
                match at[i] {
                    Some(b) => {
                        cur = if devices_only && Some(b) == host {
                            None
                        } else {
                            Some(b)
                        }
                    }
                    None => {
                        if let Some(b) = cur.filter(|&b| supports(&*backends[b], graph, &ts[i])) {
                            at[i] = Some(b);
                        }
                    }
                }
            }
        }
    }
}

/// Pass 4: move a node to a higher-priority backend that uses the same buffer type (so no copy
/// is needed) and supports it.
fn pass4_upgrade(graph: &Graph, backends: &[Arc<dyn Backend>], at: &mut [Option<usize>]) {
    let ts = graph.tensors();
    for (i, t) in ts.iter().enumerate() {
        let Some(b) = at[i].filter(|_| is_node(t) && t.op != Op::SetRows) else {
            continue;
        };
        let buft = backends[b].buffer_type();
        if let Some(better) =
            (0..b).find(|&h| backends[h].buffer_type() == buft && supports(&*backends[h], graph, t))
        {
            at[i] = Some(better);
        }
    }
}

/// Pass 5: every remaining node gets the first backend that supports it; views live with their
/// root. Fails naming the op when no backend can run a node.
fn pass5_remaining(
    graph: &Graph,
    backends: &[Arc<dyn Backend>],
    at: &mut [Option<usize>],
) -> Result<Placement> {
    let ts = graph.tensors();
    for (i, t) in ts.iter().enumerate() {
        if t.op.is_view() {
            at[i] = at[t.root.index()];
            continue;
        }
        if !is_node(t) {
            continue;
        }
        if at[i].is_none() {
            at[i] = backends.iter().position(|b| supports(&**b, graph, t));
        }
        match at[i] {
            Some(b) if supports(&*backends[b], graph, t) => {}
            _ => {
                let srcs: Vec<DType> = t.srcs.iter().map(|s| graph.tensor(*s).dtype).collect();
                return Err(Error::NoBackend {
                    op: t.op.name(),
                    node: name_of(graph, i),
                    dtype: t.dtype,
                    srcs: format!("{srcs:?}"),
                    backends: backends
                        .iter()
                        .map(|b| b.name())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
    }
    Ok(at.iter().map(|b| b.unwrap_or(0)).collect())
}
