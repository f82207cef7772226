"""The FFN of a "1b"-shaped decode layer as one kernel or as two (design data for issue 7).

Why: lowsync's decode chain runs a layer's FFN as two kernels, gate/up (with the norm prologue
and SwiGLU) and down (with the residual Add), and down waits for every gate/up block. In
`kernel_trace.py` gate/up and down move a "1b" token's end by ~28 µs per layer for 100.6 MB,
~22 µs of bytes at the read rate. This script measures what the dependency between them costs,
with both designs over the same bytes in one process, as a 16-layer chain of FFNs (each layer's
norm reads the previous layer's result, as q/k/v's does in the decode step):

- `two`: `ffn_gu` (a grid of two blocks per multiprocessor whose warps stride over the FFN rows,
  gate and up row of one FFN row per unit, NPRE 16-byte loads in flight per lane refilled as
  used, the norm prologue and SwiGLU) then `ffn_down` (the same over down's rows, h staged in
  shared memory, the residual added): lowsync's design, with dependent launch.
- `fused`: `ffn_fused`, F / FR = 256 blocks (two per multiprocessor); block b owns FFN rows
  [FR b, FR b + FR): gate and up of those rows (each warp FR / 8 row pairs), then the same FR
  columns of down, stored transposed, so no grid-wide dependency between gate/up and down. Each
  lane's loads run on from gate/up into down. The block's down partials (thread t: columns
  8t .. 8t + 7) are summed first within a cluster of `--cluster` blocks (distributed shared
  memory), then over clusters with fixed-point atomic adds (value * 2^32 in 64 bits: exact and
  order-free, so the result does not depend on the blocks' order); block 0 adds the residual;
  the next layer reads the fixed-point vector, and block 0 of each layer zeroes the accumulator
  the next one adds to. `--layout 1` stores the weights step-major (what the grid reads at one
  step lies in one run), `--layout 0` block by block.

Both are checked against a float64 numpy model. On an H200 (16 layers, 1.61 GB, one process,
rounds alternated): `two` 26.7 µs per layer = 87.5-88.5% of a plain read of the same bytes
(gate/up 15.7 µs, 1.2 µs to down's release, down 8.4); `fused` with clusters of 2 25.8 µs =
91.2-91.3% (gate/up done 14.2 µs after the release, down 21.0, the sums 22.4, the last block
24.7). Without clusters, 512 Ki atomic adds per layer take `fused` to 41.2 µs (blocks end 20.5
to 32.4 µs after the release); clusters of 4 do not all fit at two blocks per multiprocessor
(62 of 64: 32.1 µs). Either layout gives the same time. With 16 loads in flight per lane
(`NPRE=16,MAXNREG=128`) `two` takes 30.2 µs; at 80 registers (`MAXNREG=80`: spills) 34.3.

Needs an NVIDIA GPU (sm_90), libcuda and libnvrtc on LD_LIBRARY_PATH; no lowsync wheel. Run:
`python benches/python/ffn_chain.py` (`--cluster 1`, `--layout 0`, `--defines NPRE=16,...`
for the variants).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from typing import Any

import numpy as np
from attn_kernels import DEVICE_HELPERS, PTR, Cuda
from cluster_decode import CLUSTER_HELPERS, capture, config, registers, replay_us
from stream_probe import StreamRead

D, F, FR, NT = 2048, 8192, 32, 256
EPS = 1e-5
SB = 512  # stamp slots per kernel
NS = 5  # stamps per block

SOURCE = (
    DEVICE_HELPERS
    + r"""
#define D 2048
#define NT 256
#define EPS 1e-5f
#define F 8192  // FFN rows (F and FR are the script's too)
#define FR 32  // FFN rows per ffn_fused block
#ifndef NPRE
#define NPRE 8
#endif
#ifndef MAXNREG
#define MAXNREG 96
#endif
#ifndef TRIGGER_EARLY
#define TRIGGER_EARLY 0
#endif
#define NS 5  // stamp slots per block: entry, release, exit, (ffn_fused) gate/up done, down done
#define NP2 (NPRE / 2)  // chunk pairs in flight per lane
#define RPW (FR / 8)  // gate/up row pairs per warp (ffn_fused)
#define NBLK (F / FR)  // ffn_fused's blocks
#ifndef CL
#define CL 2  // ffn_fused's cluster: partials summed in distributed shared memory first
#endif
#ifndef LAYOUT
#define LAYOUT 1  // ffn_fused's weights: 0 block by block, 1 step-major (pack_fused)
#endif
#define WB (3 * FR * D * 2)  // bytes per ffn_fused block

