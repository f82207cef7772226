// Row reductions: rms_norm, soft_max, argmax. One block per row; `L` iterates the rows (all
// axes but the last): st[0] = dst, st[1] = x, st[2] = mask (broadcast strides, soft_max only).

extern "C" __global__ void rms_norm(i64 rows, i64 len, Lay L, void* dst, int dtd, i64 d_cs,
                                    const void* x, int dtx, i64 x_cs, float eps) {
    pdl_entry();
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 o[3];
        lay_offsets(L, r, 2, o);
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < len; c += blockDim.x) {
            float v = ld(x, dtx, o[1] + c * x_cs);
            s += v * v;
        }
        s = block_sum(s);
        float inv = 1.0f / sqrtf(s / (float)len + eps);
        for (i64 c = threadIdx.x; c < len; c += blockDim.x) {
            st(dst, dtd, o[0] + c * d_cs, ld(x, dtx, o[1] + c * x_cs) * inv);
        }
        __syncthreads();
    }
}

// softmax(x * scale + mask); a row with no finite maximum (all -inf) gives zeros, and a row
// holding a NaN gives NaNs (fmaxf skips NaN, so the row's NaNs are counted on their own: an
// all-NaN row must not look fully masked).
extern "C" __global__ void soft_max(i64 rows, i64 len, Lay L, void* dst, int dtd, i64 d_cs,
                                    const void* x, int dtx, i64 x_cs, const void* mask, int dtm,
                                    i64 m_cs, int has_mask, float scale) {
    pdl_entry();
    const float NEG_INF = -__int_as_float(0x7f800000);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 o[3];
        lay_offsets(L, r, has_mask ? 3 : 2, o);
        float mx = NEG_INF;
        float has_nan = 0.0f;
        for (i64 c = threadIdx.x; c < len; c += blockDim.x) {
            float v = ld(x, dtx, o[1] + c * x_cs) * scale;
            if (has_mask) v += ld(mask, dtm, o[2] + c * m_cs);
            mx = fmaxf(mx, v);
            if (v != v) has_nan = 1.0f;
        }
        mx = block_max(mx);
        has_nan = block_max(has_nan);
        if (has_nan != 0.0f || mx == NEG_INF) {
            const float fill = has_nan != 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
            for (i64 c = threadIdx.x; c < len; c += blockDim.x) st(dst, dtd, o[0] + c * d_cs, fill);
            __syncthreads();
            continue;
        }
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < len; c += blockDim.x) {
            float v = ld(x, dtx, o[1] + c * x_cs) * scale;
            if (has_mask) v += ld(mask, dtm, o[2] + c * m_cs);
            s += expf(v - mx);
        }
        s = block_sum(s);
        float inv = 1.0f / s;
        for (i64 c = threadIdx.x; c < len; c += blockDim.x) {
            float v = ld(x, dtx, o[1] + c * x_cs) * scale;
            if (has_mask) v += ld(mask, dtm, o[2] + c * m_cs);
            st(dst, dtd, o[0] + c * d_cs, expf(v - mx) * inv);
        }
        __syncthreads();
    }
}

// soft_max for rows of at most 32 * SMR_V values, one warp per row (prefill's attention
// scores: 16k rows of a few hundred per layer at pp512). The block-wide kernel above spent its
// time in three block reductions per row and in reading the row three times; here a lane keeps
// its values (columns lane, lane + 32, ...) in registers, the warp reduces by shuffles, and the
// row is read once and written once. Same results as `soft_max` up to the order of the sum.
#define SMR_V 32
extern "C" __global__ void soft_max_rows(i64 rows, i64 len, Lay L, void* dst, int dtd, i64 d_cs,
                                         const void* x, int dtx, i64 x_cs, const void* mask,
                                         int dtm, i64 m_cs, int has_mask, float scale) {
    pdl_entry();
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    for (i64 r = (i64)blockIdx.x * wpb + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * wpb) {
        i64 o[3];
        lay_offsets(L, r, has_mask ? 3 : 2, o);
        float v[SMR_V];
        float mx = NEG_INF;
        bool nan = false;
#pragma unroll
        for (int u = 0; u < SMR_V; ++u) {
            const i64 c = lane + 32 * u;
            v[u] = NEG_INF;
            if (c < len) {
                float t = ld(x, dtx, o[1] + c * x_cs) * scale;
                if (has_mask) t += ld(mask, dtm, o[2] + c * m_cs);
                v[u] = t;
                mx = fmaxf(mx, t);
                nan |= t != t;
            }
        }
        mx = warp_max(mx);
        nan = __any_sync(0xffffffffu, nan);
        if (nan || mx == NEG_INF) {
            const float fill = nan ? __int_as_float(0x7fc00000) : 0.0f;
#pragma unroll
            for (int u = 0; u < SMR_V; ++u) {
                const i64 c = lane + 32 * u;
                if (c < len) st(dst, dtd, o[0] + c * d_cs, fill);
            }
            continue;
        }
        float s = 0.0f;
#pragma unroll
        for (int u = 0; u < SMR_V; ++u) {
            v[u] = expf(v[u] - mx);  // 0 past the row's end (-inf)
            s += v[u];
        }
        const float inv = 1.0f / warp_sum(s);
#pragma unroll
        for (int u = 0; u < SMR_V; ++u) {
            const i64 c = lane + 32 * u;
            if (c < len) st(dst, dtd, o[0] + c * d_cs, v[u] * inv);
        }
    }
}

