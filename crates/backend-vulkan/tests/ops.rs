//! The op suite: every op of `lowsync_graph::Op` with a kernel, run on Vulkan and on the CPU
//! oracle (`lowsync_cpu::CpuBackend`) from identical bytes, compared by NMSE (exact for i32),
//! on both memory paths (mapped writes, and the no-ReBAR path where every write is staged).
//! Strided, transposed, broadcast and in-place views are covered, and so are f16/bf16
//! storage. Each run asserts the validation layer (synchronization validation on) stayed
//! silent.

mod common;

use std::sync::Arc;

use half::{bf16, f16};
use lowsync_backend::{Backend, BufferUsage, Error, ExecGraph, ExecNode, TensorRef};
use lowsync_cpu::CpuBackend;
use lowsync_graph::{contiguous_strides, DType, Op, RopeMode};
use lowsync_vulkan::{SplitK, VkConfig, VulkanBackend};

/// A tensor in its own buffer: `offset` elements in, with explicit strides.
#[derive(Clone, Debug)]
struct Spec {
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    fill: Fill,
}

#[derive(Clone, Debug)]
enum Fill {
    Rand,
    Zero,
    Ints(Vec<i32>),
    Values(Vec<f32>),
}

fn c(dtype: DType, shape: &[usize]) -> Spec {
    Spec {
        dtype,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
        offset: 0,
        fill: Fill::Rand,
    }
}

fn ints(shape: &[usize], v: &[i32]) -> Spec {
    Spec {
        fill: Fill::Ints(v.to_vec()),
        ..c(DType::I32, shape)
    }
}

/// The transpose of a contiguous `[rows, cols]` parent: shape `[cols, rows]`.
fn t(dtype: DType, rows: usize, cols: usize) -> Spec {
    Spec {
        dtype,
        shape: vec![cols, rows],
        strides: vec![1, cols],
        offset: 0,
        fill: Fill::Rand,
    }
}

