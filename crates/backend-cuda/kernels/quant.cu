// Kernels on GGUF block (quantized) weights: the embedding gather, decode's matrix-vector
// product and the dequantization that feeds cuBLAS for prefill. Each reads the blocks in
// place through quant.cuh's `dq16` (prepended to this module) and computes in f32.
//
// A quantized tensor's element strides and offsets count values, and every layout the graph
// admits keeps rows whole, so a row start is a whole number of blocks: the host passes row
// strides in bytes, and element offsets are turned into bytes as e / block size * block bytes.

// dst[r, :] = table[ids[r], :] dequantized. `L` iterates the ids' shape: st[0] = dst row
// strides (its leading axes), st[1] = ids strides. One thread per 16 values of a row (d is a
// whole number of blocks).
template <int QT>
__device__ __forceinline__ void get_rows_q_body(i64 rows, i64 d, const Lay& L, void* dst, int dtd,
                                                i64 dst_cs, const u8* table, i64 t_rs,
                                                i64 n_table, const int* ids, u32* err, u32 tag) {
    const int QB = q_block_size(QT), BB = q_block_bytes(QT);
    const i64 nc = d / 16, n = rows * nc;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / nc, c = i % nc;
        i64 o[3];
        lay_offsets(L, r, 2, o);
        const int id = ids[o[1]];
        if (id < 0 || (i64)id >= n_table) {
            report(err, tag);
            continue;
        }
        float v[16];
        dq16<QT>(table + (i64)id * t_rs + (16 * c / QB) * BB, (int)(c % (QB / 16)), v);
#pragma unroll
        for (int e = 0; e < 16; ++e) st(dst, dtd, o[0] + (16 * c + e) * dst_cs, v[e]);
    }
}

extern "C" __global__ void get_rows_q(i64 rows, i64 d, Lay L, void* dst, int dtd, i64 dst_cs,
                                      const u8* table, int qt, i64 t_rs, i64 n_table,
                                      const int* ids, u32* err, u32 tag) {
    pdl_entry();
    QUANT_SWITCH(qt, get_rows_q_body<QTV>(rows, d, L, dst, dtd, dst_cs, table, t_rs, n_table, ids, err, tag))
}

// Matrix-vector product on a quantized weight, decode's `x @ w.T`: out[m, n] = a[m, k] @ b[k, n]
// where column n of b is row n of w (its k values contiguous, `b_cs` bytes apart). One warp
// per R adjacent columns (R = MVQ_R for one row of a, 1 for MVQ_MT rows). The row's blocks go through shared memory in segments of MVQ_SEG values: the
// warp first copies a segment's bytes with coalesced 16-byte loads (blocks are only 2-byte
// aligned, so the copy starts at the 16-byte boundary below the segment; bytes outside the
// row are read one by one), then lane l dequantizes the segment's 16-value chunks l, l + 32
// from it and multiplies them by a's rows (k contiguous) in k order, MT rows per pass of a,
// each chunk of a loaded once for the warp's R columns;
// the lanes meet in a fixed xor butterfly. Summation order depends only on k: deterministic.
// Batch axes come in `MmBatch` (common.cuh) with b's strides in bytes; `blk` enumerates
// (batch, column block). `ahead` (b lies in a weights buffer no kernel writes): each thread
// stages its first segment of b before `pdl_entry` (the only reads before it), so the weight
// fetch overlaps the previous kernel's tail; every thread still waits exactly once.
//
// The one-row kernels' integer paths (`qm` != 0: M == 1, one batch, `LOWSYNC_CUDA_TUNE=qdot=q16`
// or `qdot=q8`, the host's choice): after the wait the block quantizes a's row once into K / 32
// records in dynamic shared memory (quant.cuh: the CPU backend's 16-bit activation blocks, bit
// for bit, or its 8-bit ones; thread t takes half-blocks t, t + blockDim.x, ...). q16: each
// staged chunk is taken as integers (`iq16`) against its half record with dp2a (`q16_fma`), in
// the same chunk order. q8: lane l takes the segment's 32-value pieces l, l + 32, ... (both
// chunks of one record) with dp4a (`q8_piece`), in k order. With `ahead`
// the warp's first segment of its rows is asked into L2 before the wait instead of staged.
#define MVQ_WARPS 4
#define MVQ_MT 8
// Columns per warp of the one-row kernels: a's chunk is loaded once for this many weight rows
// (the loads of a, not of the weight, bound a warp per column), 4 segments staged per warp.
#define MVQ_R 4
#define MVQ_SEG 1024
// Bytes of the largest segment (Q8_0: 32 blocks of 34 bytes) and a 16-byte lead-in, in uint4s.
#define MVQ_STAGE (MVQ_SEG / 32 * 34 / 16 + 2)

