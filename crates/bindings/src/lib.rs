//! lowsync-bindings: the `lowsync._native` Python module.
//!
//! Why: users script lowsync from Python; this crate is the translation layer and nothing
//! more — no scheduling decisions live here (STYLE.md: bindings hold no logic).
//!
//! Strategy: one error mapping (`errors`), one GIL-release helper (`detach`), one backend
//! registry (`registry`), numpy conversion in `numpy_io`. `Context`, `Plan`, `Graph` and
//! `Tensor` are thin wrappers over the scheduler and graph crates.

mod borrow;
mod convert;
mod detach;
mod errors;
mod graph;
mod numpy_io;
mod registry;

use std::sync::Arc;

use lowsync_backend::{Backend, Readback, StatsSnapshot};
use lowsync_graph::DType;
use lowsync_scheduler::{Plan, Sched, SyncPolicy};
use numpy::{PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{backend_err, input_err, sched_err};
use crate::graph::{PyGraph, PyTensor};

/// Backends (in priority order), a sync policy, and the memory their plans share.
#[pyclass(name = "Context", module = "lowsync._native", frozen)]
struct PyContext {
    sched: Arc<Sched>,
}

fn stats_dict<'py>(py: Python<'py>, s: &StatsSnapshot) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in s.fields() {
        d.set_item(k, v)?;
    }
    Ok(d)
}

#[pymethods]
impl PyContext {
    #[new]
    #[pyo3(signature = (backends = None, policy = None, n_copies = None))]
    fn new(
        backends: Option<&Bound<'_, PyAny>>,
        policy: Option<&str>,
        n_copies: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let backends = match backends {
            None => vec!["cpu".to_string()],
            Some(b) => convert::backend_names(b)?,
        };
        let n_copies = match n_copies {
            None => 1,
            Some(n) => convert::count(n, "Context: n_copies")?,
        };
        let policy = match policy {
            Some(p) => p.parse::<SyncPolicy>().map_err(sched_err)?,
            None => SyncPolicy::from_env().map_err(sched_err)?,
        };
        if backends.is_empty() {
            return Err(input_err("a Context needs at least one backend".into()));
        }
        let mut list: Vec<Arc<dyn Backend>> = Vec::new();
        for name in &backends {
            if list.iter().any(|b| b.name() == name) {
                return Err(input_err(format!("backend `{name}` is listed twice")));
            }
            list.push(registry::make_backend(name).map_err(backend_err)?);
        }
        let sched = Sched::new(list, policy, n_copies).map_err(sched_err)?;
        Ok(PyContext { sched })
    }

    /// Backend names in priority order.
    #[getter]
    fn backends(&self) -> Vec<String> {
        self.sched
            .backends()
            .iter()
            .map(|b| b.name().to_string())
            .collect()
    }

