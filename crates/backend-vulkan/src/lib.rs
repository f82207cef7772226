//! lowsync-vulkan: the Vulkan backend (ash + gpu-allocator, WGSL kernels compiled by naga).
//!
//! Why: lowsync's Vulkan half of S1 — staged input writes without host waits, the fence riding
//! on the last compute submission instead of an empty submit, and a transfer route used only
//! above a measured crossover — on any Vulkan 1.2 device, CI's lavapipe included.
//!
//! Strategy: [`create`] reads [`VkConfig`] from the environment (ARCHITECTURE §8) and opens
//! [`VulkanBackend`]; tests build a `VkConfig` and call [`VulkanBackend::new`] so both memory
//! paths run in one process. Modules: `device` (instance, queues, validation sink), `memory`
//! (buffers, staging/readback/scratch arenas), `pipelines` (kernel variants, descriptor-set
//! cache), `ops` (node → dispatch planning and checks), `stream` (open command buffer,
//! timelines, hazards, reclaiming), `calibrate` (transfer crossover), `backend` (the
//! contract).
//!
//! Invariants (ARCHITECTURE §7): 1, 2 (staged writes copy before returning and run behind
//! queued work), 6 (idle synchronize makes no driver call), 7 (no empty submission but the
//! legacy switch's), 8 (staging reclaimed by timeline value, bounded), 9 (routing follows the
//! crossover).

mod backend;
mod calibrate;
mod config;
mod device;
mod memory;
mod ops;
mod pipelines;
mod stream;

use std::sync::Arc;

pub use backend::{vulkan_supports_op, RouteSnapshot, VkEvent, VkGate, VulkanBackend};
pub use calibrate::Crossover;
pub use config::{EntryPointHook, VkConfig};
use lowsync_backend::{Backend, Error, Result};

/// Creates the backend called `name`: `vulkan` (device `LOWSYNC_VK_DEVICE`, default 0) or
/// `vulkan:N`. A missing loader or device is `Error::Unavailable`, never a panic.
pub fn create(name: &str) -> Result<Arc<dyn Backend>> {
    let mut config = VkConfig::from_env()?;
    match name.strip_prefix("vulkan") {
        Some("") => {}
        Some(rest) => {
            let idx = rest
                .strip_prefix(':')
                .and_then(|i| i.parse::<usize>().ok())
                .ok_or_else(|| Error::UnknownBackend(name.to_string()))?;
            config.device_index = idx;
        }
        None => return Err(Error::UnknownBackend(name.to_string())),
    }
    Ok(Arc::new(VulkanBackend::new(name, config)?))
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
