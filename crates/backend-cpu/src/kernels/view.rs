//! Strided views over raw tensor memory, and the only place kernels touch raw pointers.
//!
//! Why: sources may be any strided view (transposes, slices, broadcasts) in f32, f16, bf16 or
//! i32, and the destination may alias the first source (in-place element-wise ops) or a
//! persistent tensor (`SetRows`). Keeping every pointer dereference behind a small, checked API
//! keeps the kernels themselves safe code.
//!
//! Strategy: a [`Strided`] is a base address plus dtype, shape and element strides whose every
//! in-shape index is valid memory (the invariant, established by [`Strided::resolve`] through
//! the bounds-checked `Mem::ptr`, or by pointing at an owned buffer). Kernels see a tensor as
//! `rows x last axis` and move whole runs of a row at a time, converting to and from f32 with
//! one dtype dispatch per run (contiguous aligned runs use `half`'s vectorised slice
//! conversions). Run accessors check the row and column range against the shape, so a kernel
//! bug cannot read or write out of bounds; they do nothing (and assert in debug builds) on a
//! violation instead of panicking.
//!
//! Aliasing: no reference into tensor memory outlives one run access, so reading a row and
//! then writing the same row (in place) never overlaps a live `&` with a `&mut`.

use std::ops::Range;

use half::{bf16, f16, slice::HalfFloatSliceExt};
use lowsync_backend::{ExecNode, Result, TensorRef};
use lowsync_graph::DType;

use super::kernel_err;
use crate::memory::Mem;

/// A float element type kernels read and write through f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// `dst[i] = src[i] as f32`; equal lengths.
    fn slice_to_f32(src: &[Self], dst: &mut [f32]);
    /// `dst[i] = Self::from(src[i])`; equal lengths.
    fn slice_from_f32(src: &[f32], dst: &mut [Self]);
}

impl Elem for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        v
    }
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl Elem for f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Elem for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// A contiguous run of float elements in their stored type ([`Strided::float_row`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum FloatRow<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl FloatRow<'_> {
    /// The row's first byte and its length in bytes.
    pub(crate) fn byte_span(&self) -> (usize, usize) {
        match self {
            FloatRow::F32(r) => (r.as_ptr() as usize, std::mem::size_of_val(*r)),
            FloatRow::F16(r) => (r.as_ptr() as usize, std::mem::size_of_val(*r)),
            FloatRow::BF16(r) => (r.as_ptr() as usize, std::mem::size_of_val(*r)),
        }
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            FloatRow::F32(s) => s.len(),
            FloatRow::F16(s) => s.len(),
            FloatRow::BF16(s) => s.len(),
        }
    }

    /// The elements as f32 into `out` (equal lengths).
    pub(crate) fn to_f32(self, out: &mut [f32]) {
        match self {
            FloatRow::F32(s) => f32::slice_to_f32(s, out),
            FloatRow::F16(s) => f16::slice_to_f32(s, out),
            FloatRow::BF16(s) => bf16::slice_to_f32(s, out),
        }
    }
}

/// A tensor's memory as seen by a kernel.
///
/// Invariant: for every index `i` inside `shape`, the element at
/// `ptr + sum(i_k * strides[k]) * dtype.size_bytes()` is valid for reads for the duration of
/// the kernel (and for writes when the view is a destination). No alignment is guaranteed.
/// For a block (quantized) dtype, element offsets count elements and a view keeps rows whole
/// (`lowsync_graph::quant_layout_ok`): the block holding element offset `e` starts at byte
/// `(e / block_size) * block_bytes`, and every block reached that way is valid for reads.
#[derive(Clone, Debug)]
pub(crate) struct Strided {
    ptr: *mut u8,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    rows: usize,
}

// SAFETY: a `Strided` is an address plus metadata; kernels only write disjoint elements from
// different threads, and the memory outlives the kernel (see the type invariant).
unsafe impl Send for Strided {}
unsafe impl Sync for Strided {}