    /// The sync policy of plans compiled here.
    #[getter]
    fn policy(&self) -> &'static str {
        self.sched.policy().name()
    }

    /// Input copies per split (more than one pipelines successive evaluations).
    #[getter]
    fn n_copies(&self) -> usize {
        self.sched.n_copies()
    }

    /// Places, splits and allocates a graph once; returns a plan to run step after step.
    fn compile(&self, py: Python<'_>, graph: PyRef<'_, PyGraph>) -> PyResult<PyPlan> {
        let (sched, g) = (&self.sched, &graph.inner);
        let plan = detach::run(py, || sched.compile(g), sched_err)?;
        Ok(PyPlan { inner: plan })
    }

    /// Reserves memory for `graph` as the worst case (never shrinking an earlier reserve).
    fn reserve(&self, py: Python<'_>, graph: PyRef<'_, PyGraph>) -> PyResult<()> {
        let (sched, g) = (&self.sched, &graph.inner);
        detach::run(py, || sched.reserve(g), sched_err)
    }

    /// Counters per backend and their total: `{"total": {...}, "cpu": {...}}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let mut total = StatsSnapshot::default();
        for b in self.sched.backends() {
            let s = b.stats().snapshot();
            total = total.add(&s);
            out.set_item(b.name(), stats_dict(py, &s)?)?;
        }
        out.set_item("total", stats_dict(py, &total)?)?;
        Ok(out)
    }

    /// The counters summed over the backends, in `stat_names()` order: `stats()["total"]` as
    /// a list, cheap enough to take at every decode step (no dicts, no key strings).
    fn counters(&self) -> Vec<u64> {
        let mut total = StatsSnapshot::default();
        for b in self.sched.backends() {
            total = total.add(&b.stats().snapshot());
        }
        total.fields().into_iter().map(|(_, v)| v).collect()
    }

    /// Whether the context's backends (every one, or the one called `backend`) implement
    /// `op` (an op name such as "mul_mat") with result dtype `dst` over sources `srcs`. The
    /// model builder asks this before it keeps a weight quantized.
    #[pyo3(signature = (op, dst, srcs, backend = None))]
    fn supports(
        &self,
        op: &str,
        dst: &str,
        srcs: Vec<String>,
        backend: Option<&str>,
    ) -> PyResult<bool> {
        let op = lowsync_graph::Op::from_name(op)
            .ok_or_else(|| input_err(format!("supports: unknown op `{op}`")))?;
        let dst = numpy_io::parse_dtype(dst)?;
        let srcs = srcs
            .iter()
            .map(|s| numpy_io::parse_dtype(s))
            .collect::<PyResult<Vec<DType>>>()?;
        let backends = self.sched.backends();
        if let Some(name) = backend {
            if !backends.iter().any(|b| b.name() == name) {
                return Err(input_err(format!(
                    "supports: backend `{name}` is not in this context ({:?})",
                    self.backends()
                )));
            }
        }
        Ok(backends
            .iter()
            .filter(|b| backend.is_none_or(|n| b.name() == n))
            .all(|b| b.supports_op(&op, dst, &srcs)))
    }

    /// Zeroes every counter and forgets the kernel times of `kernel_times()`.
    fn reset_stats(&self) {
        for b in self.sched.backends() {
            b.stats().reset();
            b.reset_kernel_times();
        }
    }

    /// Device time per kernel variant over the steps completed since `reset_stats()`, longest
    /// first: dicts with `backend`, `name`, `count`, `device_ns` and `read_bytes` (bytes the
    /// dispatches bind for reading). Empty unless a backend profiles its dispatches (Vulkan
    /// with `LOWSYNC_VK_PROFILE=1`).
    fn kernel_times<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let mut out = Vec::new();
        for b in self.sched.backends() {
            for t in b.kernel_times() {
                let d = PyDict::new(py);
                d.set_item("backend", b.name())?;
                d.set_item("name", t.name)?;
                d.set_item("count", t.count)?;
                d.set_item("device_ns", t.device_ns)?;
                d.set_item("read_bytes", t.read_bytes)?;
                out.push(d);
            }
        }
        Ok(out)
    }

    /// Waits for all queued work on every backend.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let sched = &self.sched;
        detach::run(py, || sched.synchronize(), sched_err)
    }

    fn __repr__(&self) -> String {
        format!(
            "Context(backends={:?}, policy={:?})",
            self.backends(),
            self.sched.policy().name()
        )
    }
}

/// A graph compiled for a context: write inputs, compute, read outputs.
#[pyclass(name = "Plan", module = "lowsync._native")]
struct PyPlan {
    inner: Plan,
}

#[pymethods]
impl PyPlan {
    /// Copies `data` into the plan's input `name` (one copy; `data` may be reused at once).
    fn set_input(&mut self, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = data
            .cast::<PyUntypedArray>()
            .map_err(|_| input_err(format!("input `{name}`: expected a numpy array")))?;
        let slot = self.inner.input(name).map_err(sched_err)?;
        if arr.shape() != slot.shape.as_slice() {
            return Err(input_err(format!(
                "input `{name}` has shape {:?}, got an array of shape {:?}",
                slot.shape,
                arr.shape()
            )));
        }
        let dt = slot.dtype;
        let dst = self.inner.input_bytes_mut(name).map_err(sched_err)?;
        numpy_io::write_array(arr, dt, dst, "input", name)
    }

    /// Queues one step; returns without waiting where the policy allows.
    fn compute(&mut self, py: Python<'_>) -> PyResult<()> {
        let plan = &mut self.inner;
        detach::run(py, || plan.compute(), sched_err)
    }

