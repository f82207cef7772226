"""The device's streaming read rate with a kernel of our own: every byte of a buffer read once
with 16-byte streaming loads (`ld.global.cs`), eight in flight per thread, eight 256-thread
blocks per multiprocessor.

Why: the bandwidth floor of issue 7 divides the bytes a decode step must read by the read
bandwidth measured in the same process. A library reduction (`torch.sum` over a float32
tensor) is one way to measure it, but not the fastest read the device can do: on an H200 it
reads 3.8-4.0 TB/s where this kernel reads 4.4-4.5 TB/s, and a floor from the slower probe
flatters every row measured against it. `compare_torch.py` takes the best of both;
`ring_decode.py` uses this kernel as its reference.
"""

from __future__ import annotations

import time
from typing import Any

from attn_kernels import I64, PTR, Cuda

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256) stream_read(const uint4* w, long long nvec,
                                                             unsigned* sink) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i0 = first; i0 < nvec; i0 += 8 * nth) {
        uint4 q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const long long i = i0 + k * nth;
            q[k] = i < nvec ? __ldcs(w + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) acc ^= q[k].x + q[k].y + q[k].z + q[k].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // never true for the buffers read here; keeps the loads
}
"""
BLOCKS_PER_SM = 8


class StreamRead:
    """The compiled kernel, ready to read any device buffer (16-byte aligned, whole vectors)."""

    def __init__(self, cuda: Cuda) -> None:
        self.cuda = cuda
        self.func = cuda.func(cuda.compile(SOURCE, "stream_read.cu", []), "stream_read")
        self.sink = cuda.upload(None, 16)

    def launch(self, ptr: int, nbytes: int) -> None:
        grid = self.cuda.sms * BLOCKS_PER_SM
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


def attach(cuda: Cuda | None = None) -> StreamRead:
    """A StreamRead on the current device's primary context (the one torch uses)."""
    return StreamRead(cuda if cuda is not None else Cuda())
