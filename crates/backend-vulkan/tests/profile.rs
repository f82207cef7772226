//! Per-dispatch device time (`LOWSYNC_VK_PROFILE`): with profiling on, every dispatch of every
//! completed step is timed and summed per kernel variant, with the bytes it binds for reading;
//! results are bit-identical to an unprofiled backend; a reset forgets the figures; an
//! unprofiled backend reports nothing. Both memory paths, validation (synchronization
//! validation on) silent.

mod common;

use std::sync::Arc;

use lowsync_backend::{Backend, KernelTime};
use lowsync_graph::{DType, Graph};
use lowsync_scheduler::{Sched, SyncPolicy};
use lowsync_vulkan::VkConfig;

const V: usize = 64;
const D: usize = 32;

fn weights(seed: u32, n: usize) -> Vec<u8> {
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect();
    common::f32_bytes(&v)
}

/// Embedding row of the token, norm, a residual projection, the output head and its argmax.
fn step_graph() -> Graph {
    let mut g = Graph::new();
    let tok = g.input("tok", &[1], DType::I32).unwrap();
    let emb = g
        .weight("emb", &[V, D], DType::F32, weights(1, V * D), None)
        .unwrap();
    let w = g
        .weight("w", &[D, D], DType::F32, weights(2, D * D), None)
        .unwrap();
    let out = g
        .weight("out", &[V, D], DType::F32, weights(3, V * D), None)
        .unwrap();
    let x = g.get_rows(emb, tok).unwrap();
    let h = g.rms_norm(x, 1e-5).unwrap();
    let wt = g.transpose(w, 0, 1).unwrap();
    let p = g.mul_mat(h, wt).unwrap();
    let r = g.add(x, p).unwrap();
    let ot = g.transpose(out, 0, 1).unwrap();
    let logits = g.mul_mat(r, ot).unwrap();
    let next = g.argmax(logits).unwrap();
    g.output("logits", logits).unwrap();
    g.output("next", next).unwrap();
    g
}

/// The logits of `steps` steps under `staged`, and the backend's kernel times after them.
fn run(b: Arc<dyn Backend>, steps: usize) -> (Vec<Vec<u8>>, Vec<KernelTime>) {
    let sched = Sched::new(vec![b.clone()], SyncPolicy::Staged, 1).expect("scheduler");
    let mut plan = sched.compile(&step_graph()).expect("compile");
    let mut logits = Vec::new();
    for i in 0..steps {
        plan.set_input("tok", &common::i32_bytes(&[(i * 5 % V) as i32]))
            .unwrap();
        plan.compute().unwrap();
        logits.push(plan.get_output("logits").unwrap());
    }
    sched.synchronize().unwrap();
    (logits, b.kernel_times())
}

#[test]
fn profiling_times_every_dispatch_of_every_step_without_changing_results() {
    const STEPS: usize = 5;
    for base in common::both_paths() {
        let (Some(on), Some(off)) = (
            common::open(VkConfig {
                profile: true,
                ..base.clone()
            }),
            common::open(base),
        ) else {
            return;
        };
        let (on, off) = (Arc::new(on), Arc::new(off));
        let (got_on, times) = run(on.clone(), STEPS);
        let (got_off, none) = run(off.clone(), STEPS);
        assert_eq!(got_on, got_off, "profiling changed the logits");
        assert!(none.is_empty(), "an unprofiled backend reports {none:?}");
        if !on.profiling() {
            eprintln!("skipping the figures: the compute queue writes no timestamps");
            assert!(times.is_empty());
            continue;
        }
        // Every variant ran once per step: the step's dispatches, each timed every step.
        assert!(times.len() >= 5, "{times:?}");
        for t in &times {
            assert_eq!(t.count % STEPS as u64, 0, "{t:?}");
            assert!(t.count > 0 && t.read_bytes > 0, "{t:?}");
        }
        let total: u64 = times.iter().map(|t| t.device_ns).sum();
        assert!(total > 0, "no device time at all: {times:?}");
        assert!(
            times.windows(2).all(|w| w[0].device_ns >= w[1].device_ns),
            "longest first: {times:?}"
        );
        // The head's mat-vec reads at least its weight every step.
        let head = (V * D * 4) as u64;
        assert!(
            times
                .iter()
                .any(|t| t.name.starts_with("mul_mat") && t.read_bytes >= head * STEPS as u64),
            "{times:?}"
        );
        on.reset_kernel_times();
        assert!(on.kernel_times().is_empty(), "a reset forgets the figures");
        common::assert_clean(&on);
        common::assert_clean(&off);
    }
}
