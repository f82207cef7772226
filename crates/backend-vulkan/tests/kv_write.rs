//! One token's K and V written straight into their KV-cache rows (`LOWSYNC_VK_FUSION`, on by
//! default): K's rotary embedding and its `SetRows` as one `rope_set_rows` dispatch, V's
//! product and its `SetRows` as one `mul_mat_vec_*_r` dispatch, where the graph proves the
//! row dead after the copy; bit-identical to the unfused pairs for f32, f16 and bf16 caches
//! (both rotation modes and a partial rotation; float and block weights); a bad cache index is
//! the same error, naming the `SetRows`; a pair stays unfused where something else reads the
//! row. Every run asserts the validation layer (synchronization validation on) stayed silent.

mod common;

use common::{t, values};

use std::sync::Arc;

use lowsync_backend::{Backend, BufferUsage, Error, ExecGraph, ExecNode, ScratchLive, TensorRef};
use lowsync_graph::{DType, Op, RopeMode};
use lowsync_vulkan::{QuantMatVec, VkConfig};

struct Case {
    heads: usize,
    dim: usize,
    n_dims: usize,
    mode: RopeMode,
    cache: DType,
    /// The cache row the token goes to (out of `ROWS`).
    row: i32,
    /// A later node reads the rotated row.
    live: bool,
}

const ROWS: usize = 6;

/// The cache's bytes after the pair ran (or the error it gave), and whether `rope_set_rows` ran.
fn run(fusion: bool, c: &Case) -> (Result<Vec<u8>, Error>, bool) {
    run_with(fusion, c, None)
}

/// A product's weight dtype, k, whether subgroups are off, and the block mat-vec body asked
/// for (`None`: the harness's).
type Product = (DType, usize, bool, Option<QuantMatVec>);

/// `run`, or with `product: Some(..)` V's pair instead: a one-row product `[1, k] @ w.T` into
/// `[1, H * D]` copied into the cache row (`mul_mat_vec_*_r`).
fn run_with(fusion: bool, c: &Case, product: Option<Product>) -> (Result<Vec<u8>, Error>, bool) {
    let base = common::config();
    let b = common::open(VkConfig {
        fusion,
        profile: true,
        no_subgroups: product.is_some_and(|p| p.2),
        quant_mat_vec: product.and_then(|p| p.3).or(base.quant_mat_vec),
        ..base
    })
    .expect("a Vulkan device");
    let hd = c.heads * c.dim;
    let xb = common::buffer_with(&b, &common::f32_bytes(&values(hd, 1)));
    let pb = common::buffer_with(&b, &common::i32_bytes(&[37]));
    let ib = common::buffer_with(&b, &common::i32_bytes(&[c.row]));
    let cache_bytes = ROWS * hd * c.cache.size_bytes();
    let cb = common::buffer_with(&b, &vec![0x3cu8; cache_bytes]);
    let sb = b.alloc_buffer(2 * hd * 4, BufferUsage::Compute).unwrap();
    let rotated = t(sb, 0, DType::F32, &[1, c.heads, c.dim]);
    let cache = t(cb, 0, c.cache, &[ROWS, hd]);
    let first = match product {
        None => ExecNode {
            op: Op::Rope {
                mode: c.mode,
                n_dims: c.n_dims,
                theta_base: 10000.0,
            },
            name: "rope_k".into(),
            dst: rotated.clone(),
            srcs: vec![
                t(xb, 0, DType::F32, &[1, c.heads, c.dim]),
                t(pb, 0, DType::I32, &[1]),
            ],
        },
        Some((wt, k, _, _)) => {
            let ab = common::buffer_with(&b, &common::f32_bytes(&values(k, 5)));
            let wb = common::buffer_with(&b, &weight(wt, hd, k));
            ExecNode {
                op: Op::MulMat,
                name: "v".into(),
                dst: t(sb, 0, DType::F32, &[1, hd]),
                srcs: vec![
                    t(ab, 0, DType::F32, &[1, k]),
                    TensorRef {
                        buffer: wb,
                        byte_offset: 0,
                        dtype: wt,
                        shape: vec![k, hd],
                        strides: vec![1, k],
                    },
                ],
            }
        }
    };
    let mut nodes = vec![
        first,
        ExecNode {
            op: Op::SetRows,
            name: "k_to_cache".into(),
            dst: cache.clone(),
            srcs: vec![
                cache,
                t(sb, 0, DType::F32, &[1, hd]),
                t(ib, 0, DType::I32, &[1]),
            ],
        },
    ];
    if c.live {
        nodes.push(ExecNode {
            op: Op::Add,
            name: "reads_rotated".into(),
            dst: t(sb, hd * 4, DType::F32, &[1, c.heads, c.dim]),
            srcs: vec![rotated.clone(), rotated],
        });
    }
    let graph = Arc::new(ExecGraph {
        nodes,
        scratch: Some(ScratchLive {
            buffer: sb,
            kept: Vec::new(),
        }),
    });
    b.graph_compute_async(&graph).unwrap();
    let mut bytes = vec![0u8; cache_bytes];
    let got = b
        .get_tensor(cb, 0, &mut bytes)
        .and_then(|()| b.synchronize())
        .map(|()| bytes);
    let fused = b
        .kernel_times()
        .iter()
        .any(|k| k.name.starts_with("rope_set_rows") || k.name.contains("_r.d_"));
    common::assert_clean(&b);
    (got, fused)
}

