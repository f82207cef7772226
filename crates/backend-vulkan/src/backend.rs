//! `VulkanBackend`: the [`Backend`] contract on one Vulkan device.
//!
//! Why: this is the only type the scheduler sees. It turns each contract primitive into
//! stream operations (`crate::stream`) and does the counting the contract requires, inside
//! the primitive that submits or waits (ARCHITECTURE §3).
//!
//! Strategy: every primitive takes the state lock, records or submits, and releases the lock
//! before blocking, so a gate can be opened and events polled while another thread waits.
//! Host writes go (a) straight into mapped memory when the buffer is host-writable and the
//! stream is idle by its tickets — no copy on the device at all; or (b) into the staging
//! arena by memcpy before the call returns, with the copy recorded in the compute stream
//! behind queued work. Host-computed tensors copied with `cpy_tensor_async` take the compute
//! stream up to the crossover and the transfer route above it, when the device has a
//! transfer queue or `LOWSYNC_VK_FORCE_TRANSFER_SUBMIT=1`. Events are timeline points; the
//! gate is a timeline semaphore the host signals; another backend's event is bridged by a
//! helper thread that signals a semaphore the next submission waits on.
//!
//! Invariants: counts follow the tickets, never timing (a wait happens iff something was
//! enqueued since the last observed completion); `LOWSYNC_VK_LEGACY_SUBMITS=1` is the only
//! source of empty submissions; a blocking call is exactly one host wait unless its data
//! exceeds the staging cap (then one more per refill, counted).

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use ash::vk;
use gpu_allocator::vulkan::{Allocator, AllocatorCreateDesc};
use gpu_allocator::MemoryLocation;
use lowsync_backend::{
    bump, interrupt, with_host_source, Backend, BufferId, BufferType, BufferUsage, Caps,
    DeviceKind, Error, Event, ExecGraph, ExecNode, Gate, Readback, Result, SyncStats, TensorRef,
};
use lowsync_graph::{DType, Op};
use parking_lot::{Mutex, MutexGuard};

use crate::calibrate::{self, Crossover};
use crate::config::VkConfig;
use crate::device::{unavailable, vk_err, Device};
use crate::memory::{create_buffer, destroy_buffer, Arena, DevBuffer, Placement, Retire};
use crate::ops::{self, Limits, Res, Status};
use crate::pipelines::{Bind, Pipelines};
use crate::stream::{
    barrier, create_pool, create_timeline, ErrorSite, GraphPlan, HostSignal, PendingRead,
    ReadTarget, Recorded, State, StatusWords, Timeline, Tracker, TransferRoute,
};

/// Smallest staging / readback chunk.
const ARENA_MIN_CHUNK: u64 = 1 << 20;
/// Staging and readback never hold more than this; larger transfers go in pieces.
const ARENA_CAP: u64 = 256 << 20;
/// Device scratch (private copies of overlapping sources) cap.
const SCRATCH_CAP: u64 = 1 << 30;
/// Graph plans kept for replay (a model has a few shape buckets).
const PLAN_CACHE_MAX: usize = 64;

/// Copies per route of `cpy_tensor_async` and staged writes (the shared `SyncStats` count
/// every one of them as an H2D copy).
#[derive(Debug, Default)]
pub struct RouteCounters {
    /// Copies recorded in the compute stream.
    pub compute_stream_copies: AtomicU64,
    pub compute_stream_bytes: AtomicU64,
    /// Copies sent as their own submissions on the transfer route.
    pub transfer_copies: AtomicU64,
    pub transfer_bytes: AtomicU64,
    /// Staged writes that were a plain memcpy into mapped memory (idle stream).
    pub direct_writes: AtomicU64,
}

/// A copy of the route counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteSnapshot {
    pub compute_stream_copies: u64,
    pub compute_stream_bytes: u64,
    pub transfer_copies: u64,
    pub transfer_bytes: u64,
    pub direct_writes: u64,
}

impl RouteCounters {
    fn snapshot(&self) -> RouteSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RouteSnapshot {
            compute_stream_copies: l(&self.compute_stream_copies),
            compute_stream_bytes: l(&self.compute_stream_bytes),
            transfer_copies: l(&self.transfer_copies),
            transfer_bytes: l(&self.transfer_bytes),
            direct_writes: l(&self.direct_writes),
        }
    }
}

/// Shared by the backend, its events and its gates.
pub(crate) struct Inner {
    name: String,
    config: VkConfig,
    dev: Device,
    stats: SyncStats,
    routes: RouteCounters,
    limits: Limits,
    alignment: usize,
    crossover: Option<Crossover>,
    compute_sem: vk::Semaphore,
    transfer_sem: Option<vk::Semaphore>,
    state: Mutex<State>,
}

/// The Vulkan backend (`vulkan`, `vulkan:N`).
pub struct VulkanBackend {
    inner: Arc<Inner>,
}

