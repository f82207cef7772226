"""Two kernels per layer: a "1b"-shaped decode layer with two grid-wide dependencies instead
of five (design data for issue 7).

Why: lowsync's decode chain launches five kernels per layer (q/k/v, attention, o, gate/up,
down) and loses ~2.5 µs at each boundary (kernel_trace: 209 µs of a 685 µs token); a grid-wide
dependency costs ~2 µs however it is built (`grid_barrier.py`). This script tries fewer of them,
each with the weights behind it already on the chip:

- `layer_attn`: one cluster of 16 blocks per KV group. Block r of group g copies into shared
  memory, before its dependency wait (`cp.async.bulk`), its 24 of the group's 384 q/k/v rows and
  o's weights for output rows [128r, 128r + 128) at the group's 256 input columns (160 KB; the
  layer's 21 MB over 128 multiprocessors), and its cached K/V rows. After the wait: the residual
  from the previous layer's partial sums (a 128-column slice per block, pushed to the peers
  through distributed shared memory), the norm, its q/k/v rows, rope, the cache write, a cluster
  barrier, attention split over the cluster (block r takes positions r, r + 16, ...; softmax
  partials pushed to every block, one more barrier), and o's partial sums for the group.
- `layer_ffn`: 128 blocks in clusters of 8; block b owns FFN rows [64b, 64b + 64): those rows of
  gate and up and the same 64 columns of down, stored transposed, so gate/up -> down needs no
  dependency at all. Its residual is the sum of the groups' o partials; each cluster reduces its
  blocks' down partials through distributed shared memory and writes one partial, which the
  next `layer_attn` sums. Every sum has a fixed order (with `-D ATOM=1`: fixed-point atomic adds,
  exact and order-free, and `layer_ffn` without clusters).

Both kernels issue weight loads before `griddepcontrol.wait` and let the next kernel launch
before it, so `layer_attn`'s weights stream in while the previous `layer_ffn` runs. Weights are
random (hashed on the device), the KV cache holds `--pos` random rows; `--check` layers are
compared with a float64 numpy model of the same weights. Timing: the 32 launches captured in a
CUDA graph, replayed; the read of the same bytes (`stream_probe.py`) and the read rate over
4.5 GB (the rate of compare_torch.py's floor) give the floor. Per layer it prints the attention
half's time (wait release -> last exit), the gap to the FFN's release, the FFN's time, the FFN
blocks' exits, and block 0's phases (clock64 between marks: attention: x loaded, x exchanged,
norm, weights ready, q/k/v, rope + pushes, barrier, attention partials, barrier, combine, o;
ffn: x loaded, x exchanged, norm, gate/up, down, reduction pushes + barrier, sums written).

Measured on an H200 (session 19, one process per line):
- "1b"'s shape does not fit the chip at once: cuOccupancyMaxActiveClusters gives 7 clusters of
  16 (`layer_attn` needs 8) and 15 of 8 at one block per multiprocessor (`layer_ffn` needs 16);
  the last cluster runs in a second wave: 971 µs per 16 layers.
- With 7 KV groups and 7,680 FFN rows (`--groups 7 --ffn-blocks 120`, everything resident):
  612 µs per 16 layers = 38.3 µs per layer against 25.2 µs of bytes at the 4.5 GB read's rate
  (65.8%; lowsync's chain: 68.6% of its floor on "1b"). The FFN half runs at the read rate,
  carrying the next attention half's weight copies (28.0 µs for 113 MB); the attention half adds
  8.2 µs (x exchange 1.5, q/k/v 1.1, barriers 0.5 + 0.7, attention 1.6, o 1.2) and the two grid
  transitions ~2 µs. PDL off: 658 µs.
- Not better: L2 prefetch of the FFN's next weights, issued by the attention half after its
  wait (`PREF_A`) or by the FFN half before its wait (`PREF_B`): the FFN half gains 1-2.5 µs,
  the attention half and the transition lose as much or more (631-670 µs); the FFN half's
  launch trigger after its prologue (`FFN_TRIGGER_LATE`): 624 µs; eight loads in flight per lane
  instead of 16 (`NPRE=8`): 653 µs; fixed-point atomic sums (`ATOM`): the attention half falls to
  6.5 µs (no x exchange) but 120 blocks reading one 16 KB vector under the weight copies slow
  the FFN half's prologue (639 µs).

Needs an NVIDIA GPU of compute capability 9.0+, libcuda and libnvrtc on LD_LIBRARY_PATH; no
lowsync wheel. Run: `python benches/python/cluster_decode.py --groups 7 --ffn-blocks 120`
(`--defines ATOM=1,...` for the variants above).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from attn_kernels import DEVICE_HELPERS, F32, I32, I64, PTR, Cuda
from stream_probe import StreamRead

D, HD, QPG = 2048, 64, 4
NG = 8  # KV groups ("1b": 8; --groups)
CA, RA, OR, OC = 16, 24, 128, 256  # layer_attn: cluster, q/k/v rows, o rows, o columns
CB, FR = 8, 64  # layer_ffn: cluster, FFN rows per block
NB = 128  # layer_ffn blocks: FFN rows / FR ("1b": 8192 / 64; --ffn-blocks)
SB = 128  # stamp slots per kernel (blocks of either kernel)
WA_BYTES = RA * D * 2 + OR * OC * 2  # 160 KB per layer_attn block
WB_BYTES = 3 * FR * D * 2  # 768 KB per layer_ffn block
MAXJ = 32  # cached positions per layer_attn block
EPS = 1e-5
ROPE_BASE = 10000.0

# Device helpers shared with ffn_chain.py (after its NT and TRIGGER_EARLY are defined):
# distributed shared memory, cluster barriers, warp and block sums, fixed-point atomic adds, f16
# dot products, the dependency wait.
CLUSTER_HELPERS = r"""
__device__ __forceinline__ unsigned mapa(unsigned a, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
__device__ __forceinline__ void st_cl(unsigned a, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ void st_cl4(unsigned a, float x, float y, float z, float w) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
                 ::"r"(a), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
__device__ __forceinline__ void cl_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cl_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cl_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cl_sync() { cl_arrive(); cl_wait(); }
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
    return v;
}
// Fixed point (ATOM): value * 2^32 in a 64-bit integer; integer adds are exact and
// associative, so sums made of atomic adds do not depend on their order.
__device__ __forceinline__ unsigned long long f2fx(float v) {
    return (unsigned long long)__float2ll_rn(v * 4294967296.0f);
}
__device__ __forceinline__ float fx2f(long long i) { return (float)i * (1.0f / 4294967296.0f); }
__device__ __forceinline__ void red_fx(unsigned long long* p, float v) {
    asm volatile("red.global.add.u64 [%0], %1;" ::"l"(p), "l"(f2fx(v)) : "memory");
}
// Eight f16 weights times eight f32 values already loaded.
__device__ __forceinline__ float dot8x(uint4 w, float4 a, float4 b) {
    float s = h2f(w.x & 0xffff) * a.x;
    s = fmaf(h2f(w.x >> 16), a.y, s);
    s = fmaf(h2f(w.y & 0xffff), a.z, s);
    s = fmaf(h2f(w.y >> 16), a.w, s);
    s = fmaf(h2f(w.z & 0xffff), b.x, s);
    s = fmaf(h2f(w.z >> 16), b.y, s);
    s = fmaf(h2f(w.w & 0xffff), b.z, s);
    return fmaf(h2f(w.w >> 16), b.w, s);
}
// Eight f16 weights times eight f32 values in shared memory.
__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    return dot8x(w, *(const float4*)x, *(const float4*)(x + 4));
}
// Sum over the block (256 threads) in a fixed order; `red` holds 8 floats; every thread gets it.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NT / 32; ++i) s += red[i];
    return s;
}
// acc[e] += h times f16 weight e of v (e = 0..7).
__device__ __forceinline__ void axpy8(float (&acc)[8], float h, uint4 v) {
    acc[0] = fmaf(h, h2f(v.x & 0xffff), acc[0]);
    acc[1] = fmaf(h, h2f(v.x >> 16), acc[1]);
    acc[2] = fmaf(h, h2f(v.y & 0xffff), acc[2]);
    acc[3] = fmaf(h, h2f(v.y >> 16), acc[3]);
    acc[4] = fmaf(h, h2f(v.z & 0xffff), acc[4]);
    acc[5] = fmaf(h, h2f(v.z >> 16), acc[5]);
    acc[6] = fmaf(h, h2f(v.w & 0xffff), acc[6]);
    acc[7] = fmaf(h, h2f(v.w >> 16), acc[7]);
}
// The dependency wait, then the next kernel's launch (or the launch first: TRIGGER_EARLY).
__device__ __forceinline__ void pdl() {
#if TRIGGER_EARLY
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#else
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
"""

SOURCE = (
    DEVICE_HELPERS
    + r"""
#define D 2048
#define HD 64
#ifndef NG
#define NG 8
#endif
#define QPG 4
#define CA 16
#define RA 24
#define OR 128
#define OC 256
#define WA_BYTES (RA * D * 2 + OR * OC * 2)
#define CB 8
#define FR 64
#define WB_BYTES (3 * FR * D * 2)
#define NT 256
#define EPS 1e-5f
#define ROPE_BASE 10000.0
#ifndef TRIGGER_EARLY
#define TRIGGER_EARLY 1
#endif
#ifndef NPRE
#define NPRE 16
#endif
#ifndef ATOM
#define ATOM 0  // 1: residual sums as fixed-point atomic adds, layer_ffn without clusters
#endif
#ifndef PREF_A
#define PREF_A 0  // layer_attn's L2 prefetch of its layer_ffn's weights, KB per warp run
#endif
#ifndef PREF_B
#define PREF_B 0  // layer_ffn's L2 prefetch of its own weights before its wait, KB per warp
#endif
#ifndef NPARTS
#define NPARTS 16  // the residual's partial sums: layer_ffn's clusters
#endif
#define PS (HD + 4)  // a block's softmax partial for one head: HD sums, max, sum, 2 pad
#define MAXJ 32  // cached positions per layer_attn block: windows up to CA * MAXJ rows
// layer_ffn's registers: with layer_attn's 80 per thread, 176 still fit one block of each on a
// multiprocessor.
#ifndef FFN_MAXNREG
#define FFN_MAXNREG 168
#endif
#define FFN_BOUNDS __maxnreg__(FFN_MAXNREG)

"""
    + CLUSTER_HELPERS
    + r"""
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// layer_ffn: its dependency wait, and the next kernel's launch there (FFN_TRIGGER_LATE 0) or
// once its prologue is done (1), so that the next layer_attn's weight copies do not slow the
// prologue's loads.
#ifndef FFN_TRIGGER_LATE
#define FFN_TRIGGER_LATE 0
#endif
__device__ __forceinline__ void ffn_pdl() {
#if FFN_TRIGGER_LATE
    pdl_wait();
#else
    pdl();
#endif
}
__device__ __forceinline__ void ffn_trigger_late() {
#if FFN_TRIGGER_LATE
    pdl_trigger();
#endif
}
__device__ __forceinline__ void stamp(u64* st, int slot) {
    if (threadIdx.x == 0 && st) st[blockIdx.x * 3 + slot] = now();
}
// Phase marks of block 0 (thread 0), clock64: ph[k].
#define MARK(k) do { if (blockIdx.x == 0 && threadIdx.x == 0 && ph) ph[k] = clock64(); } while (0)
// Sixteen per-lane partial sums (rows 0..15) of a warp reduced across lanes with 16 shuffles:
// row (lane >> 1) & 15 ends in lanes 2k and 2k + 1.
__device__ __forceinline__ float reduce16(float (&v)[16]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int off = 16, n = 8; off >= 2; off >>= 1, n >>= 1) {
        const bool hi = lane & off;
#pragma unroll
        for (int j = 0; j < n; ++j) {
            const float send = hi ? v[j] : v[j + n], keep = hi ? v[j + n] : v[j];
            v[j] = keep + __shfl_xor_sync(~0u, send, off);
        }
    }
    return v[0] + __shfl_xor_sync(~0u, v[0], 1);
}

