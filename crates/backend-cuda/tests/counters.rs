//! Counters from the real calls on a CUDA device: an idle synchronize makes no driver call, a
//! staged write never waits, a blocking write or read is one host wait, elision off makes every
//! synchronize a driver call, and a decode-like step costs one host wait, one H2D and one D2H
//! copy. Ignored without a device.

mod common;

use std::sync::Arc;

use common::{gpu, gpu_with, wait_until};
use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode, StatsSnapshot, TensorRef};
use lowsync_cuda::CudaConfig;
use lowsync_graph::{DType, Op};

fn snap(b: &dyn Backend) -> StatsSnapshot {
    b.stats().snapshot()
}

fn f32_ref(buffer: lowsync_backend::BufferId, byte_offset: usize, n: usize) -> TensorRef {
    TensorRef {
        buffer,
        byte_offset,
        dtype: DType::F32,
        shape: vec![n],
        strides: vec![1],
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn idle_synchronize_is_elided_not_a_host_wait() {
    let b = gpu("idle_sync");
    assert!(b.caps().sync_elision, "one device: elision on");
    let before = snap(&*b);
    b.synchronize().unwrap();
    b.synchronize().unwrap();
    let d = snap(&*b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs, d.elided_syncs), (0, 0, 2));
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn staged_write_makes_no_host_wait_and_the_next_sync_waits_once() {
    // Through the staging arena and a copy engine (a small write rides in a batch otherwise:
    // `small_copies_run_as_kernels_land_in_order_and_count_as_copies`).
    let cfg = CudaConfig {
        copy_kernel_max: 0,
        ..CudaConfig::default()
    };
    let b = gpu_with("staged_write", cfg);
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    b.synchronize().unwrap();
    let before = snap(&*b);
    b.set_tensor_async_staged(buf, 0, &[3u8; 16]).unwrap();
    let d = snap(&*b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs), (0, 0));
    assert_eq!((d.h2d_copies, d.h2d_bytes, d.submits), (1, 16, 1));
    assert_eq!(
        d.staging_bytes_in_use, 16,
        "the write's bytes, held until a wait"
    );
    b.synchronize().unwrap();
    b.synchronize().unwrap();
    let d = snap(&*b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs, d.elided_syncs), (1, 1, 1));
    assert_eq!(d.staging_bytes_in_use, 0, "reclaimed after the wait");
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn blocking_write_and_read_are_one_host_wait_each() {
    let b = gpu("blocking_copies");
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    b.synchronize().unwrap();
    let before = snap(&*b);
    b.set_tensor(buf, 0, &[1u8; 16]).unwrap();
    let d = snap(&*b).since(&before);
    assert_eq!(
        (d.host_waits, d.driver_syncs, d.h2d_copies, d.h2d_bytes),
        (1, 1, 1, 16)
    );
    let mut out = [0u8; 16];
    b.get_tensor(buf, 0, &mut out).unwrap();
    let d = snap(&*b).since(&before);
    assert_eq!(
        (d.host_waits, d.driver_syncs, d.d2h_copies, d.d2h_bytes),
        (2, 2, 1, 16)
    );
    assert_eq!(out, [1u8; 16]);
    b.synchronize().unwrap();
    assert_eq!(
        snap(&*b).since(&before).host_waits,
        2,
        "nothing outstanding after a read"
    );
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn with_elision_off_every_synchronize_calls_the_driver() {
    let cfg = CudaConfig {
        sync_elision: false,
        ..CudaConfig::default()
    };
    let b = gpu_with("elision_off", cfg);
    assert!(!b.caps().sync_elision);
    let before = snap(&*b);
    for _ in 0..3 {
        b.synchronize().unwrap();
    }
    let d = snap(&*b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs, d.elided_syncs), (3, 3, 0));
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn event_synchronize_is_one_host_wait_and_a_covered_one_is_elided() {
    let b = gpu("event_sync");
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    b.set_tensor_async_staged(buf, 0, &[1u8; 8]).unwrap();
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    let before = snap(&*b);
    ev.synchronize().unwrap();
    assert!(ev.is_complete());
    ev.synchronize().unwrap();
    b.synchronize().unwrap(); // the event was the last thing queued
    let d = snap(&*b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs, d.elided_syncs), (1, 1, 2));
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_decode_like_step_is_one_wait_one_upload_one_readback() {
    // Eager launches (graph replay has its own test in graphs.rs).
    let cfg = CudaConfig {
        graphs: false,
        ..CudaConfig::default()
    };
    let b = gpu_with("decode_step", cfg);
    let buf = b.alloc_buffer(256, BufferUsage::Compute).unwrap();
    let g = Arc::new(ExecGraph::new(vec![
        ExecNode {
            op: Op::Scale { scale: 2.0 },
            name: "y".into(),
            dst: f32_ref(buf, 64, 4),
            srcs: vec![f32_ref(buf, 0, 4)],
        },
        ExecNode {
            op: Op::Argmax,
            name: "tok".into(),
            dst: TensorRef {
                buffer: buf,
                byte_offset: 128,
                dtype: DType::I32,
                shape: vec![],
                strides: vec![],
            },
            srcs: vec![f32_ref(buf, 64, 4)],
        },
    ]));
    // Warm up (kernel compilation, first launches).
    b.set_tensor_async_staged(buf, 0, &[0u8; 16]).unwrap();
    b.graph_compute_async(&g).unwrap();
    b.synchronize().unwrap();
    for step in 0..5u32 {
        let before = snap(&*b);
        let mut x = [0f32; 4];
        x[(step % 4) as usize] = 1.0;
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
        b.set_tensor_async_staged(buf, 0, &bytes).unwrap();
        b.graph_compute_async(&g).unwrap();
        let mut tok = [0u8; 4];
        b.get_tensor(buf, 128, &mut tok).unwrap();
        assert_eq!(i32::from_ne_bytes(tok), (step % 4) as i32);
        let d = snap(&*b).since(&before);
        assert_eq!(d.host_waits, 1, "step {step}: {d:?}");
        assert_eq!((d.h2d_copies, d.d2h_copies, d.d2h_bytes), (1, 1, 4));
        assert_eq!(d.kernel_launches, 2);
        assert_eq!(d.submits, 4, "upload, two kernels, readback");
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn small_copies_run_as_kernels_land_in_order_and_count_as_copies() {
    let cfg = CudaConfig {
        copy_kernel_max: 4096,
        ..CudaConfig::default()
    };
    let b = gpu_with("copy_kernel", cfg);
    let buf = b.alloc_buffer(16 << 10, BufferUsage::Inputs).unwrap();
    b.synchronize().unwrap();
    // Aligned (16-byte path), 4-byte aligned, and odd sizes and offsets (byte path).
    for (off, len) in [(0usize, 512usize), (1024, 12), (2051, 7)] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + off) as u8).collect();
        let before = snap(&*b);
        b.set_tensor_async_staged(buf, off, &data).unwrap();
        b.copy_async(buf, off, buf, 8192 + off, len).unwrap();
        let mut rb = b.read_async(buf, 8192 + off, len).unwrap();
        let got = rb.wait().unwrap().to_vec();
        assert_eq!(got, data, "{len} bytes at {off}");
        let d = snap(&*b).since(&before);
        assert_eq!(
            (d.h2d_copies, d.d2d_copies, d.d2h_copies, d.kernel_launches),
            (1, 1, 1, 0),
            "{d:?}"
        );
        // The write, the device copy and the read ride in one launch.
        assert_eq!((d.submits, d.host_waits), (1, 1), "{d:?}");
        assert_eq!(
            (d.h2d_bytes, d.d2d_bytes, d.d2h_bytes),
            (len as u64, len as u64, len as u64)
        );
    }
    // Two reads in flight across batches: the first is polled until it completes (its batch
    // is launched by the poll), the second waited after a later batch re-recorded the event.
    b.set_tensor_async_staged(buf, 0, &[9u8; 16]).unwrap();
    let mut first = b.read_async(buf, 0, 16).unwrap();
    wait_until("a polled read completes", || first.is_complete());
    b.set_tensor_async_staged(buf, 16, &[7u8; 16]).unwrap();
    let mut second = b.read_async(buf, 16, 16).unwrap();
    b.set_tensor_async_staged(buf, 32, &[5u8; 16]).unwrap();
    let mut third = b.read_async(buf, 32, 16).unwrap();
    assert_eq!(third.wait().unwrap(), &[5u8; 16]);
    assert_eq!(second.wait().unwrap(), &[7u8; 16]);
    assert_eq!(first.wait().unwrap(), &[9u8; 16]);
    // Longer than the limit: the copy engine, counted the same way.
    let big = vec![5u8; 4097];
    let before = snap(&*b);
    b.set_tensor_async_staged(buf, 0, &big).unwrap();
    let mut rb = b.read_async(buf, 0, big.len()).unwrap();
    assert_eq!(rb.wait().unwrap(), &big[..]);
    let d = snap(&*b).since(&before);
    assert_eq!((d.h2d_copies, d.d2h_copies, d.submits), (1, 1, 2), "{d:?}");
}
