//! `cpu-async`: an asynchronous CPU stream with its own memory.
//!
//! Why: the scheduler's ordering rules (staged writes, events between backends, no host wait
//! until a read) must be testable without a GPU. `cpu-async` is a real stream: a worker thread
//! runs graphs, copies and staged writes in submission order, its buffers are not addressable
//! by `cpu`, and `synchronize`, events and the test gate really block.
//!
//! Strategy: every enqueue takes the next ticket (`submitted`) and sends one work item; the
//! worker publishes `completed` after each item; a host wait publishes `observed`.
//! `synchronize` is a no-op iff `observed == submitted` (an elided sync); otherwise it is one
//! host wait and one driver sync — also when the worker already finished, so counts depend on
//! what was enqueued, never on timing.
//! Blocking `set_tensor`/`get_tensor` enqueue a copy and wait for its ticket, like a device DMA
//! followed by a stream sync. Staged writes copy the caller's bytes into a recycled staging
//! vector before returning. On Ctrl-C (the interrupt hook) a wait marks every queued ticket as
//! cancelled — the worker skips their kernels and gates but still performs their copies — waits
//! for the drain, and returns `Interrupted`; the stream stays usable.
//!
//! Waits on other streams' events count what the program did, never what had finished:
//! `event_wait` on another `cpu-async` stream's recorded event always queues one item on which
//! the worker blocks (on that stream's condition variable, no spinning) until the ticket
//! captured at the call completed. That item is counted as what it is, a device wait (this
//! stream stalls on another; no work is submitted, the host does not block), not a
//! submission. Own events, `cpu`'s (complete when recorded) and never-recorded ones cost
//! nothing. An event of another kind (CUDA, Vulkan) is waited for by the host at the call, as
//! `cpu` does, and counted by its own `synchronize`.
//!
//! Invariants: items run in ticket order (invariant 2); a staged write's bytes are owned by the
//! queue (invariant 1); counters are bumped in the primitive that enqueues or waits.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use lowsync_backend::{
    bump, interrupt, with_host_source, Backend, BufferId, BufferType, BufferUsage, Caps,
    DeviceKind, Error, Event, ExecGraph, Gate, Readback, Result, SyncStats,
};
use lowsync_graph::{DType, Op, WeightBytes};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::cpu::{cpu_supports_op, DoneEvent};
use crate::memory::{Store, ALIGNMENT};
use crate::run::{self, Plans};

/// A raw pointer the caller promises to keep valid until the item completes.
#[derive(Clone, Copy)]
struct RawPtr(*mut u8);
// SAFETY: the pointee is only touched by the worker while the enqueuing caller guarantees it
// lives (blocking calls wait for the item; async calls are `unsafe` with that contract).
unsafe impl Send for RawPtr {}

enum Work {
    Compute(Arc<ExecGraph>),
    /// A staged write: the bytes belong to the queue.
    WriteStaged {
        dst: BufferId,
        offset: usize,
        data: Vec<u8>,
    },
    WriteRaw {
        dst: BufferId,
        offset: usize,
        src: RawPtr,
        len: usize,
    },
    ReadRaw {
        src: BufferId,
        offset: usize,
        out: RawPtr,
        len: usize,
    },
    /// A stream-ordered copy between two buffers of this stream.
    Copy {
        src: BufferId,
        src_offset: usize,
        dst: BufferId,
        dst_offset: usize,
        len: usize,
    },
    /// A read into memory the [`AsyncReadback`] and the queue share.
    ReadInto {
        src: BufferId,
        offset: usize,
        into: Arc<Mutex<Vec<u8>>>,
    },
    /// A device-side wait until another `cpu-async` stream completed `ticket` (the ticket its
    /// event stood at when `event_wait` was called: a later re-record does not move it).
    WaitTicket {
        owner: Arc<Shared>,
        ticket: u64,
    },
    /// A copy from another `cpu-async` stream's buffer, made once that stream completed ticket
    /// `until` (a device-side wait: this worker blocks, the host does not).
    PeerCopy {
        owner: Arc<Shared>,
        until: u64,
        src: BufferId,
        src_offset: usize,
        dst: BufferId,
        dst_offset: usize,
        len: usize,
    },
    Gate(Arc<GateState>),
    Shutdown,
}