// One layer's attention half. Grid NG * CA blocks, clusters of CA; dynamic shared memory
// ATTN_SMEM bytes. xin: the residual as NPARTS partial sums [NPARTS][D]; kc/vc: this layer's
// cache [rows][NG][HD] f16, row `pos` written here; opart: [NG][D] o partial sums (group 0's
// includes the residual).
extern "C" __global__ void __launch_bounds__(NT, 1) layer_attn(const uint4* __restrict__ wa,
        const float* __restrict__ anorm, const float* xin, unsigned short* kc,
        unsigned short* vc, float* opart, int pos, u64* st, long long* ph, const uint4* nextb,
        int nregions, long long* zero) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* xn = (float*)(sm + WA_BYTES);  // [D] the residual, then normalised
    float* qs = xn + D;                   // [QPG * HD] the group's q after rope
    float* kn = qs + QPG * HD;            // [HD] the new key (f16-rounded)
    float* vn = kn + HD;                  // [HD] the new value
    float* part = vn + HD;                // [CA][QPG][PS] every block's softmax partials
    float* sc = part + CA * QPG * PS;     // [QPG][MAXJ] this block's scores, then weights
    float* att = sc + QPG * MAXJ;         // [QPG * HD] attention output
    float* ssp = att + QPG * HD;          // [CA] sums of squares of the slices
    float* red = ssp + CA;                // [8]
    float* res = red + 8;                 // [RA] q/k/v products
    float* pmx = res + RA;                // [8] per-warp max
    float* psum = pmx + 8;                // [8] per-warp sum
    float* xown = psum + 8;               // [OR] this block's slice of the residual
    unsigned short* kvs = (unsigned short*)(xown + OR);  // [MAXJ][2][HD] this block's K/V rows
    u64* mbar = (u64*)(kvs + MAXJ * 2 * HD);
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const int g = blockIdx.x / CA, r = blockIdx.x % CA;
    stamp(st, 0);
    const unsigned mb = sa(mbar);
    if (t == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(mb));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("{ .reg .b64 s; mbarrier.arrive.expect_tx.shared::cta.b64 s, [%0], %1; }"
                     ::"r"(mb), "r"(WA_BYTES) : "memory");
        const char* src = (const char*)wa + (size_t)blockIdx.x * WA_BYTES;
        for (int k = 0; k < WA_BYTES / 16384; ++k)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                         " [%0], [%1], 16384, [%2];"
                         ::"r"(sa(sm + k * 16384)), "l"(src + (size_t)k * 16384), "r"(mb)
                         : "memory");
    }
    // This block's cached positions (p = r + CA * j < pos; earlier steps wrote them, so they
    // load before the wait): 16-byte asynchronous copies, 8 of K and 8 of V per row.
    const int nj = pos > r ? (pos - r + CA - 1) / CA : 0;  // cached rows of this block
    for (int i = t; i < nj * 16; i += NT) {
        const int j = i >> 4, k = i & 15, p = r + CA * j;
        const unsigned short* src = (k < 8 ? kc : vc) + ((size_t)p * NG + g) * HD + (k & 7) * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                     ::"r"(sa(kvs + j * 2 * HD + k * 8)), "l"(src) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    // The rope factors of this thread's row pair (t < RA / 2) and its norm weights.
    float fc = 1.f, fs = 0.f, nw[D / NT];
    if (t < RA / 2 && r * RA + 2 * t < QPG * HD + HD) {
        double sn, cs;
        sincos((double)pos * pow(ROPE_BASE, -(double)((r * RA + 2 * t) & (HD - 1)) / HD), &sn, &cs);
        fc = (float)cs;
        fs = (float)sn;
    }
#pragma unroll
    for (int k = 0; k < D / NT; ++k) nw[k] = __ldg(anorm + t + k * NT);
    cl_arrive_relaxed();  // "started", waited for before the first remote store
    pdl();
    stamp(st, 1);
    MARK(0);
#if ATOM
    // The whole residual, from the previous kernel's fixed-point sums; block 0 zeroes the
    // sums the previous layer_ffn read (they are written again one step later).
    {
        float xr[D / NT], sq = 0.f;
#pragma unroll
        for (int k = 0; k < D / NT; ++k) xr[k] = fx2f(__ldcg((const long long*)xin + t + k * NT));
#pragma unroll
        for (int k = 0; k < D / NT; ++k) {
            sq += xr[k] * xr[k];
            if ((t + k * NT) / OR == r) xown[(t + k * NT) % OR] = xr[k];
        }
        if (blockIdx.x == 0 && zero)
            for (int k = 0; k < D / NT; ++k) zero[t + k * NT] = 0;
        MARK(1);
        const float scale = rsqrtf(block_sum(sq, red) / D + EPS);
        cl_wait();
        MARK(2);
#pragma unroll
        for (int k = 0; k < D / NT; ++k) xn[t + k * NT] = xr[k] * scale * nw[k];
        MARK(3);
    }
#else
    // The residual's slice [r * OR, r * OR + OR): the sum of the partials, in order.
    const int c = r * OR + t;
    float xv = 0.f;
    if (t < OR) {
        float v[NPARTS];
#pragma unroll
        for (int p = 0; p < NPARTS; ++p) v[p] = __ldcg(xin + (size_t)p * D + c);
#pragma unroll
        for (int p = 0; p < NPARTS; ++p) xv += v[p];
        xown[t] = xv;
    }
#if PREF_A
    // layer_ffn's weights after the part its registers preload: PREF_A KB of each warp's
    // gate/up run into L2 while this kernel's latency-bound path runs (region q: block q / 8,
    // warp q % 8).
    if (lane == 0)
        for (int q = blockIdx.x * 8 + w; q < nregions; q += gridDim.x * 8)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                         ::"l"((const char*)(nextb + (size_t)(q >> 3) * (WB_BYTES / 16) +
                                             (size_t)(q & 7) * (8 * 2 * D * 2 / 16)) + NPRE * 512),
                           "r"(PREF_A * 1024) : "memory");