"""
    + CLUSTER_HELPERS
    + r"""
__device__ __forceinline__ void stamp(u64* st, int slot) {
    if (threadIdx.x == 0 && st) st[blockIdx.x * NS + slot] = now();
}
// The norm: xn = x * rsqrt(mean(x^2) + eps) * w into shared memory; x given per thread as
// columns t + k NT.
__device__ __forceinline__ void norm(const float (&xr)[D / NT], const float* w, float* xn,
                                     float* red) {
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < D / NT; ++k) sq += xr[k] * xr[k];
    const float scale = rsqrtf(block_sum(sq, red) / D + EPS);
#pragma unroll
    for (int k = 0; k < D / NT; ++k) {
        const int i = threadIdx.x + k * NT;
        xn[i] = xr[k] * scale * w[i];
    }
    __syncthreads();
}

// One FFN layer in one kernel. xin: the residual, fixed point; xout: this layer's accumulator
// (zero on entry); zero: the next layer's accumulator, zeroed by block 0 (or null).
extern "C" __global__ void __maxnreg__(MAXNREG) ffn_fused(const uint4* __restrict__ wb,
        const float* __restrict__ fnorm, const long long* xin, unsigned long long* xout,
        unsigned long long* zero, u64* st) {
    __shared__ __align__(16) float xn[D];
    __shared__ float h[FR];
    __shared__ float red[8];
#if CL > 1
    __shared__ __align__(16) float pr[D];  // the cluster's partials of this block's slice
#endif
    const int t = threadIdx.x, lane = t & 31, w = t >> 5, b = blockIdx.x;
    stamp(st, 0);
#if LAYOUT == 0
    // Block b's weights in a row: warp w's RPW row pairs (gate row, up row, ...; chunk q of a
    // row: 32 vectors at q * 32), then its FR rows of down transposed.
    const uint4* gu = wb + (size_t)b * (WB / 16) + (size_t)w * (RPW * 2 * D * 2 / 16) + lane;
    const uint4* dn = wb + (size_t)b * (WB / 16) + (2 * FR * D * 2 / 16) + t;
#define GU_STEP(s, c) (gu + (size_t)((s) >> 3) * (2 * D / 8) + (c) * (D / 8) + ((s) & 7) * 32)
#define DN_STEP(i, c) (dn + (size_t)(2 * (i) + (c)) * (D / 8))
#else
    // Step-major: what every block reads at step s lies in one run (the grid sweeps the
    // weights as a plain read does): gate/up step s of (block b, warp w) at chunk pair
    // (s NBLK + b) 8 + w, then down step i of block b at row pair i NBLK + b.
    const uint4* gu = wb + (size_t)(b * 8 + w) * 64 + lane;
    const uint4* dn = wb + (size_t)NBLK * FR * (D / 4) + (size_t)b * (D / 4) + t;
#define GU_STEP(s, c) (gu + (size_t)(s) * (NBLK * 8 * 64) + (c) * 32)
#define DN_STEP(i, c) (dn + (size_t)(i) * (NBLK * (D / 4)) + (c) * (D / 8))
#endif
    uint4 buf[NP2][2];
#pragma unroll
    for (int k = 0; k < NP2; ++k) {
        buf[k][0] = ldw(GU_STEP(k, 0));
        buf[k][1] = ldw(GU_STEP(k, 1));
    }
    pdl();
    stamp(st, 1);
    float xr[D / NT];
#pragma unroll
    for (int k = 0; k < D / NT; ++k) xr[k] = fx2f(__ldcg(xin + t + k * NT));
    if (b == 0) {
#pragma unroll
        for (int k = 0; k < D / NT; ++k) {
            if (zero) zero[t + k * NT] = 0;
            red_fx(xout + t + k * NT, xr[k]);  // the residual (the adds' order is free)
        }
    }
    norm(xr, fnorm, xn, red);
    float ga = 0.f, ua = 0.f;
#pragma unroll 1
    for (int s0 = 0; s0 < RPW * 8; s0 += NP2) {
#pragma unroll
        for (int k = 0; k < NP2; ++k) {
            const int s = s0 + k, nx = s + NP2;
            const uint4 vg = buf[k][0], vu = buf[k][1];
#pragma unroll
            for (int c = 0; c < 2; ++c)
                buf[k][c] = nx < RPW * 8 ? ldw(GU_STEP(nx, c)) : ldw(DN_STEP(nx - RPW * 8, c));
            const float* xp = xn + ((s & 7) * 32 + lane) * 8;
            ga += dot8(vg, xp);
            ua += dot8(vu, xp);
            if ((s & 7) == 7) {
                ga = warp_sum(ga);
                ua = warp_sum(ua);
                if (lane == 0) h[w * RPW + (s >> 3)] = ga / (1.f + __expf(-ga)) * ua;
                ga = ua = 0.f;
            }
        }
    }
    stamp(st, 3);
    __syncthreads();
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int s0 = 0; s0 < FR / 2; s0 += NP2) {
#pragma unroll
        for (int k = 0; k < NP2; ++k) {
            const int i = s0 + k, nx = i + NP2;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const uint4 v = buf[k][c];
                if (nx < FR / 2) buf[k][c] = ldw(DN_STEP(nx, c));
                axpy8(acc, h[2 * i + c], v);
            }
        }
    }
