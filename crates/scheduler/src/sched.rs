//! The scheduler of one context: its backends, its policy, the memory its plans share, and the
//! worst-case reserve.
//!
//! Why: ggml re-reserves a graph whose shape changed and, doing so, can shrink the worst-case
//! plan to the current state (S2): the next growth then reallocates mid-decode. lowsync keeps the
//! reserve here, for every plan of the context, and never lets it shrink.
//!
//! Strategy: scratch ("compute") memory is one buffer per backend, shared by every plan of the
//! context and grown only. Weights and persistent tensors are shared by name across plans
//! (compiling the decode graph after the prefill graph uploads nothing and sees the same KV
//! cache). The reserve records the worst case per graph shape (node and leaf counts and
//! placement): each tensor's size. A later graph that fits the entry of its shape is planned
//! with the reserved sizes — the same offsets, no allocation. One that does not fit needs a
//! re-reserve: every backend is synchronized first, the entry becomes the element-wise maximum
//! (never smaller), and each backend's compute buffer is re-allocated (counted by the backend as
//! a realloc). `LOWSYNC_SCHED_DEBUG_REALLOC=1` turns an unexpected re-reserve (same graph size,
//! same placement as the previous graph) into an error, `=2` any re-reserve.
//!
//! The first reserve: an explicit `reserve` (any number of calls, one per shape the caller will
//! run), or, without one, the graphs compiled before the context's first step. During that
//! set-up a graph of a shape not reserved yet that fits the buffers as they are joins the
//! reserve: nothing has run and no memory changes, so it is no re-reserve (a session compiles
//! its buckets largest first, and its one-token graph has a node fewer than the others). A
//! graph of a known shape that outgrows its entry is a re-reserve even then.
//!
//! Sizes: every graph's tensors fit in `isize::MAX` bytes (the graph builder checks), and the
//! analysis checks each backend's total before planning, so no offset wraps; `n_copies` is at
//! most [`MAX_COPIES`].
//!
//! Invariants: buffers never shrink; a re-reserve synchronizes all backends first; a plan's
//! scratch offsets always lie inside the shared buffers.

use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lowsync_backend::{env, Backend, BufferId, BufferUsage, DeviceKind};
use lowsync_graph::{DType, Graph, Op, WeightBytes};
use parking_lot::Mutex;

use crate::analysis::{analyze, Analysis};
use crate::error::{Error, Result};
use crate::policy::SyncPolicy;

/// What a plan is built from once the reserve has been decided ([`Sched::prepare`]).
pub(crate) struct Prepared {
    pub analysis: Analysis,
    /// Each backend's shared scratch buffer, if it has one.
    pub compute: Vec<Option<BufferId>>,
    /// Where each weight and persistent tensor of the graph lives.
    pub leaves: HashMap<usize, LeafHome>,
}

/// Where a shared weight or persistent tensor lives.
#[derive(Clone, Debug)]
pub(crate) struct LeafHome {
    pub backend: usize,
    pub buffer: BufferId,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub op: Op,
    pub data: LeafData,
}

/// What a weight's home remembers of its bytes, to refuse a second weight of the same name
/// with other data.
///
/// Why: hashing every weight's bytes when a session is built read the whole file, so every
/// page of a memory-mapped GGUF became resident (an untied token embedding included, of which
/// decoding reads a few rows) and took time. Borrowed bytes (a file's map, a pinned numpy
/// array) stay valid and unchanged while a handle lives, so the home keeps a handle: the same
/// address and length are the same bytes without reading them, and only other bytes are
/// compared. Owned bytes are hashed, as a handle would keep them alive after their upload.
#[derive(Clone, Debug)]
pub(crate) enum LeafData {
    /// A persistent tensor (no bytes).
    None,
    Borrowed(WeightBytes),
    Hash(u64),
}

impl LeafData {
    fn of(w: Option<&WeightBytes>) -> LeafData {
        match w {
            None => LeafData::None,
            Some(b) if b.is_borrowed() => LeafData::Borrowed(b.clone()),
            Some(b) => LeafData::Hash(fingerprint(b)),
        }
    }

