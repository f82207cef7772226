//! The sampler on Vulkan against the CPU oracle: `Sample` draws the CPU's token (greedy, top-k,
//! top-p, min-p, Gumbel-max with Philox noise; NaN, -inf and +inf entries; all-NaN rows),
//! `Penalize` gives the CPU's logits bit for bit, both inside a staged decode-like step keep
//! the backend's counts (one submit per compute, no empty submit, the read is the one wait),
//! and a bad shape is an error. Every run asserts the validation layer (synchronization
//! validation on) stayed silent.
//!
//! Tokens are compared exactly. The kernels round `exp`, `ln` and sums differently from the
//! CPU by an ulp or so, which can change a token only on a near-tie (two scores, or a value
//! and the min-p threshold, within that rounding); random rows have none at these sizes, and a
//! mismatch that is not a near-tie by [`near_tie`] fails.

mod common;

use std::sync::Arc;
use std::time::Instant;

use lowsync_backend::{Backend, BufferId, BufferUsage, Error, ExecGraph, ExecNode, TensorRef};
use lowsync_cpu::CpuBackend;
use lowsync_graph::sampling::{gumbel, top_k_count, uniform, SampleParams};
use lowsync_graph::{contiguous_strides, DType, Op};

/// Deterministic test data (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn u32(&mut self) -> u32 {
        (self.next() >> 32) as u32
    }
    /// Uniform in [0, 1).
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Roughly normal (the sum of four uniforms, scaled).
    fn normal(&mut self) -> f32 {
        (self.f32() + self.f32() + self.f32() + self.f32() - 2.0) * 1.73
    }
}

