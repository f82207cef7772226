//! CUDA graph capture: queuing a compute graph eagerly, capturing it, or replaying it.
//!
//! Why: replay turns a step's hundreds of launches into one `cuGraphLaunch`, and whether it may
//! is `graph_cache`'s decision; this is the procedure that acts on it, the one place that runs
//! the executor (`fusion::run_graph`) inside a stream capture.
//!
//! Strategy: eager runs and captures run the very same executor, so a captured graph holds the
//! kernels an eager run would queue. A capture that fails (an op that cannot be captured,
//! scratch that would have to grow) ran nothing: the graph runs eagerly now and stays eager.
//! Kernel error tags handed out during a capture are kept for good, since every replay may
//! report them.
//!
//! Invariants: the stream is never left capturing (`end_capture` follows every successful
//! `begin_capture`); tokens are bit-identical with replay on and off.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use lowsync_backend::{ExecGraph, Result};

use crate::device::Inner;
use crate::exec::launch::Exec;
use crate::fusion;
use crate::graph_cache::Action;
use crate::memory::Scratch;

/// Queues `graph` through the capture cache: eager the first time, captured the second,
/// replayed after (see [`crate::graph_cache`]).
pub(crate) fn run_captured(
    inner: &Inner,
    graph: &Arc<ExecGraph>,
    scratch: &mut Scratch,
) -> Result<()> {
    let generation = inner.mem_generation.load(Ordering::Acquire) + scratch.moves();
    let mut cache = inner.graphs.lock();
    match cache.action(graph, generation) {
        Action::Eager => {
            drop(cache);
            fusion::run_graph(&mut Exec::new(inner, scratch), graph)
        }
        Action::Replay(exec) => inner
            .stream
            .graph_launch(exec)
            .map(|_| ())
            .map_err(|e| inner.driver_err("cuGraphLaunch", e)),
        Action::Capture => {
            let first_tag = inner.err_tags.lock().peek_next();
            let captured = match inner.stream.begin_capture() {
                Ok(()) => {
                    let ran = fusion::run_graph(&mut Exec::new(inner, scratch), graph);
                    let ended = inner.stream.end_capture();
                    match (ran, ended) {
                        (Ok(()), Ok(exec)) => Ok(exec),
                        (Err(e), _) => Err(e.to_string()),
                        (Ok(()), Err(e)) => Err(format!("cuStreamEndCapture: {e:?}")),
                    }
                }
                Err(e) => Err(format!("cuStreamBeginCapture: {e:?}")),
            };
            match captured {
                Ok(exec) => {
                    inner.err_tags.lock().keep_since(first_tag);
                    match cache.store(graph, exec) {
                        Some(exec) => inner
                            .stream
                            .graph_launch(exec)
                            .map(|_| ())
                            .map_err(|e| inner.driver_err("cuGraphLaunch", e)),
                        None => {
                            drop(cache);
                            fusion::run_graph(&mut Exec::new(inner, scratch), graph)
                        }
                    }
                }
                Err(why) => {
                    // Nothing of the failed capture ran: run the graph now, eagerly, and
                    // keep it eager.
                    tracing::debug!(backend = %inner.name, "CUDA graph capture refused: {why}");
                    cache.refuse(graph);
                    drop(cache);
                    fusion::run_graph(&mut Exec::new(inner, scratch), graph)
                }
            }
        }
    }
}
