// Mixture of experts: out[t, n] = sum_j w[t, j] * (x[t] @ experts[ids[t, j]])[n]. One thread
// per output element; slots in order, k in order. Dense matmul goes through the matrix-vector
// kernels below (small m) or cuBLAS.

extern "C" __global__ void mul_mat_id(i64 T, i64 N, i64 K, i64 slots, i64 n_exp, void* dst,
                                      int dtd, i64 d_rs, i64 d_cs, const void* ex, int dte,
                                      i64 e_s0, i64 e_s1, i64 e_s2, const void* x, int dtx,
                                      i64 x_rs, i64 x_cs, const int* ids, i64 i_rs, i64 i_cs,
                                      const void* w, int dtw, i64 w_rs, i64 w_cs, u32* err,
                                      u32 tag) {
    pdl_entry();
    i64 n_out = T * N;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n_out;
         i += (i64)gridDim.x * blockDim.x) {
        i64 t = i / N, n = i % N;
        float acc = 0.0f;
        for (i64 j = 0; j < slots; ++j) {
            int e = ids[t * i_rs + j * i_cs];
            if (e < 0 || (i64)e >= n_exp) {
                report(err, tag);
                continue;
            }
            float y = 0.0f;
            for (i64 k = 0; k < K; ++k) {
                y += ld(x, dtx, t * x_rs + k * x_cs) * ld(ex, dte, (i64)e * e_s0 + k * e_s1 + n * e_s2);
            }
            acc += ld(w, dtw, t * w_rs + j * w_cs) * y;
        }
        st(dst, dtd, t * d_rs + n * d_cs, acc);
    }
}

// ---------------------------------------------------------------------------------------------
// Matrix-vector products for small m (decode): out[m, n] = a[m, k] @ b[k, n] with a in f32 and
// b in f32/f16/bf16, f32 accumulation, bandwidth-bound on b. Batch axes (GQA broadcast
// included) come in `MmBatch`; `blk` enumerates (batch, column block), columns fastest.
//
// Determinism: the value of one output element depends only on k, the dtype of b and the
// launch shape chosen from the shapes (group size G, slices KS), never on the alignment of the
// operands: the vectorised and the scalar loops accumulate the same products in the same
// order, so any two runs of one graph give bit-identical results.

#define MMV_MT 8

// b's k axis is contiguous: column j of b starts at element o_b + j * b_cs. A group of G lanes
// (G a power of two <= 32) owns NC adjacent columns; lane gl of a group reads the 16-byte
// vectors gl, gl + G, ... of each column (then the k % VW tail elements, one per lane), and
// the group sums its lanes with a fixed xor butterfly. Rows of a go in passes of MT. The
// result is f32 (any strides).
template <int DT, int NC, int MT>
__device__ __forceinline__ void mmv_k_body(i64 M, i64 N, i64 K, i64 nbatch, const MmBatch& B,
                                           float* dst, i64 d_rs, i64 d_cs,
                                           const float* a, i64 a_rs, const void* b, i64 b_cs,
                                           int G, int vec) {
    const int ESZ = DT == DT_F32 ? 4 : 2;
    const int U = NC == 1 ? 4 : 1;  // vectors per column in flight per lane
    const int lane = threadIdx.x & 31;
    const int gl = lane & (G - 1);
    const i64 per_warp = 32 / G;
    const i64 group = (i64)(threadIdx.x >> 5) * per_warp + lane / G;
    const i64 cols_per_block = (i64)(blockDim.x >> 5) * per_warp * NC;
    const i64 ncb = (N + cols_per_block - 1) / cols_per_block;
    for (i64 blk = blockIdx.x; blk < ncb * nbatch; blk += gridDim.x) {
        const i64 bt = blk / ncb, cb = blk % ncb;
        i64 o[3];
        mm_batch_offsets(B, bt, o);
        const i64 col0 = cb * cols_per_block + group * NC;
        // Each column's start (clamped into range: extra lanes still take part in the
        // shuffles, their sums are not written).
        const char* wr[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) wr[c] = (const char*)b + (o[2] + min(col0 + c, N - 1) * b_cs) * ESZ;
        for (i64 i0 = 0; i0 < M; i0 += MT) {
            const int mt = (int)min((i64)MT, M - i0);
            const float* ab = a + o[1] + i0 * a_rs;
            float acc[MT][NC];
            mmv_k_pass<DT, NC, MT, U>(acc, wr, K, G, gl, vec, ab, a_rs, mt);
#pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (r < mt) {
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        float s = acc[r][c];
                        for (int off = G >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                        const i64 col = col0 + c;
                        if (gl == 0 && col < N) dst[o[0] + (i0 + r) * d_rs + col * d_cs] = s;
                    }
                }
            }
        }
    }
}

