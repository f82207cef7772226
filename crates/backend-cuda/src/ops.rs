//! Queuing one compute node: validation, resolution to device addresses, kernel launches.
//!
//! Why: the semantics of every op are the CPU oracle's (`lowsync_cpu::kernels`); this module
//! turns each [`ExecNode`] into the launches that reproduce them on the GPU, with the same
//! shape and dtype checks and the same error messages' content, before anything is queued.
//!
//! Strategy: a node's tensors are resolved to device addresses (bounds and alignment checked);
//! a source that overlaps the destination in a way the op does not allow (anything but the
//! in-place first source of an element-wise op, or `SetRows`' target) is first copied to
//! scratch, as the CPU kernels do, so no kernel reads what it already overwrote. Scratch is one
//! stream-ordered allocation, grown (freed and re-allocated on the stream) when a node needs
//! more, and sized once per node before any of its launches. Element-wise kernels take a
//! coalesced [`Lay`]; row kernels one block per row; matmul goes to [`crate::matmul`].
//!
//! Invariant: launches of one node are queued in order on the backend's single stream, so a
//! node reads only what earlier nodes wrote; scratch handed to a node is never freed before
//! the launches that use it ran (frees are stream-ordered).

use std::ffi::c_void;

use lowsync_backend::{Error, ExecNode, Result, TensorRef};
use lowsync_graph::{DType, Op, RopeMode};

use crate::backend::Inner;
use crate::driver::CuDriver;
use crate::kernels::Kernel;
use crate::layout::{broadcast_strides, contiguous, lay, Lay};
use crate::matmul;
use crate::tickets::{LaunchDims, TicketStream};

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
    }
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
    fn last_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    fn last_stride(&self) -> usize {
        self.strides.last().copied().unwrap_or(1)
    }
    /// The view as rows x last axis: (leading shape, leading strides). A scalar is one row.
    fn leading(&self) -> (Vec<usize>, Vec<usize>) {
        let r = self.rank().saturating_sub(1);
        (self.shape[..r].to_vec(), self.strides[..r].to_vec())
    }
    /// `self[.., start..start + len, ..]` along `axis`.
    fn slice_axis(&self, axis: usize, start: usize, len: usize) -> Dev {
        let mut v = self.clone();
        v.shape[axis] = len;
        v.ptr += (start * self.strides[axis] * self.dtype.size_bytes()) as u64;
        v
    }
}

/// The backend's scratch memory: one stream-ordered allocation.
#[derive(Default)]
pub(crate) struct Scratch {
    ptr: u64,
    cap: usize,
    /// Times the block moved (captured graphs hold its address).
    moves: u64,
}

impl Scratch {
    /// At least `need` bytes; growing frees the old block on the stream (after the work that
    /// uses it) and allocates a new one.
    fn ensure(
        &mut self,
        stream: &TicketStream<CuDriver>,
        need: usize,
    ) -> std::result::Result<u64, String> {
        if need <= self.cap && self.ptr != 0 {
            return Ok(self.ptr);
        }
        if stream.is_capturing() {
            // An allocation would be recorded into the graph; the eager run that precedes
            // every capture sizes the block, so this only happens for a graph that cannot be
            // captured — it falls back to eager launches.
            return Err(format!(
                "scratch would grow to {need} bytes during a graph capture"
            ));
        }
        self.moves += 1;
        let new_cap = need.next_power_of_two().max(1 << 20);
        if self.ptr != 0 {
            // SAFETY: allocated by `malloc_async` on this stream; later work gets the new block.
            unsafe { stream.free_async(self.ptr) }.map_err(|e| format!("cuMemFreeAsync: {e:?}"))?;
            self.ptr = 0;
            self.cap = 0;
        }
        // SAFETY: used only by work queued after this call.
        self.ptr = unsafe { stream.malloc_async(new_cap) }
            .map_err(|e| format!("cannot allocate {new_cap} bytes of scratch: {e:?}"))?;
        self.cap = new_cap;
        Ok(self.ptr)
    }

    /// How many times the block moved (a captured graph is stale after a move).
    pub(crate) fn moves(&self) -> u64 {
        self.moves
    }

