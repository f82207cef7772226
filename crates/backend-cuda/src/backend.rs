//! `cuda:N`: the CUDA backend.
//!
//! Why: the GPU must be driven with as few host waits as the work allows: one per token in
//! synchronous decode (the read of the sampled token). Every other wait ggml makes — per input
//! copy, per split, a sync with nothing queued — is removed here or in the scheduler.
//!
//! Strategy: one non-blocking stream per backend ([`TicketStream`], the choke point of every
//! enqueue and the home of the counters); device buffers from a table with a reuse pool; staged
//! writes through a bounded pinned arena ([`Staging`]), or, when small, in a batch of copies
//! that runs as one kernel with the host bytes in its parameters (`CudaConfig::copy_kernel_max`:
//! between two decode graphs no copy engine runs); blocking reads through a pinned readback
//! buffer (one DMA, one wait, one memcpy); events without timing; the test gate as
//! `cuStreamWaitValue32` on a host-mapped word. Kernels (NVRTC) and matmul (cuBLAS) are queued
//! by [`crate::ops`]. Every public entry binds the backend's context to the calling thread.
//!
//! Invariants: (1) a staged write's bytes are in the arena (or the pending batch) before the
//! call returns; (2) every
//! write, copy and kernel is queued on the one stream, so it runs after the work queued before
//! it, and a copy from another CUDA backend waits on an event recorded on that backend's
//! stream; (6) elided syncs as in [`crate::tickets`]; (8) the arena is bounded; counters are
//! bumped only inside the primitives of [`TicketStream`] and here.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::CudaContext;
use lowsync_backend::{
    bump, env, with_host_source, Backend, BufferId, BufferType, BufferUsage, Caps, DeviceKind,
    Error, Event, ExecGraph, Gate, Readback, Result, SyncStats,
};
use lowsync_graph::{DType, Op};
use parking_lot::Mutex;

use crate::capture::{Action, GraphCache};
use crate::driver::{CuCtx, CuDriver, CuEvent, CuTimedEvent};
use crate::kernels::Kernel;
use crate::kernels::Modules;
use crate::matmul::Blas;
use crate::memory::{Buffers, DevBuf, HeadWork, Pinned, ALIGNMENT};
use crate::ops::{Exec, Scratch};
use crate::staging::{ChunkMem, Staging};
use crate::tickets::{Counted, LaunchDims, SyncElision, TicketStream};

/// Settings of one CUDA backend. [`CudaConfig::from_env`] reads ARCHITECTURE §8's variables;
/// tests build one explicitly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// Elide a `synchronize` with nothing outstanding (`LOWSYNC_CUDA_SYNC_ELISION`, default
    /// on). Only takes effect when the process sees exactly one CUDA device.
    pub sync_elision: bool,
    /// Size of one pinned staging chunk (the largest piece one staged copy moves).
    pub staging_chunk_bytes: usize,
    /// Bound on the pinned staging arena (invariant 8).
    pub staging_max_bytes: usize,
    /// Bound on the pinned readback buffer of blocking reads; larger reads go to caller memory.
    pub readback_max_bytes: usize,
    /// Rows of a up to which `MulMat` runs the matrix-vector kernels instead of cuBLAS
    /// (`LOWSYNC_CUDA_MMV_MAX_M`; `None`: 8, or 32 when cuBLAS would first convert an f16/bf16
    /// b to f32; `Some(0)`: always cuBLAS). A tuning and comparison knob.
    pub mmv_max_m: Option<usize>,
    /// Capture each compute graph into a CUDA graph once per shape bucket and replay it
    /// (`LOWSYNC_CUDA_GRAPHS`, default on).
    pub graphs: bool,
    /// Run fused kernels for the node patterns of `fusion` (`LOWSYNC_CUDA_FUSION`,
    /// default on); off runs one kernel per node, the reference the fused kernels are checked
    /// against.
    pub fusion: bool,
    /// Time each compute graph on the device with a pair of timing events and add the elapsed
    /// time to the `device_ns` counter when a wait observes it (`LOWSYNC_CUDA_TIMING`, default
    /// off: timing events are not free).
    pub timing: bool,
    /// How single-row matrix-vector products read their activation row (a tuning knob for
    /// benches; `Off` sends them to the general matrix-vector kernels).
    pub decode_gemv: DecodeGemv,
    /// Launch kernels with programmatic dependent launch (`LOWSYNC_CUDA_PDL`, default on; takes
    /// effect on compute capability 9.0 and newer): a kernel's blocks may start while the one
    /// before it finishes, and wait on the device (`griddepcontrol.wait`) before they touch
    /// its results; decode's matrix-vector kernels load their first weights before that wait.
    pub pdl: bool,
    /// Decode attention takes its short-path kernel `attn_fast` where it applies
    /// (`LOWSYNC_CUDA_ATTN_FAST`, default on); off runs the general `attn_decode` — a knob for
    /// comparing the two inside the replayed graph.
    pub attn_fast: bool,
    /// Decode attention (`attn_fast`), launched ahead of its producer (programmatic dependent
    /// launch), rehearses before its wait (`LOWSYNC_CUDA_REHEARSE`, default on): it runs its
    /// own path once on the inputs as they are, with no global stores, so that its
    /// instructions are cached when the wait returns. Off is a knob for measuring what that
    /// buys.
    pub rehearse: bool,
    /// Decode's gate/up (streamed) and q/k/v (row pairs) take their own entry points per
    /// weight dtype, `fused_gemv1_gu16` and `fused_gemv1_rp16` and kin
    /// (`LOWSYNC_CUDA_GEMV_SPLIT`, default on): each holds one path, which fits in 88
    /// registers without a spill, where `fused_gemv1_pair` holds both. Off is a knob for
    /// measuring what that buys.
    pub gemv_split: bool,
    /// Decode's matrix-vector products without row-pair epilogues run streamed
    /// (`LOWSYNC_CUDA_GEMV_STREAM`, default on): a grid of at most `stream_blocks` blocks per
    /// multiprocessor whose warps stride over the output units, keeping their weight loads in
    /// flight from one unit to the next, with the norm prologue folded in; off launches one
    /// warp per unit as before.
    pub gemv_stream: bool,
    /// Resident blocks per multiprocessor of a streamed product's grid
    /// (`LOWSYNC_CUDA_GEMV_BLOCKS`, default 2).
    pub stream_blocks: usize,
    /// Shared memory (KiB) each block of a streamed product asks for at least
    /// (`LOWSYNC_CUDA_GEMV_PAD_KB`; 0 turns it off). `None`, the default, takes the least that
    /// keeps `stream_blocks + 1` of them off one multiprocessor (80 KiB on the H200): the
    /// streamed entry points take 80 registers, so without it a third block would land where
    /// the next kernel's first blocks should start (see `fused_gemv1_s16` in fused.cu).
    pub stream_pad_kb: Option<usize>,
    /// Decode's weight loads carry an evict-first L2 policy (`LOWSYNC_CUDA_WEIGHT_EVICT_FIRST`,
    /// default off: plain loads measured faster on the H200; see README).
    pub weight_evict_first: bool,
    /// Host-to-device writes of at most this many bytes (`set_tensor_async_staged`; a batch
    /// holds up to 3,840 host bytes) and device-to-device copies (`copy_async`) wait in a
    /// batch that runs as one kernel right before the next thing queued on the stream, the
    /// host bytes inside its parameters (`TicketStream::defer_htod`); reads of at most this
    /// many bytes (`read_async`) ride in the batch too, or run as a one-block kernel writing
    /// the pinned slot when it cannot take them (`read_kernel`). No copy engine between two
    /// decode graphs: on the H200 the time between them fell from 16.9 to 6.7 µs with the read
    /// as its own kernel (`LOWSYNC_CUDA_COPY_KERNEL`, bytes, default 4096; 0: copy engines).
    /// Outside graph capture only; each copy is counted as the copy it is, and a batch's launch
    /// as one submission.
    pub copy_kernel_max: usize,
    /// `read_async` of at most `copy_kernel_max` bytes rides in the copy batch, or runs as a
    /// one-block kernel (`LOWSYNC_CUDA_READ_KERNEL`, default on); off takes a copy engine.
    pub read_kernel: bool,
}

