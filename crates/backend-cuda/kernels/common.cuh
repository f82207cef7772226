// lowsync CUDA kernels: shared prelude (prepended to every module before NVRTC compiles it).
//
// No headers: NVRTC is used without include paths, so f16/bf16 conversions are written here
// (PTX cvt for f16, bit arithmetic with round-to-nearest-even for bf16, as the `half` crate).
// Every tensor is addressed through a dtype code and element strides; arithmetic is f32.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// A module kernels.rs compiles in parts (`PARTS`, `-DLOWSYNC_PART=n`) keeps only the kernels
// between `#if LS_PART(n)` and its `#endif`, so its parts compile side by side; compiled whole
// (no LOWSYNC_PART, as the CPU emulation does), every kernel.
#ifdef LOWSYNC_PART
#define LS_PART(n) (LOWSYNC_PART == (n))
#else
#define LS_PART(n) 1
#endif

#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2
#define DT_I32 3
#define MAXD 8

// Layout of up to 3 tensors that share one iteration shape (after broadcasting and coalescing
// on the host). Matches `Lay` in src/layout.rs.
struct Lay {
    i64 nd;
    i64 shape[MAXD];
    i64 st[3][MAXD];
};

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float ld(const void* p, int dt, i64 i) {
    switch (dt) {
        case DT_F32: return ((const float*)p)[i];
        case DT_F16: return h2f(((const u16*)p)[i]);
        case DT_BF16: return bf2f(((const u16*)p)[i]);
        default: return (float)((const int*)p)[i];
    }
}
__device__ __forceinline__ void st(void* p, int dt, i64 i, float v) {
    switch (dt) {
        case DT_F32: ((float*)p)[i] = v; break;
        case DT_F16: ((u16*)p)[i] = f2h(v); break;
        case DT_BF16: ((u16*)p)[i] = f2bf(v); break;
        default: ((int*)p)[i] = (int)v; break;
    }
}

// Element offsets (in elements) of flat row-major index `i` for the first `n` tensors of `L`.
__device__ __forceinline__ void lay_offsets(const Lay& L, i64 i, int n, i64* o) {
    o[0] = 0; o[1] = 0; o[2] = 0;
    for (int ax = (int)L.nd - 1; ax >= 0; --ax) {
        i64 d = L.shape[ax];
        i64 c = i % d;
        i /= d;
        for (int t = 0; t < n; ++t) o[t] += c * L.st[t][ax];
    }
}

// Batch axes of the matrix-vector kernels (matmul.cu, quant.cu).
#define MB_MAXD 4

// Output batch axes: st[t] / div[t] are the element strides and GQA divisors of dst, a, b
// (operand index along an axis = batch index / div; stride 0 where the operand is broadcast).
// Matches `MmBatch` in src/exec/matmul.rs. Shared by matmul.cu and quant.cu (whose b strides are
// bytes: see there).
struct MmBatch {
    i64 nd;
    i64 shape[MB_MAXD];
    i64 st[3][MB_MAXD];
    i64 div[3][MB_MAXD];
};

__device__ __forceinline__ void mm_batch_offsets(const MmBatch& B, i64 bt, i64* o) {
    o[0] = 0; o[1] = 0; o[2] = 0;
    for (int ax = (int)B.nd - 1; ax >= 0; --ax) {
        i64 d = B.shape[ax];
        i64 c = bt % d;
        bt /= d;
        for (int t = 0; t < 3; ++t) o[t] += (c / B.div[t][ax]) * B.st[t][ax];
    }
}

// Reports the first bad index of a launch into the host-mapped error word (the host reads it
// after its next wait and names the node from `tag`).
__device__ __forceinline__ void report(u32* err, u32 tag) { atomicCAS(err, 0u, tag); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    return warp_sum(v);
}
__device__ float block_max(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -__int_as_float(0x7f800000);
    return warp_max(v);
}

// Phase marks for `benches/python/attn_kernels.py`, which compiles the module itself with
// PHASE_MARKS defined: thread 0 of block 0 records clock64() at mark n, and thread 0 of every
// block its %globaltimer at entry and exit. The backend's build leaves them empty.
#ifdef PHASE_MARKS
__device__ unsigned long long phase_clk[16];
__device__ unsigned long long phase_g[2 * 1024];
__device__ __forceinline__ void phase_time(int slot) {
    if (threadIdx.x == 0 && blockIdx.x < 1024) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        phase_g[2 * blockIdx.x + slot] = t;
    }
}
#define PHASE(n)                                                            \
    do {                                                                    \
        if (threadIdx.x == 0 && blockIdx.x == 0) phase_clk[n] = clock64(); \
    } while (0)
