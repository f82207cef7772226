//! The Vulkan stream: one open command buffer, compute and transfer timelines, and everything
//! reclaimed when a timeline value completes.
//!
//! Why: lowsync's claim is that a decode step needs one host wait, no empty submissions and
//! one H2D copy. That holds only if every enqueue goes through one place that knows what is
//! outstanding: this module. Work is recorded into an *open* command buffer; staged writes
//! and graph dispatches share it, and it is submitted by `graph_compute_async` (or by
//! whatever must wait on it), signalling the next value of the compute timeline — the fence
//! rides on the last compute submission, so `synchronize` never needs an empty submit.
//!
//! Strategy: tickets, not timing (`crate::timeline`). `submitted` is the last value a compute
//! submission will signal; `observed` is the last value the host saw complete through a wait.
//! `synchronize` is elided iff nothing is open and `observed == submitted` on both timelines
//! (invariant 6). Transfer-route copies (`crate::transfer`) are separate submissions signalling
//! the transfer timeline; the next compute submission waits on it, and a host wait on compute
//! covers every transfer value a completed compute submission waited on. Hazards inside a
//! command buffer are tracked by the byte ranges each command binds (the same ranges the
//! synchronization validation layer sees); a global barrier separates a command from earlier
//! ones it conflicts with, and every command buffer opens with a barrier against earlier
//! submissions and closes with one that makes device writes visible to the host. Graph plans
//! (`crate::plan`) are recorded as they are, or once into a secondary command buffer that the
//! open buffer executes on every later step (after the same opening barrier, so the staged
//! input copies recorded before it are ordered before the plan's first command);
//! `generation` is bumped when a buffer is freed or replaced and when cached descriptor sets
//! are dropped, which retires every plan and its recording.
//!
//! Invariants: a submission always carries at least one command (invariant 7; the legacy
//! switch's empty submit is the one exception); resources used by a submission (command
//! buffers, recorded plans, staging regions, descriptor sets, freed buffers, gate semaphores)
//! are reused or destroyed only after its retire point completed (invariant 8).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use ash::vk;
use gpu_allocator::vulkan::Allocator;
use lowsync_backend::{bump, BufferId, Error, Result, SyncStats};

use crate::device::{allocate_command_buffer, unavailable, vk_err, Device};
use crate::memory::{destroy_buffer, Arena, DevBuffer, Region};
use crate::pipelines::Pipelines;
use crate::plan::{Access, CachedPlan, ErrorSite, Recorded, RecordedPlan};
use crate::profile::{Label, Profiler};
use crate::timeline::{submit_timeline, Retire, Timeline};
use crate::transfer::TransferRoute;

/// A semaphore the host signals to value 1: a test gate.
pub(crate) struct HostSignal {
    pub sem: vk::Semaphore,
    pub signaled: Arc<AtomicBool>,
    /// The last submissions that waited on it.
    pub last_waited: Retire,
    /// Still to be waited on by the next compute submission.
    pub pending: bool,
}

/// The command buffer being recorded.
pub(crate) struct Recording {
    pub cmd: vk::CommandBuffer,
    pub has_work: bool,
    /// Accesses since the last barrier.
    since_barrier: Vec<Access>,
    bound: vk::Pipeline,
    pub barriers: u64,
    /// Commands were recorded without tracking: the next tracked one needs a barrier.
    untracked: bool,
}

/// A read queued by `get_tensor_async`, copied out when its submission completes.
pub(crate) struct PendingRead {
    pub retire: Retire,
    pub src: *const u8,
    pub out: ReadTarget,
    pub len: usize,
}

/// Where a pending read lands.
pub(crate) enum ReadTarget {
    /// Caller memory, valid until the next synchronize (`get_tensor_async`'s contract).
    Raw(*mut u8),
    /// Memory a `read_async` ticket shares, so dropping the ticket early is safe.
    Owned(Arc<Mutex<Vec<u8>>>),
}

/// The error-status words of index-checking kernels: `[count, tag, position, value]`.
pub(crate) struct StatusWords {
    pub buf: DevBuffer,
    pub ptr: *mut u32,
}

