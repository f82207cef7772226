//! Fused decode kernels: node patterns of a compute graph that run as one launch.
//!
//! Why: decode is a chain of small launches (~22 per llama layer); each costs a launch and a
//! pass over its operands. Replacing the common chains by one kernel each brings a layer to 7
//! or 8 launches and drops the passes over intermediates the fused kernel keeps in registers.
//!
//! Strategy: `plan` is a pure matcher over the graph's nodes (no device, nothing cached: it
//! runs on every `run_graph` call and looks at each node and a short window after it). At
//! each node not yet taken it tries the patterns below (`patterns`), every further member
//! within `WINDOW` nodes of an earlier one; a matched group runs as one kernel at the position
//! of its first node, every other node through `Exec::run` as before. Each family has its
//! launcher and its kernels beside it (`norm_mul`, `gemv`, `rope_rows`, `attention`: a `.rs`
//! and a `.cu` each; the head's product and argmax launch from `exec::matmul`). The patterns:
//! - `RmsNorm -> Mul(norm, weight row)`: one block per row; or, for one f32 row feeding the
//!   products below, their decode kernel's prologue (each block computes the row in shared
//!   memory, block 0 also writes the norm and the product) when their blocks fit one wave.
//! - `MulMat`s of one activation (the same `TensorRef`) — q/k/v, gate/up — each optionally
//!   followed by an `Add` of its result and a bias row or a residual; or a gate/up pair feeding
//!   a `SwiGlu`: one matrix-vector launch over the concatenated output columns, epilogues
//!   included. A single `MulMat -> Add` is the one-product case. On GGUF block weights (one
//!   row, every segment of its own block type) the same groups take `fused_gemv1_q`.
//! - `Rope -> SetRows(cache, rope result reshaped)`, plus the next plain `SetRows` (the V
//!   row): rope, cache row write and V row write in one launch.
//! - `MulMat(q, K) -> SoftMax(mask, scale) -> MulMat(p, V) [-> Cpy of a permutation]` for one
//!   query row per head: one block per query head. `attn_fast` where it applies (f32 q, mask
//!   and copy, aligned rows, a power-of-two number of 16-byte pieces per head; see
//!   `CudaConfig::attn_fast`), else `attn_decode`. Both read the K/V rows of valid keys only,
//!   except that `attn_fast` reads a one-chunk window's rows together with its mask (one round
//!   trip instead of two; masked rows' values are never used). A window with a mask whose
//!   scores and p are dead (decode's) takes `attn_fast_long` at any length: it lists the valid
//!   keys first (2048 mask entries per round trip), so masked keys cost nothing; past one round
//!   trip of keys (and within one listing) it can run split over its keys, `attn_split`:
//!   several blocks per head, merged by the head's last block (`CudaConfig::attn_split`, on
//!   by default).
//! - The same chain for several query rows per head (prefill), where the raw scores and p are
//!   dead and head_dim is at most 128: `attn_prefill`, flash-attention style — a block per
//!   (head, tile of 16 query rows), keys in tiles of 32 with an online softmax, key tiles the
//!   mask excludes for every row of the block skipped (a causal mask's upper triangle), o
//!   written only when read besides its copy (`CudaConfig::attn_prefill`, tune key
//!   `attn_prefill`). Otherwise the chain runs unfused (cuBLAS products, `soft_max_rows`,
//!   `copy_strided`).
//! - `MulMat` of one row -> `Argmax` of its whole result (decode's head): each block of the
//!   product folds the best (value, row) of its rows, as a 64-bit key, into one device word
//!   with an integer atomic max (order-independent, so deterministic); a one-thread
//!   `argmax_take` turns the word into the index and zeroes it. No kernel reads the logits back.
//!   On a quantized weight (`fused_gemv1_q`, `CudaConfig::q_head_fold`) the head also takes the
//!   final `RmsNorm -> Mul` as its prologue and its grid's last block takes the index: the
//!   head is one launch.
//!
//! Each kernel has exact preconditions (dtypes, ranks, contiguity, at most
//! `matmul::mmv_max_m` activation rows, head_dim <= `ATT_MAX_D`, ...); nodes that miss one
//! run unfused. With `CudaConfig::fusion` off every node runs through `Exec::run`.
//!
//! Invariants (checked per group by `safety`, so results equal the unfused chain's):
//! - A fused kernel writes every tensor its nodes write, in node order within the thread that
//!   owns an element — except the attention's raw scores, and for `attn_fast` and
//!   `attn_prefill` also p and (beside its copy) o, when `dead_after` proves nothing reads them
//!   before they are overwritten
//!   (the scores of masked positions would need the K rows the kernel skips, and the allocator
//!   puts later tensors over them).
//!   Where the scheduler says which scratch bytes later splits read (`ExecGraph::scratch`),
//!   `dead_after` counts every other scratch byte as overwritten at the graph's end (the next
//!   graph writes it before reading), so results nothing reads after the graph are dead too.
//! - No member needs a private copy of a source (`ExecNode::src_needs_private_copy`).
//! - No write of the group overlaps a tensor the group reads, unless the same thread reads the
//!   element before writing it (an in-place residual) or, in the attention, the write belongs to
//!   the block that read those bytes first (results over q); writes overlap each other only as
//!   an in-place node over its own source.
//! - Running later members early is allowed only when no node in between writes bytes a moved
//!   member reads, or reads or writes bytes it writes (byte ranges of `TensorRef`s in one
//!   buffer: the allocator reuses memory).
//!
//! Kernels sum in fixed orders that depend only on shapes (no float atomics), so fused results
//! are deterministic run to run. Their orders differ from the unfused kernels' (decode's
//! products run one output unit per warp, `fused_gemv1`), so fused and unfused results agree
//! within the NMSE bounds of `tests/fused.rs`, not bit for bit; graph replay on and off are
//! bit-identical (same kernels), and so are streamed and unstreamed products (a streamed
//! grid's warps take several units each, every unit still one warp's, in the same order).

