//! Shared helpers of the CUDA integration tests: the device every device test opens, twin
//! tensors on the CPU oracle and the CUDA backend, a deterministic random source, the NMSE
//! check, and the deadlines of waits (shared with the CPU backend's tests).
//!
//! Tests that need a device are `#[ignore = "needs a CUDA device ..."]`, so a machine without
//! one reports them as ignored (skipped), with that reason, and never as passed; a run that
//! includes them (`--include-ignored`, nextest's `--run-ignored all`) on a machine without a
//! device fails them in [`gpu_with`]. Tests that need no device are not ignored.
#![allow(dead_code)]

#[path = "../../../backend-cpu/tests/common/mod.rs"]
mod deadline;
#[allow(unused_imports)] // each test file uses some of them
pub use deadline::{blocks_until_opened, wait_until, Watched};

use std::sync::Arc;

use half::{bf16, f16};
use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_cpu::CpuBackend;
use lowsync_cuda::{CudaBackend, CudaConfig};
use lowsync_graph::{contiguous_strides, DType, Op};

/// The CUDA backend `cuda:0` with `cfg`, for a test that needs a device (and is ignored
/// unless asked for). Panics, naming `test` and why, when the device cannot be opened.
pub fn gpu_with(test: &str, cfg: CudaConfig) -> Arc<CudaBackend> {
    lowsync_cuda::create_with_config("cuda:0", cfg).unwrap_or_else(|e| {
        panic!(
            "{test} needs a CUDA device, and this machine has none it can open ({e}); device \
             tests run only on a machine with one"
        )
    })
}

/// `cuda:0` with the default settings (elision on).
pub fn gpu(test: &str) -> Arc<CudaBackend> {
    gpu_with(test, CudaConfig::default())
}

/// A deterministic random source (xorshift).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Bytes of `values` stored as `dtype`.
pub fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size_bytes());
    for &v in values {
        match dtype {
            DType::F32 => out.extend(v.to_ne_bytes()),
            DType::F16 => out.extend(f16::from_f32(v).to_bits().to_ne_bytes()),
            DType::BF16 => out.extend(bf16::from_f32(v).to_bits().to_ne_bytes()),
            DType::I32 => out.extend((v as i32).to_ne_bytes()),
            q => panic!("{q}: block dtypes have no element encoding"),
        }
    }
    out
}

/// One element of `dtype` at `bytes[at..]`, widened.
pub fn decode_one(dtype: DType, bytes: &[u8], at: usize) -> f64 {
    let b = &bytes[at..at + dtype.size_bytes()];
    match dtype {
        DType::F32 => f32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::F16 => f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        DType::BF16 => bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        DType::I32 => i32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        q => panic!("{q}: block dtypes have no element decoding"),
    }
}

/// A tensor that exists twice: on the CPU oracle and on the CUDA backend, same layout.
#[derive(Clone, Debug)]
pub struct Twin {
    pub cpu: TensorRef,
    pub gpu: TensorRef,
}

impl Twin {
    /// The same view of both buffers: `shape`/`strides` at `offset` elements past the start.
    pub fn view(&self, shape: &[usize], strides: &[usize], offset: usize) -> Twin {
        let v = |t: &TensorRef| TensorRef {
            buffer: t.buffer,
            byte_offset: t.byte_offset + offset * t.dtype.size_bytes(),
            dtype: t.dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        };
        Twin {
            cpu: v(&self.cpu),
            gpu: v(&self.gpu),
        }
    }

    /// Axes `a` and `b` swapped.
    pub fn transpose(&self, a: usize, b: usize) -> Twin {
        let mut t = self.clone();
        for r in [&mut t.cpu, &mut t.gpu] {
            r.shape.swap(a, b);
            r.strides.swap(a, b);
        }
        t
    }
}

/// The CPU oracle next to a CUDA backend.
pub struct Pair {
    pub cpu: CpuBackend,
    pub gpu: Arc<CudaBackend>,
}

impl Pair {
    /// The oracle next to a new `cuda:0` backend (see [`gpu`]).
    pub fn new(gpu: Arc<CudaBackend>) -> Self {
        Pair {
            cpu: CpuBackend::new(),
            gpu,
        }
    }