impl Strided {
    /// A view at `ptr`.
    ///
    /// # Safety
    /// The type invariant must hold for `ptr`, `shape` and `strides` (same lengths).
    pub(crate) unsafe fn from_raw(
        ptr: *mut u8,
        dtype: DType,
        shape: Vec<usize>,
        strides: Vec<usize>,
    ) -> Self {
        debug_assert_eq!(shape.len(), strides.len());
        let rows = shape[..shape.len().saturating_sub(1)].iter().product();
        Strided {
            ptr,
            dtype,
            shape,
            strides,
            rows,
        }
    }

    /// Resolves a tensor of `node` through the bounds-checked `Mem::ptr`. Empty tensors get a
    /// dangling address (never dereferenced: they have no in-shape index) so that an unusual
    /// offset of a zero-sized tensor is not an error.
    pub(crate) fn resolve(node: &ExecNode, t: &TensorRef, mem: &dyn Mem) -> Result<Self> {
        if t.shape.len() != t.strides.len() {
            return Err(kernel_err(
                node,
                format!("tensor has shape {:?} but strides {:?}", t.shape, t.strides),
            ));
        }
        let ptr = if t.numel() == 0 {
            std::ptr::NonNull::<u64>::dangling().as_ptr().cast()
        } else {
            mem.ptr(t)?
        };
        // SAFETY: `Mem::ptr` checked that every element of `t` lies inside its buffer.
        Ok(unsafe { Strided::from_raw(ptr, t.dtype, t.shape.clone(), t.strides.clone()) })
    }

    /// A contiguous f32 view over an owned buffer of exactly `shape`'s element count.
    pub(crate) fn over_f32(buf: &mut [f32], shape: &[usize]) -> Option<Self> {
        if buf.len() != shape.iter().product::<usize>() {
            return None;
        }
        Strided::over_f32_strided(buf, shape, lowsync_graph::contiguous_strides(shape))
    }

