//! A compiled plan: one graph placed on one backend, allocated once, run step after step.
//!
//! Why: graph reuse (ARCHITECTURE §4.5) — a graph of a given shape is placed, allocated and
//! resolved to buffers once; a step then only writes inputs, queues the kernels and, when the
//! caller asks, reads outputs.
//!
//! Strategy: compile checks every op against the backend, plans memory ([`AllocPlan`]),
//! allocates four buffers (weights, persistent state, the input arena, compute), uploads the
//! weights, and resolves every compute node to buffer offsets ([`ExecGraph`]). The host keeps a
//! pack buffer that mirrors the input arena; `set_input` copies the caller's bytes into it (the
//! one host-side copy). `compute` feeds the arena under the plan's [`SyncPolicy`]:
//! - `stock`: per input, `synchronize` then a blocking `set_tensor` (ggml's W1 + W2);
//! - `relaxed`: `synchronize`, one `set_tensor_async` per input, `synchronize` (saaasg);
//! - `staged`: one `set_tensor_async_staged` of the whole arena, no host wait.
//!
//! A backend without the capability a policy needs gets the stock path (invariant 5).
//!
//! Invariants: the caller may overwrite its input buffer as soon as `set_input` returns, and
//! the pack as soon as `compute` returns (staged: copied by the backend; relaxed: the second
//! synchronize; stock: blocking writes) — invariant 1.

use std::collections::HashMap;
use std::sync::Arc;

