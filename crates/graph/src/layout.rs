//! Shapes and strides in numpy order (row-major, last axis fastest). Strides and offsets are in
//! elements of the tensor's dtype; views share their root's memory.
//!
//! Block (quantized) dtypes: strides and offsets still count elements, and every layout the
//! builder admits for them keeps rows whole ([`quant_layout_ok`]): element offset `e` of a
//! block start is byte `e / block_size * block_bytes` ([`crate::DType::checked_bytes`]).
//!
//! Size arithmetic: the graph builder admits a shape only when [`shape_bytes`] accepts it (its
//! bytes, and its strides, fit in `isize::MAX`, the most any allocation can hold). Every
//! product and sum below is then in range for admitted layouts, and is written checked or
//! saturating anyway where a caller could pass a layout the builder did not make.

/// Shape, strides (elements) and offset (elements from the start of the root tensor).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
}

impl Layout {
    /// A contiguous row-major layout at offset 0.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// Number of elements (saturating: `usize::MAX` for a shape no builder admits).
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// Whether the elements are packed row-major (offset may be non-zero).
    pub fn is_contiguous(&self) -> bool {
        let mut want = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != want {
                return false;
            }
            want = want.saturating_mul(d);
        }
        true
    }

    /// One past the furthest element reached, relative to the root (`offset` when empty);
    /// `None` when that overflows.
    pub fn checked_extent(&self) -> Option<usize> {
        if self.numel() == 0 {
            return Some(self.offset);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |acc, (&d, &s)| {
                acc.checked_add((d - 1).checked_mul(s)?)
            })?
            .checked_add(1)
    }

    /// [`Layout::checked_extent`], saturating at `usize::MAX` (so any bounds check against a
    /// real buffer fails).
    pub fn extent(&self) -> usize {
        self.checked_extent().unwrap_or(usize::MAX)
    }
}

/// Bytes of a contiguous tensor of `shape` with `elem_bytes`-byte elements, when the shape is
/// addressable: the product of its dims, each counted as at least 1 (what its row-major
/// strides reach), times the element size fits in `isize::MAX`. `None` otherwise — the
/// builder refuses such a shape instead of letting a size wrap around.
pub fn shape_bytes(shape: &[usize], elem_bytes: usize) -> Option<usize> {
    let reach = shape
        .iter()
        .try_fold(elem_bytes, |acc, &d| acc.checked_mul(d.max(1)))?;
    if reach > isize::MAX as usize {
        return None;
    }
    // Not larger than `reach`, so in range too.
    Some(shape.iter().product::<usize>() * elem_bytes)
}

/// Bytes of a contiguous tensor of `shape` and `dtype` when it is addressable: for a plain
/// dtype [`shape_bytes`]; for a block dtype the last axis must be a positive whole number of
/// blocks, and both the bytes and the element strides (which count elements, more than the
/// bytes) must fit in `isize::MAX`. `None` otherwise.
pub fn tensor_bytes(shape: &[usize], dtype: crate::DType) -> Option<usize> {
    if !dtype.is_quantized() {
        return shape_bytes(shape, dtype.size_bytes());
    }
    let (&k, lead) = shape.split_last()?;
    if k == 0 {
        return None;
    }
    let row = dtype.row_bytes(k)?;
    // Element strides reach this far; a byte count alone would admit strides that wrap.
    shape_bytes(shape, 1)?;
    let reach = lead
        .iter()
        .try_fold(row, |acc, &d| acc.checked_mul(d.max(1)))?;
    if reach > isize::MAX as usize {
        return None;
    }
    Some(lead.iter().product::<usize>() * row)
}

/// Whether `layout` is a valid view of a block-dtype root whose rows hold `row_len` elements:
/// its offset starts a row, one axis (the block axis) has stride 1 and the row's full length,
/// and every other axis of length > 1 steps by whole rows. Such a view reaches only whole rows,
/// so its bytes are whole blocks; a view that would split a block (a slice of the row axis, a
/// reshape that cuts rows) fails this.
pub fn quant_layout_ok(layout: &Layout, row_len: usize) -> bool {
    if row_len == 0
        || !layout.offset.is_multiple_of(row_len)
        || layout.shape.len() != layout.strides.len()
    {
        return false;
    }
    let mut block_axis = false;
    for (&d, &s) in layout.shape.iter().zip(&layout.strides) {
        if s == 1 && d == row_len && !block_axis {
            block_axis = true;
        } else if d > 1 && !s.is_multiple_of(row_len) {
            return false;
        }
    }
    block_axis
}

