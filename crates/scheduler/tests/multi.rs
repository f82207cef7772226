//! Scheduling across `cpu` and `cpu-async`: placement, splits and copies, the policies' counts
//! as functions of the graph, the ordering invariants under the test gate, pipelined copies,
//! the reserve with debug-realloc, and random graphs under every policy.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{blocks_until_opened, Masked, Watched};
use lowsync_backend::{Backend, BufferId, Caps, Event, Readback, StatsSnapshot, TensorRef};
use lowsync_cpu::{CpuAsyncBackend, CpuBackend};
use lowsync_graph::{DType, Graph, Op, TensorId};
use lowsync_scheduler::alloc::verify_items;
use lowsync_scheduler::{analyze, Analysis, Error, ItemKey, Plan, Sched, SyncPolicy};
use proptest::prelude::*;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn weight(g: &mut Graph, name: &str, v: &[f32], backend: &str) -> TensorId {
    g.weight(
        name,
        &[v.len()],
        DType::F32,
        Arc::from(f32_bytes(v)),
        Some(backend.to_string()),
    )
    .unwrap()
}

/// `[cpu-async, cpu]` with handles to both.
type Two = (Vec<Arc<dyn Backend>>, Arc<dyn Backend>, Arc<dyn Backend>);

fn two() -> Two {
    let dev: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    let host: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    (vec![dev.clone(), host.clone()], dev, host)
}

fn sched(policy: SyncPolicy, n_copies: usize) -> (Arc<Sched>, Arc<dyn Backend>, Arc<dyn Backend>) {
    let (bs, dev, host) = two();
    (
        Sched::with_debug_realloc(bs, policy, n_copies, 0).unwrap(),
        dev,
        host,
    )
}

/// U user inputs into a `cpu-async` split and A activations computed on `cpu` (from cpu
/// weights) crossing into it.
fn u_a_graph(u: usize, a: usize) -> Graph {
    let mut g = Graph::new();
    let acts: Vec<TensorId> = (0..a)
        .map(|j| {
            let w = weight(&mut g, &format!("wa{j}"), &[j as f32 + 1.0; 4], "cpu");
            g.scale(w, 2.0).unwrap() // runs on cpu: it reads a cpu weight
        })
        .collect();
    let wd = weight(&mut g, "wd", &[1.0, 2.0, 3.0, 4.0], "cpu-async");
    let xs: Vec<TensorId> = (0..u)
        .map(|i| g.input(&format!("x{i}"), &[4], DType::F32).unwrap())
        .collect();
    let mut acc = g.mul(xs[0], wd).unwrap(); // runs on cpu-async
    for x in &xs[1..] {
        acc = g.add(acc, *x).unwrap();
    }
    for t in acts {
        acc = g.add(acc, t).unwrap();
    }
    g.output("y", acc).unwrap();
    g
}

fn run_steps(plan: &mut Plan, inputs: &[(&str, Vec<u8>)], steps: usize, out: &str) -> Vec<u8> {
    let mut last = Vec::new();
    for _ in 0..steps {
        for (name, data) in inputs {
            plan.set_input(name, data).unwrap();
        }
        plan.compute().unwrap();
        last = plan.get_output(out).unwrap();
    }
    last
}

fn total(bs: &[&Arc<dyn Backend>]) -> StatsSnapshot {
    bs.iter().fold(StatsSnapshot::default(), |acc, b| {
        acc.add(&b.stats().snapshot())
    })
}

