//! numpy <-> bytes: dtype checks, one copy in, owned arrays out.
//!
//! Arrays are read in logical (C, row-major) order whatever their memory layout: a
//! Fortran-ordered, transposed, sliced or broadcast (stride-0) array gives the same bytes as
//! `np.ascontiguousarray` of it. Only a C-contiguous array is copied as one block. Sizes come
//! from the array's shape, not its memory (a broadcast view is small in memory and may be huge
//! logically), so they are checked and allocated fallibly.

use half::{bf16, f16};
use lowsync_graph::{DType, WeightBytes};
use numpy::{
    dtype, Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::{backend_err, graph_err, input_err};

/// Parses a dtype name.
pub fn parse_dtype(s: &str) -> PyResult<DType> {
    s.parse::<DType>().map_err(|e| input_err(e.to_string()))
}

/// The lowsync dtype of a numpy array (float32, float16, int32), if any.
pub fn dtype_of(arr: &Bound<'_, PyUntypedArray>) -> Option<DType> {
    let py = arr.py();
    let d = arr.dtype();
    if d.is_equiv_to(&dtype::<f32>(py)) {
        Some(DType::F32)
    } else if d.is_equiv_to(&dtype::<f16>(py)) {
        Some(DType::F16)
    } else if d.is_equiv_to(&dtype::<i32>(py)) {
        Some(DType::I32)
    } else {
        None
    }
}

/// Copies the elements of `arr` (any layout) into `dst` as `T`'s native bytes; `false` when
/// the array's dtype is not `T`.
fn copy_typed<T: Element + bytemuck::Pod>(
    arr: &Bound<'_, PyUntypedArray>,
    dst: &mut [u8],
) -> PyResult<bool> {
    let Ok(typed) = arr.cast::<PyArrayDyn<T>>() else {
        return Ok(false);
    };
    let ro = typed.try_readonly().map_err(|e| input_err(e.to_string()))?;
    // `as_slice` also accepts a Fortran-contiguous array, whose memory order is not C order.
    match ro.as_slice().ok().filter(|_| ro.is_c_contiguous()) {
        Some(s) => dst.copy_from_slice(bytemuck::cast_slice(s)),
        None => {
            let size = std::mem::size_of::<T>();
            for (chunk, v) in dst.chunks_exact_mut(size).zip(ro.as_array().iter()) {
                chunk.copy_from_slice(bytemuck::bytes_of(v));
            }
        }
    }
    Ok(true)
}

/// Copies float32 elements into `dst` as bf16; `false` when the array is not float32.
fn copy_f32_as_bf16(arr: &Bound<'_, PyUntypedArray>, dst: &mut [u8]) -> PyResult<bool> {
    let Ok(typed) = arr.cast::<PyArrayDyn<f32>>() else {
        return Ok(false);
    };
    let ro = typed.try_readonly().map_err(|e| input_err(e.to_string()))?;
    for (chunk, v) in dst.chunks_exact_mut(2).zip(ro.as_array().iter()) {
        chunk.copy_from_slice(&bf16::from_f32(*v).to_ne_bytes());
    }
    Ok(true)
}

/// Writes `arr` into `dst` as `want` elements; the numpy dtype must match (`bf16` takes
/// float32). `kind` and `name` name the tensor in errors. The typed cast is the only dtype check on
/// this per-step path.
pub fn write_array(
    arr: &Bound<'_, PyUntypedArray>,
    want: DType,
    dst: &mut [u8],
    kind: &str,
    name: &str,
) -> PyResult<()> {
    let done = match want {
        DType::F32 => copy_typed::<f32>(arr, dst)?,
        DType::F16 => copy_typed::<f16>(arr, dst)?,
        DType::I32 => copy_typed::<i32>(arr, dst)?,
        DType::BF16 => copy_f32_as_bf16(arr, dst)?,
        q => {
            return Err(input_err(format!(
                "{kind} `{name}` has the block dtype {q}: only weights hold blocks \
                 (Graph.weight with raw bytes)"
            )))
        }
    };
    if done {
        return Ok(());
    }
    let numpy_name = arr.dtype().str().map(|s| s.to_string()).unwrap_or_default();
    Err(input_err(format!(
        "{kind} `{name}` has dtype {want}, which takes numpy {}; got {numpy_name}",
        match want {
            DType::F32 | DType::BF16 => "float32",
            DType::F16 => "float16",
            DType::I32 => "int32",
            _ => "uint8 blocks",
        }
    )))
}

/// The bytes of a weight array converted to `dt`; an array too large for its shape to be
/// addressed is a `GraphError`, one the host cannot hold a `BackendError` (never an abort).
pub fn array_bytes(arr: &Bound<'_, PyUntypedArray>, dt: DType, name: &str) -> PyResult<Vec<u8>> {
    let shape = arr.shape();
    let Some(n) = lowsync_graph::tensor_bytes(shape, dt) else {
        return Err(graph_err(lowsync_graph::Error::Shape {
            op: "weight",
            msg: format!("`{name}` of shape {shape:?} ({dt}) is too large to address"),
        }));
    };
    let mut out =
        lowsync_backend::host_zeroed(n, || format!("weight `{name}` of shape {shape:?} ({dt})"))
            .map_err(backend_err)?;
    write_array(arr, dt, &mut out, "weight", name)?;
    Ok(out)
}

/// An owned numpy array from row-major bytes (bf16 comes back as float32).
pub fn to_array<'py>(
    py: Python<'py>,
    bytes: &[u8],
    dt: DType,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    fn build<'py, T: Element + bytemuck::Pod>(
        py: Python<'py>,
        bytes: &[u8],
        shape: &[usize],
    ) -> PyResult<Bound<'py, PyAny>> {
        let v: Vec<T> = bytemuck::pod_collect_to_vec(bytes);
        Ok(numpy::PyArray1::from_vec(py, v).reshape(shape)?.into_any())
    }
    match dt {
        DType::F32 => build::<f32>(py, bytes, shape),
        DType::F16 => build::<f16>(py, bytes, shape),
        DType::I32 => build::<i32>(py, bytes, shape),
        DType::BF16 => {
            let v: Vec<f32> = bytes
                .chunks_exact(2)
                .map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f32())
                .collect();
            Ok(numpy::PyArray1::from_vec(py, v).reshape(shape)?.into_any())
        }
        // The graph builder refuses block-dtype outputs.
        q => Err(input_err(format!(
            "a {q} tensor cannot be read as numpy values"
        ))),
    }
}

