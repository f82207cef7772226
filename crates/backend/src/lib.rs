//! lowsync-backend: the Backend contract.
//!
//! Why: the scheduler must drive CPU, CUDA and Vulkan streams without knowing any of them. This
//! crate is the only thing it knows about devices: a trait with required blocking primitives,
//! optional asynchronous ones advertised by [`Caps`] (and never assumed), events, a test gate,
//! and the [`SyncStats`] every backend fills from inside its own primitives.
//!
//! Strategy: a backend is a stream of work on one device. Required: name, kind, `supports_op`,
//! buffers, blocking `set_tensor`/`get_tensor`, `graph_compute_async`, `synchronize`. Optional:
//! `set_tensor_async` (pinned caller memory valid until the next synchronize),
//! `set_tensor_async_staged` (bytes copied before return), `get_tensor_async`,
//! `cpy_tensor_async`, `copy_async` (between two buffers of one stream), `read_async` (a read
//! into memory the returned [`Readback`] owns, waited for on its own), `graph_compute_read_async`
//! (a graph and a read behind it, one submission where the backend can), `alias_weight` (a weight
//! buffer over the caller's immutable bytes, no copy), events, the test gate. A
//! default method returns `Unsupported` so a backend that lacks a capability needs no code for
//! it.
//!
//! Invariants: counters are bumped only inside the backend's primitives; a `synchronize` with
//! nothing outstanding on a backend with `sync_elision` makes no driver call (invariant 6).

pub mod env;
mod error;
mod exec;
pub mod interrupt;
mod stats;

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

pub use error::{Error, Result};
pub use exec::{BufferId, ExecGraph, ExecNode, ScratchLive, TensorRef};
use lowsync_graph::{DType, Op, WeightBytes};
pub use stats::{bump, KernelTime, StatsSnapshot, SyncStats};

/// Where a backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// What a buffer holds; backends may place usages in different memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferUsage {
    Weights,
    Compute,
    Inputs,
    Persistent,
}

/// A kind of memory. Two backends can use each other's buffers only when the types are equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferType {
    pub name: String,
    pub alignment: usize,
    /// The host can read the memory directly.
    pub is_host: bool,
}

/// Optional capabilities. A scheduler must check them; a missing one means "use the stock
/// fallback" (invariant 5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    pub set_tensor_async: bool,
    pub set_tensor_async_staged: bool,
    pub get_tensor_async: bool,
    pub cpy_tensor_async: bool,
    pub events: bool,
    pub sync_elision: bool,
    pub graph_replay: bool,
    pub test_gate: bool,
    /// [`Backend::copy_async`]: stream-ordered copies between this backend's buffers.
    pub copy_async: bool,
    /// [`Backend::read_async`]: reads waited for one by one, not by a whole-stream sync.
    pub read_async: bool,
}

/// A point in a backend's stream. Recorded by [`Backend::event_record`], waited on by another
/// stream with [`Backend::event_wait`] or by the host with [`Event::synchronize`].
pub trait Event: Send + Sync {
    /// Whether the work before the recording point has completed (never blocks).
    fn is_complete(&self) -> bool;
    /// Host wait until complete; counted on the owning backend (a host wait, or an elided
    /// sync when a wait of its host already observed the recording point).
    fn synchronize(&self) -> Result<()>;
    /// For backends that recognise their own events.
    fn as_any(&self) -> &dyn Any;
}

/// A read queued by [`Backend::read_async`]. Its bytes land in memory the read owns.
///
/// Dropping one before it completed is safe and never blocks: the backend keeps the memory
/// until the device is done with it.
pub trait Readback: Send {
    /// Whether the read completed (never blocks, never counted, never advances what the
    /// backend observed).
    fn is_complete(&self) -> bool;
    /// Waits for the read (one counted host wait, or none when the backend already observed
    /// its completion) and returns its bytes.
    fn wait(&mut self) -> Result<&[u8]>;
}

/// The test gate: work queued on the stream after [`Backend::gate_close`] waits until
/// [`Gate::open`]. Used by ordering tests instead of sleeps.
pub trait Gate: Send + Sync {
    /// Lets the stream continue. Idempotent.
    fn open(&self);
}