/// Per step, with U user inputs into the `cpu-async` split and A activations from `cpu`
/// (`cpy_tensor_async` accepts host sources, so W4–W6 never run here):
/// - stock:   W1 (elided: nothing queued since the last wait) + W2 (1 wait) per input; W3 per
///   activation — elided for the first (the last W2 observed everything), a wait for
///   each later one (the previous activation's copy is queued); the read (1 wait):
///   U + 1 + max(A - 1, 0) waits, U + min(A, 1) elided, U + A H2D copies.
/// - relaxed: sync (elided) + U async writes + A async copies + sync (1 wait) on cpu-async,
///   two elided syncs on cpu, the read: 2 waits, 1 + 2 elided, U + A copies.
/// - staged:  one staged arena write + A async copies, the read: 1 wait, 0 elided, 1 + A.
#[test]
fn counts_per_step_follow_w0_to_w6_as_functions_of_u_and_a() {
    for (u, a) in [(1usize, 0usize), (3, 1), (6, 2)] {
        let mut outs = Vec::new();
        for policy in SyncPolicy::ALL {
            let (sc, dev, host) = sched(policy, 1);
            let mut plan = sc.compile(&u_a_graph(u, a)).unwrap();
            assert_eq!(plan.n_splits(), if a > 0 { 2 } else { 1 });
            let inputs: Vec<(String, Vec<u8>)> = (0..u)
                .map(|i| (format!("x{i}"), f32_bytes(&[i as f32 + 0.5; 4])))
                .collect();
            let inputs: Vec<(&str, Vec<u8>)> = inputs
                .iter()
                .map(|(n, d)| (n.as_str(), d.clone()))
                .collect();
            run_steps(&mut plan, &inputs, 1, "y");
            let (u, a) = (u as u64, a as u64);
            let (waits, elided_dev, elided_host, h2d) = match policy {
                SyncPolicy::Stock => (u + 1 + a.saturating_sub(1), u + a.min(1), 0, u + a),
                SyncPolicy::Relaxed => (2, 1, if a > 0 { 2 } else { 0 }, u + a),
                SyncPolicy::Staged => (1, 0, 0, 1 + a),
            };
            let mut last = Vec::new();
            // Per step, not a total: a steady 1 and an alternating 0/2 are different.
            for step in 0..4 {
                let (bd, bh) = (dev.stats().snapshot(), host.stats().snapshot());
                last = run_steps(&mut plan, &inputs, 1, "y");
                let (d, h) = (
                    dev.stats().snapshot().since(&bd),
                    host.stats().snapshot().since(&bh),
                );
                let what = format!("{policy} U={u} A={a} step {step}");
                assert_eq!(d.host_waits + h.host_waits, waits, "{what}: host waits");
                assert_eq!(d.driver_syncs, waits, "{what}: driver syncs");
                assert_eq!(d.elided_syncs, elided_dev, "{what}: cpu-async elided");
                assert_eq!(h.elided_syncs, elided_host, "{what}: cpu elided");
                assert_eq!(d.h2d_copies, h2d, "{what}: H2D copies");
                assert_eq!(d.reallocs + h.reallocs, 0, "{what}: reallocs");
            }
            outs.push(last);
        }
        assert!(
            outs.windows(2).all(|w| w[0] == w[1]),
            "policies agree bit for bit"
        );
    }
}

/// An activation crossing from `cpu-async` back to the host split: `cpu` cannot
/// `cpy_tensor_async`, so stock runs W3 (elided) W4 (1 wait) W5 (elided) W6 (a blocking read,
/// 1 wait) after the device split's W1+W2 (1 wait): 3 waits per step. Relaxed: the device
/// split's closing sync (1) + W4 + W6 = 3. Staged: one blocking read = 1 wait, the floor.
#[test]
fn activation_back_to_the_host_costs_one_wait_under_staged() {
    let graph = || {
        let mut g = Graph::new();
        let wd = weight(&mut g, "wd", &[1.0, 2.0, 3.0, 4.0], "cpu-async");
        let wc = weight(&mut g, "wc", &[10.0; 4], "cpu");
        let x = g.input("x", &[4], DType::F32).unwrap();
        let b = g.mul(x, wd).unwrap(); // cpu-async
        let c = g.mul(b, wc).unwrap(); // cpu (expands... pinned by wc)
        g.output("c", c).unwrap();
        g
    };
    let mut outs = Vec::new();
    for policy in SyncPolicy::ALL {
        let (sc, dev, host) = sched(policy, 1);
        let mut plan = sc.compile(&graph()).unwrap();
        assert_eq!(plan.split_backends(), vec![0, 1]);
        let inputs = [("x", f32_bytes(&[1.0, 1.0, 2.0, 2.0]))];
        run_steps(&mut plan, &inputs, 1, "c");
        // (host waits, elided on cpu-async, elided on cpu): stock elides W1 on cpu-async and
        // W3 and W5 on cpu; relaxed its opening sync on cpu-async and, on cpu, the host split's
        // opening and closing syncs and W5 of its stock fallback copy.
        let (waits, elided_dev, elided_host) = match policy {
            SyncPolicy::Stock => (3, 1, 2),
            SyncPolicy::Relaxed => (3, 1, 3),
            SyncPolicy::Staged => (1, 0, 0),
        };
        let mut last = Vec::new();
        for step in 0..3 {
            let (before, dev_before) = (total(&[&dev, &host]), dev.stats().snapshot());
            last = run_steps(&mut plan, &inputs, 1, "c");
            let d = total(&[&dev, &host]).since(&before);
            let dd = dev.stats().snapshot().since(&dev_before);
            assert_eq!(d.host_waits, waits, "{policy} step {step}");
            assert_eq!(
                (dd.elided_syncs, d.elided_syncs - dd.elided_syncs),
                (elided_dev, elided_host),
                "{policy} step {step}: elided syncs on cpu-async, on cpu"
            );
            assert_eq!(
                dd.d2h_copies, 1,
                "{policy} step {step}: one device read (the activation); the output is host memory"
            );
        }
        outs.push(last);
    }
    assert_eq!(floats(&outs[0]), vec![10.0, 20.0, 60.0, 80.0]);
    assert!(outs.windows(2).all(|w| w[0] == w[1]));
}

