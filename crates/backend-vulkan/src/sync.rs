//! The backend's shared core ([`Inner`]) and its host waits.
//!
//! Why: the backend, its events, its gates and its readbacks all reach the same stream, so
//! they share one `Inner` behind an `Arc`. Host waits are where the contract's counting
//! matters most: a wait is counted inside the call that blocks (ARCHITECTURE §3), and one that
//! would find nothing outstanding is elided without a driver call (invariant 6).
//!
//! Strategy: a wait reads its target under the state lock, releases the lock, and blocks on
//! the timeline semaphores (`vkWaitSemaphores`) in slices of the interrupt poll interval, so a
//! gate can be opened and events polled while another thread waits, and Ctrl-C opens this
//! backend's gates so the queue drains before `Interrupted` is reported. With
//! `LOWSYNC_VK_LEGACY_SUBMITS=1`, `synchronize` is ggml's: an empty submission carrying a
//! fence, and a fence wait.
//!
//! Invariants: counts follow the tickets, never timing (a wait happens iff something was
//! enqueued since the last observed completion); the legacy switch is the only source of empty
//! submissions; dropping the backend opens every gate and waits for the device to go idle
//! before anything is destroyed.

use ash::vk;
use lowsync_backend::{bump, interrupt, BufferId, Error, Result, SyncStats};
use parking_lot::{Mutex, MutexGuard};

use crate::config::VkConfig;
use crate::device::{vk_err, Device};
use crate::memory::destroy_buffer;
use crate::ops::Limits;
use crate::stream::{signal_once, State};
use crate::timeline::Retire;
use crate::transfer::{RouteCounters, Routing};

/// Shared by the backend, its events and its gates.
pub(crate) struct Inner {
    pub name: String,
    pub config: VkConfig,
    pub dev: Device,
    pub stats: SyncStats,
    pub routes: RouteCounters,
    pub limits: Limits,
    pub alignment: usize,
    pub routing: Routing,
    pub compute_sem: vk::Semaphore,
    pub transfer_sem: Option<vk::Semaphore>,
    pub state: Mutex<State>,
}

impl Inner {
    pub(crate) fn device(&self) -> &ash::Device {
        &self.dev.device
    }

