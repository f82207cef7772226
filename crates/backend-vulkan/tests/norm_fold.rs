//! The RmsNorm folded into the decode products that read it (`LOWSYNC_VK_FUSION`, on by
//! default): where every reader of a fused norm's result is a one-row product whose kernel
//! takes the fold (the 16-byte float mat-vec: plain, into a KV-cache row, or as the gate/up
//! pair with SwiGLU), no norm dispatch runs and each product normalises x itself; where one
//! reader's kernel takes no fold (block weights), the norm runs once, just before it. The
//! results agree with the unfused graph to f32 rounding. `LOWSYNC_VK_NORM_FOLD` (here
//! `VkConfig::norm_fold`) turns it on or off; unset, it is on for GPUs and off for CPU-type
//! devices such as lavapipe. Every run asserts the validation layer
//! (synchronization validation on) stayed silent.

mod common;

use common::{t, values};

use std::sync::Arc;

use half::f16;
use lowsync_backend::{
    Backend, BufferId, BufferUsage, ExecGraph, ExecNode, ScratchLive, TensorRef,
};
use lowsync_graph::{DType, Op};
use lowsync_vulkan::{QuantMatVec, VkConfig};

/// `rows x k` weights of `dt`: f16 values, or blocks of arbitrary bytes with a small f16 scale
/// (and min) in front.
fn weight(dt: DType, rows: usize, k: usize, seed: u32) -> Vec<u8> {
    if dt == DType::F16 {
        return values(rows * k, seed)
            .iter()
            .flat_map(|v| f16::from_f32(*v / 8.0).to_le_bytes())
            .collect();
    }
    let nb = rows * k / dt.block_size();
    let raw = values(nb * dt.block_bytes(), seed);
    let mut out: Vec<u8> = raw.iter().map(|v| (v * 1000.0) as i32 as u8).collect();
    let fields: &[usize] = if dt == DType::Q4_K { &[0, 2] } else { &[0] };
    for b in 0..nb {
        for (i, &f) in fields.iter().enumerate() {
            let at = b * dt.block_bytes() + f;
            let v = 0.01 + 0.002 * (b % 7) as f32 - 0.015 * i as f32;
            out[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    out
}

/// x [1, k] through `RmsNorm -> Mul` by a [k] weight, then read by a product into an output
/// row, one into row 2 of a cache (`SetRows`), and a gate and up product with their SwiGLU,
/// all over weights of `wt`; `odd`: one more product over a Q4_K weight, whose kernel takes
/// no fold. Returns the three results concatenated and (kernel variant, dispatches) of the
/// graph.
fn run(cfg: VkConfig, wt: DType, odd: bool) -> (Vec<f32>, Vec<(String, u64)>) {
    let (k, n, cache_rows) = (256, 24, 4);
    let b = common::open(VkConfig {
        profile: true,
        ..cfg
    })
    .expect("a Vulkan device");
    let xb = common::buffer_with(&b, &common::f32_bytes(&values(k, 1)));
    let gb = common::buffer_with(&b, &common::f32_bytes(&values(k, 2)));
    let wbufs: Vec<BufferId> = (0..4)
        .map(|s| common::buffer_with(&b, &weight(wt, n, k, 3 + s)))
        .collect();
    let kb = common::buffer_with(&b, &weight(DType::Q4_K, n, k, 9));
    let ib = common::buffer_with(&b, &common::i32_bytes(&[2]));
    let cb = common::buffer_with(&b, &vec![0u8; cache_rows * n * 4]);
    let sb = b
        .alloc_buffer(2 * k * 4 + 3 * n * 4, BufferUsage::Compute)
        .unwrap();
    let ob = b.alloc_buffer(3 * n * 4, BufferUsage::Compute).unwrap();
    let w_of = |buf: BufferId, dt: DType| TensorRef {
        buffer: buf,
        byte_offset: 0,
        dtype: dt,
        shape: vec![k, n],
        strides: vec![1, k],
    };
    let normed = t(sb, 0, DType::F32, &[1, k]);
    let x = t(sb, k * 4, DType::F32, &[1, k]);
    let scratch = |i: usize| t(sb, 2 * k * 4 + i * n * 4, DType::F32, &[1, n]);
    let product = |name: &str, w: TensorRef, dst: TensorRef| ExecNode {
        op: Op::MulMat,
        name: name.into(),
        dst,
        srcs: vec![x.clone(), w],
    };
    let cache = t(cb, 0, DType::F32, &[cache_rows, n]);
    let mut nodes = vec![
        ExecNode {
            op: Op::RmsNorm { eps: 1e-5 },
            name: "norm".into(),
            dst: normed.clone(),
            srcs: vec![t(xb, 0, DType::F32, &[1, k])],
        },
        ExecNode {
            op: Op::Mul,
            name: "norm_w".into(),
            dst: x.clone(),
            srcs: vec![normed, t(gb, 0, DType::F32, &[k])],
        },
        product("q", w_of(wbufs[0], wt), t(ob, 0, DType::F32, &[1, n])),
        product("v", w_of(wbufs[1], wt), scratch(0)),
        ExecNode {
            op: Op::SetRows,
            name: "v_to_cache".into(),
            dst: cache.clone(),
            srcs: vec![cache, scratch(0), t(ib, 0, DType::I32, &[1])],
        },
        product("gate", w_of(wbufs[2], wt), scratch(1)),
        product("up", w_of(wbufs[3], wt), scratch(2)),
        ExecNode {
            op: Op::SwiGlu,
            name: "glu".into(),
            dst: t(ob, n * 4, DType::F32, &[1, n]),
            srcs: vec![scratch(1), scratch(2)],
        },
    ];
    if odd {
        nodes.push(product(
            "k",
            w_of(kb, DType::Q4_K),
            t(ob, 2 * n * 4, DType::F32, &[1, n]),
        ));
    }
    let graph = Arc::new(ExecGraph {
        nodes,
        scratch: Some(ScratchLive {
            buffer: sb,
            kept: Vec::new(),
        }),
    });
    b.graph_compute_async(&graph).unwrap();
    let mut got = common::read_f32(&b, ob, 3 * n);
    got.extend(common::read_f32(&b, cb, cache_rows * n)[2 * n..3 * n].iter());
    b.synchronize().unwrap();
    let kernels = b
        .kernel_times()
        .into_iter()
        .map(|kt| (kt.name, kt.count))
        .collect();
    common::assert_clean(&b);
    (got, kernels)
}

/// Dispatches of a kernel family (a row kernel in either layout: `rms_norm_mul` and its
/// one-invocation-per-row `rms_norm_mul_t` are one family).
fn ran(kernels: &[(String, u64)], family: &str) -> u64 {
    kernels
        .iter()
        .filter(|(name, _)| {
            let head = name.split('.').next().unwrap_or_default();
            head.strip_suffix("_t").unwrap_or(head) == family
        })
        .map(|(_, c)| c)
        .sum()
}

fn close(got: &[f32], want: &[f32], what: &str) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * scale,
            "{what}: element {i}: {g} against {w} (largest {scale})"
        );
    }
}

