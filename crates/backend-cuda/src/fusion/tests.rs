//! The plan against hand-built graphs with the scheduler's byte offsets: no device needed.

use lowsync_backend::{BufferId, ExecNode, ScratchLive, TensorRef};
use lowsync_graph::{DType, Op, RopeMode};

use super::attention::mask_ahead;
use super::gemv::{FgSeg, FgSet};
use super::group::{has_tails, Group, Kind, Nodes, NormPro, Seg, Step, MAX_SEGS};
use super::safety::{byte_range, head_aligned, Dead};

/// Nodes with nothing known of what is read after them.
fn bare(nodes: &[ExecNode]) -> Nodes<'_> {
    Nodes {
        list: nodes,
        end: None,
    }
}

/// The defaults' plan settings (`CudaConfig::default`).
const PC: super::PlanCfg = super::PlanCfg {
    mmv_max_m: None,
    prefill: true,
    head_fold: true,
};

fn plan(nodes: &[ExecNode], mmv_max_m: Option<usize>) -> Vec<Step> {
    plan_fold(nodes, mmv_max_m, true)
}

/// `plan` with `head_fold` (`CudaConfig::q_head` and `q_head_fold`) as given.
fn plan_fold(nodes: &[ExecNode], mmv_max_m: Option<usize>, head_fold: bool) -> Vec<Step> {
    let pc = super::PlanCfg {
        mmv_max_m,
        prefill: true,
        head_fold,
    };
    super::plan(&bare(nodes), &pc)
}

fn dead_after(nodes: &[ExecNode], at: usize, reader: usize) -> bool {
    super::safety::dead_after(&bare(nodes), at, reader)
}

const ACT: u64 = 1;
const INPUTS: u64 = 2;
const K_CACHE: u64 = 3;
const V_CACHE: u64 = 4;

fn view(
    buf: u64,
    byte_offset: usize,
    dtype: DType,
    shape: &[usize],
    strides: &[usize],
) -> TensorRef {
    TensorRef {
        buffer: BufferId(buf),
        byte_offset,
        dtype,
        shape: shape.to_vec(),
        strides: strides.to_vec(),
    }
}

fn packed(buf: u64, byte_offset: usize, dtype: DType, shape: &[usize]) -> TensorRef {
    view(
        buf,
        byte_offset,
        dtype,
        shape,
        &lowsync_graph::contiguous_strides(shape),
    )
}

/// An f32 activation of `ACT`.
fn act(byte_offset: usize, shape: &[usize]) -> TensorRef {
    packed(ACT, byte_offset, DType::F32, shape)
}

/// GGUF weight `[out, in]` seen as `w.T`, alone in buffer `id`.
fn wt(id: u64, dtype: DType, inp: usize, out: usize) -> TensorRef {
    view(id, 0, dtype, &[inp, out], &[1, inp])
}

fn node(op: Op, dst: TensorRef, srcs: Vec<TensorRef>) -> ExecNode {
    ExecNode {
        op,
        name: op.name().into(),
        dst,
        srcs,
    }
}

const NORM: Op = Op::RmsNorm { eps: 1e-5 };
const ROPE: Op = Op::Rope {
    mode: RopeMode::Normal,
    n_dims: 16,
    theta_base: 1e4,
};
const SOFT_MAX: Op = Op::SoftMax { scale: 0.25 };

/// One decode layer of llama.py's graph (T = 1, d 64, 4 query heads over 2 kv heads of 16,
/// ffn 128, 32 cache rows) with the byte offsets the scheduler's allocator gives it: rope q
/// over h, rope k over the raw q, the scores over k and v, p @ V over q, its Cpy over the
/// scores, in-place bias and residual adds, SwiGlu in place over gate.
fn layer(bias: bool, kv: DType) -> Vec<ExecNode> {
    let (x, h) = (act(0, &[1, 64]), act(256, &[1, 64]));
    let pos = packed(INPUTS, 64, DType::I32, &[1]);
    let kv_idx = packed(INPUTS, 128, DType::I32, &[1]);
    let mask = packed(INPUTS, 192, DType::F32, &[1, 32]);
    let k_cache = packed(K_CACHE, 0, kv, &[32, 32]);
    let v_cache = packed(V_CACHE, 0, kv, &[32, 32]);
    let mut v = Vec::new();
    let linear = |v: &mut Vec<ExecNode>, w: u64, a: &TensorRef, dst: TensorRef| {
        let (inp, out) = (a.shape[1], dst.shape[1]);
        v.push(node(
            Op::MulMat,
            dst.clone(),
            vec![a.clone(), wt(w, DType::F32, inp, out)],
        ));
        if bias {
            let b = packed(w + 1, 0, DType::F32, &[out]);
            v.push(node(Op::Add, dst.clone(), vec![dst, b]));
        }
    };
    v.push(node(NORM, h.clone(), vec![x.clone()]));
    v.push(node(
        Op::Mul,
        h.clone(),
        vec![h.clone(), packed(10, 0, DType::F32, &[64])],
    ));
    linear(&mut v, 20, &h, act(512, &[1, 64]));
    linear(&mut v, 30, &h, act(768, &[1, 32]));
    linear(&mut v, 40, &h, act(896, &[1, 32]));
    v.push(node(
        ROPE,
        act(256, &[1, 4, 16]),
        vec![act(512, &[1, 4, 16]), pos.clone()],
    ));
    v.push(node(
        ROPE,
        act(512, &[1, 2, 16]),
        vec![act(768, &[1, 2, 16]), pos],
    ));
    v.push(node(
        Op::SetRows,
        k_cache.clone(),
        vec![k_cache, act(512, &[1, 32]), kv_idx.clone()],
    ));
    v.push(node(
        Op::SetRows,
        v_cache.clone(),
        vec![v_cache, act(896, &[1, 32]), kv_idx],
    ));
    let q = view(ACT, 256, DType::F32, &[4, 1, 16], &[16, 64, 1]);
    let keys = view(K_CACHE, 0, kv, &[2, 16, 32], &[16, 1, 32]);
    let values = view(V_CACHE, 0, kv, &[2, 32, 16], &[16, 32, 1]);
    v.push(node(Op::MulMat, act(512, &[4, 1, 32]), vec![q, keys]));
    v.push(node(
        SOFT_MAX,
        act(1024, &[4, 1, 32]),
        vec![act(512, &[4, 1, 32]), mask],
    ));
    v.push(node(
        Op::MulMat,
        act(256, &[4, 1, 16]),
        vec![act(1024, &[4, 1, 32]), values],
    ));
    let o_t = view(ACT, 256, DType::F32, &[1, 4, 16], &[16, 16, 1]);
    v.push(node(Op::Cpy, act(512, &[1, 4, 16]), vec![o_t]));
    v.push(node(
        Op::MulMat,
        act(256, &[1, 64]),
        vec![act(512, &[1, 64]), wt(50, DType::F32, 64, 64)],
    ));
    v.push(node(
        Op::Add,
        x.clone(),
        vec![x.clone(), act(256, &[1, 64])],
    ));
    v.push(node(NORM, h.clone(), vec![x.clone()]));
    v.push(node(
        Op::Mul,
        h.clone(),
        vec![h.clone(), packed(11, 0, DType::F32, &[64])],
    ));
    let (gate, up) = (act(512, &[1, 128]), act(1024, &[1, 128]));
    v.push(node(
        Op::MulMat,
        gate.clone(),
        vec![h.clone(), wt(60, DType::F32, 64, 128)],
    ));
    v.push(node(
        Op::MulMat,
        up.clone(),
        vec![h.clone(), wt(61, DType::F32, 64, 128)],
    ));
    v.push(node(Op::SwiGlu, gate.clone(), vec![gate.clone(), up]));
    v.push(node(
        Op::MulMat,
        act(256, &[1, 64]),
        vec![gate, wt(62, DType::F32, 128, 64)],
    ));
    v.push(node(Op::Add, x.clone(), vec![x, act(256, &[1, 64])]));
    v
}