    /// Whether `w` holds the bytes this home was made from.
    fn same(&self, w: Option<&WeightBytes>) -> bool {
        match (self, w) {
            (LeafData::None, None) => true,
            (LeafData::Borrowed(a), Some(b)) => {
                (a.as_ptr() == b.as_ptr() && a.len() == b.len()) || a.as_bytes() == b.as_bytes()
            }
            (LeafData::Hash(h), Some(b)) => *h == fingerprint(b),
            _ => false,
        }
    }
}

/// The worst case the context is reserved for.
#[derive(Clone, Debug)]
struct Reserved {
    n_nodes: usize,
    n_leafs: usize,
    placement: Vec<usize>,
    sizes: Vec<usize>,
}

impl Reserved {
    fn of(graph: &Graph, a: &Analysis) -> Self {
        Reserved {
            n_nodes: graph.n_nodes(),
            n_leafs: graph.n_leafs(),
            placement: a.placement.clone(),
            sizes: a.sizes.clone(),
        }
    }

    fn same_shape(&self, graph: &Graph, a: &Analysis) -> bool {
        self.n_nodes == graph.n_nodes()
            && self.n_leafs == graph.n_leafs()
            && self.placement == a.placement
    }

    fn fits(&self, graph: &Graph, a: &Analysis) -> bool {
        self.same_shape(graph, a) && a.sizes.iter().zip(&self.sizes).all(|(s, r)| s <= r)
    }

    /// The worst case of both when the shapes match (never smaller); otherwise the new shape.
    fn merged(&self, graph: &Graph, a: &Analysis) -> Self {
        let mut r = Reserved::of(graph, a);
        if self.same_shape(graph, a) {
            for (s, old) in r.sizes.iter_mut().zip(&self.sizes) {
                *s = (*s).max(*old);
            }
        }
        r
    }
}

#[derive(Default)]
struct SchedState {
    /// Per backend: the shared scratch buffer and its size.
    compute: Vec<Option<(BufferId, usize)>>,
    /// The worst case of each graph shape reserved so far.
    reserved: Vec<Reserved>,
    /// `reserve` was called: the caller declared the worst case, so set-up is over.
    explicit_reserve: bool,
    last_graph_size: Option<usize>,
    leaves: HashMap<String, LeafHome>,
}

/// A context's scheduler: backends in priority order, a policy, shared memory, the reserve.
pub struct Sched {
    backends: Vec<Arc<dyn Backend>>,
    host: Option<usize>,
    policy: SyncPolicy,
    n_copies: usize,
    debug_realloc: u8,
    state: Mutex<SchedState>,
    /// Held while a plan queues a step: plans of one context share scratch memory, so two
    /// threads must not interleave their steps.
    step_lock: Mutex<()>,
    /// A plan of this context has queued a step (the reserve's set-up is over).
    stepped: AtomicBool,
}

/// The most input copies per split a context takes (ggml keeps 4 by default). Each copy is a
/// whole set of split inputs and of pipelined scratch copies, so more only costs memory.
pub const MAX_COPIES: usize = 16;

/// Reads `LOWSYNC_SCHED_DEBUG_REALLOC` (0, 1 or 2).
pub fn debug_realloc_from_env() -> Result<u8> {
    let v = env::choice("LOWSYNC_SCHED_DEBUG_REALLOC", &["0", "1", "2"], "0, 1 or 2")?;
    Ok(v.map_or(0, |s| s.as_bytes()[0] - b'0'))
}

/// Puts a reserve entry back in its slot (`known`) or beside the others.
fn store_reserved(st: &mut SchedState, known: Option<usize>, r: Reserved) {
    match known {
        Some(k) => st.reserved[k] = r,
        None => st.reserved.push(r),
    }
}

fn fingerprint(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write_usize(bytes.len());
    h.write(bytes);
    h.finish()
}