const ALL_STAGES: vk::PipelineStageFlags = vk::PipelineStageFlags::from_raw(
    vk::PipelineStageFlags::COMPUTE_SHADER.as_raw() | vk::PipelineStageFlags::TRANSFER.as_raw(),
);
const WRITES: vk::AccessFlags = vk::AccessFlags::from_raw(
    vk::AccessFlags::SHADER_WRITE.as_raw() | vk::AccessFlags::TRANSFER_WRITE.as_raw(),
);
const READS_WRITES: vk::AccessFlags = vk::AccessFlags::from_raw(
    vk::AccessFlags::SHADER_READ.as_raw()
        | vk::AccessFlags::SHADER_WRITE.as_raw()
        | vk::AccessFlags::TRANSFER_READ.as_raw()
        | vk::AccessFlags::TRANSFER_WRITE.as_raw(),
);

/// Everything mutable of one backend, behind its state lock.
pub(crate) struct State {
    pub allocator: Option<Allocator>,
    pub buffers: HashMap<BufferId, DevBuffer>,
    pub staging: Arena,
    pub readback: Arena,
    pub scratch: Arena,
    pub pipelines: Pipelines,
    pub compute: Timeline,
    pub pool: vk::CommandPool,
    pub free_cmds: Vec<vk::CommandBuffer>,
    /// Submitted compute command buffers: (value, buffer).
    pub inflight: VecDeque<(u64, vk::CommandBuffer)>,
    pub transfer: Option<TransferRoute>,
    pub open: Option<Recording>,
    pub signals: Vec<HostSignal>,
    pub graveyard: Vec<(Retire, DevBuffer)>,
    pub pending_reads: Vec<PendingRead>,
    pub status: Option<StatusWords>,
    /// The split decode attention's partials (`crate::exec`), created at its first use.
    pub attn_parts: Option<DevBuffer>,
    /// The split-k products' partials (`LOWSYNC_VK_SPLIT_K`), created with the backend when
    /// the setting is on and kept at one size, so recorded plans binding it stay valid.
    pub split_parts: Option<DevBuffer>,
    pub error_sites: HashMap<u32, ErrorSite>,
    pub next_tag: u32,
    pub legacy_fence: vk::Fence,
    /// Buffers of this backend that may be in use by queue families other than compute.
    pub families: Vec<u32>,
    /// Graph plans by graph address (checked against a weak reference and the generation),
    /// with their recorded command buffers.
    pub plans: HashMap<usize, CachedPlan>,
    /// Recorded plans retired from the cache: (last compute value that executes it, buffer),
    /// freed once that value completed.
    pub retired_recordings: Vec<(u64, vk::CommandBuffer)>,
    /// Bumped whenever a buffer is freed or replaced, or cached descriptor sets are dropped.
    pub generation: u64,
    /// Timestamps around every dispatch (`LOWSYNC_VK_PROFILE`); `None` when not profiling.
    pub profiler: Option<Profiler>,
}

// SAFETY: raw pointers in `State` (mapped memory, pending reads) are only dereferenced under
// the state lock, and the memory they point to is owned by the state or by callers who
// promised to keep it valid (`get_tensor_async`).
unsafe impl Send for State {}

impl State {
    /// A readback region of `len` bytes used by submissions up to `retire`; `Ok(None)` when
    /// the arena is full of reads in flight (wait, then retry).
    pub(crate) fn alloc_readback(
        &mut self,
        len: u64,
        retire: Retire,
        device: &ash::Device,
    ) -> Result<Option<Region>> {
        let State {
            readback,
            allocator,
            ..
        } = self;
        let allocator = allocator
            .as_mut()
            .ok_or_else(|| unavailable("the backend is shutting down"))?;
        readback.alloc(len, 16, retire, device, allocator)
    }

    pub(crate) fn allocator(&mut self) -> Result<&mut Allocator> {
        self.allocator
            .as_mut()
            .ok_or_else(|| unavailable("the backend is shutting down"))
    }

    /// The retire point of work recorded into the open command buffer now.
    pub(crate) fn open_retire(&self) -> Retire {
        Retire {
            compute: self.compute.submitted + 1,
            transfer: 0,
        }
    }

    /// What the host knows to be complete (for reclaiming).
    pub(crate) fn completed(&self) -> Retire {
        Retire {
            compute: self.compute.completed,
            transfer: self.transfer.as_ref().map_or(0, |t| t.tl.completed),
        }
    }

