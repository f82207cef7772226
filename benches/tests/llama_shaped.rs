//! The bench graph is a real graph: it runs on `cpu` and `cpu-async` with identical greedy
//! tokens, has about 400 nodes, and its per-step counts follow the policy formulas with U = 6.

use std::sync::Arc;

use lowsync_backend::Backend;
use lowsync_benches::{llama_shaped, write_step_inputs, Shape};
use lowsync_cpu::{CpuAsyncBackend, CpuBackend, NoopBackend};
use lowsync_scheduler::{Plan, SyncPolicy};

/// Greedy-decodes `steps` tokens; returns them and each step's counts.
fn decode(
    be: Arc<dyn Backend>,
    policy: SyncPolicy,
    steps: usize,
) -> (Vec<i32>, Vec<lowsync_backend::StatsSnapshot>) {
    let s = Shape::BENCH;
    let mut plan = Plan::compile(&llama_shaped(s), be.clone(), policy).unwrap();
    let mut token = 1;
    let mut tokens = Vec::new();
    let mut counts = Vec::new();
    for n in 0..steps {
        let before = be.stats().snapshot();
        write_step_inputs(&mut plan, s, n, token);
        plan.compute().unwrap();
        let out = plan.get_output("next").unwrap();
        counts.push(be.stats().snapshot().since(&before));
        token = i32::from_ne_bytes([out[0], out[1], out[2], out[3]]);
        tokens.push(token);
    }
    (tokens, counts)
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
    for policy in SyncPolicy::ALL {
        for be in [
            Arc::new(CpuAsyncBackend::new("cpu-async").unwrap()) as Arc<dyn Backend>,
            Arc::new(NoopBackend::new()),
        ] {
            let name = be.name().to_string();
            let (_, counts) = decode(be, policy, 6);
            let (waits, h2d) = match policy {
                SyncPolicy::Staged => (1, 1),
                SyncPolicy::Relaxed => (2, 6),
                SyncPolicy::Stock => (7, 6),
            };
            // Every steady step (after the first) on its own, not their average.
            for (n, d) in counts.iter().enumerate().skip(1) {
                assert_eq!(
                    (d.host_waits, d.h2d_copies, d.d2h_copies, d.reallocs),
                    (waits, h2d, 1, 0),
                    "{name} {policy} step {n}: host waits, H2D copies, reads, reallocs"
                );
            }
        }
    }
}
