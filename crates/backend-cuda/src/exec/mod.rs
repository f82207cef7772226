//! The executor: queuing the nodes of a compute graph as kernel launches, one node at a time.
//!
//! Why: the scheduler hands a backend compute graphs of nodes; each node becomes the kernels
//! (NVRTC) or cuBLAS calls that reproduce the CPU oracle's result. Fused groups of nodes are
//! `fusion`'s; it runs every node it does not fuse through here.
//!
//! Strategy: [`launch`] holds what every launch needs (arguments, checked device addresses,
//! scratch, the launch itself); [`ops`] runs one node of any op over it; [`matmul`] maps
//! `MulMat` onto cuBLAS or the matrix-vector kernels. Imports go launch <- matmul <- ops.
//!
//! Invariant: every launch goes through `Exec::launch_shared` or a lend of the stream, so it
//! is queued on the one stream and counted there.

pub(crate) mod launch;
pub(crate) mod matmul;
pub(crate) mod ops;
