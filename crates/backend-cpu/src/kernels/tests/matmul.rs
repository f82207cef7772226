//! `MulMat` (batch broadcast, GQA, transposed and mixed-dtype operands, empty dimensions,
//! thread-count independence) and `MulMatId`.

use lowsync_backend::TensorRef;
use lowsync_graph::{DType, Op};
use proptest::prelude::*;

use super::harness::*;

/// numpy-style `a @ b` with GQA batch broadcast, over logical (row-major) values.
fn ref_mul_mat(a: &[f64], sa: &[usize], b: &[f64], sb: &[usize]) -> Vec<f64> {
    let (ra, rb) = (sa.len(), sb.len());
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    let nb = ra.max(rb) - 2;
    let dim = |s: &[usize], i: usize| {
        let own = s.len() - 2;
        if i + own >= nb {
            s[i + own - nb]
        } else {
            1
        }
    };
    let batch: Vec<usize> = (0..nb).map(|i| dim(sa, i).max(dim(sb, i))).collect();
    // Flat matrix index of an operand for output batch `idx`.
    let mat_index = |s: &[usize], idx: &[usize]| {
        let own = s.len() - 2;
        (0..own).fold(0, |acc, j| {
            let i = j + nb - own;
            acc * s[j] + idx[i] / (batch[i] / s[j])
        })
    };
    let mut out = Vec::new();
    for bi in 0..batch.iter().product() {
        let idx = unravel(&batch, bi);
        let (ma, mb) = (mat_index(sa, &idx) * m * k, mat_index(sb, &idx) * k * n);
        for i in 0..m {
            for j in 0..n {
                out.push((0..k).map(|p| a[ma + i * k + p] * b[mb + p * n + j]).sum());
            }
        }
    }
    out
}

fn out_shape(sa: &[usize], sb: &[usize]) -> Vec<usize> {
    let mut s = lowsync_graph::mul_mat_batch(&sa[..sa.len() - 2], &sb[..sb.len() - 2])
        .expect("valid batch");
    s.extend([sa[sa.len() - 2], sb[sb.len() - 1]]);
    s
}

/// Runs `a @ b` into `dst` and checks it against the reference.
fn check(mem: &TestMem, a: &TensorRef, b: &TensorRef, dst: &TensorRef, bound: f64) {
    run(mem, Op::MulMat, dst, &[a, b]).unwrap();
    let want = ref_mul_mat(&mem.read(a), &a.shape, &mem.read(b), &b.shape);
    assert_close(&mem.read(dst), &want, bound);
}

fn check_shapes(sa: &[usize], sb: &[usize], da: DType, db: DType, seed: u64) {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(seed);
    let a = mem.rand(&mut rng, da, sa);
    let b = mem.rand(&mut rng, db, sb);
    let dst = mem.zeros(DType::F32, &out_shape(sa, sb));
    check(&mem, &a, &b, &dst, tol_of(&[da, db]));
}

#[test]
fn mul_mat_2d_matches_reference() {
    check_shapes(&[5, 7], &[7, 3], DType::F32, DType::F32, 120);
    check_shapes(&[33, 65], &[65, 17], DType::F32, DType::F32, 121);
}

#[test]
fn mul_mat_gqa_broadcasts_batch_4_over_2() {
    // 4 query heads over 2 kv heads: head h uses kv head h / 2; and the other way round.
    check_shapes(&[4, 3, 8], &[2, 8, 5], DType::F32, DType::F32, 122);
    check_shapes(&[2, 3, 8], &[4, 8, 5], DType::F32, DType::F32, 123);
    // Mixed with a broadcast axis of 1 and a missing leading axis.
    check_shapes(&[2, 4, 3, 8], &[1, 2, 8, 5], DType::F32, DType::F16, 124);
    check_shapes(&[3, 8], &[2, 4, 8, 5], DType::F32, DType::F32, 125);
}

#[test]
fn mul_mat_gqa_uses_kv_head_q_over_ratio() {
    // b holds a different constant per kv head; head h of the result must see kv head h / 4.
    let mut mem = TestMem::new();
    let a = mem.tensor(DType::F32, &[8, 1, 2], &[1.0; 16]);
    let bv: Vec<f32> = (0..2).flat_map(|h| [h as f32 + 1.0; 2]).collect();
    let b = mem.tensor(DType::F32, &[2, 2, 1], &bv);
    let dst = mem.zeros(DType::F32, &[8, 1, 1]);
    run(&mem, Op::MulMat, &dst, &[&a, &b]).unwrap();
    assert_eq!(mem.read(&dst), vec![2., 2., 2., 2., 4., 4., 4., 4.]);
}

