// Fused matrix-vector products: the products of one activation (q/k/v, gate/up, o, down)
// with their epilogues (Add, SwiGlu, decode's Rope and KV-cache rows) and the norm prologue.
// The host side (patterns, preconditions, launch): src/fusion/gemv.rs.
// Like every fused kernel it writes each tensor its nodes would have written (unless the host
// proved a result dead), in the nodes' order within the thread that owns an element, so later
// readers see what the unfused chain would have left; arithmetic is f32 in fixed summation
// orders that depend only on the shapes (no float atomics), so results are deterministic run to
// run. One NVRTC module, compiled with kernels/common.cuh and kernels/quant.cuh in front of it.

// x / (1 + e^-x), as the element-wise SwiGlu.
__device__ __forceinline__ float f_silu(float x) { return x / (1.0f + expf(-x)); }

// ---------------------------------------------------------------------------------------------
// Several matrix-vector products over one activation a [M, K] (f32, k contiguous), each
// out_s[M, n_s] = a @ W_s.T with W_s [n_s, K] row-major (k contiguous) in one dtype, in one
// launch whose lane groups split the concatenated output columns. Optional epilogues:
// an Add of another tensor (bias row or residual) per product, or — pair mode, two products of
// equal n — silu(out_0) * out_1 (SwiGlu), where one lane group computes column j of both.
//
// Decode's products also take the row-pair mode (pair == 2, `fused_gemv1` only): one unit is two
// adjacent output columns of one segment, so that the unit's lane can finish a q or k head's
// rotary pairs (adjacent dims) and write them, and their KV-cache row, itself (`fg_rope_pair`).
//
// Work split as the unfused mul_mat_vec_k: a group of G lanes (G a power of two <= 32, from
// K on the host) owns one output column (a column of both products in pair mode); lane gl reads
// the 16-byte vectors gl, gl + G, ... of its weight rows, then the K % VW tail one element per
// lane, and the group sums its lanes with the same xor butterfly. Rows of a go in passes of MT
// (several rows of a: `fused_gemv` / `fused_gemv8`; one row, decode: `fused_gemv1` below).

#define FG_MAXS 4

// One product and its epilogues. Matches `FgSeg` in src/fusion/gemv.rs field for field.
struct FgSeg {
    i64 n;               // output columns (rows of W)
    u64 w;               // W row j at element j * w_rs
    i64 w_rs;
    u64 out;             // MulMat result (f32): element (i, j) at i * o_rs + j * o_cs
    i64 o_rs, o_cs;
    u64 add;             // the Add's other operand (0: no Add), broadcast strides
    i64 add_dt, a_rs, a_cs;
    u64 sum;             // the Add's result
    i64 sum_dt, s_rs, s_cs;
    i64 wout;            // 0: the product is dead after the group (nothing reads it), not written
    i64 wsum;            // 0: the same for the Add's result
    // Row-pair mode only. The segment's value (the Add's result, else the product; one row,
    // contiguous) as heads of hd dims: with n_dims > 0, a Rope (adjacent pairs) of it at
    // position pos[0] into r (contiguous, dtype r_dt) ...
    u64 r;
    i64 r_dt, hd, n_dims;
    double l2theta;      // log2 of the rope's theta base
    u64 pos;
    // ... and with c != 0, the SetRows of that result (or of the value, without the Rope) into
    // row idx[0] of cache c (c_n rows; a bad index is reported with `tag`).
    u64 c;
    i64 c_dt, c_rs, c_cs, c_n;
    u64 idx;
    i64 tag;
    // The weight's block type (quant.cuh's DT_Q4_0 ... DT_IQ4_XS; w_rs then counts bytes) for
    // `fused_gemv1_q`; 0 for the plain-dtype kernels, whose weights are all of their `dtw`.
    i64 qt;
};

// Matches `FgSet` in src/fusion/gemv.rs. pair == 1: nseg == 2, seg 0 = gate, seg 1 = up, and sw the
// SwiGlu result. pair == 2: row pairs (every n even). wnorm == 0: the norm prologue's results
// are dead after the group and not written. err: the error word of the SetRows epilogues.
struct FgSet {
    i64 nseg;
    FgSeg seg[FG_MAXS];
    i64 pair;
    u64 sw;
    i64 sw_dt, sw_rs, sw_cs;
    i64 wnorm;
    u64 err;
    // Decode's head (`fused_gemv1_q`, one segment; pair 0, or 2 for rows two to a unit under
    // `CudaConfig::q_head_pairs`, with no Rope or cache row): the u64 word that takes the
    // largest `argmax_key` of the products (atomicMax, then `argmax_take`), or 0.
    u64 amax;
    // With amax: where the launch itself takes the index (an i32, as `argmax_take` writes it;
    // `fq_take`), or 0 (`argmax_take` follows). The u32 8 bytes past the word is then the
    // blocks' ticket, zero between launches like the word.
    u64 take;
};

__device__ __forceinline__ float round_dt(int dt, float v) {
    switch (dt) {
        case DT_F16: return h2f(f2h(v));
        case DT_BF16: return bf2f(f2bf(v));
        default: return v;
    }
}

// Writes row i, column j of segment s: the product, then (reading the other operand after
// that write, as the unfused Add runs after the MulMat) the Add's result. Returns the value a
// later reader of the segment's result sees (the sum rounded to its dtype, or the product).
__device__ __forceinline__ float fg_store(const FgSeg& g, i64 i, i64 j, float y) {
    if (g.wout) ((float*)g.out)[i * g.o_rs + j * g.o_cs] = y;
    if (g.add) {
        float z = y + ld((const void*)g.add, (int)g.add_dt, i * g.a_rs + j * g.a_cs);
        if (g.wsum) st((void*)g.sum, (int)g.sum_dt, i * g.s_rs + j * g.s_cs, z);
        return round_dt((int)g.sum_dt, z);
    }
    return y;
}

// Columns j and j + 1 (one rotary pair: j even) of segment g in row-pair mode, decode's one
// row: the products and Adds, then the Rope as the rope kernel computes it (angle in f64 from
// the same expression; dims at or past n_dims copied), then the cache row — each value as the
// unfused chain's next node would read it back.
__device__ void fg_rope_pair(const FgSeg& g, u64 err, i64 j, float y0, float y1) {
    float z0 = fg_store(g, 0, j, y0), z1 = fg_store(g, 0, j + 1, y1);
    if (g.n_dims > 0) {
        if (j % g.hd < g.n_dims) {
            const i64 k = (j % g.hd) / 2;
            // theta^(-2k / n_dims) as exp2 of a host-computed log2: the same value to within
            // an ulp of f64 (invisible after the f32 rounding of sin and cos), a fraction of
            // pow's instructions on a path every q/k unit runs.
            const double freq = exp2(-2.0 * (double)k / (double)g.n_dims * g.l2theta);
            const double ang = (double)(*(const int*)g.pos) * freq;
            double sd, cd;
            sincos(ang, &sd, &cd);
            const float sn = (float)sd, cs = (float)cd;
            const float a = z0, b = z1;
            z0 = a * cs - b * sn;
            z1 = a * sn + b * cs;
        }
        st((void*)g.r, (int)g.r_dt, j, z0);
        st((void*)g.r, (int)g.r_dt, j + 1, z1);
        z0 = round_dt((int)g.r_dt, z0);
        z1 = round_dt((int)g.r_dt, z1);
    }
    if (g.c) {
        const int row = *(const int*)g.idx;
        if (row < 0 || (i64)row >= g.c_n) {
            report((u32*)err, (u32)g.tag);
        } else {
            const i64 base = (i64)row * g.c_rs;
            st((void*)g.c, (int)g.c_dt, base + j * g.c_cs, z0);
            st((void*)g.c, (int)g.c_dt, base + (j + 1) * g.c_cs, z1);
        }
    }
}

// Output units of a set: the columns of its segments one after another, the columns both
// products share (pair 1, NC 2), or the column pairs of the segments (pair 2, NC 2).
template <int NC>
__device__ __forceinline__ i64 fg_units(const FgSet& S) {
    if (NC == 2 && S.pair == 1) return S.seg[0].n;
    const int per = NC == 2 ? 2 : 1;
    i64 units = 0;
    for (int s = 0; s < S.nseg; ++s) units += S.seg[s].n / per;
    return units;
}