struct Item {
    ticket: u64,
    work: Work,
}

#[derive(Default)]
struct Progress {
    /// Tickets handed out (host side).
    submitted: u64,
    /// Last ticket the worker finished.
    completed: u64,
    /// Last ticket the host learned was finished through a wait. `synchronize` is elided iff
    /// this equals `submitted`: work enqueued since the last wait always costs a wait, even
    /// if the worker happens to be done already (tickets, not timing — ARCHITECTURE §5).
    observed: u64,
}

struct Shared {
    store: Store,
    stats: SyncStats,
    progress: Mutex<Progress>,
    done: Condvar,
    /// Tickets up to this one are cancelled (kernels and gates skipped).
    cancel_upto: AtomicU64,
    shutdown: AtomicBool,
    /// The first kernel error since the last wait; reported by the next wait.
    error: Mutex<Option<Error>>,
    staging_pool: Mutex<Vec<Vec<u8>>>,
    /// Step plans of the graphs run recently (attention chains fused).
    plans: Plans,
}

impl Shared {
    fn cancelled(&self, ticket: u64) -> bool {
        ticket <= self.cancel_upto.load(Ordering::Acquire) || self.shutdown.load(Ordering::Acquire)
    }

    /// Blocks until `ticket` completed, polling the interrupt hook. One host wait and one
    /// driver sync, counted by the caller's primitive through `count`.
    fn wait_ticket(&self, ticket: u64) -> Result<()> {
        let mut p = self.progress.lock();
        let mut interrupted = false;
        while p.completed < ticket {
            self.done.wait_for(&mut p, interrupt::POLL_INTERVAL);
            if !interrupted
                && p.completed < ticket
                && MutexGuard::unlocked(&mut p, interrupt::requested)
            {
                interrupted = true;
                self.cancel_upto.store(p.submitted, Ordering::Release);
            }
        }
        p.observed = p.observed.max(ticket);
        drop(p);
        let err = self.error.lock().take();
        match (interrupted, err) {
            (true, _) => Err(Error::Interrupted),
            (false, Some(e)) => Err(e),
            (false, None) => Ok(()),
        }
    }

    fn count_wait(&self) {
        bump(&self.stats.host_waits, 1);
        bump(&self.stats.driver_syncs, 1);
    }
}

/// The asynchronous CPU backend.
pub struct CpuAsyncBackend {
    name: String,
    shared: Arc<Shared>,
    tx: Mutex<Sender<Item>>,
    worker: Option<JoinHandle<()>>,
}

impl CpuAsyncBackend {
    /// A new stream with its own worker thread and buffers.
    pub fn new(name: &str) -> Result<Self> {
        let shared = Arc::new(Shared {
            store: Store::new(name),
            stats: SyncStats::default(),
            progress: Mutex::new(Progress::default()),
            done: Condvar::new(),
            cancel_upto: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            error: Mutex::new(None),
            staging_pool: Mutex::new(Vec::new()),
            plans: Plans::default(),
        });
        let (tx, rx) = channel();
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name(format!("lowsync-{name}"))
            .spawn(move || worker_loop(&worker_shared, rx))
            .map_err(|e| Error::Unavailable {
                backend: name.to_string(),
                reason: e.to_string(),
            })?;
        Ok(CpuAsyncBackend {
            name: name.to_string(),
            shared,
            tx: Mutex::new(tx),
            worker: Some(worker),
        })
    }

    /// Queues one item and returns its ticket. Counts one submission, or one device wait for a
    /// wait on another stream's event.
    fn enqueue(&self, work: Work) -> u64 {
        let counter = match work {
            Work::WaitTicket { .. } | Work::PeerCopy { .. } => &self.shared.stats.device_waits,
            _ => &self.shared.stats.submits,
        };
        let tx = self.tx.lock();
        let mut p = self.shared.progress.lock();
        p.submitted += 1;
        let ticket = p.submitted;
        drop(p);
        bump(counter, 1);
        // The worker only exits on Shutdown, sent from Drop, so the send cannot fail here.
        let _ = tx.send(Item { ticket, work });
        ticket
    }