impl Spec {
    fn at(mut self, offset: usize) -> Self {
        self.offset = offset;
        self
    }
    fn strided(mut self, strides: &[usize]) -> Self {
        self.strides = strides.to_vec();
        self
    }
    fn values(mut self, v: &[f32]) -> Self {
        self.fill = Fill::Values(v.to_vec());
        self
    }
    fn zero(mut self) -> Self {
        self.fill = Fill::Zero;
        self
    }
    fn elems(&self) -> usize {
        let last: usize = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| d.saturating_sub(1) * s)
            .sum();
        self.offset + last + 1
    }
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes of the whole buffer (deterministic in `seed`).
    fn bytes(&self, seed: u64) -> Vec<u8> {
        let n = self.elems();
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut vals: Vec<f32> = (0..n)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                ((rng >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        match &self.fill {
            Fill::Zero => vals.iter_mut().for_each(|v| *v = 0.0),
            Fill::Values(v) => {
                for (i, x) in v.iter().enumerate() {
                    vals[self.index(i)] = *x;
                }
            }
            _ => {}
        }
        if let Fill::Ints(v) = &self.fill {
            let mut out = vec![0i32; n];
            for (i, x) in v.iter().enumerate() {
                out[self.index(i)] = *x;
            }
            return out.iter().flat_map(|x| x.to_le_bytes()).collect();
        }
        encode(self.dtype, &vals)
    }
    /// Buffer element index of row-major element `i`.
    fn index(&self, mut i: usize) -> usize {
        let mut off = self.offset;
        for ax in (0..self.shape.len()).rev() {
            let d = self.shape[ax].max(1);
            off += (i % d) * self.strides[ax];
            i /= d;
        }
        off
    }
    fn tensor(&self, buffer: lowsync_backend::BufferId) -> TensorRef {
        TensorRef {
            buffer,
            byte_offset: self.offset * self.dtype.size_bytes(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
        }
    }
}

fn encode(dtype: DType, vals: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect(),
        DType::BF16 => vals
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect(),
        DType::I32 => vals
            .iter()
            .flat_map(|x| (*x as i32).to_le_bytes())
            .collect(),
        q => panic!("{q}: block dtypes have no element encoding"),
    }
}

fn decode(dtype: DType, b: &[u8], i: usize) -> f64 {
    let s = dtype.size_bytes();
    let w = &b[i * s..(i + 1) * s];
    match dtype {
        DType::F32 => f32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        DType::F16 => f16::from_le_bytes([w[0], w[1]]).to_f64(),
        DType::BF16 => bf16::from_le_bytes([w[0], w[1]]).to_f64(),
        DType::I32 => i32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        q => panic!("{q}: block dtypes have no element decoding"),
    }
}

struct Case {
    name: String,
    op: Op,
    dst: Spec,
    srcs: Vec<Spec>,
    /// The destination is source 0's buffer and view (in place / SetRows).
    alias: bool,
}

fn case(name: &str, op: Op, dst: Spec, srcs: Vec<Spec>) -> Case {
    Case {
        name: name.into(),
        op,
        dst: dst.zero(),
        srcs,
        alias: false,
    }
}

/// Runs `case` on `b` and returns the destination's elements (row-major).
fn run(b: &dyn Backend, case: &Case) -> Result<Vec<f64>, Error> {
    let mut srcs = Vec::new();
    for (i, s) in case.srcs.iter().enumerate() {
        let bytes = s.bytes(i as u64 + 1);
        let id = b.alloc_buffer(bytes.len(), BufferUsage::Compute)?;
        b.set_tensor(id, 0, &bytes)?;
        srcs.push(s.tensor(id));
    }
    let (dst_id, dst) = if case.alias {
        (srcs[0].buffer, srcs[0].clone())
    } else {
        let bytes = case.dst.bytes(99);
        let id = b.alloc_buffer(bytes.len(), BufferUsage::Compute)?;
        b.set_tensor(id, 0, &bytes)?;
        (id, case.dst.tensor(id))
    };
    let spec = if case.alias { &case.srcs[0] } else { &case.dst };
    let node = ExecNode {
        op: case.op,
        name: case.name.clone(),
        dst,
        srcs,
    };
    b.graph_compute_async(&Arc::new(ExecGraph::new(vec![node])))?;
    b.synchronize()?;
    let mut out = vec![0u8; spec.elems() * spec.dtype.size_bytes()];
    b.get_tensor(dst_id, 0, &mut out)?;
    Ok((0..spec.numel())
        .map(|i| decode(spec.dtype, &out, spec.index(i)))
        .collect())
}

fn nmse(got: &[f64], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        if w.is_nan() && g.is_nan() {
            continue;
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

fn cases() -> Vec<Case> {
    use DType::*;
    let mut v = Vec::new();
    for (ad, bd) in [(F32, F32), (F16, F32), (F32, BF16), (BF16, F16)] {
        v.push(case(
            &format!("add {ad}+{bd} broadcast"),
            Op::Add,
            c(ad, &[3, 5, 7]),
            vec![c(ad, &[3, 5, 7]), c(bd, &[5, 1])],
        ));
        v.push(case(
            &format!("mul {ad}*{bd} broadcast"),
            Op::Mul,
            c(ad, &[4, 33]),
            vec![c(ad, &[4, 33]), c(bd, &[33])],
        ));
    }
    v.push(Case {
        alias: true,
        ..case(
            "add in place",
            Op::Add,
            c(F32, &[2, 300]),
            vec![c(F32, &[2, 300]), c(F32, &[2, 300])],
        )
    });
    v.push(case(
        "add strided",
        Op::Add,
        c(F32, &[6, 5]),
        vec![t(F32, 5, 6), c(F32, &[6, 5]).strided(&[7, 1]).at(3)],
    ));
    for d in [F32, F16, BF16] {
        v.push(case(
            &format!("scale {d}"),
            Op::Scale { scale: 0.37 },
            c(d, &[70, 9]),
            vec![c(d, &[70, 9])],
        ));
        v.push(case(
            &format!("silu {d}"),
            Op::Silu,
            c(d, &[1000]),
            vec![c(d, &[1000])],
        ));
        v.push(case(
            &format!("gelu {d}"),
            Op::Gelu,
            c(d, &[1000]),
            vec![c(d, &[1000])],
        ));
        v.push(case(
            &format!("swiglu {d}"),
            Op::SwiGlu,
            c(d, &[3, 129]),
            vec![c(d, &[3, 129]), c(d, &[3, 129])],
        ));
    }
    v.push(case(
        "silu extremes",
        Op::Silu,
        c(F32, &[6]),
        vec![c(F32, &[6]).values(&[-100.0, -90.0, 0.0, 88.0, 100.0, -1e-3])],
    ));
    v.push(case(
        "gelu extremes",
        Op::Gelu,
        c(F32, &[6]),
        vec![c(F32, &[6]).values(&[-100.0, -10.0, 0.0, 1e-4, 10.0, 100.0])],
    ));
    for (s, d) in [(F32, F16), (F16, F32), (F32, BF16), (BF16, F32), (F16, F16)] {
        v.push(case(
            &format!("cpy {s}->{d} transposed"),
            Op::Cpy,
            c(d, &[17, 9]),
            vec![t(s, 9, 17)],
        ));
    }
    v.push(case(
        "cpy i32",
        Op::Cpy,
        c(I32, &[4, 3]),
        vec![ints(&[4, 3], &(0..12).map(|i| i * 7 - 40).collect::<Vec<_>>()).strided(&[1, 4])],
    ));
    v.push(case(
        "cpy f16 odd offset",
        Op::Cpy,
        c(F16, &[5, 3]),
        vec![c(F32, &[5, 3]).at(1)],
    ));
    v.push(case(
        "concat axis 0",
        Op::Concat { axis: 0 },
        c(F32, &[5, 4]),
        vec![c(F32, &[2, 4]), c(F16, &[3, 4])],
    ));
    v.push(case(
        "concat axis 1",
        Op::Concat { axis: 1 },
        c(F16, &[3, 9]),
        vec![c(F32, &[3, 4]), t(F32, 5, 3)],
    ));
    v.push(case(
        "concat i32",
        Op::Concat { axis: 0 },
        c(I32, &[3]),
        vec![ints(&[1], &[5]), ints(&[2], &[-3, 9])],
    ));
    for d in [F32, F16, BF16] {
        v.push(case(
            &format!("rms_norm {d}"),
            Op::RmsNorm { eps: 1e-6 },
            c(d, &[3, 2, 600]),
            vec![c(d, &[3, 2, 600])],
        ));
    }
    v.push(case(
        "rms_norm strided",
        Op::RmsNorm { eps: 1e-5 },
        c(F32, &[7, 5]),
        vec![t(F32, 5, 7)],
    ));
    v.push(case(
        "soft_max no mask",
        Op::SoftMax { scale: 0.5 },
        c(F32, &[4, 3, 300]),
        vec![c(F32, &[4, 3, 300])],
    ));
    v.push(case(
        "soft_max rows past a workgroup, strided",
        Op::SoftMax { scale: 1.0 },
        c(F32, &[70, 33]),
        vec![t(F32, 33, 70)],
    ));
    let mut mask = vec![0.0f32; 3 * 10];
    for (i, m) in mask.iter_mut().enumerate() {
        if i % 10 > i / 10 + 6 {
            *m = f32::NEG_INFINITY;
        }
    }
    mask[20..30].fill(f32::NEG_INFINITY); // a fully masked row gives zeros
    for md in [F32, F16] {
        v.push(case(
            &format!("soft_max mask {md} broadcast"),
            Op::SoftMax { scale: 0.125 },
            c(F32, &[4, 3, 10]),
            vec![
                c(F32, &[4, 3, 10]),
                Spec {
                    fill: Fill::Values(mask.clone()),
                    ..c(md, &[3, 10])
                },
            ],
        ));
    }
    let pos: Vec<i32> = vec![0, 1, 17, 255, 4095, 100_000];
    for (mode, d, dims) in [
        (RopeMode::Normal, F32, 64),
        (RopeMode::Neox, F32, 64),
        (RopeMode::Normal, F16, 32),
        (RopeMode::Neox, BF16, 48),
    ] {
        v.push(case(
            &format!("rope {mode:?} {d} n_dims {dims}"),
            Op::Rope {
                mode,
                n_dims: dims,
                theta_base: 10000.0,
            },
            c(d, &[6, 3, 64]),
            vec![c(d, &[6, 3, 64]), ints(&[6], &pos)],
        ));
    }
    v.push(case(
        "rope strided x",
        Op::Rope {
            mode: RopeMode::Neox,
            n_dims: 8,
            theta_base: 500000.0,
        },
        c(F32, &[2, 3, 8]),
        vec![c(F32, &[2, 3, 8]).strided(&[8, 16, 1]), ints(&[2], &[3, 9])],
    ));
    for (td, dd) in [(F32, F32), (F16, F32), (BF16, F16)] {
        v.push(case(
            &format!("get_rows {td}->{dd}"),
            Op::GetRows,
            c(dd, &[2, 3, 37]),
            vec![c(td, &[11, 37]), ints(&[2, 3], &[0, 10, 3, 3, 7, 1])],
        ));
    }
    for (dd, sd) in [(F32, F32), (F16, F32), (BF16, F32), (F32, F16)] {
        v.push(Case {
            alias: true,
            ..case(
                &format!("set_rows {sd}->{dd} duplicates"),
                Op::SetRows,
                c(dd, &[8, 33]),
                vec![c(dd, &[8, 33]), c(sd, &[4, 33]), ints(&[4], &[5, 0, 5, 7])],
            )
        });
    }
    // Prompt-sized writes: rows in chunks where the indices strictly increase (the last chunk
    // partial), every row by chunk 0 where they do not (distinct but unordered, and repeated).
    let up: Vec<i32> = (0..70).map(|j| 3 + j + j / 9).collect();
    let shuffled: Vec<i32> = (0..40).map(|j| (j * 17) % 41).collect();
    let repeated: Vec<i32> = (0..45).map(|j| (j * 7) % 13).collect();
    for (what, ids) in [
        ("increasing", up),
        ("unordered", shuffled),
        ("repeated", repeated),
    ] {
        let (dd, sd) = if what == "unordered" {
            (F16, F32)
        } else {
            (F32, F32)
        };
        v.push(Case {
            alias: true,
            ..case(
                &format!("set_rows {sd}->{dd} {} rows {what}", ids.len()),
                Op::SetRows,
                c(dd, &[80, 70]),
                vec![
                    c(dd, &[80, 70]),
                    c(sd, &[ids.len(), 70]),
                    ints(&[ids.len()], &ids),
                ],
            )
        });
    }
    v.push(case(
        "argmax ties and NaN",
        Op::Argmax,
        c(I32, &[4]),
        vec![c(F32, &[4, 5]).values(&[
            1.0,
            3.0,
            3.0,
            -1.0,
            0.0,
            f32::NAN,
            f32::NAN,
            f32::NAN,
            f32::NAN,
            f32::NAN,
            f32::NAN,
            -2.0,
            f32::NAN,
            -1.0,
            -5.0,
            -0.0,
            0.0,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ])],
    ));
    v.push(case(
        "argmax long rows",
        Op::Argmax,
        c(I32, &[3, 2]),
        vec![c(F16, &[3, 2, 1000])],
    ));
    // MulMat: decode-shaped (k-split and column kernels) and tiled, batches with GQA.
    for (ad, bd) in [(F32, F32), (F32, F16), (F32, BF16), (F16, F32)] {
        v.push(case(
            &format!("mul_mat vec x@w.T {ad}@{bd}"),
            Op::MulMat,
            c(F32, &[1, 70]),
            vec![c(ad, &[1, 300]), t(bd, 70, 300)],
        ));
        v.push(case(
            &format!("mul_mat tiled x@w.T {ad}@{bd}"),
            Op::MulMat,
            c(F32, &[37, 70]),
            vec![c(ad, &[37, 300]), t(bd, 70, 300)],
        ));
    }
    // The decode fast path's edges: a 16-bit operand at an odd element offset (generic kernel),
    // k not a multiple of 4 (generic), and batched `q @ k.T` with a GQA broadcast (fast).
    v.push(case(
        "mul_mat vec x@w.T f16 w at an odd offset",
        Op::MulMat,
        c(F32, &[1, 70]),
        vec![c(F32, &[1, 300]), t(F16, 70, 300).at(1)],
    ));
    v.push(case(
        "mul_mat vec x@w.T k = 301",
        Op::MulMat,
        c(F32, &[1, 70]),
        vec![c(F32, &[1, 301]), t(BF16, 70, 301)],
    ));
    v.push(case(
        "mul_mat vec gqa q@k.T",
        Op::MulMat,
        c(F32, &[8, 1, 13]),
        vec![
            c(F32, &[8, 1, 64]),
            c(F16, &[2, 64, 13]).strided(&[13 * 64, 1, 64]),
        ],
    ));
    v.push(case(
        "mul_mat vec row-major b, 3 rows",
        Op::MulMat,
        c(F32, &[3, 130]),
        vec![c(F32, &[3, 50]), c(F16, &[50, 130])],
    ));
    v.push(case(
        "mul_mat tiled row-major",
        Op::MulMat,
        c(F32, &[65, 129]),
        vec![c(F32, &[65, 33]), c(F32, &[33, 129])],
    ));
    // Prefill-shaped attention products: q @ k.T over a GQA-broadcast f16 cache (k along its
    // rows), p @ V with V's rows along k, and k not a multiple of 16.
    v.push(case(
        "mul_mat prefill gqa q@k.T",
        Op::MulMat,
        c(F32, &[8, 40, 52]),
        vec![
            c(F32, &[8, 40, 64]),
            c(F16, &[2, 64, 52]).strided(&[52 * 64, 1, 64]),
        ],
    ));
    v.push(case(
        "mul_mat prefill gqa p@v",
        Op::MulMat,
        c(F32, &[8, 40, 64]),
        vec![c(F32, &[8, 40, 52]), c(F16, &[2, 52, 64])],
    ));
    v.push(case(
        "mul_mat prefill p@v, 73 keys",
        Op::MulMat,
        c(F32, &[4, 33, 64]),
        vec![c(F32, &[4, 33, 73]).at(3), c(F32, &[4, 73, 64])],
    ));
    v.push(case(
        "mul_mat prefill x@w.T bf16, 70 rows",
        Op::MulMat,
        c(F32, &[70, 65]),
        vec![c(F32, &[70, 36]).at(8), t(BF16, 65, 36)],
    ));
    v.push(case(
        "mul_mat gqa batches",
        Op::MulMat,
        c(F32, &[8, 5, 12]),
        vec![c(F32, &[8, 5, 16]), c(F16, &[2, 16, 12])],
    ));
    v.push(case(
        "mul_mat gqa decode",
        Op::MulMat,
        c(F32, &[8, 1, 12]),
        vec![c(F32, &[8, 1, 16]), c(F32, &[2, 16, 12])],
    ));
    v.push(case(
        "mul_mat 4-D broadcast",
        Op::MulMat,
        c(F32, &[2, 4, 9, 6]),
        vec![c(F32, &[2, 4, 9, 11]), c(F32, &[1, 2, 11, 6])],
    ));
    v.push(case(
        "mul_mat k = 0",
        Op::MulMat,
        c(F32, &[3, 4]),
        vec![c(F32, &[3, 0]), c(F32, &[0, 4])],
    ));
    v.push(case(
        "mul_mat transposed a",
        Op::MulMat,
        c(F32, &[20, 10]),
        vec![t(F32, 24, 20), c(F32, &[24, 10])],
    ));
    for (ed, xd) in [(F32, F32), (F16, F32), (BF16, F16)] {
        v.push(case(
            &format!("mul_mat_id {ed} experts, {xd} x"),
            Op::MulMatId,
            c(F32, &[3, 40]),
            vec![
                c(ed, &[4, 24, 40]),
                c(xd, &[3, 24]),
                ints(&[3, 2], &[1, 3, 0, 1, 2, 2]),
                c(F32, &[3, 2]),
            ],
        ));
    }
    v
}

fn tolerance(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-7,
        DType::F16 => 1e-5,
        _ => 1e-4,
    }
}

fn suite(cfg: VkConfig) {
    suite_kernels(cfg);
}

/// The suite; returns the kernel variants that ran when `cfg` profiles (else none).
fn suite_kernels(cfg: VkConfig) -> Vec<String> {
    let Some(vk) = common::open(cfg) else {
        return Vec::new();
    };
    let cpu = CpuBackend::new();
    let mut failures = Vec::new();
    for case in cases() {
        let want = run(&cpu, &case).unwrap_or_else(|e| panic!("{}: cpu: {e}", case.name));
        let got = match run(&vk, &case) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{}: vulkan error: {e}", case.name));
                continue;
            }
        };
        let dt = if case.alias {
            case.srcs[0].dtype
        } else {
            case.dst.dtype
        };
        if dt == DType::I32 {
            if got != want {
                failures.push(format!("{}: got {got:?}, want {want:?}", case.name));
            }
            continue;
        }
        let e = nmse(&got, &want);
        if e.is_nan() || e > tolerance(dt) {
            failures.push(format!(
                "{}: NMSE {e:.3e} > {:.0e} (first got {:?} want {:?})",
                case.name,
                tolerance(dt),
                &got[..got.len().min(4)],
                &want[..want.len().min(4)]
            ));
        }
    }
    common::assert_clean(&vk);
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    vk.kernel_times().into_iter().map(|t| t.name).collect()
}