    /// Frees the block (backend drop).
    pub(crate) fn release(&mut self, stream: &TicketStream<CuDriver>) {
        if self.ptr != 0 {
            // SAFETY: as in `ensure`.
            let _ = unsafe { stream.free_async(self.ptr) };
            self.ptr = 0;
            self.cap = 0;
        }
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

    fn lay(&self, node: &ExecNode, shape: &[usize], strides: &[&[usize]]) -> Result<Lay> {
        lay(shape, strides).ok_or_else(|| {
            kernel_err(
                node,
                format!("shape {shape:?} needs more than 8 axes after merging, which the CUDA kernels do not support"),
            )
        })
    }

    /// Runs one node.
    pub(crate) fn run(&mut self, node: &ExecNode) -> Result<()> {
        let Some(want) = node.op.src_count() else {
            return Err(kernel_err(
                node,
                "has no kernel (leaves and views are not executed)",
            ));
        };
        if !want.contains(&node.srcs.len()) {
            return Err(kernel_err(
                node,
                format!(
                    "expects {}..={} sources, got {}",
                    want.start(),
                    want.end(),
                    node.srcs.len()
                ),
            ));
        }
        let dst = self.resolve(&node.dst)?;
        let mut srcs = node
            .srcs
            .iter()
            .map(|t| self.resolve(t))
            .collect::<Result<Vec<_>>>()?;
        let private: Vec<usize> = (0..node.srcs.len())
            .filter(|&i| node.src_needs_private_copy(i))
            .collect();
        let plan = match node.op {
            Op::MulMat => Some(matmul::plan(
                node,
                &dst,
                &srcs[0],
                &srcs[1],
                self.inner.cfg.mmv_max_m,
            )?),
            _ => None,
        };
        let mut sizes: Vec<usize> = private
            .iter()
            .map(|&i| node.srcs[i].byte_extent())
            .collect();
        if let Some(p) = &plan {
            sizes.extend(p.scratch_sizes());
        }
        let regions = self.scratch(node, &sizes)?;
        for (k, &i) in private.iter().enumerate() {
            let len = node.srcs[i].byte_extent();
            // SAFETY: both ranges are checked device memory of this context (a resolved
            // tensor's extent and a scratch region of that size).
            unsafe { self.inner.stream.memcpy_dtod(regions[k], srcs[i].ptr, len) }
                .map_err(|e| kernel_err(node, format!("private copy failed: {e:?}")))?;
            srcs[i].ptr = regions[k];
        }
        let op_regions = &regions[private.len()..];
        match node.op {
            Op::Add | Op::Mul | Op::SwiGlu | Op::Scale { .. } | Op::Silu | Op::Gelu => {
                self.elementwise(node, &dst, &srcs)
            }
            Op::Cpy => self.cpy(node, &dst, &srcs[0]),
            Op::Concat { axis } => self.concat(node, &dst, &srcs[0], &srcs[1], axis),
            Op::GetRows => self.get_rows(node, &dst, &srcs[0], &srcs[1]),
            Op::SetRows => self.set_rows(node, &dst, &srcs[0], &srcs[1], &srcs[2]),
            Op::RmsNorm { eps } => self.rms_norm(node, &dst, &srcs[0], eps),
            Op::SoftMax { scale } => self.soft_max(node, &dst, &srcs[0], srcs.get(1), scale),
            Op::Rope {
                mode,
                n_dims,
                theta_base,
            } => self.rope(node, &dst, &srcs[0], &srcs[1], mode, n_dims, theta_base),
            Op::Argmax => self.argmax(node, &dst, &srcs[0]),
            Op::MulMat => match plan {
                Some(p) => matmul::run(self, node, &p, &dst, &srcs[0], &srcs[1], op_regions),
                None => Err(kernel_err(node, "no matmul plan")),
            },
            Op::MulMatId => self.mul_mat_id(node, &dst, &srcs[0], &srcs[1], &srcs[2], &srcs[3]),
            Op::Input | Op::Weight | Op::Persistent | Op::View => Err(kernel_err(
                node,
                "has no kernel (leaves and views are not executed)",
            )),
        }
    }

    fn elementwise(&self, node: &ExecNode, dst: &Dev, s: &[Dev]) -> Result<()> {
        float_dst(node, dst)?;
        if let Some(bad) = s.iter().find(|x| !x.dtype.is_float()) {
            return Err(kernel_err(
                node,
                format!("sources must be float tensors, got {}", bad.dtype),
            ));
        }
        let a = &s[0];
        same_shape(node, "first source", a, dst)?;
        let n = dst.numel();
        let (code, binary) = match node.op {
            Op::Scale { .. } => (0, false),
            Op::Silu => (1, false),
            Op::Gelu => (2, false),
            Op::Add => (10, true),
            Op::Mul => (11, true),
            _ => (12, true),
        };
        if !binary {
            let scale = match node.op {
                Op::Scale { scale } => scale,
                _ => 1.0,
            };
            if n == 0 {
                return Ok(());
            }
            let l = self.lay(node, &dst.shape, &[&dst.strides, &a.strides])?;
            let args = Args::new()
                .arg(code)
                .arg(n as i64)
                .arg(l)
                .arg(dst.ptr)
                .arg(dt(dst.dtype))
                .arg(a.ptr)
                .arg(dt(a.dtype))
                .arg(scale);
            return self.launch(node, Kernel::EwUnary, grid_for(n), BLOCK, args);
        }
        let b = &s[1];
        let b_strides = if node.op == Op::SwiGlu {
            same_shape(node, "up", b, dst)?;
            b.strides.clone()
        } else {
            broadcast_strides(&b.shape, &b.strides, &dst.shape).ok_or_else(|| {
                kernel_err(
                    node,
                    format!("cannot broadcast {:?} onto {:?}", b.shape, dst.shape),
                )
            })?
        };
        if n == 0 {
            return Ok(());
        }
        let l = self.lay(node, &dst.shape, &[&dst.strides, &a.strides, &b_strides])?;
        let args = Args::new()
            .arg(code)
            .arg(n as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(a.ptr)
            .arg(dt(a.dtype))
            .arg(b.ptr)
            .arg(dt(b.dtype));
        self.launch(node, Kernel::EwBinary, grid_for(n), BLOCK, args)
    }

    fn cpy(&self, node: &ExecNode, dst: &Dev, src: &Dev) -> Result<()> {
        same_shape(node, "source", src, dst)?;
        check_kinds(node, src.dtype, dst.dtype)?;
        self.copy(node, src, dst)
    }

    fn concat(&self, node: &ExecNode, dst: &Dev, a: &Dev, b: &Dev, axis: usize) -> Result<()> {
        let (sa, sb, sd) = (&a.shape, &b.shape, &dst.shape);
        let ok = sa.len() == sb.len()
            && sd.len() == sa.len()
            && axis < sa.len()
            && (0..sa.len()).all(|i| {
                if i == axis {
                    sd[i] == sa[i] + sb[i]
                } else {
                    sa[i] == sb[i] && sd[i] == sa[i]
                }
            });
        if !ok {
            return Err(kernel_err(
                node,
                format!("cannot concatenate {sa:?} and {sb:?} along axis {axis} into {sd:?}"),
            ));
        }
        check_kinds(node, a.dtype, dst.dtype)?;
        check_kinds(node, b.dtype, dst.dtype)?;
        self.copy(node, a, &dst.slice_axis(axis, 0, sa[axis]))?;
        self.copy(node, b, &dst.slice_axis(axis, sa[axis], sb[axis]))
    }

    fn get_rows(&self, node: &ExecNode, dst: &Dev, table: &Dev, ids: &Dev) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "table", table)?;
        let want: Vec<usize> = ids
            .shape
            .iter()
            .copied()
            .chain(table.shape.get(1).copied())
            .collect();
        if table.rank() != 2 || dst.shape != want {
            return Err(kernel_err(
                node,
                format!(
                    "table {:?} and ids {:?} need a result of shape ids.shape + [d], got {:?}",
                    table.shape, ids.shape, dst.shape
                ),
            ));
        }
        if ids.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("ids must be i32, got {}", ids.dtype),
            ));
        }
        let (n_table, d) = (table.shape[0], table.shape[1]);
        let rows = ids.numel();
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let (_, dst_lead) = dst.leading();
        let l = self.lay(node, &ids.shape, &[&dst_lead, &ids.strides])?;
        let tag = self.tag(node);
        let args = Args::new()
            .arg(rows as i64)
            .arg(d as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.last_stride() as i64)
            .arg(table.ptr)
            .arg(dt(table.dtype))
            .arg(table.strides[0] as i64)
            .arg(table.strides[1] as i64)
            .arg(n_table as i64)
            .arg(ids.ptr)
            .arg(self.inner.err_word.dev())
            .arg(tag);
        self.launch(node, Kernel::GetRows, grid_for(rows * d), BLOCK, args)
    }

    fn set_rows(
        &self,
        node: &ExecNode,
        dst: &Dev,
        target: &Dev,
        src: &Dev,
        idx: &Dev,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "src", src)?;
        let (sd, ss, si) = (&dst.shape, &src.shape, &idx.shape);
        if sd.len() != 2
            || ss.len() != 2
            || ss[1] != sd[1]
            || si[..] != [ss[0]]
            || &target.shape != sd
        {
            return Err(kernel_err(
                node,
                format!(
                    "expects dst [n, d], src [m, d], indices [m]; got {sd:?} (target {:?}), {ss:?}, {si:?}",
                    target.shape
                ),
            ));
        }
        if idx.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("indices must be i32, got {}", idx.dtype),
            ));
        }
        let (n, d, m) = (sd[0], sd[1], ss[0]);
        if m == 0 || d == 0 {
            return Ok(());
        }
        let tag = self.tag(node);
        let args = Args::new()
            .arg(m as i64)
            .arg(d as i64)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.strides[0] as i64)
            .arg(dst.strides[1] as i64)
            .arg(n as i64)
            .arg(src.ptr)
            .arg(dt(src.dtype))
            .arg(src.strides[0] as i64)
            .arg(src.strides[1] as i64)
            .arg(idx.ptr)
            .arg(idx.strides[0] as i64)
            .arg(self.inner.err_word.dev())
            .arg(tag);
        self.launch(
            node,
            Kernel::SetRows,
            rows_grid(m),
            row_block(d.max(m)),
            args,
        )
    }

    fn rms_norm(&self, node: &ExecNode, dst: &Dev, x: &Dev, eps: f32) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "x", x)?;
        same_shape(node, "x", x, dst)?;
        let (len, rows) = (x.last_len(), x.numel() / x.last_len().max(1));
        if len == 0 || rows == 0 {
            return Ok(());
        }
        let ((lead, xs), (_, ds)) = (x.leading(), dst.leading());
        let l = self.lay(node, &lead, &[&ds, &xs])?;
        let args = Args::new()
            .arg(rows as i64)
            .arg(len as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.last_stride() as i64)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.last_stride() as i64)
            .arg(eps);
        self.launch(node, Kernel::RmsNorm, rows_grid(rows), row_block(len), args)
    }

    fn soft_max(
        &self,
        node: &ExecNode,
        dst: &Dev,
        x: &Dev,
        mask: Option<&Dev>,
        scale: f32,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "x", x)?;
        same_shape(node, "x", x, dst)?;
        let mask_strides = match mask {
            None => None,
            Some(m) => {
                float_src(node, "mask", m)?;
                Some(
                    broadcast_strides(&m.shape, &m.strides, &x.shape).ok_or_else(|| {
                        kernel_err(
                            node,
                            format!("mask {:?} does not broadcast onto {:?}", m.shape, x.shape),
                        )
                    })?,
                )
            }
        };
        let (len, rows) = (x.last_len(), x.numel() / x.last_len().max(1));
        if len == 0 || rows == 0 {
            return Ok(());
        }
        let ((lead, xs), (_, ds)) = (x.leading(), dst.leading());
        let r = lead.len();
        let ms: Vec<usize> = mask_strides
            .as_ref()
            .map(|m| m[..r].to_vec())
            .unwrap_or_else(|| vec![0; r]);
        let m_cs = mask_strides
            .as_ref()
            .and_then(|m| m.last().copied())
            .unwrap_or(0);
        let l = self.lay(node, &lead, &[&ds, &xs, &ms])?;
        let args = Args::new()
            .arg(rows as i64)
            .arg(len as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.last_stride() as i64)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.last_stride() as i64)
            .arg(mask.map(|m| m.ptr).unwrap_or(0))
            .arg(mask.map(|m| dt(m.dtype)).unwrap_or(0))
            .arg(m_cs as i64)
            .arg(mask.is_some() as i32)
            .arg(scale);
        self.launch(node, Kernel::SoftMax, rows_grid(rows), row_block(len), args)
    }

    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        node: &ExecNode,
        dst: &Dev,
        x: &Dev,
        pos: &Dev,
        mode: RopeMode,
        n_dims: usize,
        theta_base: f32,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "x", x)?;
        same_shape(node, "x", x, dst)?;
        if x.rank() != 3 || pos.dtype != DType::I32 || pos.shape[..] != [x.shape[0]] {
            return Err(kernel_err(
                node,
                format!(
                    "expects x [T, H, D] and i32 positions [T]; got {:?} and {} {:?}",
                    x.shape, pos.dtype, pos.shape
                ),
            ));
        }
        let (t, h, d) = (x.shape[0], x.shape[1], x.shape[2]);
        if n_dims == 0 || n_dims % 2 == 1 || n_dims > d {
            return Err(kernel_err(
                node,
                format!("n_dims {n_dims} must be even, > 0 and <= head_dim {d}"),
            ));
        }
        let total = t * h * (n_dims / 2 + (d - n_dims));
        if total == 0 {
            return Ok(());
        }
        let args = rope_args(dst, x, pos, mode, n_dims, theta_base);
        self.launch(node, Kernel::Rope, grid_for(total), BLOCK, args)
    }

    fn argmax(&self, node: &ExecNode, dst: &Dev, x: &Dev) -> Result<()> {
        float_src(node, "x", x)?;
        if dst.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("result must be i32, got {}", dst.dtype),
            ));
        }
        let (lead, xs) = x.leading();
        if x.rank() == 0 || dst.shape != lead {
            return Err(kernel_err(
                node,
                format!(
                    "x {:?} needs a result of shape {lead:?}, got {:?}",
                    x.shape, dst.shape
                ),
            ));
        }
        let (len, rows) = (x.last_len(), lead.iter().product::<usize>());
        if rows == 0 {
            return Ok(());
        }
        if len == 0 {
            return Err(kernel_err(
                node,
                format!("argmax of an empty last axis ({:?})", x.shape),
            ));
        }
        // The result is an i32 index, and the kernel's lanes exchange indices as 32-bit words.
        if len > i32::MAX as usize {
            return Err(kernel_err(
                node,
                format!("argmax over {len} values: at most 2^31 - 1 per row"),
            ));
        }
        let l = self.lay(node, &lead, &[&dst.strides, &xs])?;
        let args = Args::new()
            .arg(rows as i64)
            .arg(len as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.last_stride() as i64);
        // A long row (logits over a vocabulary) is one block's work: the widest block the
        // kernel's shared arrays hold keeps each thread's serial part short.
        let block = if len >= 8192 { 1024 } else { 256 };
        self.launch(node, Kernel::Argmax, rows_grid(rows), block, args)
    }

    fn mul_mat_id(
        &self,
        node: &ExecNode,
        dst: &Dev,
        experts: &Dev,
        x: &Dev,
        ids: &Dev,
        w: &Dev,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "experts", experts)?;
        float_src(node, "x", x)?;
        float_src(node, "weights", w)?;
        let (se, sx, si, sw) = (&experts.shape, &x.shape, &ids.shape, &w.shape);
        let ok = se.len() == 3
            && sx.len() == 2
            && sx[1] == se[1]
            && si.len() == 2
            && si[0] == sx[0]
            && sw == si
            && dst.shape[..] == [sx[0], se[2]];
        if !ok {
            return Err(kernel_err(
                node,
                format!(
                    "expects experts [E, k, n], x [T, k], ids [T, K], weights [T, K], result [T, n]; \
                     got {se:?}, {sx:?}, {si:?}, {sw:?}, {:?}",
                    dst.shape
                ),
            ));
        }
        if ids.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("ids must be i32, got {}", ids.dtype),
            ));
        }
        let (n_exp, k, n) = (se[0], se[1], se[2]);
        let (t, slots) = (si[0], si[1]);
        if dst.numel() == 0 {
            return Ok(());
        }
        let tag = self.tag(node);
        let args = Args::new()
            .arg(t as i64)
            .arg(n as i64)
            .arg(k as i64)
            .arg(slots as i64)
            .arg(n_exp as i64)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.strides[0] as i64)
            .arg(dst.strides[1] as i64)
            .arg(experts.ptr)
            .arg(dt(experts.dtype))
            .arg(experts.strides[0] as i64)
            .arg(experts.strides[1] as i64)
            .arg(experts.strides[2] as i64)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.strides[0] as i64)
            .arg(x.strides[1] as i64)
            .arg(ids.ptr)
            .arg(ids.strides[0] as i64)
            .arg(ids.strides[1] as i64)
            .arg(w.ptr)
            .arg(dt(w.dtype))
            .arg(w.strides[0] as i64)
            .arg(w.strides[1] as i64)
            .arg(self.inner.err_word.dev())
            .arg(tag);
        self.launch(node, Kernel::MulMatId, grid_for(t * n), BLOCK, args)
    }
}

