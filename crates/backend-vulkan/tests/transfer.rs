//! The transfer route (issue point 4, invariant 9): host-computed tensors copied with
//! `cpy_tensor_async` stay in the compute stream up to the crossover and take their own
//! submissions above it (on lavapipe, forced with `force_transfer_submit`); both sides arrive
//! intact, each side is counted on its route, the route waits behind queued work and gates,
//! and a wait on transfer-only work goes through the transfer timeline.

mod common;

use lowsync_backend::{Backend, BufferUsage};
use lowsync_cpu::CpuBackend;
use lowsync_vulkan::{VkConfig, VulkanBackend};

fn forced(limit: Option<u64>, no_rebar: bool) -> VkConfig {
    VkConfig {
        force_transfer_submit: true,
        compute_stream_copy_max: limit,
        no_host_visible_vram: no_rebar,
        ..common::config()
    }
}

fn host_tensor(cpu: &CpuBackend, n: usize, seed: f32) -> (lowsync_backend::BufferId, Vec<f32>) {
    let vals: Vec<f32> = (0..n).map(|i| seed + i as f32).collect();
    let id = cpu.alloc_buffer(n * 4, BufferUsage::Compute).unwrap();
    cpu.set_tensor(id, 0, &common::f32_bytes(&vals)).unwrap();
    (id, vals)
}

/// Copies `n` floats from the host through `cpy_tensor_async`, then a graph doubles them on
/// the device; returns what the device computed.
fn round_trip(b: &VulkanBackend, cpu: &CpuBackend, n: usize) -> (Vec<f32>, Vec<f32>) {
    let (src, vals) = host_tensor(cpu, n, 0.5);
    let dst = b.alloc_buffer(n * 4, BufferUsage::Compute).unwrap();
    let out = b.alloc_buffer(n * 4, BufferUsage::Compute).unwrap();
    assert!(b.cpy_tensor_async(cpu, src, 0, dst, 0, n * 4).unwrap());
    // The host may reuse its buffer at once (invariant 3).
    cpu.set_tensor(src, 0, &vec![0u8; n * 4]).unwrap();
    b.graph_compute_async(&common::add_graph(dst, dst, out, n))
        .unwrap();
    let got = common::read_f32(b, out, n);
    (got, vals.iter().map(|v| v * 2.0).collect())
}

#[test]
fn copies_take_their_route_on_both_sides_of_a_configured_limit() {
    for no_rebar in [false, true] {
        let Some(b) = common::open(forced(Some(4096), no_rebar)) else {
            return;
        };
        let cpu = CpuBackend::new();
        let r0 = b.route_stats();
        let (got, want) = round_trip(&b, &cpu, 1024); // 4096 bytes: at the limit
        assert_eq!(got, want);
        let r1 = b.route_stats();
        assert_eq!(
            (
                r1.compute_stream_copies - r0.compute_stream_copies,
                r1.transfer_copies - r0.transfer_copies
            ),
            (1, 0)
        );
        let (got, want) = round_trip(&b, &cpu, 1025); // one float above
        assert_eq!(got, want);
        let r2 = b.route_stats();
        assert_eq!(
            (
                r2.compute_stream_copies - r1.compute_stream_copies,
                r2.transfer_copies - r1.transfer_copies
            ),
            (0, 1)
        );
        assert_eq!(r2.transfer_bytes - r1.transfer_bytes, 4100);
        assert_eq!(b.stats().snapshot().empty_submits, 0);
        common::assert_clean(&b);
    }
}

