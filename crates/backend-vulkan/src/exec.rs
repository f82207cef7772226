//! Graph execution: a graph's nodes checked, planned once into commands, and recorded into
//! the compute stream on every step.
//!
//! Why: `graph_compute_async` is called every token with the same graph. Planning (resolving
//! tensors, checking shapes, choosing kernel variants, writing descriptor sets, placing
//! barriers) must not run per token, and a bad node must be an error before anything is
//! recorded, never a device fault.
//!
//! Strategy: the first call checks every node (arity by the graph's own rule, then each
//! kernel family's checks in `crate::ops`) and builds a `GraphPlan` (`crate::plan`); nothing
//! is recorded if any node is bad. Plans are cached by graph address and replayed while the
//! graph object and every buffer it binds are unchanged (the state's `generation`). A source
//! that overlaps its node's destination is first copied to device scratch memory of this
//! submission, which makes the plan single-use. Index-checking kernels get a tag naming their
//! node, so an index error the device reports names the node.
//!
//! Invariants: a plan is replayed only for the graph and generation it was built for; every
//! recorded range was bounds-checked against its buffer; the kernel-launch counter counts the
//! graph's nodes once per call.

use std::sync::Arc;

use ash::vk;
use lowsync_backend::{bump, Error, ExecGraph, ExecNode, Result, TensorRef};
use lowsync_graph::Op;

use crate::device::unavailable;
use crate::ops::{self, Res, Status};
use crate::pipelines::Bind;
use crate::plan::{ErrorSite, GraphPlan, Recorded, Tracker};
use crate::stream::State;
use crate::sync::Inner;

/// Graph plans kept for replay (a model has a few shape buckets).
const PLAN_CACHE_MAX: usize = 64;

impl Inner {
    /// Resolves a tensor to device memory, bounds-checked.
    fn resolve(&self, st: &State, node: &ExecNode, t: &TensorRef) -> Result<Res> {
        let b = st
            .buffers
            .get(&t.buffer)
            .ok_or_else(|| self.unknown(t.buffer))?;
        let extent = t.byte_extent();
        if t.byte_offset
            .checked_add(extent)
            .is_none_or(|e| e as u64 > b.size)
        {
            return Err(Error::OutOfBounds {
                buffer: t.buffer.0,
                offset: t.byte_offset,
                len: extent,
                size: b.size as usize,
            });
        }
        if t.shape.len() != t.strides.len() {
            return Err(ops::kernel_err(node, "shape and strides differ in rank"));
        }
        Ok(Res {
            buffer: b.buffer,
            buffer_size: b.vk_size,
            base: t.byte_offset as u64,
            dtype: t.dtype,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
        })
    }

    /// Queues a graph: replays its cached plan when the graph and every buffer it binds are
    /// unchanged, else checks and plans every node (nothing is recorded if any node is bad),
    /// caches the plan when it can be replayed, records and submits.
    pub(crate) fn graph_compute(&self, graph: &Arc<ExecGraph>) -> Result<()> {
        let mut st = self.state.lock();
        let key = Arc::as_ptr(graph) as usize;
        let generation = st.generation;
        let cached = st
            .plans
            .get(&key)
            .filter(|p| {
                p.generation == generation
                    && p.graph.upgrade().is_some_and(|g| Arc::ptr_eq(&g, graph))
            })
            .cloned();
        let plan = match cached {
            Some(p) => p,
            None => {
                let p = Arc::new(self.plan_graph(&mut st, graph)?);
                if p.replayable {
                    if st.plans.len() >= PLAN_CACHE_MAX {
                        st.plans.clear();
                    }
                    st.plans.insert(key, p.clone());
                }
                p
            }
        };
        st.error_sites
            .extend(plan.sites.iter().map(|(t, s)| (*t, s.clone())));
        st.record_steps(self.device(), &plan.steps)?;
        bump(&self.stats.kernel_launches, graph.nodes.len() as u64);
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())
    }

    /// Checks and plans every node of `graph` into recorded steps, with the barriers a fresh
    /// hazard tracker places between conflicting commands.
    fn plan_graph(&self, st: &mut State, graph: &Arc<ExecGraph>) -> Result<GraphPlan> {
        let device = self.device();
        let retire = st.open_retire();
        let mut steps = Vec::new();
        let mut sites = Vec::new();
        let mut tracker = Tracker::default();
        let mut replayable = true;
        for node in &graph.nodes {
            node.op
                .check_arity(node.srcs.len())
                .map_err(|m| ops::kernel_err(node, m))?;
            let dst = self.resolve(st, node, &node.dst)?;
            let mut srcs = Vec::with_capacity(node.srcs.len());
            for (i, t) in node.srcs.iter().enumerate() {
                let mut r = self.resolve(st, node, t)?;
                if node.src_needs_private_copy(i) {
                    // Another source overlaps the destination: the kernel reads a copy, in
                    // scratch memory of this submission (so this plan is not replayed).
                    replayable = false;
                    let size = r.byte_extent();
                    let region = {
                        let State {
                            scratch, allocator, ..
                        } = &mut *st;
                        let allocator = allocator
                            .as_mut()
                            .ok_or_else(|| unavailable("the backend is shutting down"))?;
                        scratch.alloc(
                            size,
                            self.limits.offset_align.max(16),
                            retire,
                            device,
                            allocator,
                        )?
                    }
                    .ok_or_else(|| ops::kernel_err(node, "device scratch memory exhausted"))?;
                    st.forget_arena_chunks(device);
                    let step = Recorded::Copy {
                        src: (r.buffer, r.base),
                        dst: (region.buffer, region.offset),
                        size,
                    };
                    tracker.push(&mut steps, step.accesses(&[]), step);
                    r.buffer = region.buffer;
                    r.base = region.offset;
                    r.buffer_size = region.offset + size.next_multiple_of(16);
                }
                srcs.push(r);
            }
            let status = match node.op {
                Op::GetRows | Op::SetRows | Op::MulMatId => {
                    let Some(s) = st.status.as_ref() else {
                        return Err(unavailable("no status words"));
                    };
                    let bind = Bind {
                        buffer: s.buf.buffer,
                        offset: 0,
                        range: 16,
                        write: true,
                    };
                    st.next_tag = st.next_tag.wrapping_add(1);
                    let tag = st.next_tag;
                    let (what, rows_of, n) = match node.op {
                        Op::GetRows => ("ids", "a table", srcs[0].shape.first().copied()),
                        Op::SetRows => ("indices", "a destination", dst.shape.first().copied()),
                        _ => ("ids", "experts", srcs[0].shape.first().copied()),
                    };
                    sites.push((
                        tag,
                        ErrorSite {
                            op: node.op.name(),
                            node: node.name.clone(),
                            what,
                            rows_of,
                            n: n.unwrap_or(0),
                        },
                    ));
                    Some(Status { bind, tag })
                }
                _ => None,
            };
            for d in ops::plan(node, &dst, &srcs, status, self.limits)? {
                let (pipeline, layout) = st.pipelines.pipeline(device, &d.kernel, d.binds.len())?;
                let set = st.pipelines.descriptor_set(device, &d.binds)?;
                let step = Recorded::Dispatch {
                    pipeline,
                    layout,
                    set,
                    push: d.push,
                    groups: d.groups,
                };
                tracker.push(&mut steps, step.accesses(&d.binds), step);
            }
        }
        Ok(GraphPlan {
            graph: Arc::downgrade(graph),
            generation: st.generation,
            steps,
            sites,
            replayable,
        })
    }
}
