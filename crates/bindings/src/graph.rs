//! `Graph` and `Tensor`: thin Python objects over the Rust graph builder.

use lowsync_graph::{DType, Graph, RopeMode, TensorId};
use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::borrow;
use crate::convert;
use crate::errors::{graph_err, input_err};
use crate::numpy_io::{array_bytes, block_bytes, parse_dtype};

/// A graph under construction.
#[pyclass(name = "Graph", module = "lowsync._native")]
pub struct PyGraph {
    pub inner: Graph,
}

/// A tensor of a graph (a node or a leaf).
#[pyclass(name = "Tensor", module = "lowsync._native", frozen)]
pub struct PyTensor {
    graph: Py<PyGraph>,
    id: TensorId,
    shape: Vec<usize>,
    dtype: DType,
    name: Option<String>,
}

fn tensor(slf: &Bound<'_, PyGraph>, id: TensorId) -> PyTensor {
    let g = slf.borrow();
    let t = g.inner.tensor(id);
    PyTensor {
        graph: slf.clone().unbind(),
        id,
        shape: t.shape().to_vec(),
        dtype: t.dtype,
        name: t.name.clone(),
    }
}

/// The id of `t`, checking it belongs to `slf`.
fn tid(slf: &Bound<'_, PyGraph>, t: &PyTensor) -> PyResult<TensorId> {
    if !t.graph.is(slf) {
        return Err(input_err("tensor belongs to another graph".into()));
    }
    Ok(t.id)
}

fn op(
    slf: &Bound<'_, PyGraph>,
    f: impl FnOnce(&mut Graph) -> lowsync_graph::Result<TensorId>,
) -> PyResult<PyTensor> {
    let id = f(&mut slf.borrow_mut().inner).map_err(graph_err)?;
    Ok(tensor(slf, id))
}

fn axis(ax: i64, ndim: usize, what: &str) -> PyResult<usize> {
    let n = ndim as i64;
    let a = if ax < 0 { ax + n } else { ax };
    if a < 0 || a >= n {
        return Err(graph_err(lowsync_graph::Error::Shape {
            op: "axis",
            msg: format!("{what} {ax} is out of range for {ndim} axes"),
        }));
    }
    Ok(a as usize)
}

#[pymethods]
impl PyGraph {
    #[new]
    fn new() -> Self {
        PyGraph {
            inner: Graph::new(),
        }
    }

    /// Nodes (views included).
    #[getter]
    fn n_nodes(&self) -> usize {
        self.inner.n_nodes()
    }

    /// Leaves (inputs, weights, persistent tensors).
    #[getter]
    fn n_leafs(&self) -> usize {
        self.inner.n_leafs()
    }