#[test]
fn copies_take_their_route_at_the_measured_crossover() {
    let Some(b) = common::open(forced(None, false)) else {
        return;
    };
    let c = b.crossover().expect("a transfer route has a crossover");
    assert!(c.measured);
    assert!(c.overhead_ns > 0.0 && c.h2d_bytes_per_s > 0.0, "{c:?}");
    eprintln!(
        "measured crossover: {} bytes (submit+wait {:.1} us, H2D {:.2} GB/s)",
        c.copy_max_bytes,
        c.overhead_ns / 1e3,
        c.h2d_bytes_per_s / 1e9
    );
    let cpu = CpuBackend::new();
    let below = (c.copy_max_bytes as usize / 4).max(1);
    let r0 = b.route_stats();
    let (got, want) = round_trip(&b, &cpu, below);
    assert_eq!(got, want);
    let (got, want) = round_trip(&b, &cpu, below + 1);
    assert_eq!(got, want);
    let r = b.route_stats();
    assert_eq!(r.compute_stream_copies - r0.compute_stream_copies, 1);
    assert_eq!(r.transfer_copies - r0.transfer_copies, 1);
    common::assert_clean(&b);
}

#[test]
fn a_transfer_copy_waits_for_queued_work_on_its_destination() {
    let Some(b) = common::open(forced(Some(0), false)) else {
        return;
    };
    let cpu = CpuBackend::new();
    let dst = common::buffer_with(&b, &common::f32_bytes(&[1.0; 64]));
    let out = b.alloc_buffer(256, BufferUsage::Compute).unwrap();
    let gate = b.gate_close().unwrap();
    // Queued behind the gate: reads `dst` before the copy below overwrites it.
    b.graph_compute_async(&common::copy_graph(dst, out, 64))
        .unwrap();
    let (src, vals) = host_tensor(&cpu, 64, 10.0);
    assert!(b.cpy_tensor_async(&cpu, src, 0, dst, 0, 256).unwrap());
    assert_eq!(b.route_stats().transfer_copies, 1);
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    assert!(!ev.is_complete());
    gate.open();
    assert_eq!(
        common::read_f32(&b, out, 64),
        vec![1.0; 64],
        "the copy overtook the graph"
    );
    assert_eq!(common::read_f32(&b, dst, 64), vals);
    common::assert_clean(&b);
}

#[test]
fn transfer_only_work_is_waited_on_through_its_timeline() {
    let Some(b) = common::open(forced(Some(0), true)) else {
        return;
    };
    let cpu = CpuBackend::new();
    let dst = b.alloc_buffer(256, BufferUsage::Compute).unwrap();
    b.synchronize().unwrap();
    let (src, vals) = host_tensor(&cpu, 64, 3.0);
    let before = b.stats().snapshot();
    assert!(b.cpy_tensor_async(&cpu, src, 0, dst, 0, 256).unwrap());
    b.synchronize().unwrap();
    b.synchronize().unwrap();
    let d = b.stats().snapshot().since(&before);
    assert_eq!(
        (
            d.submits,
            d.empty_submits,
            d.host_waits,
            d.elided_syncs,
            d.h2d_copies
        ),
        (1, 0, 1, 1, 1)
    );
    assert_eq!(common::read_f32(&b, dst, 64), vals);
    common::assert_clean(&b);
}

#[test]
fn without_a_transfer_route_everything_stays_in_the_compute_stream() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    if b.has_transfer_queue() {
        eprintln!("skipping: this device has a dedicated transfer queue");
        return;
    }
    assert!(b.crossover().is_none());
    let cpu = CpuBackend::new();
    let (got, want) = round_trip(&b, &cpu, 100_000);
    assert_eq!(got, want);
    assert_eq!(b.route_stats().transfer_copies, 0);
    common::assert_clean(&b);
}

#[test]
fn copies_from_a_non_host_backend_use_the_fallback() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    let other = lowsync_cpu::CpuAsyncBackend::new("cpu-async").unwrap();
    let src = other.alloc_buffer(16, BufferUsage::Compute).unwrap();
    let dst = b.alloc_buffer(16, BufferUsage::Compute).unwrap();
    assert!(!b.cpy_tensor_async(&other, src, 0, dst, 0, 16).unwrap());
    common::assert_clean(&b);
}