/// Runs `f` on `len` bytes at `offset` of `src` when `src_backend` is the synchronous host and
/// can lend its memory (the one case `cpy_tensor_async` implementations take a host source:
/// its producer has already returned). Returns `Ok(None)` when the source is not host memory,
/// an `OutOfBounds` error when the range does not fit. `f` must copy the bytes before it
/// returns (staging them), so the host may reuse the source at once (invariant 3).
pub fn with_host_source<R>(
    src_backend: &dyn Backend,
    src: BufferId,
    offset: usize,
    len: usize,
    f: impl FnOnce(&[u8]) -> Result<R>,
) -> Result<Option<R>> {
    if !src_backend.buffer_type().is_host || src_backend.device_kind() != DeviceKind::Cpu {
        return Ok(None);
    }
    let Some(base) = src_backend.buffer_host_ptr(src) else {
        return Ok(None);
    };
    let size = src_backend.buffer_size(src)?;
    if offset.checked_add(len).is_none_or(|e| e > size) {
        return Err(Error::OutOfBounds {
            buffer: src.0,
            offset,
            len,
            size,
        });
    }
    // SAFETY: in bounds of the host buffer (checked above); its backend is synchronous, so the
    // memory is not written while `f` runs.
    let data = unsafe { std::slice::from_raw_parts(base.as_ptr().add(offset), len) };
    f(data).map(Some)
}

/// A zeroed host vector of `len` bytes, or [`Error::OutOfMemory`] naming `what` and the size
/// when the allocator cannot provide it. Every host allocation sized by user data goes through
/// this, because `vec![0; n]` aborts the process when `n` bytes are not available (invariant
/// 14: a clear error, never a crash).
pub fn host_zeroed(len: usize, what: impl FnOnce() -> String) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    if len > isize::MAX as usize || v.try_reserve_exact(len).is_err() {
        return Err(Error::OutOfMemory {
            device: "host".into(),
            what: what(),
            bytes: len,
        });
    }
    v.resize(len, 0);
    Ok(v)
}

fn unsupported<T>(backend: &str, what: &str) -> Result<T> {
    Err(Error::Unsupported {
        backend: backend.to_string(),
        what: what.to_string(),
    })
}

/// A stream of work on one device (ARCHITECTURE §3).
pub trait Backend: Send + Sync {
    /// The registry name (`cpu`, `cpu-async`, `cuda:0`, ...).
    fn name(&self) -> &str;
    fn device_kind(&self) -> DeviceKind;
    fn caps(&self) -> Caps;
    fn buffer_type(&self) -> BufferType;
    /// Whether the backend runs `op` with these destination and source dtypes.
    fn supports_op(&self, op: &Op, dst: DType, srcs: &[DType]) -> bool;
    /// The live counters.
    fn stats(&self) -> &SyncStats;
    /// This backend as `Any`, for a backend that copies from another of its own kind directly
    /// (`cpy_tensor_async` between two devices); None (the default) where none does.
    fn as_any_backend(&self) -> Option<&dyn Any> {
        None
    }

    /// Allocates `size` bytes (zeroed) of this backend's buffer type. Counts a reserve.
    fn alloc_buffer(&self, size: usize, usage: BufferUsage) -> Result<BufferId>;
    /// Grows or shrinks a buffer, contents lost. Counts a realloc. Waits for queued work first.
    fn realloc_buffer(&self, id: BufferId, size: usize) -> Result<()>;
    /// Frees a buffer after queued work that uses it completed.
    fn free_buffer(&self, id: BufferId);
    /// Size of a buffer.
    fn buffer_size(&self, id: BufferId) -> Result<usize>;
    /// Host address of a host buffer (`buffer_type().is_host`), for zero-copy reads by others.
    fn buffer_host_ptr(&self, _id: BufferId) -> Option<NonNull<u8>> {
        None
    }
    /// A read-only buffer of a weight that reads `bytes` in place instead of a copy (host
    /// backends: the weights of a memory-mapped file stay the file's pages). The buffer keeps
    /// a clone of `bytes` until it is freed; writing it is an error. Counts a reserve and no
    /// copy. `Ok(None)`: this backend does not alias these bytes; the caller allocates a
    /// buffer and writes them with `set_tensor` (the default).
    fn alias_weight(&self, _bytes: &WeightBytes) -> Result<Option<BufferId>> {
        Ok(None)
    }

    /// Blocking write, ordered after queued work (one host wait where the device is async).
    fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()>;
    /// Blocking read, ordered after queued work (one host wait where the device is async).
    fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()>;

