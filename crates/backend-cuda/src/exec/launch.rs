//! The launch context of one node: kernel arguments, resolution to device addresses, scratch
//! regions, and the launch itself.
//!
//! Why: every way of running a node — one op (`ops`), a matmul (`matmul`), a fused group
//! (`fusion`) — builds kernel arguments, resolves tensors to checked device addresses and queues
//! kernels on the backend's one stream; [`Exec`] is the one place that does it, so the checks
//! and the launch options (programmatic dependent launch, error tags) are the same for all.
//!
//! Strategy: [`Args`] keeps each argument in its own 8-byte aligned box (stable addresses for
//! the driver); [`Exec::resolve`] checks bounds and alignment through the buffer table;
//! scratch is one stream-ordered block (`memory::Scratch`), sized once per node before any of
//! its launches.
//!
//! Invariant: launches are queued in order on the backend's single stream, so a node reads only
//! what earlier nodes wrote; scratch handed to a node is never freed before the launches that
//! use it ran (frees are stream-ordered).

use std::ffi::c_void;

use lowsync_backend::{Error, ExecNode, Result, TensorRef};
use lowsync_graph::DType;

use crate::device::Inner;
use crate::kernels::Kernel;
use crate::layout::{contiguous, lay, Lay};
use crate::memory::Scratch;
use crate::tickets::LaunchDims;

/// Kernel arguments with stable addresses (each in its own 8-byte aligned box).
#[derive(Default)]
pub(crate) struct Args(Vec<Box<[u64]>>);

impl Args {
    pub(crate) fn new() -> Self {
        Args::default()
    }

    /// Appends one argument; its Rust type must match the kernel's parameter type exactly.
    pub(crate) fn arg<T: Copy>(mut self, v: T) -> Self {
        let words = std::mem::size_of::<T>().div_ceil(8).max(1);
        let mut b = vec![0u64; words].into_boxed_slice();
        // SAFETY: the box holds at least size_of::<T>() bytes, 8-byte aligned.
        unsafe { std::ptr::write(b.as_mut_ptr().cast::<T>(), v) };
        self.0.push(b);
        self
    }

    fn ptrs(&mut self) -> Vec<*mut c_void> {
        self.0.iter_mut().map(|b| b.as_mut_ptr().cast()).collect()
    }
}

/// The dtype code of `common.cuh`.
pub(crate) fn dt(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::I32 => 3,
        // Block dtypes reach only the `quant` module's kernels, which take `qt`'s codes.
        _ => -1,
    }
}

/// The block-type code of `kernels/quant.cuh` (`DT_Q4_0` ...), or `None` for a plain dtype.
pub(crate) fn qt(d: DType) -> Option<i32> {
    Some(match d {
        DType::Q4_0 => 4,
        DType::Q4_1 => 5,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q2_K => 9,
        DType::Q3_K => 10,
        DType::Q4_K => 11,
        DType::Q5_K => 12,
        DType::Q6_K => 13,
        DType::IQ4_NL => 14,
        DType::IQ4_XS => 15,
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 => return None,
    })
}

/// Bytes spanned by an element stride of a block dtype (a row stride: whole blocks), or
/// `None` when the stride does not land on a block start.
pub(crate) fn quant_row_bytes(d: DType, stride: usize) -> Option<usize> {
    stride
        .is_multiple_of(d.block_size())
        .then(|| stride / d.block_size() * d.block_bytes())
}

/// A tensor resolved to device memory.
#[derive(Clone, Debug)]
pub(crate) struct Dev {
    pub ptr: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl Dev {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub(crate) fn rank(&self) -> usize {
        self.shape.len()
    }
    pub(crate) fn last_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    pub(crate) fn last_stride(&self) -> usize {
        self.strides.last().copied().unwrap_or(1)
    }
    /// The view as rows x last axis: (leading shape, leading strides). A scalar is one row.
    pub(crate) fn leading(&self) -> (Vec<usize>, Vec<usize>) {
        let r = self.rank().saturating_sub(1);
        (self.shape[..r].to_vec(), self.strides[..r].to_vec())
    }
    /// `self[.., start..start + len, ..]` along `axis`.
    pub(crate) fn slice_axis(&self, axis: usize, start: usize, len: usize) -> Dev {
        let mut v = self.clone();
        v.shape[axis] = len;
        v.ptr += (start * self.strides[axis] * self.dtype.size_bytes()) as u64;
        v
    }
}

/// Queues nodes on one backend.
pub(crate) struct Exec<'a> {
    pub(crate) inner: &'a Inner,
    scratch: &'a mut Scratch,
}