use lowsync_backend::{Backend, BufferId, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_graph::{DType, Graph, TensorId};

use crate::alloc::{AllocPlan, Region};
use crate::error::{Error, Result};
use crate::policy::SyncPolicy;

/// A host-written input of a plan.
#[derive(Clone, Debug)]
pub struct InputSlot {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte offset in the input arena (and the host pack).
    pub offset: usize,
    pub nbytes: usize,
}

/// A readable output of a plan.
#[derive(Clone, Debug)]
pub struct OutputSlot {
    pub name: String,
    pub tensor: TensorRef,
}

/// A graph compiled for one backend.
pub struct Plan {
    backend: Arc<dyn Backend>,
    policy: SyncPolicy,
    exec: Arc<ExecGraph>,
    inputs: Vec<InputSlot>,
    input_index: HashMap<String, usize>,
    outputs: Vec<OutputSlot>,
    output_index: HashMap<String, usize>,
    buffers: Vec<BufferId>,
    arena: Option<BufferId>,
    /// Host mirror of the input arena.
    pack: Vec<u8>,
    n_nodes: usize,
    n_leafs: usize,
}

fn region_usage(r: Region) -> BufferUsage {
    match r {
        Region::Weights => BufferUsage::Weights,
        Region::Persistent => BufferUsage::Persistent,
        Region::Inputs => BufferUsage::Inputs,
        Region::Compute => BufferUsage::Compute,
    }
}

fn node_name(g: &Graph, id: TensorId) -> String {
    let t = g.tensor(id);
    t.name
        .clone()
        .unwrap_or_else(|| format!("{}#{}", t.op.name(), id.0))
}

/// Checks that `backend` runs every op of `graph`; the error names the first op it cannot.
pub fn check_support(graph: &Graph, backend: &dyn Backend) -> Result<()> {
    for (i, t) in graph.tensors().iter().enumerate() {
        let srcs: Vec<DType> = t.srcs.iter().map(|s| graph.tensor(*s).dtype).collect();
        if !backend.supports_op(&t.op, t.dtype, &srcs) {
            return Err(Error::NoBackend {
                op: t.op.name(),
                node: node_name(graph, TensorId(i as u32)),
                dtype: t.dtype,
                srcs: format!("{srcs:?}"),
                backends: backend.name().to_string(),
            });
        }
    }
    Ok(())
}

impl Plan {
    /// Compiles `graph` for `backend`: checks ops, plans and allocates memory, uploads weights.
    pub fn compile(graph: &Graph, backend: Arc<dyn Backend>, policy: SyncPolicy) -> Result<Plan> {
        if graph.outputs().is_empty() {
            return Err(lowsync_graph::Error::NoOutputs.into());
        }
        check_support(graph, &*backend)?;
        let alloc = AllocPlan::plan(graph);
        let regions = [
            (Region::Weights, alloc.weights_bytes),
            (Region::Persistent, alloc.persistent_bytes),
            (Region::Inputs, alloc.inputs_bytes),
            (Region::Compute, alloc.compute_bytes),
        ];
        let mut buffers = Vec::new();
        let mut region_buf: HashMap<Region, BufferId> = HashMap::new();
        let used = |r: Region| alloc.slots.iter().flatten().any(|(region, _)| *region == r);
        for (r, bytes) in regions {
            // A region holding only empty tensors still gets a (minimal) buffer to point at.
            if bytes > 0 || used(r) {
                let id = backend.alloc_buffer(bytes, region_usage(r))?;
                buffers.push(id);
                region_buf.insert(r, id);
            }
        }
        let mut plan = Plan {
            backend,
            policy,
            exec: Arc::new(ExecGraph::default()),
            inputs: Vec::new(),
            input_index: HashMap::new(),
            outputs: Vec::new(),
            output_index: HashMap::new(),
            buffers,
            arena: region_buf.get(&Region::Inputs).copied(),
            pack: vec![0; alloc.inputs_bytes],
            n_nodes: graph.n_nodes(),
            n_leafs: graph.n_leafs(),
        };
        let tref = |id: TensorId| -> TensorRef {
            let t = graph.tensor(id);
            let (region, off) = alloc.slots[t.root.index()].expect("every root is planned");
            TensorRef {
                buffer: region_buf[&region],
                byte_offset: off + t.layout.offset * t.dtype.size_bytes(),
                dtype: t.dtype,
                shape: t.layout.shape.clone(),
                strides: t.layout.strides.clone(),
            }
        };
        let mut nodes = Vec::new();
        for (i, t) in graph.tensors().iter().enumerate() {
            if t.op.is_leaf() || t.op.is_view() {
                continue;
            }
            let id = TensorId(i as u32);
            nodes.push(ExecNode {
                op: t.op,
                name: node_name(graph, id),
                dst: tref(id),
                srcs: t.srcs.iter().map(|s| tref(*s)).collect(),
            });
        }
        plan.exec = Arc::new(ExecGraph { nodes });
        for (id, t) in graph.inputs() {
            let r = tref(id);
            plan.input_index
                .insert(t.name.clone().unwrap_or_default(), plan.inputs.len());
            plan.inputs.push(InputSlot {
                name: t.name.clone().unwrap_or_default(),
                dtype: t.dtype,
                shape: t.layout.shape.clone(),
                offset: r.byte_offset,
                nbytes: t.nbytes(),
            });
        }
        for (name, id) in graph.outputs() {
            plan.output_index.insert(name.clone(), plan.outputs.len());
            plan.outputs.push(OutputSlot {
                name: name.clone(),
                tensor: tref(*id),
            });
        }
        for (id, w) in graph.weights() {
            let r = tref(*id);
            plan.backend.set_tensor(r.buffer, r.byte_offset, &w.bytes)?;
        }
        Ok(plan)
    }

    /// The backend the plan runs on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    /// The plan's policy.
    pub fn policy(&self) -> SyncPolicy {
        self.policy
    }
    /// The resolved kernels.
    pub fn exec_graph(&self) -> &Arc<ExecGraph> {
        &self.exec
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

    /// Queues one step: feeds the inputs under the policy, then the graph.
    pub fn compute(&mut self) -> Result<()> {
        let caps = self.backend.caps();
        let be = &*self.backend;
        if let Some(arena) = self.arena {
            match self.policy {
                SyncPolicy::Staged if caps.set_tensor_async_staged => {
                    be.set_tensor_async_staged(arena, 0, &self.pack)?;
                }
                SyncPolicy::Relaxed if caps.set_tensor_async => {
                    be.synchronize()?;
                    for s in &self.inputs {
                        // SAFETY: the pack is neither freed nor written until the synchronize
                        // below returns (`&mut self` is held for the whole call).
                        unsafe {
                            be.set_tensor_async(
                                arena,
                                s.offset,
                                self.pack[s.offset..].as_ptr(),
                                s.nbytes,
                            )?
                        };
                    }
                    be.synchronize()?;
                }
                _ => {
                    for s in &self.inputs {
                        be.synchronize()?;
                        be.set_tensor(arena, s.offset, &self.pack[s.offset..s.offset + s.nbytes])?;
                    }
                }
            }
        }
        be.graph_compute_async(&self.exec)?;
        Ok(())
    }

    /// Waits for queued work and reads an output as contiguous row-major bytes.
    pub fn get_output(&self, name: &str) -> Result<Vec<u8>> {
        let t = &self.output(name)?.tensor;
        let esize = t.dtype.size_bytes();
        let mut raw = vec![0u8; t.byte_extent()];
        if !raw.is_empty() {
            self.backend.get_tensor(t.buffer, t.byte_offset, &mut raw)?;
        }
        if t.is_contiguous() {
            return Ok(raw);
        }
        // A strided view: gather on the host.
        let n = t.numel();
        let mut out = vec![0u8; n * esize];
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

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.backend.synchronize()?)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        for b in &self.buffers {
            self.backend.free_buffer(*b);
        }
    }
}
