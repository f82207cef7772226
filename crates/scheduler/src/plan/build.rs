//! Compiling a plan: the scheduler's analysis of one graph turned into per-split executable
//! graphs, input arenas, foreign-input copies and output slots, each resolved to buffers and
//! offsets once (graph reuse, ARCHITECTURE §4.5).
//!
//! Why its own file: [`Plan`] is what a step runs; this is how one is laid out in memory, done
//! once per graph shape. Every size and offset sum here is checked against the allocation limit
//! (`add_bytes`), so a graph too large to address is an error, never a wrapped offset.

use super::*;

impl Sched {
    /// Places, splits and allocates `graph` once; the returned plan runs it step after step.
    ///
    /// Written here, not in `sched.rs`, so the scheduler module never depends on the plan it
    /// builds: `prepare` decides the reserve, `Plan::build` lays the plan out.
    pub fn compile(self: &Arc<Self>, graph: &Graph) -> Result<Plan> {
        let p = self.prepare(graph)?;
        Plan::build(self.clone(), graph, p.analysis, &p.compute, p.leaves)
    }
}

impl Plan {
    pub(crate) fn build(
        sched: Arc<Sched>,
        graph: &Graph,
        a: Analysis,
        compute: &[Option<BufferId>],
        leaves: HashMap<usize, LeafHome>,
    ) -> Result<Plan> {
        let ts = graph.tensors();
        let backends = sched.backends().to_vec();
        let n_copies = sched.n_copies();
        let mut own_buffers: Vec<(usize, BufferId)> = Vec::new();

        // Outputs: each backend's output roots packed in a buffer of the plan's own.
        let mut out_off: HashMap<usize, usize> = HashMap::new();
        let mut out_bytes = vec![0usize; backends.len()];
        for (r, &is_out) in a.output_roots.iter().enumerate() {
            if is_out {
                let b = a.placement[r];
                out_off.insert(r, out_bytes[b]);
                out_bytes[b] = add_bytes(
                    out_bytes[b],
                    align(a.extent_bytes[r]),
                    "the outputs of this graph",
                )?;
            }
        }
        let mut out_buf: Vec<Option<BufferId>> = vec![None; backends.len()];
        for (b, &bytes) in out_bytes.iter().enumerate() {
            if a.output_roots
                .iter()
                .enumerate()
                .any(|(r, &o)| o && a.placement[r] == b)
            {
                let id = backends[b].alloc_buffer(bytes, BufferUsage::Compute)?;
                own_buffers.push((b, id));
                out_buf[b] = Some(id);
            }
        }

        // Input arenas: per split, its user inputs packed; the pack mirrors all arenas.
        let mut pack_len = 0usize;
        let mut arena_layout: Vec<Vec<(usize, usize, usize)>> = Vec::new(); // (root, offset, bytes)
        let mut arena_bytes: Vec<usize> = Vec::new();
        let mut pack_base: Vec<usize> = Vec::new();
        for sp in &a.splits {
            let mut off = 0;
            let mut lay = Vec::new();
            for &r in &sp.user_inputs {
                let bytes = a.extent_bytes[r];
                lay.push((r, off, bytes));
                off = add_bytes(off, align(bytes), "the inputs of this graph")?;
            }
            pack_base.push(pack_len);
            pack_len = add_bytes(pack_len, off, "the inputs of this graph")?;
            arena_layout.push(lay);
            arena_bytes.push(off);
        }
        let mut arena_buf_per_backend: Vec<usize> = vec![0; backends.len()];
        let mut arena_base: Vec<Vec<usize>> = Vec::new();
        for (s, sp) in a.splits.iter().enumerate() {
            let mut bases = Vec::new();
            for _ in 0..n_copies {
                bases.push(arena_buf_per_backend[sp.backend]);
                arena_buf_per_backend[sp.backend] = add_bytes(
                    arena_buf_per_backend[sp.backend],
                    arena_bytes[s],
                    "the input copies of this graph",
                )?;
            }
            arena_base.push(bases);
        }
        let mut arena_buf: Vec<Option<BufferId>> = vec![None; backends.len()];
        for (b, &bytes) in arena_buf_per_backend.iter().enumerate() {
            // Inputs of zero elements still need an address to point at.
            if bytes > 0
                || a.splits
                    .iter()
                    .any(|sp| sp.backend == b && !sp.user_inputs.is_empty())
            {
                let id = backends[b].alloc_buffer(bytes, BufferUsage::Inputs)?;
                own_buffers.push((b, id));
                arena_buf[b] = Some(id);
            }
        }

        // Where each root lives, seen from split `s`, copy `c`.
        let missing =
            |what: &str| Error::Unsupported(format!("internal: no memory planned for {what}"));
        let home = |r: usize| -> Result<(BufferId, usize)> {
            let t = &ts[r];
            let b = a.placement[r];
            match t.op {
                Op::Weight | Op::Persistent => leaves
                    .get(&r)
                    .map(|h| (h.buffer, 0))
                    .ok_or_else(|| missing("a leaf")),
                _ if a.output_roots[r] => {
                    Ok((out_buf[b].ok_or_else(|| missing("outputs"))?, out_off[&r]))
                }
                _ => {
                    let off = a.per_backend[b]
                        .offset(ItemKey::Node(r))
                        .ok_or_else(|| missing("a node"))?;
                    Ok((compute[b].ok_or_else(|| missing("scratch"))?, off))
                }
            }
        };
        let locate = |s: usize, c: usize, r: usize| -> Result<(BufferId, usize)> {
            let sp = &a.splits[s];
            if ts[r].op == Op::Input {
                let (_, off, _) = arena_layout[s]
                    .iter()
                    .find(|(x, _, _)| *x == r)
                    .ok_or_else(|| missing("an input"))?;
                return Ok((
                    arena_buf[sp.backend].ok_or_else(|| missing("an arena"))?,
                    arena_base[s][c] + off,
                ));
            }
            if a.placement[r] != sp.backend {
                let key = ItemKey::Copy {
                    split: s,
                    root: r,
                    copy: c,
                };
                let off = a.per_backend[sp.backend]
                    .offset(key)
                    .ok_or_else(|| missing("a copy"))?;
                return Ok((compute[sp.backend].ok_or_else(|| missing("scratch"))?, off));
            }
            home(r)
        };
        let tref = |base: (BufferId, usize), t: usize| -> TensorRef {
            let info = &ts[t];
            TensorRef {
                buffer: base.0,
                // Admitted layouts start at a whole block (block dtypes keep rows whole); a
                // layout that does not saturates and fails the backend's bounds check.
                byte_offset: base.1.saturating_add(
                    info.dtype
                        .checked_bytes(info.layout.offset)
                        .unwrap_or(usize::MAX),
                ),
                dtype: info.dtype,
                shape: info.layout.shape.clone(),
                strides: info.layout.strides.clone(),
            }
        };

        let mut splits = Vec::new();
        for (s, sp) in a.splits.iter().enumerate() {
            let be = &backends[sp.backend];
            let scratch = scratch_live(&a, sp, compute[sp.backend]);
            let mut exec = Vec::new();
            for c in 0..n_copies {
                let mut nodes = Vec::with_capacity(sp.nodes.len());
                for &j in &sp.nodes {
                    let t = &ts[j];
                    let dst = tref(locate(s, c, t.root.index())?, j);
                    let mut srcs = Vec::with_capacity(t.srcs.len());
                    for src in &t.srcs {
                        srcs.push(tref(
                            locate(s, c, ts[src.index()].root.index())?,
                            src.index(),
                        ));
                    }
                    nodes.push(ExecNode {
                        op: t.op,
                        name: node_name(graph, j),
                        dst,
                        srcs,
                    });
                }
                exec.push(Arc::new(ExecGraph {
                    nodes,
                    scratch: scratch.clone(),
                }));
            }
            let mut foreign = Vec::new();
            for &r in &sp.foreign {
                let src = home(r)?;
                let dst = (0..n_copies)
                    .map(|c| locate(s, c, r))
                    .collect::<Result<Vec<_>>>()?;
                foreign.push(ForeignCopy {
                    src_backend: a.placement[r],
                    src,
                    dst,
                    len: a.extent_bytes[r],
                });
            }
            let arena = arena_buf[sp.backend]
                .filter(|_| arena_bytes[s] > 0)
                .map(|id| {
                    (
                        id,
                        arena_base[s].clone(),
                        pack_base[s]..pack_base[s] + arena_bytes[s],
                    )
                });
            let user_inputs = arena_layout[s]
                .iter()
                .map(|&(_, off, bytes)| (off, bytes))
                .collect();
            let events = (0..n_copies)
                .map(|_| {
                    if be.caps().events {
                        be.event_new().map(Some)
                    } else {
                        Ok(None)
                    }
                })
                .collect::<lowsync_backend::Result<Vec<_>>>()?;
            splits.push(SplitExec {
                backend: sp.backend,
                exec,
                arena,
                user_inputs,
                foreign,
                events,
            });
        }

        // Inputs: the first split that reads an input holds its canonical pack slot.
        let mut inputs = Vec::new();
        let mut input_index = HashMap::new();
        for (id, t) in graph.inputs() {
            let r = id.index();
            let mut slots = a.splits.iter().enumerate().filter_map(|(s, _)| {
                arena_layout[s]
                    .iter()
                    .find(|(x, _, _)| *x == r)
                    .map(|(_, off, _)| pack_base[s] + off)
            });
            let name = t.name.clone().unwrap_or_default();
            let Some(offset) = slots.next() else {
                // An input no node reads: keep it settable (a pack slot of its own).
                let off = pack_len;
                pack_len = add_bytes(pack_len, align(t.nbytes()), "the inputs of this graph")?;
                input_index.insert(name.clone(), inputs.len());
                inputs.push(InputSlot {
                    name,
                    dtype: t.dtype,
                    shape: t.layout.shape.clone(),
                    offset: off,
                    nbytes: t.nbytes(),
                    mirrors: vec![],
                });
                continue;
            };
            input_index.insert(name.clone(), inputs.len());
            inputs.push(InputSlot {
                name,
                dtype: t.dtype,
                shape: t.layout.shape.clone(),
                offset,
                nbytes: t.nbytes(),
                mirrors: slots.collect(),
            });
        }

        let mut outputs = Vec::new();
        let mut output_index = HashMap::new();
        for (name, id) in graph.outputs() {
            let r = ts[id.index()].root.index();
            let slot = if ts[r].op == Op::Input {
                let off = inputs[input_index[ts[r].name.as_deref().unwrap_or_default()]].offset;
                OutputSlot {
                    name: name.clone(),
                    backend: None,
                    tensor: tref((BufferId(0), off), id.index()),
                }
            } else {
                OutputSlot {
                    name: name.clone(),
                    backend: Some(a.placement[r]),
                    tensor: tref(home(r)?, id.index()),
                }
            };
            output_index.insert(name.clone(), outputs.len());
            outputs.push(slot);
        }

        // The host pack is sized by the graph's inputs: a huge input is an error, not an abort.
        let pack = lowsync_backend::host_zeroed(pack_len, || "the input pack of a plan".into())?;
        Ok(Plan {
            sched,
            splits,
            inputs,
            input_index,
            outputs,
            output_index,
            own_buffers,
            pack,
            next_copy: 0,
            computed: false,
            resolved_feeds: Vec::new(),
            feeds: Vec::new(),
            n_nodes: graph.n_nodes(),
            n_leafs: graph.n_leafs(),
            placement: a.placement,
        })
    }
}

/// The scratch bytes of `buffer` (split `sp`'s backend's) that later splits read after `sp`'s
/// graph: every planned block written up to its last node and read after it (pipelined copies,
/// pinned, are always kept). Nothing else of the scratch is read before being written again
/// (inputs, outputs, weights and state have buffers of their own).
fn scratch_live(a: &Analysis, sp: &SplitDef, buffer: Option<BufferId>) -> Option<ScratchLive> {
    let buffer = buffer?;
    let end = *sp.nodes.iter().max()?;
    let bi = &a.per_backend[sp.backend];
    let kept = bi
        .items
        .iter()
        .zip(&bi.plan.offsets)
        .filter(|(it, _)| it.def <= end && (it.last > end || it.pinned))
        .map(|(it, &off)| (off, off + it.size))
        .collect();
    Some(ScratchLive { buffer, kept })
}

fn node_name(g: &Graph, i: usize) -> String {
    let t = &g.tensors()[i];
    t.name
        .clone()
        .unwrap_or_else(|| format!("{}#{i}", t.op.name()))
}
