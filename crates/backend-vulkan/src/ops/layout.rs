//! What every kernel planner shares: tensors resolved to device memory, their bindings, the
//! element offsets and strides that go in push constants, and the checks that keep them in
//! range.
//!
//! Why: kernels index memory with 32-bit element offsets and strides and trust them, so the
//! one place that turns a tensor into a binding is also the one place that proves the binding
//! covers every element a kernel can reach.
//!
//! Strategy: a tensor is bound as exactly the bytes it spans (start aligned down to the
//! device's storage offset alignment, end up to a 4-byte word); what is left of its offset goes
//! in push constants as an element offset. Views are coalesced (size-1 axes dropped, contiguous
//! neighbours merged) and left-padded to the rank a kernel takes.
//!
//! Invariants: a binding never exceeds its buffer or `maxStorageBufferRange`; every number put
//! in push constants fits in 32 bits or the node is refused with `Error::Kernel`.

use ash::vk;
use lowsync_backend::{Error, ExecNode, Result};
use lowsync_graph::DType;

use crate::config::{QuantMatMul, QuantMatVec, SplitK};
use crate::pipelines::{Bind, Push};

/// A tensor resolved to device memory.
#[derive(Clone, Debug)]
pub(crate) struct Res {
    pub buffer: vk::Buffer,
    /// Size of the `VkBuffer`.
    pub buffer_size: u64,
    /// Byte offset of element `[0, .., 0]`.
    pub base: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl Res {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes from `base` to one past the furthest element (0 when empty); whole blocks for a
    /// block dtype (whose views keep rows whole, so the extent is a whole number of blocks).
    pub(crate) fn byte_extent(&self) -> u64 {
        if self.numel() == 0 {
            return 0;
        }
        let last: usize = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (d - 1) * s)
            .sum();
        if self.dtype.is_quantized() {
            // `exec::resolve` checked the same extent with `TensorRef::byte_extent`.
            return self
                .dtype
                .checked_bytes(last + 1)
                .map_or(u64::MAX, |b| b as u64);
        }
        ((last + 1) * self.dtype.size_bytes()) as u64
    }

    pub(super) fn rank(&self) -> usize {
        self.shape.len()
    }

    /// `self[.., start..start + len, ..]` along `axis`.
    pub(super) fn slice_axis(&self, axis: usize, start: usize, len: usize) -> Res {
        let mut r = self.clone();
        r.base += (start * self.strides[axis] * self.dtype.size_bytes()) as u64;
        r.shape[axis] = len;
        r
    }

    /// The view broadcast (numpy rules) to `shape`; `None` when it does not broadcast.
    pub(super) fn broadcast_to(&self, shape: &[usize]) -> Option<Vec<usize>> {
        if shape.len() < self.rank() {
            return None;
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for (ax, &want) in shape.iter().enumerate().skip(lead) {
            let (d, s) = (self.shape[ax - lead], self.strides[ax - lead]);
            strides[ax] = if d == want {
                s
            } else if d == 1 {
                0
            } else {
                return None;
            };
        }
        Some(strides)
    }
}

/// One dispatch to record.
#[derive(Clone, Debug)]
pub(crate) struct Dispatch {
    /// Kernel variant name (`kernel.slot_dtype...`, as `build.rs` names it).
    pub kernel: String,
    pub binds: Vec<Bind>,
    pub push: Push,
    pub groups: [u32; 3],
}

/// What a planner needs to know about the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// `minStorageBufferOffsetAlignment` (a power of two).
    pub offset_align: u64,
    pub max_range: u64,
    pub max_groups: [u32; 3],
    pub has_f64: bool,
    /// Kernels may use subgroup arithmetic (the device has it and the config allows it).
    pub subgroups: bool,
    /// Besides, shuffles in whole subgroups of 4 to 64 lanes (`mul_mat_q_s`).
    pub shuffles: bool,
    /// Workgroups of 256 invocations along x are allowed (Vulkan guarantees only 128).
    pub wide_groups: bool,
    /// The body of the one-row block mat-vec (`LOWSYNC_VK_QV`).
    pub qv: QuantMatVec,
    /// The integer-dot products (`mul_mat_vec_qd*`) can run: the integer dot product feature,
    /// subgroup shuffles and room for their workgroup memory.
    pub idot: bool,
    /// Q4_K and Q6_K take the integer-dot products too: only where `idot` was asked for by
    /// name (`LOWSYNC_VK_QV=idot`), as they have not been timed on a GPU yet; the device's
    /// default `idot` covers Q4_0, Q4_1 and Q8_0.
    pub idot_k: bool,
    /// Rows of w per workgroup of the integer-dot products (`LOWSYNC_VK_QD_ROWS`); `None`:
    /// from the product's rows.
    pub qd_rows: Option<u32>,
    /// The layout of the prefill product over block weights (`LOWSYNC_VK_QMM`).
    pub qmm: QuantMatMul,
    /// Outputs per invocation along each side of the tiled products (`LOWSYNC_VK_TILE`: 4 or 8).
    pub tile: u32,
    /// Whether the tiled products split k (`LOWSYNC_VK_SPLIT_K`), into the partials buffer
    /// (`split_parts`, present whenever the setting is not `Off`).
    pub split_k: SplitK,
    pub split_parts: Option<Bind>,
    /// The device's multiprocessors (0: unknown).
    pub sm_count: u32,
    /// SoftMax takes one invocation per row (`LOWSYNC_VK_ROW_LANES`).
    pub row_lanes: bool,
    /// The prefill products run on cooperative matrices (`LOWSYNC_VK_COOPMAT`, device support).
    pub coopmat: bool,
}

