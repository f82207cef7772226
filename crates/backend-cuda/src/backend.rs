//! `cuda:N`: the CUDA backend.
//!
//! Why: the GPU must be driven with as few host waits as the work allows: one per token in
//! synchronous decode (the read of the sampled token). Every other wait ggml makes — per input
//! copy, per split, a sync with nothing queued — is removed here or in the scheduler.
//!
//! Strategy: this module is the `Backend` contract over the device state of `device` (one
//! non-blocking stream per backend, `TicketStream`, the choke point of every enqueue and the
//! home of the counters); device buffers from a table with a reuse pool; staged
//! writes through a bounded pinned arena ([`Staging`]), or, when small, in a batch of copies
//! that runs as one kernel with the host bytes in its parameters (`CudaConfig::copy_kernel_max`:
//! between two decode graphs no copy engine runs); blocking reads through a pinned readback
//! buffer (one DMA, one wait, one memcpy); events without timing; the test gate as
//! `cuStreamWaitValue32` on a host-mapped word. Compute graphs are queued by `capture` (replay)
//! or `fusion` (eager). Every public entry binds the backend's context to the calling thread.
//!
//! Invariants: (1) a staged write's bytes are in the arena (or the pending batch) before the
//! call returns; (2) every
//! write, copy and kernel is queued on the one stream, so it runs after the work queued before
//! it, and a copy from another CUDA backend waits on an event recorded on that backend's
//! stream; (6) elided syncs as in [`crate::tickets`]; (8) the arena is bounded; counters are
//! bumped only inside the primitives of `TicketStream` and here.

use std::any::Any;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use lowsync_backend::{
    bump, with_host_source, Backend, BufferId, BufferType, BufferUsage, Caps, DeviceKind, Error,
    Event, ExecGraph, Gate, Readback, Result, SyncStats,
};
use lowsync_graph::{DType, Op};
use parking_lot::Mutex;

