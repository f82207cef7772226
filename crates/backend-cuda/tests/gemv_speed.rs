//! Read bandwidth of decode's matrix-vector products, per kernel setting and weight shape (the
//! llama "1b" shapes): `cargo test --release --test gemv_speed -- --ignored --nocapture` on a
//! machine with a GPU. Prints figures; asserts nothing about time (timing is not a test).
//! Each setting runs a graph of 32 back-to-back products, replayed as one CUDA graph.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::{gpu_with, Rng};
use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_cuda::{CudaConfig, DecodeGemv};
use lowsync_graph::{DType, Op};

const CHAIN: usize = 32;
const REPLAYS: usize = 20;

#[test]
#[ignore = "a bandwidth measurement for the GPU machine, not a check"]
fn decode_gemv_bandwidth_per_setting_and_shape() {
    let shapes = [
        ("q/o 2048x2048", 2048usize, 2048usize),
        ("k/v 512x2048", 512, 2048),
        ("gate/up 8192x2048", 8192, 2048),
        ("down 2048x8192", 2048, 8192),
        ("output 32000x2048", 32000, 2048),
    ];
    for (label, decode_gemv) in [
        ("shared x", DecodeGemv::SharedX),
        ("global x", DecodeGemv::GlobalX),
        ("mmv_k", DecodeGemv::Off),
    ] {
        let cfg = CudaConfig {
            decode_gemv,
            ..CudaConfig::default()
        };
        let b = gpu_with("gemv_speed", cfg);
        let mut rng = Rng::new(1);
        for (shape, n, k) in shapes {
            let wbytes = n * k * 2;
            let w = b.alloc_buffer(wbytes, BufferUsage::Weights).unwrap();
            b.set_tensor(w, 0, &common::encode(DType::F16, &rng.vec(n * k)))
                .unwrap();
            let io = b
                .alloc_buffer((k + n) * 4 + 256, BufferUsage::Compute)
                .unwrap();
            b.set_tensor(io, 0, &common::encode(DType::F32, &rng.vec(k)))
                .unwrap();
            let node = ExecNode {
                op: Op::MulMat,
                name: "gemv".into(),
                dst: TensorRef {
                    buffer: io,
                    byte_offset: (k * 4).next_multiple_of(256),
                    dtype: DType::F32,
                    shape: vec![1, n],
                    strides: vec![n, 1],
                },
                srcs: vec![
                    TensorRef {
                        buffer: io,
                        byte_offset: 0,
                        dtype: DType::F32,
                        shape: vec![1, k],
                        strides: vec![k, 1],
                    },
                    TensorRef {
                        buffer: w,
                        byte_offset: 0,
                        dtype: DType::F16,
                        shape: vec![k, n],
                        strides: vec![1, k],
                    },
                ],
            };
            let g = Arc::new(ExecGraph::new(vec![node; CHAIN]));
            for _ in 0..3 {
                b.graph_compute_async(&g).unwrap(); // eager, capture, replay
            }
            b.synchronize().unwrap();
            let t = Instant::now();
            for _ in 0..REPLAYS {
                b.graph_compute_async(&g).unwrap();
            }
            b.synchronize().unwrap();
            let s = t.elapsed().as_secs_f64();
            let per = s / (CHAIN * REPLAYS) as f64;
            println!(
                "{label:9} {shape:18} {:7.2} us/product  {:7.0} GB/s",
                per * 1e6,
                wbytes as f64 / per / 1e9
            );
            b.free_buffer(w);
            b.free_buffer(io);
        }
    }
}