    /// Queues a write that reads `data` when it runs.
    ///
    /// # Safety
    /// `data..data+len` must stay valid and unchanged until the next `synchronize` returns.
    unsafe fn set_tensor_async(
        &self,
        _dst: BufferId,
        _offset: usize,
        _data: *const u8,
        _len: usize,
    ) -> Result<()> {
        unsupported(self.name(), "set_tensor_async")
    }
    /// Copies `data` before returning and queues its write after all queued work (invariant 1).
    fn set_tensor_async_staged(&self, _dst: BufferId, _offset: usize, _data: &[u8]) -> Result<()> {
        unsupported(self.name(), "set_tensor_async_staged")
    }
    /// Queues a read into caller memory, valid after the next `synchronize`.
    ///
    /// # Safety
    /// `out..out+len` must stay valid and untouched until the next `synchronize` returns.
    unsafe fn get_tensor_async(
        &self,
        _src: BufferId,
        _offset: usize,
        _out: *mut u8,
        _len: usize,
    ) -> Result<()> {
        unsupported(self.name(), "get_tensor_async")
    }
    /// Whether [`Backend::cpy_tensor_async`] from `src` is a copy between the two devices
    /// ordered on their streams, with no host wait (a peer copy): what a device-side feed from
    /// another device's output needs. False (the default) where it is not known to be.
    fn copies_from(&self, _src: &dyn Backend) -> bool {
        false
    }
    /// Copies `len` bytes from `src_backend`'s buffer into this backend's, ordered after work
    /// queued on the source, with this stream waiting for it. `Ok(false)`: not supported for
    /// this pair, use the fallback (sync both, blocking copy).
    fn cpy_tensor_async(
        &self,
        _src_backend: &dyn Backend,
        _src: BufferId,
        _src_offset: usize,
        _dst: BufferId,
        _dst_offset: usize,
        _len: usize,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Queues a copy of `len` bytes from `src` to `dst`, both buffers of this backend, in
    /// stream order: after the work queued before it, before the work queued after it. The
    /// ranges must not overlap. Counted as a device-to-device copy.
    fn copy_async(
        &self,
        _src: BufferId,
        _src_offset: usize,
        _dst: BufferId,
        _dst_offset: usize,
        _len: usize,
    ) -> Result<()> {
        unsupported(self.name(), "copy_async")
    }
    /// Queues a read of `len` bytes at `offset` of `src` at the current end of the stream.
    /// Unlike `get_tensor_async`, the bytes are ready when this one read is (not at the next
    /// `synchronize`), so the host can queue more work before it waits for them.
    fn read_async(&self, _src: BufferId, _offset: usize, _len: usize) -> Result<Box<dyn Readback>> {
        unsupported(self.name(), "read_async")
    }

    /// Queues a graph. Errors of kernels that run later surface at the next wait.
    fn graph_compute_async(&self, graph: &Arc<ExecGraph>) -> Result<()>;
    /// Queues a graph and then a read of `len` bytes at `offset` of `src` behind it, as
    /// `graph_compute_async` followed by `read_async` (the default, which needs `read_async`).
    /// A backend may put the read's copy at the end of the graph's own submission, so a decode
    /// step and its token's read are one submission.
    fn graph_compute_read_async(
        &self,
        graph: &Arc<ExecGraph>,
        src: BufferId,
        offset: usize,
        len: usize,
    ) -> Result<Box<dyn Readback>> {
        self.graph_compute_async(graph)?;
        self.read_async(src, offset, len)
    }
    /// Waits until all queued work completed (or returns at once if nothing is outstanding and
    /// the backend elides syncs).
    fn synchronize(&self) -> Result<()>;

    /// A new event of this backend.
    fn event_new(&self) -> Result<Arc<dyn Event>> {
        unsupported(self.name(), "events")
    }
    /// Records `ev` at the current end of this stream.
    fn event_record(&self, _ev: &Arc<dyn Event>) -> Result<()> {
        unsupported(self.name(), "events")
    }
    /// Orders later work of this stream after `ev`.
    ///
    /// An event this stream's device can wait on (its own kind's) is a device-side wait,
    /// counted as one `device_waits` whether or not it completed (none for this stream's own
    /// events: stream order). Any other event is waited for by the host at the call through
    /// `ev.synchronize()`, counted by the event's backend — once per call, never skipped
    /// because `is_complete` said so, so counts never depend on timing.
    fn event_wait(&self, _ev: &Arc<dyn Event>) -> Result<()> {
        unsupported(self.name(), "events")
    }

    /// Queues a closed gate: later work on this stream waits until it is opened.
    fn gate_close(&self) -> Result<Arc<dyn Gate>> {
        unsupported(self.name(), "the test gate")
    }

    /// Device time per kernel variant over the steps that completed since the last
    /// [`Backend::reset_kernel_times`], for a backend asked to profile its dispatches (Vulkan
    /// with `LOWSYNC_VK_PROFILE=1`); empty (the default) for every other backend.
    fn kernel_times(&self) -> Vec<KernelTime> {
        Vec::new()
    }
    /// Forgets the figures [`Backend::kernel_times`] returns.
    fn reset_kernel_times(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_zeroed_refuses_what_the_allocator_cannot_give() {
        assert_eq!(host_zeroed(3, || "x".into()).unwrap(), vec![0u8; 3]);
        let e = host_zeroed(usize::MAX / 2, || "the pack".into()).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("out of host memory") && m.contains("the pack"),
            "{m}"
        );
    }
}
