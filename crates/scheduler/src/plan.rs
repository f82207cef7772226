//! A compiled plan: one graph placed on a context's backends, split, allocated once, and run
//! step after step under a [`SyncPolicy`].
//!
//! Why: graph reuse (ARCHITECTURE §4.5) — a graph of a given shape is placed, split and
//! resolved to memory once; a step then only writes inputs, moves what crosses backends, queues
//! the kernels, and, when the caller asks, reads outputs. The compute loop is where host waits
//! happen, so it follows ggml's rules (W0–W6, `ggml-mechanisms.md` §2) step for step under
//! `stock` and removes them under `relaxed` and `staged`.
//!
//! Strategy: each split owns an input arena on its backend holding its user inputs
//! contiguously (times `n_copies`), and receives its foreign inputs into scratch copies. The host
//! keeps one pack mirroring every arena, so `set_input` is the one host-side copy and a staged
//! split writes its whole arena with a single `set_tensor_async_staged`. Per split and step:
//! - `stock`: [W0] a split with no inputs after another backend's split waits for that backend;
//!   [W1+W2] per user input, synchronize then a blocking write; [W3] per foreign input,
//!   synchronize (an event wait with `n_copies > 1`), then `cpy_tensor_async`, or [W4–W6] sync the
//!   source, sync the split's backend, blocking copy.
//! - `relaxed` (#20793, "saaasg"): synchronize, queue every write and copy, synchronize, graph.
//! - `staged`: one staged arena write; foreign inputs by `cpy_tensor_async` (the destination
//!   waits device-side) or, when the destination is the host, one blocking read; invariant 4 by
//!   a device-side event wait. No host wait until the caller reads an output.
//!
//! A backend without the capability a policy needs gets the stock path (invariant 5).
//!
//! Launch-ahead: [`Plan::feed`] arms, for the next step only, a stream-ordered device copy of
//! an output over an input's arena bytes, queued after the step's input writes; with
//! [`Plan::read_async`] (a read waited for on its own) a decode loop queues step t+1, fed the
//! token step t samples, before it waits for token t, so the device never idles on the host.
//! [`Plan::compute_read_async`] queues a step and its read together, so a backend that can puts
//! the read's copy in the step's own submission (one submission per token).
//!
//! Invariants: the caller may reuse its input memory when `set_input` returns and the pack when
//! `compute` returns (invariant 1); every copy is ordered after its source's producer
//! (invariant 2); sources of copies are not reused before the copy (invariant 3, by liveness and
//! by copies from host memory being staged at call time).

use std::collections::HashMap;
use std::sync::Arc;

use lowsync_backend::{
    Backend, BufferId, BufferUsage, Event, ExecGraph, ExecNode, Readback, ScratchLive, TensorRef,
};
use lowsync_graph::{DType, Graph, Op};

use crate::alloc::align;
use crate::analysis::{Analysis, ItemKey, MAX_BYTES};
use crate::error::{Error, Result};
use crate::policy::SyncPolicy;
use crate::sched::{LeafHome, Sched};
use crate::split::SplitDef;

mod build;

/// A host-written input of a plan.
#[derive(Clone, Debug)]
pub struct InputSlot {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte offset of the canonical copy in the host pack.
    pub offset: usize,
    pub nbytes: usize,
    /// Further pack offsets (other splits reading the same input), refreshed each step.
    pub mirrors: Vec<usize>,
}

/// A readable output of a plan.
#[derive(Clone, Debug)]
pub struct OutputSlot {
    pub name: String,
    /// The backend holding it; `None` for an output that is a user input (read from the pack).
    pub backend: Option<usize>,
    pub tensor: TensorRef,
}

/// A foreign input of a split: `len` bytes from `src` on backend `src_backend` into the
/// split's scratch copy.
#[derive(Clone, Debug)]
struct ForeignCopy {
    src_backend: usize,
    src: (BufferId, usize),
    /// Per copy index.
    dst: Vec<(BufferId, usize)>,
    len: usize,
}

