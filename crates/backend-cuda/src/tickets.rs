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
    /// Ordering or memory work that is not a submission (event record, waits, alloc/free).
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

/// Most copies one batch carries.
pub const BATCH_ITEMS: usize = 8;
/// Bytes of host data one batch carries inside its kernel parameters. With the items the
/// parameter block is 4,048 bytes: every CUDA device takes 4 KiB of kernel parameters.
pub const BATCH_DATA: usize = 3840;

/// One copy of a batch: `len` bytes to `dst`, from device address `src`, or (`src == 0`) from
/// the batch's own data at `at`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchItem {
    pub dst: u64,
    pub src: u64,
    pub len: u32,
    pub at: u32,
}

/// The one parameter of the `copy_batch` kernel (layout shared with `CopyBatch` in
/// elementwise.cu): the host bytes first, so that they start 16-byte aligned.
#[repr(C, align(16))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchParams {
    pub data: [u8; BATCH_DATA],
    pub items: [BatchItem; BATCH_ITEMS],
    pub n: u32,
    pub pad: u32,
}

impl Default for BatchParams {
    fn default() -> Self {
        BatchParams {
            data: [0; BATCH_DATA],
            items: [BatchItem::default(); BATCH_ITEMS],
            n: 0,
            pad: 0,
        }
    }
}