    /// An f32 view with the given strides over an owned buffer; `None` unless every in-shape
    /// index lies inside `buf`.
    pub(crate) fn over_f32_strided(
        buf: &mut [f32],
        shape: &[usize],
        strides: Vec<usize>,
    ) -> Option<Self> {
        if strides.len() != shape.len() {
            return None;
        }
        if shape.iter().all(|&d| d > 0) {
            let last = shape
                .iter()
                .zip(&strides)
                .try_fold(0usize, |acc, (&d, &s)| {
                    acc.checked_add((d - 1).checked_mul(s)?)
                })?;
            if last >= buf.len() {
                return None;
            }
        }
        // SAFETY: checked above that the furthest in-shape element lies inside `buf`.
        Some(unsafe {
            Strided::from_raw(buf.as_mut_ptr().cast(), DType::F32, shape.to_vec(), strides)
        })
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub(crate) fn strides(&self) -> &[usize] {
        &self.strides
    }

    pub(crate) fn rank(&self) -> usize {
        self.shape.len()
    }

    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Length of the last axis (1 for a scalar).
    pub(crate) fn last_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows: the product of every axis but the last (1 for a scalar).
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    fn last_stride(&self) -> usize {
        self.strides.last().copied().unwrap_or(0)
    }

    /// Element offset of row `r` (row-major over all axes but the last).
    pub(crate) fn row_offset(&self, mut r: usize) -> usize {
        let outer = self.shape.len().saturating_sub(1);
        let mut off = 0;
        for ax in (0..outer).rev() {
            let d = self.shape[ax];
            off += (r % d) * self.strides[ax];
            r /= d;
        }
        off
    }

    /// Element offset of the `i`-th element in row-major order.
    pub(crate) fn flat_offset(&self, mut i: usize) -> usize {
        let mut off = 0;
        for ax in (0..self.shape.len()).rev() {
            let d = self.shape[ax];
            off += (i % d) * self.strides[ax];
            i /= d;
        }
        off
    }

    /// Whether the address is aligned for `dtype` (true for the dangling empty address).
    pub(crate) fn is_aligned(&self) -> bool {
        match self.dtype {
            DType::F32 | DType::I32 => self.ptr.cast::<u32>().is_aligned(),
            DType::F16 | DType::BF16 => self.ptr.cast::<u16>().is_aligned(),
            // Blocks are read byte-wise.
            _ => true,
        }
    }

    /// Bytes from the base to element offset `elems` (a block start for block dtypes).
    fn byte_offset_of(&self, elems: usize) -> Option<usize> {
        if self.dtype.is_quantized() {
            self.dtype.checked_bytes(elems)
        } else {
            elems.checked_mul(self.dtype.size_bytes())
        }
    }

    /// The raw blocks of row `i` along `axis` of a 2-D block-dtype view whose other axis is
    /// its block axis (stride 1, whole rows): `table[i, :]` of a `get_rows` table (`axis`
    /// 0), or column `i` of a transposed weight `w.T` (`axis` 1). `None` for any other view.
    pub(crate) fn quant_row(&self, axis: usize, i: usize) -> Option<&[u8]> {
        if !self.dtype.is_quantized() || self.rank() != 2 || axis > 1 || i >= self.shape[axis] {
            return None;
        }
        let other = 1 - axis;
        if self.strides[other] != 1 {
            return None;
        }
        let off = self.byte_offset_of(i.checked_mul(self.strides[axis])?)?;
        let len = self.dtype.row_bytes(self.shape[other])?;
        // SAFETY: row `i` is in shape and its elements are contiguous along the block axis,
        // starting at a block boundary (whole rows, type invariant); its `len` bytes of blocks
        // are valid reads for the kernel's duration, and nothing writes weights meanwhile.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) })
    }

    /// Rows `first..first + n` along `axis` of a 2-D block-dtype view (as [`Strided::quant_row`])
    /// as one slice, when they lie back to back in memory (a weight's rows usually do); `None`
    /// otherwise.
    pub(crate) fn quant_rows(&self, axis: usize, first: usize, n: usize) -> Option<&[u8]> {
        let start = self.quant_row(axis, first)?;
        let last = self.quant_row(axis, first.checked_add(n)?.checked_sub(1)?)?;
        let len = start.len().checked_mul(n)?;
        let packed = n == 1 || self.byte_offset_of(self.strides[axis])? == start.len();
        if !packed || last.as_ptr() != start.as_ptr().wrapping_add(len - start.len()) {
            return None;
        }
        // SAFETY: rows `first` and `first + n - 1` are valid reads of `start.len()` bytes each
        // (`quant_row`), and the rows between lie back to back from `start` to the end of the
        // last one (checked above), all within the view.
        Some(unsafe { std::slice::from_raw_parts(start.as_ptr(), len) })
    }

    /// Row `i` along `axis` of a 2-D aligned float view whose other axis has stride 1, as one
    /// slice of its stored type: a weight row `W[j, :]` seen through `W.T` (`axis` 1), or a
    /// key or value row of a KV cache. `None` for any other view.
    pub(crate) fn float_row(&self, axis: usize, i: usize) -> Option<FloatRow<'_>> {
        if !self.dtype.is_float() || self.rank() != 2 || axis > 1 || i >= self.shape[axis] {
            return None;
        }
        let other = 1 - axis;
        let len = self.shape[other];
        if (self.strides[other] != 1 && len > 1) || !self.is_aligned() {
            return None;
        }
        let off = i.checked_mul(self.strides[axis])?;
        // SAFETY: row `i` is in shape and its `len` elements are contiguous (stride 1) from
        // element offset `off` (type invariant); the base is aligned for the dtype, so is every
        // element. Sources are not written while a kernel reads them (private copies).
        unsafe {
            let p = self.ptr.add(off * self.dtype.size_bytes());
            Some(match self.dtype {
                DType::F32 => FloatRow::F32(std::slice::from_raw_parts(p.cast(), len)),
                DType::F16 => FloatRow::F16(std::slice::from_raw_parts(p.cast(), len)),
                _ => FloatRow::BF16(std::slice::from_raw_parts(p.cast(), len)),
            })
        }
    }