impl VulkanBackend {
    /// Opens the device `config` names and builds a backend called `name`.
    pub fn new(name: &str, config: VkConfig) -> Result<Self> {
        let dev = Device::open(&config)?;
        let device = dev.device.clone();
        let mut allocator = Allocator::new(&AllocatorCreateDesc {
            instance: dev.instance().clone(),
            device: device.clone(),
            physical_device: dev.pdev,
            debug_settings: Default::default(),
            buffer_device_address: false,
            allocation_sizes: Default::default(),
        })
        .map_err(|e| unavailable(format!("gpu-allocator: {e}")))?;
        let mut families = vec![dev.compute.family];
        if let Some(t) = dev.transfer {
            families.push(t.family);
        }
        let transfer_queue = match (dev.transfer, config.force_transfer_submit) {
            (Some(t), _) => Some(t),
            (None, true) => Some(dev.compute),
            (None, false) => None,
        };
        let crossover = match (config.compute_stream_copy_max, transfer_queue) {
            (Some(b), _) => Some(Crossover {
                copy_max_bytes: b,
                overhead_ns: 0.0,
                h2d_bytes_per_s: 0.0,
                measured: false,
            }),
            (None, Some(q)) => Some(calibrate::crossover(&dev, q, &mut allocator)?),
            (None, None) => None,
        };
        let compute_sem = create_timeline(&device)?;
        let pool = create_pool(&device, dev.compute.family)?;
        let transfer = match transfer_queue {
            None => None,
            Some(q) => Some(TransferRoute {
                queue: q.queue,
                pool: create_pool(&device, q.family)?,
                free: Vec::new(),
                inflight: VecDeque::new(),
                tl: Timeline {
                    sem: create_timeline(&device)?,
                    submitted: 0,
                    observed: 0,
                    completed: 0,
                },
                waited_by_compute: 0,
            }),
        };
        let transfer_sem = transfer.as_ref().map(|t| t.tl.sem);
        // SAFETY: valid create info.
        let legacy_fence = unsafe { device.create_fence(&vk::FenceCreateInfo::default(), None) }
            .map_err(|r| vk_err("vkCreateFence", r))?;
        // Staging lives in host memory (host-cached where offered): a copy from it crosses the
        // bus, as on a GPU without ReBAR.
        let host = Placement {
            location: MemoryLocation::GpuToCpu,
            host_access: true,
        };
        let status_buf = create_buffer(&device, &mut allocator, 16, host, &families, "status")?;
        let status_ptr = status_buf
            .write_ptr
            .ok_or_else(|| unavailable("no host-visible coherent memory for status words"))?
            .as_ptr()
            .cast::<u32>();
        // SAFETY: 16 mapped bytes, not yet used by the device.
        unsafe { std::ptr::write_bytes(status_ptr, 0, 4) };
        let limits = Limits {
            offset_align: dev.limits.min_storage_buffer_offset_alignment.max(4),
            max_range: u64::from(dev.limits.max_storage_buffer_range),
            max_groups: dev.limits.max_compute_work_group_count,
            has_f64: dev.has_f64,
        };
        let alignment = (limits.offset_align as usize).max(64);
        let state = State {
            allocator: Some(allocator),
            buffers: HashMap::new(),
            staging: Arena::new(
                "staging",
                host,
                ARENA_MIN_CHUNK,
                ARENA_CAP,
                families.clone(),
            ),
            readback: Arena::new(
                "readback",
                Placement {
                    location: MemoryLocation::GpuToCpu,
                    host_access: true,
                },
                ARENA_MIN_CHUNK,
                ARENA_CAP,
                families.clone(),
            ),
            scratch: Arena::new(
                "scratch",
                Placement {
                    location: MemoryLocation::GpuOnly,
                    host_access: false,
                },
                ARENA_MIN_CHUNK,
                SCRATCH_CAP,
                families.clone(),
            ),
            pipelines: Pipelines::new(&device)?,
            compute: Timeline {
                sem: compute_sem,
                submitted: 0,
                observed: 0,
                completed: 0,
            },
            pool,
            free_cmds: Vec::new(),
            inflight: VecDeque::new(),
            transfer_marks: VecDeque::new(),
            plans: HashMap::new(),
            generation: 0,
            transfer,
            open: None,
            signals: Vec::new(),
            graveyard: Vec::new(),
            pending_reads: Vec::new(),
            status: Some(StatusWords {
                buf: status_buf,
                ptr: status_ptr,
            }),
            error_sites: HashMap::new(),
            next_tag: 0,
            legacy_fence,
            families,
        };
        tracing::info!(
            backend = name,
            device = %dev.name,
            crossover = ?crossover,
            no_host_visible_vram = config.no_host_visible_vram,
            legacy_submits = config.legacy_submits,
            "Vulkan backend ready"
        );
        Ok(VulkanBackend {
            inner: Arc::new(Inner {
                name: name.to_string(),
                config,
                dev,
                stats: SyncStats::default(),
                routes: RouteCounters::default(),
                limits,
                alignment,
                crossover,
                compute_sem,
                transfer_sem,
                state: Mutex::new(state),
            }),
        })
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.inner.dev.name
    }

    /// The settings this backend was built with.
    pub fn config(&self) -> &VkConfig {
        &self.inner.config
    }

    /// Warnings and errors the validation layer reported so far (empty without validation).
    pub fn validation_messages(&self) -> Vec<String> {
        self.inner.dev.inst.messages.lock().clone()
    }

    /// Copies per route.
    pub fn route_stats(&self) -> RouteSnapshot {
        self.inner.routes.snapshot()
    }

    /// The transfer-route crossover (`None`: this device has no transfer route).
    pub fn crossover(&self) -> Option<Crossover> {
        self.inner.crossover
    }

    /// Whether the device has a dedicated transfer queue.
    pub fn has_transfer_queue(&self) -> bool {
        self.inner.dev.transfer.is_some()
    }

    /// Bytes of staging memory the arena holds (used or not).
    pub fn staging_capacity(&self) -> u64 {
        self.inner.state.lock().staging.capacity()
    }

    /// Descriptor sets cached for reuse.
    pub fn cached_descriptor_sets(&self) -> usize {
        self.inner.state.lock().pipelines.cached_sets()
    }

    /// Whether the host reads `id` directly (mapped, host-cached memory).
    pub fn is_host_readable(&self, id: BufferId) -> bool {
        self.inner
            .state
            .lock()
            .buffers
            .get(&id)
            .is_some_and(|b| b.write_ptr.is_some() && b.host_read)
    }

    /// Whether the host writes `id` directly (mapped memory and not the no-ReBAR path).
    pub fn is_host_writable(&self, id: BufferId) -> bool {
        self.inner
            .state
            .lock()
            .buffers
            .get(&id)
            .is_some_and(|b| b.write_ptr.is_some())
    }