#endif
    MARK(1);
    const float ssl = block_sum(xv * xv, red);
    cl_wait();
    {
        const float x1 = __shfl_down_sync(~0u, xv, 1), x2 = __shfl_down_sync(~0u, xv, 2),
                    x3 = __shfl_down_sync(~0u, xv, 3);
        if (t < OR && (t & 3) == 0) {
#pragma unroll
            for (int q = 0; q < CA; ++q) st_cl4(mapa(sa(xn + c), q), xv, x1, x2, x3);
        }
    }
    if (t == 0) {
#pragma unroll
        for (int q = 0; q < CA; ++q) st_cl(mapa(sa(ssp + r), q), ssl);
    }
    cl_sync();
    MARK(2);
    float ss = 0.f;
#pragma unroll
    for (int q = 0; q < CA; ++q) ss += ssp[q];
    const float scale = rsqrtf(ss / D + EPS);
#pragma unroll
    for (int k = 0; k < D / NT; ++k) xn[t + k * NT] *= scale * nw[k];
    MARK(3);
#endif
    {
        unsigned ok = 0;
        while (!ok)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;"
                         " selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(mb) : "memory");
    }
    __syncthreads();
    MARK(4);
    // q/k/v: warp w, rows 3w .. 3w + 2 of the block's 24.
    {
        const uint4* wr = (const uint4*)(sm + (size_t)(RA / 8) * w * D * 2);
        float acc[RA / 8] = {};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float* xp = xn + (k * 32 + lane) * 8;
            const float4 x0 = *(const float4*)xp, x1 = *(const float4*)(xp + 4);
#pragma unroll
            for (int j = 0; j < RA / 8; ++j)
                acc[j] += dot8x(wr[j * (D / 8) + k * 32 + lane], x0, x1);
        }
