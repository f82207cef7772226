//! `Rope` in both modes, with `n_dims < D` (the tail is copied unchanged).

use lowsync_graph::{DType, Op, RopeMode};

use super::harness::*;

fn ref_rope(
    x: &[f64],
    shape: [usize; 3],
    pos: &[i32],
    mode: RopeMode,
    n_dims: usize,
    base: f64,
) -> Vec<f64> {
    let [_, h, d] = shape;
    let mut out = x.to_vec();
    for (r, row) in out.chunks_mut(d).enumerate() {
        let p = pos[r / h] as f64;
        for i in 0..n_dims / 2 {
            let theta = p * base.powf(-2.0 * i as f64 / n_dims as f64);
            let (ia, ib) = match mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::Neox => (i, i + n_dims / 2),
            };
            let (a, b) = (row[ia], row[ib]);
            row[ia] = a * theta.cos() - b * theta.sin();
            row[ib] = a * theta.sin() + b * theta.cos();
        }
    }
    out
}

fn check_rope(mode: RopeMode, dt: DType, seed: u64) {
    let (t, h, d, n_dims) = (3, 2, 10, 6);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(seed);
    let x = mem.rand(&mut rng, dt, &[t, h, d]);
    let positions = [0, 7, 1234];
    let pos = mem.ints(&[t], &positions);
    let dst = mem.zeros(dt, &[t, h, d]);
    run(
        &mem,
        Op::Rope {
            mode,
            n_dims,
            theta_base: 10000.0,
        },
        &dst,
        &[&x, &pos],
    )
    .unwrap();
    let xs = mem.read(&x);
    let got = mem.read(&dst);
    assert_close(
        &got,
        &ref_rope(&xs, [t, h, d], &positions, mode, n_dims, 10000.0),
        tol(dt),
    );
    // Dims >= n_dims are copied bit for bit (exact for every dtype).
    for (r, (g, x)) in got.chunks(d).zip(xs.chunks(d)).enumerate() {
        assert_eq!(&g[n_dims..], &x[n_dims..], "row {r}");
    }
}

#[test]
fn rope_normal_mode_rotates_adjacent_pairs_of_the_first_n_dims() {
    check_rope(RopeMode::Normal, DType::F32, 80);
    check_rope(RopeMode::Normal, DType::F16, 81);
}

#[test]
fn rope_neox_mode_rotates_halves_of_the_first_n_dims() {
    check_rope(RopeMode::Neox, DType::F32, 82);
    check_rope(RopeMode::Neox, DType::BF16, 83);
}

#[test]
fn rope_at_position_zero_is_identity() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(84);
    let x = mem.rand(&mut rng, DType::F32, &[2, 3, 8]);
    let pos = mem.ints(&[2], &[0, 0]);
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        let dst = mem.zeros(DType::F32, &[2, 3, 8]);
        run(
            &mem,
            Op::Rope {
                mode,
                n_dims: 8,
                theta_base: 500000.0,
            },
            &dst,
            &[&x, &pos],
        )
        .unwrap();
        assert_eq!(mem.read(&dst), mem.read(&x));
    }
}

#[test]
fn rope_of_a_large_prefill_matches_reference() {
    // 64 tokens x 8 heads x 64 dims: the parallel path.
    let (t, h, d) = (64, 8, 64);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(85);
    let x = mem.rand(&mut rng, DType::F32, &[t, h, d]);
    let positions: Vec<i32> = (0..t as i32).map(|p| p * 37).collect();
    let pos = mem.ints(&[t], &positions);
    let dst = mem.zeros(DType::F32, &[t, h, d]);
    run(
        &mem,
        Op::Rope {
            mode: RopeMode::Neox,
            n_dims: 32,
            theta_base: 10000.0,
        },
        &dst,
        &[&x, &pos],
    )
    .unwrap();
    let want = ref_rope(
        &mem.read(&x),
        [t, h, d],
        &positions,
        RopeMode::Neox,
        32,
        10000.0,
    );
    assert_close(&mem.read(&dst), &want, tol(DType::F32));
}
