//! The fused attention chain (`q @ K.T -> soft_max(mask) -> @ V`): when it is fused, that it
//! matches the node-by-node chain, that masked cells are never read, that NaN in a valid cell
//! still shows, and that results do not depend on the thread count or the number of cells.

use lowsync_backend::{ExecGraph, ScratchLive, TensorRef};
use lowsync_graph::{DType, Op};

use super::harness::*;
use crate::kernels::{plan, run_node, run_step, Step};

/// An attention chain as the llama graph builds it: q [T, hq, d] seen as [hq, T, d], a KV
/// cache [l, hk * d] seen as keys [hk, d, l] and values [hk, l, d], a [T, l] mask, scores and
/// probabilities in one scratch buffer (the probabilities over the scores when `in_place`,
/// which soft_max cannot do without a private copy), the result in its own buffer.
struct Chain {
    graph: ExecGraph,
    q: TensorRef,
    cache_k: TensorRef,
    cache_v: TensorRef,
    out: TensorRef,
}

#[allow(clippy::too_many_arguments)]
fn chain(
    mem: &mut TestMem,
    rng: &mut TestRng,
    (hq, hk, t, l, d): (usize, usize, usize, usize, usize),
    kv: DType,
    mask: &[f32],
    in_place: bool,
) -> Chain {
    let q = mem.rand(rng, DType::F32, &[t, hq, d]);
    let cache_k = mem.rand(rng, kv, &[l, hk * d]);
    let cache_v = mem.rand(rng, kv, &[l, hk * d]);
    let keys = view(&cache_k, &[hk, d, l], &[d, 1, hk * d], 0);
    let values = view(&cache_v, &[hk, l, d], &[d, hk * d, 1], 0);
    let mask = mem.tensor(DType::F32, &[t, l], mask);
    let n = hq * t * l;
    let scratch = mem.zeros(DType::F32, &[2 * n]);
    let scores = view(&scratch, &[hq, t, l], &[t * l, l, 1], 0);
    let probs = view(
        &scratch,
        &[hq, t, l],
        &[t * l, l, 1],
        if in_place { 0 } else { n },
    );
    let out = mem.zeros(DType::F32, &[hq, t, d]);
    let sm = Op::SoftMax {
        scale: 1.0 / (d as f32).sqrt(),
    };
    let nodes = vec![
        node(Op::MulMat, &scores, &[&transpose(&q, 0, 1), &keys]),
        node(sm, &probs, &[&scores, &mask]),
        node(Op::MulMat, &out, &[&probs, &values]),
    ];
    let graph = ExecGraph {
        nodes,
        scratch: Some(ScratchLive {
            buffer: scratch.buffer,
            kept: vec![],
        }),
    };
    Chain {
        graph,
        q,
        cache_k,
        cache_v,
        out,
    }
}

/// A causal-style mask: row `r` sees cells `0..=base + r` (-inf after), some of them with a
/// finite bias; rows listed in `empty` see nothing.
fn mask(t: usize, l: usize, base: usize, empty: &[usize]) -> Vec<f32> {
    let mut m = vec![f32::NEG_INFINITY; t * l];
    for r in 0..t {
        if empty.contains(&r) {
            continue;
        }
        for c in 0..=(base + r).min(l - 1) {
            m[r * l + c] = if c % 3 == 1 { -0.25 * c as f32 } else { 0.0 };
        }
    }
    m
}

fn fused(mem: &TestMem, c: &Chain) -> Vec<f64> {
    assert_eq!(plan(&c.graph), vec![Step::Attention(0)]);
    run_step(&c.graph, Step::Attention(0), mem).unwrap();
    mem.read(&c.out)
}

fn unfused(mem: &TestMem, c: &Chain) -> Vec<f64> {
    for n in &c.graph.nodes {
        run_node(n, mem).unwrap();
    }
    mem.read(&c.out)
}

#[test]
fn fused_attention_matches_the_node_by_node_chain() {
    // Decode (one query row) and prefill (several, one of them fully masked), GQA 6 over 2,
    // f32 / f16 / bf16 caches; head sizes of whole vectors of 8 (24), a 64-column chunk plus
    // one of 8 and a scalar tail (76), and two 64-column chunks (128).
    for (seed, kv, d) in [
        (200, DType::F32, 24),
        (201, DType::F16, 24),
        (202, DType::BF16, 24),
        (203, DType::F32, 76),
        (204, DType::F16, 128),
    ] {
        for (t, empty) in [(1, vec![]), (5, vec![3])] {
            let (hq, hk, l) = (6, 2, 40);
            let mut mem = TestMem::new();
            let mut rng = TestRng::new(seed);
            let m = mask(t, l, 7, &empty);
            let c = chain(&mut mem, &mut rng, (hq, hk, t, l, d), kv, &m, false);
            let want = unfused(&mem, &c);
            let got = fused(&mem, &c);
            assert_close(&got, &want, 1e-12);
            // A row with no valid cell is zeros, as soft_max makes it.
            for &r in &empty {
                for h in 0..hq {
                    let row = &got[(h * t + r) * d..][..d];
                    assert!(row.iter().all(|&v| v == 0.0), "{row:?}");
                }
            }
        }
    }
}