/// The largest shared memory a block may ask for on any CUDA device to date (sm_90, sm_100:
/// 227 KiB); `LOWSYNC_CUDA_GEMV_PAD_KB` above it is an error.
const MAX_PAD_KB: u64 = 227;

/// The decode matrix-vector kernel's source of the activation row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeGemv {
    /// Not used: the general `mul_mat_vec_k` kernels run single rows too.
    Off,
    /// Staged once per block in shared memory.
    SharedX,
    /// Read from global memory through the read-only cache.
    GlobalX,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            sync_elision: true,
            staging_chunk_bytes: 4 << 20,
            staging_max_bytes: 64 << 20,
            readback_max_bytes: 64 << 20,
            mmv_max_m: None,
            graphs: true,
            fusion: true,
            timing: false,
            decode_gemv: DecodeGemv::SharedX,
            pdl: true,
            attn_fast: true,
            rehearse: true,
            gemv_split: true,
            gemv_stream: true,
            stream_blocks: 2,
            stream_pad_kb: None,
            weight_evict_first: false,
            copy_kernel_max: 4096,
            read_kernel: true,
        }
    }
}

impl CudaConfig {
    /// The defaults with `LOWSYNC_CUDA_SYNC_ELISION` and `LOWSYNC_CUDA_MMV_MAX_M` applied (a bad
    /// value is an error naming the variable).
    pub fn from_env() -> Result<Self> {
        Ok(CudaConfig {
            sync_elision: env::flag("LOWSYNC_CUDA_SYNC_ELISION", true)?,
            mmv_max_m: env::unsigned("LOWSYNC_CUDA_MMV_MAX_M")?
                .map(|v| usize::try_from(v).unwrap_or(usize::MAX)),
            graphs: env::flag("LOWSYNC_CUDA_GRAPHS", true)?,
            fusion: env::flag("LOWSYNC_CUDA_FUSION", true)?,
            timing: env::flag("LOWSYNC_CUDA_TIMING", false)?,
            pdl: env::flag("LOWSYNC_CUDA_PDL", true)?,
            attn_fast: env::flag("LOWSYNC_CUDA_ATTN_FAST", true)?,
            rehearse: env::flag("LOWSYNC_CUDA_REHEARSE", true)?,
            gemv_split: env::flag("LOWSYNC_CUDA_GEMV_SPLIT", true)?,
            gemv_stream: env::flag("LOWSYNC_CUDA_GEMV_STREAM", true)?,
            stream_blocks: match env::unsigned("LOWSYNC_CUDA_GEMV_BLOCKS")? {
                Some(0) => {
                    return Err(Error::Env {
                        var: "LOWSYNC_CUDA_GEMV_BLOCKS",
                        value: "0".into(),
                        expected: "a positive integer (blocks per multiprocessor)",
                    })
                }
                Some(v) => usize::try_from(v).unwrap_or(usize::MAX).min(32),
                None => 2,
            },
            stream_pad_kb: match env::unsigned("LOWSYNC_CUDA_GEMV_PAD_KB")? {
                Some(v) if v > MAX_PAD_KB => {
                    return Err(Error::Env {
                        var: "LOWSYNC_CUDA_GEMV_PAD_KB",
                        value: v.to_string(),
                        expected: "KiB of shared memory per block, at most 227",
                    })
                }
                v => v.map(|v| v as usize),
            },
            weight_evict_first: env::flag("LOWSYNC_CUDA_WEIGHT_EVICT_FIRST", false)?,
            copy_kernel_max: env::unsigned("LOWSYNC_CUDA_COPY_KERNEL")?
                .map_or(4096, |v| usize::try_from(v).unwrap_or(usize::MAX)),
            read_kernel: env::flag("LOWSYNC_CUDA_READ_KERNEL", true)?,
            ..CudaConfig::default()
        })
    }
}

impl ChunkMem for Pinned {
    fn alloc(len: usize) -> std::result::Result<Self, String> {
        Pinned::staging(len)
    }
    fn ptr(&self) -> *mut u8 {
        Pinned::ptr(self)
    }
}