// `vec`: every column start of b and every row start of a is 16-byte aligned (checked on the
// host). blockDim.x == 128. One column per lane group and one row per pass (decode) ...
extern "C" __global__ void __launch_bounds__(128, 8) mul_mat_vec_k(
    i64 M, i64 N, i64 K, i64 nbatch, MmBatch B, float* dst, i64 d_rs, i64 d_cs,
    const float* a, i64 a_rs, const void* b, int dtb, i64 b_cs, int G, int vec) {
    pdl_entry();
    switch (dtb) {
        case DT_F16: mmv_k_body<DT_F16, 1, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, G, vec); break;
        case DT_BF16: mmv_k_body<DT_BF16, 1, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, G, vec); break;
        default: mmv_k_body<DT_F32, 1, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, G, vec); break;
    }
}

// ... and four columns per lane group, MMV_MT rows per pass (each load of a serves four
// columns).
extern "C" __global__ void mul_mat_vec_k4(i64 M, i64 N, i64 K, i64 nbatch, MmBatch B, float* dst,
                                          i64 d_rs, i64 d_cs, const float* a, i64 a_rs,
                                          const void* b, int dtb, i64 b_cs, int G, int vec) {
    pdl_entry();
    switch (dtb) {
        case DT_F16: mmv_k_body<DT_F16, 4, MMV_MT>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, G, vec); break;
        case DT_BF16: mmv_k_body<DT_BF16, 4, MMV_MT>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, G, vec); break;
        default: mmv_k_body<DT_F32, 4, MMV_MT>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, G, vec); break;
    }
}

// b's n axis is contiguous (x @ w with w [k, n], attention's probabilities @ V). A block of
// MMN_T threads is TC column threads x KS = MMN_T / TC k slices; each thread owns MMN_C
// adjacent columns and the k indices ks, ks + KS, ...; the slices are summed by a fixed tree
// in shared memory. `vec`: the MMN_C columns of every row of b are one aligned load. The
// result is f32 (any strides).
#define MMN_T 256
#define MMN_C 4

template <int DT, int MT>
__device__ __forceinline__ void mmv_n_body(i64 M, i64 N, i64 K, i64 nbatch, const MmBatch& B,
                                           float* dst, i64 d_rs, i64 d_cs,
                                           const float* a, i64 a_rs, i64 a_ks, const void* b,
                                           i64 b_rs, int TC, int vec,
                                           float (*red)[MMN_T]) {
    const int t = threadIdx.x;
    const int tc = t % TC, ks = t / TC, KS = MMN_T / TC;
    const i64 cols_per_block = (i64)TC * MMN_C;
    const i64 ncb = (N + cols_per_block - 1) / cols_per_block;
    for (i64 blk = blockIdx.x; blk < ncb * nbatch; blk += gridDim.x) {
        const i64 bt = blk / ncb, cb = blk % ncb;
        i64 o[3];
        mm_batch_offsets(B, bt, o);
        const i64 j0 = cb * cols_per_block + (i64)tc * MMN_C;
        const bool full = vec && j0 + MMN_C <= N;
        for (i64 i0 = 0; i0 < M; i0 += MT) {
            const int mt = (int)min((i64)MT, M - i0);
            const float* ab = a + o[1] + i0 * a_rs;
            float acc[MT][MMN_C];
#pragma unroll
            for (int r = 0; r < MT; ++r) {
#pragma unroll
                for (int c = 0; c < MMN_C; ++c) acc[r][c] = 0.0f;
            }
#pragma unroll 4
            for (i64 k = ks; k < K; k += KS) {
                float bf[MMN_C];
                const i64 e0 = o[2] + k * b_rs + j0;
                if (full) {
                    if (DT == DT_F32) {
                        uint4 w = *(const uint4*)((const float*)b + e0);
                        bf[0] = __uint_as_float(w.x); bf[1] = __uint_as_float(w.y);
                        bf[2] = __uint_as_float(w.z); bf[3] = __uint_as_float(w.w);
                    } else {
                        uint2 w = *(const uint2*)((const u16*)b + e0);
                        if (DT == DT_F16) {
                            bf[0] = h2f((u16)(w.x & 0xffffu)); bf[1] = h2f((u16)(w.x >> 16));
                            bf[2] = h2f((u16)(w.y & 0xffffu)); bf[3] = h2f((u16)(w.y >> 16));
                        } else {
                            bf[0] = __uint_as_float(w.x << 16); bf[1] = __uint_as_float(w.x & 0xffff0000u);
                            bf[2] = __uint_as_float(w.y << 16); bf[3] = __uint_as_float(w.y & 0xffff0000u);
                        }
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < MMN_C; ++c) bf[c] = j0 + c < N ? ld(b, DT, e0 + c) : 0.0f;
                }
#pragma unroll
                for (int r = 0; r < MT; ++r) {
                    if (r < mt) {
                        const float av = ab[r * a_rs + k * a_ks];
#pragma unroll
                        for (int c = 0; c < MMN_C; ++c) acc[r][c] = fmaf(av, bf[c], acc[r][c]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < MT; ++r) {
#pragma unroll
                for (int c = 0; c < MMN_C; ++c) red[r * MMN_C + c][t] = acc[r][c];
            }
            __syncthreads();
            for (int s = KS >> 1; s > 0; s >>= 1) {
                if (ks < s) {
                    for (int x = 0; x < mt * MMN_C; ++x) red[x][t] += red[x][t + s * TC];
                }
                __syncthreads();
            }
            if (ks == 0) {
                for (int r = 0; r < mt; ++r) {
#pragma unroll
                    for (int c = 0; c < MMN_C; ++c) {
                        if (j0 + c < N) dst[o[0] + (i0 + r) * d_rs + (j0 + c) * d_cs] = red[r * MMN_C + c][t];
                    }
                }
            }
            __syncthreads();
        }
    }
}

// blockDim.x == MMN_T; TC a power of two dividing MMN_T. One row of a per pass (decode) ...
extern "C" __global__ void __launch_bounds__(MMN_T, 2) mul_mat_vec_n(
    i64 M, i64 N, i64 K, i64 nbatch, MmBatch B, float* dst, i64 d_rs, i64 d_cs,
    const float* a, i64 a_rs, i64 a_ks, const void* b, int dtb, i64 b_rs, int TC, int vec) {
    pdl_entry();
    __shared__ float red[MMN_C][MMN_T];
    switch (dtb) {
        case DT_F16: mmv_n_body<DT_F16, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, a_ks, b, b_rs, TC, vec, red); break;
        case DT_BF16: mmv_n_body<DT_BF16, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, a_ks, b, b_rs, TC, vec, red); break;
        default: mmv_n_body<DT_F32, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, a_ks, b, b_rs, TC, vec, red); break;
    }
}