/// An [`Error::Kernel`] for `node`.
pub(crate) fn kernel_err(node: &ExecNode, msg: impl Into<String>) -> Error {
    node.kernel_error(msg)
}

pub(crate) const BLOCK: u32 = 256;

pub(crate) fn grid_for(n: usize) -> u32 {
    n.div_ceil(BLOCK as usize).clamp(1, 1 << 16) as u32
}

pub(crate) fn rows_grid(rows: usize) -> u32 {
    rows.clamp(1, 65_535) as u32
}

/// Threads per block of a row kernel: a power of two from 32 to 256 covering `len`.
pub(crate) fn row_block(len: usize) -> u32 {
    (len.next_power_of_two()).clamp(32, 256) as u32
}

impl<'a> Exec<'a> {
    pub(crate) fn new(inner: &'a Inner, scratch: &'a mut Scratch) -> Self {
        Exec { inner, scratch }
    }

    /// Whether a kernel may read `t` before its `griddepcontrol.wait` (programmatic dependent
    /// launch is on and `t` lies in a weights buffer no kernel writes).
    pub(crate) fn read_ahead(&self, t: &TensorRef) -> bool {
        self.inner.pdl && self.inner.bufs.is_weights(t.buffer)
    }

    /// Whether kernels that can rehearse do (see `CudaConfig::rehearse`): only when they are
    /// launched ahead of their producer, so that the rehearsal runs while it finishes.
    pub(crate) fn rehearse(&self) -> bool {
        self.inner.pdl && self.inner.cfg.rehearse
    }

    pub(crate) fn resolve(&self, t: &TensorRef) -> Result<Dev> {
        if t.shape.len() != t.strides.len() {
            return Err(Error::Unsupported {
                backend: self.inner.name.clone(),
                what: format!(
                    "a tensor with shape {:?} and strides {:?}",
                    t.shape, t.strides
                ),
            });
        }
        Ok(Dev {
            ptr: self.inner.bufs.tensor(t)?,
            dtype: t.dtype,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
        })
    }

    /// Scratch regions of the given sizes (256-byte aligned), carved from one block.
    pub(crate) fn scratch(&mut self, node: &ExecNode, sizes: &[usize]) -> Result<Vec<u64>> {
        let aligned: Vec<usize> = sizes.iter().map(|s| s.next_multiple_of(256)).collect();
        let total: usize = aligned.iter().sum();
        if total == 0 {
            return Ok(vec![0; sizes.len()]);
        }
        let base = self
            .scratch
            .ensure(&self.inner.stream, total)
            .map_err(|m| kernel_err(node, m))?;
        let mut off = 0u64;
        Ok(aligned
            .iter()
            .map(|s| {
                let p = base + off;
                off += *s as u64;
                p
            })
            .collect())
    }

    /// Queues one kernel.
    pub(crate) fn launch(
        &self,
        node: &ExecNode,
        k: Kernel,
        grid: u32,
        block: u32,
        args: Args,
    ) -> Result<()> {
        self.launch_shared(node, k, grid, block, 0, args)
    }

    /// Queues one kernel with `shared_bytes` of dynamic shared memory (at most 48 KB, the
    /// limit without an opt-in).
    pub(crate) fn launch_shared(
        &self,
        node: &ExecNode,
        k: Kernel,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        mut args: Args,
    ) -> Result<()> {
        let f = self.inner.modules.get(k).map_err(|m| kernel_err(node, m))?;
        let dims = LaunchDims {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_bytes,
            pdl: self.inner.pdl,
        };
        let mut ptrs = args.ptrs();
        // SAFETY: `args` matches the kernel's parameter list (each op builds it against the
        // signature in kernels/*.cu) and every address in it was resolved and bounds checked.
        unsafe { self.inner.stream.launch(f, dims, &mut ptrs) }
            .map_err(|e| kernel_err(node, format!("launch failed: {e:?}")))?;
        Ok(())
    }

