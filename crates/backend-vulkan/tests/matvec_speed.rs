//! Decode mat-vec timing on whatever Vulkan device is present (lavapipe here): `x @ w.T` with
//! `x` [1, K] f32 and `w` [N, K] f32/f16/bf16 or Q4_0/Q8_0/Q4_K/Q6_K blocks (random quants,
//! small scales), the shape of every projection of a decode step; and `x` [8, K] (a small
//! batch), where block weights take the multi-row kernel; and prefill products (16 to 128 rows
//! of x over the "tiny" and "small" models' projections), where they take the tiled kernel.
//! Prints milliseconds per product; asserts nothing about time (timing is not a test), only
//! that the result matches the CPU oracle. Run by hand:
//! `cargo test --release -p lowsync-vulkan --test matvec_speed -- --ignored --nocapture`.

mod common;

use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};
use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_cpu::CpuBackend;
use lowsync_graph::{DType, Op};
use lowsync_vulkan::VkConfig;

fn weights(dtype: DType, n: usize) -> (Vec<u8>, Vec<f32>) {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let vals: Vec<f32> = (0..n)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            ((rng >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let bytes = match dtype {
        q if q.is_quantized() => {
            // Every f16 field (scales, mins) small and finite; every other byte a quant or a
            // sub-block scale.
            let f16_at: &[usize] = match q {
                DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
                DType::Q2_K => &[80, 82],
                DType::Q3_K => &[108],
                DType::Q6_K => &[208],
                _ => &[0],
            };
            let blocks = n / q.block_size();
            let mut out = Vec::with_capacity(blocks * q.block_bytes());
            for (i, v) in vals.iter().take(blocks).enumerate() {
                let mut b: Vec<u8> = (0..q.block_bytes())
                    .map(|j| (i * 31 + j * 7) as u8)
                    .collect();
                for (f, &off) in f16_at.iter().enumerate() {
                    let x = if f == 0 { 0.02 * v } else { 0.01 * v };
                    b[off..off + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
                }
                out.extend(b);
            }
            out
        }
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
    };
    (bytes, vals)
}

/// Milliseconds per product of `m` rows of x (best of `reps`) and the result.
fn time(b: &dyn Backend, wd: DType, m: usize, n: usize, k: usize, reps: usize) -> (f64, Vec<f32>) {
    let (xb, _) = weights(DType::F32, m * k);
    let (wb, _) = weights(wd, n * k);
    let alloc = |bytes: &[u8]| {
        let id = b.alloc_buffer(bytes.len(), BufferUsage::Compute).unwrap();
        b.set_tensor(id, 0, bytes).unwrap();
        id
    };
    let (x, w, d) = (alloc(&xb), alloc(&wb), alloc(&vec![0u8; m * n * 4]));
    let wt = TensorRef {
        buffer: w,
        byte_offset: 0,
        dtype: wd,
        shape: vec![k, n],
        strides: vec![1, k],
    };
    let g = Arc::new(ExecGraph::new(vec![ExecNode {
        op: Op::MulMat,
        name: "mv".into(),
        dst: common::contiguous(d, DType::F32, &[m, n]),
        srcs: vec![common::contiguous(x, DType::F32, &[m, k]), wt],
    }]));
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        b.graph_compute_async(&g).unwrap();
        b.synchronize().unwrap();
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
    }
    (best, common::read_f32(b, d, m * n))
}

#[test]
#[ignore = "timing, run by hand with --nocapture"]
fn decode_mat_vec_milliseconds() {
    let Some(vk) = common::open(VkConfig::default()) else {
        return;
    };
    let Some(vk_wg) = common::open(VkConfig {
        no_subgroups: true,
        ..VkConfig::default()
    }) else {
        return;
    };
    let cpu = CpuBackend::new();
    for (m, n, k) in [
        (1usize, 256usize, 4096usize),
        (1, 4096, 4096),
        (1, 1536, 576),
        (1, 576, 1536),
        (8, 1536, 576),
        (8, 256, 4096),
    ] {
        for wd in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q4_0,
            DType::Q8_0,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            if !k.is_multiple_of(wd.block_size()) {
                continue;
            }
            let (ms, got) = time(&vk, wd, m, n, k, 5);
            let (wg_ms, _) = time(&vk_wg, wd, m, n, k, 5);
            let (cpu_ms, want) = time(&cpu, wd, m, n, k, 5);
            let err = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0.0f32, f32::max);
            let scale = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
            let err = err / scale;
            println!("{m}x{n}x{k} {wd}: vulkan {ms:.2} ms (no subgroups {wg_ms:.2}), cpu {cpu_ms:.2} ms, max |diff| / max |want| {err:.2e}");
            assert!(
                err < 1e-3,
                "{m}x{n}x{k} {wd}: max |diff| / max |want| {err}"
            );
        }
    }
}

#[test]
#[ignore = "timing, run by hand with --nocapture"]
fn prefill_product_milliseconds() {
    let Some(vk) = common::open(VkConfig::default()) else {
        return;
    };
    let cpu = CpuBackend::new();
    // (n, k): "tiny"'s q/o and gate/up and down projections, then "small"'s.
    for (n, k) in [
        (256usize, 256usize),
        (768, 256),
        (256, 768),
        (768, 768),
        (2048, 768),
        (768, 2048),
    ] {
        for m in [8usize, 16, 32, 64, 128] {
            for wd in [DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K] {
                if !k.is_multiple_of(wd.block_size()) {
                    continue;
                }
                let (ms, got) = time(&vk, wd, m, n, k, 5);
                let (_, want) = time(&cpu, wd, m, n, k, 1);
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0.0f32, f32::max);
                let err = err / want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
                println!("{m}x{n}x{k} {wd}: vulkan {ms:.2} ms, max |diff| / max |want| {err:.2e}");
                assert!(
                    err < 1e-3,
                    "{m}x{n}x{k} {wd}: max |diff| / max |want| {err}"
                );
            }
        }
    }
}