/// A source tensor: its bytes and its view inside them.
struct Src {
    bytes: Vec<u8>,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

fn f32_src(v: &[f32], shape: &[usize]) -> Src {
    Src {
        bytes: common::f32_bytes(v),
        dtype: DType::F32,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
        offset: 0,
    }
}

fn i32_src(v: &[i32], shape: &[usize]) -> Src {
    Src {
        bytes: common::i32_bytes(v),
        dtype: DType::I32,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
        offset: 0,
    }
}

/// Runs one node on `b`: sources from their bytes, a zeroed destination of `dst` shape; returns
/// the destination's bytes.
fn run(b: &dyn Backend, op: Op, dst: (DType, &[usize]), srcs: &[Src]) -> Result<Vec<u8>, Error> {
    let mut refs = Vec::new();
    for s in srcs {
        let id = b.alloc_buffer(s.bytes.len().max(4), BufferUsage::Compute)?;
        b.set_tensor(id, 0, &s.bytes)?;
        refs.push(TensorRef {
            buffer: id,
            byte_offset: s.offset * s.dtype.size_bytes(),
            dtype: s.dtype,
            shape: s.shape.clone(),
            strides: s.strides.clone(),
        });
    }
    let n: usize = dst.1.iter().product();
    let out = b.alloc_buffer((n * 4).max(4), BufferUsage::Compute)?;
    b.set_tensor(out, 0, &vec![0u8; (n * 4).max(4)])?;
    let node = ExecNode {
        op,
        name: op.name().to_string(),
        dst: common::contiguous(out, dst.0, dst.1),
        srcs: refs.clone(),
    };
    let result = b
        .graph_compute_async(&Arc::new(ExecGraph::new(vec![node])))
        .and_then(|()| b.synchronize());
    let mut bytes = vec![0u8; n * 4];
    let read = result.and_then(|()| b.get_tensor(out, 0, &mut bytes));
    for r in refs {
        b.free_buffer(r.buffer);
    }
    b.free_buffer(out);
    read.map(|()| bytes)
}

fn as_i32(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A batch of sampler rows: logits `[R, V]`, params `[R, 4]`, keys `[R, 2]`.
struct Rows {
    v: usize,
    logits: Vec<f32>,
    params: Vec<SampleParams>,
    keys: Vec<[u32; 2]>,
}

impl Rows {
    fn new(v: usize) -> Self {
        Rows {
            v,
            logits: Vec::new(),
            params: Vec::new(),
            keys: Vec::new(),
        }
    }
    fn push(&mut self, row: Vec<f32>, p: SampleParams, key: [u32; 2]) {
        assert_eq!(row.len(), self.v);
        self.logits.extend(row);
        self.params.push(p);
        self.keys.push(key);
    }
    fn len(&self) -> usize {
        self.params.len()
    }
    fn row(&self, r: usize) -> &[f32] {
        &self.logits[r * self.v..(r + 1) * self.v]
    }
    fn srcs(&self) -> Vec<Src> {
        let r = self.len();
        let params: Vec<f32> = self
            .params
            .iter()
            .flat_map(|p| [p.temperature, p.top_k, p.top_p, p.min_p])
            .collect();
        let keys: Vec<i32> = self
            .keys
            .iter()
            .flat_map(|k| [k[0] as i32, k[1] as i32])
            .collect();
        vec![
            f32_src(&self.logits, &[r, self.v]),
            f32_src(&params, &[r, 4]),
            i32_src(&keys, &[r, 2]),
        ]
    }
    fn tokens(&self, b: &dyn Backend) -> Result<Vec<i32>, Error> {
        run(b, Op::Sample, (DType::I32, &[self.len()]), &self.srcs()).map(|b| as_i32(&b))
    }
}

fn params(temperature: f32, top_k: f32, top_p: f32, min_p: f32) -> SampleParams {
    SampleParams {
        temperature,
        top_k,
        top_p,
        min_p,
    }
}

/// Whether a row is a near-tie, where an ulp of rounding may rightly change the token: the
/// CPU token's score within 1e-4 of another entry's, an entry within 1e-5 of the min-p
/// threshold, or the top-p target within 1e-4 of the kept mass at a key where the CPU's walk
/// could stop. Conservative: scores are compared whether the truncations kept an entry or not.
fn near_tie(x: &[f32], p: SampleParams, key: [u32; 2], token: i32) -> bool {
    let m = x
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let score = |i: usize| (x[i] - m) / p.temperature + gumbel(uniform(key[0], key[1], i as u32));
    let close = |a: f64, b: f64, rel: f64| (a - b).abs() <= rel * a.abs().max(b.abs()).max(1.0);
    if token >= 0 {
        let st = score(token as usize) as f64;
        if (0..x.len()).any(|j| j != token as usize && close(score(j) as f64, st, 1e-4)) {
            return true;
        }
    }
    if p.min_p > 0.0 {
        let thr = (m + p.min_p.ln()) as f64;
        if x.iter().any(|&v| close(v as f64, thr, 1e-5)) {
            return true;
        }
    }
    if p.top_p < 1.0 {
        // The kept values after top-k, largest first, and their masses in f64.
        let mut kept: Vec<f32> = x.iter().copied().filter(|v| !v.is_nan()).collect();
        kept.sort_by(|a, b| b.total_cmp(a));
        if let Some(k) = top_k_count(p.top_k, x.len()) {
            if k <= kept.len() {
                let kth = kept[k - 1];
                kept.retain(|&v| v >= kth);
            }
        }
        let mass: Vec<f64> = kept.iter().map(|&v| ((v - m) as f64).exp()).collect();
        let target = p.top_p as f64 * mass.iter().sum::<f64>();
        let mut cum = 0.0;
        for (i, w) in mass.iter().enumerate() {
            cum += w;
            let group_ends = kept.get(i + 1) != Some(&kept[i]);
            if group_ends && close(cum, target, 1e-4) {
                return true;
            }
        }
    }
    false
}

/// Compares Vulkan's tokens with the CPU's; returns how many rows drew something other than
/// the row's argmax (so a test can check it sampled at all).
fn compare(vk: &dyn Backend, rows: &Rows, what: &str) -> usize {
    let cpu = CpuBackend::new();
    let t0 = Instant::now();
    let want = rows.tokens(&cpu).expect("cpu");
    let t1 = Instant::now();
    let got = rows
        .tokens(vk)
        .unwrap_or_else(|e| panic!("{what}: vulkan: {e}"));
    eprintln!(
        "{what}: {} rows, cpu {:?}, vulkan {:?}",
        rows.len(),
        t1 - t0,
        t1.elapsed()
    );
    let mut failures = Vec::new();
    let mut ties = 0;
    for r in 0..rows.len() {
        if got[r] == want[r] {
            continue;
        }
        if near_tie(rows.row(r), rows.params[r], rows.keys[r], want[r]) {
            ties += 1;
            continue;
        }
        failures.push(format!(
            "row {r}: {:?} key {:?}: vulkan {} cpu {}",
            rows.params[r], rows.keys[r], got[r], want[r]
        ));
    }
    assert!(
        failures.is_empty(),
        "{what}: {} of {} rows differ:\n{}",
        failures.len(),
        rows.len(),
        failures[..failures.len().min(20)].join("\n")
    );
    // Near-ties are rare; many would mean the kernel's rounding is far from the CPU's.
    assert!(
        ties * 100 <= rows.len(),
        "{what}: {ties} near-tie mismatches"
    );
    if ties > 0 {
        eprintln!("{what}: {ties} near-tie row(s) differ (allowed)");
    }
    (0..rows.len())
        .filter(|&r| want[r] != lowsync_graph::sampling::argmax(rows.row(r)) as i32)
        .count()
}

/// The parameter grid: greedy, top-k 1 / small / above V, top-p 0 / 0.5 / 0.9 / 1, min-p
/// 0 / 0.05, temperatures from cold to hot.
fn grid(v: usize) -> Vec<SampleParams> {
    let mut g = Vec::new();
    for t in [0.0, 0.3, 1.0, 2.5] {
        for k in [0.0, 1.0, 7.0, 40.0, v as f32 + 3.0] {
            for tp in [1.0, 0.9, 0.5, 0.0] {
                for mp in [0.0, 0.05] {
                    g.push(params(t, k, tp, mp));
                }
            }
        }
    }
    g
}

/// Random rows of length `v`: `reps` passes over the grid (every `step`-th entry of it), each
/// row with its own logits (scale 0.5 to 3, so some rows are peaked and some flat) and its own
/// random key.
fn random_rows(v: usize, reps: usize, step: usize, seed: u64) -> Rows {
    let mut rng = Rng::new(seed);
    let mut rows = Rows::new(v);
    for rep in 0..reps {
        for p in grid(v).into_iter().skip(rep % step).step_by(step) {
            let scale = 0.5 + 2.5 * rng.f32();
            let row: Vec<f32> = (0..v).map(|_| rng.normal() * scale).collect();
            rows.push(row, p, [rng.u32(), rng.u32()]);
        }
    }
    rows
}

#[test]
fn sample_draws_the_cpu_token_on_random_rows() {
    // One memory path: the kernel reads the same bytes on both (the staged test below runs
    // the sampler on each).
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let mut sampled = 0;
    let mut total = 0;
    // (V, passes over the grid, grid step): long rows cost the debug-build oracle seconds.
    for (v, reps, step) in [
        (1, 2, 1),
        (7, 10, 1),
        (1000, 8, 1),
        (4097, 2, 1),
        (32000, 1, 2),
        (32003, 2, 4),
    ] {
        let rows = random_rows(v, reps, step, v as u64);
        sampled += compare(&vk, &rows, &format!("V={v}"));
        total += rows.len();
    }
    // Greedy rows, top-k 1 and top-p 0 are over half of the grid, and cold rows often draw
    // their argmax; still a fifth of the rows must draw something else.
    assert!(
        sampled * 5 >= total,
        "only {sampled} of {total} rows drew another token than the argmax"
    );
    common::assert_clean(&vk);
}

#[test]
fn sample_draws_the_cpu_token_for_many_keys() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    // One row of logits, drawn under 2048 keys: the noise decides, so this checks Philox and
    // the Gumbel transform on the device.
    let mut rng = Rng::new(7);
    let v = 512;
    let row: Vec<f32> = (0..v).map(|_| rng.normal()).collect();
    let mut rows = Rows::new(v);
    for i in 0..2048u32 {
        let key = if i < 1024 {
            [rng.u32(), rng.u32()]
        } else {
            // Consecutive counters of one seed, as a decode loop draws them.
            [0xDEAD_BEEF, i - 1024]
        };
        rows.push(row.clone(), params(1.0, 0.0, 1.0, 0.0), key);
    }
    let sampled = compare(&vk, &rows, "keys");
    assert!(sampled > 1500, "{sampled}");
    common::assert_clean(&vk);
}

#[test]
fn sample_special_values_follow_the_cpu() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let hot = params(1.0, 0.0, 1.0, 0.0);
    let all = params(0.8, 40.0, 0.95, 0.05);
    let v = 9;
    let mut rows = Rows::new(v);
    let specials: Vec<(Vec<f32>, SampleParams)> = vec![
        (vec![nan; 9], hot),
        (vec![nan; 9], params(0.0, 0.0, 1.0, 0.0)),
        (vec![-inf; 9], hot),
        (vec![nan, -inf, nan, -inf, nan, -inf, nan, -inf, nan], all),
        (vec![nan, 1.0, nan, 1.0, -inf, 0.5, nan, 2.0, -inf], hot),
        (vec![nan, 1.0, nan, 1.0, -inf, 0.5, nan, 2.0, -inf], all),
        (
            vec![nan, 1.0, nan, 1.0, -inf, 0.5, nan, 2.0, -inf],
            params(0.5, 2.0, 0.3, 0.0),
        ),
        // Ties for the argmax, -0 equal to +0.
        (
            vec![-1.0, 3.0, 3.0, 0.0, -5.0, 3.0, 1.0, 2.0, 3.0],
            params(0.0, 0.0, 1.0, 0.0),
        ),
        (
            vec![-1.0, -0.0, -2.0, 0.0, -5.0, -0.0, -3.0, 0.0, -4.0],
            params(-1.0, 0.0, 1.0, 0.0),
        ),
        (
            vec![-1.0, -0.0, -2.0, 0.0, -5.0, -0.0, -3.0, 0.0, -4.0],
            params(nan, 0.0, 1.0, 0.0),
        ),
        // Top-k keeps every entry equal to the k-th largest.
        (
            vec![1.0, 3.0, 3.0, 3.0, -5.0, 3.0, 1.0, 2.0, 3.0],
            params(1.0, 2.0, 1.0, 0.0),
        ),
        // An infinite logit: NaN scores, which the CPU only takes as the first kept entry.
        (vec![1.0, inf, 3.0, inf, -5.0, 0.0, 1.0, 2.0, 3.0], hot),
        (vec![inf, 1.0, 3.0, inf, -5.0, 0.0, 1.0, 2.0, 3.0], all),
        // An infinite temperature: -inf entries score NaN, the rest pure noise.
        (
            vec![-inf, 1.0, 3.0, -inf, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(inf, 0.0, 1.0, 0.0),
        ),
        (
            vec![1.0, -inf, 3.0, -inf, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(inf, 0.0, 1.0, 0.0),
        ),
        // Parameters out of range or NaN.
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1.0, nan, nan, nan),
        ),
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1.0, -3.0, -1.0, -1.0),
        ),
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1.0, 1e30, 2.0, 1e-30),
        ),
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1.0, 8.9, 0.0, 0.0),
        ),
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1e-30, 0.0, 1.0, 0.0),
        ),
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1e30, 0.0, 1.0, 0.0),
        ),
        // min-p 1 keeps the maximum only, and so does anything above 1 (no cut lies above it).
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 4.0],
            params(1.0, 0.0, 1.0, 1.0),
        ),
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1.0, 0.0, 1.0, 2.0),
        ),
        (
            vec![1.0, 4.0, 3.0, 2.0, -5.0, 0.0, 1.0, 2.0, 3.0],
            params(1.0, 0.0, 1.0, inf),
        ),
    ];
    for (i, (row, p)) in specials.into_iter().enumerate() {
        for k in 0..16u32 {
            rows.push(row.clone(), p, [i as u32 * 31 + k, k]);
        }
    }
    let cpu = CpuBackend::new();
    let want = rows.tokens(&cpu).unwrap();
    let got = rows.tokens(&vk).unwrap();
    for r in 0..rows.len() {
        assert_eq!(
            got[r],
            want[r],
            "row {r} {:?} {:?} key {:?}",
            rows.row(r),
            rows.params[r],
            rows.keys[r]
        );
    }
    common::assert_clean(&vk);
}

