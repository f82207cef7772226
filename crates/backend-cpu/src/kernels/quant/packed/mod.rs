//! Weight matrices repacked once into groups of 16 rows for the AVX-512 and AVX2 products.
//!
//! Why: a decode product streams every weight once. Read in place, a GGUF matrix is one stream
//! per weight row, and the products read 4-8 rows side by side to share each activation block:
//! 4-8 streams that the hardware prefetcher does not follow from DRAM, and an unpacking per
//! row and block. A copy of the matrix whose 16 rows of a group lie block by block in one
//! contiguous run, laid out so that the integer sums of the 16 rows land in the 16 lanes of a
//! 512-bit vector (`vpdpwssd`), is one stream per job and needs only shifts and masks to
//! unpack; the same copy serves prefill, which then needs no per-product panel.
//!
//! Strategy: a block type with a packed layout has a [`PackedType`]: the bytes of a group, the
//! packing of 16 raw rows into a group, and the dot product of one group with every
//! activation row (16-bit activation blocks, `super::q16::QRows`; and for Q4_0, Q4_K and Q6_K
//! with 8-bit blocks, `super::q8::Q8Rows`, by `vpdpbusd` over the same bytes), with AVX-512 and
//! with AVX2. The 32-value block types live in `q32` (AVX2 bodies in `q32::avx2`), the K types
//! in `k` (`k::avx2`).
//!
//! Invariants: a group's dot product computes each output in the order of the AVX-512 panel
//! bodies (`super::q16::avx512`): per activation block, the exact integer sum, converted,
//! times `d_w * d_x`, added by one FMA in block order; the mins in a second chain added at the
//! end. So a packed product gives the same bits as the panel path, in decode and in prefill.
//! `dot8` keeps that order with 8-bit activations, except that Q6_K scales a block's two
//! sub-block sums together (`(f0 * s0 + f1 * s1) * d_x`); its integer sums are exact too, so
//! its bits depend only on the weight row and the activation row.
//! `dot` and `dot8` run only where `super::q16::has_avx512()` holds.
//!
//! The layout is one for every instruction set: `dot_avx2` and `dot8_avx2`, for CPUs with AVX2,
//! FMA and F16C but no AVX-512 VNNI (or `LOWSYNC_CPU_QUANT_ISA=avx2`), read each 64-byte vector
//! of a group as two 256-bit halves (weight rows 0..8, then 8..16) with `pmaddwd` (16-bit
//! activations) or `pmaddubsw` and `pmaddwd` by ones (8-bit activations), and compute every
//! output in the order of `dot` and `dot8`: their integer sums are exact too, so a packed AVX2
//! product gives the bits of the AVX-512 one (unit tests compare them where both run).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod k;
mod q32;

use lowsync_graph::DType;

use super::q16::QRows;
use super::q8::Q8Rows;

/// Weight rows per packed group: the 16 lanes of a 512-bit vector of i32.
pub(crate) const GROUP: usize = 16;

/// [`GROUP`] raw weight rows to pack (`None`: past the matrix's end).
pub(crate) type GroupRows<'a> = [Option<&'a [u8]>; GROUP];

