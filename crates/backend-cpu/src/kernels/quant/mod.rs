//! Kernels over block (quantized) weights: `GetRows` of a quantized table, `MulMat` and
//! `MulMatId` with quantized weights and float activations.
//!
//! Why: GGUF weights stay in their block layout from the file to the kernel (issue 31); the
//! CPU backend is the oracle for every backend's quantized kernels, so its results are defined
//! by the scalar dequantization in `scalar` (bit-exact against `gguf.quants.dequantize`).
//!
//! Strategy: a weight is seen as rows of whole blocks (`Strided::quant_row`): a table's rows
//! for `GetRows`, which dequantizes only the rows it reads, and a transposed weight's columns
//! (`x @ w.T`, blocks along the reduction axis) for the products. A product takes the
//! activations as contiguous f32 rows once. Where `q16` has a SIMD kernel for the weight type
//! on this CPU, it quantizes them once to 16-bit integer blocks and each weight row is an
//! integer dot product per block (the default; AVX2, or AVX-512 VNNI unless
//! `LOWSYNC_CPU_QUANT_ISA=avx2`); otherwise, or with
//! `LOWSYNC_CPU_QUANT_DOT=f32`, each weight row is dequantized into a small f32 buffer and
//! dotted with every activation row in f32 (the exact path). Jobs are blocks of weight rows
//! (output columns), run in parallel above a size threshold on the rayon pool, which has one
//! thread per core (no oversubscription).
//!
//! What runs where: wherever a `q16` body runs (AVX-512 VNNI, or AVX2 with FMA and F16C), a
//! product over a Q4_0, Q4_1, Q8_0, Q4_K or Q6_K weight that lives in weight memory
//! (`crate::derived`: an aliased GGUF or built-in weight, or a weight buffer the backend
//! allocated) runs over a packed copy of the weight (`packed`: groups of 16 rows in the order
//! `vpdpwssd` reads them, made once on the rayon pool and kept while the buffer lives), in
//! decode and prefill alike, in jobs of whole groups; `LOWSYNC_CPU_PACK=off` keeps the in-place
//! paths. The groups' products are the AVX-512 bodies where `q16`'s AVX-512 bodies are allowed
//! and present, else the AVX2 ones (the same layout read as two 256-bit halves, with the same
//! bits). A prefill product (at least `q16::PANEL_MIN_ROWS` activation rows) over a packed
//! Q4_0, Q4_K or Q6_K weight quantizes its activations to 8-bit blocks instead (`q8`) and runs
//! `vpdpbusd` (AVX2: `pmaddubsw`) over the same groups (`LOWSYNC_CPU_PREFILL_ACT`); decode keeps
//! the 16-bit blocks, except over the AVX2 bodies with `LOWSYNC_CPU_DECODE_ACT=q8`. Where the
//! copy replaces a read-only file mapping, the mapping's pages are released as the copy is
//! made, and `GetRows` of the same table (a tied embedding) reads the copy. Otherwise the `q16`
//! bodies read the weight in place (AVX-512 panels from 6 activation rows, AVX2 tiles below),
//! except where the AVX2 bodies would run (no AVX-512 VNNI, or `LOWSYNC_CPU_QUANT_ISA=avx2`):
//! there a prefill product over Q4_0, Q4_K or Q6_K (Q4_1 and Q8_0 too with
//! `LOWSYNC_CPU_PREFILL_ACT=q8`) quantizes its activations to 8-bit blocks in element order and
//! runs `q8::avx2` (`pmaddubsw`) over the weight in place, and so does a decode product with
//! `LOWSYNC_CPU_DECODE_ACT=q8` (default `q16`). On aarch64 the NEON bodies of `q16` read every
//! weight in place with 16-bit activation blocks, in decode and prefill alike (no packed layout,
//! no 8-bit bodies there). Without SIMD or with `LOWSYNC_CPU_QUANT_DOT=f32` the exact path runs.
//!
//! Determinism: each output element is one dot product computed by one job in a fixed order,
//! independent of the thread count (as the f32 kernels promise). A packed product with 16-bit
//! activations gives the bits of the AVX-512 panels for every number of activation rows (with
//! the AVX2 bodies too, whose order is the same); with
//! 8-bit ones (prefill) its bits depend on the same things only (the row, `k` and whether the
//! product is a prefill), and differ from decode's within the 8-bit quantization. The AVX2
//! 8-bit bodies give an output the same bits for any number of activation rows, so with
//! `LOWSYNC_CPU_DECODE_ACT=q8` decode and prefill agree bit for bit.

