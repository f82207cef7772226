//! Block (quantized) weights: the scalar dequantization of each type against known answers of
//! `gguf.quants.dequantize` (the Python `gguf` package, the reference of every layout), and
//! `GetRows` / `MulMat` / `MulMatId` over quantized weights against f64 references built on
//! that dequantization.
//!
//! Known answers: each type's two blocks are bytes of a 64-bit LCG (seed per type) with their
//! f16 scale fields set to finite values; the expected FNV-1a hash of the 64 or 512 f32 results
//! and a few values were computed once with gguf 0.19 (`gguf.quants.dequantize`), so a layout
//! mistake in any bit changes the hash. Python's suite checks the same bit-exactness on random
//! blocks of every type through the bindings.

use lowsync_graph::{DType, Op};

use super::harness::*;
use crate::kernels::quant::scalar::dequantize_row;
use crate::kernels::quant::{
    activations_as_read, in_place_uses_q8, packed_runs_avx2, uses_packed, uses_q8,
};

/// Byte offsets of each type's f16 scale fields (set to finite values in the test blocks).
fn scale_fields(dt: DType) -> &'static [usize] {
    match dt {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

/// `n_blocks` blocks of `dt`: LCG bytes (`seed`) with finite f16 scales (|d| in [2^-7, 2^-3)).
fn lcg_blocks(dt: DType, seed: u64, n_blocks: usize) -> Vec<u8> {
    let bb = dt.block_bytes();
    let mut x = seed;
    let mut b: Vec<u8> = (0..n_blocks * bb)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect();
    for k in 0..n_blocks {
        for &off in scale_fields(dt) {
            let (lo, hi) = (b[k * bb + off], b[k * bb + off + 1]);
            let bits = 0x2000u16
                | (u16::from(hi & 0x0F) << 8)
                | u16::from(lo)
                | (u16::from(hi & 0x80) << 8);
            b[k * bb + off..k * bb + off + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    b
}

fn fnv1a(values: &[f32]) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for v in values {
        for byte in v.to_le_bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// Dequantizes a known pair of blocks and compares it with gguf's answer (values written as
/// f64 literals, which hold the f32 results exactly).
fn known_answer(dt: DType, seed: u64, hash: u64, first: [f64; 3], last: f64) {
    let bytes = lcg_blocks(dt, seed, 2);
    let n = 2 * dt.block_size();
    let mut out = vec![f32::NAN; n];
    dequantize_row(dt, &bytes, &mut out);
    let head: Vec<f64> = out[..3].iter().map(|&v| f64::from(v)).collect();
    assert_eq!(head, first, "{dt}: first values");
    assert_eq!(f64::from(out[n - 1]), last, "{dt}: last value");
    assert_eq!(fnv1a(&out), hash, "{dt}: hash of every value");
}

macro_rules! known_answers {
    ($($test:ident: $dt:ident, $seed:expr, $hash:expr, $first:expr, $last:expr;)*) => {$(
        #[test]
        fn $test() {
            known_answer(DType::$dt, $seed, $hash, $first, $last);
        }
    )*};
}

known_answers! {
    q4_0_dequantizes_like_gguf: Q4_0, 1000, 0x71ee4ddd21486373, [-0.0846405029296875, 0.0846405029296875, 0.07053375244140625], 0.1009368896484375;
    q4_1_dequantizes_like_gguf: Q4_1, 1001, 0x0ad57cdb069b2cb3, [-0.17710113525390625, -0.07611846923828125, -0.02562713623046875], 0.405517578125;
    q5_0_dequantizes_like_gguf: Q5_0, 1002, 0x17c0774f7591a715, [-0.231964111328125, -0.33740234375, -0.0843505859375], 0.0100250244140625;
    q5_1_dequantizes_like_gguf: Q5_1, 1003, 0x1476d4d5a3721704, [0.5247802734375, 0.2966766357421875, 0.474090576171875], 0.53497314453125;
    q8_0_dequantizes_like_gguf: Q8_0, 1004, 0x41275c8801eb0f2a, [-2.3373565673828125, 2.2190093994140625, 3.254547119140625], -2.87646484375;
    q2_k_dequantizes_like_gguf: Q2_K, 1005, 0x79d6598dd66815ab, [-0.0862884521484375, -0.0862884521484375, -1.2398529052734375], 0.145660400390625;
    q3_k_dequantizes_like_gguf: Q3_K, 1006, 0x59c607910e285201, [-0.036834716796875, 0.0, -0.036834716796875], 0.0;
    q4_k_dequantizes_like_gguf: Q4_K, 1007, 0x80563605ab32b06e, [-2.62109375, -1.23175048828125, -5.3997802734375], 0.339691162109375;
    q5_k_dequantizes_like_gguf: Q5_K, 1008, 0x3ce8e8b720dd230e, [-5.4091796875, -3.674560546875, -9.31207275390625], -10.18377685546875;
    q6_k_dequantizes_like_gguf: Q6_K, 1009, 0xd1c665151396e3e8, [8.6312255859375, 6.1651611328125, -7.706451416015625], -50.4107666015625;
    iq4_nl_dequantizes_like_gguf: IQ4_NL, 1010, 0xe5af49289793d510, [3.90887451171875, 10.13116455078125, 8.29638671875], 0.9675216674804688;
    iq4_xs_dequantizes_like_gguf: IQ4_XS, 1011, 0x1414abed3b022f04, [-38.33349609375, -60.985107421875, -144.621826171875], 27.6123046875;
}

/// A `[rows, k]` weight of `dt` (random blocks) and its dequantized values.
fn weight(
    mem: &mut TestMem,
    dt: DType,
    rows: usize,
    k: usize,
    seed: u64,
) -> (lowsync_backend::TensorRef, Vec<f32>) {
    let bytes = lcg_blocks(dt, seed, rows * k / dt.block_size());
    let mut values = vec![0.0f32; rows * k];
    dequantize_row(dt, &bytes, &mut values);
    (mem.blocks(dt, &[rows, k], &bytes), values)
}

#[test]
fn get_rows_of_a_quantized_table_dequantizes_the_rows_it_reads() {
    for dt in DType::QUANTIZED {
        let mut mem = TestMem::new();
        let k = dt.block_size() * 2;
        let (table, values) = weight(&mut mem, dt, 5, k, 7);
        let ids = mem.ints(&[2, 2], &[4, 0, 4, 2]);
        let dst = mem.zeros(DType::F32, &[2, 2, k]);
        run(&mem, Op::GetRows, &dst, &[&table, &ids]).unwrap();
        let want: Vec<f64> = [4, 0, 4, 2]
            .iter()
            .flat_map(|&r| values[r * k..(r + 1) * k].iter().map(|&v| v as f64))
            .collect();
        assert_eq!(mem.read(&dst), want, "{dt}");
    }
}

#[test]
fn get_rows_of_a_packed_table_reads_the_same_values() {
    use crate::kernels::quant::uses_packed;
    // A tied embedding: the output product packs the table, get_rows then reads the copy.
    for dt in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        let (n, k) = (37, 64);
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(2);
        let (table, values) = weight(&mut mem, dt, n, k, 5);
        let x = mem.rand(&mut rng, DType::F32, &[1, k]);
        let out = mem.zeros(DType::F32, &[1, n]);
        run(&mem, Op::MulMat, &out, &[&x, &transpose(&table, 0, 1)]).unwrap();
        let ids = mem.ints(&[4], &[36, 0, 17, 36]);
        let dst = mem.zeros(DType::F32, &[4, k]);
        run(&mem, Op::GetRows, &dst, &[&table, &ids]).unwrap();
        let want: Vec<f64> = [36, 0, 17, 36]
            .iter()
            .flat_map(|&r| values[r * k..(r + 1) * k].iter().map(|&v| v as f64))
            .collect();
        assert_eq!(
            mem.read(&dst),
            want,
            "{dt} (packed here: {})",
            uses_packed(dt)
        );
    }
}

#[test]
fn get_rows_of_a_quantized_table_reports_a_bad_id_before_writing() {
    let mut mem = TestMem::new();
    let (table, _) = weight(&mut mem, DType::Q4_0, 3, 32, 1);
    let ids = mem.ints(&[2], &[1, 3]);
    let dst = mem.zeros(DType::F32, &[2, 32]);
    let msg = kernel_msg(run(&mem, Op::GetRows, &dst, &[&table, &ids]));
    assert!(msg.contains("out of range"), "{msg}");
    assert!(mem.read(&dst).iter().all(|&v| v == 0.0));
}

/// `x @ w.T` against f64 over the dequantized weight, for `m` activation rows.
fn check_mul_mat(dt: DType, m: usize, n: usize, k: usize, act: DType) {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(3);
    let (w, values) = weight(&mut mem, dt, n, k, 11);
    let x = mem.rand(&mut rng, act, &[m, k]);
    let dst = mem.zeros(DType::F32, &[m, n]);
    run(&mem, Op::MulMat, &dst, &[&x, &transpose(&w, 0, 1)]).unwrap();
    // The activations as the kernel reads them (16-bit blocks on the SIMD path, 8-bit ones in
    // a prefill over packed Q4_0 / Q4_K / Q6_K).
    let x32: Vec<f32> = mem.read(&x).iter().map(|&v| v as f32).collect();
    let xs: Vec<f64> = activations_as_read(dt, &x32, m)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let want: Vec<f64> = (0..m)
        .flat_map(|i| {
            let (xs, values) = (&xs, &values);
            (0..n).map(move |j| {
                (0..k)
                    .map(|l| xs[i * k + l] * values[j * k + l] as f64)
                    .sum()
            })
        })
        .collect();
    // f32 accumulation of k products against f64: a relative bound well above its error.
    assert_close(&mem.read(&dst), &want, 1e-10);
}

#[test]
fn mul_mat_with_a_quantized_weight_matches_f64_for_every_type() {
    for dt in DType::QUANTIZED {
        let k = dt.block_size() * 3;
        check_mul_mat(dt, 1, 7, k, DType::F32);
        check_mul_mat(dt, 5, 9, k, DType::F32);
        // More activation rows than a kernel serves per unpacking (groups of 8 and a rest).
        check_mul_mat(dt, 19, 3, k, DType::F32);
    }
}

#[test]
fn mul_mat_with_a_quantized_weight_takes_f16_activations_and_runs_threaded() {
    check_mul_mat(DType::Q4_0, 3, 4, 64, DType::F16);
    // Large enough for parallel jobs.
    check_mul_mat(DType::Q8_0, 2, 300, 512, DType::F32);
    check_mul_mat(DType::Q4_K, 33, 70, 512, DType::BF16);
}

#[test]
fn a_read_only_weight_is_packed_once_and_gives_the_bits_of_the_in_place_product() {
    use crate::memory::Mem;
    // Rows in whole decode tiles in place (a leftover row there takes a body that sums in
    // another order); odd row counts are the packed kernels' own unit tests.
    let (n, k) = (48, 576);
    for dt in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        let packs = uses_packed(dt);
        for m in [1, 9] {
            let bytes = lcg_blocks(dt, 21, n * k / 32);
            let mut mem = TestMem::new();
            let mut rng = TestRng::new(8);
            let ro = mem.blocks(dt, &[n, k], &bytes);
            let rw = mem.blocks_writable(dt, &[n, k], &bytes);
            let x = mem.rand(&mut rng, DType::F32, &[m, k]);
            let (d1, d2, d3) = (
                mem.zeros(DType::F32, &[m, n]),
                mem.zeros(DType::F32, &[m, n]),
                mem.zeros(DType::F32, &[m, n]),
            );
            run(&mem, Op::MulMat, &d1, &[&x, &transpose(&ro, 0, 1)]).unwrap();
            run(&mem, Op::MulMat, &d2, &[&x, &transpose(&ro, 0, 1)]).unwrap();
            run(&mem, Op::MulMat, &d3, &[&x, &transpose(&rw, 0, 1)]).unwrap();
            let (a, b, c) = (mem.read(&d1), mem.read(&d2), mem.read(&d3));
            assert_eq!(a, b, "{dt} m {m}: the cached copy gives the same bits");
            if uses_q8(dt, m) != in_place_uses_q8(dt, m) && packed_runs_avx2(dt) {
                // One of them reads 8-bit activation blocks (Q4_1 and Q8_0 have no packed
                // 8-bit body, which `LOWSYNC_CPU_PREFILL_ACT=q8` or `LOWSYNC_CPU_DECODE_ACT=q8`
                // give them in place): equal within the 8-bit quantization.
                assert_close(&a, &c, 1e-3);
            } else if packs && dt == DType::Q8_0 && m == 1 {
                // Q8_0's in-place decode tile sums in another order.
                assert_close(&a, &c, 1e-10);
            } else if packed_runs_avx2(dt) && m > 1 && !uses_q8(dt, m) {
                // The in-place AVX2 tiles of several activation rows sum in another order than
                // the packed bodies (which keep the order of the AVX-512 panels).
                assert_close(&a, &c, 1e-10);
            } else if uses_q8(dt, m) {
                // The packed prefill reads 8-bit activation blocks, the in-place one 16-bit
                // blocks: equal within the 8-bit quantization (each product's own reference is
                // `mul_mat_with_a_quantized_weight_matches_f64_for_every_type`).
                assert_close(&a, &c, 1e-3);
            } else {
                assert_eq!(a, c, "{dt} m {m}: packed and in place");
            }
            let range = crate::derived::read_only_at(mem.ptr(&ro).unwrap(), bytes.len())
                .expect("registered");
            assert_eq!(range.derived_count(), usize::from(packs), "{dt} m {m}");
        }
    }
}

#[test]
fn mul_mat_with_a_quantized_weight_broadcasts_batches() {
    // GQA-style: b [2, k, n] (two transposed weights) against a [4, m, k].
    let (dt, k, n, m) = (DType::Q8_0, 64, 5, 3);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(5);
    let bytes = lcg_blocks(dt, 9, 2 * n * k / 32);
    let mut values = vec![0.0f32; 2 * n * k];
    dequantize_row(dt, &bytes, &mut values);
    let w = mem.blocks(dt, &[2, n, k], &bytes);
    let wt = transpose(&w, 1, 2);
    let a = mem.rand(&mut rng, DType::F32, &[4, m, k]);
    let dst = mem.zeros(DType::F32, &[4, m, n]);
    run(&mem, Op::MulMat, &dst, &[&a, &wt]).unwrap();
    let a32: Vec<f32> = mem.read(&a).iter().map(|&v| v as f32).collect();
    let xs: Vec<f64> = activations_as_read(dt, &a32, m)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let mut want = Vec::new();
    for bi in 0..4 {
        let wb = bi / 2;
        for i in 0..m {
            for j in 0..n {
                want.push(
                    (0..k)
                        .map(|l| xs[(bi * m + i) * k + l] * values[(wb * n + j) * k + l] as f64)
                        .sum(),
                );
            }
        }
    }
    assert_close(&mem.read(&dst), &want, 1e-10);
}

#[test]
fn mul_mat_results_do_not_depend_on_the_thread_count() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(8);
    let (w, _) = weight(&mut mem, DType::Q4_1, 700, 256, 4);
    let x = mem.rand(&mut rng, DType::F32, &[3, 256]);
    let dst = mem.zeros(DType::F32, &[3, 700]);
    let wt = transpose(&w, 0, 1);
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    pool(1).install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
    let one = mem.bytes(&dst);
    pool(3).install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
    assert_eq!(one, mem.bytes(&dst));
}

#[test]
fn prefill_products_with_8bit_activations_match_f64() {
    // From the prefill threshold up, n not a multiple of 16, k of 1 and 3 blocks of 256 (8
    // and 24 activation blocks); the reference reads the activations as the kernel does.
    for dt in [DType::Q4_0, DType::Q4_K, DType::Q6_K] {
        if uses_packed(dt) && std::env::var_os("LOWSYNC_CPU_PREFILL_ACT").is_none() {
            assert!(
                uses_q8(dt, 6),
                "{dt}: prefill takes 8-bit activations by default"
            );
            // Unless LOWSYNC_CPU_DECODE_ACT=q8 asks the AVX2 bodies for 8 bits.
            let dec8 = packed_runs_avx2(dt)
                && std::env::var("LOWSYNC_CPU_DECODE_ACT").as_deref() == Ok("q8");
            assert_eq!(
                uses_q8(dt, 5),
                dec8,
                "{dt}: decode keeps 16-bit activations"
            );
        }
        for k in [256, 768] {
            for m in [6, 7, 17, 40] {
                check_mul_mat(dt, m, 37, k, DType::F32);
            }
        }
    }
}

#[test]
fn prefill_products_with_8bit_activations_do_not_depend_on_the_thread_count() {
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    for dt in [DType::Q4_0, DType::Q4_K, DType::Q6_K] {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(9);
        let (w, _) = weight(&mut mem, dt, 333, 512, 6);
        let wt = transpose(&w, 0, 1);
        for m in [6, 40] {
            let x = mem.rand(&mut rng, DType::F32, &[m, 512]);
            let dst = mem.zeros(DType::F32, &[m, 333]);
            pool(1).install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
            let one = mem.bytes(&dst);
            pool(3).install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
            assert_eq!(one, mem.bytes(&dst), "{dt} m {m}");
        }
    }
}

#[test]
fn decode_products_do_not_depend_on_the_thread_count() {
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    for dt in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(10);
        let (w, _) = weight(&mut mem, dt, 333, 512, 7);
        let wt = transpose(&w, 0, 1);
        for m in [1, 2, 5] {
            let x = mem.rand(&mut rng, DType::F32, &[m, 512]);
            let dst = mem.zeros(DType::F32, &[m, 333]);
            pool(1).install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
            let one = mem.bytes(&dst);
            pool(3).install(|| run(&mem, Op::MulMat, &dst, &[&x, &wt]).unwrap());
            assert_eq!(one, mem.bytes(&dst), "{dt} m {m}");
        }
    }
}

#[test]
fn read_only_weights_pack_where_a_simd_body_runs() {
    // Packing follows LOWSYNC_CPU_PACK wherever the x86 q16 bodies run (AVX-512 VNNI or AVX2), and
    // the packed products take the AVX2 bodies where the in-place ones would be AVX2 ones.
    let off = std::env::var("LOWSYNC_CPU_PACK").as_deref() == Ok("off");
    let isa_avx2 = std::env::var("LOWSYNC_CPU_QUANT_ISA").as_deref() == Ok("avx2");
    for dt in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        if !crate::kernels::quant::uses_q16(dt) {
            eprintln!("{dt}: no SIMD body on this CPU (or LOWSYNC_CPU_QUANT_DOT=f32)");
            continue;
        }
        // The packed layouts have bodies on x86-64 only; aarch64's NEON bodies read in place.
        let packs_here = cfg!(target_arch = "x86_64") && !off;
        assert_eq!(uses_packed(dt), packs_here, "{dt}");
        if isa_avx2 && !off {
            assert!(packed_runs_avx2(dt), "{dt}: LOWSYNC_CPU_QUANT_ISA=avx2");
        }
    }
}