#[test]
fn rope_into_the_cache_row_is_bit_identical_to_rope_then_set_rows() {
    if common::open(common::config()).is_none() {
        return;
    }
    let cases = [
        (4, 64, 64, RopeMode::Normal, DType::F32, 3),
        (2, 64, 64, RopeMode::Neox, DType::F16, 0),
        (3, 32, 16, RopeMode::Normal, DType::BF16, 5),
        (8, 128, 96, RopeMode::Neox, DType::F16, 2),
    ];
    for (heads, dim, n_dims, mode, cache, row) in cases {
        let c = Case {
            heads,
            dim,
            n_dims,
            mode,
            cache,
            row,
            live: false,
        };
        let (on, fused) = run(true, &c);
        let (off, unfused) = run(false, &c);
        let what = format!("{heads}x{dim} n_dims {n_dims} {mode:?} {cache}");
        assert!(fused, "{what}: fused");
        assert!(!unfused, "{what}: LOWSYNC_VK_FUSION=0 runs unfused");
        assert_eq!(on.unwrap(), off.unwrap(), "{what}");
    }
}

#[test]
fn a_bad_cache_row_is_the_set_rows_error_and_a_read_rotation_stays_unfused() {
    if common::open(common::config()).is_none() {
        return;
    }
    let mut c = Case {
        heads: 2,
        dim: 16,
        n_dims: 16,
        mode: RopeMode::Normal,
        cache: DType::F16,
        row: ROWS as i32,
        live: false,
    };
    for fusion in [true, false] {
        let (got, fused) = run(fusion, &c);
        assert_eq!(fused, fusion);
        match got {
            Err(Error::Kernel { node, msg, .. }) => {
                assert_eq!(node, "k_to_cache", "fusion {fusion}");
                assert!(msg.contains(&format!("= {ROWS}")), "{msg}");
            }
            other => panic!("fusion {fusion}: expected a kernel error, got {other:?}"),
        }
    }
    c.row = 1;
    c.live = true;
    let (got, fused) = run(true, &c);
    assert!(!fused);
    assert_eq!(got.unwrap(), run(false, &c).0.unwrap());
}

