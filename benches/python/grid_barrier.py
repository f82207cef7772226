"""What a grid-wide barrier costs between weight-streaming phases (design data for a persistent
decode kernel).

Why: a decode step is a chain of matrix-vector products, each needing all of the one before. As
separate kernels (even with programmatic dependent launch) every boundary drains the memory pipe:
one kernel's tail, the next one's launch and first loads. A persistent kernel would replace each
boundary by a grid barrier and could issue the next product's first weight loads before it. This
script measures, in one process, one kernel of `phases` phases, each reading `MB` distinct
megabytes of a 2 GB buffer (8 16-byte loads in flight per thread, one block per multiprocessor
or two):

- `stream`: no barrier between phases (the bandwidth floor);
- `barrier`: a grid barrier after each phase (an atomic counter and a generation word, acquire
  and release at GPU scope);
- `ahead`: the same barrier, each thread's first 8 loads of the next phase issued before it;
- `flags`: as `ahead`, with a barrier without atomics: each block publishes its arrival in its
  own word, and every block reads all the words;
- `tree`, `red`: as `ahead` with other barriers: two levels of atomic counters (12 groups,
  each polling its own generation word), or arrivals by `red` (no returned value) counted by
  one master block that releases a generation word;
- `empty`: barriers only, no bytes (each barrier's own round trip);
- `bulk N KB`: as `ahead`, and each block's first N KB of the next phase copied into shared
  memory (`cp.async.bulk`) before the barrier: more bytes in flight across it than registers
  hold (also without barriers, the floor of that path).

It prints µs per phase and the implied bandwidth. Needs an NVIDIA GPU, libcuda and libnvrtc on
LD_LIBRARY_PATH; no lowsync wheel. Run: `python benches/python/grid_barrier.py --mb 8,33`.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
from attn_kernels import DEVICE_HELPERS, I32, I64, PTR, Cuda

SOURCE = (
    DEVICE_HELPERS
    + r"""