// A row's values of one thread: AM_U loads in flight before the comparisons (a decode step
// waits on this row; ties go to the lower index, so the order of comparisons does not matter).
#define AM_U 16
template <bool F32>
__device__ __forceinline__ void argmax_part(const void* x, int dtx, i64 base, i64 x_cs, i64 len,
                                            float& bv, i64& bi) {
#pragma unroll 1
    for (i64 c0 = threadIdx.x; c0 < len; c0 += (i64)AM_U * blockDim.x) {
        float v[AM_U];
#pragma unroll
        for (int u = 0; u < AM_U; ++u) {
            const i64 c = c0 + (i64)u * blockDim.x;
            v[u] = c < len ? (F32 ? ((const float*)x)[base + c * x_cs] : ld(x, dtx, base + c * x_cs)) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < AM_U; ++u) {
            const i64 c = c0 + (i64)u * blockDim.x;
            if (c < len && better(v[u], c, bv, bi)) { bv = v[u]; bi = c; }
        }
    }
}

// A contiguous f32 row that starts 16-byte aligned (decode's logits): AM_V 16-byte loads in
// flight per thread, so that a vocabulary of up to 4 * AM_V * blockDim.x values (32768 with
// 1024 threads) is one memory round trip. 32-bit indices (the host checks the length).
#define AM_V 8
__device__ __forceinline__ void argmax_part_v4(const float* x, int len, float& bv, i64& bi) {
    const int n4 = len / 4;
    const float4* x4 = (const float4*)x;
#pragma unroll 1
    for (int c0 = threadIdx.x; c0 < n4; c0 += AM_V * blockDim.x) {
        float4 v[AM_V];
#pragma unroll
        for (int u = 0; u < AM_V; ++u) {
            const int c = c0 + u * blockDim.x;
            v[u] = c < n4 ? x4[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < AM_V; ++u) {
            const int c = 4 * (c0 + u * (int)blockDim.x);
            if (c < 4 * n4) {
                if (better(v[u].x, c, bv, bi)) { bv = v[u].x; bi = c; }
                if (better(v[u].y, c + 1, bv, bi)) { bv = v[u].y; bi = c + 1; }
                if (better(v[u].z, c + 2, bv, bi)) { bv = v[u].z; bi = c + 2; }
                if (better(v[u].w, c + 3, bv, bi)) { bv = v[u].w; bi = c + 3; }
            }
        }
    }
#pragma unroll 1
    for (int c = 4 * n4 + threadIdx.x; c < len; c += blockDim.x) {
        if (better(x[c], c, bv, bi)) { bv = x[c]; bi = c; }
    }
}

// Index of the largest value of each row (`better`). `L` st[0] = dst (i32) strides, st[1] = x
// strides.
extern "C" __global__ void __launch_bounds__(1024) argmax(i64 rows, i64 len, Lay L, int* dst, const void* x, int dtx,
                                  i64 x_cs) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ i64 si[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 o[3];
        lay_offsets(L, r, 2, o);
        float bv = __int_as_float(0x7fc00000);  // NaN: loses to any number
        i64 bi = len;
        if (dtx == DT_F32 && x_cs == 1 && (((u64)((const float*)x + o[1])) & 15) == 0) {
            argmax_part_v4((const float*)x + o[1], (int)len, bv, bi);
        } else if (dtx == DT_F32) {
            argmax_part<true>(x, dtx, o[1], x_cs, len, bv, bi);
        } else {
            argmax_part<false>(x, dtx, o[1], x_cs, len, bv, bi);
        }
        argmax_warp(bv, bi);
        if (lane == 0) {
            sv[w] = bv;
            si[w] = bi;
        }
        __syncthreads();
        if (w == 0) {
            bv = lane < nw ? sv[lane] : __int_as_float(0x7fc00000);
            bi = lane < nw ? si[lane] : len;
            argmax_warp(bv, bi);
            if (lane == 0) dst[o[0]] = (bv != bv || bi >= len) ? 0 : (int)bi;
        }
        __syncthreads();
    }
}
