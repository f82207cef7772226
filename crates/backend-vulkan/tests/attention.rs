//! The fused decode attention (`LOWSYNC_VK_FUSION`, on by default): the chain `MulMat(q, K) ->
//! SoftMax(scale, mask) -> MulMat(p, V) -> Cpy` of a decode step, laid out as the Llama graph
//! lays it out (q `[heads, 1, dim]` over a `[tokens, heads, dim]` row, K and V as views of
//! `[n_ctx, kv_heads, dim]` caches), runs as one dispatch where the graph proves the scores,
//! p and the product dead, and gives the unfused chain's results and a float64 reference's:
//! GQA, f32/f16/bf16 caches, head dims up to 256 (two dims per thread), more keys than one
//! chunk (the online softmax's rescaling), per-head and broadcast masks, a fully masked head
//! (zeros), a NaN admitted logit (a NaN row) and NaN in masked cache rows (never read).
//! Chains whose intermediates something reads, or whose graph says nothing of its scratch,
//! stay unfused. A one-layer decode through the scheduler (f16 caches written by `set_rows` in
//! the same step) fuses, replays the bits of recording every step, and keeps the unfused
//! logits within 1e-5. Every run asserts the validation layer (synchronization validation on)
//! stayed silent; recorded replays give the same bits as the first step.

mod common;

use std::sync::Arc;

use half::{bf16, f16};
use lowsync_backend::{
    Backend, BufferId, BufferUsage, ExecGraph, ExecNode, ScratchLive, TensorRef,
};
use lowsync_graph::{contiguous_strides, DType, Op};
use lowsync_vulkan::{VkConfig, VulkanBackend};

#[derive(Clone)]
struct Case {
    heads: usize,
    kv_heads: usize,
    dim: usize,
    keys: usize,
    kv: DType,
    out: DType,
    /// Mask per head (`[heads, 1, keys]`), else one row broadcast (`[1, keys]`).
    per_head_mask: bool,
    /// Head whose mask hides every key.
    all_masked: Option<usize>,
    /// Head whose query holds a NaN (every admitted logit NaN).
    nan_head: Option<usize>,
    /// NaN written into every masked cache row.
    nan_in_masked: bool,
    scale: f32,
}