mod packed;
mod q16;
mod q8;
pub(crate) mod scalar;

use std::sync::{Arc, OnceLock};

use lowsync_backend::{env, ExecNode, Result};
use rayon::prelude::*;

use self::packed::{lines_as_bytes, lines_as_bytes_mut, GroupRows, Line, PackedType, GROUP};
use super::kernel_err;
use super::par::{for_each_row, PAR_MIN_ELEMS};
use super::view::Strided;
use crate::derived::{read_only_at, release_file_pages, release_rows_read, DerivedKey};

/// Multiply-adds of one parallel job of a product (about, at most).
const JOB_WORK: usize = 1 << 16;

/// A product split into jobs is split into at least this many.
const MIN_JOBS: usize = 16;

/// Whether products may quantize activations to 16-bit blocks (`LOWSYNC_CPU_QUANT_DOT`:
/// `q16`, the default, or `f32`), read once; a bad value is an error naming the variable.
fn q16_allowed() -> std::result::Result<bool, String> {
    static MODE: OnceLock<std::result::Result<bool, String>> = OnceLock::new();
    MODE.get_or_init(|| {
        env::choice("LOWSYNC_CPU_QUANT_DOT", &["q16", "f32"], "q16 or f32")
            .map(|c| c != Some("f32"))
            .map_err(|e| e.to_string())
    })
    .clone()
}

/// The widest instruction set the q16 products may use (`LOWSYNC_CPU_QUANT_ISA`: `auto`, the
/// default, takes AVX-512 with VNNI where the CPU has it; `avx2` keeps the AVX2 bodies, for A/B
/// measurements), read once; a bad value is an error naming the variable.
fn q16_isa() -> std::result::Result<q16::Isa, String> {
    static ISA: OnceLock<std::result::Result<q16::Isa, String>> = OnceLock::new();
    ISA.get_or_init(|| {
        env::choice("LOWSYNC_CPU_QUANT_ISA", &["auto", "avx2"], "auto or avx2")
            .map(|c| match c {
                Some("avx2") => q16::Isa::Avx2,
                _ => q16::Isa::Avx512,
            })
            .map_err(|e| e.to_string())
    })
    .clone()
}

/// Whether products may run over packed copies of read-only weights (`LOWSYNC_CPU_PACK`:
/// `auto`, the default, packs where a `q16` body runs (AVX-512 VNNI, or AVX2 with FMA and
/// F16C) and the type has a packed layout; `off` keeps the in-place products), read once; a bad
/// value is an error naming the variable.
fn pack_allowed() -> std::result::Result<bool, String> {
    static MODE: OnceLock<std::result::Result<bool, String>> = OnceLock::new();
    MODE.get_or_init(|| {
        env::choice("LOWSYNC_CPU_PACK", &["auto", "off"], "auto or off")
            .map(|c| c != Some("off"))
            .map_err(|e| e.to_string())
    })
    .clone()
}

/// Which activation blocks a prefill product (at least `q16::PANEL_MIN_ROWS` activation rows)
/// takes (`LOWSYNC_CPU_PREFILL_ACT`): `q8` takes the 8-bit blocks of `q8` on every type with a
/// body for them (over packed groups: Q4_0, Q4_K, Q6_K; in place with AVX2: Q4_0, Q4_1, Q8_0,
/// Q4_K, Q6_K), `q16` keeps the 16-bit blocks of `q16`, and unset takes 8 bits on the types
/// where they were measured faster ([`q8_by_default`]); read once, a bad value is an error
/// naming the variable.
fn prefill_act() -> std::result::Result<Option<&'static str>, String> {
    static ACT: OnceLock<std::result::Result<Option<&'static str>, String>> = OnceLock::new();
    ACT.get_or_init(|| {
        env::choice("LOWSYNC_CPU_PREFILL_ACT", &["q8", "q16"], "q8 or q16")
            .map_err(|e| e.to_string())
    })
    .clone()
}