mod attention;
pub(crate) mod gemv;
mod group;
mod norm_mul;
mod patterns;
mod rope_rows;
mod safety;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use lowsync_backend::{ExecGraph, Result};
use lowsync_graph::Op;

use crate::config::CudaConfig;
use crate::exec::launch::Exec;
use crate::exec::matmul;
use group::{has_tails, Kind, Nodes, Step};

/// Queues every node of `graph`, fused where a pattern matches and fusion is on.
pub(crate) fn run_graph(exec: &mut Exec<'_>, graph: &Arc<ExecGraph>) -> Result<()> {
    let nodes = &graph.nodes;
    if exec.inner.pdl {
        // Before anything of this graph is queued: a weights buffer some node writes is no
        // longer safe to read ahead of `griddepcontrol.wait`.
        exec.inner
            .bufs
            .note_written(nodes.iter().map(|n| n.dst.buffer));
    }
    if !exec.inner.cfg.fusion {
        for node in nodes {
            exec.run(node)?;
        }
        return Ok(());
    }
    let nodes = Nodes {
        list: nodes,
        end: graph.scratch.as_ref(),
    };
    let cfg = &exec.inner.cfg;
    for step in plan(&nodes, &PlanCfg::of(cfg)) {
        match step {
            Step::Node(i) => exec.run(&nodes[i])?,
            Step::Fused(g) => launch(exec, &nodes, &g.kind)?,
        }
    }
    Ok(())
}

/// What `run_graph` launches for `graph` with fusion on under `cfg`, worked out without a
/// device: one line per launch, `fused <kind>` (with its members' ops) or the op of a node run
/// on its own. A group the launch finds it cannot take after all (an alignment, a row too long
/// to stage) runs as its nodes instead; that is not foreseen here.
pub(crate) fn describe(graph: &ExecGraph, cfg: &CudaConfig) -> Vec<String> {
    let nodes = Nodes {
        list: &graph.nodes,
        end: graph.scratch.as_ref(),
    };
    let ops = |members: &[usize]| -> String {
        let names: Vec<&str> = members.iter().map(|&j| nodes[j].op.name()).collect();
        names.join(",")
    };
    plan(&nodes, &PlanCfg::of(cfg))
        .into_iter()
        .flat_map(|step| match step {
            Step::Node(i) => vec![nodes[i].op.name().to_string()],
            Step::Fused(g) => {
                let kind = match &g.kind {
                    Kind::NormMul { .. } => "norm_mul".to_string(),
                    Kind::Gemv {
                        segs, swiglu, norm, ..
                    } => format!(
                        "gemv{}{}{}",
                        if norm.is_some() { "+norm" } else { "" },
                        if swiglu.is_some() { "+swiglu" } else { "" },
                        if has_tails(segs) { "+tails" } else { "" },
                    ),
                    Kind::RopeRows { .. } => "rope_rows".to_string(),
                    Kind::HeadArgmax { norm: None, .. } => "gemv+argmax".to_string(),
                    Kind::HeadArgmax { norm: Some(_), .. } => "norm+gemv+argmax".to_string(),
                    Kind::Attention { cpy, scores, .. } => format!(
                        "attention{}{}",
                        if cpy.is_some() { "+cpy" } else { "" },
                        if *scores { "+scores" } else { "" },
                    ),
                    Kind::Prefill { cpy, out, .. } => format!(
                        "attention_prefill{}{}",
                        if cpy.is_some() { "+cpy" } else { "" },
                        if *out && cpy.is_some() { "+out" } else { "" },
                    ),
                };
                let mut lines = vec![format!("fused {kind} [{}]", ops(&g.nodes))];
                if matches!(g.kind, Kind::HeadArgmax { norm: None, .. }) {
                    // The one-thread take of the index the product's blocks folded (a head
                    // with its norm takes the index itself).
                    lines.push("argmax_take".to_string());
                }
                lines
            }
        })
        .collect()
}

