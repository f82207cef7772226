//! `SoftMax`: `softmax(x * scale + mask)` over the last axis.
//!
//! Strategy: the optional mask is broadcast onto `x` (stride-0 axes) and read row by row next
//! to `x`. Each row subtracts its maximum before `exp` for stability. A row whose entries are
//! all `-inf` (fully masked, or empty) has no maximum to subtract and gives zeros instead of
//! `NaN`. A `NaN` in a row makes its maximum `NaN` (the fold does not skip it, unlike
//! `f32::max`), so the whole row comes out `NaN`: one bad weight shows in the logits instead
//! of vanishing into finite values. One row per job, so sums never depend on threading.

use lowsync_backend::{ExecNode, Result};

use super::par::for_each_row;
use super::view::Strided;
use super::{float_dst, float_src, kernel_err, same_shape};

pub(super) fn soft_max(
    node: &ExecNode,
    dst: &Strided,
    x: &Strided,
    mask: Option<&Strided>,
    scale: f32,
) -> Result<()> {
    float_dst(node, dst)?;
    float_src(node, "x", x)?;
    same_shape(node, "x", x, dst)?;
    let mask = match mask {
        None => None,
        Some(m) => {
            float_src(node, "mask", m)?;
            Some(m.broadcast_to(x.shape()).ok_or_else(|| {
                kernel_err(
                    node,
                    format!(
                        "mask {:?} does not broadcast onto {:?}",
                        m.shape(),
                        x.shape()
                    ),
                )
            })?)
        }
    };
    let (rows, len) = (x.rows(), x.last_len());
    if len == 0 {
        return Ok(());
    }
    for_each_row(
        rows,
        len,
        || (vec![0.0f32; len], vec![0.0f32; len]),
        |(v, m), r| {
            x.read_row(r, 0..len, v);
            match &mask {
                Some(mask) => {
                    mask.read_row(r, 0..len, m);
                    v.iter_mut()
                        .zip(m.iter())
                        .for_each(|(v, m)| *v = *v * scale + m);
                }
                None => v.iter_mut().for_each(|v| *v *= scale),
            }
            softmax_in_place(v);
            dst.write_row(r, 0..len, v);
        },
    );
    Ok(())
}

/// Softmax of one row in place; an all `-inf` row becomes zeros, a row with a `NaN` all `NaN`.
/// Where `dot512` runs and the maximum is finite, the exponentials take 16 lanes at a time
/// (`elementwise`'s `exp16`, within 4 ulp of libm's `expf`) and the sum 16 partial sums
/// added by a fixed tree: the fused attention and this op share this function, so they keep
/// the same bits; the sum's order depends only on the row's length.
pub(super) fn softmax_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let max = if super::dot512::available() {
        // SAFETY: the AVX-512 features were detected (`available`).
        unsafe { x86::max(v) }
    } else {
        v.iter().copied().fold(f32::NEG_INFINITY, nan_max)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let max = v.iter().copied().fold(f32::NEG_INFINITY, nan_max);
    if max == f32::NEG_INFINITY {
        v.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if max.is_finite() && super::dot512::available() {
            // SAFETY: as above.
            unsafe { x86::exp_normalize(v, max) };
            return;
        }
    }
    let mut sum = 0.0f32;
    for x in v.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    v.iter_mut().for_each(|x| *x *= inv);
}

/// The larger of two values, `NaN` when either is `NaN` (`f32::max` returns the other one).
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::dot512::hsum;
    use super::super::elementwise::x86::exp16;

    /// The row's maximum, NaN when a lane is NaN (what the scalar fold gives).
    ///
    /// # Safety
    /// AVX-512 F is available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max(v: &[f32]) -> f32 {
        let (n, p) = (v.len(), v.as_ptr());
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut nan: __mmask16 = 0;
        let mut e = 0;
        while e < n {
            let k: __mmask16 = if n - e >= 16 {
                0xffff
            } else {
                ((1u32 << (n - e)) - 1) as __mmask16
            };
            let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), k, p.add(e));
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            m = _mm512_max_ps(m, x);
            e += 16;
        }
        if nan != 0 {
            f32::NAN
        } else {
            _mm512_reduce_max_ps(m)
        }
    }

    /// `v[i] = e^(v[i] - max) / sum`, 16 lanes at a time; `max` is the row's finite maximum,
    /// so no lane is NaN and every exponential is at most 1.
    ///
    /// # Safety
    /// AVX-512 F is available.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn exp_normalize(v: &mut [f32], max: f32) {
        let (n, p) = (v.len(), v.as_mut_ptr());
        let m = _mm512_set1_ps(max);
        let mut sum = _mm512_setzero_ps();
        let mut e = 0;
        while e < n {
            let k: __mmask16 = if n - e >= 16 {
                0xffff
            } else {
                ((1u32 << (n - e)) - 1) as __mmask16
            };
            let x = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.add(e)), m));
            sum = _mm512_mask_add_ps(sum, k, sum, x);
            _mm512_mask_storeu_ps(p.add(e), k, x);
            e += 16;
        }
        let inv = _mm512_set1_ps(1.0 / hsum(sum));
        let mut e = 0;
        while e < n {
            let k: __mmask16 = if n - e >= 16 {
                0xffff
            } else {
                ((1u32 << (n - e)) - 1) as __mmask16
            };
            let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.add(e)), inv);
            _mm512_mask_storeu_ps(p.add(e), k, x);
            e += 16;
        }
    }
}
