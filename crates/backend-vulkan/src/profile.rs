//! Per-dispatch device time (`LOWSYNC_VK_PROFILE=1`): which kernels a decode step's device
//! time goes to.
//!
//! Why: on a real GPU a step's device time, not its submissions, is what separates lowsync
//! from the fastest Vulkan decoders, and a total per step does not say which shader to fix.
//! Each dispatch's own device time, summed per kernel variant, does; with the bytes each
//! dispatch binds for reading, a mat-vec's effective bandwidth follows.
//!
//! Strategy: when the backend profiles (and the compute queue writes timestamps), a graph's
//! commands are recorded into the open command buffer on every step rather than replayed from
//! a recording, so each submission owns its queries: a query pool big enough for the graph is
//! reset at the start of its commands, one timestamp is written before the first command and
//! one at the bottom of the pipe after every command. Command `i`'s time is the difference
//! between the timestamps around it: the barrier before it and any overlap with its
//! neighbours count towards it, so the times of a step add up to its device time. A
//! bottom-of-pipe timestamp waits for the commands before it on most drivers, so dispatches
//! that would overlap (no barrier between them) run one after another while profiling: the
//! figures are each kernel's own time, and their sum can exceed an unprofiled step's. Pools wait
//! with the submission's compute value; when a host wait or poll sees that value complete,
//! their timestamps are read (the submission completed, so they are available) and added to
//! totals per kernel variant, and the pool is reused.
//!
//! Invariants: nothing here runs when profiling is off (the backend holds no profiler); a query
//! pool is reset or read only once the submission that wrote it completed; figures cover the
//! steps completed since the last reset.

use std::collections::HashMap;
use std::sync::Arc;

use ash::vk;
use lowsync_backend::{KernelTime, Result};

use crate::device::{vk_err, Device};

/// What one timed command is reported as.
#[derive(Clone, Debug)]
pub(crate) struct Label {
    /// The kernel variant, or `copy` for a copy of a graph's plan.
    pub name: Arc<str>,
    /// Bytes the command binds for reading.
    pub read_bytes: u64,
}

/// Queries of one recorded graph, waiting for their submission.
struct Timed {
    /// The compute value of the submission; 0 while its command buffer is still open.
    value: u64,
    pool: vk::QueryPool,
    capacity: u32,
    /// One label per timed command, in order (timestamp `i + 1` closes command `i`).
    labels: Vec<Label>,
}

#[derive(Clone, Copy, Default)]
struct Total {
    count: u64,
    ticks: f64,
    read_bytes: u64,
}

/// Timestamp queries around dispatches and the totals they add up to.
pub(crate) struct Profiler {
    /// Nanoseconds per timestamp tick.
    period_ns: f64,
    /// The bits of a timestamp the queue writes.
    valid_mask: u64,
    free: Vec<(vk::QueryPool, u32)>,
    timed: Vec<Timed>,
    totals: HashMap<Arc<str>, Total>,
}