/// [`run`] fused and unfused: the fused result, its kernels, and the unfused result.
fn both(cfg: VkConfig, wt: DType, odd: bool) -> (Vec<f32>, Vec<(String, u64)>, Vec<f32>) {
    let off_cfg = VkConfig {
        fusion: false,
        ..cfg.clone()
    };
    let (off, _) = run(off_cfg, wt, odd);
    let (on, kernels) = run(cfg, wt, odd);
    (on, kernels, off)
}

const FOLDED: [&str; 3] = ["mul_mat_vec_vn", "mul_mat_vec_vn_r", "mul_mat_vec_vn_g"];

/// The test config with the fold on (lavapipe, a CPU-type device, leaves it off by default).
fn folding() -> VkConfig {
    VkConfig {
        norm_fold: Some(true),
        ..common::config()
    }
}

#[test]
fn the_norm_folds_into_every_product_that_reads_it() {
    if common::open(common::config()).is_none() {
        return;
    }
    let (on, kernels, off) = both(folding(), DType::F16, false);
    let what = format!("{kernels:?}");
    for f in FOLDED {
        assert_eq!(ran(&kernels, f), 1, "{what}: {f}");
    }
    assert_eq!(ran(&kernels, "rms_norm_mul"), 0, "{what}");
    assert_eq!(ran(&kernels, "rms_norm"), 0, "{what}");
    let total: u64 = kernels.iter().map(|(_, c)| c).sum();
    assert_eq!(total, 3, "{what}: one dispatch per product");
    assert!(on.iter().all(|v| v.is_finite()), "{what}");
    close(&on, &off, &what);
}

#[test]
fn a_reader_no_kernel_folds_gets_the_norm_run_once_before_it() {
    if common::open(common::config()).is_none() {
        return;
    }
    // The products before the Q4_K one fold the norm; it then runs once, for that one.
    let (on, kernels, off) = both(folding(), DType::F16, true);
    let what = format!("{kernels:?}");
    for f in FOLDED {
        assert_eq!(ran(&kernels, f), 1, "{what}: {f}");
    }
    assert_eq!(ran(&kernels, "rms_norm_mul"), 1, "{what}");
    close(&on, &off, &what);
    // Block weights on the two-row body keep the norm as a dispatch of its own.
    let rows = VkConfig {
        quant_mat_vec: Some(QuantMatVec::Rows),
        ..folding()
    };
    let (on, kernels, off) = both(rows, DType::Q4_0, false);
    let what = format!("{kernels:?}");
    assert_eq!(ran(&kernels, "rms_norm_mul"), 1, "{what}");
    assert_eq!(ran(&kernels, "mul_mat_vec_qw_g"), 1, "{what}");
    close(&on, &off, &what);
}

#[test]
fn the_fold_follows_the_setting_and_the_device_type() {
    if common::open(common::config()).is_none() {
        return;
    }
    let cpu_type = lowsync_vulkan::device_type("vulkan").unwrap() == "cpu";
    for (setting, folds) in [(Some(false), false), (Some(true), true), (None, !cpu_type)] {
        let cfg = VkConfig {
            norm_fold: setting,
            ..common::config()
        };
        let (_, kernels) = run(cfg, DType::F16, false);
        let what = format!("{setting:?}: {kernels:?}");
        assert_eq!(ran(&kernels, "rms_norm_mul"), u64::from(!folds), "{what}");
        assert_eq!(ran(&kernels, "mul_mat_vec_vn"), u64::from(folds), "{what}");
    }
}
