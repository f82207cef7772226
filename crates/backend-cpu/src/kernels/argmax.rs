//! `Argmax` over the last axis, as i32.
//!
//! Ties keep the lowest index (only a strictly larger value replaces the best). `NaN` is
//! treated as smaller than every number: it is never picked while the row has a number, and a
//! row of only `NaN`s gives index 0. One row per job.

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::DType;

use super::par::for_each_row;
use super::view::Strided;
use super::{float_src, kernel_err};

pub(super) fn argmax(node: &ExecNode, dst: &Strided, x: &Strided) -> Result<()> {
    float_src(node, "x", x)?;
    if dst.dtype() != DType::I32 {
        return Err(kernel_err(
            node,
            format!("result must be i32, got {}", dst.dtype()),
        ));
    }
    let want = &x.shape()[..x.rank().saturating_sub(1)];
    if x.rank() == 0 || dst.shape() != want {
        return Err(kernel_err(
            node,
            format!(
                "x {:?} needs a result of shape {want:?}, got {:?}",
                x.shape(),
                dst.shape()
            ),
        ));
    }
    let (rows, len) = (x.rows(), x.last_len());
    if rows == 0 {
        return Ok(());
    }
    if len == 0 {
        return Err(kernel_err(
            node,
            format!("argmax of an empty last axis ({:?})", x.shape()),
        ));
    }
    for_each_row(
        rows,
        len,
        || vec![0.0f32; len],
        |buf, r| {
            x.read_row(r, 0..len, buf);
            dst.write_i32(r, argmax_row(buf) as i32);
        },
    );
    Ok(())
}

/// Index of the largest value, lowest on ties, `NaN` below everything. Where `dot512` runs, 16
/// lanes at a time: the largest number, then the first index holding it (the same index: the
/// first of the largest; -0 and +0 compare equal in both).
pub(crate) fn argmax_row(v: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if super::dot512::available() {
            // SAFETY: the AVX-512 features were detected (`available`).
            return unsafe { x86::argmax_row(v) };
        }
    }
    argmax_scalar(v)
}

/// [`argmax_row`] one element at a time.
fn argmax_scalar(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate().skip(1) {
        let b = v[best];
        if x > b || (b.is_nan() && !x.is_nan()) {
            best = i;
        }
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The lanes `e..min(e + 16, n)`.
    #[inline(always)]
    fn lanes(n: usize, e: usize) -> __mmask16 {
        if n - e >= 16 {
            0xffff
        } else {
            ((1u32 << (n - e)) - 1) as __mmask16
        }
    }

    /// See [`super::argmax_row`]: 0 for an empty row or one of only `NaN`s.
    ///
    /// # Safety
    /// AVX-512 F is available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn argmax_row(v: &[f32]) -> usize {
        let (n, p) = (v.len(), v.as_ptr());
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut numbers = false;
        let mut e = 0;
        while e < n {
            let x = _mm512_maskz_loadu_ps(lanes(n, e), p.add(e));
            let ordered = _mm512_mask_cmp_ps_mask::<_CMP_ORD_Q>(lanes(n, e), x, x);
            m = _mm512_mask_max_ps(m, ordered, m, x);
            numbers |= ordered != 0;
            e += 16;
        }
        if !numbers {
            return 0;
        }
        let best = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        let mut e = 0;
        while e < n {
            let x = _mm512_maskz_loadu_ps(lanes(n, e), p.add(e));
            let hit = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(lanes(n, e), x, best);
            if hit != 0 {
                return e + hit.trailing_zeros() as usize;
            }
            e += 16;
        }
        0
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn vector_argmax_picks_the_index_the_scalar_loop_picks() {
        if !super::super::dot512::detected() {
            eprintln!("skipped: this CPU lacks AVX-512");
            return;
        }
        let mut st = 7u64;
        let mut next = || {
            st = st
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (st >> 33) as u32
        };
        // Few distinct values (ties), NaN, both zeros and infinities, lengths around 16.
        let pool = [
            f32::NAN,
            -0.0,
            0.0,
            1.0,
            -1.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            2.5,
        ];
        for n in [1usize, 2, 15, 16, 17, 31, 33, 100, 32000] {
            for round in 0..50 {
                let k = 2 + round % (pool.len() - 1);
                let v: Vec<f32> = (0..n).map(|_| pool[next() as usize % k]).collect();
                // SAFETY: the features were detected.
                let got = unsafe { x86::argmax_row(&v) };
                assert_eq!(got, argmax_scalar(&v), "{v:?}");
            }
        }
        // SAFETY: as above.
        assert_eq!(unsafe { x86::argmax_row(&[f32::NAN; 20]) }, 0);
    }
}
