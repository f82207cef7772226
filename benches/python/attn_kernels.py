"""Decode attention kernels side by side: `attn_decode` (general), `attn_fast` (short path) and,
for windows past one chunk of keys, `attn_fast_long` (valid keys listed first).

Why: a decoded token waits on each layer's attention, whose time is a chain of latencies (a
memory round trip, barriers, fetching the kernel's instructions), not bytes. Inside the replayed
graph (`kernel_trace.py`) one only sees a kernel's whole time; this script compiles the CUDA
module itself with `PHASE_MARKS` (common.cuh), so the kernels record `clock64()` at their phase
marks (thread 0 of block 0) and every block its `%globaltimer` at entry and exit, and launches
both kernels on the same inputs in one process: warm (back to back) and cold (after a kernel
with 12,000 distinct instructions, which pushes the attention out of the SMs' instruction
caches, as the decode step's other kernels do). Each result is checked against a float64
reference (NMSE), masked K/V rows are NaN, so a kernel that used them would fail.

Needs an NVIDIA GPU, libcuda and libnvrtc (on LD_LIBRARY_PATH); no lowsync wheel. Run:
`python benches/python/attn_kernels.py --windows 72:40,172:100,2048:100`
(each window: cache rows L and valid rows; 32 query heads, 8 KV heads, head size 64, f16 KV).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

KERNELS = Path(__file__).resolve().parents[2] / "crates" / "backend-cuda" / "kernels"
I64, I32, F32, PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64


def _lib(name: str) -> ctypes.CDLL:
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        for f in sorted(Path(d or ".").glob(f"{name}.so*")):
            if "builtins" not in f.name:
                return ctypes.CDLL(str(f))
    return ctypes.CDLL(f"{name}.so.1" if name == "libcuda" else f"{name}.so")


class Cuda:
    """The few driver and NVRTC calls the script needs, through ctypes."""

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

    def compile(self, src: str, name: str, defines: list[str]) -> ctypes.c_void_p:
        prog = ctypes.c_void_p()
        self.ck(
            self.nvrtc.nvrtcCreateProgram(
                ctypes.byref(prog), src.encode(), name.encode(), 0, None, None
            ),
            "nvrtcCreateProgram",
        )
        opts = [f"--gpu-architecture={self.arch}".encode()] + [f"-D{d}".encode() for d in defines]
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


# Device helpers the standalone bench kernels share (grid_barrier.py, ring_decode.py,
# gemv_mma.py): the global timer, a GPU-scope acquire load, a weight load past L1, a shared
# memory address, f16 <-> f32.
DEVICE_HELPERS = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 now() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint4 ldw(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ unsigned sa(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
"""

# The kernels' parameter lists as `pack` type strings (tests/test_bench_scripts.py checks them
# against kernels/fused.cu).
DECODE_TYPES = "llfpillipllliipllliipillipllipllpllpillii"
FAST_TYPES = "iifpiiipiiipiiipiiipiiipiiipiiipiiiii"


def pack(types: str, *vals: Any) -> list[Any]:
    """Kernel arguments from a type string: l i64, i i32, f f32, p pointer."""
    kinds = {"l": I64, "i": I32, "f": F32, "p": PTR}
    return [kinds[t](v) for t, v in zip(types, vals, strict=True)]


def flush_source(n: int) -> str:
    body = "\n".join(f"    x = fmaf(x, {1.0 + i * 1e-7:.9f}f, {i * 1e-6:.8f}f);" for i in range(n))
    head = 'extern "C" __global__ void flush(float* out) {\n    float x = threadIdx.x;\n'
    return head + body + "\n    if (x == 12345.f) out[0] = x;\n}\n"


