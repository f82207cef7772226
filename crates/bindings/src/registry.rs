//! The backend registry: names of ARCHITECTURE §2 to backend instances.
//!
//! `cuda` and `vulkan` are always known names: built with the `cuda` / `vulkan` features they
//! open the device at run time (libraries are loaded dynamically, so the wheel imports
//! anywhere); without a device, or built without the feature, they report a typed
//! "unavailable" error.

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
        // `cpu-async:N`: more host "devices", each with its own stream thread (the stand-ins
        // for several GPUs in tests of placement across devices).
        if i.parse::<u32>().is_err() || !matches!(base, "cuda" | "vulkan" | "cpu-async") {
            return Err(Error::UnknownBackend(name.to_string()));
        }
    }
    match base {
        "cpu" => Ok(Arc::new(CpuBackend::new())),
        "cpu-async" => Ok(Arc::new(CpuAsyncBackend::new(name)?)),
        "noop" => Ok(Arc::new(NoopBackend::new())),
        "cuda" => cuda(name),
        "vulkan" => vulkan(name),
        _ => Err(Error::UnknownBackend(name.to_string())),
    }
}

#[cfg(feature = "cuda")]
fn cuda(name: &str) -> Result<Arc<dyn Backend>> {
    lowsync_cuda::create(name)
}

/// What the CUDA backend would launch for a split's graph (fusion on), without a device.
#[cfg(feature = "cuda")]
pub fn cuda_fusion_plan(graph: &lowsync_backend::ExecGraph) -> Result<Vec<String>> {
    Ok(lowsync_cuda::fusion_plan(graph))
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_fusion_plan(_graph: &lowsync_backend::ExecGraph) -> Result<Vec<String>> {
    Err(Error::Unavailable {
        backend: "CUDA".into(),
        reason: "this build of lowsync was made without the `cuda` feature".into(),
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda(_name: &str) -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable {
        backend: "CUDA".into(),
        reason: "this build of lowsync was made without the `cuda` feature".into(),
    })
}

/// What kind of device backend `name` runs on: `"cpu"` for the host backends, `"gpu"` for
/// CUDA, and for Vulkan the physical device's type (`"cpu"` for a software rasteriser such as
/// lavapipe, `"discrete_gpu"`, `"integrated_gpu"`, `"virtual_gpu"`, `"other"`), read without
/// opening the device.
pub fn device_type(name: &str) -> Result<&'static str> {
    let base = name.split_once(':').map_or(name, |(b, _)| b);
    match base {
        "cpu" | "noop" if base == name => Ok("cpu"),
        "cpu-async" if base == name || make_index_ok(name) => Ok("cpu"),
        "cuda" => Ok("gpu"),
        "vulkan" => vulkan_device_type(name),
        _ => Err(Error::UnknownBackend(name.to_string())),
    }
}

/// Whether `name`'s `:N` suffix is a device index.
fn make_index_ok(name: &str) -> bool {
    name.split_once(':')
        .is_some_and(|(_, i)| i.parse::<u32>().is_ok())
}

#[cfg(feature = "vulkan")]
fn vulkan_device_type(name: &str) -> Result<&'static str> {
    lowsync_vulkan::device_type(name)
}

#[cfg(not(feature = "vulkan"))]
fn vulkan_device_type(_name: &str) -> Result<&'static str> {
    Err(Error::Unavailable {
        backend: "Vulkan".into(),
        reason: "this build of lowsync was made without the `vulkan` feature".into(),
    })
}

#[cfg(feature = "vulkan")]
fn vulkan(name: &str) -> Result<Arc<dyn Backend>> {
    lowsync_vulkan::create(name)
}

#[cfg(not(feature = "vulkan"))]
fn vulkan(_name: &str) -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable {
        backend: "Vulkan".into(),
        reason: "this build of lowsync was made without the `vulkan` feature".into(),
    })
}

/// Backends that can be created on this machine: the CPU ones, then each GPU device found.
pub fn available() -> Vec<String> {
    #[allow(unused_mut)]
    let mut out: Vec<String> = ["cpu", "cpu-async", "noop"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    #[cfg(feature = "cuda")]
    out.extend(lowsync_cuda::available_devices());
    #[cfg(feature = "vulkan")]
    out.extend(lowsync_vulkan::available_devices());
    out
}
