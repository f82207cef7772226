//! Scheduler host cost per step: the llama-shaped graph (~400 nodes, 6 user inputs) over two
//! `noop` backends — the output head pinned to the second, so the step has two splits and an
//! activation crossing between them — placed, split and reserved once. Every policy side by
//! side; `noop` runs no kernels, so this is the host's own work per step.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use lowsync_backend::Backend;
use lowsync_benches::{llama_shaped_two_splits, write_step_inputs, Shape};
use lowsync_cpu::NoopBackend;
use lowsync_scheduler::{Sched, SyncPolicy};

fn scheduler(c: &mut Criterion) {
    let s = Shape::BENCH;
    let graph = llama_shaped_two_splits(s, "noop:1");
    let mut group = c.benchmark_group("scheduler_step_two_splits_noop");
    for policy in SyncPolicy::ALL {
        let backends: Vec<Arc<dyn Backend>> = vec![
            Arc::new(NoopBackend::named("noop:0")),
            Arc::new(NoopBackend::named("noop:1")),
        ];
        let sched = Sched::with_debug_realloc(backends, policy, 1, 2).unwrap();
        let mut plan = sched.compile(&graph).unwrap();
        assert_eq!(plan.n_splits(), 2, "{:?}", plan.split_backends());
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

criterion_group!(benches, scheduler);
criterion_main!(benches);
