//! Test scaffolding: a tiny [`Mem`] over owned buffers, tensor builders, strided views,
//! a deterministic random source, index helpers for reference code and the NMSE check.

use std::cell::UnsafeCell;
use std::collections::HashMap;

use half::{bf16, f16};
use lowsync_backend::{BufferId, Error, ExecNode, Result, TensorRef};
use lowsync_graph::{contiguous_strides, DType, Op};

use crate::kernels::run_node;
use crate::memory::Mem;

/// Buffers keyed by id, 8-byte aligned, zero-initialised.
#[derive(Default)]
pub(crate) struct TestMem {
    bufs: HashMap<BufferId, Box<[UnsafeCell<u64>]>>,
    /// Block-dtype weights are read-only, as a backend's aliased weights are, so products
    /// over them take the packed path where it runs.
    read_only: Vec<crate::derived::ReadOnlyGuard>,
}

// SAFETY: tests hand a `&TestMem` to rayon pools only to run kernels, which write disjoint
// elements; the host never touches the buffers while a kernel runs.
unsafe impl Sync for TestMem {}

impl Mem for TestMem {
    fn ptr(&self, t: &TensorRef) -> Result<*mut u8> {
        let b = self
            .bufs
            .get(&t.buffer)
            .ok_or_else(|| Error::UnknownBuffer(t.buffer.0, "test".into()))?;
        let (size, len) = (b.len() * 8, t.byte_extent());
        if t.byte_offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfBounds {
                buffer: t.buffer.0,
                offset: t.byte_offset,
                len,
                size,
            });
        }
        // Writing through the pointer is allowed: the storage is `UnsafeCell`.
        Ok(b.as_ptr()
            .cast::<u8>()
            .cast_mut()
            .wrapping_add(t.byte_offset))
    }
}

impl TestMem {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A zeroed buffer of at least `bytes` bytes.
    pub(crate) fn alloc(&mut self, bytes: usize) -> BufferId {
        let id = BufferId::fresh();
        let words = bytes.div_ceil(8).max(1);
        self.bufs
            .insert(id, (0..words).map(|_| UnsafeCell::new(0)).collect());
        id
    }

    fn base(&self, id: BufferId) -> *mut u8 {
        self.bufs[&id].as_ptr().cast::<u8>().cast_mut()
    }

