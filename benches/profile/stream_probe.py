"""The device's streaming read rate with a kernel of our own: every byte of a buffer read once
with 16-byte streaming loads (`ld.global.cs`), eight in flight per thread, eight 256-thread
blocks per multiprocessor.

Why: the decode bandwidth floor (`benches/python/compare_torch.py`) divides the bytes a
decode step must read by the read bandwidth measured in the same process. A library reduction
(`torch.sum` over a float32 tensor) is one way to measure it, but not the fastest read the
device can do: on an H200 it reads 3.8-4.0 TB/s where this kernel reads 4.4-4.5 TB/s, and a
floor from the slower probe flatters every row measured against it. `compare_torch.py` takes
the best of both.

Needs an NVIDIA GPU, libcuda and libnvrtc (on LD_LIBRARY_PATH); no lowsync wheel. Run:
`python benches/profile/stream_probe.py` (the sweep of loads in flight and blocks per
multiprocessor).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from cuda_driver import I64, PTR, Cuda

SOURCE = r"""
// Q 16-byte streaming loads in flight per thread, consecutive threads on consecutive vectors,
// the whole grid sweeping the buffer.
template <int Q>
__device__ __forceinline__ void sweep(const uint4* w, long long nvec, unsigned* sink) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i0 = first; i0 < nvec; i0 += Q * nth) {
        uint4 q[Q];
#pragma unroll
        for (int k = 0; k < Q; ++k) {
            const long long i = i0 + k * nth;
            q[k] = i < nvec ? __ldcs(w + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < Q; ++k) acc ^= q[k].x + q[k].y + q[k].z + q[k].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // never true for the buffers read here; keeps the loads
}
// As a decode product reads its weights: each warp a 4 KB row at a time (8 loads per lane, the
// whole row in flight), rows dealt to warps in turn.
__device__ __forceinline__ void rows(const uint4* w, long long nvec, unsigned* sink) {
    const int lane = threadIdx.x & 31;
    const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
    const long long nrow = nvec / 256;
    unsigned acc = 0;
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < nrow;
         r += nw) {
        uint4 q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = __ldcs(w + r * 256 + lane + 32 * k);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc ^= q[k].x + q[k].y + q[k].z + q[k].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
extern "C" __global__ void __launch_bounds__(256) stream_read(const uint4* w, long long nvec,
                                                             unsigned* sink) {
    sweep<8>(w, nvec, sink);
}
extern "C" __global__ void __launch_bounds__(256) stream_read4(const uint4* w, long long nvec,
                                                              unsigned* sink) {
    sweep<4>(w, nvec, sink);
}
extern "C" __global__ void __launch_bounds__(256) stream_read16(const uint4* w, long long nvec,
                                                               unsigned* sink) {
    sweep<16>(w, nvec, sink);
}
extern "C" __global__ void __launch_bounds__(256) stream_rows(const uint4* w, long long nvec,
                                                             unsigned* sink) {
    rows(w, nvec, sink);
}
"""
BLOCKS_PER_SM = 8


class StreamRead:
    """The compiled kernel, ready to read any device buffer (16-byte aligned, whole vectors)."""

    def __init__(self, cuda: Cuda, kernel: str = "stream_read", blocks_per_sm: int = BLOCKS_PER_SM):
        self.cuda = cuda
        self.func = cuda.func(cuda.compile(SOURCE, "stream_read.cu", []), kernel)
        self.sink = cuda.upload(None, 16)
        self.blocks_per_sm = blocks_per_sm

    def launch(self, ptr: int, nbytes: int) -> None:
        grid = self.cuda.sms * self.blocks_per_sm
        self.cuda.launch(self.func, grid, 256, [PTR(ptr), I64(nbytes // 16), PTR(self.sink)])

    def best_gb_s(self, ptr: int, nbytes: int, reps: int, timer: Any = None) -> float:
        """Best of `reps` reads of the buffer, in GB/s. `timer(fn) -> seconds` times one call
        (CUDA events in compare_torch.py); without one, the wall clock around launch and
        synchronize."""
        self.launch(ptr, nbytes)  # first launch: module load
        self.cuda.sync()
        best = float("inf")
        for _ in range(reps):
            if timer is not None:
                best = min(best, timer(lambda: self.launch(ptr, nbytes)))
            else:
                t = time.perf_counter()
                self.launch(ptr, nbytes)
                self.cuda.sync()
                best = min(best, time.perf_counter() - t)
        return nbytes / best / 1e9


def main() -> None:
    """Read rate against bytes in flight: loads per thread and resident 256-thread blocks per
    multiprocessor, for the grid-wide sweep and for the decode products' row-per-warp reads."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--gb", type=float, default=4.5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cuda = Cuda()
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    buf = cuda.upload(None, nbytes)
    print(f"{cuda.arch}, {cuda.sms} SMs, {nbytes / 1e9:.2f} GB, best of {args.reps}")
    kernels = {"stream_read4": 4, "stream_read": 8, "stream_read16": 16, "stream_rows": 8}
    for name, q in kernels.items():
        for bps in (1, 2, 3, 4, 8):
            probe = StreamRead(cuda, name, bps)
            gb_s = probe.best_gb_s(buf, nbytes, args.reps)
            kib = bps * 256 * q * 16 / 1024
            print(
                f"{name:14s} {bps} blocks/SM, {q:2d} loads/thread ({kib:5.0f} KiB in flight "
                f"per SM): {gb_s:6.0f} GB/s"
            )


if __name__ == "__main__":
    main()
