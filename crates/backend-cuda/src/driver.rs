//! The real [`Driver`]: cudarc's driver API around one `CUstream` of one primary context.
//!
//! Why: the ticket logic is generic so that CI can test it against a fake; this is the only
//! implementation that reaches the GPU. It is deliberately thin — one driver call per method —
//! so the counters in [`crate::tickets`] count real calls.
//!
//! Strategy: the stream is created non-blocking (no implicit ordering with the legacy default
//! stream); events are created with `CU_EVENT_DISABLE_TIMING` (cheaper record and wait). Raw
//! handles are wrapped in `Send + Sync` newtypes: the driver API is thread-safe, and the owner
//! (the backend) binds its context to the calling thread before any call.
//!
//! Invariant: nothing here enqueues except through [`crate::tickets::TicketStream`], which
//! owns the `CuDriver`.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result::DriverError;
use cudarc::driver::{result, sys, CudaContext};

use crate::tickets::{Driver, LaunchDims};

/// A CUDA event created without timing.
pub(crate) struct CuEvent(pub(crate) sys::CUevent);
// SAFETY: a CUevent is an opaque handle usable from any thread of the process.
unsafe impl Send for CuEvent {}
unsafe impl Sync for CuEvent {}

impl CuEvent {
    pub(crate) fn new() -> Result<Self, DriverError> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map(CuEvent)
    }
}

impl Drop for CuEvent {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once. A pending record is fine: the driver
        // releases the event once it completed.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// A loaded kernel.
#[derive(Clone, Copy)]
pub(crate) struct CuFunction(pub(crate) sys::CUfunction);
// SAFETY: an opaque handle, valid while its module is loaded (the module cache outlives it).
unsafe impl Send for CuFunction {}
unsafe impl Sync for CuFunction {}

/// An instantiated CUDA graph.
pub(crate) struct CuGraphExec(pub(crate) sys::CUgraphExec);
// SAFETY: an opaque handle; launches are serialised by the ticket lock.
unsafe impl Send for CuGraphExec {}
unsafe impl Sync for CuGraphExec {}

impl Drop for CuGraphExec {
    fn drop(&mut self) {
        // SAFETY: instantiated once by `end_capture`, destroyed once. A launch still in flight
        // completes first: the driver frees an executing graph when it finishes.
        let _ = unsafe { sys::cuGraphExecDestroy(self.0) };
    }
}

/// A CUDA event that records timestamps (for `LOWSYNC_CUDA_TIMING`).
pub(crate) struct CuTimedEvent(pub(crate) CuEvent);

impl CuTimedEvent {
    pub(crate) fn new() -> Result<Self, DriverError> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map(|e| CuTimedEvent(CuEvent(e)))
    }

    /// Milliseconds from `start` to `self` (both completed).
    pub(crate) fn elapsed_since(&self, start: &CuTimedEvent) -> Result<f32, DriverError> {
        let mut ms = 0f32;
        // SAFETY: both events are live and were recorded on the same stream.
        unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.0 .0, self.0 .0).result()? };
        Ok(ms)
    }
}

/// A context handle for peer copies.
#[derive(Clone, Copy)]
pub(crate) struct CuCtx(pub(crate) sys::CUcontext);

/// One stream of one context.
pub(crate) struct CuDriver {
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
}

// SAFETY: the stream handle is used through the thread-safe driver API only.
unsafe impl Send for CuDriver {}
unsafe impl Sync for CuDriver {}

impl CuDriver {
    /// A new non-blocking stream on `ctx` (bound to this thread by the caller).
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Result<Self, DriverError> {
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        Ok(CuDriver { ctx, stream })
    }
}

impl Drop for CuDriver {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created in `new`; the owner synchronized before dropping.
        let _ = unsafe { result::stream::destroy(self.stream) };
    }
}

impl Driver for CuDriver {
    type Error = DriverError;
    type Event = CuEvent;
    type Function = CuFunction;
    type GraphExec = CuGraphExec;
    type RawStream = sys::CUstream;
    type Context = CuCtx;