fn seg(mm: usize, add: Option<usize>) -> Seg {
    Seg::new(mm, add)
}

fn fused(kind: Kind) -> Step {
    Step::Fused(Group::new(kind))
}

fn tailed(mm: usize, add: Option<usize>, rope: Option<usize>, rows: Option<usize>) -> Seg {
    Seg {
        mm,
        add,
        rope,
        rows,
    }
}

#[test]
fn a_decode_layer_runs_in_five_steps() {
    for kv in [DType::F32, DType::F16, DType::BF16] {
        let want = vec![
            fused(Kind::Gemv {
                segs: vec![
                    tailed(2, Some(3), Some(8), None),
                    tailed(4, Some(5), Some(9), Some(10)),
                    tailed(6, Some(7), None, Some(11)),
                ],
                swiglu: None,
                norm: Some(NormPro { norm: 0, mul: 1 }),
            }),
            fused(Kind::Attention {
                kq: 12,
                soft_max: 13,
                pv: 14,
                cpy: Some(15),
                scores: false,
            }),
            fused(Kind::Gemv {
                segs: vec![seg(16, Some(17))],
                swiglu: None,
                norm: None,
            }),
            fused(Kind::Gemv {
                segs: vec![seg(20, None), seg(21, None)],
                swiglu: Some(22),
                norm: Some(NormPro { norm: 18, mul: 19 }),
            }),
            fused(Kind::Gemv {
                segs: vec![seg(23, Some(24))],
                swiglu: None,
                norm: None,
            }),
        ];
        assert_eq!(plan(&layer(true, kv), None), want, "{kv}");
        let steps = plan(&layer(false, kv), None);
        assert_eq!(steps.len(), 5, "{kv}: {steps:?}");
        assert_eq!(
            steps[0],
            fused(Kind::Gemv {
                segs: vec![
                    tailed(2, None, Some(5), None),
                    tailed(3, None, Some(6), Some(7)),
                    tailed(4, None, None, Some(8)),
                ],
                swiglu: None,
                norm: Some(NormPro { norm: 0, mul: 1 }),
            })
        );
        // A norm whose row is not the products' activation stays a NormMul of its own.
        let mut other = layer(false, kv);
        other[1].dst.byte_offset += 4096;
        assert_eq!(
            plan(&other, None)[0],
            fused(Kind::NormMul { norm: 0, mul: 1 })
        );
        // So does one whose prologue writes would clobber the row it reads (the product
        // of the norm over x itself).
        let mut clobber = layer(false, kv);
        let x = clobber[0].srcs[0].clone();
        clobber[1].dst = x.clone();
        for n in &mut clobber[2..5] {
            n.srcs[0] = x.clone();
        }
        assert!(
            !plan(&clobber, None).iter().any(|s| matches!(
                s,
                Step::Fused(Group {
                    kind: Kind::Gemv {
                        norm: Some(NormPro { norm: 0, .. }),
                        ..
                    },
                    ..
                })
            )),
            "{kv}"
        );
    }
}

/// llama.py's head at one token: the final norm (its own launch: the head is many waves),
/// the product with the output weight, its argmax.
fn head(rows: usize) -> Vec<ExecNode> {
    let (x, h) = (act(0, &[rows, 64]), act(1024, &[rows, 64]));
    vec![
        node(NORM, h.clone(), vec![x]),
        node(
            Op::Mul,
            h.clone(),
            vec![h.clone(), packed(10, 0, DType::F32, &[64])],
        ),
        node(
            Op::MulMat,
            act(4096, &[rows, 300]),
            vec![h, wt(20, DType::F16, 64, 300)],
        ),
        node(
            Op::Argmax,
            packed(INPUTS, 0, DType::I32, &[rows]),
            vec![act(4096, &[rows, 300])],
        ),
    ]
}