    /// Test-only: records two fills of the same bytes of `id` with no barrier between them
    /// (a write-after-write hazard the synchronization validation layer must report),
    /// submits and waits. Bypasses the hazard tracker on purpose.
    #[doc(hidden)]
    pub fn debug_record_unsynchronized_writes(&self, id: BufferId) -> Result<()> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        let b = st
            .buffers
            .get(&id)
            .map(|b| b.buffer)
            .ok_or_else(|| Error::UnknownBuffer(id.0, inner.name.clone()))?;
        let device = &inner.dev.device;
        let rec = st.open(device)?;
        // SAFETY: the buffer is recording; the hazard is the point of this call.
        unsafe {
            device.cmd_fill_buffer(rec.cmd, b, 0, 16, 1);
            device.cmd_fill_buffer(rec.cmd, b, 0, 16, 2);
        }
        rec.has_work = true;
        st.submit_open(&inner.dev, &inner.stats, vk::Fence::null())?;
        let target = st.wait_target();
        drop(st);
        match target {
            Some(t) => inner.wait(t),
            None => Ok(()),
        }
    }
}

impl Inner {
    fn device(&self) -> &ash::Device {
        &self.dev.device
    }

    fn unknown(&self, id: BufferId) -> Error {
        Error::UnknownBuffer(id.0, self.name.clone())
    }

