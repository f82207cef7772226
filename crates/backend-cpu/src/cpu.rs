//! `cpu`: the host as a backend.
//!
//! Why: user inputs start on the host, and every op needs a reference implementation that the
//! other backends are compared against (the test oracle).
//!
//! Strategy: work runs inline on the calling thread, so nothing is ever outstanding: every
//! `synchronize` is elided, events are complete once recorded, and a staged write is a memcpy.
//! Kernels are shared with `cpu-async` (`crate::kernels`).
//!
//! Invariants: counters are bumped here, in the primitive that does the work; `cpu` never
//! reports a host wait because it never blocks on a device.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use lowsync_backend::{
    bump, interrupt, Backend, BufferId, BufferType, BufferUsage, Caps, DeviceKind, Error, Event,
    ExecGraph, Result, SyncStats,
};
use lowsync_graph::{DType, Op, WeightBytes};

use crate::memory::{Store, ALIGNMENT};
use crate::run::{self, Finished, Plans};

/// The synchronous host backend.
pub struct CpuBackend {
    store: Store,
    stats: SyncStats,
    plans: Plans,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A new host backend with its own buffers.
    pub fn new() -> Self {
        CpuBackend {
            store: Store::new("cpu"),
            stats: SyncStats::default(),
            plans: Plans::default(),
        }
    }
}

/// An event of a synchronous stream: complete as soon as it is recorded.
pub struct DoneEvent;

impl Event for DoneEvent {
    fn is_complete(&self) -> bool {
        true
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Whether the CPU kernels implement `op` for these dtypes: the graph's own rule
/// ([`Op::accepts`]), which these kernels define.
pub fn cpu_supports_op(op: &Op, dst: DType, srcs: &[DType]) -> bool {
    op.accepts(dst, srcs)
}

/// Runs a graph's kernels in order (on the rayon pool), polling the interrupt hook.
fn run_graph(graph: &Arc<ExecGraph>, plans: &Plans, store: &Store) -> Result<()> {
    match run::run_graph(graph, plans, store, &interrupt::requested)? {
        Finished::Done => Ok(()),
        Finished::Stopped => Err(Error::Interrupted),
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }
    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Cpu
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
            copy_async: false,
            read_async: false,
        }
    }
    fn buffer_type(&self) -> BufferType {
        BufferType {
            name: "cpu".into(),
            alignment: ALIGNMENT,
            is_host: true,
        }
    }
    fn supports_op(&self, op: &Op, dst: DType, srcs: &[DType]) -> bool {
        cpu_supports_op(op, dst, srcs)
    }
    fn stats(&self) -> &SyncStats {
        &self.stats
    }

    fn alloc_buffer(&self, size: usize, usage: BufferUsage) -> Result<BufferId> {
        let id = self.store.alloc_for(size, usage)?;
        bump(&self.stats.reserves, 1);
        Ok(id)
    }
    fn realloc_buffer(&self, id: BufferId, size: usize) -> Result<()> {
        self.store.realloc(id, size)?;
        bump(&self.stats.reallocs, 1);
        Ok(())
    }
    fn free_buffer(&self, id: BufferId) {
        self.store.free(id)
    }
    fn buffer_size(&self, id: BufferId) -> Result<usize> {
        Ok(self.store.get(id)?.size())
    }
    fn buffer_host_ptr(&self, id: BufferId) -> Option<NonNull<u8>> {
        self.store.get(id).ok().map(|b| b.ptr())
    }
    fn alias_weight(&self, bytes: &WeightBytes) -> Result<Option<BufferId>> {
        let id = self.store.alias(bytes);
        if id.is_some() {
            bump(&self.stats.reserves, 1);
        }
        Ok(id)
    }

    fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let p = self.store.span_write(dst, offset, data.len())?;
        // SAFETY: `span` checked the bounds; the host is the only stream touching this memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        bump(&self.stats.h2d_copies, 1);
        bump(&self.stats.h2d_bytes, data.len() as u64);
        Ok(())
    }
    fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        let p = self.store.span(src, offset, out.len())?;
        // SAFETY: as in `set_tensor`.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        bump(&self.stats.d2h_copies, 1);
        bump(&self.stats.d2h_bytes, out.len() as u64);
        Ok(())
    }
    unsafe fn set_tensor_async(
        &self,
        dst: BufferId,
        offset: usize,
        data: *const u8,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller keeps `data` valid for the call (and longer).
        self.set_tensor(dst, offset, unsafe {
            std::slice::from_raw_parts(data, len)
        })
    }
    fn set_tensor_async_staged(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.set_tensor(dst, offset, data)
    }
    unsafe fn get_tensor_async(
        &self,
        src: BufferId,
        offset: usize,
        out: *mut u8,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller keeps `out` valid for the call (and longer).
        self.get_tensor(src, offset, unsafe {
            std::slice::from_raw_parts_mut(out, len)
        })
    }

    fn graph_compute_async(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        bump(&self.stats.submits, 1);
        bump(&self.stats.kernel_launches, graph.nodes.len() as u64);
        run_graph(graph, &self.plans, &self.store)
    }
    fn synchronize(&self) -> Result<()> {
        // Work ran inline: nothing is ever outstanding.
        bump(&self.stats.elided_syncs, 1);
        Ok(())
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Ok(Arc::new(DoneEvent))
    }
    fn event_record(&self, _ev: &Arc<dyn Event>) -> Result<()> {
        Ok(())
    }
    fn event_wait(&self, ev: &Arc<dyn Event>) -> Result<()> {
        // A synchronous stream can only wait on the host.
        ev.synchronize()
    }
}