/// Whether a decode product (fewer than `q16::PANEL_MIN_ROWS` activation rows) run by the AVX2
/// bodies (in place, or over packed Q4_0, Q4_K and Q6_K groups) takes 8-bit activation blocks
/// (`LOWSYNC_CPU_DECODE_ACT`: `q16`, the default, or `q8`); read once, a bad value is an error
/// naming the variable.
fn decode_q8() -> std::result::Result<bool, String> {
    static ACT: OnceLock<std::result::Result<bool, String>> = OnceLock::new();
    ACT.get_or_init(|| {
        env::choice("LOWSYNC_CPU_DECODE_ACT", &["q16", "q8"], "q16 or q8")
            .map(|c| c == Some("q8"))
            .map_err(|e| e.to_string())
    })
    .clone()
}

/// Whether a prefill product over `dt` weights takes 8-bit activations when
/// `LOWSYNC_CPU_PREFILL_ACT` is unset: Q4_0, Q4_K and Q6_K, over packed groups (AVX-512 or AVX2)
/// or in place with AVX2. Q4_1 and Q8_0 keep 16 bits: their AVX2 8-bit bodies are faster too (1.3-1.7x per
/// block, `q8_speed`), but SmolLM2-135M Q4_1 (a Q8_0 output head) then moved its logits by 4%
/// of the largest against a float64 reference, where 16 bits stay within 1e-3.
fn q8_by_default(dt: lowsync_graph::DType) -> bool {
    matches!(
        dt,
        lowsync_graph::DType::Q4_0 | lowsync_graph::DType::Q4_K | lowsync_graph::DType::Q6_K
    )
}

/// Whether a product of `m` activation rows over `dt` weights takes 8-bit activations where a
/// body for them exists: prefill as `LOWSYNC_CPU_PREFILL_ACT` says, decode as
/// `LOWSYNC_CPU_DECODE_ACT` says where the AVX2 bodies run (never over groups packed for the
/// AVX-512 bodies, `packed512`).
fn takes_q8(
    dt: lowsync_graph::DType,
    m: usize,
    packed512: bool,
) -> std::result::Result<bool, String> {
    // Both read before the row count decides, so that a bad value is an error in any product.
    let (act, dec) = (prefill_act()?, decode_q8()?);
    if m < q16::PANEL_MIN_ROWS {
        return Ok(dec && !packed512);
    }
    Ok(match act {
        Some("q8") => true,
        Some(_) => false,
        None => q8_by_default(dt),
    })
}

/// A weight's packed copy: `groups` groups of [`GROUP`] rows, `group_bytes` each, back to back
/// from a 64-byte boundary.
struct PackedWeight {
    lines: Vec<Line>,
    group_bytes: usize,
    /// The packed rows: `n` rows of `k` values, row `j`'s raw blocks at `first + j * stride`.
    n: usize,
    k: usize,
    first: usize,
    stride: usize,
}

impl PackedWeight {
    /// Row `j`'s raw blocks, rebuilt from the copy into `out`; `false` where the type's
    /// layout has no inverse.
    fn raw_row(&self, dt: lowsync_graph::DType, j: usize, out: &mut [u8]) -> bool {
        let g = &lines_as_bytes(&self.lines)[j / GROUP * self.group_bytes..][..self.group_bytes];
        packed::raw_row(dt, g, self.k, j % GROUP, out)
    }
}