#[test]
fn masked_cells_are_never_read_and_their_number_does_not_matter() {
    let (hq, hk, t, d) = (4, 2, 2, 16);
    let mut results = Vec::new();
    for l in [16, 300] {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(210);
        let m = mask(t, l, 9, &[]);
        let c = chain(&mut mem, &mut rng, (hq, hk, t, l, d), DType::F16, &m, false);
        // Same valid cells whatever l: rewrite them from one seed.
        let mut vals = TestRng::new(211);
        for cell in 0..11 {
            for e in 0..hk * d {
                mem.put(&c.cache_k, cell * hk * d + e, vals.f32() as f64);
                mem.put(&c.cache_v, cell * hk * d + e, vals.f32() as f64);
            }
        }
        // Poison every masked cell.
        for cell in 11..l {
            for e in 0..hk * d {
                mem.put(&c.cache_k, cell * hk * d + e, f64::NAN);
                mem.put(&c.cache_v, cell * hk * d + e, f64::INFINITY);
            }
        }
        let got = fused(&mem, &c);
        assert!(got.iter().all(|v| v.is_finite()), "{got:?}");
        results.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
    assert_eq!(results[0], results[1]);
}

#[test]
fn nan_in_a_valid_cell_makes_the_rows_that_read_it_nan() {
    let (hq, hk, t, l, d) = (4, 2, 1, 30, 8);
    for poison_key in [true, false] {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(220);
        let m = mask(t, l, 10, &[]);
        let c = chain(&mut mem, &mut rng, (hq, hk, t, l, d), DType::F32, &m, false);
        // Cell 5 of kv head 1 (query heads 2 and 3).
        let cache = if poison_key { &c.cache_k } else { &c.cache_v };
        mem.put(cache, 5 * hk * d + d, f64::NAN);
        let got = fused(&mem, &c);
        let (lo, hi) = got.split_at(2 * d);
        assert!(lo.iter().all(|v| v.is_finite()), "{lo:?}");
        if poison_key {
            assert!(hi.iter().all(|v| v.is_nan()), "{hi:?}");
        } else {
            // A value NaN spoils only its own element of each row.
            assert!(hi
                .chunks(d)
                .all(|r| r[0].is_nan() && r[1..].iter().all(|v| v.is_finite())));
        }
    }
}

#[test]
fn fused_attention_is_bit_identical_across_thread_counts() {
    let (hq, hk, t, l, d) = (8, 2, 6, 500, 64);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(230);
    let m = mask(t, l, 400, &[]);
    let c = chain(&mut mem, &mut rng, (hq, hk, t, l, d), DType::F16, &m, false);
    let mut results = Vec::new();
    for threads in [1, 2, 3] {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| run_step(&c.graph, Step::Attention(0), &mem).unwrap());
        results.push(mem.bytes(&c.out));
    }
    assert!(results.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn a_chain_whose_scores_or_probabilities_are_read_later_is_not_fused() {
    let (hq, hk, t, l, d) = (2, 1, 1, 8, 4);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(240);
    let m = mask(t, l, 3, &[]);
    let c = chain(&mut mem, &mut rng, (hq, hk, t, l, d), DType::F32, &m, false);
    // The probabilities read by a later node.
    let mut read_later = c.graph.clone();
    let probs = read_later.nodes[1].dst.clone();
    let extra = mem.zeros(DType::F32, &[hq, t, l]);
    read_later
        .nodes
        .push(node(Op::Scale { scale: 2.0 }, &extra, &[&probs]));
    assert_eq!(plan(&read_later)[0], Step::Node(0));
    // The scores kept for a later split.
    let mut kept = c.graph.clone();
    kept.scratch = Some(ScratchLive {
        buffer: probs.buffer,
        kept: vec![(0, 4)],
    });
    assert_eq!(plan(&kept)[0], Step::Node(0));
    // Nothing known of what is read after the graph.
    let mut unknown = c.graph.clone();
    unknown.scratch = None;
    assert_eq!(plan(&unknown)[0], Step::Node(0));
    // Probabilities over the scores (soft_max then reads a private copy).
    let c2 = chain(&mut mem, &mut rng, (hq, hk, t, l, d), DType::F32, &m, true);
    assert_eq!(plan(&c2.graph)[0], Step::Node(0));
    // A result over the values would overwrite cells not yet read.
    let mut over_v = c.graph.clone();
    over_v.nodes[2].dst = view(&c.cache_v, &[hq, t, d], &[t * d, d, 1], 0);
    assert_eq!(plan(&over_v)[0], Step::Node(0));
}

#[test]
fn a_result_over_the_queries_reads_them_first() {
    // The allocator reuses the queries' bytes for the result (they are dead after q @ K.T).
    let (hq, hk, t, l, d) = (6, 3, 3, 20, 8);
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(250);
    let m = mask(t, l, 5, &[]);
    let mut c = chain(&mut mem, &mut rng, (hq, hk, t, l, d), DType::F32, &m, false);
    let want = unfused(&mem, &c);
    // q [T, hq, d] viewed as [hq, T, d]; the result [hq, T, d] contiguous over the same bytes.
    c.out = view(&c.q, &[hq, t, d], &[t * d, d, 1], 0);
    c.graph.nodes[2].dst = c.out.clone();
    let got = fused(&mem, &c);
    assert_close(&got, &want, 1e-12);
}