#pragma unroll
        for (int j = 0; j < RA / 8; ++j) acc[j] = warp_sum(acc[j]);
        if (lane < RA / 8)
            res[(RA / 8) * w + lane] = lane == 0 ? acc[0] : lane == 1 ? acc[1] : acc[2];
    }
    __syncthreads();
    MARK(5);
    if (t < RA / 2) {
        const int gr = r * RA + 2 * t;  // the row pair's place among the group's 384 rows
        float a = res[2 * t], b = res[2 * t + 1];
        const float a2 = a * fc - b * fs, b2 = a * fs + b * fc;  // identity for v rows
        a = a2;
        b = b2;
        if (gr < QPG * HD) {
#pragma unroll
            for (int q = 0; q < CA; ++q) {
                st_cl(mapa(sa(qs + gr), q), a);
                st_cl(mapa(sa(qs + gr + 1), q), b);
            }
        } else {
            const bool isk = gr < QPG * HD + HD;
            const int d = (gr - QPG * HD) & (HD - 1);
            const unsigned short ha = f2h(a), hb = f2h(b);
            unsigned short* cache = isk ? kc : vc;
            const size_t off = ((size_t)pos * NG + g) * HD + d;
            cache[off] = ha;
            cache[off + 1] = hb;
            float* dst = isk ? kn : vn;
#pragma unroll
            for (int q = 0; q < CA; ++q) {
                st_cl(mapa(sa(dst + d), q), h2f(ha));
                st_cl(mapa(sa(dst + d + 1), q), h2f(hb));
            }
        }
    }
    MARK(6);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    cl_sync();
    MARK(7);
    // Attention, split over the cluster: block r takes positions r, r + CA, ... <= pos (the
    // new one from kn/vn) for all four heads; thread (head h = t / 64, i = t % 64).
    const int h = t >> 6, i = t & 63;
    const bool mine = pos % CA == r;  // the new position is this block's
    const int np = nj + (mine ? 1 : 0);
    {
        // scores: thread (head h, position jj of a run of 8, dims 8 ch .. 8 ch + 7)
        const int jj = (t >> 3) & 7, ch = t & 7;
        const float* qp = qs + h * HD + ch * 8;
        const float4 q0 = *(const float4*)qp, q1 = *(const float4*)(qp + 4);
        for (int pb = 0; pb < np; pb += 8) {
            const int j = pb + jj;
            float d = 0.f;
            if (j == nj) {
                const float* kp = kn + ch * 8;
                d = q0.x * kp[0] + q0.y * kp[1] + q0.z * kp[2] + q0.w * kp[3] + q1.x * kp[4] +
                    q1.y * kp[5] + q1.z * kp[6] + q1.w * kp[7];
            } else if (j < nj) {
                d = dot8x(*(const uint4*)(kvs + j * 2 * HD + ch * 8), q0, q1);
            }
            d += __shfl_xor_sync(~0u, d, 1);
            d += __shfl_xor_sync(~0u, d, 2);
            d += __shfl_xor_sync(~0u, d, 4);
            if (ch == 0 && j < np) sc[h * MAXJ + j] = d * 0.125f;
        }
    }
    __syncthreads();
    const float s = i < np ? sc[h * MAXJ + i] : -3.0e38f;
    const float wm = warp_max(s);
    if (lane == 0) pmx[w] = wm;
    __syncthreads();
    const float m = fmaxf(pmx[2 * h], pmx[2 * h + 1]);
    const float e = i < np ? __expf(s - m) : 0.f;
    if (i < np) sc[h * MAXJ + i] = e;  // this thread's own score, read above
    const float ws = warp_sum(e);
    if (lane == 0) psum[w] = ws;
    __syncthreads();
    // thread (h, d = i): this block's unnormalised output for head h, dim d
    float o = 0.f;
    for (int j = 0; j < np; ++j) {
        const float v = j == nj ? vn[i] : h2f(kvs[j * 2 * HD + HD + i]);
        o = fmaf(sc[h * MAXJ + j], v, o);
    }
    {
        // to every block: four dims per 16-byte store, then (max, sum)
        const float l = psum[2 * h] + psum[2 * h + 1];
        const float o1 = __shfl_down_sync(~0u, o, 1), o2 = __shfl_down_sync(~0u, o, 2),
                    o3 = __shfl_down_sync(~0u, o, 3);
        float* dst = part + (r * QPG + h) * PS;
        if ((i & 3) == 0) {
#pragma unroll
            for (int q2 = 0; q2 < CA; ++q2) st_cl4(mapa(sa(dst + i), q2), o, o1, o2, o3);
        }
        if (i == 0) {
            const float mm = np > 0 ? m : -3.0e38f;
#pragma unroll
            for (int q2 = 0; q2 < CA; ++q2) st_cl4(mapa(sa(dst + HD), q2), mm, l, 0.f, 0.f);
        }
    }
    MARK(8);
    cl_sync();
    MARK(9);
    {
        float M = -3.0e38f;
#pragma unroll
        for (int q2 = 0; q2 < CA; ++q2) M = fmaxf(M, part[(q2 * QPG + h) * PS + HD]);
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int q2 = 0; q2 < CA; ++q2) {
            const float* src = part + (q2 * QPG + h) * PS;
            const float f = __expf(src[HD] - M);
            L = fmaf(src[HD + 1], f, L);
            O = fmaf(src[i], f, O);
        }
        att[t] = O / L;
    }
    __syncthreads();
    // o: warp w, rows 16w .. 16w + 15 of the block's 128; each row the group's 256 columns.
    MARK(10);
    const unsigned char* wo = sm + (size_t)RA * D * 2;
    float ov[16];
#pragma unroll
    for (int j = 0; j < 16; ++j)
        ov[j] = dot8(*(const uint4*)(wo + (size_t)(16 * w + j) * OC * 2 + lane * 16),
                     att + lane * 8);
    const float a = reduce16(ov);
    if ((lane & 1) == 0) {
        const int row = 16 * w + (lane >> 1);
        const float v = a + (g == 0 ? xown[row] : 0.f);
#if ATOM
        red_fx((unsigned long long*)opart + r * OR + row, v);
#else
        opart[(size_t)g * D + r * OR + row] = v;
#endif
    }
    MARK(11);
    stamp(st, 2);
}

// One layer's FFN. Grid NB blocks in clusters of CB; dynamic shared memory FFN_SMEM bytes.
// wb: per block its 64 gate/up row pairs (gate row, up row, interleaved) then its 64 rows of
// down transposed; opart: [NG][D]; fpart: [NB / CB][D] (cluster 0's includes the residual).
extern "C" __global__ void FFN_BOUNDS layer_ffn(const uint4* __restrict__ wb,
        const float* __restrict__ fnorm, const float* opart, float* fpart, u64* st,
        long long* ph, long long* zero) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* xn = (float*)sm;  // [D]
    float* part = xn + D;    // [D] this block's down partial
    float* h = part + D;     // [FR]
    float* ssp = h + FR;     // [CB]
    float* red = ssp + CB;   // [8]
    float* nws = red + 8;    // [D] the norm's weights
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const int b = blockIdx.x, cid = b / CB, r = b % CB;
    stamp(st, 0);
    // Warp w's gate/up rows are 64 KB in a row: chunk s at gu + s * 32 (512 B per chunk).
    const uint4* gu = wb + (size_t)b * (WB_BYTES / 16) + (size_t)w * (8 * 2 * D * 2 / 16) + lane;
    const uint4* dn = wb + (size_t)b * (WB_BYTES / 16) + (2 * FR * D * 2 / 16) + t;
    uint4 buf[NPRE];
#pragma unroll
    for (int k = 0; k < NPRE; ++k) buf[k] = ldw(gu + k * 32);
#if PREF_B
    // The warp's run after the part its registers hold, into L2, while the attention runs.
    if (lane == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                     ::"l"((const char*)(gu + NPRE * 32)), "r"(PREF_B * 1024) : "memory");
#endif
#pragma unroll
    for (int k = 0; k < D / 4 / NT; ++k)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                     ::"r"(sa(nws + 4 * (t + k * NT))), "l"(fnorm + 4 * (t + k * NT)) : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