/// A device-side feed armed for the next step: `len` bytes of an output copied, in stream
/// order after the step's input writes, over each arena copy of an input.
#[derive(Clone, Debug)]
struct Feed {
    /// The output's backend and place.
    backend: usize,
    src: (BufferId, usize),
    len: usize,
    /// (split, offset of the input in the split's arena).
    targets: Vec<(usize, usize)>,
}

/// One split, resolved.
struct SplitExec {
    backend: usize,
    /// Per copy index.
    exec: Vec<Arc<ExecGraph>>,
    /// The input arena: buffer, per-copy base offsets, the pack range it mirrors, and each
    /// user input's (offset in the arena, bytes).
    arena: Option<(BufferId, Vec<usize>, std::ops::Range<usize>)>,
    user_inputs: Vec<(usize, usize)>,
    foreign: Vec<ForeignCopy>,
    /// Per copy index, when the backend has events.
    events: Vec<Option<Arc<dyn Event>>>,
}

impl SplitExec {
    fn has_inputs(&self) -> bool {
        !self.user_inputs.is_empty() || !self.foreign.is_empty()
    }
}

/// A graph compiled for a context.
pub struct Plan {
    sched: Arc<Sched>,
    splits: Vec<SplitExec>,
    inputs: Vec<InputSlot>,
    input_index: HashMap<String, usize>,
    outputs: Vec<OutputSlot>,
    output_index: HashMap<String, usize>,
    /// Buffers this plan owns (arenas, outputs): (backend, buffer).
    own_buffers: Vec<(usize, BufferId)>,
    pack: Vec<u8>,
    next_copy: usize,
    /// Feeds resolved so far, by (input, output): a decode loop arms the same one every step.
    resolved_feeds: Vec<(String, String, Feed)>,
    /// Indices into `resolved_feeds` armed by [`Plan::feed`] for the next `compute` only.
    feeds: Vec<usize>,
    n_nodes: usize,
    n_leafs: usize,
    placement: Vec<usize>,
    /// A step has been queued: before that, outputs hold no result to read.
    computed: bool,
}

/// `a + b` for a memory size, or an error naming `what` when it passes [`MAX_BYTES`].
fn add_bytes(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_add(b)
        .filter(|&n| n <= MAX_BYTES)
        .ok_or_else(|| Error::TooLarge(format!("{what} exceed {MAX_BYTES} bytes")))
}

impl Plan {
    /// Compiles `graph` for a single backend (a one-backend context).
    pub fn compile(graph: &Graph, backend: Arc<dyn Backend>, policy: SyncPolicy) -> Result<Plan> {
        Sched::new(vec![backend], policy, 1)?.compile(graph)
    }