#[test]
fn sample_reads_strided_views() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(11);
    let (r, v, pitch) = (6, 300, 307);
    let logits: Vec<f32> = (0..3 + r * pitch).map(|_| rng.normal() * 3.0).collect();
    // Params stored transposed ([4, R] in memory), keys with a row pitch of 3.
    let mut p = vec![0.0f32; 4 * r];
    for i in 0..r {
        let q = [
            1.0,
            [0.0, 5.0][i % 2],
            [1.0, 0.9][i / 3],
            0.05 * (i % 2) as f32,
        ];
        for (c, x) in q.into_iter().enumerate() {
            p[c * r + i] = x;
        }
    }
    let keys: Vec<i32> = (0..3 * r).map(|_| rng.u32() as i32).collect();
    let srcs = vec![
        Src {
            offset: 3,
            strides: vec![pitch, 1],
            ..f32_src(&logits, &[r, v])
        },
        Src {
            strides: vec![1, r],
            ..f32_src(&p, &[r, 4])
        },
        Src {
            strides: vec![3, 1],
            ..i32_src(&keys, &[r, 2])
        },
    ];
    let want = run(&cpu, Op::Sample, (DType::I32, &[r]), &srcs).unwrap();
    let got = run(&vk, Op::Sample, (DType::I32, &[r]), &srcs).unwrap();
    assert_eq!(as_i32(&got), as_i32(&want));
    common::assert_clean(&vk);
}

