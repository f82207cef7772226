//! Weight bytes borrowed from Python objects instead of copied.
//!
//! Why: `load_gguf` hands over the file's tensors as read-only numpy views of one memory map.
//! Copying each into the graph (and a host backend copying it again) kept the weights
//! resident two or three times; borrowing them leaves the file's pages as the only copy.
//!
//! Strategy: `Graph.weight` borrows data whose bytes are already what the graph wants (same
//! dtype, C-contiguous: a Fortran-ordered or strided array is never read as C order) and that
//! cannot change while lowsync reads it: a numpy array every array of whose base chain is
//! read-only and owns no data (an owner could switch `writeable` back on), ending in a `bytes`
//! object or a read-only `mmap.mmap` (what `numpy.memmap(mode="r")` and `numpy.frombuffer`
//! of `bytes` give); or a `bytes` object itself. Anything else is copied, as before. The
//! borrowed bytes hold a reference to the Python object, which keeps the memory alive; it is
//! released without the GIL through PyO3's deferred reference pool, so a backend thread that
//! drops the last handle never waits for the GIL.
//!
//! Invariants: the pointer and length come from the object while the GIL is held and the
//! object is referenced for as long as the bytes are; nothing writes through them. A read-only
//! file map can still change if another process writes the file (as with any mmap loader).

use lowsync_graph::{BorrowedBytes, WeightBytes};
use numpy::npyffi::flags::{NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_WRITEABLE};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;

/// Longest base chain followed (numpy collapses chains; this only bounds a pathological one).
const MAX_BASE_CHAIN: usize = 32;

/// Memory of a Python object, pinned by a reference to it.
struct Pinned {
    _owner: Py<PyAny>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the memory is immutable (checked in `borrow`) and kept alive by `_owner`, which is
// itself `Send + Sync`; reading it from any thread is sound.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl BorrowedBytes for Pinned {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is the object's memory, alive and unchanged while `_owner`
        // is referenced (module invariants).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Whether `obj` is a buffer exporter whose memory can never be written: `bytes`, or an
/// `mmap.mmap` opened read-only.
fn read_only_exporter(obj: &Bound<'_, PyAny>) -> bool {
    if obj.is_exact_instance_of::<PyBytes>() {
        return true;
    }
    let is_mmap = obj
        .get_type()
        .fully_qualified_name()
        .is_ok_and(|n| n == "mmap.mmap");
    is_mmap && PyBuffer::<u8>::get(obj).is_ok_and(|b| b.readonly())
}

/// Whether the memory of `arr` can never change (see the module docs).
fn frozen(arr: &Bound<'_, PyUntypedArray>) -> bool {
    let py = arr.py();
    let mut cur = arr.clone().into_any();
    for _ in 0..MAX_BASE_CHAIN {
        let Ok(a) = cur.cast::<PyUntypedArray>() else {
            return read_only_exporter(&cur);
        };
        let raw = a.as_array_ptr();
        // SAFETY: `a` is a live numpy array; its flags and base are plain fields.
        let (flags, base) = unsafe { ((*raw).flags, (*raw).base) };
        if flags & NPY_ARRAY_WRITEABLE != 0 || base.is_null() {
            return false;
        }
        // SAFETY: `base` is a live object the array holds a reference to.
        cur = unsafe { Bound::from_borrowed_ptr(py, base) };
    }
    false
}

/// `len` bytes of `data` borrowed in place, when `data` is a C-contiguous numpy array of
/// exactly `len` bytes whose memory cannot change, or a `bytes` object of `len` bytes; `None`
/// when it must be copied.
pub fn borrow(data: &Bound<'_, PyAny>, len: usize) -> Option<WeightBytes> {
    let ptr = if let Ok(b) = data.cast::<PyBytes>() {
        let s = b.as_bytes();
        (s.len() == len && data.is_exact_instance_of::<PyBytes>()).then_some(s.as_ptr())?
    } else {
        let arr = data.cast::<PyUntypedArray>().ok()?;
        let raw = arr.as_array_ptr();
        // SAFETY: a live numpy array; flags and data are plain fields.
        let (flags, ptr) = unsafe { ((*raw).flags, (*raw).data) };
        let nbytes = arr.len().checked_mul(arr.dtype().itemsize())?;
        if flags & NPY_ARRAY_C_CONTIGUOUS == 0 || nbytes != len || !frozen(arr) {
            return None;
        }
        ptr.cast::<u8>().cast_const()
    };
    if len == 0 || ptr.is_null() {
        return None;
    }
    Some(WeightBytes::borrowed(Arc::new(Pinned {
        _owner: data.clone().unbind(),
        ptr,
        len,
    })))
}