#[test]
fn mul_mat_with_a_transposed_weight_computes_x_at_w_t() {
    for (i, dw) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(126 + i as u64);
        let x = mem.rand(&mut rng, DType::F32, &[6, 40]);
        let w = mem.rand(&mut rng, dw, &[24, 40]);
        let wt = transpose(&w, 0, 1); // [40, 24], strides [1, 40]
        let dst = mem.zeros(DType::F32, &[6, 24]);
        check(&mem, &x, &wt, &dst, tol(dw));
    }
}

#[test]
fn mul_mat_with_both_operands_transposed_and_batched() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(130);
    let abase = mem.rand(&mut rng, DType::BF16, &[3, 9, 4]);
    let a = transpose(&abase, 1, 2); // [3, 4, 9]
    let bbase = mem.rand(&mut rng, DType::F32, &[3, 5, 9]);
    let b = transpose(&bbase, 1, 2); // [3, 9, 5]
    let dst = mem.zeros(DType::F32, &[3, 4, 5]);
    check(&mem, &a, &b, &dst, tol(DType::BF16));
}

#[test]
fn mul_mat_f16_and_bf16_operands_accumulate_in_f32() {
    check_shapes(&[2, 7, 130], &[2, 130, 9], DType::F16, DType::F16, 131);
    check_shapes(&[2, 7, 130], &[1, 130, 9], DType::BF16, DType::F32, 132);
    check_shapes(&[7, 130], &[130, 9], DType::F16, DType::BF16, 133);
    // Small m streams b in column blocks (here 32 + 32 + 6 columns per kv head).
    check_shapes(&[4, 3, 1000], &[2, 1000, 70], DType::F32, DType::F16, 136);
    // Small m with a row-major f16/bf16 b (`p @ v` over a KV cache): k is converted and
    // accumulated in runs (here 327 + 273 rows).
    check_shapes(&[4, 1, 600], &[2, 600, 100], DType::F32, DType::F16, 138);
    check_shapes(&[3, 600], &[600, 300], DType::F32, DType::BF16, 139);
    // Larger m converts b a panel of columns at a time: one panel here ...
    check_shapes(&[2, 40, 50], &[2, 50, 30], DType::F32, DType::BF16, 137);
}

#[test]
fn prefill_converts_a_16_bit_weight_a_panel_of_columns_at_a_time() {
    // k = 300: panels of 3504 columns (about 1 Mi elements), so 3600 columns are two panels,
    // the second partial; a transposed weight (`x @ w.T`) keeps its memory order.
    for (i, dw) in [DType::F16, DType::BF16].into_iter().enumerate() {
        check_shapes(&[33, 300], &[300, 3600], DType::F32, dw, 140 + i as u64);
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(142 + i as u64);
        let x = mem.rand(&mut rng, DType::F32, &[33, 300]);
        let w = mem.rand(&mut rng, dw, &[3600, 300]);
        let dst = mem.zeros(DType::F32, &[33, 3600]);
        check(&mem, &x, &transpose(&w, 0, 1), &dst, tol(dw));
    }
    // GQA: query heads share each converted kv head's panels (k = 64: 16384 + 116 columns).
    check_shapes(
        &[2, 2, 33, 64],
        &[2, 1, 64, 16500],
        DType::F32,
        DType::F16,
        144,
    );
}

#[test]
fn mul_mat_decode_shape_matches_reference() {
    let (k, n) = (512, 384);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(134);
    let x = mem.rand(&mut rng, DType::F32, &[1, k]);
    let w = mem.rand(&mut rng, DType::F16, &[n, k]);
    let dst = mem.zeros(DType::F32, &[1, n]);
    check(&mem, &x, &transpose(&w, 0, 1), &dst, tol(DType::F16));
}