    /// The first backend of the plan's context.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.sched.backends()[0]
    }
    /// The context's scheduler.
    pub fn sched(&self) -> &Arc<Sched> {
        &self.sched
    }
    /// The plan's policy.
    pub fn policy(&self) -> SyncPolicy {
        self.sched.policy()
    }
    /// Host-written inputs.
    pub fn inputs(&self) -> &[InputSlot] {
        &self.inputs
    }
    /// Readable outputs.
    pub fn outputs(&self) -> &[OutputSlot] {
        &self.outputs
    }
    /// Node count of the compiled graph (views included).
    pub fn n_nodes(&self) -> usize {
        self.n_nodes
    }
    /// Leaf count of the compiled graph.
    pub fn n_leafs(&self) -> usize {
        self.n_leafs
    }
    /// Number of splits.
    pub fn n_splits(&self) -> usize {
        self.splits.len()
    }
    /// The backend index of each split, in order.
    pub fn split_backends(&self) -> Vec<usize> {
        self.splits.iter().map(|s| s.backend).collect()
    }
    /// The backend index of every tensor of the compiled graph.
    pub fn placement(&self) -> &[usize] {
        &self.placement
    }
    /// The kernels of split `s` for copy `c`.
    pub fn exec_graph(&self, s: usize, c: usize) -> &Arc<ExecGraph> {
        &self.splits[s].exec[c]
    }
    /// The copy index the next `compute` uses.
    pub fn next_copy(&self) -> usize {
        self.next_copy
    }

    /// The input called `name`.
    pub fn input(&self, name: &str) -> Result<&InputSlot> {
        self.input_index
            .get(name)
            .map(|&i| &self.inputs[i])
            .ok_or_else(|| {
                let known: Vec<&str> = self.inputs.iter().map(|s| s.name.as_str()).collect();
                Error::Input(format!("unknown input `{name}` (inputs: {known:?})"))
            })
    }

    /// The output called `name`.
    pub fn output(&self, name: &str) -> Result<&OutputSlot> {
        self.output_index
            .get(name)
            .map(|&i| &self.outputs[i])
            .ok_or_else(|| {
                let known: Vec<&str> = self.outputs.iter().map(|s| s.name.as_str()).collect();
                Error::Input(format!("unknown output `{name}` (outputs: {known:?})"))
            })
    }

    /// Copies an input's bytes (contiguous, row-major, the input's dtype) into the host pack.
    /// The caller may reuse `data` at once.
    pub fn set_input(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let slot = self.input(name)?;
        if data.len() != slot.nbytes {
            return Err(Error::Input(format!(
                "input `{name}` of shape {:?} and dtype {} needs {} bytes, got {}",
                slot.shape,
                slot.dtype,
                slot.nbytes,
                data.len()
            )));
        }
        let (off, n) = (slot.offset, slot.nbytes);
        self.pack[off..off + n].copy_from_slice(data);
        Ok(())
    }

    /// The host pack region of an input, for writing in place (no intermediate copy).
    pub fn input_bytes_mut(&mut self, name: &str) -> Result<&mut [u8]> {
        let slot = self.input(name)?;
        let (off, n) = (slot.offset, slot.nbytes);
        Ok(&mut self.pack[off..off + n])
    }

    /// Resolves a feed of output `output` into input `input`: same dtype and shape, the output
    /// contiguous, and every split that reads the input on the output's backend, which can
    /// copy in stream order.
    fn resolve_feed(&self, input: &str, output: &str) -> Result<Feed> {
        let inp = self.input(input)?;
        let out = self.output(output)?;
        let t = &out.tensor;
        let bad = |why: String| Err(Error::Input(format!("feed `{output}` -> `{input}`: {why}")));
        if t.dtype != inp.dtype || t.shape != inp.shape {
            return bad(format!(
                "the output is {} {:?}, the input {} {:?}",
                t.dtype, t.shape, inp.dtype, inp.shape
            ));
        }
        if !t.is_contiguous() {
            return bad("the output is a strided view".into());
        }
        let Some(b) = out.backend else {
            return bad("the output is a user input, not computed on a device".into());
        };
        let backends = self.sched.backends();
        if !backends[b].caps().copy_async {
            return bad(format!(
                "backend {} has no stream-ordered copies",
                backends[b].name()
            ));
        }
        let mut targets = Vec::new();
        for (s, sp) in self.splits.iter().enumerate() {
            let Some((_, _, range)) = &sp.arena else {
                continue;
            };
            for q in std::iter::once(inp.offset).chain(inp.mirrors.iter().copied()) {
                if range.contains(&q) {
                    // Another device copies the bytes itself, ordered on both streams.
                    if sp.backend != b && !backends[sp.backend].copies_from(&*backends[b]) {
                        return bad(format!(
                            "split {s} reads the input on {}, the output is on {}, and the \
                             first cannot copy from the second on the devices",
                            backends[sp.backend].name(),
                            backends[b].name()
                        ));
                    }
                    targets.push((s, q - range.start));
                }
            }
        }
        if targets.is_empty() {
            return bad("no split reads the input".into());
        }
        Ok(Feed {
            backend: b,
            src: (t.buffer, t.byte_offset),
            len: inp.nbytes,
            targets,
        })
    }

    /// Whether [`Plan::read_async`] is available for output `output`: it is computed on a
    /// backend with single-read waits and is contiguous there.
    pub fn can_read_async(&self, output: &str) -> bool {
        let Ok(slot) = self.output(output) else {
            return false;
        };
        let backends = self.sched.backends();
        slot.backend.is_some_and(|b| backends[b].caps().read_async) && slot.tensor.is_contiguous()
    }

    /// An error for a read of `output` before any step was queued (its memory holds zeros,
    /// which look like a result).
    fn check_computed(&self, output: &str) -> Result<()> {
        if self.computed {
            return Ok(());
        }
        Err(Error::Input(format!(
            "output `{output}` holds no result yet: no compute() of this plan has succeeded"
        )))
    }

    /// Whether [`Plan::feed`] would accept this pair.
    pub fn can_feed(&self, input: &str, output: &str) -> bool {
        self.resolve_feed(input, output).is_ok()
    }

    /// Arms a device-side feed for the next [`Plan::compute`] only: input `input` takes the
    /// bytes output `output` holds when that step starts (what the step queued before it
    /// wrote), copied in stream order after the step's input writes, instead of the host's
    /// bytes. A decode step takes the token the previous step sampled without the host
    /// reading it first, so the host can queue step t+1 before it waits for token t. An input
    /// read on another device than the output's is fed by that device's peer copy
    /// ([`Backend::copies_from`]), so a pipeline of devices takes launch-ahead too.
    pub fn feed(&mut self, input: &str, output: &str) -> Result<()> {
        let known = self
            .resolved_feeds
            .iter()
            .position(|(i, o, _)| i == input && o == output);
        let k = match known {
            Some(k) => k,
            None => {
                let f = self.resolve_feed(input, output)?;
                self.resolved_feeds
                    .push((input.to_string(), output.to_string(), f));
                self.resolved_feeds.len() - 1
            }
        };
        self.feeds.push(k);
        Ok(())
    }

    /// Queues a read of output `output` at the current end of its backend's stream (after the
    /// steps queued so far) and returns it without waiting; its `wait` is the one host wait.
    pub fn read_async(&self, output: &str) -> Result<Box<dyn Readback>> {
        self.check_computed(output)?;
        let (b, t) = self.async_readable(output, "read_async")?;
        Ok(self.sched.backends()[b].read_async(t.buffer, t.byte_offset, t.byte_extent())?)
    }

    /// The backend and tensor of an output [`Plan::read_async`] can read.
    fn async_readable(&self, output: &str, what: &str) -> Result<(usize, TensorRef)> {
        let slot = self.output(output)?;
        let t = &slot.tensor;
        let bad = |why: &str| Err(Error::Input(format!("{what} `{output}`: {why}")));
        let Some(b) = slot.backend else {
            return bad("the output is a user input; get_output reads it without waiting");
        };
        if !t.is_contiguous() {
            return bad("the output is a strided view; use get_output");
        }
        let be = &self.sched.backends()[b];
        if !be.caps().read_async {
            return bad(&format!("backend {} has no single-read waits", be.name()));
        }
        Ok((b, t.clone()))
    }

    /// Queues one step as [`Plan::compute`] does, and a read of output `output` behind it as
    /// [`Plan::read_async`] would after it: the read goes with the last graph of the output's
    /// backend ([`Backend::graph_compute_read_async`]), so a backend may make the step and its
    /// read one submission. Nothing is queued when the output cannot be read this way.
    pub fn compute_read_async(&mut self, output: &str) -> Result<Box<dyn Readback>> {
        let (b, t) = self.async_readable(output, "compute_read_async")?;
        let Some(last) = self.splits.iter().rposition(|sp| sp.backend == b) else {
            self.compute()?;
            return self.read_async(output);
        };
        let rb = self.queue_step(Some((last, &t)))?;
        match rb {
            Some(rb) => Ok(rb),
            None => Err(Error::Input(format!(
                "compute_read_async `{output}`: split {last} queued no read"
            ))),
        }
    }

    /// Queues one step: every split's inputs under the policy, then its graph.
    pub fn compute(&mut self) -> Result<()> {
        self.queue_step(None).map(|_| ())
    }

    /// Queues one step; with `read` = (split, tensor), that split's graph is queued with a read
    /// of the tensor behind it, which is returned.
    fn queue_step(
        &mut self,
        read: Option<(usize, &TensorRef)>,
    ) -> Result<Option<Box<dyn Readback>>> {
        let sched = self.sched.clone();
        let _serial = sched.step_guard();
        let _step = tracing::debug_span!(
            "step",
            policy = sched.policy().name(),
            copy = self.next_copy
        )
        .entered();
        let c = self.next_copy;
        self.next_copy = (c + 1) % self.sched.n_copies();
        let feeds = std::mem::take(&mut self.feeds);
        for slot in &self.inputs {
            for &m in &slot.mirrors {
                self.pack
                    .copy_within(slot.offset..slot.offset + slot.nbytes, m);
            }
        }
        let backends = self.sched.backends();
        let pipelined = self.sched.n_copies() > 1;
        let mut readback = None;
        for s in 0..self.splits.len() {
            let sp = &self.splits[s];
            let be = &*backends[sp.backend];
            let _split = tracing::trace_span!("split", index = s, backend = be.name()).entered();
            let caps = be.caps();
            let policy = match self.sched.policy() {
                SyncPolicy::Staged if caps.set_tensor_async_staged => SyncPolicy::Staged,
                SyncPolicy::Relaxed if caps.set_tensor_async => SyncPolicy::Relaxed,
                _ => SyncPolicy::Stock,
            };
            // W0 (invariant 4): a split with no inputs must not overlap the previous split of
            // another backend.
            if !sp.has_inputs() && s > 0 && self.splits[s - 1].backend != sp.backend {
                let prev = &self.splits[s - 1];
                match (&prev.events[c], policy) {
                    (Some(ev), SyncPolicy::Staged) if caps.events => be.event_wait(ev)?,
                    _ => backends[prev.backend].synchronize()?,
                }
            }
            match policy {
                SyncPolicy::Stock => {
                    if let Some((arena, bases, range)) = &sp.arena {
                        for &(off, bytes) in &sp.user_inputs {
                            // W1: the previous evaluation may still read this copy.
                            match &sp.events[c] {
                                Some(ev) if pipelined => ev.synchronize()?,
                                _ => be.synchronize()?,
                            }
                            // W2: a blocking write.
                            let p = range.start + off;
                            be.set_tensor(*arena, bases[c] + off, &self.pack[p..p + bytes])?;
                        }
                    }
                    for f in &sp.foreign {
                        // W3
                        match &sp.events[c] {
                            Some(ev) if pipelined => be.event_wait(ev)?,
                            _ => be.synchronize()?,
                        }
                        copy_foreign(backends, sp.backend, f, c, CopyFallback::Stock)?;
                    }
                }
                SyncPolicy::Relaxed => {
                    be.synchronize()?;
                    if let Some((arena, bases, range)) = &sp.arena {
                        for &(off, bytes) in &sp.user_inputs {
                            let p = range.start + off;
                            // SAFETY: the pack is neither freed nor written until the
                            // synchronize below returns (`&mut self` is held for the call).
                            unsafe {
                                be.set_tensor_async(
                                    *arena,
                                    bases[c] + off,
                                    self.pack[p..].as_ptr(),
                                    bytes,
                                )?
                            };
                        }
                    }
                    for f in &sp.foreign {
                        copy_foreign(backends, sp.backend, f, c, CopyFallback::Stock)?;
                    }
                    be.synchronize()?;
                }
                SyncPolicy::Staged => {
                    if let Some((arena, bases, range)) = &sp.arena {
                        be.set_tensor_async_staged(*arena, bases[c], &self.pack[range.clone()])?;
                    }
                    for f in &sp.foreign {
                        copy_foreign(backends, sp.backend, f, c, CopyFallback::Staged)?;
                    }
                }
            }
            if let Some((arena, bases, _)) = &sp.arena {
                for f in feeds.iter().map(|&k| &self.resolved_feeds[k].2) {
                    for &(_, off) in f.targets.iter().filter(|(fs, _)| *fs == s) {
                        let dst = (*arena, bases[c] + off);
                        if f.backend == sp.backend {
                            be.copy_async(f.src.0, f.src.1, dst.0, dst.1, f.len)?;
                        } else if !be.cpy_tensor_async(
                            &*backends[f.backend],
                            f.src.0,
                            f.src.1,
                            dst.0,
                            dst.1,
                            f.len,
                        )? {
                            return Err(Error::Input(format!(
                                "feed into split {s}: {} did not copy from {}",
                                be.name(),
                                backends[f.backend].name()
                            )));
                        }
                    }
                }
            }
            match read {
                Some((r, t)) if r == s => {
                    let rb = be.graph_compute_read_async(
                        &sp.exec[c],
                        t.buffer,
                        t.byte_offset,
                        t.byte_extent(),
                    )?;
                    readback = Some(rb);
                }
                _ => be.graph_compute_async(&sp.exec[c])?,
            }
            // Recorded only where a wait takes it: the next split's W0, or W1/W3 of a later
            // step on this copy. A record nobody waits for is not free: on CUDA it launches the
            // copy batch that the read just queued, whose event the wait for an earlier step's
            // read then shares, so under launch-ahead that wait would last until this step ends.
            let waited = pipelined
                || self
                    .splits
                    .get(s + 1)
                    .is_some_and(|n| n.backend != sp.backend && !n.has_inputs());
            if let (Some(ev), true) = (&sp.events[c], waited) {
                be.event_record(ev)?;
            }
        }
        self.computed = true;
        Ok(readback)
    }

    /// Waits for queued work and reads an output as contiguous row-major bytes.
    pub fn get_output(&self, name: &str) -> Result<Vec<u8>> {
        let slot = self.output(name)?;
        self.check_computed(name)?;
        let t = &slot.tensor;
        let esize = t.dtype.size_bytes();
        let what = || format!("reading output `{name}`");
        let mut raw = lowsync_backend::host_zeroed(t.byte_extent(), what)?;
        match slot.backend {
            Some(b) if !raw.is_empty() => {
                self.sched.backends()[b].get_tensor(t.buffer, t.byte_offset, &mut raw)?
            }
            Some(_) => {}
            None => raw.copy_from_slice(&self.pack[t.byte_offset..t.byte_offset + t.byte_extent()]),
        }
        if t.is_contiguous() {
            return Ok(raw);
        }
        // A strided view: gather on the host.
        let n = t.numel();
        let mut out = lowsync_backend::host_zeroed(n.saturating_mul(esize), what)?;
        let mut idx = vec![0usize; t.shape.len()];
        for k in 0..n {
            let src: usize = idx
                .iter()
                .zip(&t.strides)
                .map(|(i, s)| i * s)
                .sum::<usize>()
                * esize;
            out[k * esize..(k + 1) * esize].copy_from_slice(&raw[src..src + esize]);
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < t.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(out)
    }

    /// Waits for all queued work of the context; the next evaluation uses copy 0 again.
    pub fn synchronize(&mut self) -> Result<()> {
        self.sched.synchronize()?;
        self.next_copy = 0;
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum CopyFallback {
    /// W4 sync the source, W5 sync the destination, W6 blocking copy.
    Stock,
    /// One blocking transfer (ordered after the source's queued work), no extra syncs.
    Staged,
}

/// Moves one foreign input into split backend `dst_b`'s copy `c`.
fn copy_foreign(
    backends: &[Arc<dyn Backend>],
    dst_b: usize,
    f: &ForeignCopy,
    c: usize,
    fallback: CopyFallback,
) -> Result<()> {
    let (src_be, dst_be) = (&*backends[f.src_backend], &*backends[dst_b]);
    let (dst, dst_off) = f.dst[c];
    if f.len == 0 {
        return Ok(());
    }
    if dst_be.cpy_tensor_async(src_be, f.src.0, f.src.1, dst, dst_off, f.len)? {
        return Ok(());
    }
    if fallback == CopyFallback::Stock {
        src_be.synchronize()?; // W4
        dst_be.synchronize()?; // W5
    }
    // W6 (or the staged path's single transfer).
    if let Some(p) = dst_be.buffer_host_ptr(dst) {
        let size = dst_be.buffer_size(dst)?;
        if dst_off + f.len > size {
            return Err(lowsync_backend::Error::OutOfBounds {
                buffer: dst.0,
                offset: dst_off,
                len: f.len,
                size,
            }
            .into());
        }
        // SAFETY: in bounds (checked); the destination backend is the synchronous host, so
        // nothing else touches this memory during the call.
        let out = unsafe { std::slice::from_raw_parts_mut(p.as_ptr().add(dst_off), f.len) };
        src_be.get_tensor(f.src.0, f.src.1, out)?;
        return Ok(());
    }
    if let Some(p) = src_be.buffer_host_ptr(f.src.0) {
        let size = src_be.buffer_size(f.src.0)?;
        if f.src.1 + f.len > size {
            return Err(lowsync_backend::Error::OutOfBounds {
                buffer: f.src.0 .0,
                offset: f.src.1,
                len: f.len,
                size,
            }
            .into());
        }
        // SAFETY: in bounds (checked); the source is host memory of a synchronous backend.
        let data = unsafe { std::slice::from_raw_parts(p.as_ptr().add(f.src.1), f.len) };
        return match fallback {
            CopyFallback::Stock => Ok(dst_be.set_tensor(dst, dst_off, data)?),
            CopyFallback::Staged if dst_be.caps().set_tensor_async_staged => {
                Ok(dst_be.set_tensor_async_staged(dst, dst_off, data)?)
            }
            CopyFallback::Staged => Ok(dst_be.set_tensor(dst, dst_off, data)?),
        };
    }
    let mut tmp = vec![0u8; f.len];
    src_be.get_tensor(f.src.0, f.src.1, &mut tmp)?;
    match fallback {
        CopyFallback::Staged if dst_be.caps().set_tensor_async_staged => {
            dst_be.set_tensor_async_staged(dst, dst_off, &tmp)?
        }
        _ => dst_be.set_tensor(dst, dst_off, &tmp)?,
    }
    Ok(())
}

impl Drop for Plan {
    fn drop(&mut self) {
        for (b, id) in &self.own_buffers {
            self.sched.backends()[*b].free_buffer(*id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lowsync_cpu::CpuBackend;

    fn scale_plan(shape: &[usize]) -> Result<Plan> {
        let mut g = Graph::new();
        let x = g.input("x", shape, DType::F32)?;
        let y = g.scale(x, 2.0)?;
        g.output("y", y)?;
        Plan::compile(&g, Arc::new(CpuBackend::new()), SyncPolicy::Staged)
    }

    #[test]
    fn add_bytes_refuses_a_sum_past_the_allocation_limit() {
        assert_eq!(add_bytes(2, 3, "x").unwrap(), 5);
        assert!(add_bytes(MAX_BYTES, 1, "the inputs").is_err());
        assert!(add_bytes(usize::MAX, 1, "the inputs").is_err());
    }

    #[test]
    fn an_output_read_before_any_compute_is_an_error_not_zeros() {
        let mut p = scale_plan(&[2]).unwrap();
        let e = p.get_output("y").unwrap_err();
        assert!(
            matches!(&e, Error::Input(m) if m.contains("no compute() of this plan")),
            "{e}"
        );
        p.set_input("x", &1f32.to_ne_bytes().repeat(2)).unwrap();
        p.compute().unwrap();
        assert_eq!(p.get_output("y").unwrap(), 2f32.to_ne_bytes().repeat(2));
    }

    #[test]
    fn a_huge_input_is_an_error_at_compile() {
        // 2^40 f32 elements: 4 TiB of arena and pack, more than the host has.
        let e = scale_plan(&[1 << 40]).err().expect("refused");
        assert!(e.to_string().contains("out of host memory"), "{e}");
    }

    #[test]
    fn can_read_async_needs_a_backend_with_single_read_waits() {
        let p = scale_plan(&[2]).unwrap();
        assert!(!p.can_read_async("y"), "cpu has no read_async");
        assert!(!p.can_read_async("nope"));
    }
}
