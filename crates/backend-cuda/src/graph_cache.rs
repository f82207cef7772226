//! The cache of CUDA graph replay: which compute graph is run eagerly, captured or replayed.
//!
//! Why: a decode step queues hundreds of small kernels; each eager launch costs the host a
//! driver call and leaves gaps on the device. Every per-step value the kernels read (token ids,
//! positions, KV slots, the mask) lives in device memory written by the staged input copy, and a
//! plan's tensors sit at fixed addresses, so one step's launches are the same launches every
//! step of a shape bucket: record them once, replay them as one `cuGraphLaunch`.
//!
//! Strategy: a small cache keyed by the identity of the plan's `ExecGraph` (one per split, copy
//! and bucket; a new bucket is a new plan, so it is captured on its own); `capture` acts on
//! what it decides. The first time a graph is seen it runs eagerly (that run sizes scratch memory and settles anything lazy); the
//! second time it is captured (`cuStreamBeginCapture` .. `cuStreamEndCapture`, instantiate) and
//! launched; later it is only launched. A capture that fails — an op that cannot be captured,
//! scratch that would have to grow — leaves that graph on eager launches for good. Captured
//! addresses are only valid while device memory stays where it was: the backend bumps a memory
//! generation on every buffer re-allocation, free and scratch growth, and an entry of an older
//! generation is captured again.
//!
//! Invariants: a replayed graph launches exactly the kernels an eager run of the same graph
//! would (same kernels, same arguments), so tokens are bit-identical with replay on and off;
//! entries hold only a weak reference to their graph and are dropped when it is; the cache is
//! bounded.

use std::sync::{Arc, Weak};

use lowsync_backend::ExecGraph;

use crate::driver::CuGraphExec;

/// Entries kept at most (plans of every bucket and copy of a context, with room to spare).
const MAX_ENTRIES: usize = 256;

/// What to do with a compute graph this time.
pub(crate) enum Action<'a> {
    /// Run the nodes as eager launches.
    Eager,
    /// Capture the nodes, then launch the result ([`GraphCache::store`] or
    /// [`GraphCache::refuse`] afterwards).
    Capture,
    /// Launch the captured graph.
    Replay(&'a CuGraphExec),
}

enum State {
    /// Ran eagerly once; captured on the next run.
    Seen,
    Captured(CuGraphExec),
    /// Capture failed: eager launches from now on.
    Refused,
}

struct Entry {
    graph: Weak<ExecGraph>,
    generation: u64,
    state: State,
}

/// The captured graphs of one backend.
#[derive(Default)]
pub(crate) struct GraphCache {
    entries: Vec<Entry>,
}

impl GraphCache {
    fn find(&self, g: &Arc<ExecGraph>) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| std::ptr::eq(e.graph.as_ptr(), Arc::as_ptr(g)))
    }

    /// Decides how `g` runs now, given the backend's current memory generation.
    pub(crate) fn action(&mut self, g: &Arc<ExecGraph>, generation: u64) -> Action<'_> {
        let Some(i) = self.find(g) else {
            self.entries.retain(|e| e.graph.strong_count() > 0);
            if self.entries.len() >= MAX_ENTRIES {
                self.entries.remove(0);
            }
            self.entries.push(Entry {
                graph: Arc::downgrade(g),
                generation,
                state: State::Seen,
            });
            return Action::Eager;
        };
        let e = &mut self.entries[i];
        if e.generation != generation {
            // Memory moved since the capture: its addresses are stale. Run eagerly (which
            // also settles any new scratch size) and capture again next time.
            e.generation = generation;
            e.state = State::Seen;
            return Action::Eager;
        }
        match &e.state {
            State::Seen => Action::Capture,
            State::Captured(exec) => Action::Replay(exec),
            State::Refused => Action::Eager,
        }
    }

    /// Keeps the graph captured for `g` and returns it for its first launch (`None` only if `g`
    /// has no entry, i.e. `action` was not asked first: the caller then runs `g` eagerly).
    pub(crate) fn store(&mut self, g: &Arc<ExecGraph>, exec: CuGraphExec) -> Option<&CuGraphExec> {
        let i = self.find(g)?;
        let e = &mut self.entries[i];
        e.state = State::Captured(exec);
        match &e.state {
            State::Captured(exec) => Some(exec),
            _ => None,
        }
    }

    /// Marks `g` as not capturable: it runs eagerly from now on.
    pub(crate) fn refuse(&mut self, g: &Arc<ExecGraph>) {
        if let Some(i) = self.find(g) {
            self.entries[i].state = State::Refused;
        }
    }

    /// Drops every captured graph (the backend is going away).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_exec() -> CuGraphExec {
        // A null handle: never launched here, and destroying null is a harmless driver error
        // (the Drop ignores it) — but without a loaded driver it must not be dropped either.
        CuGraphExec(std::ptr::null_mut())
    }

    fn kind(a: Action<'_>) -> &'static str {
        match a {
            Action::Eager => "eager",
            Action::Capture => "capture",
            Action::Replay(_) => "replay",
        }
    }

    #[test]
    fn eager_then_capture_then_replay_and_again_after_memory_moves() {
        let mut c = GraphCache::default();
        let g = Arc::new(ExecGraph::default());
        assert_eq!(kind(c.action(&g, 0)), "eager");
        assert_eq!(kind(c.action(&g, 0)), "capture");
        std::mem::forget(std::mem::replace(
            &mut c.entries[0].state,
            State::Captured(fake_exec()),
        ));
        assert_eq!(kind(c.action(&g, 0)), "replay");
        assert_eq!(kind(c.action(&g, 0)), "replay");
        // A re-allocation moved memory: eager once more, then a new capture.
        let old = std::mem::replace(&mut c.entries[0].state, State::Seen);
        std::mem::forget(old);
        assert_eq!(kind(c.action(&g, 1)), "eager");
        assert_eq!(kind(c.action(&g, 1)), "capture");
        c.refuse(&g);
        assert_eq!(kind(c.action(&g, 1)), "eager", "refused for good");
        assert_eq!(kind(c.action(&g, 1)), "eager");
    }

    #[test]
    fn each_graph_has_its_own_entry_and_dead_graphs_are_dropped() {
        let mut c = GraphCache::default();
        let a = Arc::new(ExecGraph::default());
        let b = Arc::new(ExecGraph::default());
        assert_eq!(kind(c.action(&a, 0)), "eager");
        assert_eq!(kind(c.action(&b, 0)), "eager");
        assert_eq!(kind(c.action(&a, 0)), "capture");
        drop(a);
        let d = Arc::new(ExecGraph::default());
        assert_eq!(kind(c.action(&d, 0)), "eager");
        assert_eq!(c.entries.len(), 2, "the dead graph's entry went");
        for _ in 0..MAX_ENTRIES + 10 {
            let g = Arc::new(ExecGraph::default());
            let _ = c.action(&g, 0);
            std::mem::forget(g); // keep it alive (a distinct address) without holding it
        }
        assert!(c.entries.len() <= MAX_ENTRIES);
    }
}