// Segment s and (first) column j of unit u, and the start of the weight row(s) it reads: row j
// of segment s, of each product (pair 1), or rows j and j + 1 of segment s (pair 2).
// DT: the weights' dtype (F32, F16, BF16), or a block type, whose row strides count bytes.
template <int DT, int NC>
__device__ __forceinline__ void fg_unit(const FgSet& S, i64 u, int& s, i64& j,
                                        const char* (&wr)[NC]) {
    const int ESZ = DT == DT_F32 ? 4 : DT == DT_F16 || DT == DT_BF16 ? 2 : 1;
    const bool pair1 = NC == 2 && S.pair == 1;
    const int per = NC == 2 ? 2 : 1;
    s = 0;
    j = u;
    if (!pair1) {
        while (s + 1 < S.nseg && j >= S.seg[s].n / per) {
            j -= S.seg[s].n / per;
            ++s;
        }
        j *= per;
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const FgSeg& g = S.seg[pair1 ? c : s];
        wr[c] = (const char*)g.w + (j + (pair1 ? 0 : c)) * g.w_rs * ESZ;
    }
}

template <int DT, int MT, int NC>
__device__ __forceinline__ void fg_body(i64 M, i64 K, const float* a, i64 a_rs, const FgSet& S,
                                        int G, int vec) {
    const int U = MT == 1 ? 4 / NC : 1;  // vectors per weight row in flight per lane
    const int gl = threadIdx.x & (G - 1);
    const i64 groups = blockDim.x / G;
    const i64 group = threadIdx.x / G;
    const i64 units = fg_units<NC>(S);
    for (i64 base = (i64)blockIdx.x * groups; base < units; base += (i64)gridDim.x * groups) {
        const i64 u = base + group;
        // Lanes past the last unit compute a clamped one (they take part in the shuffles);
        // their sums are not written.
        int s;
        i64 j;
        const char* wr[NC];
        fg_unit<DT, NC>(S, min(u, units - 1), s, j, wr);
        for (i64 i0 = 0; i0 < M; i0 += MT) {
            const int mt = (int)min((i64)MT, M - i0);
            const float* ab = a + i0 * a_rs;
            float acc[MT][NC];
            mmv_k_pass<DT, NC, MT, U>(acc, wr, K, G, gl, vec, ab, a_rs, mt);
#pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (r < mt) {
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        for (int off = G >> 1; off > 0; off >>= 1) {
                            acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], off);
                        }
                    }
                    if (gl == 0 && u < units) {
                        const i64 i = i0 + r;
                        if (NC == 1) {
                            fg_store(S.seg[s], i, j, acc[r][0]);
                        } else {
                            const float gv = acc[r][0], uv = acc[r][NC - 1];
                            fg_store(S.seg[0], i, j, gv);
                            fg_store(S.seg[1], i, j, uv);
                            st((void*)S.sw, (int)S.sw_dt, i * S.sw_rs + j * S.sw_cs, f_silu(gv) * uv);
                        }
                    }
                }
            }
        }
    }
}

// The norm prologue of `fused_gemv1`: y = round_n(x * inv) * w with inv = 1 / sqrt(mean(x^2) +
// eps), as rms_norm_mul computes it (round_n: rounding to the norm result's dtype), staged in
// xs as the products' activation; block 0 also writes the norm (nd) and the product (md, f32)
// in that order per element (unless `write` is off: they are dead). A row of up to NP_V values per thread is read once, x and w
// together; longer rows loop. `split`: xs in the layout of `split_slot`. The first NP_T
// threads take the elements (t, t + NP_T, ...), the rest of a larger block (`fused_gemv1_q`'s
// blocks of more than FG1_WARPS warps) only waits, so the norm's sum, and every bit after it,
// is the same whatever the block.
#define NP_V 8
#define NP_T 256
__device__ __noinline__ void norm_stage_any(float* xs, i64 K, const float* x, float eps, void* nd, int dtn,
                           const void* w, int dtw, float* md, bool split, bool write) {
    const i64 ng = split ? K / 8 : 0;
    const bool regs = K <= (i64)NP_T * NP_V;
    const bool in = threadIdx.x < NP_T;
    const bool first = write && blockIdx.x == 0;
    float xv[NP_V], wv[NP_V];
    float s = 0.0f;
    if (regs) {
#pragma unroll
        for (int j = 0; j < NP_V; ++j) {
            const i64 i = threadIdx.x + (i64)j * NP_T;
            xv[j] = in && i < K ? x[i] : 0.0f;
            wv[j] = in && i < K ? ld(w, dtw, i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < NP_V; ++j) s += xv[j] * xv[j];
    } else {
        for (i64 i = threadIdx.x; in && i < K; i += NP_T) {
            const float v = x[i];
            xs[split_slot(i, ng)] = v;
            s += v * v;
        }
    }
    s = block_sum(s);
    const float inv = 1.0f / sqrtf(s / (float)K + eps);
    if (regs) {
#pragma unroll
        for (int j = 0; j < NP_V; ++j) {
            const i64 i = threadIdx.x + (i64)j * NP_T;
            if (in && i < K) {
                const float y = round_dt(dtn, xv[j] * inv) * wv[j];
                xs[split_slot(i, ng)] = y;
                if (first) {
                    st(nd, dtn, i, xv[j] * inv);
                    md[i] = y;
                }
            }
        }
    } else {
        for (i64 i = threadIdx.x; in && i < K; i += NP_T) {
            const i64 sl = split_slot(i, ng);
            const float xo = xs[sl];
            const float y = round_dt(dtn, xo * inv) * ld(w, dtw, i);
            xs[sl] = y;
            if (first) {
                st(nd, dtn, i, xo * inv);
                md[i] = y;
            }
        }
    }
    __syncthreads();
}

// The norm prologue. Its common case — f32 weight row and norm result, a row of at most NP_V
// values per thread — takes a short path of plain loads and stores: decode kernels are
// short enough that fetching their instructions is much of their time, and the generic
// path's per-element dtype switches are most of this prologue's code.
__device__ __forceinline__ void norm_stage(float* xs, i64 K, const float* x, float eps, void* nd,
                                           int dtn, const void* w, int dtw, float* md,
                                           bool split, bool write) {
    if (dtn != DT_F32 || dtw != DT_F32 || K > (i64)NP_T * NP_V) {
        norm_stage_any(xs, K, x, eps, nd, dtn, w, dtw, md, split, write);
        return;
    }
    const int k = (int)K, ng = split ? k / 8 : 0;
    const bool first = write && blockIdx.x == 0;
    float xv[NP_V], wv[NP_V];
    const float inv = row_rms_f32<NP_V>(x, (const float*)w, k, eps, xv, wv, NP_T);
#pragma unroll
    for (int j = 0; j < NP_V; ++j) {
        const int i = threadIdx.x + j * NP_T;
        if ((int)threadIdx.x < NP_T && i < k) {
            const float n = xv[j] * inv, y = n * wv[j];
            xs[i < ng * 8 ? ((i & 4) ? ng * 4 : 0) + (i >> 3) * 4 + (i & 3) : i] = y;
            if (first) {
                ((float*)nd)[i] = n;
                md[i] = y;
            }
        }
    }
    __syncthreads();
}

// acc[c] += the products of loaded weight vector w[c] (vector v of its row) with the VW
// activation values of v — one step of both decode bodies below.
template <int DT, int NC, bool STAGED>
__device__ __forceinline__ void fg1_fma(const float* xr, int v, int nvec, const uint4 (&w)[NC],
                                        float (&acc)[NC]) {
    const int VW = DT == DT_F32 ? 4 : 8;
    float xa[VW];
    decode_x<VW>(xr, v, nvec, STAGED, xa);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        float f[VW];
        unpack16<DT>(w[c], f);
#pragma unroll
        for (int e = 0; e < VW; ++e) acc[c] = fmaf(xa[e], f[e], acc[c]);
    }
}

// A unit's last K % VW products, then its lanes' sums (a fixed xor butterfly): every lane
// ends with the unit's sums.
template <int DT, int NC>
__device__ __forceinline__ void fg1_sums(int K, int nvec, const float* xr, const uint4* const (&wr)[NC],
                                         int lane, float (&acc)[NC]) {
    const int VW = DT == DT_F32 ? 4 : 8;
#pragma unroll 1
    for (int kk = nvec * VW + lane; kk < K; kk += 32) {
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = fmaf(xr[kk], ld((const void*)wr[c], DT, kk), acc[c]);
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], off);
    }
}

