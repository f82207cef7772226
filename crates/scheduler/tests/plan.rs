//! Single-backend plans: counts per policy as functions of the graph, the staged-input
//! invariant under the test gate, and the stock fallback for backends without async
//! capabilities.

mod common;

use std::sync::Arc;

use common::{blocks_until_opened, Masked, Watched};
use lowsync_backend::{Backend, Caps, StatsSnapshot};
use lowsync_cpu::{CpuAsyncBackend, CpuBackend};
use lowsync_graph::{DType, Graph, TensorId};
use lowsync_scheduler::{Plan, SyncPolicy};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `out = (((x0 + x1) + x2) ... ) * w`, with `u` inputs of 4 elements.
fn sum_graph(u: usize) -> Graph {
    let mut g = Graph::new();
    let xs: Vec<TensorId> = (0..u)
        .map(|i| g.input(&format!("x{i}"), &[4], DType::F32).unwrap())
        .collect();
    let w = g
        .weight(
            "w",
            &[4],
            DType::F32,
            Arc::from(f32_bytes(&[1.0, 2.0, 3.0, 4.0])),
            None,
        )
        .unwrap();
    let mut acc = xs[0];
    for x in &xs[1..] {
        acc = g.add(acc, *x).unwrap();
    }
    let y = g.mul(acc, w).unwrap();
    g.output("y", y).unwrap();
    g
}

fn step(plan: &mut Plan, u: usize, k: f32) -> Vec<f32> {
    for i in 0..u {
        plan.set_input(&format!("x{i}"), &f32_bytes(&[k + i as f32; 4]))
            .unwrap();
    }
    plan.compute().unwrap();
    floats(&plan.get_output("y").unwrap())
}

/// Per-step counts on `cpu-async` for U user inputs, after a warm-up step:
/// - staged:  0 host waits in compute, 1 for the read; 1 H2D copy; 0 elided syncs.
/// - relaxed: sync (elided: the read observed everything), U async writes, sync (1 wait),
///   graph, read (1 wait): 2 host waits, 1 elided, U H2D copies.
/// - stock:   per input a sync (elided: nothing queued since the last wait) and a blocking
///   write (1 wait), graph, read (1 wait): U + 1 host waits, U elided, U H2D copies.
#[test]
fn counts_per_step_are_functions_of_the_user_inputs() {
    for u in [1usize, 3, 6] {
        let mut outs = Vec::new();
        for policy in SyncPolicy::ALL {
            let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
            let mut plan = Plan::compile(&sum_graph(u), be.clone(), policy).unwrap();
            step(&mut plan, u, 0.5);
            let u64_ = u as u64;
            let (waits, elided, h2d) = match policy {
                SyncPolicy::Staged => (1, 0, 1),
                SyncPolicy::Relaxed => (2, 1, u64_),
                SyncPolicy::Stock => (u64_ + 1, u64_, u64_),
            };
            let mut out = Vec::new();
            // Per step, not a total: a steady 1 and an alternating 0/2 are different.
            for s in 0..5 {
                let before = be.stats().snapshot();
                out = step(&mut plan, u, s as f32);
                let d = be.stats().snapshot().since(&before);
                assert_eq!(
                    (d.host_waits, d.driver_syncs, d.elided_syncs),
                    (waits, waits, elided),
                    "{policy} U={u} step {s}: host waits, driver syncs, elided syncs"
                );
                assert_eq!(
                    (d.h2d_copies, d.d2h_copies, d.reallocs),
                    (h2d, 1, 0),
                    "{policy} U={u} step {s}: H2D copies, one read, no realloc"
                );
            }
            outs.push(out);
        }
        assert!(
            outs.windows(2).all(|w| w[0] == w[1]),
            "policies give bit-identical outputs: {outs:?}"
        );
    }
}

#[test]
fn staged_compute_makes_no_host_wait_before_the_read() {
    let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    let mut plan = Plan::compile(&sum_graph(6), be.clone(), SyncPolicy::Staged).unwrap();
    let before = be.stats().snapshot();
    for s in 0..10 {
        for i in 0..6 {
            plan.set_input(&format!("x{i}"), &f32_bytes(&[s as f32; 4]))
                .unwrap();
        }
        plan.compute().unwrap();
    }
    assert_eq!(be.stats().snapshot().since(&before).host_waits, 0);
    assert_eq!(
        floats(&plan.get_output("y").unwrap()),
        vec![54.0, 108.0, 162.0, 216.0]
    );
}