#define PHASE_ENTRY() phase_time(0)
#define PHASE_EXIT()     \
    do {                 \
        __syncthreads(); \
        phase_time(1);   \
    } while (0)
#else
#define PHASE(n)
#define PHASE_ENTRY()
#define PHASE_EXIT()
#endif

// Programmatic dependent launch (compute capability 9.0+; no-ops on older devices and in a
// launch that did not ask for it). Every kernel calls `pdl_entry` before it reads or writes
// memory another kernel may use — only weights (see `DevBuf::weights`) may be read before it —
// and on every path, so that its completion implies that of the kernels before it.
// `griddepcontrol.wait` returns once the grids this one depends on have completed and their
// writes are visible; `launch_dependents` then lets the next kernel's blocks start (they wait
// in turn), so at most one kernel runs ahead of its producer.
//
// A kernel launched early may also rehearse (`attn_fast` does): run its own path once before
// the wait, on whatever its inputs hold then, with every global store off, so that the
// instructions of the real pass are in the multiprocessor's instruction cache when the wait
// returns (these kernels run each instruction about once per warp; fetching them is much of
// their time). The rehearsal reads activations and the KV cache through `ld_cg` only, in both
// passes, so no line it brought into L1 can be read by the real pass. The CPU emulation
// (LOWSYNC_EMU) makes the wait a block barrier with a hook, where its tests swap stale inputs
// for the real ones. (Rehearsing matrix-vector kernels measured slower on the H200: the loop
// keeps the loaded weights live across both passes, 128 registers instead of 80, and the first
// wave's extra staging competes with the producer's tail.)
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#elif defined(LOWSYNC_EMU)
    emu_pdl_wait();
#endif
}

// A ticket's integer add at GPU scope with release and acquire semantics, by one thread of a
// block that has just passed a barrier (`__syncthreads`) after its threads' stores: the release
// covers every store the barrier ordered before it, and a block whose add sees the others'
// (the last to arrive) reads their stores after its own barrier. One trip to L2 where a fence by
// every thread and a relaxed atomic took two. The CPU emulation's atomics are sequentially
// consistent, which is stronger.
__device__ __forceinline__ unsigned ticket_add(unsigned* p, unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
#else
    return atomicAdd(p, v);
#endif
}

// Argmax order (the `argmax` kernel and decode's head): a larger value wins, the lower index
// on ties, NaN below every number (an all-NaN row gives index 0).
__device__ __forceinline__ bool better(float v, i64 i, float bv, i64 bi) {
    bool vn = v != v, bn = bv != bv;
    if (vn != bn) return bn;  // a number beats NaN
    if (vn) return i < bi;
    return v > bv || (v == bv && i < bi);
}
// The best of a warp's (value, index) pairs, in every lane (an xor butterfly; `better` is a
// total order on distinct indices, so the result does not depend on the order). Indices
// travel as 32-bit words: the host launches rows shorter than 2^31.
__device__ __forceinline__ void argmax_warp(float& bv, i64& bi) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const i64 oi = (i64)__float_as_int(__shfl_xor_sync(0xffffffffu, __int_as_float((int)bi), off));
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
}

// The key of decode's head argmax (matmul.cu's `mul_mat_vec_1_argmax`, quant.cu's
// `mul_mat_vec_q_argmax`): u64 keys order (value, row) pairs as `better` does — a larger
// value, then the lower row, NaN below every number, -0 equal to +0 — so the largest key of a
// row's pairs names the `argmax` kernel's index; 0 is below every key. Rows below 2^31.
__device__ __forceinline__ u64 argmax_key(float v, i64 row) {
    u32 o = 0u;  // NaN: below every number
    if (v == v) {
        const u32 b = __float_as_uint(v == 0.0f ? 0.0f : v);
        o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    }
    return ((u64)o << 32) | (u64)(0xFFFFFFFFu - (u32)row);
}

// Loads of data an earlier kernel writes, in code a rehearsal runs: cached in L2 only (the
// point of coherence), never in L1.
__device__ __forceinline__ float ld_cg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ uint4 ld_cg(const uint4* p) { return __ldcg(p); }

// A 16-byte load of a weight for decode's matrix-vector kernels: read-only path, no L1
// allocation. A token streams every weight byte through L2 once (gigabytes against tens of
// megabytes of L2). An evict-first L2 policy on this load (meant to keep what is reused —
// activations, KV rows, kernel code — resident) measured slower on the H200 and was dropped.
__device__ __forceinline__ uint4 ld_weight(const uint4* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
#else
    return __ldg(p);
#endif
}