/// The float products on cooperative matrices (`LOWSYNC_VK_COOPMAT`): every MulMat case of the
/// suite, within the f16 rounding of its operands (NMSE 1e-5) where the device has them and
/// `mul_mat_cm` runs; where it does not (lavapipe), to the suite's own bounds with the device's
/// own kernels.
#[test]
fn mul_mat_on_cooperative_matrices_matches_the_cpu_oracle() {
    let Some(vk) = common::open(VkConfig {
        coopmat: true,
        profile: true,
        ..common::config()
    }) else {
        return;
    };
    let cm = vk.has_coopmat();
    let cpu = CpuBackend::new();
    let mut failures = Vec::new();
    for case in cases()
        .into_iter()
        .filter(|c| c.name.starts_with("mul_mat"))
    {
        let want = run(&cpu, &case).unwrap_or_else(|e| panic!("{}: cpu: {e}", case.name));
        let got = match run(&vk, &case) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{}: vulkan error: {e}", case.name));
                continue;
            }
        };
        let bound = if cm { 1e-5 } else { tolerance(case.dst.dtype) };
        let e = nmse(&got, &want);
        if e.is_nan() || e > bound {
            failures.push(format!("{}: NMSE {e:.3e} > {bound:.0e}", case.name));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let ran = vk
        .kernel_times()
        .iter()
        .any(|t| t.name.starts_with("mul_mat_cm."));
    assert_eq!(ran, cm);
    common::assert_clean(&vk);
}

