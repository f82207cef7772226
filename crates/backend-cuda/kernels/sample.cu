// The sampler after the output head: `penalize` and `sample`, one block per row.
//
// Why: a seeded run must draw the same token here as on the CPU oracle, which follows
// `lowsync_graph::sampling` (read it first). So nothing is sorted: every truncation is a
// threshold on the order key of the f32 bits, found by bisection over the u32 keys with exact
// counts (top-k) or block sums of exp(x - max) (top-p), and the draw is the Gumbel-max trick
// with the same counter-based Philox noise per element, reduced with ties to the lowest index.
// The block's threads take the row in strided loops; every reduction returns its result to
// every thread, so all threads take the same branches of the bisections. Each bisection is
// about 32 passes over the row; when top-k leaves at most SMP_CAND candidates, they are packed
// into shared memory and top-p, min-p and the draw read only them (top-p then without a
// bisection: each candidate's mass is summed directly).
//
// What may differ from the oracle: expf / logf round differently by an ulp, and top-p's sums
// run in another order, which moves a decision only for candidates within that rounding of
// each other. Floats are IEEE (division and the accurate expf / logf, no fast-math), and every
// product or inlined expf / logf result that feeds a sum goes through __fmul_rn / __fadd_rn so
// that NVRTC does not fuse the two into an FMA, which rounds once where the oracle rounds twice.

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
    return fminf(__fmul_rn(__fadd_rn((float)(w >> 8), 0.5f), 1.0f / 16777216.0f), 0.99999994f);
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

