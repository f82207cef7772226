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

/// A timeline semaphore at value 0.
pub(crate) fn create_timeline(device: &ash::Device) -> Result<vk::Semaphore> {
    let mut ty = vk::SemaphoreTypeCreateInfo::default()
        .semaphore_type(vk::SemaphoreType::TIMELINE)
        .initial_value(0);
    let info = vk::SemaphoreCreateInfo::default().push_next(&mut ty);
    // SAFETY: valid create info.
    unsafe { device.create_semaphore(&info, None) }.map_err(|r| vk_err("vkCreateSemaphore", r))
}