/// Recently launched kernels that check indices, so that a bad index reported by the device
/// (through the error word) can name its node.
#[derive(Default)]
pub(crate) struct ErrTags {
    next: u32,
    recent: VecDeque<(u32, &'static str, String)>,
    kept: HashMap<u32, (&'static str, String)>,
}

impl ErrTags {
    /// The tag the next `tag` call hands out.
    fn peek_next(&self) -> u32 {
        self.next.wrapping_add(1).max(1)
    }

    /// Keeps the tags handed out since `first` for good: a captured graph's kernels report
    /// them at every replay, long after the recent window moved on.
    fn keep_since(&mut self, first: u32) {
        for (t, op, node) in &self.recent {
            if *t >= first {
                self.kept.insert(*t, (*op, node.clone()));
            }
        }
    }

    fn find(&self, tag: u32) -> Option<(&'static str, String)> {
        self.recent
            .iter()
            .find(|(t, _, _)| *t == tag)
            .map(|(_, op, n)| (*op, n.clone()))
            .or_else(|| self.kept.get(&tag).cloned())
    }

    pub(crate) fn tag(&mut self, op: &'static str, node: &str) -> u32 {
        self.next = self.next.wrapping_add(1).max(1);
        self.recent.push_back((self.next, op, node.to_string()));
        if self.recent.len() > 4096 {
            self.recent.pop_front();
        }
        self.next
    }
}

/// Pages of host-mapped words for test gates (one word per gate, never reused).
#[derive(Default)]
struct GateWords {
    pages: Vec<Pinned>,
    used: usize,
}

const GATE_PAGE_BYTES: usize = 4096;

/// The state shared by a backend, its events and its gates.
pub(crate) struct Inner {
    pub(crate) name: String,
    ordinal: usize,
    pub(crate) stream: TicketStream<CuDriver>,
    pub(crate) bufs: Buffers,
    staging: Mutex<Staging<CuDriver, Pinned>>,
    readback: Mutex<Option<Pinned>>,
    /// Pinned slots of `read_async`, each with the event of its last read. A slot is reused
    /// once that event completed (a read dropped before it completed stays out until then).
    read_slots: Mutex<Vec<ReadSlot>>,
    pub(crate) exec: Mutex<Scratch>,
    pub(crate) modules: Modules,
    pub(crate) blas: Mutex<Option<Blas>>,
    /// Host-mapped word kernels write a tag into on a bad index.
    pub(crate) err_word: Pinned,
    pub(crate) err_tags: Mutex<ErrTags>,
    /// The ticket and partials of kernels that elect a last block.
    pub(crate) head_work: HeadWork,
    gates: Mutex<GateWords>,
    pub(crate) cfg: CudaConfig,
    /// Kernels are launched with programmatic dependent launch (`cfg.pdl` on a device that
    /// has it: compute capability 9.0 or newer).
    pub(crate) pdl: bool,
    /// Streaming multiprocessors of the device.
    pub(crate) sms: usize,
    /// Bytes of shared memory a streamed product's block asks for at least (`stream_pad`).
    pub(crate) stream_shared: usize,
    /// Captured compute graphs (`cfg.graphs`).
    graphs: Mutex<GraphCache>,
    /// Bumped whenever device memory a captured graph may address moves or goes away.
    mem_generation: AtomicU64,
    /// Device timing of compute graphs (`cfg.timing`).
    timing: Mutex<Timing>,
    /// Declared last: dropped after everything that needs the context.
    pub(crate) ctx: Arc<CudaContext>,
}

impl Inner {
    /// Makes this backend's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.driver_err("binding the CUDA context", e))
    }

    pub(crate) fn driver_err(&self, what: &str, e: impl std::fmt::Debug) -> Error {
        Error::Unavailable {
            backend: self.name.clone(),
            reason: format!("{what} failed: {e:?}"),
        }
    }

    /// A completed wait happened: report a bad index a kernel recorded, reclaim staging and
    /// refresh the staging gauge.
    fn after_wait(&self) -> Result<()> {
        self.timing
            .lock()
            .collect(self.stream.tickets().observed, self.stream.stats());
        {
            let mut st = self.staging.lock();
            st.reclaim(self.stream.tickets().observed);
            self.stream
                .stats()
                .staging_bytes_in_use
                .store(st.bytes_in_use() as u64, Ordering::Relaxed);
        }
        let word = self.err_word.ptr().cast::<AtomicU32>();
        // SAFETY: the error word is a live, aligned u32 in pinned memory; the device writes it
        // only from kernels, which have completed (a wait just returned).
        let tag = unsafe { (*word).swap(0, Ordering::AcqRel) };
        if tag == 0 {
            return Ok(());
        }
        let (op, node) = self
            .err_tags
            .lock()
            .find(tag)
            .unwrap_or(("kernel", "?".into()));
        Err(Error::Kernel {
            op,
            node,
            msg: "an index was out of range; the rows it addressed were skipped".into(),
        })
    }

    /// Waits for the whole stream (elided when nothing is outstanding).
    pub(crate) fn wait(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| self.driver_err("cuStreamSynchronize", e))?;
        self.after_wait()
    }

    fn update_gauge(&self, st: &Staging<CuDriver, Pinned>) {
        self.stream
            .stats()
            .staging_bytes_in_use
            .store(st.bytes_in_use() as u64, Ordering::Relaxed);
    }

    /// The result of a `defer_*` call (which may launch the pending batch) as this backend's
    /// error.
    fn defer<T>(
        &self,
        r: std::result::Result<T, cudarc::driver::result::DriverError>,
    ) -> Result<T> {
        r.map_err(|e| self.driver_err("copy_batch launch", e))
    }

    /// Queues `read_async`'s copy of `len` device bytes at `src` into its pinned slot at `dst`
    /// as a one-block kernel (`small_copy`; `cfg.read_kernel`), counted as one D2H copy;
    /// `Ok(None)` when it does not apply (too long, a graph being captured, kernels
    /// unavailable), and the caller takes a copy engine.
    fn read_by_kernel(&self, dst: u64, src: u64, len: usize) -> Result<Option<u64>> {
        if len == 0
            || len > self.cfg.copy_kernel_max
            || !self.cfg.read_kernel
            || self.stream.is_capturing()
        {
            return Ok(None);
        }
        let Ok(f) = self.modules.get(Kernel::SmallCopy) else {
            return Ok(None);
        };
        let dims = LaunchDims::one_block(128);
        let mut args = [dst, src, len as u64];
        let mut ptrs: Vec<*mut std::ffi::c_void> =
            args.iter_mut().map(|a| (a as *mut u64).cast()).collect();
        // SAFETY: `small_copy(u64, u64, i64)` takes exactly these three values; the caller
        // keeps both ranges valid until the copy's ticket is observed.
        let t = unsafe {
            self.stream
                .launch_copy(Counted::D2H(len), f, dims, &mut ptrs)
        }
        .map_err(|e| self.driver_err("small_copy launch", e))?;
        Ok(Some(t))
    }

    /// Stages `data` and queues its copy to device address `dst` (split into chunk pieces).
    fn stage_to(&self, dst: u64, data: &[u8]) -> Result<()> {
        let mut st = self.staging.lock();
        let piece = st.max_piece();
        let new_event = || CuEvent::new().map_err(|e| format!("cuEventCreate: {e:?}"));
        for (i, part) in data.chunks(piece).enumerate() {
            let region = st
                .reserve(&self.stream, &new_event, part.len())
                .map_err(|reason| Error::Unavailable {
                    backend: self.name.clone(),
                    reason,
                })?;
            // SAFETY: the region holds `part.len()` bytes that no queued copy reads (invariant
            // 8, kept by the arena); the source is the caller's slice.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), region.ptr, part.len()) };
            let at = dst + (i * piece) as u64;
            // SAFETY: the region stays untouched until its ticket is observed or fenced.
            let t = unsafe { self.stream.memcpy_htod(at, region.ptr, part.len()) }
                .map_err(|e| self.driver_err("cuMemcpyHtoDAsync", e))?;
            st.commit(&region, t);
        }
        self.update_gauge(&st);
        Ok(())
    }