    unsafe fn launch(
        &self,
        f: CuFunction,
        dims: LaunchDims,
        params: &mut [*mut c_void],
    ) -> Result<(), DriverError> {
        if !dims.pdl {
            return result::launch_kernel(
                f.0,
                dims.grid,
                dims.block,
                dims.shared_bytes,
                self.stream,
                params,
            );
        }
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: std::mem::zeroed(),
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: dims.grid.0,
            gridDimY: dims.grid.1,
            gridDimZ: dims.grid.2,
            blockDimX: dims.block.0,
            blockDimY: dims.block.1,
            blockDimZ: dims.block.2,
            sharedMemBytes: dims.shared_bytes,
            hStream: self.stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(&config, f.0, params.as_mut_ptr(), std::ptr::null_mut()).result()
    }
    unsafe fn memcpy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<(), DriverError> {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.stream).result()
    }
    unsafe fn memcpy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), DriverError> {
        sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream).result()
    }
    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<(), DriverError> {
        sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream).result()
    }
    unsafe fn memcpy_peer(
        &self,
        dst: u64,
        dst_ctx: CuCtx,
        src: u64,
        src_ctx: CuCtx,
        len: usize,
    ) -> Result<(), DriverError> {
        sys::cuMemcpyPeerAsync(dst, dst_ctx.0, src, src_ctx.0, len, self.stream).result()
    }
    unsafe fn memset_d8(&self, dst: u64, value: u8, len: usize) -> Result<(), DriverError> {
        sys::cuMemsetD8Async(dst, value, len, self.stream).result()
    }
    unsafe fn malloc_async(&self, len: usize) -> Result<u64, DriverError> {
        result::malloc_async(self.stream, len)
    }
    unsafe fn free_async(&self, ptr: u64) -> Result<(), DriverError> {
        result::free_async(ptr, self.stream)
    }
    fn event_record(&self, ev: &CuEvent) -> Result<(), DriverError> {
        // SAFETY: both handles are live.
        unsafe { sys::cuEventRecord(ev.0, self.stream).result() }
    }
    fn stream_wait_event(&self, ev: &CuEvent) -> Result<(), DriverError> {
        // SAFETY: both handles are live; flags 0 is the only defined value.
        unsafe { sys::cuStreamWaitEvent(self.stream, ev.0, 0).result() }
    }
    unsafe fn stream_wait_value32(&self, addr: u64, value: u32) -> Result<(), DriverError> {
        sys::cuStreamWaitValue32_v2(
            self.stream,
            addr,
            value,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
        .result()
    }
    fn graph_launch(&self, exec: &CuGraphExec) -> Result<(), DriverError> {
        // SAFETY: both handles are live.
        unsafe { sys::cuGraphLaunch(exec.0, self.stream).result() }
    }
    fn begin_capture(&self) -> Result<(), DriverError> {
        // SAFETY: the stream is live. Thread-local mode: only unsafe calls made by this thread
        // (the one queueing the graph) break the capture; other threads are not affected.
        unsafe {
            sys::cuStreamBeginCapture_v2(
                self.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .result()
        }
    }
    fn end_capture(&self) -> Result<CuGraphExec, DriverError> {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (begin_capture succeeded); ending an invalidated
        // capture returns an error and no graph.
        unsafe { sys::cuStreamEndCapture(self.stream, &mut graph).result()? };
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is the captured graph; it is destroyed once instantiated (the
        // executable graph keeps its own copy).
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0).result() };
        // SAFETY: created by the capture above, destroyed once.
        let _ = unsafe { sys::cuGraphDestroy(graph) };
        r.map(|_| CuGraphExec(exec))
    }
    fn raw_stream(&self) -> sys::CUstream {
        self.stream
    }
    fn stream_synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: the stream is live.
        unsafe { sys::cuStreamSynchronize(self.stream).result() }
    }
    fn event_synchronize(&self, ev: &CuEvent) -> Result<(), DriverError> {
        // SAFETY: the event is live.
        unsafe { sys::cuEventSynchronize(ev.0).result() }
    }
    fn event_query(&self, ev: &CuEvent) -> Result<bool, DriverError> {
        // SAFETY: the event is live.
        match unsafe { sys::cuEventQuery(ev.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(DriverError(e)),
        }
    }
}
