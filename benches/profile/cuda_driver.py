"""The few CUDA driver and NVRTC calls the profiling scripts make, through ctypes.

Why: `attn_kernels.py` and `stream_probe.py` launch kernels of their own (the backend's
attention kernels with phase marks, a plain streaming read) in processes that may have no
lowsync wheel and no CUDA toolkit, only a driver and NVRTC on the loader path. A thin ctypes
layer needs neither a build step nor a Python CUDA package.

Strategy: one `Cuda` object opens device 0's primary context, compiles CUDA C with NVRTC for
the device's own architecture (SASS, no PTX JIT), and offers allocation, copies, launches and a
context-wide synchronize; every driver error becomes a `RuntimeError` naming the call. Kernel
arguments are ctypes scalars built by `pack` from a type string, one letter per parameter, so a
script's argument list can be checked against a kernel's signature without a GPU
(tests/test_bench_scripts.py does).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

I64, I32, F32, PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64


def _lib(name: str) -> ctypes.CDLL:
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        for f in sorted(Path(d or ".").glob(f"{name}.so*")):
            if "builtins" not in f.name:
                return ctypes.CDLL(str(f))
    return ctypes.CDLL(f"{name}.so.1" if name == "libcuda" else f"{name}.so")


def pack(types: str, *vals: Any) -> list[Any]:
    """Kernel arguments from a type string: l i64, i i32, f f32, p pointer."""
    kinds = {"l": I64, "i": I32, "f": F32, "p": PTR}
    return [kinds[t](v) for t, v in zip(types, vals, strict=True)]


class Cuda:
    """Device 0's primary context: NVRTC compilation, memory, launches."""

    def __init__(self) -> None:
        self.cu = _lib("libcuda")
        self.nvrtc = _lib("libnvrtc")
        self.ck(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.ck(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self.ck(
            self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        self.ck(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        attr = {"clock_khz": 13, "sms": 16, "major": 75, "minor": 76}
        vals = {}
        for k, a in attr.items():
            v = ctypes.c_int()
            self.ck(self.cu.cuDeviceGetAttribute(ctypes.byref(v), a, dev), "cuDeviceGetAttribute")
            vals[k] = v.value
        self.mhz = vals["clock_khz"] / 1000
        self.sms = vals["sms"]
        self.arch = f"sm_{vals['major']}{vals['minor']}"

    @staticmethod
    def ck(r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"{what} failed: error {r}")

    def compile(
        self, src: str, name: str, defines: list[str], include_dirs: Sequence[Path] = ()
    ) -> ctypes.c_void_p:
        """A loaded module of `src` built for this device, with `-D` for each of `defines` and
        `#include` searching `include_dirs`."""
        prog = ctypes.c_void_p()
        self.ck(
            self.nvrtc.nvrtcCreateProgram(
                ctypes.byref(prog), src.encode(), name.encode(), 0, None, None
            ),
            "nvrtcCreateProgram",
        )
        opts = [f"--gpu-architecture={self.arch}".encode()]
        opts += [f"-D{d}".encode() for d in defines]
        opts += [f"--include-path={d}".encode() for d in include_dirs]
        r = self.nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        if r != 0:
            self.nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            self.nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC: {name}: {log.value.decode()[:4000]}")
        self.nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        cubin = ctypes.create_string_buffer(n.value)
        self.nvrtc.nvrtcGetCUBIN(prog, cubin)
        mod = ctypes.c_void_p()
        self.ck(self.cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        return mod

    def func(self, mod: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
        f = ctypes.c_void_p()
        self.ck(self.cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
        return f

    def upload(self, a: np.ndarray[Any, Any] | None, nbytes: int = 0) -> int:
        """A device allocation holding `a`, or `nbytes` of zeros when `a` is None."""
        p = ctypes.c_uint64()
        size = a.nbytes if a is not None else nbytes
        n = ctypes.c_size_t(max(size, 16))  # ctypes would pass a bare int as a 32-bit int
        self.ck(self.cu.cuMemAlloc_v2(ctypes.byref(p), n), "cuMemAlloc")
        if a is not None:
            b = np.ascontiguousarray(a).tobytes()
            self.ck(self.cu.cuMemcpyHtoD_v2(p, b, len(b)), "cuMemcpyHtoD")
        else:
            self.ck(self.cu.cuMemsetD8_v2(p, 0, n), "cuMemsetD8")
        return p.value

    def download(self, ptr: int, out: np.ndarray[Any, Any]) -> None:
        self.ck(
            self.cu.cuMemcpyDtoH_v2(
                ctypes.c_void_p(out.ctypes.data), ctypes.c_uint64(ptr), ctypes.c_size_t(out.nbytes)
            ),
            "cuMemcpyDtoH",
        )

    def global_u64(self, mod: ctypes.c_void_p, name: str, n: int) -> np.ndarray[Any, Any]:
        """The first `n` values of the module's `__device__ unsigned long long name[]`."""
        p, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.ck(
            self.cu.cuModuleGetGlobal_v2(ctypes.byref(p), ctypes.byref(size), mod, name.encode()),
            name,
        )
        out = np.zeros(n, np.uint64)
        self.download(p.value, out)
        return out

    def launch(self, f: ctypes.c_void_p, grid: int, block: int, args: list[Any]) -> None:
        ptrs = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args]
        )
        self.ck(
            self.cu.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, None, ptrs, None),
            "cuLaunchKernel",
        )

    def sync(self) -> None:
        self.ck(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")
