//! Recorded graph plans (`LOWSYNC_VK_RECORD`, on by default): a cached plan is recorded once
//! into a secondary command buffer at its first use (one graph capture) and every step executes
//! it from the stream's open buffer (one graph launch, no kernel recorded), on both memory
//! paths. A decode-like step under the `staged` policy — token id, position, KV slot and mask
//! written by the one staged copy — makes the same waits, submits and copies as with recording
//! off, and bit-identical results. Steps in flight together share one recording; a replaced
//! buffer records the plan again; recordings of dropped graphs are freed. Independently of
//! lowsync's counters, wrapped entry points show a replayed step records no dispatch. Every
//! run asserts the validation layer (synchronization validation on) stayed silent.

mod common;

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use ash::vk;
use lowsync_backend::{Backend, BufferUsage, StatsSnapshot};
use lowsync_cpu::CpuBackend;
use lowsync_graph::{DType, Graph, RopeMode};
use lowsync_scheduler::{Sched, SyncPolicy};
use lowsync_vulkan::{VkConfig, VulkanBackend};

fn with_record(base: VkConfig, record: bool) -> VkConfig {
    VkConfig { record, ..base }
}

// A decode step of a one-layer, one-head-group toy model.
const V: usize = 48;
const D: usize = 32;
const HEADS: usize = 4;
const N_CTX: usize = 16;

fn weights(seed: u32, n: usize) -> Vec<u8> {
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect();
    common::f32_bytes(&v)
}

/// Embedding row of the token, norm, a projection, rope at the position, the row stored in a
/// persistent KV cache at the slot, attention over the cache under the mask (the valid length
/// as data), the output head. Every per-step value is a graph input.
fn decode_graph() -> Graph {
    let mut g = Graph::new();
    let tok = g.input("tok", &[1], DType::I32).unwrap();
    let pos = g.input("pos", &[1], DType::I32).unwrap();
    let slot = g.input("slot", &[1], DType::I32).unwrap();
    let mask = g.input("mask", &[1, N_CTX], DType::F32).unwrap();
    let emb = g
        .weight("emb", &[V, D], DType::F32, weights(1, V * D), None)
        .unwrap();
    let wq = g
        .weight("wq", &[D, D], DType::F32, weights(2, D * D), None)
        .unwrap();
    let out = g
        .weight("out", &[D, V], DType::F32, weights(3, D * V), None)
        .unwrap();
    let cache = g.persistent("cache", &[N_CTX, D], DType::F32).unwrap();
    let x = g.get_rows(emb, tok).unwrap();
    let h = g.rms_norm(x, 1e-5).unwrap();
    let q = g.mul_mat(h, wq).unwrap();
    let q = g.reshape(q, &[1, HEADS, D / HEADS]).unwrap();
    let q = g
        .rope(q, pos, RopeMode::Normal, D / HEADS, 10_000.0)
        .unwrap();
    let q = g.reshape(q, &[1, D]).unwrap();
    let kv = g.set_rows(cache, q, slot).unwrap();
    let kt = g.transpose(kv, 0, 1).unwrap();
    let scores = g.mul_mat(q, kt).unwrap();
    let p = g.soft_max(scores, Some(mask), 0.25).unwrap();
    let o = g.mul_mat(p, kv).unwrap();
    let logits = g.mul_mat(o, out).unwrap();
    g.output("logits", logits).unwrap();
    g
}

