//! The fused decode kernels against the unfused chains they replace: each case is a node chain
//! on device buffers, run once with `fusion: false` and once with fusion on (graph replay off,
//! so every kernel is counted), comparing every tensor the chain leaves behind and the kernel
//! launches saved. The fused run is also checked against the CPU oracle.
//!
//! Bounds, fused vs unfused: NMSE <= 1e-8 for results stored in f32, whatever the weight or
//! cache dtype (the same f32 arithmetic, at most in another summation order); 1e-6 for results
//! stored in f16 and 1e-5 in bf16 (an f32 value one ulp apart may round to the neighbouring
//! half). Against the oracle, the op suite's bounds (1e-7 f32, 1e-5 f16, 1e-4 bf16). Ignored
//! without a CUDA device (see `common`).

mod common;

use std::sync::Arc;

use common::{decode_one, encode, gpu_with, nmse, quant_blocks, Rng, FLOATS};
use lowsync_backend::{Backend, BufferId, BufferUsage, Error, ExecGraph, ExecNode, TensorRef};
use lowsync_cpu::CpuBackend;
use lowsync_cuda::CudaConfig;
use lowsync_graph::{contiguous_strides, DType, Op, RopeMode};

/// A chain of nodes over a few buffers (`BufferId(i)`: buffer i of the case) and their
/// initial bytes; run on fresh buffers of each backend.
#[derive(Clone, Default)]
struct Case {
    bufs: Vec<Vec<u8>>,
    nodes: Vec<ExecNode>,
}

impl Case {
    fn buffer(&mut self, bytes: usize) -> u64 {
        self.bufs.push(vec![0; bytes]);
        (self.bufs.len() - 1) as u64
    }

    /// A packed tensor in a buffer of its own.
    fn tensor(&mut self, dtype: DType, shape: &[usize]) -> TensorRef {
        let n: usize = shape.iter().product();
        let buf = self.buffer(n * dtype.size_bytes());
        packed(buf, 0, dtype, shape)
    }

    /// Writes `values` (row-major over `t`'s shape) at `t`'s elements.
    fn fill(&mut self, t: &TensorRef, values: &[f32]) {
        assert_eq!(values.len(), t.numel());
        let esz = t.dtype.size_bytes();
        let buf = &mut self.bufs[t.buffer.0 as usize];
        for (i, v) in values.iter().enumerate() {
            let at = t.byte_offset + offset(t, i) * esz;
            buf[at..at + esz].copy_from_slice(&encode(t.dtype, &[*v]));
        }
    }

    fn rand(&mut self, rng: &mut Rng, t: &TensorRef, scale: f32) {
        let v: Vec<f32> = (0..t.numel()).map(|_| rng.f() * scale).collect();
        self.fill(t, &v);
    }

    fn node(&mut self, op: Op, dst: &TensorRef, srcs: &[&TensorRef]) {
        self.nodes.push(ExecNode {
            op,
            name: format!("{}#{}", op.name(), self.nodes.len()),
            dst: dst.clone(),
            srcs: srcs.iter().map(|&t| t.clone()).collect(),
        });
    }
}

fn view(
    buf: u64,
    byte_offset: usize,
    dtype: DType,
    shape: &[usize],
    strides: &[usize],
) -> TensorRef {
    TensorRef {
        buffer: BufferId(buf),
        byte_offset,
        dtype,
        shape: shape.to_vec(),
        strides: strides.to_vec(),
    }
}

fn packed(buf: u64, byte_offset: usize, dtype: DType, shape: &[usize]) -> TensorRef {
    view(buf, byte_offset, dtype, shape, &contiguous_strides(shape))
}

/// Element offset of row-major index `i` of `t`.
fn offset(t: &TensorRef, mut i: usize) -> usize {
    let mut off = 0;
    for ax in (0..t.shape.len()).rev() {
        off += (i % t.shape[ax]) * t.strides[ax];
        i /= t.shape[ax];
    }
    off
}

fn values(bufs: &[Vec<u8>], t: &TensorRef) -> Vec<f64> {
    let esz = t.dtype.size_bytes();
    (0..t.numel())
        .map(|i| {
            decode_one(
                t.dtype,
                &bufs[t.buffer.0 as usize],
                t.byte_offset + offset(t, i) * esz,
            )
        })
        .collect()
}

/// Runs `case` on `be` (fresh buffers); returns the final bytes of every buffer.
fn execute(be: &dyn Backend, case: &Case) -> Vec<Vec<u8>> {
    let (done, bufs) = try_execute(be, case);
    done.unwrap();
    bufs
}

/// `execute`, returning what the wait after the graph reported.
fn try_execute(be: &dyn Backend, case: &Case) -> (lowsync_backend::Result<()>, Vec<Vec<u8>>) {
    let ids: Vec<BufferId> = case
        .bufs
        .iter()
        .map(|b| {
            let id = be
                .alloc_buffer(b.len().max(4), BufferUsage::Compute)
                .unwrap();
            if !b.is_empty() {
                be.set_tensor(id, 0, b).unwrap();
            }
            id
        })
        .collect();
    let map = |t: &TensorRef| TensorRef {
        buffer: ids[t.buffer.0 as usize],
        ..t.clone()
    };
    let nodes = case
        .nodes
        .iter()
        .map(|n| ExecNode {
            op: n.op,
            name: n.name.clone(),
            dst: map(&n.dst),
            srcs: n.srcs.iter().map(map).collect(),
        })
        .collect();
    be.synchronize().unwrap();
    be.graph_compute_async(&Arc::new(ExecGraph::new(nodes)))
        .unwrap();
    let done = be.synchronize();
    let out = ids
        .iter()
        .zip(&case.bufs)
        .map(|(&id, b)| {
            let mut v = vec![0u8; b.len()];
            if !v.is_empty() {
                be.get_tensor(id, 0, &mut v).unwrap();
            }
            be.free_buffer(id);
            v
        })
        .collect();
    (done, out)
}

/// Final buffers and kernel launches of `case` on a CUDA backend.
fn on_gpu(test: &str, case: &Case, fusion: bool) -> (Vec<Vec<u8>>, u64) {
    let cfg = CudaConfig {
        fusion,
        graphs: false,
        ..CudaConfig::default()
    };
    let be = gpu_with(test, cfg);
    let before = be.stats().snapshot();
    let bufs = execute(&*be, case);
    (bufs, be.stats().snapshot().since(&before).kernel_launches)
}

fn fused_bound(d: DType) -> f64 {
    match d {
        DType::F16 => 1e-6,
        DType::BF16 => 1e-5,
        _ => 1e-8,
    }
}

fn oracle_bound(d: DType) -> f64 {
    match d {
        DType::F16 => 1e-5,
        DType::BF16 => 1e-4,
        _ => 1e-7,
    }
}

fn assert_close(what: &str, want: &[f64], got: &[f64], bound: f64) {
    let e = nmse(want, got);
    assert!(
        e <= bound,
        "{what}: NMSE {e:e} > {bound:e}\nwant {:?}\ngot  {:?}",
        &want[..want.len().min(8)],
        &got[..got.len().min(8)]
    );
}

/// Runs `case` unfused and fused (the fused run on `fused_case`, the same chain with other
/// initial bytes where a test wants that), compares `outputs` and checks that fusion saved
/// `saved` launches.
fn check_with(
    test: &str,
    case: &Case,
    fused_case: &Case,
    outputs: &[(&str, &TensorRef)],
    saved: u64,
) {
    check_against(test, case, fused_case, outputs, saved, oracle_bound)
}

/// The CPU oracle's products on quantized weights round the activations to 16-bit blocks
/// (`LOWSYNC_CPU_QUANT_DOT`'s default): an f32 result differs from the device's f32 products
/// by that rounding (2.8e-7 NMSE on the H200 for a Q4_0 layer, fused and unfused alike).
fn quant_oracle_bound(d: DType) -> f64 {
    oracle_bound(d).max(1e-6)
}

