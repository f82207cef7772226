//! Errors of compiling and running plans.

/// Errors of the scheduler; graph and backend errors pass through unchanged.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Graph(#[from] lowsync_graph::Error),
    #[error(transparent)]
    Backend(#[from] lowsync_backend::Error),
    #[error("{0}")]
    Input(String),
    #[error("no backend supports {op} (node `{node}`, dtype {dtype}, sources {srcs}); backends tried: {backends}")]
    NoBackend {
        op: &'static str,
        node: String,
        dtype: lowsync_graph::DType,
        srcs: String,
        backends: String,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("placement: {0}")]
    Placement(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("unexpected graph re-allocation: {0}")]
    Realloc(String),
    #[error("unknown sync policy `{0}` (expected stock, relaxed or staged)")]
    UnknownPolicy(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