/// The inputs of step `i`: token, position and slot `i`, the first `i + 1` cells unmasked.
fn step_inputs(i: usize) -> [(&'static str, Vec<u8>); 4] {
    let mask: Vec<f32> = (0..N_CTX)
        .map(|c| if c <= i { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    [
        ("tok", common::i32_bytes(&[(i * 7 % V) as i32])),
        ("pos", common::i32_bytes(&[i as i32])),
        ("slot", common::i32_bytes(&[i as i32])),
        ("mask", common::f32_bytes(&mask)),
    ]
}

/// Per step: the logits' bytes and the backend's counts over the step.
fn decode(b: Arc<dyn Backend>, steps: usize) -> Vec<(Vec<u8>, StatsSnapshot)> {
    let sched =
        Sched::with_debug_realloc(vec![b.clone()], SyncPolicy::Staged, 1, 1).expect("scheduler");
    let mut plan = sched.compile(&decode_graph()).expect("compile");
    assert_eq!(plan.split_backends(), vec![0], "one split");
    (0..steps)
        .map(|i| {
            let before = b.stats().snapshot();
            for (name, bytes) in &step_inputs(i) {
                plan.set_input(name, bytes).unwrap();
            }
            plan.compute().unwrap();
            let logits = plan.get_output("logits").unwrap();
            (logits, b.stats().snapshot().since(&before))
        })
        .collect()
}

/// The counts a step makes whether its plan is replayed or recorded.
fn stream_counts(s: &StatsSnapshot) -> [u64; 8] {
    [
        s.host_waits,
        s.driver_syncs,
        s.elided_syncs,
        s.submits,
        s.empty_submits,
        s.h2d_copies,
        s.d2h_copies,
        s.reallocs,
    ]
}

#[test]
fn a_decode_step_is_recorded_once_then_replayed_with_unchanged_counts_and_results() {
    const STEPS: usize = 12;
    let cpu = decode(Arc::new(CpuBackend::new()), STEPS);
    for base in common::both_paths() {
        let no_rebar = base.no_host_visible_vram;
        let (Some(on), Some(off)) = (
            common::open(with_record(base.clone(), true)),
            common::open(with_record(base, false)),
        ) else {
            return;
        };
        let (on, off) = (Arc::new(on), Arc::new(off));
        let got_on = decode(on.clone(), STEPS);
        let got_off = decode(off.clone(), STEPS);
        let nodes = got_off[0].1.kernel_launches;
        assert!(nodes >= 8, "a recorded step launches every node: {nodes}");
        for (i, ((l_on, s_on), (l_off, s_off))) in got_on.iter().zip(&got_off).enumerate() {
            assert_eq!(l_on, l_off, "step {i}: logits differ bitwise");
            assert_eq!(stream_counts(s_on), stream_counts(s_off), "step {i}");
            assert_eq!(
                (
                    s_on.graph_captures,
                    s_on.graph_launches,
                    s_on.kernel_launches
                ),
                (u64::from(i == 0), 1, 0),
                "step {i}: recorded at the first step, replayed at every step"
            );
            assert_eq!(
                (
                    s_off.graph_captures,
                    s_off.graph_launches,
                    s_off.kernel_launches
                ),
                (0, 0, nodes),
                "step {i}"
            );
            if i > 0 {
                // The steady state: the logits' read is the one wait; one compute submission,
                // and on the no-ReBAR path the read's copy, submitted on its own.
                assert_eq!(
                    (
                        s_on.host_waits,
                        s_on.empty_submits,
                        s_on.h2d_copies,
                        s_on.reallocs
                    ),
                    (1, 0, 1, 0),
                    "step {i}"
                );
                assert_eq!(s_on.submits, 1 + u64::from(no_rebar), "step {i}: {s_on:?}");
            }
            let (v, c) = (common_f32(l_on), common_f32(&cpu[i].0));
            let err = v
                .iter()
                .zip(&c)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-4, "step {i}: {err} from the CPU's logits");
        }
        // The scheduler's plans are gone, their buffers freed: so are the recordings.
        assert_eq!(on.recorded_plans(), 0);
        assert!(on.caps().graph_replay && !off.caps().graph_replay);
        common::assert_clean(&on);
        common::assert_clean(&off);
    }
}

#[test]
fn a_decode_step_queued_with_its_read_is_one_submission_on_both_paths() {
    const STEPS: usize = 8;
    let cpu = decode(Arc::new(CpuBackend::new()), STEPS);
    for base in common::both_paths() {
        for record in [true, false] {
            let Some(b) = common::open(with_record(base.clone(), record)) else {
                return;
            };
            let b = Arc::new(b);
            let sched = Sched::with_debug_realloc(
                vec![b.clone() as Arc<dyn Backend>],
                SyncPolicy::Staged,
                1,
                1,
            )
            .expect("scheduler");
            let mut plan = sched.compile(&decode_graph()).expect("compile");
            for (i, want) in cpu.iter().enumerate() {
                let before = b.stats().snapshot();
                for (name, bytes) in &step_inputs(i) {
                    plan.set_input(name, bytes).unwrap();
                }
                let mut rb = plan.compute_read_async("logits").unwrap();
                let got = common_f32(rb.wait().unwrap());
                let s = b.stats().snapshot().since(&before);
                if i > 0 {
                    assert_eq!(
                        (
                            s.host_waits,
                            s.submits,
                            s.empty_submits,
                            s.h2d_copies,
                            s.d2h_copies
                        ),
                        (1, 1, 0, 1, 1),
                        "step {i} (record {record}): the step and its read, one submission"
                    );
                }
                let c = common_f32(&want.0);
                let err = got
                    .iter()
                    .zip(&c)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < 1e-4, "step {i}: {err} from the CPU's logits");
            }
            drop(plan);
            common::assert_clean(&b);
        }
    }
}

fn common_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn steps_in_flight_together_execute_one_recording() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let inp = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
        let bias = common::buffer_with(&b, &common::f32_bytes(&[0.5; 16]));
        let out = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let g = common::add_graph(inp, bias, out, 16);
        b.synchronize().unwrap();
        let before = b.stats().snapshot();
        // Behind a closed gate, every step's submission is pending at once, each executing the
        // same secondary command buffer.
        let gate = b.gate_close().unwrap();
        let reads: Vec<_> = (0..6)
            .map(|i| {
                b.set_tensor_async_staged(inp, 0, &common::f32_bytes(&[i as f32; 16]))
                    .unwrap();
                b.graph_compute_async(&g).unwrap();
                b.read_async(out, 0, 64).unwrap()
            })
            .collect();
        let d = b.stats().snapshot().since(&before);
        assert_eq!(
            (d.graph_captures, d.graph_launches, d.host_waits),
            (1, 6, 0)
        );
        gate.open();
        for (i, mut r) in reads.into_iter().enumerate() {
            let got = common_f32(r.wait().unwrap());
            assert_eq!(got, vec![i as f32 + 0.5; 16], "step {i}");
        }
        common::assert_clean(&b);
    }
}

