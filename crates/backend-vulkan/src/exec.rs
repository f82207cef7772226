//! Graph execution: a graph's nodes checked, planned once into commands, recorded once into a
//! command buffer of their own and replayed from the compute stream on every later step.
//!
//! Why: `graph_compute_async` is called every token with the same graph. Planning (resolving
//! tensors, checking shapes, choosing kernel variants, writing descriptor sets, placing
//! barriers) must not run per token, nor should recording the same few hundred commands
//! again; and a bad node must be an error before anything is recorded, never a device fault.
//!
//! Strategy: the first call checks every node (arity by the graph's own rule, then each
//! kernel family's checks in `crate::ops`) and builds a `GraphPlan` (`crate::plan`); nothing
//! is recorded if any node is bad. Plans are cached by graph address and replayed while the
//! graph object and every buffer it binds are unchanged (the state's `generation`). A cached
//! plan is recorded into a secondary command buffer at its first use (a graph capture) and
//! every call executes that buffer from the open primary one (a graph launch), so staged input
//! copies before it and readbacks after it still share the step's one submission; with
//! `LOWSYNC_VK_RECORD=0` its commands are recorded into the primary buffer on every call
//! instead. A source that overlaps its node's destination is first copied to device scratch
//! memory of this submission, which makes the plan single-use: recorded into the primary
//! buffer, never cached. Index-checking kernels get a tag naming their node, so an index error
//! the device reports names the node. With `LOWSYNC_VK_FUSION` on (the default), a chain
//! `crate::fusion` proves safe (a decode attention, a norm times its weight, a product and
//! the add, SwiGLU or cache write consuming it, K's rope and its cache write) is planned as one
//! dispatch (two for an attention split over keys) at its first node's position and its other
//! nodes plan nothing; the graph's node count is still what a step counts as kernel launches.
//!
//! Invariants: a plan is replayed only for the graph and generation it was built for; every
//! recorded range was bounds-checked against its buffer; per call, either the graph's nodes
//! are counted as kernel launches (recorded into the stream) or one graph launch is counted
//! (a recorded plan executed), plus one graph capture when it was recorded by this call.

use std::collections::BTreeMap;
use std::sync::Arc;

use ash::vk;
use lowsync_backend::{bump, Error, ExecGraph, ExecNode, Result, TensorRef};
use lowsync_graph::Op;

use gpu_allocator::MemoryLocation;

use crate::config::ATTN_SPLIT_DEFAULT_CHUNKS;
use crate::device::unavailable;
use crate::fusion::{self, AttnGroup, Group};
use crate::memory::{create_buffer, Placement};
use crate::ops::{self, Res, Status};
use crate::pipelines::Bind;
use crate::plan::{CachedPlan, ErrorSite, GraphPlan, Recorded, RecordedPlan, Tracker};
use crate::stream::{barrier, State};
use crate::sync::Inner;