    /// Submits the open command buffer when it carries work.
    pub(crate) fn submit_open(&self) -> Result<()> {
        let mut st = self.state.lock();
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())
    }

    pub(crate) fn unknown(&self, id: BufferId) -> Error {
        Error::UnknownBuffer(id.0, self.name.clone())
    }

    /// Host wait until the stream passed `p`: elided (counted as such) when a wait already
    /// observed it, else one counted wait on the timelines `p` is still ahead on.
    pub(crate) fn wait_point(&self, p: Retire) -> Result<()> {
        let st = self.state.lock();
        let observed = Retire {
            compute: st.compute.observed,
            transfer: st.transfer.as_ref().map_or(0, |t| t.tl.observed),
        };
        drop(st);
        if p.done_by(observed) {
            bump(&self.stats.elided_syncs, 1);
            return Ok(());
        }
        let target = Retire {
            compute: if p.compute > observed.compute {
                p.compute
            } else {
                0
            },
            transfer: if p.transfer > observed.transfer {
                p.transfer
            } else {
                0
            },
        };
        self.wait(target)
    }

    /// Blocks until `target` completed: one host wait, one driver sync. Polls the interrupt
    /// hook; on Ctrl-C it opens this backend's gates so the queue drains, then reports
    /// `Interrupted` (the backend stays usable).
    pub(crate) fn wait(&self, target: Retire) -> Result<()> {
        bump(&self.stats.host_waits, 1);
        bump(&self.stats.driver_syncs, 1);
        let mut sems = Vec::with_capacity(2);
        let mut vals = Vec::with_capacity(2);
        if target.compute > 0 {
            sems.push(self.compute_sem);
            vals.push(target.compute);
        }
        if let (Some(t), true) = (self.transfer_sem, target.transfer > 0) {
            sems.push(t);
            vals.push(target.transfer);
        }
        if sems.is_empty() {
            return self.state.lock().complete(&self.dev, &self.stats, target);
        }
        let mut interrupted = false;
        let poll = interrupt::POLL_INTERVAL.as_nanos() as u64;
        loop {
            let info = vk::SemaphoreWaitInfo::default()
                .semaphores(&sems)
                .values(&vals);
            // SAFETY: live semaphores; the wait does not need the state lock.
            match unsafe { self.device().wait_semaphores(&info, poll) } {
                Ok(()) => break,
                Err(vk::Result::TIMEOUT) => {
                    if !interrupted && interrupt::requested() {
                        interrupted = true;
                        self.open_all_gates();
                    }
                }
                Err(r) => return Err(vk_err("vkWaitSemaphores", r)),
            }
        }
        let r = self.state.lock().complete(&self.dev, &self.stats, target);
        if interrupted {
            return Err(Error::Interrupted);
        }
        r
    }

    /// The legacy path's synchronize: an empty submission carrying a fence, and a fence wait.
    pub(crate) fn legacy_sync(&self, mut st: MutexGuard<'_, State>) -> Result<()> {
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())?;
        let fence = st.legacy_fence;
        // SAFETY: queue access under the state lock; an empty batch with a fence.
        let r = unsafe {
            self.device()
                .queue_submit(self.dev.compute.queue, &[], fence)
        };
        bump(&self.stats.submits, 1);
        bump(&self.stats.empty_submits, 1);
        r.map_err(|r| vk_err("vkQueueSubmit", r))?;
        let target = Retire {
            compute: st.compute.submitted,
            transfer: 0,
        };
        let transfer_left = st
            .transfer
            .as_ref()
            .filter(|t| t.tl.submitted > t.tl.observed)
            .map(|t| t.tl.submitted);
        drop(st);
        self.fence_wait(fence)?;
        self.state.lock().complete(&self.dev, &self.stats, target)?;
        if let Some(t) = transfer_left {
            self.wait(Retire {
                compute: 0,
                transfer: t,
            })?;
        }
        Ok(())
    }

    /// Waits for and resets the legacy fence: one host wait, one driver sync.
    pub(crate) fn fence_wait(&self, fence: vk::Fence) -> Result<()> {
        bump(&self.stats.host_waits, 1);
        bump(&self.stats.driver_syncs, 1);
        let poll = interrupt::POLL_INTERVAL.as_nanos() as u64;
        let mut interrupted = false;
        loop {
            // SAFETY: a live fence.
            match unsafe { self.device().wait_for_fences(&[fence], true, poll) } {
                Ok(()) => break,
                Err(vk::Result::TIMEOUT) => {
                    if !interrupted && interrupt::requested() {
                        interrupted = true;
                        self.open_all_gates();
                    }
                }
                Err(r) => return Err(vk_err("vkWaitForFences", r)),
            }
        }
        // SAFETY: signalled and no longer in use.
        unsafe { self.device().reset_fences(&[fence]) }.map_err(|r| vk_err("vkResetFences", r))?;
        if interrupted {
            return Err(Error::Interrupted);
        }
        Ok(())
    }

    /// Submits open work and waits for everything outstanding (one host wait), or returns
    /// at once when nothing is outstanding (no wait, nothing counted).
    pub(crate) fn drain(&self, st: MutexGuard<'_, State>) -> Result<()> {
        if !st.outstanding() {
            return Ok(());
        }
        if self.config.legacy_submits {
            return self.legacy_sync(st);
        }
        let mut st = st;
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())?;
        let target = st.wait_target();
        drop(st);
        match target {
            Some(t) => self.wait(t),
            None => Ok(()),
        }
    }

    pub(crate) fn open_all_gates(&self) {
        let st = self.state.lock();
        for s in &st.signals {
            signal_once(self.device(), s.sem, &s.signaled);
        }
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        let st = self.state.lock();
        if self.config.legacy_submits {
            return self.legacy_sync(st);
        }
        if !st.outstanding() {
            bump(&self.stats.elided_syncs, 1);
            return Ok(());
        }
        self.drain(st)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let device = self.dev.device.clone();
        let st = self.state.get_mut();
        // Work behind a closed gate would never finish: open every gate first.
        for s in &st.signals {
            signal_once(&device, s.sem, &s.signaled);
        }
        // SAFETY: nothing else uses the device now; waiting for idle makes every resource free.
        unsafe {
            let _ = device.device_wait_idle();
        }
        let Some(mut allocator) = st.allocator.take() else {
            return;
        };
        st.staging.destroy(&device, &mut allocator);
        st.readback.destroy(&device, &mut allocator);
        st.scratch.destroy(&device, &mut allocator);
        for (_, b) in st.buffers.drain() {
            destroy_buffer(&device, &mut allocator, b);
        }
        for (_, b) in st.graveyard.drain(..) {
            destroy_buffer(&device, &mut allocator, b);
        }
        if let Some(s) = st.status.take() {
            destroy_buffer(&device, &mut allocator, s.buf);
        }
        if let Some(b) = st.attn_parts.take() {
            destroy_buffer(&device, &mut allocator, b);
        }
        if let Some(b) = st.split_parts.take() {
            destroy_buffer(&device, &mut allocator, b);
        }
        st.pipelines.destroy(&device);
        if let Some(mut p) = st.profiler.take() {
            p.destroy(&device);
        }
        if let Some(t) = st.transfer.take() {
            t.destroy(&device);
        }
        // SAFETY: the device is idle; every object below was created by this backend.
        unsafe {
            for s in st.signals.drain(..) {
                device.destroy_semaphore(s.sem, None);
            }
            device.destroy_command_pool(st.pool, None);
            device.destroy_semaphore(st.compute.sem, None);
            device.destroy_fence(st.legacy_fence, None);
        }
        drop(allocator);
    }
}
