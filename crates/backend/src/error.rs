//! Errors of backends.

/// Errors a backend reports. Messages say what the user can do about them.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("backend `{backend}` does not support {what}")]
    Unsupported { backend: String, what: String },
    #[error("{backend} unavailable: {reason}")]
    Unavailable { backend: String, reason: String },
    #[error("unknown backend `{0}` (known: cpu, cpu-async, noop, cuda, cuda:N, vulkan, vulkan:N)")]
    UnknownBackend(String),
    #[error("buffer {0} is not owned by backend `{1}`")]
    UnknownBuffer(u64, String),
    #[error("access of {len} bytes at offset {offset} is outside buffer {buffer} of {size} bytes")]
    OutOfBounds {
        buffer: u64,
        offset: usize,
        len: usize,
        size: usize,
    },
    #[error("{op} (node `{node}`): {msg}")]
    Kernel {
        op: &'static str,
        node: String,
        msg: String,
    },
    #[error("out of {device} memory: cannot allocate {bytes} bytes for {what}")]
    OutOfMemory {
        device: String,
        what: String,
        bytes: usize,
    },
    #[error("interrupted; queued work was drained and the backend is usable")]
    Interrupted,
    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    Env {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error(transparent)]
    Graph(#[from] lowsync_graph::Error),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