def run_window(
    cuda: Cuda, mod: ctypes.c_void_p, flush: ctypes.c_void_p, L: int, nvalid: int, reps: int
) -> None:
    hq, hk, d = 32, 8, 64
    rng = np.random.default_rng(0)
    k = rng.standard_normal((L, hk, d)).astype(np.float16)
    v = rng.standard_normal((L, hk, d)).astype(np.float16)
    q = rng.standard_normal((hq, d)).astype(np.float32)
    mask = np.where(np.arange(L) < nvalid, 0.0, -np.inf).astype(np.float32)
    if nvalid > 4:
        mask[3] = -np.inf  # a hole
    bad = mask == -np.inf
    k[bad] = np.nan
    v[bad] = np.nan
    ref = np.zeros((hq, d))
    for h in range(hq):
        kh = h // (hq // hk)
        lg = k[~bad, kh].astype(np.float64) @ q[h].astype(np.float64) * d**-0.5
        pr = np.exp(lg - lg.max())
        ref[h] = (pr / pr.sum()) @ v[~bad, kh].astype(np.float64)
    kc, vc, qd, md = cuda.upload(k), cuda.upload(v), cuda.upload(q), cuda.upload(mask)
    p, o, c = (
        cuda.upload(None, hq * L * 4),
        cuda.upload(None, hq * d * 4),
        cuda.upload(None, hq * d * 4),
    )
    fo = cuda.upload(None, 64)
    ld, div, scale = hk * d, hq // hk, d**-0.5
    # Arguments as the backend passes them (fusion.rs, launch_attention); the copy is [d, hq].
    general = pack(
        DECODE_TYPES,
        *(L, d, scale, qd, 0, d, 1, 1, kc, d, ld, div, 1, 8, vc, d, ld, div, 1, 8),
        *(md, 0, 0, 1, 1, 0, L, 1, 0, p, L, 1, o, d, 1, c, 0, 1, hq, 1, 1),
    )
    # The last two arguments, `rehearse` and `mask_ahead`, are 0: no launch runs ahead of a
    # producer here.
    short = pack(
        FAST_TYPES,
        *(L, d, scale, qd, d, 1, 1, kc, d, ld, div, vc, d, ld, div, md, 0, 1, 1),
        *(0, L, 1, 0, p, L, 1, 0, o, d, 1, 1, c, 1, hq, 1, 0, 0),
    )
    print(f"window {L} rows, {int((~bad).sum())} valid; µs: block 0 | all blocks | phases")
    kernels = [("attn_decode", 9, general), ("attn_fast", 5, short)]
    if L > 256:  # past one chunk of keys (head size 64, f16): the listing path too
        kernels.append(("attn_fast_long", 5, short))
    for name, marks, args in kernels:
        f = cuda.func(mod, name)
        cuda.ck(cuda.cu.cuMemsetD8_v2(ctypes.c_uint64(c), 0, hq * d * 4), "cuMemsetD8")
        for cold in (False, True):
            rows = []
            for _ in range(reps):
                if cold:
                    cuda.launch(flush, cuda.sms * 4, 256, [PTR(fo)])
                cuda.launch(f, hq, 256, args)
                cuda.sync()
                clk = cuda.global_u64(mod, "phase_clk", marks).astype(np.int64)
                g = cuda.global_u64(mod, "phase_g", 2 * hq).astype(np.int64)
                block0 = (clk[-1] - clk[0]) / cuda.mhz
                grid = (g[1::2].max() - g[0::2].min()) / 1e3
                rows.append(np.concatenate([[block0, grid], np.diff(clk) / cuda.mhz]))
            med = np.median(np.array(rows), axis=0)
            phases = " ".join(f"{x:5.2f}" for x in med[2:])
            how = "cold" if cold else "warm"
            print(f"  {name:11s} {how}: {med[0]:6.2f} | {med[1]:6.2f} | {phases}")
        out = np.zeros(hq * d, np.float32)
        cuda.download(c, out)
        got = out.reshape(d, hq).T
        nmse = float(((got - ref) ** 2).sum() / (ref**2).sum())
        print(f"  {name:11s} NMSE against float64: {nmse:.2e}")
        if not nmse < 1e-10:
            raise SystemExit(f"{name}: wrong result (NMSE {nmse:.2e})")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--windows", default="72:40,172:100,2048:100", help="L:valid,...")
    ap.add_argument("--reps", type=int, default=30, help="launches per setting (median)")
    args = ap.parse_args()
    windows = []
    for w in args.windows.split(","):
        L, _, n = w.partition(":")
        if not (L.isdigit() and n.isdigit() and 1 <= int(n) <= int(L)):
            raise SystemExit(f"--windows: {w!r} is not L:valid with 1 <= valid <= L")
        windows.append((int(L), int(n)))
    cuda = Cuda()
    src = (KERNELS / "common.cuh").read_text() + (KERNELS / "fused.cu").read_text()
    t = time.time()
    mod = cuda.compile(src, "fused.cu", ["PHASE_MARKS"])
    flush = cuda.func(cuda.compile(flush_source(12000), "flush.cu", []), "flush")
    print(f"{cuda.arch}, {cuda.sms} SMs, {cuda.mhz:.0f} MHz; compiled in {time.time() - t:.1f} s")
    for L, n in windows:
        run_window(cuda, mod, flush, L, n, args.reps)


if __name__ == "__main__":
    main()
