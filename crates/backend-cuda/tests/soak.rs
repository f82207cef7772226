//! 10,000 decode-like steps: a staged input, a graph, a 4-byte read. Pinned staging stays
//! bounded (one chunk) and every step makes exactly one host wait (invariant 8); 10,000 staged
//! writes with no wait in between stay within the arena's bound. Ignored without a device.

mod common;

use std::sync::Arc;

use common::gpu_with;
use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_cuda::CudaConfig;
use lowsync_graph::{DType, Op};

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn ten_thousand_staged_steps_keep_staging_bounded_and_one_wait_per_step() {
    // Through the staging arena (a small write rides in a copy batch otherwise, and the arena
    // would stay empty).
    let cfg = CudaConfig {
        copy_kernel_max: 0,
        ..CudaConfig::default()
    };
    let b = gpu_with("soak_steps", cfg.clone());
    let buf = b.alloc_buffer(1024, BufferUsage::Compute).unwrap();
    let x = |off: usize, n: usize| TensorRef {
        buffer: buf,
        byte_offset: off,
        dtype: DType::F32,
        shape: vec![n],
        strides: vec![1],
    };
    let g = Arc::new(ExecGraph::new(vec![
        ExecNode {
            op: Op::Scale { scale: 3.0 },
            name: "y".into(),
            dst: x(256, 8),
            srcs: vec![x(0, 8)],
        },
        ExecNode {
            op: Op::Argmax,
            name: "tok".into(),
            dst: TensorRef {
                buffer: buf,
                byte_offset: 512,
                dtype: DType::I32,
                shape: vec![],
                strides: vec![],
            },
            srcs: vec![x(256, 8)],
        },
    ]));
    let mut max_staging = 0;
    for step in 0..10_000usize {
        let before = b.stats().snapshot();
        let mut v = [0f32; 8];
        v[step % 8] = 1.0 + step as f32;
        let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_ne_bytes()).collect();
        b.set_tensor_async_staged(buf, 0, &bytes).unwrap();
        b.graph_compute_async(&g).unwrap();
        let mut tok = [0u8; 4];
        b.get_tensor(buf, 512, &mut tok).unwrap();
        assert_eq!(i32::from_ne_bytes(tok) as usize, step % 8, "step {step}");
        let d = b.stats().snapshot().since(&before);
        assert_eq!(d.host_waits, 1, "step {step}: the read's wait, no other");
        assert_eq!(d.staging_bytes_in_use, 0, "step {step}: staging reclaimed");
        max_staging = max_staging.max(b.staging_bytes_allocated());
    }
    assert_eq!(
        max_staging, cfg.staging_chunk_bytes,
        "one chunk, rewound by every step's wait"
    );
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn ten_thousand_staged_writes_without_a_wait_stay_within_the_bound() {
    let cfg = CudaConfig {
        staging_chunk_bytes: 64 << 10,
        staging_max_bytes: 256 << 10,
        ..CudaConfig::default()
    };
    let b = gpu_with("soak_writes", cfg.clone());
    let buf = b.alloc_buffer(8 << 10, BufferUsage::Inputs).unwrap();
    let data: Vec<u8> = (0..(8 << 10)).map(|i| (i % 251) as u8).collect();
    for i in 0..10_000usize {
        b.set_tensor_async_staged(buf, 0, &data[..(1 + i % (8 << 10))])
            .unwrap();
        assert!(b.staging_bytes_allocated() <= cfg.staging_max_bytes);
    }
    b.synchronize().unwrap();
    let mut out = vec![0u8; 8 << 10];
    b.get_tensor(buf, 0, &mut out).unwrap();
    let last = 1 + 9_999 % (8 << 10);
    assert_eq!(&out[..last], &data[..last]);
}
