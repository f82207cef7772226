//! The transfer route: which host-to-device copies take their own submission, how large
//! "large enough" is on this device, and the submissions themselves.
//!
//! Why: a host-computed tensor copied with `cpy_tensor_async` can ride in the compute stream
//! (a copy command in the open command buffer, no extra submission) or go on the transfer
//! route (its own submission, on a dedicated transfer queue when the device has one, with a
//! timeline semaphore the next compute submission waits on). The route costs one more
//! submission and a semaphore wait on the compute side; it pays off only when the copy itself
//! takes longer than that (ARCHITECTURE §5, S1). The break-even size is overhead × bandwidth,
//! which differs by orders of magnitude between lavapipe, a PCIe GPU and an eGPU, so it is
//! measured, not guessed.
//!
//! Strategy: [`open`] decides at start-up. The route exists when the device has a dedicated
//! transfer queue, or when `LOWSYNC_VK_FORCE_TRANSFER_SUBMIT=1` asks for separate submissions
//! on the compute queue. Its crossover is `LOWSYNC_VK_COMPUTE_STREAM_COPY_MAX` when set, else
//! measured once per device and queue family (cached for the process) on the idle queue before
//! the backend is handed out: the host clock times submit + timeline wait of a tiny copy
//! (median of 16 after warm-up), GPU timestamps around an 8 MiB copy from host staging memory
//! give the H2D bandwidth (the host clock when the queue has no timestamps). These calibration
//! submissions are start-up cost and are not in `SyncStats`, which starts counting when the
//! backend is returned. [`Routing::takes_transfer`] then sends a copy above the crossover to
//! [`TransferRoute::submit_copy`]; everything else stays in the compute stream. The host side
//! of a routed write (staging the bytes, ordering behind gates) is `io`'s `transfer_write`.
//!
//! Invariants (9): a copy takes the route iff the route exists and the copy is larger than the
//! crossover; a route copy waits for the compute work submitted before it (invariant 2) and
//! the next compute submission waits for it; a completed compute submission covers every
//! transfer value it waited on, so one host wait on compute observes both timelines; a
//! route command buffer is reused only after its timeline value completed (invariant 8).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use ash::vk;
use gpu_allocator::vulkan::Allocator;
use gpu_allocator::MemoryLocation;
use lowsync_backend::{bump, Result, SyncStats};

use crate::config::VkConfig;
use crate::device::{allocate_command_buffer, create_pool, vk_err, Device, Queue};
use crate::memory::{create_buffer, destroy_buffer, DevBuffer, Placement};
use crate::timeline::{create_timeline, submit_timeline, Timeline};

/// The measured (or configured) transfer-route crossover.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Crossover {
    /// Copies up to this many bytes stay in the compute stream.
    pub copy_max_bytes: u64,
    /// Host time of one submission plus its timeline wait, in nanoseconds (0 if configured).
    pub overhead_ns: f64,
    /// Host-to-device bandwidth in bytes per second (0 if configured).
    pub h2d_bytes_per_s: f64,
    /// Whether the figures were measured (false: `LOWSYNC_VK_COMPUTE_STREAM_COPY_MAX`).
    pub measured: bool,
}

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
    pub(crate) fn snapshot(&self) -> RouteSnapshot {
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

/// Where copies of host-computed tensors go, fixed when the backend is built.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Routing {
    /// The crossover (`None`: no transfer route and no configured limit).
    pub crossover: Option<Crossover>,
    /// Whether the backend has a transfer route.
    pub has_route: bool,
}

impl Routing {
    /// Whether a host copy of `len` bytes takes the transfer route (else the compute stream).
    pub(crate) fn takes_transfer(&self, len: u64) -> bool {
        self.crossover.is_some_and(|c| len > c.copy_max_bytes) && self.has_route
    }
}

/// Chooses the route of a new backend and builds it: the transfer queue (dedicated, or the
/// compute queue when forced), its crossover (configured or measured) and its command pool
/// and timeline.
pub(crate) fn open(
    dev: &Device,
    config: &VkConfig,
    allocator: &mut Allocator,
) -> Result<(Routing, Option<TransferRoute>)> {
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
        (None, Some(q)) => Some(measured_crossover(dev, q, allocator)?),
        (None, None) => None,
    };
    let route = match transfer_queue {
        None => None,
        Some(q) => Some(TransferRoute {
            queue: q.queue,
            pool: create_pool(&dev.device, q.family)?,
            free: Vec::new(),
            inflight: VecDeque::new(),
            tl: Timeline::new(&dev.device)?,
            waited_by_compute: 0,
            marks: VecDeque::new(),
        }),
    };
    let routing = Routing {
        crossover,
        has_route: route.is_some(),
    };
    Ok((routing, route))
}