#[test]
fn a_replaced_buffer_records_the_plan_again_and_a_new_graph_has_its_own_recording() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let inp = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
        let bias = common::buffer_with(&b, &common::f32_bytes(&[0.5; 16]));
        let out = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let g = common::add_graph(inp, bias, out, 16);
        let step = |g: &Arc<lowsync_backend::ExecGraph>, x: f32| {
            b.set_tensor_async_staged(inp, 0, &common::f32_bytes(&[x; 16]))
                .unwrap();
            b.graph_compute_async(g).unwrap();
            common::read_f32(&b, out, 16)
        };
        let counts = || {
            let s = b.stats().snapshot();
            (s.graph_captures, s.graph_launches)
        };
        for i in 0..3 {
            assert_eq!(step(&g, i as f32), vec![i as f32 + 0.5; 16]);
        }
        assert_eq!(counts(), (1, 3));
        // New memory behind the same buffer id: the recording binds the old one.
        b.realloc_buffer(bias, 128).unwrap();
        b.set_tensor(bias, 0, &common::f32_bytes(&[2.0; 16]))
            .unwrap();
        for i in 0..3 {
            assert_eq!(step(&g, i as f32), vec![i as f32 + 2.0; 16]);
        }
        assert_eq!(counts(), (2, 6), "recorded again once after the realloc");
        // Another graph over the same buffers is recorded on its own; the first one still
        // replays its recording.
        let g2 = common::add_graph(inp, bias, out, 16);
        assert_eq!(step(&g2, 1.0), vec![3.0; 16]);
        assert_eq!(step(&g, 2.0), vec![4.0; 16]);
        assert_eq!(counts(), (3, 8));
        assert_eq!(b.recorded_plans(), 2);
        common::assert_clean(&b);
    }
}

#[test]
fn recordings_of_dropped_graphs_are_freed() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = common::buffer_with(&b, &common::f32_bytes(&[1.0; 16]));
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        for i in 0..200 {
            // A new graph object every time, as a caller that rebuilds its graph would.
            let g = common::add_graph(x, x, y, 16);
            b.graph_compute_async(&g).unwrap();
            if i % 10 == 0 {
                b.synchronize().unwrap();
            }
        }
        b.synchronize().unwrap();
        assert_eq!(common::read_f32(&b, y, 16), vec![2.0; 16]);
        assert_eq!(b.stats().snapshot().graph_captures, 200);
        // The last graph's recording, and at most the one it replaced, not yet reclaimed.
        assert!(
            b.recorded_plans() <= 2,
            "{} recordings kept",
            b.recorded_plans()
        );
        common::assert_clean(&b);
    }
}

