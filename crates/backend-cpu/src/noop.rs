//! `noop`: a backend that accepts every op and runs nothing.
//!
//! Why: to measure the host's own cost per step (scheduler, bindings, Python) with no kernel
//! time in the way, the benches need a device that completes instantly but is driven and
//! counted exactly like an asynchronous one.
//!
//! Strategy: an asynchronous stream whose work is done the moment it is queued. Enqueues take a
//! ticket; a `synchronize` with outstanding tickets is one host wait and one driver sync (that
//! returns at once), otherwise it is elided — the same rules as `cpu-async`. Buffers hold no
//! memory; reads return zeros.
//!
//! Invariants: counts match `cpu-async` call for call, so host-overhead figures measured here
//! carry over.

use std::collections::HashMap;
use std::sync::Arc;

use lowsync_backend::{
    bump, Backend, BufferId, BufferType, BufferUsage, Caps, DeviceKind, Error, Event, ExecGraph,
    Readback, Result, SyncStats,
};
use lowsync_graph::{DType, Op};
use parking_lot::Mutex;

use crate::cpu::DoneEvent;

#[derive(Default)]
struct Progress {
    submitted: u64,
    completed: u64,
}

/// The counters and tickets, shared with the backend's reads.
#[derive(Default)]
struct Shared {
    stats: SyncStats,
    progress: Mutex<Progress>,
}

impl Shared {
    /// One host wait that finds everything up to `ticket` done.
    fn wait_for(&self, ticket: u64) {
        bump(&self.stats.host_waits, 1);
        bump(&self.stats.driver_syncs, 1);
        let mut p = self.progress.lock();
        p.completed = p.completed.max(ticket);
    }
}

/// The no-op backend.
pub struct NoopBackend {
    name: String,
    shared: Arc<Shared>,
    sizes: Mutex<HashMap<BufferId, usize>>,
}

/// A read of the no-op stream: zeros, counted like `cpu-async`'s (one wait, none once the
/// stream was observed past it).
struct NoopReadback {
    owner: Arc<Shared>,
    ticket: u64,
    bytes: Option<Vec<u8>>,
    len: usize,
}

impl Readback for NoopReadback {
    fn is_complete(&self) -> bool {
        true
    }
    fn wait(&mut self) -> Result<&[u8]> {
        if self.bytes.is_none() {
            if self.owner.progress.lock().completed >= self.ticket {
                bump(&self.owner.stats.elided_syncs, 1);
            } else {
                self.owner.wait_for(self.ticket);
            }
            self.bytes = Some(lowsync_backend::host_zeroed(self.len, || {
                "a read of the noop backend".into()
            })?);
        }
        Ok(self.bytes.as_deref().unwrap_or_default())
    }
}

impl NoopBackend {
    /// A new no-op stream called `noop`.
    pub fn new() -> Self {
        Self::named("noop")
    }

    /// A new no-op stream with another name (several in one context make several splits).
    pub fn named(name: &str) -> Self {
        NoopBackend {
            name: name.to_string(),
            shared: Arc::default(),
            sizes: Mutex::default(),
        }
    }

    fn enqueue(&self) -> u64 {
        let mut p = self.shared.progress.lock();
        p.submitted += 1;
        bump(&self.shared.stats.submits, 1);
        p.submitted
    }

    fn wait_all(&self) {
        let submitted = self.shared.progress.lock().submitted;
        self.shared.wait_for(submitted);
    }