/// Small copies waiting to run together as one kernel (see [`TicketStream::defer_htod`]).
struct Batch<F> {
    /// The `copy_batch` kernel; `None`: batching is off.
    kernel: Option<F>,
    params: Box<BatchParams>,
    /// Bytes of `params.data` in use (each copy's data starts 16-byte aligned).
    used: usize,
    /// The pending batch holds a read.
    has_read: bool,
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
            batch: Mutex::new(Batch {
                kernel: None,
                params: Box::default(),
                used: 0,
                has_read: false,
            }),
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
        self.batch.lock().kernel = Some(kernel);
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
    pub fn wait_read(&self, ticket: u64) -> Result<(), D::Error> {
        match self.read_event.get() {
            Some(ev) => self.wait_event_host(ev, ticket),
            None => self.flush(), // no read was batched
        }
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
        let fits = |b: &Batch<D::Function>| {
            (b.params.n as usize) < BATCH_ITEMS && b.used + data.len() <= BATCH_DATA
        };
        let mut b = self.batch.lock();
        // Checked under the batch lock, which `begin_capture` holds while it starts one.
        if b.kernel.is_none() || self.tickets.lock().capturing {
            return Ok(None);
        }
        if !fits(&b) {
            drop(b);
            self.flush()?;
            b = self.batch.lock();
            if !fits(&b) {
                // Another thread filled it since the flush: the caller takes the copy engine.
                return Ok(None);
            }
        }
        let at = b.used;
        b.params.data[at..at + data.len()].copy_from_slice(data);
        b.used = (at + data.len()).next_multiple_of(16);
        let n = b.params.n as usize;
        b.params.items[n] = BatchItem {
            dst,
            src,
            len: len as u32,
            at: at as u32,
        };
        b.params.n += 1;
        b.has_read |= read;
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
        let Some(f) = b.kernel.filter(|_| b.params.n > 0) else {
            return Ok(());
        };
        let mut t = self.tickets.lock();
        t.submitted += 1;
        let dims = LaunchDims::one_block(128);
        let mut param: *mut c_void = (&mut *b.params as *mut BatchParams).cast();
        // SAFETY: `copy_batch` takes one `BatchParams` by value, which the driver copies at the
        // launch; every address in it was checked by the backend that deferred the copy.
        let mut r = unsafe {
            self.driver
                .launch(f, dims, std::slice::from_mut(&mut param))
        };
        let launched = r.is_ok();
        if let (true, true, Some(ev)) = (launched, b.has_read, self.read_event.get()) {
            t.submitted += 1;
            r = self.driver.event_record(ev);
        }
        drop(t);
        // Launched or not, these copies are done with (a failed launch leaves them lost and the
        // ticket outstanding, so the next synchronize asks the driver and reports the error).
        b.params.n = 0;
        b.used = 0;
        b.has_read = false;
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

    /// Makes later work on this stream wait (device side) for `ev`.
    pub fn wait_event(&self, ev: &D::Event) -> Result<u64, D::Error> {
        self.enqueue(Counted::NotASubmit, |d| d.stream_wait_event(ev))
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
mod tests {
    //! The ticket logic against a recording fake driver: no GPU needed.

    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Call {
        Launch,
        HtoD(usize),
        DtoH(usize),
        DtoD(usize),
        Peer(usize),
        Memset(usize),
        MallocAsync(usize),
        FreeAsync,
        EventRecord(u32),
        StreamWaitEvent(u32),
        WaitValue32(u32),
        GraphLaunch,
        BeginCapture,
        EndCapture,
        RawStream,
        StreamSynchronize,
        EventSynchronize(u32),
        EventQuery(u32),
    }

    #[derive(Default)]
    struct Fake {
        calls: Mutex<Vec<Call>>,
        /// The parameter block of every one-parameter launch (the batches).
        batches: Mutex<Vec<BatchParams>>,
        fail_next_wait: AtomicBool,
        fail_enqueues: AtomicBool,
    }

    impl Fake {
        fn push(&self, c: Call) -> Result<(), String> {
            self.calls.lock().push(c);
            if self.fail_enqueues.load(Ordering::SeqCst) {
                return Err("enqueue failed".into());
            }
            Ok(())
        }
        fn wait(&self, c: Call) -> Result<(), String> {
            self.calls.lock().push(c);
            if self.fail_next_wait.swap(false, Ordering::SeqCst) {
                return Err("CUDA_ERROR_LAUNCH_FAILED".into());
            }
            Ok(())
        }
    }

    impl Driver for Fake {
        type Error = String;
        type Event = u32;
        type Function = ();
        type GraphExec = ();
        type RawStream = usize;
        type Context = ();

        unsafe fn launch(
            &self,
            _f: (),
            _dims: LaunchDims,
            params: &mut [*mut c_void],
        ) -> Result<(), String> {
            if let [p] = params {
                // SAFETY: the only one-parameter launch in these tests is a batch's.
                self.batches
                    .lock()
                    .push(unsafe { (*p as *const BatchParams).read() });
            }
            self.push(Call::Launch)
        }
        unsafe fn memcpy_htod(&self, _dst: u64, _src: *const u8, len: usize) -> Result<(), String> {
            self.push(Call::HtoD(len))
        }
        unsafe fn memcpy_dtoh(&self, _dst: *mut u8, _src: u64, len: usize) -> Result<(), String> {
            self.push(Call::DtoH(len))
        }
        unsafe fn memcpy_dtod(&self, _dst: u64, _src: u64, len: usize) -> Result<(), String> {
            self.push(Call::DtoD(len))
        }
        unsafe fn memcpy_peer(
            &self,
            _dst: u64,
            _dc: (),
            _src: u64,
            _sc: (),
            len: usize,
        ) -> Result<(), String> {
            self.push(Call::Peer(len))
        }
        unsafe fn memset_d8(&self, _dst: u64, _v: u8, len: usize) -> Result<(), String> {
            self.push(Call::Memset(len))
        }
        unsafe fn malloc_async(&self, len: usize) -> Result<u64, String> {
            self.push(Call::MallocAsync(len)).map(|_| 0x1000)
        }
        unsafe fn free_async(&self, _ptr: u64) -> Result<(), String> {
            self.push(Call::FreeAsync)
        }
        fn event_record(&self, ev: &u32) -> Result<(), String> {
            self.push(Call::EventRecord(*ev))
        }
        fn stream_wait_event(&self, ev: &u32) -> Result<(), String> {
            self.push(Call::StreamWaitEvent(*ev))
        }
        unsafe fn stream_wait_value32(&self, _addr: u64, value: u32) -> Result<(), String> {
            self.push(Call::WaitValue32(value))
        }
        fn graph_launch(&self, _exec: &()) -> Result<(), String> {
            self.push(Call::GraphLaunch)
        }
        fn begin_capture(&self) -> Result<(), String> {
            self.push(Call::BeginCapture)
        }
        fn end_capture(&self) -> Result<(), String> {
            self.push(Call::EndCapture)
        }
        fn raw_stream(&self) -> usize {
            self.calls.lock().push(Call::RawStream);
            7
        }
        fn stream_synchronize(&self) -> Result<(), String> {
            self.wait(Call::StreamSynchronize)
        }
        fn event_synchronize(&self, ev: &u32) -> Result<(), String> {
            self.wait(Call::EventSynchronize(*ev))
        }
        fn event_query(&self, ev: &u32) -> Result<bool, String> {
            self.calls.lock().push(Call::EventQuery(*ev));
            Ok(false)
        }
    }

    fn single() -> SyncElision {
        SyncElision {
            requested: true,
            device_count: 1,
        }
    }

    fn stream(elision: SyncElision) -> TicketStream<Fake> {
        TicketStream::new(Fake::default(), elision)
    }

    fn calls(s: &TicketStream<Fake>) -> Vec<Call> {
        s.driver.calls.lock().clone()
    }

    fn syncs(s: &TicketStream<Fake>) -> usize {
        calls(s)
            .iter()
            .filter(|c| matches!(c, Call::StreamSynchronize))
            .count()
    }

    type Path = (&'static str, fn(&TicketStream<Fake>));

    /// Every enqueue path of the stream, each as a closure.
    fn every_enqueue_path() -> Vec<Path> {
        vec![
            ("launch", |s| unsafe {
                let dims = LaunchDims::one_block(32);
                s.launch((), dims, &mut []).unwrap();
            }),
            ("launch_copy", |s| unsafe {
                let dims = LaunchDims::one_block(128);
                s.launch_copy(Counted::D2H(4), (), dims, &mut []).unwrap();
            }),
            ("memcpy_htod", |s| unsafe {
                s.memcpy_htod(0, [0u8; 4].as_ptr(), 4).unwrap();
            }),
            ("memcpy_dtoh", |s| unsafe {
                s.memcpy_dtoh([0u8; 4].as_mut_ptr(), 0, 4).unwrap();
            }),
            ("memcpy_dtod", |s| unsafe {
                s.memcpy_dtod(0, 0, 4).unwrap();
            }),
            ("memcpy_peer", |s| unsafe {
                s.memcpy_peer(0, (), 0, (), 4).unwrap();
            }),
            ("memset_d8", |s| unsafe {
                s.memset_d8(0, 0, 4).unwrap();
            }),
            ("malloc_async", |s| unsafe {
                s.malloc_async(4).unwrap();
            }),
            ("free_async", |s| unsafe {
                s.free_async(0x1000).unwrap();
            }),
            ("record_event", |s| {
                s.record_event(&1).unwrap();
            }),
            ("wait_event", |s| {
                s.wait_event(&1).unwrap();
            }),
            ("wait_value32", |s| unsafe {
                s.wait_value32(0, 1).unwrap();
            }),
            ("graph_launch", |s| {
                s.graph_launch(&()).unwrap();
            }),
            ("lend (cuBLAS handle / raw stream)", |s| {
                s.lend(Counted::Kernel, |raw| assert_eq!(raw.as_raw(), 7))
                    .unwrap();
            }),
        ]
    }

    #[test]
    fn every_enqueue_path_bumps_the_ticket_and_makes_the_next_sync_wait() {
        for (name, path) in every_enqueue_path() {
            let s = stream(single());
            s.synchronize().unwrap();
            assert_eq!(syncs(&s), 0, "{name}: idle sync must not call the driver");
            let before = s.tickets().submitted;
            path(&s);
            assert_eq!(s.tickets().submitted, before + 1, "{name}: one ticket");
            s.synchronize().unwrap();
            assert_eq!(syncs(&s), 1, "{name}: a sync after an enqueue waits");
            assert_eq!(s.tickets().observed, s.tickets().submitted);
            s.synchronize().unwrap();
            assert_eq!(syncs(&s), 1, "{name}: and the next one is elided");
            let st = s.stats().snapshot();
            assert_eq!((st.host_waits, st.driver_syncs, st.elided_syncs), (1, 1, 2));
        }
    }

    #[test]
    fn sync_after_no_enqueue_makes_no_driver_call() {
        let s = stream(single());
        for _ in 0..5 {
            s.synchronize().unwrap();
        }
        assert!(calls(&s).is_empty());
        let st = s.stats().snapshot();
        assert_eq!((st.host_waits, st.driver_syncs, st.elided_syncs), (0, 0, 5));
    }

    #[test]
    fn failed_wait_does_not_mark_completion() {
        let s = stream(single());
        unsafe { s.memcpy_htod(0, [1u8].as_ptr(), 1).unwrap() };
        s.driver.fail_next_wait.store(true, Ordering::SeqCst);
        assert!(s.synchronize().is_err());
        assert_eq!(s.tickets().observed, 0, "a failed wait observes nothing");
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 2, "the next sync asks the driver again");
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 2);
    }

    #[test]
    fn failed_event_wait_does_not_mark_completion() {
        let s = stream(single());
        let t = s.record_event(&3).unwrap();
        s.driver.fail_next_wait.store(true, Ordering::SeqCst);
        assert!(s.wait_event_host(&3, t).is_err());
        assert_eq!(s.tickets().observed, 0);
        s.wait_event_host(&3, t).unwrap();
        assert_eq!(s.tickets().observed, t);
    }

    #[test]
    fn failed_enqueue_still_counts_as_outstanding_work() {
        let s = stream(single());
        s.driver.fail_enqueues.store(true, Ordering::SeqCst);
        assert!(unsafe { s.memcpy_dtod(0, 0, 8) }.is_err());
        s.driver.fail_enqueues.store(false, Ordering::SeqCst);
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 1);
        assert_eq!(s.stats().snapshot().d2d_copies, 0, "nothing was submitted");
    }

    #[test]
    fn multi_device_never_elides() {
        let s = stream(SyncElision {
            requested: true,
            device_count: 2,
        });
        assert!(!s.elides());
        s.synchronize().unwrap();
        s.synchronize().unwrap();
        let t = s.record_event(&1).unwrap();
        s.synchronize().unwrap();
        s.wait_event_host(&1, t).unwrap();
        assert_eq!(syncs(&s), 3);
        let st = s.stats().snapshot();
        assert_eq!((st.host_waits, st.driver_syncs, st.elided_syncs), (4, 4, 0));
    }

    #[test]
    fn elision_off_makes_every_sync_a_driver_call() {
        let s = stream(SyncElision {
            requested: false,
            device_count: 1,
        });
        for _ in 0..3 {
            s.synchronize().unwrap();
        }
        assert_eq!(syncs(&s), 3);
        assert_eq!(s.stats().snapshot().elided_syncs, 0);
    }

    #[test]
    fn event_wait_observes_only_up_to_its_ticket() {
        let s = stream(single());
        unsafe { s.memcpy_htod(0, [1u8].as_ptr(), 1).unwrap() };
        let t = s.record_event(&9).unwrap();
        unsafe { s.memcpy_htod(0, [1u8].as_ptr(), 1).unwrap() };
        s.wait_event_host(&9, t).unwrap();
        assert_eq!(s.tickets().observed, t);
        assert!(
            s.query_event(&9, t).unwrap(),
            "known complete, no driver call"
        );
        assert!(!calls(&s).contains(&Call::EventQuery(9)));
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 1, "work after the event still needs a wait");
        s.wait_event_host(&9, t).unwrap();
        assert_eq!(
            calls(&s)
                .iter()
                .filter(|c| matches!(c, Call::EventSynchronize(_)))
                .count(),
            1,
            "a covered event wait is elided"
        );
    }