    /// Whether the elements are packed row-major.
    pub(crate) fn is_contiguous(&self) -> bool {
        let mut want = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != want {
                return false;
            }
            want *= d;
        }
        true
    }

    /// Every element of a packed row-major, aligned f32 view, as one slice; `None` otherwise.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // used by x86 bodies only
    pub(crate) fn f32_slice(&self) -> Option<&[f32]> {
        let p = self.f32_base()?;
        if !self.is_contiguous() {
            return None;
        }
        // SAFETY: the view's `numel` elements are packed from its aligned base (checked
        // above), all within the resolved buffer (type invariant). Sources are not written
        // while a kernel reads them (private copies).
        Some(unsafe { std::slice::from_raw_parts(p, self.numel()) })
    }

    /// The address of element `[0, .., 0]` as f32, when the view is f32 and aligned.
    pub(crate) fn f32_base(&self) -> Option<*mut f32> {
        (self.dtype == DType::F32 && self.is_aligned()).then_some(self.ptr.cast())
    }

    /// numpy broadcast of this view onto `shape` (stride 0 on broadcast axes); `None` when the
    /// shapes are incompatible.
    pub(crate) fn broadcast_to(&self, shape: &[usize]) -> Option<Self> {
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
        // SAFETY: every in-shape index maps to an in-shape index of `self` (broadcast axes to 0).
        Some(unsafe { Strided::from_raw(self.ptr, self.dtype, shape.to_vec(), strides) })
    }

    /// `self[.., start..start + len, ..]` along `axis`; `None` when out of range.
    pub(crate) fn slice_axis(&self, axis: usize, start: usize, len: usize) -> Option<Self> {
        let d = *self.shape.get(axis)?;
        if start.checked_add(len)? > d {
            return None;
        }
        let mut shape = self.shape.clone();
        shape[axis] = len;
        // An empty slice may start one past the end: keep the address computation wrapping.
        let ptr = self
            .ptr
            .wrapping_add(self.byte_offset_of(start * self.strides[axis])?);
        // SAFETY: indices of the slice are indices of `self` shifted by `start` along `axis`.
        Some(unsafe { Strided::from_raw(ptr, self.dtype, shape, self.strides.clone()) })
    }

    /// `self[.., i, ..]` with `axis` removed; `None` when out of range.
    pub(crate) fn index_axis(&self, axis: usize, i: usize) -> Option<Self> {
        let s = self.slice_axis(axis, i, 1)?;
        let (mut shape, mut strides) = (s.shape, s.strides);
        shape.remove(axis);
        strides.remove(axis);
        // SAFETY: the removed axis had length 1.
        Some(unsafe { Strided::from_raw(s.ptr, s.dtype, shape, strides) })
    }

    /// The view with its axes reordered: result axis `i` is axis `perm[i]`.
    pub(crate) fn permuted(&self, perm: &[usize]) -> Option<Self> {
        if perm.len() != self.rank() || perm.iter().any(|&p| p >= self.rank()) {
            return None;
        }
        let shape = perm.iter().map(|&p| self.shape[p]).collect();
        let strides = perm.iter().map(|&p| self.strides[p]).collect();
        // SAFETY: a permutation of the axes reaches the same elements (duplicates would only
        // revisit them; callers pass permutations).
        Some(unsafe { Strided::from_raw(self.ptr, self.dtype, shape, strides) })
    }

    /// The same elements viewed with another shape and strides, after `check` confirmed that
    /// the new layout only reaches elements the old one did. Used by [`coalesce`].
    ///
    /// # Safety
    /// Every in-shape index of the new layout must address an element of `self`.
    unsafe fn relayout(&self, shape: Vec<usize>, strides: Vec<usize>) -> Self {
        Strided::from_raw(self.ptr, self.dtype, shape, strides)
    }

    /// Copies the bytes this view reaches into a private buffer and returns a view of the copy
    /// with the same strides, so that writes to the original memory no longer affect it.
    pub(crate) fn detach(&self) -> (Vec<u64>, Strided) {
        let extent = if self.numel() == 0 {
            0
        } else {
            let elems = self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
                + 1;
            // Resolved views reach whole blocks (type invariant), so this is `Some`.
            self.byte_offset_of(elems).unwrap_or(0)
        };
        let mut buf = vec![0u64; extent.div_ceil(8)];
        let dst: *mut u8 = buf.as_mut_ptr().cast();
        if extent > 0 {
            // SAFETY: the view reaches exactly `extent` bytes from its base (type invariant),
            // and `buf` holds at least as many; the two cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst, extent) };
        }
        // SAFETY: same strides over a buffer covering the same extent.
        let view =
            unsafe { Strided::from_raw(dst, self.dtype, self.shape.clone(), self.strides.clone()) };
        (buf, view)
    }

    /// Checks a run `r, cols` against the shape and returns its starting offset and stride.
    fn run(&self, r: usize, cols: &Range<usize>, len: usize) -> Option<(usize, usize)> {
        let ok = r < self.rows
            && cols.start <= cols.end
            && cols.end <= self.last_len()
            && len == cols.len();
        debug_assert!(ok, "run {r} {cols:?} (len {len}) outside {:?}", self.shape);
        ok.then(|| {
            let stride = self.last_stride();
            (self.row_offset(r) + cols.start * stride, stride)
        })
    }

    /// Reads elements `cols` of row `r` as f32 into `out` (a float view).
    pub(crate) fn read_row(&self, r: usize, cols: Range<usize>, out: &mut [f32]) {
        let Some((off, stride)) = self.run(r, &cols, out.len()) else {
            return;
        };
        if out.is_empty() {
            return;
        }
        // SAFETY: `run` checked that the run lies inside the shape.
        unsafe {
            match self.dtype {
                DType::F32 => read_run::<f32>(self.ptr, off, stride, out),
                DType::F16 => read_run::<f16>(self.ptr, off, stride, out),
                DType::BF16 => read_run::<bf16>(self.ptr, off, stride, out),
                _ => debug_assert!(false, "read_row on a {} view", self.dtype),
            }
        }
    }

    /// Writes `src` converted to the view's float dtype into elements `cols` of row `r`.
    /// Only for destination views.
    pub(crate) fn write_row(&self, r: usize, cols: Range<usize>, src: &[f32]) {
        let Some((off, stride)) = self.run(r, &cols, src.len()) else {
            return;
        };
        if src.is_empty() {
            return;
        }
        // SAFETY: `run` checked that the run lies inside the shape; destinations are writable.
        unsafe {
            match self.dtype {
                DType::F32 => write_run::<f32>(self.ptr, off, stride, src),
                DType::F16 => write_run::<f16>(self.ptr, off, stride, src),
                DType::BF16 => write_run::<bf16>(self.ptr, off, stride, src),
                _ => debug_assert!(false, "write_row on a {} view", self.dtype),
            }
        }
    }

    /// Every element of an i32 view, in row-major order.
    pub(crate) fn read_all_i32(&self) -> Vec<i32> {
        if self.dtype != DType::I32 {
            debug_assert!(false, "read_all_i32 on a {} view", self.dtype);
            return Vec::new();
        }
        let p: *const i32 = self.ptr.cast();
        (0..self.numel())
            // SAFETY: `flat_offset` of an in-range flat index is an in-shape element.
            .map(|i| unsafe { p.wrapping_add(self.flat_offset(i)).read_unaligned() })
            .collect()
    }

    /// Writes `v` at the `i`-th element (row-major) of an i32 destination view.
    pub(crate) fn write_i32(&self, i: usize, v: i32) {
        let ok = self.dtype == DType::I32 && i < self.numel();
        debug_assert!(ok, "write_i32 {i} on {} {:?}", self.dtype, self.shape);
        if ok {
            // SAFETY: in-range flat index of a writable i32 view.
            unsafe {
                self.ptr
                    .cast::<i32>()
                    .wrapping_add(self.flat_offset(i))
                    .write_unaligned(v)
            };
        }
    }

    /// Copies elements `cols` of row `r` of `src` into row `dr` of `self` without conversion
    /// (equal dtypes; any dtype, i32 included). Only for destination views.
    pub(crate) fn copy_row_raw(&self, dr: usize, src: &Strided, sr: usize, cols: Range<usize>) {
        if self.dtype != src.dtype || self.dtype.is_quantized() {
            debug_assert!(
                false,
                "copy_row_raw between {} and {}",
                src.dtype, self.dtype
            );
            return;
        }
        let n = cols.len();
        let (Some((doff, dstride)), Some((soff, sstride))) =
            (self.run(dr, &cols, n), src.run(sr, &cols, n))
        else {
            return;
        };
        let size = self.dtype.size_bytes();
        // SAFETY: both runs were checked against their shapes. `ptr::copy` tolerates overlap
        // (a destination that aliases its source with the same layout).
        unsafe {
            let (d, s) = (
                self.ptr.wrapping_add(doff * size),
                src.ptr.wrapping_add(soff * size),
            );
            if dstride == 1 && sstride == 1 {
                std::ptr::copy(s, d, n * size);
            } else {
                for i in 0..n {
                    std::ptr::copy(
                        s.wrapping_add(i * sstride * size),
                        d.wrapping_add(i * dstride * size),
                        size,
                    );
                }
            }
        }
    }
}