/// Where this CPU runs the AVX-512 packed bodies, the products of this module run again in a
/// child process with `LOWSYNC_CPU_QUANT_ISA=avx2` (read once per process), so the packed AVX2
/// bodies meet the same checks through `MulMat` as on a CPU without AVX-512.
#[test]
fn quant_products_pass_again_with_the_avx2_bodies() {
    if std::env::var_os("LOWSYNC_CPU_QUANT_ISA").is_some() {
        eprintln!("LOWSYNC_CPU_QUANT_ISA is set: this run already picked its bodies");
        return;
    }
    if !uses_packed(DType::Q4_0) || packed_runs_avx2(DType::Q4_0) {
        eprintln!("products here do not run the AVX-512 packed bodies: nothing to add");
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .args(["kernels::tests::quant::", "--test-threads", "2"])
        .env("LOWSYNC_CPU_QUANT_ISA", "avx2")
        .output()
        .expect("the child runs");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("test result: ok"),
        "{text}"
    );
}

/// On aarch64 a product over Q4_0, Q4_1, Q8_0, Q4_K or Q6_K weights (read-only ones too: no
/// packed layout there) runs the NEON body: the bits of the body called directly, for decode
/// and prefill shapes, in parallel jobs and leftover tiles.
#[cfg(target_arch = "aarch64")]
#[test]
fn aarch64_products_run_the_neon_bodies() {
    if std::env::var("LOWSYNC_CPU_QUANT_DOT").as_deref() == Ok("f32") {
        eprintln!("skipped: LOWSYNC_CPU_QUANT_DOT=f32 asks for the exact path");
        return;
    }
    let (n, k) = (333, 512);
    for dt in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        assert!(crate::kernels::quant::uses_q16(dt), "{dt}: a NEON body");
        assert!(!uses_packed(dt), "{dt}: no packed layout on aarch64");
        let bytes = lcg_blocks(dt, 31, n * k / dt.block_size());
        let row_bytes = bytes.len() / n;
        for m in [1, 2, 3, 7] {
            let mut mem = TestMem::new();
            let mut rng = TestRng::new(12);
            let w = mem.blocks(dt, &[n, k], &bytes);
            let x = mem.rand(&mut rng, DType::F32, &[m, k]);
            let dst = mem.zeros(DType::F32, &[m, n]);
            run(&mem, Op::MulMat, &dst, &[&x, &transpose(&w, 0, 1)]).unwrap();
            let x32: Vec<f32> = mem.read(&x).iter().map(|&v| v as f32).collect();
            let want = crate::kernels::quant::q16_body_product(dt, &bytes, row_bytes, &x32, m)
                .expect("a NEON body");
            let got: Vec<f32> = mem.read(&dst).iter().map(|&v| v as f32).collect();
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{dt} m {m}: output {i}");
            }
        }
    }
}