    /// The end of the stream: a point after everything enqueued so far.
    pub(crate) fn end_point(&self) -> Retire {
        let open = self.open.as_ref().is_some_and(|r| r.has_work);
        Retire {
            compute: self.compute.submitted + u64::from(open),
            transfer: self.transfer.as_ref().map_or(0, |t| t.tl.submitted),
        }
    }

    /// Whether anything was enqueued since the host last saw the stream complete.
    pub(crate) fn outstanding(&self) -> bool {
        self.open.as_ref().is_some_and(|r| r.has_work)
            || self.compute.submitted > self.compute.observed
            || self
                .transfer
                .as_ref()
                .is_some_and(|t| t.tl.submitted > t.tl.observed)
    }

    /// What a host wait must reach so that everything submitted has completed; `None` when
    /// nothing is outstanding. Call after submitting the open work.
    pub(crate) fn wait_target(&self) -> Option<Retire> {
        let c = self.compute.submitted > self.compute.observed;
        let t = self
            .transfer
            .as_ref()
            .is_some_and(|t| t.tl.submitted > t.tl.observed);
        (c || t).then(|| Retire {
            compute: if c { self.compute.submitted } else { 0 },
            transfer: if t {
                self.transfer.as_ref().map_or(0, |t| t.tl.submitted)
            } else {
                0
            },
        })
    }

    fn take_cmd(&mut self, device: &ash::Device) -> Result<vk::CommandBuffer> {
        match self.free_cmds.pop() {
            Some(c) => Ok(c),
            None => allocate_command_buffer(device, self.pool, vk::CommandBufferLevel::PRIMARY),
        }
    }

    /// The open recording, beginning a command buffer when none is open.
    pub(crate) fn open(&mut self, device: &ash::Device) -> Result<&mut Recording> {
        if self.open.is_none() {
            let cmd = self.take_cmd(device)?;
            let begin = vk::CommandBufferBeginInfo::default()
                .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: a reset (or fresh) command buffer owned by this state.
            if let Err(r) = unsafe { device.begin_command_buffer(cmd, &begin) } {
                self.free_cmds.push(cmd);
                return Err(vk_err("vkBeginCommandBuffer", r));
            }
            // Order this buffer after every earlier submission on the queue.
            barrier(device, cmd, ALL_STAGES, WRITES, ALL_STAGES, READS_WRITES);
            self.open = Some(Recording {
                cmd,
                has_work: false,
                since_barrier: Vec::new(),
                bound: vk::Pipeline::null(),
                barriers: 1,
                untracked: false,
            });
        }
        self.open
            .as_mut()
            .ok_or_else(|| unavailable("no open command buffer"))
    }

    /// Records a buffer copy into the open command buffer.
    pub(crate) fn record_copy(
        &mut self,
        device: &ash::Device,
        src: (vk::Buffer, u64),
        dst: (vk::Buffer, u64),
        size: u64,
    ) -> Result<()> {
        let rec = self.open(device)?;
        let acc = [
            Access {
                buffer: src.0,
                start: src.1,
                end: src.1 + size,
                write: false,
            },
            Access {
                buffer: dst.0,
                start: dst.1,
                end: dst.1 + size,
                write: true,
            },
        ];
        rec.order(device, &acc);
        let region = vk::BufferCopy {
            src_offset: src.1,
            dst_offset: dst.1,
            size,
        };
        // SAFETY: both ranges were bounds-checked by the caller; the buffer is recording.
        unsafe { device.cmd_copy_buffer(rec.cmd, src.0, dst.0, &[region]) };
        rec.has_work = true;
        Ok(())
    }

    /// Records a graph plan into the open command buffer, after a barrier against whatever
    /// the buffer already holds (so the plan's own barrier placement holds); when profiling,
    /// with a timestamp before the plan and after each of its commands.
    pub(crate) fn record_steps(&mut self, device: &ash::Device, steps: &[Recorded]) -> Result<()> {
        if steps.is_empty() {
            return Ok(());
        }
        self.open(device)?;
        let State { open, profiler, .. } = self;
        let Some(rec) = open.as_mut() else {
            return Err(unavailable("no open command buffer"));
        };
        rec.barrier_if_used(device);
        let stamps = match profiler {
            Some(p) => Some(p.begin(device, rec.cmd, labels(steps))?),
            None => None,
        };
        rec.barriers += record_commands(device, rec.cmd, steps, &mut rec.bound, stamps);
        rec.since_barrier.clear();
        rec.untracked = true;
        rec.has_work = true;
        Ok(())
    }