/// # Safety
/// Elements `off + i * stride` for `i < out.len()` are valid reads of `T` at `base`.
unsafe fn read_run<T: Elem>(base: *mut u8, off: usize, stride: usize, out: &mut [f32]) {
    let p: *const T = base.cast::<T>().wrapping_add(off);
    if stride == 0 {
        out.fill(p.read_unaligned().to_f32());
    } else if stride == 1 && p.is_aligned() {
        T::slice_to_f32(std::slice::from_raw_parts(p, out.len()), out);
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            *o = p.wrapping_add(i * stride).read_unaligned().to_f32();
        }
    }
}

/// # Safety
/// Elements `off + i * stride` for `i < src.len()` are valid writes of `T` at `base`, and no
/// reference to them is live.
unsafe fn write_run<T: Elem>(base: *mut u8, off: usize, stride: usize, src: &[f32]) {
    let p: *mut T = base.cast::<T>().wrapping_add(off);
    if stride == 1 && p.is_aligned() {
        T::slice_from_f32(src, std::slice::from_raw_parts_mut(p, src.len()));
    } else {
        // A zero stride (never produced for destinations) would just write one element.
        for (i, &v) in src.iter().enumerate() {
            p.wrapping_add(i * stride).write_unaligned(T::from_f32(v));
        }
    }
}