/// The raw blocks of a block-dtype weight and its logical shape. `data` is a uint8 numpy array
/// (any layout, read in C order) or any object with a byte buffer (`bytes`, `memoryview`,
/// `bytearray`). The logical shape is `shape` when given; else, for a uint8 array of GGUF's
/// byte shape `[..., row_bytes]`, that shape with its last axis counted in elements. Blocks
/// that cannot change (a read-only map of a GGUF file, `bytes`) are borrowed, not copied.
pub fn block_bytes(
    data: &Bound<'_, PyAny>,
    dt: DType,
    shape: Option<Vec<usize>>,
    name: &str,
) -> PyResult<(WeightBytes, Vec<usize>)> {
    let bad = |msg: String| input_err(format!("weight `{name}` ({dt}): {msg}"));
    let buf = pyo3::buffer::PyBuffer::<u8>::get(data).map_err(|_| {
        let what = data
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let numpy = data
            .cast::<PyUntypedArray>()
            .ok()
            .and_then(|a| a.dtype().str().ok().map(|s| s.to_string()));
        bad(format!(
            "raw blocks must be a uint8 numpy array, bytes or a memoryview of bytes, got {}",
            numpy.map_or(what, |d| format!("a numpy array of dtype {d}"))
        ))
    })?;
    let shape = match shape {
        Some(s) => s,
        None => {
            let byte_shape = buf.shape().to_vec();
            let (bb, bs) = (dt.block_bytes(), dt.block_size());
            match byte_shape.split_last() {
                Some((&row, lead))
                    if buf.dimensions() >= 1
                        && row.is_multiple_of(bb)
                        && data.cast::<PyUntypedArray>().is_ok() =>
                {
                    lead.iter().copied().chain([row / bb * bs]).collect()
                }
                _ => {
                    return Err(bad(format!(
                        "pass `shape=` (the logical shape in elements) with data of byte shape \
                         {byte_shape:?}; only a uint8 array whose last axis is whole {bb}-byte \
                         blocks gives it"
                    )))
                }
            }
        }
    };
    let n = buf.item_count();
    if buf.is_c_contiguous() {
        if let Some(b) = crate::borrow::borrow(data, n) {
            return Ok((b, shape));
        }
    }
    let mut out = lowsync_backend::host_zeroed(n, || format!("weight `{name}` ({n} bytes)"))
        .map_err(backend_err)?;
    buf.copy_to_slice(data.py(), &mut out)?;
    Ok((out.into(), shape))
}
