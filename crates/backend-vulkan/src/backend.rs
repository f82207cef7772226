//! `VulkanBackend`: the [`Backend`] contract on one Vulkan device.
//!
//! Why: this is the only type the scheduler sees. It builds the device, the arenas and the
//! stream, and maps each contract primitive onto the module that owns its mechanism: host
//! waits (`crate::sync`), host writes and reads (`crate::io`), graphs (`crate::exec`),
//! events and gates (`crate::events`), the transfer route (`crate::transfer`). The counting
//! the contract requires happens inside the primitive that submits or waits (ARCHITECTURE §3).
//!
//! Strategy: every primitive takes the state lock, records or submits, and releases the lock
//! before blocking, so a gate can be opened and events polled while another thread waits.
//! Buffers are placed by usage: graph inputs in device-local host-visible memory when the
//! device offers it (writes are memcpys), everything else device-local; the no-ReBAR switch
//! maps nothing. Op support is the graph's own rule (`Op::accepts`), narrowed where the
//! kernels cover less.
//!
//! Invariants: counts follow the tickets, never timing (a wait happens iff something was
//! enqueued since the last observed completion); `LOWSYNC_VK_LEGACY_SUBMITS=1` is the only
//! source of empty submissions; a freed buffer is destroyed only after the work queued before
//! the free completed, and every plan that bound it is retired at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use ash::vk;
use gpu_allocator::vulkan::{Allocator, AllocatorCreateDesc};
use gpu_allocator::MemoryLocation;
use lowsync_backend::{
    bump, with_host_source, Backend, BufferId, BufferType, BufferUsage, Caps, DeviceKind, Error,
    Event, ExecGraph, Gate, KernelTime, Readback, Result, SyncStats,
};
use lowsync_graph::{DType, Op};
use parking_lot::Mutex;

use crate::config::{QuantMatMul, QuantMatVec, SplitK, VkConfig};
use crate::device::{create_pool, unavailable, vk_err, Device};
use crate::events::VkReadback;
use crate::memory::{create_buffer, destroy_buffer, Arena, DevBuffer, Placement};
use crate::ops::{Limits, QD_SHARED_BYTES};
use crate::pipelines::{Bind, Pipelines};
use crate::profile::Profiler;
use crate::stream::{barrier, ReadTarget, State, StatusWords};
use crate::sync::Inner;
use crate::timeline::Timeline;
use crate::transfer::{self, Crossover, RouteCounters, RouteSnapshot};