    #[test]
    fn queries_never_advance_observed() {
        let s = stream(single());
        let t = s.record_event(&4).unwrap();
        assert!(!s.query_event(&4, t).unwrap());
        assert_eq!(s.tickets().observed, 0);
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 1);
    }

    #[test]
    fn captured_enqueues_run_nothing_and_the_replay_is_the_submission() {
        let s = stream(single());
        let dims = LaunchDims::one_block(1);
        s.begin_capture().unwrap();
        assert!(s.is_capturing());
        unsafe {
            s.launch((), dims, &mut []).unwrap();
            s.memcpy_dtod(0, 0, 8).unwrap();
            s.launch((), dims, &mut []).unwrap();
        }
        s.lend(Counted::Kernel, |_| ()).unwrap();
        s.end_capture().unwrap();
        assert!(!s.is_capturing());
        let t = s.tickets();
        assert_eq!((t.submitted, t.captured), (0, 4), "recorded, not submitted");
        let st = s.stats().snapshot();
        assert_eq!(
            (
                st.submits,
                st.kernel_launches,
                st.d2d_copies,
                st.graph_captures
            ),
            (0, 0, 0, 1)
        );
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 0, "a capture queues nothing to wait for");
        for _ in 0..3 {
            s.graph_launch(&()).unwrap();
            s.synchronize().unwrap();
        }
        let st = s.stats().snapshot();
        assert_eq!(
            (st.submits, st.graph_launches, st.kernel_launches),
            (3, 3, 0)
        );
        assert_eq!((st.host_waits, syncs(&s)), (3, 3), "one wait per replay");
    }

    #[test]
    fn a_failed_capture_leaves_the_stream_counting_normally() {
        let s = stream(single());
        s.begin_capture().unwrap();
        s.driver.fail_enqueues.store(true, Ordering::SeqCst);
        assert!(s.end_capture().is_err());
        s.driver.fail_enqueues.store(false, Ordering::SeqCst);
        assert!(!s.is_capturing());
        assert_eq!(s.stats().snapshot().graph_captures, 0);
        unsafe { s.memcpy_dtod(0, 0, 8).unwrap() };
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 1);
        assert_eq!(s.stats().snapshot().d2d_copies, 1);
    }

    #[test]
    fn enqueues_are_counted_where_they_happen() {
        let s = stream(single());
        unsafe {
            s.memcpy_htod(0, [0u8; 16].as_ptr(), 16).unwrap();
            s.memcpy_dtoh([0u8; 4].as_mut_ptr(), 0, 4).unwrap();
            s.memcpy_dtod(0, 0, 8).unwrap();
            let dims = LaunchDims::one_block(1);
            s.launch((), dims, &mut []).unwrap();
        }
        s.graph_launch(&()).unwrap();
        s.record_event(&1).unwrap();
        let st = s.stats().snapshot();
        assert_eq!((st.h2d_copies, st.h2d_bytes), (1, 16));
        assert_eq!((st.d2h_copies, st.d2h_bytes), (1, 4));
        assert_eq!((st.d2d_copies, st.d2d_bytes), (1, 8));
        assert_eq!(st.kernel_launches, 1);
        assert_eq!(st.graph_launches, 1);
        assert_eq!(
            st.submits, 5,
            "copies, the kernel and the graph; not the event"
        );
    }

    #[test]
    fn a_copy_done_by_a_kernel_counts_as_that_copy_not_as_a_kernel() {
        let s = stream(single());
        let dims = LaunchDims::one_block(128);
        unsafe {
            s.launch_copy(Counted::H2D(512), (), dims, &mut []).unwrap();
            s.launch_copy(Counted::D2D(4), (), dims, &mut []).unwrap();
            s.launch_copy(Counted::D2H(4), (), dims, &mut []).unwrap();
        }
        let st = s.stats().snapshot();
        assert_eq!((st.h2d_copies, st.h2d_bytes), (1, 512));
        assert_eq!((st.d2d_copies, st.d2d_bytes), (1, 4));
        assert_eq!((st.d2h_copies, st.d2h_bytes), (1, 4));
        assert_eq!((st.kernel_launches, st.submits), (0, 3));
        assert!(
            calls(&s).iter().all(|c| matches!(c, Call::Launch)),
            "{:?}",
            calls(&s)
        );
        assert_eq!(s.tickets().submitted, 3);
    }

    fn batched() -> TicketStream<Fake> {
        let s = stream(single());
        s.enable_batch((), Some(9));
        s
    }

    #[test]
    fn the_batch_parameters_have_the_layout_the_kernel_reads() {
        assert_eq!(std::mem::size_of::<BatchParams>(), 4048);
        assert_eq!(std::mem::align_of::<BatchParams>(), 16);
        assert_eq!(std::mem::offset_of!(BatchParams, items), 3840);
        assert_eq!(std::mem::offset_of!(BatchParams, n), 4032);
        assert_eq!(std::mem::size_of::<BatchItem>(), 24);
    }

    #[test]
    fn deferred_copies_run_as_one_launch_before_the_next_enqueue() {
        let s = batched();
        assert!(s.defer_htod(0x1000, &[1, 2, 3]).unwrap());
        assert!(s.defer_htod(0x2000, &[7u8; 32]).unwrap());
        assert!(s.defer_dtod(0x3000, 0x1000, 4).unwrap());
        assert!(calls(&s).is_empty(), "nothing reaches the driver yet");
        assert_eq!(s.tickets().submitted, 0);
        let st = s.stats().snapshot();
        assert_eq!(
            (st.h2d_copies, st.h2d_bytes, st.d2d_copies, st.d2d_bytes),
            (2, 35, 1, 4)
        );
        assert_eq!(st.submits, 0, "the launch is the submission");
        s.graph_launch(&()).unwrap();
        assert_eq!(calls(&s), vec![Call::Launch, Call::GraphLaunch]);
        assert_eq!(s.tickets().submitted, 2);
        assert_eq!(s.stats().snapshot().submits, 2);
        let b = s.driver.batches.lock()[0].clone();
        assert_eq!(b.n, 3);
        let items = &b.items[..3];
        assert_eq!(
            items,
            &[
                BatchItem {
                    dst: 0x1000,
                    src: 0,
                    len: 3,
                    at: 0
                },
                BatchItem {
                    dst: 0x2000,
                    src: 0,
                    len: 32,
                    at: 16
                },
                BatchItem {
                    dst: 0x3000,
                    src: 0x1000,
                    len: 4,
                    at: 48
                },
            ]
        );
        assert_eq!(&b.data[..3], &[1, 2, 3]);
        assert_eq!(&b.data[16..48], &[7u8; 32]);
        // The next enqueue finds nothing pending.
        s.graph_launch(&()).unwrap();
        assert_eq!(calls(&s).len(), 3);
    }

    #[test]
    fn every_wait_and_lend_launches_the_pending_batch_first() {
        let s = batched();
        s.defer_htod(0x1000, &[1]).unwrap();
        s.synchronize().unwrap();
        assert_eq!(calls(&s), vec![Call::Launch, Call::StreamSynchronize]);
        assert_eq!(
            s.stats().snapshot().elided_syncs,
            0,
            "the batch is work to wait for"
        );
        s.defer_htod(0x1000, &[1]).unwrap();
        s.wait_event_host(&3, 1).unwrap();
        assert_eq!(calls(&s)[2], Call::Launch);
        s.defer_htod(0x1000, &[1]).unwrap();
        s.lend(Counted::NotASubmit, |_| ()).unwrap();
        assert_eq!(
            calls(&s)[calls(&s).len() - 2..],
            [Call::Launch, Call::RawStream]
        );
        s.defer_htod(0x1000, &[1]).unwrap();
        s.begin_capture().unwrap();
        assert_eq!(
            calls(&s)[calls(&s).len() - 2..],
            [Call::Launch, Call::BeginCapture]
        );
        assert!(
            !s.defer_htod(0x1000, &[1]).unwrap(),
            "nothing is deferred into a capture"
        );
        s.end_capture().unwrap();
    }

    #[test]
    fn a_full_batch_is_launched_and_a_new_one_started() {
        let s = batched();
        for k in 0..BATCH_ITEMS {
            assert!(s.defer_htod(0x1000 * k as u64, &[k as u8; 8]).unwrap());
        }
        assert!(calls(&s).is_empty());
        assert!(s.defer_htod(0x9000, &[9; 8]).unwrap());
        assert_eq!(
            calls(&s),
            vec![Call::Launch],
            "the ninth copy launched the first eight"
        );
        // Data: two copies of 2,000 bytes do not fit one batch's 3,840.
        s.synchronize().unwrap();
        assert!(s.defer_htod(0, &vec![1u8; 2000]).unwrap());
        assert!(s.defer_htod(0, &vec![2u8; 2000]).unwrap());
        let n = calls(&s).iter().filter(|c| **c == Call::Launch).count();
        assert_eq!(n, 3);
        s.synchronize().unwrap();
        let b = s.driver.batches.lock();
        assert_eq!(b.iter().map(|b| b.n).collect::<Vec<_>>(), vec![8, 1, 1, 1]);
    }

    #[test]
    fn a_read_rides_in_the_batch_and_its_wait_is_on_the_read_event() {
        let s = batched();
        let mut out = [0u8; 4];
        let t = unsafe { s.defer_dtoh(out.as_mut_ptr(), 0x5000, 4) }
            .unwrap()
            .unwrap();
        assert!(s.defer_htod(0x1000, &[1; 8]).unwrap());
        assert!(s.defer_dtod(0x2000, 0x5000, 4).unwrap());
        assert_eq!(
            t, 2,
            "the batch's launch takes ticket 1, its read event ticket 2"
        );
        assert!(calls(&s).is_empty());
        let st = s.stats().snapshot();
        assert_eq!(
            (st.d2h_copies, st.d2h_bytes, st.h2d_copies, st.d2d_copies),
            (1, 4, 1, 1)
        );
        s.graph_launch(&()).unwrap();
        assert_eq!(
            calls(&s),
            vec![Call::Launch, Call::EventRecord(9), Call::GraphLaunch]
        );
        assert_eq!(s.tickets().submitted, 3);
        let b = s.driver.batches.lock()[0].clone();
        assert_eq!(b.n, 3);
        assert_eq!(
            b.items[0],
            BatchItem {
                dst: out.as_mut_ptr() as u64,
                src: 0x5000,
                len: 4,
                at: 0
            }
        );
        // The wait: one host wait on the read event, observing the read's ticket only (the
        // graph after it is still outstanding).
        s.wait_read(t).unwrap();
        assert_eq!(calls(&s)[3], Call::EventSynchronize(9));
        assert_eq!(s.tickets().observed, 2);
        let st = s.stats().snapshot();
        assert_eq!(
            (st.host_waits, st.submits),
            (1, 2),
            "the batch and the graph"
        );
        s.wait_read(t).unwrap();
        assert_eq!(
            s.stats().snapshot().elided_syncs,
            1,
            "a covered read is not waited again"
        );
        s.synchronize().unwrap();
        assert_eq!(calls(&s).last(), Some(&Call::StreamSynchronize));
    }

    #[test]
    fn waiting_or_polling_a_pending_read_launches_its_batch_first() {
        let s = batched();
        let mut out = [0u8; 4];
        let t = unsafe { s.defer_dtoh(out.as_mut_ptr(), 0x5000, 4) }
            .unwrap()
            .unwrap();
        assert!(!s.read_done(t).unwrap(), "the fake's events never complete");
        assert_eq!(
            calls(&s),
            vec![Call::Launch, Call::EventRecord(9), Call::EventQuery(9)]
        );
        let t2 = unsafe { s.defer_dtoh(out.as_mut_ptr(), 0x6000, 4) }
            .unwrap()
            .unwrap();
        assert_eq!(t2, 4);
        s.wait_read(t2).unwrap();
        assert_eq!(
            calls(&s)[3..],
            [
                Call::Launch,
                Call::EventRecord(9),
                Call::EventSynchronize(9)
            ]
        );
        assert_eq!(s.tickets().observed, 4);
        // Without a read event, reads are not batched.
        let plain = stream(single());
        plain.enable_batch((), None);
        assert_eq!(
            unsafe { plain.defer_dtoh(out.as_mut_ptr(), 0x5000, 4) }.unwrap(),
            None
        );
        assert_eq!(plain.stats().snapshot().d2h_copies, 0);
    }

    #[test]
    fn copies_a_batch_cannot_take_are_left_to_the_caller() {
        let off = stream(single());
        assert!(
            !off.defer_htod(0x1000, &[1]).unwrap(),
            "batching not enabled"
        );
        let s = batched();
        assert!(!s.defer_htod(0x1000, &vec![0u8; BATCH_DATA + 1]).unwrap());
        assert!(!s.defer_htod(0x1000, &[]).unwrap());
        assert!(!s.defer_dtod(0x1000, 0, 4).unwrap(), "a null source");
        assert!(calls(&s).is_empty());
        assert_eq!(s.stats().snapshot().h2d_copies, 0);
    }

    #[test]
    fn lend_hands_out_the_stream_only_inside_the_call() {
        let s = stream(single());
        let got = s.lend(Counted::NotASubmit, |raw| raw.as_raw()).unwrap();
        assert_eq!(got, 7);
        assert_eq!(s.tickets().submitted, 1);
        assert_eq!(s.stats().snapshot().submits, 0);
    }
}