// Bytes [lo, hi) of a row that spans [r0, r1) into `st` from the 16-byte boundary below lo:
// whole 16-byte loads inside the row, single bytes where a boundary vector leaves it. Returns
// lo's offset in `st`. Every lane of the warp takes part.
__device__ __forceinline__ int mvq_stage(uint4* st, const u8* lo, const u8* hi, const u8* r0, const u8* r1, int lane) {
    const u8* a0 = (const u8*)((u64)lo & ~(u64)15);
    const int nv = (int)((hi - a0 + 15) / 16);
    for (int v = lane; v < nv; v += 32) {
        const u8* p = a0 + 16 * v;
        if (p >= r0 && p + 16 <= r1) {
            st[v] = ld_weight((const uint4*)p);
        } else {
            u8* d = (u8*)(st + v);
            for (int e = 0; e < 16; ++e) d[e] = p + e >= r0 && p + e < r1 ? p[e] : (u8)0;
        }
    }
    return (int)(lo - a0);
}

template <int QT, int MT, int R, bool AM, int QM>
__device__ __forceinline__ void mmv_q_body(i64 M, i64 N, i64 K, i64 nbatch, const MmBatch& B,
                                           float* dst, i64 d_rs, i64 d_cs, const float* a,
                                           i64 a_rs, const u8* b, i64 b_cs,
                                           uint4 (*stage)[MVQ_STAGE], int ahead, u64* key, u8* xq) {
    const int QB = q_block_size(QT), BB = q_block_bytes(QT);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 ncb = (N + MVQ_WARPS * R - 1) / (MVQ_WARPS * R);
    const i64 row_bytes = K / QB * BB;
    const i64 seg_bytes = MVQ_SEG / QB * BB;
    bool waited = !ahead;
    if (QM) {
        // One batch, one row: the warp's first columns are known before the wait.
        const i64 col0 = ((i64)blockIdx.x * MVQ_WARPS + warp) * R;
        if (ahead && col0 < N) {
#pragma unroll
            for (int c = 0; c < R; ++c) {
                const u8* wc = b + (col0 + min((i64)c, N - 1 - col0)) * b_cs;
                const u8* line = (const u8*)((u64)wc & ~(u64)127);
                const u8* end = wc + min(seg_bytes, row_bytes);
                for (const u8* p = line + 128 * lane; p < end; p += 128 * 32) prefetch_l2(p);
            }
        }
        pdl_entry();
        waited = true;
        const int nh = (int)(K / 16);
        const bool a16 = ((u64)a & 15u) == 0;  // float4 loads where a allows them
        for (int h0 = 0; h0 < nh; h0 += blockDim.x) {
            const int h = h0 + threadIdx.x;
            const bool live = h < nh;
            float v[16];
            if (live && a16) {
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const float4 f = ((const float4*)a)[4 * h + t];
                    v[4 * t] = f.x;
                    v[4 * t + 1] = f.y;
                    v[4 * t + 2] = f.z;
                    v[4 * t + 3] = f.w;
                }
            } else {
#pragma unroll
                for (int e = 0; e < 16; ++e) v[e] = live ? a[16 * h + e] : 0.0f;
            }
            if (QM == 2) {
                q8_half(v, xq + Q8_REC * (h / 2), h, live);
            } else {
                q16_half(v, xq + Q16_REC * (h / 2), h, live);
            }
        }
        __syncthreads();
    }
    if (waited && !QM) pdl_entry();
    u64 best = 0ull;  // AM: the largest argmax key of this warp's columns
    for (i64 blk = blockIdx.x; blk < ncb * nbatch; blk += gridDim.x) {
        const i64 bt = blk / ncb, cb = blk % ncb;
        i64 o[3];
        mm_batch_offsets(B, bt, o);
        const i64 col0 = (cb * MVQ_WARPS + warp) * R;
        if (col0 >= N) continue;  // warp-uniform: the warp's shuffles stay whole
        const int nr = (int)min((i64)R, N - col0);
        for (i64 i0 = 0; i0 < M; i0 += MT) {
            const int mt = (int)min((i64)MT, M - i0);
            const float* ab = a + o[1] + i0 * a_rs;
            float acc[MT][R];
#pragma unroll
            for (int r = 0; r < MT; ++r)
#pragma unroll
                for (int c = 0; c < R; ++c) acc[r][c] = 0.0f;
            for (i64 k0 = 0; k0 < K; k0 += MVQ_SEG) {
                const i64 s0 = k0 / QB * BB;
                int lead[R];
#pragma unroll
                for (int c = 0; c < R; ++c) {
                    // A warp's columns past N stage the last one again (never stored).
                    const u8* wc = b + o[2] + (col0 + min(c, nr - 1)) * b_cs;
                    lead[c] = mvq_stage(stage[warp * R + c], wc + s0, wc + min(s0 + seg_bytes, row_bytes),
                                        wc, wc + row_bytes, lane);
                }
                __syncwarp();
                if (!waited) {  // a is read from here on
                    pdl_entry();
                    waited = true;
                }
                const int nch = (int)(min((i64)MVQ_SEG, K - k0) / 16);
                if (QM == 2) {
                    // k0 is a multiple of 32: piece p (chunks 2p, 2p + 1) is record (k0 + 32 p)
                    // / 32, both chunks of one block (a piece never straddles blocks). The
                    // record is loaded once for the R columns (12 registers, q16's would be 19).
                    for (int p = lane; p < nch / 2; p += 32) {
                        const Q8x x = q8_load(xq + Q8_REC * ((k0 + 32 * p) / 32));
#pragma unroll
                        for (int c = 0; c < R; ++c) {
                            acc[0][c] = q8_piece<QT>((const u8*)stage[warp * R + c] + lead[c] + (32 * p / QB) * BB,
                                                     p % (QB / 32), x, acc[0][c]);
                        }
                    }
                    __syncwarp();
                    continue;
                }
                if (QM == 1) {
                    // k0 is a multiple of 32: chunk j is half j % 2 of record (k0 + 16 j) / 32.
                    // (Chunk by chunk: a lane taking both chunks of a record for its R columns
                    // held 168 registers in `mul_mat_vec_q_argmax` against 128, NVRTC 13.0.)
                    for (int j = lane; j < nch; j += 32) {
                        const u8* rec = xq + Q16_REC * ((k0 + 16 * j) / 32);
#pragma unroll
                        for (int c = 0; c < R; ++c) {
                            u32 w[4];
                            float d, m;
                            iq16<QT>((const u8*)stage[warp * R + c] + lead[c] + (16 * j / QB) * BB, j % (QB / 16), w, d, m);
                            acc[0][c] = q16_fma<QT>(w, d, m, rec, j & 1, acc[0][c]);
                        }
                    }
                    __syncwarp();
                    continue;
                }
                for (int j = lane; j < nch; j += 32) {
                    // This chunk's 16 values of each row of a, read once for the R columns.
                    float x[MT][16];
#pragma unroll
                    for (int r = 0; r < MT; ++r) {
                        if (r < mt) {
                            const float* ar = ab + r * a_rs + k0 + 16 * j;
#pragma unroll
                            for (int e = 0; e < 16; ++e) x[r][e] = ar[e];
                        }
                    }
#pragma unroll
                    for (int c = 0; c < R; ++c) {
                        float v[16];
                        dq16<QT>((const u8*)stage[warp * R + c] + lead[c] + (16 * j / QB) * BB, j % (QB / 16), v);
#pragma unroll
                        for (int r = 0; r < MT; ++r) {
                            if (r < mt) {
#pragma unroll
                                for (int e = 0; e < 16; ++e) acc[r][c] = fmaf(x[r][e], v[e], acc[r][c]);
                            }
                        }
                    }
                }
                __syncwarp();
            }
#pragma unroll
            for (int r = 0; r < MT; ++r) {
#pragma unroll
                for (int c = 0; c < R; ++c) {
                    if (r < mt && c < nr) {
                        float s = acc[r][c];
                        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                        const i64 col = col0 + c;
                        if (lane == 0) dst[o[0] + (i0 + r) * d_rs + col * d_cs] = s;
                        if (AM) {
                            const u64 kk = argmax_key(s, col);
                            best = kk > best ? kk : best;
                        }
                    }
                }
            }
        }
    }
    if (!waited) pdl_entry();  // a warp without a column (or M == 0)
    if (AM) {
        // As `gemv1_argmax` (matmul.cu): the block's largest key into *key, not waited for.
        __shared__ u64 sk[MVQ_WARPS];
        if (lane == 0) sk[warp] = best;
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 m = 0ull;
            for (int w = 0; w < MVQ_WARPS; ++w) m = sk[w] > m ? sk[w] : m;
            if (m != 0ull) atomicMax(key, m);
        }
    }
}

