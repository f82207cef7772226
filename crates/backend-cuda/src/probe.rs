//! Probing the CUDA libraries without panicking.
//!
//! Why: cudarc loads libcuda, libnvrtc and libcublas with `dlopen` on first use and panics when
//! a library or a symbol is missing. lowsync must build and import on machines without CUDA and
//! answer "CUDA unavailable: ..." there, so nothing may reach cudarc's loader before a probe.
//!
//! Strategy: first `is_culib_present` (it only tries `dlopen`), then every driver symbol the
//! backend calls is looked up in the loaded library, so an old driver is a clear error at
//! `create` instead of a panic in the middle of a step; `catch_unwind` wraps all of it as the
//! last resort. NVRTC and cuBLAS are probed the same way the first time a kernel or a matmul
//! needs them.
//!
//! Invariant: every function here returns `Err`/`false`, never unwinds into the caller.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::{result, sys};

/// Driver symbols the backend calls (the names cudarc's loader asks for).
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamWaitValue32_v2",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemGetInfo_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuDeviceCanAccessPeer",
    "cuCtxEnablePeerAccess",
    "cuMemsetD8Async",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuEventElapsedTime_v2",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Runs `f`, turning a panic (a missing library or symbol in cudarc's loader) into `Err`.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("{what} failed inside the CUDA loader: {msg}"))
        }
    }
}

/// Loads libcuda, checks its symbols and initialises the driver. `Err` says why CUDA is not
/// usable, in words a user can act on.
pub(crate) fn driver() -> Result<(), String> {
    guarded("probing libcuda", || {
        // SAFETY: only tries to dlopen the candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "libcuda (the NVIDIA driver library) was not found; install the NVIDIA driver \
                 or add its folder to LD_LIBRARY_PATH"
                    .into(),
            );
        }
        // SAFETY: the library is present (checked above); `get` only looks symbols up.
        let lib = unsafe { sys::culib() };
        let missing: Vec<&str> = DRIVER_SYMBOLS
            .iter()
            .copied()
            // SAFETY: a symbol lookup; the pointer is not called.
            .filter(|s| unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err())
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "the NVIDIA driver is too old: libcuda lacks {}",
                missing.join(", ")
            ));
        }
        result::init().map_err(|e| format!("cuInit failed: {e:?}"))
    })
}

/// Number of CUDA devices (after [`driver`] succeeded).
pub(crate) fn device_count() -> Result<usize, String> {
    guarded("counting CUDA devices", || {
        result::device::get_count()
            .map(|n| n.max(0) as usize)
            .map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))
    })
}

/// Checks that libnvrtc is loadable and has what kernel compilation calls.
pub(crate) fn nvrtc() -> Result<(), String> {
    use cudarc::nvrtc::sys as nv;
    guarded("probing libnvrtc", || {
        // SAFETY: dlopen attempts only.
        if !unsafe { nv::is_culib_present() } {
            return Err(
                "libnvrtc (the CUDA runtime compiler) was not found; add the folder of \
                 libnvrtc.so.13 (a CUDA toolkit's lib64, or the nvidia/cu13/lib folder of the \
                 Python `nvidia-cuda-nvrtc` package) to LD_LIBRARY_PATH"
                    .into(),
            );
        }
        // SAFETY: present (checked above); lookups only.
        let lib = unsafe { nv::culib() };
        for s in [
            "nvrtcCreateProgram",
            "nvrtcCompileProgram",
            "nvrtcDestroyProgram",
            "nvrtcGetProgramLogSize",
            "nvrtcGetProgramLog",
            "nvrtcGetCUBINSize",
            "nvrtcGetCUBIN",
            "nvrtcVersion",
        ] {
            // SAFETY: a symbol lookup.
            if unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err() {
                return Err(format!("libnvrtc lacks {s}"));
            }
        }
        Ok(())
    })
}

/// Checks that libcublas is loadable and has what matmul calls.
pub(crate) fn cublas() -> Result<(), String> {
    use cudarc::cublas::sys as cb;
    guarded("probing libcublas", || {
        // SAFETY: dlopen attempts only.
        if !unsafe { cb::is_culib_present() } {
            return Err(
                "libcublas was not found; add the folder of libcublas.so.13 (a CUDA toolkit's \
                 lib64, or the nvidia/cu13/lib folder of the Python `nvidia-cublas` package) to \
                 LD_LIBRARY_PATH"
                    .into(),
            );
        }
        // SAFETY: present; lookups only.
        let lib = unsafe { cb::culib() };
        for s in [
            "cublasCreate_v2",
            "cublasDestroy_v2",
            "cublasSetStream_v2",
            "cublasGemmStridedBatchedEx",
        ] {
            // SAFETY: a symbol lookup.
            if unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err() {
                return Err(format!("libcublas lacks {s}"));
            }
        }
        Ok(())
    })
}