    /// Blocks until `target` completed: one host wait, one driver sync. Polls the interrupt
    /// hook; on Ctrl-C it opens this backend's gates so the queue drains, then reports
    /// `Interrupted` (the backend stays usable).
    /// Queues a read of `src` into a readback region; the bytes land in `target` at the wait
    /// that observes it. With `submit` the open work is submitted at once, so the read
    /// completes without another call. Returns the point to wait for.
    fn queue_read(
        &self,
        src: BufferId,
        offset: usize,
        len: usize,
        submit: bool,
        target: impl FnOnce() -> ReadTarget,
    ) -> Result<Retire> {
        let mut st = self.state.lock();
        Inner::check_span(&st, &self.name, src, offset, len)?;
        bump(&self.stats.d2h_copies, 1);
        bump(&self.stats.d2h_bytes, len as u64);
        if len == 0 {
            return Ok(Retire::default());
        }
        if len as u64 > st.readback.max_region() {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: format!(
                    "asynchronous reads above {} bytes",
                    st.readback.max_region()
                ),
            });
        }
        let vk_src = st.buffers[&src].buffer;
        let mut region = None;
        for attempt in 0..2 {
            let retire = st.open_retire();
            region = st
                .alloc_readback(len as u64, retire, self.device())?
                .map(|r| (r, retire));
            if region.is_some() || attempt == 1 {
                break;
            }
            // The readback arena is full of reads in flight: wait for them (counted) and retry.
            drop(st);
            self.synchronize()?;
            st = self.state.lock();
        }
        let Some((region, retire)) = region else {
            return Err(unavailable("readback arena exhausted"));
        };
        st.record_copy(
            self.device(),
            (vk_src, offset as u64),
            (region.buffer, region.offset),
            len as u64,
        )?;
        st.pending_reads.push(PendingRead {
            retire,
            src: region.ptr,
            out: target(),
            len,
        });
        if submit {
            st.submit_open(&self.dev, &self.stats, vk::Fence::null())?;
        }
        Ok(st.end_point())
    }

    /// Host wait until the stream passed `p`: elided (counted as such) when a wait already
    /// observed it, else one counted wait on the timelines `p` is still ahead on.
    fn wait_point(&self, p: Retire) -> Result<()> {
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

    fn wait(&self, target: Retire) -> Result<()> {
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
    fn legacy_sync(&self, mut st: MutexGuard<'_, State>) -> Result<()> {
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
    fn fence_wait(&self, fence: vk::Fence) -> Result<()> {
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
    fn drain(&self, st: MutexGuard<'_, State>) -> Result<()> {
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

    fn open_all_gates(&self) {
        let st = self.state.lock();
        for s in &st.signals {
            signal_once(self.device(), s.sem, &s.signaled);
        }
    }

    fn synchronize(&self) -> Result<()> {
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

    /// Checks `offset..offset+len` against buffer `id`.
    fn check_span(st: &State, name: &str, id: BufferId, offset: usize, len: usize) -> Result<()> {
        let b = st
            .buffers
            .get(&id)
            .ok_or_else(|| Error::UnknownBuffer(id.0, name.to_string()))?;
        if offset.checked_add(len).is_none_or(|e| e as u64 > b.size) {
            return Err(Error::OutOfBounds {
                buffer: id.0,
                offset,
                len,
                size: b.size as usize,
            });
        }
        Ok(())
    }

    /// A staging region of `len` bytes for work retiring at `retire`, waiting for the device
    /// (counted) when the arena is at its cap and nothing completed can be reclaimed.
    fn staging_region<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        len: u64,
        retire: impl Fn(&State) -> Retire,
    ) -> Result<(MutexGuard<'a, State>, crate::memory::Region)> {
        for attempt in 0..4 {
            let r = retire(&st);
            let State {
                staging, allocator, ..
            } = &mut *st;
            let allocator = allocator
                .as_mut()
                .ok_or_else(|| unavailable("the backend is shutting down"))?;
            if let Some(region) = staging.alloc(len, 16, r, self.device(), allocator)? {
                bump(&self.stats.staging_bytes_in_use, len);
                return Ok((st, region));
            }
            // Bounded staging (invariant 8): reclaim what completed, else wait for the device.
            st.poll(self.device());
            st.reclaim(&self.dev, &self.stats)?;
            if attempt > 0 {
                self.drain(st)?;
                st = self.state.lock();
            }
        }
        Err(unavailable(format!("no staging memory for {len} bytes")))
    }

    /// Queues a write of `data` into `dst` behind all queued work: memcpy into staging now,
    /// copy in the compute stream later. Large data goes in arena-sized pieces.
    fn staged_write(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let mut st = self.state.lock();
        Self::check_span(&st, &self.name, dst, offset, data.len())?;
        bump(&self.stats.h2d_copies, 1);
        bump(&self.stats.h2d_bytes, data.len() as u64);
        if data.is_empty() {
            return Ok(());
        }
        let b = &st.buffers[&dst];
        if let (Some(p), false) = (b.write_ptr, st.outstanding()) {
            // The stream is idle by its tickets: nothing queued can read or write these bytes.
            // SAFETY: bounds checked; mapped coherent memory no pending work uses.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr().add(offset), data.len())
            };
            bump(&self.routes.direct_writes, 1);
            return Ok(());
        }
        let vk_dst = b.buffer;
        let piece = st.staging.max_region() as usize;
        for (i, chunk) in data.chunks(piece.max(1)).enumerate() {
            let (g, region) = self.staging_region(st, chunk.len() as u64, State::open_retire)?;
            st = g;
            // SAFETY: a fresh staging region of `chunk.len()` bytes that no pending copy reads.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), region.ptr, chunk.len()) };
            st.record_copy(
                self.device(),
                (region.buffer, region.offset),
                (vk_dst, (offset + i * piece) as u64),
                chunk.len() as u64,
            )?;
        }
        Ok(())
    }

    /// A copy of host bytes on the transfer route: its own submission, after queued compute
    /// work (invariant 2), signalling the transfer timeline the next compute submit waits on.
    fn transfer_write(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let mut st = self.state.lock();
        Self::check_span(&st, &self.name, dst, offset, data.len())?;
        if data.len() as u64 > st.staging.max_region() {
            drop(st);
            return self.staged_write(dst, offset, data);
        }
        bump(&self.stats.h2d_copies, 1);
        bump(&self.stats.h2d_bytes, data.len() as u64);
        // Queued compute work that may read `dst` goes first, so this copy can wait on it.
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())?;
        let vk_dst = st.buffers[&dst].buffer;
        let (g, region) = self.staging_region(st, data.len() as u64, |s| Retire {
            compute: 0,
            transfer: s.transfer.as_ref().map_or(0, |t| t.tl.submitted + 1),
        })?;
        st = g;
        // SAFETY: a fresh staging region that no pending copy reads.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), region.ptr, data.len()) };
        let device = self.device();
        let compute_value = st.compute.submitted;
        let mut gate_waits = Vec::new();
        let t_next = st.transfer.as_ref().map_or(0, |t| t.tl.submitted + 1);
        for s in st.signals.iter_mut().filter(|s| s.pending) {
            if !s.signaled.load(Ordering::Acquire) {
                gate_waits.push(s.sem);
                s.last_waited = s.last_waited.max(Retire {
                    compute: 0,
                    transfer: t_next,
                });
            }
        }
        let Some(t) = st.transfer.as_mut() else {
            return Err(unavailable("no transfer route"));
        };
        let cmd = match t.free.pop() {
            Some(c) => c,
            None => {
                let info = vk::CommandBufferAllocateInfo::default()
                    .command_pool(t.pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1);
                // SAFETY: a live pool used under the state lock.
                unsafe { device.allocate_command_buffers(&info) }
                    .map_err(|r| vk_err("vkAllocateCommandBuffers", r))?
                    .first()
                    .copied()
                    .ok_or_else(|| unavailable("no command buffer allocated"))?
            }
        };
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: an idle command buffer of the transfer pool.
        unsafe {
            device
                .begin_command_buffer(cmd, &begin)
                .map_err(|r| vk_err("vkBeginCommandBuffer", r))?;
            let region_copy = vk::BufferCopy {
                src_offset: region.offset,
                dst_offset: offset as u64,
                size: data.len() as u64,
            };
            device.cmd_copy_buffer(cmd, region.buffer, vk_dst, &[region_copy]);
            device
                .end_command_buffer(cmd)
                .map_err(|r| vk_err("vkEndCommandBuffer", r))?;
        }
        let value = t.tl.submitted + 1;
        let mut wait_sems = gate_waits;
        let mut wait_vals = vec![1u64; wait_sems.len()];
        if compute_value > 0 {
            wait_sems.push(self.compute_sem);
            wait_vals.push(compute_value);
        }
        let stages = vec![vk::PipelineStageFlags::TRANSFER; wait_sems.len()];
        let signal = [t.tl.sem];
        let signal_vals = [value];
        let cmds = [cmd];
        let mut tl = vk::TimelineSemaphoreSubmitInfo::default()
            .wait_semaphore_values(&wait_vals)
            .signal_semaphore_values(&signal_vals);
        let submit = vk::SubmitInfo::default()
            .wait_semaphores(&wait_sems)
            .wait_dst_stage_mask(&stages)
            .command_buffers(&cmds)
            .signal_semaphores(&signal)
            .push_next(&mut tl);
        // SAFETY: queue access under the state lock; resources live to the retire point.
        let r = unsafe { device.queue_submit(t.queue, &[submit], vk::Fence::null()) };
        bump(&self.stats.submits, 1);
        if let Err(r) = r {
            // SAFETY: never submitted.
            let _ =
                unsafe { device.reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty()) };
            t.free.push(cmd);
            return Err(vk_err("vkQueueSubmit", r));
        }
        t.tl.submitted = value;
        t.inflight.push_back((value, cmd));
        bump(&self.routes.transfer_copies, 1);
        bump(&self.routes.transfer_bytes, data.len() as u64);
        Ok(())
    }

    /// Blocking write: ordered after queued work, one host wait (none when the buffer is
    /// host-writable and the stream idle).
    fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let st = self.state.lock();
        Self::check_span(&st, &self.name, dst, offset, data.len())?;
        if let Some(p) = st.buffers[&dst].write_ptr {
            bump(&self.stats.h2d_copies, 1);
            bump(&self.stats.h2d_bytes, data.len() as u64);
            // Queued work may read or write these bytes: wait for it first.
            self.drain(st)?;
            let st = self.state.lock();
            // The buffer may have been freed while unlocked.
            Self::check_span(&st, &self.name, dst, offset, data.len())?;
            // SAFETY: bounds checked; the stream is idle, so no device access races this.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr().add(offset), data.len())
            };
            return Ok(());
        }
        drop(st);
        self.staged_write(dst, offset, data)?;
        let st = self.state.lock();
        if self.config.legacy_submits {
            // ggml: one submit carrying the copy and a fence, then a fence wait.
            let mut st = st;
            let fence = st.legacy_fence;
            st.submit_open(&self.dev, &self.stats, fence)?;
            let target = Retire {
                compute: st.compute.submitted,
                transfer: 0,
            };
            drop(st);
            self.fence_wait(fence)?;
            return self.state.lock().complete(&self.dev, &self.stats, target);
        }
        self.drain(st)
    }

    /// Blocking read: ordered after queued work, one host wait (none when the buffer is
    /// host-readable and the stream idle).
    fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        let st = self.state.lock();
        Self::check_span(&st, &self.name, src, offset, out.len())?;
        bump(&self.stats.d2h_copies, 1);
        bump(&self.stats.d2h_bytes, out.len() as u64);
        let b = &st.buffers[&src];
        if let (Some(p), true) = (b.write_ptr, b.host_read) {
            self.drain(st)?;
            let st = self.state.lock();
            Self::check_span(&st, &self.name, src, offset, out.len())?;
            // SAFETY: bounds checked; the stream is idle and device writes were made visible
            // to the host by the closing barrier of their submission.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr().add(offset), out.as_mut_ptr(), out.len())
            };
            return Ok(());
        }
        let vk_src = b.buffer;
        let piece = st.readback.max_region() as usize;
        let mut st = st;
        for (i, chunk) in out.chunks_mut(piece.max(1)).enumerate() {
            let retire = st.open_retire();
            let region = st.alloc_readback(chunk.len() as u64, retire, self.device())?;
            let Some(region) = region else {
                return Err(unavailable("readback arena exhausted"));
            };
            st.record_copy(
                self.device(),
                (vk_src, (offset + i * piece) as u64),
                (region.buffer, region.offset),
                chunk.len() as u64,
            )?;
            st.pending_reads.push(PendingRead {
                retire,
                src: region.ptr,
                out: ReadTarget::Raw(chunk.as_mut_ptr()),
                len: chunk.len(),
            });
            if self.config.legacy_submits {
                let fence = st.legacy_fence;
                st.submit_open(&self.dev, &self.stats, fence)?;
                let target = Retire {
                    compute: st.compute.submitted,
                    transfer: 0,
                };
                drop(st);
                self.fence_wait(fence)?;
                self.state.lock().complete(&self.dev, &self.stats, target)?;
            } else {
                self.drain(st)?;
            }
            st = self.state.lock();
        }
        Ok(())
    }

    /// Resolves a tensor to device memory, bounds-checked.
    fn resolve(&self, st: &State, node: &ExecNode, t: &TensorRef) -> Result<Res> {
        let b = st
            .buffers
            .get(&t.buffer)
            .ok_or_else(|| self.unknown(t.buffer))?;
        let extent = t.byte_extent();
        if t.byte_offset
            .checked_add(extent)
            .is_none_or(|e| e as u64 > b.size)
        {
            return Err(Error::OutOfBounds {
                buffer: t.buffer.0,
                offset: t.byte_offset,
                len: extent,
                size: b.size as usize,
            });
        }
        if t.shape.len() != t.strides.len() {
            return Err(ops::kernel_err(node, "shape and strides differ in rank"));
        }
        Ok(Res {
            buffer: b.buffer,
            buffer_size: b.vk_size,
            base: t.byte_offset as u64,
            dtype: t.dtype,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
        })
    }

    /// Queues a graph: replays its cached plan when the graph and every buffer it binds are
    /// unchanged, else checks and plans every node (nothing is recorded if any node is bad),
    /// caches the plan when it can be replayed, records and submits.
    fn graph_compute(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        let mut st = self.state.lock();
        let key = Arc::as_ptr(graph) as usize;
        let generation = st.generation;
        let cached = st
            .plans
            .get(&key)
            .filter(|p| {
                p.generation == generation
                    && p.graph.upgrade().is_some_and(|g| Arc::ptr_eq(&g, graph))
            })
            .cloned();
        let plan = match cached {
            Some(p) => p,
            None => {
                let p = Arc::new(self.plan_graph(&mut st, graph)?);
                if p.replayable {
                    if st.plans.len() >= PLAN_CACHE_MAX {
                        st.plans.clear();
                    }
                    st.plans.insert(key, p.clone());
                }
                p
            }
        };
        st.error_sites
            .extend(plan.sites.iter().map(|(t, s)| (*t, s.clone())));
        st.record_steps(self.device(), &plan.steps)?;
        bump(&self.stats.kernel_launches, graph.nodes.len() as u64);
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())
    }

    /// Checks and plans every node of `graph` into recorded steps, with the barriers a fresh
    /// hazard tracker places between conflicting commands.
    fn plan_graph(&self, st: &mut State, graph: &Arc<ExecGraph>) -> Result<GraphPlan> {
        let device = self.device();
        let retire = st.open_retire();
        let mut steps = Vec::new();
        let mut sites = Vec::new();
        let mut tracker = Tracker::default();
        let mut replayable = true;
        for node in &graph.nodes {
            let Some(want) = node.op.src_count() else {
                return Err(ops::kernel_err(
                    node,
                    "has no kernel (leaves and views are not executed)",
                ));
            };
            if !want.contains(&node.srcs.len()) {
                return Err(ops::kernel_err(
                    node,
                    format!(
                        "expects {}..={} sources, got {}",
                        want.start(),
                        want.end(),
                        node.srcs.len()
                    ),
                ));
            }
            let dst = self.resolve(st, node, &node.dst)?;
            let mut srcs = Vec::with_capacity(node.srcs.len());
            for (i, t) in node.srcs.iter().enumerate() {
                let mut r = self.resolve(st, node, t)?;
                if node.src_needs_private_copy(i) {
                    // Another source overlaps the destination: the kernel reads a copy, in
                    // scratch memory of this submission (so this plan is not replayed).
                    replayable = false;
                    let size = r.byte_extent();
                    let region = {
                        let State {
                            scratch, allocator, ..
                        } = &mut *st;
                        let allocator = allocator
                            .as_mut()
                            .ok_or_else(|| unavailable("the backend is shutting down"))?;
                        scratch.alloc(
                            size,
                            self.limits.offset_align.max(16),
                            retire,
                            device,
                            allocator,
                        )?
                    }
                    .ok_or_else(|| ops::kernel_err(node, "device scratch memory exhausted"))?;
                    st.forget_arena_chunks(device);
                    let step = Recorded::Copy {
                        src: (r.buffer, r.base),
                        dst: (region.buffer, region.offset),
                        size,
                    };
                    tracker.push(&mut steps, step.accesses(&[]), step);
                    r.buffer = region.buffer;
                    r.base = region.offset;
                    r.buffer_size = region.offset + size.next_multiple_of(16);
                }
                srcs.push(r);
            }
            let status = match node.op {
                Op::GetRows | Op::SetRows | Op::MulMatId => {
                    let Some(s) = st.status.as_ref() else {
                        return Err(unavailable("no status words"));
                    };
                    let bind = Bind {
                        buffer: s.buf.buffer,
                        offset: 0,
                        range: 16,
                        write: true,
                    };
                    st.next_tag = st.next_tag.wrapping_add(1);
                    let tag = st.next_tag;
                    let (what, rows_of, n) = match node.op {
                        Op::GetRows => ("ids", "a table", srcs[0].shape.first().copied()),
                        Op::SetRows => ("indices", "a destination", dst.shape.first().copied()),
                        _ => ("ids", "experts", srcs[0].shape.first().copied()),
                    };
                    sites.push((
                        tag,
                        ErrorSite {
                            op: node.op.name(),
                            node: node.name.clone(),
                            what,
                            rows_of,
                            n: n.unwrap_or(0),
                        },
                    ));
                    Some(Status { bind, tag })
                }
                _ => None,
            };
            for d in ops::plan(node, &dst, &srcs, status, self.limits)? {
                let (pipeline, layout) = st.pipelines.pipeline(device, &d.kernel, d.binds.len())?;
                let set = st.pipelines.descriptor_set(device, &d.binds)?;
                let step = Recorded::Dispatch {
                    pipeline,
                    layout,
                    set,
                    push: d.push,
                    groups: d.groups,
                };
                tracker.push(&mut steps, step.accesses(&d.binds), step);
            }
        }
        Ok(GraphPlan {
            graph: Arc::downgrade(graph),
            generation: st.generation,
            steps,
            sites,
            replayable,
        })
    }

    fn placement(&self, usage: BufferUsage) -> Placement {
        if self.config.no_host_visible_vram {
            // The path of a GPU without ReBAR: device memory the host never maps.
            return Placement {
                location: MemoryLocation::GpuOnly,
                host_access: false,
            };
        }
        match usage {
            // Inputs prefer device-local host-visible memory (ReBAR); writes are memcpys.
            BufferUsage::Inputs => Placement {
                location: MemoryLocation::CpuToGpu,
                host_access: true,
            },
            // Everything else is device-local; on UMA devices that memory is host-visible too.
            _ => Placement {
                location: if self.dev.uma {
                    MemoryLocation::CpuToGpu
                } else {
                    MemoryLocation::GpuOnly
                },
                host_access: true,
            },
        }
    }

    /// A zero-filled buffer: by memset when host-writable, else by a fill in the stream.
    fn new_buffer(&self, st: &mut State, size: usize, usage: BufferUsage) -> Result<DevBuffer> {
        let placement = self.placement(usage);
        let families = st.families.clone();
        let mut b = create_buffer(
            self.device(),
            st.allocator()?,
            size as u64,
            placement,
            &families,
            &self.name,
        )?;
        b.usage = usage;
        match b.write_ptr {
            // SAFETY: fresh mapped memory of `vk_size` bytes no submission uses.
            Some(p) => unsafe { std::ptr::write_bytes(p.as_ptr(), 0, b.vk_size as usize) },
            None => {
                let rec = st.open(self.device())?;
                // SAFETY: a fresh buffer; later users are ordered by the hazard tracker's
                // leading barrier of this or a later command buffer.
                unsafe {
                    self.device()
                        .cmd_fill_buffer(rec.cmd, b.buffer, 0, vk::WHOLE_SIZE, 0)
                };
                barrier(
                    self.device(),
                    rec.cmd,
                    vk::PipelineStageFlags::TRANSFER,
                    vk::AccessFlags::TRANSFER_WRITE,
                    vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
                    vk::AccessFlags::SHADER_READ
                        | vk::AccessFlags::SHADER_WRITE
                        | vk::AccessFlags::TRANSFER_READ
                        | vk::AccessFlags::TRANSFER_WRITE,
                );
                rec.has_work = true;
            }
        }
        Ok(b)
    }
}