    fn alloc_zeroed(&self, size: usize) -> Result<DevBuf> {
        let alloc = match self.bufs.take_pooled(size) {
            Some(a) => a,
            None => match self.bufs.alloc_new(size) {
                Ok(a) => a,
                Err(_) => {
                    // Give the pool back to the driver and try once more.
                    self.wait()?;
                    self.bufs.drain_pool();
                    self.bufs
                        .alloc_new(size)
                        .map_err(|reason| Error::Unavailable {
                            backend: self.name.clone(),
                            reason: format!("out of device memory: {reason}"),
                        })?
                }
            },
        };
        if size > 0 {
            // Queued, so it also orders after any work still reading a pooled allocation.
            // SAFETY: `size <= capacity` of a live allocation.
            unsafe { self.stream.memset_d8(alloc.ptr, 0, size) }
                .map_err(|e| self.driver_err("cuMemsetD8Async", e))?;
        }
        Ok(DevBuf {
            alloc,
            size,
            weights: false,
        })
    }
}

impl Inner {
    /// Queues `graph` through the capture cache: eager the first time, captured the second,
    /// replayed after (see [`crate::capture`]).
    fn run_captured(&self, graph: &Arc<ExecGraph>, scratch: &mut Scratch) -> Result<()> {
        let generation = self.mem_generation.load(Ordering::Acquire) + scratch.moves();
        let mut cache = self.graphs.lock();
        match cache.action(graph, generation) {
            Action::Eager => {
                drop(cache);
                crate::fusion::run_graph(&mut Exec::new(self, scratch), graph)
            }
            Action::Replay(exec) => self
                .stream
                .graph_launch(exec)
                .map(|_| ())
                .map_err(|e| self.driver_err("cuGraphLaunch", e)),
            Action::Capture => {
                let first_tag = self.err_tags.lock().peek_next();
                let captured = match self.stream.begin_capture() {
                    Ok(()) => {
                        let ran = crate::fusion::run_graph(&mut Exec::new(self, scratch), graph);
                        let ended = self.stream.end_capture();
                        match (ran, ended) {
                            (Ok(()), Ok(exec)) => Ok(exec),
                            (Err(e), _) => Err(e.to_string()),
                            (Ok(()), Err(e)) => Err(format!("cuStreamEndCapture: {e:?}")),
                        }
                    }
                    Err(e) => Err(format!("cuStreamBeginCapture: {e:?}")),
                };
                match captured {
                    Ok(exec) => {
                        self.err_tags.lock().keep_since(first_tag);
                        match cache.store(graph, exec) {
                            Some(exec) => self
                                .stream
                                .graph_launch(exec)
                                .map(|_| ())
                                .map_err(|e| self.driver_err("cuGraphLaunch", e)),
                            None => {
                                drop(cache);
                                crate::fusion::run_graph(&mut Exec::new(self, scratch), graph)
                            }
                        }
                    }
                    Err(why) => {
                        // Nothing of the failed capture ran: run the graph now, eagerly, and
                        // keep it eager.
                        tracing::debug!(backend = %self.name, "CUDA graph capture refused: {why}");
                        cache.refuse(graph);
                        drop(cache);
                        crate::fusion::run_graph(&mut Exec::new(self, scratch), graph)
                    }
                }
            }
        }
    }
}

/// Timing events around compute graphs, read back when a wait observed them.
#[derive(Default)]
struct Timing {
    /// (start, end, ticket of the end record)
    pending: VecDeque<(CuTimedEvent, CuTimedEvent, u64)>,
    free: Vec<CuTimedEvent>,
}

impl Timing {
    fn event(&mut self) -> std::result::Result<CuTimedEvent, cudarc::driver::DriverError> {
        match self.free.pop() {
            Some(e) => Ok(e),
            None => CuTimedEvent::new(),
        }
    }

    /// Records the start of a timed graph.
    fn start(
        &mut self,
        stream: &TicketStream<CuDriver>,
    ) -> std::result::Result<CuTimedEvent, cudarc::driver::DriverError> {
        let ev = self.event()?;
        stream.record_event(&ev.0)?;
        Ok(ev)
    }

    /// Records the end of a timed graph begun with `start`.
    fn end(
        &mut self,
        stream: &TicketStream<CuDriver>,
        start: CuTimedEvent,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        let ev = self.event()?;
        let ticket = stream.record_event(&ev.0)?;
        self.pending.push_back((start, ev, ticket));
        Ok(())
    }

    /// Adds the device time of every pair a wait has covered to `device_ns`.
    fn collect(&mut self, observed: u64, stats: &SyncStats) {
        while self.pending.front().is_some_and(|p| p.2 <= observed) {
            let (start, end, _) = self.pending.pop_front().expect("checked");
            if let Ok(ms) = end.elapsed_since(&start) {
                bump(&stats.device_ns, (f64::from(ms) * 1e6) as u64);
            }
            self.free.push(start);
            self.free.push(end);
        }
    }

    fn clear(&mut self) {
        self.pending.clear();
        self.free.clear();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // A gate left closed would hold the stream forever: open them all first.
        for page in &self.gates.lock().pages {
            let words = page.ptr().cast::<AtomicU32>();
            for i in 0..GATE_PAGE_BYTES / 4 {
                // SAFETY: in bounds of the page; plain host stores the device polls.
                unsafe { (*words.add(i)).store(1, Ordering::Release) };
            }
        }
        let _ = self.stream.synchronize();
        self.graphs.lock().clear();
        self.timing.lock().clear();
        self.exec.lock().release(&self.stream);
        let _ = self.stream.synchronize();
        self.bufs.release_all();
        self.blas.lock().take();
    }
}

/// The registry of live CUDA backends: lets `cpy_tensor_async` recognise a source backend as
/// CUDA (the contract has no downcast) by its address.
static REGISTRY: Mutex<Vec<(usize, Weak<Inner>)>> = Mutex::new(Vec::new());

fn lookup(b: &dyn Backend) -> Option<Arc<Inner>> {
    let addr = b as *const dyn Backend as *const () as usize;
    REGISTRY
        .lock()
        .iter()
        .find(|(a, _)| *a == addr)
        .and_then(|(_, w)| w.upgrade())
}

/// A CUDA stream on one device.
pub struct CudaBackend {
    inner: Arc<Inner>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let me = self as *const CudaBackend as usize;
        REGISTRY
            .lock()
            .retain(|(a, w)| *a != me && w.strong_count() > 0);
    }
}