fn base() -> Case {
    Case {
        heads: 8,
        kv_heads: 2,
        dim: 64,
        keys: 40,
        kv: DType::F32,
        out: DType::F32,
        per_head_mask: false,
        all_masked: None,
        nan_head: None,
        nan_in_masked: false,
        scale: 0.125,
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Values as stored in `dt` (rounded) and their bytes.
fn store(v: &[f32], dt: DType) -> (Vec<f32>, Vec<u8>) {
    match dt {
        DType::F32 => (v.to_vec(), common::f32_bytes(v)),
        DType::F16 => {
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let b = h.iter().flat_map(|x| x.to_le_bytes()).collect();
            (h.iter().map(|x| x.to_f32()).collect(), b)
        }
        DType::BF16 => {
            let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            let b = h.iter().flat_map(|x| x.to_le_bytes()).collect();
            (h.iter().map(|x| x.to_f32()).collect(), b)
        }
        d => panic!("no {d} storage here"),
    }
}

fn load(b: &[u8], dt: DType) -> Vec<f64> {
    match dt {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        d => panic!("no {d} storage here"),
    }
}

/// The case's data: q `[heads, dim]`, K and V `[keys, kv_heads, dim]` (as stored), the mask
/// `[mask_heads, keys]`.
struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    k_bytes: Vec<u8>,
    v_bytes: Vec<u8>,
    mask: Vec<f32>,
}

fn data(c: &Case, seed: u64) -> Data {
    let mut r = Rng(seed);
    let mut q: Vec<f32> = (0..c.heads * c.dim).map(|_| r.next()).collect();
    if let Some(h) = c.nan_head {
        q[h * c.dim + 3] = f32::NAN;
    }
    let mh = if c.per_head_mask { c.heads } else { 1 };
    // Roughly a third of the keys hidden, the first always visible.
    let mut mask: Vec<f32> = (0..mh * c.keys)
        .map(|i| {
            let x = r.next();
            if i % c.keys != 0 && x < -0.35 {
                f32::NEG_INFINITY
            } else {
                x * 0.5
            }
        })
        .collect();
    if let Some(h) = c.all_masked {
        assert!(c.per_head_mask);
        mask[h * c.keys..(h + 1) * c.keys].fill(f32::NEG_INFINITY);
    }
    let row = c.kv_heads * c.dim;
    let mut k: Vec<f32> = (0..c.keys * row).map(|_| r.next()).collect();
    let mut v: Vec<f32> = (0..c.keys * row).map(|_| r.next()).collect();
    if c.nan_in_masked {
        // Keys every head's mask hides (the broadcast mask's).
        for j in 0..c.keys {
            if mask[j] == f32::NEG_INFINITY {
                k[j * row..(j + 1) * row].fill(f32::NAN);
                v[j * row..(j + 1) * row].fill(f32::NAN);
            }
        }
    }
    let (k, k_bytes) = store(&k, c.kv);
    let (v, v_bytes) = store(&v, c.kv);
    Data {
        q,
        k,
        v,
        k_bytes,
        v_bytes,
        mask,
    }
}

/// Float64 attention over the admitted keys, `[heads, dim]`.
fn reference(c: &Case, d: &Data) -> Vec<f64> {
    let gqa = c.heads / c.kv_heads;
    let mut out = vec![0.0; c.heads * c.dim];
    for h in 0..c.heads {
        let kv = h / gqa;
        let m = if c.per_head_mask { h * c.keys } else { 0 };
        let mut logits = Vec::new();
        for j in 0..c.keys {
            let mv = d.mask[m + j] as f64;
            if mv == f64::NEG_INFINITY {
                continue;
            }
            let kr = (j * c.kv_heads + kv) * c.dim;
            let dot: f64 = (0..c.dim)
                .map(|e| d.q[h * c.dim + e] as f64 * d.k[kr + e] as f64)
                .sum();
            logits.push((j, dot * c.scale as f64 + mv));
        }
        let o = &mut out[h * c.dim..(h + 1) * c.dim];
        if logits.iter().any(|(_, l)| l.is_nan()) {
            o.fill(f64::NAN);
            continue;
        }
        let mx = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|x| (x.1 - mx).exp()).sum();
        for &(j, l) in &logits {
            let p = (l - mx).exp() / sum;
            let vr = (j * c.kv_heads + kv) * c.dim;
            for (x, &ve) in o.iter_mut().zip(&d.v[vr..vr + c.dim]) {
                *x += p * ve as f64;
            }
        }
    }
    out
}

fn view(buffer: BufferId, off: usize, dtype: DType, shape: &[usize], st: &[usize]) -> TensorRef {
    TensorRef {
        buffer,
        byte_offset: off,
        dtype,
        shape: shape.to_vec(),
        strides: st.to_vec(),
    }
}

fn upload(b: &VulkanBackend, bytes: &[u8]) -> BufferId {
    let id = b
        .alloc_buffer(bytes.len().max(4), BufferUsage::Compute)
        .unwrap();
    b.set_tensor(id, 0, bytes).unwrap();
    id
}

/// What the graph around the chain looks like.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Around {
    /// The scratch holding scores, p and the product is dead after the graph.
    Dead,
    /// Nothing is known of the scratch after the graph (`ExecGraph::scratch` is `None`).
    Unknown,
    /// A later node reads p.
    PRead,
}

/// Runs the chain `steps` times on a backend with `cfg`; the result `[heads, dim]` of each run
/// and whether a fused dispatch ran (from the profile when `cfg.profile`).
fn run(cfg: VkConfig, c: &Case, d: &Data, around: Around, steps: usize) -> Vec<Vec<u8>> {
    run_masks(cfg, c, d, around, &vec![d.mask.clone(); steps])
}