    /// A tensor written by the host every step.
    #[pyo3(signature = (name, shape, dtype = "f32"))]
    fn input(
        slf: &Bound<'_, Self>,
        name: &str,
        shape: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> PyResult<PyTensor> {
        let shape = convert::shape(shape, "input", &format!("`{name}`"))?;
        let dt = parse_dtype(dtype)?;
        op(slf, |g| g.input(name, &shape, dt))
    }

    /// A constant tensor, optionally pinned to a backend. A block (quantized) dtype takes raw
    /// blocks and the logical `shape` (see `numpy_io::block_bytes`). Data that cannot change
    /// (a read-only memory map, `bytes`) is borrowed, anything else copied (`borrow`).
    #[pyo3(signature = (name, data, backend = None, dtype = None, shape = None))]
    fn weight(
        slf: &Bound<'_, Self>,
        name: &str,
        data: &Bound<'_, PyAny>,
        backend: Option<String>,
        dtype: Option<&str>,
        shape: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTensor> {
        let shape = shape
            .map(|s| convert::shape(s, "weight", &format!("`{name}`")))
            .transpose()?;
        if let Some(dt) = dtype
            .map(parse_dtype)
            .transpose()?
            .filter(|d| d.is_quantized())
        {
            let (bytes, shape) = block_bytes(data, dt, shape, name)?;
            return op(slf, |g| g.weight(name, &shape, dt, bytes, backend));
        }
        let arr = data
            .cast::<PyUntypedArray>()
            .map_err(|_| input_err(format!("weight `{name}`: data must be a numpy array")))?;
        if shape.as_deref().is_some_and(|s| s != arr.shape()) {
            return Err(input_err(format!(
                "weight `{name}`: shape {:?} differs from the array's {:?} (only block dtypes \
                 take a logical shape)",
                shape.unwrap_or_default(),
                arr.shape()
            )));
        }
        let shape = arr.shape().to_vec();
        let dt = match dtype {
            Some(d) => parse_dtype(d)?,
            None => crate::numpy_io::dtype_of(arr).ok_or_else(|| {
                input_err(format!(
                    "weight `{name}`: numpy dtype {} is not supported (float32, float16, int32)",
                    arr.dtype().str().map(|s| s.to_string()).unwrap_or_default()
                ))
            })?,
        };
        // Bytes that are already the graph's (same dtype, C order) and cannot change are
        // borrowed; anything else is converted into an owned copy.
        let same = crate::numpy_io::dtype_of(arr) == Some(dt);
        let borrowed = lowsync_graph::tensor_bytes(&shape, dt)
            .filter(|_| same)
            .and_then(|n| borrow::borrow(data, n));
        let bytes = match borrowed {
            Some(b) => b,
            None => array_bytes(arr, dt, name)?.into(),
        };
        op(slf, |g| g.weight(name, &shape, dt, bytes, backend))
    }

    /// Zero-initialised state kept across steps (e.g. a KV cache), optionally pinned to a
    /// backend. Plans of one context share persistent tensors by name.
    #[pyo3(signature = (name, shape, dtype = "f32", backend = None))]
    fn persistent(
        slf: &Bound<'_, Self>,
        name: &str,
        shape: &Bound<'_, PyAny>,
        dtype: &str,
        backend: Option<String>,
    ) -> PyResult<PyTensor> {
        let shape = convert::shape(shape, "persistent", &format!("`{name}`"))?;
        let dt = parse_dtype(dtype)?;
        op(slf, |g| {
            let id = g.persistent(name, &shape, dt)?;
            if let Some(b) = &backend {
                g.pin(id, b)?;
            }
            Ok(id)
        })
    }

    /// Marks `t` as an output readable after a step.
    fn output(slf: &Bound<'_, Self>, name: &str, t: PyRef<'_, PyTensor>) -> PyResult<()> {
        let id = tid(slf, &t)?;
        slf.borrow_mut().inner.output(name, id).map_err(graph_err)
    }

    fn get_rows(
        slf: &Bound<'_, Self>,
        table: PyRef<'_, PyTensor>,
        ids: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (a, b) = (tid(slf, &table)?, tid(slf, &ids)?);
        op(slf, |g| g.get_rows(a, b))
    }
    fn mul_mat(
        slf: &Bound<'_, Self>,
        a: PyRef<'_, PyTensor>,
        b: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (a, b) = (tid(slf, &a)?, tid(slf, &b)?);
        op(slf, |g| g.mul_mat(a, b))
    }
    fn add(
        slf: &Bound<'_, Self>,
        a: PyRef<'_, PyTensor>,
        b: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (a, b) = (tid(slf, &a)?, tid(slf, &b)?);
        op(slf, |g| g.add(a, b))
    }
    fn mul(
        slf: &Bound<'_, Self>,
        a: PyRef<'_, PyTensor>,
        b: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (a, b) = (tid(slf, &a)?, tid(slf, &b)?);
        op(slf, |g| g.mul(a, b))
    }
    fn scale(slf: &Bound<'_, Self>, a: PyRef<'_, PyTensor>, s: f32) -> PyResult<PyTensor> {
        let a = tid(slf, &a)?;
        op(slf, |g| g.scale(a, s))
    }
    #[pyo3(signature = (x, eps = 1e-5))]
    fn rms_norm(slf: &Bound<'_, Self>, x: PyRef<'_, PyTensor>, eps: f32) -> PyResult<PyTensor> {
        let x = tid(slf, &x)?;
        op(slf, |g| g.rms_norm(x, eps))
    }
    #[pyo3(signature = (x, pos, n_dims = None, theta_base = 10000.0, mode = "normal"))]
    fn rope(
        slf: &Bound<'_, Self>,
        x: PyRef<'_, PyTensor>,
        pos: PyRef<'_, PyTensor>,
        n_dims: Option<usize>,
        theta_base: f32,
        mode: &str,
    ) -> PyResult<PyTensor> {
        let mode = match mode {
            "normal" => RopeMode::Normal,
            "neox" => RopeMode::Neox,
            m => {
                return Err(input_err(format!(
                    "rope mode `{m}` is not one of: normal, neox"
                )))
            }
        };
        let n_dims = n_dims.unwrap_or_else(|| x.shape.last().copied().unwrap_or(0));
        let (x, p) = (tid(slf, &x)?, tid(slf, &pos)?);
        op(slf, |g| g.rope(x, p, mode, n_dims, theta_base))
    }
    #[pyo3(signature = (x, mask = None, scale = 1.0))]
    fn soft_max(
        slf: &Bound<'_, Self>,
        x: PyRef<'_, PyTensor>,
        mask: Option<PyRef<'_, PyTensor>>,
        scale: f32,
    ) -> PyResult<PyTensor> {
        let x = tid(slf, &x)?;
        let m = mask.map(|m| tid(slf, &m)).transpose()?;
        op(slf, |g| g.soft_max(x, m, scale))
    }
    fn silu(slf: &Bound<'_, Self>, x: PyRef<'_, PyTensor>) -> PyResult<PyTensor> {
        let x = tid(slf, &x)?;
        op(slf, |g| g.silu(x))
    }
    fn gelu(slf: &Bound<'_, Self>, x: PyRef<'_, PyTensor>) -> PyResult<PyTensor> {
        let x = tid(slf, &x)?;
        op(slf, |g| g.gelu(x))
    }
    fn swiglu(
        slf: &Bound<'_, Self>,
        gate: PyRef<'_, PyTensor>,
        up: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (a, b) = (tid(slf, &gate)?, tid(slf, &up)?);
        op(slf, |g| g.swiglu(a, b))
    }
    fn cpy(slf: &Bound<'_, Self>, x: PyRef<'_, PyTensor>, dtype: &str) -> PyResult<PyTensor> {
        let dt = parse_dtype(dtype)?;
        let x = tid(slf, &x)?;
        op(slf, |g| g.cpy(x, dt))
    }
    fn cont(slf: &Bound<'_, Self>, x: PyRef<'_, PyTensor>) -> PyResult<PyTensor> {
        let x = tid(slf, &x)?;
        op(slf, |g| g.cont(x))
    }
    fn concat(
        slf: &Bound<'_, Self>,
        a: PyRef<'_, PyTensor>,
        b: PyRef<'_, PyTensor>,
        axis: i64,
    ) -> PyResult<PyTensor> {
        let ax = self::axis(axis, a.shape.len(), "axis")?;
        let (a, b) = (tid(slf, &a)?, tid(slf, &b)?);
        op(slf, |g| g.concat(a, b, ax))
    }
    fn set_rows(
        slf: &Bound<'_, Self>,
        dst: PyRef<'_, PyTensor>,
        src: PyRef<'_, PyTensor>,
        idx: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (d, s, i) = (tid(slf, &dst)?, tid(slf, &src)?, tid(slf, &idx)?);
        op(slf, |g| g.set_rows(d, s, i))
    }
    fn argmax(slf: &Bound<'_, Self>, x: PyRef<'_, PyTensor>) -> PyResult<PyTensor> {
        let x = tid(slf, &x)?;
        op(slf, |g| g.argmax(x))
    }
    fn penalize(
        slf: &Bound<'_, Self>,
        logits: PyRef<'_, PyTensor>,
        hist: PyRef<'_, PyTensor>,
        params: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (l, h, p) = (tid(slf, &logits)?, tid(slf, &hist)?, tid(slf, &params)?);
        op(slf, |g| g.penalize(l, h, p))
    }
    fn sample(
        slf: &Bound<'_, Self>,
        logits: PyRef<'_, PyTensor>,
        params: PyRef<'_, PyTensor>,
        key: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (l, p, k) = (tid(slf, &logits)?, tid(slf, &params)?, tid(slf, &key)?);
        op(slf, |g| g.sample(l, p, k))
    }
    fn mul_mat_id(
        slf: &Bound<'_, Self>,
        experts: PyRef<'_, PyTensor>,
        x: PyRef<'_, PyTensor>,
        ids: PyRef<'_, PyTensor>,
        weights: PyRef<'_, PyTensor>,
    ) -> PyResult<PyTensor> {
        let (e, x, i, w) = (
            tid(slf, &experts)?,
            tid(slf, &x)?,
            tid(slf, &ids)?,
            tid(slf, &weights)?,
        );
        op(slf, |g| g.mul_mat_id(e, x, i, w))
    }
    fn reshape(
        slf: &Bound<'_, Self>,
        x: PyRef<'_, PyTensor>,
        shape: &Bound<'_, PyAny>,
    ) -> PyResult<PyTensor> {
        let shape = convert::shape(shape, "reshape", "the result")?;
        let x = tid(slf, &x)?;
        op(slf, |g| g.reshape(x, &shape))
    }
    fn permute(
        slf: &Bound<'_, Self>,
        x: PyRef<'_, PyTensor>,
        axes: Vec<i64>,
    ) -> PyResult<PyTensor> {
        let n = x.shape.len();
        let axes = axes
            .iter()
            .map(|&a| axis(a, n, "axis"))
            .collect::<PyResult<Vec<_>>>()?;
        let x = tid(slf, &x)?;
        op(slf, |g| g.permute(x, &axes))
    }
    #[pyo3(signature = (x, ax0 = -2, ax1 = -1))]
    fn transpose(
        slf: &Bound<'_, Self>,
        x: PyRef<'_, PyTensor>,
        ax0: i64,
        ax1: i64,
    ) -> PyResult<PyTensor> {
        let n = x.shape.len();
        let (a0, a1) = (axis(ax0, n, "ax0")?, axis(ax1, n, "ax1")?);
        let x = tid(slf, &x)?;
        op(slf, |g| g.transpose(x, a0, a1))
    }
    fn slice(
        slf: &Bound<'_, Self>,
        x: PyRef<'_, PyTensor>,
        axis: i64,
        start: usize,
        stop: usize,
    ) -> PyResult<PyTensor> {
        let ax = self::axis(axis, x.shape.len(), "axis")?;
        let x = tid(slf, &x)?;
        op(slf, |g| g.slice(x, ax, start, stop))
    }

    fn __repr__(&self) -> String {
        format!(
            "Graph(n_nodes={}, n_leafs={}, outputs={})",
            self.inner.n_nodes(),
            self.inner.n_leafs(),
            self.inner.outputs().len()
        )
    }
}

impl PyTensor {
    fn graph<'py>(&self, py: Python<'py>) -> Bound<'py, PyGraph> {
        self.graph.bind(py).clone()
    }
}