/// Invariant 4 (W0): a split with no inputs after another backend's split does not start
/// before that split ended. Under `staged` the host split waits on the device split's event;
/// the device split sits behind a closed gate, opened by a helper thread only once the host is
/// blocked in that wait.
#[test]
fn split_without_inputs_never_overlaps_the_previous_split() {
    for policy in SyncPolicy::ALL {
        let (sc, dev, _host) = sched(policy, 1);
        let mut g = Graph::new();
        let wd = weight(&mut g, "wd", &[1.0; 4], "cpu-async");
        let wc = weight(&mut g, "wc", &[3.0; 4], "cpu");
        let x = g.input("x", &[4], DType::F32).unwrap();
        let b = g.mul(x, wd).unwrap();
        let c = g.scale(wc, 2.0).unwrap(); // a cpu split that reads nothing from other backends
        g.output("b", b).unwrap();
        g.output("c", c).unwrap();
        let mut plan = sc.compile(&g).unwrap();
        assert_eq!(plan.split_backends(), vec![0, 1]);
        plan.set_input("x", &f32_bytes(&[2.0; 4])).unwrap();
        let gate = Watched::close(&*dev);
        // The host split must wait for the device split, which sits behind the gate.
        let blocked = blocks_until_opened(&dev, &gate, || plan.compute().unwrap());
        gate.open();
        assert!(
            blocked,
            "{policy}: compute returned while the device split was behind its closed gate: \
             the host split did not wait for it"
        );
        let ev = dev.event_new().unwrap();
        dev.event_record(&ev).unwrap();
        assert!(
            ev.is_complete(),
            "{policy}: the device split finished before the host split ran"
        );
        assert_eq!(floats(&plan.get_output("b").unwrap()), vec![2.0; 4]);
        assert_eq!(floats(&plan.get_output("c").unwrap()), vec![6.0; 4]);
        // Ungated steps: W0 is one host wait on cpu-async under every policy (stock and
        // relaxed synchronize it, staged waits on its event from the synchronous host), on top
        // of the input's (stock W2, relaxed's closing sync) and the read of `b`.
        let waits = match policy {
            SyncPolicy::Stock | SyncPolicy::Relaxed => 3,
            SyncPolicy::Staged => 2,
        };
        for step in 0..3 {
            let before = dev.stats().snapshot();
            plan.set_input("x", &f32_bytes(&[step as f32; 4])).unwrap();
            plan.compute().unwrap();
            assert_eq!(floats(&plan.get_output("b").unwrap()), vec![step as f32; 4]);
            let d = dev.stats().snapshot().since(&before);
            assert_eq!(d.host_waits, waits, "{policy} step {step}: host waits");
        }
    }
}

/// `cpu-async` with its calls to `event_record` counted; every primitive the policies use is
/// forwarded.
struct CountsRecords {
    inner: CpuAsyncBackend,
    records: AtomicU64,
}

impl CountsRecords {
    fn new() -> Arc<Self> {
        Arc::new(CountsRecords {
            inner: CpuAsyncBackend::new("cpu-async").unwrap(),
            records: AtomicU64::new(0),
        })
    }
    fn records(&self) -> u64 {
        self.records.load(Ordering::Relaxed)
    }
}

impl Backend for CountsRecords {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn caps(&self) -> Caps {
        self.inner.caps()
    }
    fn supports_op(&self, op: &Op, dst: DType, srcs: &[DType]) -> bool {
        self.inner.supports_op(op, dst, srcs)
    }
    common::forward_required!();
    fn set_tensor_async_staged(
        &self,
        dst: BufferId,
        offset: usize,
        data: &[u8],
    ) -> lowsync_backend::Result<()> {
        self.inner.set_tensor_async_staged(dst, offset, data)
    }
    fn read_async(
        &self,
        src: BufferId,
        offset: usize,
        len: usize,
    ) -> lowsync_backend::Result<Box<dyn Readback>> {
        self.inner.read_async(src, offset, len)
    }
    fn event_new(&self) -> lowsync_backend::Result<Arc<dyn Event>> {
        self.inner.event_new()
    }
    fn event_record(&self, ev: &Arc<dyn Event>) -> lowsync_backend::Result<()> {
        self.records.fetch_add(1, Ordering::Relaxed);
        self.inner.event_record(ev)
    }
    fn event_wait(&self, ev: &Arc<dyn Event>) -> lowsync_backend::Result<()> {
        self.inner.event_wait(ev)
    }
}