    /// Waits for the step and returns output `name` as an owned numpy array.
    fn get_output<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let slot = self.inner.output(name).map_err(sched_err)?;
        let (dt, shape) = (slot.tensor.dtype, slot.tensor.shape.clone());
        let plan = &self.inner;
        let bytes = detach::run(py, || plan.get_output(name), sched_err)?;
        numpy_io::to_array(py, &bytes, dt, &shape)
    }

    /// Arms a device-side feed for the next `compute` only: input `input` takes output
    /// `output`'s bytes as the previous step left them, copied on the device in stream order
    /// (e.g. `feed("tokens", "next")`: the token the last step sampled, unseen by the host).
    fn feed(&mut self, input: &str, output: &str) -> PyResult<()> {
        self.inner.feed(input, output).map_err(sched_err)
    }

    /// Whether `feed(input, output)` would be accepted (same dtype and shape, and the backend
    /// reading the input can copy the output in stream order).
    fn can_feed(&self, input: &str, output: &str) -> bool {
        self.inner.can_feed(input, output)
    }

    /// Whether `read_async(output)` is available for this output.
    fn can_read_async(&self, output: &str) -> bool {
        self.inner.can_read_async(output)
    }

    /// Queues a read of output `output` after the steps queued so far and returns at once; the
    /// returned `PendingOutput.wait()` is the host wait (more steps may be queued before it).
    fn read_async(&self, py: Python<'_>, output: &str) -> PyResult<PendingOutput> {
        let slot = self.inner.output(output).map_err(sched_err)?;
        let (dtype, shape) = (slot.tensor.dtype, slot.tensor.shape.clone());
        let plan = &self.inner;
        let rb = detach::run(py, || plan.read_async(output), sched_err)?;
        Ok(PendingOutput {
            rb: std::sync::Mutex::new(rb),
            dtype,
            shape,
        })
    }

    /// Queues one step (as `compute`) and a read of output `output` behind it (as
    /// `read_async` right after it) and returns the read at once; a backend that can makes the
    /// step and the read one submission. `PendingOutput.wait()` is the host wait.
    fn compute_read_async(&mut self, py: Python<'_>, output: &str) -> PyResult<PendingOutput> {
        let slot = self.inner.output(output).map_err(sched_err)?;
        let (dtype, shape) = (slot.tensor.dtype, slot.tensor.shape.clone());
        let plan = &mut self.inner;
        let rb = detach::run(py, || plan.compute_read_async(output), sched_err)?;
        Ok(PendingOutput {
            rb: std::sync::Mutex::new(rb),
            dtype,
            shape,
        })
    }

    /// Waits for all queued work of the plan's context (the next step uses input copy 0).
    fn synchronize(&mut self, py: Python<'_>) -> PyResult<()> {
        let plan = &mut self.inner;
        detach::run(py, || plan.synchronize(), sched_err)
    }

    /// Number of splits (runs of nodes on one backend).
    #[getter]
    fn n_splits(&self) -> usize {
        self.inner.n_splits()
    }

    /// The backend of each split, in order.
    #[getter]
    fn split_backends(&self) -> Vec<String> {
        let bs = self.inner.sched().backends();
        self.inner
            .split_backends()
            .iter()
            .map(|&b| bs[b].name().to_string())
            .collect()
    }

    #[getter]
    fn inputs(&self) -> Vec<String> {
        self.inner.inputs().iter().map(|s| s.name.clone()).collect()
    }
    #[getter]
    fn outputs(&self) -> Vec<String> {
        self.inner
            .outputs()
            .iter()
            .map(|s| s.name.clone())
            .collect()
    }
    #[getter]
    fn n_nodes(&self) -> usize {
        self.inner.n_nodes()
    }
    #[getter]
    fn n_leafs(&self) -> usize {
        self.inner.n_leafs()
    }
    /// The context's first (highest-priority) backend.
    #[getter]
    fn backend(&self) -> String {
        self.inner.backend().name().to_string()
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy().name()
    }
}

/// An output read queued by `Plan.read_async`.
#[pyclass(name = "PendingOutput", module = "lowsync._native", frozen)]
struct PendingOutput {
    rb: std::sync::Mutex<Box<dyn Readback>>,
    dtype: DType,
    shape: Vec<usize>,
}

#[pymethods]
impl PendingOutput {
    /// Whether the read completed (never waits).
    #[getter]
    fn done(&self) -> bool {
        self.rb.lock().is_ok_and(|rb| rb.is_complete())
    }

    /// Waits for the read (the one host wait; none once waited) and returns the output as an
    /// owned numpy array.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let rb = &self.rb;
        let bytes = detach::run(
            py,
            || -> Result<Vec<u8>, lowsync_backend::Error> {
                let mut rb = rb.lock().map_err(|_| lowsync_backend::Error::Unavailable {
                    backend: "read".into(),
                    reason: "a wait on this read panicked".into(),
                })?;
                Ok(rb.wait()?.to_vec())
            },
            backend_err,
        )?;
        numpy_io::to_array(py, &bytes, self.dtype, &self.shape)
    }
}

