"""Decode's matrix-vector product with the tensor cores instead of one conversion and one FMA
per weight (design data for issue 7).

Why: a stream of plain 16-byte loads reads an H200's memory at ~4.4 TB/s with two 256-thread
blocks per multiprocessor and eight loads in flight per thread (`stream_probe.py`), but
lowsync's streamed products (o, down, gate/up, the head) move their weights at ~3.3-3.6 TB/s in
the same configuration: per 16 weight bytes each lane converts 8 halves and does 8 FMAs, and
the loads wait on that work. Here the same streamed product runs two ways, in one process, on
the same f16 weights and f32 activations:

- `scalar`: as lowsync's `fused_gemv1_s16` — a warp per row, each lane 16 bytes of the row per
  load, eight loads in flight (refilled as they are used), the activations staged in shared
  memory as f32, `cvt` + FMA, a shuffle butterfly per row;
- `mma`: a warp per 8 rows, four lanes per row (lane 4g + t loads 16 bytes of row g at
  k = 32 r + 8 t in round r), the weights going straight from the load registers into
  `mma.sync.m16n8k16` as its B operand (8 rows x 16 k); A carries the activations as f16
  pairs, rows 0-7 their f16 rounding (hi) and rows 8-15 the rest (lo = f16(x - hi)), so
  hi + lo keeps ~22 bits of each f32 activation; two MMAs per load, the sums accumulate in
  the MMA's f32 accumulators (rows 2t, 2t + 1 of the unit in lanes 4g + t) — no conversion,
  no FMA, no shuffle.

Each result is checked against float64 (NMSE). Needs an NVIDIA GPU of compute capability 8.0+,
libcuda and libnvrtc on LD_LIBRARY_PATH; no lowsync wheel. Run:
`python benches/python/gemv_mma.py` (shapes: gate/up 16384 x 2048, down 2048 x 8192, head
32000 x 2048, o 2048 x 2048).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

import numpy as np
from attn_kernels import DEVICE_HELPERS, I32, PTR, Cuda
from stream_probe import StreamRead

SOURCE = (
    DEVICE_HELPERS
    + r"""
