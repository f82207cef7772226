//! Row reductions: `RmsNorm`, `SoftMax` (masks, fully masked rows) and `Argmax` (ties, NaN).

use lowsync_graph::{DType, Op};

use super::harness::*;

fn ref_rms_norm(x: &[f64], len: usize, eps: f64) -> Vec<f64> {
    x.chunks(len)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / len as f64;
            row.iter().map(move |v| v / (ms + eps).sqrt())
        })
        .collect()
}

#[test]
fn rms_norm_normalises_the_last_axis_in_every_dtype() {
    for (i, dt) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(50 + i as u64);
        let x = mem.rand(&mut rng, dt, &[2, 3, 64]);
        let dst = mem.zeros(dt, &[2, 3, 64]);
        run(&mem, Op::RmsNorm { eps: 1e-5 }, &dst, &[&x]).unwrap();
        let want = ref_rms_norm(&mem.read(&x), 64, 1e-5f32 as f64);
        assert_close(&mem.read(&dst), &want, tol(dt));
    }
}

#[test]
fn rms_norm_reads_a_strided_input() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(53);
    let base = mem.rand(&mut rng, DType::F32, &[16, 5]);
    let x = transpose(&base, 0, 1); // [5, 16], last-axis stride 5
    let dst = mem.zeros(DType::F32, &[5, 16]);
    run(&mem, Op::RmsNorm { eps: 1e-6 }, &dst, &[&x]).unwrap();
    let want = ref_rms_norm(&mem.read(&x), 16, 1e-6f32 as f64);
    assert_close(&mem.read(&dst), &want, tol(DType::F32));
}

/// softmax(x * scale + mask) per row, all -inf rows to zeros.
fn ref_softmax(x: &[f64], sx: &[usize], mask: Option<(&[f64], &[usize])>, scale: f64) -> Vec<f64> {
    let len = *sx.last().unwrap();
    let v: Vec<f64> = (0..x.len())
        .map(|i| x[i] * scale + mask.map_or(0.0, |(m, sm)| m[broadcast_index(sm, &unravel(sx, i))]))
        .collect();
    v.chunks(len)
        .flat_map(|row| {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if max == f64::NEG_INFINITY {
                return vec![0.0; row.len()];
            }
            let e: Vec<f64> = row.iter().map(|v| (v - max).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|e| e / s).collect()
        })
        .collect()
}

#[test]
fn softmax_with_scale_matches_reference_and_rows_sum_to_one() {
    for (i, dt) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(60 + i as u64);
        let vals: Vec<f32> = rng.vec(4 * 37).into_iter().map(|v| v * 8.0).collect();
        let x = mem.tensor(dt, &[4, 37], &vals);
        let dst = mem.zeros(dt, &[4, 37]);
        run(&mem, Op::SoftMax { scale: 0.5 }, &dst, &[&x]).unwrap();
        let got = mem.read(&dst);
        assert_close(
            &got,
            &ref_softmax(&mem.read(&x), &[4, 37], None, 0.5),
            tol(dt),
        );
        for row in got.chunks(37) {
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-2);
        }
    }
}

#[test]
fn softmax_broadcasts_a_causal_mask_onto_heads() {
    // x [heads 3, queries 4, keys 6], mask [4, 6] in f16 with -inf above the causal diagonal.
    let (h, q, k) = (3, 4, 6);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(63);
    let x = mem.rand(&mut rng, DType::F32, &[h, q, k]);
    let mask_vals: Vec<f32> = (0..q * k)
        .map(|i| {
            if i % k > i / k + 2 {
                f32::NEG_INFINITY
            } else {
                0.25 * (i % 3) as f32
            }
        })
        .collect();
    let mask = mem.tensor(DType::F16, &[q, k], &mask_vals);
    let dst = mem.zeros(DType::F32, &[h, q, k]);
    run(&mem, Op::SoftMax { scale: 0.125 }, &dst, &[&x, &mask]).unwrap();
    let m = mem.read(&mask);
    let want = ref_softmax(&mem.read(&x), &[h, q, k], Some((&m, &[q, k])), 0.125);
    let got = mem.read(&dst);
    assert_close(&got, &want, tol(DType::F32));
    for (i, g) in got.iter().enumerate() {
        if m[i % (q * k)] == f64::NEG_INFINITY {
            assert_eq!(*g, 0.0, "masked entry {i}");
        }
    }
}

