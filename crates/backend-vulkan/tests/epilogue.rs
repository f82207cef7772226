//! The element-wise op that consumes a decode product, run in the product's store
//! (`LOWSYNC_VK_FUSION`, on by default): the residual add `x + W v` and SwiGLU
//! `silu(gate) * up` are one `mul_mat_vec_*_e` dispatch where the graph proves the product
//! dead after the op, bit-identical to the unfused pair for float and block weights, on the
//! subgroup and the shared-memory kernels, in place or not; and the pair stays unfused where
//! something else reads the product or nothing is known of the scratch after the graph. The
//! gate and up products with their SwiGLU are one `mul_mat_vec_*_g` dispatch where the kernel
//! computing a pair of rows takes both weights (the two-row block body, the 16-byte float
//! mat-vec), bit-identical to the three nodes, and fall back to the up product's `_e` flavour
//! where it does not. Every run asserts the validation layer (synchronization validation on)
//! stayed silent.

mod common;

use common::{t, values};

use std::sync::Arc;

use half::{bf16, f16};
use lowsync_backend::{
    Backend, BufferId, BufferUsage, ExecGraph, ExecNode, ScratchLive, TensorRef,
};
use lowsync_graph::{DType, Op};
use lowsync_vulkan::{QuantMatVec, VkConfig};

