//! Kernel tests: every op against a straightforward f64 reference (NMSE bounds per input
//! dtype, see [`harness::tol`]), plus the contract every kernel shares (empty tensors,
//! determinism, errors instead of panics).
//!
//! Nodes run over [`harness::TestMem`], a minimal `Mem` of owned buffers, so the tests depend
//! on nothing but the kernels and the `Mem` trait.

mod attention;
mod contract;
mod copy;
mod elementwise;
mod harness;
mod matmul;
mod quant;
mod reductions;
mod rope;
mod rows;
