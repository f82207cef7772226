//! The device state of one CUDA backend: context, stream, memory, kernels, and the primitives
//! every public entry uses.
//!
//! Why: a backend's events, gates and reads outlive calls and must reach the same stream and
//! memory, and the executor (`exec`, `fusion`) needs them too; [`Inner`] is that state, shared
//! by `Arc` and owned by nothing of its own (no cycle keeps a backend alive), with the few
//! primitives several entries share: the completed-wait hook, staged writes through the arena,
//! zeroed allocations, reads by a one-block kernel.
//!
//! Strategy: [`Inner::open`] makes everything that may synchronize the context before any work
//! is queued: the primary context with cudarc's event tracking off, one non-blocking stream
//! behind the ticketed choke point, the kernel modules (loaded, not only compiled), the copy
//! batch, the cuBLAS handle; it ends with one counted wait so the backend starts idle. A bad
//! index a kernel finds is written as a tag into a host-mapped word and reported, naming its
//! node ([`ErrTags`]), after the next completed wait.
//!
//! Invariants: (1) a staged write's bytes are in the arena (or the pending batch) before the
//! call returns; (8) the arena is bounded; everything is queued on the one stream; dropping
//! opens every gate first, then drains the stream before any memory it may use is released.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::cublas::{result as cbres, sys as cb};
use cudarc::driver::{sys, CudaContext};
use lowsync_backend::{Error, Result};
use parking_lot::Mutex;