/// Every MulMat case (tile edges, strided and transposed operands, GQA batches, k = 0) on the
/// tiled products with 4x4 and with 8x8 outputs per invocation (`LOWSYNC_VK_TILE`), split over
/// k as `split_k` says; row lanes off, so the tiles are what runs. The two must give the same
/// bits (the same sums in the same order) and match the CPU oracle; returns the two backends
/// (profiled) for the caller's checks of what ran.
fn four_and_eight(split_k: SplitK) -> Option<[VulkanBackend; 2]> {
    let open = |tile| {
        common::open(VkConfig {
            tile,
            split_k,
            row_lanes: Some(false),
            profile: true,
            ..common::config()
        })
    };
    let (Some(four), Some(eight)) = (open(4), open(8)) else {
        return None;
    };
    let cpu = CpuBackend::new();
    let mut failures = Vec::new();
    for case in cases()
        .into_iter()
        .filter(|c| c.name.starts_with("mul_mat "))
    {
        let want = run(&cpu, &case).unwrap_or_else(|e| panic!("{}: cpu: {e}", case.name));
        let (a, b) = match (run(&four, &case), run(&eight, &case)) {
            (Ok(a), Ok(b)) => (a, b),
            (a, b) => {
                failures.push(format!(
                    "{}: errors {:?} / {:?}",
                    case.name,
                    a.err(),
                    b.err()
                ));
                continue;
            }
        };
        if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) || a.len() != b.len() {
            failures.push(format!("{}: 8x8 tiles changed the bits", case.name));
        }
        let e = nmse(&a, &want);
        if e.is_nan() || e > tolerance(case.dst.dtype) {
            failures.push(format!("{}: NMSE {e:.3e}", case.name));
        }
    }
    assert!(failures.is_empty(), "{split_k:?}: {}", failures.join("\n"));
    common::assert_clean(&four);
    common::assert_clean(&eight);
    Some([four, eight])
}