/// Runs the chain once per mask of `masks` (each written into the mask input before its
/// step, the graph unchanged); the result of each step, then the name of the fused kernel
/// that ran (`attn_dec`, `attn_split`, `attn_split_g` or `attn_split_v`; profiled configs
/// only).
fn run_masks(
    cfg: VkConfig,
    c: &Case,
    d: &Data,
    around: Around,
    masks: &[Vec<f32>],
) -> Vec<Vec<u8>> {
    let b = common::open(cfg).expect("a Vulkan device");
    let (hq, hk, dim, l) = (c.heads, c.kv_heads, c.dim, c.keys);
    let qb = upload(&b, &common::f32_bytes(&d.q));
    let kb = upload(&b, &d.k_bytes);
    let vb = upload(&b, &d.v_bytes);
    let mb = upload(&b, &common::f32_bytes(&d.mask));
    let q = view(qb, 0, DType::F32, &[hq, 1, dim], &[dim, hq * dim, 1]);
    let k = view(kb, 0, c.kv, &[hk, dim, l], &[dim, 1, hk * dim]);
    let v = view(vb, 0, c.kv, &[hk, l, dim], &[dim, hk * dim, 1]);
    let mask = if c.per_head_mask {
        view(mb, 0, DType::F32, &[hq, 1, l], &[l, l, 1])
    } else {
        view(mb, 0, DType::F32, &[1, l], &[l, 1])
    };
    // Scratch: scores, p, the product, and (for `PRead`) a sum of p.
    let n_sc = hq * l * 4;
    let n_o = hq * dim * 4;
    let sb = b
        .alloc_buffer(2 * n_sc + n_o + 2 * n_sc, BufferUsage::Compute)
        .unwrap();
    let sc3 = |off| {
        view(
            sb,
            off,
            DType::F32,
            &[hq, 1, l],
            &contiguous_strides(&[hq, 1, l]),
        )
    };
    let scores = sc3(0);
    let p = sc3(n_sc);
    let o = view(sb, 2 * n_sc, DType::F32, &[hq, 1, dim], &[dim, dim, 1]);
    let ob = b
        .alloc_buffer(hq * dim * c.out.size_bytes(), BufferUsage::Compute)
        .unwrap();
    let out = view(ob, 0, c.out, &[1, hq, dim], &[hq * dim, dim, 1]);
    let o_perm = view(sb, 2 * n_sc, DType::F32, &[1, hq, dim], &[dim, dim, 1]);
    let node = |op, name: &str, dst: &TensorRef, srcs: Vec<TensorRef>| ExecNode {
        op,
        name: name.into(),
        dst: dst.clone(),
        srcs,
    };
    let mut nodes = vec![
        node(Op::MulMat, "kq", &scores, vec![q, k]),
        node(
            Op::SoftMax { scale: c.scale },
            "kq_soft_max",
            &p,
            vec![scores.clone(), mask],
        ),
        node(Op::MulMat, "kqv", &o, vec![p.clone(), v]),
        node(Op::Cpy, "kqv_out", &out, vec![o_perm]),
    ];
    if around == Around::PRead {
        let p2 = sc3(2 * n_sc + n_o);
        nodes.push(node(Op::Add, "p_twice", &p2, vec![p.clone(), p.clone()]));
    }
    let graph = Arc::new(ExecGraph {
        nodes,
        scratch: (around != Around::Unknown).then(|| ScratchLive {
            buffer: sb,
            kept: Vec::new(),
        }),
    });
    let mut outs = Vec::new();
    for m in masks {
        b.set_tensor(mb, 0, &common::f32_bytes(m)).unwrap();
        b.graph_compute_async(&graph).unwrap();
        let mut bytes = vec![0u8; hq * dim * c.out.size_bytes()];
        b.get_tensor(ob, 0, &mut bytes).unwrap();
        outs.push(bytes);
    }
    b.synchronize().unwrap();
    let times = b.kernel_times();
    for kernel in ["attn_dec", "attn_split", "attn_split_g", "attn_split_v"] {
        if times
            .iter()
            .any(|t| t.name.starts_with(&format!("{kernel}.")))
        {
            outs.push(kernel.as_bytes().to_vec());
        }
    }
    // A split step is one dispatch: its last chunk merges (no second kernel).
    let split_calls: u64 = times
        .iter()
        .filter(|t| t.name.starts_with("attn_split"))
        .map(|t| t.count)
        .sum();
    if split_calls > 0 {
        assert_eq!(
            split_calls,
            masks.len() as u64,
            "one attn_split dispatch a step"
        );
    }
    common::assert_clean(&b);
    outs
}

fn cfg(fuse: bool, profile: bool) -> VkConfig {
    VkConfig {
        fusion: fuse,
        profile,
        attn_split: Some(0),
        attn_group: Some(false),
        attn_vec: false,
        ..common::config()
    }
}

/// `cfg(true, profile)` with the attention split into at most `chunks` per head.
fn cfg_split(chunks: u32, profile: bool) -> VkConfig {
    VkConfig {
        attn_split: Some(chunks),
        ..cfg(true, profile)
    }
}

