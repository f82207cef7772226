//! The fused `RmsNorm -> Mul` by the norm's weight (`LOWSYNC_VK_FUSION`, on by default): one
//! `rms_norm_mul` dispatch where the graph proves the normalised rows dead after the product,
//! bit-identical to the unfused pair for f32, f16 and bf16 weights and results, rows of 1 to
//! 300 elements, a weight broadcast onto every row; and the pair stays unfused where something
//! else reads the normalised rows or nothing is known of the scratch after the graph. Every run
//! asserts the validation layer (synchronization validation on) stayed silent.

mod common;

use common::{t, values};

use std::sync::Arc;

use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode, ScratchLive};
use lowsync_graph::{DType, Op};
use lowsync_vulkan::VkConfig;

/// Rows `rows x len` normalised and multiplied by a `[len]` weight of `wt`, into a `dt`
/// result; `live`: a later node reads the normalised rows; `known`: the graph says its scratch
/// is dead afterwards. Returns the result's bytes and whether `rms_norm_mul` ran.
fn run(
    fusion: bool,
    rows: usize,
    len: usize,
    wt: DType,
    dt: DType,
    live: bool,
    known: bool,
) -> (Vec<u8>, bool) {
    let b = common::open(VkConfig {
        fusion,
        profile: true,
        ..common::config()
    })
    .expect("a Vulkan device");
    let xb = common::buffer_with(&b, &common::f32_bytes(&values(rows * len, 1)));
    let w = values(len, 2);
    let wbytes: Vec<u8> = match wt {
        DType::F32 => common::f32_bytes(&w),
        DType::F16 => w
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => w
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
    };
    let wb = common::buffer_with(&b, &wbytes);
    let n = rows * len * 4;
    let sb = b.alloc_buffer(3 * n, BufferUsage::Compute).unwrap();
    let ob = b
        .alloc_buffer(rows * len * dt.size_bytes(), BufferUsage::Compute)
        .unwrap();
    let x = t(xb, 0, DType::F32, &[rows, len]);
    let normed = t(sb, 0, DType::F32, &[rows, len]);
    let out = t(ob, 0, dt, &[rows, len]);
    let mut nodes = vec![
        ExecNode {
            op: Op::RmsNorm { eps: 1e-5 },
            name: "norm".into(),
            dst: normed.clone(),
            srcs: vec![x],
        },
        ExecNode {
            op: Op::Mul,
            name: "norm_w".into(),
            dst: out,
            srcs: vec![normed.clone(), t(wb, 0, wt, &[len])],
        },
    ];
    if live {
        nodes.push(ExecNode {
            op: Op::Add,
            name: "reads_norm".into(),
            dst: t(sb, n, DType::F32, &[rows, len]),
            srcs: vec![normed.clone(), normed],
        });
    }
    let graph = Arc::new(ExecGraph {
        nodes,
        scratch: known.then(|| ScratchLive {
            buffer: sb,
            kept: Vec::new(),
        }),
    });
    b.graph_compute_async(&graph).unwrap();
    let mut bytes = vec![0u8; rows * len * dt.size_bytes()];
    b.get_tensor(ob, 0, &mut bytes).unwrap();
    b.synchronize().unwrap();
    let fused = b
        .kernel_times()
        .iter()
        .any(|k| k.name.starts_with("rms_norm_mul"));
    common::assert_clean(&b);
    (bytes, fused)
}

#[test]
fn fused_norm_times_weight_is_bit_identical_to_the_unfused_pair() {
    if common::open(common::config()).is_none() {
        return;
    }
    for (rows, len, wt, dt) in [
        (3, 64, DType::F32, DType::F32),
        (1, 1, DType::F32, DType::F32),
        (5, 300, DType::F16, DType::F32),
        (2, 256, DType::BF16, DType::F16),
        (4, 100, DType::F32, DType::BF16),
    ] {
        let (on, fused) = run(true, rows, len, wt, dt, false, true);
        let (off, unfused) = run(false, rows, len, wt, dt, false, true);
        assert!(fused, "{rows}x{len}: fused");
        assert!(!unfused, "LOWSYNC_VK_FUSION=0: unfused");
        assert_eq!(on, off, "{rows}x{len} {wt} -> {dt}");
    }
}

#[test]
fn a_read_norm_or_unknown_scratch_stays_unfused() {
    if common::open(common::config()).is_none() {
        return;
    }
    let (want, _) = run(false, 3, 64, DType::F32, DType::F32, false, true);
    for (live, known) in [(true, true), (false, false)] {
        let (got, fused) = run(true, 3, 64, DType::F32, DType::F32, live, known);
        assert!(!fused, "live {live} known {known}");
        assert_eq!(got, want);
    }
}