/// One block type's packed layout and its product.
pub(crate) struct PackedType {
    /// Bytes of one packed group of [`GROUP`] rows of `k` values (`k` a whole number of the
    /// type's blocks, which the caller checks).
    pub group_bytes: fn(k: usize) -> usize,
    /// Packs [`GROUP`] rows into `dst` (`group_bytes(k)` bytes): `rows[r]` is row `r`'s raw
    /// GGUF blocks (`k` values), `None` for a row past the matrix's end, packed so that it
    /// contributes zero.
    pub pack: fn(rows: &GroupRows<'_>, k: usize, dst: &mut [u8]),
    /// `out[i * GROUP + r]` = weight row `r` of group `g` times activation row `i` of `x`, for
    /// every activation row of `x` (`out.len() == GROUP * m`, `x` holding `m` rows of `k`).
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C; `g.len() ==
    /// group_bytes(k)`.
    pub dot: DotFn,
    /// As `dot` with 8-bit activation blocks (`super::q8::Q8Rows`), where the type has a body
    /// for them (`vpdpbusd`; Q4_0, Q4_K, Q6_K).
    ///
    /// # Safety
    /// As `dot`.
    pub dot8: Option<Dot8Fn>,
    /// As `dot` with AVX2 (each 64-byte vector read as two halves of 8 weight rows).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `g.len() == group_bytes(k)`.
    pub dot_avx2: DotFn,
    /// As `dot8` with AVX2 (`pmaddubsw`), for the same types.
    ///
    /// # Safety
    /// As `dot_avx2`.
    pub dot8_avx2: Option<Dot8Fn>,
}

/// A group's product with 16-bit activation blocks (see [`PackedType::dot`]).
pub(crate) type DotFn = unsafe fn(g: &[u8], k: usize, x: &QRows, out: &mut [f32]);

/// A group's product with 8-bit activation blocks (see [`PackedType::dot8`]).
pub(crate) type Dot8Fn = unsafe fn(g: &[u8], k: usize, x: &Q8Rows, out: &mut [f32]);

/// Writes row `r` of group `g` (of `dt`, `k` values a row) back as its raw GGUF blocks into
/// `out`; `false` where `dt`'s layout has no inverse here (the caller reads the weight itself).
pub(crate) fn raw_row(dt: DType, g: &[u8], k: usize, r: usize, out: &mut [u8]) -> bool {
    q32::raw_row_of(dt, g, k, r, out)
}

/// The packed layout of `dt`'s weights, where one exists: on x86-64 only, the one target with
/// bodies for it (elsewhere, aarch64's NEON bodies included, products read the weight in place).
pub(crate) fn packed_type(dt: DType) -> Option<&'static PackedType> {
    if cfg!(target_arch = "x86_64") {
        q32::lookup(dt).or_else(|| k::lookup(dt))
    } else {
        None
    }
}

/// 64 bytes at a 64-byte boundary: packed groups are kept in vectors of these, so that every
/// piece of a group starts on a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub [u8; 64]);

/// The bytes of `lines`.
pub(crate) fn lines_as_bytes_mut(lines: &mut [Line]) -> &mut [u8] {
    // SAFETY: `Line` is 64 plain bytes with no padding.
    unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), lines.len() * 64) }
}

/// The bytes of `lines`.
pub(crate) fn lines_as_bytes(lines: &[Line]) -> &[u8] {
    // SAFETY: `Line` is 64 plain bytes with no padding.
    unsafe { std::slice::from_raw_parts(lines.as_ptr().cast::<u8>(), lines.len() * 64) }
}

