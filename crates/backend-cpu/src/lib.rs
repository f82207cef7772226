//! lowsync-cpu: the CPU backends.
//!
//! - [`CpuBackend`] (`cpu`): the host, synchronous; user inputs start here; the test oracle.
//! - [`CpuAsyncBackend`] (`cpu-async`): a worker-thread stream with its own memory, so the
//!   scheduler's asynchronous paths are real and testable without a GPU.
//! - [`NoopBackend`] (`noop`): accepts every op, runs nothing, counts like an async device.
//!
//! All three share the kernels in [`kernels`] (f32 compute, f16/bf16 storage, GGUF block
//! types for weights; [`kernels::dequantize`] is the reference dequantization).

mod cpu;
mod cpu_async;
mod derived;
pub mod kernels;
pub mod memory;
mod noop;
mod run;

pub use cpu::{cpu_supports_op, CpuBackend, DoneEvent};
pub use cpu_async::{AsyncEvent, CpuAsyncBackend};
pub use noop::NoopBackend;