/// Invariant 1 at the plan level: the caller overwrites its input right after `compute()`
/// returns, while the graph that reads it waits behind a closed gate; the result uses the old
/// value, and the step is not complete before the gate opens.
#[test]
fn input_overwritten_after_compute_is_not_seen_by_the_queued_graph() {
    for policy in SyncPolicy::ALL {
        let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
        let mut plan = Plan::compile(&sum_graph(1), be.clone(), policy).unwrap();
        plan.set_input("x0", &f32_bytes(&[1.0; 4])).unwrap();
        let gate = Watched::close(&*be);
        if policy == SyncPolicy::Staged {
            plan.compute().unwrap();
        } else {
            // stock and relaxed wait for the stream before writing: the gate is opened from a
            // thread once the plan is blocked in that wait (they are correct by waiting, not by
            // staging), which must happen before compute returns.
            let blocked = blocks_until_opened(&be, &gate, || plan.compute().unwrap());
            assert!(
                blocked,
                "{policy}: compute returned without waiting for the stream"
            );
        }
        let ev = be.event_new().unwrap();
        be.event_record(&ev).unwrap();
        plan.set_input("x0", &f32_bytes(&[100.0; 4])).unwrap();
        if policy == SyncPolicy::Staged {
            assert!(!ev.is_complete(), "the step waits behind the gate");
        }
        gate.open();
        assert_eq!(
            floats(&plan.get_output("y").unwrap()),
            vec![1.0, 2.0, 3.0, 4.0],
            "{policy}"
        );
    }
}

/// `cpu-async` with every optional capability hidden (invariant 5).
fn plain() -> Masked<CpuAsyncBackend> {
    Masked {
        name: "plain",
        inner: CpuAsyncBackend::new("cpu-async").unwrap(),
        caps: Caps::default(),
        refuse: |_| false,
    }
}