/// The leading parameters of the `rope` kernel, which `rope_rows` (fused.cu) shares: shape of x
/// [T, H, D], result r and x with their dtypes and strides, positions, rotated dims, base and
/// mode.
pub(crate) fn rope_args(
    r: &Dev,
    x: &Dev,
    pos: &Dev,
    mode: RopeMode,
    n_dims: usize,
    theta_base: f32,
) -> Args {
    Args::new()
        .arg(x.shape[0] as i64)
        .arg(x.shape[1] as i64)
        .arg(x.shape[2] as i64)
        .arg(r.ptr)
        .arg(dt(r.dtype))
        .arg(r.strides[0] as i64)
        .arg(r.strides[1] as i64)
        .arg(r.strides[2] as i64)
        .arg(x.ptr)
        .arg(dt(x.dtype))
        .arg(x.strides[0] as i64)
        .arg(x.strides[1] as i64)
        .arg(x.strides[2] as i64)
        .arg(pos.ptr)
        .arg(pos.strides[0] as i64)
        .arg(n_dims as i64)
        .arg(theta_base as f64)
        .arg((mode == RopeMode::Neox) as i32)
}

fn same_shape(node: &ExecNode, what: &str, src: &Dev, dst: &Dev) -> Result<()> {
    if src.shape != dst.shape {
        return Err(kernel_err(
            node,
            format!(
                "{what} has shape {:?} but the result has {:?}",
                src.shape, dst.shape
            ),
        ));
    }
    Ok(())
}

pub(crate) fn float_dst(node: &ExecNode, dst: &Dev) -> Result<()> {
    if !dst.dtype.is_float() {
        return Err(kernel_err(
            node,
            format!("result must be a float tensor, got {}", dst.dtype),
        ));
    }
    Ok(())
}

pub(crate) fn float_src(node: &ExecNode, what: &str, s: &Dev) -> Result<()> {
    if !s.dtype.is_float() {
        return Err(kernel_err(
            node,
            format!("{what} must be a float tensor, got {}", s.dtype),
        ));
    }
    Ok(())
}

fn check_kinds(node: &ExecNode, src: DType, dst: DType) -> Result<()> {
    if src.is_float() != dst.is_float() {
        return Err(kernel_err(node, format!("cannot convert {src} to {dst}")));
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

    #[test]
    fn row_blocks_are_powers_of_two_within_a_block() {
        for len in [0, 1, 31, 32, 33, 100, 4096] {
            let b = row_block(len);
            assert!(b.is_power_of_two() && (32..=256).contains(&b));
        }
    }
}