#undef GU_STEP
#undef DN_STEP
    stamp(st, 4);
#if CL == 1
#pragma unroll
    for (int e = 0; e < 8; ++e) red_fx(xout + 8 * t + e, acc[e]);
#else
    // The cluster's CL partials first: columns 8t .. 8t + 7 go to the block that owns their
    // slice (D / CL columns per rank) through distributed shared memory, then each block adds
    // its slice's CL partials in rank order and sends one atomic add per column.
    {
        const int q = (8 * t) / (D / CL), rank = b % CL;
        const unsigned dst = mapa(sa(pr + rank * (D / CL) + 8 * t - q * (D / CL)), q);
        st_cl4(dst, acc[0], acc[1], acc[2], acc[3]);
        st_cl4(dst + 16, acc[4], acc[5], acc[6], acc[7]);
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
        for (int c = t; c < D / CL; c += NT) {
            float v = 0.f;
#pragma unroll
            for (int r = 0; r < CL; ++r) v += pr[r * (D / CL) + c];
            red_fx(xout + rank * (D / CL) + c, v);
        }
    }
#endif
    stamp(st, 2);
}

// lowsync's design: gate/up with the norm prologue and SwiGLU, warps striding over the FFN
// rows (unit j: gate row j then up row j, 16 chunks of 512 bytes), loads refilled as used
// from this unit's next chunk or the next unit's first.
extern "C" __global__ void __maxnreg__(MAXNREG) ffn_gu(const uint4* __restrict__ gate,
        const uint4* __restrict__ up, const float* __restrict__ fnorm, const float* x,
        float* hout, u64* st) {
    __shared__ __align__(16) float xn[D];
    __shared__ float red[8];
    const int t = threadIdx.x, lane = t & 31;
    const int stride = gridDim.x * (NT / 32);
    int u = blockIdx.x * (NT / 32) + (t >> 5);
    stamp(st, 0);
    // chunk c of unit u: 32 vectors of gate row u and of up row u at c * 32; NP2 chunks in
    // flight, refilled from this unit's next chunk or the next unit's first.
    const uint4* gp = gate + (size_t)(u < F ? u : 0) * (D / 8) + lane;
    const uint4* upp = up + (size_t)(u < F ? u : 0) * (D / 8) + lane;
    uint4 buf[NP2][2];
#pragma unroll
    for (int k = 0; k < NP2; ++k) {
        buf[k][0] = u < F ? ldw(gp + k * 32) : make_uint4(0, 0, 0, 0);
        buf[k][1] = u < F ? ldw(upp + k * 32) : make_uint4(0, 0, 0, 0);
    }
    pdl();
    stamp(st, 1);
    float xr[D / NT];
#pragma unroll
    for (int k = 0; k < D / NT; ++k) xr[k] = __ldcg(x + t + k * NT);
    norm(xr, fnorm, xn, red);
#pragma unroll 1
    for (; u < F; u += stride) {
        const bool more = u + stride < F;
        const uint4* gn = gp + (size_t)stride * (D / 8);
        const uint4* unp = upp + (size_t)stride * (D / 8);
        float ga = 0.f, ua = 0.f;
#pragma unroll 1
        for (int c0 = 0; c0 < 8; c0 += NP2) {
            const bool last = c0 + NP2 >= 8;
#pragma unroll
            for (int k = 0; k < NP2; ++k) {
                const uint4 vg = buf[k][0], vu = buf[k][1];
                if (!last) {
                    buf[k][0] = ldw(gp + (c0 + NP2 + k) * 32);
                    buf[k][1] = ldw(upp + (c0 + NP2 + k) * 32);
                } else if (more) {
                    buf[k][0] = ldw(gn + k * 32);
                    buf[k][1] = ldw(unp + k * 32);
                }
                const float* xp = xn + ((c0 + k) * 32 + lane) * 8;
                ga += dot8(vg, xp);
                ua += dot8(vu, xp);
            }
        }
        ga = warp_sum(ga);
        ua = warp_sum(ua);
        if (lane == 0) hout[u] = ga / (1.f + __expf(-ga)) * ua;
        gp = gn;
        upp = unp;
    }
    stamp(st, 2);
}