#[test]
fn mul_mat_handles_empty_dimensions() {
    let mut mem = TestMem::new();
    let shapes: [(&[usize], &[usize], &[usize]); 6] = [
        (&[0, 3], &[3, 4], &[0, 4]),
        (&[2, 3], &[3, 0], &[2, 0]),
        (&[0, 2, 3], &[0, 3, 4], &[0, 2, 4]),
        (&[4, 0, 3], &[2, 3, 4], &[4, 0, 4]),
        // numpy broadcasts an empty batch against 1 (the graph builder does not allow it).
        (&[0, 2, 3], &[1, 3, 4], &[0, 2, 4]),
        (&[0, 2, 3], &[3, 4], &[0, 2, 4]),
    ];
    for (sa, sb, sd) in shapes {
        let a = mem.zeros(DType::F32, sa);
        let b = mem.zeros(DType::F16, sb);
        let dst = mem.zeros(DType::F32, sd);
        run(&mem, Op::MulMat, &dst, &[&a, &b]).unwrap();
    }
    // k = 0 gives zeros (over a destination that held garbage).
    let a = mem.zeros(DType::F32, &[2, 2, 0]);
    let b = mem.zeros(DType::BF16, &[2, 0, 3]);
    let dst = mem.tensor(DType::F32, &[2, 2, 3], &[5.0; 12]);
    run(&mem, Op::MulMat, &dst, &[&a, &b]).unwrap();
    assert_eq!(mem.read(&dst), vec![0.0; 12]);
}

#[test]
fn mul_mat_is_bit_identical_across_thread_counts() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(135);
    // A big gemm (threaded inside gemm), many small attention-like batches (threaded over
    // batches), decode products streaming an f16 weight (threaded over column blocks; the
    // row-major one accumulating runs of k) and decode attention over an f16 cache (query
    // heads grouped per kv head), each run on pools of 1 and 3 threads and the global pool.
    let x = mem.rand(&mut rng, DType::F32, &[2, 100, 300]);
    let w = mem.rand(&mut rng, DType::F16, &[200, 300]);
    let wt = transpose(&w, 0, 1);
    let q = mem.rand(&mut rng, DType::F32, &[8, 16, 64]);
    let kbase = mem.rand(&mut rng, DType::F32, &[2, 16, 64]);
    let kt = transpose(&kbase, 1, 2);
    let xd = mem.rand(&mut rng, DType::F32, &[1, 300]);
    let wr = mem.rand(&mut rng, DType::F16, &[300, 200]);
    // Decode attention over an f16 KV cache: 8 query heads over 2 kv heads, 700 positions.
    let q1 = mem.rand(&mut rng, DType::F32, &[8, 1, 64]);
    let kcache = mem.rand(&mut rng, DType::F16, &[2, 700, 64]);
    let p1 = mem.rand(&mut rng, DType::F32, &[8, 1, 700]);
    let cases = [
        (x, wt.clone(), vec![2, 100, 200]),
        (q, kt, vec![8, 16, 16]),
        (xd.clone(), wt, vec![1, 200]),
        (xd, wr, vec![1, 200]),
        (q1, transpose(&kcache, 1, 2), vec![8, 1, 700]),
        (p1, kcache, vec![8, 1, 64]),
    ];
    for (a, b, shape) in &cases {
        let mut results = Vec::new();
        for threads in [1, 3, 0] {
            let dst = mem.zeros(DType::F32, shape);
            let go = || run(&mem, Op::MulMat, &dst, &[a, b]).unwrap();
            if threads == 0 {
                go();
            } else {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap()
                    .install(go);
            }
            results.push(mem.bytes(&dst));
        }
        assert!(
            results.windows(2).all(|w| w[0] == w[1]),
            "results differ for {shape:?}"
        );
        let dst = mem.zeros(DType::F32, shape);
        check(&mem, a, b, &dst, tol(DType::F16));
    }
}

/// `out[t] = sum_j w[t, j] * (x[t] @ experts[ids[t, j]])`.
fn ref_mul_mat_id(
    e: &[f64],
    se: [usize; 3],
    x: &[f64],
    ids: &[i32],
    w: &[f64],
    slots: usize,
) -> Vec<f64> {
    let [_, k, n] = se;
    let t_len = ids.len() / slots.max(1);
    let mut out = vec![0.0; t_len * n];
    for t in 0..t_len {
        for j in 0..slots {
            let ex = ids[t * slots + j] as usize;
            for c in 0..n {
                let dot: f64 = (0..k)
                    .map(|p| x[t * k + p] * e[ex * k * n + p * n + c])
                    .sum();
                out[t * n + c] += w[t * slots + j] * dot;
            }
        }
    }
    out
}