#[test]
fn the_head_and_its_argmax_are_one_launch() {
    let want = vec![
        fused(Kind::NormMul { norm: 0, mul: 1 }),
        fused(Kind::HeadArgmax {
            mm: 2,
            argmax: 3,
            norm: None,
        }),
    ];
    assert_eq!(plan(&head(1), None), want);
    // Otherwise the argmax runs on its own (the product may still take the norm).
    let alone = |steps: &[Step], am: usize| {
        steps.contains(&Step::Node(am))
            && !steps.iter().any(|s| {
                matches!(
                    s,
                    Step::Fused(Group {
                        kind: Kind::HeadArgmax { .. },
                        ..
                    })
                )
            })
    };
    // Two rows: two indices, not the one-row kernel's.
    assert!(alone(&plan(&head(2), None), 3));
    // cuBLAS for the product (no matrix-vector kernel at all).
    assert!(alone(&plan(&head(1), Some(0)), 3));
    // The argmax of something else, or of a part of the logits.
    let mut other = head(1);
    other[3].srcs[0].byte_offset += 4;
    other[3].srcs[0].shape = vec![1, 299];
    assert!(alone(&plan(&other, None), 3));
    // A node between them that writes the logits runs between them.
    let mut between = head(1);
    let fill = node(
        Op::Scale { scale: 2.0 },
        act(4096, &[1, 300]),
        vec![act(4096, &[1, 300])],
    );
    between.insert(3, fill);
    let steps = plan(&between, None);
    assert!(
        alone(&steps, 4) && steps.ends_with(&[Step::Node(3), Step::Node(4)]),
        "{steps:?}"
    );
    // The index overlapping the activation the product reads.
    let mut clobber = head(1);
    clobber[3].dst = packed(ACT, 1024, DType::I32, &[1]);
    assert!(alone(&plan(&clobber, None), 3));
}

#[test]
fn each_node_is_run_once() {
    let nodes = layer(true, DType::F16);
    let mut seen: Vec<usize> = plan(&nodes, None)
        .iter()
        .flat_map(|s| match s {
            Step::Node(i) => vec![*i],
            Step::Fused(g) => g.nodes.clone(),
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..nodes.len()).collect::<Vec<_>>());
}

#[test]
fn matrix_vector_limit_and_config_decide_the_products() {
    let nodes = layer(false, DType::F16);
    // cuBLAS for every product: no fused matrix-vector launch.
    let steps = plan(&nodes, Some(0));
    assert!(steps.iter().all(|s| !matches!(
        s,
        Step::Fused(Group {
            kind: Kind::Gemv { .. },
            ..
        })
    )));
    // Nine rows over f32 weights exceed the limit.
    let a = act(0, &[9, 64]);
    let mm = |w, off| {
        node(
            Op::MulMat,
            act(off, &[9, 32]),
            vec![a.clone(), wt(w, DType::F32, 64, 32)],
        )
    };
    let nodes = vec![mm(20, 4096), mm(21, 8192)];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    // With f16 weights too (cuBLAS rounds the f32 activations to f16 and reads the weight in
    // place: `blas_compute`); the tuning override raises the limit.
    let mm = |w, off| {
        node(
            Op::MulMat,
            act(off, &[9, 32]),
            vec![a.clone(), wt(w, DType::F16, 64, 32)],
        )
    };
    let nodes = vec![mm(20, 4096), mm(21, 8192)];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    assert_eq!(
        plan(&nodes, Some(16)),
        vec![fused(Kind::Gemv {
            segs: vec![seg(0, None), seg(1, None)],
            swiglu: None,
            norm: None,
        })]
    );
}

/// Two projections of `h` at 0 with `between` in the middle.
fn two_products(between: ExecNode) -> Vec<ExecNode> {
    let h = act(0, &[1, 64]);
    vec![
        node(
            Op::MulMat,
            act(256, &[1, 64]),
            vec![h.clone(), wt(20, DType::F16, 64, 64)],
        ),
        between,
        node(
            Op::MulMat,
            act(512, &[1, 64]),
            vec![h, wt(21, DType::F16, 64, 64)],
        ),
    ]
}

#[test]
fn reordering_is_refused_over_an_overlapping_node() {
    let scale = |dst, src| node(Op::Scale { scale: 2.0 }, dst, vec![src]);
    // Unrelated: the second product moves before it.
    let ok = two_products(scale(act(2048, &[1, 64]), act(1024, &[1, 64])));
    assert_eq!(
        plan(&ok, None),
        vec![
            fused(Kind::Gemv {
                segs: vec![seg(0, None), seg(2, None)],
                swiglu: None,
                norm: None,
            }),
            Step::Node(1)
        ]
    );
    let unfused = vec![Step::Node(0), Step::Node(1), Step::Node(2)];
    // It writes the activation the moved product reads.
    let writes_src = two_products(scale(act(0, &[1, 16]), act(1024, &[1, 16])));
    assert_eq!(plan(&writes_src, None), unfused);
    // It reads what the moved product writes.
    let reads_dst = two_products(scale(act(2048, &[1, 8]), act(540, &[1, 8])));
    assert_eq!(plan(&reads_dst, None), unfused);
    // It writes what the moved product writes.
    let writes_dst = two_products(scale(act(600, &[1, 8]), act(1024, &[1, 8])));
    assert_eq!(plan(&writes_dst, None), unfused);
}