fn ran(vk: &VulkanBackend, family: &str) -> bool {
    vk.kernel_times()
        .iter()
        .any(|t| t.name.starts_with(&format!("{family}.")))
}

/// The tiled products with 8x8 outputs per invocation (`LOWSYNC_VK_TILE=8`, `mul_mat8`) give
/// the 4x4 tiles' bits and match the oracle.
#[test]
fn eight_by_eight_tiles_give_the_four_by_four_bits() {
    let Some([four, eight]) = four_and_eight(SplitK::Off) else {
        return;
    };
    assert!(ran(&four, "mul_mat") && !ran(&four, "mul_mat8"));
    assert!(ran(&eight, "mul_mat8") && !ran(&eight, "mul_mat"));
    assert!(!ran(&four, "split_sum") && !ran(&eight, "split_sum"));
}

/// The tiled products split over k (`LOWSYNC_VK_SPLIT_K=3`: each tile's k in up to three
/// ranges summed into partials, then `split_sum`) match the oracle, 4x4 and 8x8 alike.
#[test]
fn split_k_products_match_the_cpu_oracle() {
    let Some([four, eight]) = four_and_eight(SplitK::Fixed(3)) else {
        return;
    };
    assert!(ran(&four, "split_sum") && ran(&eight, "split_sum"));
}