// The exclusive prefix sum of v over the block's threads in thread order (deterministic: it
// fixes where each thread's candidates land when a row is packed).
__device__ u32 smp_block_excl_scan(u32 v) {
    __shared__ u32 sh[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u32 inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = (u32)__shfl_up_sync(0xffffffffu, (int)inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();
    if (lane == 31) sh[w] = inc;
    __syncthreads();
    u32 base = 0;
    for (int j = 0; j < w; ++j) base += sh[j];
    return base + inc - v;
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

// Candidates a row is packed into after top-k when at most this many remain (shared memory).
#define SMP_CAND 1024

// One token per row (sampling.rs `sample_row`): dst[r] = the drawn index of x[r, :len), with
// params[r] = (temperature, top_k, top_p, min_p) and key[r] = (seed, counter). 32-bit indices
// (the host checks len < 2^31).
extern "C" __global__ void __launch_bounds__(1024) sample(i64 rows, i64 len, int* dst, i64 d_s,
                                                          const float* x, i64 x_rs, i64 x_cs,
                                                          const float* prm, i64 p_rs, i64 p_cs,
                                                          const int* key, i64 k_rs, i64 k_cs) {
    pdl_entry();
    // The packed row: values, indices and exp(value - max) of the candidates (see step 3).
    __shared__ float cv[SMP_CAND];
    __shared__ u32 ci[SMP_CAND];
    __shared__ float ce[SMP_CAND];
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
        // Whether the candidates (key >= cut) sit in cv / ci, n_c of them.
        bool packed = false;
        u32 n_c = 0;

        // 3. top-k (sampling.rs `top_k_count`: truncated toward zero, kept when 1 <= k < len):
        // the k-th largest key, i.e. the largest T with count(key >= T) >= k. count(>= 0) is
        // len >= k, so the bisection starts valid at 0.
        const double tk = (double)top_k;
        if (tk >= 1.0 && tk < (double)len) {
            const u32 k = (u32)tk;
            u32 lo = 0u, hi = km, n_lo = (u32)len;  // n_lo = count(key >= lo)
            while (lo < hi) {
                const u32 mid = (u32)(((u64)lo + hi + 1) >> 1);
                u32 n = 0;
                for (i64 c = tid; c < len; c += bd) n += smp_key(xr[c * x_cs]) >= mid;
                n = smp_block_u32(n, 0);
                if (n >= k) {
                    lo = mid;
                    n_lo = n;
                } else {
                    hi = mid - 1;
                }
            }
            cut = smp_umax(cut, lo);
            // A small k leaves few candidates: pack them into shared memory (each thread's in
            // its loop order, at its exclusive prefix of the counts), so that the later steps
            // read n_c values instead of the row. The order is fixed by the block size, so
            // every run sums top-p's masses alike.
            if (lo >= 1u && n_lo <= SMP_CAND) {
                u32 mine = 0;
                for (i64 c = tid; c < len; c += bd) mine += smp_key(xr[c * x_cs]) >= cut;
                u32 at = smp_block_excl_scan(mine);
                for (i64 c = tid; c < len; c += bd) {
                    const float v = xr[c * x_cs];
                    if (smp_key(v) >= cut) {
                        cv[at] = v;
                        ci[at] = (u32)c;
                        ++at;
                    }
                }
                packed = true;
                n_c = n_lo;
                __syncthreads();
            }
        }

        // 4. top-p: Z = the mass of the kept values; the largest T in [cut, km] whose values
        // and every larger one hold at least top_p * Z. Each thread sums its values in a fixed
        // order, so mass(key >= T) never grows with T and the bisection is sound; a target that
        // rounding leaves out of reach (or NaN) keeps the cut (as sampling.rs `top_p_cut`).
        if (top_p < 1.0f && packed) {
            // On the packed row, directly: every thread sums exp(x - m) of all candidates in
            // slot order (so all get the same Z), and for each of its candidates j the mass of
            // the candidates with key >= key_j, in the same order (so the masses never grow
            // with the key); the cut is the largest key_j whose mass reaches the target.
            for (u32 j = tid; j < n_c; j += bd) ce[j] = expf(cv[j] - m);
            __syncthreads();
            float z = 0.0f;
            for (u32 i = 0; i < n_c; ++i) z = __fadd_rn(z, ce[i]);
            const float target = top_p * z;
            u32 best = cut;
            for (u32 j = tid; j < n_c; j += bd) {
                const u32 kj = smp_key(cv[j]);
                if (kj <= best) continue;
                float mass = 0.0f;
                for (u32 i = 0; i < n_c; ++i) {
                    if (smp_key(cv[i]) >= kj) mass = __fadd_rn(mass, ce[i]);
                }
                if (mass >= target) best = kj;
            }
            cut = smp_block_u32(best, 1);
        } else if (top_p < 1.0f) {
            float z = 0.0f;
            for (i64 c = tid; c < len; c += bd) {
                const float v = xr[c * x_cs];
                if (smp_key(v) >= cut) z = __fadd_rn(z, expf(v - m));
            }
            z = block_sum(z);
            const float target = top_p * z;
            u32 lo = cut, hi = km;
            while (lo < hi) {
                const u32 mid = (u32)(((u64)lo + hi + 1) >> 1);
                float mass = 0.0f;
                for (i64 c = tid; c < len; c += bd) {
                    const float v = xr[c * x_cs];
                    if (smp_key(v) >= mid) mass = __fadd_rn(mass, expf(v - m));
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
        if (min_p > 0.0f) cut = smp_umax(cut, smp_key(__fadd_rn(m, logf(min_p))));
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
        auto draw = [&](i64 c, float v) {
            if (smp_key(v) < cut) return;
            const float s =
                __fadd_rn((v - m) / temperature, smp_gumbel(smp_uniform(seed, counter, (u32)c)));
            if ((u32)c < first) {
                first = (u32)c;
                first_nan = s != s;
            }
            if (better(s, c, bv, bi)) {
                bv = s;
                bi = c;
            }
        };
        if (packed) {
            for (u32 j = tid; j < n_c; j += bd) draw((i64)ci[j], cv[j]);
        } else {
            for (i64 c = tid; c < len; c += bd) draw(c, xr[c * x_cs]);
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
