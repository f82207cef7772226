//! lowsync-cpu: the CPU backends.
pub mod kernels;
pub mod memory;