/// `LOWSYNC_VK_SPLIT_K=auto` splits a product of few tiles and long k (128 x 256 over k =
/// 2,048: 8 tiles) where the device counts its multiprocessors (16 or more: the tiles then
/// fill at most half), and nothing where it does not (lavapipe); the result matches the oracle
/// either way.
#[test]
fn auto_split_k_follows_the_multiprocessor_count() {
    let Some(vk) = common::open(VkConfig {
        split_k: SplitK::Auto,
        row_lanes: Some(false),
        profile: true,
        ..common::config()
    }) else {
        return;
    };
    let case = case(
        "mul_mat auto split",
        Op::MulMat,
        c(DType::F32, &[128, 256]),
        vec![c(DType::F32, &[128, 2048]), t(DType::F16, 256, 2048)],
    );
    let want = run(&CpuBackend::new(), &case).expect("cpu");
    let got = run(&vk, &case).expect("vulkan");
    let e = nmse(&got, &want);
    assert!(e <= tolerance(DType::F32), "NMSE {e:.3e}");
    assert_eq!(ran(&vk, "split_sum"), vk.multiprocessors() >= 16);
    common::assert_clean(&vk);
}

#[test]
fn every_op_matches_the_cpu_oracle_on_mapped_memory() {
    suite(common::config());
}

