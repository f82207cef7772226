//! Ticketed sync elision: the single choke point of a CUDA stream.
//!
//! Why: a `synchronize` with nothing queued since the last completed wait still costs a driver
//! call (and, on some platforms, a real host stall). S3 removed those calls with a "stream used"
//! flag that any new enqueue path could forget to set. Here the stream object itself is the only
//! way to reach the driver's enqueue calls, so nothing can be queued without being counted.
//!
//! Strategy: [`TicketStream`] owns a [`Driver`] (the real cudarc one, or a recording fake in
//! tests) and exposes one method per enqueue kind — kernel launch, memcpy, memset, stream-ordered
//! alloc/free, event record, device-side event wait, the test gate's value wait, graph launch —
//! plus [`TicketStream::lend`], which hands out the raw stream (for cuBLAS) for the length of one
//! closure. Each of them takes the next ticket (`submitted += 1`) under the same lock as the
//! driver call, so a waiter that reads `submitted` knows every ticket up to it has reached the
//! driver. A successful wait records `observed = submitted-at-wait`; `synchronize` makes no
//! driver call iff `observed == submitted` (an elided sync). Counters are bumped here, in the
//! primitive that enqueues or waits (ARCHITECTURE §3).
//!
//! Small host-to-device and device-to-device copies, and reads into pinned host memory, may
//! wait in a batch ([`TicketStream::defer_htod`], [`TicketStream::defer_dtoh`]) that runs as
//! one kernel, the host bytes in its parameters. The batch is launched first by whatever
//! reaches the driver next — every enqueue, a lend, a capture, a synchronize, a host wait, a
//! poll of a batched read — so stream order is the order of the calls, and the ticket a
//! deferred copy will take is known when it is deferred; a deferred copy is counted when it is
//! deferred, its batch's launch is the submission.
//!
//! Invariants: (6) with elision on, `synchronize` after no enqueue makes no driver call and
//! after any enqueue it waits; a failed wait never advances `observed`; a failed enqueue still
//! counts as outstanding work (the next sync asks the driver); elision is only on when exactly
//! one device is in use (S3: multi-device keeps unconditional syncs); non-blocking queries never
//! advance `observed`, so counts depend on what was enqueued, never on timing.

use std::ffi::c_void;
use std::marker::PhantomData;

use lowsync_backend::{bump, SyncStats};
use parking_lot::Mutex;

use crate::copy_batch::Batch;
pub use crate::copy_batch::{BatchItem, BatchParams, BATCH_DATA, BATCH_ITEMS};

/// Grid, block and dynamic shared memory of one kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
    /// Programmatic dependent launch: the kernel may start before the previous kernel in the
    /// stream completes (it waits with `griddepcontrol.wait` before using its results).
    pub pdl: bool,
}

impl LaunchDims {
    /// One block of `threads` threads, no dynamic shared memory, launched in stream order
    /// (the copy kernels).
    pub fn one_block(threads: u32) -> Self {
        LaunchDims {
            grid: (1, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
            pdl: false,
        }
    }
}

/// The driver calls the ticket logic routes. The real implementation wraps cudarc's driver API
/// around one `CUstream`; tests use a recording fake. Enqueue methods are only reachable through
/// [`TicketStream`], which owns the driver.
pub trait Driver: Send + Sync {
    type Error: std::fmt::Debug;
    type Event: Send + Sync;
    type Function: Copy + Send + Sync;
    type GraphExec: Send + Sync;
    type RawStream: Copy;
    type Context: Copy;