    /// A contiguous zeroed tensor in its own buffer.
    pub(crate) fn zeros(&mut self, dtype: DType, shape: &[usize]) -> TensorRef {
        let n: usize = shape.iter().product();
        let buffer = self.alloc(n * dtype.size_bytes());
        TensorRef {
            buffer,
            byte_offset: 0,
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    }

    /// A contiguous block-dtype tensor of logical `shape` holding the raw blocks `bytes`,
    /// registered as read-only memory (as a backend's aliased weights are).
    pub(crate) fn blocks(&mut self, dtype: DType, shape: &[usize], bytes: &[u8]) -> TensorRef {
        let t = self.blocks_writable(dtype, shape, bytes);
        let base = self.base(t.buffer);
        self.read_only
            .push(crate::derived::register_read_only(base, bytes.len()));
        t
    }

    /// As [`TestMem::blocks`], in memory that is not registered read-only (a weight that
    /// products read in place).
    pub(crate) fn blocks_writable(
        &mut self,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> TensorRef {
        let n: usize = shape.iter().product();
        assert_eq!(
            dtype.checked_bytes(n),
            Some(bytes.len()),
            "{dtype} {shape:?}"
        );
        let buffer = self.alloc(bytes.len());
        // SAFETY: the buffer was just allocated with at least `bytes.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base(buffer), bytes.len());
        }
        TensorRef {
            buffer,
            byte_offset: 0,
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    }

    /// A contiguous float tensor holding `values` (rounded to `dtype`).
    pub(crate) fn tensor(&mut self, dtype: DType, shape: &[usize], values: &[f32]) -> TensorRef {
        let t = self.zeros(dtype, shape);
        assert_eq!(values.len(), t.numel(), "values for {shape:?}");
        for (i, &v) in values.iter().enumerate() {
            self.put(&t, i, v as f64);
        }
        t
    }

    /// A contiguous i32 tensor.
    pub(crate) fn ints(&mut self, shape: &[usize], values: &[i32]) -> TensorRef {
        let t = self.zeros(DType::I32, shape);
        assert_eq!(values.len(), t.numel(), "values for {shape:?}");
        for (i, &v) in values.iter().enumerate() {
            self.put(&t, i, v as f64);
        }
        t
    }

    /// A contiguous tensor of uniform values in [-1, 1).
    pub(crate) fn rand(&mut self, rng: &mut TestRng, dtype: DType, shape: &[usize]) -> TensorRef {
        let n = shape.iter().product();
        let v = rng.vec(n);
        self.tensor(dtype, shape, &v)
    }

    fn addr(&self, t: &TensorRef, i: usize) -> *mut u8 {
        let off = flat_offset(&t.shape, &t.strides, i);
        self.base(t.buffer)
            .wrapping_add(t.byte_offset + off * t.dtype.size_bytes())
    }

    /// Writes element `i` (row-major) of `t`.
    pub(crate) fn put(&mut self, t: &TensorRef, i: usize, v: f64) {
        let p = self.addr(t, i);
        // SAFETY: test tensors lie inside their buffers (checked by `get` users via `Mem::ptr`).
        unsafe {
            match t.dtype {
                DType::F32 => p.cast::<f32>().write_unaligned(v as f32),
                DType::F16 => p.cast::<f16>().write_unaligned(f16::from_f32(v as f32)),
                DType::BF16 => p.cast::<bf16>().write_unaligned(bf16::from_f32(v as f32)),
                DType::I32 => p.cast::<i32>().write_unaligned(v as i32),
                q => panic!("put on a {q} tensor"),
            }
        }
    }

    /// Every element of `t` in row-major order, as f64 (exact for every dtype).
    pub(crate) fn read(&self, t: &TensorRef) -> Vec<f64> {
        self.ptr(t).expect("tensor inside its buffer");
        (0..t.numel())
            .map(|i| {
                let p = self.addr(t, i);
                // SAFETY: checked by `ptr` above.
                unsafe {
                    match t.dtype {
                        DType::F32 => p.cast::<f32>().read_unaligned() as f64,
                        DType::F16 => p.cast::<f16>().read_unaligned().to_f64(),
                        DType::BF16 => p.cast::<bf16>().read_unaligned().to_f64(),
                        DType::I32 => p.cast::<i32>().read_unaligned() as f64,
                        q => panic!("read of a {q} tensor"),
                    }
                }
            })
            .collect()
    }

    /// Every element of an i32 tensor.
    pub(crate) fn read_i32(&self, t: &TensorRef) -> Vec<i32> {
        assert_eq!(t.dtype, DType::I32);
        self.read(t).into_iter().map(|v| v as i32).collect()
    }

    /// The raw bytes of a buffer (for bit-identity checks).
    pub(crate) fn bytes(&self, t: &TensorRef) -> Vec<u8> {
        let n = self.bufs[&t.buffer].len() * 8;
        // SAFETY: the whole buffer, read while no kernel runs.
        unsafe { std::slice::from_raw_parts(self.base(t.buffer), n).to_vec() }
    }
}

/// A view of `t`'s buffer: `shape`/`strides` at `offset` elements past `t`'s start.
pub(crate) fn view(t: &TensorRef, shape: &[usize], strides: &[usize], offset: usize) -> TensorRef {
    TensorRef {
        buffer: t.buffer,
        byte_offset: t.byte_offset + offset * t.dtype.size_bytes(),
        dtype: t.dtype,
        shape: shape.to_vec(),
        strides: strides.to_vec(),
    }
}

/// `t` with axes `a` and `b` swapped.
pub(crate) fn transpose(t: &TensorRef, a: usize, b: usize) -> TensorRef {
    let mut v = t.clone();
    v.shape.swap(a, b);
    v.strides.swap(a, b);
    v
}

/// An exec node called `test`.
pub(crate) fn node(op: Op, dst: &TensorRef, srcs: &[&TensorRef]) -> ExecNode {
    ExecNode {
        op,
        name: "test".into(),
        dst: dst.clone(),
        srcs: srcs.iter().map(|&s| s.clone()).collect(),
    }
}

/// Runs `op` over `srcs` into `dst`.
pub(crate) fn run(mem: &TestMem, op: Op, dst: &TensorRef, srcs: &[&TensorRef]) -> Result<()> {
    run_node(&node(op, dst, srcs), mem)
}

/// The message of a kernel error (panics on other results: tests expect a kernel error).
pub(crate) fn kernel_msg(r: Result<()>) -> String {
    match r {
        Err(Error::Kernel { msg, .. }) => msg,
        other => panic!("expected a kernel error, got {other:?}"),
    }
}

/// Normalised mean squared error `sum((got - want)^2) / sum(want^2)` (plain squared error
/// when `want` is all zeros).
pub(crate) fn nmse(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let err: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    if norm == 0.0 {
        err
    } else {
        err / norm
    }
}

/// The NMSE bound for results computed from inputs of (or rounded to) `dtype`.
pub(crate) fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::I32 => 1e-10,
        DType::F16 => 1e-5,
        DType::BF16 => 1e-4,
        // Dequantized values are exact f32: the products' error is f32 accumulation's.
        _ => 1e-10,
    }
}

/// The bound for a mix of dtypes: the loosest one.
pub(crate) fn tol_of(dtypes: &[DType]) -> f64 {
    dtypes.iter().map(|&d| tol(d)).fold(0.0, f64::max)
}

/// Asserts NMSE within `bound`, and no NaN.
#[track_caller]
pub(crate) fn assert_close(got: &[f64], want: &[f64], bound: f64) {
    assert!(got.iter().all(|v| !v.is_nan()), "NaN in result: {got:?}");
    let e = nmse(got, want);
    assert!(
        e <= bound,
        "nmse {e:e} > {bound:e}\n got {:?}\nwant {:?}",
        &got[..got.len().min(16)],
        &want[..want.len().min(16)]
    );
}

/// Element offset of row-major index `i` under `strides`.
pub(crate) fn flat_offset(shape: &[usize], strides: &[usize], mut i: usize) -> usize {
    let mut off = 0;
    for ax in (0..shape.len()).rev() {
        off += (i % shape[ax]) * strides[ax];
        i /= shape[ax];
    }
    off
}

/// Multi-index of row-major index `i`.
pub(crate) fn unravel(shape: &[usize], mut i: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for ax in (0..shape.len()).rev() {
        idx[ax] = i % shape[ax];
        i /= shape[ax];
    }
    idx
}

/// Row-major index into a contiguous tensor of `shape` that numpy-broadcasts onto `idx`'s
/// shape (right-aligned; size-1 axes pinned to 0).
pub(crate) fn broadcast_index(shape: &[usize], idx: &[usize]) -> usize {
    let lead = idx.len() - shape.len();
    shape.iter().enumerate().fold(0, |acc, (ax, &d)| {
        acc * d + if d == 1 { 0 } else { idx[ax + lead] }
    })
}

/// splitmix64: deterministic test data without extra dependencies.
pub(crate) struct TestRng(u64);

impl TestRng {
    pub(crate) fn new(seed: u64) -> Self {
        TestRng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}
