//! Iteration layouts handed to kernels, and the host-side shape helpers.
//!
//! Why: kernels accept any strided view (transposes, slices, broadcasts) in any float dtype.
//! Rather than one kernel per layout, each launch gets a [`Lay`]: one iteration shape and the
//! element strides of up to three tensors over it, which a thread turns into offsets.
//!
//! Strategy: size-1 axes are dropped and neighbouring axes merged wherever every tensor is
//! contiguous across them (the same coalescing the CPU kernels do), so typical launches iterate
//! one or two axes. Broadcast axes carry stride 0.
//!
//! Invariant: `Lay` matches `struct Lay` in `kernels/common.cuh` field for field.

/// Axes a kernel can iterate after coalescing.
pub(crate) const MAXD: usize = 8;

/// The layout passed to kernels by value (`#[repr(C)]`, mirrors the CUDA struct).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Lay {
    pub nd: i64,
    pub shape: [i64; MAXD],
    pub st: [[i64; MAXD]; 3],
}

/// Coalesces `shape` with the element strides of up to three tensors over it. `None` when the
/// shape needs more than [`MAXD`] axes even after merging. An empty or scalar shape gives one
/// axis (of length 0 or 1).
pub(crate) fn lay(shape: &[usize], strides: &[&[usize]]) -> Option<Lay> {
    debug_assert!(strides.len() <= 3 && strides.iter().all(|s| s.len() == shape.len()));
    let mut out_shape: Vec<usize> = Vec::new();
    let mut out_st: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    if shape.contains(&0) {
        out_shape.push(0);
        out_st.iter_mut().for_each(|s| s.push(1));
    } else {
        for (ax, &d) in shape.iter().enumerate() {
            if d == 1 {
                continue;
            }
            let mergeable = !out_shape.is_empty()
                && strides
                    .iter()
                    .zip(&out_st)
                    .all(|(s, o)| o.last() == Some(&(s[ax] * d)));
            if mergeable {
                if let Some(l) = out_shape.last_mut() {
                    *l *= d;
                }
                for (s, o) in strides.iter().zip(out_st.iter_mut()) {
                    if let Some(l) = o.last_mut() {
                        *l = s[ax];
                    }
                }
            } else {
                out_shape.push(d);
                for (s, o) in strides.iter().zip(out_st.iter_mut()) {
                    o.push(s[ax]);
                }
            }
        }
        if out_shape.is_empty() {
            out_shape.push(1);
            out_st.iter_mut().for_each(|s| s.push(0));
        }
    }
    if out_shape.len() > MAXD {
        return None;
    }
    let mut l = Lay {
        nd: out_shape.len() as i64,
        ..Lay::default()
    };
    for (i, &d) in out_shape.iter().enumerate() {
        l.shape[i] = d as i64;
        for (t, o) in out_st.iter().enumerate() {
            l.st[t][i] = o[i] as i64;
        }
    }
    Some(l)
}

/// Strides of `shape`/`strides` broadcast (numpy rules, aligned right) onto `target`, with 0
/// on broadcast axes; `None` when incompatible.
pub(crate) fn broadcast_strides(
    shape: &[usize],
    strides: &[usize],
    target: &[usize],
) -> Option<Vec<usize>> {
    if shape.len() > target.len() {
        return None;
    }
    let lead = target.len() - shape.len();
    let mut out = vec![0; target.len()];
    for (ax, &want) in target.iter().enumerate().skip(lead) {
        let (d, s) = (shape[ax - lead], strides[ax - lead]);
        out[ax] = if d == want {
            s
        } else if d == 1 {
            0
        } else {
            return None;
        };
    }
    Some(out)
}

/// Row-major strides of a shape.
pub(crate) fn contiguous(shape: &[usize]) -> Vec<usize> {
    lowsync_graph::contiguous_strides(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_tensors_coalesce_to_one_axis() {
        let l = lay(&[2, 3, 4], &[&[12, 4, 1], &[12, 4, 1]]).unwrap();
        assert_eq!(l.nd, 1);
        assert_eq!(l.shape[0], 24);
        assert_eq!((l.st[0][0], l.st[1][0]), (1, 1));
    }

    #[test]
    fn transposes_and_broadcasts_keep_their_axes() {
        // dst [2, 3] contiguous, src a transposed [3, 2] view, b a broadcast row.
        let l = lay(&[2, 3], &[&[3, 1], &[1, 2], &[0, 1]]).unwrap();
        assert_eq!(l.nd, 2);
        assert_eq!(&l.shape[..2], &[2, 3]);
        assert_eq!(&l.st[1][..2], &[1, 2]);
        assert_eq!(&l.st[2][..2], &[0, 1]);
    }

    #[test]
    fn size_one_axes_are_dropped_and_scalars_get_one_axis() {
        let l = lay(&[1, 5, 1], &[&[99, 1, 7]]).unwrap();
        assert_eq!((l.nd, l.shape[0], l.st[0][0]), (1, 5, 1));
        let s = lay(&[], &[&[]]).unwrap();
        assert_eq!((s.nd, s.shape[0]), (1, 1));
        let e = lay(&[3, 0], &[&[1, 1]]).unwrap();
        assert_eq!((e.nd, e.shape[0]), (1, 0));
    }

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(
            broadcast_strides(&[4], &[1], &[2, 3, 4]),
            Some(vec![0, 0, 1])
        );
        assert_eq!(
            broadcast_strides(&[3, 1], &[1, 1], &[3, 5]),
            Some(vec![1, 0])
        );
        assert_eq!(broadcast_strides(&[2], &[1], &[3]), None);
    }

    /// Against `struct Lay` of common.cuh (the kernels' source, not a restatement of the Rust
    /// struct): the same fields in order, size and bound.
    #[test]
    fn lay_matches_the_cuda_struct() {
        use crate::abi::{c_define, c_struct, debug_fields};
        let src = include_str!("../kernels/common.cuh");
        assert_eq!(c_define(src, "MAXD"), MAXD);
        let c = c_struct(src, "Lay");
        assert_eq!(c.names(), debug_fields(&format!("{:?}", Lay::default())));
        assert_eq!(
            (c.size, c.align),
            (std::mem::size_of::<Lay>(), std::mem::align_of::<Lay>())
        );
    }
}