#[test]
fn groups_whose_writes_clobber_their_reads_are_refused() {
    let h = act(0, &[1, 64]);
    // The second product would overwrite the activation the first still reads.
    let nodes = vec![
        node(
            Op::MulMat,
            act(256, &[1, 64]),
            vec![h.clone(), wt(20, DType::F32, 64, 64)],
        ),
        node(
            Op::MulMat,
            act(0, &[1, 16]),
            vec![h.clone(), wt(21, DType::F32, 64, 16)],
        ),
    ];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    // A residual Add in place over the activation of its own product: other blocks still
    // read the activation while one writes the sum.
    let nodes = vec![
        node(
            Op::MulMat,
            act(256, &[1, 64]),
            vec![h.clone(), wt(20, DType::F32, 64, 64)],
        ),
        node(Op::Add, h.clone(), vec![h.clone(), act(256, &[1, 64])]),
    ];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    // A shifted, overlapping residual needs a private copy.
    let nodes = vec![
        node(
            Op::MulMat,
            act(256, &[1, 64]),
            vec![h.clone(), wt(20, DType::F32, 64, 64)],
        ),
        node(
            Op::Add,
            act(256, &[1, 64]),
            vec![act(256, &[1, 64]), act(260, &[1, 64])],
        ),
    ];
    assert!(nodes[1].src_needs_private_copy(1));
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
}

#[test]
fn mismatched_dtypes_and_shapes_stay_unfused() {
    let h = act(0, &[1, 64]);
    let w16 = wt(20, DType::F16, 64, 64);
    let unfused = |nodes: &[ExecNode]| (0..nodes.len()).map(Step::Node).collect::<Vec<_>>();
    let cases: Vec<(&str, Vec<ExecNode>)> = vec![
        (
            "f16 activation",
            vec![
                node(
                    Op::MulMat,
                    act(256, &[1, 64]),
                    vec![packed(ACT, 0, DType::F16, &[1, 64]), w16.clone()],
                ),
                node(
                    Op::Add,
                    act(256, &[1, 64]),
                    vec![act(256, &[1, 64]), act(1024, &[1, 64])],
                ),
            ],
        ),
        (
            "weights of two dtypes",
            vec![
                node(Op::MulMat, act(256, &[1, 64]), vec![h.clone(), w16.clone()]),
                node(
                    Op::MulMat,
                    act(512, &[1, 64]),
                    vec![h.clone(), wt(21, DType::F32, 64, 64)],
                ),
            ],
        ),
        (
            "row-major weight (n contiguous)",
            vec![
                node(
                    Op::MulMat,
                    act(256, &[1, 64]),
                    vec![h.clone(), packed(20, 0, DType::F16, &[64, 64])],
                ),
                node(
                    Op::MulMat,
                    act(512, &[1, 64]),
                    vec![h.clone(), packed(21, 0, DType::F16, &[64, 64])],
                ),
            ],
        ),
        (
            "add broadcasting the product",
            vec![
                node(Op::MulMat, act(256, &[1, 64]), vec![h.clone(), w16.clone()]),
                node(
                    Op::Add,
                    act(1024, &[3, 64]),
                    vec![act(2048, &[3, 64]), act(256, &[1, 64])],
                ),
            ],
        ),
        (
            "norm weight that is not a row",
            vec![
                node(NORM, act(256, &[2, 64]), vec![act(0, &[2, 64])]),
                node(
                    Op::Mul,
                    act(256, &[2, 64]),
                    vec![act(256, &[2, 64]), packed(10, 0, DType::F32, &[2, 64])],
                ),
            ],
        ),
        (
            "rope of nine rows",
            vec![
                node(
                    ROPE,
                    act(512, &[9, 2, 16]),
                    vec![act(0, &[9, 2, 16]), packed(INPUTS, 0, DType::I32, &[9])],
                ),
                node(
                    Op::SetRows,
                    packed(K_CACHE, 0, DType::F16, &[32, 32]),
                    vec![
                        packed(K_CACHE, 0, DType::F16, &[32, 32]),
                        act(512, &[9, 32]),
                        packed(INPUTS, 64, DType::I32, &[9]),
                    ],
                ),
            ],
        ),
    ];
    for (name, nodes) in cases {
        assert_eq!(plan(&nodes, None), unfused(&nodes), "{name}");
    }
}

/// Attention nodes over 2 kv heads of `d` dims (K and V caches of `kv` / `vdt`), 8 query
/// heads, 40 cache rows, at fresh offsets, plus `tail`.
fn attention_nodes(d: usize, kv: DType, vdt: DType, tail: Vec<ExecNode>) -> Vec<ExecNode> {
    let q = view(ACT, 0, DType::F32, &[8, 1, d], &[d, 8 * d, 1]);
    let keys = view(K_CACHE, 0, kv, &[2, d, 40], &[d, 1, 2 * d]);
    let values = view(V_CACHE, 0, vdt, &[2, 40, d], &[d, 2 * d, 1]);
    let mask = packed(INPUTS, 0, DType::F32, &[1, 40]);
    let mut v = vec![
        node(Op::MulMat, act(8192, &[8, 1, 40]), vec![q, keys]),
        node(
            SOFT_MAX,
            act(16384, &[8, 1, 40]),
            vec![act(8192, &[8, 1, 40]), mask],
        ),
        node(
            Op::MulMat,
            act(24576, &[8, 1, d]),
            vec![act(16384, &[8, 1, 40]), values],
        ),
    ];
    v.extend(tail);
    v
}

