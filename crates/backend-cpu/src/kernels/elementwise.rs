//! Element-wise ops: `Add`, `Mul` (numpy broadcast of `b` onto `a`), `Scale`, `Silu`, `Gelu`,
//! `SwiGlu`.
//!
//! Strategy: the destination and the (broadcast) sources are coalesced together into long rows,
//! then processed in segments: read a run of `a` (and `b`) into f32 scratch, apply the op over
//! the slice (a tight loop the compiler vectorises), write the run converted to the
//! destination's dtype. A segment reads all its inputs before writing, and the destination has
//! the first source's layout when it runs in place, so in-place execution is safe.

use lowsync_backend::{ExecNode, Result};

use super::par::{for_each_segment, segment_buf, Threads};
use super::view::{coalesce, Strided};
use super::{float_dst, kernel_err, same_shape};

/// `x * sigmoid(x)`, written as `x / (1 + e^-x)` so that a large negative `x` (where `e^-x`
/// overflows to infinity) gives `-0` instead of `NaN`.
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `x[i] = silu(x[i]) * u[i]` (or `silu(x[i])` without `u`): 16 lanes at a time with
/// AVX-512 where `dot512` runs, else [`silu`] per element (the libm `exp`, not vectorised: a
/// prefill SwiGLU of 128 x 2048 took about 1 ms that way).
fn silu_slice(x: &mut [f32], u: Option<&[f32]>) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::dot512::available() {
            // SAFETY: the AVX-512 features were detected (`available`).
            unsafe { x86::silu_slice(x, u) };
            return;
        }
    }
    match u {
        Some(u) => x.iter_mut().zip(u).for_each(|(g, u)| *g = silu(*g) * u),
        None => x.iter_mut().for_each(|g| *g = silu(*g)),
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! SiLU over 16 lanes: `x / (1 + e^-x)` with `e^-x` from a range reduction and a
    //! polynomial, within 2 ulp of libm's `expf` over the whole f32 range.
    //!
    //! Strategy: `e^y = 2^n * e^r` with `n = round(y * log2 e)` and `r = y - n ln 2` (ln 2
    //! split in a high and a low part, so `r` is exact to a few ulp), `e^r` by a degree-6
    //! polynomial on `|r| <= ln2 / 2`, and `2^n` applied by `vscalefps`, which gives +inf for
    //! a large `n` and +0 for a very negative one (so a large negative `x` gives `x / inf = -0`,
    //! as [`super::silu`] does) and keeps NaN.

    use std::arch::x86_64::*;

    /// `e^y`, lane by lane (also `softmax`'s exponentials). A NaN lane gives a finite value:
    /// callers keep NaN themselves.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn exp16(y: __m512) -> __m512 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        // Beyond these `e^y` is inf or 0 in f32; clamping keeps `n` finite for `vscalefps`.
        let y = _mm512_min_ps(
            _mm512_max_ps(y, _mm512_set1_ps(-104.0)),
            _mm512_set1_ps(89.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(y, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), y);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        // Taylor coefficients 1/k! for k = 6 down to 2, then 1 + r + ...
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// `silu(x) (* u)` for 16 lanes.
    #[inline(always)]
    unsafe fn silu16(x: __m512) -> __m512 {
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e))
    }

    /// # Safety
    /// AVX-512 F is available; `u`, when given, is at least as long as `x`.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn silu_slice(x: &mut [f32], u: Option<&[f32]>) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let mut e = 0;
        while e < n {
            let m: __mmask16 = if n - e >= 16 {
                0xffff
            } else {
                ((1u32 << (n - e)) - 1) as __mmask16
            };
            let mut v = silu16(_mm512_maskz_loadu_ps(m, p.add(e)));
            if let Some(u) = u {
                v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, u.as_ptr().add(e)));
            }
            _mm512_mask_storeu_ps(p.add(e), m, v);
            e += 16;
        }
    }
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
#[inline]
fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `dst = f(a)` element by element.
fn map1(dst: &Strided, a: &Strided, f: impl Fn(&mut [f32]) + Sync + Send) {
    let v = coalesce(&[dst, a]);
    let (d, a) = (&v[0], &v[1]);
    let (rows, len) = (d.rows(), d.last_len());
    for_each_segment(
        Threads::Auto,
        rows,
        len,
        || segment_buf(len),
        |buf, r, cols| {
            let buf = &mut buf[..cols.len()];
            a.read_row(r, cols.clone(), buf);
            f(buf);
            d.write_row(r, cols, buf);
        },
    );
}

