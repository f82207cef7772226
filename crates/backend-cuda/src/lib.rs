//! lowsync-cuda: the CUDA backend.
//!
//! Why: lowsync's claim — the host waits once per token, not twenty times — has to hold on the
//! device people decode on. This crate drives an NVIDIA GPU through cudarc with dynamic loading,
//! so the wheel builds, imports and runs its CPU paths on machines without CUDA, and `cuda`
//! there is a clear "CUDA unavailable: ..." error, never a panic.
//!
//! Strategy: [`create`] probes the driver library and its symbols before anything can panic
//! (`probe`), opens the device's primary context with cudarc's event tracking off, and builds
//! a [`CudaBackend`]: one stream behind the ticketed choke point of [`tickets`] (sync elision
//! by tickets, not a flag), device buffers with a reuse pool, a bounded pinned staging arena,
//! NVRTC-compiled kernels for every op (small-m matmul included: decode's matrix-vector
//! products) and cuBLAS for larger matmuls. Counters are bumped inside those primitives.
//!
//! Invariants: see [`tickets`] (6: no driver call for an idle sync), `staging` (8: bounded
//! staging, never rewritten under a pending copy), `device` and `backend` (1, 2: staged bytes
//! copied before return; one stream orders everything).

// Layers, bottom to top (a module imports only from modules above it in this list):
// config, probe, layout, copy_batch -> tickets -> driver -> memory, staging, kernels,
// graph_cache, timing -> device -> exec -> fusion -> capture -> backend.
#[cfg(test)]
mod abi;
mod backend;
mod capture;
mod config;
mod copy_batch;
mod device;
mod driver;
mod exec;
mod fusion;
mod graph_cache;
mod kernels;
mod layout;
mod memory;
mod probe;
mod staging;
pub mod tickets;
mod timing;

use std::sync::Arc;

pub use backend::{cuda_supports_op, CudaBackend, CudaEvent, CudaGate};
pub use config::{CudaConfig, DecodeGemv, TypedQ};
use lowsync_backend::{Backend, Error, Result};

/// The device ordinal of a backend name: `cuda` is 0, `cuda:N` is N.
pub fn parse_name(name: &str) -> Result<usize> {
    match name.strip_prefix("cuda") {
        Some("") => Ok(0),
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| Error::UnknownBackend(name.to_string())),
        None => Err(Error::UnknownBackend(name.to_string())),
    }
}

/// Creates the backend called `name` (`cuda` or `cuda:N`) with the settings of the
/// environment (`LOWSYNC_CUDA_SYNC_ELISION`, `LOWSYNC_CUDA_GRAPHS`, `LOWSYNC_CUDA_FUSION`,
/// `LOWSYNC_CUDA_TIMING`, `LOWSYNC_CUDA_TUNE`).
pub fn create(name: &str) -> Result<Arc<dyn Backend>> {
    let cfg = CudaConfig::from_env()?;
    create_with_config(name, cfg).map(|b| b as Arc<dyn Backend>)
}

/// Creates the backend called `name` with explicit settings (tests, benches).
pub fn create_with_config(name: &str, cfg: CudaConfig) -> Result<Arc<CudaBackend>> {
    let ordinal = parse_name(name)?;
    probe::driver().map_err(|reason| Error::Unavailable {
        backend: "CUDA".into(),
        reason,
    })?;
    let canonical = format!("cuda:{ordinal}");
    CudaBackend::open(
        if name == "cuda" { "cuda" } else { &canonical },
        ordinal,
        cfg,
    )
}

/// What the CUDA backend launches for `graph` with fusion on (default settings), worked out
/// without a device: one line per launch, `fused <kind> [<member ops>]` or the op of a node run
/// on its own. Tests and tools use it to check which of a model's nodes fuse at a given shape.
pub fn fusion_plan(graph: &lowsync_backend::ExecGraph) -> Vec<String> {
    fusion::describe(graph, &CudaConfig::default())
}

/// Names of the CUDA devices usable on this machine (`cuda:0`, ...); empty, without a panic,
/// when the driver library or a device is missing.
pub fn available_devices() -> Vec<String> {
    if probe::driver().is_err() {
        return Vec::new();
    }
    match probe::device_count() {
        Ok(n) => (0..n).map(|i| format!("cuda:{i}")).collect(),
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_ordinals() {
        assert_eq!(parse_name("cuda").unwrap(), 0);
        assert_eq!(parse_name("cuda:3").unwrap(), 3);
        for bad in ["cuda:", "cuda:x", "cud", "cuda3", "vulkan:0"] {
            assert!(
                matches!(parse_name(bad), Err(Error::UnknownBackend(_))),
                "{bad}"
            );
        }
    }
}