impl CudaBackend {
    /// Opens device `ordinal` (after the caller probed the driver).
    pub(crate) fn open(name: &str, ordinal: usize, cfg: CudaConfig) -> Result<Arc<Self>> {
        let unavailable = |reason: String| Error::Unavailable {
            backend: "CUDA".into(),
            reason,
        };
        let device_count = crate::probe::device_count().map_err(unavailable)?;
        if ordinal >= device_count {
            return Err(unavailable(format!(
                "`{name}` asks for device {ordinal}, but this machine has {device_count} CUDA \
                 device(s)"
            )));
        }
        let inner = crate::probe::guarded("opening the CUDA device", || {
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| format!("cuDevicePrimaryCtxRetain: {e:?}"))?;
            // The scheduler orders work itself; cudarc's per-buffer events would add syncs.
            // SAFETY: called before any cudarc allocation on this context.
            unsafe { ctx.disable_event_tracking() };
            let (major, minor) = ctx
                .compute_capability()
                .map_err(|e| format!("reading the compute capability: {e:?}"))?;
            let attr = |a, what: &str| {
                ctx.attribute(a)
                    .map(|v| v.max(0) as usize)
                    .map_err(|e| format!("reading {what}: {e:?}"))
            };
            use cudarc::driver::sys::CUdevice_attribute as A;
            let sms = attr(
                A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "the multiprocessor count",
            )?;
            let shared = crate::fusion::SharedLimits {
                per_sm: attr(
                    A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                    "the shared memory per multiprocessor",
                )?,
                per_block: attr(
                    A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                    "the shared memory per block",
                )?,
                reserved: attr(
                    A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
                    "the shared memory reserved per block",
                )?,
            };
            let stream_shared =
                crate::fusion::stream_pad(cfg.stream_pad_kb, cfg.stream_blocks, shared);
            let driver =
                CuDriver::new(ctx.clone()).map_err(|e| format!("cuStreamCreate: {e:?}"))?;
            let stream = TicketStream::new(
                driver,
                SyncElision {
                    requested: cfg.sync_elision,
                    device_count,
                },
            );
            let err_word = Pinned::mapped(64)?;
            let head_work = HeadWork::new()?;
            Ok(Inner {
                name: name.to_string(),
                ordinal,
                stream,
                bufs: Buffers::new(name),
                staging: Mutex::new(Staging::new(cfg.staging_chunk_bytes, cfg.staging_max_bytes)),
                readback: Mutex::new(None),
                read_slots: Mutex::new(Vec::new()),
                exec: Mutex::new(Scratch::default()),
                modules: Modules::new(major, minor, shared.per_block, cfg.weight_evict_first),
                blas: Mutex::new(None),
                err_word,
                err_tags: Mutex::new(ErrTags::default()),
                head_work,
                gates: Mutex::new(GateWords::default()),
                pdl: cfg.pdl && major >= 9,
                sms: sms.max(1),
                stream_shared,
                cfg,
                graphs: Mutex::new(GraphCache::default()),
                mem_generation: AtomicU64::new(0),
                timing: Mutex::new(Timing::default()),
                ctx,
            })
        })
        .map_err(unavailable)?;
        // Everything that may synchronize the context happens now, before any work is queued:
        // module loads (see `Modules::preload`) and the cuBLAS handle. A missing NVRTC or cuBLAS
        // is not fatal here (copies still work); the first kernel or matmul reports it.
        if let Err(e) = inner.modules.preload() {
            tracing::warn!(backend = name, "CUDA kernels unavailable: {e}");
        }
        if inner.cfg.copy_kernel_max > 0 {
            if let Ok(f) = inner.modules.get(Kernel::CopyBatch) {
                // Reads ride in the batch too when they may run as kernels (and an event for
                // them can be made; otherwise they take `small_copy` or a copy engine).
                let read_event = match inner.cfg.read_kernel {
                    true => CuEvent::new().ok(),
                    false => None,
                };
                inner.stream.enable_batch(f, read_event);
            }
        }
        match crate::matmul::Blas::new(&inner.stream) {
            Ok(blas) => *inner.blas.lock() = Some(blas),
            Err(e) => tracing::warn!(backend = name, "cuBLAS unavailable: {e}"),
        }
        // Lending the stream to cuBLAS took a ticket: settle it now, so the backend starts with
        // nothing outstanding (one counted host wait, at open, outside any step).
        inner
            .bind()
            .and_then(|_| inner.wait())
            .map_err(|e| Error::Unavailable {
                backend: "CUDA".into(),
                reason: format!("the first synchronize of `{name}` failed: {e}"),
            })?;
        let b = Arc::new(CudaBackend {
            inner: Arc::new(inner),
        });
        let addr = Arc::as_ptr(&b) as usize;
        let mut reg = REGISTRY.lock();
        reg.retain(|(_, w)| w.strong_count() > 0);
        reg.push((addr, Arc::downgrade(&b.inner)));
        drop(reg);
        tracing::debug!(backend = name, "CUDA backend open");
        Ok(b)
    }

    /// Whether this backend elides idle syncs (single device and not turned off).
    pub fn elides_syncs(&self) -> bool {
        self.inner.stream.elides()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// How many owners the backend's shared state has: 1 once the backend is the only one
    /// (no event, gate or read of it alive). Tests use it to prove nothing of the backend keeps
    /// the backend itself alive (a cycle would keep its context and memory after its last user).
    pub fn state_owners(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// Pinned staging bytes allocated (bounded by the configuration; invariant 8).
    pub fn staging_bytes_allocated(&self) -> usize {
        self.inner.staging.lock().bytes_allocated()
    }

    fn own_event<'a>(&self, ev: &'a Arc<dyn Event>) -> Option<&'a CudaEvent> {
        ev.as_any()
            .downcast_ref::<CudaEvent>()
            .filter(|e| Arc::ptr_eq(&e.owner, &self.inner))
    }
}

/// An event of a CUDA backend: a `CU_EVENT_DISABLE_TIMING` event and the ticket it was last
/// recorded at (0: never recorded, complete).
pub struct CudaEvent {
    owner: Arc<Inner>,
    ev: CuEvent,
    ticket: AtomicU64,
}

impl Event for CudaEvent {
    fn is_complete(&self) -> bool {
        let t = self.ticket.load(Ordering::Acquire);
        if t == 0 || self.owner.bind().is_err() {
            return t == 0;
        }
        self.owner.stream.query_event(&self.ev, t).unwrap_or(false)
    }
    fn synchronize(&self) -> Result<()> {
        self.owner.bind()?;
        let t = self.ticket.load(Ordering::Acquire);
        self.owner
            .stream
            .wait_event_host(&self.ev, t)
            .map_err(|e| self.owner.driver_err("cuEventSynchronize", e))?;
        self.owner.after_wait()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A pinned slot of `read_async`, the event recorded after its last read and that record's
/// ticket (0: never recorded). A raw event, not a [`CudaEvent`]: the slots live in `Inner`, so
/// they must not hold an `Arc` of it.
struct ReadSlot {
    mem: Pinned,
    ev: CuEvent,
    ticket: u64,
    /// The last read rode in a copy batch (`TicketStream::defer_dtoh`): `ticket` is the batch
    /// read event's, and `ev` was not recorded.
    batched: bool,
}

impl ReadSlot {
    /// Whether the slot's last read completed (a non-blocking query, not counted; a batch
    /// still pending is launched).
    fn idle(&self, owner: &Inner) -> bool {
        if self.ticket == 0 {
            return true;
        }
        owner.bind().is_ok()
            && match self.batched {
                true => owner.stream.read_done(self.ticket),
                false => owner.stream.query_event(&self.ev, self.ticket),
            }
            .unwrap_or(false)
    }
}

/// A read into a pinned slot. Dropping it returns the slot to the pool; the pool reuses a slot
/// only once its last read completed, so an early drop is safe.
struct CudaReadback {
    owner: Arc<Inner>,
    slot: Option<ReadSlot>,
    len: usize,
    waited: bool,
}

impl Readback for CudaReadback {
    fn is_complete(&self) -> bool {
        self.waited || self.slot.as_ref().is_none_or(|s| s.idle(&self.owner))
    }
    fn wait(&mut self) -> Result<&[u8]> {
        let Some(slot) = self.slot.as_ref() else {
            return Ok(&[]);
        };
        if !self.waited {
            let o = &self.owner;
            o.bind()?;
            match slot.batched {
                true => o.stream.wait_read(slot.ticket),
                false => o.stream.wait_event_host(&slot.ev, slot.ticket),
            }
            .map_err(|e| o.driver_err("cuEventSynchronize", e))?;
            o.after_wait()?;
            self.waited = true;
        }
        // SAFETY: the slot holds at least `len` bytes, and the read into them completed.
        Ok(unsafe { std::slice::from_raw_parts(slot.mem.ptr(), self.len) })
    }
}

impl Drop for CudaReadback {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.owner.read_slots.lock().push(slot);
        }
    }
}