    /// Records `steps` once into a new secondary command buffer that steps in flight together
    /// may all execute (SIMULTANEOUS_USE); it starts with no pipeline bound, as a secondary
    /// buffer inherits no state.
    pub(crate) fn record_plan(
        &mut self,
        device: &ash::Device,
        steps: &[Recorded],
    ) -> Result<vk::CommandBuffer> {
        let cmd = allocate_command_buffer(device, self.pool, vk::CommandBufferLevel::SECONDARY)?;
        let inheritance = vk::CommandBufferInheritanceInfo::default();
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::SIMULTANEOUS_USE)
            .inheritance_info(&inheritance);
        // SAFETY: a fresh secondary buffer of this state's pool (the state lock serialises the
        // pool); plans hold live handles and checked ranges (see `record_steps`).
        let r = unsafe {
            device.begin_command_buffer(cmd, &begin).and_then(|()| {
                record_commands(device, cmd, steps, &mut vk::Pipeline::null(), None);
                device.end_command_buffer(cmd)
            })
        };
        if let Err(r) = r {
            // SAFETY: never executed by any primary buffer.
            unsafe { device.free_command_buffers(self.pool, &[cmd]) };
            return Err(vk_err("recording a graph plan", r));
        }
        Ok(cmd)
    }

    /// Executes a recorded plan from the open command buffer, after a barrier against whatever
    /// the buffer already holds (as `record_steps`). The caller keeps the recording alive until
    /// the submission of the open buffer (`open_retire`) completed.
    pub(crate) fn execute_recorded(
        &mut self,
        device: &ash::Device,
        recorded: vk::CommandBuffer,
    ) -> Result<()> {
        let rec = self.open(device)?;
        rec.barrier_if_used(device);
        // SAFETY: the primary is recording; `recorded` is an ended secondary buffer begun with
        // SIMULTANEOUS_USE whose handles are live while its plan's generation is current.
        unsafe { device.cmd_execute_commands(rec.cmd, &[recorded]) };
        // The primary's bound pipeline is undefined after a secondary buffer ran.
        rec.bound = vk::Pipeline::null();
        rec.since_barrier.clear();
        rec.untracked = true;
        rec.has_work = true;
        Ok(())
    }

    /// Takes a plan out of service: its recording is freed once its last submission completed.
    pub(crate) fn retire_plan(&mut self, cached: CachedPlan) {
        if let Some(RecordedPlan { cmd, last_used }) = cached.recorded {
            self.retired_recordings.push((last_used, cmd));
        }
    }

    /// A buffer was freed or replaced, or cached descriptor sets were dropped: no plan may be
    /// replayed any more, so every cached plan is retired with its recording.
    pub(crate) fn bump_generation(&mut self) {
        self.generation += 1;
        let plans: Vec<CachedPlan> = self.plans.drain().map(|(_, p)| p).collect();
        for p in plans {
            self.retire_plan(p);
        }
    }

    /// Submits the open command buffer when it carries work (never an empty batch), waiting
    /// on pending gates and transfer work and signalling the next compute value; `fence` is
    /// the legacy path's fence.
    pub(crate) fn submit_open(
        &mut self,
        dev: &Device,
        stats: &SyncStats,
        fence: vk::Fence,
    ) -> Result<()> {
        let device = &dev.device;
        let Some(rec) = self.open.as_ref() else {
            return Ok(());
        };
        if !rec.has_work {
            return Ok(());
        }
        let cmd = rec.cmd;
        // Device writes become visible to host reads after the wait (`get_tensor`, status).
        barrier(
            device,
            cmd,
            ALL_STAGES,
            WRITES,
            vk::PipelineStageFlags::HOST,
            vk::AccessFlags::HOST_READ,
        );
        // SAFETY: the buffer is recording.
        unsafe { device.end_command_buffer(cmd) }.map_err(|r| vk_err("vkEndCommandBuffer", r))?;
        let value = self.compute.submitted + 1;
        let mut waits = Vec::new();
        for s in self.signals.iter_mut().filter(|s| s.pending) {
            if !s.signaled.load(Ordering::Acquire) {
                waits.push((s.sem, 1u64));
                s.last_waited = s.last_waited.max(Retire {
                    compute: value,
                    transfer: 0,
                });
            }
            s.pending = false;
        }
        let waited_transfer = self.transfer.as_mut().and_then(TransferRoute::compute_wait);
        waits.extend(waited_transfer);
        // SAFETY: queue access is serialised by the state lock; the buffer has ended; everything
        // referenced lives until the submission's retire point.
        let r = unsafe {
            submit_timeline(
                device,
                dev.compute.queue,
                cmd,
                &waits,
                ALL_STAGES,
                (self.compute.sem, value),
                fence,
            )
        };
        bump(&stats.submits, 1);
        self.open = None;
        if let Some(p) = self.profiler.as_mut() {
            if r.is_ok() {
                p.submitted(value);
            } else {
                p.abandon_open();
            }
        }
        if let Err(r) = r {
            // The buffer never ran; recycle it.
            // SAFETY: not pending (the submit failed).
            let _ =
                unsafe { device.reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty()) };
            self.free_cmds.push(cmd);
            return Err(vk_err("vkQueueSubmit", r));
        }
        self.compute.submitted = value;
        self.inflight.push_back((value, cmd));
        if let (Some(t), Some((_, v))) = (self.transfer.as_mut(), waited_transfer) {
            t.waited_by(value, v);
        }
        Ok(())
    }

    /// Records that the host saw `target` complete, then reclaims what it frees; reports a
    /// kernel index error once the stream is idle.
    pub(crate) fn complete(
        &mut self,
        dev: &Device,
        stats: &SyncStats,
        target: Retire,
    ) -> Result<()> {
        self.compute.observed = self.compute.observed.max(target.compute);
        self.compute.completed = self.compute.completed.max(self.compute.observed);
        // A completed compute submission implies the transfer values it waited on.
        if let Some(t) = self.transfer.as_mut() {
            t.observe(self.compute.observed, target.transfer);
        }
        let done = Retire {
            compute: self.compute.observed,
            transfer: self.transfer.as_ref().map_or(0, |t| t.tl.observed),
        };
        // Reads queued by get_tensor_async land now (valid after this wait).
        let mut i = 0;
        while i < self.pending_reads.len() {
            if self.pending_reads[i].retire.done_by(done) {
                let r = self.pending_reads.swap_remove(i);
                match r.out {
                    // SAFETY: `src` is a readback region held until this point; `out` is valid
                    // per the caller's `get_tensor_async` contract.
                    ReadTarget::Raw(out) => unsafe {
                        std::ptr::copy_nonoverlapping(r.src, out, r.len)
                    },
                    ReadTarget::Owned(out) => {
                        let mut out = out.lock();
                        let n = r.len.min(out.len());
                        // SAFETY: the region holds `r.len` bytes until this point; `out` owns
                        // `n` of them.
                        unsafe { std::ptr::copy_nonoverlapping(r.src, out.as_mut_ptr(), n) };
                    }
                }
            } else {
                i += 1;
            }
        }
        self.reclaim(dev, stats)?;
        self.check_status()
    }

    /// Polls the timelines without blocking (not a host wait), to reclaim more.
    pub(crate) fn poll(&mut self, device: &ash::Device) {
        // SAFETY: live semaphores.
        if let Ok(v) = unsafe { device.get_semaphore_counter_value(self.compute.sem) } {
            self.compute.completed = self.compute.completed.max(v);
        }
        if let Some(t) = self.transfer.as_mut() {
            t.poll(device);
        }
    }

    /// Recycles command buffers, staging regions, freed buffers, descriptor sets and host
    /// signals whose submissions completed.
    pub(crate) fn reclaim(&mut self, dev: &Device, stats: &SyncStats) -> Result<()> {
        let device = &dev.device;
        let done = self.completed();
        while let Some(&(v, cmd)) = self.inflight.front() {
            if v > done.compute {
                break;
            }
            self.inflight.pop_front();
            // SAFETY: its submission completed.
            unsafe { device.reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty()) }
                .map_err(|r| vk_err("vkResetCommandBuffer", r))?;
            self.free_cmds.push(cmd);
        }
        if let Some(p) = self.profiler.as_mut() {
            p.harvest(device, done.compute)?;
        }
        let pool = self.pool;
        self.retired_recordings.retain(|&(last_used, cmd)| {
            let keep = last_used > done.compute;
            if !keep {
                // SAFETY: every submission that executed it completed, and the primary buffers
                // that did were reset above.
                unsafe { device.free_command_buffers(pool, &[cmd]) };
            }
            keep
        });
        if let Some(t) = self.transfer.as_mut() {
            t.reclaim(device, done.transfer)?;
        }
        let Some(allocator) = self.allocator.as_mut() else {
            return Ok(());
        };
        let freed = self.staging.reclaim(done, device, allocator);
        stats
            .staging_bytes_in_use
            .fetch_sub(freed, Ordering::Relaxed);
        self.readback.reclaim(done, device, allocator);
        self.scratch.reclaim(done, device, allocator);
        let mut i = 0;
        while i < self.graveyard.len() {
            if self.graveyard[i].0.done_by(done) {
                let (_, b) = self.graveyard.swap_remove(i);
                self.pipelines.forget_buffer(device, b.buffer);
                destroy_buffer(device, allocator, b);
            } else {
                i += 1;
            }
        }
        self.signals.retain(|s| {
            let signaled = s.signaled.load(Ordering::Acquire);
            let drop = signaled && s.last_waited.done_by(done);
            if drop {
                // SAFETY: signalled and no longer waited on by pending work.
                unsafe { device.destroy_semaphore(s.sem, None) };
            }
            !drop
        });
        self.forget_arena_chunks(device);
        // Cached sets are dropped only on an idle stream (no submission can use one), and
        // plans that bound them are retired with the generation.
        if !self.outstanding() && self.pipelines.evict(device) {
            self.bump_generation();
        }
        Ok(())
    }

    /// Drops cached descriptor sets that bound arena chunks destroyed since the last call.
    pub(crate) fn forget_arena_chunks(&mut self, device: &ash::Device) {
        let mut gone = self.scratch.take_destroyed();
        gone.extend(self.staging.take_destroyed());
        gone.extend(self.readback.take_destroyed());
        for b in gone {
            self.pipelines.forget_buffer(device, b);
        }
    }

    /// Reports (once) the first index error a kernel recorded, when the stream is idle.
    fn check_status(&mut self) -> Result<()> {
        if self.outstanding() {
            return Ok(());
        }
        let Some(s) = self.status.as_ref() else {
            return Ok(());
        };
        // SAFETY: four mapped, coherent words; no submission is outstanding, and the closing
        // barrier of every submission made kernel writes visible to the host.
        let words: [u32; 4] = unsafe { std::array::from_fn(|i| s.ptr.add(i).read_volatile()) };
        let sites = std::mem::take(&mut self.error_sites);
        if words[0] == 0 {
            return Ok(());
        }
        // SAFETY: as above; the device is idle, so the host may reset the words.
        unsafe {
            for i in 0..4 {
                s.ptr.add(i).write_volatile(0);
            }
        }
        let (tag, pos, value) = (words[1], words[2], words[3] as i32);
        Err(match sites.get(&tag) {
            Some(site) => Error::Kernel {
                op: site.op,
                node: site.node.clone(),
                msg: format!(
                    "{}[{pos}] = {value} is out of range for {} with {} rows",
                    site.what, site.rows_of, site.n
                ),
            },
            None => Error::Kernel {
                op: "index",
                node: format!("tag {tag}"),
                msg: format!("index {value} at position {pos} is out of range"),
            },
        })
    }
}