/// `cfg_split` with the query heads of a KV head in one workgroup (`LOWSYNC_VK_ATTN_GROUP=1`).
fn cfg_group(chunks: u32, profile: bool) -> VkConfig {
    VkConfig {
        attn_group: Some(true),
        ..cfg_split(chunks, profile)
    }
}

/// `cfg_split` with K and V read 16 bytes at a time (`LOWSYNC_VK_ATTN_VEC=1`); `chunks` 0:
/// unsplit.
fn cfg_vec(chunks: u32, profile: bool) -> VkConfig {
    VkConfig {
        attn_vec: true,
        ..cfg_split(chunks, profile)
    }
}

/// Whether the grouped split takes `c`: 2 to 4 query heads per KV head, their dims in one
/// workgroup, one mask row for every head.
fn groupable(c: &Case) -> bool {
    let g = c.heads / c.kv_heads;
    (2..=4).contains(&g) && g * c.dim <= 256 && !c.per_head_mask
}

/// Fails unless `got` matches the float64 reference within `tol` (NaN where it is NaN).
fn assert_near(what: &str, c: &Case, got: &[f64], want: &[f64], tol: f64) {
    for i in 0..want.len() {
        let h = i / c.dim;
        assert_eq!(
            got[i].is_nan(),
            want[i].is_nan(),
            "{what}, head {h}: {} ref {}",
            got[i],
            want[i]
        );
        if !want[i].is_nan() {
            assert!(
                (got[i] - want[i]).abs() <= tol,
                "{what}, head {h} elem {i}: {} ref {}",
                got[i],
                want[i]
            );
        }
    }
}

/// Runs `c` fused (profiled, then recorded and replayed) and unfused; checks both against the
/// reference, each other and the replays.
fn check(c: &Case) {
    let d = data(c, 0x5eed ^ (c.keys * 31 + c.dim) as u64);
    let Some(_) = common::open(common::config()) else {
        return;
    };
    let fused = run(cfg(true, true), c, &d, Around::Dead, 1);
    assert_eq!(fused.len(), 2, "the chain runs fused");
    assert_eq!(fused[1], b"attn_dec", "unsplit: one workgroup per head");
    let unfused = run(cfg(false, true), c, &d, Around::Dead, 1);
    assert_eq!(unfused.len(), 1, "LOWSYNC_VK_FUSION=0 runs it unfused");
    let replays = run(cfg(true, false), c, &d, Around::Dead, 3);
    for r in &replays {
        assert_eq!(
            r, &fused[0],
            "recorded replays give the profiled run's bits"
        );
    }
    if c.nan_in_masked {
        let u = load(&unfused[0], c.out);
        assert!(
            u.iter().all(|x| x.is_nan()),
            "the unfused chain reads the NaN rows"
        );
    }
    let want = reference(c, &d);
    let tol = if c.out == DType::F32 { 2e-5 } else { 1e-2 };
    let (f, u) = (load(&fused[0], c.out), load(&unfused[0], c.out));
    for i in 0..want.len() {
        let h = i / c.dim;
        assert_eq!(
            f[i].is_nan(),
            want[i].is_nan(),
            "head {h}: fused {} ref {}",
            f[i],
            want[i]
        );
        if !want[i].is_nan() {
            let err = (f[i] - want[i]).abs();
            assert!(
                err <= tol,
                "head {h} elem {i}: fused {} ref {}",
                f[i],
                want[i]
            );
        }
        if !c.nan_in_masked {
            // Unfused reads the masked rows too; without NaN there it agrees.
            assert_eq!(u[i].is_nan(), f[i].is_nan(), "head {h}: unfused {}", u[i]);
            if !u[i].is_nan() {
                let err = (f[i] - u[i]).abs();
                assert!(
                    err <= tol,
                    "head {h} elem {i}: fused {} unfused {}",
                    f[i],
                    u[i]
                );
            }
        }
    }
    check_split(c, &d, &want, tol);
    check_grouped_unsplit(c, &d, &want, tol);
    check_vec(c, &d, &want, tol);
}