/// The packed copy of the weight whose rows a table view `table` (rows along axis 0, `d`
/// values each) reads, if a product already made one: a tied embedding's `get_rows` then reads
/// the copy, and the file pages released after packing stay released.
fn packed_table(table: &Strided, d: usize) -> Option<Arc<PackedWeight>> {
    let n = *table.shape().first()?;
    let first = table.quant_row(0, 0)?;
    let last = table.quant_row(0, n.checked_sub(1)?)?;
    let (a, end) = (first.as_ptr() as usize, last.as_ptr() as usize + last.len());
    let stride = if n > 1 {
        table.quant_row(0, 1)?.as_ptr() as usize - a
    } else {
        0
    };
    let range = read_only_at(first.as_ptr(), end - a)?;
    let dt = table.dtype();
    range
        .find_derived::<PackedWeight>(|key| {
            key.addr == a && key.dtype == dt && key.kind == "packed"
        })
        .filter(|p| p.n == n && p.k == d && p.first == a && (n == 1 || p.stride == stride))
}

/// The packed copy of the weight `w` (`x @ w.T` of `n` rows of `k`), made on first use and kept
/// while `w`'s buffer lives; `None` where `w` is not read-only memory (only read-only weights
/// are packed, so a copy never goes stale). After packing, the weight's own pages are released
/// where they are a read-only file mapping: the packed copy replaces them in resident memory.
fn packed_weight(
    w: &Strided,
    pt: &'static PackedType,
    n: usize,
    k: usize,
) -> Option<Arc<PackedWeight>> {
    let (first, last) = (w.quant_row(1, 0)?, w.quant_row(1, n - 1)?);
    let start = first.as_ptr();
    let len = (last.as_ptr() as usize + last.len()).checked_sub(start as usize)?;
    let range = read_only_at(start, len)?;
    let key = DerivedKey {
        addr: start as usize,
        shape: w.shape().to_vec(),
        strides: w.strides().to_vec(),
        dtype: w.dtype(),
        kind: "packed",
    };
    range.derived(key, || {
        let gb = (pt.group_bytes)(k);
        let groups = n.div_ceil(GROUP);
        let mut lines = vec![Line([0; 64]); (groups * gb).div_ceil(64)];
        let bytes = &mut lines_as_bytes_mut(&mut lines)[..groups * gb];
        // Chunk by chunk, each chunk's source pages released as soon as it is packed, so that
        // the source and the copy of a large weight (the output head) are not resident together.
        let (mut released, mut from) = (0, start as usize);
        for (c, chunk) in bytes.chunks_mut(PACK_CHUNK_GROUPS * gb).enumerate() {
            let g0 = c * PACK_CHUNK_GROUPS;
            chunk.par_chunks_mut(gb).enumerate().for_each(|(gi, dst)| {
                let rows: GroupRows<'_> = std::array::from_fn(|r| {
                    let j = (g0 + gi) * GROUP + r;
                    if j < n {
                        w.quant_row(1, j)
                    } else {
                        None
                    }
                });
                (pt.pack)(&rows, k, dst);
            });
            let last = ((g0 + chunk.len() / gb) * GROUP).min(n) - 1;
            if let Some(row) = w.quant_row(1, last) {
                let end = row.as_ptr() as usize + row.len();
                released += release_file_pages(from as *const u8, end - from);
                // The page that holds `end` goes with the next chunk.
                from = from.max(end / PAGE_BYTES * PAGE_BYTES);
            }
        }
        tracing::debug!(n, k, dtype = %w.dtype(), released, "cpu: packed a weight");
        let stride = match w.quant_row(1, 1.min(n - 1)) {
            Some(r) => r.as_ptr() as usize - start as usize,
            None => 0,
        };
        PackedWeight {
            lines,
            group_bytes: gb,
            n,
            k,
            first: start as usize,
            stride,
        }
    })
}

/// Groups packed before their source pages are released (64 groups of Q8_0 rows of 768: 816
/// KiB).
const PACK_CHUNK_GROUPS: usize = 64;

/// The page size the releases round to (a larger page only leaves a little more resident).
const PAGE_BYTES: usize = 4096;

/// Whether products over read-only `dt` weights run over packed copies here.
#[cfg(test)]
pub(crate) fn uses_packed(dt: lowsync_graph::DType) -> bool {
    uses_q16(dt) && pack_allowed().unwrap_or(false) && packed::packed_type(dt).is_some()
}