    fn check(&self, id: BufferId, offset: usize, len: usize) -> Result<()> {
        let size = self.buffer_size(id)?;
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(Error::OutOfBounds {
                buffer: id.0,
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    fn count_h2d(&self, len: usize) {
        bump(&self.shared.stats.h2d_copies, 1);
        bump(&self.shared.stats.h2d_bytes, len as u64);
    }

    fn count_d2h(&self, len: usize) {
        bump(&self.shared.stats.d2h_copies, 1);
        bump(&self.shared.stats.d2h_bytes, len as u64);
    }
}

impl Backend for NoopBackend {
    fn name(&self) -> &str {
        &self.name
    }
    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Gpu
    }
    fn caps(&self) -> Caps {
        Caps {
            set_tensor_async: true,
            set_tensor_async_staged: true,
            get_tensor_async: true,
            cpy_tensor_async: false,
            events: true,
            sync_elision: true,
            graph_replay: false,
            test_gate: false,
            copy_async: true,
            read_async: true,
        }
    }
    fn buffer_type(&self) -> BufferType {
        BufferType {
            name: self.name.clone(),
            alignment: 64,
            is_host: false,
        }
    }
    fn supports_op(&self, _op: &Op, _dst: DType, _srcs: &[DType]) -> bool {
        true
    }
    fn stats(&self) -> &SyncStats {
        &self.shared.stats
    }

    fn alloc_buffer(&self, size: usize, _usage: BufferUsage) -> Result<BufferId> {
        bump(&self.shared.stats.reserves, 1);
        let id = BufferId::fresh();
        self.sizes.lock().insert(id, size);
        Ok(id)
    }
    fn realloc_buffer(&self, id: BufferId, size: usize) -> Result<()> {
        self.synchronize()?;
        let mut sizes = self.sizes.lock();
        let slot = sizes
            .get_mut(&id)
            .ok_or_else(|| Error::UnknownBuffer(id.0, self.name.clone()))?;
        *slot = size;
        bump(&self.shared.stats.reallocs, 1);
        Ok(())
    }
    fn free_buffer(&self, id: BufferId) {
        self.sizes.lock().remove(&id);
    }
    fn buffer_size(&self, id: BufferId) -> Result<usize> {
        self.sizes
            .lock()
            .get(&id)
            .copied()
            .ok_or_else(|| Error::UnknownBuffer(id.0, self.name.clone()))
    }

    fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.check(dst, offset, data.len())?;
        self.count_h2d(data.len());
        self.enqueue();
        self.wait_all();
        Ok(())
    }
    fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(src, offset, out.len())?;
        self.count_d2h(out.len());
        self.enqueue();
        self.wait_all();
        out.fill(0);
        Ok(())
    }
    unsafe fn set_tensor_async(
        &self,
        dst: BufferId,
        offset: usize,
        _data: *const u8,
        len: usize,
    ) -> Result<()> {
        self.check(dst, offset, len)?;
        self.count_h2d(len);
        self.enqueue();
        Ok(())
    }
    fn set_tensor_async_staged(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.check(dst, offset, data.len())?;
        self.count_h2d(data.len());
        self.enqueue();
        Ok(())
    }
    unsafe fn get_tensor_async(
        &self,
        src: BufferId,
        offset: usize,
        out: *mut u8,
        len: usize,
    ) -> Result<()> {
        self.check(src, offset, len)?;
        self.count_d2h(len);
        self.enqueue();
        // SAFETY: the caller keeps `out` valid until the next synchronize.
        unsafe { std::ptr::write_bytes(out, 0, len) };
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
        self.check(src, src_offset, len)?;
        self.check(dst, dst_offset, len)?;
        bump(&self.shared.stats.d2d_copies, 1);
        bump(&self.shared.stats.d2d_bytes, len as u64);
        self.enqueue();
        Ok(())
    }
    fn read_async(&self, src: BufferId, offset: usize, len: usize) -> Result<Box<dyn Readback>> {
        self.check(src, offset, len)?;
        self.count_d2h(len);
        let ticket = self.enqueue();
        Ok(Box::new(NoopReadback {
            owner: self.shared.clone(),
            ticket,
            bytes: None,
            len,
        }))
    }

    fn graph_compute_async(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        bump(&self.shared.stats.kernel_launches, graph.nodes.len() as u64);
        self.enqueue();
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        let idle = {
            let p = self.shared.progress.lock();
            p.completed == p.submitted
        };
        if idle {
            bump(&self.shared.stats.elided_syncs, 1);
        } else {
            self.wait_all();
        }
        Ok(())
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Ok(Arc::new(DoneEvent))
    }
    fn event_record(&self, _ev: &Arc<dyn Event>) -> Result<()> {
        Ok(())
    }
    fn event_wait(&self, _ev: &Arc<dyn Event>) -> Result<()> {
        Ok(())
    }
}

impl Default for NoopBackend {
    fn default() -> Self {
        Self::new()
    }
}
