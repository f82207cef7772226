//! Properties every op must have: zero-element tensors work, results are bit-identical run to
//! run and across thread counts, and malformed nodes are errors, never panics.

use lowsync_backend::{Error, TensorRef};
use lowsync_graph::{DType, Op, RopeMode};

use super::harness::*;

/// One node per op with `t` tokens (0: every tensor empty).
fn cases(mem: &mut TestMem, rng: &mut TestRng, t: usize) -> Vec<(Op, Vec<TensorRef>, TensorRef)> {
    let d = 300;
    let mut v = Vec::new();
    let mut r = |mem: &mut TestMem, dt, s: &[usize]| mem.rand(rng, dt, s);
    let x = r(mem, DType::F32, &[t, d]);
    let xh = r(mem, DType::F16, &[t, d]);
    let xb = r(mem, DType::BF16, &[t, d]);
    let bias = r(mem, DType::F16, &[d]);
    let col = r(mem, DType::F32, &[t, 1]);
    v.push((
        Op::Add,
        vec![x.clone(), bias.clone()],
        mem.zeros(DType::F32, &[t, d]),
    ));
    v.push((
        Op::Mul,
        vec![xb.clone(), col],
        mem.zeros(DType::BF16, &[t, d]),
    ));
    v.push((
        Op::Scale { scale: 0.3 },
        vec![x.clone()],
        mem.zeros(DType::F32, &[t, d]),
    ));
    v.push((Op::Silu, vec![xh.clone()], mem.zeros(DType::F16, &[t, d])));
    v.push((Op::Gelu, vec![x.clone()], mem.zeros(DType::F32, &[t, d])));
    v.push((
        Op::SwiGlu,
        vec![xh.clone(), x.clone()],
        mem.zeros(DType::F16, &[t, d]),
    ));
    v.push((
        Op::RmsNorm { eps: 1e-6 },
        vec![xb.clone()],
        mem.zeros(DType::BF16, &[t, d]),
    ));
    let q = r(mem, DType::F32, &[t, 4, 64]);
    let pos = mem.ints(&[t], &(0..t as i32).map(|p| p * 3).collect::<Vec<_>>());
    let rope = Op::Rope {
        mode: RopeMode::Normal,
        n_dims: 32,
        theta_base: 10000.0,
    };
    v.push((rope, vec![q, pos], mem.zeros(DType::F32, &[t, 4, 64])));
    let scores = r(mem, DType::F32, &[4, t, t + 7]);
    let mask = r(mem, DType::F16, &[t, t + 7]);
    v.push((
        Op::SoftMax { scale: 0.125 },
        vec![scores, mask],
        mem.zeros(DType::F32, &[4, t, t + 7]),
    ));
    let xt = transpose(&r(mem, DType::F32, &[d, t]), 0, 1);
    v.push((Op::Cpy, vec![xt], mem.zeros(DType::F16, &[t, d])));
    let y = r(mem, DType::F32, &[t, 100]);
    v.push((
        Op::Concat { axis: 1 },
        vec![x.clone(), y],
        mem.zeros(DType::F32, &[t, d + 100]),
    ));
    let table = r(mem, DType::F16, &[50, d]);
    let ids = mem.ints(
        &[t],
        &(0..t).map(|i| (i * 7 % 50) as i32).collect::<Vec<_>>(),
    );
    v.push((
        Op::GetRows,
        vec![table, ids],
        mem.zeros(DType::F32, &[t, d]),
    ));
    let cache = mem.zeros(DType::F16, &[2 * t + 1, d]);
    let idx = mem.ints(
        &[t],
        &(0..t).map(|i| (2 * i + 1) as i32).collect::<Vec<_>>(),
    );
    v.push((Op::SetRows, vec![cache.clone(), x.clone(), idx], cache));
    v.push((Op::Argmax, vec![xh.clone()], mem.zeros(DType::I32, &[t])));
    let w = r(mem, DType::F16, &[200, d]);
    v.push((
        Op::MulMat,
        vec![x.clone(), transpose(&w, 0, 1)],
        mem.zeros(DType::F32, &[t, 200]),
    ));
    let experts = r(mem, DType::BF16, &[4, d, 50]);
    let eids = mem.ints(
        &[t, 2],
        &(0..2 * t).map(|i| (i * 3 % 4) as i32).collect::<Vec<_>>(),
    );
    let ew = r(mem, DType::F32, &[t, 2]);
    v.push((
        Op::MulMatId,
        vec![experts, x, eids, ew],
        mem.zeros(DType::F32, &[t, 50]),
    ));
    v
}

#[test]
fn cases_cover_every_op_with_a_kernel() {
    let mut mem = TestMem::new();
    let names: std::collections::HashSet<_> = cases(&mut mem, &mut TestRng::new(1), 2)
        .iter()
        .map(|(op, _, _)| op.name())
        .collect();
    assert_eq!(names.len(), 16, "{names:?}");
}

