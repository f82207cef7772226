//! Shared test scaffolding: opening the backend (skip or fail when there is no device),
//! checking the validation layer stayed silent, and tensor helpers.
#![allow(dead_code)]

use lowsync_backend::{Backend, BufferId, BufferUsage, TensorRef};
use lowsync_graph::{contiguous_strides, DType};
use lowsync_vulkan::{QuantMatMul, QuantMatVec, VkConfig, VulkanBackend};

/// The default test config: validation with synchronization validation on unless
/// `LOWSYNC_VK_VALIDATION=0` (a device machine without the layer, or with one older than the
/// extensions the backend enables there), and the block mat-vec body `LOWSYNC_VK_QV` and
/// prefill layout `LOWSYNC_VK_QMM` name (the device's defaults unset), so the whole suite runs
/// under any.
pub fn config() -> VkConfig {
    VkConfig {
        validation: std::env::var("LOWSYNC_VK_VALIDATION").map_or(true, |v| v.trim() != "0"),
        quant_mat_vec: QuantMatVec::from_env().expect("LOWSYNC_VK_QV is group, block or rows"),
        quant_mat_mul: QuantMatMul::from_env().expect("LOWSYNC_VK_QMM is rows or tiles"),
        ..VkConfig::default()
    }
}

/// The no-ReBAR path.
pub fn config_no_rebar() -> VkConfig {
    VkConfig {
        no_host_visible_vram: true,
        ..config()
    }
}

/// Opens a backend, or returns `None` (printing why) when this machine has no Vulkan device;
/// with `LOWSYNC_REQUIRE_VULKAN=1` a missing device fails the test instead.
pub fn open(cfg: VkConfig) -> Option<VulkanBackend> {
    match VulkanBackend::new("vulkan", cfg) {
        Ok(b) => Some(b),
        Err(e) => {
            let required = std::env::var("LOWSYNC_REQUIRE_VULKAN").is_ok_and(|v| v.trim() == "1");
            if required {
                panic!("LOWSYNC_REQUIRE_VULKAN=1 and the Vulkan backend is unavailable: {e}");
            }
            eprintln!("skipping: {e}");
            None
        }
    }
}

/// The layer's report that its own timeline tracking fell behind: Debian 12's layers (1.3.239)
/// lose a host `vkSignalSemaphore` that races a submission waiting on it, wait 10 s for
/// their tracker and then say so ("most likely a validation bug"). The driver saw the signal and
/// the work ran; Vulkan-ValidationLayers PR 8519 (2024) rewrote that tracking and fixed it.
const LAYER_TRACKING_TIMEOUT: &str = "UNASSIGNED-VkSemaphore-state-timeout";

/// Fails when the validation layer reported anything but its own tracking timeout, which is
/// printed instead.
pub fn assert_clean(b: &VulkanBackend) {
    let (layer_bug, msgs): (Vec<String>, Vec<String>) = b
        .validation_messages()
        .into_iter()
        .partition(|m| m.contains(LAYER_TRACKING_TIMEOUT));
    for m in &layer_bug {
        eprintln!("ignored (validation-layer tracking bug, not a usage error): {m}");
    }
    assert!(
        msgs.is_empty(),
        "{} validation message(s):\n{}",
        msgs.len(),
        msgs.join("\n")
    );
}

pub fn contiguous(buffer: BufferId, dtype: DType, shape: &[usize]) -> TensorRef {
    TensorRef {
        buffer,
        byte_offset: 0,
        dtype,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn read_f32(b: &dyn Backend, id: BufferId, n: usize) -> Vec<f32> {
    let mut out = vec![0u8; n * 4];
    b.get_tensor(id, 0, &mut out).expect("read");
    out.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn buffer_with(b: &dyn Backend, bytes: &[u8]) -> BufferId {
    let id = b
        .alloc_buffer(bytes.len(), BufferUsage::Compute)
        .expect("alloc");
    b.set_tensor(id, 0, bytes).expect("write");
    id
}

/// A one-node graph.
pub fn graph(
    op: lowsync_graph::Op,
    dst: TensorRef,
    srcs: Vec<TensorRef>,
) -> std::sync::Arc<lowsync_backend::ExecGraph> {
    std::sync::Arc::new(lowsync_backend::ExecGraph::new(vec![
        lowsync_backend::ExecNode {
            op,
            name: op.name().to_string(),
            dst,
            srcs,
        },
    ]))
}

/// `dst = src` (f32, `n` elements) as a graph.
pub fn copy_graph(
    src: BufferId,
    dst: BufferId,
    n: usize,
) -> std::sync::Arc<lowsync_backend::ExecGraph> {
    graph(
        lowsync_graph::Op::Cpy,
        contiguous(dst, DType::F32, &[n]),
        vec![contiguous(src, DType::F32, &[n])],
    )
}

/// `dst = a + b` (f32, `n` elements) as a graph.
pub fn add_graph(
    a: BufferId,
    b: BufferId,
    dst: BufferId,
    n: usize,
) -> std::sync::Arc<lowsync_backend::ExecGraph> {
    graph(
        lowsync_graph::Op::Add,
        contiguous(dst, DType::F32, &[n]),
        vec![
            contiguous(a, DType::F32, &[n]),
            contiguous(b, DType::F32, &[n]),
        ],
    )
}

/// Both memory paths.
pub fn both_paths() -> [VkConfig; 2] {
    [config(), config_no_rebar()]
}

/// A contiguous view of `shape` at byte `off` of `buffer`.
pub fn t(buffer: BufferId, off: usize, dtype: DType, shape: &[usize]) -> TensorRef {
    TensorRef {
        buffer,
        byte_offset: off,
        dtype,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
    }
}

/// Deterministic values in [-2, 2].
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            (x % 2001) as f32 / 500.0 - 2.0
        })
        .collect()
}