#[test]
fn mul_mat_id_matches_reference() {
    for (i, de) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let (e, k, n, t, slots) = (4, 6, 5, 3, 2);
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(140 + i as u64);
        let experts = mem.rand(&mut rng, de, &[e, k, n]);
        let x = mem.rand(&mut rng, DType::F32, &[t, k]);
        // Token 2 routes to the same expert twice; expert 0 is unused.
        let ids_v = [3, 1, 1, 2, 3, 3];
        let ids = mem.ints(&[t, slots], &ids_v);
        let w = mem.rand(&mut rng, DType::F16, &[t, slots]);
        let dst = mem.zeros(DType::F32, &[t, n]);
        run(&mem, Op::MulMatId, &dst, &[&experts, &x, &ids, &w]).unwrap();
        let want = ref_mul_mat_id(
            &mem.read(&experts),
            [e, k, n],
            &mem.read(&x),
            &ids_v,
            &mem.read(&w),
            slots,
        );
        assert_close(&mem.read(&dst), &want, tol(de));
    }
}

#[test]
fn mul_mat_id_with_transposed_experts_and_many_tokens() {
    let (e, k, n, t, slots) = (8, 64, 48, 40, 2);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(145);
    let base = mem.rand(&mut rng, DType::F16, &[e, n, k]);
    let experts = transpose(&base, 1, 2); // [e, k, n], strided
    let x = mem.rand(&mut rng, DType::BF16, &[t, k]);
    let ids_v: Vec<i32> = (0..t * slots).map(|_| rng.below(e) as i32).collect();
    let ids = mem.ints(&[t, slots], &ids_v);
    let w = mem.rand(&mut rng, DType::F32, &[t, slots]);
    let dst = mem.zeros(DType::F32, &[t, n]);
    run(&mem, Op::MulMatId, &dst, &[&experts, &x, &ids, &w]).unwrap();
    let want = ref_mul_mat_id(
        &mem.read(&experts),
        [e, k, n],
        &mem.read(&x),
        &ids_v,
        &mem.read(&w),
        slots,
    );
    assert_close(&mem.read(&dst), &want, tol(DType::BF16));
}

#[test]
fn mul_mat_id_with_no_tokens_writes_nothing() {
    let mut mem = TestMem::new();
    let experts = mem.tensor(DType::F32, &[2, 3, 4], &[1.0; 24]);
    let x = mem.zeros(DType::F32, &[0, 3]);
    let ids = mem.zeros(DType::I32, &[0, 2]);
    let w = mem.zeros(DType::F32, &[0, 2]);
    let dst = mem.zeros(DType::F32, &[0, 4]);
    run(&mem, Op::MulMatId, &dst, &[&experts, &x, &ids, &w]).unwrap();
}

#[test]
fn mul_mat_id_out_of_range_expert_is_an_error() {
    for bad in [2, -1] {
        let mut mem = TestMem::new();
        let experts = mem.zeros(DType::F32, &[2, 3, 4]);
        let x = mem.zeros(DType::F32, &[2, 3]);
        let ids = mem.ints(&[2, 1], &[0, bad]);
        let w = mem.zeros(DType::F32, &[2, 1]);
        let dst = mem.tensor(DType::F32, &[2, 4], &[9.0; 8]);
        let msg = kernel_msg(run(&mem, Op::MulMatId, &dst, &[&experts, &x, &ids, &w]));
        assert!(msg.contains(&bad.to_string()) && msg.contains('2'), "{msg}");
        assert_eq!(mem.read(&dst), vec![9.0; 8], "nothing written");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn mul_mat_matches_reference_for_random_shapes_and_layouts(
        m in 1usize..9, k in 1usize..40, n in 1usize..9,
        hb in 1usize..3, ratio in 1usize..4, swap in any::<bool>(),
        ta in any::<bool>(), tb in any::<bool>(), seed in any::<u64>(),
    ) {
        let (ba, bb) = if swap { (hb, hb * ratio) } else { (hb * ratio, hb) };
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(seed);
        // Optionally build each operand as the transpose of a stored tensor.
        let a = if ta { transpose(&mem.rand(&mut rng, DType::F32, &[ba, k, m]), 1, 2) } else { mem.rand(&mut rng, DType::F32, &[ba, m, k]) };
        let b = if tb { transpose(&mem.rand(&mut rng, DType::F16, &[bb, n, k]), 1, 2) } else { mem.rand(&mut rng, DType::F16, &[bb, k, n]) };
        let dst = mem.zeros(DType::F32, &out_shape(&a.shape, &b.shape));
        check(&mem, &a, &b, &dst, tol(DType::F16));
    }
}

#[test]
fn decode_products_over_float_weight_rows_match_reference() {
    // `x @ W.T` with up to 8 activation rows reads each weight row in its own dtype: every
    // row count (pairs and a last single row), k with and without 32- and 8-element tails,
    // and GQA batches whose keys are rows of a cache (`q @ K.T`).
    for (seed, dt) in [(140, DType::F32), (141, DType::F16), (142, DType::BF16)] {
        for m in [1, 2, 3, 8] {
            for k in [5, 40, 67, 96] {
                let mut mem = TestMem::new();
                let mut rng = TestRng::new(seed + (m * 100 + k) as u64);
                let x = mem.rand(&mut rng, DType::F32, &[m, k]);
                let w = mem.rand(&mut rng, dt, &[37, k]);
                let dst = mem.zeros(DType::F32, &[m, 37]);
                check(&mem, &x, &transpose(&w, 0, 1), &dst, tol(dt));
            }
        }
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(seed + 7);
        let q = mem.rand(&mut rng, DType::BF16, &[6, 3, 40]);
        let keys = mem.rand(&mut rng, dt, &[2, 50, 40]);
        let dst = mem.zeros(DType::F32, &[6, 3, 50]);
        check(
            &mem,
            &q,
            &transpose(&keys, 1, 2),
            &dst,
            tol_of(&[dt, DType::BF16]),
        );
    }
}

#[test]
fn decode_products_are_bit_identical_across_thread_counts() {
    // Large enough to be split into column jobs over the pool.
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(143);
    for (dt, m) in [(DType::F16, 1), (DType::F32, 3), (DType::BF16, 2)] {
        let x = mem.rand(&mut rng, DType::F32, &[m, 300]);
        let w = mem.rand(&mut rng, dt, &[1500, 300]);
        let wt = transpose(&w, 0, 1);
        let mut results = Vec::new();
        for threads in [1, 2, 3] {
            let dst = mem.zeros(DType::F32, &[m, 1500]);
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
            results.push(mem.bytes(&dst));
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]), "{dt} m = {m}");
        let dst = mem.zeros(DType::F32, &[m, 1500]);
        check(&mem, &x, &wt, &dst, tol(dt));
    }
}