#if ATOM
    ffn_pdl();
    stamp(st, 1);
    MARK(0);
    {
        float xr[D / NT], sq = 0.f;
#pragma unroll
        for (int k = 0; k < D / NT; ++k)
            xr[k] = fx2f(__ldcg((const long long*)opart + t + k * NT));
#pragma unroll
        for (int k = 0; k < D / NT; ++k) {
            sq += xr[k] * xr[k];
            part[t + k * NT] = xr[k];  // block 0 adds the residual to its sums
        }
        if (b == 0 && zero)
            for (int k = 0; k < D / NT; ++k) zero[t + k * NT] = 0;
        MARK(1);
        const float scale = rsqrtf(block_sum(sq, red) / D + EPS);
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        MARK(2);
#pragma unroll
        for (int k = 0; k < D / NT; ++k) xn[t + k * NT] = xr[k] * scale * nws[t + k * NT];
        __syncthreads();
        MARK(3);
        ffn_trigger_late();
    }
#else
    cl_arrive_relaxed();
    ffn_pdl();
    stamp(st, 1);
    MARK(0);
    const int c = r * (D / CB) + t;  // this block's slice of the residual: D / CB = NT columns
    float xv = 0.f;
    {
        float v[NG];
#pragma unroll
        for (int gg = 0; gg < NG; ++gg) v[gg] = __ldcg(opart + (size_t)gg * D + c);
#pragma unroll
        for (int gg = 0; gg < NG; ++gg) xv += v[gg];
    }
    MARK(1);
    const float ssl = block_sum(xv * xv, red);
    cl_wait();
#pragma unroll
    for (int q = 0; q < CB; ++q) st_cl(mapa(sa(xn + c), q), xv);
    if (t == 0) {
#pragma unroll
        for (int q = 0; q < CB; ++q) st_cl(mapa(sa(ssp + r), q), ssl);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    cl_sync();
    MARK(2);
    float ss = 0.f;
#pragma unroll
    for (int q = 0; q < CB; ++q) ss += ssp[q];
    const float scale = rsqrtf(ss / D + EPS);
#pragma unroll
    for (int k = 0; k < D / NT; ++k) xn[t + k * NT] *= scale * nws[t + k * NT];
    __syncthreads();
    MARK(3);
    ffn_trigger_late();
#endif
    // gate/up: 8 row pairs per warp, 16 chunks each (8 of gate, 8 of up), NPRE loads in
    // flight per lane; the loads run on into down's rows.
    float ga = 0.f, ua = 0.f;
#pragma unroll 1
    for (int s0 = 0; s0 < 128; s0 += NPRE) {
#pragma unroll
        for (int k = 0; k < NPRE; ++k) {
            const int s = s0 + k, nx = s + NPRE;
            const uint4 v = buf[k];
            buf[k] = nx < 128 ? ldw(gu + (size_t)nx * 32) : ldw(dn + (size_t)(nx - 128) * (D / 8));
            const int kk = s & 15;
            const float d = dot8(v, xn + ((kk & 7) * 32 + lane) * 8);
            if (kk < 8) ga += d; else ua += d;
            if (kk == 15) {
                ga = warp_sum(ga);
                ua = warp_sum(ua);
                if (lane == 0) h[w * 8 + (s >> 4)] = ga / (1.f + __expf(-ga)) * ua;
                ga = ua = 0.f;
            }
        }
    }
    __syncthreads();
    MARK(4);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int s0 = 0; s0 < FR; s0 += NPRE) {
#pragma unroll
        for (int k = 0; k < NPRE; ++k) {
            const int i = s0 + k, nx = i + NPRE;
            const uint4 v = buf[k];
            if (nx < FR) buf[k] = ldw(dn + (size_t)nx * (D / 8));
            axpy8(acc, h[i], v);
        }
    }
#if ATOM
    MARK(5);
#pragma unroll
    for (int e = 0; e < 8; ++e)
        red_fx((unsigned long long*)fpart + 8 * t + e, acc[e] + (b == 0 ? part[8 * t + e] : 0.f));
    MARK(6);
    MARK(7);
#else
    // Columns 8t .. 8t + 7 go to their slice's owner, block (8t) / 256 = w of the cluster.
    {
        const unsigned dst = mapa(sa(part + r * (D / CB) + ((8 * t) & (D / CB - 1))), w);
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
                     ::"r"(dst), "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3]) : "memory");
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
                     ::"r"(dst + 16), "f"(acc[4]), "f"(acc[5]), "f"(acc[6]), "f"(acc[7])
                     : "memory");
    }
    MARK(5);
    cl_sync();
    MARK(6);
    float v = 0.f;
#pragma unroll
    for (int q = 0; q < CB; ++q) v += part[q * (D / CB) + t];
    if (cid == 0) v += xv;
    fpart[(size_t)cid * D + c] = v;
    MARK(7);
#endif
    stamp(st, 2);
}