/// `rows` rows of `k` weights of `dt`: float values, or blocks of arbitrary bytes whose f16
/// scale and min are small and finite.
fn weight(dt: DType, rows: usize, k: usize) -> Vec<u8> {
    let v = values(rows * k, 9);
    match dt {
        DType::F32 => common::f32_bytes(&v),
        DType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x / 8.0).to_le_bytes())
            .collect(),
        _ => {
            let nb = rows * k / dt.block_size();
            let mut out: Vec<u8> = values(nb * dt.block_bytes(), 11)
                .iter()
                .map(|x| (x * 1000.0) as i32 as u8)
                .collect();
            let fields: &[usize] = if dt == DType::Q4_K { &[0, 2] } else { &[0] };
            for b in 0..nb {
                for (i, &f) in fields.iter().enumerate() {
                    let at = b * dt.block_bytes() + f;
                    let s = 0.01 + 0.002 * (b % 7) as f32 - 0.015 * i as f32;
                    out[at..at + 2].copy_from_slice(&half::f16::from_f32(s).to_le_bytes());
                }
            }
            out
        }
    }
}

#[test]
fn a_product_into_the_cache_row_is_bit_identical_to_the_product_then_set_rows() {
    if common::open(common::config()).is_none() {
        return;
    }
    // (heads, dim, cache, weight, k, no subgroups): 16-byte-load and 4-element float kernels,
    // block types, the shared-memory kernels.
    let cases = [
        (4, 16, DType::F16, DType::F16, 64, false),
        (2, 10, DType::F32, DType::F32, 12, false),
        (3, 8, DType::BF16, DType::Q4_0, 64, false),
        (2, 32, DType::F16, DType::Q8_0, 96, false),
        (1, 24, DType::F16, DType::Q4_K, 256, false),
        (4, 16, DType::F16, DType::F16, 64, true),
        (2, 16, DType::F32, DType::Q4_0, 64, true),
    ];
    // The same through the integer-dot body (`LOWSYNC_VK_QV=idot`) where the device has it.
    let idot = [
        (3, 8, DType::BF16, DType::Q4_0, 64),
        (2, 32, DType::F16, DType::Q8_0, 96),
        (2, 16, DType::F32, DType::Q4_1, 256),
        (1, 24, DType::F16, DType::Q4_K, 256),
        (2, 8, DType::F16, DType::Q6_K, 512),
    ];
    let cases = cases
        .iter()
        .map(|&(h, d, c, w, k, no_sg)| (h, d, c, w, k, no_sg, None))
        .chain(
            idot.iter()
                .map(|&(h, d, c, w, k)| (h, d, c, w, k, false, Some(QuantMatVec::Idot))),
        );
    for (heads, dim, cache, wt, k, no_sg, qv) in cases {
        let c = Case {
            heads,
            dim,
            n_dims: dim,
            mode: RopeMode::Normal,
            cache,
            row: 4,
            live: false,
        };
        let p = Some((wt, k, no_sg, qv));
        let (on, fused) = run_with(true, &c, p);
        let (off, unfused) = run_with(false, &c, p);
        let what = format!("{heads}x{dim} {cache} <- {wt} k={k} no_subgroups {no_sg} {qv:?}");
        assert!(fused, "{what}: fused");
        assert!(!unfused, "{what}: unfused");
        assert_eq!(on.unwrap(), off.unwrap(), "{what}");
    }
    let mut c = Case {
        heads: 2,
        dim: 16,
        n_dims: 16,
        mode: RopeMode::Normal,
        cache: DType::F16,
        row: -1,
        live: false,
    };
    let p = Some((DType::F16, 64, false, None));
    let (got, fused) = run_with(true, &c, p);
    assert!(fused);
    match got {
        Err(Error::Kernel { node, msg, .. }) => {
            assert_eq!(node, "k_to_cache");
            assert!(msg.contains("= -1"), "{msg}");
        }
        other => panic!("expected a kernel error, got {other:?}"),
    }
    c.row = 2;
    c.live = true;
    let (got, fused) = run_with(true, &c, p);
    assert!(!fused);
    assert_eq!(got.unwrap(), run_with(false, &c, p).0.unwrap());
}
