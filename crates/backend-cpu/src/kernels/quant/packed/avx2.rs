//! Pieces shared by the AVX2 bodies of the packed products (`q32::avx2`, `k::avx2`).

use std::arch::x86_64::*;

/// Word `o` (a pair of i16, or 4 bytes) at `p`, in every lane. A function, not a closure: a
/// closure does not inherit its caller's target features.
#[inline(always)]
pub(super) unsafe fn word(p: *const i32, o: usize) -> __m256i {
    _mm256_set1_epi32(p.add(o).read_unaligned())
}

/// 8 f16 at `p` as f32.
#[inline(always)]
pub(super) unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// The exact integer sums (lane = weight row) of half `h` of a block's nibble values at `q`
/// (Q4_0, Q4_1, Q4_K: four vectors, pair `4j + s` at bits `4s` of each 16-bit half) with one
/// activation block (`xb`: its pairs), for the decode bodies. Each nibble is masked in place,
/// not shifted down, so pairs `4j + 1` and `4j + 2` give 16 and 256 times their products,
/// summed in chains of their own and shifted down once a block (exact: every term is a multiple
/// of 16 or 256): a mask (any vector port) instead of a shift and a mask (the shift ports, which
/// `pmaddwd` needs too), 8 shifts a block and half fewer for 2 more. Bounds: the 256-times lane
/// adds 8 products of at most `3840 * 32767`, about `1.0e9 < 2^31`.
#[inline(always)]
pub(super) unsafe fn nibble_sums(q: *const u8, h: usize, xb: *const i32) -> __m256i {
    let (m0, m1, m2) = (
        _mm256_set1_epi16(0x000F),
        _mm256_set1_epi16(0x00F0),
        _mm256_set1_epi16(0x0F00),
    );
    let z = _mm256_setzero_si256();
    let (mut a, mut b, mut c) = (z, z, z);
    for j in 0..4 {
        let v = _mm256_loadu_si256(q.add(64 * j + 32 * h).cast());
        a = _mm256_add_epi32(
            a,
            _mm256_madd_epi16(_mm256_and_si256(v, m0), word(xb, 4 * j)),
        );
        b = _mm256_add_epi32(
            b,
            _mm256_madd_epi16(_mm256_and_si256(v, m1), word(xb, 4 * j + 1)),
        );
        c = _mm256_add_epi32(
            c,
            _mm256_madd_epi16(_mm256_and_si256(v, m2), word(xb, 4 * j + 2)),
        );
        let top = _mm256_srli_epi16::<12>(v);
        a = _mm256_add_epi32(a, _mm256_madd_epi16(top, word(xb, 4 * j + 3)));
    }
    let bc = _mm256_add_epi32(_mm256_srai_epi32::<4>(b), _mm256_srai_epi32::<8>(c));
    _mm256_add_epi32(a, bc)
}
