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
//! While the loop runs, every other pool thread runs a helper that keeps looking for work to
//! steal instead of going to sleep ([`Team`]): between two products the loop runs the small
//! nodes alone for a few microseconds, long enough for an idle rayon worker to yield its way
//! into a sleep, and the next product's fork then waits for a futex wake-up and a virtual CPU's
//! wake-up before its second half starts (85 forks a decode step on the small model). The loop
//! is pinned to pool thread 0 and the helpers to the others (one broadcast job each); they end
//! with the loop, so no thread spins between steps, and a pool with more threads than the
//! process has CPUs runs no helpers (they would spin on the cores the loop needs). Yielding the
//! core to the OS now and then while idle cost 2-4% of F16 tg on a shared machine (the OS gave
//! the core to other processes), so a helper never yields.
//! `LOWSYNC_CPU_SPIN=0` leaves idle workers to rayon's sleep, for A/B measurements.
//!
//! Steps: the node loop runs a graph's `kernels::plan` (attention chains fused), computed once
//! per graph and kept in the backend's [`Plans`] while the graph is alive.
//!
//! Invariants: nodes run one at a time in graph order (kernels parallelise inside themselves);
//! the caller returns only after the loop has ended, and a kernel's panic is re-raised on the
//! caller, as if the loop had run there. A helper only runs jobs the kernels forked, so which
//! thread runs a job never changes a result (kernels' results do not depend on it). A helper
//! waits for nothing but its own loop, which is already running when the helper starts to spin
//! and needs no helper to finish, so it cannot deadlock that loop or another graph sharing the
//! pool (another graph's job beneath a helper waits at most until this loop ends).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use lowsync_backend::{env, interrupt, Error, ExecGraph, Result};
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
    let threads = rayon::current_num_threads();
    // A pool larger than the CPUs would have helpers spinning on the cores the loop needs.
    static CPUS: OnceLock<usize> = OnceLock::new();
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let spinning = spin()? && threads > 1 && threads <= cpus;
    let stop = AtomicBool::new(false);
    let team = Team::new(threads - 1);
    let outcome = Mutex::new(None);
    let finished = Condvar::new();
    let run_loop = || {
        if spinning {
            team.gather();
        }
        let r = catch_unwind(AssertUnwindSafe(|| {
            run_nodes(graph, steps, store, &|| stop.load(Ordering::Acquire))
        }));
        team.state.store(DONE, Ordering::SeqCst);
        *outcome.lock() = Some(r);
        finished.notify_one();
    };
    rayon::in_place_scope(|s| {
        if spinning {
            // The loop on pool thread 0, a helper on each other one: a broadcast job runs
            // only on its own thread, so no helper can take the loop's place.
            s.spawn_broadcast(|_, ctx| {
                if ctx.index() == 0 {
                    run_loop();
                } else {
                    team.help();
                }
            });
        } else {
            s.spawn(|_| run_loop());
        }
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

/// `LOWSYNC_CPU_SPIN`: whether idle pool threads look for work while a graph runs (default
/// 1), read once per process.
fn spin() -> Result<bool> {
    const VAR: &str = "LOWSYNC_CPU_SPIN";
    static ON: OnceLock<std::result::Result<bool, String>> = OnceLock::new();
    ON.get_or_init(|| env::flag(VAR, true).map_err(|_| std::env::var(VAR).unwrap_or_default()))
        .clone()
        .map_err(|value| Error::Env {
            var: VAR,
            value,
            expected: "0 or 1",
        })
}

/// States of a [`Team`].
const NOT_STARTED: u8 = 0;
const GATHERING: u8 = 1;
const RUNNING: u8 = 2;
const DONE: u8 = 3;

/// How long the loop waits for the helpers to report before it starts without the late ones
/// (they usually report within 0-25 us of a step's start on the 2-vCPU VM, where both threads
/// wake from rayon's sleep; a wait in vain costs the step this much).
const GATHER_WAIT: Duration = Duration::from_micros(50);

/// How long a helper that started before the loop waits for it (its own core's time only).
const LOOP_WAIT: Duration = Duration::from_micros(500);

/// The helpers of one graph run and the loop's progress.
///
/// A helper must never spin beneath work the loop waits for: it may be run by a thread that is
/// itself waiting inside a job (rayon runs queued jobs while a join waits), and spinning until
/// the loop ends would then never return to that job. So a helper spins only if it started
/// before the loop forked anything (the loop gathers the helpers first, then runs); one that
/// finds the loop already running returns at once, and one that finds it not started yet waits
/// a bounded time for it. While it spins the loop is running, so the loop ends whatever the
/// helper's thread has beneath it.
struct Team {
    helpers: usize,
    state: AtomicU8,
    arrived: AtomicUsize,
}

impl Team {
    fn new(helpers: usize) -> Team {
        Team {
            helpers,
            state: AtomicU8::new(NOT_STARTED),
            arrived: AtomicUsize::new(0),
        }
    }

    /// The loop's side: waits (at most [`GATHER_WAIT`]) for every helper to report.
    fn gather(&self) {
        self.state.store(GATHERING, Ordering::SeqCst);
        let t0 = Instant::now();
        while self.arrived.load(Ordering::SeqCst) < self.helpers && t0.elapsed() < GATHER_WAIT {
            std::hint::spin_loop();
        }
        self.state.store(RUNNING, Ordering::SeqCst);
    }

    /// A helper's side: runs jobs forked onto the pool (stolen from the loop's thread or any
    /// other) until the loop is done, without ever sleeping; returns at once when it came too
    /// late to be safe.
    fn help(&self) {
        let t0 = Instant::now();
        loop {
            match self.state.load(Ordering::SeqCst) {
                NOT_STARTED if t0.elapsed() < LOOP_WAIT => std::hint::spin_loop(),
                GATHERING => break,
                _ => return,
            }
        }
        self.arrived.fetch_add(1, Ordering::SeqCst);
        while self.state.load(Ordering::SeqCst) != DONE {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::hint::spin_loop();
            }
        }
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

#[cfg(test)]
mod tests {
    //! Graphs run from several threads at once share the global pool, its thread 0 and its
    //! helpers: each must finish, with the bits it has alone.

    use lowsync_backend::{ExecNode, TensorRef};
    use lowsync_graph::{DType, Op};

    use super::*;

    fn tensor(store: &Store, shape: &[usize], values: &[f32]) -> TensorRef {
        let id = store.alloc(values.len() * 4).unwrap();
        let p = store.span_write(id, 0, values.len() * 4).unwrap();
        // SAFETY: the buffer was just allocated with room for `values`.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), p.cast::<f32>(), values.len()) };
        let strides = match shape {
            [_, n] => vec![*n, 1],
            _ => vec![1],
        };
        TensorRef {
            buffer: id,
            byte_offset: 0,
            dtype: DType::F32,
            shape: shape.to_vec(),
            strides,
        }
    }

    fn node(op: Op, dst: &TensorRef, srcs: &[&TensorRef]) -> ExecNode {
        ExecNode {
            op,
            name: "test".into(),
            dst: dst.clone(),
            srcs: srcs.iter().map(|&s| s.clone()).collect(),
        }
    }

    /// `layers` rounds of `x = x + x @ W.T` (a product large enough to fork, then an add on
    /// the loop's thread), in buffers of its own; the graph and its output.
    fn graph(
        store: &Store,
        w: &TensorRef,
        layers: usize,
        seed: f32,
    ) -> (Arc<ExecGraph>, TensorRef) {
        let n = w.shape[0];
        let x0: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * seed).sin()) / n as f32)
            .collect();
        let x = tensor(store, &[1, n], &x0);
        let y = tensor(store, &[1, n], &vec![0.0; n]);
        let wt = TensorRef {
            shape: vec![n, n],
            strides: vec![1, n],
            ..w.clone()
        };
        let mut nodes = Vec::new();
        for _ in 0..layers {
            nodes.push(node(Op::MulMat, &y, &[&x, &wt]));
            nodes.push(node(Op::Add, &x, &[&x, &y]));
        }
        let g = ExecGraph {
            nodes,
            scratch: None,
        };
        (Arc::new(g), x)
    }

    fn read(store: &Store, t: &TensorRef) -> Vec<u8> {
        let len = t.byte_extent();
        let p = store.span(t.buffer, 0, len).unwrap();
        // SAFETY: `len` bytes of the buffer.
        unsafe { std::slice::from_raw_parts(p, len) }.to_vec()
    }

    #[test]
    fn graphs_run_from_several_threads_at_once_finish_with_their_own_results() {
        let n = 512;
        let store = Store::new("cpu");
        let wv: Vec<f32> = (0..n * n)
            .map(|i| ((i % 97) as f32 - 48.0) / 4096.0)
            .collect();
        let w = tensor(&store, &[n, n], &wv);
        let runs: Vec<_> = (0..3)
            .map(|t| graph(&store, &w, 8, 1.0 + t as f32))
            .collect();
        let plans = Plans::default();
        let alone: Vec<Vec<u8>> = runs
            .iter()
            .map(|(g, out)| {
                // The graph updates x in place: put its starting values back afterwards.
                let before = read(&store, out);
                run_graph(g, &plans, &store, &|| false).unwrap();
                let r = read(&store, out);
                let p = store.span_write(out.buffer, 0, before.len()).unwrap();
                // SAFETY: `before` was read from the same span.
                unsafe { std::ptr::copy_nonoverlapping(before.as_ptr(), p, before.len()) };
                r
            })
            .collect();
        std::thread::scope(|s| {
            for (i, (g, out)) in runs.iter().enumerate() {
                let (store, plans, alone) = (&store, &plans, &alone);
                s.spawn(move || {
                    let before = read(store, out);
                    for _ in 0..40 {
                        let p = store.span_write(out.buffer, 0, before.len()).unwrap();
                        // SAFETY: `before` was read from the same span, which only this
                        // thread's graph uses.
                        unsafe { std::ptr::copy_nonoverlapping(before.as_ptr(), p, before.len()) };
                        run_graph(g, plans, store, &|| false).unwrap();
                        assert_eq!(read(store, out), alone[i], "graph {i}");
                    }
                });
            }
        });
    }
}
