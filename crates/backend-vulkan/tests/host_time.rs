//! Host time per primitive (run with `--ignored --nocapture`, ideally `--release` and without
//! the validation layer: `LOWSYNC_VK_VALIDATION` is not read here, this test opens the backend
//! without validation). Prints figures; asserts nothing about speed. A decode-sized graph is
//! queued with its plan replayed from its recording and recorded every step
//! (`LOWSYNC_VK_RECORD` on and off), one backend after the other.

mod common;

use std::sync::Arc;
use std::time::Instant;

use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode};
use lowsync_graph::{DType, Op};
use lowsync_vulkan::VkConfig;

fn per(n: usize, t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

/// CPU time of the calling thread in ns (Linux `schedstat`; `None` elsewhere): on a shared
/// machine wall time also counts the time other processes held the cores.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

#[test]
#[ignore = "prints host-time figures; run explicitly"]
fn host_time_per_submit_and_staged_write() {
    for (no_rebar, record) in [(false, true), (false, false), (true, true), (true, false)] {
        let cfg = VkConfig {
            no_host_visible_vram: no_rebar,
            record,
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
        let (t, cpu) = (Instant::now(), thread_cpu_ns());
        for _ in 0..m {
            b.graph_compute_async(&chain).unwrap();
        }
        let chain_us = per(m, t);
        let chain_cpu_us = match (cpu, thread_cpu_ns()) {
            (Some(a), Some(b)) => format!("{:.0}", (b - a) as f64 / 1e3 / m as f64),
            _ => "?".into(),
        };
        gate.open();
        b.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..n {
            b.set_tensor_async_staged(inp, 0, &bytes).unwrap();
        }
        let idle_staged_us = per(n, t);
        println!(
            "{} no_rebar={no_rebar} record={record}: submit (1-node graph) {submit_us:.1} us, submit+wait \
             {round_trip_us:.1} us, staged write behind work {staged_us:.2} us, staged write \
             on an idle stream {idle_staged_us:.2} us, 300-node graph queued {chain_us:.0} us ({chain_cpu_us} us of thread CPU time)",
            b.device_name()
        );
    }
}