    /// Copies from another `cpu-async` stream with no host wait, as one GPU copies from
    /// another (peer copy after an event): this stream waits for the work queued on `peer` so
    /// far and copies (one device wait, one device-to-device copy), and `peer` waits for that
    /// copy before its later work may overwrite the source (one device wait there). The
    /// stand-in for pipeline stages on several devices.
    fn copy_from_peer(
        &self,
        peer: &CpuAsyncBackend,
        src: BufferId,
        src_offset: usize,
        dst: BufferId,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        peer.shared.store.span(src, src_offset, len)?;
        self.shared.store.span_write(dst, dst_offset, len)?;
        let until = peer.shared.progress.lock().submitted;
        bump(&self.shared.stats.d2d_copies, 1);
        bump(&self.shared.stats.d2d_bytes, len as u64);
        let ticket = self.enqueue(Work::PeerCopy {
            owner: peer.shared.clone(),
            until,
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        });
        peer.enqueue(Work::WaitTicket {
            owner: self.shared.clone(),
            ticket,
        });
        Ok(())
    }

    /// Enqueues `work` and blocks until it ran: one host wait.
    fn enqueue_and_wait(&self, work: Work) -> Result<()> {
        let ticket = self.enqueue(work);
        self.shared.count_wait();
        self.shared.wait_ticket(ticket)
    }

    fn take_staging(&self, data: &[u8]) -> Vec<u8> {
        let mut pool = self.shared.staging_pool.lock();
        let mut v = match pool.iter().position(|v| v.capacity() >= data.len()) {
            Some(i) => pool.swap_remove(i),
            None => pool.pop().unwrap_or_default(),
        };
        drop(pool);
        v.clear();
        v.extend_from_slice(data);
        v
    }
}

impl Drop for CpuAsyncBackend {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        let _ = self.tx.lock().send(Item {
            ticket: u64::MAX,
            work: Work::Shutdown,
        });
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Blocks this stream's worker (item `ticket`) until `owner` completed ticket `until`; false if
/// this item was cancelled first (Ctrl-C, shutdown) or `owner` shut down.
fn wait_for_peer(shared: &Shared, ticket: u64, owner: &Shared, until: u64) -> bool {
    let mut p = owner.progress.lock();
    // Woken by every item the owner completes; the timeout only lets a cancellation of this
    // stream (or the owner's shutdown) through.
    while p.completed < until {
        if shared.cancelled(ticket) || owner.shutdown.load(Ordering::Acquire) {
            return false;
        }
        owner.done.wait_for(&mut p, interrupt::POLL_INTERVAL);
    }
    true
}

fn worker_loop(shared: &Shared, rx: Receiver<Item>) {
    while let Ok(Item { ticket, work }) = rx.recv() {
        let cancelled = shared.cancelled(ticket);
        let result = match work {
            Work::Shutdown => break,
            Work::Compute(g) if !cancelled => run_graph_cancellable(shared, ticket, &g),
            Work::Compute(_) => Ok(()),
            Work::WriteStaged { dst, offset, data } => {
                let r = copy_into(&shared.store, dst, offset, data.as_ptr(), data.len());
                shared
                    .stats
                    .staging_bytes_in_use
                    .fetch_sub(data.len() as u64, Ordering::Relaxed);
                shared.staging_pool.lock().push(data);
                r
            }
            Work::WriteRaw {
                dst,
                offset,
                src,
                len,
            } => copy_into(&shared.store, dst, offset, src.0, len),
            Work::ReadRaw {
                src,
                offset,
                out,
                len,
            } => shared.store.span(src, offset, len).map(|p| {
                // SAFETY: bounds checked by `span`; `out` is valid per the enqueue contract.
                unsafe { std::ptr::copy_nonoverlapping(p, out.0, len) }
            }),
            Work::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => shared.store.span(src, src_offset, len).and_then(|from| {
                let to = shared.store.span_write(dst, dst_offset, len)?;
                // SAFETY: both ranges bounds-checked by `span`; `copy` allows overlap.
                unsafe { std::ptr::copy(from, to, len) };
                Ok(())
            }),
            Work::ReadInto { src, offset, into } => {
                let mut out = into.lock();
                shared.store.span(src, offset, out.len()).map(|p| {
                    // SAFETY: bounds checked by `span`; `out` is owned memory of that length.
                    unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) }
                })
            }
            Work::WaitTicket {
                owner,
                ticket: until,
            } => {
                wait_for_peer(shared, ticket, &owner, until);
                Ok(())
            }
            Work::PeerCopy {
                owner,
                until,
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => {
                if wait_for_peer(shared, ticket, &owner, until) {
                    owner.store.span(src, src_offset, len).and_then(|from| {
                        let to = shared.store.span_write(dst, dst_offset, len)?;
                        // SAFETY: both ranges bounds-checked; two streams' buffers never
                        // overlap, and the source wrote its bytes before `until` and waits for
                        // this ticket before it may write them again (`copy_from_peer`).
                        unsafe { std::ptr::copy_nonoverlapping(from, to, len) };
                        Ok(())
                    })
                } else {
                    Ok(()) // cancelled: the source may still be writing, nothing is copied
                }
            }
            Work::Gate(g) => {
                let mut open = g.open.lock();
                while !*open && !shared.cancelled(ticket) {
                    g.cv.wait_for(&mut open, interrupt::POLL_INTERVAL);
                }
                Ok(())
            }
        };
        if let Err(e) = result {
            shared.error.lock().get_or_insert(e);
        }
        let mut p = shared.progress.lock();
        p.completed = ticket;
        drop(p);
        shared.done.notify_all();
    }
}

