//! lowsync-vulkan: the Vulkan backend (being brought up; reports "unavailable" until then).

use std::sync::Arc;

use lowsync_backend::{Backend, Error, Result};

/// Creates the backend called `name` (`vulkan` or `vulkan:N`).
pub fn create(name: &str) -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable {
        backend: "Vulkan".into(),
        reason: format!("the Vulkan backend of this build cannot open `{name}` yet"),
    })
}

/// Names of the Vulkan devices usable on this machine (`vulkan:0`, ...).
pub fn available_devices() -> Vec<String> {
    Vec::new()
}
