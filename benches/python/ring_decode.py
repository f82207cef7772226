"""A persistent decode kernel with a weight ring: how close to the read bandwidth can one
launch stream a "1b" decode step's weights when the products' dependencies stay? (design data
for issue 7).

Why: decoded as a chain of kernels, every boundary drains the memory pipe (one kernel's tail,
the next one's first loads, the latency-bound attention between q/k/v and o), and weight loads
issued ahead of a dependency are bounded by the registers of the blocks that fit beside the
running kernel. Here one block per multiprocessor runs the whole step. Warp 0 streams the
block's share of every product's weight rows — in step order, regardless of dependencies
(weights depend on nothing) — into a ring of shared-memory slots with bulk asynchronous copies
(`cp.async.bulk`, completion on an mbarrier per slot); eight warps consume the slots. A product
waits on a counter per phase (each block adds one when its rows of the phase are written; the
next phase waits until every block has), so the ring keeps loading the next products' weights
while a dependency is pending, up to its depth.

The step mimics "1b" (16 layers: q/k/v 3072 x 2048, an attention-like latency phase — 32 blocks
read 18 KB of a cache and q, reduce and write 64 values —, o 2048 x 2048, gate/up 16384 x 2048,
down 2048 x 8192; head 32000 x 2048; f16 weights, f32 vectors): 2.08 GB per step, the bytes of
lowsync's "1b" floor. Products are real (each row's dot product with the previous phase's
output; a few phases are checked against numpy). Settings, one process:

- `plain`: a streaming read of the same bytes (`stream_probe.py`, the bandwidth reference);
- `ring N`: the persistent kernel with an N-slot ring of 16 KB (N 2 ... 13);
- `nodeps N`: the same without waiting on counters (the ring's own floor);
- `drain N`: nodeps, and the consumers release each slot without reading it.

Needs an NVIDIA GPU of compute capability 9.0+, libcuda and libnvrtc on LD_LIBRARY_PATH; no
lowsync wheel. Run: `python benches/python/ring_decode.py --slots 2,4,8,13`.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from attn_kernels import DEVICE_HELPERS, I32, I64, PTR, Cuda
from stream_probe import StreamRead

SLOT = 16384
MAXR = 256  # rows of one phase per block

SOURCE = (
    DEVICE_HELPERS
    + r"""
#define SLOT 16384
#ifndef CW
#define CW 8
#endif
#ifndef SPW
#define SPW 0
#endif
#if SPW
#define NG CW
#endif
#ifndef NG
#define NG 1
#endif
#define GW (CW / NG)
#define VPL (32 / GW)
#ifndef FASTCVT
#define FASTCVT 0
#endif
#ifndef INTERLEAVE
#define INTERLEAVE 0
#endif
// This block's chunks of a phase: contiguous rows [rows*b/G, rows*(b+1)/G) in runs of rps rows,
// or (INTERLEAVE) chunks b, b + G, ... of rps rows. r: first row, n: rows, lr: local row.
#if INTERLEAVE
#define CHUNKS(P, rps) \
    for (int c_ = b, lr = 0; c_ * rps < P.rows; c_ += G, lr += rps)