/// `rows` rows of `k` weights of `dt`: float values, or blocks of arbitrary bytes whose f16
/// scale and min are small and finite.
fn weight(dt: DType, rows: usize, k: usize, seed: u32) -> Vec<u8> {
    match dt {
        DType::F32 => common::f32_bytes(&values(rows * k, seed)),
        DType::F16 => values(rows * k, seed)
            .iter()
            .flat_map(|v| f16::from_f32(*v / 8.0).to_le_bytes())
            .collect(),
        DType::BF16 => values(rows * k, seed)
            .iter()
            .flat_map(|v| bf16::from_f32(*v / 8.0).to_le_bytes())
            .collect(),
        _ => {
            let nb = rows * k / dt.block_size();
            let raw = values(nb * dt.block_bytes(), seed);
            let mut out: Vec<u8> = raw.iter().map(|v| (v * 1000.0) as i32 as u8).collect();
            // The f16 (super-)scale, then the min where the type has one.
            let fields: &[usize] = match dt {
                DType::Q4_K | DType::Q4_1 | DType::Q5_1 => &[0, 2],
                DType::Q6_K => &[208],
                _ => &[0],
            };
            for b in 0..nb {
                for (i, &f) in fields.iter().enumerate() {
                    let at = b * dt.block_bytes() + f;
                    let v = 0.01 + 0.002 * (b % 7) as f32 - 0.015 * i as f32;
                    out[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            out
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Case {
    /// `r + x @ w.T` into a buffer of its own.
    Add,
    /// The same add written over `r`.
    AddInPlace,
    /// `swiglu(x @ g.T, x @ w.T)`: the up product last.
    Glu,
    /// `swiglu(x @ w.T, x @ g.T)` with the gate product last.
    GluGateLast,
}

/// A one-row product `[1, k] @ w.T` (`w [n, k]` of `wt`) and the op consuming it, as `case`
/// says; `live`: a later node reads the product; `known`: the graph says its scratch is dead
/// afterwards. Returns the result and whether a fused (`_e` or `_g`) kernel ran.
fn run(
    cfg: VkConfig,
    wt: DType,
    n: usize,
    k: usize,
    case: Case,
    live: bool,
    known: bool,
) -> (Vec<f32>, bool) {
    let (got, kernels) = run_kernels(cfg, wt, n, k, case, live, known);
    let fused = kernels.iter().any(|(name, _)| {
        name.starts_with("mul_mat_vec") && (name.contains("_e.") || name.contains("_g."))
    });
    (got, fused)
}

/// [`run`], returning the kernel variants that ran with their dispatch counts.
fn run_kernels(
    cfg: VkConfig,
    wt: DType,
    n: usize,
    k: usize,
    case: Case,
    live: bool,
    known: bool,
) -> (Vec<f32>, Vec<(String, u64)>) {
    let b = common::open(VkConfig {
        profile: true,
        ..cfg
    })
    .expect("a Vulkan device");
    let xb = common::buffer_with(&b, &common::f32_bytes(&values(k, 1)));
    let wb = common::buffer_with(&b, &weight(wt, n, k, 2));
    let gb = common::buffer_with(&b, &weight(wt, n, k, 3));
    let rb = common::buffer_with(&b, &common::f32_bytes(&values(n, 4)));
    let sb = b.alloc_buffer(3 * n * 4, BufferUsage::Compute).unwrap();
    let ob = b.alloc_buffer(n * 4, BufferUsage::Compute).unwrap();
    let x = t(xb, 0, DType::F32, &[1, k]);
    let wt_of = |buf| TensorRef {
        buffer: buf,
        byte_offset: 0,
        dtype: wt,
        shape: vec![k, n],
        strides: vec![1, k],
    };
    let product = |name: &str, w: BufferId, at: usize| ExecNode {
        op: Op::MulMat,
        name: name.into(),
        dst: t(sb, at * n * 4, DType::F32, &[1, n]),
        srcs: vec![x.clone(), wt_of(w)],
    };
    let (p, other) = (
        t(sb, 0, DType::F32, &[1, n]),
        t(sb, n * 4, DType::F32, &[1, n]),
    );
    let out_at = if case == Case::AddInPlace { rb } else { ob };
    let out = t(out_at, 0, DType::F32, &[1, n]);
    let mut nodes = match case {
        Case::Add | Case::AddInPlace => vec![
            product("p", wb, 0),
            ExecNode {
                op: Op::Add,
                name: "residual".into(),
                dst: out,
                srcs: vec![t(rb, 0, DType::F32, &[1, n]), p.clone()],
            },
        ],
        Case::Glu => vec![
            product("gate", gb, 1),
            product("up", wb, 0),
            ExecNode {
                op: Op::SwiGlu,
                name: "glu".into(),
                dst: out,
                srcs: vec![other, p.clone()],
            },
        ],
        Case::GluGateLast => vec![
            product("up", gb, 1),
            product("gate", wb, 0),
            ExecNode {
                op: Op::SwiGlu,
                name: "glu".into(),
                dst: out,
                srcs: vec![p.clone(), other],
            },
        ],
    };
    if live {
        nodes.push(ExecNode {
            op: Op::Add,
            name: "reads_product".into(),
            dst: t(sb, 2 * n * 4, DType::F32, &[1, n]),
            srcs: vec![p.clone(), p],
        });
    }
    let graph = Arc::new(ExecGraph {
        nodes,
        scratch: known.then(|| ScratchLive {
            buffer: sb,
            kept: Vec::new(),
        }),
    });
    b.graph_compute_async(&graph).unwrap();
    let got = common::read_f32(&b, out_at, n);
    b.synchronize().unwrap();
    let kernels = b
        .kernel_times()
        .into_iter()
        .map(|kt| (kt.name, kt.count))
        .collect();
    common::assert_clean(&b);
    (got, kernels)
}

fn check(cfg: fn() -> VkConfig) {
    // (weight, n, k): 16-byte-load and 4-element float kernels (k a multiple of 8 or only of
    // 4), block types of 32 and 256 elements, an odd result count (a last pair of one row).
    let shapes = [
        (DType::F32, 24, 64),
        (DType::F16, 13, 260),
        (DType::BF16, 9, 256),
        (DType::F16, 40, 512),
        (DType::Q4_0, 17, 128),
        (DType::Q8_0, 8, 64),
        (DType::Q4_K, 11, 256),
        (DType::Q6_K, 5, 512),
    ];
    for (wt, n, k) in shapes {
        for case in [Case::Add, Case::AddInPlace, Case::Glu, Case::GluGateLast] {
            let (on, fused) = run(
                VkConfig {
                    fusion: true,
                    ..cfg()
                },
                wt,
                n,
                k,
                case,
                false,
                true,
            );
            let (off, unfused) = run(
                VkConfig {
                    fusion: false,
                    ..cfg()
                },
                wt,
                n,
                k,
                case,
                false,
                true,
            );
            let what = format!("{wt} n={n} k={k} case {}", case as u8);
            assert!(fused, "{what}: fused");
            assert!(!unfused, "{what}: LOWSYNC_VK_FUSION=0 runs unfused");
            assert!(on.iter().all(|v| v.is_finite()), "{what}: finite");
            let (on_bits, off_bits): (Vec<u32>, Vec<u32>) = (
                on.iter().map(|v| v.to_bits()).collect(),
                off.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(on_bits, off_bits, "{what}");
        }
    }
}

#[test]
fn a_product_and_its_add_or_swiglu_fused_are_bit_identical_to_the_pair() {
    if common::open(common::config()).is_none() {
        return;
    }
    check(common::config);
}

#[test]
fn the_shared_memory_kernels_fuse_the_same_ops() {
    if common::open(common::config()).is_none() {
        return;
    }
    check(|| VkConfig {
        no_subgroups: true,
        ..common::config()
    });
}

#[test]
fn the_integer_dot_products_fuse_the_same_ops() {
    if common::open(common::config()).is_none() {
        return;
    }
    check(|| VkConfig {
        quant_mat_vec: Some(QuantMatVec::Idot),
        ..common::config()
    });
}

#[test]
fn a_read_product_or_unknown_scratch_stays_unfused() {
    if common::open(common::config()).is_none() {
        return;
    }
    for case in [Case::Add, Case::Glu] {
        let (want, _) = run(common::config(), DType::F16, 16, 64, case, false, true);
        let cfg = || VkConfig {
            fusion: false,
            ..common::config()
        };
        let (off, _) = run(cfg(), DType::F16, 16, 64, case, false, true);
        assert_eq!(want, off);
        for (live, known) in [(true, true), (false, false)] {
            let (got, fused) = run(common::config(), DType::F16, 16, 64, case, live, known);
            assert!(!fused, "live {live} known {known}");
            assert_eq!(got, want);
        }
    }
}

/// The bits of `v`.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_gate_and_up_products_and_their_swiglu_run_as_one_dispatch() {
    if common::open(common::config()).is_none() {
        return;
    }
    let rows = || VkConfig {
        quant_mat_vec: Some(QuantMatVec::Rows),
        ..common::config()
    };
    // (config, weight, n, k, the kernel family that takes all three): every 32-element block
    // type on the two-row body (a row count past one workgroup's, an odd one), every float
    // type on the 16-byte mat-vec (n not a multiple of its four pairs a workgroup).
    let idot = || VkConfig {
        quant_mat_vec: Some(QuantMatVec::Idot),
        ..common::config()
    };
    let has_idot = common::open(idot()).is_some_and(|b| b.has_integer_dot());
    let qd_g = if has_idot {
        "mul_mat_vec_qd_g"
    } else {
        "mul_mat_vec_qw_g"
    };
    type Shape = (fn() -> VkConfig, DType, usize, usize, &'static str);
    let shapes: [Shape; 14] = [
        (rows, DType::Q4_0, 17, 128, "mul_mat_vec_qw_g"),
        (rows, DType::Q4_1, 6, 256, "mul_mat_vec_qw_g"),
        (rows, DType::Q5_0, 3, 64, "mul_mat_vec_qw_g"),
        (rows, DType::Q5_1, 5, 96, "mul_mat_vec_qw_g"),
        (rows, DType::Q8_0, 8, 1056, "mul_mat_vec_qw_g"),
        (rows, DType::IQ4_NL, 4, 64, "mul_mat_vec_qw_g"),
        (idot, DType::Q4_0, 17, 128, qd_g),
        (idot, DType::Q4_1, 6, 256, qd_g),
        (idot, DType::Q8_0, 8, 1056, qd_g),
        (idot, DType::Q4_K, 7, 512, qd_g),
        (idot, DType::Q6_K, 5, 256, qd_g),
        (common::config, DType::F32, 24, 64, "mul_mat_vec_v_g"),
        (common::config, DType::F16, 13, 512, "mul_mat_vec_v_g"),
        (common::config, DType::BF16, 9, 256, "mul_mat_vec_v_g"),
    ];
    for (cfg, wt, n, k, family) in shapes {
        for case in [Case::Glu, Case::GluGateLast] {
            let what = format!("{wt} n={n} k={k} case {}", case as u8);
            let (on, kernels) = run_kernels(cfg(), wt, n, k, case, false, true);
            let off_cfg = VkConfig {
                fusion: false,
                ..cfg()
            };
            let (off, _) = run_kernels(off_cfg, wt, n, k, case, false, true);
            let want = format!("{family}.d_f32.a_f32.b_{}.u_{}", wt.name(), wt.name());
            assert_eq!(kernels, vec![(want, 1)], "{what}: one dispatch");
            assert!(on.iter().all(|v| v.is_finite()), "{what}: finite");
            assert_eq!(bits(&on), bits(&off), "{what}");
        }
    }
}

#[test]
fn a_pair_no_two_weight_kernel_takes_runs_swiglu_in_the_up_product() {
    if common::open(common::config()).is_none() {
        return;
    }
    let rows = VkConfig {
        quant_mat_vec: Some(QuantMatVec::Rows),
        ..common::config()
    };
    // A super-block type (no two-row body), a float k only a multiple of 4 (no 16-byte
    // loads), and the shared-memory kernels (no subgroups).
    let no_sg = VkConfig {
        no_subgroups: true,
        ..common::config()
    };
    for (cfg, wt, n, k) in [
        (rows, DType::Q4_K, 11, 256),
        (common::config(), DType::F16, 13, 260),
        (no_sg, DType::Q4_0, 17, 128),
    ] {
        let (on, kernels) = run_kernels(cfg.clone(), wt, n, k, Case::Glu, false, true);
        let off_cfg = VkConfig {
            fusion: false,
            ..cfg
        };
        let (off, _) = run_kernels(off_cfg, wt, n, k, Case::Glu, false, true);
        let what = format!("{wt} n={n} k={k}");
        let fused: Vec<_> = kernels.iter().filter(|(k, _)| k.contains("_e.")).collect();
        let total: u64 = kernels.iter().map(|(_, c)| c).sum();
        assert_eq!(fused.len(), 1, "{what}: {kernels:?}");
        assert_eq!(
            total, 2,
            "{what}: the gate product, then up with SwiGLU: {kernels:?}"
        );
        assert!(!kernels.iter().any(|(k, _)| k.contains("_g.")), "{what}");
        assert_eq!(bits(&on), bits(&off), "{what}");
    }
}