impl Recording {
    /// A barrier against everything the buffer already holds, when it holds anything: a graph
    /// plan's own barrier placement assumes it starts on a clean slate.
    fn barrier_if_used(&mut self, device: &ash::Device) {
        if self.has_work {
            self.full_barrier(device);
        }
    }

    /// Inserts a barrier when `acc` conflicts with a command since the last barrier.
    fn order(&mut self, device: &ash::Device, acc: &[Access]) {
        let conflict = self.untracked
            || acc
                .iter()
                .any(|a| self.since_barrier.iter().any(|b| a.conflicts(b)));
        if conflict {
            self.untracked = false;
            self.full_barrier(device);
            self.since_barrier.clear();
        }
        self.since_barrier.extend_from_slice(acc);
    }

    /// A global barrier (every write before it visible to every read and write after it),
    /// counted.
    fn full_barrier(&mut self, device: &ash::Device) {
        barrier(
            device,
            self.cmd,
            ALL_STAGES,
            WRITES,
            ALL_STAGES,
            READS_WRITES,
        );
        self.barriers += 1;
    }
}

/// What a profile reports each command of `steps` as (barriers are not commands of their own:
/// their time counts towards the command after them).
fn labels(steps: &[Recorded]) -> Vec<Label> {
    steps
        .iter()
        .filter_map(|s| match s {
            Recorded::Barrier => None,
            Recorded::Copy { size, .. } => Some(Label {
                name: "copy".into(),
                read_bytes: *size,
            }),
            Recorded::Dispatch {
                kernel, read_bytes, ..
            } => Some(Label {
                name: kernel.clone(),
                read_bytes: *read_bytes,
            }),
        })
        .collect()
}