/// Whether products over packed `dt` weights run the AVX2 bodies (`PackedType::dot_avx2`)
/// here, not the AVX-512 ones.
#[cfg(test)]
pub(crate) fn packed_runs_avx2(dt: lowsync_graph::DType) -> bool {
    uses_packed(dt) && avx2_in_place()
}

#[cfg(test)]
/// Whether products over `dt` weights quantize the activations (`q16`) here: a SIMD kernel
/// for `dt` on this CPU and `LOWSYNC_CPU_QUANT_DOT` not `f32`.
pub(crate) fn uses_q16(dt: lowsync_graph::DType) -> bool {
    q16_allowed().unwrap_or(false) && q16::dot_fn(dt, q16::Isa::Avx2).is_some()
}

/// `x` (rows of `k`) times raw weight rows `w` of `dt` (`row_bytes` each) by this CPU's `q16`
/// body, called directly (`out[i * rows + r]`), where there is one.
#[cfg(all(test, target_arch = "aarch64"))]
pub(crate) fn q16_body_product(
    dt: lowsync_graph::DType,
    w: &[u8],
    row_bytes: usize,
    x: &[f32],
    m: usize,
) -> Option<Vec<f32>> {
    let dot = q16::dot_fn(dt, q16_isa().ok()?)?;
    let mut out = vec![0.0f32; w.len() / row_bytes * m];
    dot(w, row_bytes, &q16::QRows::quantize(x), &mut out);
    Some(out)
}

/// Whether a product of `m` activation rows over read-only `dt` weights takes 8-bit activation
/// blocks here.
#[cfg(test)]
pub(crate) fn uses_q8(dt: lowsync_graph::DType, m: usize) -> bool {
    if uses_packed(dt) {
        let dot8 = |pt: &PackedType| {
            if avx2_in_place() {
                pt.dot8_avx2.is_some()
            } else {
                pt.dot8.is_some()
            }
        };
        return packed::packed_type(dt).is_some_and(dot8)
            && takes_q8(dt, m, !avx2_in_place()).unwrap_or(false);
    }
    in_place_uses_q8(dt, m)
}

/// Whether a product of `m` activation rows over `dt` weights read in place (not packed) takes
/// 8-bit activation blocks here.
#[cfg(test)]
pub(crate) fn in_place_uses_q8(dt: lowsync_graph::DType, m: usize) -> bool {
    uses_q16(dt)
        && avx2_in_place()
        && q8::avx2_dot_fn(dt).is_some()
        && takes_q8(dt, m, false).unwrap_or(false)
}

/// Whether in-place products run the AVX2 bodies (no AVX-512 VNNI, or
/// `LOWSYNC_CPU_QUANT_ISA=avx2`).
fn avx2_in_place() -> bool {
    q16_isa() != Ok(q16::Isa::Avx512) || !q16::has_avx512()
}

/// The values a product of `m` activation rows reads for activations `x` (rows of `k`) over
/// read-only `dt` weights: `x` on the exact path, its 8-bit blocks dequantized (`d * q`) where
/// `uses_q8(dt, m)`, else its 16-bit blocks where `uses_q16(dt)`.
#[cfg(test)]
pub(crate) fn activations_as_read(dt: lowsync_graph::DType, x: &[f32], m: usize) -> Vec<f32> {
    if uses_q8(dt, m) {
        let xq = q8::Q8Rows::quantize(x);
        return (0..x.len())
            .map(|i| xq.d[i / q8::QK] * f32::from(xq.value(i / q8::QK, i % q8::QK)))
            .collect();
    }
    if !uses_q16(dt) {
        return x.to_vec();
    }
    let xq = q16::QRows::quantize(x);
    xq.q.iter()
        .enumerate()
        .map(|(i, &q)| xq.d[i / q16::QK] * f32::from(q))
        .collect()
}