/// `LOWSYNC_VK_ATTN_VEC=1` unsplit and with at most 3 and 8 chunks a head: `attn_split_v`
/// where the head dim is a multiple of 8 (the cases' caches are contiguous), else the kernel
/// the split count picks; profiled, then recorded and replayed, against the reference.
fn check_vec(c: &Case, d: &Data, want: &[f64], tol: f64) {
    for chunks in [0, 3, 8] {
        let once = run(cfg_vec(chunks, true), c, d, Around::Dead, 1);
        let kernel: &[u8] = match (c.dim % 8, chunks) {
            (0, _) => b"attn_split_v",
            (_, 0) => b"attn_dec",
            _ => b"attn_split",
        };
        assert_eq!(once[1], kernel, "LOWSYNC_VK_ATTN_VEC=1, {chunks} chunks");
        for r in &run(cfg_vec(chunks, false), c, d, Around::Dead, 3) {
            assert_eq!(r, &once[0], "vec replays give the profiled run's bits");
        }
        let what = format!("vec, split {chunks}");
        assert_near(&what, c, &load(&once[0], c.out), want, tol);
    }
}

/// `LOWSYNC_VK_ATTN_GROUP=1` with the split off: one workgroup per KV head (`attn_split_g`
/// with one chunk) where the grouped kernel takes `c`, else `attn_dec`; profiled, then
/// recorded and replayed, against the reference.
fn check_grouped_unsplit(c: &Case, d: &Data, want: &[f64], tol: f64) {
    let group = |profile| VkConfig {
        attn_group: Some(true),
        ..cfg(true, profile)
    };
    let once = run(group(true), c, d, Around::Dead, 1);
    let kernel: &[u8] = if groupable(c) {
        b"attn_split_g"
    } else {
        b"attn_dec"
    };
    assert_eq!(once[1], kernel, "LOWSYNC_VK_ATTN_GROUP=1, unsplit");
    for r in &run(group(false), c, d, Around::Dead, 3) {
        assert_eq!(r, &once[0], "grouped replays give the profiled run's bits");
    }
    assert_near("grouped, unsplit", c, &load(&once[0], c.out), want, tol);
}

/// The split kernels on `c` (at most 3 and 8 chunks a head): profiled, then recorded and
/// replayed, against the reference.
fn check_split(c: &Case, d: &Data, want: &[f64], tol: f64) {
    for chunks in [3, 8] {
        let split = run(cfg_split(chunks, true), c, d, Around::Dead, 1);
        assert_eq!(split.len(), 2, "the chain runs fused");
        assert_eq!(
            split[1], b"attn_split",
            "LOWSYNC_VK_ATTN_SPLIT={chunks} splits"
        );
        let replays = run(cfg_split(chunks, false), c, d, Around::Dead, 3);
        for r in &replays {
            assert_eq!(r, &split[0], "split replays give the profiled run's bits");
        }
        let what = format!("split {chunks}");
        assert_near(&what, c, &load(&split[0], c.out), want, tol);

        // Grouped where the kernel takes the case, else the per-head split as before.
        let grouped = run(cfg_group(chunks, true), c, d, Around::Dead, 1);
        let kernel: &[u8] = if groupable(c) {
            b"attn_split_g"
        } else {
            b"attn_split"
        };
        assert_eq!(
            grouped[1], kernel,
            "LOWSYNC_VK_ATTN_GROUP=1, {chunks} chunks"
        );
        let replays = run(cfg_group(chunks, false), c, d, Around::Dead, 3);
        for r in &replays {
            assert_eq!(
                r, &grouped[0],
                "grouped replays give the profiled run's bits"
            );
        }
        let what = format!("grouped, split {chunks}");
        assert_near(&what, c, &load(&grouped[0], c.out), want, tol);
    }
}

#[test]
fn gqa_f32_cache_broadcast_mask() {
    check(&base());
}

#[test]
fn f16_cache_and_f16_result() {
    check(&Case {
        kv: DType::F16,
        out: DType::F16,
        ..base()
    });
}

#[test]
fn bf16_cache() {
    check(&Case {
        kv: DType::BF16,
        ..base()
    });
}

#[test]
fn more_keys_than_a_chunk_and_wide_heads() {
    check(&Case {
        heads: 4,
        kv_heads: 4,
        dim: 200,
        keys: 1300,
        kv: DType::F16,
        ..base()
    });
}

#[test]
fn fully_masked_head_gives_zeros_and_nan_logit_gives_nan_row() {
    let c = Case {
        per_head_mask: true,
        all_masked: Some(2),
        nan_head: Some(5),
        ..base()
    };
    check(&c);
    let d = data(&c, 7);
    if common::open(common::config()).is_none() {
        return;
    }
    let f = load(&run(cfg(true, false), &c, &d, Around::Dead, 1)[0], c.out);
    assert!(f[2 * c.dim..3 * c.dim].iter().all(|&x| x == 0.0));
    assert!(f[5 * c.dim..6 * c.dim].iter().all(|x| x.is_nan()));
    assert!(f[..2 * c.dim].iter().all(|x| x.is_finite()));
}