    pub(crate) fn tag(&self, node: &ExecNode) -> u32 {
        self.inner.err_tags.lock().tag(node.op.name(), &node.name)
    }

    /// `dst = src` (equal shapes), converting floats; used by Cpy, Concat and matmul.
    pub(crate) fn copy(&self, node: &ExecNode, src: &Dev, dst: &Dev) -> Result<()> {
        let n = dst.numel();
        if n == 0 {
            return Ok(());
        }
        let l = self.lay(node, &dst.shape, &[&dst.strides, &src.strides])?;
        let args = Args::new()
            .arg(n as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(src.ptr)
            .arg(dt(src.dtype));
        self.launch(node, Kernel::CopyStrided, grid_for(n), BLOCK, args)
    }

    /// Writes `value` over every element of `dst`.
    pub(crate) fn fill(&self, node: &ExecNode, dst: &Dev, value: f32) -> Result<()> {
        let n = dst.numel();
        if n == 0 {
            return Ok(());
        }
        let l = self.lay(node, &dst.shape, &[&dst.strides])?;
        let args = Args::new()
            .arg(n as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(value);
        self.launch(node, Kernel::Fill, grid_for(n), BLOCK, args)
    }

    pub(crate) fn lay(
        &self,
        node: &ExecNode,
        shape: &[usize],
        strides: &[&[usize]],
    ) -> Result<Lay> {
        lay(shape, strides).ok_or_else(|| {
            kernel_err(
                node,
                format!("shape {shape:?} needs more than 8 axes after merging, which the CUDA kernels do not support"),
            )
        })
    }
}

/// An error unless the result `dst` is a float tensor.
pub(crate) fn float_dst(node: &ExecNode, dst: &Dev) -> Result<()> {
    if !dst.dtype.is_float() {
        return Err(kernel_err(
            node,
            format!("result must be a float tensor, got {}", dst.dtype),
        ));
    }
    Ok(())
}

/// An error unless source `s` (`what`) is a float tensor.
pub(crate) fn float_src(node: &ExecNode, what: &str, s: &Dev) -> Result<()> {
    if !s.dtype.is_float() {
        return Err(kernel_err(
            node,
            format!("{what} must be a float tensor, got {}", s.dtype),
        ));
    }
    Ok(())
}

/// A contiguous view of `shape` at `ptr`.
pub(crate) fn packed(ptr: u64, dtype: DType, shape: &[usize]) -> Dev {
    Dev {
        ptr,
        dtype,
        shape: shape.to_vec(),
        strides: contiguous(shape),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_keep_each_value_at_a_stable_aligned_address() {
        let mut a = Args::new()
            .arg(3i32)
            .arg(7i64)
            .arg(1.5f32)
            .arg(Lay::default());
        let p = a.ptrs();
        assert_eq!(p.len(), 4);
        // SAFETY: reading back what was written, with the written types.
        unsafe {
            assert_eq!(*(p[0] as *const i32), 3);
            assert_eq!(*(p[1] as *const i64), 7);
            assert_eq!(*(p[2] as *const f32), 1.5);
        }
        assert!(p.iter().all(|q| (*q as usize).is_multiple_of(8)));
    }

    /// Against the `#define DT_...` codes of quant.cuh (the kernels' source) and the block bytes
    /// its `q_block_bytes` returns.
    #[test]
    fn block_type_codes_match_quant_cuh() {
        use crate::abi::c_define;
        let src = include_str!("../../kernels/quant.cuh");
        let blocks = DType::ALL.iter().filter(|d| d.is_quantized());
        for &d in blocks {
            let name = format!("DT_{}", format!("{d:?}").to_uppercase());
            let code = qt(d).unwrap_or_else(|| panic!("{d} has a code"));
            assert_eq!(c_define(src, &name) as i32, code, "{name}");
            let bytes = format!("case {name}: return {};", d.block_bytes());
            assert!(src.contains(&bytes), "quant.cuh: `{bytes}`");
        }
        assert_eq!(qt(DType::F16), None);
    }

    #[test]
    fn row_blocks_are_powers_of_two_within_a_block() {
        for len in [0, 1, 31, 32, 33, 100, 4096] {
            let b = row_block(len);
            assert!(b.is_power_of_two() && (32..=256).contains(&b));
        }
    }
}