use crate::config::{stream_pad, CudaConfig, SharedLimits};
use crate::driver::{CuDriver, CuEvent};
use crate::graph_cache::GraphCache;
use crate::kernels::{Kernel, Modules};
use crate::memory::{AttnSplitWork, Buffers, DevBuf, HeadWork, Pinned, Scratch};
use crate::probe;
use crate::staging::{ChunkMem, Staging};
use crate::tickets::{Counted, LaunchDims, SyncElision, TicketStream};
use crate::timing::Timing;

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
    pub(crate) fn peek_next(&self) -> u32 {
        self.next.wrapping_add(1).max(1)
    }

    /// Keeps the tags handed out since `first` for good: a captured graph's kernels report
    /// them at every replay, long after the recent window moved on.
    pub(crate) fn keep_since(&mut self, first: u32) {
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

    /// A fresh tag for a launch of node `node` (op `op`), for the kernel to report a bad index
    /// with.
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
pub(crate) struct GateWords {
    pub(crate) pages: Vec<Pinned>,
    pub(crate) used: usize,
}

/// Bytes of one page of gate words (a page holds `GATE_PAGE_BYTES / 4` gates).
pub(crate) const GATE_PAGE_BYTES: usize = 4096;

/// A cuBLAS handle bound to the backend's stream. Used only inside a lend of that stream.
pub(crate) struct Blas(pub(crate) cb::cublasHandle_t);

// SAFETY: the handle is used under the backend's `blas` lock and the stream's ticket lock.
unsafe impl Send for Blas {}

impl Blas {
    /// Creates the handle (probing libcublas first) and binds it to the stream.
    pub(crate) fn new(stream: &TicketStream<CuDriver>) -> std::result::Result<Self, String> {
        probe::cublas()?;
        probe::guarded("creating a cuBLAS handle", || {
            let h = cbres::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
            let blas = Blas(h);
            stream
                .lend(Counted::NotASubmit, |s| {
                    // SAFETY: a live handle and the backend's live stream.
                    unsafe { cbres::set_stream(blas.0, s.as_raw() as cb::cudaStream_t) }
                })
                .map_err(|e| format!("launching the pending copies: {e:?}"))?
                .map_err(|e| format!("cublasSetStream: {e:?}"))?;
            Ok(blas)
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once (the backend drained its stream).
        let _ = unsafe { cbres::destroy_handle(self.0) };
    }
}

/// The state shared by a backend, its events and its gates.
pub(crate) struct Inner {
    pub(crate) name: String,
    pub(crate) ordinal: usize,
    pub(crate) stream: TicketStream<CuDriver>,
    pub(crate) bufs: Buffers,
    pub(crate) staging: Mutex<Staging<CuDriver, Pinned>>,
    pub(crate) readback: Mutex<Option<Pinned>>,
    /// Pinned slots of `read_async`, each with the event of its last read. A slot is reused
    /// once that event completed (a read dropped before it completed stays out until then).
    pub(crate) read_slots: Mutex<Vec<ReadSlot>>,
    pub(crate) exec: Mutex<Scratch>,
    pub(crate) modules: Modules,
    pub(crate) blas: Mutex<Option<Blas>>,
    /// Host-mapped word kernels write a tag into on a bad index.
    pub(crate) err_word: Pinned,
    pub(crate) err_tags: Mutex<ErrTags>,
    /// The ticket and partials of kernels that elect a last block.
    pub(crate) head_work: HeadWork,
    /// The tickets and partials of `attn_split`.
    pub(crate) attn_split_work: AttnSplitWork,
    pub(crate) gates: Mutex<GateWords>,
    pub(crate) cfg: CudaConfig,
    /// Kernels are launched with programmatic dependent launch (`cfg.pdl` on a device that
    /// has it: compute capability 9.0 or newer).
    pub(crate) pdl: bool,
    /// Streaming multiprocessors of the device.
    pub(crate) sms: usize,
    /// Bytes of shared memory a streamed product's block asks for at least (`stream_pad`).
    pub(crate) stream_shared: usize,
    /// Captured compute graphs (`cfg.graphs`).
    pub(crate) graphs: Mutex<GraphCache>,
    /// Bumped whenever device memory a captured graph may address moves or goes away.
    pub(crate) mem_generation: AtomicU64,
    /// Device timing of compute graphs (`cfg.timing`).
    pub(crate) timing: Mutex<Timing>,
    /// The event pair of copies from each other CUDA backend (`cpy_tensor_async`).
    pub(crate) peer_events: Mutex<Vec<PeerEvents>>,
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

    /// Turns on direct access between this backend's device and `other`'s, both ways, where the
    /// devices can (NVLink or PCIe peer to peer): without it a `cuMemcpyPeerAsync` between two
    /// contexts goes through host memory. Returns whether the direct path is on. A pair that
    /// cannot, or a driver that refuses, keeps the copy through host memory, which the events
    /// order all the same, so a refusal is not an error. Binds `other`'s context last.
    pub(crate) fn enable_peer_access(&self, other: &Inner) -> bool {
        let one_way = |from: &Inner, to: &Inner| -> bool {
            let mut can: std::ffi::c_int = 0;
            // SAFETY: two valid device handles of the retained contexts; `can` is written.
            let asked = unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, from.ctx.cu_device(), to.ctx.cu_device())
            };
            if asked != sys::CUresult::CUDA_SUCCESS || can == 0 || from.bind().is_err() {
                return false;
            }
            // SAFETY: `from`'s context is current; `to`'s is a live primary context; flags
            // must be 0.
            let r = unsafe { sys::cuCtxEnablePeerAccess(to.ctx.cu_ctx(), 0) };
            matches!(
                r,
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            )
        };
        let there = one_way(self, other);
        let back = one_way(other, self);
        let _ = other.bind();
        there && back
    }

    /// A completed wait happened: report a bad index a kernel recorded, reclaim staging and
    /// refresh the staging gauge.
    pub(crate) fn after_wait(&self) -> Result<()> {
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

    pub(crate) fn update_gauge(&self, st: &Staging<CuDriver, Pinned>) {
        self.stream
            .stats()
            .staging_bytes_in_use
            .store(st.bytes_in_use() as u64, Ordering::Relaxed);
    }

    /// The result of a `defer_*` call (which may launch the pending batch) as this backend's
    /// error.
    pub(crate) fn defer<T>(
        &self,
        r: std::result::Result<T, cudarc::driver::result::DriverError>,
    ) -> Result<T> {
        r.map_err(|e| self.driver_err("copy_batch launch", e))
    }

    /// Queues `read_async`'s copy of `len` device bytes at `src` into its pinned slot at `dst`
    /// as a one-block kernel (`small_copy`; `cfg.read_kernel`), counted as one D2H copy;
    /// `Ok(None)` when it does not apply (too long, a graph being captured, kernels
    /// unavailable), and the caller takes a copy engine.
    pub(crate) fn read_by_kernel(&self, dst: u64, src: u64, len: usize) -> Result<Option<u64>> {
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
    pub(crate) fn stage_to(&self, dst: u64, data: &[u8]) -> Result<()> {
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

    pub(crate) fn alloc_zeroed(&self, size: usize) -> Result<DevBuf> {
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
    /// Opens device `ordinal` (after the caller probed the driver): its primary context, the
    /// stream, the kernel modules (loaded now) and the cuBLAS handle, with nothing outstanding.
    pub(crate) fn open(name: &str, ordinal: usize, cfg: CudaConfig) -> Result<Inner> {
        let unavailable = |reason: String| Error::Unavailable {
            backend: "CUDA".into(),
            reason,
        };
        // The driver is initialised here too (cuInit is idempotent), so a backend opened
        // without `create` (unit tests, benches) never meets CUDA_ERROR_NOT_INITIALIZED.
        probe::driver().map_err(unavailable)?;
        let device_count = probe::device_count().map_err(unavailable)?;
        if ordinal >= device_count {
            return Err(unavailable(format!(
                "`{name}` asks for device {ordinal}, but this machine has {device_count} CUDA \
                 device(s)"
            )));
        }
        let inner = probe::guarded("opening the CUDA device", || {
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
            let shared = SharedLimits {
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
            let stream_shared = stream_pad(cfg.stream_pad_kb, cfg.stream_blocks, shared);
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
            // Four blocks per multiprocessor at least: the default split takes one wave.
            let attn_split_work = AttnSplitWork::new((4 * sms.max(1)).max(512))?;
            Ok(Inner {
                name: name.to_string(),
                ordinal,
                stream,
                bufs: Buffers::new(name),
                staging: Mutex::new(Staging::new(cfg.staging_chunk_bytes, cfg.staging_max_bytes)),
                readback: Mutex::new(None),
                read_slots: Mutex::new(Vec::new()),
                exec: Mutex::new(Scratch::default()),
                modules: Modules::new(major, minor, shared.per_block).with_kdefs(&cfg.kdefs),
                blas: Mutex::new(None),
                err_word,
                err_tags: Mutex::new(ErrTags::default()),
                head_work,
                attn_split_work,
                gates: Mutex::new(GateWords::default()),
                pdl: cfg.pdl && major >= 9,
                sms: sms.max(1),
                stream_shared,
                cfg,
                graphs: Mutex::new(GraphCache::default()),
                mem_generation: AtomicU64::new(0),
                timing: Mutex::new(Timing::default()),
                peer_events: Mutex::new(Vec::new()),
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
        match Blas::new(&inner.stream) {
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
        Ok(inner)
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

/// The events ordering copies from the CUDA backend `src` into this one, made by the first
/// copy and recorded again by every later one (a stream's wait takes the record that precedes
/// it, so a later record never changes an earlier wait): `ready` on the source's stream before
/// the copy, `done` on this stream after it (the back edge). A step crossing a stage boundary
/// then creates no event. `src` is weak: the source may go first (its pair is dropped then).
pub(crate) struct PeerEvents {
    pub(crate) src: Weak<Inner>,
    pub(crate) ready: CuEvent,
    pub(crate) done: CuEvent,
    /// The two devices read each other's memory directly (see [`Inner::enable_peer_access`]).
    pub(crate) direct: bool,
}

/// A pinned slot of `read_async`, the event recorded after its last read and that record's
/// ticket (0: never recorded). A raw event, not a `CudaEvent`: the slots live in `Inner`, so
/// they must not hold an `Arc` of it.
pub(crate) struct ReadSlot {
    pub(crate) mem: Pinned,
    pub(crate) ev: CuEvent,
    pub(crate) ticket: u64,
    /// The last read rode in a copy batch (`TicketStream::defer_dtoh`): `ticket` is the batch
    /// read event's, and `ev` was not recorded.
    pub(crate) batched: bool,
}

impl ReadSlot {
    /// Whether the slot's last read completed (a non-blocking query, not counted; a batch
    /// still pending is launched).
    pub(crate) fn idle(&self, owner: &Inner) -> bool {
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