#[test]
fn a_quantized_weight_read_along_its_rows_is_an_error_not_a_panic() {
    // `x @ w` with blocks along the output axis is not a layout the kernels read.
    let mut mem = TestMem::new();
    let (w, _) = weight(&mut mem, DType::Q4_0, 32, 32, 2);
    let x = mem.tensor(DType::F32, &[1, 32], &[0.5; 32]);
    let dst = mem.zeros(DType::F32, &[1, 32]);
    let msg = kernel_msg(run(&mem, Op::MulMat, &dst, &[&x, &w]));
    assert!(msg.contains("x @ w.T"), "{msg}");
}

#[test]
fn mul_mat_id_with_quantized_experts_matches_f64() {
    let (dt, e, k, n, t) = (DType::Q5_K, 3, 256, 6, 4);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(6);
    let bytes = lcg_blocks(dt, 12, e * n * k / 256);
    let mut values = vec![0.0f32; e * n * k];
    dequantize_row(dt, &bytes, &mut values);
    let experts = transpose(&mem.blocks(dt, &[e, n, k], &bytes), 1, 2); // [E, k, n]
    let x = mem.rand(&mut rng, DType::F32, &[t, k]);
    let ids = mem.ints(&[t, 2], &[0, 2, 1, 1, 2, 0, 0, 1]);
    let w = mem.tensor(
        DType::F32,
        &[t, 2],
        &[0.5, 0.25, 1.0, -1.0, 0.75, 0.5, 2.0, 0.125],
    );
    let dst = mem.zeros(DType::F32, &[t, n]);
    run(&mem, Op::MulMatId, &dst, &[&experts, &x, &ids, &w]).unwrap();
    let (xs, ws, is) = (mem.read(&x), mem.read(&w), mem.read_i32(&ids));
    let mut want = vec![0.0f64; t * n];
    for ti in 0..t {
        for s in 0..2 {
            let ex = is[ti * 2 + s] as usize;
            for j in 0..n {
                let y: f64 = (0..k)
                    .map(|l| xs[ti * k + l] * values[(ex * n + j) * k + l] as f64)
                    .sum();
                want[ti * n + j] += ws[ti * 2 + s] * y;
            }
        }
    }
    assert_close(&mem.read(&dst), &want, 1e-10);
}