/// The transfer route: a dedicated transfer queue, or (forced) separate submissions on the
/// compute queue with their own timeline.
pub(crate) struct TransferRoute {
    pub queue: vk::Queue,
    pub pool: vk::CommandPool,
    pub free: Vec<vk::CommandBuffer>,
    /// Submitted command buffers: (transfer value, buffer).
    pub inflight: VecDeque<(u64, vk::CommandBuffer)>,
    pub tl: Timeline,
    /// The highest transfer value a compute submission has waited on.
    pub waited_by_compute: u64,
    /// Compute values whose submission waited on a transfer value: (compute, transfer).
    marks: VecDeque<(u64, u64)>,
}

impl TransferRoute {
    /// The wait the next compute submission needs: the last transfer value, when no compute
    /// submission has waited on it yet. Marks it waited on.
    pub(crate) fn compute_wait(&mut self) -> Option<(vk::Semaphore, u64)> {
        if self.tl.submitted > self.waited_by_compute {
            self.waited_by_compute = self.tl.submitted;
            return Some((self.tl.sem, self.tl.submitted));
        }
        None
    }

    /// Records that compute value `compute` (submitted) waited on transfer value `transfer`.
    pub(crate) fn waited_by(&mut self, compute: u64, transfer: u64) {
        self.marks.push_back((compute, transfer));
    }

    /// The host saw compute reach `compute_observed` and, directly, this timeline reach
    /// `transfer`: every transfer value a completed compute submission waited on is complete.
    pub(crate) fn observe(&mut self, compute_observed: u64, transfer: u64) {
        let mut covered = 0;
        while let Some(&(v, t)) = self.marks.front() {
            if v > compute_observed {
                break;
            }
            covered = t;
            self.marks.pop_front();
        }
        self.tl.observed = self.tl.observed.max(transfer).max(covered);
        self.tl.completed = self.tl.completed.max(self.tl.observed);
    }

    /// Reads the timeline without blocking (not a host wait), to reclaim more.
    pub(crate) fn poll(&mut self, device: &ash::Device) {
        // SAFETY: a live semaphore.
        if let Ok(v) = unsafe { device.get_semaphore_counter_value(self.tl.sem) } {
            self.tl.completed = self.tl.completed.max(v);
        }
    }

    /// Recycles command buffers whose submissions completed by transfer value `done`.
    pub(crate) fn reclaim(&mut self, device: &ash::Device, done: u64) -> Result<()> {
        while let Some(&(v, cmd)) = self.inflight.front() {
            if v > done {
                break;
            }
            self.inflight.pop_front();
            // SAFETY: its submission completed.
            unsafe { device.reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty()) }
                .map_err(|r| vk_err("vkResetCommandBuffer", r))?;
            self.free.push(cmd);
        }
        Ok(())
    }

    /// Submits one copy `src -> dst` (`region`) as its own submission, waiting on `waits`
    /// (semaphore, value) and signalling the next transfer value. Counts the submission, as
    /// every submitting primitive does.
    pub(crate) fn submit_copy(
        &mut self,
        device: &ash::Device,
        stats: &SyncStats,
        src: vk::Buffer,
        dst: vk::Buffer,
        region: vk::BufferCopy,
        waits: &[(vk::Semaphore, u64)],
    ) -> Result<()> {
        let cmd = match self.free.pop() {
            Some(c) => c,
            None => allocate_command_buffer(device, self.pool, vk::CommandBufferLevel::PRIMARY)?,
        };
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: an idle command buffer of the transfer pool.
        unsafe {
            device
                .begin_command_buffer(cmd, &begin)
                .map_err(|r| vk_err("vkBeginCommandBuffer", r))?;
            device.cmd_copy_buffer(cmd, src, dst, &[region]);
            device
                .end_command_buffer(cmd)
                .map_err(|r| vk_err("vkEndCommandBuffer", r))?;
        }
        let value = self.tl.submitted + 1;
        // SAFETY: queue access under the owner's state lock; the buffer has ended; resources
        // live to the retire point.
        let r = unsafe {
            submit_timeline(
                device,
                self.queue,
                cmd,
                waits,
                vk::PipelineStageFlags::TRANSFER,
                (self.tl.sem, value),
                vk::Fence::null(),
            )
        };
        bump(&stats.submits, 1);
        if let Err(r) = r {
            // SAFETY: never submitted.
            let _ =
                unsafe { device.reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty()) };
            self.free.push(cmd);
            return Err(vk_err("vkQueueSubmit", r));
        }
        self.tl.submitted = value;
        self.inflight.push_back((value, cmd));
        Ok(())
    }

    /// Destroys the pool and the timeline; the device must be idle.
    pub(crate) fn destroy(self, device: &ash::Device) {
        // SAFETY: the device is idle; both objects were created by `open`.
        unsafe {
            device.destroy_command_pool(self.pool, None);
            device.destroy_semaphore(self.tl.sem, None);
        }
    }
}

