//! Shapes and strides in numpy order (row-major, last axis fastest). Strides and offsets are in
//! elements of the tensor's dtype; views share their root's memory.

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

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are packed row-major (offset may be non-zero).
    pub fn is_contiguous(&self) -> bool {
        let mut want = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != want {
                return false;
            }
            want *= d;
        }
        true
    }

    /// One past the furthest element reached, relative to the root (0 when empty).
    pub fn extent(&self) -> usize {
        if self.numel() == 0 {
            return self.offset;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }
}

/// Row-major strides of a shape, in elements.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i].max(1);
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
