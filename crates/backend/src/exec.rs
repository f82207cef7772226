//! What a backend executes: compute nodes with every tensor resolved to a buffer and offset.

use lowsync_graph::{DType, Op};
use std::sync::atomic::{AtomicU64, Ordering};

/// A buffer owned by one backend. Ids are unique across all backends of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

impl BufferId {
    /// A fresh process-unique id.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        BufferId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A tensor resolved to memory: element `[0, .., 0]` sits at `byte_offset` of `buffer`, and the
/// element at index `i` at `byte_offset + sum(i_k * strides[k]) * dtype.size_bytes()`. For a
/// block (quantized) dtype, offsets count elements of whole rows and the block holding element
/// offset `e` starts at `byte_offset + dtype.checked_bytes(e)` (`lowsync_graph::DType`).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRef {
    pub buffer: BufferId,
    pub byte_offset: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Strides in elements.
    pub strides: Vec<usize>,
}

impl TensorRef {
    /// Number of elements (saturating at `usize::MAX`).
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// Bytes from `byte_offset` to one past the furthest element (0 when empty); `None` when
    /// that overflows.
    pub fn checked_byte_extent(&self) -> Option<usize> {
        if self.numel() == 0 {
            return Some(0);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(0usize, |acc, (&d, &s)| {
                acc.checked_add((d - 1).checked_mul(s)?)
            })?
            .checked_add(1)
            // Whole blocks for a block dtype (`None`, failing every bounds check, otherwise).
            .and_then(|e| self.dtype.checked_bytes(e))
    }

    /// [`TensorRef::checked_byte_extent`], saturating at `usize::MAX`: a layout whose extent
    /// overflows then fails every bounds check instead of wrapping to a small size that passes.
    pub fn byte_extent(&self) -> usize {
        self.checked_byte_extent().unwrap_or(usize::MAX)
    }

    /// Whether the elements are packed row-major.
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
}

/// One kernel to run.
#[derive(Clone, Debug)]
pub struct ExecNode {
    pub op: Op,
    /// A name for error messages (the tensor's name, or `op#index`).
    pub name: String,
    pub dst: TensorRef,
    pub srcs: Vec<TensorRef>,
}

impl ExecNode {
    /// An [`Error::Kernel`](crate::Error::Kernel) naming this node and its op.
    pub fn kernel_error(&self, msg: impl Into<String>) -> crate::Error {
        crate::Error::Kernel {
            op: self.op.name(),
            node: self.name.clone(),
            msg: msg.into(),
        }
    }

    /// Whether source `i` shares bytes with the destination in a way a kernel must not see, so
    /// it has to be read from a private copy: every overlap except `SetRows`' aliased target
    /// and an element-wise op's in-place first source with exactly the destination's layout.
    /// One rule for every backend, so they all agree with the CPU oracle.
    pub fn src_needs_private_copy(&self, i: usize) -> bool {
        let (dst, src) = (&self.dst, &self.srcs[i]);
        if i == 0 && self.op == lowsync_graph::Op::SetRows {
            return false;
        }
        let (a, b) = (src.byte_extent(), dst.byte_extent());
        let overlap = src.buffer == dst.buffer
            && a > 0
            && b > 0
            && src.byte_offset < dst.byte_offset + b
            && dst.byte_offset < src.byte_offset + a;
        overlap && !(i == 0 && self.op.can_inplace() && src == dst)
    }
}

/// The compute nodes of one split, in execution order (views removed: they run no kernel).
#[derive(Clone, Debug, Default)]
pub struct ExecGraph {
    pub nodes: Vec<ExecNode>,
    /// What of the scheduler's scratch memory is read after this graph, where the scheduler
    /// knows it (`None`: every byte the graph writes may be read later). A backend may skip
    /// writing results nothing reads (the CUDA fusion pass does).
    pub scratch: Option<ScratchLive>,
}

impl ExecGraph {
    /// A graph of `nodes` with nothing known of what is read after it.
    pub fn new(nodes: Vec<ExecNode>) -> Self {
        ExecGraph {
            nodes,
            scratch: None,
        }
    }
}

/// A scratch buffer of a split's backend and the byte ranges `[start, end)` of it that later
/// splits read after the split's graph. Every other byte of `buffer` is dead once the graph
/// has run: the next write to it comes before any read (inputs, outputs, weights and state
/// live in other buffers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScratchLive {
    pub buffer: BufferId,
    pub kept: Vec<(usize, usize)>,
}

impl ScratchLive {
    /// Whether bytes `[start, end)` of `buffer` may be read after the graph.
    pub fn read_after(&self, buffer: BufferId, start: usize, end: usize) -> bool {
        buffer != self.buffer || self.kept.iter().any(|&(a, b)| start < b && a < end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tref(shape: Vec<usize>, strides: Vec<usize>) -> TensorRef {
        TensorRef {
            buffer: BufferId(1),
            byte_offset: 0,
            dtype: DType::F32,
            shape,
            strides,
        }
    }

    #[test]
    fn byte_extent_of_a_transposed_quantized_weight_is_its_blocks() {
        let mut t = tref(vec![64, 3], vec![1, 64]);
        t.dtype = DType::Q4_0;
        assert_eq!(t.byte_extent(), 3 * 2 * 18);
        // A layout that ends inside a block has no byte size.
        let mut cut = tref(vec![48], vec![1]);
        cut.dtype = DType::Q4_0;
        assert_eq!(cut.checked_byte_extent(), None);
    }

    #[test]
    fn byte_extent_saturates_instead_of_wrapping() {
        assert_eq!(tref(vec![2, 3], vec![3, 1]).byte_extent(), 24);
        assert_eq!(tref(vec![0, 3], vec![3, 1]).byte_extent(), 0);
        // Unchecked, ((2^63) * 2 + 1 + 1) * 4 wraps to 8 bytes and passes a bounds check.
        let wraps = tref(vec![(1 << 63) + 1, 2], vec![2, 1]);
        assert_eq!(wraps.checked_byte_extent(), None);
        assert_eq!(wraps.byte_extent(), usize::MAX);
        assert_eq!(wraps.numel(), usize::MAX);
    }
}