/// An index-checking kernel's error slot: the status binding and the tag naming this node.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Status {
    pub bind: Bind,
    pub tag: u32,
}

pub(crate) fn kernel_err(node: &ExecNode, msg: impl Into<String>) -> Error {
    node.kernel_error(msg)
}

pub(super) fn dt(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I32 => "i32",
        // Block dtypes: `q4_0`, ... (the ones `build.rs` compiles kernels for).
        q => q.name(),
    }
}

pub(super) struct Ctx<'a> {
    pub node: &'a ExecNode,
    pub lim: Limits,
}

impl Ctx<'_> {
    pub(super) fn err(&self, msg: impl Into<String>) -> Error {
        kernel_err(self.node, msg)
    }

    pub(super) fn u32(&self, v: usize, what: &str) -> Result<u32> {
        u32::try_from(v).map_err(|_| self.err(format!("{what} {v} does not fit in 32 bits")))
    }

    pub(super) fn u4(&self, v: &[usize], what: &str) -> Result<[u32; 4]> {
        let mut out = [0u32; 4];
        for (o, &x) in out.iter_mut().zip(v) {
            *o = self.u32(x, what)?;
        }
        Ok(out)
    }

    /// Binds `r` and returns the binding and the element offset of `[0, .., 0]` inside it (the
    /// byte offset for a block dtype, whose elements have no size of their own).
    pub(super) fn bind(&self, r: &Res, write: bool) -> Result<(Bind, u32)> {
        let esize = if r.dtype.is_quantized() {
            1
        } else {
            r.dtype.size_bytes() as u64
        };
        if !r.base.is_multiple_of(esize) {
            return Err(self.err(format!(
                "a {} tensor at byte offset {} is not aligned to its element size",
                r.dtype, r.base
            )));
        }
        let end = r.base.saturating_add(r.byte_extent().max(esize));
        if end > r.buffer_size {
            return Err(self.err(format!(
                "tensor of {} bytes at offset {} lies outside its buffer of {} bytes",
                r.byte_extent(),
                r.base,
                r.buffer_size
            )));
        }
        let start = r.base & !(self.lim.offset_align - 1);
        let end = ((end + 3) & !3).min(r.buffer_size);
        let range = end - start;
        if range > self.lim.max_range {
            return Err(self.err(format!(
                "tensor spans {range} bytes, above this device's maxStorageBufferRange of {}",
                self.lim.max_range
            )));
        }
        let off = self.u32(((r.base - start) / esize) as usize, "element offset")?;
        Ok((
            Bind {
                buffer: r.buffer,
                offset: start,
                range,
                write,
            },
            off,
        ))
    }

    /// Workgroups for `threads` threads in groups of `wg`, spread over x and y.
    pub(super) fn spread(&self, threads: usize, wg: usize) -> Result<[u32; 3]> {
        let groups = threads.div_ceil(wg).max(1);
        let max_x = self.lim.max_groups[0].max(1) as usize;
        let x = groups.min(max_x);
        let y = groups.div_ceil(x);
        if y > self.lim.max_groups[1] as usize {
            return Err(self.err(format!("{threads} threads exceed the dispatch limits")));
        }
        Ok([x as u32, y as u32, 1])
    }

    /// Bytes of `elems` elements of block dtype `d` (a whole number of blocks), as a 32-bit
    /// kernel offset or stride.
    pub(super) fn block_bytes(&self, d: DType, elems: usize, what: &str) -> Result<u32> {
        let b = d.checked_bytes(elems).ok_or_else(|| {
            self.err(format!(
                "{what} of {elems} elements does not step by whole {d} blocks"
            ))
        })?;
        self.u32(b, what)
    }

    pub(super) fn float(&self, what: &str, d: DType) -> Result<()> {
        if !d.is_float() {
            return Err(self.err(format!("{what} must be a float tensor, got {d}")));
        }
        Ok(())
    }

    pub(super) fn same_shape(&self, what: &str, a: &Res, d: &Res) -> Result<()> {
        if a.shape != d.shape {
            return Err(self.err(format!(
                "{what} has shape {:?} but the result has {:?}",
                a.shape, d.shape
            )));
        }
        Ok(())
    }
}