#[test]
fn every_op_matches_the_cpu_oracle_on_the_no_rebar_path() {
    suite(common::config_no_rebar());
}

/// Devices without subgroup arithmetic run the shared-memory flavour of the decode mat-vec.
#[test]
fn every_op_matches_the_cpu_oracle_without_subgroups() {
    suite(VkConfig {
        no_subgroups: true,
        ..common::config()
    });
}

/// Both layouts of the row kernels and the float prefill product (`LOWSYNC_VK_ROW_LANES`: a
/// workgroup per row or a 64x64 tile; an invocation per row or per result column) match the
/// oracle, whichever the device picks by default.
#[test]
fn every_op_matches_the_cpu_oracle_with_either_row_layout() {
    for lanes in [false, true] {
        let names = suite_kernels(VkConfig {
            row_lanes: Some(lanes),
            profile: true,
            ..common::config()
        });
        if names.is_empty() {
            return;
        }
        let family = |f: &str| names.iter().any(|n| n.starts_with(&format!("{f}.")));
        for f in ["soft_max", "rms_norm"] {
            assert_eq!(family(f), !lanes, "{f}: {names:?}");
            assert_eq!(family(&format!("{f}_t")), lanes, "{f}_t: {names:?}");
        }
        assert!(family("mul_mat"), "{names:?}");
        let shuffles = common::open(common::config()).is_some_and(|b| b.has_subgroup_shuffles());
        assert_eq!(family("mul_mat_s"), lanes && shuffles, "{names:?}");
        assert_eq!(family("mul_mat_s1"), lanes && shuffles, "{names:?}");
    }
}