/// Views of equal shape re-described with as few axes as possible: size-1 axes dropped and
/// neighbouring axes merged where every view is contiguous across them. Row-wise loops over
/// the result then run over long unit-stride rows. An empty shape gives `[0]`, a single
/// element `[1]`.
pub(crate) fn coalesce(views: &[&Strided]) -> Vec<Strided> {
    let Some(first) = views.first() else {
        return Vec::new();
    };
    let shape = first.shape.clone();
    debug_assert!(views.iter().all(|v| v.shape == shape));
    let mut out_shape: Vec<usize> = Vec::new();
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::new(); views.len()];
    if shape.contains(&0) {
        out_shape.push(0);
        out_strides.iter_mut().for_each(|s| s.push(1));
    } else {
        for (ax, &d) in shape.iter().enumerate() {
            if d == 1 {
                continue;
            }
            let mergeable = !out_shape.is_empty()
                && views
                    .iter()
                    .zip(&out_strides)
                    .all(|(v, s)| s.last() == Some(&(v.strides[ax] * d)));
            if mergeable {
                if let Some(last) = out_shape.last_mut() {
                    *last *= d;
                }
                for (v, s) in views.iter().zip(out_strides.iter_mut()) {
                    if let Some(last) = s.last_mut() {
                        *last = v.strides[ax];
                    }
                }
            } else {
                out_shape.push(d);
                for (v, s) in views.iter().zip(out_strides.iter_mut()) {
                    s.push(v.strides[ax]);
                }
            }
        }
        if out_shape.is_empty() {
            out_shape.push(1);
            out_strides.iter_mut().for_each(|s| s.push(0));
        }
    }
    views
        .iter()
        .zip(out_strides)
        // SAFETY: merging axes (a, b) with stride_a == stride_b * len_b and dropping size-1
        // axes addresses exactly the elements of the original layout.
        .map(|(v, s)| unsafe { v.relayout(out_shape.clone(), s) })
        .collect()
}