/// A test gate: the stream waits until the host writes 1 into a mapped word. Dropping an
/// unopened gate opens it, so a forgotten gate cannot hang the stream.
pub struct CudaGate {
    word: *const AtomicU32,
    _owner: Arc<Inner>,
}

// SAFETY: the word is pinned memory owned by `_owner`, which the gate keeps alive.
unsafe impl Send for CudaGate {}
unsafe impl Sync for CudaGate {}

impl Gate for CudaGate {
    fn open(&self) {
        // SAFETY: a live, aligned word (see the type).
        unsafe { (*self.word).store(1, Ordering::Release) };
    }
}

impl Drop for CudaGate {
    fn drop(&mut self) {
        self.open();
    }
}

/// Whether the CUDA kernels implement `op` for these dtypes (the same set as the CPU oracle).
pub fn cuda_supports_op(op: &Op, dst: DType, srcs: &[DType]) -> bool {
    let floats = |ds: &[DType]| ds.iter().all(|d| d.is_float());
    match op {
        Op::Input | Op::Weight | Op::Persistent | Op::View => true,
        Op::GetRows => {
            dst.is_float() && srcs.len() == 2 && srcs[0].is_float() && srcs[1] == DType::I32
        }
        Op::SetRows => srcs.len() == 3 && floats(&srcs[..2]) && srcs[2] == DType::I32,
        Op::Rope { .. } => srcs.len() == 2 && srcs[0].is_float() && srcs[1] == DType::I32,
        Op::Argmax => dst == DType::I32 && floats(srcs),
        Op::MulMatId => {
            srcs.len() == 4 && floats(&srcs[..2]) && srcs[2] == DType::I32 && srcs[3].is_float()
        }
        Op::Cpy | Op::Concat { .. } => srcs.iter().all(|s| s.is_float() == dst.is_float()),
        _ => dst.is_float() && floats(srcs),
    }
}

