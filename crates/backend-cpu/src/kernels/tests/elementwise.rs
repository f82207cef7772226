//! Element-wise ops against f64 references: broadcasting, dtype mixes, strided operands,
//! in-place execution and the parallel path.

use lowsync_graph::{DType, Op};
use proptest::prelude::*;

use super::harness::*;

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// numpy `a op b` with `b` broadcast onto `a`.
fn ref_binary(
    a: &[f64],
    sa: &[usize],
    b: &[f64],
    sb: &[usize],
    f: fn(f64, f64) -> f64,
) -> Vec<f64> {
    (0..a.len())
        .map(|i| f(a[i], b[broadcast_index(sb, &unravel(sa, i))]))
        .collect()
}

fn check_binary(
    op: Op,
    f: fn(f64, f64) -> f64,
    sa: &[usize],
    sb: &[usize],
    da: DType,
    db: DType,
    seed: u64,
) {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(seed);
    let a = mem.rand(&mut rng, da, sa);
    let b = mem.rand(&mut rng, db, sb);
    let dst = mem.zeros(da, sa);
    run(&mem, op, &dst, &[&a, &b]).unwrap();
    let want = ref_binary(&mem.read(&a), sa, &mem.read(&b), sb, f);
    assert_close(&mem.read(&dst), &want, tol_of(&[da, db]));
}

const BROADCASTS: [&[usize]; 7] = [&[2, 3, 4], &[4], &[3, 1], &[1, 3, 4], &[2, 1, 1], &[1], &[]];

#[test]
fn add_broadcasts_b_onto_a_numpy_style() {
    for (i, sb) in BROADCASTS.iter().enumerate() {
        check_binary(
            Op::Add,
            |x, y| x + y,
            &[2, 3, 4],
            sb,
            DType::F32,
            DType::F32,
            i as u64,
        );
    }
}

#[test]
fn mul_broadcasts_b_onto_a_numpy_style() {
    for (i, sb) in BROADCASTS.iter().enumerate() {
        check_binary(
            Op::Mul,
            |x, y| x * y,
            &[2, 3, 4],
            sb,
            DType::F32,
            DType::F32,
            10 + i as u64,
        );
    }
}

#[test]
fn add_and_mul_mix_float_dtypes_and_keep_a_dtype() {
    let dts = [DType::F32, DType::F16, DType::BF16];
    for (i, &da) in dts.iter().enumerate() {
        for (j, &db) in dts.iter().enumerate() {
            let seed = (i * 3 + j) as u64;
            check_binary(Op::Add, |x, y| x + y, &[5, 7], &[7], da, db, seed);
            check_binary(Op::Mul, |x, y| x * y, &[5, 7], &[5, 1], da, db, seed + 100);
        }
    }
}

#[test]
fn binary_ops_read_strided_operands() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(7);
    // a: transposed view [4, 3] of a [3, 4] tensor; b: every other column of a [4, 6] tensor.
    let a_base = mem.rand(&mut rng, DType::F32, &[3, 4]);
    let a = transpose(&a_base, 0, 1);
    let b_base = mem.rand(&mut rng, DType::F16, &[4, 6]);
    let b = view(&b_base, &[4, 3], &[6, 2], 1);
    let dst = mem.zeros(DType::F32, &[4, 3]);
    run(&mem, Op::Add, &dst, &[&a, &b]).unwrap();
    let want = ref_binary(&mem.read(&a), &[4, 3], &mem.read(&b), &[4, 3], |x, y| x + y);
    assert_close(&mem.read(&dst), &want, tol(DType::F32));
}

#[test]
fn add_in_place_over_first_source_is_correct() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(8);
    let a = mem.rand(&mut rng, DType::F32, &[3, 50]);
    let b = mem.rand(&mut rng, DType::F32, &[50]);
    let want = ref_binary(&mem.read(&a), &[3, 50], &mem.read(&b), &[50], |x, y| x + y);
    run(&mem, Op::Add, &a, &[&a, &b]).unwrap();
    assert_close(&mem.read(&a), &want, tol(DType::F32));
}