// The epilogue of a unit without row pairs: column j of segment s (NC 1), or of gate and up
// with their SwiGlu (NC 2).
template <int NC>
__device__ __forceinline__ void fg1_store(const FgSet& S, int s, i64 j, const float (&acc)[NC]) {
    if (NC == 1) {
        fg_store(S.seg[s], 0, j, acc[0]);
    } else {
        const float gv = acc[0], uv = acc[NC - 1];
        fg_store(S.seg[0], 0, j, gv);
        fg_store(S.seg[1], 0, j, uv);
        st((void*)S.sw, (int)S.sw_dt, j * S.sw_cs, f_silu(gv) * uv);
    }
}

// Decode (one row of a, every weight row 16-byte aligned): the same products and epilogues
// with the work split of `mul_mat_vec_1` — one output unit (column j of a segment, or of both
// products in pair mode) per warp, FG1_U 16-byte loads of each weight row in flight per lane,
// the first ones issued before a is staged in shared memory (`staged`, K floats) or read
// through the read-only cache. Partial sums meet in a fixed xor butterfly (deterministic).
#define FG1_WARPS 8  // NP_T / 32
#define FG1_U 8
// `fg_unit` with the weight rows as 16-byte vectors (decode's rows are 16-byte aligned).
template <int DT, int NC>
__device__ __forceinline__ void fg1_unit(const FgSet& S, int u, int& s, i64& j,
                                         const uint4* (&wr)[NC]) {
    const char* row[NC];
    fg_unit<DT, NC>(S, u, s, j, row);
#pragma unroll
    for (int c = 0; c < NC; ++c) wr[c] = (const uint4*)row[c];
}

// The start of both decode bodies: a unit's first FG1_U weight loads per lane (`active`: the
// warp has a unit), issued before the wait when `ahead`, then the activation row staged in
// xs — through the norm prologue when nx != 0 — or read in place. Returns the row to use.
template <int DT, int NC, bool STAGED>
__device__ __forceinline__ const float* fg1_start(int K, const float* a, const FgSet& S, float* xs,
                                                  int ahead, bool active,
                                                  const uint4* const (&wr)[NC],
                                                  uint4 (&q)[FG1_U / NC][NC], const float* nx,
                                                  float eps, void* nd, int dtn, const void* nw,
                                                  int dtnw) {
    const int VW = DT == DT_F32 ? 4 : 8;
    const int lane = threadIdx.x & 31, nvec = K / VW;
    if (!ahead) pdl_entry();
#pragma unroll
    for (int t = 0; t < FG1_U / NC; ++t) {
        const int v = lane + 32 * t;
#pragma unroll
        for (int c = 0; c < NC; ++c) q[t][c] = active && v < nvec ? ld_weight(wr[c] + v) : make_uint4(0, 0, 0, 0);
    }
    if (ahead) pdl_entry();
    if (!STAGED) return a;
    if (nx) {
        norm_stage(xs, K, nx, eps, nd, dtn, nw, dtnw, (float*)a, VW == 8, S.wnorm != 0);
    } else {
        stage_row(xs, a, K, VW == 8);
    }
    return xs;
}

