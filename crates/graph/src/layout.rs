//! Shapes and strides in numpy order (row-major, last axis fastest). Strides and offsets are in
//! elements of the tensor's dtype; views share their root's memory.
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