// ... and MMV_MT rows per pass.
extern "C" __global__ void mul_mat_vec_n8(i64 M, i64 N, i64 K, i64 nbatch, MmBatch B, float* dst,
                                          i64 d_rs, i64 d_cs, const float* a,
                                          i64 a_rs, i64 a_ks, const void* b, int dtb, i64 b_rs,
                                          int TC, int vec) {
    pdl_entry();
    __shared__ float red[MMV_MT * MMN_C][MMN_T];
    switch (dtb) {
        case DT_F16: mmv_n_body<DT_F16, MMV_MT>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, a_ks, b, b_rs, TC, vec, red); break;
        case DT_BF16: mmv_n_body<DT_BF16, MMV_MT>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, a_ks, b, b_rs, TC, vec, red); break;
        default: mmv_n_body<DT_F32, MMV_MT>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, a_ks, b, b_rs, TC, vec, red); break;
    }
}

// Decode's matrix-vector product, one activation row: dst[j * d_cs] = sum_k x[k] * w[j, k] for
// weights whose rows are contiguous and 16-byte aligned (w_rs: row stride in elements). Built
// for bandwidth: each warp owns one row and every lane keeps GV_U 16-byte loads of it in flight,
// so a 4 KB f16 row is one round trip; the first loads are issued before anything else. x comes
// either from shared memory (`staged`: copied once per block with 16-byte loads, all in flight
// at once) or straight from global memory through the read-only cache. The lanes' partial sums
// meet in a fixed xor butterfly (deterministic). With AM, the argmax of the row follows
// (`gemv1_argmax`; every warp of the block gets there).
#define GV_WARPS 8
#define GV_U 8
__device__ __forceinline__ void gemv1_argmax(bool active, i64 row, float acc, u64* key);
template <int DT, bool AM>
__device__ __forceinline__ void gemv1_body(i64 N, i64 K, float* dst, i64 d_cs, const float* x,
                                           const void* w, i64 w_rs, float* xs, int staged,
                                           int ahead, u64* key) {
    const int VW = DT == DT_F32 ? 4 : 8;
    const int ESZ = DT == DT_F32 ? 4 : 2;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * GV_WARPS + (threadIdx.x >> 5);
    const bool active = row < N;
    const uint4* wv = (const uint4*)((const char*)w + (active ? row : 0) * w_rs * ESZ);
    const i64 nvec = K / VW;
    uint4 q[GV_U];
    if (!ahead) pdl_entry();
#pragma unroll
    for (int u = 0; u < GV_U; ++u) {
        const i64 v = lane + 32 * u;
        q[u] = active && v < nvec ? ld_weight(wv + v) : make_uint4(0, 0, 0, 0);
    }
    if (ahead) pdl_entry();
    const float* xr = x;
    if (staged) {
        stage_row(xs, x, K, VW == 8);
        xr = xs;
    }
    if (!AM && !active) return;
    float acc = 0.0f;
    if (!AM || active) {  // warp-uniform
        for (i64 v0 = 0; v0 < nvec; v0 += 32 * GV_U) {
            if (v0 > 0) {
#pragma unroll
                for (int u = 0; u < GV_U; ++u) {
                    const i64 v = v0 + lane + 32 * u;
                    q[u] = v < nvec ? ld_weight(wv + v) : make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < GV_U; ++u) {
                const i64 v = v0 + lane + 32 * u;
                if (v < nvec) {
                    float f[VW], xa[VW];
                    unpack16<DT>(q[u], f);
                    decode_x<VW>(xr, v, nvec, staged, xa);
#pragma unroll
                    for (int e = 0; e < VW; ++e) acc = fmaf(xa[e], f[e], acc);
                }
            }
        }
        for (i64 kk = nvec * VW + lane; kk < K; kk += 32) acc = fmaf(xr[kk], ld(w, DT, row * w_rs + kk), acc);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) dst[row * d_cs] = acc;
    }
    if (AM) gemv1_argmax(active, row, acc, key);
}

