//! The bench graph is a real graph: it runs on `cpu` and `cpu-async` with identical greedy
//! tokens, has about 400 nodes, and its per-step counts follow the policy formulas with U = 6.

use std::sync::Arc;

use lowsync_backend::Backend;
use lowsync_benches::{llama_shaped, write_step_inputs, Shape};
use lowsync_cpu::{CpuAsyncBackend, CpuBackend, NoopBackend};
use lowsync_scheduler::{Plan, SyncPolicy};

fn decode(
    be: Arc<dyn Backend>,
    policy: SyncPolicy,
    steps: usize,
) -> (Vec<i32>, lowsync_backend::StatsSnapshot) {
    let s = Shape::BENCH;
    let mut plan = Plan::compile(&llama_shaped(s), be.clone(), policy).unwrap();
    let mut token = 1;
    let mut tokens = Vec::new();
    let mut before = be.stats().snapshot();
    for n in 0..steps {
        if n == 1 {
            before = be.stats().snapshot(); // steady state after the first step
        }
        write_step_inputs(&mut plan, s, n, token);
        plan.compute().unwrap();
        let out = plan.get_output("next").unwrap();
        token = i32::from_ne_bytes([out[0], out[1], out[2], out[3]]);
        tokens.push(token);
    }
    (tokens, be.stats().snapshot().since(&before))
}

#[test]
fn bench_graph_has_about_400_nodes_and_six_inputs() {
    let g = llama_shaped(Shape::BENCH);
    assert!((380..=460).contains(&g.n_nodes()), "{} nodes", g.n_nodes());
    assert_eq!(g.inputs().count(), 6);
}

#[test]
fn greedy_tokens_match_across_backends_and_policies() {
    let (reference, _) = decode(Arc::new(CpuBackend::new()), SyncPolicy::Stock, 6);
    for policy in SyncPolicy::ALL {
        let (t, _) = decode(
            Arc::new(CpuAsyncBackend::new("cpu-async").unwrap()),
            policy,
            6,
        );
        assert_eq!(t, reference, "{policy}");
    }
}

#[test]
fn steady_state_counts_per_token_follow_the_policy() {
    let steps = 5u64; // counted: steps 1..=5 of 6
    for policy in SyncPolicy::ALL {
        for be in [
            Arc::new(CpuAsyncBackend::new("cpu-async").unwrap()) as Arc<dyn Backend>,
            Arc::new(NoopBackend::new()),
        ] {
            let name = be.name().to_string();
            let (_, d) = decode(be, policy, 6);
            let (waits, h2d) = match policy {
                SyncPolicy::Staged => (1, 1),
                SyncPolicy::Relaxed => (2, 6),
                SyncPolicy::Stock => (7, 6),
            };
            assert_eq!(d.host_waits, waits * steps, "{name} {policy}");
            assert_eq!(d.h2d_copies, h2d * steps, "{name} {policy}");
            assert_eq!(d.d2h_copies, steps);
            assert_eq!(d.reallocs, 0);
        }
    }
}