#[test]
fn scratch_no_later_split_reads_ends_the_life_of_what_is_left_there() {
    // Nothing after the attention overwrites its scores: without knowing what is read
    // after the graph they are written; with the scheduler's word that no later split
    // reads those bytes, they are dead.
    let f = DType::F32;
    let nodes = attention_nodes(64, f, f, vec![]);
    let scores = nodes[0].dst.clone();
    let (s0, _) = byte_range(&scores);
    let written =
        |end: Option<&ScratchLive>| match &super::plan(&Nodes { list: &nodes, end }, &PC)[0] {
            Step::Fused(Group {
                kind: Kind::Attention { scores, .. },
                ..
            }) => *scores,
            s => panic!("not an attention: {s:?}"),
        };
    let live = |kept: Vec<(usize, usize)>| ScratchLive {
        buffer: scores.buffer,
        kept,
    };
    assert!(written(None), "nothing known");
    assert!(
        !written(Some(&live(vec![]))),
        "no later split reads the scratch"
    );
    assert!(
        written(Some(&live(vec![(s0 + 4, s0 + 8)]))),
        "a later split reads some"
    );
    assert!(
        !written(Some(&live(vec![(0, s0)]))),
        "a later split reads other bytes"
    );
    let other = ScratchLive {
        buffer: BufferId(999),
        kept: vec![],
    };
    assert!(
        written(Some(&other)),
        "another buffer's scratch says nothing of this one"
    );
}

fn attention_kind(cpy: Option<usize>, scores: bool) -> Step {
    fused(Kind::Attention {
        kq: 0,
        soft_max: 1,
        pv: 2,
        cpy,
        scores,
    })
}

#[test]
fn raw_scores_are_written_unless_overwritten_before_any_read() {
    let f = DType::F16;
    // Nothing overwrites them: a later split or the host may read them.
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![]), None),
        vec![attention_kind(None, true)]
    );
    // Overwritten whole.
    let over = node(
        Op::Scale { scale: 1.0 },
        act(8192, &[8, 40]),
        vec![act(60000, &[8, 40])],
    );
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![over.clone()]), None),
        vec![attention_kind(None, false), Step::Node(3)]
    );
    // Read first, or only half overwritten.
    let read = node(
        Op::Scale { scale: 1.0 },
        act(60000, &[8]),
        vec![act(8192 + 600, &[8])],
    );
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![read, over]), None)[0],
        attention_kind(None, true)
    );
    let half = node(
        Op::Scale { scale: 1.0 },
        act(8192, &[4, 40]),
        vec![act(60000, &[4, 40])],
    );
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![half]), None)[0],
        attention_kind(None, true)
    );
}

#[test]
fn the_copy_joins_unless_it_overwrites_live_scores() {
    let f = DType::BF16;
    let o_t = view(ACT, 24576, DType::F32, &[1, 8, 64], &[64, 64, 1]);
    // Into fresh memory.
    let cpy = node(Op::Cpy, act(40000, &[1, 8, 64]), vec![o_t.clone()]);
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![cpy]), None),
        vec![attention_kind(Some(3), true)]
    );
    // Over part of the scores, the rest of which nothing overwrites: other blocks may still
    // be writing scores where one writes its copy.
    let cpy = node(Op::Cpy, act(7168, &[1, 8, 64]), vec![o_t.clone()]);
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![cpy.clone()]), None),
        vec![attention_kind(None, true), Step::Node(3)]
    );
    // ... unless the rest of them is overwritten too: then the scores are not written.
    let rest = node(
        Op::Scale { scale: 1.0 },
        act(9216, &[64]),
        vec![act(60000, &[64])],
    );
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![cpy, rest]), None),
        vec![attention_kind(Some(3), false), Step::Node(4)]
    );
    // A copy of another layout is not the attention's.
    let other = node(
        Op::Cpy,
        act(40000, &[8, 64]),
        vec![view(ACT, 24576, DType::F32, &[8, 64], &[1, 8])],
    );
    assert_eq!(
        plan(&attention_nodes(64, f, f, vec![other]), None),
        vec![attention_kind(None, true), Step::Node(3)]
    );
}

#[test]
fn attention_preconditions() {
    let f = DType::F16;
    let unfused = vec![Step::Node(0), Step::Node(1), Step::Node(2)];
    assert_eq!(
        plan(&attention_nodes(512, f, f, vec![]), None),
        unfused,
        "head_dim > 256"
    );
    assert_eq!(
        plan(&attention_nodes(64, f, DType::F32, vec![]), None),
        unfused,
        "K and V dtypes differ"
    );
    assert_eq!(
        plan(&attention_nodes(80, f, f, vec![]), None),
        vec![attention_kind(None, true)],
        "head_dim 80"
    );
    // Results over q, per head: head h of p @ V lies over head h of q.
    let q_over = |o_stride: usize| {
        let mut v = attention_nodes(64, f, f, vec![]);
        v[0].srcs[0] = view(ACT, 24576, DType::F32, &[8, 1, 64], &[64, 512, 1]);
        v[2].dst = view(
            ACT,
            24576,
            DType::F32,
            &[8, 1, 64],
            &[o_stride, o_stride, 1],
        );
        v
    };
    assert_eq!(plan(&q_over(64), None)[0], attention_kind(None, true));
    // Shifted heads would overwrite another block's q before it is read.
    let mut shifted = q_over(64);
    shifted[2].dst.byte_offset += 256;
    assert_eq!(plan(&shifted, None), unfused);
}