/// A split records its event only where a wait takes it: the next split's W0, or (pipelined)
/// W1/W3 of a later step on the same copy. A one-backend decode step records none: on CUDA
/// a record launches the copy batch holding the step's token read, and the read event it
/// then records again makes the wait for the previous token last until this step ends, which
/// undid launch-ahead.
#[test]
fn a_split_records_its_event_only_where_a_wait_takes_it() {
    let one_split = || {
        let mut g = Graph::new();
        let w = weight(&mut g, "w", &[1.0, 2.0, 3.0, 4.0], "cpu-async");
        let x = g.input("x", &[4], DType::F32).unwrap();
        let y = g.mul(x, w).unwrap();
        g.output("y", y).unwrap();
        g
    };
    for (n_copies, per_step) in [(1, 0), (2, 1)] {
        let dev = CountsRecords::new();
        let sc = Sched::new(
            vec![dev.clone() as Arc<dyn Backend>],
            SyncPolicy::Staged,
            n_copies,
        )
        .unwrap();
        let mut plan = sc.compile(&one_split()).unwrap();
        assert_eq!(plan.split_backends(), vec![0]);
        for step in 0..3 {
            let before = dev.records();
            plan.set_input("x", &f32_bytes(&[step as f32; 4])).unwrap();
            let mut rb = plan.compute_read_async("y").unwrap();
            let y = floats(rb.wait().unwrap());
            assert_eq!(
                y,
                [1.0, 2.0, 3.0, 4.0]
                    .iter()
                    .map(|k| k * step as f32)
                    .collect::<Vec<_>>()
            );
            assert_eq!(
                dev.records() - before,
                per_step,
                "n_copies {n_copies} step {step}: event records"
            );
        }
    }
    // W0: the host split after the device split waits on the device split's event.
    let dev = CountsRecords::new();
    let host: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let sc = Sched::new(
        vec![dev.clone() as Arc<dyn Backend>, host],
        SyncPolicy::Staged,
        1,
    )
    .unwrap();
    let mut g = Graph::new();
    let wd = weight(&mut g, "wd", &[1.0; 4], "cpu-async");
    let wc = weight(&mut g, "wc", &[3.0; 4], "cpu");
    let x = g.input("x", &[4], DType::F32).unwrap();
    let b = g.mul(x, wd).unwrap();
    let c = g.scale(wc, 2.0).unwrap();
    g.output("b", b).unwrap();
    g.output("c", c).unwrap();
    let mut plan = sc.compile(&g).unwrap();
    assert_eq!(plan.split_backends(), vec![0, 1]);
    for step in 0..3 {
        let before = dev.records();
        plan.set_input("x", &f32_bytes(&[step as f32; 4])).unwrap();
        plan.compute().unwrap();
        assert_eq!(floats(&plan.get_output("b").unwrap()), vec![step as f32; 4]);
        assert_eq!(dev.records() - before, 1, "W0 step {step}: event records");
    }
}

/// Invariants 2 and 3: an activation computed on the host and copied to the device is not
/// reused by the host before the copy ran — the next step overwrites it while the device split
/// still waits behind the gate, and each step's value reaches the KV-style persistent rows.
#[test]
fn host_activation_overwritten_by_the_next_step_still_reaches_the_queued_split() {
    for policy in SyncPolicy::ALL {
        let (sc, dev, _host) = sched(policy, 1);
        let mut g = Graph::new();
        let wa = g
            .weight(
                "wa",
                &[1, 4],
                DType::F32,
                Arc::from(f32_bytes(&[1.0, 2.0, 3.0, 4.0])),
                Some("cpu".into()),
            )
            .unwrap();
        let kv = g.persistent("kv", &[2, 4], DType::F32).unwrap();
        g.pin(kv, "cpu-async").unwrap();
        let x = g.input("x", &[1, 4], DType::F32).unwrap();
        let slot = g.input("slot", &[1], DType::I32).unwrap();
        let act = g.mul(x, wa).unwrap(); // cpu
        let rows = g.set_rows(kv, act, slot).unwrap(); // cpu-async
        let out = g.scale(rows, 1.0).unwrap();
        g.output("rows", out).unwrap();
        let mut plan = sc.compile(&g).unwrap();
        let gate = (policy == SyncPolicy::Staged).then(|| Watched::close(&*dev));
        for (step, v) in [(0i32, 1.0f32), (1, 5.0)] {
            plan.set_input("x", &f32_bytes(&[v; 4])).unwrap();
            plan.set_input("slot", &step.to_ne_bytes()).unwrap();
            plan.compute().unwrap();
        }
        if let Some(gate) = gate {
            let ev = dev.event_new().unwrap();
            dev.event_record(&ev).unwrap();
            assert!(!ev.is_complete(), "both steps are queued behind the gate");
            gate.open();
        }
        assert_eq!(
            floats(&plan.get_output("rows").unwrap()),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0],
            "{policy}"
        );
    }
}