fn check_against(
    test: &str,
    case: &Case,
    fused_case: &Case,
    outputs: &[(&str, &TensorRef)],
    saved: u64,
    oracle_bound: fn(DType) -> f64,
) {
    let (off, n_off) = on_gpu(test, case, false);
    let (on, n_on) = on_gpu(test, fused_case, true);
    let oracle = execute(&CpuBackend::new(), case);
    for (name, t) in outputs {
        let what = format!("{test}: {name}");
        let got = values(&on, t);
        assert_close(
            &format!("{what} vs unfused"),
            &values(&off, t),
            &got,
            fused_bound(t.dtype),
        );
        assert_close(
            &format!("{what} vs oracle"),
            &values(&oracle, t),
            &got,
            oracle_bound(t.dtype),
        );
    }
    assert_eq!(
        n_off - n_on,
        saved,
        "{test}: launches {n_off} unfused, {n_on} fused"
    );
}

fn check(test: &str, case: &Case, outputs: &[(&str, &TensorRef)], saved: u64) {
    check_with(test, case, case, outputs, saved)
}

/// A GGUF weight `[out, in]` (random, scaled by 1/sqrt(in); of a block type: random blocks
/// with finite scales) seen as `w.T`.
fn weight(c: &mut Case, rng: &mut Rng, dtype: DType, inp: usize, out: usize) -> TensorRef {
    if dtype.is_quantized() {
        let bytes = quant_blocks(rng, dtype, out, inp);
        let buf = c.buffer(bytes.len());
        c.bufs[buf as usize] = bytes;
        return view(buf, 0, dtype, &[inp, out], &[1, inp]);
    }
    let w = c.tensor(dtype, &[out, inp]);
    c.rand(rng, &w, 1.0 / (inp as f32).sqrt());
    view(w.buffer.0, 0, dtype, &[inp, out], &[1, inp])
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn norm_and_weight_row_are_one_launch() {
    let mut rng = Rng::new(31);
    for xdt in [DType::F32, DType::F16] {
        for wdt in FLOATS {
            for in_place in [true, false] {
                for transposed in [false, true] {
                    let mut c = Case::default();
                    let x = if transposed {
                        let raw = c.tensor(xdt, &[300, 3]);
                        c.rand(&mut rng, &raw, 2.0);
                        view(raw.buffer.0, 0, xdt, &[3, 300], &[1, 3])
                    } else {
                        let x = c.tensor(xdt, &[3, 300]);
                        c.rand(&mut rng, &x, 2.0);
                        x
                    };
                    let w = c.tensor(wdt, &[300]);
                    c.rand(&mut rng, &w, 1.5);
                    let norm = c.tensor(xdt, &[3, 300]);
                    let out = if in_place {
                        norm.clone()
                    } else {
                        c.tensor(xdt, &[3, 300])
                    };
                    c.node(Op::RmsNorm { eps: 1e-5 }, &norm, &[&x]);
                    c.node(Op::Mul, &out, &[&norm, &w]);
                    let test =
                        format!("norm x {xdt} w {wdt} in_place {in_place} transposed {transposed}");
                    check(&test, &c, &[("norm", &norm), ("product", &out)], 1);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_norm_in_front_of_decode_products_joins_their_launch() {
    let mut rng = Rng::new(39);
    // k 2050: weight rows not 16-byte aligned, so the norm runs as its own launch first; k
    // 4096: longer than the prologue's registers (its loop).
    for (k, launches) in [(64, 1), (4096, 1), (2050, 2)] {
        for (ndt, in_place) in [(DType::F32, true), (DType::F32, false), (DType::F16, false)] {
            for (nw_dt, products) in [(DType::F32, 3), (DType::F16, 1), (DType::BF16, 2)] {
                let mut c = Case::default();
                let x = c.tensor(DType::F32, &[1, k]);
                c.rand(&mut rng, &x, 2.0);
                let nw = c.tensor(nw_dt, &[k]);
                c.rand(&mut rng, &nw, 1.5);
                let norm = c.tensor(ndt, &[1, k]);
                let h = if in_place {
                    norm.clone()
                } else {
                    c.tensor(DType::F32, &[1, k])
                };
                c.node(Op::RmsNorm { eps: 1e-5 }, &norm, &[&x]);
                c.node(Op::Mul, &h, &[&norm, &nw]);
                let mut outputs = vec![("norm".to_string(), norm.clone()), ("h".into(), h.clone())];
                for p in 0..products {
                    let w = weight(&mut c, &mut rng, DType::F16, k, 40 + 8 * p);
                    let out = c.tensor(DType::F32, &[1, 40 + 8 * p]);
                    c.node(Op::MulMat, &out, &[&h, &w]);
                    outputs.push((format!("product {p}"), out));
                }
                let test = format!(
                    "norm prologue k {k} norm {ndt} in_place {in_place} weight row {nw_dt} \
                     products {products}"
                );
                let outs: Vec<(&str, &TensorRef)> =
                    outputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
                let saved = c.nodes.len() as u64 - launches;
                check(&test, &c, &outs, saved);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn projections_of_one_activation_are_one_launch() {
    let mut rng = Rng::new(32);
    for wdt in FLOATS {
        // k = 2050: rows not 16-byte aligned (scalar loads) and a k % 8 tail; m = 3: eight
        // rows per pass.
        for (m, k) in [(1, 64), (1, 2050), (3, 256)] {
            for bias in [false, true] {
                let mut c = Case::default();
                let h = c.tensor(DType::F32, &[m, k]);
                c.rand(&mut rng, &h, 1.0);
                let mut outputs = Vec::new();
                for (name, n) in [("q", 96), ("k", 32), ("v", 32)] {
                    let w = weight(&mut c, &mut rng, wdt, k, n);
                    let out = c.tensor(DType::F32, &[m, n]);
                    c.node(Op::MulMat, &out, &[&h, &w]);
                    if bias {
                        // q: in place; k: into a new tensor (the product survives); v: an f16
                        // bias.
                        let b = c.tensor(if name == "v" { DType::F16 } else { DType::F32 }, &[n]);
                        c.rand(&mut rng, &b, 1.0);
                        let sum = if name == "q" {
                            out.clone()
                        } else {
                            c.tensor(DType::F32, &[m, n])
                        };
                        c.node(Op::Add, &sum, &[&out, &b]);
                        outputs.push((name, sum));
                    }
                    outputs.push((name, out));
                }
                let test = format!("qkv {wdt} m {m} k {k} bias {bias}");
                let outs: Vec<(&str, &TensorRef)> = outputs.iter().map(|(n, t)| (*n, t)).collect();
                check(&test, &c, &outs, if bias { 5 } else { 2 });
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn gate_up_and_swiglu_are_one_launch() {
    let mut rng = Rng::new(33);
    for wdt in FLOATS {
        for m in [1, 4] {
            for in_place in [true, false] {
                let mut c = Case::default();
                let h = c.tensor(DType::F32, &[m, 256]);
                c.rand(&mut rng, &h, 1.0);
                let wg = weight(&mut c, &mut rng, wdt, 256, 200);
                let wu = weight(&mut c, &mut rng, wdt, 256, 200);
                let gate = c.tensor(DType::F32, &[m, 200]);
                let up = c.tensor(DType::F32, &[m, 200]);
                c.node(Op::MulMat, &gate, &[&h, &wg]);
                c.node(Op::MulMat, &up, &[&h, &wu]);
                let f = if in_place {
                    gate.clone()
                } else {
                    c.tensor(DType::F32, &[m, 200])
                };
                c.node(Op::SwiGlu, &f, &[&gate, &up]);
                let test = format!("gate/up {wdt} m {m} in_place {in_place}");
                check(
                    &test,
                    &c,
                    &[("gate", &gate), ("up", &up), ("swiglu", &f)],
                    2,
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn product_and_residual_add_are_one_launch() {
    let mut rng = Rng::new(34);
    for wdt in FLOATS {
        for m in [1, 2] {
            for residual_first in [true, false] {
                let mut c = Case::default();
                let a = c.tensor(DType::F32, &[m, 512]);
                c.rand(&mut rng, &a, 1.0);
                let x = c.tensor(DType::F32, &[m, 256]);
                c.rand(&mut rng, &x, 1.0);
                let w = weight(&mut c, &mut rng, wdt, 512, 256);
                let o = c.tensor(DType::F32, &[m, 256]);
                c.node(Op::MulMat, &o, &[&a, &w]);
                // x + o in place over x (llama.py), or o + x in place over o.
                if residual_first {
                    c.node(Op::Add, &x, &[&x, &o]);
                } else {
                    c.node(Op::Add, &o, &[&o, &x]);
                }
                let test = format!("residual {wdt} m {m} residual_first {residual_first}");
                check(&test, &c, &[("product", &o), ("residual", &x)], 1);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn the_head_product_and_its_argmax_are_one_launch() {
    let mut rng = Rng::new(41);
    for wdt in FLOATS {
        // A vocabulary of one block and one of thousands (every block folds its key in).
        for vocab in [300, 32003] {
            let mut c = Case::default();
            let h = c.tensor(DType::F32, &[1, 256]);
            c.rand(&mut rng, &h, 1.0);
            let w = weight(&mut c, &mut rng, wdt, 256, vocab);
            let logits = c.tensor(DType::F32, &[1, vocab]);
            let next = c.tensor(DType::I32, &[1]);
            c.node(Op::MulMat, &logits, &[&h, &w]);
            c.node(Op::Argmax, &next, &[&logits]);
            let test = format!("head {wdt} vocab {vocab}");
            let (off, _) = on_gpu(&test, &c, false);
            let (on, _) = on_gpu(&test, &c, true);
            assert_eq!(
                values(&on, &logits),
                values(&off, &logits),
                "{test}: the same kernel arithmetic, so the same logits"
            );
            assert_eq!(values(&on, &next), values(&off, &next), "{test}: index");
            // As many launches: the argmax kernel that read the logits back with one block is
            // replaced by the one-thread take of the folded index.
            check(&test, &c, &[("logits", &logits)], 0);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn rope_and_cache_rows_are_one_launch() {
    let mut rng = Rng::new(35);
    let (n_kv, hd, n_ctx) = (2, 64, 24);
    for cache in FLOATS {
        for mode in [RopeMode::Normal, RopeMode::Neox] {
            for n_dims in [hd, hd / 2] {
                // Three rows with a repeated index: the last write wins.
                for (pos, idx) in [(vec![17], vec![17]), (vec![5, 6, 7], vec![9, 4, 9])] {
                    let t = pos.len();
                    let mut c = Case::default();
                    let k_cache = c.tensor(cache, &[n_ctx, n_kv * hd]);
                    let v_cache = c.tensor(cache, &[n_ctx, n_kv * hd]);
                    c.rand(&mut rng, &k_cache, 1.0);
                    c.rand(&mut rng, &v_cache, 1.0);
                    let k = c.tensor(DType::F32, &[t, n_kv, hd]);
                    let v = c.tensor(DType::F32, &[t, n_kv * hd]);
                    c.rand(&mut rng, &k, 1.0);
                    c.rand(&mut rng, &v, 1.0);
                    let p = c.tensor(DType::I32, &[t]);
                    c.fill(&p, &pos.iter().map(|&x| x as f32).collect::<Vec<_>>());
                    let ix = c.tensor(DType::I32, &[t]);
                    c.fill(&ix, &idx.iter().map(|&x| x as f32).collect::<Vec<_>>());
                    let r = c.tensor(DType::F32, &[t, n_kv, hd]);
                    let rows = packed(r.buffer.0, 0, DType::F32, &[t, n_kv * hd]);
                    let rope = Op::Rope {
                        mode,
                        n_dims,
                        theta_base: 10_000.0,
                    };
                    c.node(rope, &r, &[&k, &p]);
                    c.node(Op::SetRows, &k_cache, &[&k_cache, &rows, &ix]);
                    c.node(Op::SetRows, &v_cache, &[&v_cache, &v, &ix]);
                    let test = format!("rope {cache} cache {mode:?} n_dims {n_dims} rows {t}");
                    let outs = [("rope", &r), ("k cache", &k_cache), ("v cache", &v_cache)];
                    check(&test, &c, &outs, 2);
                }
            }
        }
    }
}

/// q/k/v products of one row with their Rope and cache-row writes as epilogues (decode's
/// row-pair kernel): one launch, partial rotation included. With an activation that is not
/// 16-byte aligned the group runs as the products' launch, then each Rope and SetRows.
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn products_with_rope_and_cache_rows_are_one_launch() {
    let mut rng = Rng::new(41);
    let (d, nh, nkv, n_ctx, at) = (128, 4, 2, 16, 9);
    for (wdt, cache, bias) in [
        (DType::F16, DType::F16, false),
        (DType::BF16, DType::BF16, true),
        (DType::F32, DType::F32, false),
        (DType::F16, DType::F32, true),
    ] {
        for (hd, x_at) in [(32, 0), (16, 0), (16, 4)] {
            for n_dims in [hd, hd / 2] {
                let kvd = nkv * hd;
                let q_d = nh * hd;
                let mut c = Case::default();
                let xb = c.buffer(x_at + d * 4);
                let x = packed(xb, x_at, DType::F32, &[1, d]);
                c.rand(&mut rng, &x, 1.0);
                let k_cache = c.tensor(cache, &[n_ctx, kvd]);
                let v_cache = c.tensor(cache, &[n_ctx, kvd]);
                c.rand(&mut rng, &k_cache, 1.0);
                c.rand(&mut rng, &v_cache, 1.0);
                let p = c.tensor(DType::I32, &[1]);
                c.fill(&p, &[(at + 3) as f32]);
                let ix = c.tensor(DType::I32, &[1]);
                c.fill(&ix, &[at as f32]);
                let mut vals = Vec::new();
                for n in [q_d, kvd, kvd] {
                    let out = c.tensor(DType::F32, &[1, n]);
                    let w = weight(&mut c, &mut rng, wdt, d, n);
                    c.node(Op::MulMat, &out, &[&x, &w]);
                    if bias {
                        let b = c.tensor(DType::F32, &[n]);
                        c.rand(&mut rng, &b, 0.5);
                        c.node(Op::Add, &out, &[&out, &b]);
                    }
                    vals.push(out);
                }
                let rope = Op::Rope {
                    mode: RopeMode::Normal,
                    n_dims,
                    theta_base: 10_000.0,
                };
                let heads =
                    |t: &TensorRef, h: usize| packed(t.buffer.0, 0, DType::F32, &[1, h, hd]);
                let rq = c.tensor(DType::F32, &[1, nh, hd]);
                let rk = c.tensor(DType::F32, &[1, nkv, hd]);
                c.node(rope, &rq, &[&heads(&vals[0], nh), &p]);
                c.node(rope, &rk, &[&heads(&vals[1], nkv), &p]);
                let rk_rows = packed(rk.buffer.0, 0, DType::F32, &[1, kvd]);
                c.node(Op::SetRows, &k_cache, &[&k_cache, &rk_rows, &ix]);
                c.node(Op::SetRows, &v_cache, &[&v_cache, &vals[2], &ix]);
                let n = c.nodes.len() as u64;
                let test = format!(
                    "qkv epilogues w {wdt} cache {cache} bias {bias} hd {hd} n_dims {n_dims} x at {x_at}"
                );
                let launches = if x_at == 0 { 1 } else { 5 };
                let outs = [
                    ("q", &vals[0]),
                    ("k", &vals[1]),
                    ("v", &vals[2]),
                    ("q rope", &rq),
                    ("k rope", &rk),
                    ("k cache", &k_cache),
                    ("v cache", &v_cache),
                ];
                check(&test, &c, &outs, n - launches);
            }
        }
    }
}

/// A bad cache index in a product's SetRows epilogue is reported against that node, and the
/// backend stays usable.
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_bad_cache_row_in_an_epilogue_is_an_error_naming_its_node() {
    let be = gpu_with("epilogue_bad_row", CudaConfig::default());
    let mut rng = Rng::new(42);
    let (d, n, n_ctx) = (64, 32, 8);
    let mut c = Case::default();
    let x = c.tensor(DType::F32, &[1, d]);
    c.rand(&mut rng, &x, 1.0);
    let cache = c.tensor(DType::F16, &[n_ctx, n]);
    let ix = c.tensor(DType::I32, &[1]);
    let out = c.tensor(DType::F32, &[1, n]);
    let w = weight(&mut c, &mut rng, DType::F16, d, n);
    c.node(Op::MulMat, &out, &[&x, &w]);
    c.node(Op::SetRows, &cache, &[&cache, &out, &ix]);
    for (row, ok) in [(n_ctx as f32, false), (-1.0, false), (3.0, true)] {
        c.fill(&ix, &[row]);
        match (try_execute(&*be, &c).0, ok) {
            (Ok(()), true) => {}
            (Err(Error::Kernel { op, node, msg }), false) => {
                assert_eq!((op, node.as_str()), ("set_rows", "set_rows#1"), "{msg}");
                assert!(msg.contains("out of range"), "{msg}");
            }
            (other, _) => panic!("row {row}: got {other:?}"),
        }
    }
}

/// Mask rows: position j of head h is visible when j < valid[h], except j == hole.
fn mask_values(heads: usize, n_ctx: usize, valid: &[usize], hole: Option<usize>) -> Vec<f32> {
    (0..heads * n_ctx)
        .map(|i| {
            let (h, j) = (i / n_ctx, i % n_ctx);
            if j < valid[h % valid.len()] && Some(j) != hole {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

/// The attention chain of llama.py for one token: q [1, hq, d] f32 seen as [hq, 1, d], K and
/// V caches [n_ctx, hkv * d] seen as [hkv, d, n_ctx] and [hkv, n_ctx, d], scores, softmax
/// under `mask`, p @ V and the Cpy of its permutation, all in one activation buffer. With
/// `over_scores`, the Cpy's result lies over the scores (as the allocator places it) and a
/// last node overwrites the rest of them, so they are dead. Returns the case, the masked
/// cache rows' tensors and the outputs to compare.
struct Attn {
    case: Case,
    k_cache: TensorRef,
    v_cache: TensorRef,
    outputs: Vec<(&'static str, TensorRef)>,
}

fn attention_case(
    rng: &mut Rng,
    kv: DType,
    (hq, hkv, d): (usize, usize, usize),
    n_ctx: usize,
    mask: (&[usize], usize, Option<usize>),
    over_scores: bool,
) -> Attn {
    let (valid, mask_heads, hole) = mask;
    let mut c = Case::default();
    let k_cache = c.tensor(kv, &[n_ctx, hkv * d]);
    let v_cache = c.tensor(kv, &[n_ctx, hkv * d]);
    c.rand(rng, &k_cache, 1.0);
    c.rand(rng, &v_cache, 1.0);
    let m = if mask_heads == 1 {
        c.tensor(DType::F32, &[1, n_ctx])
    } else {
        c.tensor(DType::F32, &[mask_heads, 1, n_ctx])
    };
    c.fill(&m, &mask_values(mask_heads, n_ctx, valid, hole));
    let (sq, ss, so) = (hq * d * 4, hq * n_ctx * 4, hq * d * 4);
    let act = c.buffer(sq + 2 * ss + so + so.max(ss));
    let q = packed(act, 0, DType::F32, &[1, hq, d]);
    c.rand(rng, &q, 1.0);
    let qh = view(act, 0, DType::F32, &[hq, 1, d], &[d, hq * d, 1]);
    let keys = view(k_cache.buffer.0, 0, kv, &[hkv, d, n_ctx], &[d, 1, hkv * d]);
    let values = view(v_cache.buffer.0, 0, kv, &[hkv, n_ctx, d], &[d, hkv * d, 1]);
    let scores = packed(act, sq, DType::F32, &[hq, 1, n_ctx]);
    let probs = packed(act, sq + ss, DType::F32, &[hq, 1, n_ctx]);
    let o = packed(act, sq + 2 * ss, DType::F32, &[hq, 1, d]);
    let o_t = view(act, sq + 2 * ss, DType::F32, &[1, hq, d], &[d, d, 1]);
    let att = packed(
        act,
        if over_scores { sq } else { sq + 2 * ss + so },
        DType::F32,
        &[1, hq, d],
    );
    c.node(Op::MulMat, &scores, &[&qh, &keys]);
    c.node(
        Op::SoftMax {
            scale: 1.0 / (d as f32).sqrt(),
        },
        &probs,
        &[&scores, &m],
    );
    c.node(Op::MulMat, &o, &[&probs, &values]);
    c.node(Op::Cpy, &att, &[&o_t]);
    let mut outputs = vec![("probs", probs), ("p @ V", o), ("copy", att)];
    if over_scores {
        assert!(so < ss, "the copy covers part of the scores");
        let rest = packed(act, sq + so, DType::F32, &[(ss - so) / 4]);
        let src = packed(act, sq + 2 * ss + so, DType::F32, &[(ss - so) / 4]);
        c.rand(rng, &src, 1.0);
        c.node(Op::Scale { scale: 1.0 }, &rest, &[&src]);
        outputs.push(("rest of the scores", rest));
    } else {
        outputs.push(("scores", scores));
    }
    Attn {
        case: c,
        k_cache,
        v_cache,
        outputs,
    }
}

fn outputs(a: &Attn) -> Vec<(&str, &TensorRef)> {
    a.outputs.iter().map(|(n, t)| (*n, t)).collect()
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn decode_attention_is_one_launch() {
    let mut rng = Rng::new(36);
    let n_ctx = 160;
    for kv in FLOATS {
        // GQA 8 over 2; no GQA at head_dim 128; head_dim 80 (not a power of two) over 3.
        for heads in [(8, 2, 64), (4, 4, 128), (6, 3, 80)] {
            let masks: [(&[usize], usize, Option<usize>); 4] = [
                (&[37], 1, Some(5)),                 // a valid prefix with a hole
                (&[n_ctx], 1, None),                 // every row
                (&[0], 1, None),                     // every row masked: zeros
                (&[3, 60, n_ctx, 1], heads.0, None), // per-head masks
            ];
            for mask in masks {
                for over_scores in [false, true] {
                    let a = attention_case(&mut rng, kv, heads, n_ctx, mask, over_scores);
                    let test =
                        format!("attention {kv} {heads:?} mask {mask:?} over_scores {over_scores}");
                    check(&test, &a.case, &outputs(&a), 3);
                }
            }
        }
    }
}

/// `a`'s case with `rows` of both caches NaN.
fn poison_rows(a: &Attn, kv: DType, rows: impl Iterator<Item = usize>) -> Case {
    let mut poisoned = a.case.clone();
    for row in rows {
        for cache in [&a.k_cache, &a.v_cache] {
            let r = view(
                cache.buffer.0,
                row * cache.strides[0] * kv.size_bytes(),
                kv,
                &[cache.shape[1]],
                &[1],
            );
            poisoned.fill(&r, &vec![f32::NAN; cache.shape[1]]);
        }
    }
    poisoned
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn masked_cache_rows_are_never_read() {
    let mut rng = Rng::new(37);
    let n_ctx = 96;
    let valid = 29;
    for kv in FLOATS {
        // Dead scores: the kernel reads neither K nor V rows under a -inf mask, so NaN there
        // changes nothing (the unfused chain, reading them, runs on finite rows).
        let a = attention_case(
            &mut rng,
            kv,
            (8, 2, 64),
            n_ctx,
            (&[valid], 1, Some(3)),
            true,
        );
        let poisoned = poison_rows(&a, kv, (valid..n_ctx).chain([3]));
        check_with(
            &format!("poisoned {kv} cache"),
            &a.case,
            &poisoned,
            &outputs(&a),
            3,
        );
    }
}

/// One decode layer of llama.py (d 256, 8 query heads over 2 kv heads of 32, ffn 512, 64 cache
/// rows, token at position 20) laid out as the scheduler's allocator lays it out: rope q over
/// h, rope k over the raw q, the scores over q/k/v, p @ V over the rotated q, its Cpy over the
/// scores, gate over them all, in-place bias and residual adds, SwiGlu in place over gate.
/// Weights of dtype `wdt[0]`, except v's and down's: `wdt[1]` (as a Q4_K_M file's Q6_K).
fn layer(
    rng: &mut Rng,
    bias: bool,
    wdt: [DType; 2],
    kv: DType,
) -> (Case, Vec<(&'static str, TensorRef)>) {
    let (d, nh, nkv, hd, dff, n_ctx, at) = (256, 8, 2, 32, 512, 64, 20);
    let kvd = nkv * hd;
    let mut c = Case::default();
    let inputs = c.buffer(256 + n_ctx * 4);
    let pos = packed(inputs, 0, DType::I32, &[1]);
    let kv_idx = packed(inputs, 64, DType::I32, &[1]);
    let mask = packed(inputs, 256, DType::F32, &[1, n_ctx]);
    c.fill(&pos, &[at as f32]);
    c.fill(&kv_idx, &[at as f32]);
    c.fill(&mask, &mask_values(1, n_ctx, &[at + 1], None));
    let k_cache = c.tensor(kv, &[n_ctx, kvd]);
    let v_cache = c.tensor(kv, &[n_ctx, kvd]);
    let filled = |c: &mut Case, rng: &mut Rng, t: &TensorRef| {
        let rows = packed(t.buffer.0, 0, kv, &[at, kvd]);
        c.rand(rng, &rows, 1.0);
    };
    filled(&mut c, rng, &k_cache);
    filled(&mut c, rng, &v_cache);
    // Byte offsets: x, h, then a region reused by q/k/v, the scores, the copy and gate.
    let (xo, ho, qo) = (0, d * 4, 2 * d * 4);
    let (ko, vo) = (qo + d * 4, qo + d * 4 + kvd * 4);
    let big = (nh * n_ctx).max(dff).max(d + 2 * kvd);
    assert!(nh * n_ctx <= dff, "gate covers the scores");
    let po = qo + big * 4;
    let act = c.buffer(po + big * 4);
    let a = |off: usize, shape: &[usize]| packed(act, off, DType::F32, shape);
    let (x, h) = (a(xo, &[1, d]), a(ho, &[1, d]));
    c.rand(rng, &x, 1.0);
    let linear =
        |c: &mut Case, rng: &mut Rng, inp: &TensorRef, out: TensorRef, bias: bool, wdt: DType| {
            let w = weight(c, rng, wdt, inp.shape[1], out.shape[1]);
            c.node(Op::MulMat, &out, &[inp, &w]);
            if bias {
                let b = c.tensor(DType::F32, &[out.shape[1]]);
                c.rand(rng, &b, 0.5);
                c.node(Op::Add, &out, &[&out, &b]);
            }
        };
    let norm = |c: &mut Case, rng: &mut Rng| {
        let w = c.tensor(DType::F32, &[d]);
        c.rand(rng, &w, 1.0);
        c.node(Op::RmsNorm { eps: 1e-5 }, &h, &[&x]);
        c.node(Op::Mul, &h, &[&h, &w]);
    };
    norm(&mut c, rng);
    linear(&mut c, rng, &h, a(qo, &[1, d]), bias, wdt[0]);
    linear(&mut c, rng, &h, a(ko, &[1, kvd]), bias, wdt[0]);
    linear(&mut c, rng, &h, a(vo, &[1, kvd]), bias, wdt[1]);
    let rope = Op::Rope {
        mode: RopeMode::Normal,
        n_dims: hd,
        theta_base: 10_000.0,
    };
    c.node(rope, &a(ho, &[1, nh, hd]), &[&a(qo, &[1, nh, hd]), &pos]);
    c.node(rope, &a(qo, &[1, nkv, hd]), &[&a(ko, &[1, nkv, hd]), &pos]);
    c.node(
        Op::SetRows,
        &k_cache,
        &[&k_cache, &a(qo, &[1, kvd]), &kv_idx],
    );
    c.node(
        Op::SetRows,
        &v_cache,
        &[&v_cache, &a(vo, &[1, kvd]), &kv_idx],
    );
    let q = view(act, ho, DType::F32, &[nh, 1, hd], &[hd, nh * hd, 1]);
    let keys = view(k_cache.buffer.0, 0, kv, &[nkv, hd, n_ctx], &[hd, 1, kvd]);
    let values = view(v_cache.buffer.0, 0, kv, &[nkv, n_ctx, hd], &[hd, kvd, 1]);
    c.node(Op::MulMat, &a(qo, &[nh, 1, n_ctx]), &[&q, &keys]);
    let sm = Op::SoftMax {
        scale: 1.0 / (hd as f32).sqrt(),
    };
    c.node(
        sm,
        &a(po, &[nh, 1, n_ctx]),
        &[&a(qo, &[nh, 1, n_ctx]), &mask],
    );
    c.node(
        Op::MulMat,
        &a(ho, &[nh, 1, hd]),
        &[&a(po, &[nh, 1, n_ctx]), &values],
    );
    let o_t = view(act, ho, DType::F32, &[1, nh, hd], &[hd, hd, 1]);
    c.node(Op::Cpy, &a(qo, &[1, nh, hd]), &[&o_t]);
    let o = a(ho, &[1, d]);
    linear(&mut c, rng, &a(qo, &[1, d]), o.clone(), false, wdt[0]);
    c.node(Op::Add, &x, &[&x, &o]);
    norm(&mut c, rng);
    let (gate, up) = (a(qo, &[1, dff]), a(po, &[1, dff]));
    linear(&mut c, rng, &h, gate.clone(), false, wdt[0]);
    linear(&mut c, rng, &h, up.clone(), false, wdt[0]);
    c.node(Op::SwiGlu, &gate, &[&gate, &up]);
    linear(&mut c, rng, &gate, o.clone(), false, wdt[1]);
    c.node(Op::Add, &x, &[&x, &o]);
    let outputs = vec![
        ("x", x),
        ("h", h),
        ("ffn", gate),
        ("up", up),
        ("down", o),
        ("k cache", k_cache),
        ("v cache", v_cache),
    ];
    (c, outputs)
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_decode_layer_is_five_launches() {
    let mut rng = Rng::new(38);
    for (wdt, kv) in [
        (DType::F32, DType::F32),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F32),
    ] {
        for bias in [false, true] {
            let (c, outs) = layer(&mut rng, bias, [wdt, wdt], kv);
            let unfused = if bias { 25 } else { 22 };
            assert_eq!(c.nodes.len(), unfused);
            let test = format!("layer weights {wdt} cache {kv} bias {bias}");
            let outs: Vec<(&str, &TensorRef)> = outs.iter().map(|(n, t)| (*n, t)).collect();
            check(&test, &c, &outs, unfused as u64 - 5);
        }
    }
}

/// The same layer on quantized weights (`fused_gemv1_q`): still five launches, with one block
/// type throughout or mixed as llama-quantize mixes them (Q4_K_M: Q6_K for v and down; Q4_0
/// beside Q8_0), against the unfused products (`mul_mat_vec_q` and the separate norm, rope,
/// SwiGlu, residual kernels) and the CPU oracle.
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_quantized_decode_layer_is_five_launches() {
    let mut rng = Rng::new(39);
    for wdt in [
        [DType::Q4_0, DType::Q4_0],
        [DType::Q4_K, DType::Q6_K],
        [DType::Q8_0, DType::Q4_0],
        [DType::Q5_K, DType::IQ4_XS],
        [DType::Q2_K, DType::Q3_K],
        [DType::Q4_1, DType::IQ4_NL],
        [DType::Q5_0, DType::Q5_1],
    ] {
        for (bias, kv) in [(false, DType::F32), (true, DType::F16)] {
            let (c, outs) = layer(&mut rng, bias, wdt, kv);
            let unfused = if bias { 25 } else { 22 };
            assert_eq!(c.nodes.len(), unfused);
            let test = format!("layer weights {} {} cache {kv} bias {bias}", wdt[0], wdt[1]);
            let outs: Vec<(&str, &TensorRef)> = outs.iter().map(|(n, t)| (*n, t)).collect();
            check_against(&test, &c, &c, &outs, unfused as u64 - 5, quant_oracle_bound);
        }
    }
}

/// The quantized layer with each arithmetic of `LOWSYNC_CUDA_TUNE=qdot` (`q16`: 16-bit
/// activation blocks and integer dot products, the default; `f32`): the same launches, each
/// within the oracle's bound (the oracle quantizes activations as `q16` does), and the two
/// within 1e-6 of each other (they differ by the activations' 16-bit rounding, about 1e-9).
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_quantized_decode_layer_gives_the_same_results_with_either_qdot() {
    let mut rng = Rng::new(41);
    for wdt in [[DType::Q4_0, DType::Q4_0], [DType::Q4_K, DType::Q6_K]] {
        let (c, outs) = layer(&mut rng, true, wdt, DType::F16);
        let test = format!("layer weights {} {} by qdot", wdt[0], wdt[1]);
        let tuned = |tune: &str| {
            let cfg = CudaConfig::default().with_tune(tune).expect("a valid tune");
            on_gpu_cfg(&test, &c, cfg)
        };
        let (q16, n_q16) = tuned("qdot=q16");
        let (f32s, n_f32) = tuned("qdot=f32");
        assert_eq!(n_q16, n_f32, "{test}: launches");
        let oracle = execute(&CpuBackend::new(), &c);
        for (name, t) in &outs {
            let got = values(&q16, t);
            let what = format!("{test}: {name}");
            assert_close(&format!("{what} q16 vs f32"), &values(&f32s, t), &got, 1e-6);
            let bound = quant_oracle_bound(t.dtype);
            assert_close(
                &format!("{what} q16 vs oracle"),
                &values(&oracle, t),
                &got,
                bound,
            );
            let f = values(&f32s, t);
            assert_close(
                &format!("{what} f32 vs oracle"),
                &values(&oracle, t),
                &f,
                bound,
            );
        }
    }
}

/// The quantized layer through every one of `fused_gemv1_q`'s typed entry points
/// (`gemv_q_typed=2`, the default; `1` takes those of Q4_0, Q8_0 and Q6_K only) and through the
/// generic kernel (`=0`): the same launches and the same bits, for a layer of one block type
/// per typed entry point and for Q4_K beside Q6_K.
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_quantized_decode_layer_gives_the_same_bits_through_the_typed_kernels() {
    let mut rng = Rng::new(43);
    for wdt in [
        [DType::Q4_0, DType::Q4_0],
        [DType::Q8_0, DType::Q8_0],
        [DType::Q4_K, DType::Q4_K],
        [DType::Q6_K, DType::Q6_K],
        [DType::Q4_K, DType::Q6_K],
    ] {
        let (c, outs) = layer(&mut rng, true, wdt, DType::F16);
        let test = format!("layer weights {} {} typed", wdt[0], wdt[1]);
        let tuned = |tune: &str| {
            let cfg = CudaConfig::default().with_tune(tune).expect("a valid tune");
            on_gpu_cfg(&test, &c, cfg)
        };
        let (typed, n_typed) = tuned("gemv_q_typed=2");
        let (generic, n_generic) = tuned("gemv_q_typed=0");
        assert_eq!(n_typed, n_generic, "{test}: launches");
        for (name, t) in &outs {
            let (a, b) = (values(&typed, t), values(&generic, t));
            let same =
                a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{test}: {name} differs between the typed and the generic kernel"
            );
        }
    }
}

/// The quantized layer with `qdot=q8` (8-bit activation blocks, dp4a): the same launches as
/// `q16`, and every result within 1e-2 NMSE of the oracle (which quantizes activations to 16
/// bits: 8-bit blocks move a product by 1e-5 to 4e-3 NMSE on random rows in the emulation,
/// short rows the most; a wrong kernel is off by order 1) and of the q16 run.
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_quantized_decode_layer_with_8_bit_activations_stays_near_the_oracle() {
    let mut rng = Rng::new(41);
    for wdt in [[DType::Q4_0, DType::Q4_0], [DType::Q4_K, DType::Q6_K]] {
        let (c, outs) = layer(&mut rng, true, wdt, DType::F16);
        let test = format!("layer weights {} {} q8", wdt[0], wdt[1]);
        let tuned = |tune: &str| {
            let cfg = CudaConfig::default().with_tune(tune).expect("a valid tune");
            on_gpu_cfg(&test, &c, cfg)
        };
        let (q8, n_q8) = tuned("qdot=q8");
        let (q16, n_q16) = tuned("qdot=q16");
        assert_eq!(n_q8, n_q16, "{test}: launches");
        let oracle = execute(&CpuBackend::new(), &c);
        for (name, t) in &outs {
            let got = values(&q8, t);
            let what = format!("{test}: {name}");
            assert_close(&format!("{what} q8 vs q16"), &values(&q16, t), &got, 1e-2);
            assert_close(
                &format!("{what} q8 vs oracle"),
                &values(&oracle, t),
                &got,
                1e-2,
            );
        }
    }
}

/// A norm and three biased projections on quantized weights of mixed block types: one launch
/// when the activation row is 16-byte aligned; when it is not, the group's nodes run unfused
/// at launch time (no launch saved), with the same results.
#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn quantized_projections_run_unfused_where_the_row_is_misaligned() {
    let mut rng = Rng::new(40);
    let k = 512;
    for lead in [0, 4] {
        let mut c = Case::default();
        let x = c.tensor(DType::F32, &[1, k]);
        c.rand(&mut rng, &x, 2.0);
        let nw = c.tensor(DType::F32, &[k]);
        c.rand(&mut rng, &nw, 1.5);
        let buf = c.buffer(lead + k * 4);
        let h = packed(buf, lead, DType::F32, &[1, k]);
        c.node(Op::RmsNorm { eps: 1e-5 }, &h, &[&x]);
        c.node(Op::Mul, &h, &[&h, &nw]);
        let mut outputs = vec![("h".to_string(), h.clone())];
        for (name, n, wdt) in [
            ("q", 96, DType::Q4_K),
            ("k", 32, DType::Q4_K),
            ("v", 32, DType::Q6_K),
        ] {
            let w = weight(&mut c, &mut rng, wdt, k, n);
            let out = c.tensor(DType::F32, &[1, n]);
            c.node(Op::MulMat, &out, &[&h, &w]);
            let b = c.tensor(DType::F32, &[n]);
            c.rand(&mut rng, &b, 1.0);
            c.node(Op::Add, &out, &[&out, &b]);
            outputs.push((name.to_string(), out));
        }
        let test = format!("quantized qkv, row {lead} bytes past a 16-byte boundary");
        let outs: Vec<(&str, &TensorRef)> = outputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let saved = if lead == 0 {
            c.nodes.len() as u64 - 1
        } else {
            0
        };
        check_against(&test, &c, &c, &outs, saved, quant_oracle_bound);
    }
}

/// Final buffers and kernel launches of `case` on a CUDA backend with `cfg` (graphs off).
fn on_gpu_cfg(test: &str, case: &Case, cfg: CudaConfig) -> (Vec<Vec<u8>>, u64) {
    let be = gpu_with(
        test,
        CudaConfig {
            graphs: false,
            ..cfg
        },
    );
    let before = be.stats().snapshot();
    let bufs = execute(&*be, case);
    (bufs, be.stats().snapshot().since(&before).kernel_launches)
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn streamed_products_match_a_warp_per_unit_bit_for_bit() {
    // More output units than a streamed grid has warps (sms x 2 blocks x 8 warps): warps take
    // several units each, their loads running on from one unit into the next. Every unit is
    // still summed by one warp in one order, so the results are the same bytes; the norm in
    // front of gate/up joins the streamed launch (one block per multiprocessor computes it),
    // where a warp per unit is more than a wave and runs it on its own.
    let mut rng = Rng::new(41);
    for wdt in FLOATS {
        let (k, n, dn) = (256, 6000, 5000);
        let mut c = Case::default();
        let x = c.tensor(DType::F32, &[1, k]);
        c.rand(&mut rng, &x, 2.0);
        let nw = c.tensor(DType::F32, &[k]);
        c.rand(&mut rng, &nw, 1.5);
        let norm = c.tensor(DType::F32, &[1, k]);
        let h = c.tensor(DType::F32, &[1, k]);
        c.node(Op::RmsNorm { eps: 1e-5 }, &norm, &[&x]);
        c.node(Op::Mul, &h, &[&norm, &nw]);
        let wg = weight(&mut c, &mut rng, wdt, k, n);
        let wu = weight(&mut c, &mut rng, wdt, k, n);
        let gate = c.tensor(DType::F32, &[1, n]);
        let up = c.tensor(DType::F32, &[1, n]);
        c.node(Op::MulMat, &gate, &[&h, &wg]);
        c.node(Op::MulMat, &up, &[&h, &wu]);
        c.node(Op::SwiGlu, &gate, &[&gate, &up]);
        let wd = weight(&mut c, &mut rng, wdt, n, dn);
        let d = c.tensor(DType::F32, &[1, dn]);
        let res = c.tensor(DType::F32, &[1, dn]);
        c.rand(&mut rng, &res, 1.0);
        c.node(Op::MulMat, &d, &[&gate, &wd]);
        c.node(Op::Add, &res, &[&res, &d]);
        let test = format!("streamed {wdt}");
        let on = CudaConfig::default();
        let off = CudaConfig {
            gemv_stream: false,
            ..CudaConfig::default()
        };
        let (streamed, n_on) = on_gpu_cfg(&test, &c, on);
        let (plain, n_off) = on_gpu_cfg(&test, &c, off);
        // The streamed blocks' shared memory pad (occupancy only) changes no result.
        let unpadded = CudaConfig {
            stream_pad_kb: Some(0),
            ..CudaConfig::default()
        };
        let (unpadded, _) = on_gpu_cfg(&test, &c, unpadded);
        for (name, t) in [
            ("norm", &norm),
            ("h", &h),
            ("swiglu", &gate),
            ("up", &up),
            ("residual", &res),
        ] {
            for (other, what) in [
                (&plain, "one warp per unit"),
                (&unpadded, "unpadded streamed blocks"),
            ] {
                assert!(
                    values(&streamed, t) == values(other, t),
                    "{test}: {name} differs between streamed and {what}"
                );
            }
        }
        let oracle = execute(&CpuBackend::new(), &c);
        assert_close(
            &format!("{test}: residual vs oracle"),
            &values(&oracle, &res),
            &values(&streamed, &res),
            oracle_bound(wdt),
        );
        assert_eq!(
            (n_on, n_off),
            (2, 3),
            "{test}: launches streamed, unstreamed"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn masked_windows_list_their_valid_keys() {
    // Masked windows with p and the scores dead — decode's case — run `attn_fast_long` at any
    // length: the valid keys are listed, 2048 mask entries at a time, and only their rows are
    // read. Sparse and dense windows across listings, per-head masks, and every key masked, in
    // a long window and in one shorter than a chunk of keys (256 at head size 64 in f16);
    // masked rows are NaN in the poisoned copy. With q written by a node of the graph (as
    // decode's q/k/v group does) and the mask by none, the attention launched ahead takes its
    // rehearsal's listing (`mask_ahead`) in windows of one listing.
    let mut rng = Rng::new(44);
    type Mask = (&'static [usize], usize, Option<usize>);
    let windows: [(usize, [Mask; 4]); 2] = [
        (
            4500,
            [
                (&[100], 1, Some(7)),
                (&[3000], 1, None),
                (&[5, 2100, 700, 4500], 8, None),
                (&[0], 1, None),
            ],
        ),
        (
            77,
            [
                (&[40], 1, Some(7)),
                (&[77], 1, None),
                (&[5, 70, 30, 77], 8, None),
                (&[0], 1, None),
            ],
        ),
    ];
    for (kv, q_node) in [
        (DType::F16, false),
        (DType::F32, false),
        (DType::F16, true),
        (DType::F32, true),
    ] {
        for (n_ctx, masks) in windows {
            for mask in masks {
                let mut a = attention_case(&mut rng, kv, (8, 2, 64), n_ctx, mask, true);
                if q_node {
                    let q = packed(a.case.nodes[0].srcs[0].buffer.0, 0, DType::F32, &[1, 8, 64]);
                    let src = a.case.tensor(DType::F32, &[1, 8, 64]);
                    a.case.rand(&mut rng, &src, 1.0);
                    a.case.node(Op::Scale { scale: 1.0 }, &q, &[&src]);
                    let scale = a.case.nodes.pop().expect("just pushed");
                    a.case.nodes.insert(0, scale);
                }
                // p dead too: a later node overwrites it (as the allocator reuses that memory).
                let probs = a.outputs.remove(0).1;
                assert_eq!(probs.shape, [8, 1, n_ctx]);
                let src = a.case.tensor(DType::F32, &[8, 1, n_ctx]);
                a.case.rand(&mut rng, &src, 1.0);
                a.case.node(Op::Scale { scale: 1.0 }, &probs, &[&src]);
                let test = format!("window {n_ctx} {kv} mask {mask:?} q from a node {q_node}");
                let (valid, heads, hole) = mask;
                let unused = (0..n_ctx).filter(|&row| {
                    !(0..heads).any(|h| row < valid[h % valid.len()] && Some(row) != hole)
                });
                let poisoned = poison_rows(&a, kv, unused);
                check_with(&test, &a.case, &poisoned, &outputs(&a), 3);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn decode_attention_split_over_keys_matches_one_block_per_head() {
    // Masked windows past one round trip of keys with p and the scores dead run `attn_split`
    // (several blocks per head, merged by the head's last block) with `attn_split=1`: against the
    // oracle, and against one block per head (`attn_split=0`) and the most chunks
    // (`attn_split=32`), with the same launches. Depths of 600 and more (the bench's), a hole,
    // per-head masks with a fully masked head, a valid part of one chunk, none valid.
    let mut rng = Rng::new(45);
    type Mask = (&'static [usize], usize, Option<usize>);
    for kv in [DType::F16, DType::F32] {
        for heads in [(8, 2, 64), (4, 4, 128)] {
            let masks: [Mask; 5] = [
                (&[600], 1, Some(7)),
                (&[631], 1, None),
                (&[0, 300, 257, 2000], heads.0, None),
                (&[100], 1, None),
                (&[0], 1, None),
            ];
            for n_ctx in [640, 1000] {
                for mask in masks {
                    let mut a = attention_case(&mut rng, kv, heads, n_ctx, mask, true);
                    let probs = a.outputs.remove(0).1;
                    let src = a.case.tensor(DType::F32, &[heads.0, 1, n_ctx]);
                    a.case.rand(&mut rng, &src, 1.0);
                    a.case.node(Op::Scale { scale: 1.0 }, &probs, &[&src]);
                    let test = format!("split {kv} {heads:?} window {n_ctx} mask {mask:?}");
                    check_with(&test, &a.case, &a.case, &outputs(&a), 3);
                    let run = |tune: &str| {
                        let cfg = CudaConfig::default().with_tune(tune).expect("a valid tune");
                        on_gpu_cfg(&format!("{test} {tune}"), &a.case, cfg)
                    };
                    let (split, n_split) = run("attn_split=1");
                    for tune in ["attn_split=0", "attn_split=32"] {
                        let (other, n_other) = run(tune);
                        assert_eq!(n_split, n_other, "{test}: launches, {tune}");
                        for (name, t) in outputs(&a) {
                            assert_close(
                                &format!("{test}: {name} against {tune}"),
                                &values(&other, t),
                                &values(&split, t),
                                fused_bound(kv),
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Prefill attention as llama.py lays it out: `t` query rows after `past` cached positions in a
/// cache of `n_ctx` rows, q `[t, hq, d]` f32 seen as `[hq, t, d]`, a causal mask `[t, n_ctx]`
/// (row i admits keys up to `past + i`; with `holes`, every 7th key and every 8th row masked
/// too), the scores, p, o and the Cpy of o's permutation (over q itself with `over_q`, as the
/// allocator may place it). Two last nodes overwrite the scores and p, so they are dead and
/// the fused kernel takes the chain; o stays live (nothing overwrites it).
fn prefill_case(
    rng: &mut Rng,
    kv: DType,
    (hq, hkv, d): (usize, usize, usize),
    (t, past, n_ctx): (usize, usize, usize),
    holes: bool,
    over_q: bool,
) -> Attn {
    let mut c = Case::default();
    let k_cache = c.tensor(kv, &[n_ctx, hkv * d]);
    let v_cache = c.tensor(kv, &[n_ctx, hkv * d]);
    c.rand(rng, &k_cache, 1.0);
    c.rand(rng, &v_cache, 1.0);
    let m = c.tensor(DType::F32, &[t, n_ctx]);
    let mask: Vec<f32> = (0..t * n_ctx)
        .map(|x| {
            let (i, j) = (x / n_ctx, x % n_ctx);
            let ok = j <= past + i && !(holes && (j % 7 == 4 || i % 8 == 3));
            if ok {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    c.fill(&m, &mask);
    let (sq, ss) = (t * hq * d * 4, hq * t * n_ctx * 4);
    let act = c.buffer(sq + 2 * ss + 2 * sq);
    let fresh = c.buffer(2 * ss);
    let q = packed(act, 0, DType::F32, &[t, hq, d]);
    c.rand(rng, &q, 1.0);
    let qh = view(act, 0, DType::F32, &[hq, t, d], &[d, hq * d, 1]);
    let keys = view(k_cache.buffer.0, 0, kv, &[hkv, d, n_ctx], &[d, 1, hkv * d]);
    let values = view(v_cache.buffer.0, 0, kv, &[hkv, n_ctx, d], &[d, hkv * d, 1]);
    let scores = packed(act, sq, DType::F32, &[hq, t, n_ctx]);
    let probs = packed(act, sq + ss, DType::F32, &[hq, t, n_ctx]);
    let o = packed(act, sq + 2 * ss, DType::F32, &[hq, t, d]);
    let o_t = view(act, sq + 2 * ss, DType::F32, &[t, hq, d], &[d, t * d, 1]);
    let att = packed(
        act,
        if over_q { 0 } else { 2 * sq + 2 * ss },
        DType::F32,
        &[t, hq, d],
    );
    c.node(Op::MulMat, &scores, &[&qh, &keys]);
    c.node(
        Op::SoftMax {
            scale: 1.0 / (d as f32).sqrt(),
        },
        &probs,
        &[&scores, &m],
    );
    c.node(Op::MulMat, &o, &[&probs, &values]);
    c.node(Op::Cpy, &att, &[&o_t]);
    let src = packed(fresh, 0, DType::F32, &[2 * ss / 4]);
    c.rand(rng, &src, 1.0);
    let both = packed(act, sq, DType::F32, &[2 * ss / 4]);
    c.node(Op::Scale { scale: 1.0 }, &both, &[&src]);
    Attn {
        case: c,
        k_cache,
        v_cache,
        outputs: vec![
            ("p @ V", o),
            ("copy", att),
            ("scores and p overwritten", both),
        ],
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn prefill_attention_matches_the_unfused_chain() {
    let mut rng = Rng::new(41);
    for kv in FLOATS {
        // GQA 8 over 2 ("1b": 32 over 8 of 64); no GQA at 128; head_dim 80 over 3.
        for heads in [(8, 2, 64), (4, 4, 128), (6, 3, 80)] {
            // Whole tiles; rows and cache rows not multiples of a tile, after a past.
            for shape in [(32, 0, 64), (37, 13, 70)] {
                for (holes, over_q) in [(false, false), (true, false), (false, true)] {
                    let a = prefill_case(&mut rng, kv, heads, shape, holes, over_q);
                    let test = format!(
                        "prefill attention {kv} {heads:?} rows/past/n_ctx {shape:?} holes \
                         {holes} over_q {over_q}"
                    );
                    let on = CudaConfig::default();
                    let off = CudaConfig {
                        attn_prefill: false,
                        ..CudaConfig::default()
                    };
                    let (want, n_off) = on_gpu_cfg(&test, &a.case, off);
                    let (got, n_on) = on_gpu_cfg(&test, &a.case, on);
                    let oracle = execute(&CpuBackend::new(), &a.case);
                    for (name, t) in &a.outputs {
                        let g = values(&got, t);
                        assert_close(
                            &format!("{test}: {name} vs unfused"),
                            &values(&want, t),
                            &g,
                            // The unfused products may round p to the cache's dtype.
                            oracle_bound(kv),
                        );
                        assert_close(
                            &format!("{test}: {name} vs oracle"),
                            &values(&oracle, t),
                            &g,
                            oracle_bound(t.dtype),
                        );
                    }
                    assert!(
                        n_on + 3 <= n_off,
                        "{test}: {n_on} launches fused, {n_off} with attn_prefill=0"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn prefill_attention_never_reads_cache_rows_no_row_admits() {
    let mut rng = Rng::new(42);
    let (t, past, n_ctx) = (37, 13, 70);
    for kv in FLOATS {
        let a = prefill_case(&mut rng, kv, (8, 2, 64), (t, past, n_ctx), true, false);
        // Rows past the last query's position: no row admits them.
        let poisoned = poison_rows(&a, kv, past + t..n_ctx);
        let test = format!("prefill poisoned {kv} cache");
        let (want, _) = on_gpu_cfg(&test, &a.case, CudaConfig::default());
        let (got, _) = on_gpu_cfg(&test, &poisoned, CudaConfig::default());
        for (name, t) in &a.outputs {
            assert_close(
                &format!("{test}: {name}"),
                &values(&want, t),
                &values(&got, t),
                0.0,
            );
        }
    }
}