#[test]
fn rope_and_cache_epilogues_skip_only_dead_results() {
    // In the layer the norm row lies under q's rotation and q's product under k's: the
    // row-pair group writes neither (nothing outside reads them before they are
    // overwritten), nor the products its Rope or SetRows consume.
    // The skipped results of the first step (the q/k/v group) of a layer.
    let dead_of = |nodes: &[ExecNode]| match &plan(nodes, None)[0] {
        Step::Fused(Group {
            kind: Kind::Gemv { segs, norm, .. },
            ..
        }) => Dead::of(&bare(nodes), segs, *norm),
        other => panic!("no fused products: {other:?}"),
    };
    let dead = dead_of(&layer(false, DType::F16));
    assert!(dead.norm);
    assert_eq!(dead.products, [true, true, true]);
    assert_eq!(dead.sums, [false, false, false]);
    // With biases the products are consumed by their Adds and the sums by the tails.
    let dead = dead_of(&layer(true, DType::F16));
    assert!(dead.norm);
    assert_eq!(dead.products, [true, true, true]);
    assert_eq!(dead.sums, [true, true, true]);

    // Something outside that reads q's product keeps it live: its write would then
    // overlap k's rotation, so the epilogues are refused and the ropes run as before.
    let mut live = layer(false, DType::F16);
    let q_out = live[2].dst.clone();
    live.insert(
        9,
        node(
            Op::Cpy,
            packed(ACT, 4096, DType::F32, &[1, 64]),
            vec![q_out],
        ),
    );
    let steps = plan(&live, None);
    assert!(
        matches!(&steps[0], Step::Fused(Group { kind: Kind::Gemv { segs, .. }, .. }) if !has_tails(segs)),
        "{steps:?}"
    );
    assert_eq!(steps[1], Step::Node(5));
    // A product of an odd number of columns cannot be split into row pairs: no epilogues
    // for the group.
    let mut odd = layer(false, DType::F16);
    odd[4].dst.shape = vec![1, 31];
    odd[4].srcs[1].shape = vec![64, 31];
    let steps = plan(&odd, None);
    assert!(
        matches!(&steps[0], Step::Fused(Group { kind: Kind::Gemv { segs, .. }, .. }) if !has_tails(segs)),
        "{steps:?}"
    );
    // A neox rope (halves, not adjacent pairs) is no epilogue either; the cache writes
    // still are.
    let mut neox = layer(false, DType::F16);
    for n in &mut neox[5..7] {
        n.op = Op::Rope {
            mode: RopeMode::Neox,
            n_dims: 16,
            theta_base: 10000.0,
        };
    }
    let steps = plan(&neox, None);
    let Step::Fused(Group {
        kind: Kind::Gemv { segs, .. },
        ..
    }) = &steps[0]
    else {
        panic!("{steps:?}");
    };
    assert!(segs.iter().all(|s| s.rope.is_none()), "{steps:?}");
}

#[test]
fn the_q_rope_is_not_fused_over_a_hazard() {
    // Without the products' epilogues (here: matrix-vector fusion off by a rows limit of
    // 0), the k rope writes over the raw q the q rope reads.
    let steps = plan(&layer(false, DType::F16), Some(0));
    assert!(steps.contains(&Step::Node(5)), "{steps:?}");
    // Without a cache write the k rope stays alone too.
    let pos = packed(INPUTS, 0, DType::I32, &[1]);
    let nodes = vec![node(
        ROPE,
        act(512, &[1, 2, 16]),
        vec![act(0, &[1, 2, 16]), pos],
    )];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0)]);
}

#[test]
fn head_alignment_needs_one_start_and_stride_and_disjoint_heads() {
    let q = view(ACT, 256, DType::F32, &[4, 1, 16], &[16, 64, 1]);
    let o = view(ACT, 256, DType::F32, &[4, 1, 16], &[16, 16, 1]);
    assert!(head_aligned(&q, Some(0), &o, Some(0)));
    let wide = view(ACT, 256, DType::F32, &[4, 1, 32], &[16, 16, 1]);
    assert!(
        !head_aligned(&q, Some(0), &wide, Some(0)),
        "heads reach the next one"
    );
    let half = view(ACT, 256, DType::F16, &[4, 1, 16], &[32, 32, 1]);
    assert!(
        head_aligned(&q, Some(0), &half, Some(0)),
        "same bytes per head"
    );
    let one = view(ACT, 300, DType::F32, &[1, 1, 16], &[16, 16, 1]);
    let q1 = view(ACT, 256, DType::F32, &[1, 1, 16], &[16, 16, 1]);
    assert!(head_aligned(&q1, Some(0), &one, None), "one block");
}

#[test]
fn dead_bytes_need_a_covering_write_before_any_read() {
    let scale = |dst, src| node(Op::Scale { scale: 1.0 }, dst, vec![src]);
    let nodes = vec![
        scale(act(0, &[64]), act(1024, &[64])),
        scale(act(2048, &[64]), act(0, &[64])),
        scale(act(0, &[32]), act(1024, &[32])),
        scale(act(128, &[32]), act(1024, &[32])),
    ];
    assert!(dead_after(&nodes, 0, 1), "its reader is skipped");
    assert!(!dead_after(&nodes, 0, 3), "read by node 1");
    assert!(!dead_after(&nodes[..3], 0, 1), "half never overwritten");
}

#[test]
fn the_mask_is_read_ahead_only_when_no_node_writes_it_and_q_is_the_graphs() {
    // A decode layer: the mask is an input no node writes, q comes from its q/k/v group.
    let l = layer(true, DType::F16);
    assert!(mask_ahead(&l, &l[12], &l[13]));
    // A node writing anything in the mask's buffer (a mask built on the device).
    let mut built = l.clone();
    let mask = built[13].srcs[1].clone();
    built.insert(0, node(Op::Cpy, mask.clone(), vec![act(0, &[1, 32])]));
    assert!(!mask_ahead(&built, &built[13], &built[14]));
    // No mask, or q from outside the graph (the attention could be its first launch).
    let mut bare = l.clone();
    bare[13].srcs.truncate(1);
    assert!(!mask_ahead(&bare, &bare[12], &bare[13]));
    let alone = attention_nodes(64, DType::F16, DType::F16, vec![]);
    assert!(!mask_ahead(&alone, &alone[0], &alone[1]));
}