extern "C" __global__ void __launch_bounds__(GV_WARPS * 32) mul_mat_vec_1(
    i64 N, i64 K, float* dst, i64 d_cs, const float* x, const void* w, int dtw, i64 w_rs,
    int staged, int ahead) {
    extern __shared__ float4 gv_smem[];
    float* xs = (float*)gv_smem;
    switch (dtw) {
        case DT_F16: gemv1_body<DT_F16, false>(N, K, dst, d_cs, x, w, w_rs, xs, staged, ahead, nullptr); break;
        case DT_BF16: gemv1_body<DT_BF16, false>(N, K, dst, d_cs, x, w, w_rs, xs, staged, ahead, nullptr); break;
        default: gemv1_body<DT_F32, false>(N, K, dst, d_cs, x, w, w_rs, xs, staged, ahead, nullptr); break;
    }
}

// Decode's output head: `mul_mat_vec_1`'s product (N logits, one f32 row) with the argmax of
// the row folded in, so no kernel reads the logits back with one block. Each block takes the
// largest `argmax_key` of its rows and folds it into *key with one atomicMax whose result is
// unused (a reduction the block does not wait for: a fence or a returned ticket per block
// holds every block's retirement, measured 18 µs more on "1b"'s 4,000 blocks). `argmax_take`,
// the next launch, turns the key into the index and sets it back to 0. The key orders pairs as
// `better` does — a larger value, then the lower row, NaN below every number, -0 equal to +0 —
// so the index is the `argmax` kernel's (`argmax_key`, common.cuh). *key is 0 before the launch
// (the host's invariant) and N < 2^31.
__device__ __forceinline__ void gemv1_argmax(bool active, i64 row, float acc, u64* key) {
    __shared__ u64 sk[GV_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sk[warp] = active ? argmax_key(acc, row) : 0ull;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 best = 0ull;
        for (int i = 0; i < GV_WARPS; ++i) best = sk[i] > best ? sk[i] : best;
        if (best != 0ull) atomicMax(key, best);
    }
}

// The index of the head's argmax from its key (0 for an all-NaN row: every key has a zero high
// word), and the key back at 0 for the next launch. One thread.
extern "C" __global__ void argmax_take(u64* key, int* am) {
    pdl_entry();
    if (threadIdx.x != 0) return;
    const u64 k = __ldcg(key);
    am[0] = (k >> 32) == 0ull ? 0 : (int)(0xFFFFFFFFu - (u32)k);
    *key = 0ull;
}

extern "C" __global__ void __launch_bounds__(GV_WARPS * 32) mul_mat_vec_1_argmax(
    i64 N, i64 K, float* dst, i64 d_cs, const float* x, const void* w, int dtw, i64 w_rs,
    int staged, int ahead, u64* key) {
    extern __shared__ float4 gv_smem[];
    float* xs = (float*)gv_smem;
    switch (dtw) {
        case DT_F16: gemv1_body<DT_F16, true>(N, K, dst, d_cs, x, w, w_rs, xs, staged, ahead, key); break;
        case DT_BF16: gemv1_body<DT_BF16, true>(N, K, dst, d_cs, x, w, w_rs, xs, staged, ahead, key); break;
        default: gemv1_body<DT_F32, true>(N, K, dst, d_cs, x, w, w_rs, xs, staged, ahead, key); break;
    }
}