// Matrix-vector helpers shared by matmul.cu and the fused products (src/fusion/gemv.cu).
// 16 loaded bytes of a weight as floats: 4 f32 or 8 f16/bf16, in memory order.
template <int DT>
__device__ __forceinline__ void unpack16(uint4 w, float* f) {
    if (DT == DT_F32) {
        f[0] = __uint_as_float(w.x); f[1] = __uint_as_float(w.y);
        f[2] = __uint_as_float(w.z); f[3] = __uint_as_float(w.w);
    } else {
        u32 p[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (DT == DT_F16) {
                f[2 * i] = h2f((u16)(p[i] & 0xffffu));
                f[2 * i + 1] = h2f((u16)(p[i] >> 16));
            } else {
                f[2 * i] = __uint_as_float(p[i] << 16);
                f[2 * i + 1] = __uint_as_float(p[i] & 0xffff0000u);
            }
        }
    }
}

// acc[r][c] += a[r, k0 .. k0+VW) . bf[c][..] for the rows r < mt of this pass, products in k
// order. `avec`: a's rows are 16-byte aligned at k0 (float4 loads), else scalar loads.
template <int VW, int NC, int MT>
__device__ __forceinline__ void mmv_k_fma(float (&acc)[MT][NC], const float (&bf)[NC][VW],
                                          const float* ab, i64 a_rs, int mt, i64 k0, bool avec) {
#pragma unroll
    for (int r = 0; r < MT; ++r) {
        if (r < mt) {
            const float* ar = ab + r * a_rs + k0;
            float av[VW];
            if (avec) {
#pragma unroll
                for (int q = 0; q < VW / 4; ++q) {
                    float4 x = ((const float4*)ar)[q];
                    av[4 * q] = x.x; av[4 * q + 1] = x.y; av[4 * q + 2] = x.z; av[4 * q + 3] = x.w;
                }
            } else {
#pragma unroll
                for (int e = 0; e < VW; ++e) av[e] = ar[e];
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
#pragma unroll
                for (int e = 0; e < VW; ++e) acc[r][c] = fmaf(av[e], bf[c][e], acc[r][c]);
            }
        }
    }
}

// The "split" staging of a row for 16-bit weights, whose lanes each take 8 adjacent values per
// 16-byte weight load: of every 8 values, the first 4 go to a low half and the last 4 to a high
// half (ng = K / 8 groups; values past 8 * ng keep their index), so a warp's two float4 reads
// per weight load are 16 bytes apart lane to lane (no shared-memory bank conflict) instead of
// 32 (two-way). `split_slot` is element i's slot.
__device__ __forceinline__ i64 split_slot(i64 i, i64 ng) {
    return i < ng * 8 ? ((i & 4) ? ng * 4 : 0) + (i >> 3) * 4 + (i & 3) : i;
}

// One pass of MT rows of a against NC weight rows wr[c] (k contiguous, DT) by lane gl of a
// group of G lanes: acc[r][c] = the lane's share of a[r, :] . wr[c], before the group's xor
// butterfly. The lane takes the 16-byte vectors gl, gl + G, ... — U of each row in flight at
// a time when `vec` (every row start 16-byte aligned), else the same elements by scalar loads
// in the same order — then the k % VW tail, one element per lane. Shared by mul_mat_vec_k and
// fused_gemv, so both sum in one order.
template <int DT, int NC, int MT, int U>
__device__ __forceinline__ void mmv_k_pass(float (&acc)[MT][NC], const char* const (&wr)[NC], i64 K,
                                           int G, int gl, int vec, const float* ab, i64 a_rs,
                                           int mt) {
    const int VW = DT == DT_F32 ? 4 : 8;
    const i64 nvec = K / VW;
#pragma unroll
    for (int r = 0; r < MT; ++r) {
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
    }
    i64 v = gl;
    if (vec) {
        if (U > 1) {
            for (; v + (U - 1) * G < nvec; v += U * G) {
                uint4 w[U][NC];
#pragma unroll
                for (int u = 0; u < U; ++u) {
#pragma unroll
                    for (int c = 0; c < NC; ++c) w[u][c] = ((const uint4*)wr[c])[v + u * G];
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    float bf[NC][VW];
#pragma unroll
                    for (int c = 0; c < NC; ++c) unpack16<DT>(w[u][c], bf[c]);
                    mmv_k_fma<VW, NC, MT>(acc, bf, ab, a_rs, mt, (v + u * G) * VW, true);
                }
            }
        }
        for (; v < nvec; v += G) {
            float bf[NC][VW];
#pragma unroll
            for (int c = 0; c < NC; ++c) unpack16<DT>(((const uint4*)wr[c])[v], bf[c]);
            mmv_k_fma<VW, NC, MT>(acc, bf, ab, a_rs, mt, v * VW, true);
        }
    } else {
        for (; v < nvec; v += G) {
            float bf[NC][VW];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
#pragma unroll
                for (int e = 0; e < VW; ++e) bf[c][e] = ld(wr[c], DT, v * VW + e);
            }
            mmv_k_fma<VW, NC, MT>(acc, bf, ab, a_rs, mt, v * VW, false);
        }
    }
    for (i64 kk = nvec * VW + gl; kk < K; kk += G) {
        float bf[NC][1];
#pragma unroll
        for (int c = 0; c < NC; ++c) bf[c][0] = ld(wr[c], DT, kk);
        mmv_k_fma<1, NC, MT>(acc, bf, ab, a_rs, mt, kk, false);
    }
}

