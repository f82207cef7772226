//! Quantized (GGUF block) weights on CUDA, every block type: `MulMat` as `x @ w.T` at decode
//! (m = 1, the in-place `mul_mat_vec_q`), a few rows (m = 3, `mul_mat_vec_q8`) and prefill
//! (m = 64: dequantized to f16 for cuBLAS), on a row slice of a larger weight and over a batch
//! axis; and `GetRows` of a quantized table into f32 and f16 rows. Against the CPU backend (the
//! oracle, itself checked bit for bit against gguf-py): NMSE for products, bit-exact rows.
//! The one-row products and the head run with each arithmetic of `LOWSYNC_CUDA_TUNE=qdot`
//! (`q16`, the default: the oracle's own 16-bit activation blocks and integer dot products;
//! `q8`: 8-bit activation blocks and dp4a, at a looser bound; `f32`: f32 activations and
//! dequantized weights).
//! The kernels' own float64 and gguf checks run in the emulation (scripts/kernel_emu.sh groups
//! `quant_dequant`, `quant_rows`, `quant_mmv`). Ignored without a CUDA device (see `common`).

mod common;

use common::{gpu, gpu_with, nmse, quant_blocks as blocks, Pair, Rng, Twin};
use lowsync_cuda::CudaConfig;
use lowsync_graph::{DType, Op};

fn pair(test: &str) -> Pair {
    Pair::new(gpu(test))
}

/// A pair whose CUDA backend takes the tuning `tune` (`LOWSYNC_CUDA_TUNE`'s syntax).
fn pair_tuned(test: &str, tune: &str) -> Pair {
    let cfg = CudaConfig::default()
        .with_tune(tune)
        .unwrap_or_else(|e| panic!("{test}: {tune}: {e}"));
    Pair::new(gpu_with(test, cfg))
}

/// The arithmetics of decode's quantized products.
const QDOTS: [&str; 3] = ["qdot=q16", "qdot=q8", "qdot=f32"];

/// The NMSE bound of a one-row product (`mul_mat_vec_q`, in place) under `tune` against the
/// oracle (whose decode products take 16-bit activations): 8-bit activations move each value
/// by up to amax / 254 of its block, an NMSE near 1e-5 on long random rows and up to 4e-3 on
/// one-block rows in the emulation (against float64; a wrong kernel is off by order 1, and the
/// emulation checks the q8 kernels tightly against the q8-rounded row); q16 and f32 stay near
/// 1e-8.
fn decode_bound(tune: &str) -> f64 {
    if tune.split(',').any(|item| item == "qdot=q8") {
        1e-2
    } else {
        1e-6
    }
}

/// The block dtypes.
fn quants() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|d| d.is_quantized())
}