fn run_graph_cancellable(shared: &Shared, ticket: u64, g: &Arc<ExecGraph>) -> Result<()> {
    // A cancelled graph stops between nodes and reports nothing (`cancel_upto` says why).
    run::run_graph(g, &shared.plans, &shared.store, &|| {
        shared.cancelled(ticket)
    })
    .map(|_| ())
}

fn copy_into(
    store: &Store,
    dst: BufferId,
    offset: usize,
    src: *const u8,
    len: usize,
) -> Result<()> {
    let p = store.span_write(dst, offset, len)?;
    // SAFETY: bounds checked by `span_write`; `src` is valid per the enqueue contract.
    unsafe { std::ptr::copy_nonoverlapping(src, p, len) };
    Ok(())
}

/// A read of a `cpu-async` stream. The queue item shares its memory, so dropping it early is
/// safe.
struct AsyncReadback {
    owner: Arc<Shared>,
    ticket: u64,
    into: Arc<Mutex<Vec<u8>>>,
    /// The bytes, once waited for.
    bytes: Option<Vec<u8>>,
}

impl Readback for AsyncReadback {
    fn is_complete(&self) -> bool {
        self.bytes.is_some() || self.owner.progress.lock().completed >= self.ticket
    }
    fn wait(&mut self) -> Result<&[u8]> {
        if self.bytes.is_none() {
            if self.owner.progress.lock().observed >= self.ticket {
                bump(&self.owner.stats.elided_syncs, 1);
            } else {
                self.owner.count_wait();
                self.owner.wait_ticket(self.ticket)?;
            }
            self.bytes = Some(std::mem::take(&mut *self.into.lock()));
        }
        Ok(self.bytes.as_deref().unwrap_or_default())
    }
}

/// An event of a `cpu-async` stream: complete when the owner's `completed` reaches its ticket.
pub struct AsyncEvent {
    owner: Arc<Shared>,
    ticket: AtomicU64,
}