#[test]
fn recording_off_records_every_step_and_never_captures() {
    for base in common::both_paths() {
        let Some(b) = common::open(with_record(base, false)) else {
            return;
        };
        let x = common::buffer_with(&b, &common::f32_bytes(&[1.0; 16]));
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let g = common::add_graph(x, x, y, 16);
        for _ in 0..5 {
            b.graph_compute_async(&g).unwrap();
        }
        b.synchronize().unwrap();
        let s = b.stats().snapshot();
        assert_eq!(
            (s.graph_captures, s.graph_launches, s.kernel_launches),
            (0, 0, 5)
        );
        assert_eq!(b.recorded_plans(), 0);
        common::assert_clean(&b);
    }
}

// Entry points wrapped where the loader hands them out (`VkConfig::entry_point_hook`): the
// commands recorded, counted outside lowsync. Only `entry_point_counts_show_no_dispatch_...`
// opens a backend with this hook.
static DISPATCHES: AtomicU64 = AtomicU64::new(0);
static EXECUTES: AtomicU64 = AtomicU64::new(0);
static REAL_DISPATCH: AtomicUsize = AtomicUsize::new(0);
static REAL_EXECUTE: AtomicUsize = AtomicUsize::new(0);

unsafe extern "system" fn cmd_dispatch(cmd: vk::CommandBuffer, x: u32, y: u32, z: u32) {
    DISPATCHES.fetch_add(1, Ordering::Relaxed);
    let real: vk::PFN_vkCmdDispatch =
        unsafe { std::mem::transmute(REAL_DISPATCH.load(Ordering::Relaxed)) };
    unsafe { real(cmd, x, y, z) }
}

unsafe extern "system" fn cmd_execute_commands(
    cmd: vk::CommandBuffer,
    count: u32,
    buffers: *const vk::CommandBuffer,
) {
    EXECUTES.fetch_add(u64::from(count), Ordering::Relaxed);
    let real: vk::PFN_vkCmdExecuteCommands =
        unsafe { std::mem::transmute(REAL_EXECUTE.load(Ordering::Relaxed)) };
    unsafe { real(cmd, count, buffers) }
}

fn hook(name: &CStr, real: *const c_void) -> *const c_void {
    if real.is_null() {
        return real;
    }
    let (slot, ours): (&AtomicUsize, *const c_void) = match name.to_bytes() {
        b"vkCmdDispatch" => (&REAL_DISPATCH, cmd_dispatch as *const c_void),
        b"vkCmdExecuteCommands" => (&REAL_EXECUTE, cmd_execute_commands as *const c_void),
        _ => return real,
    };
    slot.store(real as usize, Ordering::Relaxed);
    ours
}

#[test]
fn entry_point_counts_show_no_dispatch_recorded_by_a_replayed_step() {
    for record in [true, false] {
        let cfg = VkConfig {
            entry_point_hook: Some(hook),
            ..with_record(common::config(), record)
        };
        let Some(b) = common::open(cfg) else { return };
        let b: Arc<VulkanBackend> = Arc::new(b);
        let sched = Sched::with_debug_realloc(
            vec![b.clone() as Arc<dyn Backend>],
            SyncPolicy::Staged,
            1,
            1,
        )
        .unwrap();
        let mut plan = sched.compile(&decode_graph()).unwrap();
        for i in 0..6 {
            let before = (
                DISPATCHES.load(Ordering::Relaxed),
                EXECUTES.load(Ordering::Relaxed),
                b.stats().snapshot(),
            );
            for (name, bytes) in &step_inputs(i) {
                plan.set_input(name, bytes).unwrap();
            }
            plan.compute().unwrap();
            plan.get_output("logits").unwrap();
            let dispatches = DISPATCHES.load(Ordering::Relaxed) - before.0;
            let executes = EXECUTES.load(Ordering::Relaxed) - before.1;
            let s = b.stats().snapshot().since(&before.2);
            assert_eq!(executes, s.graph_launches, "record={record} step {i}");
            if record {
                assert_eq!(executes, 1, "step {i}");
                if i > 0 {
                    assert_eq!(
                        dispatches, 0,
                        "step {i}: a replayed step records no dispatch"
                    );
                } else {
                    assert!(dispatches > 0, "the first step records the plan");
                }
            } else {
                assert_eq!(executes, 0);
                assert!(
                    dispatches >= s.kernel_launches,
                    "step {i}: {dispatches} dispatches"
                );
            }
        }
        common::assert_clean(&b);
    }
}