// blockDim.x == 32 * MVQ_WARPS. One row of a (decode), MVQ_R columns per warp: each chunk of a
// is read once for MVQ_R weight rows, whose segments are staged side by side. `qm`: 0 the f32
// path, 1 the q16 integer path, 2 the q8 one (M == 1, nbatch == 1, dynamic shared memory K / 32
// * Q16_REC or Q8_REC bytes, within the default 48 KiB beside `stage`: `MVQ_Q16_MAX_SHARED` in
// src/exec/matmul.rs) ...
extern "C" __global__ void __launch_bounds__(32 * MVQ_WARPS) mul_mat_vec_q(
    i64 M, i64 N, i64 K, i64 nbatch, MmBatch B, float* dst, i64 d_rs, i64 d_cs, const float* a,
    i64 a_rs, const u8* b, int qt, i64 b_cs, int ahead, int qm) {
    __shared__ uint4 stage[MVQ_WARPS * MVQ_R][MVQ_STAGE];
    extern __shared__ uint4 mvq_smem[];
    u8* xq = (u8*)mvq_smem;
    if (qm == 2) {
        QUANT_SWITCH(qt, mmv_q_body<QTV, 1, MVQ_R, false, 2>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, stage, ahead, nullptr, xq))
    } else if (qm) {
        QUANT_SWITCH(qt, mmv_q_body<QTV, 1, MVQ_R, false, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, stage, ahead, nullptr, xq))
    } else {
        QUANT_SWITCH(qt, mmv_q_body<QTV, 1, MVQ_R, false, 0>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, stage, ahead, nullptr, xq))
    }
}