#[test]
fn masked_cache_rows_are_never_read() {
    // NaN in every masked row: the unfused chain's scores there are NaN (and so is its
    // result); the fused kernel skips those rows and matches the reference.
    check(&Case {
        nan_in_masked: true,
        keys: 600,
        ..base()
    });
}

/// Window lengths around the score pass (64 keys), the chunk (512) and a long window, f32
/// and f16 caches, one and four query heads per kv head, NaN in every masked cache row.
#[test]
fn split_over_keys_matches_the_reference_at_every_window_length() {
    for (i, keys) in [1, 63, 64, 65, 511, 512, 513, 2000].into_iter().enumerate() {
        let (heads, kv_heads) = if i % 2 == 0 { (8, 2) } else { (4, 4) };
        check(&Case {
            heads,
            kv_heads,
            keys,
            kv: if i % 3 == 0 { DType::F16 } else { DType::F32 },
            nan_in_masked: keys > 1,
            ..base()
        });
    }
}

#[test]
fn split_fully_masked_head_gives_zeros_and_nan_logit_gives_nan_row() {
    let c = Case {
        per_head_mask: true,
        all_masked: Some(2),
        nan_head: Some(5),
        keys: 700,
        ..base()
    };
    check(&c);
    let d = data(&c, 7);
    if common::open(common::config()).is_none() {
        return;
    }
    let f = load(&run(cfg_split(8, false), &c, &d, Around::Dead, 1)[0], c.out);
    assert!(f[2 * c.dim..3 * c.dim].iter().all(|&x| x == 0.0));
    assert!(f[5 * c.dim..6 * c.dim].iter().all(|x| x.is_nan()));
    assert!(f[..2 * c.dim].iter().all(|x| x.is_finite()));
}

/// A decode's mask: the first `depth` keys admitted (the rest NaN in the cache, never read).
/// One recorded graph replayed as the depth grows gives the bits of a graph recorded afresh
/// at every step, and the reference's values.
#[test]
fn split_recorded_step_replays_at_growing_depth() {
    replays_at_growing_depth(
        cfg_split,
        b"attn_split",
        &[1, 16, 64, 65, 130, 160, 400, 1023, 1100],
        23,
    );
}

/// A head dim that is not a multiple of 8 (K and V rows not on 16 bytes): with
/// `LOWSYNC_VK_ATTN_VEC=1` the per-head kernels run instead of `attn_split_v` (`check_vec`),
/// with the reference's results.
#[test]
fn vec_attention_falls_back_where_rows_are_not_16_byte_aligned() {
    check(&Case {
        dim: 36,
        keys: 300,
        kv: DType::F16,
        ..base()
    });
}

/// The same with K and V read 16 bytes at a time (`attn_split_v`: one workgroup a head up to
/// 256 valid keys, then chunks of at least 256 merged by the last).
#[test]
fn split_v_recorded_step_replays_at_growing_depth() {
    replays_at_growing_depth(
        cfg_vec,
        b"attn_split_v",
        &[1, 16, 64, 65, 130, 160, 256, 257, 400, 1023, 1100],
        29,
    );
}

