//! The backend registry: names of ARCHITECTURE §2 to backend instances.
//!
//! `cuda` and `vulkan` are known names whose backends arrive with their own issues; until then
//! (and on machines without the device) they report a typed "unavailable" error.

use std::sync::Arc;

use lowsync_backend::{Backend, Error, Result};
use lowsync_cpu::{CpuAsyncBackend, CpuBackend, NoopBackend};

/// Creates the backend called `name`.
pub fn make_backend(name: &str) -> Result<Arc<dyn Backend>> {
    let (base, index) = match name.split_once(':') {
        Some((b, i)) => (b, Some(i)),
        None => (name, None),
    };
    if let Some(i) = index {
        if i.parse::<u32>().is_err() || !matches!(base, "cuda" | "vulkan") {
            return Err(Error::UnknownBackend(name.to_string()));
        }
    }
    match base {
        "cpu" => Ok(Arc::new(CpuBackend::new())),
        "cpu-async" => Ok(Arc::new(CpuAsyncBackend::new("cpu-async")?)),
        "noop" => Ok(Arc::new(NoopBackend::new())),
        "cuda" => Err(Error::Unavailable {
            backend: "CUDA".into(),
            reason: "this build of lowsync has no CUDA backend yet".into(),
        }),
        "vulkan" => Err(Error::Unavailable {
            backend: "Vulkan".into(),
            reason: "this build of lowsync has no Vulkan backend yet".into(),
        }),
        _ => Err(Error::UnknownBackend(name.to_string())),
    }
}

/// Backends that can be created on this machine.
pub fn available() -> Vec<String> {
    ["cpu", "cpu-async", "noop"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}
