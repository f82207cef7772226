// lowsync's CUDA kernels on the CPU: just enough of CUDA's device language for the kernels in
// ../kernels to compile as C++ and run with one std::thread per CUDA thread.
//
// Why: CI has no GPU. The kernels' logic — indexing, tails, masks, reductions, shared-memory
// layouts, the order of writes the fusion rules rely on — is checked here against float64
// references on every CI run; timing and the memory model are not (the GPU suite is).
//
// Strategy: blocks run one after another (so a `__shared__` variable, made `static`, is one
// block's), the threads of a block concurrently; `__syncthreads` is a barrier of the block and
// `__shfl_xor_sync` one of the warp (every lane of the warp must take part, as the kernels
// ensure). Inline PTX sits behind `__CUDA_ARCH__` in the kernels, except the f16 conversions,
// which scripts/kernel_emu.sh replaces by `emu_h2f` / `emu_f2h` when it copies common.cuh.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 blockDim, gridDim;

#define __device__
#define __forceinline__ inline
#define __noinline__
#define __global__
#define __grid_constant__
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
#define __maxnreg__(...)
#define __shared__ static

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};

inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline int __float_as_int(float f) {
    int u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float emu_h2f(unsigned short h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}
inline unsigned short emu_f2h(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    memcpy(&h, &x, 2);
    return h;
}
template <class T>
T min(T a, T b) {
    return a < b ? a : b;
}
inline void sincos(double a, double* s, double* c) {
    *s = std::sin(a);
    *c = std::cos(a);
}
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
template <class T>
inline T __ldg(const T* p) {
    return *p;
}

template <class T>
inline T __ldcg(const T* p) {
    return *p;
}

inline std::unique_ptr<std::barrier<>> emu_block;
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warps;
inline float emu_lanes[1024];

inline void __syncthreads() { emu_block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warps[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int t = (int)threadIdx.x, w = t / 32;
    emu_lanes[t] = v;
    emu_warps[w]->arrive_and_wait();
    const float r = emu_lanes[(t & ~31) | ((t & 31) ^ off)];
    emu_warps[w]->arrive_and_wait();
    return r;
}
// Lane i reads lane src(i)'s int (its own where src is outside the warp, as __shfl_up_sync).
inline int emu_ilanes[1024];
template <class Src>
inline int emu_shfl_int(int v, Src src) {
    const int t = (int)threadIdx.x, w = t / 32, s = src(t & 31);
    emu_ilanes[t] = v;
    emu_warps[w]->arrive_and_wait();
    const int r = s >= 0 && s < 32 ? emu_ilanes[(t & ~31) | s] : v;
    emu_warps[w]->arrive_and_wait();
    return r;
}
inline int __shfl_up_sync(unsigned, int v, int off) {
    return emu_shfl_int(v, [off](int lane) { return lane - off; });
}
inline int __shfl_sync(unsigned, int v, int src) {
    return emu_shfl_int(v, [src](int) { return src; });
}
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int off) {
    return (unsigned)emu_shfl_int((int)v, [off](int lane) { return lane ^ off; });
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// Integer and rounding intrinsics of the sampler (kernels/sample.cu). Plain C++ float
// arithmetic is IEEE round-to-nearest without contraction here (-std=c++20 sets
// -ffp-contract=off), which is what the _rn forms promise on the device.
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// The integer intrinsics of the quantized products (quant.cuh), as the CUDA Math API documents
// them. `__byte_perm(x, y, s)`: byte n of the result is byte (s >> 4n) & 7 of the 8 bytes
// y:x (x's bytes 0..3, y's 4..7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
// `__dp2a_lo(a, b, c)`: c plus the products of a's two signed 16-bit halves with the signed
// bytes 0 and 1 of b (low half with byte 0); `__dp2a_hi` takes b's bytes 2 and 3. Wraps modulo
// 2^32 as the device's 32-bit adds.
inline int emu_dp2a(int a, int b, int c, int sh) {
    const long long lo = (long long)(short)(a & 0xFFFF) * (signed char)((b >> sh) & 0xFF);
    const long long hi = (long long)(short)((unsigned)a >> 16) * (signed char)((b >> (sh + 8)) & 0xFF);
    return (int)(unsigned)((unsigned long long)(long long)c + (unsigned long long)(lo + hi));
}
inline int __dp2a_lo(int a, int b, int c) { return emu_dp2a(a, b, c, 0); }
inline int __dp2a_hi(int a, int b, int c) { return emu_dp2a(a, b, c, 16); }
// `__dp4a(a, b, c)`: c plus the products of the four signed bytes of a with those of b (byte i
// with byte i). Wraps modulo 2^32 as the device's 32-bit adds.
inline int __dp4a(int a, int b, int c) {
    long long s = 0;
    for (int i = 0; i < 4; ++i) s += (long long)(signed char)((a >> (8 * i)) & 0xFF) * (signed char)((b >> (8 * i)) & 0xFF);
    return (int)(unsigned)((unsigned long long)(long long)c + (unsigned long long)s);
}
inline int emu_votes[1024];
inline unsigned __ballot_sync(unsigned, int pred) {
    const int t = (int)threadIdx.x, w = t / 32;
    emu_votes[t] = pred != 0;
    emu_warps[w]->arrive_and_wait();
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= (unsigned)emu_votes[(t & ~31) | i] << i;
    emu_warps[w]->arrive_and_wait();
    return r;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long val) {
    std::atomic_ref<unsigned long long> a(*p);
    unsigned long long old = a.load();
    while (old < val && !a.compare_exchange_weak(old, val)) {
    }
    return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned val) { return std::atomic_ref<unsigned>(*p).fetch_add(val); }
// Blocks run one at a time here, so a fence has nothing to order against another block; it is a
// fence of the block's threads all the same.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned val) {
    std::atomic_ref<unsigned> a(*p);
    unsigned c = cmp;
    a.compare_exchange_strong(c, val);
    return c;
}

// The wait of programmatic dependent launch (`pdl_entry` under LOWSYNC_EMU). With a hook
// installed it is a barrier of the block around the hook, called by thread 0: where a test of a
// rehearsing kernel checks that nothing was stored yet and swaps stale inputs for the real
// ones. Without one it is nothing (kernels whose threads do not all wait run as before).
inline std::function<void()> emu_on_wait;
inline void emu_pdl_wait() {
    if (!emu_on_wait) return;
    emu_block->arrive_and_wait();
    if (threadIdx.x == 0) emu_on_wait();
    emu_block->arrive_and_wait();
}

// The order `launch` runs blocks in: ascending, or (when a test sets it) emu_block_order[i]
// for i = 0, 1, ... — for kernels whose result must not depend on which block runs last.
inline std::vector<unsigned> emu_block_order;

// Runs `f` as a grid of `grid` blocks of `block` threads (block a multiple of 32, <= 1024).
template <class F>
void launch(unsigned grid, unsigned block, F f) {
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned i = 0; i < grid; ++i) {
        const unsigned b = emu_block_order.size() == grid ? emu_block_order[i] : i;
        emu_block = std::make_unique<std::barrier<>>(block);
        emu_warps.clear();
        for (unsigned w = 0; w < block / 32; ++w) emu_warps.push_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([=] {
                threadIdx.x = t;
                blockIdx.x = b;
                f();
            });
        }
        for (auto& t : threads) t.join();
    }
}

#include "common.h"
