//! Host time per primitive (run with `--ignored --nocapture`, ideally `--release` and without
//! the validation layer: `LOWSYNC_VK_VALIDATION` is not read here, this test opens the backend
//! without validation). Prints figures; asserts nothing about speed.

mod common;

use std::sync::Arc;
use std::time::Instant;

use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode};
use lowsync_graph::{DType, Op};
use lowsync_vulkan::VkConfig;

fn per(n: usize, t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

#[test]
#[ignore = "prints host-time figures; run explicitly"]
fn host_time_per_submit_and_staged_write() {
    for no_rebar in [false, true] {
        let cfg = VkConfig {
            no_host_visible_vram: no_rebar,
            ..VkConfig::default()
        };
        let Some(b) = common::open(cfg) else { return };
        let inp = b.alloc_buffer(1024, BufferUsage::Inputs).unwrap();
        let w = b.alloc_buffer(1024, BufferUsage::Weights).unwrap();
        let out = b.alloc_buffer(1024, BufferUsage::Compute).unwrap();
        let one = common::add_graph(inp, w, out, 256);
        // A 300-node chain, decode-sized.
        let nodes: Vec<ExecNode> = (0..300)
            .map(|i| ExecNode {
                op: Op::Add,
                name: format!("n{i}"),
                dst: common::contiguous(if i % 2 == 0 { out } else { inp }, DType::F32, &[256]),
                srcs: vec![
                    common::contiguous(if i % 2 == 0 { inp } else { out }, DType::F32, &[256]),
                    common::contiguous(w, DType::F32, &[256]),
                ],
            })
            .collect();
        let chain = Arc::new(ExecGraph::new(nodes));
        for _ in 0..50 {
            b.graph_compute_async(&one).unwrap();
            b.graph_compute_async(&chain).unwrap();
        }
        b.synchronize().unwrap();
        let n = 2000;
        let t = Instant::now();
        for _ in 0..n {
            b.graph_compute_async(&one).unwrap();
            b.synchronize().unwrap();
        }
        let round_trip_us = per(n, t);
        // Host cost alone: everything below queues behind a closed gate, so the device
        // neither runs nor throttles the submitting thread.
        let gate = b.gate_close().unwrap();
        let t = Instant::now();
        for _ in 0..n {
            b.graph_compute_async(&one).unwrap();
        }
        let submit_us = per(n, t);
        let t = Instant::now();
        let bytes = [7u8; 256];
        for _ in 0..n {
            b.set_tensor_async_staged(inp, 0, &bytes).unwrap();
        }
        let staged_us = per(n, t);
        let m = 200;
        let t = Instant::now();
        for _ in 0..m {
            b.graph_compute_async(&chain).unwrap();
        }
        let chain_us = per(m, t);
        gate.open();
        b.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..n {
            b.set_tensor_async_staged(inp, 0, &bytes).unwrap();
        }
        let idle_staged_us = per(n, t);
        println!(
            "{} no_rebar={no_rebar}: submit (1-node graph) {submit_us:.1} us, submit+wait \
             {round_trip_us:.1} us, staged write behind work {staged_us:.2} us, staged write \
             on an idle stream {idle_staged_us:.2} us, 300-node graph record+submit {chain_us:.0} us",
            b.device_name()
        );
    }
}
