//! Running a graph's kernels: in order, as one job on the rayon pool, the caller waiting.
//!
//! Why: kernels fork onto the rayon pool above a size threshold. From a thread outside the
//! pool (the Python thread for `cpu`, the stream's worker for `cpu-async`) every fork injects a
//! job, wakes a worker and puts the caller to sleep on a latch until the job is done: two
//! thread wake-ups per parallel op, hundreds per decode step, and a third runnable thread
//! competing with the pool's for the cores (about 15% of a SmolLM2 decode step went to the
//! scheduler and to idle workers' yielding).
//!
//! Strategy: the node loop runs as one job on the pool, so the kernels' forks are
//! work-stealing joins between pool threads. The caller sleeps on a condition variable, waking
//! every `interrupt::POLL_INTERVAL` to run its `poll` (Ctrl-C, cancellation); a stop it reports
//! is seen by the loop before the next node. A caller that already is a pool thread (a test
//! inside `install`, a nested call) runs the loop itself, polling between nodes.
//!
//! Steps: the node loop runs a graph's `kernels::plan` (attention chains fused), computed once
//! per graph and kept in the backend's [`Plans`] while the graph is alive.
//!
//! Invariants: nodes run one at a time in graph order (kernels parallelise inside themselves);
//! the caller returns only after the loop has ended, and a kernel's panic is re-raised on the
//! caller, as if the loop had run there.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use lowsync_backend::{interrupt, ExecGraph, Result};
use parking_lot::{Condvar, Mutex};

use crate::kernels::{self, Step};
use crate::memory::Store;

/// How a graph run ended without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finished {
    /// Every node ran.
    Done,
    /// `poll` asked to stop; the nodes after that point did not run.
    Stopped,
}

/// The step plans of the graphs a backend ran recently, by graph identity. A graph is
/// immutable behind its `Arc`, so a plan stays valid while the graph lives; dead entries are
/// dropped on the next lookup.
#[derive(Default)]
pub(crate) struct Plans {
    known: Mutex<Vec<(Weak<ExecGraph>, Plan)>>,
}

/// A graph's steps (`kernels::plan`).
type Plan = Arc<Vec<Step>>;

/// Graphs whose plans are kept (a session compiles one per shape bucket).
const PLANS_KEPT: usize = 16;

impl Plans {
    fn of(&self, graph: &Arc<ExecGraph>) -> Plan {
        let mut known = self.known.lock();
        known.retain(|(g, _)| g.strong_count() > 0);
        if let Some((_, p)) = known
            .iter()
            .find(|(g, _)| std::ptr::eq(g.as_ptr(), Arc::as_ptr(graph)))
        {
            return p.clone();
        }
        let plan = Arc::new(kernels::plan(graph));
        if known.len() >= PLANS_KEPT {
            known.remove(0);
        }
        known.push((Arc::downgrade(graph), plan.clone()));
        plan
    }
}

/// Runs `graph`'s nodes in order over `store`, on the rayon pool; `poll` runs on the calling
/// thread only and returns true to stop.
pub(crate) fn run_graph(
    graph: &Arc<ExecGraph>,
    plans: &Plans,
    store: &Store,
    poll: &dyn Fn() -> bool,
) -> Result<Finished> {
    if poll() {
        return Ok(Finished::Stopped);
    }
    let steps = plans.of(graph);
    let (graph, steps) = (&**graph, steps.as_slice());
    if rayon::current_thread_index().is_some() {
        return run_nodes(graph, steps, store, poll);
    }
    let stop = AtomicBool::new(false);
    let outcome = Mutex::new(None);
    let finished = Condvar::new();
    rayon::in_place_scope(|s| {
        s.spawn(|_| {
            let r = catch_unwind(AssertUnwindSafe(|| {
                run_nodes(graph, steps, store, &|| stop.load(Ordering::Acquire))
            }));
            *outcome.lock() = Some(r);
            finished.notify_one();
        });
        let mut o = outcome.lock();
        while o.is_none() {
            finished.wait_for(&mut o, interrupt::POLL_INTERVAL);
            if o.is_none() && poll() {
                stop.store(true, Ordering::Release);
            }
        }
    });
    match outcome.into_inner() {
        Some(Ok(r)) => r,
        Some(Err(panic)) => resume_unwind(panic),
        // The scope waited for the job, which always stores its outcome.
        None => unreachable!("graph job ended without an outcome"),
    }
}

/// The node loop, on this thread.
fn run_nodes(
    graph: &ExecGraph,
    steps: &[Step],
    store: &Store,
    stop: &dyn Fn() -> bool,
) -> Result<Finished> {
    for &step in steps {
        if stop() {
            return Ok(Finished::Stopped);
        }
        kernels::run_step(graph, step, store)?;
    }
    Ok(Finished::Done)
}