/// Stock with `n_copies > 1` (pipelined): W1 waits on the event of the copy it overwrites, not
/// on the whole stream. Each step's read observed everything, so each input's W1 is an elided
/// event wait, then W2 a blocking write: U + 1 host waits and U elided syncs per step, as with
/// one copy, the copies rotating.
#[test]
fn pipelined_stock_waits_on_the_event_of_the_copy_it_overwrites() {
    let (sc, dev, host) = sched(SyncPolicy::Stock, 4);
    let mut plan = sc.compile(&u_a_graph(2, 1)).unwrap();
    let inputs = [("x0", f32_bytes(&[1.0; 4])), ("x1", f32_bytes(&[2.0; 4]))];
    run_steps(&mut plan, &inputs, 1, "y");
    for step in 0..6 {
        let copy = plan.next_copy();
        let (bd, bh) = (dev.stats().snapshot(), host.stats().snapshot());
        let y = run_steps(&mut plan, &inputs, 1, "y");
        assert_eq!(floats(&y), vec![5.0, 6.0, 7.0, 8.0]);
        let (d, h) = (
            dev.stats().snapshot().since(&bd),
            host.stats().snapshot().since(&bh),
        );
        assert_eq!(
            (d.host_waits, d.elided_syncs, h.host_waits, d.h2d_copies),
            (3, 2, 0, 3),
            "step {step} (copy {copy}): host waits, elided syncs, cpu waits, H2D copies"
        );
    }
}

#[test]
fn pipelined_copies_rotate_and_return_to_copy_zero_after_an_idle_synchronize() {
    let (sc, _dev, _host) = sched(SyncPolicy::Staged, 4);
    let mut plan = sc.compile(&u_a_graph(2, 1)).unwrap();
    let mut seen = Vec::new();
    for _ in 0..6 {
        seen.push(plan.next_copy());
        plan.set_input("x0", &f32_bytes(&[1.0; 4])).unwrap();
        plan.set_input("x1", &f32_bytes(&[2.0; 4])).unwrap();
        plan.compute().unwrap();
    }
    assert_eq!(seen, vec![0, 1, 2, 3, 0, 1]);
    plan.synchronize().unwrap();
    assert_eq!(plan.next_copy(), 0);
    assert_eq!(
        floats(&plan.get_output("y").unwrap()),
        vec![5.0, 6.0, 7.0, 8.0]
    );
}

// ---- placement -------------------------------------------------------------------------------

/// `cpu` without `gelu` (to test "no backend supports this op").
fn no_gelu() -> Masked<CpuBackend> {
    let inner = CpuBackend::new();
    Masked {
        name: "no-gelu",
        caps: inner.caps(),
        inner,
        refuse: |op| *op == Op::Gelu,
    }
}

fn gelu_graph() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", &[4], DType::F32).unwrap();
    let y = g.gelu(x).unwrap();
    g.output("y", y).unwrap();
    g
}

#[test]
fn an_op_no_backend_supports_is_a_clear_error_and_another_backend_can_take_it() {
    let only: Vec<Arc<dyn Backend>> = vec![Arc::new(no_gelu())];
    let err = Sched::with_debug_realloc(only, SyncPolicy::Staged, 1, 0)
        .unwrap()
        .compile(&gelu_graph())
        .err()
        .unwrap();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::NoBackend { .. }) && msg.contains("gelu") && msg.contains("no-gelu"),
        "{msg}"
    );
    let both: Vec<Arc<dyn Backend>> = vec![
        Arc::new(no_gelu()),
        Arc::new(CpuAsyncBackend::new("cpu-async").unwrap()),
    ];
    let sc = Sched::with_debug_realloc(both, SyncPolicy::Staged, 1, 0).unwrap();
    let plan = sc.compile(&gelu_graph()).unwrap();
    assert_eq!(
        plan.split_backends(),
        vec![1],
        "gelu falls to the next backend that has it"
    );
}

#[test]
fn placement_pins_inputs_to_the_host_and_weight_consumers_to_the_weight() {
    let (sc, _, _) = sched(SyncPolicy::Staged, 1);
    let g = u_a_graph(2, 1);
    let a = analyze(&g, sc.backends(), Some(1), 1, None).unwrap();
    for (i, t) in g.tensors().iter().enumerate() {
        match t.op {
            Op::Input => assert_eq!(a.placement[i], 1, "inputs start on the host"),
            Op::Weight => assert_eq!(
                a.placement[i],
                if t.name.as_deref() == Some("wd") {
                    0
                } else {
                    1
                }
            ),
            Op::Scale { .. } => assert_eq!(a.placement[i], 1, "reads a cpu weight"),
            _ => assert_eq!(
                a.placement[i], 0,
                "expanded from the cpu-async weight's consumer"
            ),
        }
    }
    assert_eq!(a.splits.len(), 2);
    assert_eq!(a.splits[1].user_inputs.len(), 2);
    assert_eq!(a.splits[1].foreign.len(), 1);
    // Deterministic.
    let again = analyze(&g, sc.backends(), Some(1), 1, None).unwrap();
    assert_eq!(a.placement, again.placement);
}