// Calibration: measured once per device and queue family, on the idle queue.

const BANDWIDTH_BYTES: u64 = 8 << 20;
const OVERHEAD_RUNS: usize = 16;
const WARMUP_RUNS: usize = 3;

type Key = (String, [u8; 16], u32);

fn cache() -> &'static Mutex<HashMap<Key, Crossover>> {
    static C: OnceLock<Mutex<HashMap<Key, Crossover>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The crossover of `queue` on `dev`, measured on first use per process.
fn measured_crossover(dev: &Device, queue: Queue, allocator: &mut Allocator) -> Result<Crossover> {
    let key = (dev.name.clone(), dev.uuid, queue.family);
    if let Some(c) = cache().lock().ok().and_then(|m| m.get(&key).copied()) {
        return Ok(c);
    }
    let c = measure(dev, queue, allocator)?;
    tracing::info!(
        device = %dev.name,
        family = queue.family,
        overhead_ns = c.overhead_ns,
        h2d_bytes_per_s = c.h2d_bytes_per_s,
        copy_max_bytes = c.copy_max_bytes,
        "measured the transfer-route crossover"
    );
    if let Ok(mut m) = cache().lock() {
        m.insert(key, c);
    }
    Ok(c)
}

struct Scratch<'a> {
    device: &'a ash::Device,
    pool: vk::CommandPool,
    sem: vk::Semaphore,
    query: vk::QueryPool,
    bufs: Vec<DevBuffer>,
}

impl Scratch<'_> {
    fn release(mut self, allocator: &mut Allocator) {
        // SAFETY: every submission was waited on before release.
        unsafe {
            self.device.destroy_command_pool(self.pool, None);
            self.device.destroy_semaphore(self.sem, None);
            if self.query != vk::QueryPool::null() {
                self.device.destroy_query_pool(self.query, None);
            }
        }
        for b in self.bufs.drain(..) {
            destroy_buffer(self.device, allocator, b);
        }
    }
}

fn measure(dev: &Device, queue: Queue, allocator: &mut Allocator) -> Result<Crossover> {
    let device = &dev.device;
    let mut s = Scratch {
        device,
        pool: create_pool(device, queue.family)?,
        sem: vk::Semaphore::null(),
        query: vk::QueryPool::null(),
        bufs: Vec::new(),
    };
    let r = run(dev, queue, allocator, &mut s);
    s.release(allocator);
    r
}

