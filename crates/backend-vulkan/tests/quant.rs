//! Quantized (GGUF block) weights on Vulkan: `x @ w.T` and `get_rows` over every block type
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS), against the CPU backend (the
//! oracle) and against a float64 product of the blocks' values (dequantized here from the GGUF
//! layout for Q4_0/Q4_1/Q8_0, by the CPU's scalar oracle for the rest), at decode shapes (one
//! row of x, odd row counts, k of one to many blocks, a weight starting mid-word) and a few
//! rows of x (prefill).
//! Both reductions (subgroups and shared memory) run; the validation layer stays silent, and a
//! step over quantized weights counts exactly what the same step over f16 weights counts.

mod common;

use std::sync::Arc;

use half::f16;
use lowsync_backend::{Backend, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_cpu::CpuBackend;
use lowsync_graph::{DType, Op};
use lowsync_vulkan::{QuantMatMul, QuantMatVec, SplitK, VkConfig, VulkanBackend, VK_QUANTS};

/// A deterministic xorshift stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Byte offsets of a block type's f16 fields (super-)scale first, then the min where it has one.
fn f16_fields(dt: DType) -> &'static [usize] {
    match dt {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

/// Whether an element is `scale * q + min` (a device may fuse the add into one rounding).
fn has_min(dt: DType) -> bool {
    f16_fields(dt).len() == 2
}

/// `rows` rows of `k` elements of random blocks of `dt`: any quants and sub-block scales,
/// f16 scales around 0.05 and mins around 0 (finite, so every value is).
fn blocks(dt: DType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let n = rows * k / dt.block_size();
    let mut out = Vec::with_capacity(n * dt.block_bytes());
    for _ in 0..n {
        let mut b: Vec<u8> = (0..dt.block_bytes()).map(|_| rng.next() as u8).collect();
        for (i, &off) in f16_fields(dt).iter().enumerate() {
            let v = if i == 0 {
                0.05 * rng.unit() + 0.01
            } else {
                0.1 * rng.unit()
            };
            b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        out.extend(b);
    }
    out
}

/// The blocks of the three legacy types dequantized as GGUF defines them (written from the
/// format, not from a kernel); `None` for the others, whose reference values are the CPU
/// oracle's dequantization (`reference_values`).
fn dequantize(dt: DType, bytes: &[u8]) -> Option<Vec<f64>> {
    if !matches!(dt, DType::Q4_0 | DType::Q4_1 | DType::Q8_0) {
        return None;
    }
    let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f64();
    let mut out = Vec::new();
    for b in bytes.chunks_exact(dt.block_bytes()) {
        let d = f16_at(b, 0);
        for j in 0..32 {
            out.push(match dt {
                DType::Q4_0 => {
                    let q = if j < 16 {
                        b[2 + j] & 15
                    } else {
                        b[2 + j - 16] >> 4
                    };
                    (f64::from(q) - 8.0) * d
                }
                DType::Q4_1 => {
                    let q = if j < 16 {
                        b[4 + j] & 15
                    } else {
                        b[4 + j - 16] >> 4
                    };
                    f64::from(q) * d + f16_at(b, 2)
                }
                _ => f64::from(b[2 + j] as i8) * d,
            });
        }
    }
    Some(out)
}

/// The values of `rows` rows of `k` elements of `dt` blocks: from the format for the legacy
/// types, else as the CPU backend's `get_rows` dequantizes them (its scalar oracle is checked
/// bit for bit against `gguf.quants` in lowsync-cpu).
fn reference_values(cpu: &CpuBackend, dt: DType, w: &[u8], rows: usize, k: usize) -> Vec<f64> {
    if let Some(v) = dequantize(dt, w) {
        return v;
    }
    let ids: Vec<i32> = (0..rows as i32).collect();
    let wb = common::buffer_with(cpu, w);
    let ib = common::buffer_with(cpu, &common::i32_bytes(&ids));
    let db = cpu
        .alloc_buffer(rows * k * 4, BufferUsage::Compute)
        .unwrap();
    let g = common::graph(
        Op::GetRows,
        common::contiguous(db, DType::F32, &[rows, k]),
        vec![
            common::contiguous(wb, dt, &[rows, k]),
            common::contiguous(ib, DType::I32, &[rows]),
        ],
    );
    cpu.graph_compute_async(&g).unwrap();
    cpu.synchronize().unwrap();
    let out = common::read_f32(cpu, db, rows * k);
    for id in [wb, ib, db] {
        cpu.free_buffer(id);
    }
    out.into_iter().map(f64::from).collect()
}

fn f32s(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.unit()).collect()
}

fn nmse(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - w).powi(2);
        den += w * w;
    }
    num / den.max(1e-300)
}

/// One product case: x [batch, m, k] f32 @ w.T, w [n, k] of `dt` (or [batch, n, k]) starting
/// `lead` rows into its buffer (a row slice of a larger weight; Q4_0/Q8_0 rows of an odd block
/// count start mid-word). A batch of 1 is no batch axis at all.
struct Product {
    dt: DType,
    m: usize,
    n: usize,
    k: usize,
    lead: usize,
    /// x is a transposed view (strides [1, m] in each batch: not contiguous along k).
    xt: bool,
    /// Batches of x (a leading axis when above 1).
    batch: usize,
    /// w has the batch axis too (consecutive [n, k] matrices); else one w serves every batch.
    w_batched: bool,
}

impl Product {
    /// A product without batch axes.
    fn plain(dt: DType, (m, n, k): (usize, usize, usize), lead: usize, xt: bool) -> Self {
        Product {
            dt,
            m,
            n,
            k,
            lead,
            xt,
            batch: 1,
            w_batched: false,
        }
    }

    /// Rows of w the weight bytes hold after the `lead` rows.
    fn w_rows(&self) -> usize {
        if self.w_batched {
            self.batch * self.n
        } else {
            self.n
        }
    }

    /// x (`batch * m * k` values, row-major [batch, m, k]) @ w.T on `b`, as [batch, m, n].
    fn run(&self, b: &dyn Backend, w: &[u8], x: &[f32]) -> Vec<f32> {
        let (m, n, k) = (self.m, self.n, self.k);
        let row = self.dt.row_bytes(k).expect("whole blocks");
        let wb = common::buffer_with(b, w);
        let (xs, mut x_strides) = if self.xt {
            let t: Vec<f32> = (0..self.batch * k * m)
                .map(|i| {
                    let (bi, j) = (i / (k * m), i % (k * m));
                    x[bi * m * k + (j % m) * k + j / m]
                })
                .collect();
            (t, vec![1, m])
        } else {
            (x.to_vec(), vec![k, 1])
        };
        let xb = common::buffer_with(b, &common::f32_bytes(&xs));
        let db = b
            .alloc_buffer(self.batch * m * n * 4, BufferUsage::Compute)
            .unwrap();
        let (mut x_shape, mut d_shape) = (vec![m, k], vec![m, n]);
        let (mut w_shape, mut w_strides) = (vec![k, n], vec![1, k]);
        if self.batch > 1 {
            x_shape.insert(0, self.batch);
            x_strides.insert(0, m * k);
            d_shape.insert(0, self.batch);
            if self.w_batched {
                w_shape.insert(0, self.batch);
                w_strides.insert(0, n * k);
            }
        }
        let wt = TensorRef {
            buffer: wb,
            byte_offset: self.lead * row,
            dtype: self.dt,
            shape: w_shape,
            strides: w_strides,
        };
        let g = common::graph(
            Op::MulMat,
            common::contiguous(db, DType::F32, &d_shape),
            vec![
                TensorRef {
                    buffer: xb,
                    byte_offset: 0,
                    dtype: DType::F32,
                    shape: x_shape,
                    strides: x_strides,
                },
                wt,
            ],
        );
        b.graph_compute_async(&g).unwrap();
        b.synchronize().unwrap();
        let out = common::read_f32(b, db, self.batch * m * n);
        for id in [wb, xb, db] {
            b.free_buffer(id);
        }
        out
    }

    /// The product in float64 over the weight's values `wd` (`w_rows` rows from `lead`).
    fn reference(&self, x: &[f32], wd: &[f64]) -> Vec<f64> {
        let (m, n, k) = (self.m, self.n, self.k);
        (0..self.batch * m * n)
            .map(|e| {
                let (bi, r, c) = (e / (m * n), (e / n) % m, e % n);
                let wrow = if self.w_batched { bi * n + c } else { c };
                let xr = &x[(bi * m + r) * k..][..k];
                let wr = &wd[wrow * k..][..k];
                xr.iter().zip(wr).map(|(&a, &w)| f64::from(a) * w).sum()
            })
            .collect()
    }

    /// Failures of the product on `vk` against float64 and against the CPU oracle.
    fn check(&self, vk: &VulkanBackend, cpu: &CpuBackend, seed: u64) -> Option<String> {
        // f32 accumulation in another order than float64: ~1e-13. The CPU backend's 16-bit
        // activation blocks stay within 2.4e-4 of the range: ~1e-8; its prefill products (6 or
        // more activation rows) may take 8-bit blocks (`LOWSYNC_CPU_PREFILL_ACT`: Q4_0, Q4_K
        // and Q6_K by default on CPUs without AVX-512 VNNI), ~1e-5.
        let cpu_bound = if self.m >= 6 { 1e-4 } else { 1e-6 };
        self.check_within(vk, cpu, seed, 1e-10, cpu_bound)
    }

    /// `check` with the NMSE bounds against float64 and against the CPU oracle given.
    fn check_within(
        &self,
        vk: &VulkanBackend,
        cpu: &CpuBackend,
        seed: u64,
        bound64: f64,
        cpu_bound: f64,
    ) -> Option<String> {
        let (dt, k) = (self.dt, self.k);
        let w = blocks(dt, self.lead + self.w_rows(), k, 7 + seed);
        let mut rng = Rng(1234 + seed);
        let x = f32s(&mut rng, self.batch * self.m * k);
        let lead_bytes = self.lead * dt.row_bytes(k).unwrap();
        let wd = reference_values(cpu, dt, &w[lead_bytes..], self.w_rows(), k);
        let want = self.reference(&x, &wd);
        let got = self.run(vk, &w, &x);
        let oracle = self.run(cpu, &w, &x);
        let (e64, ecpu) = (
            nmse(&got, &want),
            nmse(
                &got,
                &oracle.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
            ),
        );
        let ok = !e64.is_nan() && e64 <= bound64 && !ecpu.is_nan() && ecpu <= cpu_bound;
        (!ok).then(|| {
            format!(
                "{dt} batch={} (w batched {}) m={} n={} k={k} lead={} xt={}: NMSE vs float64 \
                 {e64:.2e}, vs cpu {ecpu:.2e} (got {:?}, want {:?})",
                self.batch,
                self.w_batched,
                self.m,
                self.n,
                self.lead,
                self.xt,
                &got[..got.len().min(3)],
                &want[..want.len().min(3)]
            )
        })
    }
}

/// The NMSE bound against float64 of the one-row products: the integer-dot body (`idot`)
/// quantizes x to 16 bits per block of 32 (within 1.5e-5 of each block's largest value), as the
/// CPU oracle's one-row products do (a one-element row of one block, where the sum cancels,
/// measured 2.6e-8); the f32 bodies stay near 1e-13.
fn one_row_bound64(idot: bool) -> f64 {
    if idot {
        1e-6
    } else {
        1e-10
    }
}

/// Every block type's products against float64 and the CPU oracle, the one-row products within
/// `bound64` of float64 (`one_row_bound64`).
fn products_within(vk: &VulkanBackend, cpu: &CpuBackend, bound64: f64) -> Vec<String> {
    let mut failures = Vec::new();
    // (m, n, blocks per row, lead rows, x transposed): one block to many, odd row counts, a
    // weight starting mid-word (most block sizes are not a multiple of 4 bytes), several rows
    // of x (small batches, prefill: 8 rows per workgroup, a last workgroup with fewer), and an
    // x not contiguous along k (one row per workgroup); rows of 160 and 300 blocks take every
    // round of `mul_mat_vec_qw` (four quarters a lane, two, one).
    let shapes = [
        (1, 1, 1, 0, false),
        (1, 7, 2, 1, false),
        (1, 13, 3, 3, false),
        (1, 37, 5, 0, false),
        (1, 64, 18, 1, false),
        (1, 9, 48, 2, false),
        (1, 5, 160, 1, false),
        (1, 3, 300, 0, false),
        (3, 11, 3, 1, false),
        (8, 6, 2, 2, false),
        (9, 5, 2, 0, false),
        (17, 3, 1, 1, false),
        (5, 7, 2, 1, true),
    ];
    for &dt in VK_QUANTS {
        for (i, &(m, n, nb, lead, xt)) in shapes.iter().enumerate() {
            let p = Product::plain(dt, (m, n, nb * dt.block_size()), lead, xt);
            let cpu_bound = if m >= 6 { 1e-4 } else { 1e-6 };
            let bound = if m == 1 { bound64 } else { 1e-10 };
            failures.extend(p.check_within(vk, cpu, i as u64, bound, cpu_bound));
        }
    }
    failures
}

fn get_rows(vk: &VulkanBackend, cpu: &CpuBackend) -> Vec<String> {
    let mut failures = Vec::new();
    let rows = 11;
    let ids = [3i32, 0, 10, 3, 7];
    for &dt in VK_QUANTS {
        let k = 3 * dt.block_size();
        for dst_dt in [DType::F32, DType::F16] {
            let w = blocks(dt, rows, k, 99);
            let run = |b: &dyn Backend| {
                let wb = common::buffer_with(b, &w);
                let ib = common::buffer_with(b, &common::i32_bytes(&ids));
                let db = b
                    .alloc_buffer(ids.len() * k * 4, BufferUsage::Compute)
                    .unwrap();
                let g = common::graph(
                    Op::GetRows,
                    common::contiguous(db, dst_dt, &[ids.len(), k]),
                    vec![
                        common::contiguous(wb, dt, &[rows, k]),
                        common::contiguous(ib, DType::I32, &[ids.len()]),
                    ],
                );
                b.graph_compute_async(&g).unwrap();
                b.synchronize().unwrap();
                let mut out = vec![0u8; ids.len() * k * dst_dt.size_bytes()];
                b.get_tensor(db, 0, &mut out).unwrap();
                out
            };
            let (got, want) = (run(vk), run(cpu));
            // Dequantization is one multiply (and an add for a type with a min, which a device
            // may fuse into one rounding): bit-identical except for that fused add.
            let same = if has_min(dt) && dst_dt == DType::F32 {
                let f = |b: &[u8]| -> Vec<f32> {
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect()
                };
                f(&got)
                    .iter()
                    .zip(f(&want))
                    .all(|(g, w)| (g - w).abs() <= 1e-6 * w.abs().max(1e-3))
            } else if has_min(dt) {
                got.chunks_exact(2).zip(want.chunks_exact(2)).all(|(g, w)| {
                    let (g, w) = (
                        f16::from_le_bytes([g[0], g[1]]).to_f32(),
                        f16::from_le_bytes([w[0], w[1]]).to_f32(),
                    );
                    (g - w).abs() <= 1e-3 * w.abs().max(1e-3)
                })
            } else {
                got == want
            };
            if !same {
                failures.push(format!("get_rows {dt} -> {dst_dt}: differs from the cpu"));
            }
        }
    }
    failures
}

/// Prefill-shaped products (many rows of x), where block weights take the prefill kernel
/// (`mul_mat_q` or `mul_mat_qt`) from 16 rows: row counts on both sides of that threshold and
/// of the 32- and 64-row tiles, result columns not a multiple of 64, one block to several (K-quants: k a multiple of
/// 256), a weight starting mid-word, an x not contiguous along k, and batch axes with w
/// batched or broadcast.
/// `few`: three of the shapes (a row count on the threshold, one past a 64-row tile, batches),
/// for a layout whose kernel lavapipe runs slowly.
fn tiled_products(vk: &VulkanBackend, cpu: &CpuBackend, few: bool) -> Vec<String> {
    // (m, n, blocks per row, lead rows, x transposed, batches, w batched)
    let shapes = [
        (9, 70, 1, 1, false, 1, false),
        (16, 65, 2, 0, false, 1, false),
        (33, 100, 3, 3, false, 1, false),
        (64, 64, 1, 0, false, 1, false),
        (65, 129, 2, 1, false, 1, false),
        (130, 40, 4, 2, true, 1, false),
        (200, 77, 5, 1, false, 1, false),
        (40, 66, 2, 1, false, 3, true),
        (24, 33, 1, 0, false, 2, false),
    ];
    let mut failures = Vec::new();
    for &dt in VK_QUANTS {
        for (i, &(m, n, nb, lead, xt, batch, w_batched)) in shapes.iter().enumerate() {
            if few && ![1, 4, 7].contains(&i) {
                continue;
            }
            let p = Product {
                batch,
                w_batched,
                ..Product::plain(dt, (m, n, nb * dt.block_size()), lead, xt)
            };
            failures.extend(p.check(vk, cpu, 100 + i as u64));
        }
    }
    failures
}

/// The tiled product's results do not depend on where its tile edges fall: rows 50 .. 130 of x
/// against rows 20 .. 100 of w (shifted off the tiles of 32 or 64 rows of x and 64 of w) give bit for bit the
/// elements of the full 130 x 100 product.
fn tile_edges(vk: &VulkanBackend) -> Vec<String> {
    let (m, n, lead, dr, dc) = (130, 100, 1, 50, 20);
    let mut failures = Vec::new();
    for &dt in VK_QUANTS {
        let k = 2 * dt.block_size();
        let w = blocks(dt, lead + n, k, 41);
        let x = f32s(&mut Rng(42), m * k);
        let full = Product::plain(dt, (m, n, k), lead, false).run(vk, &w, &x);
        let part =
            Product::plain(dt, (m - dr, n - dc, k), lead + dc, false).run(vk, &w, &x[dr * k..]);
        let same = (0..m - dr)
            .all(|r| (0..n - dc).all(|c| part[r * (n - dc) + c] == full[(r + dr) * n + c + dc]));
        if !same {
            failures.push(format!("{dt}: a shifted tile changed the results"));
        }
    }
    failures
}

fn suite(cfg: VkConfig) {
    let Some(vk) = common::open(cfg) else {
        return;
    };
    let cpu = CpuBackend::new();
    // A GPU with hardware integer dot products runs the one-row products of the types that
    // have them as `idot` by default.
    let idot = vk.quant_mat_vec() == QuantMatVec::Idot && vk.has_integer_dot();
    let mut failures = products_within(&vk, &cpu, one_row_bound64(idot));
    failures.extend(get_rows(&vk, &cpu));
    common::assert_clean(&vk);
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn quantized_products_and_rows_match_the_cpu_oracle() {
    suite(common::config());
}

#[test]
fn quantized_products_and_rows_match_the_cpu_oracle_without_subgroups() {
    suite(VkConfig {
        no_subgroups: true,
        ..common::config()
    });
}

/// `LOWSYNC_VK_QV=group`, `block`, `rows` and `idot` side by side in one process: every block
/// type's products match the CPU oracle under each, and the one-row products take the
/// whole-block kernel (`mul_mat_vec_qb`) exactly when it is asked for, the integer-dot kernel
/// (`mul_mat_vec_qd`) exactly when it is asked for, the device has it and the type is Q4_0,
/// Q4_1, Q8_0, Q4_K or Q6_K, and the two-row kernel (`mul_mat_vec_qw`) for the other 32-element types
/// under `rows` or `idot`.
#[test]
fn every_block_mat_vec_body_matches_the_cpu_oracle() {
    let cpu = CpuBackend::new();
    for body in [
        QuantMatVec::Group,
        QuantMatVec::Block,
        QuantMatVec::Rows,
        QuantMatVec::Idot,
    ] {
        let Some(vk) = common::open(VkConfig {
            quant_mat_vec: Some(body),
            profile: true,
            ..common::config()
        }) else {
            return;
        };
        let failures = products_within(&vk, &cpu, one_row_bound64(body == QuantMatVec::Idot));
        assert!(
            failures.is_empty(),
            "{body:?}: {} case(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
        let names: Vec<String> = vk.kernel_times().into_iter().map(|t| t.name).collect();
        let ran = |family: &str, dt: DType| {
            let suffix = format!(".b_{}", dt.name());
            names
                .iter()
                .any(|n| n.starts_with(&format!("{family}.")) && n.ends_with(&suffix))
        };
        // Both bodies need subgroups and 256-invocation workgroups; a device without them runs
        // neither, and the products above were checked on the kernels it has.
        let one_row_16b = VK_QUANTS.iter().any(|&dt| {
            [
                "mul_mat_vec_qv",
                "mul_mat_vec_qb",
                "mul_mat_vec_qw",
                "mul_mat_vec_qd",
            ]
            .iter()
            .any(|f| ran(f, dt))
        });
        if !one_row_16b {
            eprintln!("{body:?}: this device runs no one-row body; kernel choice unchecked");
        }
        if body == QuantMatVec::Idot && !vk.has_integer_dot() {
            eprintln!("Idot: this device has no integer dot products; the two-row body ran");
        }
        for &dt in VK_QUANTS.iter().filter(|_| one_row_16b) {
            let whole = body == QuantMatVec::Block;
            let qd = body == QuantMatVec::Idot
                && vk.has_integer_dot()
                && matches!(
                    dt,
                    DType::Q4_0 | DType::Q4_1 | DType::Q8_0 | DType::Q4_K | DType::Q6_K
                );
            let rows =
                matches!(body, QuantMatVec::Rows | QuantMatVec::Idot) && dt.block_size() == 32;
            assert_eq!(ran("mul_mat_vec_qb", dt), whole, "{body:?} {dt}: {names:?}");
            assert_eq!(ran("mul_mat_vec_qd", dt), qd, "{body:?} {dt}: {names:?}");
            if !qd {
                // Where k is past 8,192 (two cases of `products`) the integer-dot types take
                // what `rows` takes, so the two-row kernel is checked for the others only.
                assert_eq!(ran("mul_mat_vec_qw", dt), rows, "{body:?} {dt}: {names:?}");
            }
            assert_eq!(
                ran("mul_mat_vec_qv", dt),
                !whole && !rows,
                "{body:?} {dt}: {names:?}"
            );
        }
        common::assert_clean(&vk);
    }
}

/// The integer-dot products give the oracle's results whatever rows each workgroup takes
/// (`LOWSYNC_VK_QD_ROWS`): one (most subgroups idle), three (fewer than its subgroups, a last
/// workgroup short) and 100 (several rows a subgroup, past every product's row count here).
#[test]
fn the_integer_dot_products_match_at_any_rows_per_workgroup() {
    let cpu = CpuBackend::new();
    // Without subgroups the integer-dot products cannot run: asking for them then falls back
    // to the f32 bodies, which must give their own (tighter) bound; that case runs on every
    // device, so a device without integer dot products still checks something.
    for (rows, no_subgroups) in [(1, false), (3, false), (100, false), (8, true)] {
        let Some(vk) = common::open(VkConfig {
            quant_mat_vec: Some(QuantMatVec::Idot),
            qd_rows: Some(rows),
            no_subgroups,
            profile: true,
            ..common::config()
        }) else {
            return;
        };
        let idot = vk.has_integer_dot();
        if no_subgroups {
            assert!(!idot, "integer-dot products offered without subgroups");
        }
        let failures = products_within(&vk, &cpu, one_row_bound64(idot));
        assert!(
            failures.is_empty(),
            "{rows} rows (integer dot {idot}): {} case(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
        let names: Vec<String> = vk.kernel_times().into_iter().map(|t| t.name).collect();
        assert_eq!(
            names.iter().any(|n| n.starts_with("mul_mat_vec_qd.")),
            idot,
            "{rows} rows: the integer-dot products ran if and only if the device has them: {names:?}"
        );
        common::assert_clean(&vk);
    }
}

/// Under `rows`, a one-row Q4_0 product of 131,073 rows (a head past 2 x 65,535, Vulkan's
/// minimum workgroup count along x, as a 152,064-token vocabulary is) matches the CPU oracle and
/// takes the two-row kernel only where the device dispatches that many workgroups; elsewhere
/// (lavapipe) the group body, instead of failing.
#[test]
fn a_head_too_wide_for_two_rows_a_workgroup_takes_the_group_body() {
    let Some(vk) = common::open(VkConfig {
        quant_mat_vec: Some(QuantMatVec::Rows),
        profile: true,
        ..common::config()
    }) else {
        return;
    };
    let cpu = CpuBackend::new();
    let n = 2 * 65_535 + 3;
    let p = Product::plain(DType::Q4_0, (1, n, 64), 0, false);
    if let Some(f) = p.check(&vk, &cpu, 5) {
        panic!("{f}");
    }
    let names: Vec<String> = vk.kernel_times().into_iter().map(|t| t.name).collect();
    let ran = |family: &str| names.iter().any(|n| n.starts_with(&format!("{family}.")));
    let two_rows = n.div_ceil(2) <= vk.max_group_count()[0] as usize;
    assert_eq!(ran("mul_mat_vec_qw"), two_rows, "{names:?}");
    assert_eq!(ran("mul_mat_vec_qv"), !two_rows, "{names:?}");
    common::assert_clean(&vk);
}

/// Every block type's prefill products match the CPU oracle and float64 under both layouts
/// (`LOWSYNC_VK_QMM`: `rows`, 64 invocations a workgroup, which every Vulkan device allows,
/// x shared through the subgroup where the device has shuffles (`mul_mat_q_s`) and read by
/// every invocation with subgroups off (`mul_mat_q`); `tiles`, 256), take that layout's
/// kernel, and do not depend on the tile edges; the validation layer stays silent.
#[test]
fn tiled_quantized_products_match_the_cpu_oracle() {
    // Lavapipe runs the 256-invocation tiles about ten times slower than the rows; the tile
    // edges and three shapes cover their loader. The subgroup-less rows read x the slow way
    // there too; they give the shuffling kernel's bits (`rows_share_x_bit_for_bit`).
    // The tiles split over k too (`LOWSYNC_VK_SPLIT_K=3`, the partials then `split_sum`).
    for (layout, no_subgroups, tile, split_k, kernel, few) in [
        (
            QuantMatMul::Rows,
            false,
            4,
            SplitK::Off,
            "mul_mat_q_s",
            false,
        ),
        (QuantMatMul::Rows, true, 4, SplitK::Off, "mul_mat_q", true),
        (
            QuantMatMul::Tiles,
            false,
            4,
            SplitK::Off,
            "mul_mat_qt",
            true,
        ),
        (
            QuantMatMul::Tiles,
            false,
            8,
            SplitK::Off,
            "mul_mat_qt8",
            true,
        ),
        (
            QuantMatMul::Tiles,
            false,
            4,
            SplitK::Fixed(3),
            "mul_mat_qt",
            true,
        ),
    ] {
        let Some(vk) = common::open(VkConfig {
            profile: true,
            quant_mat_mul: Some(layout),
            no_subgroups,
            tile,
            split_k,
            ..common::config()
        }) else {
            return;
        };
        // A device without subgroup shuffles runs `mul_mat_q` for `rows` either way.
        let kernel = if kernel == "mul_mat_q_s" && !vk.has_subgroup_shuffles() {
            "mul_mat_q"
        } else {
            kernel
        };
        let cpu = CpuBackend::new();
        let mut failures = tiled_products(&vk, &cpu, few);
        failures.extend(tile_edges(&vk));
        assert!(
            failures.is_empty(),
            "{kernel}: {} case(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
        let names: Vec<String> = vk.kernel_times().into_iter().map(|t| t.name).collect();
        for &dt in VK_QUANTS {
            let name = format!("{kernel}.d_f32.a_f32.b_{}", dt.name());
            assert!(names.contains(&name), "{name} did not run: {names:?}");
        }
        let summed = names.iter().any(|n| n.starts_with("split_sum."));
        assert_eq!(summed, split_k != SplitK::Off, "{kernel}: {names:?}");
        common::assert_clean(&vk);
    }
}

/// The tiled prefill product over block weights gives the same bits with 8x8 outputs per
/// invocation (`LOWSYNC_VK_TILE=8`, `mul_mat_qt8`) as with 4x4 (`mul_mat_qt`): every block
/// type, a row count past a 64-row tile, columns past a 64-column tile, batches.
#[test]
fn eight_by_eight_block_tiles_give_the_four_by_four_bits() {
    let open = |tile| {
        common::open(VkConfig {
            quant_mat_mul: Some(QuantMatMul::Tiles),
            tile,
            ..common::config()
        })
    };
    let (Some(four), Some(eight)) = (open(4), open(8)) else {
        return;
    };
    let mut failures = Vec::new();
    for &dt in VK_QUANTS {
        for (i, (m, n, nb, batch)) in [(70, 129, 2, 1), (17, 40, 1, 2)].into_iter().enumerate() {
            let p = Product {
                batch,
                w_batched: batch > 1,
                ..Product::plain(dt, (m, n, nb * dt.block_size()), 1, false)
            };
            let w = blocks(dt, 1 + p.w_rows(), p.k, 60 + i as u64);
            let x = f32s(&mut Rng(61 + i as u64), batch * m * p.k);
            let (a, b) = (p.run(&four, &w, &x), p.run(&eight, &w, &x));
            if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                failures.push(format!("{dt} {m}x{n}, {batch} batches: the bits differ"));
            }
        }
    }
    common::assert_clean(&four);
    common::assert_clean(&eight);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The `rows` prefill product gives the same bits whether x reaches its invocations through
/// subgroup shuffles or by each invocation's own loads: row counts that leave a partial run of
/// rows per load (1, 3, 17, 31 past a tile), an x not contiguous along k, batches.
#[test]
fn rows_share_x_bit_for_bit() {
    let open = |no_subgroups| {
        common::open(VkConfig {
            quant_mat_mul: Some(QuantMatMul::Rows),
            no_subgroups,
            ..common::config()
        })
    };
    let (Some(shared), Some(own)) = (open(false), open(true)) else {
        return;
    };
    if !shared.has_subgroup_shuffles() {
        eprintln!("skipped: the device has no subgroup shuffles");
        return;
    }
    let mut failures = Vec::new();
    for &dt in VK_QUANTS {
        for (i, &(m, n, nb, lead, xt, batch)) in [
            (17, 70, 2, 1, false, 1),
            (33, 65, 1, 0, false, 1),
            (63, 64, 3, 2, true, 1),
            (35, 40, 1, 0, false, 2),
        ]
        .iter()
        .enumerate()
        {
            let p = Product {
                batch,
                ..Product::plain(dt, (m, n, nb * dt.block_size()), lead, xt)
            };
            let w = blocks(dt, lead + p.w_rows(), p.k, 300 + i as u64);
            let x = f32s(&mut Rng(400 + i as u64), batch * m * p.k);
            let (a, b) = (p.run(&shared, &w, &x), p.run(&own, &w, &x));
            let same =
                a.len() == b.len() && a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits());
            if !same {
                failures.push(format!("{dt} {m}x{n}: the two kernels' results differ"));
            }
        }
    }
    common::assert_clean(&shared);
    common::assert_clean(&own);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The prefill products on cooperative matrices (`LOWSYNC_VK_COOPMAT`). Where the device has
/// them, every block type's products run `mul_mat_qcm` and match float64 and the oracle within
/// the f16 rounding of x and w (about 1e-7 of NMSE, bound 1e-5); where it does not (lavapipe),
/// asking for them changes nothing: the device's own prefill kernels run, to their usual
/// bounds. Rows of x and w on both sides of the 64x64 tile, an x not contiguous along k, a
/// weight starting mid-word.
#[test]
fn coopmat_products_match_where_the_device_has_them() {
    let Some(vk) = common::open(VkConfig {
        profile: true,
        coopmat: true,
        ..common::config()
    }) else {
        return;
    };
    let cm = vk.has_coopmat();
    if !cm {
        eprintln!(
            "{} has no cooperative matrices for the products: checking the fallback",
            vk.device_name()
        );
    }
    let (bound64, cpu_bound) = if cm { (1e-5, 1e-4) } else { (1e-10, 1e-4) };
    let cpu = CpuBackend::new();
    let mut failures = Vec::new();
    for &dt in VK_QUANTS {
        for (i, &(m, n, nb, lead, xt)) in [
            (16, 65, 2, 1, false),
            (70, 130, 3, 0, false),
            (33, 64, 1, 2, true),
        ]
        .iter()
        .enumerate()
        {
            let p = Product::plain(dt, (m, n, nb * dt.block_size()), lead, xt);
            failures.extend(p.check_within(&vk, &cpu, 500 + i as u64, bound64, cpu_bound));
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let names: Vec<String> = vk.kernel_times().into_iter().map(|t| t.name).collect();
    let ran = |f: &str| names.iter().any(|n| n.starts_with(&format!("{f}.")));
    assert_eq!(ran("mul_mat_qcm"), cm, "{names:?}");
    common::assert_clean(&vk);
}

#[test]
fn quantized_products_match_on_the_no_rebar_path() {
    suite(common::config_no_rebar());
}

/// A decode-shaped step (embedding lookup, a projection, the tied output head) counts exactly
/// what the same step over f16 weights counts, for legacy blocks and for super-blocks (Q6_K
/// and Q4_K, what Q4_K_M files are made of): one submit and one host wait per step.
#[test]
fn a_quantized_step_counts_what_an_f16_step_counts() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let (vocab, k, n) = (40, 256, 24);
        let mut per_dtype = Vec::new();
        for (emb_dt, proj_dt) in [
            (DType::F16, DType::F16),
            (DType::Q8_0, DType::Q4_1),
            (DType::Q6_K, DType::Q4_K),
        ] {
            let bytes = |dt: DType, rows: usize, seed: u64| {
                if dt.is_quantized() {
                    blocks(dt, rows, k, seed)
                } else {
                    let mut rng = Rng(seed);
                    (0..rows * k)
                        .flat_map(|_| f16::from_f32(rng.unit()).to_le_bytes())
                        .collect()
                }
            };
            let emb = common::buffer_with(&b, &bytes(emb_dt, vocab, 1));
            let proj = common::buffer_with(&b, &bytes(proj_dt, n, 2));
            let ids = common::buffer_with(&b, &common::i32_bytes(&[5]));
            let h = b.alloc_buffer(k * 4, BufferUsage::Compute).unwrap();
            let p = b.alloc_buffer(n * 4, BufferUsage::Compute).unwrap();
            let logits = b.alloc_buffer(vocab * 4, BufferUsage::Compute).unwrap();
            let wt = |buf, dt, rows| TensorRef {
                buffer: buf,
                byte_offset: 0,
                dtype: dt,
                shape: vec![k, rows],
                strides: vec![1, k],
            };
            let node = |op: Op, dst, srcs| ExecNode {
                op,
                name: op.name().into(),
                dst,
                srcs,
            };
            let g = Arc::new(ExecGraph::new(vec![
                node(
                    Op::GetRows,
                    common::contiguous(h, DType::F32, &[1, k]),
                    vec![
                        common::contiguous(emb, emb_dt, &[vocab, k]),
                        common::contiguous(ids, DType::I32, &[1]),
                    ],
                ),
                node(
                    Op::MulMat,
                    common::contiguous(p, DType::F32, &[1, n]),
                    vec![
                        common::contiguous(h, DType::F32, &[1, k]),
                        wt(proj, proj_dt, n),
                    ],
                ),
                node(
                    Op::MulMat,
                    common::contiguous(logits, DType::F32, &[1, vocab]),
                    vec![
                        common::contiguous(h, DType::F32, &[1, k]),
                        wt(emb, emb_dt, vocab),
                    ],
                ),
            ]));
            b.synchronize().unwrap();
            let mut steps = Vec::new();
            for _ in 0..3 {
                let before = b.stats().snapshot();
                b.graph_compute_async(&g).unwrap();
                b.synchronize().unwrap();
                let d = b.stats().snapshot().since(&before);
                steps.push((d.host_waits, d.driver_syncs, d.submits, d.empty_submits));
            }
            assert_eq!(steps, vec![(1, 1, 1, 0); 3], "{emb_dt}/{proj_dt}");
            per_dtype.push(steps);
            let out = common::read_f32(&b, logits, vocab);
            assert!(out.iter().all(|v| v.is_finite()), "{emb_dt}/{proj_dt}");
            for id in [emb, proj, ids, h, p, logits] {
                b.free_buffer(id);
            }
        }
        assert!(per_dtype.iter().all(|s| *s == per_dtype[0]));
        common::assert_clean(&b);
    }
}