/// Penalize's sources: logits `[R, V]`, a history `[R, N]` with repeats, `-1` slots and ids
/// past the row, and per-row (repeat, frequency, presence).
fn penalize_srcs(r: usize, v: usize, n: usize, seed: u64) -> Vec<Src> {
    let mut rng = Rng::new(seed);
    let mut logits: Vec<f32> = (0..r * v).map(|_| rng.normal() * 4.0).collect();
    for i in (0..logits.len()).step_by(13) {
        logits[i] = [0.0, -0.0, f32::NAN, f32::NEG_INFINITY, f32::INFINITY][i % 5];
    }
    let hist: Vec<i32> = (0..r * n)
        .map(|_| match rng.below(10) {
            0 => -1,
            1 => (v + rng.below(5)) as i32,
            2 => i32::MIN,
            // Few distinct ids, so repeats are common.
            _ => rng.below(v.min(24)) as i32,
        })
        .collect();
    let params: Vec<f32> = (0..r)
        .flat_map(|i| {
            if i == 0 {
                [1.0, 0.0, 0.0]
            } else {
                [0.5 + 1.5 * rng.f32(), rng.f32(), rng.f32() - 0.25]
            }
        })
        .collect();
    vec![
        f32_src(&logits, &[r, v]),
        i32_src(&hist, &[r, n]),
        f32_src(&params, &[r, 3]),
    ]
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        assert!(same, "{what}: element {i}: vulkan {g:e} cpu {w:e}");
    }
}