fn run(
    dev: &Device,
    queue: Queue,
    allocator: &mut Allocator,
    s: &mut Scratch,
) -> Result<Crossover> {
    let device = &dev.device;
    s.sem = create_timeline(device)?;
    // Host memory, as the staging arena uses: the copy crosses the bus.
    let host = Placement {
        location: MemoryLocation::GpuToCpu,
        host_access: true,
    };
    let gpu = Placement {
        location: MemoryLocation::GpuOnly,
        host_access: false,
    };
    s.bufs.push(create_buffer(
        device,
        allocator,
        BANDWIDTH_BYTES,
        host,
        &[],
        "calibration staging",
    )?);
    s.bufs.push(create_buffer(
        device,
        allocator,
        BANDWIDTH_BYTES,
        gpu,
        &[],
        "calibration target",
    )?);
    let (src, dst) = (s.bufs[0].buffer, s.bufs[1].buffer);
    // Timestamps need a reset: from the host (hostQueryReset), since a transfer-only queue
    // cannot reset queries in a command buffer.
    let timestamps =
        queue.timestamp_bits > 0 && dev.limits.timestamp_period > 0.0 && dev.host_query_reset;
    if timestamps {
        let info = vk::QueryPoolCreateInfo::default()
            .query_type(vk::QueryType::TIMESTAMP)
            .query_count(2);
        // SAFETY: valid create info.
        s.query = unsafe { device.create_query_pool(&info, None) }
            .map_err(|r| vk_err("vkCreateQueryPool", r))?;
    }
    let cmd = allocate_command_buffer(device, s.pool, vk::CommandBufferLevel::PRIMARY)?;
    let mut value = 0u64;
    let mut submit_wait = |bytes: u64, stamp: bool| -> Result<f64> {
        // SAFETY: `cmd` is idle (every submission is waited on below).
        unsafe {
            device
                .reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty())
                .map_err(|r| vk_err("vkResetCommandBuffer", r))?;
            device
                .begin_command_buffer(
                    cmd,
                    &vk::CommandBufferBeginInfo::default()
                        .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
                )
                .map_err(|r| vk_err("vkBeginCommandBuffer", r))?;
            if stamp {
                device.reset_query_pool(s.query, 0, 2);
                device.cmd_write_timestamp(cmd, vk::PipelineStageFlags::TOP_OF_PIPE, s.query, 0);
            }
            let region = vk::BufferCopy {
                src_offset: 0,
                dst_offset: 0,
                size: bytes,
            };
            device.cmd_copy_buffer(cmd, src, dst, &[region]);
            if stamp {
                device.cmd_write_timestamp(cmd, vk::PipelineStageFlags::BOTTOM_OF_PIPE, s.query, 1);
            }
            device
                .end_command_buffer(cmd)
                .map_err(|r| vk_err("vkEndCommandBuffer", r))?;
        }
        value += 1;
        let t0 = Instant::now();
        // SAFETY: the queue is not used by anyone else yet (the backend is being built); `cmd`
        // has ended and is waited on below.
        unsafe {
            submit_timeline(
                device,
                queue.queue,
                cmd,
                &[],
                vk::PipelineStageFlags::TRANSFER,
                (s.sem, value),
                vk::Fence::null(),
            )
            .map_err(|r| vk_err("vkQueueSubmit", r))?;
            device
                .wait_semaphores(
                    &vk::SemaphoreWaitInfo::default()
                        .semaphores(&[s.sem])
                        .values(&[value]),
                    10_000_000_000,
                )
                .map_err(|r| vk_err("vkWaitSemaphores", r))?;
        }
        Ok(t0.elapsed().as_nanos() as f64)
    };
    let mut runs = Vec::with_capacity(OVERHEAD_RUNS);
    for i in 0..WARMUP_RUNS + OVERHEAD_RUNS {
        let ns = submit_wait(256, false)?;
        if i >= WARMUP_RUNS {
            runs.push(ns);
        }
    }
    runs.sort_by(|a, b| a.total_cmp(b));
    let overhead_ns = runs[runs.len() / 2];
    submit_wait(BANDWIDTH_BYTES, false)?; // warm the pages
    let host_ns = submit_wait(BANDWIDTH_BYTES, timestamps)?;
    let mut copy_ns = (host_ns - overhead_ns).max(1.0);
    if timestamps {
        let mut ts = [0u64; 2];
        // SAFETY: both queries were written by the completed submission.
        let got = unsafe {
            device.get_query_pool_results(s.query, 0, &mut ts, vk::QueryResultFlags::TYPE_64)
        };
        if got.is_ok() && ts[1] > ts[0] {
            copy_ns = (ts[1] - ts[0]) as f64 * dev.limits.timestamp_period as f64;
        }
    }
    let h2d_bytes_per_s = BANDWIDTH_BYTES as f64 / copy_ns * 1e9;
    let copy_max_bytes = (overhead_ns * 1e-9 * h2d_bytes_per_s) as u64;
    Ok(Crossover {
        copy_max_bytes,
        overhead_ns,
        h2d_bytes_per_s,
        measured: true,
    })
}