#define Q 8
// A warp per row (units = rows), Q loads per lane in flight, refilled as used.
extern "C" __global__ void __launch_bounds__(256) gemv_scalar(const uint4* w, const float* x,
                                                             float* y, int rows, int K) {
    extern __shared__ float4 smem[];
    float* xs = (float*)smem;
    for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, nvec = K / 8, R = nvec / (32 * Q);  // rounds per row
    const int stride = gridDim.x * 8;
    int u = blockIdx.x * 8 + (threadIdx.x >> 5);
    uint4 q[Q];
#pragma unroll
    for (int j = 0; j < Q; ++j) {
        q[j] = u < rows ? ldw(w + (size_t)u * nvec + lane + 32 * j) : make_uint4(0, 0, 0, 0);
    }
    while (u < rows) {
        const int un = u + stride;
        float acc = 0.0f;
        for (int r = 0; r < R; ++r) {
            const bool last = r + 1 == R;
#pragma unroll
            for (int j = 0; j < Q; ++j) {
                const int v = (r * Q + j) * 32 + lane;
                const float4 a = *(const float4*)(xs + 8 * v), b = *(const float4*)(xs + 8 * v + 4);
                const unsigned p[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
                acc = fmaf(h2f((unsigned short)(p[0] & 0xffff)), a.x, acc);
                acc = fmaf(h2f((unsigned short)(p[0] >> 16)), a.y, acc);
                acc = fmaf(h2f((unsigned short)(p[1] & 0xffff)), a.z, acc);
                acc = fmaf(h2f((unsigned short)(p[1] >> 16)), a.w, acc);
                acc = fmaf(h2f((unsigned short)(p[2] & 0xffff)), b.x, acc);
                acc = fmaf(h2f((unsigned short)(p[2] >> 16)), b.y, acc);
                acc = fmaf(h2f((unsigned short)(p[3] & 0xffff)), b.z, acc);
                acc = fmaf(h2f((unsigned short)(p[3] >> 16)), b.w, acc);
                const int vn = last ? lane + 32 * j : v + 32 * Q;
                const int rn = last ? un : u;
                q[j] = rn < rows ? ldw(w + (size_t)rn * nvec + vn) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) y[u] = acc;
        u = un;
    }
}
__device__ __forceinline__ void mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// A warp per 8 rows; lane 4g + t: row g, k = 32 r + 8 t .. + 8 in round r. The activations
// staged as f16 pairs: xh (hi) and xl (lo), K/2 words each.
extern "C" __global__ void __launch_bounds__(256) gemv_mma(const uint4* w, const float* x,
                                                          float* y, int rows, int K) {
    extern __shared__ float4 smem[];
    unsigned* xh = (unsigned*)smem;
    unsigned* xl = xh + K / 2;
    for (int i = threadIdx.x; i < K / 2; i += blockDim.x) {
        const float v0 = x[2 * i], v1 = x[2 * i + 1];
        const unsigned short h0 = f2h(v0), h1 = f2h(v1);
        xh[i] = h0 | ((unsigned)h1 << 16);
        xl[i] = f2h(v0 - h2f(h0)) | ((unsigned)f2h(v1 - h2f(h1)) << 16);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nvec = K / 8, R = K / 32;  // rounds per unit (8 rows)
    const int units = rows / 8, stride = gridDim.x * 8;
    int u = blockIdx.x * 8 + (threadIdx.x >> 5);
    // this lane's vector of round r of unit u: row 8u + g, vector 4r + t
    uint4 q[Q];
#pragma unroll
    for (int j = 0; j < Q; ++j) {
        const uint4* p = w + (size_t)(8 * u + g) * nvec + 4 * j + t;
        q[j] = u < units ? ldw(p) : make_uint4(0, 0, 0, 0);
    }
    const uint4* xh4 = (const uint4*)xh;
    const uint4* xl4 = (const uint4*)xl;
    while (u < units) {
        const int un = u + stride;
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int r0 = 0; r0 < R; r0 += Q) {
            const bool last = r0 + Q >= R;
#pragma unroll
            for (int j = 0; j < Q; ++j) {
                const int r = r0 + j;
                const uint4 h = xh4[4 * r + t], l = xl4[4 * r + t];  // k = 32r + 8t .. +8
                mma16816(c, h.x, l.x, h.y, l.y, q[j].x, q[j].y);
                mma16816(c, h.z, l.z, h.w, l.w, q[j].z, q[j].w);
                const int rn = last ? j : r + Q;
                const int unx = last ? un : u;
                const uint4* p = w + (size_t)(8 * unx + g) * nvec + 4 * rn + t;
                q[j] = unx < units ? ldw(p) : make_uint4(0, 0, 0, 0);
            }
        }
        if (g == 0) {
            y[8 * u + 2 * t] = c[0] + c[2];
            y[8 * u + 2 * t + 1] = c[1] + c[3];
        }
        u = un;
    }
}
"""
)

SHAPES = {"gate/up": (16384, 2048), "down": (2048, 8192), "head": (32000, 2048), "o": (2048, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gb", type=float, default=2.0, help="bytes per launch (copies stacked)")
    args = ap.parse_args()
    cuda = Cuda()
    mod = cuda.compile(SOURCE, "gemv_mma.cu", [])
    kern = {n: cuda.func(mod, f"gemv_{n}") for n in ("scalar", "mma")}
    probe = StreamRead(cuda, "stream_rows", 2)
    rng = np.random.default_rng(0)
    print(
        f"{cuda.arch}, {cuda.sms} SMs; 2 blocks of 256 threads per SM; each launch streams "
        f"~{args.gb} GB (copies of the matrix stacked, so the rates are steady-state); best of "
        f"{args.reps}"
    )
    for name, (rows, k) in SHAPES.items():
        wh = (rng.standard_normal((rows, k)) * (1.0 / k) ** 0.5).astype(np.float16)
        xh = rng.standard_normal(k).astype(np.float32) * 3.0
        copies = max(1, int(args.gb * 1e9 // wh.nbytes))
        total_rows, nbytes = rows * copies, wh.nbytes * copies
        w = cuda.upload(np.tile(wh, (copies, 1)))
        x = cuda.upload(xh)
        y = cuda.upload(None, total_rows * 4)
        ref = wh.astype(np.float64) @ xh.astype(np.float64)

        def timed(launch: Callable[[], None]) -> float:
            launch()
            cuda.sync()
            best = float("inf")
            for _ in range(args.reps):
                t = time.perf_counter()
                launch()
                cuda.sync()
                best = min(best, time.perf_counter() - t)
            return best

        cells = []
        for kname, f in kern.items():
            cuda.ck(cuda.cu.cuFuncSetAttribute(f, 8, k * 4), "cuFuncSetAttribute")
            a = [PTR(w), PTR(x), PTR(y), I32(total_rows), I32(k)]
            ptrs = (ctypes.c_void_p * len(a))(
                *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in a]
            )

            def go(
                f: ctypes.c_void_p = f,
                ptrs: ctypes.Array[ctypes.c_void_p] = ptrs,
                smem: int = k * 4,
            ) -> None:
                grid = cuda.sms * 2
                r = cuda.cu.cuLaunchKernel(f, grid, 1, 1, 256, 1, 1, smem, None, ptrs, None)
                cuda.ck(r, "cuLaunchKernel")

            best = timed(go)
            got = np.zeros(total_rows, np.float32)
            cuda.download(y, got)
            nmse = max(
                float(np.sum((got[c * rows : (c + 1) * rows] - ref) ** 2) / np.sum(ref**2))
                for c in (0, copies - 1)
            )
            cells.append(f"{kname} {nbytes / best / 1e9:5.0f} GB/s (NMSE {nmse:.1e})")
        rd = nbytes / timed(lambda w=w, nbytes=nbytes: probe.launch(w, nbytes)) / 1e9
        print(f"{name:8s} {rows}x{k} x {copies}: {' | '.join(cells)} | rows read {rd:5.0f} GB/s")
        for p in (w, y, x):
            cuda.ck(cuda.cu.cuMemFree_v2(ctypes.c_uint64(p)), "cuMemFree")


if __name__ == "__main__":
    main()