impl Backend for CudaBackend {
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
            sync_elision: self.inner.stream.elides(),
            graph_replay: false,
            test_gate: true,
            copy_async: true,
            read_async: true,
        }
    }
    fn buffer_type(&self) -> BufferType {
        BufferType {
            name: self.inner.name.clone(),
            alignment: ALIGNMENT,
            is_host: false,
        }
    }
    fn supports_op(&self, op: &Op, dst: DType, srcs: &[DType]) -> bool {
        cuda_supports_op(op, dst, srcs)
    }
    fn stats(&self) -> &SyncStats {
        self.inner.stream.stats()
    }

    fn alloc_buffer(&self, size: usize, usage: BufferUsage) -> Result<BufferId> {
        let i = &self.inner;
        i.bind()?;
        let mut buf = i.alloc_zeroed(size)?;
        buf.weights = usage == BufferUsage::Weights;
        let id = BufferId::fresh();
        i.bufs.insert(id, buf);
        bump(&i.stream.stats().reserves, 1);
        Ok(id)
    }
    fn realloc_buffer(&self, id: BufferId, size: usize) -> Result<()> {
        let i = &self.inner;
        i.bind()?;
        let old = i.bufs.get(id)?;
        // Queued work may still use the old memory (the contract waits; the pool would not
        // need it, but callers rely on the old contents being settled).
        i.wait()?;
        let mut buf = i.alloc_zeroed(size)?;
        buf.weights = old.weights;
        i.bufs.remove_to_pool(id);
        i.bufs.insert(id, buf);
        i.mem_generation.fetch_add(1, Ordering::AcqRel);
        bump(&i.stream.stats().reallocs, 1);
        Ok(())
    }
    fn free_buffer(&self, id: BufferId) {
        // Pooled, not freed: a later allocation reusing it zeroes it with a queued memset, which
        // runs after any queued work that still reads it.
        self.inner.bufs.remove_to_pool(id);
        self.inner.mem_generation.fetch_add(1, Ordering::AcqRel);
    }
    fn buffer_size(&self, id: BufferId) -> Result<usize> {
        Ok(self.inner.bufs.get(id)?.size)
    }

    fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let i = &self.inner;
        i.bind()?;
        let at = i.bufs.span(dst, offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        if data.len() <= i.cfg.staging_chunk_bytes {
            i.stage_to(at, data)?;
        } else {
            // SAFETY: `data` outlives the wait below.
            unsafe { i.stream.memcpy_htod(at, data.as_ptr(), data.len()) }
                .map_err(|e| i.driver_err("cuMemcpyHtoDAsync", e))?;
        }
        i.wait()
    }
    fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        let i = &self.inner;
        i.bind()?;
        let from = i.bufs.span(src, offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        if out.len() > i.cfg.readback_max_bytes {
            // SAFETY: `out` outlives the wait below.
            unsafe { i.stream.memcpy_dtoh(out.as_mut_ptr(), from, out.len()) }
                .map_err(|e| i.driver_err("cuMemcpyDtoHAsync", e))?;
            return i.wait();
        }
        let mut rb = i.readback.lock();
        if rb.as_ref().is_none_or(|p| p.len() < out.len()) {
            // Only blocking reads use the buffer and each waits, so nothing reads the old one.
            *rb = Some(
                Pinned::staging(out.len().next_power_of_two()).map_err(|reason| {
                    Error::Unavailable {
                        backend: i.name.clone(),
                        reason,
                    }
                })?,
            );
        }
        let Some(p) = rb.as_ref() else {
            return Err(i.driver_err("readback buffer", "missing"));
        };
        // SAFETY: the pinned buffer holds `out.len()` bytes and is not touched until the wait.
        unsafe { i.stream.memcpy_dtoh(p.ptr(), from, out.len()) }
            .map_err(|e| i.driver_err("cuMemcpyDtoHAsync", e))?;
        i.wait()?;
        // SAFETY: the copy completed (the wait returned Ok); both ranges hold `out.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(p.ptr(), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    unsafe fn set_tensor_async(
        &self,
        dst: BufferId,
        offset: usize,
        data: *const u8,
        len: usize,
    ) -> Result<()> {
        let i = &self.inner;
        i.bind()?;
        let at = i.bufs.span(dst, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller keeps `data` valid and unchanged until the next synchronize.
        unsafe { i.stream.memcpy_htod(at, data, len) }
            .map_err(|e| i.driver_err("cuMemcpyHtoDAsync", e))?;
        Ok(())
    }
    fn set_tensor_async_staged(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let i = &self.inner;
        i.bind()?;
        let at = i.bufs.span(dst, offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        if data.len() <= i.cfg.copy_kernel_max && i.defer(i.stream.defer_htod(at, data))? {
            return Ok(());
        }
        i.stage_to(at, data)
    }
    unsafe fn get_tensor_async(
        &self,
        src: BufferId,
        offset: usize,
        out: *mut u8,
        len: usize,
    ) -> Result<()> {
        let i = &self.inner;
        i.bind()?;
        let from = i.bufs.span(src, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller keeps `out` valid and untouched until the next synchronize.
        unsafe { i.stream.memcpy_dtoh(out, from, len) }
            .map_err(|e| i.driver_err("cuMemcpyDtoHAsync", e))?;
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
        let i = &self.inner;
        i.bind()?;
        let from = i.bufs.span(src, src_offset, len)?;
        let to = i.bufs.span(dst, dst_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let apart = to + len as u64 <= from || from + len as u64 <= to;
        if apart && len <= i.cfg.copy_kernel_max && i.defer(i.stream.defer_dtod(to, from, len))? {
            return Ok(());
        }
        // SAFETY: both ranges are checked device memory of this context.
        unsafe { i.stream.memcpy_dtod(to, from, len) }
            .map_err(|e| i.driver_err("cuMemcpyDtoDAsync", e))?;
        Ok(())
    }
    fn read_async(&self, src: BufferId, offset: usize, len: usize) -> Result<Box<dyn Readback>> {
        let i = &self.inner;
        i.bind()?;
        let from = i.bufs.span(src, offset, len)?;
        if len == 0 {
            return Ok(Box::new(CudaReadback {
                owner: i.clone(),
                slot: None,
                len,
                waited: true,
            }));
        }
        let reusable = {
            let mut pool = i.read_slots.lock();
            let found = pool.iter().position(|s| s.mem.len() >= len && s.idle(i));
            found.map(|k| pool.swap_remove(k))
        };
        let slot = match reusable {
            Some(s) => s,
            None => ReadSlot {
                mem: Pinned::staging(len.next_power_of_two()).map_err(|reason| {
                    Error::Unavailable {
                        backend: i.name.clone(),
                        reason,
                    }
                })?,
                ev: CuEvent::new().map_err(|e| i.driver_err("cuEventCreate", e))?,
                ticket: 0,
                batched: false,
            },
        };
        // From here the slot goes back to the pool on every path (the readback's drop).
        let mut rb = CudaReadback {
            owner: i.clone(),
            slot: Some(slot),
            len,
            waited: false,
        };
        let Some(slot) = rb.slot.as_mut() else {
            return Err(i.driver_err("read slot", "missing"));
        };
        slot.batched = false;
        if len <= i.cfg.copy_kernel_max && i.cfg.read_kernel {
            // SAFETY: the slot is pinned, holds `len` bytes, and is neither read nor reused
            // before its read completed (`wait` and `idle` ask the stream).
            let deferred = unsafe { i.stream.defer_dtoh(slot.mem.ptr(), from, len) };
            if let Some(t) = i.defer(deferred)? {
                slot.ticket = t;
                slot.batched = true;
                return Ok(Box::new(rb));
            }
        }
        // The slot is pinned, holds `len` bytes and is not read before its event.
        if i.read_by_kernel(slot.mem.ptr() as u64, from, len)?
            .is_none()
        {
            // SAFETY: as above.
            unsafe { i.stream.memcpy_dtoh(slot.mem.ptr(), from, len) }
                .map_err(|e| i.driver_err("cuMemcpyDtoHAsync", e))?;
        }
        match i.stream.record_event(&slot.ev) {
            Ok(t) => slot.ticket = t,
            Err(e) => {
                // The copy may still be in flight and nothing marks its end: the slot must
                // neither be reused nor freed (a broken context; a few bytes are kept).
                std::mem::forget(rb.slot.take());
                return Err(i.driver_err("cuEventRecord", e));
            }
        }
        Ok(Box::new(rb))
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
        let i = &self.inner;
        if let Some(other) = lookup(src_backend) {
            i.bind()?;
            let to = i.bufs.span(dst, dst_offset, len)?;
            let from = other.bufs.span(src, src_offset, len)?;
            if len == 0 {
                return Ok(true);
            }
            if Arc::ptr_eq(&other, i) {
                // SAFETY: both ranges are checked device memory of this context.
                unsafe { i.stream.memcpy_dtod(to, from, len) }
                    .map_err(|e| i.driver_err("cuMemcpyDtoDAsync", e))?;
                return Ok(true);
            }
            // Ordered after the work queued on the source: an event on its stream, waited on
            // (device side) by this one, then the copy on this stream.
            other.bind()?;
            let ev = CuEvent::new().map_err(|e| i.driver_err("cuEventCreate", e))?;
            other
                .stream
                .record_event(&ev)
                .map_err(|e| other.driver_err("cuEventRecord", e))?;
            i.bind()?;
            i.stream
                .wait_event(&ev)
                .map_err(|e| i.driver_err("cuStreamWaitEvent", e))?;
            if other.ordinal == i.ordinal {
                // SAFETY: checked device ranges of one device (the same primary context).
                unsafe { i.stream.memcpy_dtod(to, from, len) }
                    .map_err(|e| i.driver_err("cuMemcpyDtoDAsync", e))?;
            } else {
                // SAFETY: checked device ranges of their contexts.
                unsafe {
                    i.stream.memcpy_peer(
                        to,
                        CuCtx(i.ctx.cu_ctx()),
                        from,
                        CuCtx(other.ctx.cu_ctx()),
                        len,
                    )
                }
                .map_err(|e| i.driver_err("cuMemcpyPeerAsync", e))?;
            }
            // Destroying `ev` now is fine: the driver keeps a pending event alive.
            return Ok(true);
        }
        // S0's copy_from_host: a host (`cpu`) source is ready once its synchronous producer
        // returned; its bytes are staged now, so the host may reuse them at once (invariant 3).
        let staged = with_host_source(src_backend, src, src_offset, len, |data| {
            self.set_tensor_async_staged(dst, dst_offset, data)
        })?;
        Ok(staged.is_some())
    }

    fn graph_compute_async(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        let i = &self.inner;
        i.bind()?;
        let mut scratch = i.exec.lock();
        let timed = if i.cfg.timing {
            Some(
                i.timing
                    .lock()
                    .start(&i.stream)
                    .map_err(|e| i.driver_err("cuEventRecord", e))?,
            )
        } else {
            None
        };
        if i.cfg.graphs {
            i.run_captured(graph, &mut scratch)?;
        } else {
            crate::fusion::run_graph(&mut Exec::new(i, &mut scratch), graph)?;
        }
        if let Some(start) = timed {
            i.timing
                .lock()
                .end(&i.stream, start)
                .map_err(|e| i.driver_err("cuEventRecord", e))?;
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.bind()?;
        self.inner.wait()
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        self.inner.bind()?;
        Ok(Arc::new(CudaEvent {
            owner: self.inner.clone(),
            ev: CuEvent::new().map_err(|e| self.inner.driver_err("cuEventCreate", e))?,
            ticket: AtomicU64::new(0),
        }))
    }
    fn event_record(&self, ev: &Arc<dyn Event>) -> Result<()> {
        let Some(e) = self.own_event(ev) else {
            return Err(Error::Unsupported {
                backend: self.inner.name.clone(),
                what: "recording another backend's event".into(),
            });
        };
        self.inner.bind()?;
        let t = self
            .inner
            .stream
            .record_event(&e.ev)
            .map_err(|err| self.inner.driver_err("cuEventRecord", err))?;
        e.ticket.store(t, Ordering::Release);
        Ok(())
    }
    fn event_wait(&self, ev: &Arc<dyn Event>) -> Result<()> {
        if self.own_event(ev).is_some() {
            return Ok(()); // stream order suffices
        }
        if let Some(other) = ev.as_any().downcast_ref::<CudaEvent>() {
            if other.ticket.load(Ordering::Acquire) == 0 {
                return Ok(()); // never recorded: complete
            }
            self.inner.bind()?;
            self.inner
                .stream
                .wait_event(&other.ev)
                .map_err(|e| self.inner.driver_err("cuStreamWaitEvent", e))?;
            return Ok(());
        }
        if ev.is_complete() {
            return Ok(());
        }
        // Another kind of stream: the device cannot wait on it, so the host does (counted on
        // that event's backend).
        ev.synchronize()
    }

    fn gate_close(&self) -> Result<Arc<dyn Gate>> {
        let i = &self.inner;
        i.bind()?;
        let mut g = i.gates.lock();
        if g.pages.is_empty() || g.used == GATE_PAGE_BYTES / 4 {
            let page = Pinned::mapped(GATE_PAGE_BYTES).map_err(|reason| Error::Unavailable {
                backend: i.name.clone(),
                reason,
            })?;
            g.pages.push(page);
            g.used = 0;
        }
        let slot = g.used;
        g.used += 1;
        let Some(page) = g.pages.last() else {
            return Err(i.driver_err("gate page", "missing"));
        };
        let word = page.ptr().wrapping_add(slot * 4).cast::<AtomicU32>();
        let dev = page.dev() + (slot * 4) as u64;
        drop(g);
        // SAFETY: a mapped word kept alive by the backend (pages are freed only on drop, after
        // every gate was opened and the stream drained).
        unsafe { i.stream.wait_value32(dev, 1) }
            .map_err(|e| i.driver_err("cuStreamWaitValue32", e))?;
        Ok(Arc::new(CudaGate {
            word,
            _owner: i.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernel;
    use cudarc::driver::result::{function, occupancy};
    use cudarc::driver::sys::CUfunction_attribute as F;

    /// On the device: a streamed product's blocks, padded as `stream_pad` says, fit
    /// `stream_blocks` to a multiprocessor and no more, and beside them there is room (registers
    /// and shared memory) for a block of any pair kernel (`fused_gemv1_pair`,
    /// `fused_gemv1_gu16`, `fused_gemv1_rp16` and kin) staging a 4096-wide row, the next
    /// kernel's first wave. Skipped without a CUDA device.
    #[test]
    fn padded_streamed_blocks_leave_room_for_the_next_kernel() {
        let b = match CudaBackend::open("cuda", 0, CudaConfig::default()) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("SKIPPED streamed occupancy: {e}");
                return;
            }
        };
        let inner = &b.inner;
        inner.bind().unwrap();
        let threads = (crate::matmul::GEMV1_WARPS * 32) as i32;
        let pad = inner.stream_shared;
        let attr = |a| inner.ctx.attribute(a).unwrap() as usize;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let regs_per_sm = attr(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR);
        let smem_per_sm = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
        let reserved = attr(A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK);
        eprintln!(
            "stream pad {pad} B; {regs_per_sm} registers, {smem_per_sm} B per multiprocessor"
        );
        assert!(pad > 0, "the default pads streamed blocks on this device");
        // The pair kernels: `fused_gemv1_pair` and its one-path entry points.
        let pair_regs = std::iter::once(Kernel::FusedGemv1Pair)
            .chain(Kernel::GATE_UP)
            .chain(Kernel::ROW_PAIRS)
            .map(|k| {
                let f = inner.modules.get(k).unwrap();
                // SAFETY: the function handles come from loaded modules; the context is bound.
                unsafe { function::get_function_attribute(f.0, F::CU_FUNC_ATTRIBUTE_NUM_REGS) }
                    .unwrap() as usize
            })
            .max()
            .unwrap();
        for k in Kernel::STREAMED {
            let f = inner.modules.get(k).unwrap();
            // SAFETY: as above.
            let (fit, fit_bare, regs) = unsafe {
                (
                    occupancy::max_active_block_per_multiprocessor(f.0, threads, pad).unwrap(),
                    occupancy::max_active_block_per_multiprocessor(f.0, threads, 16 << 10).unwrap(),
                    function::get_function_attribute(f.0, F::CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap(),
                )
            };
            eprintln!("{k:?}: {regs} registers; {fit} blocks per multiprocessor padded, {fit_bare} with 16 KiB");
            assert_eq!(fit as usize, inner.cfg.stream_blocks, "{k:?} padded");
            let blocks = inner.cfg.stream_blocks;
            let regs_used = (blocks * regs as usize + pair_regs) * threads as usize;
            assert!(
                regs_used <= regs_per_sm,
                "{k:?}: {blocks} blocks of {regs} registers and a pair block of {pair_regs} need \
                 {regs_used} of {regs_per_sm}"
            );
            let smem_used = blocks * (pad + reserved) + (4096 * 4 + reserved);
            assert!(
                smem_used <= smem_per_sm,
                "{k:?}: shared memory {smem_used} of {smem_per_sm}"
            );
        }
    }
}