#[test]
fn prefill_products_over_float_weight_rows_match_reference() {
    // More than 8 activation rows over weight rows read in place (the prefill tiles, where
    // the CPU has them): row counts around the tile heights, column counts that are not a
    // multiple of the tile widths, k with and without 8- and 16-element tails, transposed
    // activations, and GQA batches whose keys are rows of a cache (`q @ K.T`).
    for (seed, dt) in [(150, DType::F16), (151, DType::BF16)] {
        for (m, n, k) in [
            (9, 7, 37),
            (12, 13, 5),
            (13, 11, 70),
            (33, 29, 768),
            (10, 3, 1),
        ] {
            let mut mem = TestMem::new();
            let mut rng = TestRng::new(seed + (m * 1000 + n * 10 + k) as u64);
            let x = mem.rand(&mut rng, DType::F32, &[m, k]);
            let w = mem.rand(&mut rng, dt, &[n, k]);
            let dst = mem.zeros(DType::F32, &[m, n]);
            check(&mem, &x, &transpose(&w, 0, 1), &dst, tol(dt));
            let xt = transpose(&mem.rand(&mut rng, DType::F32, &[k, m]), 0, 1);
            let dst = mem.zeros(DType::F32, &[m, n]);
            check(&mem, &xt, &transpose(&w, 0, 1), &dst, tol(dt));
        }
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(seed + 7);
        let q = mem.rand(&mut rng, DType::F32, &[6, 11, 40]);
        let keys = mem.rand(&mut rng, dt, &[2, 50, 40]);
        let dst = mem.zeros(DType::F32, &[6, 11, 50]);
        check(&mem, &q, &transpose(&keys, 1, 2), &dst, tol(dt));
    }
}

#[test]
fn prefill_products_are_bit_identical_across_thread_counts() {
    // Large enough to be split into column blocks over the pool; an output head's shape.
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(152);
    for (dt, m, n, k) in [(DType::F16, 17, 3001, 300), (DType::BF16, 40, 1000, 99)] {
        let x = mem.rand(&mut rng, DType::F32, &[m, k]);
        let w = mem.rand(&mut rng, dt, &[n, k]);
        let wt = transpose(&w, 0, 1);
        let mut results = Vec::new();
        for threads in [1, 2, 3] {
            let dst = mem.zeros(DType::F32, &[m, n]);
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
            results.push(mem.bytes(&dst));
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]), "{dt} m = {m}");
        let dst = mem.zeros(DType::F32, &[m, n]);
        check(&mem, &x, &wt, &dst, tol(dt));
    }
}