#[test]
fn inconsistent_user_placements_are_clear_errors_and_the_context_stays_usable() {
    let (sc, _, _) = sched(SyncPolicy::Staged, 1);
    let mut g = Graph::new();
    let w = weight(&mut g, "w", &[1.0; 4], "cuda");
    let y = g.scale(w, 1.0).unwrap();
    g.output("y", y).unwrap();
    let msg = sc.compile(&g).err().unwrap().to_string();
    assert!(msg.contains("`w`") && msg.contains("cuda"), "{msg}");
    // The same persistent name on two backends across plans.
    let kv_graph = |backend: &str| {
        let mut g = Graph::new();
        let kv = g.persistent("kv", &[2, 4], DType::F32).unwrap();
        g.pin(kv, backend).unwrap();
        let y = g.scale(kv, 1.0).unwrap();
        g.output("y", y).unwrap();
        g
    };
    sc.compile(&kv_graph("cpu-async")).unwrap();
    let msg = sc.compile(&kv_graph("cpu")).err().unwrap().to_string();
    assert!(msg.contains("`kv` lives on `cpu-async`"), "{msg}");
    let mut plan = sc.compile(&u_a_graph(1, 1)).unwrap();
    plan.set_input("x0", &f32_bytes(&[1.0; 4])).unwrap();
    plan.compute().unwrap();
    assert_eq!(
        floats(&plan.get_output("y").unwrap()),
        vec![3.0, 4.0, 5.0, 6.0]
    );
}

#[test]
fn plans_of_one_context_share_weights_and_persistent_state_by_name() {
    let (sc, dev, _) = sched(SyncPolicy::Staged, 1);
    let g = |scale: f32| {
        let mut g = Graph::new();
        let kv = g.persistent("kv", &[2, 4], DType::F32).unwrap();
        let w = weight(&mut g, "w", &[1.0, 2.0, 3.0, 4.0], "cpu-async");
        let x = g.input("x", &[1, 4], DType::F32).unwrap();
        let slot = g.input("slot", &[1], DType::I32).unwrap();
        let v = g.mul(x, w).unwrap();
        let v = g.scale(v, scale).unwrap();
        let r = g.set_rows(kv, v, slot).unwrap();
        let r = g.scale(r, 1.0).unwrap();
        g.output("kv_out", r).unwrap();
        g
    };
    let mut a = sc.compile(&g(1.0)).unwrap();
    let uploads = dev.stats().snapshot().h2d_copies;
    let mut b = sc.compile(&g(10.0)).unwrap();
    assert_eq!(
        dev.stats().snapshot().h2d_copies,
        uploads,
        "the second plan uploads no weight"
    );
    a.set_input("x", &f32_bytes(&[1.0; 4])).unwrap();
    a.set_input("slot", &0i32.to_ne_bytes()).unwrap();
    a.compute().unwrap();
    b.set_input("x", &f32_bytes(&[1.0; 4])).unwrap();
    b.set_input("slot", &1i32.to_ne_bytes()).unwrap();
    b.compute().unwrap();
    assert_eq!(
        floats(&b.get_output("kv_out").unwrap()),
        vec![1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0]
    );
}

// ---- reserve and debug-realloc ---------------------------------------------------------------

/// A chain over `[rows, 16]` with `extra` additional nodes.
fn chain(rows: usize, extra: usize) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", &[rows, 16], DType::F32).unwrap();
    let w = g
        .weight("w", &[16, 16], DType::F32, Arc::from(vec![0u8; 1024]), None)
        .unwrap();
    let mut h = g.mul_mat(x, w).unwrap();
    for _ in 0..2 + extra {
        h = g.silu(h).unwrap();
    }
    g.output("y", h).unwrap();
    g
}

fn debug_sched(level: u8) -> (Arc<Sched>, Arc<dyn Backend>) {
    let dev: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    (
        Sched::with_debug_realloc(vec![dev.clone()], SyncPolicy::Staged, 1, level).unwrap(),
        dev,
    )
}

#[test]
fn state_independent_shapes_run_clean_at_level_1_and_2_after_the_worst_case_reserve() {
    for level in [1u8, 2] {
        let (sc, dev) = debug_sched(level);
        sc.reserve(&chain(32, 0)).unwrap(); // prefill bucket: the worst case
        for _ in 0..5 {
            for rows in [1usize, 32, 7] {
                let mut p = sc.compile(&chain(rows, 0)).unwrap();
                p.set_input("x", &vec![0u8; rows * 64]).unwrap();
                p.compute().unwrap();
                p.get_output("y").unwrap();
            }
        }
        assert_eq!(dev.stats().snapshot().reallocs, 0, "level {level}");
    }
}

#[test]
fn under_reserved_plan_counts_a_realloc_and_never_shrinks() {
    let (sc, dev) = debug_sched(0);
    sc.reserve(&chain(1, 0)).unwrap();
    sc.compile(&chain(32, 0)).unwrap();
    assert_eq!(dev.stats().snapshot().reallocs, 1);
    // Back to the small graph: it fits the (grown) reserve; nothing shrinks or reallocates.
    sc.compile(&chain(1, 0)).unwrap();
    sc.compile(&chain(32, 0)).unwrap();
    assert_eq!(dev.stats().snapshot().reallocs, 1);
}