impl Event for AsyncEvent {
    fn is_complete(&self) -> bool {
        self.owner.progress.lock().completed >= self.ticket.load(Ordering::Acquire)
    }
    fn synchronize(&self) -> Result<()> {
        if self.owner.progress.lock().observed >= self.ticket.load(Ordering::Acquire) {
            bump(&self.owner.stats.elided_syncs, 1);
            return Ok(());
        }
        self.owner.count_wait();
        self.owner.wait_ticket(self.ticket.load(Ordering::Acquire))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The `cpu-async` test gate.
pub struct GateState {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate for GateState {
    fn open(&self) {
        *self.open.lock() = true;
        self.cv.notify_all();
    }
}

impl Backend for CpuAsyncBackend {
    fn name(&self) -> &str {
        &self.name
    }
    fn as_any_backend(&self) -> Option<&dyn Any> {
        Some(self)
    }
    fn copies_from(&self, src: &dyn Backend) -> bool {
        src.as_any_backend()
            .and_then(|b| b.downcast_ref::<CpuAsyncBackend>())
            .is_some_and(|peer| !Arc::ptr_eq(&peer.shared, &self.shared))
    }
    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn caps(&self) -> Caps {
        Caps {
            set_tensor_async: true,
            set_tensor_async_staged: true,
            get_tensor_async: true,
            cpy_tensor_async: true,
            events: true,
            sync_elision: true,
            graph_replay: false,
            test_gate: true,
            copy_async: true,
            read_async: true,
        }
    }
    fn buffer_type(&self) -> BufferType {
        BufferType {
            name: self.name.clone(),
            alignment: ALIGNMENT,
            is_host: false,
        }
    }
    fn supports_op(&self, op: &Op, dst: DType, srcs: &[DType]) -> bool {
        cpu_supports_op(op, dst, srcs)
    }
    fn stats(&self) -> &SyncStats {
        &self.shared.stats
    }

    fn alloc_buffer(&self, size: usize, usage: BufferUsage) -> Result<BufferId> {
        let id = self.shared.store.alloc_for(size, usage)?;
        bump(&self.shared.stats.reserves, 1);
        Ok(id)
    }
    fn realloc_buffer(&self, id: BufferId, size: usize) -> Result<()> {
        // Queued work may still use the old memory.
        self.synchronize()?;
        self.shared.store.realloc(id, size)?;
        bump(&self.shared.stats.reallocs, 1);
        Ok(())
    }
    fn free_buffer(&self, id: BufferId) {
        // Queued work may still use it; a failed wait leaves the buffer to the backend's drop.
        if self.synchronize().is_ok() {
            self.shared.store.free(id);
        }
    }
    fn buffer_size(&self, id: BufferId) -> Result<usize> {
        Ok(self.shared.store.get(id)?.size())
    }
    fn alias_weight(&self, bytes: &WeightBytes) -> Result<Option<BufferId>> {
        // Nothing queued can use a buffer that does not exist yet: no ordering needed.
        let id = self.shared.store.alias(bytes);
        if id.is_some() {
            bump(&self.shared.stats.reserves, 1);
        }
        Ok(id)
    }

    fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.shared.store.span_write(dst, offset, data.len())?;
        bump(&self.shared.stats.h2d_copies, 1);
        bump(&self.shared.stats.h2d_bytes, data.len() as u64);
        let src = RawPtr(data.as_ptr().cast_mut());
        self.enqueue_and_wait(Work::WriteRaw {
            dst,
            offset,
            src,
            len: data.len(),
        })
    }
    fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        self.shared.store.span(src, offset, out.len())?;
        bump(&self.shared.stats.d2h_copies, 1);
        bump(&self.shared.stats.d2h_bytes, out.len() as u64);
        let out_ptr = RawPtr(out.as_mut_ptr());
        self.enqueue_and_wait(Work::ReadRaw {
            src,
            offset,
            out: out_ptr,
            len: out.len(),
        })
    }
    unsafe fn set_tensor_async(
        &self,
        dst: BufferId,
        offset: usize,
        data: *const u8,
        len: usize,
    ) -> Result<()> {
        self.shared.store.span_write(dst, offset, len)?;
        bump(&self.shared.stats.h2d_copies, 1);
        bump(&self.shared.stats.h2d_bytes, len as u64);
        self.enqueue(Work::WriteRaw {
            dst,
            offset,
            src: RawPtr(data.cast_mut()),
            len,
        });
        Ok(())
    }
    fn set_tensor_async_staged(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.shared.store.span_write(dst, offset, data.len())?;
        let staged = self.take_staging(data);
        bump(&self.shared.stats.staging_bytes_in_use, data.len() as u64);
        bump(&self.shared.stats.h2d_copies, 1);
        bump(&self.shared.stats.h2d_bytes, data.len() as u64);
        self.enqueue(Work::WriteStaged {
            dst,
            offset,
            data: staged,
        });
        Ok(())
    }
    unsafe fn get_tensor_async(
        &self,
        src: BufferId,
        offset: usize,
        out: *mut u8,
        len: usize,
    ) -> Result<()> {
        self.shared.store.span(src, offset, len)?;
        bump(&self.shared.stats.d2h_copies, 1);
        bump(&self.shared.stats.d2h_bytes, len as u64);
        self.enqueue(Work::ReadRaw {
            src,
            offset,
            out: RawPtr(out),
            len,
        });
        Ok(())
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
        if let Some(peer) = src_backend
            .as_any_backend()
            .and_then(|b| b.downcast_ref::<CpuAsyncBackend>())
        {
            if !Arc::ptr_eq(&peer.shared, &self.shared) {
                self.copy_from_peer(peer, src, src_offset, dst, dst_offset, len)?;
                return Ok(true);
            }
        }
        // Only from host memory, which is ready as soon as its (synchronous) producer returned.
        // The bytes are staged now, at call time, so the host may reuse the source at once
        // (invariant 3 holds without keeping it alive until this stream gets there).
        let staged = with_host_source(src_backend, src, src_offset, len, |data| {
            self.set_tensor_async_staged(dst, dst_offset, data)
        })?;
        Ok(staged.is_some())
    }

    fn copy_async(
        &self,
        src: BufferId,
        src_offset: usize,
        dst: BufferId,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.shared.store.span(src, src_offset, len)?;
        self.shared.store.span_write(dst, dst_offset, len)?;
        bump(&self.shared.stats.d2d_copies, 1);
        bump(&self.shared.stats.d2d_bytes, len as u64);
        self.enqueue(Work::Copy {
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        });
        Ok(())
    }
    fn read_async(&self, src: BufferId, offset: usize, len: usize) -> Result<Box<dyn Readback>> {
        self.shared.store.span(src, offset, len)?;
        bump(&self.shared.stats.d2h_copies, 1);
        bump(&self.shared.stats.d2h_bytes, len as u64);
        let into = Arc::new(Mutex::new(vec![0u8; len]));
        let ticket = self.enqueue(Work::ReadInto {
            src,
            offset,
            into: into.clone(),
        });
        Ok(Box::new(AsyncReadback {
            owner: self.shared.clone(),
            ticket,
            into,
            bytes: None,
        }))
    }

    fn graph_compute_async(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        bump(&self.shared.stats.kernel_launches, graph.nodes.len() as u64);
        self.enqueue(Work::Compute(graph.clone()));
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        let target = {
            let p = self.shared.progress.lock();
            (p.observed < p.submitted).then_some(p.submitted)
        };
        match target {
            None => {
                bump(&self.shared.stats.elided_syncs, 1);
                self.shared.error.lock().take().map_or(Ok(()), Err)
            }
            Some(t) => {
                self.shared.count_wait();
                self.shared.wait_ticket(t)
            }
        }
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Ok(Arc::new(AsyncEvent {
            owner: self.shared.clone(),
            ticket: AtomicU64::new(0),
        }))
    }
    fn event_record(&self, ev: &Arc<dyn Event>) -> Result<()> {
        let a = ev
            .as_any()
            .downcast_ref::<AsyncEvent>()
            .filter(|a| Arc::ptr_eq(&a.owner, &self.shared));
        let Some(a) = a else {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: "recording another backend's event".into(),
            });
        };
        // Items run in ticket order, so the event is the current end of the stream.
        a.ticket
            .store(self.shared.progress.lock().submitted, Ordering::Release);
        Ok(())
    }
    fn event_wait(&self, ev: &Arc<dyn Event>) -> Result<()> {
        if ev.as_any().is::<DoneEvent>() {
            return Ok(()); // recorded by the synchronous host: complete when recorded
        }
        let Some(a) = ev.as_any().downcast_ref::<AsyncEvent>() else {
            // Another kind of stream: the host waits (counted by that event's backend).
            return ev.synchronize();
        };
        if Arc::ptr_eq(&a.owner, &self.shared) {
            return Ok(()); // stream order suffices
        }
        let ticket = a.ticket.load(Ordering::Acquire);
        if ticket == 0 {
            return Ok(()); // never recorded: complete
        }
        // Queued even when the event already completed, so the count (one device wait) never
        // depends on timing.
        self.enqueue(Work::WaitTicket {
            owner: a.owner.clone(),
            ticket,
        });
        Ok(())
    }

    fn gate_close(&self) -> Result<Arc<dyn Gate>> {
        let g = Arc::new(GateState {
            open: Mutex::new(false),
            cv: Condvar::new(),
        });
        self.enqueue(Work::Gate(g.clone()));
        Ok(g)
    }
}