#[test]
fn penalize_matches_the_cpu_bit_for_bit() {
    for cfg in common::both_paths() {
        let Some(vk) = common::open(cfg) else { return };
        let cpu = CpuBackend::new();
        for (r, v, n) in [
            (1, 1, 4),
            (3, 7, 0),
            (4, 7, 64),
            (5, 1000, 64),
            (2, 32003, 64),
            (9, 300, 200),
        ] {
            let srcs = penalize_srcs(r, v, n, (r * v + n) as u64);
            let want = run(&cpu, Op::Penalize, (DType::F32, &[r, v]), &srcs).unwrap();
            let got = run(&vk, Op::Penalize, (DType::F32, &[r, v]), &srcs)
                .unwrap_or_else(|e| panic!("R={r} V={v} N={n}: {e}"));
            assert_same_bits(&as_f32(&got), &as_f32(&want), &format!("R={r} V={v} N={n}"));
        }
        // Strided views: logits with a row pitch, the history transposed.
        let (r, v, n) = (3, 50, 20);
        let base = penalize_srcs(r, v, n, 5);
        let mut logits = vec![0.0f32; 2 + r * 64];
        let lv = as_f32(&base[0].bytes);
        for i in 0..r {
            logits[2 + i * 64..2 + i * 64 + v].copy_from_slice(&lv[i * v..(i + 1) * v]);
        }
        let hv = as_i32(&base[1].bytes);
        let mut ht = vec![0i32; r * n];
        for i in 0..r {
            for j in 0..n {
                ht[j * r + i] = hv[i * n + j];
            }
        }
        let srcs = vec![
            Src {
                offset: 2,
                strides: vec![64, 1],
                ..f32_src(&logits, &[r, v])
            },
            Src {
                strides: vec![1, r],
                ..i32_src(&ht, &[r, n])
            },
            f32_src(&as_f32(&base[2].bytes), &[r, 3]),
        ];
        let want = run(&cpu, Op::Penalize, (DType::F32, &[r, v]), &srcs).unwrap();
        let got = run(&vk, Op::Penalize, (DType::F32, &[r, v]), &srcs).unwrap();
        assert_same_bits(&as_f32(&got), &as_f32(&want), "strided");
        common::assert_clean(&vk);
    }
}