#[test]
fn a_weight_whose_rows_are_not_back_to_back_is_read_row_by_row() {
    // The first k columns of a [n, 2k] weight: rows of whole blocks with gaps between them.
    for dt in [DType::Q4_1, DType::Q8_0, DType::Q4_K] {
        let (m, n, k) = (3, 40, dt.block_size() * 2);
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(4);
        let (w, values) = weight(&mut mem, dt, n, 2 * k, 12);
        let half = lowsync_backend::TensorRef {
            shape: vec![n, k],
            ..w.clone()
        };
        let x = mem.rand(&mut rng, DType::F32, &[m, k]);
        let dst = mem.zeros(DType::F32, &[m, n]);
        run(&mem, Op::MulMat, &dst, &[&x, &transpose(&half, 0, 1)]).unwrap();
        let x32: Vec<f32> = mem.read(&x).iter().map(|&v| v as f32).collect();
        let xs = activations_as_read(dt, &x32, m);
        let want: Vec<f64> = (0..m * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                (0..k)
                    .map(|l| xs[i * k + l] as f64 * values[j * 2 * k + l] as f64)
                    .sum()
            })
            .collect();
        assert_close(&mem.read(&dst), &want, 1e-10);
    }
}

/// The child half of `a_bad_decode_act_is_an_error_naming_the_variable` (the switch is read
/// once per process, so the bad value is set in a child process of this test binary only).
#[test]
#[ignore = "run by a_bad_decode_act_is_an_error_naming_the_variable in a child process"]
fn bad_decode_act_child() {
    if std::env::var("LOWSYNC_CPU_DECODE_ACT").as_deref() != Ok("bogus") {
        eprintln!("not the child run: the variable is not `bogus`");
        return;
    }
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(1);
    let (w, _) = weight(&mut mem, DType::Q4_0, 4, 64, 3);
    let x = mem.rand(&mut rng, DType::F32, &[1, 64]);
    let dst = mem.zeros(DType::F32, &[1, 4]);
    let msg = kernel_msg(run(&mem, Op::MulMat, &dst, &[&x, &transpose(&w, 0, 1)]));
    assert!(msg.contains("LOWSYNC_CPU_DECODE_ACT"), "{msg}");
    println!("child: the error names the variable");
}