impl Sched {
    /// A scheduler over `backends` (priority order). `n_copies` >= 1 input copies per split
    /// (more than one pipelines successive evaluations). Reads `LOWSYNC_SCHED_DEBUG_REALLOC`.
    pub fn new(
        backends: Vec<Arc<dyn Backend>>,
        policy: SyncPolicy,
        n_copies: usize,
    ) -> Result<Arc<Sched>> {
        Self::with_debug_realloc(backends, policy, n_copies, debug_realloc_from_env()?)
    }

    /// As [`Sched::new`], with the debug-realloc level given instead of read from the
    /// environment (0 off, 1 unexpected re-reserves are errors, 2 every re-reserve is).
    pub fn with_debug_realloc(
        backends: Vec<Arc<dyn Backend>>,
        policy: SyncPolicy,
        n_copies: usize,
        debug_realloc: u8,
    ) -> Result<Arc<Sched>> {
        if debug_realloc > 2 {
            return Err(Error::Input(format!(
                "debug-realloc level {debug_realloc} is not 0, 1 or 2"
            )));
        }
        if backends.is_empty() {
            return Err(Error::Input("a context needs at least one backend".into()));
        }
        if n_copies == 0 || n_copies > MAX_COPIES {
            return Err(Error::Input(format!(
                "n_copies must be between 1 and {MAX_COPIES}, got {n_copies}"
            )));
        }
        let host = backends
            .iter()
            .position(|b| b.device_kind() == DeviceKind::Cpu && b.buffer_type().is_host);
        let n = backends.len();
        Ok(Arc::new(Sched {
            backends,
            host,
            policy,
            n_copies,
            debug_realloc,
            state: Mutex::new(SchedState {
                compute: vec![None; n],
                ..Default::default()
            }),
            step_lock: Mutex::new(()),
            stepped: AtomicBool::new(false),
        }))
    }

    /// Backends in priority order.
    pub fn backends(&self) -> &[Arc<dyn Backend>] {
        &self.backends
    }
    /// The policy of plans compiled here.
    pub fn policy(&self) -> SyncPolicy {
        self.policy
    }
    /// Input copies per split.
    pub fn n_copies(&self) -> usize {
        self.n_copies
    }
    /// The debug-realloc level in force.
    pub fn debug_realloc(&self) -> u8 {
        self.debug_realloc
    }

