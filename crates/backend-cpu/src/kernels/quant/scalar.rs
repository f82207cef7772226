//! The scalar dequantization of every block type: the oracle of all quantized kernels.
//!
//! Why: a quantized weight's values are defined by its GGUF block layout; every faster kernel
//! (SIMD dot products here, CUDA and Vulkan later) must agree with one plain statement of it.
//! These functions are that statement, checked bit for bit against `gguf.quants.dequantize`
//! (the `gguf` Python package; the layouts below are read from it as facts).
//!
//! Strategy: one function per type turns one block of bytes into `block_size` f32 values,
//! with f32 arithmetic in exactly the order the reference uses (`d * q + m` is a product then
//! a sum, never fused; a sub-block scale `d * sc` is rounded to f32 before it multiplies `q`),
//! so the results are identical, not merely close. Scales are little-endian f16, widened
//! exactly.
//!
//! Invariant: `dequantize_row` writes every element of `out` when `bytes` holds exactly the
//! blocks of `out.len()` elements, and nothing otherwise (a caller bug, asserted in debug).

use half::f16;
use lowsync_graph::DType;

/// IQ4_NL's (and IQ4_XS's) non-linear 4-bit code book.
pub(crate) const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The little-endian f16 at `b[i..i + 2]`, as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The 32 nibbles of a 32-element block (`qs`, 16 bytes) in element order: low nibbles hold
/// elements 0..16, high nibbles 16..32. One branch-free pass, so the loops after it vectorize.
#[inline]
fn nibbles(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for (j, &byte) in qs[..16].iter().enumerate() {
        q[j] = byte & 0x0F;
        q[j + 16] = byte >> 4;
    }
    q
}

/// The 32 5-bit values of a Q5 block: nibbles, and bit `j` of the 32 high bits as bit 4.
#[inline]
fn fives(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = nibbles(qs);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) as u8) << 4;
    }
    q
}

fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, q) in out.iter_mut().zip(nibbles(&b[2..18])) {
        *o = d * f32::from(q as i8 - 8);
    }
}

fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (o, q) in out.iter_mut().zip(nibbles(&b[4..20])) {
        *o = d * f32::from(q) + m;
    }
}

fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (o, q) in out.iter_mut().zip(fives(qh, &b[6..22])) {
        *o = d * f32::from(q as i8 - 16);
    }
}

fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (o, q) in out.iter_mut().zip(fives(qh, &b[8..24])) {
        *o = d * f32::from(q) + m;
    }
}

fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// Q2_K: 16 sub-blocks of 16; `scales[i]` holds the sub-block's scale (low nibble) and min
/// (high nibble); 2-bit values, four per byte, in groups of 32 bytes per 128 elements.
fn q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (e, o) in out.iter_mut().enumerate() {
        let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
        let q = (qs[half * 32 + l] >> (2 * shift)) & 3;
        let sc = scales[e / 16];
        let dl = d * f32::from(sc & 0x0F);
        let ml = dmin * f32::from(sc >> 4);
        *o = dl * f32::from(q) - ml;
    }
}

/// Q3_K: 16 sub-blocks of 16 with 6-bit signed scales (low 4 bits in bytes 0..8, high 2 bits
/// in bytes 8..12); 2-bit values plus a high-bit mask whose *clear* bit subtracts 4.
fn q3_k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    let mut dl = [0.0f32; 16];
    for (i, x) in dl.iter_mut().enumerate() {
        let lo = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        *x = d * f32::from((lo | (hi << 4)) as i8 - 32);
    }
    for (e, o) in out.iter_mut().enumerate() {
        let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
        let ql = ((qs[half * 32 + l] >> (2 * shift)) & 3) as i8;
        let h = ((hmask[l] >> (e / 32)) & 1) ^ 1;
        *o = dl[e / 16] * f32::from(ql - ((h << 2) as i8));
    }
}