#[test]
fn second_source_overlapping_the_result_is_read_before_any_write() {
    let mut mem = TestMem::new();
    let buf = mem.tensor(DType::F32, &[10], &[0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]);
    let a = mem.tensor(DType::F32, &[8], &[100.; 8]);
    // dst = buf[0..8], b = buf[2..10]: writing dst[i] would clobber b[i - 2].
    let dst = view(&buf, &[8], &[1], 0);
    let b = view(&buf, &[8], &[1], 2);
    run(&mem, Op::Add, &dst, &[&a, &b]).unwrap();
    let want: Vec<f64> = (2..10).map(|v| 100.0 + v as f64).collect();
    assert_eq!(mem.read(&dst), want);
}

/// A unary op and its f64 reference.
type UnaryCase = (Op, fn(f64) -> f64);

#[test]
fn scale_silu_gelu_match_reference_in_every_dtype() {
    let cases: [UnaryCase; 3] = [
        (Op::Scale { scale: -0.37 }, |x| x * (-0.37f32) as f64),
        (Op::Silu, silu),
        (Op::Gelu, gelu),
    ];
    for (i, dt) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        for (op, f) in cases {
            let mut mem = TestMem::new();
            let mut rng = TestRng::new(20 + i as u64);
            let vals: Vec<f32> = rng.vec(6 * 33).into_iter().map(|v| v * 6.0).collect();
            let x = mem.tensor(dt, &[6, 33], &vals);
            let dst = mem.zeros(dt, &[6, 33]);
            run(&mem, op, &dst, &[&x]).unwrap();
            let want: Vec<f64> = mem.read(&x).into_iter().map(f).collect();
            assert_close(&mem.read(&dst), &want, tol(dt));
        }
    }
}

#[test]
fn silu_and_gelu_of_large_magnitudes_are_finite() {
    let mut mem = TestMem::new();
    let x = mem.tensor(DType::F32, &[4], &[-1000.0, -100.0, 100.0, 1000.0]);
    for (op, want) in [
        (Op::Silu, [0.0, 0.0, 100.0, 1000.0]),
        (Op::Gelu, [0.0, 0.0, 100.0, 1000.0]),
    ] {
        let dst = mem.zeros(DType::F32, &[4]);
        run(&mem, op, &dst, &[&x]).unwrap();
        let got = mem.read(&dst);
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-3, "{op:?}: {got:?}");
        }
    }
}

#[test]
fn swiglu_is_silu_of_gate_times_up() {
    for (i, dt) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(30 + i as u64);
        let g = mem.rand(&mut rng, dt, &[3, 40]);
        let u = mem.rand(&mut rng, DType::F32, &[3, 40]);
        let dst = mem.zeros(dt, &[3, 40]);
        run(&mem, Op::SwiGlu, &dst, &[&g, &u]).unwrap();
        let want: Vec<f64> = mem
            .read(&g)
            .iter()
            .zip(mem.read(&u))
            .map(|(g, u)| silu(*g) * u)
            .collect();
        assert_close(&mem.read(&dst), &want, tol(dt));
    }
}

#[test]
fn large_elementwise_ops_run_in_parallel_and_match_reference() {
    // 64 x 1000 = 64k elements: above the parallel threshold, rows split into segments.
    check_binary(
        Op::Add,
        |x, y| x + y,
        &[64, 1000],
        &[1000],
        DType::F32,
        DType::F16,
        40,
    );
    check_binary(
        Op::Mul,
        |x, y| x * y,
        &[8, 8, 1000],
        &[8, 1, 1000],
        DType::BF16,
        DType::F32,
        41,
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn add_matches_numpy_broadcast_for_random_shapes(
        sa in proptest::collection::vec(1usize..5, 0..4),
        mask in proptest::collection::vec(any::<bool>(), 4),
        drop in 0usize..4,
        seed in any::<u64>(),
    ) {
        // b: a suffix of a's shape with some axes set to 1.
        let keep = sa.len() - drop.min(sa.len());
        let sb: Vec<usize> = sa[sa.len() - keep..].iter().zip(&mask).map(|(&d, &m)| if m { 1 } else { d }).collect();
        check_binary(Op::Add, |x, y| x + y, &sa, &sb, DType::F32, DType::F32, seed);
    }
}