/// The inputs of one decode-like sampling step, packed into one arena as the staged policy
/// packs a split's user inputs: logits, history, penalty params, sampler params, key.
struct Arena {
    v: usize,
    n: usize,
}

impl Arena {
    const ROWS: usize = 1;
    fn offsets(&self) -> [usize; 6] {
        let (v, n) = (self.v, self.n);
        let mut o = [0; 6];
        let sizes = [v, n, 3, 4, 2];
        for i in 0..5 {
            o[i + 1] = o[i] + sizes[i];
        }
        o.map(|e| e * 4)
    }
    fn bytes(&self, step: u32, rng: &mut Rng) -> Vec<u8> {
        let mut b = Vec::new();
        let logits: Vec<f32> = (0..self.v).map(|_| rng.normal() * 2.0).collect();
        b.extend(common::f32_bytes(&logits));
        let hist: Vec<i32> = (0..self.n)
            .map(|_| rng.below(self.v + 2) as i32 - 1)
            .collect();
        b.extend(common::i32_bytes(&hist));
        b.extend(common::f32_bytes(&[1.3, 0.2, 0.1]));
        b.extend(common::f32_bytes(&[0.9, 40.0, 0.95, 0.02]));
        b.extend(common::i32_bytes(&[1234, step as i32]));
        b
    }
    /// Penalize then sample, reading the arena; the token goes to `out`.
    fn graph(&self, arena: BufferId, pen: BufferId, out: BufferId) -> Arc<ExecGraph> {
        let o = self.offsets();
        let (r, v, n) = (Self::ROWS, self.v, self.n);
        let at = |i: usize, dtype, shape: &[usize]| TensorRef {
            buffer: arena,
            byte_offset: o[i],
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        };
        let penalized = common::contiguous(pen, DType::F32, &[r, v]);
        Arc::new(ExecGraph::new(vec![
            ExecNode {
                op: Op::Penalize,
                name: "penalize".into(),
                dst: penalized.clone(),
                srcs: vec![
                    at(0, DType::F32, &[r, v]),
                    at(1, DType::I32, &[r, n]),
                    at(2, DType::F32, &[r, 3]),
                ],
            },
            ExecNode {
                op: Op::Sample,
                name: "sample".into(),
                dst: common::contiguous(out, DType::I32, &[r]),
                srcs: vec![
                    penalized,
                    at(3, DType::F32, &[r, 4]),
                    at(4, DType::I32, &[r, 2]),
                ],
            },
        ]))
    }
}