// bar[0]: arrivals, bar[1]: generation.
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = ld_acquire(bar + 1);
        unsigned old;
        asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;"
                     : "=r"(old) : "l"(bar) : "memory");
        if (old == gridDim.x - 1) {
            bar[0] = 0;
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar + 1) : "memory");
        } else {
            while (ld_acquire(bar + 1) == gen) {
            }
        }
    }
    __syncthreads();
}
// Two levels: block b arrives on its group's counter (b % TG; counters 128 bytes apart), the
// last of a group on the top counter, and the last of those writes every group's generation
// word, which the group's blocks poll. Counts grow by the epoch (no reset). bar[64 + 32 g]:
// group g's counter, bar[64 + 32 TG]: top, bar[1024 + 32 g]: group g's generation.
#define TG 12
__device__ __forceinline__ void tree_barrier(unsigned* bar, unsigned epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned g = blockIdx.x % TG;
        const unsigned size = gridDim.x / TG + (g < gridDim.x % TG ? 1 : 0);
        unsigned old;
        asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;"
                     : "=r"(old) : "l"(bar + 64 + 32 * g) : "memory");
        if (old == epoch * size - 1) {
            asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;"
                         : "=r"(old) : "l"(bar + 64 + 32 * TG) : "memory");
            if (old == epoch * TG - 1) {
                for (unsigned h = 0; h < TG; ++h) {
                    asm volatile("st.release.gpu.global.u32 [%0], %1;"
                                 ::"l"(bar + 1024 + 32 * h), "r"(epoch) : "memory");
                }
            }
        }
        while (ld_acquire(bar + 1024 + 32 * g) < epoch) {
        }
    }
    __syncthreads();
}
// Arrivals without a returned value (`red`), one master (block 0) polls the count and
// releases a generation word every block polls. bar[2048]: count, bar[2080]: generation.
__device__ __forceinline__ void red_barrier(unsigned* bar, unsigned epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar + 2048) : "memory");
        if (blockIdx.x == 0) {
            while (ld_acquire(bar + 2048) < epoch * gridDim.x) {
            }
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 2080), "r"(epoch)
                         : "memory");
        } else {
            while (ld_acquire(bar + 2080) < epoch) {
            }
        }
    }
    __syncthreads();
}
// Without atomics: block b publishes its arrival count in its own word (release); warp 0 of
// every block reads all the words (acquire) until each has arrived. bar[2 + b]: block b.
__device__ __forceinline__ void flag_barrier(unsigned* bar, unsigned epoch) {
    __syncthreads();
    unsigned* flags = bar + 2;
    if (threadIdx.x == 0) {
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + blockIdx.x), "r"(epoch)
                     : "memory");
    }
    if (threadIdx.x < 32) {
        for (unsigned b = threadIdx.x; b < gridDim.x; b += 32) {
            while ((int)(ld_acquire(flags + b) - epoch) < 0) {
            }
        }
        __syncwarp();
    }
    __syncthreads();
}
#define Q 8
extern "C" __global__ void __launch_bounds__(256) phases(const uint4* w, long long nvec,
        long long per, int nphase, int mode, unsigned* bar, float* sink, u64* t) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long slots = per > 0 ? nvec / per : 1;
    unsigned acc = 0;
    uint4 q[Q];
    auto issue = [&](int p) {
        const uint4* base = w + (p % slots) * per;
#pragma unroll
        for (int k = 0; k < Q; ++k) {
            const long long i = gid + k * nth;
            q[k] = i < per ? ldw(base + i) : make_uint4(0, 0, 0, 0);
        }
    };
    if (blockIdx.x == 0 && threadIdx.x == 0) t[0] = now();
    issue(0);
    for (int p = 0; p < nphase; ++p) {
#pragma unroll
        for (int k = 0; k < Q; ++k) acc ^= q[k].x + q[k].y + q[k].z + q[k].w;
        const uint4* base = w + (p % slots) * per;
        for (long long i0 = gid + Q * nth; i0 < per; i0 += Q * nth) {
#pragma unroll
            for (int k = 0; k < Q; ++k) {
                const long long i = i0 + k * nth;
                q[k] = i < per ? ldw(base + i) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int k = 0; k < Q; ++k) acc ^= q[k].x + q[k].y + q[k].z + q[k].w;
        }
        const bool more = p + 1 < nphase;
        if (mode >= 2 && more) issue(p + 1);
        if (mode == 1 || mode == 2) grid_barrier(bar);
        if (mode == 3) flag_barrier(bar, (unsigned)p + 1);
        if (mode == 4) tree_barrier(bar, (unsigned)p + 1);
        if (mode == 5) red_barrier(bar, (unsigned)p + 1);
        if (mode < 2 && more) issue(p + 1);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) t[1] = now();
    if (acc == 0x12345678u) sink[gid] = (float)acc;
}
// `phases` with more bytes in flight across each barrier than registers hold: block b's chunk
// of every phase (cvec vectors from b * cvec) comes by one bulk copy into shared memory
// (`cp.async.bulk`, an mbarrier), issued before the barrier that ends the previous phase; the
// rest of the phase streams through registers, its first Q loads per thread also issued
// before the barrier (as `ahead`). `barrier` 0: the same without barriers.
extern "C" __global__ void __launch_bounds__(256) phases_bulk(const uint4* w, long long nvec,
        long long per, int nphase, int barrier, unsigned* bar, float* sink, u64* t, int cvec) {
    extern __shared__ __align__(128) uint4 chunk[];
    __shared__ __align__(8) u64 mb;
    const long long nth = (long long)gridDim.x * blockDim.x;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long slots = nvec / per, head = (long long)gridDim.x * cvec;
    unsigned acc = 0;
    uint4 q[Q];
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&mb)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto prefetch = [&](int p) {
        if (threadIdx.x == 0 && cvec > 0) {
            const uint4* src = w + (p % slots) * per + (long long)blockIdx.x * cvec;
            asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                         ::"r"(sa(&mb)), "r"(cvec * 16) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                         " [%0], [%1], %2, [%3];"
                         ::"r"(sa(chunk)), "l"(src), "r"(cvec * 16), "r"(sa(&mb)) : "memory");
        }
    };
    auto issue = [&](int p) {
        const uint4* base = w + (p % slots) * per;
#pragma unroll
        for (int k = 0; k < Q; ++k) {
            const long long i = head + gid + k * nth;
            q[k] = i < per ? ldw(base + i) : make_uint4(0, 0, 0, 0);
        }
    };
    if (blockIdx.x == 0 && threadIdx.x == 0) t[0] = now();
    prefetch(0);
    issue(0);
    for (int p = 0; p < nphase; ++p) {
        if (cvec > 0) {
            unsigned ok = 0;
            while (!ok) {
                asm volatile("{ .reg .pred r; mbarrier.try_wait.parity.shared::cta.b64 r, [%1], %2;"
                             " selp.u32 %0, 1, 0, r; }"
                             : "=r"(ok) : "r"(sa(&mb)), "r"(p & 1) : "memory");
            }
            for (int i = threadIdx.x; i < cvec; i += blockDim.x) {
                const uint4 v = chunk[i];
                acc ^= v.x + v.y + v.z + v.w;
            }
        }
#pragma unroll
        for (int k = 0; k < Q; ++k) acc ^= q[k].x + q[k].y + q[k].z + q[k].w;
        const uint4* base = w + (p % slots) * per;
        for (long long i0 = head + gid + Q * nth; i0 < per; i0 += Q * nth) {
#pragma unroll
            for (int k = 0; k < Q; ++k) {
                const long long i = i0 + k * nth;
                q[k] = i < per ? ldw(base + i) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int k = 0; k < Q; ++k) acc ^= q[k].x + q[k].y + q[k].z + q[k].w;
        }
        __syncthreads();  // the chunk is read before the next copy overwrites it
        if (p + 1 < nphase) {
            prefetch(p + 1);
            issue(p + 1);
        }
        if (barrier) grid_barrier(bar);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) t[1] = now();
    if (acc == 0x12345678u) sink[gid] = (float)acc;
}
"""
)

MODES = {"stream": 0, "barrier": 1, "ahead": 2, "flags": 3, "tree": 4, "red": 5}
BAR_BYTES = 4 * 4096


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", default="8,33", help="megabytes per phase, comma list")
    ap.add_argument("--phases", type=int, default=64, help="phases per kernel")
    ap.add_argument("--reps", type=int, default=9, help="launches per setting (median)")
    ap.add_argument(
        "--chunk-kb",
        default="16,48",
        help="`bulk` rows: KB per block copied to shared memory ahead of each barrier",
    )
    args = ap.parse_args()
    sizes = [float(m) for m in args.mb.split(",")]
    cuda = Cuda()
    mod = cuda.compile(SOURCE, "barrier.cu", [])
    f = cuda.func(mod, "phases")
    nbytes = 2 << 30
    w = cuda.upload(None, nbytes)
    bar = cuda.upload(None, BAR_BYTES)
    t = cuda.upload(None, 16)
    sink = cuda.upload(None, cuda.sms * 2 * 256 * 4)
    print(f"{cuda.arch}, {cuda.sms} SMs; {args.phases} phases per launch, median of {args.reps}")

    fb = cuda.func(mod, "phases_bulk")

    def run(grid: int, per_vec: int, mode: int, chunk_kb: int = -1) -> float:
        """µs per phase: `phases` in `mode`, or (chunk_kb >= 0) `phases_bulk` with a chunk of
        that many KB per block, with barriers (mode 1) or without (0)."""
        times = []
        for _ in range(args.reps):
            zero = ctypes.c_size_t(BAR_BYTES)
            cuda.ck(cuda.cu.cuMemsetD8_v2(ctypes.c_uint64(bar), 0, zero), "cuMemsetD8")
            a = [PTR(w), I64(nbytes // 16), I64(per_vec), I32(args.phases), I32(mode)]
            if chunk_kb < 0:
                cuda.launch(f, grid, 256, [*a, PTR(bar), PTR(sink), PTR(t)])
            else:
                smem = chunk_kb * 1024
                cuda.ck(cuda.cu.cuFuncSetAttribute(fb, 8, max(smem, 16)), "cuFuncSetAttribute")
                b = [*a, PTR(bar), PTR(sink), PTR(t), I32(smem // 16)]
                ptrs = (ctypes.c_void_p * len(b))(
                    *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in b]
                )
                r = cuda.cu.cuLaunchKernel(fb, grid, 1, 1, 256, 1, 1, smem, None, ptrs, None)
                cuda.ck(r, "cuLaunchKernel")
            cuda.sync()
            out = np.zeros(2, np.uint64)
            cuda.download(t, out)
            times.append((int(out[1]) - int(out[0])) / 1e3 / args.phases)
        return float(np.median(times))

    for per_block in (1, 2):
        grid = cuda.sms * per_block
        empty = {name: run(grid, 0, MODES[name]) for name in ("barrier", "flags", "tree", "red")}
        cells = ", ".join(f"{k} {v:.2f} us" for k, v in empty.items())
        print(f"grid {grid} blocks: empty barriers: {cells}")
        for mb in sizes:
            per_vec = int(mb * (1 << 20)) // 16
            row = []
            for name, mode in MODES.items():
                us = run(grid, per_vec, mode)
                row.append(f"{name} {us:6.2f} us ({mb * (1 << 20) / us / 1e3:5.0f} GB/s)")
            print(f"  {mb:5.1f} MB per phase: " + " | ".join(row))
            row = []
            for kb in [int(c) for c in args.chunk_kb.split(",")]:
                if per_vec < grid * kb * 64 or kb * 1024 * per_block > 200 * 1024:
                    continue
                for name, mode in (("bulk", 1), ("bulk, no barrier", 0)):
                    us = run(grid, per_vec, mode, kb)
                    gb_s = mb * (1 << 20) / us / 1e3
                    row.append(f"{name} {kb} KB {us:6.2f} us ({gb_s:5.0f} GB/s)")
            if row:
                print("                      " + " | ".join(row))


if __name__ == "__main__":
    main()