// Offsets are 32-bit (the host checks K and the units fit) and `staged` is a template
// parameter: decode kernels spend much of their time fetching instructions (each warp runs
// its path once), so the path is kept short — no 64-bit index arithmetic, no run-time branch
// per weight load, no unrolled copies of loops that run once.
template <int DT, int NC, bool STAGED>
__device__ __forceinline__ void fg1_body(int K, const float* a, const FgSet& S, float* xs,
                                         int ahead, const float* nx, float eps, void* nd,
                                         int dtn, const void* nw, int dtnw) {
    const int VW = DT == DT_F32 ? 4 : 8;
    const int U = FG1_U / NC;
    const int lane = threadIdx.x & 31;
    const int units = (int)fg_units<NC>(S);
    const int u = blockIdx.x * FG1_WARPS + (threadIdx.x >> 5);
    const bool active = u < units;
    int s;
    i64 j;
    const uint4* wr[NC];
    fg1_unit<DT, NC>(S, active ? u : 0, s, j, wr);
    const int nvec = K / VW;
    uint4 q[U][NC];
    const float* xr = fg1_start<DT, NC, STAGED>(K, a, S, xs, ahead, active, wr, q, nx, eps, nd,
                                                dtn, nw, dtnw);
    if (!active) return;
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
#pragma unroll 1
    for (int v0 = 0; v0 < nvec; v0 += 32 * U) {
        if (v0 > 0) {
#pragma unroll
            for (int t = 0; t < U; ++t) {
                const int v = v0 + lane + 32 * t;
#pragma unroll
                for (int c = 0; c < NC; ++c) q[t][c] = v < nvec ? ld_weight(wr[c] + v) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int t = 0; t < U; ++t) {
            const int v = v0 + lane + 32 * t;
            if (v < nvec) fg1_fma<DT, NC, STAGED>(xr, v, nvec, q[t], acc);
        }
    }
    fg1_sums<DT, NC>(K, nvec, xr, wr, lane, acc);
    if (lane == 0) {
        if (NC == 2 && S.pair == 2) {
            fg_rope_pair(S.seg[s], S.err, j, acc[0], acc[NC - 1]);
        } else {
            fg1_store<NC>(S, s, j, acc);
        }
    }
}

// The same products without row-pair epilogues (NC 1, or gate/up with SwiGlu), streamed: the
// grid is at most one wave and its warps stride over the units (unit u, u + warps, ...), and
// each lane keeps its FG1_U weight loads in flight the whole time — the register of a loaded
// vector is refilled, as soon as its products are done, with the load FG1_U vectors ahead in
// the warp's sequence: the next round of the unit, or the first of its next unit. No block
// turnover, no round without loads in flight, and the staging (and norm prologue) runs once
// per block. Each unit is still one warp's, in the same order (the same sums bit for bit).
template <int DT, int NC, bool STAGED>
__device__ __forceinline__ void fg1_stream(int K, const float* a, const FgSet& S, float* xs,
                                           int ahead, const float* nx, float eps, void* nd,
                                           int dtn, const void* nw, int dtnw) {
    const int VW = DT == DT_F32 ? 4 : 8;
    const int U = FG1_U / NC;
    const int lane = threadIdx.x & 31;
    const int units = (int)fg_units<NC>(S);
    const int stride = gridDim.x * FG1_WARPS;
    int u = blockIdx.x * FG1_WARPS + (threadIdx.x >> 5);
    const int nvec = K / VW;
    int s;
    i64 j;
    const uint4* wr[NC];
    fg1_unit<DT, NC>(S, u < units ? u : 0, s, j, wr);
    uint4 q[U][NC];
    const float* xr = fg1_start<DT, NC, STAGED>(K, a, S, xs, ahead, u < units, wr, q, nx, eps,
                                                nd, dtn, nw, dtnw);
#pragma unroll 1
    while (u < units) {  // warp-uniform
        const int un = u + stride;
        int sn;
        i64 jn;
        const uint4* wn[NC];
        fg1_unit<DT, NC>(S, un < units ? un : u, sn, jn, wn);
        float acc[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
#pragma unroll 1
        for (int v0 = 0; v0 < nvec; v0 += 32 * U) {
            const bool last = v0 + 32 * U >= nvec;
#pragma unroll
            for (int t = 0; t < U; ++t) {
                const int v = v0 + lane + 32 * t;
                if (v < nvec) fg1_fma<DT, NC, STAGED>(xr, v, nvec, q[t], acc);
                // Refill: this unit's next round, or the next unit's first.
                const int vn = last ? lane + 32 * t : v + 32 * U;
                const bool ok = vn < nvec && (!last || un < units);
#pragma unroll
                for (int c = 0; c < NC; ++c) q[t][c] = ok ? ld_weight((last ? wn[c] : wr[c]) + vn) : make_uint4(0, 0, 0, 0);
            }
        }
        fg1_sums<DT, NC>(K, nvec, xr, wr, lane, acc);
        if (lane == 0) fg1_store<NC>(S, s, j, acc);
        u = un;
        s = sn;
        j = jn;
#pragma unroll
        for (int c = 0; c < NC; ++c) wr[c] = wn[c];
    }
}

// blockDim.x == FG1_WARPS * 32; dynamic shared memory K floats when `staged`. With nx != 0
// (then `staged`), a is the result of the norm prologue (`norm_stage`) over row nx. K and
// the number of output units are below 2^31 (checked on the host). `stream`: the grid may be
// smaller than one warp per unit (`fg1_stream`); row pairs (S.pair == 2) are never streamed.
#define FG1_NORM nx, eps, nd, dtn, nw, dtnw
#define FG1_CASE(DT, NC)                                                              \
    if (S.pair == 2 || !stream) {                                                     \
        if (staged) {                                                                 \
            fg1_body<DT, NC, true>((int)K, a, S, xs, ahead, FG1_NORM);                \
        } else {                                                                      \
            fg1_body<DT, NC, false>((int)K, a, S, xs, ahead, FG1_NORM);               \
        }                                                                             \
    } else if (staged) {                                                              \
        fg1_stream<DT, NC, true>((int)K, a, S, xs, ahead, FG1_NORM);                  \
    } else {                                                                          \
        fg1_stream<DT, NC, false>((int)K, a, S, xs, ahead, FG1_NORM);                 \
    }                                                                                 \
    break;
// One product per unit (S.pair == 0). The pair modes have their own entry point below, so
// that each is allocated the registers it needs: the row-pair epilogue's f64 rope would
// otherwise cost every product a resident block per multiprocessor.
#if LS_PART(1)
extern "C" __global__ void __launch_bounds__(FG1_WARPS * 32) fused_gemv1(i64 K, const float* a,
                                                                      FgSet S, int dtw,
                                                                      int staged, int ahead,
                                                                      int stream,
                                                                      const float* nx,
                                                                      float eps, void* nd,
                                                                      int dtn, const void* nw,
                                                                      int dtnw) {
    extern __shared__ float4 fg1_smem[];
    float* xs = (float*)fg1_smem;
    switch (dtw) {
        case DT_F16: FG1_CASE(DT_F16, 1)
        case DT_BF16: FG1_CASE(DT_BF16, 1)
        default: FG1_CASE(DT_F32, 1)
    }
}
#endif

// The streamed, staged path of `fused_gemv1` for one weight dtype each (`fused_gemv1_s16`: f16,
// `fused_gemv1_sb16`: bf16, `fused_gemv1_s32`: f32; decode's o and down), same parameters
// (`staged` and `stream` are 1). Held to 80 registers: two of these blocks (the streamed grid)
// then leave room for a `fused_gemv1_pair` block (88) on the multiprocessor, so the next
// kernel's first wave (q/k/v after down, gate/up after o) loads its weights while this one
// finishes. The host pads each block's shared memory (`stream_pad` in src/config.rs) so that a
// third does not fit: unpadded, three land on some multiprocessors and the grid of two per
// multiprocessor runs unevenly (H200, "1b": 755 µs per token unpadded, 730 padded, 760 with
// `fused_gemv1`). One path per entry point is what fits in 80: `fused_gemv1` with every path
// takes 104 registers, and capped at 80 it spills in the streamed loop.
#define FG1S_PARAMS                                                                             \
    i64 K, const float *a, FgSet S, int dtw, int staged, int ahead, int stream, const float *nx, \
        float eps, void *nd, int dtn, const void *nw, int dtnw
// The body of a one-path entry point: `fg1_stream` or `fg1_body` (PATH stream or body), staged,
// for weights of dtype DT_##DT and NC products per unit.
#define FG1_OWN(PATH, DT, NC)                                                               \
    extern __shared__ float4 fg1_smem[];                                                    \
    fg1_##PATH<DT_##DT, NC, true>((int)K, a, S, (float*)fg1_smem, ahead, FG1_NORM);
#if LS_PART(2)
extern "C" __global__ void __maxnreg__(80) fused_gemv1_s16(FG1S_PARAMS) { FG1_OWN(stream, F16, 1) }
extern "C" __global__ void __maxnreg__(80) fused_gemv1_sb16(FG1S_PARAMS) { FG1_OWN(stream, BF16, 1) }
extern "C" __global__ void __maxnreg__(80) fused_gemv1_s32(FG1S_PARAMS) { FG1_OWN(stream, F32, 1) }
#endif

// Gate/up with SwiGlu (S.pair == 1) and row pairs (S.pair == 2); same parameters — the paths
// the entry points below do not take (`LOWSYNC_CUDA_TUNE=gemv_split=0`, unstaged, unstreamed). At
// most 88 registers per thread (a spill of 8 bytes in the rope epilogue; blockDim.x is
// FG1_WARPS * 32):
// with programmatic dependent launch the next kernel's blocks start on a multiprocessor only
// where registers are left, and 88 leaves room for an `attn_fast` block (158) beside one of
// these — attention rehearses while q/k/v finishes. `fused_gemv1` (104) does not fit beside two
// streamed gate/up blocks, nor these beside two of its own; holding it to 80 to make room was
// measured slower on the H200 (docs/notes/decode-experiments.md).
#if LS_PART(1)
extern "C" __global__ void __maxnreg__(88) fused_gemv1_pair(FG1S_PARAMS) {
    extern __shared__ float4 fg1_smem[];
    float* xs = (float*)fg1_smem;
    switch (dtw) {
        case DT_F16: FG1_CASE(DT_F16, 2)
        case DT_BF16: FG1_CASE(DT_BF16, 2)
        default: FG1_CASE(DT_F32, 2)
    }
}
#endif
#undef FG1_CASE

// The two decode paths of `fused_gemv1_pair`, each in its own entry point per weight dtype
// (the parameters of `fused_gemv1_s16`, `staged` 1): gate/up with SwiGlu streamed
// (`fused_gemv1_gu16`, `_gub16`, `_gu32`: `stream` 1) and q/k/v's row pairs
// (`fused_gemv1_rp16`, `_rpb16`, `_rp32`). Alone,
// each path fits in 88 registers without a spill, and its launch runs only its own code —
// these kernels fetch much of their time in instructions. On the H200 ("1b", one process):
// 699.9 µs per token against 730.7 through `fused_gemv1_pair` (q/k/v 7.17 -> 6.33 µs per
// layer exposed, gate/up 19.71 -> 18.27, down 9.28 -> 9.73).
#if LS_PART(2)
extern "C" __global__ void __maxnreg__(88) fused_gemv1_gu16(FG1S_PARAMS) { FG1_OWN(stream, F16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_gub16(FG1S_PARAMS) { FG1_OWN(stream, BF16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_gu32(FG1S_PARAMS) { FG1_OWN(stream, F32, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_rp16(FG1S_PARAMS) { FG1_OWN(body, F16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_rpb16(FG1S_PARAMS) { FG1_OWN(body, BF16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_rp32(FG1S_PARAMS) { FG1_OWN(body, F32, 2) }
#endif
#undef FG1_OWN
#undef FG1S_PARAMS

// ---------------------------------------------------------------------------------------------
// Decode's products on GGUF block (quantized) weights, `fused_gemv1_q`: the same units and
// epilogues as `fused_gemv1` / `_pair` (columns of the segments, gate/up with SwiGlu, or q/k/v's
// row pairs with their Rope and KV-cache row), each segment's weight of its own block type
// (`FgSeg::qt`: a Q4_K_M file mixes Q4_K and Q6_K in one group). The activation row is staged
// in shared memory (plain layout) — through the norm prologue when nx != 0 — then each warp
// takes a unit (u, u + warps of the grid, ...); lane l dequantizes its weight row's 16-value
// chunks l, l + 32, ... in registers (`dq16`, quant.cuh: values bit-identical to gguf-py's) and
// accumulates them in f32 in k order, and the lanes meet in the fixed xor butterfly: the order
// depends only on K, so results are deterministic and do not depend on the grid. The blocks
// are read in place (2-byte aligned fields: byte and 16-bit loads; a warp's 32 chunks are one
// contiguous run of the row, so its loads share cache lines).
//
// With `q16` (the default, `LOWSYNC_CUDA_TUNE=qdot=q16`) the staged row is then quantized in
// place to q16 records (quant.cuh: the CPU backend's 16-bit activation blocks, bit for bit) and
// lane l takes 32-value pieces l, l + 32, ... of the weight row as integers (`iq16`) against
// them with dp2a (`fq_dot16`), in k order; same units, same butterfly. With `q8`
// (`qdot=q8`) the records are the CPU backend's 8-bit blocks and the pieces go through dp4a
// (`fq_dot8`, quant.cuh's `q8_piece`). Without either (`qdot=f32`) the chunks are dequantized
// to f32 (`dq16`) and multiplied by the f32 row.

// Lane `lane`'s part of the dot product of weight row w (K values of block type QT) with xr:
// its chunks in order, two per round — both chunks' bytes are loaded before either is used
// (the second's address clamped to the row: the loads stay unconditional, its products are
// skipped past the end), doubling the weight bytes each warp has in flight.
template <int QT>
__device__ __forceinline__ float fq_dot(const u8* w, int K, const float* xr, int lane) {
    const int QB = q_block_size(QT), BB = q_block_bytes(QT), CPB = QB / 16;
    const int nch = K / 16;
    float acc = 0.0f;
#pragma unroll 1
    for (int c0 = lane; c0 < nch; c0 += 64) {
        const int c1 = min(c0 + 32, nch - 1);
        float v[2][16];
        dq16<QT>(w + (c0 / CPB) * BB, c0 % CPB, v[0]);
        dq16<QT>(w + (c1 / CPB) * BB, c1 % CPB, v[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h == 0 || c0 + 32 < nch) {
                const int c = h ? c1 : c0;
                const float4* x4 = (const float4*)(xr + 16 * c);
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const float4 x = x4[t ^ ((c >> 1) & 3)];  // `fq_swizzle`'s layout
                    acc = fmaf(x.x, v[h][4 * t], acc);
                    acc = fmaf(x.y, v[h][4 * t + 1], acc);
                    acc = fmaf(x.z, v[h][4 * t + 2], acc);
                    acc = fmaf(x.w, v[h][4 * t + 3], acc);
                }
            }
        }
    }
    return acc;
}

// Lane `lane`'s part of a `q_paired` row's dot product (Q4_K, Q6_K): pairs of pieces sharing
// their bytes, g = lane, lane + 32, ..., one a round (`iq64`), each pair's two pieces in order,
// against q16 records, or q8 records with Q8.
template <int QT, bool Q8>
__device__ __forceinline__ float fq_dot_pairs(const u8* w, int K, const u8* xq, int lane) {
    const int BB = q_block_bytes(QT);
    float acc = 0.0f;
#pragma unroll 1
    for (int g = lane; g < K / 64; g += 32) {
        u32 wv[4][4];
        float d[4], m[4];
        iq64<QT>(w + (g / 4) * BB, g % 4, wv, d, m);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int piece = q_pair_piece<QT>(g, e);
            if (Q8) {
                acc = q8_fma<QT>(wv[2 * e], wv[2 * e + 1], d[2 * e], m[2 * e], d[2 * e + 1], m[2 * e + 1],
                                 q8_load(xq + Q8_REC * piece), acc);
            } else {
                acc = q16_fma<QT>(wv[2 * e], d[2 * e], m[2 * e], xq + Q16_REC * piece, 0, acc);
                acc = q16_fma<QT>(wv[2 * e + 1], d[2 * e + 1], m[2 * e + 1], xq + Q16_REC * piece, 1, acc);
            }
        }
    }
    return acc;
}

// `fq_dot` on the q16 records at xq (`fq_quantize`): lane `lane` takes 32-value pieces (both
// chunks of one record, decoded together by `iq32`, which loads a piece's bytes once for
// both where its block type allows) p = lane, lane + 32, ..., two per round with both
// pieces' weight loads issued first (the second piece's index clamped to the row, its
// products skipped past the end), and adds each chunk's integer sum against its half record,
// in k order. Q4_K and Q6_K (`q_paired`): pairs of pieces g = lane, lane + 32, ..., one a
// round, each pair's two pieces in order (`iq64`, `q_pair_piece`).
template <int QT>
__device__ __forceinline__ float fq_dot16(const u8* w, int K, const u8* xq, int lane) {
    const int QB = q_block_size(QT), BB = q_block_bytes(QT), PPB = QB / 32;
    const int np = K / 32;
    float acc = 0.0f;
    if (q_paired(QT)) return fq_dot_pairs<QT, false>(w, K, xq, lane);
#pragma unroll 1
    for (int p0 = lane; p0 < np; p0 += 64) {
        const int p1 = min(p0 + 32, np - 1);
        u32 wv[4][4];
        float d[4], m[4];
        iq32<QT>(w + (p0 / PPB) * BB, p0 % PPB, wv[0], wv[1], d[0], m[0], d[1], m[1]);
        iq32<QT>(w + (p1 / PPB) * BB, p1 % PPB, wv[2], wv[3], d[2], m[2], d[3], m[3]);
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            if (h < 2 || p0 + 32 < np) {
                const int p = h < 2 ? p0 : p1;
                acc = q16_fma<QT>(wv[h], d[h], m[h], xq + Q16_REC * p, h & 1, acc);
            }
        }
    }
    return acc;
}

// `fq_dot16` on q8 records (`fq_quantize` with qm 2): the same pieces, two per round, each
// `q8_piece` (dp4a, f32 once per piece where the block type's scale spans it). The second
// piece's sum is taken unconditionally (its index clamped to the row) and kept only inside it,
// so both pieces' weight loads issue before either is used. Q4_K and Q6_K (`q_paired`): pairs
// of pieces g = lane, lane + 32, ..., one a round, as `fq_dot16` takes them.
template <int QT>
__device__ __forceinline__ float fq_dot8(const u8* w, int K, const u8* xq, int lane) {
    const int QB = q_block_size(QT), BB = q_block_bytes(QT), PPB = QB / 32;
    const int np = K / 32;
    float acc = 0.0f;
    if (q_paired(QT)) return fq_dot_pairs<QT, true>(w, K, xq, lane);
#pragma unroll 1
    for (int p0 = lane; p0 < np; p0 += 64) {
        const int p1 = min(p0 + 32, np - 1);
        const Q8x x0 = q8_load(xq + Q8_REC * p0), x1 = q8_load(xq + Q8_REC * p1);
        acc = q8_piece<QT>(w + (p0 / PPB) * BB, p0 % PPB, x0, acc);
        const float a1 = q8_piece<QT>(w + (p1 / PPB) * BB, p1 % PPB, x1, acc);
        acc = p0 + 32 < np ? a1 : acc;
    }
    return acc;
}

// The whole warp's dot product of row w (block type qt, warp-uniform) with the staged row xr
// (f32, `fq_swizzle`d; q16 records with qm 1, q8 records with qm 2), in every lane. Not
// inlined: one copy of the decoders per kernel, however many rows a unit has.
__device__ __noinline__ float fq_row(int qt, const u8* w, int K, const float* xr, int lane, int qm) {
    float acc = 0.0f;
    if (qm == 2) {
        QUANT_SWITCH(qt, acc = fq_dot8<QTV>(w, K, (const u8*)xr, lane))
    } else if (qm) {
        QUANT_SWITCH(qt, acc = fq_dot16<QTV>(w, K, (const u8*)xr, lane))
    } else {
        QUANT_SWITCH(qt, acc = fq_dot<QTV>(w, K, xr, lane))
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

// `fq_row` on q16 records (on q8 records with Q8: a piece's two chunks against one record,
// `q8_fma`, as `fq_dot8`) for the NC weight rows of a unit, of one block type known when
// compiling (the typed entry points): each row's pieces, sums and butterfly as `fq_dot16` and
// `fq_row` take them, in the same order (so the same bits), but a round takes PR pieces of
// every row of the unit (lane l: pieces l, l + 32, ... of the round), all their weight loads
// issued before any of their products: a row's rounds are dependent trips to memory, so fewer,
// fuller rounds (two rows of a pair together, or four pieces of one row) keep more bytes in
// flight per warp; Q4_K and Q6_K take PR / 2 pairs of pieces a round instead (`q_paired`),
// in `fq_dot16`'s order. Past the row's end a piece's index is clamped (its loads stay
// unconditional) and its products skipped. Inlined into the unit loop instead of called
// through the switch over arithmetics and types. Q4_K rows start on 16 bytes here (the host
// launches the typed kernels of Q4_K only then), so `iq32` takes them without its test.
template <int QT, int NC, int PR, bool Q8>
__device__ __forceinline__ void fq_rows16(const char* const (&w)[NC], int K, const u8* xq, int lane,
                                          float (&acc)[NC]) {
    const int QB = q_block_size(QT), BB = q_block_bytes(QT), PPB = QB / 32;
    const int np = K / 32;
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    if (q_paired(QT)) {
        // PR / 2 pairs of pieces a round (`iq64`), the same pieces as PR single ones.
        constexpr int PG = PR / 2 > 0 ? PR / 2 : 1;
        const int ng = K / 64;
#pragma unroll 1
        for (int g0 = lane; g0 < ng; g0 += 32 * PG) {
            u32 wv[NC][4 * PG][4];
            float d[NC][4 * PG], m[NC][4 * PG];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const u8* r = (const u8*)w[c];
#pragma unroll
                for (int i = 0; i < PG; ++i) {
                    const int g = min(g0 + 32 * i, ng - 1);
                    iq64<QT, true>(r + (g / 4) * BB, g % 4, &wv[c][4 * i], &d[c][4 * i], &m[c][4 * i]);
                }
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
#pragma unroll
                for (int h = 0; h < 4 * PG; h += Q8 ? 2 : 1) {
                    const int g = g0 + 32 * (h / 4);
                    if (!(h < 4 || g < ng)) continue;
                    const int piece = q_pair_piece<QT>(g, (h / 2) & 1);
                    if (Q8) {
                        acc[c] = q8_fma<QT>(wv[c][h], wv[c][h + 1], d[c][h], m[c][h], d[c][h + 1], m[c][h + 1],
                                            q8_load(xq + Q8_REC * piece), acc[c]);
                    } else {
                        acc[c] = q16_fma<QT>(wv[c][h], d[c][h], m[c][h], xq + Q16_REC * piece, h & 1, acc[c]);
                    }
                }
            }
        }
    } else {
#pragma unroll 1
        for (int p0 = lane; p0 < np; p0 += 32 * PR) {
            u32 wv[NC][2 * PR][4];
            float d[NC][2 * PR], m[NC][2 * PR];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const u8* r = (const u8*)w[c];
#pragma unroll
                for (int i = 0; i < PR; ++i) {
                    const int p = min(p0 + 32 * i, np - 1);
                    iq32<QT, true>(r + (p / PPB) * BB, p % PPB, wv[c][2 * i], wv[c][2 * i + 1], d[c][2 * i], m[c][2 * i],
                             d[c][2 * i + 1], m[c][2 * i + 1]);
                }
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
#pragma unroll
                for (int h = 0; h < 2 * PR; h += Q8 ? 2 : 1) {
                    const int p = p0 + 32 * (h / 2);
                    if (!(h < 2 || p < np)) continue;
                    if (Q8) {
                        acc[c] = q8_fma<QT>(wv[c][h], wv[c][h + 1], d[c][h], m[c][h], d[c][h + 1], m[c][h + 1],
                                            q8_load(xq + Q8_REC * p), acc[c]);
                    } else {
                        acc[c] = q16_fma<QT>(wv[c][h], d[c][h], m[c][h], xq + Q16_REC * p, h & 1, acc[c]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], off);
    }
}

// A unit's NC rows of block type QT (the typed entry points) into acc, on q16 records or (Q8)
// q8 records, rounds as `pf` bit 2 says (`fq_rows16`).
template <int QT, int NC, bool Q8>
__device__ __forceinline__ void fq_unit16(const char* const (&wr)[NC], int K, const u8* xq, int lane, int pf,
                                          float (&acc)[NC]) {
    if (NC == 1 && !(pf & 4) && K >= 32 * 32 * 4) {
        // A single row of four pieces a lane or more (down): four a round. A shorter row
        // would load pieces past its end (o, the head: two a lane at K = 2048).
        fq_rows16<QT, NC, 4, Q8>(wr, K, xq, lane, acc);
    } else if (NC == 1 || !(pf & 4)) {
        // A pair's rows two pieces a round each (one trip where the generic kernel takes two).
        fq_rows16<QT, NC, 2, Q8>(wr, K, xq, lane, acc);
    } else {
        // `pf` bit 2: each row of a pair alone, two pieces a round (the generic kernel's loads).
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const char* w1[1] = {wr[c]};
            float a1[1];
            fq_rows16<QT, 1, 2, Q8>(w1, K, xq, lane, a1);
            acc[c] = a1[0];
        }
    }
}

// Re-lays the staged row (every thread takes part) for `fq_dot`: float4 t of chunk c (16
// values) moves to slot t ^ ((c >> 1) & 3) of the chunk, so the eight lanes of one 16-byte
// shared-memory access (chunks c .. c + 7, the same t) hit eight distinct bank groups; in the
// plain layout, 64 bytes lane to lane, they meet four to a bank group.
__device__ __forceinline__ void fq_swizzle(float* xs, int K) {
    float4* x4 = (float4*)xs;
    for (int c = threadIdx.x; c < K / 16; c += blockDim.x) {
        const int sw = (c >> 1) & 3;
        float4 v[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) v[t] = x4[4 * c + t];
#pragma unroll
        for (int t = 0; t < 4; ++t) x4[4 * c + (t ^ sw)] = v[t];
    }
    __syncthreads();
}

// The 16 floats at p (16-byte aligned) into v.
__device__ __forceinline__ void fq_load16(const float* p, float (&v)[16]) {
    const float4* x4 = (const float4*)p;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const float4 f = x4[t];
        v[4 * t] = f.x;
        v[4 * t + 1] = f.y;
        v[4 * t + 2] = f.z;
        v[4 * t + 3] = f.w;
    }
}

// Half-block h's values v into its q16 record at xs (with `Q8`, its q8 record); `live` false:
// a thread past the row, which takes part in the halves' shuffle and stores nothing.
template <bool Q8>
__device__ __forceinline__ void fq_half(const float (&v)[16], float* xs, int h, bool live) {
    if (Q8) {
        q8_half(v, (u8*)xs + Q8_REC * (h / 2), h, live);
    } else {
        q16_half(v, (u8*)xs + Q16_REC * (h / 2), h, live);
    }
}

// Quantizes the staged row (K floats at xs, K a multiple of 32; every thread takes part) in
// place to K / 32 q16 records at xs (`Q16_REC` bytes each, 2.5 bytes a value: they fit in the
// row's 4), or with `Q8` to q8 records (`Q8_REC` bytes, 1.5 bytes a value). Thread t of round r
// takes half-block h = r * blockDim.x + t (16 floats); all of a round's floats are read before
// the barrier and its records written after it. Round r's records end at byte 40 (q8: 24) *
// blockDim.x * (r + 1), below the floats of round r + 1 (from byte 64 * blockDim.x * (r + 1)),
// so a record only overwrites floats already read.
// A warp whose first lane's half-block lies past the row only meets the barriers.
template <bool Q8>
__device__ __forceinline__ void fq_quantize(float* xs, int K) {
    const int nh = K / 16;
    const int w0 = (int)(threadIdx.x & ~31u);
    for (int h0 = 0; h0 < nh; h0 += blockDim.x) {
        const int h = h0 + threadIdx.x;
        const bool live = h < nh, warp_live = h0 + w0 < nh;
        float v[16];
        if (warp_live) fq_load16(xs + 16 * (live ? h : 0), v);
        __syncthreads();
        if (warp_live) fq_half<Q8>(v, xs, h, live);
    }
    __syncthreads();
}

// `fq_quantize` of the row at a (global, K floats, 16-byte aligned; K a multiple of 32)
// without staging it: thread t of round r takes half-block h = r * blockDim.x + t, its 16
// floats loaded from a straight into registers (two rounds' loads issued before either is
// quantized), and writes its q16 (or with `Q8` q8) record half to xs. The same records bit
// for bit (the same values through `q16_half` / `q8_half`); the floats never pass through
// shared memory, so no barrier but the last.
template <bool Q8>
__device__ __forceinline__ void fq_quantize_direct(float* xs, const float* a, int K) {
    const int nh = K / 16, bd = (int)blockDim.x;
    // A warp takes a round's half-blocks only where its first lane's is inside the row: uniform
    // over the warp (every lane of a live warp meets the halves' shuffle), and the warps past the
    // row (12 of o's 16 at K = 2,048) neither load nor quantize. Their rounds end for good, since
    // h0 only grows.
    const int w0 = (int)(threadIdx.x & ~31u);
    for (int h0 = 0; h0 + w0 < nh; h0 += 2 * bd) {
        float v[2][16];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int h = h0 + r * bd + (int)threadIdx.x;
            if (h0 + r * bd + w0 < nh) fq_load16(a + 16 * (h < nh ? h : 0), v[r]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (h0 + r * bd + w0 < nh) {
                const int h = h0 + r * bd + (int)threadIdx.x;
                fq_half<Q8>(v[r], xs, h, h < nh);
            }
        }
    }
    __syncthreads();
}

// The norm prologue and `fq_quantize_direct` together (f32 row x, f32 norm weight w, both
// 16-byte aligned, K <= NP_T * NP_V, K a multiple of 32): the sum of squares as `norm_stage`
// takes it (`row_rms_f32` over the first NP_T threads), block 0 writing the norm (nd) and its
// product (md) unless `write` is off, then each thread's half-blocks of x and w loaded again,
// straight from global memory (the block's loads of a moment ago: L1), as 16 contiguous values,
// their products y = (x * inv) * w formed as `norm_stage` forms them and quantized into their
// q16 (`Q8`: q8) records at xs. The same values, so the same records bit for bit, without
// staging y in shared memory, reading it back or the barrier between.
template <bool Q8>
__device__ __forceinline__ void fq_norm_direct(float* xs, int K, const float* x, float eps, float* nd,
                                               const float* w, float* md, bool write) {
    float xv[NP_V], wv[NP_V];
    const float inv = row_rms_f32<NP_V>(x, w, K, eps, xv, wv, NP_T);
    if (write && blockIdx.x == 0) {
#pragma unroll
        for (int j = 0; j < NP_V; ++j) {
            const int i = threadIdx.x + j * NP_T;
            if ((int)threadIdx.x < NP_T && i < K) {
                const float n = xv[j] * inv;
                nd[i] = n;
                md[i] = n * wv[j];
            }
        }
    }
    const int nh = K / 16, bd = (int)blockDim.x;
    // Warps whose first lane is past the row skip the round (as `fq_quantize_direct`): half of
    // q/k/v's and gate/up's 8 warps at K = 2,048.
    const int w0 = (int)(threadIdx.x & ~31u);
    for (int h0 = 0; h0 + w0 < nh; h0 += bd) {
        const int h = h0 + (int)threadIdx.x;
        const bool live = h < nh;
        float v[16], g[16];
        fq_load16(x + 16 * (live ? h : 0), v);
        fq_load16(w + 16 * (live ? h : 0), g);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float n = v[i] * inv;
            v[i] = n * g[i];
        }
        fq_half<Q8>(v, xs, h, live);
    }
    __syncthreads();
}

// Unit u's weight rows (block types from their segments) into L2: a 128-byte line per lane
// per pass, from the line holding each row's first byte to its end.
template <int NC>
__device__ __forceinline__ void fq_prefetch(const FgSet& S, int u, int K, int lane) {
    const bool pair1 = NC == 2 && S.pair == 1;
    int s;
    i64 j;
    const char* wr[NC];
    fg_unit<DT_Q4_0, NC>(S, u, s, j, wr);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int qt = (int)S.seg[pair1 ? c : s].qt;
        const char* end = wr[c] + (i64)(K / q_block_size(qt)) * q_block_bytes(qt);
        const char* line = (const char*)((u64)wr[c] & ~(u64)127);
        for (const char* p = line + 128 * lane; p < end; p += 128 * 32) prefetch_l2(p);
    }
}

// The head's index taken by the launch itself (`FgSet::take`), by each block's thread 0 after
// its atomicMax: a ticket (`ticket_add`, whose release covers that atomicMax, issued before it
// by the same thread), and the grid's last block to arrive, which then sees every block's
// maximum in the word, writes the index as `argmax_take` would and sets the word and the ticket
// back to 0 for the next launch. This saves `argmax_take`'s launch and its wait for this grid:
// one kernel boundary of a decode step, for one trip to L2 at each block's end.
__device__ __forceinline__ void fq_take(const FgSet& S) {
    unsigned* ticket = (unsigned*)(S.amax + 8);
    if (ticket_add(ticket, 1u) != gridDim.x - 1) return;
    const u64 k = __ldcg((const u64*)S.amax);
    *(int*)S.take = (k >> 32) == 0ull ? 0 : (int)(0xFFFFFFFFu - (u32)k);
    *(u64*)S.amax = 0ull;
    *ticket = 0u;
}

// The largest block of `fused_gemv1_q` and its typed entry points (24 warps): the bounds
// `(768, 1)` hold the typed ones to the 80 registers that three blocks of FG1_WARPS warps
// also allowed, so one kernel serves both shapes.
#define FQ1_MAX_WARPS 24

// QT: 0 for any block type per segment and any arithmetic `qm` (`fq_row`); a block type for
// the typed entry points, whose segments all hold that type (or QT2, where it is not 0) and
// whose arithmetic is QM, fixed when compiling (1: q16, 2: q8; the argument `qm` is then
// ignored), so each entry point holds the code of one arithmetic only.
template <int NC, int QT, int QT2 = 0, int QM = 0>
__device__ __forceinline__ void fq1_body(int K, const float* a, const FgSet& S, float* xs,
                                         const float* nx, float eps, void* nd, int dtn,
                                         const void* nw, int dtnw, int qm_arg, int pf) {
    const int qm = QT ? QM : qm_arg;
    const int lane = threadIdx.x & 31;
    const int units = (int)fg_units<NC>(S);
    const bool pair1 = NC == 2 && S.pair == 1;
    u64 best = 0ull;  // S.amax: the largest argmax key of this warp's units (lane 0)
    // Before the wait (overlapping the previous kernel's tail): the warp's first unit's weight
    // rows into L2, unless `pf` bit 1.
    // Warps per block: up to FQ1_MAX_WARPS (`CudaConfig::q_warps`, `q_warps_norm`); nothing
    // below depends on it but the units' owners (the norm's sums take the first NP_T threads).
    const int nwarps = (int)(blockDim.x >> 5);
    const int stride = (int)gridDim.x * nwarps;
    const int u0 = (int)blockIdx.x * nwarps + (threadIdx.x >> 5);
    if (u0 < units && !(pf & 2)) fq_prefetch<NC>(S, u0, K, lane);
    pdl_entry();
    const bool quant = QT != 0 || qm;
    if (!nx && (pf & 8) && quant) {
        // `pf` bit 3: the row quantized straight from global memory (no norm prologue).
        if (qm == 2) {
            fq_quantize_direct<true>(xs, a, K);
        } else {
            fq_quantize_direct<false>(xs, a, K);
        }
    } else if (nx && (pf & 16) && quant && dtn == DT_F32 && dtnw == DT_F32 && K <= NP_T * NP_V &&
               (((u64)nx | (u64)nw) & 15) == 0) {
        // `pf` bit 4: the norm prologue's products quantized from registers (`fq_norm_direct`).
        if (qm == 2) {
            fq_norm_direct<true>(xs, K, nx, eps, (float*)nd, (const float*)nw, (float*)a, S.wnorm != 0);
        } else {
            fq_norm_direct<false>(xs, K, nx, eps, (float*)nd, (const float*)nw, (float*)a, S.wnorm != 0);
        }
    } else {
        if (nx) {
            norm_stage(xs, K, nx, eps, nd, dtn, nw, dtnw, (float*)a, false, S.wnorm != 0);
        } else {
            stage_row(xs, a, K, false);
        }
        if (qm == 2) {
            fq_quantize<true>(xs, K);
        } else if (QT != 0 || qm) {
            fq_quantize<false>(xs, K);
        } else {
            fq_swizzle(xs, K);
        }
    }
#pragma unroll 1
    for (int u = u0; u < units; u += stride) {
        int s;
        i64 j;
        const char* wr[NC];
        fg_unit<DT_Q4_0, NC>(S, u, s, j, wr);  // any block type: byte strides
        // `pf` bit 0: the warp's next unit's rows into L2 before this one's products, so its loads
        // meet L2 instead of DRAM (a warp otherwise has one unit's bytes in flight).
        if ((pf & 1) && u + stride < units) fq_prefetch<NC>(S, u + stride, K, lane);
        float acc[NC];
        if (QT && QT2) {
            // Two block types (Q4_K_M's Q4_K and Q6_K): each row takes its segment's.
            const int t0 = (int)S.seg[pair1 ? 0 : s].qt, t1 = (int)S.seg[pair1 ? NC - 1 : s].qt;
            if (t0 == t1) {
                if (t0 == QT) {
                    fq_unit16<QT, NC, QM == 2>(wr, K, (const u8*)xs, lane, pf, acc);
                } else {
                    fq_unit16<QT2, NC, QM == 2>(wr, K, (const u8*)xs, lane, pf, acc);
                }
            } else {
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const char* w1[1] = {wr[c]};
                    float a1[1];
                    if ((c ? t1 : t0) == QT) {
                        fq_unit16<QT, 1, QM == 2>(w1, K, (const u8*)xs, lane, pf, a1);
                    } else {
                        fq_unit16<QT2, 1, QM == 2>(w1, K, (const u8*)xs, lane, pf, a1);
                    }
                    acc[c] = a1[0];
                }
            }
        } else if (QT) {
            fq_unit16<QT, NC, QM == 2>(wr, K, (const u8*)xs, lane, pf, acc);
        } else {
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                acc[c] = fq_row((int)S.seg[pair1 ? c : s].qt, (const u8*)wr[c], K, xs, lane, qm);
            }
        }
        if (lane == 0) {
            if (NC == 2 && S.pair == 2) {
                fg_rope_pair(S.seg[s], S.err, j, acc[0], acc[NC - 1]);
            } else {
                fg1_store<NC>(S, s, j, acc);
            }
            if (S.amax) {
                // The head (one segment, no Rope): NC 2 is a pair of adjacent rows j, j + 1.
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const u64 kk = argmax_key(acc[c], j + c);
                    best = kk > best ? kk : best;
                }
            }
        }
    }
    if (S.amax) {
        // As `mul_mat_vec_q_argmax`: the block's largest key into the word, not waited for
        // (unless the launch takes the index itself, `fq_take`).
        __shared__ u64 sk[FQ1_MAX_WARPS];
        if (lane == 0) sk[threadIdx.x >> 5] = best;
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 m = 0ull;
            for (int w = 0; w < nwarps; ++w) m = sk[w] > m ? sk[w] : m;
            if (m != 0ull) atomicMax((unsigned long long*)S.amax, (unsigned long long)m);
            if (S.take) fq_take(S);
        }
    }
}

// blockDim.x a multiple of 32, at most FQ1_MAX_WARPS * 32 (at least NP_T with a norm prologue,
// whose sums take the first NP_T threads), dynamic shared memory K floats; K a multiple of every
// segment's block size, below 2^31 with the units (checked on the host), a 16-byte aligned
// and every weight 2-byte aligned. Any grid of at least one block (the warps stride over the
// units); S.pair as `fused_gemv1`'s sets (0, 1: SwiGlu, 2: row pairs). `qm`: integer products
// on the row quantized to q16 (1) or q8 (2) records, else (0) f32. `pf` bit 0: each warp asks
// its next unit's rows into L2 before its current unit's products (`CudaConfig::q_prefetch`);
// bit 1: no warp asks its first unit's rows into L2 before the wait (`CudaConfig::q_ahead`
// off); bit 2 (typed entry points): each row alone, two pieces a round, instead of a round
// over both rows of a pair or four pieces of a single row (`CudaConfig::q_interleave` off);
// bit 3: without a norm prologue, the row quantized straight from a (`fq_quantize_direct`,
// `CudaConfig::q_direct`); bit 4: with one (f32, aligned, K <= 2,048), its products quantized
// from registers (`fq_norm_direct`, `CudaConfig::q_direct_norm`).
#if LS_PART(3)
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32) fused_gemv1_q(i64 K, const float* a,
                                                                        FgSet S, const float* nx,
                                                                        float eps, void* nd,
                                                                        int dtn, const void* nw,
                                                                        int dtnw, int qm, int pf) {
    extern __shared__ float4 fg1_smem[];
    float* xs = (float*)fg1_smem;
    if (S.pair) {
        fq1_body<2, 0>((int)K, a, S, xs, nx, eps, nd, dtn, nw, dtnw, qm, pf);
    } else {
        fq1_body<1, 0>((int)K, a, S, xs, nx, eps, nd, dtn, nw, dtnw, qm, pf);
    }
}
#endif

// `fused_gemv1_q` for sets whose segments all hold one block type, on q16 records or (`_q8`)
// q8 records (the argument `qm` is ignored): the decode products of a file quantized to one
// type (and most groups of a mixed one) run one type's code, inlined, with no call or switch
// per weight row. The products are those of `fused_gemv1_q` bit for bit. One entry point per
// type that has a one-load piece (`iq32`) and arithmetic, and one for the two types of Q4_K_M's
// mixed groups.
#define FQ1_PARAMS                                                                            \
    i64 K, const float *a, FgSet S, const float *nx, float eps, void *nd, int dtn, const void *nw, \
        int dtnw, int qm, int pf
#define FQ_TYPED(QT, QT2, QM)                                                              \
    extern __shared__ float4 fg1_smem[];                                                   \
    float* xs = (float*)fg1_smem;                                                          \
    if (S.pair) {                                                                          \
        fq1_body<2, QT, QT2, QM>((int)K, a, S, xs, nx, eps, nd, dtn, nw, dtnw, qm, pf);    \
    } else {                                                                               \
        fq1_body<1, QT, QT2, QM>((int)K, a, S, xs, nx, eps, nd, dtn, nw, dtnw, qm, pf);    \
    }
#if LS_PART(4)
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_0(FQ1_PARAMS) { FQ_TYPED(DT_Q4_0, 0, 1) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_1(FQ1_PARAMS) { FQ_TYPED(DT_Q4_1, 0, 1) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q8_0(FQ1_PARAMS) { FQ_TYPED(DT_Q8_0, 0, 1) }
#endif
#if LS_PART(5)
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_k(FQ1_PARAMS) { FQ_TYPED(DT_Q4_K, 0, 1) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q6_k(FQ1_PARAMS) { FQ_TYPED(DT_Q6_K, 0, 1) }
// Q4_K_M's groups of Q4_K and Q6_K weights (q and k beside v).
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_k_q6_k(FQ1_PARAMS) { FQ_TYPED(DT_Q4_K, DT_Q6_K, 1) }
#endif
// The same on q8 records (`qdot=q8`).
#if LS_PART(6)
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_0_q8(FQ1_PARAMS) { FQ_TYPED(DT_Q4_0, 0, 2) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_1_q8(FQ1_PARAMS) { FQ_TYPED(DT_Q4_1, 0, 2) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q8_0_q8(FQ1_PARAMS) { FQ_TYPED(DT_Q8_0, 0, 2) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_k_q8(FQ1_PARAMS) { FQ_TYPED(DT_Q4_K, 0, 2) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q6_k_q8(FQ1_PARAMS) { FQ_TYPED(DT_Q6_K, 0, 2) }
extern "C" __global__ void __launch_bounds__(FQ1_MAX_WARPS * 32, 1) fused_gemv1_q4_k_q6_k_q8(FQ1_PARAMS) { FQ_TYPED(DT_Q4_K, DT_Q6_K, 2) }
#endif
#undef FQ_TYPED
#undef FQ1_PARAMS

#define FG_DISPATCH(MT)                                                                   \
    if (S.pair) {                                                                         \
        switch (dtw) {                                                                    \
            case DT_F16: fg_body<DT_F16, MT, 2>(M, K, a, a_rs, S, G, vec); break;         \
            case DT_BF16: fg_body<DT_BF16, MT, 2>(M, K, a, a_rs, S, G, vec); break;       \
            default: fg_body<DT_F32, MT, 2>(M, K, a, a_rs, S, G, vec); break;             \
        }                                                                                 \
    } else {                                                                              \
        switch (dtw) {                                                                    \
            case DT_F16: fg_body<DT_F16, MT, 1>(M, K, a, a_rs, S, G, vec); break;         \
            case DT_BF16: fg_body<DT_BF16, MT, 1>(M, K, a, a_rs, S, G, vec); break;       \
            default: fg_body<DT_F32, MT, 1>(M, K, a, a_rs, S, G, vec); break;             \
        }                                                                                 \
    }

// `vec`: a's rows and every weight row start 16-byte aligned (checked on the host).
// blockDim.x == 128. One row of a per pass (M <= 2) ...
#if LS_PART(1)
extern "C" __global__ void __launch_bounds__(128, 8) fused_gemv(i64 M, i64 K, const float* a,
                                                                i64 a_rs, FgSet S, int dtw,
                                                                int G, int vec) {
    pdl_entry();
    FG_DISPATCH(1)
}
#endif

// ... and eight rows per pass (each weight load serves all of them).
#if LS_PART(1)
extern "C" __global__ void __launch_bounds__(128) fused_gemv8(i64 M, i64 K, const float* a,
                                                              i64 a_rs, FgSet S, int dtw, int G,
                                                              int vec) {
    pdl_entry();
    FG_DISPATCH(8)
}
#endif