/// The launch structs against their CUDA twins in gemv.cu (read from the source the kernel is
/// compiled from, not restated here): the same fields in the same order, the same size and
/// alignment, and the same bound on the products.
#[test]
fn fg_structs_match_the_cuda_layout() {
    use crate::abi::{c_define, c_struct, debug_fields};
    let src = include_str!("gemv.cu");
    assert_eq!(c_define(src, "FG_MAXS"), MAX_SEGS);
    let seg = c_struct(src, "FgSeg");
    assert_eq!(
        seg.names(),
        debug_fields(&format!("{:?}", FgSeg::default()))
    );
    assert_eq!(
        (seg.size, seg.align),
        (std::mem::size_of::<FgSeg>(), std::mem::align_of::<FgSeg>())
    );
    assert!(
        seg.fields.iter().all(|f| f.size == 8),
        "every FgSeg field is 8 bytes on the host side: {seg:?}"
    );
    let set = c_struct(src, "FgSet");
    assert_eq!(
        set.names(),
        debug_fields(&format!("{:?}", FgSet::default()))
    );
    assert_eq!(
        (set.size, set.align),
        (std::mem::size_of::<FgSet>(), std::mem::align_of::<FgSet>())
    );
}

/// `nodes` with the weight of every product in buffer `w` (>= 20) of block type `pick(w)`
/// (`None`: left as it is); returns the products changed.
fn quantize(nodes: &mut [ExecNode], pick: impl Fn(u64) -> Option<DType>) -> Vec<usize> {
    let mut mms = Vec::new();
    for (i, n) in nodes.iter_mut().enumerate() {
        if n.op != Op::MulMat || n.srcs[1].buffer.0 < 20 || n.srcs[1].strides[0] != 1 {
            continue;
        }
        if let Some(d) = pick(n.srcs[1].buffer.0) {
            n.srcs[1].dtype = d;
            mms.push(i);
        }
    }
    mms
}

/// Decode's layer on quantized weights fuses as on plain ones (`fused_gemv1_q`): the same five
/// steps, whatever mix of block types its products have (a Q4_K_M file mixes two per group).
#[test]
fn a_quantized_decode_layer_fuses_like_a_plain_one() {
    let mixes: [fn(u64) -> Option<DType>; 3] = [
        |_| Some(DType::Q4_0),
        // q, k, gate, o: Q4_0; v, up: Q8_0; down: IQ4_NL.
        |w| match w {
            40 | 61 => Some(DType::Q8_0),
            62 => Some(DType::IQ4_NL),
            _ => Some(DType::Q4_0),
        },
        |w| {
            Some(if w % 20 == 0 {
                DType::Q5_1
            } else {
                DType::Q5_0
            })
        },
    ];
    for bias in [false, true] {
        let want = plan(&layer(bias, DType::F16), None);
        for mix in mixes {
            let mut l = layer(bias, DType::F16);
            assert_eq!(quantize(&mut l, mix).len(), 7);
            assert_eq!(plan(&l, None), want, "bias {bias}");
        }
    }
}

/// Where `fused_gemv1_q` does not apply, the products run alone (`mul_mat_vec_q`) and the rest
/// of the layer fuses as before: k not a whole number of blocks (Q4_K blocks are 256 values,
/// the layer's rows 64 and 128), more than one row, or a plain weight beside a quantized one
/// (separate launches).
#[test]
fn quantized_products_the_fused_kernel_cannot_take_run_alone() {
    let mut l = layer(false, DType::F16);
    let mms = quantize(&mut l, |_| Some(DType::Q4_K));
    let steps = plan(&l, None);
    for &i in &mms {
        assert!(
            steps.contains(&Step::Node(i)),
            "product {i} alone: {steps:?}"
        );
    }
    assert!(
        steps.iter().any(|s| matches!(
            s,
            Step::Fused(Group {
                kind: Kind::NormMul { .. },
                ..
            })
        )),
        "{steps:?}"
    );
    // Two rows of a: `mul_mat_vec_q8` each.
    let a = act(0, &[2, 64]);
    let mm = |w, off| {
        node(
            Op::MulMat,
            act(off, &[2, 32]),
            vec![a.clone(), wt(w, DType::Q8_0, 64, 32)],
        )
    };
    let nodes = vec![mm(20, 4096), mm(21, 8192)];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    // One row: one launch for both, of different block types.
    let a = act(0, &[1, 64]);
    let mm = |w, off, d| {
        node(
            Op::MulMat,
            act(off, &[1, 32]),
            vec![a.clone(), wt(w, d, 64, 32)],
        )
    };
    let nodes = vec![mm(20, 4096, DType::Q8_0), mm(21, 8192, DType::Q4_1)];
    assert_eq!(
        plan(&nodes, None),
        vec![fused(Kind::Gemv {
            segs: vec![seg(0, None), seg(1, None)],
            swiglu: None,
            norm: None,
        })]
    );
    // A plain weight does not join a quantized one's launch (nor the reverse).
    let nodes = vec![mm(20, 4096, DType::Q8_0), mm(21, 8192, DType::F16)];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    let nodes = vec![mm(20, 4096, DType::F16), mm(21, 8192, DType::Q8_0)];
    assert_eq!(plan(&nodes, None), vec![Step::Node(0), Step::Node(1)]);
    // The head keeps its argmax fusion and takes the final norm as its prologue
    // (`fused_gemv1_q` under `q_head_fold`); without the fold, the norm is a launch of its own
    // (`mul_mat_vec_q_argmax` or `fused_gemv1_q` after it); cuBLAS for the product takes
    // neither.
    let mut h = head(1);
    assert_eq!(quantize(&mut h, |_| Some(DType::Q4_0)), vec![2]);
    let folded = Kind::HeadArgmax {
        mm: 2,
        argmax: 3,
        norm: Some(NormPro { norm: 0, mul: 1 }),
    };
    assert_eq!(plan(&h, None), vec![fused(folded)]);
    assert_eq!(
        plan_fold(&h, None, false),
        vec![
            fused(Kind::NormMul { norm: 0, mul: 1 }),
            fused(Kind::HeadArgmax {
                mm: 2,
                argmax: 3,
                norm: None,
            }),
        ]
    );
    assert_eq!(
        plan(&h, Some(0)),
        vec![
            fused(Kind::NormMul { norm: 0, mul: 1 }),
            Step::Node(2),
            Step::Node(3)
        ]
    );
}

