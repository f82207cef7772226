//! A test backend: another backend with some capabilities hidden or some ops refused; and the
//! deadlines of the tests' waits (`wait_until`, the watched test gate), shared with the CPU
//! backend's tests so that a broken ordering wait fails a test instead of hanging it.
#![allow(dead_code)]

#[path = "../../../backend-cpu/tests/common/mod.rs"]
mod deadline;
pub use deadline::{blocks_until_opened, Watched};

use lowsync_backend::{Backend, Caps};
use lowsync_graph::{DType, Op};

/// Forwards every required primitive to `inner`, advertises `caps`, and refuses the ops for
/// which `refuse` is true. Optional primitives stay at the trait's "unsupported" defaults.
pub struct Masked<B: Backend> {
    pub name: &'static str,
    pub inner: B,
    pub caps: Caps,
    pub refuse: fn(&Op) -> bool,
}

/// The required primitives every wrapper here forwards to its `inner` backend unchanged (the
/// wrapper writes `name`, `caps` and `supports_op`, and any optional primitive, itself).
macro_rules! forward_required {
    () => {
        fn device_kind(&self) -> lowsync_backend::DeviceKind {
            self.inner.device_kind()
        }
        fn buffer_type(&self) -> lowsync_backend::BufferType {
            self.inner.buffer_type()
        }
        fn stats(&self) -> &lowsync_backend::SyncStats {
            self.inner.stats()
        }
        fn alloc_buffer(
            &self,
            size: usize,
            usage: lowsync_backend::BufferUsage,
        ) -> lowsync_backend::Result<lowsync_backend::BufferId> {
            self.inner.alloc_buffer(size, usage)
        }
        fn realloc_buffer(
            &self,
            id: lowsync_backend::BufferId,
            size: usize,
        ) -> lowsync_backend::Result<()> {
            self.inner.realloc_buffer(id, size)
        }
        fn free_buffer(&self, id: lowsync_backend::BufferId) {
            self.inner.free_buffer(id)
        }
        fn buffer_size(&self, id: lowsync_backend::BufferId) -> lowsync_backend::Result<usize> {
            self.inner.buffer_size(id)
        }
        fn set_tensor(
            &self,
            dst: lowsync_backend::BufferId,
            offset: usize,
            data: &[u8],
        ) -> lowsync_backend::Result<()> {
            self.inner.set_tensor(dst, offset, data)
        }
        fn get_tensor(
            &self,
            src: lowsync_backend::BufferId,
            offset: usize,
            out: &mut [u8],
        ) -> lowsync_backend::Result<()> {
            self.inner.get_tensor(src, offset, out)
        }
        fn graph_compute_async(
            &self,
            graph: &std::sync::Arc<lowsync_backend::ExecGraph>,
        ) -> lowsync_backend::Result<()> {
            self.inner.graph_compute_async(graph)
        }
        fn synchronize(&self) -> lowsync_backend::Result<()> {
            self.inner.synchronize()
        }
    };
}
#[allow(unused_imports)] // used by some of the test crates that include this module
pub(crate) use forward_required;

impl<B: Backend> Backend for Masked<B> {
    fn name(&self) -> &str {
        self.name
    }
    fn caps(&self) -> Caps {
        self.caps
    }
    fn supports_op(&self, op: &Op, dst: DType, srcs: &[DType]) -> bool {
        !(self.refuse)(op) && self.inner.supports_op(op, dst, srcs)
    }
    forward_required!();
}