#[test]
fn a_staged_sampling_step_is_one_submit_one_wait_and_the_cpu_token() {
    let cpu = CpuBackend::new();
    for cfg in common::both_paths() {
        let Some(vk) = common::open(cfg) else { return };
        let a = Arena { v: 1000, n: 16 };
        let size = a.offsets()[5];
        let setup = |b: &dyn Backend, usage| {
            let arena = b.alloc_buffer(size, usage).unwrap();
            let pen = b.alloc_buffer(a.v * 4, BufferUsage::Compute).unwrap();
            let out = b.alloc_buffer(4, BufferUsage::Compute).unwrap();
            (arena, a.graph(arena, pen, out), out)
        };
        let (c_arena, c_graph, c_out) = setup(&cpu, BufferUsage::Compute);
        let (arena, g, out) = setup(&vk, BufferUsage::Inputs);
        let readable = vk.is_host_readable(out);
        vk.synchronize().unwrap();
        let mut rng = Rng::new(3);
        let mut tokens = std::collections::BTreeSet::new();
        for step in 0..20u32 {
            let bytes = a.bytes(step, &mut rng);
            cpu.set_tensor(c_arena, 0, &bytes).unwrap();
            cpu.graph_compute_async(&c_graph).unwrap();
            let mut want = [0u8; 4];
            cpu.get_tensor(c_out, 0, &mut want).unwrap();

            let before = vk.stats().snapshot();
            vk.set_tensor_async_staged(arena, 0, &bytes).unwrap();
            vk.graph_compute_async(&g).unwrap();
            let mut got = [0u8; 4];
            vk.get_tensor(out, 0, &mut got).unwrap();
            let d = vk.stats().snapshot().since(&before);
            assert_eq!(
                (d.host_waits, d.driver_syncs, d.empty_submits, d.h2d_copies),
                (1, 1, 0, 1),
                "step {step}"
            );
            // One compute submission; memory the host cannot read adds the readback's.
            assert_eq!(d.submits, if readable { 1 } else { 2 }, "step {step}");
            assert_eq!(got, want, "step {step}");
            tokens.insert(i32::from_le_bytes(got));
        }
        assert!(tokens.len() > 5, "the steps drew {tokens:?}");
        common::assert_clean(&vk);
    }
}

#[test]
fn bad_sampler_shapes_are_errors_and_the_backend_stays_usable() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let logits = f32_src(&[0.5; 12], &[2, 6]);
    let keys = i32_src(&[1, 2, 3, 4], &[2, 2]);
    let cases: Vec<(Op, (DType, Vec<usize>), Vec<Src>, &str)> = vec![
        (
            Op::Sample,
            (DType::I32, vec![2]),
            vec![
                f32_src(&[0.5; 12], &[2, 6]),
                f32_src(&[1.0; 6], &[2, 3]),
                i32_src(&[1, 2, 3, 4], &[2, 2]),
            ],
            "params must be f32 [2, 4]",
        ),
        (
            Op::Sample,
            (DType::I32, vec![3]),
            vec![
                f32_src(&[0.5; 12], &[2, 6]),
                f32_src(&[1.0; 8], &[2, 4]),
                i32_src(&[1, 2, 3, 4], &[2, 2]),
            ],
            "result must be i32 [2]",
        ),
        (
            Op::Sample,
            (DType::I32, vec![2]),
            vec![
                f32_src(&[], &[2, 0]),
                f32_src(&[1.0; 8], &[2, 4]),
                i32_src(&[1, 2, 3, 4], &[2, 2]),
            ],
            "V > 0",
        ),
        (
            Op::Sample,
            (DType::I32, vec![2]),
            vec![
                f32_src(&[0.5; 12], &[2, 6]),
                f32_src(&[1.0; 8], &[2, 4]),
                i32_src(&[1, 2], &[2, 1]),
            ],
            "key must be i32 [2, 2]",
        ),
        (
            Op::Penalize,
            (DType::F32, vec![2, 6]),
            vec![
                f32_src(&[0.5; 12], &[2, 6]),
                i32_src(&[1, 2, 3], &[3, 1]),
                f32_src(&[1.0; 6], &[2, 3]),
            ],
            "hist must be i32 [2, 1]",
        ),
        (
            Op::Penalize,
            (DType::F32, vec![2, 6]),
            vec![
                f32_src(&[0.5; 12], &[2, 6]),
                f32_src(&[1.0; 2], &[2, 1]),
                f32_src(&[1.0; 6], &[2, 3]),
            ],
            "hist must be i32",
        ),
        (
            Op::Penalize,
            (DType::F32, vec![12]),
            vec![
                f32_src(&[0.5; 12], &[2, 6]),
                i32_src(&[1, 2], &[2, 1]),
                f32_src(&[1.0; 6], &[2, 3]),
            ],
            "result must be f32 [2, 6]",
        ),
    ];
    for (op, (dt, shape), srcs, msg) in cases {
        let before = vk.stats().snapshot();
        match run(&vk, op, (dt, &shape), &srcs) {
            Err(Error::Kernel {
                op: name, msg: m, ..
            }) => {
                assert_eq!(name, op.name());
                assert!(m.contains(msg), "{m:?} should say {msg:?}");
            }
            other => panic!("{op:?} {msg}: expected a kernel error, got {other:?}"),
        }
        assert_eq!(vk.stats().snapshot().since(&before).kernel_launches, 0);
    }
    // Still usable.
    let p = f32_src(&[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0], &[2, 4]);
    let got = run(&vk, Op::Sample, (DType::I32, &[2]), &[logits, p, keys]).unwrap();
    assert_eq!(as_i32(&got), vec![0, 0]);
    common::assert_clean(&vk);
}