/// Bytes of the split attention's partials buffer: a ticket word for each of up to 256 heads,
/// then 64 chunks of 32 heads of dim 256 (a head with more chunks, heads or dims than fit runs
/// with fewer chunks).
const ATTN_PARTS_BYTES: u64 = (256 + 64 * 32 * (256 + 4)) * 4;

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
    /// unchanged, else checks and plans every node (nothing is recorded if any node is bad)
    /// and caches the plan when it can be replayed; then executes the plan's recording
    /// (recording it first when it has none) or records its commands, and submits unless
    /// `submit` is false (the caller records a read behind it and submits both at once).
    pub(crate) fn graph_compute(&self, graph: &Arc<ExecGraph>, submit: bool) -> Result<()> {
        let mut st = self.state.lock();
        let key = Arc::as_ptr(graph) as usize;
        let generation = st.generation;
        let current = |c: &CachedPlan| {
            c.plan.generation == generation
                && c.plan
                    .graph
                    .upgrade()
                    .is_some_and(|g| Arc::ptr_eq(&g, graph))
        };
        if !st.plans.get(&key).is_some_and(current) {
            let plan = Arc::new(self.plan_graph(&mut st, graph)?);
            if !plan.replayable {
                return self.record_and_submit(&mut st, graph, &plan, submit);
            }
            // The plan this replaces and those of dropped graphs go, with their recordings
            // (all of them when the cache is full).
            let full = st.plans.len() >= PLAN_CACHE_MAX;
            let gone: Vec<usize> = st
                .plans
                .iter()
                .filter(|(k, c)| **k == key || full || c.plan.graph.strong_count() == 0)
                .map(|(k, _)| *k)
                .collect();
            for k in gone {
                if let Some(c) = st.plans.remove(&k) {
                    st.retire_plan(c);
                }
            }
            let cached = CachedPlan {
                plan,
                recorded: None,
            };
            st.plans.insert(key, cached);
        }
        let Some(cached) = st.plans.get(&key) else {
            return Err(unavailable("a cached graph plan went missing"));
        };
        let (plan, recorded) = (cached.plan.clone(), cached.recorded);
        if !self.config.record || st.profiler.is_some() || plan.steps.is_empty() {
            return self.record_and_submit(&mut st, graph, &plan, submit);
        }
        let cmd = match recorded {
            Some(r) => r.cmd,
            None => {
                let cmd = st.record_plan(self.device(), &plan.steps)?;
                bump(&self.stats.graph_captures, 1);
                cmd
            }
        };
        st.error_sites
            .extend(plan.sites.iter().map(|(t, s)| (*t, s.clone())));
        // Kept in the cache before anything else can fail, so the recording is freed with it.
        let last_used = st.open_retire().compute;
        if let Some(c) = st.plans.get_mut(&key) {
            c.recorded = Some(RecordedPlan { cmd, last_used });
        }
        st.execute_recorded(self.device(), cmd)?;
        bump(&self.stats.graph_launches, 1);
        if !submit {
            return Ok(());
        }
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())
    }

    /// Records `plan`'s commands into the open command buffer (counted as the graph's kernel
    /// launches) and submits unless `submit` is false.
    fn record_and_submit(
        &self,
        st: &mut State,
        graph: &ExecGraph,
        plan: &GraphPlan,
        submit: bool,
    ) -> Result<()> {
        st.error_sites
            .extend(plan.sites.iter().map(|(t, s)| (*t, s.clone())));
        st.record_steps(self.device(), &plan.steps)?;
        bump(&self.stats.kernel_launches, graph.nodes.len() as u64);
        if !submit {
            return Ok(());
        }
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
        let groups = if self.config.fusion {
            fusion::groups(graph)
        } else {
            Vec::new()
        };
        // By first member; a pair the kernels refuse may leave a shorter group behind.
        let mut groups: BTreeMap<usize, Group> =
            groups.into_iter().map(|g| (g.first(), g)).collect();
        let mut fused = vec![false; graph.nodes.len()];
        // Fused norms not yet recorded (their products normalise x themselves).
        let mut held: Vec<Fold> = Vec::new();
        for (i, node) in graph.nodes.iter().enumerate() {
            if fused[i] {
                continue;
            }
            let grp = groups.remove(&i);
            let members = grp.as_ref().map_or_else(|| vec![i], Group::members);
            // A held norm whose result this node or group reads: folded into the products
            // that can take it, else recorded now (before anything reads its result).
            let fold_at = match &grp {
                None if node.op == Op::MulMat => vec![i],
                Some(Group::ProductRows { mm, .. }) => vec![*mm],
                Some(Group::GluPair { gate, up, .. }) => vec![*gate, *up],
                _ => Vec::new(),
            };
            let mut fold = None;
            for h in std::mem::take(&mut held) {
                let reads = members.iter().any(|&m| {
                    graph.nodes[m]
                        .srcs
                        .iter()
                        .any(|s| fusion::overlap(s, &h.result))
                });
                if !reads {
                    held.push(h);
                } else if fold.is_none()
                    && !fold_at.is_empty()
                    && fold_at.iter().all(|m| h.readers.contains(m))
                {
                    fold = Some(h);
                } else {
                    for d in h.dispatches {
                        self.push_dispatch(st, &mut tracker, &mut steps, d)?;
                    }
                }
            }
            if let Some(f) = fold.take() {
                let d = match &grp {
                    None => self.plan_folded_product(st, node, &f)?,
                    Some(Group::ProductRows { mm, set_rows }) => {
                        self.plan_product_rows(st, &mut sites, graph, (*mm, *set_rows), Some(&f))?
                    }
                    Some(Group::GluPair { gate, up, glu, .. }) => {
                        self.plan_glu_pair(st, graph, (*gate, *up, *glu), Some(&f))?
                    }
                    Some(_) => None,
                };
                match d {
                    Some(d) => {
                        self.push_dispatch(st, &mut tracker, &mut steps, d)?;
                        // Held while readers remain (after the last, its bytes are others').
                        let done = members.iter().max().copied().unwrap_or(i);
                        for m in members {
                            fused[m] = true;
                        }
                        if f.readers.last().is_some_and(|&r| r > done) {
                            held.push(f);
                        }
                        continue;
                    }
                    None => {
                        // No kernel folds it here: the norm runs now, for this and every
                        // later reader.
                        for d in f.dispatches {
                            self.push_dispatch(st, &mut tracker, &mut steps, d)?;
                        }
                    }
                }
            }
            if let Some(grp) = grp {
                let planned = match &grp {
                    Group::Attn(a) => self.plan_attention(st, graph, a)?,
                    Group::NormMul { norm, mul } => {
                        let ds = self.plan_norm_mul(st, graph, *norm, *mul)?;
                        let fold = self.config.norm_fold.unwrap_or(!self.dev.cpu_type);
                        if let (Some(ds), true) = (&ds, fold) {
                            if let Some(h) =
                                self.hold_norm(st, graph, (*norm, *mul), ds, &groups)?
                            {
                                held.push(h);
                                fused[*norm] = true;
                                fused[*mul] = true;
                                continue;
                            }
                        }
                        ds
                    }
                    Group::Epilogue { mm, op, epi } => self
                        .plan_epilogue(st, graph, *mm, *op, *epi)?
                        .map(|d| vec![d]),
                    Group::RopeRows { rope, set_rows } => self
                        .plan_rope_rows(st, &mut sites, graph, *rope, *set_rows)?
                        .map(|d| vec![d]),
                    Group::ProductRows { mm, set_rows } => self
                        .plan_product_rows(st, &mut sites, graph, (*mm, *set_rows), None)?
                        .map(|d| vec![d]),
                    Group::GluPair {
                        gate,
                        up,
                        glu,
                        alone,
                    } => {
                        let d = self.plan_glu_pair(st, graph, (*gate, *up, *glu), None)?;
                        if let (None, Some(epi)) = (&d, alone) {
                            // The later product runs SwiGLU in its store instead.
                            let mm = *gate.max(up);
                            let op = *glu;
                            groups.insert(mm, Group::Epilogue { mm, op, epi: *epi });
                        }
                        d.map(|d| vec![d])
                    }
                };
                if let Some(ds) = planned {
                    for d in ds {
                        self.push_dispatch(st, &mut tracker, &mut steps, d)?;
                    }
                    for m in grp.members() {
                        fused[m] = true;
                    }
                    continue;
                }
            }
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
                Op::GetRows | Op::MulMatId => Some(index_status(
                    st,
                    &mut sites,
                    node,
                    srcs[0].shape.first().copied(),
                )?),
                Op::SetRows => Some(index_status(
                    st,
                    &mut sites,
                    node,
                    dst.shape.first().copied(),
                )?),
                _ => None,
            };
            for d in ops::plan(node, &dst, &srcs, status, self.limits)? {
                self.push_dispatch(st, &mut tracker, &mut steps, d)?;
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

    /// Adds a planned dispatch to a plan's steps, with a barrier before it where it conflicts.
    fn push_dispatch(
        &self,
        st: &mut State,
        tracker: &mut Tracker,
        steps: &mut Vec<Recorded>,
        d: ops::Dispatch,
    ) -> Result<()> {
        let device = self.device();
        let (pipeline, layout) = st.pipelines.pipeline(device, &d.kernel, d.binds.len())?;
        let set = st.pipelines.descriptor_set(device, &d.binds)?;
        let read_bytes = d.binds.iter().filter(|b| !b.write).map(|b| b.range).sum();
        let step = Recorded::Dispatch {
            pipeline,
            layout,
            set,
            push: d.push,
            groups: d.groups,
            kernel: d.kernel.as_str().into(),
            read_bytes,
        };
        tracker.push(steps, step.accesses(&d.binds), step);
        Ok(())
    }

    /// The fused attention dispatch of `grp` (`crate::fusion` proved it safe), or `None` when
    /// the kernel does not take its operands and the chain runs unfused.
    fn plan_attention(
        &self,
        st: &mut State,
        graph: &ExecGraph,
        grp: &AttnGroup,
    ) -> Result<Option<Vec<ops::Dispatch>>> {
        let nodes = &graph.nodes;
        let (kq, sm, pv) = (&nodes[grp.kq], &nodes[grp.soft_max], &nodes[grp.pv]);
        let last = &nodes[grp.last()];
        let Some(out_strides) = fusion::out_strides(&pv.dst, grp.cpy.map(|c| &nodes[c])) else {
            return Ok(None);
        };
        let Op::SoftMax { scale } = sm.op else {
            return Ok(None);
        };
        let chunks = self.config.attn_split.unwrap_or(if self.dev.cpu_type {
            0
        } else {
            ATTN_SPLIT_DEFAULT_CHUNKS
        });
        let grouped = self.config.attn_group.unwrap_or(self.dev.cpu_type);
        let vec = self.config.attn_vec;
        let split = match chunks {
            // Grouped and vec need the partials binding even unsplit (one chunk, no slots
            // used).
            0 if grouped || vec => Some(ops::AttnSplit {
                parts: self.attn_parts(st)?,
                max_chunks: 1,
                grouped,
                vec,
            }),
            0 => None,
            n => Some(ops::AttnSplit {
                parts: self.attn_parts(st)?,
                max_chunks: if n == 1 { ATTN_SPLIT_DEFAULT_CHUNKS } else { n },
                grouped,
                vec,
            }),
        };
        let a = ops::Attn {
            q: &self.resolve(st, kq, &kq.srcs[0])?,
            k: &self.resolve(st, kq, &kq.srcs[1])?,
            v: &self.resolve(st, pv, &pv.srcs[1])?,
            mask: &self.resolve(st, sm, &sm.srcs[1])?,
            scale,
            out: &self.resolve(st, last, &last.dst)?,
            out_strides,
            split,
        };
        Ok(ops::attention(kq, &a, self.limits).ok())
    }

    /// The split attention's partials buffer, created at its first use and kept (at one size,
    /// so recorded plans binding it stay valid) until the backend closes.
    fn attn_parts(&self, st: &mut State) -> Result<Bind> {
        if st.attn_parts.is_none() {
            let allocator = st
                .allocator
                .as_mut()
                .ok_or_else(|| unavailable("the backend is shutting down"))?;
            let buf = create_buffer(
                self.device(),
                allocator,
                ATTN_PARTS_BYTES,
                Placement {
                    location: MemoryLocation::GpuOnly,
                    host_access: false,
                },
                &st.families,
                "attention partials",
            )?;
            // The heads' ticket words start at zero (each merge puts its head's back). The
            // fill runs in the open command buffer, before any plan that binds the buffer.
            let device = self.device();
            let rec = st.open(device)?;
            // SAFETY: a fresh buffer no submission uses; the barrier orders the fill before
            // every later compute access.
            unsafe { device.cmd_fill_buffer(rec.cmd, buf.buffer, 0, vk::WHOLE_SIZE, 0) };
            barrier(
                device,
                rec.cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::AccessFlags::TRANSFER_WRITE,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE,
            );
            rec.has_work = true;
            st.attn_parts = Some(buf);
        }
        let buf = st.attn_parts.as_ref().expect("created above");
        Ok(Bind {
            buffer: buf.buffer,
            offset: 0,
            range: ATTN_PARTS_BYTES.min(self.limits.max_range) & !3,
            write: true,
        })
    }

    /// The fused `RmsNorm -> Mul` of nodes `norm` and `mul` (`crate::fusion` proved it safe),
    /// or `None` when the kernel does not take its operands and the pair runs unfused.
    fn plan_norm_mul(
        &self,
        st: &State,
        graph: &ExecGraph,
        norm: usize,
        mul: usize,
    ) -> Result<Option<Vec<ops::Dispatch>>> {
        let (n, m) = (&graph.nodes[norm], &graph.nodes[mul]);
        let Op::RmsNorm { eps } = n.op else {
            return Ok(None);
        };
        let x = self.resolve(st, n, &n.srcs[0])?;
        let w = self.resolve(st, m, &m.srcs[1])?;
        let dst = self.resolve(st, m, &m.dst)?;
        Ok(ops::norm_mul(n, &dst, &x, &w, eps, self.limits).ok())
    }

    /// The product at node `mm` with the element-wise node `op` in its store (`crate::fusion`
    /// proved it safe), or `None` when no fused kernel takes the operands and the pair runs
    /// unfused.
    fn plan_epilogue(
        &self,
        st: &State,
        graph: &ExecGraph,
        mm: usize,
        op: usize,
        epi: ops::Epilogue,
    ) -> Result<Option<ops::Dispatch>> {
        let (m, o) = (&graph.nodes[mm], &graph.nodes[op]);
        let other = if o.srcs[0] == m.dst { 1 } else { 0 };
        let a = self.resolve(st, m, &m.srcs[0])?;
        let b = self.resolve(st, m, &m.srcs[1])?;
        let e = self.resolve(st, o, &o.srcs[other])?;
        let dst = self.resolve(st, o, &o.dst)?;
        ops::mul_mat_epilogue(m, &dst, [&a, &b, &e], epi, self.limits)
    }

    /// SwiGLU of the products at nodes `gate` and `up` (the `SwiGlu` at node `glu`) as one
    /// dispatch (`crate::fusion` proved it safe), or `None` when no kernel takes the operands.
    fn plan_glu_pair(
        &self,
        st: &State,
        graph: &ExecGraph,
        (gate, up, glu): (usize, usize, usize),
        fold: Option<&Fold>,
    ) -> Result<Option<ops::Dispatch>> {
        let (g, u, o) = (&graph.nodes[gate], &graph.nodes[up], &graph.nodes[glu]);
        let x = match fold {
            Some(f) => f.x.clone(),
            None => self.resolve(st, g, &g.srcs[0])?,
        };
        let wg = self.resolve(st, g, &g.srcs[1])?;
        let wu = self.resolve(st, u, &u.srcs[1])?;
        let dst = self.resolve(st, o, &o.dst)?;
        let d = ops::mul_mat_glu(g, &dst, [&x, &wg, &wu], self.limits)?;
        self.fold_into(g, d, fold)
    }

    /// `d` with the held norm `fold` folded in (`None` where its kernel takes none), or `d`
    /// itself without one.
    fn fold_into(
        &self,
        node: &ExecNode,
        d: Option<ops::Dispatch>,
        fold: Option<&Fold>,
    ) -> Result<Option<ops::Dispatch>> {
        match (d, fold) {
            (Some(d), Some(f)) => ops::with_norm(node, d, &f.g, f.eps, self.limits),
            (d, _) => Ok(d),
        }
    }

    /// The fused `Rope -> SetRows` of nodes `rope` and `set_rows` (`crate::fusion` proved it
    /// safe), or `None` when the kernel does not take the operands and the pair runs unfused.
    fn plan_rope_rows(
        &self,
        st: &mut State,
        sites: &mut Vec<(u32, ErrorSite)>,
        graph: &ExecGraph,
        rope: usize,
        set_rows: usize,
    ) -> Result<Option<ops::Dispatch>> {
        let (r, w) = (&graph.nodes[rope], &graph.nodes[set_rows]);
        let Op::Rope {
            mode,
            n_dims,
            theta_base,
        } = r.op
        else {
            return Ok(None);
        };
        let x = self.resolve(st, r, &r.srcs[0])?;
        let pos = self.resolve(st, r, &r.srcs[1])?;
        let ids = self.resolve(st, w, &w.srcs[2])?;
        let cache = self.resolve(st, w, &w.dst)?;
        let status = index_status(st, sites, w, cache.shape.first().copied())?;
        ops::rope_set_rows(
            r,
            [&cache, &x, &pos, &ids],
            (mode, n_dims, theta_base),
            Some(status),
            self.limits,
        )
    }

    /// The fused `MulMat -> SetRows` of nodes `mm` and `set_rows` (`crate::fusion` proved it
    /// safe), or `None` when no kernel takes the operands and the pair runs unfused.
    fn plan_product_rows(
        &self,
        st: &mut State,
        sites: &mut Vec<(u32, ErrorSite)>,
        graph: &ExecGraph,
        (mm, set_rows): (usize, usize),
        fold: Option<&Fold>,
    ) -> Result<Option<ops::Dispatch>> {
        let (m, w) = (&graph.nodes[mm], &graph.nodes[set_rows]);
        let product = self.resolve(st, m, &m.dst)?;
        let a = match fold {
            Some(f) => f.x.clone(),
            None => self.resolve(st, m, &m.srcs[0])?,
        };
        let b = self.resolve(st, m, &m.srcs[1])?;
        let ids = self.resolve(st, w, &w.srcs[2])?;
        let cache = self.resolve(st, w, &w.dst)?;
        let status = index_status(st, sites, w, cache.shape.first().copied())?;
        let d = ops::mul_mat_set_rows(
            m,
            [&product, &a, &b, &cache, &ids],
            Some(status),
            self.limits,
        )?;
        self.fold_into(m, d, fold)
    }

    /// The one-row product at node `i` reading x through the held norm `fold`, or `None` when
    /// no kernel takes the fold.
    fn plan_folded_product(
        &self,
        st: &State,
        node: &ExecNode,
        fold: &Fold,
    ) -> Result<Option<ops::Dispatch>> {
        let w = self.resolve(st, node, &node.srcs[1])?;
        let dst = self.resolve(st, node, &node.dst)?;
        let mut ds = ops::plan(node, &dst, &[fold.x.clone(), w], None, self.limits)?;
        let (Some(d), None) = (ds.pop(), ds.pop()) else {
            return Ok(None);
        };
        self.fold_into(node, Some(d), Some(fold))
    }

    /// Holds back the fused norm `norm -> mul` (planned as `dispatches`) where every product
    /// reading its result may normalise x itself (`fusion::norm_readers`): the products get
    /// the norm's source, weight and eps instead.
    fn hold_norm(
        &self,
        st: &State,
        graph: &ExecGraph,
        (norm, mul): (usize, usize),
        dispatches: &[ops::Dispatch],
        groups: &BTreeMap<usize, Group>,
    ) -> Result<Option<Fold>> {
        let Some(readers) = fusion::norm_readers(graph, norm, mul) else {
            return Ok(None);
        };
        let (n, m) = (&graph.nodes[norm], &graph.nodes[mul]);
        let Op::RmsNorm { eps } = n.op else {
            return Ok(None);
        };
        // The readers now read the source and weight at their own places: a fused group that
        // starts by then and moves a later write of either before a reader rules it out.
        let last = readers.last().copied().unwrap_or(mul);
        let moved_write = groups.range(..=last).any(|(_, grp)| {
            grp.members().iter().any(|&k| {
                let d = &graph.nodes[k].dst;
                k > last && (fusion::overlap(d, &n.srcs[0]) || fusion::overlap(d, &m.srcs[1]))
            })
        });
        if moved_write {
            return Ok(None);
        }
        Ok(Some(Fold {
            x: self.resolve(st, n, &n.srcs[0])?,
            g: self.resolve(st, m, &m.srcs[1])?,
            eps,
            result: m.dst.clone(),
            readers,
            dispatches: dispatches.to_vec(),
        }))
    }
}

/// A fused `RmsNorm -> Mul` held back while the products reading its result normalise x
/// themselves (`mul_mat_vec_x_norm.wgsl`).
struct Fold {
    /// The norm's source, its weight (the `Mul`'s other operand) and eps.
    x: Res,
    g: Res,
    eps: f32,
    /// The norm's result (never written while every reader folds it).
    result: TensorRef,
    /// The nodes reading the result (`fusion::norm_readers`).
    readers: Vec<usize>,
    /// The fused norm, recorded before the first reader that cannot fold it.
    dispatches: Vec<ops::Dispatch>,
}

/// A fresh error tag for the index-checking node `node` (its ids index `n` rows), registered
/// in `sites` so an index error the device reports names the node.
fn index_status(
    st: &mut State,
    sites: &mut Vec<(u32, ErrorSite)>,
    node: &ExecNode,
    n: Option<usize>,
) -> Result<Status> {
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
    let (what, rows_of) = match node.op {
        Op::GetRows => ("ids", "a table"),
        Op::SetRows => ("indices", "a destination"),
        _ => ("ids", "experts"),
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
    Ok(Status { bind, tag })
}
