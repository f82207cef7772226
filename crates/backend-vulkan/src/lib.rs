//! lowsync-vulkan: the Vulkan backend (ash + gpu-allocator, WGSL kernels compiled by naga).
//!
//! Why: lowsync's Vulkan half of S1 — staged input writes without host waits, the fence riding
//! on the last compute submission instead of an empty submit, and a transfer route used only
//! above a measured crossover — on any Vulkan 1.2 device, CI's lavapipe included.
//!
//! Strategy: [`create`] reads [`VkConfig`] from the environment (ARCHITECTURE §8) and opens
//! [`VulkanBackend`]; tests build a `VkConfig` and call [`VulkanBackend::new`] so both memory
//! paths run in one process. Modules, each importing only those listed before it:
//! `config` (settings), `device` (instance, queues, validation sink, command pools),
//! `timeline` (timeline semaphores and retire points), `memory` (buffers,
//! staging/readback/scratch arenas), `pipelines` (kernel variants, push constants,
//! descriptor-set cache), `ops` (node → dispatch planning and checks, one module per kernel
//! family), `plan` (graph plans as data, hazard tracking), `profile` (per-dispatch device
//! time, `LOWSYNC_VK_PROFILE`), `transfer` (the transfer route:
//! crossover calibration, routing, its submissions), `stream` (open command buffer,
//! timelines, reclaiming), `sync` (the shared core and its host waits), `events` (events,
//! readbacks, the test gate), `io` (host writes and reads), `exec` (graph planning, recording
//! and replay), `backend` (the contract).
//!
//! Invariants (ARCHITECTURE §7): 1, 2 (staged writes copy before returning and run behind
//! queued work), 6 (idle synchronize makes no driver call), 7 (no empty submission but the
//! legacy switch's), 8 (staging reclaimed by timeline value, bounded), 9 (routing follows the
//! crossover).

mod backend;
mod config;
mod device;
mod events;
mod exec;
mod fusion;
mod io;
mod memory;
mod ops;
mod pipelines;
mod plan;
mod profile;
mod stream;
mod sync;
mod timeline;
mod transfer;

use std::sync::Arc;

pub use backend::{vulkan_supports_op, VulkanBackend, VK_QUANTS};
pub use config::{EntryPointHook, QuantMatMul, QuantMatVec, SplitK, VkConfig};
pub use events::{VkEvent, VkGate};
use lowsync_backend::{Backend, Error, Result};
pub use transfer::{Crossover, RouteSnapshot};

/// Creates the backend called `name`: `vulkan` (device `LOWSYNC_VK_DEVICE`, default 0) or
/// `vulkan:N`. A missing loader or device is `Error::Unavailable`, never a panic.
pub fn create(name: &str) -> Result<Arc<dyn Backend>> {
    let mut config = VkConfig::from_env()?;
    if let Some(idx) = device_index(name)? {
        config.device_index = idx;
    }
    Ok(Arc::new(VulkanBackend::new(name, config)?))
}

/// The device index a backend name asks for: `Some(N)` for `vulkan:N`, `None` for plain
/// `vulkan` (the configured default); any other name is `UnknownBackend`.
fn device_index(name: &str) -> Result<Option<usize>> {
    match name.strip_prefix("vulkan") {
        Some("") => Ok(None),
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|i| i.parse::<usize>().ok())
            .map(Some)
            .ok_or_else(|| Error::UnknownBackend(name.to_string())),
        None => Err(Error::UnknownBackend(name.to_string())),
    }
}

/// The kind of device the backend `name` (`vulkan`, `vulkan:N`) would run on: "cpu",
/// "discrete_gpu", "integrated_gpu", "virtual_gpu" or "other", from the device's reported
/// `VkPhysicalDeviceType`. Opens only an instance (no logical device, no calibration), so it
/// is cheap enough to ask before choosing a backend. A missing loader or device is
/// `Error::Unavailable`.
pub fn device_type(name: &str) -> Result<&'static str> {
    let idx = match device_index(name)? {
        Some(i) => i,
        None => VkConfig::from_env()?.device_index,
    };
    let inst = device::Instance::new(false)?;
    inst.device_type(idx)
}

/// Names of the Vulkan devices usable on this machine (`vulkan:0`, ...); empty when there is
/// no loader or no device.
pub fn available_devices() -> Vec<String> {
    let Ok(inst) = device::Instance::new(false) else {
        return Vec::new();
    };
    match inst.devices() {
        Ok(ds) => ds
            .iter()
            .enumerate()
            .filter(|(_, (_, usable))| usable.is_ok())
            .map(|(i, _)| format!("vulkan:{i}"))
            .collect(),
        Err(_) => Vec::new(),
    }
}