/// `x [m, k] @ w.T` with w rows `lead..lead + n` of a `[lead + n + 1, k]` weight, on both
/// backends; the NMSE of CUDA's result against the oracle's.
fn product(p: &Pair, rng: &mut Rng, dt: DType, m: usize, n: usize, k: usize, lead: usize) -> f64 {
    let rows = lead + n + 1;
    let w = p.blocks(dt, &[rows, k], &blocks(rng, dt, rows, k));
    // (`Twin::view` counts its offset in elements of a plain dtype: move by whole rows here.)
    let mut wt = w.view(&[k, n], &[1, k], 0);
    let row = dt.row_bytes(k).expect("whole blocks");
    wt.cpu.byte_offset += lead * row;
    wt.gpu.byte_offset += lead * row;
    let x = p.rand(rng, DType::F32, &[m, k]);
    let d = p.zeros(DType::F32, &[m, n]);
    p.run(Op::MulMat, &d, &[&x, &wt])
        .unwrap_or_else(|e| panic!("{dt} m={m}: CUDA failed: {e}"));
    let (want, got) = p.read(&d);
    nmse(&want, &got)
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn quantized_products_match_the_oracle_at_decode_and_prefill_shapes() {
    for tune in QDOTS {
        products_match_the_oracle(tune);
    }
}

fn products_match_the_oracle(tune: &str) {
    let p = pair_tuned("quant_products", tune);
    let mut rng = Rng::new(33);
    for dt in quants() {
        let bs = dt.block_size();
        // (m, n, k, lead): decode over one and several blocks per row, a few rows, prefill.
        for (m, n, k, lead) in [
            (1, 37, bs, 0),
            (1, 45, 3 * bs, 2),
            (3, 37, 2 * bs, 1),
            (64, 40, 2 * bs, 0),
        ] {
            let e = product(&p, &mut rng, dt, m, n, k, lead);
            // In place (f32 accumulation; m = 1 with q16 activations, the oracle's own): the
            // oracle's 16-bit activation blocks stay near 1e-8 from f32 activations (q8 at
            // m = 1: `decode_bound`; several rows are f32 every way). Prefill rounds x and the
            // weight to f16 for cuBLAS: about 1e-7.
            let bound = match m {
                1 => decode_bound(tune),
                2..=8 => 1e-6,
                _ => 1e-5,
            };
            assert!(
                e <= bound,
                "{tune} {dt} m={m} n={n} k={k} lead={lead}: NMSE {e:e} > {bound:e}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_large_quantized_weight_is_dequantized_for_cublas_a_slice_at_a_time() {
    // 8,200 rows of 4,096: 67 MB in f16, past the 64 MiB a slice may take, so two slices (the
    // second of 8 rows) each multiply into their columns of the result.
    let p = pair("quant_slices");
    let mut rng = Rng::new(38);
    for dt in [DType::Q4_0, DType::Q4_K] {
        let e = product(&p, &mut rng, dt, 9, 8200, 4096, 3);
        assert!(e <= 1e-5, "{dt}: NMSE {e:e}");
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn quantized_products_over_a_batch_axis_match_the_oracle() {
    let p = pair("quant_batched");
    let mut rng = Rng::new(34);
    for dt in [DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K] {
        let (b, m, n, k) = (3, 2, 19, 2 * dt.block_size());
        let w = p.blocks(dt, &[b, n, k], &blocks(&mut rng, dt, b * n, k));
        let wt = w.transpose(1, 2); // [b, k, n], k contiguous
        for m in [m, 40] {
            let x = p.rand(&mut rng, DType::F32, &[b, m, k]);
            let d = p.zeros(DType::F32, &[b, m, n]);
            p.run(Op::MulMat, &d, &[&x, &wt])
                .unwrap_or_else(|e| panic!("{dt} batched m={m}: CUDA failed: {e}"));
            let (want, got) = p.read(&d);
            let e = nmse(&want, &got);
            let bound = if m <= 8 { 1e-6 } else { 1e-5 };
            assert!(e <= bound, "{dt} batched m={m}: NMSE {e:e} > {bound:e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn quantized_tables_give_the_oracles_rows_bit_for_bit() {
    let p = pair("quant_rows");
    let mut rng = Rng::new(35);
    for dt in quants() {
        let (rows, k) = (9, 2 * dt.block_size());
        let table = p.blocks(dt, &[rows, k], &blocks(&mut rng, dt, rows, k));
        let ids = p.ints(&[2, 3], &[4, 0, 8, 4, 1, 7]);
        for dst_dt in [DType::F32, DType::F16] {
            let d: Twin = p.zeros(dst_dt, &[2, 3, k]);
            p.run(Op::GetRows, &d, &[&table, &ids])
                .unwrap_or_else(|e| panic!("{dt} -> {dst_dt}: CUDA failed: {e}"));
            let (want, got) = p.read(&d);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!(
                    w.to_bits() == g.to_bits(),
                    "{dt} -> {dst_dt}: element {i}: want {w}, got {g}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_quantized_weight_read_other_than_as_w_transposed_is_a_clear_error() {
    let p = pair("quant_layout");
    let mut rng = Rng::new(36);
    let dt = DType::Q4_0;
    let (n, k) = (8, 64);
    // `x @ w` with w [n, k] quantized read as [k = n, n = k]: its contraction axis is the
    // strided one, which no kernel reads. The CPU oracle refuses it too, so run CUDA alone.
    let w = p.blocks(dt, &[n, k], &blocks(&mut rng, dt, n, k));
    let x = p.rand(&mut rng, DType::F32, &[1, n]);
    let d = p.zeros(DType::F32, &[1, k]);
    let node = lowsync_backend::ExecNode {
        op: Op::MulMat,
        name: "wrong_way".into(),
        dst: d.gpu.clone(),
        srcs: vec![x.gpu.clone(), w.gpu.clone()],
    };
    let g = std::sync::Arc::new(lowsync_backend::ExecGraph::new(vec![node]));
    use lowsync_backend::Backend;
    let r = p
        .gpu
        .graph_compute_async(&g)
        .and_then(|()| p.gpu.synchronize());
    let msg = r
        .expect_err("a strided contraction axis is refused")
        .to_string();
    assert!(msg.contains("x @ w.T"), "{msg}");
}

/// Decode's head on a quantized weight: the product and its `Argmax` in one graph run as one
/// product with the argmax folded in (`fused_gemv1_q`, its rows one or, with
/// `gemv_q_head_pairs`, two to a unit) + `argmax_take`; with the final `RmsNorm -> Mul` in
/// front, as one launch that takes the norm as its prologue and the index itself
/// (`gemv_q_head_fold`). The logits match the oracle's and the index is the argmax of the
/// logits CUDA wrote (the lower column on a tie, made by a repeated row), launch after launch.
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_quantized_head_and_its_argmax_give_the_logits_argmax() {
    for tune in QDOTS {
        for norm in [false, true] {
            // The head's rows one to a unit, then two (300 rows: 150 pairs; the tie across two
            // pairs); with the norm, folded in or launched first.
            head_and_argmax(&format!("{tune},gemv_q_head_pairs=0"), norm);
            head_and_argmax(&format!("{tune},gemv_q_head_pairs=1"), norm);
        }
        head_and_argmax(&format!("{tune},gemv_q_head_fold=0"), true);
    }
}

fn head_and_argmax(tune: &str, norm: bool) {
    use lowsync_backend::{Backend, ExecGraph, ExecNode};
    use std::sync::Arc;
    let p = pair_tuned("quant_head", tune);
    let mut rng = Rng::new(37);
    for dt in quants() {
        let (n, k) = (300, 2 * dt.block_size());
        let mut bytes = blocks(&mut rng, dt, n, k);
        let row = dt.row_bytes(k).expect("whole blocks");
        // Row 7 repeats row 200: whichever is best, a tie between them goes to 7.
        bytes.copy_within(200 * row..201 * row, 7 * row);
        let w = p.blocks(dt, &[n, k], &bytes);
        let wt = w.view(&[k, n], &[1, k], 0);
        let x = p.rand(&mut rng, DType::F32, &[1, k]);
        // With `norm`: x is the norm's input and its weight row nw; the head reads their product.
        let (nw, nx, act) = (
            p.rand(&mut rng, DType::F32, &[1, k]),
            p.zeros(DType::F32, &[1, k]),
            p.zeros(DType::F32, &[1, k]),
        );
        let logits = p.zeros(DType::F32, &[1, n]);
        let idx = p.ints(&[1], &[-1]);
        let nodes = |l: &Twin, x: &Twin, w: &Twin, i: &Twin, gpu: bool| {
            let pick = |t: &Twin| if gpu { t.gpu.clone() } else { t.cpu.clone() };
            let mut v = Vec::new();
            if norm {
                v.push(ExecNode {
                    op: Op::RmsNorm { eps: 1e-5 },
                    name: "norm".into(),
                    dst: pick(&nx),
                    srcs: vec![pick(x)],
                });
                v.push(ExecNode {
                    op: Op::Mul,
                    name: "norm_w".into(),
                    dst: pick(&act),
                    srcs: vec![pick(&nx), pick(&nw)],
                });
            }
            let a = if norm { pick(&act) } else { pick(x) };
            v.push(ExecNode {
                op: Op::MulMat,
                name: "head".into(),
                dst: pick(l),
                srcs: vec![a, pick(w)],
            });
            v.push(ExecNode {
                op: Op::Argmax,
                name: "next".into(),
                dst: pick(i),
                srcs: vec![pick(l)],
            });
            v
        };
        p.cpu
            .graph_compute_async(&Arc::new(ExecGraph::new(nodes(
                &logits, &x, &wt, &idx, false,
            ))))
            .expect("the oracle runs the head");
        p.gpu
            .graph_compute_async(&Arc::new(ExecGraph::new(nodes(
                &logits, &x, &wt, &idx, true,
            ))))
            .and_then(|()| p.gpu.synchronize())
            .unwrap_or_else(|e| panic!("{dt}: CUDA failed: {e}"));
        let (want, got) = p.read(&logits);
        let e = nmse(&want, &got);
        let bound = decode_bound(tune);
        assert!(
            e <= bound,
            "{tune} norm {norm} {dt}: logits NMSE {e:e} > {bound:e}"
        );
        if norm {
            // The norm's product is written (something may read it after the graph).
            let (want, got) = p.read(&act);
            let e = nmse(&want, &got);
            assert!(e <= 1e-12, "{tune} {dt}: norm product NMSE {e:e}");
        }
        let mut best = 0;
        for (j, &v) in got.iter().enumerate() {
            if v > got[best] {
                best = j;
            }
        }
        let (_, got_idx) = p.read(&idx);
        assert_eq!(
            got_idx[0] as usize, best,
            "{tune} norm {norm} {dt}: the argmax of CUDA's logits"
        );
    }
}