/// One recording of a split attention (`config(8, profile)`, kernel `kernel`) replayed at
/// each depth: bit for bit a fresh recording's result, and the reference's within 2e-5; the
/// cache rows no depth reaches hold NaN, so a key read past the valid ones shows.
fn replays_at_growing_depth(
    config: fn(u32, bool) -> VkConfig,
    kernel: &[u8],
    depths: &[usize],
    seed: u64,
) {
    let c = Case {
        heads: 8,
        kv_heads: 2,
        keys: 1200,
        kv: DType::F16,
        ..base()
    };
    let mut d = data(&c, seed);
    if common::open(common::config()).is_none() {
        return;
    }
    let masks: Vec<Vec<f32>> = depths
        .iter()
        .map(|&n| {
            (0..c.keys)
                .map(|j| if j < n { 0.0 } else { f32::NEG_INFINITY })
                .collect()
        })
        .collect();
    // f16 0x7e00 is NaN.
    let row = c.kv_heads * c.dim * 2;
    for b in [&mut d.k_bytes, &mut d.v_bytes] {
        for w in b[1100 * row..].chunks_exact_mut(2) {
            w.copy_from_slice(&0x7e00u16.to_le_bytes());
        }
    }
    let replayed = run_masks(config(8, false), &c, &d, Around::Dead, &masks);
    let fresh = run_masks(
        VkConfig {
            record: false,
            ..config(8, true)
        },
        &c,
        &d,
        Around::Dead,
        &masks,
    );
    assert_eq!(fresh.last().unwrap(), kernel);
    for (i, &n) in depths.iter().enumerate() {
        assert_eq!(
            replayed[i], fresh[i],
            "depth {n}: the replayed recording gives the fresh recording's bits"
        );
        d.mask.clone_from(&masks[i]);
        let want = reference(&c, &d);
        assert_near(
            &format!("depth {n}"),
            &c,
            &load(&replayed[i], c.out),
            &want,
            2e-5,
        );
    }
}

#[test]
fn live_intermediates_or_unknown_scratch_stay_unfused() {
    let c = base();
    let d = data(&c, 11);
    if common::open(common::config()).is_none() {
        return;
    }
    let fused = run(cfg(true, true), &c, &d, Around::Dead, 1);
    for around in [Around::Unknown, Around::PRead] {
        let r = run(cfg(true, true), &c, &d, around, 1);
        assert_eq!(r.len(), 1, "not fused");
        let (a, b) = (load(&r[0], c.out), load(&fused[0], c.out));
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 2e-5));
    }
}

/// A one-layer decode through the scheduler, laid out as the Llama graph: q rotated, K and V
/// rows written into persistent caches by `set_rows` and read back through permuted views by
/// the attention under the mask, the heads' results copied back to a row and projected.
mod scheduled {
    use super::*;
    use lowsync_graph::{Graph, RopeMode};
    use lowsync_scheduler::{Sched, SyncPolicy};

    const V: usize = 32;
    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HD: usize = 16;
    const N_CTX: usize = 24;

    fn w(g: &mut Graph, name: &str, shape: &[usize], seed: u64) -> lowsync_graph::TensorId {
        let n = shape.iter().product();
        let mut r = Rng(seed);
        let v: Vec<f32> = (0..n).map(|_| r.next()).collect();
        g.weight(name, shape, DType::F32, common::f32_bytes(&v), None)
            .unwrap()
    }

    fn graph() -> Graph {
        let mut g = Graph::new();
        let tok = g.input("tok", &[1], DType::I32).unwrap();
        let pos = g.input("pos", &[1], DType::I32).unwrap();
        let slot = g.input("slot", &[1], DType::I32).unwrap();
        let mask = g.input("mask", &[1, N_CTX], DType::F32).unwrap();
        let emb = w(&mut g, "emb", &[V, HEADS * HD], 1);
        let wq = w(&mut g, "wq", &[HEADS * HD, HEADS * HD], 2);
        let wk = w(&mut g, "wk", &[KV_HEADS * HD, HEADS * HD], 3);
        let wv = w(&mut g, "wv", &[KV_HEADS * HD, HEADS * HD], 4);
        let out = w(&mut g, "out", &[V, HEADS * HD], 5);
        let kc = g
            .persistent("k_cache", &[N_CTX, KV_HEADS * HD], DType::F16)
            .unwrap();
        let vc = g
            .persistent("v_cache", &[N_CTX, KV_HEADS * HD], DType::F16)
            .unwrap();
        let x = g.get_rows(emb, tok).unwrap();
        let wqt = g.transpose(wq, 0, 1).unwrap();
        let wkt = g.transpose(wk, 0, 1).unwrap();
        let wvt = g.transpose(wv, 0, 1).unwrap();
        let q = g.mul_mat(x, wqt).unwrap();
        let q = g.reshape(q, &[1, HEADS, HD]).unwrap();
        let q = g.rope(q, pos, RopeMode::Normal, HD, 10_000.0).unwrap();
        let k = g.mul_mat(x, wkt).unwrap();
        let v = g.mul_mat(x, wvt).unwrap();
        let k_all = g.set_rows(kc, k, slot).unwrap();
        let v_all = g.set_rows(vc, v, slot).unwrap();
        let keys = g.reshape(k_all, &[N_CTX, KV_HEADS, HD]).unwrap();
        let keys = g.permute(keys, &[1, 2, 0]).unwrap();
        let values = g.reshape(v_all, &[N_CTX, KV_HEADS, HD]).unwrap();
        let values = g.permute(values, &[1, 0, 2]).unwrap();
        let queries = g.permute(q, &[1, 0, 2]).unwrap();
        let scores = g.mul_mat(queries, keys).unwrap();
        let p = g.soft_max(scores, Some(mask), 0.25).unwrap();
        let o = g.mul_mat(p, values).unwrap();
        let o = g.permute(o, &[1, 0, 2]).unwrap();
        let o = g.cont(o).unwrap();
        let o = g.reshape(o, &[1, HEADS * HD]).unwrap();
        let outt = g.transpose(out, 0, 1).unwrap();
        let logits = g.mul_mat(o, outt).unwrap();
        g.output("logits", logits).unwrap();
        g
    }