// Copies x[0, K) (f32, 16-byte aligned; written by an earlier kernel, so plain loads, not the
// read-only path) into shared xs — in the split layout when `split` — with every thread's
// 16-byte loads in flight at once (four per pass), then waits for the whole block. Every
// thread must call it.
__device__ __forceinline__ void stage_row(float* xs, const float* x, i64 K, bool split) {
    const int n4 = (int)(K / 4);
    const int ng = split ? (int)(K / 8) : 0;
    const float4* x4 = (const float4*)x;
    float4* s4 = (float4*)xs;
    // Float4 i of x (values 4i .. 4i+3) in the split layout: half i % 2 of group i / 2.
    auto slot = [&](int i) { return i < 2 * ng ? ((i & 1) ? ng : 0) + (i >> 1) : i; };
    const int bd = blockDim.x;
    int i = threadIdx.x;
#pragma unroll 1
    for (; i + 3 * bd < n4; i += 4 * bd) {
        const float4 a0 = x4[i], a1 = x4[i + bd];
        const float4 a2 = x4[i + 2 * bd], a3 = x4[i + 3 * bd];
        s4[slot(i)] = a0;
        s4[slot(i + bd)] = a1;
        s4[slot(i + 2 * bd)] = a2;
        s4[slot(i + 3 * bd)] = a3;
    }
#pragma unroll 1
    for (; i < n4; i += bd) s4[slot(i)] = x4[i];
#pragma unroll 1
    for (i64 j = (i64)n4 * 4 + threadIdx.x; j < K; j += bd) xs[j] = x[j];
    __syncthreads();
}

// The 8 staged values of 16-byte weight load v (VW == 8: split layout; VW == 4: plain).
template <int VW>
__device__ __forceinline__ void staged_x(const float* xs, i64 v, i64 nvec, float* xa) {
    float4 a, b;
    if (VW == 8) {
        a = ((const float4*)xs)[v];
        b = ((const float4*)xs)[nvec + v];
    } else {
        a = ((const float4*)xs)[v];
    }
    xa[0] = a.x; xa[1] = a.y; xa[2] = a.z; xa[3] = a.w;
    if (VW == 8) {
        xa[4] = b.x; xa[5] = b.y; xa[6] = b.z; xa[7] = b.w;
    }
}

// The VW activation values of 16-byte weight load v: from the staged row (`staged_x`) or
// straight from global memory (x 16-byte aligned).
template <int VW>
__device__ __forceinline__ void decode_x(const float* xr, i64 v, i64 nvec, int staged, float* xa) {
    if (staged) {
        staged_x<VW>(xr, v, nvec, xa);
        return;
    }
    const float4* xv = (const float4*)(xr + v * VW);
#pragma unroll
    for (int e = 0; e < VW / 4; ++e) {
        const float4 a4 = xv[e];
        xa[4 * e] = a4.x; xa[4 * e + 1] = a4.y; xa[4 * e + 2] = a4.z; xa[4 * e + 3] = a4.w;
    }
}

// One f32 row x[0, n) and weight row w, NV values per thread (n <= NV * blockDim.x): each
// thread's values of both, in flight together, and 1 / sqrt(mean(x^2) + eps) over the block.
// The short path of decode's norms (no dtype switch, 32-bit indices; rms_norm_mul and the
// fused products' norm prologue). Every thread must call it. The first `nt` threads (a
// multiple of 32, at most blockDim.x) take elements t, t + nt, ... into xv and wv; the others
// get zeros and add nothing, so the sum, and its bits, depend on nt, not on blockDim.x.
template <int NV>
__device__ __forceinline__ float row_rms_f32(const float* x, const float* w, int n, float eps,
                                             float (&xv)[NV], float (&wv)[NV], int nt) {
    float s = 0.0f;
    const bool in = (int)threadIdx.x < nt;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int i = threadIdx.x + j * nt;
        xv[j] = in && i < n ? x[i] : 0.0f;
        wv[j] = in && i < n ? w[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) s += xv[j] * xv[j];
    s = block_sum(s);
    return 1.0f / sqrtf(s / (float)n + eps);
}