/// A prompt-sized `SetRows` with two bad indices in different row chunks names the first,
/// writes nothing, and leaves the backend usable.
#[test]
fn a_chunked_set_rows_reports_its_first_bad_row() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let mut ids: Vec<i32> = (0..70).collect();
    ids[61] = -2;
    ids[40] = 90;
    let bad = Case {
        alias: true,
        ..case(
            "kv write",
            Op::SetRows,
            c(DType::F32, &[80, 8]),
            vec![
                c(DType::F32, &[80, 8]),
                c(DType::F32, &[70, 8]),
                ints(&[70], &ids),
            ],
        )
    };
    match run(&vk, &bad) {
        Err(Error::Kernel { msg, node, .. }) => {
            assert_eq!(node, "kv write");
            assert!(msg.contains("indices[40] = 90"), "{msg}");
        }
        other => panic!("expected a kernel error, got {other:?}"),
    }
    common::assert_clean(&vk);
}

#[test]
fn a_bad_index_is_an_error_at_the_next_wait_and_the_backend_stays_usable() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let bad = case(
        "embd",
        Op::GetRows,
        c(DType::F32, &[2, 4]),
        vec![c(DType::F32, &[5, 4]), ints(&[2], &[1, 9])],
    );
    match run(&vk, &bad) {
        Err(Error::Kernel { msg, node, .. }) => {
            assert_eq!(node, "embd");
            assert!(msg.contains("ids[1] = 9"), "{msg}");
        }
        other => panic!("expected a kernel error, got {other:?}"),
    }
    let good = case(
        "embd",
        Op::GetRows,
        c(DType::F32, &[2, 4]),
        vec![c(DType::F32, &[5, 4]), ints(&[2], &[1, 4])],
    );
    assert!(run(&vk, &good).is_ok());
    common::assert_clean(&vk);
}

#[test]
fn bad_shapes_are_errors_before_anything_runs() {
    let Some(vk) = common::open(common::config()) else {
        return;
    };
    let bad = case(
        "mm",
        Op::MulMat,
        c(DType::F32, &[2, 3]),
        vec![c(DType::F32, &[2, 4]), c(DType::F32, &[5, 3])],
    );
    let before = vk.stats().snapshot();
    match run(&vk, &bad) {
        Err(Error::Kernel { op, .. }) => assert_eq!(op, "mul_mat"),
        other => panic!("expected a kernel error, got {other:?}"),
    }
    // Nothing was submitted for the bad graph (only the buffer writes).
    let d = vk.stats().snapshot().since(&before);
    assert_eq!(
        (d.kernel_launches, d.graph_captures, d.graph_launches),
        (0, 0, 0)
    );
    let _ = VulkanBackend::device_name(&vk);
    common::assert_clean(&vk);
}

#[test]
fn an_overlapping_source_is_read_before_the_destination_is_written() {
    let cpu = CpuBackend::new();
    for cfg in common::both_paths() {
        let Some(vk) = common::open(cfg) else { return };
        let vals: Vec<f32> = (0..33).map(|i| i as f32).collect();
        let mut results = Vec::new();
        for b in [&cpu as &dyn Backend, &vk as &dyn Backend] {
            let buf = common::buffer_with(b, &common::f32_bytes(&vals));
            let at = |off: usize| TensorRef {
                buffer: buf,
                byte_offset: off * 4,
                dtype: DType::F32,
                shape: vec![32],
                strides: vec![1],
            };
            // dst = x[1..33] = x[0..32]: a shifted overlap, not an in-place layout.
            let g = Arc::new(ExecGraph::new(vec![ExecNode {
                op: Op::Cpy,
                name: "shift".into(),
                dst: at(1),
                srcs: vec![at(0)],
            }]));
            b.graph_compute_async(&g).unwrap();
            results.push(common::read_f32(b, buf, 33));
        }
        assert_eq!(results[0], results[1]);
        assert_eq!(results[1][32], 31.0);
        common::assert_clean(&vk);
    }
}