impl Profiler {
    /// A profiler for `dev`'s compute queue; `None` when profiling is off or the queue writes
    /// no timestamps (a warning says so).
    pub(crate) fn new(dev: &Device, enabled: bool) -> Option<Profiler> {
        if !enabled {
            return None;
        }
        let bits = dev.compute.timestamp_bits;
        if bits == 0 || dev.limits.timestamp_period <= 0.0 {
            tracing::warn!(
                "LOWSYNC_VK_PROFILE: the compute queue of {} writes no timestamps",
                dev.name
            );
            return None;
        }
        Some(Profiler {
            period_ns: f64::from(dev.limits.timestamp_period),
            valid_mask: if bits >= 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            },
            free: Vec::new(),
            timed: Vec::new(),
            totals: HashMap::new(),
        })
    }

    /// A reset query pool of at least `n` queries, reset by a command recorded into `cmd`
    /// (queries of one pool are used in submission order, so the reset precedes the writes).
    pub(crate) fn begin(
        &mut self,
        device: &ash::Device,
        cmd: vk::CommandBuffer,
        labels: Vec<Label>,
    ) -> Result<vk::QueryPool> {
        let n = labels.len() as u32 + 1;
        let (pool, capacity) = match self.free.iter().position(|&(_, c)| c >= n) {
            Some(i) => self.free.swap_remove(i),
            None => {
                let capacity = n.next_power_of_two().max(64);
                let info = vk::QueryPoolCreateInfo::default()
                    .query_type(vk::QueryType::TIMESTAMP)
                    .query_count(capacity);
                // SAFETY: valid create info on a live device.
                let pool = unsafe { device.create_query_pool(&info, None) }
                    .map_err(|r| vk_err("vkCreateQueryPool", r))?;
                (pool, capacity)
            }
        };
        // SAFETY: `cmd` is recording; the pool is free (its last submission completed).
        unsafe {
            device.cmd_reset_query_pool(cmd, pool, 0, capacity);
            device.cmd_write_timestamp(cmd, vk::PipelineStageFlags::BOTTOM_OF_PIPE, pool, 0);
        }
        self.timed.push(Timed {
            value: 0,
            pool,
            capacity,
            labels,
        });
        Ok(pool)
    }

    /// The open command buffer was submitted as compute value `value`.
    pub(crate) fn submitted(&mut self, value: u64) {
        for t in self.timed.iter_mut().filter(|t| t.value == 0) {
            t.value = value;
        }
    }

    /// The open command buffer was never submitted: its pools are free again.
    pub(crate) fn abandon_open(&mut self) {
        let (open, rest): (Vec<Timed>, Vec<Timed>) =
            self.timed.drain(..).partition(|t| t.value == 0);
        self.timed = rest;
        self.free
            .extend(open.into_iter().map(|t| (t.pool, t.capacity)));
    }

    /// Adds the timestamps of every submission up to compute value `done` to the totals.
    pub(crate) fn harvest(&mut self, device: &ash::Device, done: u64) -> Result<()> {
        let mut i = 0;
        while i < self.timed.len() {
            let t = &self.timed[i];
            if t.value == 0 || t.value > done {
                i += 1;
                continue;
            }
            let t = self.timed.swap_remove(i);
            let mut ts = vec![0u64; t.labels.len() + 1];
            // SAFETY: the submission that wrote these queries completed, so every one is
            // available; `ts` holds one 64-bit value per query.
            let r = unsafe {
                device.get_query_pool_results(
                    t.pool,
                    0,
                    &mut ts,
                    vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
                )
            };
            self.free.push((t.pool, t.capacity));
            r.map_err(|r| vk_err("vkGetQueryPoolResults", r))?;
            for (w, label) in ts.windows(2).zip(&t.labels) {
                let ticks = w[1].wrapping_sub(w[0]) & self.valid_mask;
                let e = self.totals.entry(label.name.clone()).or_default();
                e.count += 1;
                e.ticks += ticks as f64;
                e.read_bytes += label.read_bytes;
            }
        }
        Ok(())
    }

    /// The totals per kernel variant, longest first.
    pub(crate) fn times(&self) -> Vec<KernelTime> {
        let mut out: Vec<KernelTime> = self
            .totals
            .iter()
            .map(|(name, t)| KernelTime {
                name: name.to_string(),
                count: t.count,
                device_ns: (t.ticks * self.period_ns).round() as u64,
                read_bytes: t.read_bytes,
            })
            .collect();
        out.sort_by(|a, b| b.device_ns.cmp(&a.device_ns).then(a.name.cmp(&b.name)));
        out
    }

    /// Forgets the totals (submissions still in flight are counted when they complete).
    pub(crate) fn reset(&mut self) {
        self.totals.clear();
    }

    /// Destroys every pool; the device is idle.
    pub(crate) fn destroy(&mut self, device: &ash::Device) {
        // SAFETY: no submission is pending (the caller waited for the device to go idle).
        unsafe {
            for (pool, _) in self.free.drain(..) {
                device.destroy_query_pool(pool, None);
            }
            for t in self.timed.drain(..) {
                device.destroy_query_pool(t.pool, None);
            }
        }
    }
}