/// The 8 (scale, min) pairs of Q4_K / Q5_K: 6 bits each, packed in 12 bytes.
#[inline]
pub(crate) fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3F, s[4 + j] & 0x3F)
    } else {
        (
            (s[4 + j] & 0x0F) | ((s[j - 4] >> 2) & 0x30),
            (s[4 + j] >> 4) | ((s[j] >> 2) & 0x30),
        )
    }
}

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins; nibbles, 32 bytes per 64 elements
/// (low nibbles first).
fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (s, qs) = (&b[4..16], &b[16..144]);
    for (j, sub) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(s, j);
        let (dj, mj) = (d * f32::from(sc), dmin * f32::from(m));
        let (chunk, shift) = (j / 2, 4 * (j % 2));
        for (l, o) in sub.iter_mut().enumerate() {
            let q = (qs[chunk * 32 + l] >> shift) & 0x0F;
            *o = dj * f32::from(q) - mj;
        }
    }
}

/// Q5_K: Q4_K plus a fifth bit per value from 32 bytes of high bits (bit `j` for sub-block `j`).
fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (s, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (j, sub) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(s, j);
        let (dj, mj) = (d * f32::from(sc), dmin * f32::from(m));
        let (chunk, shift) = (j / 2, 4 * (j % 2));
        for (l, o) in sub.iter_mut().enumerate() {
            let q = ((qs[chunk * 32 + l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
            *o = dj * f32::from(q) - mj;
        }
    }
}

/// Q6_K: 16 sub-blocks of 16 with int8 scales; low nibbles (64 bytes per 128 elements) and
/// 2 high bits (32 bytes per 128 elements), offset by 32.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (e, o) in out.iter_mut().enumerate() {
        let (half, r) = (e / 128, e % 128);
        let lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        let hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
        let q = (lo | (hi << 4)) as i8 - 32;
        *o = d * f32::from(sc[e / 16] as i8) * f32::from(q);
    }
}

fn iq4_nl(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, q) in out.iter_mut().zip(nibbles(&b[2..18])) {
        *o = d * f32::from(IQ4_VALUES[usize::from(q)]);
    }
}

/// IQ4_XS: 8 sub-blocks of 32 with 6-bit signed scales (low 4 bits in bytes 4..8, high 2 bits
/// in the u16 at 2..4); values index IQ4_NL's code book, nibble layout per sub-block.
fn iq4_xs(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let sh = u16::from_le_bytes([b[2], b[3]]);
    let (sl, qs) = (&b[4..8], &b[8..136]);
    for (i, sub) in out.chunks_exact_mut(32).enumerate() {
        let lo = (sl[i / 2] >> (4 * (i % 2))) & 0x0F;
        let hi = ((sh >> (2 * i)) & 3) as u8;
        let dl = d * f32::from((lo | (hi << 4)) as i8 - 32);
        for (o, q) in sub.iter_mut().zip(nibbles(&qs[i * 16..i * 16 + 16])) {
            *o = dl * f32::from(IQ4_VALUES[usize::from(q)]);
        }
    }
}

/// Dequantizes one block into its `block_size` values.
type BlockFn = fn(&[u8], &mut [f32]);

/// The block function of a block type (`None` for plain types).
fn block_fn(dt: DType) -> Option<BlockFn> {
    Some(match dt {
        DType::Q4_0 => q4_0,
        DType::Q4_1 => q4_1,
        DType::Q5_0 => q5_0,
        DType::Q5_1 => q5_1,
        DType::Q8_0 => q8_0,
        DType::Q2_K => q2_k,
        DType::Q3_K => q3_k,
        DType::Q4_K => q4_k,
        DType::Q5_K => q5_k,
        DType::Q6_K => q6_k,
        DType::IQ4_NL => iq4_nl,
        DType::IQ4_XS => iq4_xs,
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 => return None,
    })
}

/// Dequantizes the blocks in `bytes` (exactly `out.len()` elements of `dt`) into `out`.
pub(crate) fn dequantize_row(dt: DType, bytes: &[u8], out: &mut [f32]) {
    let Some(f) = block_fn(dt) else {
        debug_assert!(false, "dequantize_row of a plain dtype {dt}");
        return;
    };
    let (bs, bb) = (dt.block_size(), dt.block_bytes());
    let ok = out.len().is_multiple_of(bs) && dt.row_bytes(out.len()) == Some(bytes.len());
    debug_assert!(ok, "{} bytes for {} {dt} elements", bytes.len(), out.len());
    if !ok {
        return;
    }
    for (blk, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
        f(blk, o);
    }
}