/// Smallest staging / readback chunk.
const ARENA_MIN_CHUNK: u64 = 1 << 20;
/// Staging and readback never hold more than this; larger transfers go in pieces.
const ARENA_CAP: u64 = 256 << 20;
/// Device scratch (private copies of overlapping sources) cap.
const SCRATCH_CAP: u64 = 1 << 30;
/// Bytes of the split-k products' partials buffer: a product splits only where its partials
/// (splits x batches x m x n f32) fit. `auto` splits a product only while its workgroups are
/// at most the multiprocessors, so 132 of them need 132 x 64 x 64 x 4 bytes (2.1 MiB).
const SPLIT_PARTS_BYTES: u64 = 8 << 20;

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
        let (routing, transfer) = transfer::open(&dev, &config, &mut allocator)?;
        let compute = Timeline::new(&device)?;
        let compute_sem = compute.sem;
        let pool = create_pool(&device, dev.compute.family)?;
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
        let split_parts = if config.split_k == SplitK::Off {
            None
        } else {
            let gpu = Placement {
                location: MemoryLocation::GpuOnly,
                host_access: false,
            };
            let parts = SPLIT_PARTS_BYTES.min(u64::from(dev.limits.max_storage_buffer_range));
            let b = create_buffer(&device, &mut allocator, parts, gpu, &families, "split-k")?;
            Some(b)
        };
        let limits = Limits {
            offset_align: dev.limits.min_storage_buffer_offset_alignment.max(4),
            max_range: u64::from(dev.limits.max_storage_buffer_range),
            max_groups: dev.limits.max_compute_work_group_count,
            has_f64: dev.has_f64,
            subgroups: dev.subgroup_arith && !config.no_subgroups,
            shuffles: dev.subgroup_shuffle && !config.no_subgroups,
            wide_groups: dev.limits.max_compute_work_group_invocations >= 256
                && dev.limits.max_compute_work_group_size[0] >= 256,
            qv: config
                .quant_mat_vec
                .unwrap_or(QuantMatVec::for_device(dev.cpu_type, dev.integer_dot_fast)),
            qmm: config
                .quant_mat_mul
                .unwrap_or(QuantMatMul::for_device(dev.cpu_type)),
            tile: config.tile,
            split_k: config.split_k,
            split_parts: split_parts.as_ref().map(|b| Bind {
                buffer: b.buffer,
                offset: 0,
                range: b.size & !3,
                write: true,
            }),
            sm_count: dev.sm_count,
            idot: dev.integer_dot
                && dev.subgroup_shuffle
                && !config.no_subgroups
                && dev.limits.max_compute_shared_memory_size >= QD_SHARED_BYTES,
            idot_k: config.quant_mat_vec == Some(QuantMatVec::Idot),
            qd_rows: config.qd_rows,
            row_lanes: config.row_lanes.unwrap_or(dev.cpu_type),
            coopmat: dev.coopmat,
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
            compute,
            pool,
            free_cmds: Vec::new(),
            inflight: VecDeque::new(),
            plans: HashMap::new(),
            retired_recordings: Vec::new(),
            generation: 0,
            profiler: Profiler::new(&dev, config.profile),
            transfer,
            open: None,
            signals: Vec::new(),
            graveyard: Vec::new(),
            pending_reads: Vec::new(),
            status: Some(StatusWords {
                buf: status_buf,
                ptr: status_ptr,
            }),
            attn_parts: None,
            split_parts,
            error_sites: HashMap::new(),
            next_tag: 0,
            legacy_fence,
            families,
        };
        tracing::info!(
            backend = name,
            device = %dev.name,
            crossover = ?routing.crossover,
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
                routing,
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

    /// The device's `maxComputeWorkGroupCount`: the most workgroups a dispatch takes along
    /// x, y and z.
    pub fn max_group_count(&self) -> [u32; 3] {
        self.inner.dev.limits.max_compute_work_group_count
    }

    /// Whether kernels may shuffle values across a subgroup: the device has subgroup shuffles
    /// in whole subgroups of 4 to 64 lanes, and the config leaves subgroups on (the prefill
    /// product over block weights then shares x through them: `mul_mat_q_s`).
    pub fn has_subgroup_shuffles(&self) -> bool {
        self.inner.dev.subgroup_shuffle && !self.inner.config.no_subgroups
    }

    /// Whether the integer-dot decode products (`LOWSYNC_VK_QV=idot`, `mul_mat_vec_qd*`) can
    /// run here: the device has the integer dot product feature (enabled at creation), subgroup
    /// shuffles (the config leaving subgroups on) and room for their workgroup memory.
    pub fn has_integer_dot(&self) -> bool {
        self.inner.limits.idot
    }

    /// The body of the one-row products over block weights this backend runs: the one
    /// `LOWSYNC_VK_QV` asked for, else the device's default (`QuantMatVec::for_device`).
    pub fn quant_mat_vec(&self) -> QuantMatVec {
        self.inner.limits.qv
    }

    /// Whether this device runs 4x8-bit packed integer dot products in hardware (lavapipe
    /// emulates them): where the integer-dot products can pay.
    pub fn has_fast_integer_dot(&self) -> bool {
        self.inner.limits.idot && self.inner.dev.integer_dot_fast
    }

    /// The device's multiprocessors where it reports them (`VK_NV_shader_sm_builtins`' SMs,
    /// `VK_AMD_shader_core_properties`' compute units), else 0: what `LOWSYNC_VK_SPLIT_K=auto`
    /// splits the tiled products by (nothing where 0).
    pub fn multiprocessors(&self) -> u32 {
        self.inner.dev.sm_count
    }

    /// Whether the prefill products run on cooperative matrices: `LOWSYNC_VK_COOPMAT` asked for
    /// them and the device has what they need.
    pub fn has_coopmat(&self) -> bool {
        self.inner.dev.coopmat
    }

    /// The settings this backend was built with.
    pub fn config(&self) -> &VkConfig {
        &self.inner.config
    }

    /// Whether dispatches are timed: profiling was asked for (`LOWSYNC_VK_PROFILE`) and the
    /// compute queue writes timestamps.
    pub fn profiling(&self) -> bool {
        self.inner.state.lock().profiler.is_some()
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
        self.inner.routing.crossover
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

    /// Command buffers holding recorded graph plans: those of cached plans, and retired ones
    /// whose last submission has not been seen to complete yet.
    pub fn recorded_plans(&self) -> usize {
        let st = self.inner.state.lock();
        st.plans.values().filter(|c| c.recorded.is_some()).count() + st.retired_recordings.len()
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
    /// Where a buffer of `usage` lives (memory location, and whether the host maps it).
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

impl Backend for VulkanBackend {
    fn name(&self) -> &str {
        &self.inner.name
    }
    fn kernel_times(&self) -> Vec<KernelTime> {
        let mut st = self.inner.state.lock();
        // Steps that completed since the last wait are counted too (a poll, not a wait).
        st.poll(self.inner.device());
        let done = st.compute.completed;
        let Some(p) = st.profiler.as_mut() else {
            return Vec::new();
        };
        if let Err(e) = p.harvest(self.inner.device(), done) {
            tracing::warn!("LOWSYNC_VK_PROFILE: {e}");
        }
        p.times()
    }
    fn reset_kernel_times(&self) {
        if let Some(p) = self.inner.state.lock().profiler.as_mut() {
            p.reset();
        }
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
            graph_replay: self.inner.config.record,
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
        st.bump_generation();
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
        st.bump_generation();
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
            inner.routed_write(dst, dst_offset, data)
        })?;
        Ok(copied.is_some())
    }

    fn graph_compute_async(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        self.inner.graph_compute(graph, true)
    }
    fn graph_compute_read_async(
        &self,
        graph: &Arc<ExecGraph>,
        src: BufferId,
        offset: usize,
        len: usize,
    ) -> Result<Box<dyn Readback>> {
        let inner = &self.inner;
        // A read that cannot be queued fails before the graph is.
        {
            let st = inner.state.lock();
            Inner::check_span(&st, &inner.name, src, offset, len)?;
        }
        inner.graph_compute(graph, false)?;
        let into = Arc::new(Mutex::new(vec![0u8; len]));
        // The read's copy goes at the end of the graph's command buffer, and `queue_read`
        // submits both: the step is one submission.
        let read = inner.queue_read(src, offset, len, true, || ReadTarget::Owned(into.clone()));
        // The graph is queued whatever became of the read (an empty read submits nothing).
        inner.submit_open()?;
        let point = read?;
        Ok(Box::new(VkReadback {
            owner: inner.clone(),
            point,
            into,
            bytes: None,
        }))
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        self.inner.event_new()
    }
    fn event_record(&self, ev: &Arc<dyn Event>) -> Result<()> {
        self.inner.event_record(ev)
    }
    fn event_wait(&self, ev: &Arc<dyn Event>) -> Result<()> {
        self.inner.event_wait(ev)
    }
    fn gate_close(&self) -> Result<Arc<dyn Gate>> {
        self.inner.gate_close()
    }
}

/// Block dtypes with Vulkan kernels (`QUANTS` in build.rs lists the same): every GGUF block
/// type of the IR.
pub const VK_QUANTS: &[DType] = &[
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

/// Whether the Vulkan kernels implement `op` for these dtypes: the graph's rule
/// ([`Op::accepts`]), except that the products write f32 only, and block (quantized) sources
/// are read only as [`VK_QUANTS`] weights of `MulMat` over f32 activations and tables of
/// `GetRows` (not yet as experts of `MulMatId`).
pub fn vulkan_supports_op(op: &Op, dst: DType, srcs: &[DType]) -> bool {
    if srcs.iter().any(|s| s.is_quantized()) {
        // Block weights: `x @ w.T` with f32 x into f32 (`mul_mat_vec_q*.wgsl`, any number of
        // rows of x) and get_rows of a table (`get_rows_q.wgsl`), for the types in VK_QUANTS.
        let ok = match (op, srcs) {
            (Op::MulMat, [DType::F32, w]) => dst == DType::F32 && VK_QUANTS.contains(w),
            (Op::GetRows, [t, DType::I32]) => dst.is_float() && VK_QUANTS.contains(t),
            _ => false,
        };
        return ok && op.accepts(dst, srcs);
    }
    let narrowed = match op {
        Op::MulMat | Op::MulMatId => dst == DType::F32,
        _ => true,
    };
    narrowed && op.accepts(dst, srcs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_are_narrowed_to_f32_and_everything_else_follows_the_graph_rule() {
        use DType::{F16, F32, I32};
        assert!(Op::MulMat.accepts(F16, &[F16, F16]));
        assert!(!vulkan_supports_op(&Op::MulMat, F16, &[F16, F16]));
        assert!(vulkan_supports_op(&Op::MulMat, F32, &[F16, F32]));
        assert!(!vulkan_supports_op(
            &Op::MulMatId,
            F16,
            &[F16, F16, I32, F32]
        ));
        assert!(vulkan_supports_op(
            &Op::MulMatId,
            F32,
            &[F16, F16, I32, F32]
        ));
        assert!(Op::MulMat.accepts(F32, &[F32, DType::Q4_0]));
        for &q in VK_QUANTS {
            assert!(vulkan_supports_op(&Op::MulMat, F32, &[F32, q]));
            assert!(vulkan_supports_op(&Op::GetRows, F32, &[q, I32]));
            assert!(vulkan_supports_op(&Op::GetRows, F16, &[q, I32]));
            assert!(!vulkan_supports_op(&Op::MulMat, F32, &[F16, q]));
            assert!(!vulkan_supports_op(&Op::MulMat, F16, &[F32, q]));
            assert!(!vulkan_supports_op(&Op::MulMatId, F32, &[q, F32, I32, F32]));
        }
        // Every block type of the IR has kernels.
        for dt in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            assert!(VK_QUANTS.contains(&dt), "{dt}");
        }
        let others: [(Op, DType, &[DType]); 12] = [
            (Op::Add, F32, &[F32, F16]),
            (Op::Add, F32, &[F32]),
            (Op::GetRows, F16, &[F16, I32]),
            (Op::Argmax, I32, &[F32]),
            (Op::Cpy, I32, &[I32]),
            (Op::Cpy, F32, &[I32]),
            (Op::Penalize, F32, &[F32, I32, F32]),
            (Op::Penalize, F16, &[F16, I32, F32]),
            (Op::Penalize, F32, &[F32, F32, F32]),
            (Op::Sample, I32, &[F32, F32, I32]),
            (Op::Sample, I32, &[F16, F32, I32]),
            (Op::Sample, F32, &[F32, F32, I32]),
        ];
        for (op, dst, srcs) in others {
            assert_eq!(
                vulkan_supports_op(&op, dst, srcs),
                op.accepts(dst, srcs),
                "{op:?}"
            );
        }
        // The sampler runs on Vulkan for exactly the dtypes of the graph's rule: f32 logits.
        assert!(vulkan_supports_op(&Op::Penalize, F32, &[F32, I32, F32]));
        assert!(vulkan_supports_op(&Op::Sample, I32, &[F32, F32, I32]));
        assert!(!vulkan_supports_op(&Op::Sample, I32, &[F16, F32, I32]));
    }
}
