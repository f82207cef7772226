// The sampler after the output head: `penalize` and `sample`, one block per row.
//
// Why: a seeded run must draw the same token here as on the CPU oracle, which follows
// `lowsync_graph::sampling` (read it first). So nothing is sorted: every truncation is a
// threshold on the order key of the f32 bits, found by bisection over the u32 keys with exact
// counts (top-k) or block sums of exp(x - max) (top-p), and the draw is the Gumbel-max trick
// with the same counter-based Philox noise per element, reduced with ties to the lowest index.
// The block's threads take the row in strided loops; every reduction returns its result to
// every thread, so all threads take the same branches of the bisections.
//
// What may differ from the oracle: expf / logf round differently by an ulp, and top-p's sums
// run in another order, which moves a decision only for candidates within that rounding of
// each other. Floats are IEEE (division and the accurate expf / logf, no fast-math), and a
// product that feeds a sum is written __fmul_rn so that NVRTC does not fuse it into an FMA,
// which would round differently from the oracle.

// Philox4x32 multipliers and key increments (Salmon et al., SC'11; as sampling.rs).
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

// Philox4x32 with 10 rounds: four counter words under a two-word key.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const u32 hi0 = __umulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
        const u32 hi1 = __umulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// The uniform of element i of a row keyed (seed, counter): sampling.rs `uniform`.
__device__ __forceinline__ float smp_uniform(u32 seed, u32 counter, u32 i) {
    const u32 w = philox4x32_10(make_uint4(i, counter, 0u, 0u), seed, 0u).x;
    // At most 1 - 2^-24: the top bucket's centre rounds to 1.0 (Gumbel +inf).
    return fminf(((float)(w >> 8) + 0.5f) * (1.0f / 16777216.0f), 0.99999994f);
}

// Standard Gumbel noise -ln(-ln(u)): sampling.rs `gumbel`.
__device__ __forceinline__ float smp_gumbel(float u) { return -logf(-logf(u)); }