/// Drops size-1 axes and merges neighbours that are contiguous in every view.
pub(super) fn coalesce(shape: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let keep: Vec<usize> = (0..shape.len()).filter(|&i| shape[i] != 1).collect();
    let mut sh: Vec<usize> = Vec::new();
    let mut st: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    for &ax in &keep {
        let merge = !sh.is_empty()
            && strides
                .iter()
                .enumerate()
                .all(|(t, s)| st[t].last().copied() == Some(s[ax] * shape[ax]));
        if merge {
            let last = sh.len() - 1;
            sh[last] *= shape[ax];
            for (t, s) in strides.iter().enumerate() {
                let l = st[t].len() - 1;
                st[t][l] = s[ax];
            }
        } else {
            sh.push(shape[ax]);
            for (t, s) in strides.iter().enumerate() {
                st[t].push(s[ax]);
            }
        }
    }
    (sh, st)
}

/// Left-pads to rank `n` (shape 1, stride 0); `None` when the rank is above `n`.
pub(super) fn pad(
    shape: &[usize],
    strides: &[Vec<usize>],
    n: usize,
) -> Option<(Vec<usize>, Vec<Vec<usize>>)> {
    if shape.len() > n {
        return None;
    }
    let k = n - shape.len();
    let sh = std::iter::repeat_n(1, k)
        .chain(shape.iter().copied())
        .collect();
    let st = strides
        .iter()
        .map(|s| std::iter::repeat_n(0, k).chain(s.iter().copied()).collect())
        .collect();
    Some((sh, st))
}

/// Rows of a view (all axes but the last) coalesced to at most three, for several views.
pub(super) fn rows3(
    c: &Ctx,
    lead: &[usize],
    strides: &[Vec<usize>],
) -> Result<([u32; 4], Vec<[u32; 4]>)> {
    let (sh, st) = coalesce(lead, strides);
    let (sh, st) = pad(&sh, &st, 3).ok_or_else(|| {
        c.err(format!(
            "leading axes {lead:?} do not reduce to 3 dimensions"
        ))
    })?;
    let shape = c.u4(&sh, "extent")?;
    let st = st
        .iter()
        .map(|s| c.u4(s, "stride"))
        .collect::<Result<Vec<_>>>()?;
    Ok((shape, st))
}

pub(super) fn need_status(c: &Ctx, status: Option<Status>) -> Result<Status> {
    status.ok_or_else(|| c.err("index-checking kernel planned without a status slot"))
}