use crate::capture::run_captured;
use crate::config::CudaConfig;
use crate::device::{Inner, PeerEvents, ReadSlot, GATE_PAGE_BYTES};
use crate::driver::{CuCtx, CuEvent};
use crate::exec::launch::Exec;
use crate::fusion;
use crate::memory::{Pinned, ALIGNMENT};

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
        let b = Arc::new(CudaBackend {
            inner: Arc::new(Inner::open(name, ordinal, cfg)?),
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

    /// The CUDA backends this one has copied from on the streams (`cpy_tensor_async`), by
    /// name, each with whether its copies go straight between the two devices (peer access
    /// on) rather than through host memory. A backend of the same device copies within it
    /// (`false`: no peer access involved).
    pub fn copy_sources(&self) -> Vec<(String, bool)> {
        self.inner
            .peer_events
            .lock()
            .iter()
            .filter_map(|p| p.src.upgrade().map(|src| (src.name.clone(), p.direct)))
            .collect()
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

/// Whether the CUDA kernels implement `op` for these dtypes: the reference rule of the graph
/// crate ([`Op::accepts`]), which the CUDA kernels cover in full except for quantized experts
/// of `MulMatId`. Block (quantized) weights are read by `MulMat` (as `x @ w.T`) and `GetRows`
/// (`kernels/quant.cu`).
pub fn cuda_supports_op(op: &Op, dst: DType, srcs: &[DType]) -> bool {
    let quant_ok = match op {
        Op::MulMat | Op::GetRows => true,
        _ => !srcs.iter().any(|s| s.is_quantized()),
    };
    quant_ok && op.accepts(dst, srcs)
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
    /// Another CUDA backend (another device, or another stream of this one) is copied from
    /// on the streams: an event on its stream waited on by this one, the copy, and the back
    /// edge (`cpy_tensor_async`); no host wait.
    fn copies_from(&self, src: &dyn Backend) -> bool {
        lookup(src).is_some_and(|o| !Arc::ptr_eq(&o, &self.inner))
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
            let mut peers = i.peer_events.lock();
            peers.retain(|p| p.src.strong_count() > 0);
            let k = match peers
                .iter()
                .position(|p| std::ptr::eq(p.src.as_ptr(), Arc::as_ptr(&other)))
            {
                Some(k) => k,
                None => {
                    // A pair's first copy: its events, and direct access between two devices.
                    let direct = other.ordinal != i.ordinal && i.enable_peer_access(&other);
                    other.bind()?;
                    let ready = CuEvent::new().map_err(|e| other.driver_err("cuEventCreate", e))?;
                    i.bind()?;
                    let done = CuEvent::new().map_err(|e| i.driver_err("cuEventCreate", e))?;
                    peers.push(PeerEvents {
                        src: Arc::downgrade(&other),
                        ready,
                        done,
                        direct,
                    });
                    peers.len() - 1
                }
            };
            let pe = &peers[k];
            other.bind()?;
            other
                .stream
                .record_event(&pe.ready)
                .map_err(|e| other.driver_err("cuEventRecord", e))?;
            i.bind()?;
            i.stream
                .wait_event(&pe.ready)
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
            // The back edge: work queued on the source after this call may overwrite the
            // bytes, so the source stream waits (device side) for the copy. Without it a
            // pipeline stage could run its next ubatch into the boundary tensor while the next
            // stage's stream, still busy with the previous one, has not copied it yet.
            i.stream
                .record_event(&pe.done)
                .map_err(|e| i.driver_err("cuEventRecord", e))?;
            other.bind()?;
            let waited = other.stream.wait_event(&pe.done);
            i.bind()?;
            waited.map_err(|e| other.driver_err("cuStreamWaitEvent", e))?;
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
            run_captured(i, graph, &mut scratch)?;
        } else {
            fusion::run_graph(&mut Exec::new(i, &mut scratch), graph)?;
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
        // Another kind of stream: the device cannot wait on it, so the host does, through the
        // event's own `synchronize` (counted on that event's backend: a host wait, or an elided
        // sync when its host already saw it complete). Called whatever `is_complete` would say,
        // so the count depends on what the program did, never on timing (issue 29.14).
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
    /// kernel's first wave. Ignored (reported as skipped, with the reason) unless asked for;
    /// asked for without a device, it fails.
    #[test]
    #[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
    fn padded_streamed_blocks_leave_room_for_the_next_kernel() {
        let b = CudaBackend::open("cuda", 0, CudaConfig::default()).unwrap_or_else(|e| {
            panic!("the streamed-occupancy test needs a CUDA device, and none opens here: {e}")
        });
        let inner = &b.inner;
        inner.bind().unwrap();
        let threads = (crate::exec::matmul::GEMV1_WARPS * 32) as i32;
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

    #[test]
    fn quantized_weights_are_read_by_mul_mat_and_get_rows_only() {
        use DType::{F16, F32, I32, Q4_0};
        for &q in DType::ALL.iter().filter(|d| d.is_quantized()) {
            assert!(cuda_supports_op(&Op::MulMat, F32, &[F32, q]), "{q}");
            assert!(cuda_supports_op(&Op::MulMat, F16, &[F16, q]), "{q}");
            assert!(cuda_supports_op(&Op::GetRows, F32, &[q, I32]), "{q}");
            assert!(cuda_supports_op(&Op::GetRows, F16, &[q, I32]), "{q}");
            // Quantized experts stay refused (no kernel reads them yet) ...
            assert!(Op::MulMatId.accepts(F32, &[q, F32, I32, F32]), "{q}");
            assert!(
                !cuda_supports_op(&Op::MulMatId, F32, &[q, F32, I32, F32]),
                "{q}"
            );
            // ... and what the graph refuses stays refused: a quantized activation or result.
            assert!(!cuda_supports_op(&Op::MulMat, F32, &[q, F32]), "{q}");
            assert!(!cuda_supports_op(&Op::MulMat, q, &[F32, q]), "{q}");
            assert!(!cuda_supports_op(&Op::Cpy, F32, &[q]), "{q}");
        }
        assert!(cuda_supports_op(&Op::MulMat, F32, &[F32, F32]));
        assert!(cuda_supports_op(&Op::MulMatId, F32, &[F16, F32, I32, F32]));
        assert!(!cuda_supports_op(&Op::GetRows, F32, &[Q4_0, F32]));
    }
}