#define CHUNK_R(P, rps) const int r = c_ * rps, n = min(rps, P.rows - r)
#define LOCAL_ROWS(P, rps) (((P.rows + rps - 1) / rps - b + G - 1) / G * rps)
#define GLOBAL_ROW(i, rps) ((b + ((i) / rps) * G) * rps + (i) % rps)
#else
#define CHUNKS(P, rps) for (int lr = 0; lr < re - rb; lr += rps)
#define CHUNK_R(P, rps) const int r = rb + lr, n = min(rps, re - r)
#define LOCAL_ROWS(P, rps) (re - rb)
#define GLOBAL_ROW(i, rps) (rb + (i))
#endif
#ifndef SPLIT
#define SPLIT 1
#endif
#define MAXR 256
#define TIMEOUT_NS 300000000ull
struct Phase { u64 off; int rows, K, kind, in, out, pad; };
__device__ __forceinline__ bool mbar_try(unsigned bar, unsigned parity) {
    unsigned ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                 " selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    return ok != 0;
}
// Waits for the phase of parity `parity` of the barrier; gives up (setting err) past the timeout.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity, u64 t0, unsigned* err) {
    int n = 0;
    while (!mbar_try(bar, parity)) {
        if (++n == 4096) {
            n = 0;
            if (now() - t0 > TIMEOUT_NS) { atomicOr(err, 1u); return; }
        }
    }
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }"
                 ::"r"(bar) : "memory");
}
// Block b's first row of a phase of `rows` rows (its share: share(b) .. share(b + 1)).
__device__ __forceinline__ int share(int rows, int b, int G) {
    return (int)(((long long)rows * b) / G);
}
// The ring position after a slot: the next slot, and a wrap counted in `use`.
#define NEXT_SLOT()            \
    do {                       \
        if (++slot == nslots) { \
            slot = 0;          \
            ++use;             \
        }                      \
    } while (0)
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" ::"r"(CW * 32) : "memory");
}
#if FASTCVT
// f16 -> f32 by moving the bits (sign, exponent and mantissa shifted into place): the value
// times 2^-112, exact for normal and subnormal halves; the sums are scaled back by CVT_SCALE.
#define CVT_SCALE 5.192296858534828e+33f
__device__ __forceinline__ void unpack(const uint4 v, float (&f)[8]) {
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = __uint_as_float(((u[e] & 0x7fffu) << 13) | ((u[e] & 0x8000u) << 16));
        f[2 * e + 1] = __uint_as_float(((u[e] >> 3) & 0x0fffe000u) | (u[e] & 0x80000000u));
    }
}
#else
#define CVT_SCALE 1.0f
__device__ __forceinline__ void unpack(const uint4 v, float (&f)[8]) {
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = h2f((unsigned short)(u[e] & 0xffffu));
        f[2 * e + 1] = h2f((unsigned short)(u[e] >> 16));
    }
}
#endif
// The chunks (rows r, n rows) of phase P's rows that block b streams: its rows
// [rows*b/G, rows*(b+1)/G) in runs of SLOT bytes.
extern "C" __global__ void __launch_bounds__((CW + 1) * 32, 1) ring(const char* w, const Phase* ph,
        int nphase, float* vec, int vstride, unsigned* cnt, unsigned target, int deps,
        const uint4* kv, unsigned* err, int nslots) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    float* red = (float*)(smem + (size_t)nslots * SLOT);
    __shared__ __align__(8) u64 full[16], empty[16];
    __shared__ float att[CW];
    const int G = gridDim.x, b = blockIdx.x;
    const u64 t0 = now();
    if (threadIdx.x == 0) {
        for (int s = 0; s < nslots; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&full[s])), "r"(1));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&empty[s])), "r"(GW));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // producer
        if (threadIdx.x != 0) return;
        int slot = 0;
        unsigned use = 0;  // how many times the ring has wrapped
        for (int p = 0; p < nphase; ++p) {
            const Phase P = ph[p];
            if (P.kind != 0) continue;
            const int rb = share(P.rows, b, G), re = share(P.rows, b + 1, G);
            const int rowb = P.K * 2, rps = SLOT / rowb;
            CHUNKS(P, rps) {
                CHUNK_R(P, rps);
                const unsigned bytes = (unsigned)(n * rowb);
                if (use > 0) mbar_wait(sa(&empty[slot]), (use - 1) & 1, t0, err);
                const unsigned fb = sa(&full[slot]);
                asm volatile("{ .reg .b64 st;"
                             " mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                             ::"r"(fb), "r"(bytes) : "memory");
                // SPLIT bulk copies per slot (16-byte multiples; the last takes the rest).
                const unsigned part = (bytes / SPLIT) & ~15u;
                for (int k = 0; k < SPLIT; ++k) {
                    const unsigned o = part * k, nb = k + 1 < SPLIT ? part : bytes - o;
                    if (nb == 0) continue;
                    const unsigned dst = sa(ring + (size_t)slot * SLOT + o);
                    const char* src = w + P.off + (u64)r * rowb + o;
                    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                                 " [%0], [%1], %2, [%3];"
                                 ::"r"(dst), "l"(src), "r"(nb), "r"(fb) : "memory");
                }
                NEXT_SLOT();
            }
        }
        return;
    }
    const int ct = threadIdx.x - 32, warp = ct >> 5, lane = ct & 31;
    const int grp = warp / GW, gw = warp % GW;  // NG groups of GW warps take chunks in turn
    int slot = 0;
    unsigned use = 0;
    for (int p = 0; p < nphase; ++p) {
        const Phase P = ph[p];
        if (deps == 1 && p > 0) {
            if (ct == 0) {
                int n = 0;
                while (ld_acquire(cnt + p - 1) < target) {
                    if (++n == 1024) {
                        n = 0;
                        if (now() - t0 > TIMEOUT_NS) { atomicOr(err, 2u); break; }
                    }
                }
            }
            consumers_sync();
        }
        const float* x = vec + (size_t)P.in * vstride;
        float* y = vec + (size_t)P.out * vstride;
#if SPW
        if (P.kind == 0) {
            // A slot per warp (warps take chunks in turn): each of its rows whole (lane: vectors
            // lane + 32 j), the activations staged in shared memory, one butterfly per row.
            float* xs = red;
            for (int i = ct; i < P.K; i += CW * 32) xs[i] = __ldcg(x + i);
            consumers_sync();
            const int kv8 = P.K / 8;
            const int rb = share(P.rows, b, G), re = share(P.rows, b + 1, G);
            const int rps = SLOT / (P.K * 2);
            CHUNKS(P, rps) {
                CHUNK_R(P, rps);
                if (slot % NG != grp) {  // the host keeps nslots a multiple of NG
                    NEXT_SLOT();
                    continue;
                }
                mbar_wait(sa(&full[slot]), use & 1, t0, err);
                if (deps != 2) {
                    const uint4* sl = (const uint4*)(ring + (size_t)slot * SLOT);
                    for (int i = 0; i < n; ++i) {
                        float acc = 0.0f, acc2 = 0.0f;
#pragma unroll 8
                        for (int v = lane; v < kv8; v += 32) {
                            float f[8];
                            unpack(sl[i * kv8 + v], f);
                            const float4 a = *(const float4*)(xs + 8 * v);
                            const float4 c = *(const float4*)(xs + 8 * v + 4);
                            acc = fmaf(f[0], a.x, acc); acc2 = fmaf(f[1], a.y, acc2);
                            acc = fmaf(f[2], a.z, acc); acc2 = fmaf(f[3], a.w, acc2);
                            acc = fmaf(f[4], c.x, acc); acc2 = fmaf(f[5], c.y, acc2);
                            acc = fmaf(f[6], c.z, acc); acc2 = fmaf(f[7], c.w, acc2);
                        }
                        acc += acc2;
#pragma unroll
                        for (int o = 16; o > 0; o >>= 1) {
                            acc += __shfl_xor_sync(0xffffffffu, acc, o);
                        }
                        if (lane == 0) __stcg(y + r + i, acc);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(sa(&empty[slot]));
                NEXT_SLOT();
            }
#else
        if (P.kind == 0) {
            // A slot's 1024 vectors in CW segments, one per warp (VPL per lane): segment w is
            // row (w * SEG) / (K/8) of the slot, from vector (w * SEG) % (K/8) on. Its
            // activation values are the same for every slot of the phase.
            const int SEG = 32 * VPL;
            const int kv8 = P.K / 8, segs = kv8 / SEG;
            const int srow = (SEG * gw) / kv8, col0 = (SEG * gw) % kv8;
            float xr[VPL][8];
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const float4* xp = (const float4*)(x + (col0 + lane + 32 * j) * 8);
                const float4 a = __ldcg(xp), bb = __ldcg(xp + 1);
                xr[j][0] = a.x; xr[j][1] = a.y; xr[j][2] = a.z; xr[j][3] = a.w;
                xr[j][4] = bb.x; xr[j][5] = bb.y; xr[j][6] = bb.z; xr[j][7] = bb.w;
            }
            const int rb = share(P.rows, b, G), re = share(P.rows, b + 1, G);
            const int rps = SLOT / (P.K * 2);
            CHUNKS(P, rps) {
                CHUNK_R(P, rps);
                if (slot % NG != grp) {  // the host keeps nslots a multiple of NG
                    NEXT_SLOT();
                    continue;
                }
                mbar_wait(sa(&full[slot]), use & 1, t0, err);
                if (srow < n && deps != 2) {
                    const uint4* sl = (const uint4*)(ring + (size_t)slot * SLOT) + SEG * gw + lane;
                    uint4 v[VPL];
#pragma unroll
                    for (int j = 0; j < VPL; ++j) v[j] = sl[32 * j];
                    float acc[VPL];
#pragma unroll
                    for (int j = 0; j < VPL; ++j) {
                        float f[8];
                        unpack(v[j], f);
                        acc[j] = 0.0f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[j] = fmaf(f[e], xr[j][e], acc[j]);
                    }
                    float t = 0.0f;
#pragma unroll
                    for (int j = 0; j < VPL; ++j) t += acc[j];
                    t *= CVT_SCALE;
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
                    if (lane == 0) red[(lr + srow) * GW + gw % segs] = t;
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(sa(&empty[slot]));
                NEXT_SLOT();
            }
            consumers_sync();
            for (int i = ct; i < LOCAL_ROWS(P, rps); i += CW * 32) {
                float s = 0.0f;
                for (int k = 0; k < segs; ++k) s += red[i * GW + k];
                if (GLOBAL_ROW(i, rps) < P.rows) __stcg(y + GLOBAL_ROW(i, rps), s);
            }
#endif
        } else if (b < 32) {
            // Attention-like: q (64 values) and 18 KB of cache rows in one round trip, a block
            // sum, 64 outputs.
            const float q = __ldcg(x + b * 64 + (ct & 63));
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < 1152 / (CW * 32) + 1; ++j) {
                const int i = ct + CW * 32 * j;
                if (i < 1152) {
                    float f[8];
                    unpack(__ldcg(kv + (size_t)b * 1152 + i), f);
#pragma unroll
                    for (int e = 0; e < 8; ++e) s += f[e];
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) att[warp] = s;
            consumers_sync();
            float t = 0.0f;
#pragma unroll
            for (int k = 0; k < CW; ++k) t += att[k];
            if (ct < 64) __stcg(y + b * 64 + ct, q * (1.0f + 1e-3f * t));
        }
        consumers_sync();
        if (ct == 0) {
            __threadfence();
            atomicAdd(cnt + p, 1u);
        }
    }
}
// Weights: uniform in [-scale, scale] from a hash of the index.
extern "C" __global__ void fill(unsigned short* w, long long n, float scale, unsigned seed) {
    const long long nth = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nth) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 16; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        const float v = scale * ((float)(h & 0xffffff) / 8388608.0f - 1.0f);
        unsigned short o;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(o) : "f"(v));
        w[i] = o;
    }
}
"""
)


def smem_bytes(slots: int, cw: int, spw: int) -> int:
    """Dynamic shared memory of a `ring` block: the slots, then the partial sums (or, a slot per
    warp, the staged activations of the longest row)."""
    return slots * SLOT + max(MAXR * cw * 4, 8192 * 4 if spw else 0)


def phases_1b(layers: int) -> list[tuple[int, int, int]]:
    """(rows, K, kind) per phase: kind 0 a product, 1 the attention-like phase."""
    out: list[tuple[int, int, int]] = []
    for _ in range(layers):
        out += [(3072, 2048, 0), (0, 0, 1), (2048, 2048, 0), (16384, 2048, 0), (2048, 8192, 0)]
    out.append((32000, 2048, 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--slots", default="2,4,8,13", help="ring depths (16 KB slots), comma list")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20, help="launches per setting")
    ap.add_argument("--rounds", type=int, default=3, help="settings interleaved this many times")
    ap.add_argument(
        "--cw", type=int, default=8, choices=(4, 8, 16), help="consumer warps per block"
    )
    ap.add_argument("--split", type=int, default=1, help="bulk copies per 16 KB slot")
    ap.add_argument(
        "--groups",
        type=int,
        default=1,
        choices=(1, 2, 4),
        help="consumer groups taking slots in turn (consumer warps / groups each)",
    )
    switches = {
        "--fastcvt": "1: f16 to f32 by moving bits instead of cvt",
        "--interleave": "1: a phase's chunks dealt to blocks in turn, not a contiguous share",
        "--spw": "1: a slot per consumer warp (whole rows, no partial sums)",
    }
    for flag, text in switches.items():
        ap.add_argument(flag, type=int, default=0, choices=(0, 1), help=text)
    ap.add_argument("--bps", type=int, default=1, choices=(1, 2), help="blocks per SM")
    args = ap.parse_args()
    if args.cw // args.groups < 4 and not args.spw:
        ap.error("each consumer group needs at least 4 warps (--cw / --groups)")
    owners = args.cw if args.spw else args.groups
    bad = [s for s in args.slots.split(",") if int(s) % owners]
    if bad:
        # A slot always goes to the same consumer (group or warp): a consumer waiting for a
        # later use of a slot than the one pending would see the pending phase's parity as done.
        ap.error(f"--slots {','.join(bad)}: each must be a multiple of {owners} (the consumers)")
    # Every block must be resident at once (they wait on each other): --bps blocks of shared
    # memory per multiprocessor (228 KB on sm_90, 1 KB reserved per block).
    fits = (228 << 10) // args.bps - (1 << 10)
    big = [s for s in args.slots.split(",") if smem_bytes(int(s), args.cw, args.spw) > fits]
    if big:
        ap.error(f"--slots {','.join(big)}: {args.bps} block(s) per SM do not fit")
    cuda = Cuda()
    mod = cuda.compile(
        SOURCE,
        "ring.cu",
        [
            f"CW={args.cw}",
            f"SPLIT={args.split}",
            f"INTERLEAVE={args.interleave}",
            f"NG={args.groups}",
            f"FASTCVT={args.fastcvt}",
            f"SPW={args.spw}",
        ],
    )
    grid = cuda.sms * args.bps
    cw = args.cw
    f_ring, f_fill = (cuda.func(mod, n) for n in ("ring", "fill"))
    probe = StreamRead(cuda)
    spec = phases_1b(args.layers)
    nphase = len(spec)
    vstride = 32768
    table = np.zeros(
        nphase,
        dtype=[
            ("off", "<u8"),
            ("rows", "<i4"),
            ("K", "<i4"),
            ("kind", "<i4"),
            ("in", "<i4"),
            ("out", "<i4"),
            ("pad", "<i4"),
        ],
    )
    off, prev = 0, nphase  # vector nphase: the step's input
    for p, (rows, k, kind) in enumerate(spec):
        table[p] = (off, rows, k, kind, prev, p, 0)
        off += rows * k * 2
        prev = p
    total = off
    w = cuda.upload(None, total)
    for p, (rows, k, kind) in enumerate(spec):
        if kind == 0:
            n = rows * k
            a = [
                PTR(w + int(table[p]["off"])),
                I64(n),
                ctypes.c_float((3.0 / k) ** 0.5),
                ctypes.c_uint32(p * 7919 + 1),
            ]
            cuda.launch(f_fill, 1024, 256, a)
    rng = np.random.default_rng(0)
    vec_host = np.zeros((nphase + 1, vstride), np.float32)
    vec_host[nphase, :2048] = rng.standard_normal(2048).astype(np.float32)
    vec = cuda.upload(vec_host)
    ph = cuda.upload(table)
    cnt = cuda.upload(None, 4 * nphase)
    kv = cuda.upload((rng.standard_normal(32 * 1152 * 8) * 0.01).astype(np.float16))
    err = cuda.upload(None, 4)
    cuda.sync()
    print(
        f"{cuda.arch}, {cuda.sms} SMs; {nphase} phases, {total / 1e9:.3f} GB per step, "
        f"{cw} consumer warps, {args.bps} block(s) per SM, {args.split} bulk copies per slot, "
        f"interleave {args.interleave}, "
        f"{args.groups} consumer group(s), fastcvt {args.fastcvt}"
    )
    smem_attr = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    epoch = [0]

    def launch_ring(slots: int, deps: int) -> None:
        dyn = smem_bytes(slots, cw, args.spw)
        cuda.ck(cuda.cu.cuFuncSetAttribute(f_ring, smem_attr, dyn), "cuFuncSetAttribute")
        epoch[0] += 1
        a = [
            PTR(w),
            PTR(ph),
            I32(nphase),
            PTR(vec),
            I32(vstride),
            PTR(cnt),
            ctypes.c_uint32(epoch[0] * grid),
            I32(deps),
            PTR(kv),
            PTR(err),
            I32(slots),
        ]
        ptrs = (ctypes.c_void_p * len(a))(
            *[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in a]
        )
        cuda.ck(
            cuda.cu.cuLaunchKernel(f_ring, grid, 1, 1, (cw + 1) * 32, 1, 1, dyn, None, ptrs, None),
            "cuLaunchKernel",
        )

    def launch_plain() -> None:
        probe.launch(w, total)

    def timed(fn, *a) -> float:  # type: ignore[no-untyped-def]
        fn(*a)
        cuda.sync()
        t = time.perf_counter()
        for _ in range(args.reps):
            fn(*a)
        cuda.sync()
        return (time.perf_counter() - t) / args.reps * 1e6

    # Correctness: one step, then a few phases against numpy.
    launch_ring(int(args.slots.split(",")[0]), 1)
    cuda.sync()
    e = np.zeros(1, np.uint32)
    cuda.download(err, e)
    out = np.zeros_like(vec_host)
    cuda.download(vec, out)
    worst = 0.0
    for p in sorted({0, 2, 3, 4, nphase - 1} & {q for q in range(nphase) if spec[q][2] == 0}):
        rows, k = int(table[p]["rows"]), int(table[p]["K"])
        wp = np.zeros(rows * k, np.float16)
        cuda.download(w + int(table[p]["off"]), wp)
        xin = out[int(table[p]["in"]), :k].astype(np.float64)
        ref = wp.reshape(rows, k).astype(np.float64) @ xin
        got = out[p, :rows].astype(np.float64)
        nmse = float(np.sum((got - ref) ** 2) / max(np.sum(ref**2), 1e-30))
        worst = max(worst, nmse)
    print(f"check: err flags {int(e[0])}, worst NMSE of 5 phases {worst:.2e}")
    if e[0] != 0 or worst > 1e-8:
        raise SystemExit("ring kernel wrong")

    slots = [int(s) for s in args.slots.split(",")]
    names = ["plain"] + [f"{k} {s}" for k in ("ring", "nodeps", "drain") for s in slots]
    res: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        res["plain"].append(timed(launch_plain))
        for s in slots:
            res[f"ring {s}"].append(timed(launch_ring, s, 1))
            res[f"nodeps {s}"].append(timed(launch_ring, s, 0))
            res[f"drain {s}"].append(timed(launch_ring, s, 2))
    cuda.download(err, e)
    bw = total / min(res["plain"]) / 1e3
    print(f"err flags after timing: {int(e[0])}")
    print(f"plain read: {bw:.0f} GB/s -> floor {total / bw / 1e3:.1f} us per step")
    for n in names:
        us = min(res[n])
        print(
            f"{n:10s} {us:8.1f} us per step (best of {args.rounds}; all "
            f"{', '.join(f'{v:.1f}' for v in res[n])}), {total / us / 1e3:6.0f} GB/s, "
            f"{100 * total / bw / 1e3 / us:5.1f}% of the floor"
        )


if __name__ == "__main__":
    main()