    /// Serialises the steps of this context's plans; taken by every step, so it also marks the
    /// end of the reserve's set-up.
    pub(crate) fn step_guard(&self) -> parking_lot::MutexGuard<'_, ()> {
        let g = self.step_lock.lock();
        self.stepped.store(true, Ordering::Relaxed);
        g
    }

    /// Waits for all queued work on every backend.
    pub fn synchronize(&self) -> Result<()> {
        for b in &self.backends {
            b.synchronize()?;
        }
        Ok(())
    }

    fn graph_size(&self, graph: &Graph) -> usize {
        graph.n_nodes().max(graph.n_leafs()) + graph.inputs().count() * 2 * self.n_copies
    }

    /// Plans `graph` as the worst case of its shape (merged with an earlier reserve of the
    /// same shape; other shapes keep theirs) and sizes the shared buffers for it. Counts one
    /// reserve per buffer allocated.
    pub fn reserve(&self, graph: &Graph) -> Result<()> {
        let mut st = self.state.lock();
        let fresh = analyze(graph, &self.backends, self.host, self.n_copies, None)?;
        let known = st.reserved.iter().position(|r| r.same_shape(graph, &fresh));
        let merged = match known {
            Some(k) => st.reserved[k].merged(graph, &fresh),
            None => Reserved::of(graph, &fresh),
        };
        let a = analyze(
            graph,
            &self.backends,
            self.host,
            self.n_copies,
            Some(&merged.sizes),
        )?;
        self.grow(&mut st, &a)?;
        store_reserved(&mut st, known, merged);
        st.explicit_reserve = true;
        Ok(())
    }

    /// Whether every backend's shared buffer already holds what `a` plans.
    fn fits_buffers(st: &SchedState, a: &Analysis) -> bool {
        a.per_backend
            .iter()
            .zip(&st.compute)
            .all(|(bi, c)| match c {
                Some((_, have)) => bi.plan.bytes <= *have,
                None => bi.plan.bytes == 0 && bi.items.is_empty(),
            })
    }

    /// The reserve's side of compiling `graph` (see `Sched::compile`, beside `Plan::build`):
    /// its weights and state placed, the reserve grown or re-reserved as needed, and the
    /// analysis, scratch buffers and leaf homes a plan is built from.
    pub(crate) fn prepare(self: &Arc<Self>, graph: &Graph) -> Result<Prepared> {
        if graph.outputs().is_empty() {
            return Err(lowsync_graph::Error::NoOutputs.into());
        }
        let mut st = self.state.lock();
        let fresh = analyze(graph, &self.backends, self.host, self.n_copies, None)?;
        // Weights and state first: a model too large for a device fails here, before the
        // reserve is touched, so the context is as it was (invariant 14).
        let leaves = self.leaf_homes(&mut st, graph, &fresh)?;
        let graph_size = self.graph_size(graph);
        let known = st.reserved.iter().position(|r| r.same_shape(graph, &fresh));
        let setting_up = !st.explicit_reserve && !self.stepped.load(Ordering::Relaxed);
        let analysis = match known.map(|k| st.reserved[k].clone()) {
            None if st.reserved.is_empty() => {
                // The first graph is the reserve.
                self.grow(&mut st, &fresh)?;
                st.reserved.push(Reserved::of(graph, &fresh));
                fresh
            }
            None if setting_up && Self::fits_buffers(&st, &fresh) => {
                // Another shape of the first reserve (see the module header): no memory moves.
                st.reserved.push(Reserved::of(graph, &fresh));
                fresh
            }
            Some(r) if r.fits(graph, &fresh) => analyze(
                graph,
                &self.backends,
                self.host,
                self.n_copies,
                Some(&r.sizes),
            )?,
            r => {
                // A shape not reserved yet is compared with the latest entry, as ggml compares
                // with the previous graph.
                let r = match r.or_else(|| st.reserved.last().cloned()) {
                    Some(r) => r,
                    None => Reserved::of(graph, &fresh),
                };
                let same_size = st.last_graph_size == Some(graph_size);
                let same_placement = r.placement == fresh.placement;
                let why = format!(
                    "graph of {} nodes / {} leafs does not fit the reserve of {} nodes / {} leafs",
                    graph.n_nodes(),
                    graph.n_leafs(),
                    r.n_nodes,
                    r.n_leafs
                );
                if self.debug_realloc == 2 {
                    return Err(Error::Realloc(format!(
                        "{why} (LOWSYNC_SCHED_DEBUG_REALLOC=2 rejects every re-allocation)"
                    )));
                }
                if self.debug_realloc == 1 && same_size && same_placement {
                    return Err(Error::Realloc(format!(
                        "{why}; the graph size ({graph_size}) and placement equal the previous graph's, so its shape \
                         depends on runtime state (LOWSYNC_SCHED_DEBUG_REALLOC=1)"
                    )));
                }
                // A re-reserve: wait for every backend, then never plan smaller than before.
                self.synchronize()?;
                let merged = match known {
                    Some(_) => r.merged(graph, &fresh),
                    None => Reserved::of(graph, &fresh),
                };
                let a = analyze(
                    graph,
                    &self.backends,
                    self.host,
                    self.n_copies,
                    Some(&merged.sizes),
                )?;
                self.realloc_all(&mut st, &a)?;
                store_reserved(&mut st, known, merged);
                a
            }
        };
        self.grow(&mut st, &analysis)?;
        st.last_graph_size = Some(graph_size);
        let compute: Vec<Option<BufferId>> =
            st.compute.iter().map(|c| c.map(|(id, _)| id)).collect();
        drop(st);
        Ok(Prepared {
            analysis,
            compute,
            leaves,
        })
    }

    /// Makes every backend's shared buffer at least as large as `a` needs.
    fn grow(&self, st: &mut SchedState, a: &Analysis) -> Result<()> {
        for (b, bi) in a.per_backend.iter().enumerate() {
            let need = bi.plan.bytes;
            match st.compute[b] {
                None if need > 0 || !bi.items.is_empty() => {
                    let id = self.backends[b].alloc_buffer(need, BufferUsage::Compute)?;
                    st.compute[b] = Some((id, need));
                }
                Some((id, have)) if have < need => {
                    self.backends[b].realloc_buffer(id, need)?;
                    st.compute[b] = Some((id, need));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A re-reserve: every backend with scratch memory re-allocates it (never smaller).
    fn realloc_all(&self, st: &mut SchedState, a: &Analysis) -> Result<()> {
        for (b, bi) in a.per_backend.iter().enumerate() {
            if let Some((id, have)) = st.compute[b] {
                let size = have.max(bi.plan.bytes);
                self.backends[b].realloc_buffer(id, size)?;
                st.compute[b] = Some((id, size));
            }
        }
        Ok(())
    }

    /// Finds or creates the shared home of every weight and persistent tensor of `graph`.
    fn leaf_homes(
        &self,
        st: &mut SchedState,
        graph: &Graph,
        a: &Analysis,
    ) -> Result<HashMap<usize, LeafHome>> {
        let weights: HashMap<usize, &lowsync_graph::WeightData> = graph
            .weights()
            .iter()
            .map(|(id, w)| (id.index(), w))
            .collect();
        let mut out = HashMap::new();
        for (i, t) in graph.tensors().iter().enumerate() {
            if !matches!(t.op, Op::Weight | Op::Persistent) {
                continue;
            }
            let name = t.name.clone().unwrap_or_default();
            let data = weights.get(&i).map(|w| &w.bytes);
            let b = a.placement[i];
            let home = match st.leaves.get(&name) {
                Some(h) => {
                    if h.op != t.op || h.dtype != t.dtype || h.shape != t.layout.shape {
                        return Err(Error::Input(format!(
                            "`{name}` already exists in this context as a {} of shape {:?} and dtype {}; here it is a {} of shape {:?} and dtype {}",
                            h.op.name(), h.shape, h.dtype, t.op.name(), t.layout.shape, t.dtype
                        )));
                    }
                    if h.backend != b {
                        return Err(Error::Placement(format!(
                            "`{name}` lives on `{}` in this context but is placed on `{}` here",
                            self.backends[h.backend].name(),
                            self.backends[b].name()
                        )));
                    }
                    if !h.data.same(data) {
                        return Err(Error::Input(format!(
                            "weight `{name}` already exists in this context with other data; use another name or a new context"
                        )));
                    }
                    h.clone()
                }
                None => {
                    let nbytes = t.nbytes();
                    let usage = if t.op == Op::Weight {
                        BufferUsage::Weights
                    } else {
                        BufferUsage::Persistent
                    };
                    // A host backend may read the weight's bytes in place (no copy); any other
                    // gets a buffer and one upload straight from them.
                    let aliased = match weights.get(&i) {
                        Some(w) => self.backends[b].alias_weight(&w.bytes)?,
                        None => None,
                    };
                    let buffer = match aliased {
                        Some(id) => id,
                        None => {
                            let buffer = self.backends[b].alloc_buffer(nbytes, usage)?;
                            if let Some(w) = weights.get(&i) {
                                self.backends[b].set_tensor(buffer, 0, &w.bytes)?;
                            }
                            buffer
                        }
                    };
                    let h = LeafHome {
                        backend: b,
                        buffer,
                        dtype: t.dtype,
                        shape: t.layout.shape.clone(),
                        op: t.op,
                        data: LeafData::of(data),
                    };
                    st.leaves.insert(name, h.clone());
                    h
                }
            };
            out.insert(i, home);
        }
        Ok(out)
    }
}

impl Drop for Sched {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        for (b, c) in st.compute.iter().enumerate() {
            if let Some((id, _)) = c {
                self.backends[b].free_buffer(*id);
            }
        }
        for h in st.leaves.values() {
            self.backends[h.backend].free_buffer(h.buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lowsync_cpu::{CpuBackend, NoopBackend};

    fn cpu() -> Vec<Arc<dyn Backend>> {
        vec![Arc::new(CpuBackend::new())]
    }

    /// `x [rows, 4]` through `extra + 1` scales.
    fn chain(rows: usize, extra: usize) -> Graph {
        let mut g = Graph::new();
        let mut h = g.input("x", &[rows, 4], DType::F32).unwrap();
        for _ in 0..=extra {
            h = g.scale(h, 2.0).unwrap();
        }
        h = g.silu(h).unwrap();
        g.output("y", h).unwrap();
        g
    }

    #[test]
    fn n_copies_beyond_the_limit_is_refused_before_anything_is_sized() {
        for n in [0, MAX_COPIES + 1, 1 << 40] {
            let e = Sched::with_debug_realloc(cpu(), SyncPolicy::Staged, n, 0)
                .err()
                .expect("refused");
            assert!(
                e.to_string().contains("n_copies must be between 1 and 16"),
                "{e}"
            );
        }
        assert!(Sched::with_debug_realloc(cpu(), SyncPolicy::Staged, MAX_COPIES, 0).is_ok());
    }

    #[test]
    fn a_smaller_graph_of_another_shape_joins_the_first_reserve_at_level_2() {
        // What a session does: its largest bucket first, then a graph with a node fewer.
        let noop: Arc<dyn Backend> = Arc::new(NoopBackend::new());
        let sc = Sched::with_debug_realloc(vec![noop.clone()], SyncPolicy::Staged, 1, 2).unwrap();
        sc.compile(&chain(32, 1)).unwrap();
        sc.compile(&chain(8, 0)).unwrap();
        // Both shapes are reserved now: compiling either again is free.
        sc.compile(&chain(32, 1)).unwrap();
        sc.compile(&chain(8, 0)).unwrap();
        assert_eq!(noop.stats().snapshot().reallocs, 0);
    }

    #[test]
    fn after_the_first_step_a_new_shape_is_a_re_reserve_again() {
        let sc = Sched::with_debug_realloc(cpu(), SyncPolicy::Staged, 1, 2).unwrap();
        let mut p = sc.compile(&chain(32, 1)).unwrap();
        p.set_input("x", &[0u8; 32 * 16]).unwrap();
        p.compute().unwrap();
        let e = sc.compile(&chain(8, 0)).err().expect("refused");
        assert!(matches!(e, Error::Realloc(_)), "{e}");
    }

    #[test]
    fn a_known_shape_that_outgrows_its_entry_is_a_re_reserve_even_in_set_up() {
        let sc = Sched::with_debug_realloc(cpu(), SyncPolicy::Staged, 1, 2).unwrap();
        sc.compile(&chain(8, 0)).unwrap();
        let e = sc.compile(&chain(32, 0)).err().expect("refused");
        assert!(matches!(e, Error::Realloc(_)), "{e}");
    }

    #[test]
    fn an_explicit_reserve_ends_the_set_up() {
        let sc = Sched::with_debug_realloc(cpu(), SyncPolicy::Staged, 1, 2).unwrap();
        sc.reserve(&chain(32, 1)).unwrap();
        let e = sc.compile(&chain(8, 0)).err().expect("refused");
        assert!(matches!(e, Error::Realloc(_)), "{e}");
        // Reserving the second shape too declares both; then both compile.
        sc.reserve(&chain(8, 0)).unwrap();
        sc.compile(&chain(8, 0)).unwrap();
        sc.compile(&chain(32, 1)).unwrap();
    }
}