// ... and MVQ_MT rows of a per pass, one column per warp (each dequantized chunk serves them all).
extern "C" __global__ void __launch_bounds__(32 * MVQ_WARPS) mul_mat_vec_q8(
    i64 M, i64 N, i64 K, i64 nbatch, MmBatch B, float* dst, i64 d_rs, i64 d_cs, const float* a,
    i64 a_rs, const u8* b, int qt, i64 b_cs, int ahead) {
    __shared__ uint4 stage[MVQ_WARPS][MVQ_STAGE];
    QUANT_SWITCH(qt, mmv_q_body<QTV, MVQ_MT, 1, false, 0>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, stage, ahead, nullptr, nullptr))
}

// Decode's output head on a quantized weight: `mul_mat_vec_q` (M == 1, one batch; `qm` as
// there) with the argmax of the row folded in as `mul_mat_vec_1_argmax` does; `argmax_take`
// (matmul.cu) then turns *key (0 before the launch) into the index.
extern "C" __global__ void __launch_bounds__(32 * MVQ_WARPS) mul_mat_vec_q_argmax(
    i64 M, i64 N, i64 K, i64 nbatch, MmBatch B, float* dst, i64 d_rs, i64 d_cs, const float* a,
    i64 a_rs, const u8* b, int qt, i64 b_cs, int ahead, u64* key, int qm) {
    __shared__ uint4 stage[MVQ_WARPS * MVQ_R][MVQ_STAGE];
    extern __shared__ uint4 mvq_smem[];
    u8* xq = (u8*)mvq_smem;
    if (qm == 2) {
        QUANT_SWITCH(qt, mmv_q_body<QTV, 1, MVQ_R, true, 2>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, stage, ahead, key, xq))
    } else if (qm) {
        QUANT_SWITCH(qt, mmv_q_body<QTV, 1, MVQ_R, true, 1>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, stage, ahead, key, xq))
    } else {
        QUANT_SWITCH(qt, mmv_q_body<QTV, 1, MVQ_R, true, 0>(M, N, K, nbatch, B, dst, d_rs, d_cs, a, a_rs, b, b_cs, stage, ahead, key, xq))
    }
}

// Prefill's weight for cuBLAS: dst[r, :] (f16, rows of k packed back to back) = row r of the
// quantized source dequantized; `L` iterates the rows (st[0]: their element offsets). One
// thread per 16 values; dst 16-byte aligned.
template <int QT>
__device__ __forceinline__ void dequant_rows_body(i64 rows, i64 k, const Lay& L, u16* dst, const u8* src) {
    const int QB = q_block_size(QT), BB = q_block_bytes(QT);
    const i64 nc = k / 16, n = rows * nc;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / nc, c = i % nc;
        i64 o[3];
        lay_offsets(L, r, 1, o);
        float v[16];
        dq16<QT>(src + (o[0] / QB + 16 * c / QB) * BB, (int)(c % (QB / 16)), v);
        // Two 16-byte stores (k is a whole number of blocks, so 16 values of a row start on a
        // 32-byte boundary): 16 two-byte stores, 32 bytes apart from lane to lane, made each
        // warp's 1 KB of output 16 partial writes of every sector it covers.
        u32 h[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) h[e] = (u32)f2h(v[2 * e]) | ((u32)f2h(v[2 * e + 1]) << 16);
        uint4* d4 = (uint4*)(dst + r * k + 16 * c);
        d4[0] = make_uint4(h[0], h[1], h[2], h[3]);
        d4[1] = make_uint4(h[4], h[5], h[6], h[7]);
    }
}

extern "C" __global__ void dequant_rows(i64 rows, i64 k, Lay L, u16* dst, const u8* src, int qt) {
    pdl_entry();
    QUANT_SWITCH(qt, dequant_rows_body<QTV>(rows, k, L, dst, src))
}