/// Signals a host semaphore to 1 once.
fn signal_once(device: &ash::Device, sem: vk::Semaphore, flag: &AtomicBool) {
    if flag.load(Ordering::Acquire) {
        return;
    }
    let info = vk::SemaphoreSignalInfo::default().semaphore(sem).value(1);
    // SAFETY: a live timeline semaphore at value 0; the flag is set after the signal so
    // nobody destroys it first. Concurrent openers are serialised by the owners' locks.
    if unsafe { device.signal_semaphore(&info) }.is_ok() {
        flag.store(true, Ordering::Release);
    }
}

/// A point in a Vulkan stream.
pub struct VkEvent {
    owner: Arc<Inner>,
    point: Mutex<Retire>,
}

impl Event for VkEvent {
    fn is_complete(&self) -> bool {
        let p = *self.point.lock();
        let mut st = self.owner.state.lock();
        if p.done_by(Retire {
            compute: st.compute.observed,
            transfer: st.transfer.as_ref().map_or(0, |t| t.tl.observed),
        }) {
            return true;
        }
        st.poll(self.owner.device());
        p.done_by(st.completed())
    }
    fn synchronize(&self) -> Result<()> {
        let p = *self.point.lock();
        self.owner.wait_point(p)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A read of a Vulkan stream: its bytes land in `into` at the wait that observes `point`.
struct VkReadback {
    owner: Arc<Inner>,
    point: Retire,
    into: Arc<Mutex<Vec<u8>>>,
    bytes: Option<Vec<u8>>,
}

impl Readback for VkReadback {
    fn is_complete(&self) -> bool {
        if self.bytes.is_some() {
            return true;
        }
        let mut st = self.owner.state.lock();
        st.poll(self.owner.device());
        self.point.done_by(st.completed())
    }
    fn wait(&mut self) -> Result<&[u8]> {
        if self.bytes.is_none() {
            self.owner.wait_point(self.point)?;
            self.bytes = Some(std::mem::take(&mut *self.into.lock()));
        }
        Ok(self.bytes.as_deref().unwrap_or_default())
    }
}

/// The Vulkan test gate: a timeline semaphore the host signals.
pub struct VkGate {
    owner: Weak<Inner>,
    sem: vk::Semaphore,
    signaled: Arc<AtomicBool>,
}

impl Gate for VkGate {
    fn open(&self) {
        if let Some(inner) = self.owner.upgrade() {
            let _guard = inner.state.lock();
            signal_once(inner.device(), self.sem, &self.signaled);
        }
    }
}

impl Backend for VulkanBackend {
    fn name(&self) -> &str {
        &self.inner.name
    }
    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Gpu
    }
    fn caps(&self) -> Caps {
        Caps {
            set_tensor_async: true,
            set_tensor_async_staged: true,
            get_tensor_async: true,
            cpy_tensor_async: true,
            events: true,
            sync_elision: !self.inner.config.legacy_submits,
            graph_replay: false,
            test_gate: true,
            copy_async: true,
            read_async: true,
        }
    }
    fn buffer_type(&self) -> BufferType {
        BufferType {
            name: self.inner.name.clone(),
            alignment: self.inner.alignment,
            is_host: false,
        }
    }
    fn supports_op(&self, op: &Op, dst: DType, srcs: &[DType]) -> bool {
        vulkan_supports_op(op, dst, srcs)
    }
    fn stats(&self) -> &SyncStats {
        &self.inner.stats
    }

    fn alloc_buffer(&self, size: usize, usage: BufferUsage) -> Result<BufferId> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        let b = inner.new_buffer(&mut st, size, usage)?;
        let id = BufferId::fresh();
        st.buffers.insert(id, b);
        bump(&inner.stats.reserves, 1);
        Ok(id)
    }
    fn realloc_buffer(&self, id: BufferId, size: usize) -> Result<()> {
        let inner = &self.inner;
        if !inner.state.lock().buffers.contains_key(&id) {
            return Err(inner.unknown(id));
        }
        // Queued work may still use the old memory.
        inner.synchronize()?;
        let mut st = inner.state.lock();
        let usage = st
            .buffers
            .get(&id)
            .map_or(BufferUsage::Compute, |b| b.usage);
        let nb = inner.new_buffer(&mut st, size, usage)?;
        st.generation += 1;
        let old = st.buffers.insert(id, nb);
        if let Some(old) = old {
            st.pipelines.forget_buffer(inner.device(), old.buffer);
            destroy_buffer(inner.device(), st.allocator()?, old);
        }
        bump(&inner.stats.reallocs, 1);
        Ok(())
    }
    fn free_buffer(&self, id: BufferId) {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        let Some(b) = st.buffers.remove(&id) else {
            return;
        };
        // Plans binding it may not be replayed; it is destroyed once the work queued so far
        // completed (no wait here).
        st.generation += 1;
        let at = st.end_point();
        st.graveyard.push((at, b));
        let _ = st.reclaim(&inner.dev, &inner.stats);
    }
    fn buffer_size(&self, id: BufferId) -> Result<usize> {
        let st = self.inner.state.lock();
        st.buffers
            .get(&id)
            .map(|b| b.size as usize)
            .ok_or_else(|| self.inner.unknown(id))
    }

    fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.inner.set_tensor(dst, offset, data)
    }
    fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        self.inner.get_tensor(src, offset, out)
    }
    unsafe fn set_tensor_async(
        &self,
        dst: BufferId,
        offset: usize,
        data: *const u8,
        len: usize,
    ) -> Result<()> {
        // Staged: the bytes are copied now, which the pinned contract also allows.
        // SAFETY: the caller keeps `data..data+len` valid for (at least) this call.
        let data = unsafe { std::slice::from_raw_parts(data, len) };
        self.inner.staged_write(dst, offset, data)
    }
    fn set_tensor_async_staged(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.inner.staged_write(dst, offset, data)
    }
    unsafe fn get_tensor_async(
        &self,
        src: BufferId,
        offset: usize,
        out: *mut u8,
        len: usize,
    ) -> Result<()> {
        self.inner
            .queue_read(src, offset, len, false, || ReadTarget::Raw(out))?;
        Ok(())
    }
    fn copy_async(
        &self,
        src: BufferId,
        src_offset: usize,
        dst: BufferId,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        Inner::check_span(&st, &inner.name, src, src_offset, len)?;
        Inner::check_span(&st, &inner.name, dst, dst_offset, len)?;
        bump(&inner.stats.d2d_copies, 1);
        bump(&inner.stats.d2d_bytes, len as u64);
        if len == 0 {
            return Ok(());
        }
        let (vk_src, vk_dst) = (st.buffers[&src].buffer, st.buffers[&dst].buffer);
        st.record_copy(
            inner.device(),
            (vk_src, src_offset as u64),
            (vk_dst, dst_offset as u64),
            len as u64,
        )
    }
    fn read_async(&self, src: BufferId, offset: usize, len: usize) -> Result<Box<dyn Readback>> {
        let inner = &self.inner;
        let into = Arc::new(Mutex::new(vec![0u8; len]));
        let point = inner.queue_read(src, offset, len, true, || ReadTarget::Owned(into.clone()))?;
        Ok(Box::new(VkReadback {
            owner: inner.clone(),
            point,
            into,
            bytes: None,
        }))
    }
    fn cpy_tensor_async(
        &self,
        src_backend: &dyn Backend,
        src: BufferId,
        src_offset: usize,
        dst: BufferId,
        dst_offset: usize,
        len: usize,
    ) -> Result<bool> {
        // Only from host memory, ready as soon as its synchronous producer returned. The bytes
        // are staged at call time, so the source may be reused at once (invariant 3).
        let inner = &self.inner;
        let copied = with_host_source(src_backend, src, src_offset, len, |data| {
            let transfer = inner
                .crossover
                .is_some_and(|c| len as u64 > c.copy_max_bytes)
                && inner.transfer_sem.is_some();
            if transfer {
                inner.transfer_write(dst, dst_offset, data)
            } else {
                inner.staged_write(dst, dst_offset, data)?;
                bump(&inner.routes.compute_stream_copies, 1);
                bump(&inner.routes.compute_stream_bytes, len as u64);
                Ok(())
            }
        })?;
        Ok(copied.is_some())
    }

    fn graph_compute_async(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        self.inner.graph_compute(graph)
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Ok(Arc::new(VkEvent {
            owner: self.inner.clone(),
            point: Mutex::new(Retire::default()),
        }))
    }
    fn event_record(&self, ev: &Arc<dyn Event>) -> Result<()> {
        let inner = &self.inner;
        let e = ev
            .as_any()
            .downcast_ref::<VkEvent>()
            .filter(|e| Arc::ptr_eq(&e.owner, inner));
        let Some(e) = e else {
            return Err(Error::Unsupported {
                backend: inner.name.clone(),
                what: "recording another backend's event".into(),
            });
        };
        let mut st = inner.state.lock();
        // The event must complete without another call: open work is submitted now.
        st.submit_open(&inner.dev, &inner.stats, vk::Fence::null())?;
        *e.point.lock() = st.end_point();
        Ok(())
    }
    fn event_wait(&self, ev: &Arc<dyn Event>) -> Result<()> {
        let inner = &self.inner;
        let own = ev
            .as_any()
            .downcast_ref::<VkEvent>()
            .is_some_and(|e| Arc::ptr_eq(&e.owner, inner));
        if own || ev.is_complete() {
            return Ok(()); // stream order, or nothing to wait for
        }
        // Another stream's event: a helper thread signals a semaphore the next submission
        // waits on, so the host thread does not block.
        let mut st = inner.state.lock();
        let sem = create_timeline(inner.device())?;
        let signaled = Arc::new(AtomicBool::new(false));
        st.signals.push(HostSignal {
            sem,
            signaled: signaled.clone(),
            last_waited: Retire::default(),
            pending: true,
        });
        drop(st);
        let owner = inner.clone();
        let ev = ev.clone();
        std::thread::Builder::new()
            .name(format!("lowsync-{}-bridge", inner.name))
            .spawn(move || {
                let mut pause = Duration::from_micros(20);
                while !ev.is_complete() {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(2));
                }
                let _guard = owner.state.lock();
                signal_once(owner.device(), sem, &signaled);
            })
            .map_err(|e| unavailable(format!("cannot start an event bridge thread: {e}")))?;
        Ok(())
    }

    fn gate_close(&self) -> Result<Arc<dyn Gate>> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        // Work queued before the gate is not held back by it.
        st.submit_open(&inner.dev, &inner.stats, vk::Fence::null())?;
        let sem = create_timeline(inner.device())?;
        let signaled = Arc::new(AtomicBool::new(false));
        st.signals.push(HostSignal {
            sem,
            signaled: signaled.clone(),
            last_waited: Retire::default(),
            pending: true,
        });
        Ok(Arc::new(VkGate {
            owner: Arc::downgrade(inner),
            sem,
            signaled,
        }))
    }
}