#[test]
fn backend_without_async_capabilities_behaves_exactly_like_stock() {
    let u = 4;
    let mut counts: Vec<StatsSnapshot> = Vec::new();
    let mut outs = Vec::new();
    for policy in SyncPolicy::ALL {
        let be: Arc<dyn Backend> = Arc::new(plain());
        let mut plan = Plan::compile(&sum_graph(u), be.clone(), policy).unwrap();
        let before = be.stats().snapshot();
        outs.push(step(&mut plan, u, 2.0));
        counts.push(be.stats().snapshot().since(&before));
    }
    assert!(counts.windows(2).all(|w| w[0] == w[1]), "{counts:?}");
    assert!(outs.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(counts[0].h2d_copies, u as u64);
}

#[test]
fn cpu_and_cpu_async_are_bit_identical() {
    let g = sum_graph(3);
    let a: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let b: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    let mut pa = Plan::compile(&g, a, SyncPolicy::Staged).unwrap();
    let mut pb = Plan::compile(&g, b, SyncPolicy::Staged).unwrap();
    for k in 0..3 {
        assert_eq!(
            step(&mut pa, 3, k as f32 * 0.37),
            step(&mut pb, 3, k as f32 * 0.37)
        );
    }
}

#[test]
fn bad_input_sizes_and_names_are_errors_and_the_plan_stays_usable() {
    let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    let mut plan = Plan::compile(&sum_graph(2), be, SyncPolicy::Staged).unwrap();
    assert!(plan
        .set_input("x0", &[0u8; 3])
        .unwrap_err()
        .to_string()
        .contains("needs 16 bytes"));
    assert!(plan
        .set_input("nope", &[0u8; 16])
        .unwrap_err()
        .to_string()
        .contains("unknown input"));
    assert!(plan.get_output("nope").is_err());
    assert_eq!(step(&mut plan, 2, 1.0), vec![3.0, 6.0, 9.0, 12.0]);
}

#[test]
fn persistent_state_survives_steps_and_is_written_by_set_rows() {
    let mut g = Graph::new();
    let kv = g.persistent("kv", &[4, 2], DType::F32).unwrap();
    let row = g.input("row", &[1, 2], DType::F32).unwrap();
    let slot = g.input("slot", &[1], DType::I32).unwrap();
    let w = g.set_rows(kv, row, slot).unwrap();
    let s = g.scale(w, 1.0).unwrap();
    g.output("cache", s).unwrap();
    let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    let mut plan = Plan::compile(&g, be, SyncPolicy::Staged).unwrap();
    for i in 0..4i32 {
        plan.set_input("row", &f32_bytes(&[i as f32 + 1.0, -(i as f32) - 1.0]))
            .unwrap();
        plan.set_input("slot", &i.to_ne_bytes()).unwrap();
        plan.compute().unwrap();
    }
    assert_eq!(
        floats(&plan.get_output("cache").unwrap()),
        vec![1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0]
    );
}

/// A device-side feed (the launch-ahead decode loop's mechanism): step k+1 is queued before
/// step k's output is read, and takes that output as its input on the device. Every policy
/// gives the same values, whether each read is queued after its step (`read_async`) or with it
/// (`compute_read_async`); under `staged` nothing waits until the reads; the feed is armed for
/// one step only.
#[test]
fn a_fed_step_takes_the_previous_output_on_the_device() {
    for (policy, with_step) in SyncPolicy::ALL
        .into_iter()
        .flat_map(|p| [(p, false), (p, true)])
    {
        let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
        let mut plan = Plan::compile(&sum_graph(1), be.clone(), policy).unwrap();
        assert!(plan.can_feed("x0", "y"));
        plan.set_input("x0", &f32_bytes(&[1.0; 4])).unwrap();
        let before = be.stats().snapshot();
        let queue = |plan: &mut Plan| {
            if with_step {
                plan.compute_read_async("y").unwrap()
            } else {
                plan.compute().unwrap();
                plan.read_async("y").unwrap()
            }
        };
        let mut reads = vec![queue(&mut plan)];
        for _ in 0..2 {
            plan.feed("x0", "y").unwrap();
            reads.push(queue(&mut plan));
        }
        let queued = be.stats().snapshot().since(&before);
        if policy == SyncPolicy::Staged {
            assert_eq!(queued.host_waits, 0, "nothing waits before the reads");
        }
        assert_eq!((queued.d2d_copies, queued.d2d_bytes), (2, 32), "{policy}");
        let got: Vec<Vec<f32>> = reads
            .iter_mut()
            .map(|r| floats(r.wait().unwrap()))
            .collect();
        assert_eq!(
            got,
            vec![
                vec![1.0, 2.0, 3.0, 4.0],
                vec![1.0, 4.0, 9.0, 16.0],
                vec![1.0, 8.0, 27.0, 64.0]
            ],
            "{policy}"
        );
        if policy == SyncPolicy::Staged {
            let d = be.stats().snapshot().since(&before);
            assert_eq!(d.host_waits, 3, "one wait per read");
        }
        // Not armed any more: the host's bytes again.
        plan.compute().unwrap();
        assert_eq!(
            floats(&plan.get_output("y").unwrap()),
            vec![1.0, 2.0, 3.0, 4.0]
        );
    }
}

#[test]
fn bad_feeds_and_reads_are_errors_and_the_plan_stays_usable() {
    let mut g = sum_graph(1);
    let idx = g.input("idx", &[4], DType::I32).unwrap();
    g.output("idx_out", idx).unwrap();
    let z = g.input("z", &[4], DType::F32).unwrap();
    g.output("z_out", z).unwrap();
    let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    let mut plan = Plan::compile(&g, be, SyncPolicy::Staged).unwrap();
    let err = |r: lowsync_scheduler::Result<()>| r.unwrap_err().to_string();
    assert!(err(plan.feed("nope", "y")).contains("nope"));
    assert!(err(plan.feed("x0", "nope")).contains("nope"));
    assert!(err(plan.feed("idx", "y")).contains("i32"), "dtype mismatch");
    assert!(err(plan.feed("x0", "z_out")).contains("user input"));
    assert!(plan.read_async("z_out").is_err());
    assert!(
        plan.compute_read_async("z_out").is_err(),
        "refused before queuing"
    );
    assert!(!plan.can_feed("idx", "y"));
    // A backend without stream-ordered copies cannot feed, and says so.
    let sync: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let mut on_cpu = Plan::compile(&sum_graph(1), sync, SyncPolicy::Staged).unwrap();
    assert!(err(on_cpu.feed("x0", "y")).contains("stream-ordered copies"));
    assert!(on_cpu.read_async("y").is_err());
    let before = on_cpu.backend().stats().snapshot();
    assert!(on_cpu.compute_read_async("y").is_err());
    assert_eq!(
        on_cpu.backend().stats().snapshot(),
        before,
        "nothing queued by a refused read"
    );
    assert_eq!(step(&mut on_cpu, 1, 1.0), vec![1.0, 2.0, 3.0, 4.0]);
    // Nothing was armed by the failed calls.
    plan.set_input("x0", &f32_bytes(&[2.0; 4])).unwrap();
    plan.compute().unwrap();
    assert_eq!(
        floats(&plan.get_output("y").unwrap()),
        vec![2.0, 4.0, 6.0, 8.0]
    );
}