    /// Queues a kernel.
    ///
    /// # Safety
    /// `f` is a loaded kernel whose parameters are exactly `params`, and every pointer they hold
    /// stays valid until the kernel ran.
    unsafe fn launch(
        &self,
        f: Self::Function,
        dims: LaunchDims,
        params: &mut [*mut c_void],
    ) -> Result<(), Self::Error>;
    /// # Safety
    /// `src..src+len` stays valid and unchanged until the copy ran; `dst` is device memory.
    unsafe fn memcpy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<(), Self::Error>;
    /// # Safety
    /// `dst..dst+len` stays valid and untouched until the copy ran.
    unsafe fn memcpy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), Self::Error>;
    /// # Safety
    /// Both ranges are device memory of this context.
    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<(), Self::Error>;
    /// # Safety
    /// Each range is device memory of its context.
    unsafe fn memcpy_peer(
        &self,
        dst: u64,
        dst_ctx: Self::Context,
        src: u64,
        src_ctx: Self::Context,
        len: usize,
    ) -> Result<(), Self::Error>;
    /// # Safety
    /// `dst..dst+len` is device memory.
    unsafe fn memset_d8(&self, dst: u64, value: u8, len: usize) -> Result<(), Self::Error>;
    /// Stream-ordered allocation.
    ///
    /// # Safety
    /// The memory may only be used by work queued after this call.
    unsafe fn malloc_async(&self, len: usize) -> Result<u64, Self::Error>;
    /// Stream-ordered free (cudarc frees this way on drop; here it is explicit and counted).
    ///
    /// # Safety
    /// `ptr` came from [`Driver::malloc_async`] and no work queued later uses it.
    unsafe fn free_async(&self, ptr: u64) -> Result<(), Self::Error>;
    fn event_record(&self, ev: &Self::Event) -> Result<(), Self::Error>;
    /// Device-side wait: later work on this stream waits for `ev`.
    fn stream_wait_event(&self, ev: &Self::Event) -> Result<(), Self::Error>;
    /// Device-side wait until the 32-bit word at `addr` is `>= value`.
    ///
    /// # Safety
    /// `addr` is device-visible memory that outlives the wait.
    unsafe fn stream_wait_value32(&self, addr: u64, value: u32) -> Result<(), Self::Error>;
    fn graph_launch(&self, exec: &Self::GraphExec) -> Result<(), Self::Error>;
    /// Starts recording this stream's enqueues into a graph instead of running them
    /// (`cuStreamBeginCapture`, thread-local mode).
    fn begin_capture(&self) -> Result<(), Self::Error>;
    /// Ends the recording and instantiates what it captured (the graph itself is released
    /// once instantiated). On `Err` nothing was captured and the stream is back to normal.
    fn end_capture(&self) -> Result<Self::GraphExec, Self::Error>;
    /// The raw stream handle (only handed out through [`TicketStream::lend`]).
    fn raw_stream(&self) -> Self::RawStream;

    /// Host blocks until the stream is idle (`cuStreamSynchronize`).
    fn stream_synchronize(&self) -> Result<(), Self::Error>;
    /// Host blocks until `ev` completed (`cuEventSynchronize`).
    fn event_synchronize(&self, ev: &Self::Event) -> Result<(), Self::Error>;
    /// Whether `ev` completed, without blocking (`cuEventQuery`).
    fn event_query(&self, ev: &Self::Event) -> Result<bool, Self::Error>;
}

/// The ticket state of one stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tickets {
    /// Tickets handed out: one per enqueue or lend.
    pub submitted: u64,
    /// The last ticket the host saw complete through a successful wait.
    pub observed: u64,
    /// Enqueues are being recorded into a graph (between [`TicketStream::begin_capture`] and
    /// [`TicketStream::end_capture`]): they run nothing, so they take no ticket and are not
    /// counted as submissions.
    pub capturing: bool,
    /// Enqueues recorded into graphs so far (kernels, copies, memsets, lends).
    pub captured: u64,
}

/// Whether `synchronize` may skip the driver when nothing is outstanding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncElision {
    /// Asked for (`LOWSYNC_CUDA_SYNC_ELISION`, default on).
    pub requested: bool,
    /// CUDA devices in use by the process; elision is only on for exactly one (S3).
    pub device_count: usize,
}

impl SyncElision {
    /// Whether syncs are elided under this setting.
    pub fn enabled(self) -> bool {
        self.requested && self.device_count == 1
    }
}

