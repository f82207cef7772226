//! The one mapping from Rust errors to Python exception classes.
//!
//! Each exception is a subclass of `LowsyncError` and, where it helps `except` clauses users
//! already write, of a builtin (`ValueError`, `RuntimeError`).

use lowsync_backend::Error as BackendError;
use lowsync_scheduler::Error as SchedError;
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The exception classes, created once at import.
pub struct Exceptions {
    pub lowsync: Py<PyType>,
    pub graph: Py<PyType>,
    pub input: Py<PyType>,
    pub unknown_backend: Py<PyType>,
    pub env: Py<PyType>,
    pub backend: Py<PyType>,
    pub unsupported: Py<PyType>,
    pub unavailable: Py<PyType>,
    pub realloc: Py<PyType>,
}

static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

fn new_class(py: Python<'_>, name: &str, bases: &[&Py<PyType>], doc: &str) -> PyResult<Py<PyType>> {
    let dict = PyDict::new(py);
    dict.set_item("__module__", "lowsync._native")?;
    dict.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases.iter().map(|b| b.bind(py)))?;
    let ty = py.get_type::<PyType>().call1((name, bases, dict))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

/// The exception classes (created on first use).
pub fn exceptions(py: Python<'_>) -> PyResult<&'static Exceptions> {
    EXCEPTIONS.get_or_try_init(py, || {
        let exc = |t: Bound<'_, PyType>| t.unbind();
        let value_error = exc(py.get_type::<pyo3::exceptions::PyValueError>());
        let runtime_error = exc(py.get_type::<pyo3::exceptions::PyRuntimeError>());
        let exception = exc(py.get_type::<pyo3::exceptions::PyException>());
        let lowsync = new_class(
            py,
            "LowsyncError",
            &[&exception],
            "Base class of every lowsync error.",
        )?;
        let graph = new_class(
            py,
            "GraphError",
            &[&lowsync, &value_error],
            "A shape or dtype error when a node is built.",
        )?;
        let input = new_class(
            py,
            "InputError",
            &[&lowsync, &value_error],
            "A wrong input or output name, shape, dtype or size.",
        )?;
        let unknown_backend = new_class(
            py,
            "UnknownBackendError",
            &[&lowsync, &value_error],
            "A backend name lowsync does not know.",
        )?;
        let env = new_class(
            py,
            "EnvError",
            &[&lowsync, &value_error],
            "A bad value of a LOWSYNC_* environment variable.",
        )?;
        let backend = new_class(
            py,
            "BackendError",
            &[&lowsync, &runtime_error],
            "An error reported by a backend.",
        )?;
        let unsupported = new_class(
            py,
            "UnsupportedError",
            &[&backend],
            "An op or feature a backend does not support.",
        )?;
        let unavailable = new_class(
            py,
            "BackendUnavailableError",
            &[&backend],
            "A backend whose device or library is missing.",
        )?;
        let realloc = new_class(
            py,
            "ReallocError",
            &[&lowsync, &runtime_error],
            "An unexpected graph re-allocation.",
        )?;
        Ok::<_, PyErr>(Exceptions {
            lowsync,
            graph,
            input,
            unknown_backend,
            env,
            backend,
            unsupported,
            unavailable,
            realloc,
        })
    })
}

fn raise(ty: &Py<PyType>, msg: String) -> PyErr {
    Python::attach(|py| PyErr::from_type(ty.bind(py).clone(), msg))
}

/// Converts a backend error.
pub fn backend_err(e: BackendError) -> PyErr {
    let ex = match Python::attach(exceptions) {
        Ok(ex) => ex,
        Err(e) => return e,
    };
    let msg = e.to_string();
    match e {
        BackendError::Interrupted => PyKeyboardInterrupt::new_err(msg),
        BackendError::Unsupported { .. } => raise(&ex.unsupported, msg),
        BackendError::Unavailable { .. } => raise(&ex.unavailable, msg),
        BackendError::UnknownBackend(_) => raise(&ex.unknown_backend, msg),
        BackendError::Env { .. } => raise(&ex.env, msg),
        BackendError::Graph(_) => raise(&ex.graph, msg),
        _ => raise(&ex.backend, msg),
    }
}

/// Converts a scheduler error.
pub fn sched_err(e: SchedError) -> PyErr {
    let ex = match Python::attach(exceptions) {
        Ok(ex) => ex,
        Err(e) => return e,
    };
    let msg = e.to_string();
    match e {
        SchedError::Backend(b) => backend_err(b),
        SchedError::Graph(_) => raise(&ex.graph, msg),
        SchedError::Input(_) | SchedError::UnknownPolicy(_) => raise(&ex.input, msg),
        SchedError::NoBackend { .. } | SchedError::Unsupported(_) => raise(&ex.unsupported, msg),
        SchedError::Placement(_) | SchedError::TooLarge(_) => raise(&ex.graph, msg),
        SchedError::Realloc(_) => raise(&ex.realloc, msg),
    }
}

/// Converts a graph-builder error.
pub fn graph_err(e: lowsync_graph::Error) -> PyErr {
    sched_err(SchedError::Graph(e))
}

/// An `InputError` with `msg`.
pub fn input_err(msg: String) -> PyErr {
    match Python::attach(exceptions) {
        Ok(ex) => raise(&ex.input, msg),
        Err(e) => e,
    }
}

/// Registers the classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let ex = exceptions(py)?;
    for (name, ty) in [
        ("LowsyncError", &ex.lowsync),
        ("GraphError", &ex.graph),
        ("InputError", &ex.input),
        ("UnknownBackendError", &ex.unknown_backend),
        ("EnvError", &ex.env),
        ("BackendError", &ex.backend),
        ("UnsupportedError", &ex.unsupported),
        ("BackendUnavailableError", &ex.unavailable),
        ("ReallocError", &ex.realloc),
    ] {
        m.add(name, ty.bind(py))?;
    }
    Ok(())
}