#[pymethods]
impl PyTensor {
    /// Shape in numpy order.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }
    /// `f32`, `f16`, `bf16` or `i32`.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }
    #[getter]
    fn name(&self) -> Option<String> {
        self.name.clone()
    }
    /// The tensor's index in its graph.
    #[getter]
    fn id(&self) -> u32 {
        self.id.0
    }
    /// The last two axes swapped.
    #[getter(T)]
    fn transposed(slf: PyRef<'_, Self>) -> PyResult<PyTensor> {
        let g = slf.graph(slf.py());
        let n = slf.shape.len();
        if n < 2 {
            return Err(graph_err(lowsync_graph::Error::Shape {
                op: "transpose",
                msg: format!(".T needs 2 or more axes, got {:?}", slf.shape),
            }));
        }
        let x = slf.id;
        op(&g, |gr| gr.transpose(x, n - 2, n - 1))
    }
    fn __matmul__(slf: PyRef<'_, Self>, other: PyRef<'_, PyTensor>) -> PyResult<PyTensor> {
        let g = slf.graph(slf.py());
        let (a, b) = (tid(&g, &slf)?, tid(&g, &other)?);
        op(&g, |gr| gr.mul_mat(a, b))
    }
    fn __add__(slf: PyRef<'_, Self>, other: PyRef<'_, PyTensor>) -> PyResult<PyTensor> {
        let g = slf.graph(slf.py());
        let (a, b) = (tid(&g, &slf)?, tid(&g, &other)?);
        op(&g, |gr| gr.add(a, b))
    }
    fn __mul__(slf: PyRef<'_, Self>, other: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        let g = slf.graph(slf.py());
        let a = tid(&g, &slf)?;
        if let Ok(t) = other.cast::<PyTensor>() {
            let b = tid(&g, &t.borrow())?;
            return op(&g, |gr| gr.mul(a, b));
        }
        let s: f32 = other
            .extract()
            .map_err(|_| input_err("a Tensor can be multiplied by a Tensor or a number".into()))?;
        op(&g, |gr| gr.scale(a, s))
    }
    fn __rmul__(slf: PyRef<'_, Self>, other: f32) -> PyResult<PyTensor> {
        let g = slf.graph(slf.py());
        let a = tid(&g, &slf)?;
        op(&g, |gr| gr.scale(a, other))
    }
    fn __repr__(&self) -> String {
        match &self.name {
            Some(n) => format!(
                "Tensor(name={n:?}, shape={:?}, dtype={})",
                self.shape, self.dtype
            ),
            None => format!(
                "Tensor(id={}, shape={:?}, dtype={})",
                self.id.0, self.shape, self.dtype
            ),
        }
    }
}