/// The block axis of a valid block-dtype view (see [`quant_layout_ok`]): the axis with stride
/// 1 and length `row_len`.
pub fn quant_block_axis(layout: &Layout, row_len: usize) -> Option<usize> {
    layout
        .shape
        .iter()
        .zip(&layout.strides)
        .position(|(&d, &s)| s == 1 && d == row_len)
}

/// Row-major strides of a shape, in elements (saturating for a shape [`shape_bytes`] refuses).
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
    strides
}

/// numpy broadcasting of two shapes; `None` when incompatible.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_bytes_refuses_what_wraps_or_exceeds_isize() {
        assert_eq!(shape_bytes(&[2, 3], 4), Some(24));
        assert_eq!(shape_bytes(&[], 4), Some(4));
        assert_eq!(shape_bytes(&[5, 0], 4), Some(0));
        // 2^31 * 2^31 * 4 = 2^64 bytes wraps to 0 when unchecked.
        assert_eq!(shape_bytes(&[1 << 31, 1 << 31], 4), None);
        // (2^63 + 1) * 2 elements wraps to 2 elements when unchecked.
        assert_eq!(shape_bytes(&[(1 << 63) + 1, 2], 4), None);
        // Empty, but its strides would overflow.
        assert_eq!(shape_bytes(&[1 << 40, 0, 1 << 40], 4), None);
        assert_eq!(
            shape_bytes(&[isize::MAX as usize / 4], 4),
            Some(isize::MAX as usize / 4 * 4)
        );
        assert_eq!(shape_bytes(&[isize::MAX as usize / 4 + 1], 4), None);
    }

    #[test]
    fn tensor_bytes_counts_whole_blocks_and_refuses_split_rows() {
        use crate::DType;
        assert_eq!(tensor_bytes(&[3, 64], DType::Q4_0), Some(3 * 2 * 18));
        assert_eq!(tensor_bytes(&[3, 48], DType::Q4_0), None);
        assert_eq!(tensor_bytes(&[3, 0], DType::Q4_0), None);
        assert_eq!(tensor_bytes(&[], DType::Q4_0), None);
        assert_eq!(tensor_bytes(&[0, 256], DType::Q6_K), Some(0));
        assert_eq!(tensor_bytes(&[2, 3], DType::F32), Some(24));
        // Bytes fit but element strides do not.
        assert_eq!(tensor_bytes(&[1 << 58, 1 << 8], DType::Q6_K), None);
        assert_eq!(tensor_bytes(&[1 << 60, 32], DType::Q8_0), None);
    }

    #[test]
    fn quant_layouts_keep_rows_whole() {
        let w = Layout::contiguous(&[4, 64]);
        assert!(quant_layout_ok(&w, 64));
        let t = Layout {
            shape: vec![64, 4],
            strides: vec![1, 64],
            offset: 0,
        };
        assert!(quant_layout_ok(&t, 64));
        assert_eq!(quant_block_axis(&t, 64), Some(0));
        let rows = Layout {
            shape: vec![2, 64],
            strides: vec![64, 1],
            offset: 128,
        };
        assert!(quant_layout_ok(&rows, 64));
        let half_row = Layout {
            shape: vec![4, 32],
            strides: vec![64, 1],
            offset: 0,
        };
        assert!(!quant_layout_ok(&half_row, 64));
        let cut = Layout::contiguous(&[8, 32]);
        assert!(!quant_layout_ok(&cut, 64));
        let mid = Layout {
            shape: vec![1, 64],
            strides: vec![64, 1],
            offset: 32,
        };
        assert!(!quant_layout_ok(&mid, 64));
    }

    #[test]
    fn extent_saturates_instead_of_wrapping() {
        let l = Layout {
            shape: vec![(1 << 63) + 1, 2],
            strides: vec![2, 1],
            offset: 0,
        };
        assert_eq!(l.checked_extent(), None);
        assert_eq!(l.extent(), usize::MAX);
        assert_eq!(l.numel(), usize::MAX);
        assert_eq!(Layout::contiguous(&[3, 4]).checked_extent(), Some(12));
    }
}
