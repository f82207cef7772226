//! Device timing of compute graphs (`LOWSYNC_CUDA_TIMING`): the `device_ns` counter.
//!
//! Why: the counters say how often the host waits; what a token costs on the device needs the
//! device's own clock, since host timestamps include launch and wait latency.
//!
//! Strategy: a pair of timing events is recorded around each compute graph (timing events
//! are not free, so this is off by default); a pair is read only once a completed wait
//! covered its end record's ticket, so reading it never blocks, and its events are reused.
//!
//! Invariant: `collect` adds each pair exactly once, and never before a wait observed it.

use std::collections::VecDeque;

use lowsync_backend::{bump, SyncStats};

use crate::driver::{CuDriver, CuTimedEvent};
use crate::tickets::TicketStream;

/// Timing events around compute graphs, read back when a wait observed them.
#[derive(Default)]
pub(crate) struct Timing {
    /// (start, end, ticket of the end record)
    pending: VecDeque<(CuTimedEvent, CuTimedEvent, u64)>,
    free: Vec<CuTimedEvent>,
}

impl Timing {
    fn event(&mut self) -> std::result::Result<CuTimedEvent, cudarc::driver::DriverError> {
        match self.free.pop() {
            Some(e) => Ok(e),
            None => CuTimedEvent::new(),
        }
    }

    /// Records the start of a timed graph.
    pub(crate) fn start(
        &mut self,
        stream: &TicketStream<CuDriver>,
    ) -> std::result::Result<CuTimedEvent, cudarc::driver::DriverError> {
        let ev = self.event()?;
        stream.record_event(&ev.0)?;
        Ok(ev)
    }

    /// Records the end of a timed graph begun with `start`.
    pub(crate) fn end(
        &mut self,
        stream: &TicketStream<CuDriver>,
        start: CuTimedEvent,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        let ev = self.event()?;
        let ticket = stream.record_event(&ev.0)?;
        self.pending.push_back((start, ev, ticket));
        Ok(())
    }

    /// Adds the device time of every pair a wait has covered to `device_ns`.
    pub(crate) fn collect(&mut self, observed: u64, stats: &SyncStats) {
        while self.pending.front().is_some_and(|p| p.2 <= observed) {
            let (start, end, _) = self.pending.pop_front().expect("checked");
            if let Ok(ms) = end.elapsed_since(&start) {
                bump(&stats.device_ns, (f64::from(ms) * 1e6) as u64);
            }
            self.free.push(start);
            self.free.push(end);
        }
    }

    pub(crate) fn clear(&mut self) {
        self.pending.clear();
        self.free.clear();
    }
}