// Weights from a hash: uniform in [-1, 1) times s1 for the first `split` elements of every
// `period`, s2 for the rest.
extern "C" __global__ void init_f16(unsigned short* w, long long n, unsigned long long seed,
        float s1, float s2, long long period, long long split) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long z = (unsigned long long)i + seed * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
        w[i] = f2h(u * ((i % period) < split ? s1 : s2));
    }
}
"""
)

ATTN_SMEM = WA_BYTES + 4 * (D + QPG * HD + 2 * HD + CA * QPG * (HD + 4) + QPG * MAXJ + QPG * HD)
ATTN_SMEM += 4 * (CA + 8 + RA + 16 + OR) + MAXJ * 2 * HD * 2 + 16
FFN_SMEM = 4 * (3 * D + FR + CB + 8)


class LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("val", ctypes.c_uint32 * 16)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("smem", ctypes.c_uint32),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttr)),
        ("nattrs", ctypes.c_uint32),
    ]


def config(grid: int, smem: int, cluster: int, pdl: bool, stream: Any) -> tuple[Any, Any]:
    attrs = (LaunchAttr * 2)()
    attrs[0].id = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attrs[0].val[0], attrs[0].val[1], attrs[0].val[2] = cluster, 1, 1
    attrs[1].id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[1].val[0] = 1 if pdl else 0
    cfg = LaunchConfig()
    cfg.grid[:] = [grid, 1, 1]
    cfg.block[:] = [256, 1, 1]
    cfg.smem = smem
    cfg.stream = stream
    cfg.attrs = attrs
    cfg.nattrs = 2
    return cfg, attrs  # the attributes must outlive the call


def capture(cuda: Cuda, stream: ctypes.c_void_p, enqueue: Callable[[], None]) -> ctypes.c_void_p:
    """The launches `enqueue` makes on `stream`, captured and instantiated as one graph."""
    cu = cuda.cu
    cuda.ck(cu.cuStreamBeginCapture_v2(stream, 2), "cuStreamBeginCapture")
    enqueue()
    g, ex = ctypes.c_void_p(), ctypes.c_void_p()
    cuda.ck(cu.cuStreamEndCapture(stream, ctypes.byref(g)), "cuStreamEndCapture")
    cuda.ck(cu.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_uint64(0)), "inst")
    return ex


def registers(cuda: Cuda, mod: ctypes.c_void_p, names: tuple[str, ...]) -> list[int]:
    """Registers per thread of each kernel of `mod` named."""
    out = []
    for f in names:
        n = ctypes.c_int()
        cuda.ck(cuda.cu.cuFuncGetAttribute(ctypes.byref(n), 4, cuda.func(mod, f)), "regs")
        out.append(n.value)
    return out


def replay_us(
    cuda: Cuda,
    stream: ctypes.c_void_p,
    ex: ctypes.c_void_p,
    reps: int,
    before: Callable[[], None] | None = None,
) -> list[float]:
    """µs of each of `reps` replays of graph `ex` (CUDA events around each; `before` runs on the
    host ahead of each replay, untimed)."""
    cu, ck = cuda.cu, cuda.ck
    e0, e1 = ctypes.c_void_p(), ctypes.c_void_p()
    ck(cu.cuEventCreate(ctypes.byref(e0), 0), "cuEventCreate")
    ck(cu.cuEventCreate(ctypes.byref(e1), 0), "cuEventCreate")
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        ck(cu.cuEventRecord(e0, stream), "cuEventRecord")
        ck(cu.cuGraphLaunch(ex, stream), "cuGraphLaunch")
        ck(cu.cuEventRecord(e1, stream), "cuEventRecord")
        ck(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        ms = ctypes.c_float()
        ck(cu.cuEventElapsedTime(ctypes.byref(ms), e0, e1), "cuEventElapsedTime")
        out.append(ms.value * 1e3)
    return out


Matrix = np.ndarray[Any, Any]


def pack_attn(wq: Matrix, wk: Matrix, wv: Matrix, wo: Matrix) -> Matrix:
    """layer_attn's weights, [groups * CA, WA_BYTES / 2]: block (g, r) holds rows
    [24r, 24r + 24) of group g's q (its 4 heads), k and v rows, then o's rows [128r, 128r + 128)
    at the group's 256 input columns. wq [groups * 256, D], wk/wv [groups * 64, D], wo [D, groups
    * 256] (rows out, columns in, as GGUF stores them)."""
    ng = wk.shape[0] // HD
    out = []
    for g in range(ng):
        rows = np.concatenate(
            [
                wq[g * QPG * HD : (g + 1) * QPG * HD],
                wk[g * HD : (g + 1) * HD],
                wv[g * HD : (g + 1) * HD],
            ]
        ).reshape(CA, RA * D)
        o = wo[:, g * OC : (g + 1) * OC].reshape(CA, OR * OC)
        out.append(np.concatenate([rows, o], axis=1))
    return np.concatenate(out).astype(np.float16)


def unpack_attn(wa: Matrix, ng: int) -> tuple[Matrix, Matrix, Matrix, Matrix]:
    """wq, wk, wv, wo from `pack_attn`'s layout."""
    wa = wa.reshape(ng, CA, WA_BYTES // 2)
    rows = wa[:, :, : RA * D].reshape(ng, CA * RA, D)
    wq = rows[:, : QPG * HD].reshape(-1, D)
    wk = rows[:, QPG * HD : QPG * HD + HD].reshape(-1, D)
    wv = rows[:, QPG * HD + HD :].reshape(-1, D)
    wo = wa[:, :, RA * D :].reshape(ng, CA * OR, OC).transpose(1, 0, 2).reshape(D, ng * OC)
    return wq, wk, wv, wo


def pack_ffn(gate: Matrix, up: Matrix, down: Matrix) -> Matrix:
    """layer_ffn's weights, [blocks, WB_BYTES / 2]: block b holds FFN rows [64b, 64b + 64) of
    gate and up, interleaved row by row, then the same 64 columns of down, transposed (so each
    is a contiguous row of D). gate/up [F, D], down [D, F]."""
    nb = gate.shape[0] // FR
    gu = np.stack([gate, up], axis=1).reshape(nb, 2 * FR * D)
    dt = down.T.reshape(nb, FR * D)
    return np.concatenate([gu, dt], axis=1).astype(np.float16)


def unpack_ffn(wb: Matrix, nb: int) -> tuple[Matrix, Matrix, Matrix]:
    """gate, up, down from `pack_ffn`'s layout."""
    wb = wb.reshape(nb, 3 * FR, D)
    gu = wb[:, : 2 * FR].reshape(nb * FR, 2, D)
    return gu[:, 0], gu[:, 1], wb[:, 2 * FR :].reshape(nb * FR, D).T


class Model:
    """The device side: weights, cache, activations, and the step as a captured graph."""

    def __init__(
        self, cuda: Cuda, mod: ctypes.c_void_p, layers: int, pos: int, rows: int, atom: bool
    ):
        self.atom = atom  # built with ATOM=1: fixed-point sums, layer_ffn without clusters
        self.cb = 1 if atom else CB
        self.cuda, self.layers, self.pos, self.rows = cuda, layers, pos, rows
        cu = cuda.cu
        self.attn = cuda.func(mod, "layer_attn")
        self.ffn = cuda.func(mod, "layer_ffn")
        init = cuda.func(mod, "init_f16")
        for f, smem in ((self.attn, ATTN_SMEM), (self.ffn, FFN_SMEM)):
            cuda.ck(cu.cuFuncSetAttribute(f, 8, smem), "max dynamic smem")
        cuda.ck(cu.cuFuncSetAttribute(self.attn, 14, 1), "non-portable cluster size")
        self.wa = cuda.upload(None, layers * NG * CA * WA_BYTES)
        self.wb = cuda.upload(None, layers * NB * WB_BYTES)
        self.nbytes = layers * (NG * CA * WA_BYTES + NB * WB_BYTES)
        sa, sf, sd = (3 / D) ** 0.5, (3 / D) ** 0.5, (3 / (NB * FR)) ** 0.5
        grid = cuda.sms * 8
        for ptr, n, seed, s1, s2, period, split in (
            (self.wa, layers * NG * CA * WA_BYTES // 2, 1, sa, sa, 1, 1),
            (self.wb, layers * NB * WB_BYTES // 2, 2, sf, sd, WB_BYTES // 2, 2 * FR * D),
        ):
            args = [PTR(ptr), I64(n), ctypes.c_uint64(seed), F32(s1), F32(s2), I64(period)]
            cuda.launch(init, grid, 256, [*args, I64(split)])
        rng = np.random.default_rng(3)
        self.anorm = (1 + 0.1 * rng.standard_normal((layers, D))).astype(np.float32)
        self.fnorm = (1 + 0.1 * rng.standard_normal((layers, D))).astype(np.float32)
        self.kcache = (rng.standard_normal((layers, rows, NG, HD))).astype(np.float16)
        self.vcache = (rng.standard_normal((layers, rows, NG, HD))).astype(np.float16)
        self.kcache[:, pos:] = 0
        self.vcache[:, pos:] = 0
        self.x0 = rng.standard_normal(D).astype(np.float32)
        xin: Matrix = np.zeros((NB // CB, D), np.float32)
        xin[0] = self.x0
        if atom:  # one fixed-point vector (x0 * 2^32 is an integer in f32: exact)
            xin = (self.x0.astype(np.float64) * 2.0**32).astype(np.int64)
        self.d_anorm, self.d_fnorm = cuda.upload(self.anorm), cuda.upload(self.fnorm)
        self.d_k, self.d_v = cuda.upload(self.kcache), cuda.upload(self.vcache)
        self.d_xin = cuda.upload(xin)
        self.d_opart = cuda.upload(None, layers * NG * D * 4)
        self.d_fpart = cuda.upload(None, layers * (NB // CB) * D * 4)
        self.d_st = cuda.upload(None, 2 * layers * SB * 3 * 8)
        self.d_ph = cuda.upload(None, 2 * layers * 16 * 8)
        self.stream = ctypes.c_void_p()
        cuda.ck(cu.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")
        cuda.sync()

    def occupancy(self) -> tuple[int, int]:
        out = []
        for f, grid, smem, cl in (
            (self.attn, NG * CA, ATTN_SMEM, CA),
            (self.ffn, NB, FFN_SMEM, self.cb),
        ):
            n = ctypes.c_int()
            cfg, _keep = config(grid, smem, cl, False, self.stream)
            self.cuda.ck(
                self.cuda.cu.cuOccupancyMaxActiveClusters(ctypes.byref(n), f, ctypes.byref(cfg)),
                "cuOccupancyMaxActiveClusters",
            )
            out.append(n.value)
        return out[0], out[1]

    def enqueue(self, pdl: bool) -> None:
        L = self.layers
        kv = self.rows * NG * HD * 2
        for layer in range(L):
            xin = self.d_xin if layer == 0 else self.d_fpart + (layer - 1) * (NB // CB) * D * 4
            opart = self.d_opart + layer * NG * D * 4
            st = self.d_st + 2 * layer * SB * 3 * 8
            ph = self.d_ph + 2 * layer * 16 * 8
            a: list[Any] = [PTR(self.wa + layer * NG * CA * WA_BYTES)]
            a += [PTR(self.d_anorm + layer * D * 4), PTR(xin)]
            a += [PTR(self.d_k + layer * kv), PTR(self.d_v + layer * kv)]
            a += [PTR(opart), I32(self.pos), PTR(st), PTR(ph)]
            prev = (layer - 1) % L  # the sums the previous kernel of each kind read (ATOM)
            a += [PTR(self.wb + layer * NB * WB_BYTES), I32(NB * 8)]
            a += [PTR(self.d_opart + prev * NG * D * 4 if self.atom else 0)]
            self._launch(self.attn, NG * CA, ATTN_SMEM, CA, pdl and layer > 0, a)
            b = [PTR(self.wb + layer * NB * WB_BYTES), PTR(self.d_fnorm + layer * D * 4)]
            b += [PTR(opart), PTR(self.d_fpart + layer * (NB // CB) * D * 4)]
            b += [PTR(st + SB * 3 * 8), PTR(ph + 16 * 8)]
            b += [PTR(self.d_fpart + prev * (NB // CB) * D * 4 if self.atom else 0)]
            self._launch(self.ffn, NB, FFN_SMEM, self.cb, pdl, b)

    def _launch(self, f: Any, grid: int, smem: int, cl: int, pdl: bool, args: list[Any]) -> None:
        cfg, _keep = config(grid, smem, cl, pdl, self.stream)
        ptrs = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args]
        )
        self.cuda.ck(
            self.cuda.cu.cuLaunchKernelEx(ctypes.byref(cfg), f, ptrs, None), "cuLaunchKernelEx"
        )

    def graph(self, pdl: bool) -> ctypes.c_void_p:
        return capture(self.cuda, self.stream, lambda: self.enqueue(pdl))

    def time_graph(self, ex: ctypes.c_void_p, reps: int) -> float:
        """Median µs per replay (events around each of `reps` replays)."""
        return float(np.median(replay_us(self.cuda, self.stream, ex, reps)))

    def stamps(self) -> tuple[list[Matrix], list[Matrix]]:
        """Per layer, each block's globaltimer (ns) at entry, after its wait and at exit:
        layer_attn's blocks, layer_ffn's blocks."""
        out = np.zeros(2 * self.layers * SB * 3, np.uint64)
        self.cuda.download(self.d_st, out)
        st = out.reshape(self.layers, 2, SB, 3).astype(np.int64)
        return [s[0, : NG * CA] for s in st], [s[1, :NB] for s in st]

    def phases(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Median µs between consecutive phase marks of block 0: layer_attn's 12, layer_ffn's 8."""
        out = np.zeros(2 * self.layers * 16, np.uint64)
        self.cuda.download(self.d_ph, out)
        ph = out.reshape(self.layers, 2, 16).astype(np.int64)
        a = np.median(np.diff(ph[:, 0, :12], axis=1), axis=0) / self.cuda.mhz
        b = np.median(np.diff(ph[:, 1, :8], axis=1), axis=0) / self.cuda.mhz
        return a, b

    def result(self) -> np.ndarray[Any, Any]:
        last = self.d_fpart + (self.layers - 1) * (NB // CB) * D * 4
        if self.atom:
            fx = np.zeros(D, np.int64)
            self.cuda.download(last, fx)
            x: Matrix = fx.astype(np.float64) / 2.0**32
            return x
        out = np.zeros((NB // CB, D), np.float32)
        self.cuda.download(last, out)
        x = out.astype(np.float64).sum(axis=0)
        return x

    def reference(self) -> np.ndarray[Any, Any]:
        """float64 numpy of the same layers, from the device's weights."""
        cuda, pos = self.cuda, self.pos
        x = self.x0.astype(np.float64)
        d = np.arange(0, HD, 2)
        ang = pos * ROPE_BASE ** (-d / HD)
        cs, sn = np.cos(ang), np.sin(ang)

        def rope(v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            v = v.reshape(-1, HD // 2, 2)
            a, b = v[..., 0], v[..., 1]
            return np.stack([a * cs - b * sn, a * sn + b * cs], -1).reshape(-1)

        for layer in range(self.layers):
            wa = np.zeros(NG * CA * WA_BYTES // 2, np.float16)
            cuda.download(self.wa + layer * NG * CA * WA_BYTES, wa)
            wq, wk, wv, wo = (m.astype(np.float64) for m in unpack_attn(wa, NG))
            xn = x / np.sqrt((x * x).mean() + EPS) * self.anorm[layer]
            q, k = rope(wq @ xn).reshape(-1, HD), rope(wk @ xn).reshape(-1, HD)
            v = (wv @ xn).reshape(-1, HD)
            k, v = (a.astype(np.float16).astype(np.float64) for a in (k, v))  # as cached
            att = np.zeros(NG * QPG * HD)
            for h in range(NG * QPG):
                g = h // QPG
                keys = np.concatenate(
                    [self.kcache[layer, :pos, g].astype(np.float64), k[g : g + 1]]
                )
                vals = np.concatenate(
                    [self.vcache[layer, :pos, g].astype(np.float64), v[g : g + 1]]
                )
                s = keys @ q[h] * HD**-0.5
                p = np.exp(s - s.max())
                att[h * HD : h * HD + HD] = (p / p.sum()) @ vals
            x = x + wo @ att
            wb = np.zeros(NB * WB_BYTES // 2, np.float16)
            cuda.download(self.wb + layer * NB * WB_BYTES, wb)
            gate, up, down = (m.astype(np.float64) for m in unpack_ffn(wb, NB))
            xn = x / np.sqrt((x * x).mean() + EPS) * self.fnorm[layer]
            g_, u_ = gate @ xn, up @ xn
            x = x + down @ (g_ / (1 + np.exp(-g_)) * u_)
        return x


def report(m: Model, pdl: bool, reps: int, floor: float, floor_big: float) -> None:
    """One setting: µs per step, and where a layer's time goes (from the blocks' stamps)."""
    us = m.time_graph(m.graph(pdl), reps)
    attn, ffn = m.stamps()
    # per layer (medians): attention's wait release -> its last exit; -> ffn's release;
    # ffn's release -> its last exit; each ffn block's exit after the release
    rows = np.array(
        [
            [
                a[:, 2].max() - a[:, 1].max(),
                f[:, 1].max() - a[:, 2].max(),
                f[:, 2].max() - f[:, 1].max(),
            ]
            for a, f in zip(attn, ffn, strict=True)
        ]
    )
    med = np.median(rows, axis=0) / 1e3
    exits = np.median(np.array([f[:, 2] - f[:, 1].max() for f in ffn]), axis=0) / 1e3
    n = m.layers
    print(
        f"pdl {'on ' if pdl else 'off'}: {us:7.1f} µs per step = {us / n:5.2f} per layer = "
        f"{floor / us * 100:5.1f}% of their read ({floor_big / us * 100:4.1f}% at the large "
        f"read's rate); per layer: attention {med[0]:.2f}, "
        f"-> ffn {med[1]:.2f}, ffn {med[2]:.2f}"
    )
    pc = " ".join(f"{x:.1f}" for x in np.percentile(exits, [0, 10, 50, 90, 100]))
    cl = " ".join(f"{x:.1f}" for x in exits.reshape(-1, CB).mean(axis=1))
    print(f"  ffn block exits after its release, min p10 p50 p90 max: {pc}; per cluster: {cl}")
    pa, pf = m.phases()
    print("  attention phases, block 0: " + " ".join(f"{x:.2f}" for x in pa))
    print("  ffn phases, block 0: " + " ".join(f"{x:.2f}" for x in pf))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--check", type=int, default=2, help="layers of the float64 check (0: none)")
    ap.add_argument("--pos", type=int, default=100, help="cache rows before this step")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--probe-gb", type=float, default=4.5, help="size of the bandwidth probe")
    ap.add_argument("--defines", default="", help="comma list of -D for the kernels")
    ap.add_argument("--groups", type=int, default=8, help="KV groups (clusters of 16 blocks)")
    ap.add_argument("--ffn-blocks", type=int, default=128, help="FFN rows / 64 (clusters of 8)")
    args = ap.parse_args()
    global NG, NB
    NG, NB = args.groups, args.ffn_blocks
    if not (1 <= NG <= 8 and CB <= NB <= 128 and NB % CB == 0):
        raise SystemExit("--groups must be 1..8, --ffn-blocks a multiple of 8 up to 128")
    if not 1 <= args.pos < CA * MAXJ:
        raise SystemExit(f"--pos must be in 1..{CA * MAXJ - 1}")
    if args.layers < 1 or args.check < 0:
        raise SystemExit("--layers must be at least 1, --check at least 0")
    cuda = Cuda()
    t = time.time()
    defines = [d for d in args.defines.split(",") if d] + [f"NG={NG}", f"NPARTS={NB // CB}"]
    mod = cuda.compile(SOURCE, "cluster_decode.cu", defines)
    regs = registers(cuda, mod, ("layer_attn", "layer_ffn"))
    print(
        f"{cuda.arch}, {cuda.sms} SMs; compiled in {time.time() - t:.1f} s; "
        f"-D {' '.join(defines)}; registers: layer_attn {regs[0]}, layer_ffn {regs[1]}"
    )
    atom = "ATOM=1" in defines
    if atom and (args.layers < 2 or args.check == 1 or NB < 2 * CB):
        raise SystemExit("ATOM=1 needs --layers and --check of 2 or more, --ffn-blocks >= 16")
    m = Model(cuda, mod, args.layers, args.pos, args.pos + 64, atom)
    fit = m.occupancy()
    print(
        f"{NG} KV groups, {NB * FR} FFN rows; clusters resident at once: layer_attn {fit[0]} of "
        f"{NG} (16 blocks), layer_ffn {fit[1]} of {NB // m.cb} ({m.cb} blocks)"
        + ("" if fit[0] >= NG and fit[1] >= NB // m.cb else " -- the rest wait for a second wave")
    )
    if args.check:
        c = Model(cuda, mod, min(args.check, args.layers), args.pos, args.pos + 8, atom)
        for pdl in (True, False):
            ex = c.graph(pdl)
            cuda.ck(cuda.cu.cuGraphLaunch(ex, c.stream), "cuGraphLaunch")
            cuda.ck(cuda.cu.cuStreamSynchronize(c.stream), "cuStreamSynchronize")
            got, ref = c.result(), c.reference()
            nmse = float(((got - ref) ** 2).sum() / (ref**2).sum())
            print(f"check, {c.layers} layers, pdl {pdl}: NMSE {nmse:.2e} against float64")
            if not nmse < 1e-8:
                raise SystemExit("wrong result")
    probe = StreamRead(cuda)
    na, nb = NG * CA * WA_BYTES * args.layers, NB * WB_BYTES * args.layers
    seconds = (na / probe.best_gb_s(m.wa, na, 10) + nb / probe.best_gb_s(m.wb, nb, 10)) / 1e9
    floor = seconds * 1e6  # µs: the two allocations read one after the other
    big = int(args.probe_gb * 1e9) // 4096 * 4096
    scratch = cuda.upload(None, big)
    gb_s = probe.best_gb_s(scratch, big, 10)  # the read bandwidth of compare_torch.py's floor
    cuda.ck(cuda.cu.cuMemFree_v2(ctypes.c_uint64(scratch)), "cuMemFree")
    print(
        f"{args.layers} layers, {m.nbytes / 1e9:.3f} GB: a plain read of them takes {floor:.1f} µs "
        f"({m.nbytes / seconds / 1e9:.0f} GB/s, {floor / args.layers:.2f} µs per layer); over "
        f"{big / 1e9:.1f} GB the read runs at {gb_s:.0f} GB/s: {m.nbytes / gb_s / 1e3:.1f} µs"
    )
    for pdl in (True, False):
        report(m, pdl, args.reps, floor, m.nbytes / gb_s / 1e3)


if __name__ == "__main__":
    main()
