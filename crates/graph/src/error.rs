//! Errors of graph construction and validation.

/// Errors raised while building or validating a graph. Each names the op and the shapes.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum Error {
    #[error("unknown dtype `{0}` (supported: f32, f16, bf16, i32, and the block types q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs)")]
    UnknownDType(String),
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("{op}: {msg}")]
    DType { op: &'static str, msg: String },
    #[error("tensor id {0} does not belong to this graph")]
    BadTensor(u32),
    #[error(
        "duplicate name `{0}`: inputs, weights, persistent tensors and outputs need unique names"
    )]
    DuplicateName(String),
    #[error("weight `{name}`: data has {got} bytes, shape {shape:?} of {dtype} needs {want}")]
    WeightSize {
        name: String,
        shape: Vec<usize>,
        dtype: crate::DType,
        got: usize,
        want: usize,
    },
    #[error("graph has no outputs; mark at least one tensor with `output`")]
    NoOutputs,
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
