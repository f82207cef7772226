//! Per-step host cost of the single-backend executor on a llama-shaped graph (~400 nodes,
//! 6 inputs) on the `noop` backend, which runs no kernels — so what is timed is the host's
//! own work: writing inputs, the policy's copies and waits, queuing the graph, reading 4 bytes.
//! Also one step on `cpu-async` for reference.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use lowsync_backend::Backend;
use lowsync_benches::{llama_shaped, write_step_inputs, Shape};
use lowsync_cpu::{CpuAsyncBackend, NoopBackend};
use lowsync_scheduler::{Plan, SyncPolicy};

fn executor(c: &mut Criterion) {
    let s = Shape::BENCH;
    let graph = llama_shaped(s);
    eprintln!(
        "llama-shaped bench graph: {} nodes, {} leafs",
        graph.n_nodes(),
        graph.n_leafs()
    );
    let mut group = c.benchmark_group("executor_step_noop");
    for policy in SyncPolicy::ALL {
        let be: Arc<dyn Backend> = Arc::new(NoopBackend::new());
        let mut plan = Plan::compile(&graph, be, policy).unwrap();
        let mut n = 0usize;
        group.bench_function(policy.name(), |b| {
            b.iter(|| {
                write_step_inputs(&mut plan, s, n, 1);
                plan.compute().unwrap();
                let next = plan.get_output("next").unwrap();
                n += 1;
                next
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("executor_step_cpu_async");
    for policy in SyncPolicy::ALL {
        let be: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
        let mut plan = Plan::compile(&graph, be, policy).unwrap();
        let mut n = 0usize;
        group.bench_function(policy.name(), |b| {
            b.iter(|| {
                write_step_inputs(&mut plan, s, n, 1);
                plan.compute().unwrap();
                n += 1;
                plan.get_output("next").unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, executor);
criterion_main!(benches);