/// A rough figure, printed (not asserted): one sample dispatch over a 49152-entry row, the
/// default llama.cpp chain and top-p alone (the most bisection work).
#[test]
fn sample_time_per_dispatch_at_v_49152() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let v = 49152;
    let mut rng = Rng::new(5);
    let row: Vec<f32> = (0..v).map(|_| rng.normal() * 3.0).collect();
    let cpu = CpuBackend::new();
    for (what, p) in [
        ("greedy", params(0.0, 0.0, 1.0, 0.0)),
        ("temperature only", params(0.8, 0.0, 1.0, 0.0)),
        (
            "top_k 40, top_p 0.95, min_p 0.05",
            params(0.8, 40.0, 0.95, 0.05),
        ),
        ("top_p 0.9 alone", params(0.8, 0.0, 0.9, 0.0)),
    ] {
        let mut rows = Rows::new(v);
        rows.push(row.clone(), p, [9, 1]);
        let srcs = rows.srcs();
        let mut ids = Vec::new();
        let mut refs = Vec::new();
        for s in &srcs {
            let id = common::buffer_with(&vk, &s.bytes);
            ids.push(id);
            refs.push(common::contiguous(id, s.dtype, &s.shape));
        }
        let out = vk.alloc_buffer(4, BufferUsage::Compute).unwrap();
        let g = Arc::new(ExecGraph::new(vec![ExecNode {
            op: Op::Sample,
            name: "sample".into(),
            dst: common::contiguous(out, DType::I32, &[1]),
            srcs: refs,
        }]));
        vk.graph_compute_async(&g).unwrap();
        vk.synchronize().unwrap();
        let iters = 5;
        let t0 = Instant::now();
        for _ in 0..iters {
            vk.graph_compute_async(&g).unwrap();
            vk.synchronize().unwrap();
        }
        let per = t0.elapsed() / iters;
        let mut got = [0u8; 4];
        vk.get_tensor(out, 0, &mut got).unwrap();
        assert_eq!(as_i32(&got), rows.tokens(&cpu).unwrap(), "{what}");
        println!(
            "sample V={v} ({what}) on {}: {:.2} ms per dispatch (submit + wait)",
            vk.device_name(),
            per.as_secs_f64() * 1e3
        );
        for id in ids {
            vk.free_buffer(id);
        }
        vk.free_buffer(out);
    }
    common::assert_clean(&vk);
}