    /// A contiguous tensor holding `values` (rounded to `dtype`) on both backends.
    pub fn tensor(&self, dtype: DType, shape: &[usize], values: &[f32]) -> Twin {
        let n: usize = shape.iter().product();
        assert_eq!(values.len(), n, "values for {shape:?}");
        let bytes = encode(dtype, values);
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
                dtype,
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
            }
        };
        Twin {
            cpu: mk(&self.cpu),
            gpu: mk(&*self.gpu),
        }
    }

    /// A contiguous tensor of block dtype `dtype` holding `bytes` (whole rows of blocks) on
    /// both backends.
    pub fn blocks(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Twin {
        let want = lowsync_graph::tensor_bytes(shape, dtype).expect("whole rows of blocks");
        assert_eq!(bytes.len(), want, "{dtype} bytes for {shape:?}");
        let mk = |b: &dyn Backend| -> TensorRef {
            let id = b.alloc_buffer(bytes.len(), BufferUsage::Compute).unwrap();
            b.set_tensor(id, 0, bytes).unwrap();
            TensorRef {
                buffer: id,
                byte_offset: 0,
                dtype,
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
            }
        };
        Twin {
            cpu: mk(&self.cpu),
            gpu: mk(&*self.gpu),
        }
    }

    pub fn rand(&self, rng: &mut Rng, dtype: DType, shape: &[usize]) -> Twin {
        let n = shape.iter().product();
        self.tensor(dtype, shape, &rng.vec(n))
    }

    pub fn ints(&self, shape: &[usize], values: &[i32]) -> Twin {
        let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        self.tensor(DType::I32, shape, &v)
    }

    pub fn zeros(&self, dtype: DType, shape: &[usize]) -> Twin {
        let n = shape.iter().product();
        self.tensor(dtype, shape, &vec![0.0; n])
    }

    /// Runs `op` on both backends; returns the CUDA result (the CPU one must succeed).
    pub fn run(&self, op: Op, dst: &Twin, srcs: &[&Twin]) -> lowsync_backend::Result<()> {
        let node = |d: &TensorRef, s: Vec<TensorRef>| ExecNode {
            op,
            name: "test".into(),
            dst: d.clone(),
            srcs: s,
        };
        let gc = Arc::new(ExecGraph::new(vec![node(
            &dst.cpu,
            srcs.iter().map(|t| t.cpu.clone()).collect(),
        )]));
        self.cpu
            .graph_compute_async(&gc)
            .expect("the CPU oracle runs the case");
        let gg = Arc::new(ExecGraph::new(vec![node(
            &dst.gpu,
            srcs.iter().map(|t| t.gpu.clone()).collect(),
        )]));
        self.gpu.graph_compute_async(&gg)?;
        self.gpu.synchronize()
    }

    /// Elements of `t` (row-major) on each backend: (oracle, CUDA).
    pub fn read(&self, t: &Twin) -> (Vec<f64>, Vec<f64>) {
        (read(&self.cpu, &t.cpu), read(&*self.gpu, &t.gpu))
    }
}

/// Every element of `t` in row-major order, widened to f64.
pub fn read(b: &dyn Backend, t: &TensorRef) -> Vec<f64> {
    let size = b.buffer_size(t.buffer).unwrap();
    let mut bytes = vec![0u8; size];
    b.get_tensor(t.buffer, 0, &mut bytes).unwrap();
    let n = t.numel();
    let esz = t.dtype.size_bytes();
    (0..n)
        .map(|mut i| {
            let mut off = 0;
            for ax in (0..t.shape.len()).rev() {
                off += (i % t.shape[ax]) * t.strides[ax];
                i /= t.shape[ax];
            }
            decode_one(t.dtype, &bytes, t.byte_offset + off * esz)
        })
        .collect()
}

/// `sum((got - want)^2) / sum(want^2)` (plain squared error when `want` is all zeros). NaNs in
/// the same places compare equal; a NaN on one side only is an infinite error.
pub fn nmse(want: &[f64], got: &[f64]) -> f64 {
    assert_eq!(want.len(), got.len());
    let (mut num, mut den) = (0.0, 0.0);
    for (&w, &g) in want.iter().zip(got) {
        if w.is_nan() || g.is_nan() {
            if w.is_nan() != g.is_nan() {
                return f64::INFINITY;
            }
            continue;
        }
        if w.is_infinite() || g.is_infinite() {
            if w != g {
                return f64::INFINITY;
            }
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

/// The NMSE bound of a result dtype (the core issue's: 1e-7 f32, 1e-5 f16, 1e-4 bf16).
pub fn bound(d: DType) -> f64 {
    match d {
        DType::F32 | DType::I32 => 1e-7,
        DType::F16 => 1e-5,
        DType::BF16 => 1e-4,
        q => panic!("{q}: no bound for block dtypes"),
    }
}

/// The float dtypes.
pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Byte offsets of each block type's f16 scale fields (GGUF layouts).
pub fn scale_fields(dt: DType) -> &'static [usize] {
    match dt {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

/// `rows` rows of `k` values of `dt`: random bytes with finite f16 scales (|d| in [2^-7, 2^-3),
/// either sign), so every value is finite.
pub fn quant_blocks(rng: &mut Rng, dt: DType, rows: usize, k: usize) -> Vec<u8> {
    let bb = dt.block_bytes();
    let n = rows * k / dt.block_size();
    let mut b: Vec<u8> = (0..n * bb).map(|_| rng.next_u64() as u8).collect();
    for blk in b.chunks_exact_mut(bb) {
        for &off in scale_fields(dt) {
            let r = rng.next_u64();
            let bits = 0x2000u16 | (r as u16 & 0x0fff) | ((r >> 32) as u16 & 0x8000);
            blk[off..off + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    b
}