/// `dot(a, b)` in a fixed order: 8 interleaved f32 partial sums, added pairwise at the end.
#[inline]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[i] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `dst[i, :] = dequantize(table[ids[i], :])`: only the rows read are dequantized.
pub(super) fn get_rows(
    node: &ExecNode,
    dst: &Strided,
    table: &Strided,
    rows: &[usize],
    d: usize,
) -> Result<()> {
    let dt = table.dtype();
    // Check every row is addressable before writing anything.
    if rows.iter().any(|&r| table.quant_row(0, r).is_none()) {
        return Err(kernel_err(
            node,
            format!(
                "the {dt} table {:?} (strides {:?}) is not a view of whole rows",
                table.shape(),
                table.strides()
            ),
        ));
    }
    let packed = packed_table(table, d);
    let raw_len = dt.row_bytes(d).unwrap_or(0);
    for_each_row(
        rows.len(),
        d,
        || (vec![0.0f32; d], vec![0u8; raw_len]),
        |(buf, raw), r| {
            if let Some(p) = &packed {
                if p.raw_row(dt, rows[r], raw) {
                    scalar::dequantize_row(dt, raw, buf);
                    dst.write_row(r, 0..d, buf);
                    return;
                }
            }
            if let Some(bytes) = table.quant_row(0, rows[r]) {
                scalar::dequantize_row(dt, bytes, buf);
                dst.write_row(r, 0..d, buf);
            }
        },
    );
    if packed.is_none() {
        // Read in place: the file pages mapped around the rows go again.
        let spans: Vec<(usize, usize)> = rows
            .iter()
            .filter_map(|&r| table.quant_row(0, r))
            .map(|b| (b.as_ptr() as usize, b.len()))
            .collect();
        release_rows_read(&spans);
    }
    Ok(())
}