/// How an enqueue is counted in [`SyncStats`] (ARCHITECTURE §3: submissions are kernel and
/// graph launches and copies; memsets are kernels the driver launches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    Kernel,
    Memset,
    H2D(usize),
    D2H(usize),
    D2D(usize),
    Graph,
    /// A device-side wait on another stream's event: not a submission, a device wait.
    DeviceWait,
    /// Ordering or memory work that is not a submission (event record, the gate's value wait,
    /// alloc/free).
    NotASubmit,
}

/// The raw stream, lent for the length of one [`TicketStream::lend`] closure. It is neither
/// `Clone` nor `Send`, and its lifetime ends with the closure: cache nothing taken from it.
pub struct LentStream<'a, D: Driver> {
    raw: D::RawStream,
    _call: PhantomData<&'a ()>,
    _not_send: PhantomData<*const ()>,
}

impl<D: Driver> LentStream<'_, D> {
    /// The raw handle, for one library call inside the lend.
    pub fn as_raw(&self) -> D::RawStream {
        self.raw
    }
}

/// A stream whose every enqueue takes a ticket (see the module docs).
pub struct TicketStream<D: Driver> {
    driver: D,
    tickets: Mutex<Tickets>,
    /// Locked before `tickets` wherever both are held.
    batch: Mutex<Batch<D::Function>>,
    /// Recorded right after each batch that holds a read (`defer_dtoh`): what reads wait on.
    read_event: std::sync::OnceLock<D::Event>,
    elide: bool,
    stats: SyncStats,
}

impl<D: Driver> TicketStream<D> {
    /// Wraps `driver`; syncs are elided iff `elision.enabled()`.
    pub fn new(driver: D, elision: SyncElision) -> Self {
        TicketStream {
            driver,
            tickets: Mutex::new(Tickets::default()),
            batch: Mutex::new(Batch::new()),
            read_event: std::sync::OnceLock::new(),
            elide: elision.enabled(),
            stats: SyncStats::default(),
        }
    }

    /// The live counters of this stream.
    pub fn stats(&self) -> &SyncStats {
        &self.stats
    }

    /// Whether idle syncs are elided.
    pub fn elides(&self) -> bool {
        self.elide
    }

    /// The current tickets.
    pub fn tickets(&self) -> Tickets {
        *self.tickets.lock()
    }

    /// The driver (tests inspect their fakes through it).
    #[cfg(test)]
    pub(crate) fn driver(&self) -> &D {
        &self.driver
    }

    /// The one enqueue path: takes a ticket and calls the driver under the ticket lock.
    fn enqueue<R>(
        &self,
        counted: Counted,
        call: impl FnOnce(&D) -> Result<R, D::Error>,
    ) -> Result<(R, u64), D::Error> {
        self.flush()?;
        let mut t = self.tickets.lock();
        if t.capturing {
            // Recorded, not run: the graph's launch takes the ticket and is the submission.
            t.captured += 1;
            let ticket = t.submitted;
            return call(&self.driver).map(|r| (r, ticket));
        }
        // Taken before the call: a call that fails may still have queued work, so the next
        // synchronize must ask the driver (conservative).
        t.submitted += 1;
        let ticket = t.submitted;
        let r = call(&self.driver);
        drop(t);
        let r = r?;
        self.count(counted);
        Ok((r, ticket))
    }

    fn count(&self, counted: Counted) {
        let s = &self.stats;
        match counted {
            Counted::Kernel => {
                bump(&s.submits, 1);
                bump(&s.kernel_launches, 1);
            }
            Counted::Memset => bump(&s.submits, 1),
            Counted::H2D(n) => {
                bump(&s.submits, 1);
                bump(&s.h2d_copies, 1);
                bump(&s.h2d_bytes, n as u64);
            }
            Counted::D2H(n) => {
                bump(&s.submits, 1);
                bump(&s.d2h_copies, 1);
                bump(&s.d2h_bytes, n as u64);
            }
            Counted::D2D(n) => {
                bump(&s.submits, 1);
                bump(&s.d2d_copies, 1);
                bump(&s.d2d_bytes, n as u64);
            }
            Counted::Graph => {
                bump(&s.submits, 1);
                bump(&s.graph_launches, 1);
            }
            Counted::DeviceWait => bump(&s.device_waits, 1),
            Counted::NotASubmit => {}
        }
    }

