//! lowsync-cuda: the CUDA backend (being brought up; reports "unavailable" until then).

use std::sync::Arc;

use lowsync_backend::{Backend, Error, Result};

/// Creates the backend called `name` (`cuda` or `cuda:N`).
pub fn create(name: &str) -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable {
        backend: "CUDA".into(),
        reason: format!("the CUDA backend of this build cannot open `{name}` yet"),
    })
}

/// Names of the CUDA devices usable on this machine (`cuda:0`, ...).
pub fn available_devices() -> Vec<String> {
    Vec::new()
}
