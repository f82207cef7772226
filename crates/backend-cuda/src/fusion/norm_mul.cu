// Fused RmsNorm -> Mul: decode's norms with their weight row in one launch.
// The host side (patterns, preconditions, launch): src/fusion/norm_mul.rs.
// Like every fused kernel it writes each tensor its nodes would have written (unless the host
// proved a result dead), in the nodes' order within the thread that owns an element, so later
// readers see what the unfused chain would have left; arithmetic is f32 in fixed summation
// orders that depend only on the shapes (no float atomics), so results are deterministic run to
// run. One NVRTC module, compiled with kernels/common.cuh in front of it.

// ---------------------------------------------------------------------------------------------
// RmsNorm followed by Mul with a weight row. One block per row; `L` iterates the rows with
// st[0] = norm result, st[1] = x, st[2] = product. A row of up to four values per thread is
// read once into registers (longer rows loop as the rms_norm kernel does). Each thread
// stores a norm element and reads it back before multiplying, so the product sees the value
// rounded to the norm's dtype, as the unfused Mul does (and an in-place Mul overwrites it only
// after that read).
extern "C" __global__ void rms_norm_mul(i64 rows, i64 len, Lay L, void* nd, int dtn, i64 n_cs,
                                        const void* x, int dtx, i64 x_cs, float eps, void* od,
                                        int dto, i64 o_cs, const void* w, int dtw, i64 w_cs) {
    pdl_entry();
    // A row that fits RN_V values per thread is read once, with every load in flight before
    // the first use (decode's rows are one round trip, not a loop of them); longer rows loop.
    const int RN_V = 4;
    const bool in_regs = len <= (i64)blockDim.x * RN_V;
    if (rows == 1 && in_regs && dtn == DT_F32 && dtx == DT_F32 && dto == DT_F32 &&
        dtw == DT_F32 && n_cs == 1 && x_cs == 1 && o_cs == 1 && w_cs == 1) {
        // Decode's case (one contiguous f32 row, at offset 0 of each tensor): a short path with
        // no dtype switches and no index arithmetic, as instruction fetch is much of the
        // cost of a kernel this small. Each thread reads its elements before it writes them.
        const int n = (int)len;
        float v[RN_V], wq[RN_V];
        const float inv = row_rms_f32<RN_V>((const float*)x, (const float*)w, n, eps, v, wq, (int)blockDim.x);
#pragma unroll
        for (int q = 0; q < RN_V; ++q) {
            const int c = threadIdx.x + q * blockDim.x;
            if (c < n) {
                const float nv = v[q] * inv;
                ((float*)nd)[c] = nv;
                ((float*)od)[c] = nv * wq[q];
            }
        }
        return;
    }
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 o[3];
        lay_offsets(L, r, 3, o);
        float v[RN_V], wq[RN_V];
        float s = 0.0f;
        if (in_regs) {
#pragma unroll
            for (int q = 0; q < RN_V; ++q) {
                const i64 c = threadIdx.x + (i64)q * blockDim.x;
                v[q] = c < len ? ld(x, dtx, o[1] + c * x_cs) : 0.0f;
                wq[q] = c < len ? ld(w, dtw, c * w_cs) : 0.0f;
            }
#pragma unroll
            for (int q = 0; q < RN_V; ++q) s += v[q] * v[q];
        } else {
            for (i64 c = threadIdx.x; c < len; c += blockDim.x) {
                float xv = ld(x, dtx, o[1] + c * x_cs);
                s += xv * xv;
            }
        }
        s = block_sum(s);
        float inv = 1.0f / sqrtf(s / (float)len + eps);
        if (in_regs) {
#pragma unroll
            for (int q = 0; q < RN_V; ++q) {
                const i64 c = threadIdx.x + (i64)q * blockDim.x;
                if (c < len) {
                    const i64 ni = o[0] + c * n_cs;
                    st(nd, dtn, ni, v[q] * inv);
                    st(od, dto, o[2] + c * o_cs, ld(nd, dtn, ni) * wq[q]);
                }
            }
        } else {
            for (i64 c = threadIdx.x; c < len; c += blockDim.x) {
                const i64 ni = o[0] + c * n_cs;
                st(nd, dtn, ni, ld(x, dtx, o[1] + c * x_cs) * inv);
                st(od, dto, o[2] + c * o_cs, ld(nd, dtn, ni) * ld(w, dtw, c * w_cs));
            }
        }
        __syncthreads();
    }
}