    /// Queues a kernel. Returns its ticket.
    ///
    /// # Safety
    /// As [`Driver::launch`].
    pub unsafe fn launch(
        &self,
        f: D::Function,
        dims: LaunchDims,
        params: &mut [*mut c_void],
    ) -> Result<u64, D::Error> {
        self.enqueue(Counted::Kernel, |d| unsafe { d.launch(f, dims, params) })
            .map(|r| r.1)
    }

    /// Lets host-to-device and device-to-device copies of a few bytes wait and run together as
    /// one launch of `kernel` (`copy_batch`, taking one [`BatchParams`]).
    /// With `read_event`, reads of a few bytes into host memory may ride in the batch too
    /// ([`Self::defer_dtoh`]); the event is recorded after each batch that holds one.
    pub fn enable_batch(&self, kernel: D::Function, read_event: Option<D::Event>) {
        self.batch.lock().enable(kernel);
        if let Some(ev) = read_event {
            // Set once: a second call keeps the first event (reads may be waiting on it).
            let _ = self.read_event.set(ev);
        }
    }

    /// Queues a read of `len` device bytes at `src` into host memory at `dst` (pinned, which
    /// the device addresses directly) in the pending batch, as [`Self::defer_htod`] (counted as
    /// one D2H copy now). Returns the ticket to wait for with [`Self::wait_read`]; `None`,
    /// nothing queued: reads are not batched, a graph is being captured, or the batch is full
    /// of other copies.
    ///
    /// # Safety
    /// `dst` holds `len` bytes that stay valid and unread until that wait (or
    /// [`Self::read_done`]) says the read completed.
    pub unsafe fn defer_dtoh(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<Option<u64>, D::Error> {
        if src == 0 || self.read_event.get().is_none() {
            return Ok(None);
        }
        // The batch's launch takes the returned ticket, its read event the one after.
        Ok(self.defer(dst as u64, src, &[], len, true)?.map(|t| t + 1))
    }

    /// Host wait for a read queued by [`Self::defer_dtoh`] at `ticket`: launches the batch if
    /// it is still pending, then waits for the read event (elided when a completed wait already
    /// covered the ticket). A later batch may have recorded the event again since: the wait
    /// then lasts until that later point of the stream, which is after the read.
    ///
    /// The pending batch is launched only while it still holds this read. Under launch-ahead
    /// it holds the next step's read, queued behind the next step's graph: launching it here
    /// would record the read event again behind that graph, and this wait would last until the
    /// step queued ahead ended (the host then never runs ahead of the device).
    pub fn wait_read(&self, ticket: u64) -> Result<(), D::Error> {
        let Some(ev) = self.read_event.get() else {
            return self.flush(); // no read was batched
        };
        if ticket > self.tickets.lock().submitted {
            self.flush()?; // its batch is still pending
        }
        self.wait_recorded(ev, ticket)
    }

    /// Whether a read queued by [`Self::defer_dtoh`] at `ticket` completed, without blocking
    /// (launching the batch if it is still pending, so that polling never waits forever).
    pub fn read_done(&self, ticket: u64) -> Result<bool, D::Error> {
        if ticket > self.tickets.lock().submitted {
            self.flush()?; // its batch is still pending
        }
        match self.read_event.get() {
            Some(ev) => self.query_event(ev, ticket),
            None => Ok(true),
        }
    }

    /// Queues `data` for device address `dst` in the pending batch: the bytes are copied into
    /// the batch now, and the batch runs as one kernel (the bytes riding in its parameters, no
    /// copy engine) right before whatever reaches this stream's driver next — an enqueue, a
    /// lend, a capture, a wait. Counted as one H2D copy now; the batch's launch is the
    /// submission. `Ok(false)`, nothing queued: batching is off, a graph is being captured, or
    /// `data` is longer than a batch holds.
    pub fn defer_htod(&self, dst: u64, data: &[u8]) -> Result<bool, D::Error> {
        Ok(self.defer(dst, 0, data, data.len(), false)?.is_some())
    }

    /// Queues a device-to-device copy of `len` bytes in the pending batch, as
    /// [`Self::defer_htod`] (counted as one D2D copy now). The ranges must not overlap.
    pub fn defer_dtod(&self, dst: u64, src: u64, len: usize) -> Result<bool, D::Error> {
        if src == 0 {
            return Ok(false);
        }
        Ok(self.defer(dst, src, &[], len, false)?.is_some())
    }

    /// `data` (host bytes, `src == 0`) or `len` bytes at `src` into the batch (`read`: into
    /// host memory). Returns the ticket the batch's launch will take (nothing takes a ticket
    /// before it: every path to the driver launches the batch first), or `None`: not deferred.
    fn defer(
        &self,
        dst: u64,
        src: u64,
        data: &[u8],
        len: usize,
        read: bool,
    ) -> Result<Option<u64>, D::Error> {
        if len == 0 || len > BATCH_DATA {
            return Ok(None);
        }
        let mut b = self.batch.lock();
        // Checked under the batch lock, which `begin_capture` holds while it starts one.
        if !b.enabled() || self.tickets.lock().capturing {
            return Ok(None);
        }
        if !b.fits(data.len()) {
            drop(b);
            self.flush()?;
            b = self.batch.lock();
            if !b.fits(data.len()) {
                // Another thread filled it since the flush: the caller takes the copy engine.
                return Ok(None);
            }
        }
        b.push(dst, src, data, len, read);
        // Read under the batch lock: no flush can launch the batch in between.
        let ticket = self.tickets.lock().submitted + 1;
        drop(b);
        let s = &self.stats;
        let (copies, bytes) = match (src == 0, read) {
            (true, _) => (&s.h2d_copies, &s.h2d_bytes),
            (false, true) => (&s.d2h_copies, &s.d2h_bytes),
            (false, false) => (&s.d2d_copies, &s.d2d_bytes),
        };
        bump(copies, 1);
        bump(bytes, len as u64);
        Ok(Some(ticket))
    }

    /// Launches the pending batch, if any (one ticket, one submission).
    fn flush(&self) -> Result<(), D::Error> {
        self.flush_locked(&mut self.batch.lock())
    }

    fn flush_locked(&self, b: &mut Batch<D::Function>) -> Result<(), D::Error> {
        let Some(f) = b.launchable() else {
            return Ok(());
        };
        let mut t = self.tickets.lock();
        t.submitted += 1;
        let dims = LaunchDims::one_block(128);
        let mut param: *mut c_void = b.params_ptr().cast();
        // SAFETY: `copy_batch` takes one `BatchParams` by value, which the driver copies at the
        // launch; every address in it was checked by the backend that deferred the copy.
        let mut r = unsafe {
            self.driver
                .launch(f, dims, std::slice::from_mut(&mut param))
        };
        let launched = r.is_ok();
        if let (true, true, Some(ev)) = (launched, b.has_read(), self.read_event.get()) {
            t.submitted += 1;
            r = self.driver.event_record(ev);
        }
        drop(t);
        // Launched or not, these copies are done with (a failed launch leaves them lost and the
        // ticket outstanding, so the next synchronize asks the driver and reports the error).
        b.clear();
        if launched {
            bump(&self.stats.submits, 1);
        }
        r
    }

    /// Queues a kernel that performs one copy (a few bytes moved by one block instead of a copy
    /// engine): counted as that copy (`counted`: `H2D`, `D2H` or `D2D`), one submission.
    ///
    /// # Safety
    /// As [`Driver::launch`].
    pub unsafe fn launch_copy(
        &self,
        counted: Counted,
        f: D::Function,
        dims: LaunchDims,
        params: &mut [*mut c_void],
    ) -> Result<u64, D::Error> {
        self.enqueue(counted, |d| unsafe { d.launch(f, dims, params) })
            .map(|r| r.1)
    }

    /// Queues a host-to-device copy.
    ///
    /// # Safety
    /// As [`Driver::memcpy_htod`].
    pub unsafe fn memcpy_htod(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<u64, D::Error> {
        self.enqueue(Counted::H2D(len), |d| unsafe {
            d.memcpy_htod(dst, src, len)
        })
        .map(|r| r.1)
    }

    /// Queues a device-to-host copy.
    ///
    /// # Safety
    /// As [`Driver::memcpy_dtoh`].
    pub unsafe fn memcpy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<u64, D::Error> {
        self.enqueue(Counted::D2H(len), |d| unsafe {
            d.memcpy_dtoh(dst, src, len)
        })
        .map(|r| r.1)
    }

    /// Queues a device-to-device copy within this context.
    ///
    /// # Safety
    /// As [`Driver::memcpy_dtod`].
    pub unsafe fn memcpy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<u64, D::Error> {
        self.enqueue(Counted::D2D(len), |d| unsafe {
            d.memcpy_dtod(dst, src, len)
        })
        .map(|r| r.1)
    }

    /// Queues a copy from another context's device memory.
    ///
    /// # Safety
    /// As [`Driver::memcpy_peer`].
    pub unsafe fn memcpy_peer(
        &self,
        dst: u64,
        dst_ctx: D::Context,
        src: u64,
        src_ctx: D::Context,
        len: usize,
    ) -> Result<u64, D::Error> {
        self.enqueue(Counted::D2D(len), |d| unsafe {
            d.memcpy_peer(dst, dst_ctx, src, src_ctx, len)
        })
        .map(|r| r.1)
    }

    /// Queues a byte fill.
    ///
    /// # Safety
    /// As [`Driver::memset_d8`].
    pub unsafe fn memset_d8(&self, dst: u64, value: u8, len: usize) -> Result<u64, D::Error> {
        self.enqueue(Counted::Memset, |d| unsafe { d.memset_d8(dst, value, len) })
            .map(|r| r.1)
    }

    /// Stream-ordered allocation.
    ///
    /// # Safety
    /// As [`Driver::malloc_async`].
    pub unsafe fn malloc_async(&self, len: usize) -> Result<u64, D::Error> {
        self.enqueue(Counted::NotASubmit, |d| unsafe { d.malloc_async(len) })
            .map(|r| r.0)
    }

    /// Stream-ordered free.
    ///
    /// # Safety
    /// As [`Driver::free_async`].
    pub unsafe fn free_async(&self, ptr: u64) -> Result<u64, D::Error> {
        self.enqueue(Counted::NotASubmit, |d| unsafe { d.free_async(ptr) })
            .map(|r| r.1)
    }

    /// Records `ev` at the end of the stream; returns the ticket the event completes with.
    pub fn record_event(&self, ev: &D::Event) -> Result<u64, D::Error> {
        self.enqueue(Counted::NotASubmit, |d| d.event_record(ev))
            .map(|r| r.1)
    }

    /// Makes later work on this stream wait (device side) for `ev`: one device wait, counted
    /// whether or not the event already completed.
    pub fn wait_event(&self, ev: &D::Event) -> Result<u64, D::Error> {
        self.enqueue(Counted::DeviceWait, |d| d.stream_wait_event(ev))
            .map(|r| r.1)
    }

    /// Makes later work wait (device side) until the word at `addr` is `>= value`.
    ///
    /// # Safety
    /// As [`Driver::stream_wait_value32`].
    pub unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<u64, D::Error> {
        self.enqueue(Counted::NotASubmit, |d| unsafe {
            d.stream_wait_value32(addr, value)
        })
        .map(|r| r.1)
    }

    /// Launches an instantiated CUDA graph.
    pub fn graph_launch(&self, exec: &D::GraphExec) -> Result<u64, D::Error> {
        self.enqueue(Counted::Graph, |d| d.graph_launch(exec))
            .map(|r| r.1)
    }

    /// Starts recording enqueues into a graph (see [`Tickets::capturing`]). Only the thread
    /// that queues a compute graph may enqueue until [`Self::end_capture`]; a synchronize in
    /// between is an error.
    pub fn begin_capture(&self) -> Result<(), D::Error> {
        // The batch stays locked until the capture started, so nothing is deferred between the
        // launch of the pending batch and the capture (nothing is deferred during one).
        let mut b = self.batch.lock();
        self.flush_locked(&mut b)?;
        let mut t = self.tickets.lock();
        self.driver.begin_capture()?;
        t.capturing = true;
        Ok(())
    }

    /// Ends the recording and instantiates the graph; counts a capture on success.
    pub fn end_capture(&self) -> Result<D::GraphExec, D::Error> {
        let mut t = self.tickets.lock();
        t.capturing = false;
        let exec = self.driver.end_capture()?;
        drop(t);
        bump(&self.stats.graph_captures, 1);
        Ok(exec)
    }

    /// Whether enqueues are being recorded into a graph right now.
    pub fn is_capturing(&self) -> bool {
        self.tickets.lock().capturing
    }

    /// Lends the raw stream for one call (cuBLAS). Borrowing counts as work (S3: acquiring
    /// a handle marks the stream used), so it takes a ticket even if the closure queues
    /// nothing. The ticket lock is held while `f` runs: `f` must not call back into this stream.
    /// A pending batch is launched first; `Err` only when that launch fails (`f` not called).
    pub fn lend<R>(
        &self,
        counted: Counted,
        f: impl FnOnce(&LentStream<'_, D>) -> R,
    ) -> Result<R, D::Error> {
        self.flush()?;
        let mut t = self.tickets.lock();
        if t.capturing {
            t.captured += 1;
            let lent = LentStream {
                raw: self.driver.raw_stream(),
                _call: PhantomData,
                _not_send: PhantomData,
            };
            return Ok(f(&lent));
        }
        t.submitted += 1;
        let lent = LentStream {
            raw: self.driver.raw_stream(),
            _call: PhantomData,
            _not_send: PhantomData,
        };
        let r = f(&lent);
        drop(t);
        self.count(counted);
        Ok(r)
    }

    /// Waits until everything queued completed, or returns at once (an elided sync) when the
    /// last completed wait already covered every ticket and elision is on.
    pub fn synchronize(&self) -> Result<(), D::Error> {
        self.flush()?;
        let target = {
            let t = self.tickets.lock();
            if self.elide && t.observed == t.submitted {
                bump(&self.stats.elided_syncs, 1);
                return Ok(());
            }
            t.submitted
        };
        bump(&self.stats.host_waits, 1);
        bump(&self.stats.driver_syncs, 1);
        self.driver.stream_synchronize()?;
        self.observe(target);
        Ok(())
    }

    /// Host wait for an event recorded at `ticket` (from [`Self::record_event`]); elided when
    /// a completed wait already covered the ticket.
    pub fn wait_event_host(&self, ev: &D::Event, ticket: u64) -> Result<(), D::Error> {
        self.flush()?;
        self.wait_recorded(ev, ticket)
    }

    /// [`Self::wait_event_host`] without launching the pending batch first.
    fn wait_recorded(&self, ev: &D::Event, ticket: u64) -> Result<(), D::Error> {
        if self.elide && ticket <= self.tickets.lock().observed {
            bump(&self.stats.elided_syncs, 1);
            return Ok(());
        }
        bump(&self.stats.host_waits, 1);
        bump(&self.stats.driver_syncs, 1);
        self.driver.event_synchronize(ev)?;
        self.observe(ticket);
        Ok(())
    }

    /// Whether the event recorded at `ticket` completed, without blocking. Never advances
    /// `observed` (counts must not depend on timing).
    pub fn query_event(&self, ev: &D::Event, ticket: u64) -> Result<bool, D::Error> {
        if ticket <= self.tickets.lock().observed {
            return Ok(true);
        }
        self.driver.event_query(ev)
    }

    fn observe(&self, ticket: u64) {
        let mut t = self.tickets.lock();
        t.observed = t.observed.max(ticket);
    }
}

#[cfg(test)]
mod tests;