/// S2's bug class: a graph whose node count depends on runtime state. The first mismatch
/// re-reserves ("expected": the graph size changed); the next step has the same graph size
/// but bigger tensors than the state-shaped reserve, which level 1 reports.
#[test]
fn a_graph_whose_shape_depends_on_state_is_caught_at_level_1() {
    let (sc, _dev) = debug_sched(1);
    sc.reserve(&chain(32, 0)).unwrap(); // the worst-case reserve
                                        // "After seq_cp" the model takes another path: 3 fewer... here 3 more nodes, sized by state.
    sc.compile(&chain(4, 3)).unwrap();
    let err = sc.compile(&chain(5, 3)).err().expect("caught");
    assert!(matches!(err, Error::Realloc(_)), "{err}");
    assert!(
        err.to_string().contains("depends on runtime state"),
        "{err}"
    );
    // Level 2 rejects the first re-reserve already; level 0 lets it through, counting.
    let (sc2, _) = debug_sched(2);
    sc2.reserve(&chain(32, 0)).unwrap();
    assert!(matches!(sc2.compile(&chain(4, 3)), Err(Error::Realloc(_))));
    let (sc0, dev0) = debug_sched(0);
    sc0.reserve(&chain(32, 0)).unwrap();
    sc0.compile(&chain(4, 3)).unwrap();
    sc0.compile(&chain(5, 3)).unwrap();
    assert_eq!(dev0.stats().snapshot().reallocs, 2);
}

// ---- random graphs ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum RandOp {
    Add(usize, usize),
    Mul(usize, usize),
    Scale(usize),
    Silu(usize),
    MatMul(usize, bool),
    Norm(usize),
    TransposeCont(usize),
}

fn rand_op() -> impl Strategy<Value = RandOp> {
    prop_oneof![
        (0usize..64, 0usize..64).prop_map(|(a, b)| RandOp::Add(a, b)),
        (0usize..64, 0usize..64).prop_map(|(a, b)| RandOp::Mul(a, b)),
        (0usize..64).prop_map(RandOp::Scale),
        (0usize..64).prop_map(RandOp::Silu),
        (0usize..64, any::<bool>()).prop_map(|(a, d)| RandOp::MatMul(a, d)),
        (0usize..64).prop_map(RandOp::Norm),
        (0usize..64).prop_map(RandOp::TransposeCont),
    ]
}

/// A random DAG over `[8, 8]` f32 tensors with two inputs and two weights (one per backend:
/// matmuls against them pin nodes to either backend); the last `n_out` tensors are outputs.
fn random_graph(ops: &[RandOp], n_out: usize) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", &[8, 8], DType::F32).unwrap();
    let x2 = g.input("x2", &[8, 8], DType::F32).unwrap();
    let wdata = |k: usize| -> Arc<[u8]> {
        Arc::from(f32_bytes(
            &(0..64)
                .map(|i| (((i * 37 + k) % 17) as f32 - 8.0) / 16.0)
                .collect::<Vec<_>>(),
        ))
    };
    let w_dev = g
        .weight(
            "w_dev",
            &[8, 8],
            DType::F32,
            wdata(1),
            Some("cpu-async".into()),
        )
        .unwrap();
    let w_host = g
        .weight("w_host", &[8, 8], DType::F32, wdata(2), Some("cpu".into()))
        .unwrap();
    let mut pool = vec![x, x2];
    for op in ops {
        let pick = |i: usize| pool[i % pool.len()];
        let t = match *op {
            RandOp::Add(a, b) => g.add(pick(a), pick(b)),
            RandOp::Mul(a, b) => g.mul(pick(a), pick(b)),
            RandOp::Scale(a) => g.scale(pick(a), 0.5),
            RandOp::Silu(a) => g.silu(pick(a)),
            RandOp::MatMul(a, dev) => g.mul_mat(pick(a), if dev { w_dev } else { w_host }),
            RandOp::Norm(a) => g.rms_norm(pick(a), 1e-5),
            RandOp::TransposeCont(a) => {
                let t = g.transpose(pick(a), 0, 1).unwrap();
                g.cont(t)
            }
        }
        .unwrap();
        pool.push(t);
    }
    let start = pool.len().saturating_sub(n_out).max(2);
    for (i, t) in pool[start..].iter().enumerate() {
        g.output(&format!("o{i}"), *t).unwrap();
    }
    if pool.len() == 2 {
        let t = g.add(x, x2).unwrap();
        g.output("o0", t).unwrap();
    }
    g
}

fn byte_span(t: &TensorRef) -> (usize, usize) {
    (t.byte_offset, t.byte_offset + t.byte_extent())
}