// down with the residual Add: warps stride over down's D rows (F values, F / 256 chunks of 512
// bytes), h staged in shared memory.
extern "C" __global__ void __maxnreg__(MAXNREG) ffn_down(const uint4* __restrict__ down,
        const float* h, const float* x, float* xout, u64* st) {
    extern __shared__ __align__(16) float hs[];  // [F]
    const int t = threadIdx.x, lane = t & 31;
    const int stride = gridDim.x * (NT / 32);
    const int NC = F / 256;  // chunks per row
    int u = blockIdx.x * (NT / 32) + (t >> 5);
    stamp(st, 0);
    const uint4* rp = down + (size_t)(u < D ? u : 0) * (F / 8) + lane;
    uint4 buf[NPRE];
#pragma unroll
    for (int k = 0; k < NPRE; ++k) buf[k] = u < D ? ldw(rp + k * 32) : make_uint4(0, 0, 0, 0);
    pdl();
    stamp(st, 1);
    for (int i = t; i < F / 4; i += NT) ((float4*)hs)[i] = __ldcg((const float4*)h + i);
    __syncthreads();
#pragma unroll 1
    for (; u < D; u += stride) {
        const bool more = u + stride < D;
        const uint4* rn = rp + (size_t)stride * (F / 8);
        float a = 0.f;
#pragma unroll 1
        for (int c0 = 0; c0 < NC; c0 += NPRE) {
            const bool last = c0 + NPRE >= NC;
#pragma unroll
            for (int k = 0; k < NPRE; ++k) {
                const uint4 v = buf[k];
                if (!last) {
                    buf[k] = ldw(rp + (c0 + NPRE + k) * 32);
                } else if (more) {
                    buf[k] = ldw(rn + k * 32);
                }
                a += dot8(v, hs + ((c0 + k) * 32 + lane) * 8);
            }
        }
        rp = rn;
        a = warp_sum(a);
        if (lane == 0) xout[u] = x[u] + a;
    }
    stamp(st, 2);
}