/// `out[i, j] = sum_l x[i, l] * w[l, j]` for contiguous f32 activations `x [m, k]`, a 2-D
/// block-dtype view `w [k, n]` whose axis 0 is its block axis (`W.T` of a weight `W [n, k]`),
/// and a row-major `out [m, n]`.
pub(super) fn matmul(
    node: &ExecNode,
    x: &[f32],
    (m, n, k): (usize, usize, usize),
    w: &Strided,
    out: &mut [f32],
) -> Result<()> {
    let dt = w.dtype();
    let ok = x.len() == m * k
        && out.len() == m * n
        && w.shape() == [k, n]
        && (n == 0 || (w.quant_row(1, 0).is_some() && w.quant_row(1, n - 1).is_some()));
    if !ok {
        return Err(kernel_err(
            node,
            format!(
                "a {dt} weight must be read as `x @ w.T` with whole rows: x [{m}, {k}], w {:?} \
                 (strides {:?})",
                w.shape(),
                w.strides()
            ),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let fast = if q16_allowed().map_err(|e| kernel_err(node, e))? {
        let isa = q16_isa().map_err(|e| kernel_err(node, e))?;
        q16::dot_fn(dt, isa).filter(|_| k.is_multiple_of(q16::QK))
    } else {
        None
    };
    // A packed copy where a SIMD body runs (`fast`: AVX-512 VNNI, or AVX2 with FMA and F16C),
    // the type has a packed layout and the weight is read-only; its product is the AVX2 body
    // where the in-place products would be AVX2 ones.
    let packed = match fast {
        Some(_) if pack_allowed().map_err(|e| kernel_err(node, e))? => {
            packed::packed_type(dt).and_then(|pt| Some((pt, packed_weight(w, pt, n, k)?)))
        }
        _ => None,
    };
    let packed_avx2 = avx2_in_place();
    let packed_dot = packed
        .as_ref()
        .map(|(pt, _)| if packed_avx2 { pt.dot_avx2 } else { pt.dot });
    // Prefill products over packed Q4_0 / Q4_K / Q6_K take 8-bit activation blocks
    // (`vpdpbusd`: 4 products a lane against `vpdpwssd`'s 2); decode and the other types keep
    // the 16-bit ones. Where the AVX2 bodies read the weight in place, prefill products (and
    // decode with `LOWSYNC_CPU_DECODE_ACT=q8`) take the 8-bit bodies of `q8::avx2`
    // (`pmaddubsw`: 32 byte products an instruction against `pmaddwd`'s 16).
    let q8 = takes_q8(dt, m, packed.is_some() && !packed_avx2).map_err(|e| kernel_err(node, e))?;
    let dot8 = match &packed {
        Some((pt, _)) if q8 && packed_avx2 => pt.dot8_avx2,
        Some((pt, _)) if q8 => pt.dot8,
        _ => None,
    };
    let in_place8 = match (fast, &packed) {
        (Some(_), None) if q8 && avx2_in_place() => q8::avx2_dot_fn(dt),
        _ => None,
    };
    let x8 = if dot8.is_some() {
        Some(q8::Q8Rows::quantize(x))
    } else if in_place8.is_some() {
        Some(q8::Q8Rows::quantize_elements(x))
    } else {
        None
    };
    let xq = fast
        .filter(|_| x8.is_none())
        .map(|_| q16::QRows::quantize(x));
    // One job's weight rows: about JOB_WORK multiply-adds, never fewer than 1 row.
    // At least MIN_JOBS jobs, so that the threads finish together (9 jobs over 2 threads
    // left one idle for a ninth of a 768-row product), and a multiple of the kernel's tile of
    // weight rows (4 in decode, a panel of 16 in the AVX-512 prefill bodies).
    let granule = match (fast, q16_isa()) {
        _ if packed.is_some() => GROUP,
        (Some(_), Ok(isa)) => q16::row_granule(isa, m),
        _ => 4,
    };
    let rows_per_job = (JOB_WORK / (k * m).max(1))
        .min(n.div_ceil(MIN_JOBS))
        .max(1)
        .next_multiple_of(granule)
        .min(n);
    // Each job writes its own columns `j0..j0 + rows` of every output row straight into `out`
    // (one run of values per activation row). A result buffer of `n * m` for the whole
    // product, copied into `out` afterwards on the calling thread, cost a 16 MB zeroed
    // allocation and a serial copy per output-head product of a 128-token prefill.
    let dst = OutCols {
        ptr: out.as_mut_ptr(),
        n,
        m,
    };
    let n_jobs = n.div_ceil(rows_per_job);
    // `buf`: a packed group's results or a row's dequantized weights; `chunk`: the job's results,
    // activation row by activation row (`chunk[i * rows + jj]`: weight row `j0 + jj` times
    // activation row `i`), as the in-place bodies write them.
    let job = |jb: usize, (buf, chunk): &mut (Vec<f32>, Vec<f32>)| {
        let j0 = jb * rows_per_job;
        let rows = rows_per_job.min(n - j0);
        if let (Some((_, pw)), Some(pdot)) = (&packed, packed_dot) {
            // Jobs start on a group (rows_per_job is a multiple of GROUP).
            let gb = pw.group_bytes;
            let groups = lines_as_bytes(&pw.lines)[j0 / GROUP * gb..].chunks_exact(gb);
            buf.resize(GROUP * m, 0.0);
            for (gi, grp) in groups.take(rows.div_ceil(GROUP)).enumerate() {
                let (at, rn) = (gi * GROUP, (rows - gi * GROUP).min(GROUP));
                match (dot8, &x8, &xq) {
                    // SAFETY: `packed` exists only where `q16::dot_fn` found AVX2, FMA and F16C;
                    // the AVX-512 bodies (`dot`, `dot8`) are taken only where `avx2_in_place`
                    // is false, that is where `has_avx512` detected AVX-512 F/BW/VL and VNNI;
                    // `grp` is one group of `k`.
                    (Some(d8), Some(x8), _) => unsafe { d8(grp, k, x8, buf) },
                    (_, _, Some(xq)) if m == 1 && rn == GROUP => {
                        // SAFETY: as above; columns `j0 + at..` of row 0 are this job's.
                        unsafe { pdot(grp, k, xq, dst.run(0, j0 + at, GROUP)) };
                        continue;
                    }
                    // SAFETY: as above.
                    (_, _, Some(xq)) => unsafe { pdot(grp, k, xq, buf) },
                    _ => unreachable!("a packed product quantizes its activations"),
                }
                for i in 0..m {
                    // SAFETY: columns `j0 + at..j0 + at + rn` are this job's.
                    let run = unsafe { dst.run(i, j0 + at, rn) };
                    let src = &buf[i * GROUP..i * GROUP + rn];
                    // A whole group's 64 bytes as one fixed-size copy: a call to `memcpy` per
                    // row and group was 4% of a 128-token Q4_0 prefill.
                    if rn == GROUP {
                        let run: &mut [f32; GROUP] = run.try_into().expect("a whole group");
                        *run = src.try_into().expect("a whole group");
                    } else {
                        run.copy_from_slice(src);
                    }
                }
            }
            return;
        }
        chunk.clear();
        chunk.resize(rows * m, 0.0);
        let quant_rows = w.quant_rows(1, j0, rows).zip(dt.row_bytes(k));
        if let (Some(dot), Some(x8), Some((bytes, row_bytes))) = (in_place8, &x8, quant_rows) {
            dot(bytes, row_bytes, x8, chunk);
        } else if let (Some(dot), Some(xq), Some((bytes, row_bytes))) = (fast, &xq, quant_rows) {
            dot(bytes, row_bytes, xq, chunk);
        } else {
            let mut res = vec![0.0f32; m];
            for jj in 0..rows {
                let Some(bytes) = w.quant_row(1, j0 + jj) else {
                    continue;
                };
                if let (Some(dot), Some(x8)) = (in_place8, &x8) {
                    dot(bytes, bytes.len(), x8, &mut res);
                } else if let (Some(dot), Some(xq)) = (fast, &xq) {
                    dot(bytes, bytes.len(), xq, &mut res);
                } else {
                    buf.resize(k, 0.0);
                    scalar::dequantize_row(dt, bytes, buf);
                    for (i, r) in res.iter_mut().enumerate() {
                        *r = dot_f32(&x[i * k..(i + 1) * k], buf);
                    }
                }
                for (i, &r) in res.iter().enumerate() {
                    chunk[i * rows + jj] = r;
                }
            }
        }
        for (i, run) in chunk.chunks_exact(rows).enumerate() {
            // SAFETY: columns `j0..j0 + rows` are this job's.
            unsafe { dst.run(i, j0, rows) }.copy_from_slice(run);
        }
    };
    if n.saturating_mul(k).saturating_mul(m) <= PAR_MIN_ELEMS * 4 || n <= rows_per_job {
        let mut bufs = (Vec::new(), Vec::new());
        (0..n_jobs).for_each(|jb| job(jb, &mut bufs));
    } else {
        (0..n_jobs)
            .into_par_iter()
            .for_each_init(|| (Vec::new(), Vec::new()), |bufs, jb| job(jb, bufs));
    }
    Ok(())
}

/// A product's output `[m, n]` (row-major), shared by its jobs, each of which writes only its
/// own columns of every row.
struct OutCols {
    ptr: *mut f32,
    n: usize,
    m: usize,
}

// SAFETY: jobs write disjoint columns (see `OutCols::run`), and the output outlives them.
unsafe impl Sync for OutCols {}

impl OutCols {
    /// Columns `j..j + len` of output row `i`.
    ///
    /// # Safety
    /// No other job reads or writes those columns while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn run(&self, i: usize, j: usize, len: usize) -> &mut [f32] {
        assert!(i < self.m && j + len <= self.n, "a run inside the output");
        // SAFETY: in bounds (checked above) of the `m * n` output; exclusive per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.n + j), len) }
    }
}

/// The rows of a float view `a [m, k]` as contiguous f32.
pub(super) fn rows_f32(a: &Strided) -> Vec<f32> {
    let (m, k) = (a.rows(), a.last_len());
    let mut x = vec![0.0f32; m * k];
    if k > 0 {
        for (r, row) in x.chunks_exact_mut(k).enumerate() {
            a.read_row(r, 0..k, row);
        }
    }
    x
}