/// Prefill attention as llama.py lays it out: q, the rope result `[20, 8, d]` at 0, seen as
/// `[8, 20, d]`; K/V caches of 40 rows over 2 kv heads; the scores, p and o after it, the
/// Cpy of o's permutation `[20, 8, d]` at `cpy_at`, then `tail`.
fn prefill_nodes(d: usize, cpy_at: usize, tail: Vec<ExecNode>) -> Vec<ExecNode> {
    let (t, l, f) = (20, 40, DType::F16);
    let sq = t * 8 * d * 4;
    let ss = 8 * t * l * 4;
    let q = view(ACT, 0, DType::F32, &[8, t, d], &[d, 8 * d, 1]);
    let keys = view(K_CACHE, 0, f, &[2, d, l], &[d, 1, 2 * d]);
    let values = view(V_CACHE, 0, f, &[2, l, d], &[d, 2 * d, 1]);
    let mask = packed(INPUTS, 0, DType::F32, &[t, l]);
    let o_t = view(ACT, sq + 2 * ss, DType::F32, &[t, 8, d], &[d, t * d, 1]);
    let mut v = vec![
        node(Op::MulMat, act(sq, &[8, t, l]), vec![q, keys]),
        node(
            SOFT_MAX,
            act(sq + ss, &[8, t, l]),
            vec![act(sq, &[8, t, l]), mask],
        ),
        node(
            Op::MulMat,
            act(sq + 2 * ss, &[8, t, d]),
            vec![act(sq + ss, &[8, t, l]), values],
        ),
        node(Op::Cpy, act(cpy_at, &[t, 8, d]), vec![o_t]),
    ];
    v.extend(tail);
    v
}

/// A node overwriting `floats` f32 values of `ACT` at `at` with fresh ones.
fn overwrite(at: usize, floats: usize) -> ExecNode {
    node(
        Op::Scale { scale: 1.0 },
        act(at, &[floats]),
        vec![act(1 << 24, &[floats])],
    )
}

fn prefill_kind(cpy: Option<usize>, out: bool) -> Step {
    fused(Kind::Prefill {
        kq: 0,
        soft_max: 1,
        pv: 2,
        cpy,
        out,
    })
}

#[test]
fn prefill_attention_fuses_where_scores_and_p_are_dead() {
    let d = 64;
    let (sq, ss) = (20 * 8 * d * 4, 8 * 20 * 40 * 4);
    let fresh = 1 << 20;
    // The scores and p overwritten (dead), o overwritten after its copy.
    let dead = || vec![overwrite(sq, 2 * ss / 4), overwrite(sq + 2 * ss, sq / 4)];
    let nodes = prefill_nodes(d, fresh, dead());
    assert_eq!(
        plan(&nodes, None),
        vec![prefill_kind(Some(3), false), Step::Node(4), Step::Node(5)]
    );
    assert_eq!(
        super::plan(
            &bare(&nodes),
            &super::PlanCfg {
                prefill: false,
                ..PC
            }
        ),
        (0..6).map(Step::Node).collect::<Vec<_>>(),
        "attn_prefill=0"
    );
    // o read later: written beside the copy.
    let nodes = prefill_nodes(d, fresh, dead()[..1].to_vec());
    assert_eq!(
        plan(&nodes, None),
        vec![prefill_kind(Some(3), true), Step::Node(4)]
    );
    // Live scores or p: the chain runs unfused (the kernel never writes them).
    for tail in [
        vec![overwrite(sq + ss, ss / 4)],
        vec![overwrite(sq, ss / 4)],
    ] {
        assert_eq!(
            plan(&prefill_nodes(d, fresh, tail), None),
            (0..5).map(Step::Node).collect::<Vec<_>>()
        );
    }
    // head_dim above 128 (decode's kernel takes up to 256).
    let (sq2, ss2) = (20 * 8 * 256 * 4, ss);
    let nodes = prefill_nodes(
        256,
        fresh << 2,
        vec![
            overwrite(sq2, 2 * ss2 / 4),
            overwrite(sq2 + 2 * ss2, sq2 / 4),
        ],
    );
    assert_eq!(
        plan(&nodes, None),
        (0..6).map(Step::Node).collect::<Vec<_>>()
    );
}

#[test]
fn prefill_results_may_lie_over_q_only_element_for_element() {
    let d = 64;
    let (sq, ss) = (20 * 8 * d * 4, 8 * 20 * 40 * 4);
    let dead = vec![overwrite(sq, 2 * ss / 4), overwrite(sq + 2 * ss, sq / 4)];
    // The copy's `[20, 8, d]` over q's own `[20, 8, d]`: each block writes what it read.
    assert_eq!(
        plan(&prefill_nodes(d, 0, dead.clone()), None),
        vec![prefill_kind(Some(3), false), Step::Node(4), Step::Node(5)]
    );
    // Shifted by one head: a block would overwrite q another block still reads; the copy
    // runs on its own after the kernel, which writes o for it.
    assert_eq!(
        plan(&prefill_nodes(d, d * 4, dead), None),
        vec![
            prefill_kind(None, true),
            Step::Node(3),
            Step::Node(4),
            Step::Node(5)
        ]
    );
    // o (`[8, 20, d]`, read later) over q (`[20, 8, d]`): other elements, refused.
    let mut nodes = prefill_nodes(d, 1 << 20, vec![overwrite(sq, 2 * ss / 4)]);
    nodes[2].dst = act(0, &[8, 20, d]);
    nodes[3].srcs[0].byte_offset = 0;
    assert_eq!(
        plan(&nodes, None),
        (0..5).map(Step::Node).collect::<Vec<_>>()
    );
}