extern "C" __global__ void init_f16(unsigned short* w, long long n, unsigned long long seed,
        float s) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long z = (unsigned long long)i * 0x9E3779B97F4A7C15ull + seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        w[i] = f2h(u * s);
    }
}
"""
)

Matrix = np.ndarray[Any, Any]


def pack_fused(gate: Matrix, up: Matrix, down: Matrix, layout: int = 1, fr: int = FR) -> Matrix:
    """ffn_fused's weights (flat). Block b owns FFN rows [fr b, fr b + fr); warp w of it the fr / 8
    row pairs from fr b + (fr / 8) w, each read as 8 chunk pairs (512 bytes of gate and of up at
    the same columns), then the block's fr columns of down, transposed, two rows per step.
    Layout 0: block by block (pairs with gate row then up row, then down's rows). Layout 1
    (step-major): gate/up step s (pair s // 8, chunk s % 8) of every (block, warp), then down
    step i (rows 2i, 2i + 1) of every block. gate/up [F, D], down [D, F]."""
    f, d = gate.shape
    nb, rpw = f // fr, fr // 8
    dt = np.ascontiguousarray(down.T)  # [F, D]
    if layout == 0:
        gu = np.stack([gate, up], axis=1).reshape(nb, 2 * fr * d)
        return np.concatenate([gu, dt.reshape(nb, fr * d)], axis=1).reshape(-1)
    g = np.stack([gate, up], axis=-2).reshape(nb, 8, rpw, 2, 8, d // 8)
    g = g.transpose(2, 4, 0, 1, 3, 5)  # pair, chunk, block, warp, gate/up, 256 values
    dn = dt.reshape(nb, fr // 2, 2, d).transpose(1, 0, 2, 3)  # step, block, row, values
    return np.concatenate([g.reshape(-1), dn.reshape(-1)])


def unpack_fused(
    w: Matrix, f: int, d: int, layout: int = 1, fr: int = FR
) -> tuple[Matrix, Matrix, Matrix]:
    """gate, up, down from `pack_fused`'s layout."""
    nb, rpw = f // fr, fr // 8
    if layout == 0:
        wb = w.reshape(nb, 3 * fr, d)
        gu = wb[:, : 2 * fr].reshape(nb * fr, 2, d)
        return gu[:, 0], gu[:, 1], wb[:, 2 * fr :].reshape(nb * fr, d).T
    g = w[: 2 * f * d].reshape(rpw, 8, nb, 8, 2, d // 8).transpose(2, 3, 0, 4, 1, 5)
    g = g.reshape(f, 2, d)
    dn = w[2 * f * d :].reshape(fr // 2, nb, 2, d).transpose(1, 0, 2, 3).reshape(f, d)
    return g[:, 0], g[:, 1], dn.T


class Chain:
    """L FFN layers, both designs over the same weight values (each in its own layout)."""

    def __init__(
        self,
        cuda: Cuda,
        mod: ctypes.c_void_p,
        layers: int,
        pads: tuple[int, int],
        layout: int,
        cluster: int,
    ):
        self.cuda, self.L, self.cluster = cuda, layers, cluster
        self.pad_fused, self.pad_down = pads  # dynamic shared memory per block (bytes)
        cu = cuda.cu
        self.fused = cuda.func(mod, "ffn_fused")
        self.gu, self.down = cuda.func(mod, "ffn_gu"), cuda.func(mod, "ffn_down")
        for f, smem in ((self.fused, self.pad_fused), (self.down, self.pad_down)):
            cuda.ck(cu.cuFuncSetAttribute(f, 8, smem), "max dynamic smem")
        self.layer_bytes = 3 * F * D * 2
        # two: per layer gate [F, D], up [F, D], down [D, F]; fused: its packed layout
        self.w2 = cuda.upload(None, layers * self.layer_bytes)
        self.wf = cuda.upload(None, layers * self.layer_bytes)
        init = cuda.func(mod, "init_f16")
        n = layers * self.layer_bytes // 2
        args = [PTR(self.w2), ctypes.c_int64(n), ctypes.c_uint64(7), ctypes.c_float(3**0.5)]
        cuda.launch(init, cuda.sms * 8, 256, args)
        cuda.sync()
        # scale: gate/up rows by 1 / sqrt(D), down by 1 / sqrt(F) (done on the host copy)
        self.host: list[tuple[Matrix, Matrix, Matrix]] = []
        for layer in range(layers):
            raw = np.zeros(3 * F * D, np.float16)
            cuda.download(self.w2 + layer * self.layer_bytes, raw)
            g = (raw[: F * D].astype(np.float32) / D**0.5).astype(np.float16).reshape(F, D)
            u = (raw[F * D : 2 * F * D].astype(np.float32) / D**0.5).astype(np.float16)
            dn = (raw[2 * F * D :].astype(np.float32) / F**0.5).astype(np.float16)
            u, dn = u.reshape(F, D), dn.reshape(D, F)
            self.host.append((g, u, dn))
            two = np.concatenate([g.reshape(-1), u.reshape(-1), dn.reshape(-1)])
            self._put(self.w2 + layer * self.layer_bytes, two)
            self._put(self.wf + layer * self.layer_bytes, pack_fused(g, u, dn, layout))
        rng = np.random.default_rng(3)
        self.fnorm = (1 + 0.1 * rng.standard_normal((layers, D))).astype(np.float32)
        self.x0 = rng.standard_normal(D).astype(np.float32)
        self.d_fnorm = cuda.upload(self.fnorm)
        # two: x_0 .. x_L (f32); h scratch per layer
        xs = np.zeros((layers + 1, D), np.float32)
        xs[0] = self.x0
        self.d_x = cuda.upload(xs)
        self.d_h = cuda.upload(None, layers * F * 4)
        # fused: fixed-point x_0 then the layers' accumulators
        fx = np.zeros((layers + 1, D), np.int64)
        fx[0] = (self.x0.astype(np.float64) * 2.0**32).astype(np.int64)
        self.d_fx = cuda.upload(fx)
        self.d_st = cuda.upload(None, 2 * layers * SB * NS * 8)
        self.stream = ctypes.c_void_p()
        cuda.ck(cu.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")
        cuda.sync()

    def _put(self, ptr: int, a: Matrix) -> None:
        b = np.ascontiguousarray(a)
        self.cuda.ck(
            self.cuda.cu.cuMemcpyHtoD_v2(
                ctypes.c_uint64(ptr), ctypes.c_void_p(b.ctypes.data), ctypes.c_size_t(b.nbytes)
            ),
            "HtoD",
        )

    def enqueue(self, design: str, pdl: bool) -> None:
        L, grid = self.L, 2 * self.cuda.sms
        for layer in range(L):
            st = self.d_st + 2 * layer * SB * NS * 8
            first = pdl and layer > 0
            if design == "fused":
                # the first layer zeroes its own accumulator before the chain (a plain launch)
                acc = self.d_fx + (layer + 1) * D * 8
                nxt = self.d_fx + (layer + 2) * D * 8 if layer + 1 < L else 0
                a = [PTR(self.wf + layer * self.layer_bytes), PTR(self.d_fnorm + layer * D * 4)]
                a += [PTR(self.d_fx + layer * D * 8), PTR(acc), PTR(nxt), PTR(st)]
                self._launch(self.fused, F // FR, self.pad_fused, first, a, self.cluster)
            else:
                base = self.w2 + layer * self.layer_bytes
                x = self.d_x + layer * D * 4
                h = self.d_h + layer * F * 4
                a = [PTR(base), PTR(base + F * D * 2), PTR(self.d_fnorm + layer * D * 4)]
                a += [PTR(x), PTR(h), PTR(st)]
                self._launch(self.gu, grid, 0, first, a)
                b = [PTR(base + 2 * F * D * 2), PTR(h), PTR(x)]
                b += [PTR(self.d_x + (layer + 1) * D * 4), PTR(st + SB * NS * 8)]
                self._launch(self.down, grid, self.pad_down, pdl, b)

    def _launch(
        self, f: Any, grid: int, smem: int, pdl: bool, args: list[Any], cl: int = 1
    ) -> None:
        cfg, _keep = config(grid, smem, cl, pdl, self.stream)
        ptrs = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args]
        )
        self.cuda.ck(
            self.cuda.cu.cuLaunchKernelEx(ctypes.byref(cfg), f, ptrs, None), "cuLaunchKernelEx"
        )

    def clusters_resident(self) -> int:
        n = ctypes.c_int()
        cfg, _keep = config(F // FR, self.pad_fused, self.cluster, False, self.stream)
        self.cuda.ck(
            self.cuda.cu.cuOccupancyMaxActiveClusters(
                ctypes.byref(n), self.fused, ctypes.byref(cfg)
            ),
            "cuOccupancyMaxActiveClusters",
        )
        return n.value

    def zero_first(self) -> None:
        z = np.zeros(D, np.int64)
        self._put(self.d_fx + D * 8, z)

    def graph(self, design: str, pdl: bool) -> ctypes.c_void_p:
        return capture(self.cuda, self.stream, lambda: self.enqueue(design, pdl))

    def run(self, design: str, ex: ctypes.c_void_p, reps: int) -> list[float]:
        """µs per replay (events around each); the fused chain's first accumulator is zeroed
        before each."""
        zero = self.zero_first if design == "fused" else None
        return replay_us(self.cuda, self.stream, ex, reps, zero)

    def result(self, design: str) -> Matrix:
        if design == "fused":
            fx = np.zeros(D, np.int64)
            self.cuda.download(self.d_fx + self.L * D * 8, fx)
            x: Matrix = fx.astype(np.float64) / 2.0**32
            return x
        out = np.zeros(D, np.float32)
        self.cuda.download(self.d_x + self.L * D * 4, out)
        return out.astype(np.float64)

    def reference(self) -> Matrix:
        x = self.x0.astype(np.float64)
        for layer, (g, u, dn) in enumerate(self.host):
            xn = x / np.sqrt((x * x).mean() + EPS) * self.fnorm[layer]
            gv, uv = g.astype(np.float64) @ xn, u.astype(np.float64) @ xn
            x = x + dn.astype(np.float64) @ (gv / (1 + np.exp(-gv)) * uv)
        return x

    def stamps(self) -> np.ndarray[Any, Any]:
        out = np.zeros(2 * self.L * SB * NS, np.uint64)
        self.cuda.download(self.d_st, out)
        return out.reshape(self.L, 2, SB, NS).astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="designs alternated this many times")
    ap.add_argument("--defines", default="", help="comma list of -D for the kernels")
    ap.add_argument(
        "--pad-kb",
        default="80,80",
        help="shared memory per block of ffn_fused and of ffn_down, KiB (80: two per SM)",
    )
    ap.add_argument("--cluster", type=int, default=2, help="ffn_fused's cluster: 1, 2, 4 or 8")
    ap.add_argument("--layout", type=int, default=1, help="ffn_fused's weights: 0 or 1")
    args = ap.parse_args()
    try:
        pf, pd = (int(v) * 1024 for v in args.pad_kb.split(","))
    except ValueError:
        raise SystemExit("--pad-kb must be two integers, e.g. 80,80") from None
    if args.layers < 1 or args.reps < 1 or args.rounds < 1:
        raise SystemExit("--layers, --reps and --rounds must be at least 1")
    if args.cluster not in (1, 2, 4, 8) or args.layout not in (0, 1):
        raise SystemExit("--cluster must be 1, 2, 4 or 8 and --layout 0 or 1")
    if not (0 <= pf <= 200 * 1024 and 0 <= pd <= 200 * 1024):
        raise SystemExit("--pad-kb values must be in 0..200")
    cuda = Cuda()
    t = time.time()
    defines = [d for d in args.defines.split(",") if d]
    defines += [f"CL={args.cluster}", f"LAYOUT={args.layout}"]
    mod = cuda.compile(SOURCE, "ffn_chain.cu", defines)
    regs = registers(cuda, mod, ("ffn_fused", "ffn_gu", "ffn_down"))
    print(
        f"{cuda.arch}, {cuda.sms} SMs; compiled in {time.time() - t:.1f} s; -D {defines}; "
        f"registers: ffn_fused {regs[0]}, ffn_gu {regs[1]}, ffn_down {regs[2]}"
    )
    c = Chain(cuda, mod, args.layers, (pf, max(pd, F * 4)), args.layout, args.cluster)
    fit = c.clusters_resident()
    print(
        f"ffn_fused: {F // FR} blocks in clusters of {args.cluster}; clusters resident at once: "
        f"{fit} of {F // FR // args.cluster}"
        + ("" if fit * args.cluster >= F // FR else " -- the rest wait for a second wave")
    )
    ref = c.reference()
    for design in ("two", "fused"):
        for pdl in (True, False):
            if design == "fused":
                c.zero_first()
            ex = c.graph(design, pdl)
            cuda.ck(cuda.cu.cuGraphLaunch(ex, c.stream), "cuGraphLaunch")
            cuda.ck(cuda.cu.cuStreamSynchronize(c.stream), "cuStreamSynchronize")
            got = c.result(design)
            nmse = float(((got - ref) ** 2).sum() / (ref**2).sum())
            print(f"check {design}, pdl {pdl}: NMSE {nmse:.2e} against float64")
            if not nmse < 1e-8:
                raise SystemExit("wrong result")
    probe = StreamRead(cuda)
    nbytes = args.layers * c.layer_bytes
    gb_s = max(probe.best_gb_s(c.w2, nbytes, 10), probe.best_gb_s(c.wf, nbytes, 10))
    floor = nbytes / gb_s / 1e3
    print(
        f"{args.layers} layers, {nbytes / 1e9:.3f} GB: a plain read takes {floor:.1f} µs "
        f"({gb_s:.0f} GB/s, {floor / args.layers:.2f} µs per layer)"
    )
    graphs = {d: c.graph(d, True) for d in ("two", "fused")}
    times: dict[str, list[float]] = {"two": [], "fused": []}
    for _ in range(args.rounds):
        for d, ex in graphs.items():
            times[d] += c.run(d, ex, args.reps)
    for d in ("two", "fused"):
        us = float(np.median(times[d]))
        print(
            f"{d:5s}: {us:7.1f} µs per {args.layers} layers = {us / args.layers:5.2f} per layer "
            f"= {floor / us * 100:5.1f}% of the read"
        )
    # where a layer's time goes (the last replay of each design, stamps)
    for d, ex in graphs.items():
        c.run(d, ex, 1)
        st = c.stamps()
        if d == "fused":
            rel = [s[0, : F // FR] for s in st]
            span = np.median([r[:, 2].max() - r[:, 1].max() for r in rel]) / 1e3
            ex_p = np.median(np.array([r[:, 2] - r[:, 1].max() for r in rel]), axis=0) / 1e3
            pc = " ".join(f"{x:.1f}" for x in np.percentile(ex_p, [0, 10, 50, 90, 100]))
            print(f"fused: per layer release -> last exit {span:.2f} µs; exits {pc}")
            for name, k in (("gate/up done", 3), ("down done", 4)):
                v = np.median(np.array([r[:, k] - r[:, 1].max() for r in rel]), axis=0) / 1e3
                pc = " ".join(f"{x:.1f}" for x in np.percentile(v, [0, 10, 50, 90, 100]))
                print(f"  {name} after the release, min p10 p50 p90 max: {pc}")
        else:
            g = [s[0, : 2 * cuda.sms] for s in st]
            dn = [s[1, : 2 * cuda.sms] for s in st]
            a = np.median([x[:, 2].max() - x[:, 1].max() for x in g]) / 1e3
            b = np.median([y[:, 1].max() - x[:, 2].max() for x, y in zip(g, dn, strict=True)]) / 1e3
            e = np.median([y[:, 2].max() - y[:, 1].max() for y in dn]) / 1e3
            print(f"two: per layer gate/up {a:.2f} µs, -> down release {b:.2f}, down {e:.2f}")
            for name, x in (("gate/up", g), ("down", dn)):
                v = np.median(np.array([r[:, 2] - r[:, 1].max() for r in x]), axis=0) / 1e3
                pc = " ".join(f"{y:.1f}" for y in np.percentile(v, [0, 10, 50, 90, 100]))
                print(f"  {name} exits after the release, min p10 p50 p90 max: {pc}")


if __name__ == "__main__":
    main()