/// What the CUDA backend launches for split `split` of `plan` with fusion on, worked out
/// without a device (the plan may be compiled for any backend): one line per launch,
/// `fused <kind> [<member ops>]` or the op of a node run on its own.
#[pyfunction]
#[pyo3(signature = (plan, split = 0))]
fn cuda_fusion_plan(plan: PyRef<'_, PyPlan>, split: usize) -> PyResult<Vec<String>> {
    let p = &plan.inner;
    if split >= p.n_splits() {
        return Err(input_err(format!(
            "split {split} does not exist: the plan has {} split(s)",
            p.n_splits()
        )));
    }
    registry::cuda_fusion_plan(p.exec_graph(split, 0)).map_err(backend_err)
}

/// The f32 values of raw blocks of a block dtype (see `numpy_io::block_bytes` for `data` and
/// `shape`), by the CPU backend's reference dequantization.
#[pyfunction]
#[pyo3(signature = (data, dtype, shape = None))]
fn dequantize<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    dtype: &str,
    shape: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let dt = numpy_io::parse_dtype(dtype)?;
    if !dt.is_quantized() {
        return Err(input_err(format!(
            "dequantize: {dt} is not a block (quantized) dtype"
        )));
    }
    let shape = shape
        .map(|s| convert::shape(s, "dequantize", "the result"))
        .transpose()?;
    let (bytes, shape) = numpy_io::block_bytes(data, dt, shape, "dequantize")?;
    let n = lowsync_graph::tensor_bytes(&shape, dt)
        .filter(|&b| b == bytes.len())
        .map(|_| shape.iter().product::<usize>())
        .ok_or_else(|| {
            input_err(format!(
                "dequantize: {} bytes are not the {dt} blocks of shape {shape:?}",
                bytes.len()
            ))
        })?;
    let mut out: Vec<f32> = Vec::new();
    out.try_reserve_exact(n).map_err(|_| {
        backend_err(lowsync_backend::Error::OutOfMemory {
            device: "host".into(),
            what: format!("{n} dequantized values"),
            bytes: n.saturating_mul(4),
        })
    })?;
    out.resize(n, 0.0);
    let dst = &mut out;
    detach::run(
        py,
        || lowsync_cpu::kernels::dequantize(dt, &bytes, dst),
        |e| input_err(format!("dequantize: {e}")),
    )?;
    Ok(numpy::PyArray1::from_vec(py, out)
        .reshape(shape)?
        .into_any())
}

/// Backends that can be created on this machine.
#[pyfunction]
fn available_backends() -> Vec<String> {
    registry::available()
}

/// The counter names, in the order `stats()` lists them.
#[pyfunction]
fn stat_names() -> Vec<&'static str> {
    StatsSnapshot::NAMES.to_vec()
}

/// The environment flags the Python package reads; they go through the same parser as the
/// core's, so a bad value is the same `EnvError` naming the variable.
const PYTHON_FLAGS: &[&str] = &["LOWSYNC_LAUNCH_AHEAD"];

/// What kind of device backend `name` runs on (`"cpu"`, `"gpu"`, or a Vulkan device's type:
/// `"cpu"` for a software rasteriser, `"discrete_gpu"`, ...), without opening it.
#[pyfunction]
fn device_type(name: &str) -> PyResult<&'static str> {
    registry::device_type(name).map_err(backend_err)
}

/// Reads the `0`/`1` flag `var` (one of the Python package's flags); unset or empty means
/// `default`.
#[pyfunction]
fn env_flag(var: &str, default: bool) -> PyResult<bool> {
    let Some(&name) = PYTHON_FLAGS.iter().find(|n| **n == var) else {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{var} is not a flag the Python package reads (known: {})",
            PYTHON_FLAGS.join(", ")
        )));
    };
    lowsync_backend::env::flag(name, default).map_err(backend_err)
}

/// Sends lowsync's tracing spans and events (per step, per split, per submit) to stderr,
/// filtered like `RUST_LOG` (e.g. `"lowsync_scheduler=debug"`). Once per process.
#[pyfunction]
fn enable_tracing(filter: &str) -> PyResult<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| input_err(format!("bad tracing filter `{filter}`: {e}")))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .try_init()
        .map_err(|e| input_err(format!("tracing is already enabled: {e}")))
}

/// The package version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<PyGraph>()?;
    m.add_class::<PyTensor>()?;
    m.add_class::<PyContext>()?;
    m.add_class::<PyPlan>()?;
    m.add_class::<PendingOutput>()?;
    m.add_function(wrap_pyfunction!(available_backends, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_fusion_plan, m)?)?;
    m.add_function(wrap_pyfunction!(stat_names, m)?)?;
    m.add_function(wrap_pyfunction!(env_flag, m)?)?;
    m.add_function(wrap_pyfunction!(device_type, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(enable_tracing, m)?)?;
    Ok(())
}