#[test]
fn softmax_fully_masked_row_gives_zeros() {
    let mut mem = TestMem::new();
    let x = mem.tensor(
        DType::F32,
        &[3, 4],
        &[1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12.],
    );
    let ninf = f32::NEG_INFINITY;
    // Row 1 fully masked; row 2 partly.
    let mask = mem.tensor(
        DType::F32,
        &[3, 4],
        &[0., 0., 0., 0., ninf, ninf, ninf, ninf, ninf, 0., ninf, 0.],
    );
    let dst = mem.zeros(DType::F32, &[3, 4]);
    run(&mem, Op::SoftMax { scale: 1.0 }, &dst, &[&x, &mask]).unwrap();
    let got = mem.read(&dst);
    assert!(got.iter().all(|v| v.is_finite()), "{got:?}");
    assert_eq!(&got[4..8], &[0.0; 4]);
    assert_eq!((got[8], got[10]), (0.0, 0.0));
    assert!((got[9] + got[11] - 1.0).abs() < 1e-6);
    // An input of -inf with no mask is fully masked too.
    let x = mem.tensor(DType::F16, &[1, 3], &[ninf, ninf, ninf]);
    let dst = mem.zeros(DType::F16, &[1, 3]);
    run(&mem, Op::SoftMax { scale: 1.0 }, &dst, &[&x]).unwrap();
    assert_eq!(mem.read(&dst), vec![0.0; 3]);
}

#[test]
fn argmax_picks_the_largest_of_each_row() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(70);
    let x = mem.rand(&mut rng, DType::BF16, &[2, 3, 50]);
    let dst = mem.zeros(DType::I32, &[2, 3]);
    run(&mem, Op::Argmax, &dst, &[&x]).unwrap();
    let want: Vec<i32> = mem
        .read(&x)
        .chunks(50)
        .map(|r| {
            let mut best = 0;
            for (i, &v) in r.iter().enumerate() {
                if v > r[best] {
                    best = i;
                }
            }
            best as i32
        })
        .collect();
    assert_eq!(mem.read_i32(&dst), want);
}

#[test]
fn argmax_ties_pick_the_lowest_index() {
    let mut mem = TestMem::new();
    let x = mem.tensor(
        DType::F32,
        &[3, 4],
        &[1., 3., 3., 0., 7., 7., 7., 7., -1., -2., -1., -5.],
    );
    let dst = mem.zeros(DType::I32, &[3]);
    run(&mem, Op::Argmax, &dst, &[&x]).unwrap();
    assert_eq!(mem.read_i32(&dst), vec![1, 0, 0]);
}

#[test]
fn argmax_treats_nan_as_smaller_than_everything() {
    let mut mem = TestMem::new();
    let nan = f32::NAN;
    let x = mem.tensor(
        DType::F32,
        &[3, 3],
        &[nan, -5., -7., 1., nan, 2., nan, nan, nan],
    );
    let dst = mem.zeros(DType::I32, &[3]);
    run(&mem, Op::Argmax, &dst, &[&x]).unwrap();
    assert_eq!(mem.read_i32(&dst), vec![1, 2, 0]);
}

#[test]
fn softmax_propagates_nan_through_its_row() {
    let mut mem = TestMem::new();
    let nan = f32::NAN;
    // Row 0 all NaN (a max fold that skips NaN turned it into zeros), row 1 one NaN, row 2
    // finite, row 3 a NaN in the mask.
    let x = mem.tensor(
        DType::F32,
        &[4, 3],
        &[nan, nan, nan, 1., nan, 3., 1., 2., 3., 1., 2., 3.],
    );
    let mask = mem.tensor(
        DType::F32,
        &[4, 3],
        &[0., 0., 0., 0., 0., 0., 0., 0., 0., 0., nan, 0.],
    );
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let dst = mem.zeros(dt, &[4, 3]);
        run(&mem, Op::SoftMax { scale: 1.0 }, &dst, &[&x, &mask]).unwrap();
        let got = mem.read(&dst);
        assert!(got[..6].iter().all(|v| v.is_nan()), "{dt}: {got:?}");
        assert!(got[6..9].iter().all(|v| v.is_finite()), "{dt}: {got:?}");
        assert!(got[9..].iter().all(|v| v.is_nan()), "{dt}: {got:?}");
    }
}
