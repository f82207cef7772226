//! The transfer-route crossover: above how many bytes a host-to-device copy pays for its own
//! submission.
//!
//! Why: a copy on the transfer route costs one more submission and a semaphore wait on the
//! compute side; it pays off only when the copy itself takes longer than that overhead
//! (ARCHITECTURE §5, S1). The break-even size is overhead × bandwidth, which differs by
//! orders of magnitude between lavapipe, a PCIe GPU and an eGPU, so it is measured.
//!
//! Strategy: once per device and queue family (cached for the process), on an idle queue
//! before the backend is handed out: the host clock times submit + timeline wait of a tiny
//! copy (median of 16 after warm-up); GPU timestamps around an 8 MiB copy from host staging
//! memory give the H2D bandwidth (the host clock when the queue has no timestamps). The result is logged.
//! These calibration submissions are the backend's own start-up cost and are not in
//! `SyncStats`, which starts counting when the backend is returned.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use ash::vk;
use gpu_allocator::vulkan::Allocator;
use gpu_allocator::MemoryLocation;
use lowsync_backend::Result;

use crate::device::{vk_err, Device, Queue};
use crate::memory::{create_buffer, destroy_buffer, DevBuffer, Placement};
use crate::stream::{create_pool, create_timeline};

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

const BANDWIDTH_BYTES: u64 = 8 << 20;
const OVERHEAD_RUNS: usize = 16;
const WARMUP_RUNS: usize = 3;

type Key = (String, [u8; 16], u32);

fn cache() -> &'static Mutex<HashMap<Key, Crossover>> {
    static C: OnceLock<Mutex<HashMap<Key, Crossover>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The crossover of `queue` on `dev`, measured on first use per process.
pub(crate) fn crossover(
    dev: &Device,
    queue: Queue,
    allocator: &mut Allocator,
) -> Result<Crossover> {
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
    let info = vk::CommandBufferAllocateInfo::default()
        .command_pool(s.pool)
        .level(vk::CommandBufferLevel::PRIMARY)
        .command_buffer_count(1);
    // SAFETY: a live pool.
    let cmd = unsafe { device.allocate_command_buffers(&info) }
        .map_err(|r| vk_err("vkAllocateCommandBuffers", r))?
        .first()
        .copied()
        .ok_or_else(|| crate::device::unavailable("no command buffer allocated"))?;
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
        let vals = [value];
        let sems = [s.sem];
        let cmds = [cmd];
        let mut tl = vk::TimelineSemaphoreSubmitInfo::default().signal_semaphore_values(&vals);
        let submit = vk::SubmitInfo::default()
            .command_buffers(&cmds)
            .signal_semaphores(&sems)
            .push_next(&mut tl);
        let t0 = Instant::now();
        // SAFETY: the queue is not used by anyone else yet (the backend is being built).
        unsafe {
            device
                .queue_submit(queue.queue, &[submit], vk::Fence::null())
                .map_err(|r| vk_err("vkQueueSubmit", r))?;
            device
                .wait_semaphores(
                    &vk::SemaphoreWaitInfo::default()
                        .semaphores(&sems)
                        .values(&vals),
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