// The packed layouts exist on x86_64 only (elsewhere `packed_type` has none).
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    //! The `#[ignore]`d benchmark of the AVX2 bodies: what a CPU without AVX-512 VNNI ran
    //! before (the AVX2 bodies over the weight in place) against the packed AVX2 bodies, one
    //! thread, alternated in one process (`cargo test --release -p lowsync-cpu
    //! avx2_packed_speed -- --ignored --nocapture`).

    use lowsync_graph::DType;

    use super::super::q16::{self, Isa, QRows};
    use super::super::q8::{self, Q8Rows};
    use super::*;

    #[test]
    #[ignore = "a benchmark: run with --release --ignored --nocapture"]
    fn avx2_packed_speed() {
        let simd = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if !simd {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C");
            return;
        }
        // (type, raw block bytes, f16 scale offsets, activation blocks a raw block).
        let types: [(DType, usize, &[usize], usize); 5] = [
            (DType::Q4_0, 18, &[0], 1),
            (DType::Q4_1, 20, &[0, 2], 1),
            (DType::Q8_0, 34, &[0], 1),
            (DType::Q4_K, 144, &[0, 2], 8),
            (DType::Q6_K, 210, &[208], 8),
        ];
        for (dt, bb, halves, per) in types {
            let pt = packed_type(dt).expect("a packed layout");
            for k in [768, 2048] {
                let rb = k / q16::QK / per * bb;
                let gb = (pt.group_bytes)(k);
                for (m, label, bytes, reps) in [
                    (1, "cache 1 MiB", 1 << 20, 64),
                    (1, "DRAM 96 MiB", 96 << 20, 2),
                    (128, "cache 256 KiB", 256 << 10, 4),
                    (128, "DRAM 48 MiB", 48 << 20, 1),
                ] {
                    let n = (bytes / rb).next_multiple_of(GROUP);
                    let w = q16::x86::tests::rows(n, rb, bb, halves, 9);
                    let mut lines = vec![Line([0; 64]); n / GROUP * gb / 64];
                    let packed = lines_as_bytes_mut(&mut lines);
                    for (j, g) in packed.chunks_exact_mut(gb).enumerate() {
                        let rows: GroupRows<'_> = std::array::from_fn(|r| {
                            let at = (j * GROUP + r) * rb;
                            Some(&w[at..at + rb])
                        });
                        (pt.pack)(&rows, k, g);
                    }
                    let packed = lines_as_bytes(&lines);
                    let xf: Vec<f32> = (0..m * k)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                        .collect();
                    let x16 = QRows::quantize(&xf);
                    // What a product takes by default: 8-bit activations in prefill where a
                    // body for them exists, 16-bit ones otherwise.
                    let prefill8 = m >= q16::PANEL_MIN_ROWS && pt.dot8_avx2.is_some();
                    let (x8e, x8p) = (Q8Rows::quantize_elements(&xf), Q8Rows::quantize(&xf));
                    let in_place16 = q16::dot_fn(dt, Isa::Avx2).expect("an AVX2 body");
                    let in_place8 = q8::avx2_dot_fn(dt).expect("an 8-bit AVX2 body");
                    let mut out = vec![0.0f32; n * m];
                    let mut tmp = vec![0.0f32; GROUP * m];
                    let units = (n * (k / q16::QK) * m * reps) as f64;
                    let (mut best_old, mut best_new) = (f64::MAX, f64::MAX);
                    for round in 0..7 {
                        for v in 0..2 {
                            let new = (v + round) % 2 == 1;
                            let t0 = std::time::Instant::now();
                            for _ in 0..reps {
                                if !new && prefill8 {
                                    in_place8(&w, rb, &x8e, &mut out);
                                } else if !new {
                                    in_place16(&w, rb, &x16, &mut out);
                                } else {
                                    for grp in packed.chunks_exact(gb) {
                                        // SAFETY: AVX2, FMA and F16C were detected; `grp` is
                                        // one group of `k`.
                                        unsafe {
                                            match pt.dot8_avx2 {
                                                Some(d8) if prefill8 => d8(grp, k, &x8p, &mut tmp),
                                                _ => (pt.dot_avx2)(grp, k, &x16, &mut tmp),
                                            }
                                        }
                                        std::hint::black_box(&mut tmp);
                                    }
                                }
                                std::hint::black_box(&mut out);
                            }
                            let ns = t0.elapsed().as_secs_f64() * 1e9 / units;
                            if new {
                                best_new = best_new.min(ns);
                            } else {
                                best_old = best_old.min(ns);
                            }
                        }
                    }
                    let act = if prefill8 { "8-bit" } else { "16-bit" };
                    eprintln!(
                        "{dt} k {k} m {m} {label} ({act}): in place {best_old:.4} ns, packed \
                         {best_new:.4} ns per (block of 32, weight row, activation row), {:.2}x",
                        best_old / best_new
                    );
                }
            }
        }
    }
}
