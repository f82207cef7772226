//! Argument conversions whose PyO3 defaults give internal messages (`OverflowError: can't
//! convert negative int to unsigned`, "Can't extract `str` to `Vec`") instead of saying which
//! argument, and which dim, was wrong.

use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::errors::{graph_err, input_err};

/// Why `v` is not a size: negative, too large, or not an integer; `None` when it is one.
fn not_a_size(v: &Bound<'_, PyAny>) -> Option<String> {
    if v.extract::<usize>().is_ok() {
        return None;
    }
    let repr = v
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    Some(match v.extract::<i64>() {
        Ok(n) if n < 0 => format!("{repr}, which is negative"),
        _ if v.is_instance_of::<PyInt>() => format!("{repr}, more than {}", usize::MAX),
        _ => format!("{repr}, which is not an integer"),
    })
}

/// A count argument (`n_copies`): a non-negative integer, else an `InputError` naming `what`.
pub fn count(v: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    match not_a_size(v) {
        None => v.extract::<usize>(),
        Some(why) => Err(input_err(format!(
            "{what} must be an integer >= 0, got {why}"
        ))),
    }
}

/// A shape argument of `op` for tensor `name`: a sequence of integers >= 0, else a
/// `GraphError` naming the dim.
pub fn shape(v: &Bound<'_, PyAny>, op: &'static str, name: &str) -> PyResult<Vec<usize>> {
    let bad = |msg: String| graph_err(lowsync_graph::Error::Shape { op, msg });
    if v.extract::<String>().is_ok() {
        return Err(bad(format!(
            "the shape of {name} must be a sequence of integers, got a str"
        )));
    }
    let items = v.try_iter().map_err(|_| {
        bad(format!(
            "the shape of {name} must be a sequence of integers, got {}",
            v.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let mut out = Vec::new();
    for (i, item) in items.enumerate() {
        let item = item?;
        if let Some(why) = not_a_size(&item) {
            return Err(bad(format!(
                "dim {i} of the shape of {name} is {why}; dims are integers >= 0"
            )));
        }
        out.push(item.extract::<usize>()?);
    }
    Ok(out)
}

/// The backend names of `Context(backends=...)`: one name, or a sequence of names.
pub fn backend_names(b: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if let Ok(s) = b.extract::<String>() {
        return Ok(vec![s]);
    }
    b.extract::<Vec<String>>().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "Context: backends must be a backend name or a list of names (e.g. [\"cpu\"]), got {}",
            b.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })
}