/// What each split's graph reports as read after it (`ExecGraph::scratch`) covers every later
/// node's read of a result the split left in its scratch (one no node and no foreign copy —
/// `a`'s copy items, written as their split starts — overwrote since); and a plan of one
/// split, unpipelined, keeps nothing.
fn later_reads_are_kept(plan: &Plan, a: &Analysis, n_copies: usize) -> Result<(), String> {
    for c in 0..n_copies {
        let graphs: Vec<_> = (0..plan.n_splits())
            .map(|s| plan.exec_graph(s, c))
            .collect();
        for (s, g) in graphs.iter().enumerate() {
            let Some(sc) = &g.scratch else {
                // No scratch buffer on its backend (every result is an output).
                continue;
            };
            if graphs.len() == 1 && n_copies == 1 && !sc.kept.is_empty() {
                return Err(format!("one split keeps {:?}", sc.kept));
            }
            let mut left: Vec<(usize, usize)> = g
                .nodes
                .iter()
                .filter(|n| n.dst.buffer == sc.buffer)
                .map(|n| byte_span(&n.dst))
                .collect();
            let cut =
                |left: Vec<(usize, usize)>, (w0, w1): (usize, usize)| -> Vec<(usize, usize)> {
                    left.into_iter()
                        .flat_map(|(l0, l1)| [(l0, l1.min(w0)), (l0.max(w1), l1)])
                        .filter(|&(x, y)| x < y)
                        .collect()
                };
            let backend = a.splits[s].backend;
            for (s2, g2) in graphs.iter().enumerate().skip(s + 1) {
                if a.splits[s2].backend == backend {
                    let bi = &a.per_backend[backend];
                    for ((key, item), &off) in bi.keys.iter().zip(&bi.items).zip(&bi.plan.offsets) {
                        if matches!(*key, ItemKey::Copy { split, copy, .. } if split == s2 && copy == c)
                        {
                            left = cut(left, (off, off + item.size));
                        }
                    }
                }
                for n in &g2.nodes {
                    for src in n.srcs.iter().filter(|t| t.buffer == sc.buffer) {
                        let (a, b) = byte_span(src);
                        let ours = left.iter().any(|&(l0, l1)| a < l1 && l0 < b);
                        if ours && !sc.read_after(src.buffer, a, b) {
                            return Err(format!(
                                "split {s} copy {c}: {} reads [{a}, {b}) of it later, kept {:?}",
                                n.name, sc.kept
                            ));
                        }
                    }
                    if n.dst.buffer == sc.buffer && n.op != Op::SetRows && n.dst.is_contiguous() {
                        left = cut(left, byte_span(&n.dst));
                    }
                }
            }
        }
    }
    Ok(())
}

fn eval(plan: &mut Plan, steps: usize) -> Vec<Vec<u8>> {
    let names: Vec<String> = plan.outputs().iter().map(|o| o.name.clone()).collect();
    let mut out = Vec::new();
    for s in 0..steps {
        let xv: Vec<f32> = (0..64)
            .map(|i| (i as f32 - 30.0 + s as f32) / 10.0)
            .collect();
        let x2v: Vec<f32> = (0..64).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect();
        plan.set_input("x", &f32_bytes(&xv)).unwrap();
        plan.set_input("x2", &f32_bytes(&x2v)).unwrap();
        plan.compute().unwrap();
        out = names.iter().map(|n| plan.get_output(n).unwrap()).collect();
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    #[test]
    fn random_graphs_give_identical_results_under_every_policy_placement_and_copy_count(
        ops in prop::collection::vec(rand_op(), 1..32),
        n_out in 1usize..4,
    ) {
        let g = random_graph(&ops, n_out);
        // Reference: everything on the host, stock.
        let host_only: Vec<Arc<dyn Backend>> = vec![Arc::new(CpuBackend::new()), Arc::new(CpuAsyncBackend::new("cpu-async").unwrap())];
        let mut reference = Sched::with_debug_realloc(host_only, SyncPolicy::Stock, 1, 0).unwrap().compile(&g).unwrap();
        let want = eval(&mut reference, 2);
        for policy in SyncPolicy::ALL {
            for n_copies in [1usize, 4] {
                let (sc, _, _) = sched(policy, n_copies);
                let a = analyze(&g, sc.backends(), Some(1), n_copies, None).unwrap();
                for bi in &a.per_backend {
                    prop_assert!(verify_items(&bi.items, &bi.plan).is_ok(), "{:?}", verify_items(&bi.items, &bi.plan));
                }
                prop_assert!(a.placement.iter().all(|&b| b < 2));
                let mut plan = sc.compile(&g).unwrap();
                let kept = later_reads_are_kept(&plan, &a, n_copies);
                prop_assert!(kept.is_ok(), "{:?}", kept);
                prop_assert_eq!(&eval(&mut plan, 2), &want, "{} n_copies={}", policy, n_copies);
            }
        }
    }
}