#[test]
fn a_bad_decode_act_is_an_error_naming_the_variable() {
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .args([
            "kernels::tests::quant::bad_decode_act_child",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("LOWSYNC_CPU_DECODE_ACT", "bogus")
        .output()
        .expect("the child runs");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("child: the error names the variable"),
        "{text}"
    );
}

#[test]
fn decode_and_prefill_take_the_activation_blocks_the_switches_say() {
    // Where the AVX2 bodies read weights in place (no AVX-512 VNNI here): prefill takes 8-bit
    // blocks by default on Q4_0, Q4_K and Q6_K (on all five with LOWSYNC_CPU_PREFILL_ACT=q8),
    // decode 16-bit ones unless LOWSYNC_CPU_DECODE_ACT=q8.
    for dt in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        // The 8-bit bodies are x86-64's: elsewhere (aarch64's NEON bodies) every product keeps
        // the 16-bit blocks, which `check_mul_mat` checks through `activations_as_read`.
        let x86 = cfg!(target_arch = "x86_64");
        if uses_packed(dt) || !crate::kernels::quant::uses_q16(dt) || !x86 {
            eprintln!("{dt}: products here do not run the AVX2 in-place bodies");
            continue;
        }
        let dec = std::env::var("LOWSYNC_CPU_DECODE_ACT").as_deref() == Ok("q8");
        assert_eq!(uses_q8(dt, 1), dec, "{dt}: decode");
        assert_eq!(uses_q8(dt, 5), dec, "{dt}: decode of 5 rows");
        let by_default = matches!(dt, DType::Q4_0 | DType::Q4_K | DType::Q6_K);
        match std::env::var("LOWSYNC_CPU_PREFILL_ACT").as_deref() {
            Ok("q8") => assert!(uses_q8(dt, 6), "{dt}: prefill with q8"),
            Ok("q16") => assert!(!uses_q8(dt, 6), "{dt}: prefill with q16"),
            _ => assert_eq!(uses_q8(dt, 6), by_default, "{dt}: prefill by default"),
        }
    }
}

#[test]
fn products_with_8bit_activations_match_f64_for_odd_shapes() {
    // Every type with an 8-bit body, prefill row counts (and decode where
    // LOWSYNC_CPU_DECODE_ACT=q8), n not a multiple of the 4-row tile, k of 1 to 9 blocks (1 to
    // 3 super-blocks); the reference reads the activations as the kernel does.
    for dt in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        let ks: Vec<usize> = if dt.block_size() == 32 {
            vec![32, 64, 160, 288]
        } else {
            vec![256, 512, 768]
        };
        for k in ks {
            for m in [1, 2, 3, 6, 9, 17] {
                check_mul_mat(dt, m, 13, k, DType::F32);
            }
        }
    }
}