/// Records a graph plan's commands into `cmd` (a primary or secondary buffer that is
/// recording); `bound` is the pipeline bound in `cmd` before and after. With `stamps`, a
/// timestamp is written into query `i + 1` after the `i`-th command (barriers not counted).
/// Returns the barriers recorded.
fn record_commands(
    device: &ash::Device,
    cmd: vk::CommandBuffer,
    steps: &[Recorded],
    bound: &mut vk::Pipeline,
    stamps: Option<vk::QueryPool>,
) -> u64 {
    let mut barriers = 0;
    let mut timed = 0;
    for s in steps {
        // SAFETY: plans hold live pipelines, layouts and sets (a freed buffer or evicted
        // set bumps the generation, which retires the plan); ranges were checked.
        unsafe {
            match s {
                Recorded::Barrier => {
                    barrier(device, cmd, ALL_STAGES, WRITES, ALL_STAGES, READS_WRITES);
                    barriers += 1;
                }
                Recorded::Copy { src, dst, size } => {
                    let region = vk::BufferCopy {
                        src_offset: src.1,
                        dst_offset: dst.1,
                        size: *size,
                    };
                    device.cmd_copy_buffer(cmd, src.0, dst.0, &[region]);
                }
                Recorded::Dispatch {
                    pipeline,
                    layout,
                    set,
                    push,
                    groups,
                    ..
                } => {
                    if *bound != *pipeline {
                        device.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, *pipeline);
                        *bound = *pipeline;
                    }
                    device.cmd_bind_descriptor_sets(
                        cmd,
                        vk::PipelineBindPoint::COMPUTE,
                        *layout,
                        0,
                        &[*set],
                        &[],
                    );
                    device.cmd_push_constants(
                        cmd,
                        *layout,
                        vk::ShaderStageFlags::COMPUTE,
                        0,
                        bytemuck::bytes_of(push),
                    );
                    device.cmd_dispatch(cmd, groups[0], groups[1], groups[2]);
                }
            }
            if let (Some(pool), false) = (stamps, matches!(s, Recorded::Barrier)) {
                timed += 1;
                // The pool holds a query per command plus the opening one (`Profiler::begin`).
                device.cmd_write_timestamp(
                    cmd,
                    vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                    pool,
                    timed,
                );
            }
        }
    }
    barriers
}

/// A global memory barrier.
pub(crate) fn barrier(
    device: &ash::Device,
    cmd: vk::CommandBuffer,
    src: vk::PipelineStageFlags,
    src_access: vk::AccessFlags,
    dst: vk::PipelineStageFlags,
    dst_access: vk::AccessFlags,
) {
    let mb = vk::MemoryBarrier::default()
        .src_access_mask(src_access)
        .dst_access_mask(dst_access);
    // SAFETY: `cmd` is recording.
    unsafe {
        device.cmd_pipeline_barrier(cmd, src, dst, vk::DependencyFlags::empty(), &[mb], &[], &[])
    };
}

/// Signals a host semaphore to 1 once.
pub(crate) fn signal_once(device: &ash::Device, sem: vk::Semaphore, flag: &AtomicBool) {
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