/// Whether the Vulkan kernels implement `op` for these dtypes.
pub fn vulkan_supports_op(op: &Op, dst: DType, srcs: &[DType]) -> bool {
    let floats = |ds: &[DType]| ds.iter().all(|d| d.is_float());
    match op {
        Op::Input | Op::Weight | Op::Persistent | Op::View => true,
        Op::GetRows => {
            dst.is_float() && srcs.len() == 2 && srcs[0].is_float() && srcs[1] == DType::I32
        }
        Op::SetRows => {
            dst.is_float() && srcs.len() == 3 && floats(&srcs[..2]) && srcs[2] == DType::I32
        }
        Op::Rope { .. } => {
            dst.is_float() && srcs.len() == 2 && srcs[0].is_float() && srcs[1] == DType::I32
        }
        Op::Argmax => dst == DType::I32 && srcs.len() == 1 && floats(srcs),
        Op::MulMat => dst == DType::F32 && srcs.len() == 2 && floats(srcs),
        Op::MulMatId => {
            dst == DType::F32
                && srcs.len() == 4
                && floats(&srcs[..2])
                && srcs[2] == DType::I32
                && srcs[3].is_float()
        }
        Op::Cpy | Op::Concat { .. } => srcs.iter().all(|s| s.is_float() == dst.is_float()),
        _ => dst.is_float() && floats(srcs),
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
        st.pipelines.destroy(&device);
        // SAFETY: the device is idle; every object below was created by this backend.
        unsafe {
            for s in st.signals.drain(..) {
                device.destroy_semaphore(s.sem, None);
            }
            if let Some(t) = st.transfer.take() {
                device.destroy_command_pool(t.pool, None);
                device.destroy_semaphore(t.tl.sem, None);
            }
            device.destroy_command_pool(st.pool, None);
            device.destroy_semaphore(st.compute.sem, None);
            device.destroy_fence(st.legacy_fence, None);
        }
        drop(allocator);
    }
}
