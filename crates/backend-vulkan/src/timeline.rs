//! Timeline semaphores and retire points: the tickets that sync elision and reclaiming are
//! built on.
//!
//! Why: the backend never asks the driver whether work is finished in order to decide whether
//! to wait; it compares numbers it keeps itself. Each queue route signals its own timeline
//! semaphore with increasing values, and the host remembers the last value it submitted and
//! the last it saw complete. Every resource a submission uses is stamped with the point in both
//! timelines after which it is free again.
//!
//! Strategy: a [`Timeline`] holds a semaphore and three counters: `submitted` (the last value a
//! submission signals), `observed` (the last value a host wait saw complete) and `completed`
//! (also raised by non-blocking queries, used only for reclaiming). A [`Retire`] is a pair of
//! values, one per timeline (compute, transfer); `0` means "not used on that timeline".
//! [`submit_timeline`] is the one place a command buffer is submitted with timeline waits and a
//! timeline signal: the compute stream's submissions, the transfer route's and the route's
//! calibration all go through it, so the waits, stage masks and signal are built once.
//!
//! Invariants: `completed >= observed` and neither exceeds `submitted`; counters only grow; a
//! resource is reused only when its `Retire` is `done_by` what completed.

use ash::vk;
use lowsync_backend::Result;

use crate::device::vk_err;

/// Where in the two timelines a resource is last used: it may be reused once the compute
/// timeline reached `compute` and the transfer timeline reached `transfer`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Retire {
    pub compute: u64,
    pub transfer: u64,
}

impl Retire {
    pub(crate) fn done_by(&self, done: Retire) -> bool {
        self.compute <= done.compute && self.transfer <= done.transfer
    }
    pub(crate) fn max(self, o: Retire) -> Retire {
        Retire {
            compute: self.compute.max(o.compute),
            transfer: self.transfer.max(o.transfer),
        }
    }
}

/// A timeline semaphore and what the host knows of it.
pub(crate) struct Timeline {
    pub sem: vk::Semaphore,
    /// The last value a submission signals.
    pub submitted: u64,
    /// The last value the host saw complete through a wait.
    pub observed: u64,
    /// The last value known complete (waits or non-blocking queries); used for reclaiming.
    pub completed: u64,
}

impl Timeline {
    /// A fresh timeline at value 0 with nothing submitted.
    pub(crate) fn new(device: &ash::Device) -> Result<Timeline> {
        Ok(Timeline {
            sem: create_timeline(device)?,
            submitted: 0,
            observed: 0,
            completed: 0,
        })
    }
}

/// Submits `cmd` to `queue` as one batch that waits, at `stage`, until each `(semaphore,
/// value)` of `waits` is reached and then signals `signal.0` to `signal.1`; `fence` is null but
/// on the legacy path. Counts nothing: the backend primitive that calls it counts its
/// submission (every call is one, failed or not).
///
/// # Safety
/// The caller serialises access to `queue` (the state lock, or a queue nobody else has yet);
/// `cmd` has ended recording; `cmd`, every semaphore and everything the commands use stay alive
/// until the signal value completed.
pub(crate) unsafe fn submit_timeline(
    device: &ash::Device,
    queue: vk::Queue,
    cmd: vk::CommandBuffer,
    waits: &[(vk::Semaphore, u64)],
    stage: vk::PipelineStageFlags,
    signal: (vk::Semaphore, u64),
    fence: vk::Fence,
) -> std::result::Result<(), vk::Result> {
    let wait_sems: Vec<vk::Semaphore> = waits.iter().map(|w| w.0).collect();
    let wait_vals: Vec<u64> = waits.iter().map(|w| w.1).collect();
    let stages = vec![stage; waits.len()];
    let signal_sems = [signal.0];
    let signal_vals = [signal.1];
    let cmds = [cmd];
    let mut tl = vk::TimelineSemaphoreSubmitInfo::default()
        .wait_semaphore_values(&wait_vals)
        .signal_semaphore_values(&signal_vals);
    let submit = vk::SubmitInfo::default()
        .wait_semaphores(&wait_sems)
        .wait_dst_stage_mask(&stages)
        .command_buffers(&cmds)
        .signal_semaphores(&signal_sems)
        .push_next(&mut tl);
    // SAFETY: per this function's contract.
    unsafe { device.queue_submit(queue, &[submit], fence) }
}

/// A timeline semaphore at value 0.
pub(crate) fn create_timeline(device: &ash::Device) -> Result<vk::Semaphore> {
    let mut ty = vk::SemaphoreTypeCreateInfo::default()
        .semaphore_type(vk::SemaphoreType::TIMELINE)
        .initial_value(0);
    let info = vk::SemaphoreCreateInfo::default().push_next(&mut ty);
    // SAFETY: valid create info.
    unsafe { device.create_semaphore(&info, None) }.map_err(|r| vk_err("vkCreateSemaphore", r))
}
