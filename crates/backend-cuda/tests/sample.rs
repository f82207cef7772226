//! The sampler on the CUDA backend against the CPU oracle: `Op::Sample` draws the oracle's
//! token (a grid of vocabulary sizes, parameters, keys, and rows of NaN, -inf, +inf and ties),
//! `Op::Penalize` is bit-exact, strided sources are read as the oracle reads them, bad shapes
//! are errors, and both ops replay in a captured CUDA graph with new keys every step. Ignored
//! without a CUDA device (see `common`).
//!
//! One test needs no device: the cases of the kernel emulation (`emu/sample_cases.txt`, which
//! `scripts/kernel_emu.sh` runs through kernels/sample.cu on the CPU) must be the answers of
//! `lowsync_graph::sampling` today; `LOWSYNC_BLESS=1` rewrites the file from it.
//!
//! Tokens are compared exactly except where the draw is a near tie: the GPU's expf / logf
//! round differently from the host's by an ulp and top-p's sums run in another order, so a
//! row whose token moves when top-p / min-p move by a relative 1e-4, or where another value's
//! score is within 1e-5 of the winner's, may differ and is counted, not failed (see
//! `lowsync_graph::sampling`: "What may still differ between backends").

mod common;

use common::{gpu, gpu_with, read, Pair, Rng, Twin};
use lowsync_backend::{Backend, BufferId, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_cuda::CudaConfig;
use lowsync_graph::sampling::{gumbel, order_key, penalize_row, sample_row, uniform, SampleParams};
use lowsync_graph::{contiguous_strides, DType, Op};
use std::sync::Arc;

/// xorshift32, the generator of the emulation's rows (emu/kernels_test.cpp has its twin).
struct Xs(u32);

impl Xs {
    fn new(gen: u32) -> Self {
        Xs(gen.wrapping_mul(0x9E37_79B9) | 1)
    }
    fn next(&mut self) -> u32 {
        let mut s = self.0;
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        self.0 = s;
        s
    }
}

/// Row `gen` of `v` logits: 24-bit integers times 2^(scale - 23), in [-2^scale, 2^scale)
/// (exact in f32, so C++ makes the same row), with the special values of `kind`:
/// 0 none, 1 NaN at i % 3 == 1, 2 all NaN, 3 all -inf, 4 -inf at i % 4 == 0, 5 +inf at v / 2,
/// 6 the maximum 2^scale at v / 3 and v - 1 (a tie), 7 all 1.0, 8 zeros of both signs at
/// i % 5 == 0 / 1 and NaN at i % 7 == 3.
fn emu_row(gen: u32, v: usize, kind: u32, scale: i32) -> Vec<f32> {
    let mut s = Xs::new(gen);
    let unit = f32::from_bits(((127 + scale - 23) as u32) << 23);
    let top = f32::from_bits(((127 + scale) as u32) << 23);
    (0..v)
        .map(|i| {
            let x = ((s.next() >> 8) as i32 - (1 << 23)) as f32 * unit;
            match kind {
                1 if i % 3 == 1 => f32::NAN,
                2 => f32::NAN,
                3 => f32::NEG_INFINITY,
                4 if i % 4 == 0 => f32::NEG_INFINITY,
                5 if i == v / 2 => f32::INFINITY,
                6 if i == v / 3 || i == v - 1 => top,
                7 => 1.0,
                8 if i % 5 == 0 => 0.0,
                8 if i % 5 == 1 => -0.0,
                8 if i % 7 == 3 => f32::NAN,
                _ => x,
            }
        })
        .collect()
}

/// Row `gen`'s history of `n` ids in [-2, v + 2) (out-of-range ids and repeats included).
fn emu_hist(gen: u32, v: usize, n: usize) -> Vec<i32> {
    let mut s = Xs::new(gen ^ 0xA5A5_A5A5);
    (0..n)
        .map(|_| (s.next() % (v as u32 + 4)) as i32 - 2)
        .collect()
}

/// FNV-1a over the f32 bits of a row, every NaN counted as 0x7fc00000 (the GPU's NaNs carry
/// another payload).
fn row_hash(row: &[f32]) -> u32 {
    row.iter().fold(0x811c_9dc5u32, |h, &x| {
        let b = if x.is_nan() { 0x7fc0_0000 } else { x.to_bits() };
        (h ^ b).wrapping_mul(0x0100_0193)
    })
}

/// The sampler settings of the grid for rows of `v` values: (temperature, top_k, top_p, min_p).
fn param_sets(v: usize) -> Vec<SampleParams> {
    let vf = v as f32;
    [
        (0.0, 0.0, 1.0, 0.0),           // greedy
        (f32::NAN, 40.0, 0.9, 0.05),    // NaN temperature: greedy
        (-1.0, 0.0, 1.0, 0.0),          // negative temperature: greedy
        (1.0, 0.0, 1.0, 0.0),           // the plain draw
        (0.7, 40.0, 0.95, 0.05),        // llama.cpp's defaults (top_k 40, top_p 0.95)
        (1.5, 1.0, 1.0, 0.0),           // top_k 1
        (1.0, 5.0, 1.0, 0.0),           // a small k
        (1.0, 2.7, 1.0, 0.0),           // truncated to 2
        (1.0, vf, 1.0, 0.0),            // k == V keeps all
        (1.0, 1e9, 0.9, 0.0),           // k > V keeps all
        (1.0, -3.0, 0.9, 0.0),          // negative k keeps all
        (1.0, f32::NAN, 0.0, 0.0),      // top_p 0: the maximum only
        (1.0, 0.0, 0.9, 0.0),           // top_p 0.9
        (0.8, 0.0, 0.5, 0.0),           // top_p 0.5
        (1.0, 0.0, 1.0, 0.05),          // min_p 0.05
        (1.0, 0.0, 1.0, 1.0),           // min_p 1: the maximum only
        (1.0, 0.0, f32::NAN, f32::NAN), // NaN top_p / min_p keep all
        (f32::INFINITY, 0.0, 1.0, 0.0), // infinite temperature
        (2.0, 50.0, 0.99, 0.01),        // everything at once
        (1e-3, 0.0, 0.9, 0.0),          // a cold draw
        (1.0, 0.0, 1.0, 2.0),           // min_p > 1: only the maximum is kept
        (1.0, 300.0, 0.9, 0.0),         // more candidates than a small block has threads
        (0.9, 2000.0, 0.9, 0.05),       // more candidates than the kernel packs (1024)
        (1.0, 300.0, 0.5, 0.0),         // top-p cutting deep into many candidates
        (1.2, 40.0, 0.3, 0.0),          // and into few
    ]
    .into_iter()
    .map(|(temperature, top_k, top_p, min_p)| SampleParams {
        temperature,
        top_k,
        top_p,
        min_p,
    })
    .collect()
}

fn params_row(p: &SampleParams) -> [f32; 4] {
    [p.temperature, p.top_k, p.top_p, p.min_p]
}

/// Whether `sample_row(x, p, seed, counter)` is a near tie (see the module doc): its token moves
/// when top-p or min-p move by a relative 1e-4, or another non-NaN value's score is within 1e-5
/// (relative) of the winner's.
fn near_tie(x: &[f32], p: SampleParams, seed: u32, counter: u32) -> bool {
    if p.temperature.is_nan() || p.temperature <= 0.0 {
        return false;
    }
    let t = sample_row(x, p, seed, counter);
    for f in [1.0 - 1e-4, 1.0 + 1e-4] {
        let mut q = p;
        if p.top_p < 1.0 {
            q.top_p = p.top_p * f;
        }
        if p.min_p > 0.0 {
            q.min_p = p.min_p * f;
        }
        if q != p && sample_row(x, q, seed, counter) != t {
            return true;
        }
    }
    let Some(&win) = x.get(t) else {
        return false;
    };
    let key_max = x.iter().map(|&v| order_key(v)).max().unwrap_or(0);
    let m = x
        .iter()
        .copied()
        .find(|&v| order_key(v) == key_max)
        .unwrap_or(f32::NAN);
    let score =
        |i: usize, v: f32| (v - m) / p.temperature + gumbel(uniform(seed, counter, i as u32));
    let st = score(t, win);
    x.iter().enumerate().any(|(i, &v)| {
        i != t && !v.is_nan() && (score(i, v) - st).abs() <= 1e-5 * st.abs().max(1.0)
    })
}

/// A launch of the emulation: V, the kinds of rows (one launch each), the scale, the block, and
/// the settings (indices into `param_sets`), a row each.
type EmuCase<'a> = (usize, &'a [u32], i32, u32, &'a [usize]);

/// The emulation's cases (see the module doc), as the text of emu/sample_cases.txt.
fn emulation_cases() -> String {
    let mut out = String::from(
        "# The kernel emulation's sampler cases (scripts/kernel_emu.sh). Generated from\n\
         # lowsync_graph::sampling by crates/backend-cuda/tests/sample.rs; do not edit: run\n\
         # LOWSYNC_BLESS=1 cargo test -p lowsync-cuda --test sample emulation\n\
         # sample <V> <kind> <scale> <block> <rows>, then a line per row: <gen> <temperature>\n\
         #   <top_k> <top_p> <min_p> <seed> <counter> <token> <logits hash> (hex but the token);\n\
         #   rows whose token is a near tie are left out\n\
         # penalize <V> <N> <block> <rows>, then a line per row: <gen> <repeat> <frequency>\n\
         #   <presence> <result hash> (hex); logits of kind 8 at scale 2, history\n\
         #   emu_hist(gen, V, N)\n",
    );
    // Every emulated block reduction costs thousands of thread switches, so the grid is
    // trimmed: all settings on plain rows, the telling ones on special rows and long rows
    // (indices into `param_sets`), blocks of 32 to 256 threads and one launch of 1024.
    let all: Vec<usize> = (0..param_sets(1).len()).collect();
    let special = [0, 3, 4, 11, 15, 17, 20];
    #[rustfmt::skip]
    let cases: &[EmuCase] = &[
        (1, &[0], 0, 32, &all),
        (1, &[2, 3, 5], 0, 32, &special),
        (7, &[0], 3, 64, &all),
        (7, &[1, 2, 3, 4, 5, 6, 7], 3, 32, &special),
        (100, &[0], 0, 128, &all),
        (100, &[1, 4, 6], 0, 64, &special),
        (1000, &[0], 3, 256, &all),
        (1000, &[1, 5], 0, 128, &special),
        // Spread rows, where top-p and min-p cut deep into the top-k candidates: many keys.
        (1000, &[0], 5, 128, &[4, 4, 18, 21, 21, 23, 23, 23, 23, 24, 24, 24, 24, 12, 13, 13, 14]),
        (4099, &[0], 4, 256, &[0, 3, 4, 12, 14, 19, 21, 22]),
        (32_000, &[0], 3, 1024, &[0, 4, 12]),
        (151_936, &[0], 4, 256, &[4, 14, 19]),
    ];
    let mut gen = 1u32;
    for &(v, kinds, scale, block, pick) in cases {
        let sets = param_sets(v);
        for &kind in kinds {
            let mut lines = Vec::new();
            for &j in pick {
                let p = &sets[j];
                gen += 1;
                let x = emu_row(gen, v, kind, scale);
                let seed = if j % 3 == 0 {
                    0xDEAD_BEEF ^ gen
                } else {
                    gen.wrapping_mul(7919)
                };
                let counter = j as u32 * 3 + 1;
                if near_tie(&x, *p, seed, counter) {
                    continue;
                }
                let t = sample_row(&x, *p, seed, counter) as i32;
                let [a, b, c, d] = params_row(p).map(f32::to_bits);
                lines.push(format!(
                    "{gen:x} {a:x} {b:x} {c:x} {d:x} {seed:x} {counter:x} {t} {:x}\n",
                    row_hash(&x)
                ));
            }
            out += &format!("sample {v} {kind} {scale} {block} {}\n", lines.len());
            lines.iter().for_each(|l| out += l);
        }
    }
    let pens: [[f32; 3]; 4] = [
        [1.1, 0.5, 0.25],
        [1.0, 0.0, 0.0],
        [0.5, -0.3, 1.5],
        [2.0, 0.1, 0.0],
    ];
    for (v, n, block) in [
        (1, 3, 32),
        (7, 16, 64),
        (1000, 0, 256),
        (1000, 64, 128),
        (4099, 200, 1024),
    ] {
        out += &format!("penalize {v} {n} {block} {}\n", pens.len());
        for q in pens {
            gen += 1;
            let mut x = emu_row(gen, v, 8, 2);
            penalize_row(&mut x, &emu_hist(gen, v, n), q[0], q[1], q[2]);
            let [a, b, c] = q.map(f32::to_bits);
            out += &format!("{gen:x} {a:x} {b:x} {c:x} {:x}\n", row_hash(&x));
        }
    }
    out
}

#[test]
fn emulation_cases_are_the_reference_s_answers() {
    let want = emulation_cases();
    if std::env::var("LOWSYNC_BLESS").is_ok_and(|v| v == "1") {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/emu/sample_cases.txt");
        std::fs::write(path, &want).expect("write emu/sample_cases.txt");
        return;
    }
    // Compiled in: the device machine runs this binary without the source tree.
    let have = include_str!("../emu/sample_cases.txt");
    assert!(
        have == want,
        "emu/sample_cases.txt is not what lowsync_graph::sampling answers today; rewrite it with \
         LOWSYNC_BLESS=1 cargo test -p lowsync-cuda --test sample emulation"
    );
    assert_eq!(
        have.lines().filter(|l| l.starts_with("penalize ")).count(),
        5
    );
}

/// An exact i32 tensor (seeds use all 32 bits) on both backends.
fn ints(p: &Pair, shape: &[usize], values: &[i32]) -> Twin {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let mk = |b: &dyn Backend| -> TensorRef {
        let id = b
            .alloc_buffer(bytes.len().max(4), BufferUsage::Compute)
            .unwrap();
        if !bytes.is_empty() {
            b.set_tensor(id, 0, &bytes).unwrap();
        }
        TensorRef {
            buffer: id,
            byte_offset: 0,
            dtype: DType::I32,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    };
    Twin {
        cpu: mk(&p.cpu),
        gpu: mk(&*p.gpu),
    }
}

/// The f32 bits of every element of `t` (row-major).
fn bits(b: &dyn Backend, t: &TensorRef) -> Vec<u32> {
    read(b, t).iter().map(|&v| (v as f32).to_bits()).collect()
}

/// Runs `Op::Sample` on rows `xs` with settings `ps` and keys `ks` on both backends and checks
/// every token; returns the number of near ties that differed.
fn check_tokens(
    p: &Pair,
    case: &str,
    v: usize,
    xs: &[Vec<f32>],
    ps: &[SampleParams],
    ks: &[[u32; 2]],
) -> usize {
    let r = xs.len();
    let flat: Vec<f32> = xs.concat();
    let logits = p.tensor(DType::F32, &[r, v], &flat);
    let prm: Vec<f32> = ps.iter().flat_map(params_row).collect();
    let params = p.tensor(DType::F32, &[r, 4], &prm);
    let kv: Vec<i32> = ks.iter().flat_map(|k| k.map(|w| w as i32)).collect();
    let key = ints(p, &[r, 2], &kv);
    let dst = ints(p, &[r], &vec![7; r]);
    p.run(Op::Sample, &dst, &[&logits, &params, &key])
        .unwrap_or_else(|e| panic!("{case}: CUDA failed: {e}"));
    let (want, got) = p.read(&dst);
    let mut ties = 0;
    for i in 0..r {
        // The oracle runs lowsync_graph::sampling.
        assert_eq!(
            want[i] as i64,
            sample_row(&xs[i], ps[i], ks[i][0], ks[i][1]) as i32 as i64,
            "{case}: row {i}: the CPU oracle"
        );
        if want[i] == got[i] {
            continue;
        }
        if near_tie(&xs[i], ps[i], ks[i][0], ks[i][1]) {
            ties += 1;
            continue;
        }
        panic!(
            "{case}: row {i} ({:?}, key {:?}): CUDA drew {}, the oracle {}",
            ps[i], ks[i], got[i], want[i]
        );
    }
    ties
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn sample_draws_the_oracle_s_token_over_a_grid_of_sizes_settings_and_keys() {
    let p = Pair::new(gpu("sample_tokens"));
    let mut rng = Rng::new(11);
    let (mut rows, mut ties) = (0, 0);
    for v in [1, 7, 1000, 32_000, 151_936] {
        let sets = param_sets(v);
        let keys_per = if v >= 32_000 { 3 } else { 8 };
        let (mut xs, mut ps, mut ks) = (Vec::new(), Vec::new(), Vec::new());
        for (j, set) in sets.iter().enumerate() {
            for k in 0..keys_per {
                // Mostly plain rows at three spreads; every kind of special row now and then.
                let kind = [0, 0, 1, 0, 4, 5, 0, 6, 8, 0, 2, 3, 7][(j * keys_per + k) % 13];
                let scale = [0, 3, 5][k % 3];
                xs.push(emu_row(rng.next_u64() as u32, v, kind, scale));
                ps.push(*set);
                ks.push([rng.next_u64() as u32, rng.next_u64() as u32]);
            }
        }
        rows += xs.len();
        ties += check_tokens(&p, &format!("V {v}"), v, &xs, &ps, &ks);
    }
    eprintln!("{rows} rows, {ties} near ties drew another token");
    assert!(ties * 100 <= rows, "{ties} near ties of {rows} rows");
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn sample_draws_the_oracle_s_token_for_many_keys_of_one_row() {
    // One llama-like row (a few large logits), 512 keys: the draws of the settings people use.
    let p = Pair::new(gpu("sample_keys"));
    let v = 32_000;
    let mut x = emu_row(99, v, 0, 2);
    for (i, b) in [
        (17, 9.0),
        (4000, 8.5),
        (4001, 8.5),
        (31_999, 7.0),
        (123, 6.0),
    ] {
        x[i] = b;
    }
    let settings = [
        (0.7, 40.0, 0.95, 0.05),
        (1.0, 0.0, 0.9, 0.0),
        (1.0, 0.0, 1.0, 0.0),
        (0.6, 20.0, 0.8, 0.0),
    ];
    let mut ties = 0;
    for (t, k, tp, mp) in settings {
        let ps = vec![
            SampleParams {
                temperature: t,
                top_k: k,
                top_p: tp,
                min_p: mp,
            };
            512
        ];
        let ks: Vec<[u32; 2]> = (0..512u32).map(|i| [42, i]).collect();
        let xs = vec![x.clone(); 512];
        ties += check_tokens(&p, &format!("keys {t} {k} {tp} {mp}"), v, &xs, &ps, &ks);
    }
    assert!(ties <= 4, "{ties} near ties");
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn sample_reads_strided_logits_params_and_keys() {
    let p = Pair::new(gpu("sample_strided"));
    let (r, v, pad) = (6, 1000, 5);
    let mut flat = Vec::new();
    let mut xs = Vec::new();
    for i in 0..r {
        let x = emu_row(500 + i as u32, v, (i % 3) as u32, 3);
        flat.extend(&x);
        flat.extend([f32::INFINITY; 5]); // padding a wrong stride would read
        xs.push(x);
    }
    let base = p.tensor(DType::F32, &[r, v + pad], &flat);
    let logits = base.view(&[r, v], &[v + pad, 1], 0);
    let sets = param_sets(v);
    let ps: Vec<SampleParams> = (0..r).map(|i| sets[3 + 2 * i]).collect();
    // params stored transposed [4, R], read through a [R, 4] view with strides (1, R).
    let mut pt = vec![0.0; 4 * r];
    for (i, q) in ps.iter().enumerate() {
        for (c, val) in params_row(q).into_iter().enumerate() {
            pt[c * r + i] = val;
        }
    }
    let params = p.tensor(DType::F32, &[4, r], &pt).transpose(0, 1);
    let ks: Vec<[u32; 2]> = (0..r as u32).map(|i| [0x8000_0000 | i, 3 * i]).collect();
    let kt: Vec<i32> = (0..2 * r).map(|j| ks[j % r][j / r] as i32).collect();
    let key = ints(&p, &[2, r], &kt).transpose(0, 1);
    let dst = ints(&p, &[r], &vec![-5; r]);
    p.run(Op::Sample, &dst, &[&logits, &params, &key]).unwrap();
    let (want, got) = p.read(&dst);
    for i in 0..r {
        let t = sample_row(&xs[i], ps[i], ks[i][0], ks[i][1]) as i32;
        assert_eq!(want[i] as i32, t, "row {i}: the oracle");
        assert!(
            got[i] as i32 == t || near_tie(&xs[i], ps[i], ks[i][0], ks[i][1]),
            "row {i}: CUDA {} != {t}",
            got[i]
        );
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn penalize_is_bit_exact_against_the_oracle() {
    let p = Pair::new(gpu("penalize"));
    let pens: [[f32; 3]; 4] = [
        [1.1, 0.5, 0.25],
        [1.0, 0.0, 0.0],
        [0.5, -0.3, 1.5],
        [2.0, 0.1, 0.0],
    ];
    let mut gen = 1000;
    for (v, n) in [
        (1, 3),
        (7, 16),
        (1000, 0),
        (1000, 64),
        (32_000, 256),
        (151_936, 64),
    ] {
        let r = pens.len();
        let (mut flat, mut hist) = (Vec::new(), Vec::new());
        for _ in 0..r {
            gen += 1;
            flat.extend(emu_row(gen, v, 8, 2));
            hist.extend(emu_hist(gen, v, n));
        }
        let logits = p.tensor(DType::F32, &[r, v], &flat);
        let h = ints(&p, &[r, n], &hist);
        let params = p.tensor(DType::F32, &[r, 3], &pens.concat());
        let dst = p.tensor(DType::F32, &[r, v], &vec![f32::NAN; r * v]);
        p.run(Op::Penalize, &dst, &[&logits, &h, &params])
            .unwrap_or_else(|e| panic!("V {v} N {n}: CUDA failed: {e}"));
        let (want, got) = (bits(&p.cpu, &dst.cpu), bits(&*p.gpu, &dst.gpu));
        for i in 0..r * v {
            let (w, g) = (f32::from_bits(want[i]), f32::from_bits(got[i]));
            assert!(
                want[i] == got[i] || (w.is_nan() && g.is_nan()),
                "V {v} N {n}: element {i}: want {w} ({:#x}), got {g} ({:#x})",
                want[i],
                got[i]
            );
        }
        // And the oracle is penalize_row.
        let mut row = flat[..v].to_vec();
        penalize_row(&mut row, &hist[..n], pens[0][0], pens[0][1], pens[0][2]);
        let first: Vec<f32> = want[..v].iter().map(|&b| f32::from_bits(b)).collect();
        assert_eq!(row_hash(&row), row_hash(&first), "V {v} N {n}: the oracle");
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn sampler_shapes_are_checked_before_anything_is_queued() {
    let p = Pair::new(gpu("sample_shapes"));
    let x = p.tensor(DType::F32, &[2, 10], &[0.5; 20]);
    let prm3 = p.tensor(DType::F32, &[2, 3], &[1.0; 6]);
    let prm4 = p.tensor(DType::F32, &[2, 4], &[1.0; 8]);
    let key = ints(&p, &[2, 2], &[1, 2, 3, 4]);
    let tok = ints(&p, &[2], &[0, 0]);
    let gpu_run = |op: Op, dst: &Twin, srcs: &[&Twin]| {
        let g = Arc::new(ExecGraph::new(vec![ExecNode {
            op,
            name: "bad".into(),
            dst: dst.gpu.clone(),
            srcs: srcs.iter().map(|t| t.gpu.clone()).collect(),
        }]));
        p.gpu.graph_compute_async(&g)
    };
    let e = gpu_run(Op::Sample, &tok, &[&x, &prm3, &key]).unwrap_err();
    assert!(e.to_string().contains("params must be f32 [2, 4]"), "{e}");
    let empty = p.tensor(DType::F32, &[2, 0], &[]);
    let e = gpu_run(Op::Sample, &tok, &[&empty, &prm4, &key]).unwrap_err();
    assert!(e.to_string().contains("V > 0"), "{e}");
    let h = ints(&p, &[3, 1], &[0, 1, 2]);
    let d = p.tensor(DType::F32, &[2, 10], &[0.0; 20]);
    let e = gpu_run(Op::Penalize, &d, &[&x, &h, &prm3]).unwrap_err();
    assert!(e.to_string().contains("hist must be i32 [2, 1]"), "{e}");
    // The backend still runs a good node afterwards.
    p.run(Op::Sample, &tok, &[&x, &prm4, &key]).unwrap();
    p.gpu.synchronize().unwrap();
}

fn t(buf: BufferId, off: usize, dtype: DType, shape: &[usize]) -> TensorRef {
    TensorRef {
        buffer: buf,
        byte_offset: off,
        dtype,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
    }
}

fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn penalize_and_sample_replay_in_a_cuda_graph_with_new_keys_every_step() {
    // penalize(logits, hist, pen) -> sample(.., params, key) over one buffer; every step
    // writes new keys and history (staged), runs the graph and reads the tokens. The backend
    // with graph replay must give the tokens of one without it, and both the oracle's.
    let (r, v, n) = (4, 32_000, 32);
    let on = gpu_with(
        "sample_graph_on",
        CudaConfig {
            graphs: true,
            ..CudaConfig::default()
        },
    );
    let off = gpu_with(
        "sample_graph_off",
        CudaConfig {
            graphs: false,
            ..CudaConfig::default()
        },
    );
    let (o_logits, o_hist, o_pen, o_prm, o_key, o_mid, o_tok) = (
        0,
        r * v * 4,
        r * v * 4 + r * n * 4,
        r * v * 4 + r * n * 4 + 256,
        r * v * 4 + r * n * 4 + 512,
        r * v * 4 + r * n * 4 + 1024,
        2 * r * v * 4 + r * n * 4 + 1024,
    );
    let size = o_tok + 256;
    let xs: Vec<Vec<f32>> = (0..r).map(|i| emu_row(77 + i as u32, v, 0, 3)).collect();
    let pens: Vec<f32> = (0..r).flat_map(|_| [1.3f32, 0.2, 0.1]).collect();
    let ps: Vec<SampleParams> = [3, 4, 12, 18].iter().map(|&i| param_sets(v)[i]).collect();
    let prm: Vec<f32> = ps.iter().flat_map(params_row).collect();
    let setup = |b: &lowsync_cuda::CudaBackend| {
        let buf = b.alloc_buffer(size, BufferUsage::Compute).unwrap();
        b.set_tensor(buf, o_logits, &le(&xs.concat(), f32::to_ne_bytes))
            .unwrap();
        b.set_tensor(buf, o_pen, &le(&pens, f32::to_ne_bytes))
            .unwrap();
        b.set_tensor(buf, o_prm, &le(&prm, f32::to_ne_bytes))
            .unwrap();
        let mid = t(buf, o_mid, DType::F32, &[r, v]);
        let g = Arc::new(ExecGraph::new(vec![
            ExecNode {
                op: Op::Penalize,
                name: "penalize".into(),
                dst: mid.clone(),
                srcs: vec![
                    t(buf, o_logits, DType::F32, &[r, v]),
                    t(buf, o_hist, DType::I32, &[r, n]),
                    t(buf, o_pen, DType::F32, &[r, 3]),
                ],
            },
            ExecNode {
                op: Op::Sample,
                name: "sample".into(),
                dst: t(buf, o_tok, DType::I32, &[r]),
                srcs: vec![
                    mid,
                    t(buf, o_prm, DType::F32, &[r, 4]),
                    t(buf, o_key, DType::I32, &[r, 2]),
                ],
            },
        ]));
        (buf, g)
    };
    let (b_on, g_on) = setup(&on);
    let (b_off, g_off) = setup(&off);
    let mut rng = Rng::new(3);
    let steps = 6u64;
    for step in 0..steps {
        let hist: Vec<i32> = (0..r * n)
            .map(|_| rng.below(v as u64 + 2) as i32 - 1)
            .collect();
        let keys: Vec<u32> = (0..2 * r).map(|_| rng.next_u64() as u32).collect();
        let mut toks = Vec::new();
        for (b, buf, g) in [(&on, b_on, &g_on), (&off, b_off, &g_off)] {
            b.set_tensor_async_staged(buf, o_hist, &le(&hist, i32::to_ne_bytes))
                .unwrap();
            b.set_tensor_async_staged(buf, o_key, &le(&keys, u32::to_ne_bytes))
                .unwrap();
            b.graph_compute_async(g).unwrap();
            let mut out = vec![0u8; r * 4];
            b.get_tensor(buf, o_tok, &mut out).unwrap();
            toks.push(
                out.chunks(4)
                    .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<_>>(),
            );
        }
        assert_eq!(
            toks[0], toks[1],
            "step {step}: replay and eager launches differ"
        );
        for i in 0..r {
            let mut row = xs[i].clone();
            penalize_row(
                &mut row,
                &hist[i * n..(i + 1) * n],
                pens[3 * i],
                pens[3 * i + 1],
                pens[3 * i + 2],
            );
            let (seed, counter) = (keys[2 * i], keys[2 * i + 1]);
            let want = sample_row(&row, ps[i], seed, counter) as i32;
            assert!(
                toks[0][i] == want || near_tie(&row, ps[i], seed, counter),
                "step {step} row {i}: CUDA {} != oracle {want}",
                toks[0][i]
            );
        }
    }
    let s = on.stats().snapshot();
    assert_eq!(s.graph_captures, 1, "{s:?}");
    assert_eq!(
        s.graph_launches,
        steps - 1,
        "every step after the eager first: {s:?}"
    );
    assert_eq!(off.stats().snapshot().graph_launches, 0);
}

#[test]
#[ignore = "a time measurement for the GPU machine, not a check"]
fn sample_time_per_row_by_setting() {
    // `cargo test --release --test sample -- --ignored --nocapture sample_time`: the device time
    // of one `Op::Sample` over a 151936-entry row (Qwen's vocabulary), per setting, from a chain
    // of 16 nodes replayed as one CUDA graph. Prints figures; asserts nothing about time.
    const CHAIN: usize = 16;
    const REPLAYS: usize = 10;
    let b = gpu("sample_time");
    let v = 151_936;
    let buf = b.alloc_buffer(v * 4 + 4096, BufferUsage::Compute).unwrap();
    let x = emu_row(5, v, 0, 4);
    b.set_tensor(buf, 0, &le(&x, f32::to_ne_bytes)).unwrap();
    let (o_prm, o_key, o_tok) = (v * 4, v * 4 + 256, v * 4 + 512);
    b.set_tensor(buf, o_key, &le(&[9u32, 1], u32::to_ne_bytes))
        .unwrap();
    let nodes: Vec<ExecNode> = (0..CHAIN)
        .map(|i| ExecNode {
            op: Op::Sample,
            name: format!("sample{i}"),
            dst: t(buf, o_tok + 4 * i, DType::I32, &[1]),
            srcs: vec![
                t(buf, 0, DType::F32, &[1, v]),
                t(buf, o_prm, DType::F32, &[1, 4]),
                t(buf, o_key, DType::I32, &[1, 2]),
            ],
        })
        .collect();
    let g = Arc::new(ExecGraph::new(nodes));
    for (name, p) in [
        ("greedy", [0.0, 0.0, 1.0, 0.0]),
        ("plain draw", [1.0, 0.0, 1.0, 0.0]),
        ("top_k 40", [1.0, 40.0, 1.0, 0.0]),
        ("top_p 0.9", [1.0, 0.0, 0.9, 0.0]),
        ("min_p 0.05", [1.0, 0.0, 1.0, 0.05]),
        ("top_k 40 top_p 0.95 min_p 0.05", [0.8, 40.0, 0.95, 0.05]),
    ] {
        b.set_tensor(buf, o_prm, &le(&p, f32::to_ne_bytes)).unwrap();
        for _ in 0..3 {
            b.graph_compute_async(&g).unwrap(); // eager, capture, replay
        }
        b.synchronize().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..REPLAYS {
            b.graph_compute_async(&g).unwrap();
        }
        b.synchronize().unwrap();
        let us = t0.elapsed().as_secs_f64() * 1e6 / (REPLAYS * CHAIN) as f64;
        eprintln!("sample V {v} {name}: {us:.1} us per row");
    }
}
