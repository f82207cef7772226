//! When and how kernels use threads.
//!
//! Why: a decode step runs hundreds of tiny ops, where a rayon fork/join costs more than the
//! work; prefill-sized tensors want every core. Results must also be bit-identical whatever
//! the thread count.
//!
//! Strategy: work below [`PAR_MIN_ELEMS`] elements runs on the calling thread. Above it, work
//! is split into independent jobs of whole rows (reductions) or row segments (element-wise
//! maps) with about [`JOB_ELEMS`] elements each. A job's result depends only on its own
//! inputs, never on how jobs were grouped onto threads, so the output is deterministic:
//! no reduction is ever split across jobs.

use std::ops::Range;

use rayon::prelude::*;

/// Below this many elements an op runs single-threaded.
pub(crate) const PAR_MIN_ELEMS: usize = 16 * 1024;

/// Target elements per parallel job (and the segment length of element-wise maps).
pub(crate) const JOB_ELEMS: usize = 4 * 1024;

/// Calls `f(scratch, r)` for every row `r < rows` of `row_len` elements; each row is handled
/// by exactly one call. `init` makes per-thread scratch.
pub(crate) fn for_each_row<S, I, F>(rows: usize, row_len: usize, init: I, f: F)
where
    I: Fn() -> S + Sync + Send,
    F: Fn(&mut S, usize) + Sync + Send,
{
    if rows <= 1 || rows.saturating_mul(row_len) <= PAR_MIN_ELEMS {
        let mut s = init();
        (0..rows).for_each(|r| f(&mut s, r));
        return;
    }
    let min_len = (JOB_ELEMS / row_len.max(1)).max(1);
    (0..rows)
        .into_par_iter()
        .with_min_len(min_len)
        .for_each_init(init, f);
}

/// Whether a helper may fork onto the rayon pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Threads {
    /// Parallel above [`PAR_MIN_ELEMS`].
    Auto,
    /// Always on the calling thread (the caller is already one job of a parallel loop).
    Caller,
}

/// Calls `f(scratch, r, cols)` over segments of at most [`JOB_ELEMS`] columns covering every
/// element of a `rows x row_len` space exactly once (element-wise maps).
pub(crate) fn for_each_segment<S, I, F>(
    threads: Threads,
    rows: usize,
    row_len: usize,
    init: I,
    f: F,
) where
    I: Fn() -> S + Sync + Send,
    F: Fn(&mut S, usize, Range<usize>) + Sync + Send,
{
    if rows == 0 || row_len == 0 {
        return;
    }
    let per_row = row_len.div_ceil(JOB_ELEMS);
    let task = |s: &mut S, t: usize| {
        let (r, seg) = (t / per_row, t % per_row);
        let start = seg * JOB_ELEMS;
        f(s, r, start..(start + JOB_ELEMS).min(row_len));
    };
    let tasks = rows * per_row;
    if threads == Threads::Caller || rows.saturating_mul(row_len) <= PAR_MIN_ELEMS {
        let mut s = init();
        (0..tasks).for_each(|t| task(&mut s, t));
        return;
    }
    let min_len = (JOB_ELEMS / row_len).max(1);
    (0..tasks)
        .into_par_iter()
        .with_min_len(min_len)
        .for_each_init(init, task);
}

/// Segment scratch: a buffer of `min(row_len, JOB_ELEMS)` floats.
pub(crate) fn segment_buf(row_len: usize) -> Vec<f32> {
    vec![0.0; row_len.min(JOB_ELEMS)]
}