/// The settings that shape a plan: `mmv_max_m` is `CudaConfig::mmv_max_m` (fused products take
/// the matrix-vector kernels' rows limit), `prefill` `CudaConfig::attn_prefill` (attention over
/// several query rows per head fused), `head_fold` `CudaConfig::q_head` and `q_head_fold`
/// (a quantized head takes the final norm and its index itself).
#[derive(Clone, Copy, Debug)]
struct PlanCfg {
    mmv_max_m: Option<usize>,
    prefill: bool,
    head_fold: bool,
}

impl PlanCfg {
    fn of(cfg: &CudaConfig) -> PlanCfg {
        PlanCfg {
            mmv_max_m: cfg.mmv_max_m,
            prefill: cfg.attn_prefill,
            head_fold: cfg.q_head && cfg.q_head_fold,
        }
    }
}

/// The steps of `nodes` under `pc`, in execution order.
fn plan(nodes: &Nodes<'_>, pc: &PlanCfg) -> Vec<Step> {
    let (mmv_max_m, prefill) = (pc.mmv_max_m, pc.prefill);
    let mut used = vec![false; nodes.len()];
    let mut steps = Vec::with_capacity(nodes.len());
    for i in 0..nodes.len() {
        if used[i] {
            continue;
        }
        let group = match nodes[i].op {
            Op::RmsNorm { .. } => patterns::norm_gemv(nodes, i, &used, mmv_max_m, pc.head_fold)
                .or_else(|| patterns::norm_mul(nodes, i, &used)),
            Op::MulMat => patterns::attention(nodes, i, &used, prefill)
                .or_else(|| patterns::gemv(nodes, i, &used, mmv_max_m))
                .or_else(|| patterns::head_argmax(nodes, i, &used, mmv_max_m)),
            Op::Rope { .. } => patterns::rope_rows(nodes, i, &used),
            _ => None,
        };
        match group {
            Some(g) => {
                for &j in &g.nodes {
                    used[j] = true;
                }
                steps.push(Step::Fused(g));
            }
            None => steps.push(Step::Node(i)),
        }
    }
    steps
}

fn launch(exec: &mut Exec<'_>, nodes: &Nodes<'_>, kind: &Kind) -> Result<()> {
    match kind {
        Kind::NormMul { norm, mul } => norm_mul::launch_norm_mul(exec, &nodes[*norm], &nodes[*mul]),
        Kind::Gemv { segs, swiglu, norm } => gemv::launch_gemv(exec, nodes, segs, *swiglu, *norm),
        Kind::HeadArgmax { mm, argmax, norm } => {
            let pro = norm.map(|n| gemv::HeadNorm {
                norm: &nodes[n.norm],
                mul: &nodes[n.mul],
                write: !safety::norm_dead(nodes, n, &[*mm]),
            });
            let (mm, argmax) = (&nodes[*mm], &nodes[*argmax]);
            if !matmul::run_vec1_argmax(exec, mm, argmax, pro.as_ref())? {
                if let Some(p) = &pro {
                    p.launch_alone(exec)?;
                }
                exec.run(mm)?;
                exec.run(argmax)?;
            }
            Ok(())
        }
        Kind::RopeRows { rope, rows, plain } => rope_rows::launch_rope_rows(
            exec,
            &nodes[*rope],
            &nodes[*rows],
            plain.map(|p| &nodes[p]),
        ),
        Kind::Attention {
            kq,
            soft_max,
            pv,
            cpy,
            scores,
        } => {
            // p and (beside its copy) o are written only when something reads them later.
            let live = attention::Live {
                scores: *scores,
                probs: !safety::dead_after(nodes, *soft_max, *pv),
                out: cpy.is_none_or(|c| !safety::dead_after(nodes, *pv, c)),
                mask_ahead: attention::mask_ahead(nodes, &nodes[*kq], &nodes[*soft_max]),
            };
            attention::launch_attention(
                exec,
                [&nodes[*kq], &nodes[*soft_max], &nodes[*pv]],
                cpy.map(|c| &nodes[c]),
                live,
            )
        }
        Kind::Prefill {
            kq,
            soft_max,
            pv,
            cpy,
            out,
        } => attention::launch_prefill(
            exec,
            [&nodes[*kq], &nodes[*soft_max], &nodes[*pv]],
            cpy.map(|c| &nodes[c]),
            *out,
        ),
    }
}