/// `dst = f(a, b)` element by element; `b` already has `a`'s shape (possibly broadcast).
fn map2(dst: &Strided, a: &Strided, b: &Strided, f: impl Fn(&mut [f32], &[f32]) + Sync + Send) {
    let v = coalesce(&[dst, a, b]);
    let (d, a, b) = (&v[0], &v[1], &v[2]);
    let (rows, len) = (d.rows(), d.last_len());
    for_each_segment(
        Threads::Auto,
        rows,
        len,
        || (segment_buf(len), segment_buf(len)),
        |(x, y), r, cols| {
            let (x, y) = (&mut x[..cols.len()], &mut y[..cols.len()]);
            a.read_row(r, cols.clone(), x);
            b.read_row(r, cols.clone(), y);
            f(x, y);
            d.write_row(r, cols, x);
        },
    );
}

/// The element-wise op of `node`, on resolved views.
pub(super) fn run(node: &ExecNode, dst: &Strided, srcs: &[Strided]) -> Result<()> {
    use lowsync_graph::Op;
    float_dst(node, dst)?;
    for s in srcs {
        if !s.dtype().is_float() {
            return Err(kernel_err(
                node,
                format!("sources must be float tensors, got {}", s.dtype()),
            ));
        }
    }
    let a = &srcs[0];
    same_shape(node, "first source", a, dst)?;
    let broadcast_b = || -> Result<Strided> {
        let b = &srcs[1];
        b.broadcast_to(dst.shape()).ok_or_else(|| {
            kernel_err(
                node,
                format!("cannot broadcast {:?} onto {:?}", b.shape(), dst.shape()),
            )
        })
    };
    match node.op {
        Op::Add => map2(dst, a, &broadcast_b()?, |x, y| {
            x.iter_mut().zip(y).for_each(|(x, y)| *x += y)
        }),
        Op::Mul => map2(dst, a, &broadcast_b()?, |x, y| {
            x.iter_mut().zip(y).for_each(|(x, y)| *x *= y)
        }),
        Op::SwiGlu => {
            same_shape(node, "up", &srcs[1], dst)?;
            map2(dst, a, &srcs[1], |g, u| silu_slice(g, Some(u)))
        }
        Op::Scale { scale } => map1(dst, a, |x| x.iter_mut().for_each(|x| *x *= scale)),
        Op::Silu => map1(dst, a, |x| silu_slice(x, None)),
        Op::Gelu => map1(dst, a, |x| x.iter_mut().for_each(|x| *x = gelu(*x))),
        other => {
            return Err(kernel_err(
                node,
                format!("{} is not element-wise", other.name()),
            ))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_silu_is_within_a_few_ulp_of_the_scalar_one_over_the_whole_range() {
        let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.06).collect();
        xs.extend([
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            88.0,
            89.5,
            -87.0,
            -104.0,
            -200.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        let u: Vec<f32> = (0..xs.len()).map(|i| 0.5 + (i % 7) as f32).collect();
        for with_u in [false, true] {
            // 37 elements at a time: whole vectors and a masked tail.
            let mut got = xs.clone();
            for (c, uc) in got.chunks_mut(37).zip(u.chunks(37)) {
                silu_slice(c, with_u.then_some(uc));
            }
            for ((&x, &g), &u) in xs.iter().zip(&got).zip(&u) {
                let want = silu(x) * if with_u { u } else { 1.0 };
                if want.is_nan() {
                    assert!(g.is_nan(), "silu({x}) = {g}");
                    continue;
                }
                let ulp = (want.abs() * f32::EPSILON).max(f32::MIN_POSITIVE * f32::EPSILON);
                assert!(
                    (g - want).abs() <= 4.0 * ulp || g == want,
                    "silu({x}) = {g}, want {want}"
                );
                assert_eq!(
                    g.is_sign_negative(),
                    want.is_sign_negative(),
                    "sign of silu({x})"
                );
            }
        }
    }
}