#[test]
fn every_op_handles_zero_element_tensors() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(150);
    for (op, srcs, dst) in cases(&mut mem, &mut rng, 0) {
        let srcs: Vec<&TensorRef> = srcs.iter().collect();
        run(&mem, op, &dst, &srcs).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
    // Empty last axes and empty middle axes.
    let e = mem.zeros(DType::F32, &[3, 0]);
    for op in [
        Op::RmsNorm { eps: 1e-6 },
        Op::SoftMax { scale: 1.0 },
        Op::Silu,
    ] {
        let dst = mem.zeros(DType::F32, &[3, 0]);
        run(&mem, op, &dst, &[&e]).unwrap();
    }
    let x = mem.zeros(DType::F32, &[2, 0, 8]);
    let pos = mem.ints(&[2], &[1, 2]);
    let rope = Op::Rope {
        mode: RopeMode::Neox,
        n_dims: 8,
        theta_base: 10000.0,
    };
    let dst = mem.zeros(DType::F32, &[2, 0, 8]);
    run(&mem, rope, &dst, &[&x, &pos]).unwrap();
    let table = mem.zeros(DType::F32, &[4, 0]);
    let ids = mem.ints(&[2], &[3, 0]);
    let dst = mem.zeros(DType::F32, &[2, 0]);
    run(&mem, Op::GetRows, &dst, &[&table, &ids]).unwrap();
    let a = mem.tensor(DType::F32, &[2, 1], &[1., 2.]);
    let dst = mem.zeros(DType::F32, &[2, 1]);
    run(
        &mem,
        Op::Concat { axis: 1 },
        &dst,
        &[&a, &e.clone_with_shape(&[2, 0])],
    )
    .unwrap();
    assert_eq!(mem.read(&dst), vec![1., 2.]);
    let x = mem.zeros(DType::F32, &[0, 5]);
    let dst = mem.zeros(DType::I32, &[0]);
    run(&mem, Op::Argmax, &dst, &[&x]).unwrap();
}

trait WithShape {
    fn clone_with_shape(&self, shape: &[usize]) -> TensorRef;
}

impl WithShape for TensorRef {
    fn clone_with_shape(&self, shape: &[usize]) -> TensorRef {
        view(self, shape, &lowsync_graph::contiguous_strides(shape), 0)
    }
}

#[test]
fn every_op_is_bit_identical_run_to_run_and_across_thread_counts() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(151);
    // 64 tokens x 300: above the parallel threshold for every op.
    for (op, srcs, dst) in cases(&mut mem, &mut rng, 64) {
        let srcs: Vec<&TensorRef> = srcs.iter().collect();
        let mut outs = Vec::new();
        for threads in [0, 0, 1, 3] {
            let go = || run(&mem, op, &dst, &srcs).unwrap();
            if threads == 0 {
                go();
            } else {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap()
                    .install(go);
            }
            outs.push(mem.bytes(&dst));
        }
        assert!(
            outs.windows(2).all(|w| w[0] == w[1]),
            "{op:?} differs between runs"
        );
        let vals = mem.read(&dst);
        assert!(
            vals.iter().all(|v| v.is_finite()),
            "{op:?} produced non-finite values"
        );
    }
}

#[test]
fn leaf_and_view_ops_are_rejected() {
    let mut mem = TestMem::new();
    let x = mem.zeros(DType::F32, &[2]);
    for op in [Op::Input, Op::Weight, Op::Persistent, Op::View] {
        kernel_msg(run(&mem, op, &x, &[]));
        kernel_msg(run(&mem, op, &x, &[&x]));
    }
}

#[test]
fn wrong_source_count_is_an_error() {
    let mut mem = TestMem::new();
    let x = mem.zeros(DType::F32, &[2, 2]);
    let dst = mem.zeros(DType::F32, &[2, 2]);
    kernel_msg(run(&mem, Op::Add, &dst, &[&x]));
    kernel_msg(run(&mem, Op::Silu, &dst, &[&x, &x]));
    kernel_msg(run(&mem, Op::MulMatId, &dst, &[&x, &x, &x]));
    kernel_msg(run(&mem, Op::SoftMax { scale: 1.0 }, &dst, &[]));
}

#[test]
fn mismatched_shapes_and_dtypes_are_errors_not_panics() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(152);
    for (op, srcs, dst) in cases(&mut mem, &mut rng, 3) {
        let srcs: Vec<&TensorRef> = srcs.iter().collect();
        // A result with one extra row (or an extra axis for 1-D results).
        let mut shape = dst.shape.clone();
        match shape.first_mut() {
            Some(d) if op != Op::SetRows => *d += 1,
            _ => shape.push(2),
        }
        let bad = mem.zeros(dst.dtype, &shape);
        let msg = kernel_msg(run(&mem, op, &bad, &srcs));
        assert!(!msg.is_empty());
    }
    // Float where an index is required, and an i32 result where a float is required.
    let x = mem.zeros(DType::F32, &[2, 3]);
    let fids = mem.zeros(DType::F32, &[2]);
    let dst = mem.zeros(DType::F32, &[2, 3]);
    kernel_msg(run(&mem, Op::GetRows, &dst, &[&x, &fids]));
    let dst = mem.zeros(DType::I32, &[2, 3]);
    kernel_msg(run(&mem, Op::Silu, &dst, &[&x]));
    let dst = mem.zeros(DType::F32, &[2]);
    kernel_msg(run(&mem, Op::Argmax, &dst, &[&x]));
    // Strides that do not match the shape's rank.
    let mut broken = x.clone();
    broken.strides.pop();
    kernel_msg(run(&mem, Op::Silu, &x, &[&broken]));
}

#[test]
fn a_tensor_outside_its_buffer_is_an_error() {
    let mut mem = TestMem::new();
    let x = mem.zeros(DType::F32, &[4]);
    let past = view(&x, &[4], &[1], 3);
    let dst = mem.zeros(DType::F32, &[4]);
    match run(&mem, Op::Silu, &dst, &[&past]) {
        Err(Error::OutOfBounds { .. }) => {}
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
}
