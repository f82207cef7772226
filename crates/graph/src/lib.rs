//! lowsync-graph: the tensor/op IR shared by the scheduler and every backend.
//!
//! Shapes are in numpy order (row-major, last axis fastest). A graph is built node by node;
//! each builder call validates shapes and dtypes and reports the op and the shapes on error.

mod bytes;
mod dtype;
mod error;
mod graph;
mod layout;
mod op;
pub mod sampling;

pub use bytes::{BorrowedBytes, WeightBytes};
pub use dtype::DType;
pub use error::{Error, Result};
pub use graph::{mul_mat_batch, Graph, TensorId, TensorInfo, WeightData};
pub use layout::{
    broadcast_shapes, contiguous_strides, quant_block_axis, quant_layout_ok, shape_bytes,
    tensor_bytes, Layout,
};
pub use op::{Op, RopeMode};