// sampling.rs `order_key`: order-preserving f32 -> u32, NaN (only NaN) 0.
__device__ __forceinline__ u32 smp_key(float x) {
    if (x != x) return 0u;
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
// The value of a non-zero key (the inverse of smp_key).
__device__ __forceinline__ float smp_key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ u32 smp_umax(u32 a, u32 b) { return a > b ? a : b; }
__device__ __forceinline__ u32 smp_umin(u32 a, u32 b) { return a < b ? a : b; }

// Block-wide u32 reductions (op 0: sum, 1: max, 2: min) for blockDim.x a multiple of 32; every
// thread gets the result. The leading barrier lets a caller reuse them back to back.
__device__ __forceinline__ u32 smp_op(u32 a, u32 b, int op) {
    return op == 0 ? a + b : (op == 1 ? smp_umax(a, b) : smp_umin(a, b));
}
__device__ __forceinline__ u32 smp_warp_u32(u32 v, int op) {
    for (int o = 16; o > 0; o >>= 1) v = smp_op(v, __shfl_xor_sync(0xffffffffu, v, o), op);
    return v;
}
__device__ u32 smp_block_u32(u32 v, int op) {
    __shared__ u32 sh[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = smp_warp_u32(v, op);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : (op == 2 ? 0xffffffffu : 0u);
    return smp_warp_u32(v, op);
}

// The best (value, index) pair of the block by `better` (common.cuh: larger value, NaN below
// every number, lower index on ties), in every thread.
__device__ void smp_block_best(float& bv, i64& bi) {
    __shared__ float sv[32];
    __shared__ i64 si[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    argmax_warp(bv, bi);
    __syncthreads();
    if (lane == 0) {
        sv[w] = bv;
        si[w] = bi;
    }
    __syncthreads();
    bv = lane < nw ? sv[lane] : __int_as_float(0x7fc00000);
    bi = lane < nw ? si[lane] : (i64)0x7fffffff;
    argmax_warp(bv, bi);
}

// dst = x with llama.cpp's penalties (sampling.rs `penalize_row`): for each distinct id t of
// hist[r] inside [0, len), seen c times, x = x <= 0 ? x * repeat : x / repeat, then
// x -= c * frequency + presence; params[r] = (repeat, frequency, presence). The row is copied
// first; after a barrier, one thread per history slot updates its id, if the slot holds the
// id's first occurrence (so each id is written once, by one thread).
extern "C" __global__ void __launch_bounds__(1024) penalize(i64 rows, i64 len, i64 n_hist,
                                                            float* dst, i64 d_rs, i64 d_cs,
                                                            const float* x, i64 x_rs, i64 x_cs,
                                                            const int* hist, i64 h_rs, i64 h_cs,
                                                            const float* prm, i64 p_rs, i64 p_cs) {
    pdl_entry();
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* dr = dst + r * d_rs;
        const float* xr = x + r * x_rs;
        const int* hr = hist + r * h_rs;
        for (i64 c = threadIdx.x; c < len; c += blockDim.x) dr[c * d_cs] = xr[c * x_cs];
        __syncthreads();
        const float repeat = prm[r * p_rs], frequency = prm[r * p_rs + p_cs],
                    presence = prm[r * p_rs + 2 * p_cs];
        for (i64 j = threadIdx.x; j < n_hist; j += blockDim.x) {
            const int t = hr[j * h_cs];
            if (t < 0 || (i64)t >= len) continue;
            bool first = true;
            for (i64 q = 0; q < j && first; ++q) first = hr[q * h_cs] != t;
            if (!first) continue;
            int c = 0;
            for (i64 q = j; q < n_hist; ++q) c += hr[q * h_cs] == t;
            float v = xr[(i64)t * x_cs];
            v = v <= 0.0f ? __fmul_rn(v, repeat) : v / repeat;
            dr[(i64)t * d_cs] = v - __fadd_rn(__fmul_rn((float)c, frequency), presence);
        }
    }
}

// One token per row (sampling.rs `sample_row`): dst[r] = the drawn index of x[r, :len), with
// params[r] = (temperature, top_k, top_p, min_p) and key[r] = (seed, counter). 32-bit indices
// (the host checks len < 2^31).
extern "C" __global__ void __launch_bounds__(1024) sample(i64 rows, i64 len, int* dst, i64 d_s,
                                                          const float* x, i64 x_rs, i64 x_cs,
                                                          const float* prm, i64 p_rs, i64 p_cs,
                                                          const int* key, i64 k_rs, i64 k_cs) {
    pdl_entry();
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int tid = threadIdx.x, bd = blockDim.x;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * x_rs;
        const float temperature = prm[r * p_rs], top_k = prm[r * p_rs + p_cs],
                    top_p = prm[r * p_rs + 2 * p_cs], min_p = prm[r * p_rs + 3 * p_cs];
        const u32 seed = (u32)key[r * k_rs], counter = (u32)key[r * k_rs + k_cs];

        // 1. The largest key, exactly; m is its value.
        u32 km = 0;
        for (i64 c = tid; c < len; c += bd) km = smp_umax(km, smp_key(xr[c * x_cs]));
        km = smp_block_u32(km, 1);
        const float m = smp_key_value(km);

        // 2. No draw (greedy, NaN temperature, nothing finite): the argmax rule.
        if (!(temperature > 0.0f) || km == 0u || m == NEG_INF) {
            float bv = __int_as_float(0x7fc00000);
            i64 bi = len;
            for (i64 c = tid; c < len; c += bd) {
                const float v = xr[c * x_cs];
                if (better(v, c, bv, bi)) {
                    bv = v;
                    bi = c;
                }
            }
            smp_block_best(bv, bi);
            if (tid == 0) dst[r * d_s] = bi >= len ? 0 : (int)bi;
            continue;
        }

        // Every cut is a key threshold; 1 admits every non-NaN value.
        u32 cut = 1u;

        // 3. top-k (sampling.rs `top_k_count`: truncated toward zero, kept when 1 <= k < len):
        // the k-th largest key, i.e. the largest T with count(key >= T) >= k. count(>= 0) is
        // len >= k, so the bisection starts valid at 0.
        const double tk = (double)top_k;
        if (tk >= 1.0 && tk < (double)len) {
            const u32 k = (u32)tk;
            u32 lo = 0u, hi = km;
            while (lo < hi) {
                const u32 mid = (u32)(((u64)lo + hi + 1) >> 1);
                u32 n = 0;
                for (i64 c = tid; c < len; c += bd) n += smp_key(xr[c * x_cs]) >= mid;
                n = smp_block_u32(n, 0);
                if (n >= k) {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            cut = smp_umax(cut, lo);
        }

        // 4. top-p: Z = the mass of the kept values; the largest T in [cut, km] whose values
        // and every larger one hold at least top_p * Z. Each thread sums its values in a fixed
        // order, so mass(key >= T) never grows with T and the bisection is sound; a target that
        // rounding leaves out of reach (or NaN) keeps the cut (as sampling.rs `top_p_cut`).
        if (top_p < 1.0f) {
            float z = 0.0f;
            for (i64 c = tid; c < len; c += bd) {
                const float v = xr[c * x_cs];
                if (smp_key(v) >= cut) z += expf(v - m);
            }
            z = block_sum(z);
            const float target = top_p * z;
            u32 lo = cut, hi = km;
            while (lo < hi) {
                const u32 mid = (u32)(((u64)lo + hi + 1) >> 1);
                float mass = 0.0f;
                for (i64 c = tid; c < len; c += bd) {
                    const float v = xr[c * x_cs];
                    if (smp_key(v) >= mid) mass += expf(v - m);
                }
                mass = block_sum(mass);
                if (mass >= target) {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            cut = lo;
        }

        // 5. min-p: keep x >= m + ln(min_p).
        if (min_p > 0.0f) cut = smp_umax(cut, smp_key(m + logf(min_p)));
        // The maximum is always kept (min_p > 1 would otherwise cut above it).
        cut = smp_umin(cut, km);

        // 6. The Gumbel-max draw over the kept values. sampling.rs scans in index order and takes
        // the first kept value, then any later one whose score is larger: so the token is the
        // first kept index when its score is NaN (nothing is larger than NaN), else the best
        // score by `better` (NaN scores lose, ties go to the lowest index). The maximum always
        // passes the cut, so something is kept; -1 would mean a broken invariant.
        float bv = __int_as_float(0x7fc00000);
        i64 bi = len;
        u32 first = 0xffffffffu, first_nan = 0u;
        for (i64 c = tid; c < len; c += bd) {
            const float v = xr[c * x_cs];
            if (smp_key(v) < cut) continue;
            const float s = (v - m) / temperature + smp_gumbel(smp_uniform(seed, counter, (u32)c));
            if ((u32)c < first) {
                first = (u32)c;
                first_nan = s != s;
            }
            if (better(s, c, bv, bi)) {
                bv = s;
                bi = c;
            }
        }
        smp_block_best(bv, bi);
        const u32 first_all = smp_block_u32(first, 2);
        first_nan = smp_block_u32(first == first_all ? first_nan : 0u, 1);
        if (tid == 0) {
            int t = (int)bi;
            if (first_all == 0xffffffffu) {
                t = -1;
            } else if (first_nan) {
                t = (int)first_all;
            }
            dst[r * d_s] = t;
        }
    }
}
