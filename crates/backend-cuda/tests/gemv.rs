//! The matrix-vector path of `MulMat` (small m: decode, short prefill chunks, attention over a
//! KV cache) against the CPU oracle: weights seen as `w.T` (k contiguous) and as `w` (n
//! contiguous) in f32/f16/bf16, odd k tails, GQA batches, one launch per product, bit-identical
//! results run to run and whatever the operands' alignment. NMSE bounds as in `ops.rs` (the
//! result is f32: 1e-7). Ignored without a CUDA device (see `common`).

mod common;

use common::{bound, gpu, gpu_with, nmse, Pair, Rng, Twin, FLOATS};
use lowsync_backend::Backend;
use lowsync_cuda::CudaConfig;
use lowsync_graph::{DType, Op};

fn pair(test: &str) -> Pair {
    Pair::new(gpu(test))
}

/// Runs `dst = a @ b` on both backends, checks the f32 bound and returns the CUDA result's bits
/// and the number of kernel launches it took.
fn check(p: &Pair, case: &str, dst: &Twin, a: &Twin, b: &Twin) -> (Vec<u64>, u64) {
    let before = p.gpu.stats().snapshot();
    p.run(Op::MulMat, dst, &[a, b])
        .unwrap_or_else(|e| panic!("{case}: CUDA failed: {e}"));
    let launches = p.gpu.stats().snapshot().since(&before).kernel_launches;
    let (want, got) = p.read(dst);
    let e = nmse(&want, &got);
    let bd = bound(dst.cpu.dtype);
    assert!(
        e <= bd,
        "{case}: NMSE {e:e} > {bd:e}\nwant {:?}\ngot  {:?}",
        &want[..want.len().min(8)],
        &got[..got.len().min(8)]
    );
    (got.iter().map(|v| v.to_bits()).collect(), launches)
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn transposed_weights_match_the_oracle_in_one_launch() {
    let p = pair("gemv_k");
    let mut rng = Rng::new(21);
    for bdt in FLOATS {
        // 8192: the decode kernel's shared staging of x at a large k; 16384 f32 exceeds it.
        for k in [64, 2048, 2050, 8192, 16384] {
            for n in [1, 33, 4096] {
                if k >= 8192 && n == 4096 {
                    continue; // the CPU oracle's time; 33 rows cover every row index path
                }
                let w = p.rand(&mut rng, bdt, &[n, k]); // x @ w.T
                let wt = w.transpose(0, 1);
                for m in [1, 2, 5, 8] {
                    let x = p.rand(&mut rng, DType::F32, &[m, k]);
                    let d = p.zeros(DType::F32, &[m, n]);
                    let case = format!("f32[{m}, {k}] @ {bdt}[{n}, {k}].T");
                    let (_, launches) = check(&p, &case, &d, &x, &wt);
                    assert_eq!(launches, 1, "{case}: one matrix-vector launch");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn row_major_weights_match_the_oracle_in_one_launch() {
    let p = pair("gemv_n");
    let mut rng = Rng::new(22);
    for bdt in FLOATS {
        for k in [64, 2050] {
            for n in [1, 33, 4096] {
                let w = p.rand(&mut rng, bdt, &[k, n]); // x @ w
                for m in [1, 2, 5, 8] {
                    let x = p.rand(&mut rng, DType::F32, &[m, k]);
                    let d = p.zeros(DType::F32, &[m, n]);
                    let case = format!("f32[{m}, {k}] @ {bdt}[{k}, {n}]");
                    let (_, launches) = check(&p, &case, &d, &x, &w);
                    assert_eq!(launches, 1, "{case}: one matrix-vector launch");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn bf16_weights_take_the_kernel_up_to_32_rows_and_f16_ones_take_cublas_past_8() {
    // cuBLAS would convert a bf16 weight to f32 (the kernel reads it in place up to 32 rows of
    // f32 activations); beside an f16 weight it rounds the activations to f16 instead (one
    // conversion launch and the product), so only up to 8 rows go to the kernel.
    let p = pair("gemv_rows");
    let mut rng = Rng::new(23);
    for bdt in [DType::F16, DType::BF16] {
        for (k, n) in [(2048, 300), (2050, 33)] {
            let w = p.rand(&mut rng, bdt, &[n, k]);
            let w2 = p.rand(&mut rng, bdt, &[k, n]);
            for m in [8, 9, 17, 32] {
                let want = if bdt == DType::BF16 || m <= 8 { 1 } else { 2 };
                let x = p.rand(&mut rng, DType::F32, &[m, k]);
                let d = p.zeros(DType::F32, &[m, n]);
                let case = format!("f32[{m}, {k}] @ {bdt}[{n}, {k}].T");
                assert_eq!(
                    check(&p, &case, &d, &x, &w.transpose(0, 1)).1,
                    want,
                    "{case}"
                );
                let case = format!("f32[{m}, {k}] @ {bdt}[{k}, {n}]");
                assert_eq!(check(&p, &case, &d, &x, &w2).1, want, "{case}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn attention_over_a_kv_cache_is_one_launch_per_product() {
    let p = pair("gemv_attention");
    let mut rng = Rng::new(24);
    let (n_h, n_kv, hd) = (8, 2, 64);
    for kv in FLOATS {
        for n_ctx in [37, 256] {
            // The cache as the llama graph lays it out: [n_ctx, n_kv * hd].
            let k_cache = p.rand(&mut rng, kv, &[n_ctx, n_kv * hd]);
            let v_cache = p.rand(&mut rng, kv, &[n_ctx, n_kv * hd]);
            let keys = k_cache.view(&[n_kv, hd, n_ctx], &[hd, 1, n_kv * hd], 0);
            let values = v_cache.view(&[n_kv, n_ctx, hd], &[hd, n_kv * hd, 1], 0);
            for t in [1, 3] {
                // q [T, n_h, hd] seen as [n_h, T, hd].
                let q = p.rand(&mut rng, DType::F32, &[t, n_h, hd]);
                let qh = q.view(&[n_h, t, hd], &[hd, n_h * hd, 1], 0);
                let kq = p.zeros(DType::F32, &[n_h, t, n_ctx]);
                let case = format!("q @ K^T, {kv} cache, T={t}, n_ctx={n_ctx}");
                assert_eq!(check(&p, &case, &kq, &qh, &keys).1, 1, "{case}");
                let probs = p.rand(&mut rng, DType::F32, &[n_h, t, n_ctx]);
                let o = p.zeros(DType::F32, &[n_h, t, hd]);
                let case = format!("p @ V, {kv} cache, T={t}, n_ctx={n_ctx}");
                assert_eq!(check(&p, &case, &o, &probs, &values).1, 1, "{case}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn batches_broadcasts_strided_results_and_converted_activations() {
    let p = pair("gemv_layouts");
    let mut rng = Rng::new(25);
    for bdt in FLOATS {
        // A 3-D a over a 2-D weight (the weight broadcast over the batch).
        let x = p.rand(&mut rng, DType::F32, &[3, 2, 96]);
        let w = p.rand(&mut rng, bdt, &[40, 96]);
        let d = p.zeros(DType::F32, &[3, 2, 40]);
        check(&p, &format!("3-D a @ {bdt}.T"), &d, &x, &w.transpose(0, 1));
        // The result written through a transposed view.
        let x = p.rand(&mut rng, DType::F32, &[4, 96]);
        let buf = p.zeros(DType::F32, &[40, 4]);
        let out_t = buf.transpose(0, 1); // [4, 40], strides (1, 4)
        let case = format!("{bdt} into a transposed result");
        check(&p, &case, &out_t, &x, &w.transpose(0, 1));
        // a in the weight's dtype, and a strided along k: converted to packed f32 first.
        let xh = p.rand(&mut rng, bdt, &[2, 96]);
        let d = p.zeros(DType::F32, &[2, 40]);
        check(&p, &format!("{bdt} @ {bdt}.T"), &d, &xh, &w.transpose(0, 1));
        let xs = p.rand(&mut rng, DType::F32, &[96, 2]).transpose(0, 1);
        check(
            &p,
            &format!("strided a @ {bdt}.T"),
            &d,
            &xs,
            &w.transpose(0, 1),
        );
        let w2 = p.rand(&mut rng, bdt, &[96, 40]);
        check(&p, &format!("strided a @ {bdt}"), &d, &xs, &w2);
        // k = 1 and k smaller than one vector.
        for k in [1, 3] {
            let x = p.rand(&mut rng, DType::F32, &[2, k]);
            let w = p.rand(&mut rng, bdt, &[40, k]);
            check(&p, &format!("k={k} {bdt}.T"), &d, &x, &w.transpose(0, 1));
            let w2 = p.rand(&mut rng, bdt, &[k, 40]);
            check(&p, &format!("k={k} {bdt}"), &d, &x, &w2);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn results_do_not_depend_on_operand_alignment() {
    let p = pair("gemv_alignment");
    let mut rng = Rng::new(26);
    for bdt in FLOATS {
        let (m, k, n) = (2, 1024, 48);
        // The same values at element 0 (aligned: vector loads) and at element 1 (not aligned:
        // scalar loads) of their buffers.
        let placed = |dtype: DType, v: &[f32]| {
            let shifted: Vec<f32> = std::iter::once(0.0).chain(v.iter().copied()).collect();
            (
                p.tensor(dtype, &[v.len()], v),
                p.tensor(dtype, &[v.len() + 1], &shifted),
            )
        };
        let (x0, x1) = placed(DType::F32, &rng.vec(m * k));
        let (w0, w1) = placed(bdt, &rng.vec(n * k));
        let xs = [x0.view(&[m, k], &[k, 1], 0), x1.view(&[m, k], &[k, 1], 1)];
        let d = p.zeros(DType::F32, &[m, n]);
        for (case, strides) in [("w.T", [1, k]), ("w", [n, 1])] {
            let ws = [w0.view(&[k, n], &strides, 0), w1.view(&[k, n], &strides, 1)];
            let mut results = Vec::new();
            for (i, x) in xs.iter().enumerate() {
                for (j, w) in ws.iter().enumerate() {
                    let case = format!("{bdt} {case}, a at +{i}, b at +{j}");
                    results.push((case.clone(), check(&p, &case, &d, x, w).0));
                }
            }
            for (case, r) in &results[1..] {
                assert_eq!(r, &results[0].1, "{case} differs from {}", results[0].0);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn results_are_bit_identical_run_to_run() {
    let p = pair("gemv_determinism");
    let mut rng = Rng::new(27);
    for bdt in FLOATS {
        let w = p.rand(&mut rng, bdt, &[2048, 2048]);
        for m in [1, 5, 20] {
            let x = p.rand(&mut rng, DType::F32, &[m, 2048]);
            let d = p.zeros(DType::F32, &[m, 2048]);
            for (case, b) in [("w.T", w.transpose(0, 1)), ("w", w.clone())] {
                let case = format!("{bdt} {case} m={m}");
                let (first, _) = check(&p, &case, &d, &x, &b);
                let (second, _) = check(&p, &case, &d, &x, &b);
                assert_eq!(first, second, "{case}: two runs differ");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn the_threshold_knob_sends_small_products_back_to_cublas() {
    let cfg = CudaConfig {
        mmv_max_m: Some(0),
        ..CudaConfig::default()
    };
    let g = gpu_with("gemv_knob", cfg);
    let p = Pair::new(g);
    let mut rng = Rng::new(28);
    let x = p.rand(&mut rng, DType::F32, &[1, 256]);
    let w = p.rand(&mut rng, DType::F16, &[64, 256]);
    let d = p.zeros(DType::F32, &[1, 64]);
    // cuBLAS: the f16 weight is converted to f32 first, then one GEMM.
    let (_, launches) = check(&p, "f32 @ f16.T on cuBLAS", &d, &x, &w.transpose(0, 1));
    assert_eq!(launches, 2);
}