    /// Logits of `steps` decode steps, and whether `attn_dec` ran (profiled configs only).
    fn decode(cfg: VkConfig, steps: usize) -> (Vec<Vec<f64>>, bool) {
        let b = Arc::new(common::open(cfg).expect("a Vulkan device"));
        let dynb: Arc<dyn Backend> = b.clone();
        let sched = Sched::with_debug_realloc(vec![dynb], SyncPolicy::Staged, 1, 1).unwrap();
        let mut plan = sched.compile(&graph()).unwrap();
        let mut out = Vec::new();
        for i in 0..steps {
            let mask: Vec<f32> = (0..N_CTX)
                .map(|c| if c <= i { 0.0 } else { f32::NEG_INFINITY })
                .collect();
            plan.set_input("tok", &common::i32_bytes(&[(i * 7 % V) as i32]))
                .unwrap();
            plan.set_input("pos", &common::i32_bytes(&[i as i32]))
                .unwrap();
            plan.set_input("slot", &common::i32_bytes(&[i as i32]))
                .unwrap();
            plan.set_input("mask", &common::f32_bytes(&mask)).unwrap();
            plan.compute().unwrap();
            out.push(load(&plan.get_output("logits").unwrap(), DType::F32));
        }
        b.synchronize().unwrap();
        let fused = b
            .kernel_times()
            .iter()
            .any(|t| t.name.starts_with("attn_dec"));
        common::assert_clean(&b);
        (out, fused)
    }

    #[test]
    fn a_scheduled_decode_fuses_replays_and_matches_the_unfused_steps() {
        if common::open(common::config()).is_none() {
            return;
        }
        let steps = 10;
        let (on, _) = decode(cfg(true, false), steps);
        let (off, _) = decode(cfg(false, false), steps);
        let (profiled, fused) = decode(cfg(true, true), steps);
        let (split, _) = decode(cfg_split(1, false), steps);
        assert!(fused, "the scheduled decode's attention runs fused");
        for i in 0..steps {
            assert_eq!(
                on[i], profiled[i],
                "step {i}: replayed and recorded-every-step agree"
            );
            for (a, b) in split[i].iter().zip(&on[i]) {
                assert!(
                    (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                    "step {i}: split {a} unsplit {b}"
                );
            }
            let scale = off[i].iter().fold(0.0f64, |m, x| m.max(x.abs()));
            for (a, b) in on[i].iter().zip(&off[i]) {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "step {i}: fused {a} unfused {b}"
                );
            }
        }
    }
}

#[test]
fn grouped_split_takes_two_to_four_heads_per_kv_head() {
    // G = 3 (dim 64), G = 2 with dim 128, G = 4 over an f16 cache and an f16 result, a NaN
    // query element in one head, and G = 8 (too many: the per-head split).
    for (heads, kv_heads, dim, keys) in [(6, 2, 64, 300), (4, 2, 128, 129), (8, 1, 64, 90)] {
        check(&Case {
            heads,
            kv_heads,
            dim,
            keys,
            nan_in_masked: true,
            ..base()
        });
    }
    check(&Case {
        heads: 8,
        kv_heads: 2,
        keys: 700,
        kv: DType::F16,
        out: DType::F16,
        nan_head: Some(5),
        ..base()
    });
}

#[test]
fn grouped_split_replays_at_growing_depth() {
    replays_at_growing_depth(
        cfg_group,
        b"attn_split_g",
        &[1, 31, 32, 33, 100, 400, 1100],
        29,
    );
}
