//! SyncStats: the counters that prove what the host did.
//!
//! Why: the product's claim is "fewer host waits, same results". The counts are the proof, so
//! they are plain integers, always on, and incremented inside each backend's own blocking or
//! submitting primitive (ARCHITECTURE §3) — never by the scheduler on a backend's behalf.
//!
//! Counting rules: a host wait is one call in which the host thread blocks until device work
//! completes; a driver sync is a real call into the driver or worker that waits; an elided sync
//! is a `synchronize` that found nothing outstanding and returned without such a call (it is
//! not a host wait); a device wait is a stream told to wait, on the device, for another stream's
//! event — counted when it is queued, whether or not the event had completed, so the count
//! depends on what the program did, never on timing. A backend that cannot make its stream wait
//! on an event waits on the host instead, through the event's own `synchronize`, and that is
//! counted by the event's backend as a host wait (or an elided sync).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters of one backend (atomics; shared with its worker threads).
        #[derive(Debug, Default)]
        pub struct SyncStats {
            $($(#[$doc])* pub $name: AtomicU64,)*
        }

        /// A plain copy of the counters at one moment.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl SyncStats {
            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }

            /// Zeroes every counter but the `staging_bytes_in_use` gauge.
            pub fn reset(&self) {
                $(if stringify!($name) != "staging_bytes_in_use" {
                    self.$name.store(0, Ordering::Relaxed);
                })*
            }
        }

        impl StatsSnapshot {
            /// The counter names, in a fixed order (the keys of `ctx.stats()` in Python).
            pub const NAMES: &'static [&'static str] = &[$(stringify!($name),)*];

            /// `(name, value)` pairs in [`Self::NAMES`] order.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }

            /// Element-wise sum (for the total over backends).
            pub fn add(&self, o: &StatsSnapshot) -> StatsSnapshot {
                StatsSnapshot { $($name: self.$name + o.$name,)* }
            }

            /// Element-wise difference `self - earlier` (gauges keep `self`'s value).
            pub fn since(&self, earlier: &StatsSnapshot) -> StatsSnapshot {
                let mut d = StatsSnapshot { $($name: self.$name.saturating_sub(earlier.$name),)* };
                d.staging_bytes_in_use = self.staging_bytes_in_use;
                d
            }
        }
    };
}

counters! {
    /// Calls in which the host blocked until device work completed.
    host_waits,
    /// Real calls into the driver or worker that wait.
    driver_syncs,
    /// `synchronize` calls that found nothing outstanding (no driver call, no host wait).
    elided_syncs,
    /// Device-side waits on another stream's event queued on this stream (`event_wait`, the
    /// wait inside a copy between streams): the stream stalls, the host does not.
    device_waits,
    /// Work handed to the device: queue submits, kernel/graph launches, worker work items.
    submits,
    /// Submissions that carried no work.
    empty_submits,
    /// Host-to-device copies.
    h2d_copies,
    h2d_bytes,
    /// Device-to-host copies.
    d2h_copies,
    d2h_bytes,
    /// Device-to-device copies (within or between backends).
    d2d_copies,
    d2d_bytes,
    /// Kernels run (one per compute node).
    kernel_launches,
    /// Graph captures and replays (CUDA graphs, pre-recorded command buffers).
    graph_captures,
    graph_launches,
    /// Device time of compute graphs in nanoseconds, measured by the device's timing events
    /// (only backends asked to time: CUDA with `LOWSYNC_CUDA_TIMING=1`; 0 elsewhere).
    device_ns,
    /// Bytes of staging memory held right now (a gauge).
    staging_bytes_in_use,
    /// Buffers allocated for a reserve.
    reserves,
    /// Buffers re-allocated because a plan grew.
    reallocs,
}

/// Device time of one kernel variant, summed over the dispatches a profile saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelTime {
    /// The kernel variant (e.g. `mul_mat_vec_k.d_f32.a_f32.b_f16`).
    pub name: String,
    /// Dispatches timed.
    pub count: u64,
    /// Device time of those dispatches in nanoseconds.
    pub device_ns: u64,
    /// Bytes the dispatches bind for reading (a mat-vec's weight bytes dominate its share), so
    /// `read_bytes / device_ns` is an effective bandwidth.
    pub read_bytes: u64,
}

/// Adds `n` to a counter.
#[inline]
pub fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}
