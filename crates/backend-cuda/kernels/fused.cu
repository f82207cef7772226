// Fused decode kernels: one launch for a chain of nodes (see src/fusion.rs for the patterns and
// the host-side preconditions each kernel relies on). Every kernel still writes each tensor its
// nodes would have written (the attention's raw scores only when the host says they may be
// read later), in the nodes' order within the thread that owns an element, so later readers see
// what the unfused chain would have left. Arithmetic follows the unfused kernels: f32, fixed
// summation orders that depend only on the shapes (no float atomics), so results are
// deterministic run to run.

#define F_NEG_INF (-__int_as_float(0x7f800000))

// x / (1 + e^-x), as the element-wise SwiGlu.
__device__ __forceinline__ float f_silu(float x) { return x / (1.0f + expf(-x)); }

// One f32 row x[0, n) and weight row w, NV values per thread (n <= NV * blockDim.x): each
// thread's values of both, in flight together, and 1 / sqrt(mean(x^2) + eps) over the block.
// The short path of decode's norms (no dtype switch, 32-bit indices). Every thread must call
// it.
template <int NV>
__device__ __forceinline__ float row_rms_f32(const float* x, const float* w, int n, float eps,
                                             float (&xv)[NV], float (&wv)[NV]) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        xv[j] = i < n ? x[i] : 0.0f;
        wv[j] = i < n ? w[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) s += xv[j] * xv[j];
    s = block_sum(s);
    return 1.0f / sqrtf(s / (float)n + eps);
}

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
        const float inv = row_rms_f32<RN_V>((const float*)x, (const float*)w, n, eps, v, wq);
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

// One product and its epilogues. Matches `FgSeg` in src/fusion.rs field for field.
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
};

// Matches `FgSet` in src/fusion.rs. pair == 1: nseg == 2, seg 0 = gate, seg 1 = up, and sw the
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
template <int DT, int NC>
__device__ __forceinline__ void fg_unit(const FgSet& S, i64 u, int& s, i64& j,
                                        const char* (&wr)[NC]) {
    const int ESZ = DT == DT_F32 ? 4 : 2;
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
// together; longer rows loop. `split`: xs in the layout of `split_slot`.
#define NP_V 8
__device__ __noinline__ void norm_stage_any(float* xs, i64 K, const float* x, float eps, void* nd, int dtn,
                           const void* w, int dtw, float* md, bool split, bool write) {
    const i64 ng = split ? K / 8 : 0;
    const bool regs = K <= (i64)blockDim.x * NP_V;
    const bool first = write && blockIdx.x == 0;
    float xv[NP_V], wv[NP_V];
    float s = 0.0f;
    if (regs) {
#pragma unroll
        for (int j = 0; j < NP_V; ++j) {
            const i64 i = threadIdx.x + (i64)j * blockDim.x;
            xv[j] = i < K ? x[i] : 0.0f;
            wv[j] = i < K ? ld(w, dtw, i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < NP_V; ++j) s += xv[j] * xv[j];
    } else {
        for (i64 i = threadIdx.x; i < K; i += blockDim.x) {
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
            const i64 i = threadIdx.x + (i64)j * blockDim.x;
            if (i < K) {
                const float y = round_dt(dtn, xv[j] * inv) * wv[j];
                xs[split_slot(i, ng)] = y;
                if (first) {
                    st(nd, dtn, i, xv[j] * inv);
                    md[i] = y;
                }
            }
        }
    } else {
        for (i64 i = threadIdx.x; i < K; i += blockDim.x) {
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
    if (dtn != DT_F32 || dtw != DT_F32 || K > (i64)blockDim.x * NP_V) {
        norm_stage_any(xs, K, x, eps, nd, dtn, w, dtw, md, split, write);
        return;
    }
    const int k = (int)K, ng = split ? k / 8 : 0;
    const bool first = write && blockIdx.x == 0;
    float xv[NP_V], wv[NP_V];
    const float inv = row_rms_f32<NP_V>(x, (const float*)w, k, eps, xv, wv);
#pragma unroll
    for (int j = 0; j < NP_V; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < k) {
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
#define FG1_WARPS 8
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

// The streamed, staged path of `fused_gemv1` for one weight dtype each (`fused_gemv1_s16`: f16,
// `fused_gemv1_sb16`: bf16, `fused_gemv1_s32`: f32; decode's o and down), same parameters
// (`staged` and `stream` are 1). Held to 80 registers: two of these blocks (the streamed grid)
// then leave room for a `fused_gemv1_pair` block (88) on the multiprocessor, so the next
// kernel's first wave (q/k/v after down, gate/up after o) loads its weights while this one
// finishes. The host pads each block's shared memory (`stream_pad` in fusion.rs) so that a
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
extern "C" __global__ void __maxnreg__(80) fused_gemv1_s16(FG1S_PARAMS) { FG1_OWN(stream, F16, 1) }
extern "C" __global__ void __maxnreg__(80) fused_gemv1_sb16(FG1S_PARAMS) { FG1_OWN(stream, BF16, 1) }
extern "C" __global__ void __maxnreg__(80) fused_gemv1_s32(FG1S_PARAMS) { FG1_OWN(stream, F32, 1) }

// Gate/up with SwiGlu (S.pair == 1) and row pairs (S.pair == 2); same parameters — the paths
// the entry points below do not take (`LOWSYNC_CUDA_GEMV_SPLIT=0`, unstaged, unstreamed). At
// most 88 registers per thread (a spill of 8 bytes in the rope epilogue; blockDim.x is
// FG1_WARPS * 32):
// with programmatic dependent launch the next kernel's blocks start on a multiprocessor only
// where registers are left, and 88 leaves room for an `attn_fast` block (158) beside one of
// these — attention rehearses while q/k/v finishes. `fused_gemv1` (104) does not fit beside two
// streamed gate/up blocks, nor these beside two of its own; holding it to 80 to make room was
// measured slower on the H200 (README: "Measured on the H200 and not kept").
extern "C" __global__ void __maxnreg__(88) fused_gemv1_pair(FG1S_PARAMS) {
    extern __shared__ float4 fg1_smem[];
    float* xs = (float*)fg1_smem;
    switch (dtw) {
        case DT_F16: FG1_CASE(DT_F16, 2)
        case DT_BF16: FG1_CASE(DT_BF16, 2)
        default: FG1_CASE(DT_F32, 2)
    }
}
#undef FG1_CASE

// The two decode paths of `fused_gemv1_pair`, each in its own entry point per weight dtype
// (the parameters of `fused_gemv1_s16`, `staged` 1): gate/up with SwiGlu streamed
// (`fused_gemv1_gu16`, `_gub16`, `_gu32`: `stream` 1) and q/k/v's row pairs
// (`fused_gemv1_rp16`, `_rpb16`, `_rp32`). Alone,
// each path fits in 88 registers without a spill, and its launch runs only its own code —
// these kernels fetch much of their time in instructions. On the H200 ("1b", one process):
// 699.9 µs per token against 730.7 through `fused_gemv1_pair` (q/k/v 7.17 -> 6.33 µs per
// layer exposed, gate/up 19.71 -> 18.27, down 9.28 -> 9.73).
extern "C" __global__ void __maxnreg__(88) fused_gemv1_gu16(FG1S_PARAMS) { FG1_OWN(stream, F16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_gub16(FG1S_PARAMS) { FG1_OWN(stream, BF16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_gu32(FG1S_PARAMS) { FG1_OWN(stream, F32, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_rp16(FG1S_PARAMS) { FG1_OWN(body, F16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_rpb16(FG1S_PARAMS) { FG1_OWN(body, BF16, 2) }
extern "C" __global__ void __maxnreg__(88) fused_gemv1_rp32(FG1S_PARAMS) { FG1_OWN(body, F32, 2) }
#undef FG1_OWN
#undef FG1S_PARAMS

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
extern "C" __global__ void __launch_bounds__(128, 8) fused_gemv(i64 M, i64 K, const float* a,
                                                                i64 a_rs, FgSet S, int dtw,
                                                                int G, int vec) {
    pdl_entry();
    FG_DISPATCH(1)
}

// ... and eight rows per pass (each weight load serves all of them).
extern "C" __global__ void __launch_bounds__(128) fused_gemv8(i64 M, i64 K, const float* a,
                                                              i64 a_rs, FgSet S, int dtw, int G,
                                                              int vec) {
    pdl_entry();
    FG_DISPATCH(8)
}

// ---------------------------------------------------------------------------------------------
// Rope followed by the SetRows of its result into a cache, and optionally a second, plain
// SetRows (decode's V row). Rotary embedding of x [T, H, D] at positions pos [T] into r (the
// Rope's result, contiguous on the host's word), as the rope kernel: one work item per
// (t, h, pair) or copied dim past n_dims, angles in f64. Each element written to r is read
// back (rounded to r's dtype, as SetRows would read it) and stored into row idx[t] of cache c,
// column h * D + d. Work items past the rope's are the plain copy c2[idx2[j], :] = s2[j, :].
// SetRows' rules hold for both: a row whose index a later row repeats is skipped (the last
// write wins), a bad index is reported with the node's tag and its row skipped.

extern "C" __global__ void rope_rows(
    i64 T, i64 H, i64 D, void* r, int dtr, i64 r_st0, i64 r_st1, i64 r_st2, const void* x,
    int dtx, i64 x_st0, i64 x_st1, i64 x_st2, const int* pos, i64 pos_st, i64 n_dims,
    double theta_base, int neox, void* c, int dtc, i64 c_rs, i64 c_cs, i64 c_n, const int* idx,
    i64 idx_st, u32 tag, i64 m2, i64 d2, void* c2, int dtc2, i64 c2_rs, i64 c2_cs, i64 c2_n,
    const void* s2, int dts2, i64 s2_rs, i64 s2_cs, const int* idx2, i64 idx2_st, u32 tag2,
    u32* err) {
    pdl_entry();
    const i64 half = n_dims / 2;
    const i64 per_row = half + (D - n_dims);
    const i64 n1 = T * H * per_row;
    const i64 n = n1 + m2 * d2;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        if (i >= n1) {
            const i64 jj = (i - n1) / d2, cc = (i - n1) % d2;
            const int row = idx2[jj * idx2_st];
            bool later = false;
            for (i64 q = jj + 1; q < m2; ++q) later |= idx2[q * idx2_st] == row;
            if (later) continue;
            if (row < 0 || (i64)row >= c2_n) {
                report(err, tag2);
                continue;
            }
            st(c2, dtc2, (i64)row * c2_rs + cc * c2_cs, ld(s2, dts2, jj * s2_rs + cc * s2_cs));
            continue;
        }
        const i64 k = i % per_row;
        const i64 th = i / per_row;
        const i64 h = th % H, t = th / H;
        const i64 xb = t * x_st0 + h * x_st1, rb = t * r_st0 + h * r_st1;
        // The dims this item writes and their values.
        i64 ca, cb = -1;
        float va, vb = 0.0f;
        if (k >= half) {
            ca = n_dims + (k - half);
            va = ld(x, dtx, xb + ca * x_st2);
        } else {
            double freq = pow(theta_base, -2.0 * (double)k / (double)n_dims);
            double ang = (double)pos[t * pos_st] * freq;
            double sd, cd;
            sincos(ang, &sd, &cd);
            float sn = (float)sd, cs = (float)cd;
            ca = neox ? k : 2 * k;
            cb = neox ? k + half : 2 * k + 1;
            float a = ld(x, dtx, xb + ca * x_st2), b = ld(x, dtx, xb + cb * x_st2);
            va = a * cs - b * sn;
            vb = a * sn + b * cs;
        }
        st(r, dtr, rb + ca * r_st2, va);
        if (cb >= 0) st(r, dtr, rb + cb * r_st2, vb);
        const int row = idx[t * idx_st];
        bool later = false;
        for (i64 q = t + 1; q < T; ++q) later |= idx[q * idx_st] == row;
        if (later) continue;
        if (row < 0 || (i64)row >= c_n) {
            report(err, tag);
            continue;
        }
        const i64 cr = (i64)row * c_rs + h * D * c_cs;
        st(c, dtc, cr + ca * c_cs, ld(r, dtr, rb + ca * r_st2));
        if (cb >= 0) st(c, dtc, cr + cb * c_cs, ld(r, dtr, rb + cb * r_st2));
    }
}

// ---------------------------------------------------------------------------------------------
// Decode attention for one query row per head: kq = q @ K^T, p = softmax(kq * scale + mask),
// o = p @ V, and optionally the Cpy of a permuted view of o — one block per query head h,
// whose K and V head is h / k_div and h / v_div (the unfused MulMat's GQA broadcast).
//
// Built for latency: a decode step waits on this kernel, and its K/V rows come from DRAM. The
// key positions go in chunks of ATT_T, one position per thread. A chunk costs two dependent
// memory round trips: its mask entries (with q, first chunk), then — all in flight together —
// each thread's K row (for its logit) and up to ATT_VU V rows of its slice of p @ V. A position
// whose mask is -inf is never read from V, nor from K unless the raw scores must be written
// (`write_kq`: the host found a later reader). Softmax is online across chunks (running max
// and sum, the V accumulators rescaled); logits of chunks after the first are parked in p and
// normalized at the end. In p @ V, TC threads own a V row's dims (VW adjacent ones each) and
// the ATT_T / TC row slices are summed in a fixed order (deterministic). All reads of q
// precede every write of the block, so results may be written over q[h] itself.

#define ATT_T 256
#define ATT_MAXD 256
#define ATT_KU 8
#define ATT_VU 8

// Loads and stores of a tensor that is f32 whenever `F32` (the host checked): no dtype switch
// on the path, which keeps decode kernels short.
template <bool F32>
__device__ __forceinline__ float ldio(const void* p, int dt, i64 i) {
    return F32 ? ((const float*)p)[i] : ld(p, dt, i);
}
template <bool F32>
__device__ __forceinline__ void stio(void* p, int dt, i64 i, float v) {
    if (F32) {
        ((float*)p)[i] = v;
    } else {
        st(p, dt, i, v);
    }
}

// FAST: the short path — 32-bit offsets, f32 q/mask/copy, vector K and V rows, no raw scores
// (I = int with it); the flags' other branches are compiled out of it.
template <int DT, typename I, bool FAST>
__device__ __forceinline__ void attn_body(
    I L, I D, float scale, const void* q, int dtq, I q_hs, I q_ds, const void* k,
    I k_hs, I k_ls, I k_div, int kvec_arg, const void* v, I v_hs, I v_ls, I v_div,
    int vvec_arg, int TC, const void* mask, int dtm, I m_hs, I m_ls, int has_mask, float* kq,
    I kq_hs, I kq_ls, int write_kq_arg, float* p, I p_hs, I p_ls, float* o, I o_hs,
    I o_ds, void* c, int dtc, I c_hs, I c_ds, int has_cpy, float* qs, float* red,
    float* es, int* vf) {
    const bool kvec = FAST || kvec_arg, vvec = FAST || vvec_arg;
    const bool write_kq = !FAST && write_kq_arg;
    const int VW = DT == DT_F32 ? 4 : 8;
    const int ESZ = DT == DT_F32 ? 4 : 2;
    const int tid = threadIdx.x;
    const I h = (I)blockIdx.x;
#pragma unroll 1
    for (I d = tid; d < D; d += ATT_T) qs[d] = ldio<FAST>(q, dtq, h * q_hs + d * q_ds);
    const char* kb = (const char*)k + (h / k_div) * k_hs * ESZ;
    const char* vb = (const char*)v + (h / v_div) * v_hs * ESZ;
    float* ph = p + h * p_hs;
    // This thread's part of p @ V: dims [c0, c0 + vw) of rows rs, rs + RS, ... of a chunk.
    const int RS = ATT_T / TC;
    const int tc = tid % TC, rs = tid / TC;
    const int vw = vvec ? VW : 1;
    const I c0 = (I)tc * vw;
    const bool vcol = c0 < D;
    const I nvec = kvec ? D / VW : 0;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    float run_max = F_NEG_INF, run_sum = 0.0f, lg0 = F_NEG_INF;
    uint4 vq[ATT_VU];
#pragma unroll 1
    for (I base = 0; base < L; base += ATT_T) {
        const I l = base + tid;
        const bool in = l < L;
        const float mv = in && has_mask ? ldio<FAST>(mask, dtm, h * m_hs + l * m_ls) : 0.0f;
        const bool valid = in && mv != F_NEG_INF;
        vf[tid] = valid;
        __syncthreads();
        PHASE(2);
        // V rows g0 .. g0 + ATT_VU of this thread's slice (valid rows only).
        auto load_v = [&](int g0) {
#pragma unroll
            for (int u = 0; u < ATT_VU; ++u) {
                const int r = rs + RS * (g0 + u);
                if (g0 + u < TC && vcol && base + r < L && vf[r]) {
                    const I off = (base + r) * v_ls + c0;
                    if (vvec) {
                        vq[u] = *(const uint4*)(vb + off * ESZ);
                    } else {
                        vq[u].x = __float_as_uint(ld(vb, DT, off));
                    }
                }
            }
        };
        load_v(0);
        // The logit of position l.
        float dot = 0.0f;
        if (in && (write_kq || valid)) {
            const char* kr = kb + l * k_ls * ESZ;
#pragma unroll 1
            for (I v0 = 0; v0 < nvec; v0 += ATT_KU) {
                uint4 w[ATT_KU];
#pragma unroll
                for (int u = 0; u < ATT_KU; ++u) {
                    if (v0 + u < nvec) w[u] = ((const uint4*)kr)[v0 + u];
                }
#pragma unroll
                for (int u = 0; u < ATT_KU; ++u) {
                    if (v0 + u < nvec) {
                        float f[VW];
                        unpack16<DT>(w[u], f);
#pragma unroll
                        for (int e = 0; e < VW; ++e) dot = fmaf(qs[(v0 + u) * VW + e], f[e], dot);
                    }
                }
            }
#pragma unroll 1
            for (I e = nvec * VW; e < D; ++e) dot = fmaf(qs[e], ld(kr, DT, e), dot);
        }
        PHASE(3);
        if (write_kq && in) kq[h * kq_hs + l * kq_ls] = dot;
        const float lg = valid ? dot * scale + mv : F_NEG_INF;
        if (base == 0) {
            lg0 = lg;
        } else if (in) {
            ph[l * p_ls] = lg;
        }
        const float new_max = fmaxf(run_max, block_max(lg));
        PHASE(4);
        const float ex = valid && new_max != F_NEG_INF ? expf(lg - new_max) : 0.0f;
        es[tid] = ex;
        const float chunk_sum = block_sum(ex);  // its barriers also publish es
        PHASE(5);
        const float rescale = run_max != F_NEG_INF ? expf(run_max - new_max) : 0.0f;
        run_sum = run_sum * rescale + chunk_sum;
        run_max = new_max;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= rescale;
#pragma unroll 1
        for (int g0 = 0; g0 < TC; g0 += ATT_VU) {
            if (g0 > 0) load_v(g0);
#pragma unroll
            for (int u = 0; u < ATT_VU; ++u) {
                const int r = rs + RS * (g0 + u);
                const float pw = g0 + u < TC && vcol && base + r < L ? es[r] : 0.0f;
                if (pw != 0.0f) {
                    if (vvec) {
                        float f[VW];
                        unpack16<DT>(vq[u], f);
#pragma unroll
                        for (int e = 0; e < VW; ++e) acc[e] = fmaf(pw, f[e], acc[e]);
                    } else {
                        acc[0] = fmaf(pw, __uint_as_float(vq[u].x), acc[0]);
                    }
                }
            }
        }
        __syncthreads();  // es and vf are rewritten by the next chunk
    }
    PHASE(6);
    const float inv = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
#pragma unroll 1
    for (I base = 0; base < L; base += ATT_T) {
        const I l = base + tid;
        if (l < L) {
            const float lg = base == 0 ? lg0 : ph[l * p_ls];
            ph[l * p_ls] = lg != F_NEG_INF ? expf(lg - run_max) * inv : 0.0f;
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) red[tid * 8 + e] = acc[e];
    __syncthreads();
    PHASE(7);
#pragma unroll 1
    for (I col = tid; col < D; col += ATT_T) {
        const int ct = (int)(col / vw), ce = (int)(col % vw);
        float y = 0.0f;
#pragma unroll 4
        for (int s = 0; s < RS; ++s) y += red[(s * TC + ct) * 8 + ce];
        y *= inv;
        o[h * o_hs + col * o_ds] = y;
        if (has_cpy) stio<FAST>(c, dtc, h * c_hs + col * c_ds, y);
    }
}

// K and V share one dtype (dtkv). G: unused (the host's lanes per key row of an earlier split,
// kept in the signature); `narrow`: every element offset of the launch fits in 32 bits; TC: threads per V row (a power of two dividing ATT_T). `kvec` /
// `vvec`: every K / V row start is 16-byte aligned (and, for V, D a multiple of the vector
// width), checked on the host.
extern "C" __global__ void __launch_bounds__(ATT_T) attn_decode(
    i64 L, i64 D, float scale, const void* q, int dtq, i64 q_hs, i64 q_ds, int dtkv,
    const void* k, i64 k_hs, i64 k_ls, i64 k_div, int kvec, int G, const void* v, i64 v_hs,
    i64 v_ls, i64 v_div, int vvec, int TC, const void* mask, int dtm, i64 m_hs, i64 m_ls,
    int has_mask, float* kq, i64 kq_hs, i64 kq_ls, int write_kq, float* p, i64 p_hs, i64 p_ls,
    float* o, i64 o_hs, i64 o_ds, void* c, int dtc, i64 c_hs, i64 c_ds, int has_cpy,
    int narrow) {
    PHASE_ENTRY();
    PHASE(0);
    pdl_entry();
    PHASE(1);
    __shared__ float qs[ATT_MAXD];
    __shared__ float red[ATT_T * 8];
    __shared__ float es[ATT_T];
    __shared__ int vf[ATT_T];
    (void)G;
#define ATT_ARGS                                                                              \
    L, D, scale, q, dtq, q_hs, q_ds, k, k_hs, k_ls, k_div, kvec, v, v_hs, v_ls, v_div, vvec,  \
        TC, mask, dtm, m_hs, m_ls, has_mask, kq, kq_hs, kq_ls, write_kq, p, p_hs, p_ls, o,    \
        o_hs, o_ds, c, dtc, c_hs, c_ds, has_cpy, qs, red, es, vf
    // The short path: 32-bit offsets (every offset the host computes fits), f32 q, mask and
    // copy, vector rows and no raw scores; else the general one.
    const bool f32io = dtq == DT_F32 && (!has_mask || dtm == DT_F32) && (!has_cpy || dtc == DT_F32);
    if (narrow && f32io && kvec && vvec && !write_kq) {
        switch (dtkv) {
            case DT_F16: attn_body<DT_F16, int, true>(ATT_ARGS); break;
            case DT_BF16: attn_body<DT_BF16, int, true>(ATT_ARGS); break;
            default: attn_body<DT_F32, int, true>(ATT_ARGS); break;
        }
    } else {
        switch (dtkv) {
            case DT_F16: attn_body<DT_F16, i64, false>(ATT_ARGS); break;
            case DT_BF16: attn_body<DT_BF16, i64, false>(ATT_ARGS); break;
            default: attn_body<DT_F32, i64, false>(ATT_ARGS); break;
        }
    }
#undef ATT_ARGS
    PHASE(8);
    PHASE_EXIT();
}

// ---------------------------------------------------------------------------------------------
// Decode attention, short path (`attn_fast`): the same results as `attn_decode` for f32 q, mask
// and copy, 16-byte aligned K/V rows whose head size D is VW * G (VW: elements in 16 bytes, G a
// power of two up to 32). The raw scores, p and o are written only when asked (`write_kq`,
// `write_p`, `write_o`: the host found a later reader).
//
// Built for the length of its dependency chain, which is all a decode step sees of it: G lanes
// share a key (each holds VW dims of q, K and V), AF_T / G keys per pass, AF_P passes per chunk
// of keys (256 for f16 and D = 64). A window of one chunk (SPEC) loads q, mask entries, K and V
// rows at once — one memory round trip; K and V rows of its masked keys are read too (at most
// a chunk of rows: bytes instead of a second round trip; never used). Longer windows load each
// chunk's mask entries first, then K and V rows of valid keys only, and a warp skips passes
// without a valid key (a vote): a long window with a short valid part reads little. The logit
// is a VW-long dot product and log2(G) shuffles; each warp keeps its own running max, sum and
// p @ V partials (online softmax across chunks, no barrier), and the warps meet once, through
// shared memory, at the end — in a fixed order (deterministic). p, when written, first holds
// the logits; each thread normalizes the entries it wrote itself.
//
// LIST (`attn_fast_long`: a window longer than a chunk, a mask, no scores or p written): the
// window is taken AF_LS keys at a time — one round trip loads all their mask entries, the
// block lists the keys with a finite entry in order (`af_list`), and the passes run over that
// list as SPEC runs over a window: a round trip per chunk of valid keys, none for masked ones.
#define AF_T 256
#define AF_P 8
#define AF_LR 8                 // mask entries per thread per listing
#define AF_LS (AF_T * AF_LR)    // keys per listing
#define AF_LSH (2 * AF_LS + AF_LR * (AF_T / 32) + 1)  // af_list's shared words

// Keys [sb, sb + n) of the window whose mask entry is not -inf, ascending, into keys (their
// entries into mv); returns how many (every thread). cnt: AF_LR * (AF_T / 32) + 1 words.
__device__ __forceinline__ int af_list(const float* mh, int m_ls, int sb, int n, int* keys,
                                       float* mv, int* cnt) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int NW = AF_T / 32;
    float e[AF_LR];
#pragma unroll
    for (int r = 0; r < AF_LR; ++r) {
        const int i = r * AF_T + tid;
        e[r] = i < n ? ld_cg(mh + (sb + i) * m_ls) : F_NEG_INF;
    }
    unsigned bal[AF_LR];
#pragma unroll
    for (int r = 0; r < AF_LR; ++r) {
        bal[r] = __ballot_sync(0xffffffffu, e[r] != F_NEG_INF);
        if (lane == 0) cnt[r * NW + warp] = __popc(bal[r]);
    }
    __syncthreads();
    if (warp == 0) {
        // Exclusive offsets of the AF_LR * NW counts, in key order (round, then warp).
        int run = 0;
#pragma unroll 1
        for (int b = 0; b < AF_LR * NW; b += 32) {
            const int c = b + lane < AF_LR * NW ? cnt[b + lane] : 0;
            int incl = c;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += y;
            }
            if (b + lane < AF_LR * NW) cnt[b + lane] = run + incl - c;
            run += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) cnt[AF_LR * NW] = run;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < AF_LR; ++r) {
        if (e[r] != F_NEG_INF) {
            const int at = cnt[r * NW + warp] + __popc(bal[r] & ((1u << lane) - 1u));
            keys[at] = sb + r * AF_T + tid;
            mv[at] = e[r];
        }
    }
    const int total = cnt[AF_LR * NW];
    __syncthreads();
    return total;
}

template <int DT, int G, bool SPEC, bool LIST = false>
__device__ __forceinline__ void attn_fast_body(int L, float scale, const float* q, int q_hs,
                                               int q_ds, const void* k, int k_hs, int k_ls,
                                               int k_div, const void* v, int v_hs, int v_ls,
                                               int v_div, const float* mask, int m_hs, int m_ls,
                                               int has_mask, float* kq, int kq_hs, int kq_ls,
                                               int write_kq, float* p, int p_hs, int p_ls,
                                               int write_p, float* o, int o_hs, int o_ds,
                                               int write_o, float* c, int c_hs, int c_ds,
                                               int has_cpy, float* sh, int* lsh = nullptr,
                                               bool listed = false) {
    constexpr int VW = DT == DT_F32 ? 4 : 8;
    constexpr int ESZ = DT == DT_F32 ? 4 : 2;
    constexpr int D = G * VW;
    constexpr int KP = AF_T / G;  // keys per pass
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kg = tid / G, d0 = (tid % G) * VW;
    const int h = blockIdx.x;
    float qv[VW];
#pragma unroll
    for (int e = 0; e < VW; ++e) qv[e] = ld_cg(q + h * q_hs + (d0 + e) * q_ds);
    const char* kb = (const char*)k + ((h / k_div) * k_hs + d0) * ESZ;
    const char* vb = (const char*)v + ((h / v_div) * v_hs + d0) * ESZ;
    const float* mh = mask + h * m_hs;
    const bool lead = tid % G == 0;  // writes its key's scores and p
    float* ph = p + h * p_hs;
    // Keys whose scores or p are written are computed even when masked.
    const bool every = write_kq || write_p;
    float wmax = F_NEG_INF, wsum = 0.0f, acc[VW];
#pragma unroll
    for (int e = 0; e < VW; ++e) acc[e] = 0.0f;
    int* keys = lsh;
    float* mv = (float*)(lsh + AF_LS);
    int* cnt = lsh + 2 * AF_LS;  // af_list's counts; the listing's length at the end
#pragma unroll 1
    for (int sb = 0; sb < (LIST ? L : 1); sb += AF_LS) {
        // LIST: the valid keys of this listing (`listed`: the rehearsal's, still in shared
        // memory); otherwise the whole window.
        const int n = !LIST ? L
                      : listed ? cnt[AF_LR * (AF_T / 32)]
                               : af_list(mh, m_ls, sb, min(AF_LS, L - sb), keys, mv, cnt);
#pragma unroll 1
        for (int base = 0; base < n; base += KP * AF_P) {
            uint4 kr[AF_P], vr[AF_P];
            float lg[AF_P];
            bool alive[AF_P];
            // Passes past the window (or the list) are skipped whole (a block-uniform branch):
            // short windows run and fetch only the code of the passes they use.
            const int np = min(AF_P, (n - base + KP - 1) / KP);
            if (LIST) {
#pragma unroll
                for (int t = 0; t < AF_P; ++t) {
                    alive[t] = t < np;
                    if (t < np) {
                        const int j = base + kg + KP * t;
                        const bool in = j < n;
                        const int l = in ? keys[j] : 0;
                        lg[t] = in ? mv[j] : F_NEG_INF;
                        kr[t] = in ? ld_cg((const uint4*)(kb + l * k_ls * ESZ)) : make_uint4(0, 0, 0, 0);
                        vr[t] = in ? ld_cg((const uint4*)(vb + l * v_ls * ESZ)) : make_uint4(0, 0, 0, 0);
                    }
                }
            } else if (SPEC) {
#pragma unroll
                for (int t = 0; t < AF_P; ++t) {
                    alive[t] = t < np;
                    if (t < np) {
                        const int l = base + kg + KP * t;
                        const bool in = l < L;
                        lg[t] = in ? (has_mask ? ld_cg(mh + l * m_ls) : 0.0f) : F_NEG_INF;
                        kr[t] = in ? ld_cg((const uint4*)(kb + l * k_ls * ESZ)) : make_uint4(0, 0, 0, 0);
                        vr[t] = in ? ld_cg((const uint4*)(vb + l * v_ls * ESZ)) : make_uint4(0, 0, 0, 0);
                    }
                }
            } else {
#pragma unroll
                for (int t = 0; t < AF_P; ++t) {
                    const int l = base + kg + KP * t;
                    lg[t] = t < np && l < L ? (has_mask ? ld_cg(mh + l * m_ls) : 0.0f) : F_NEG_INF;
                }
#pragma unroll
                for (int t = 0; t < AF_P; ++t) {
                    alive[t] = false;
                    if (t < np) {
                        const int l = base + kg + KP * t;
                        const bool in = l < L, ok = lg[t] != F_NEG_INF;
                        alive[t] = __any_sync(0xffffffffu, ok || (every && in));
                        kr[t] = ok || (write_kq && in) ? ld_cg((const uint4*)(kb + l * k_ls * ESZ)) : make_uint4(0, 0, 0, 0);
                        vr[t] = ok ? ld_cg((const uint4*)(vb + l * v_ls * ESZ)) : make_uint4(0, 0, 0, 0);
                    }
                }
            }
            float cmax = F_NEG_INF;
#pragma unroll
            for (int t = 0; t < AF_P; ++t) {
                if (t >= np) break;
                if (!alive[t]) continue;  // warp-uniform
                float f[VW];
                unpack16<DT>(kr[t], f);
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < VW; ++e) dot = fmaf(qv[e], f[e], dot);
#pragma unroll
                for (int off = G >> 1; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
                const int l = base + kg + KP * t;
                // (LIST never writes scores or p: the host takes it only when neither is.)
                if (!LIST && write_kq && lead && l < L) kq[h * kq_hs + l * kq_ls] = dot;
                lg[t] = lg[t] != F_NEG_INF ? dot * scale + lg[t] : F_NEG_INF;
                if (!LIST && write_p && lead && l < L) ph[l * p_ls] = lg[t];
                cmax = fmaxf(cmax, lg[t]);
            }
#pragma unroll
            for (int off = G; off < 32; off <<= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, off));
            const float nmax = fmaxf(wmax, cmax);
            const float rescale = wmax != F_NEG_INF ? expf(wmax - nmax) : 0.0f;
            wsum *= rescale;
#pragma unroll
            for (int e = 0; e < VW; ++e) acc[e] *= rescale;
            wmax = nmax;
#pragma unroll
            for (int t = 0; t < AF_P; ++t) {
                if (t >= np) break;
                if (!alive[t]) continue;
                const float pw = lg[t] != F_NEG_INF ? expf(lg[t] - nmax) : 0.0f;
                wsum += pw;
                if (pw != 0.0f) {
                    float f[VW];
                    unpack16<DT>(vr[t], f);
#pragma unroll
                    for (int e = 0; e < VW; ++e) acc[e] = fmaf(pw, f[e], acc[e]);
                }
            }
        }
    }
    PHASE(2);
    // The warp's key groups meet: lanes with the same dims, in xor order.
#pragma unroll
    for (int off = G; off < 32; off <<= 1) {
        wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
#pragma unroll
        for (int e = 0; e < VW; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], off);
    }
    float* wm = sh;              // [AF_T / 32]
    float* ws = sh + AF_T / 32;  // [AF_T / 32]
    float* wa = sh + AF_T / 16;  // [AF_T / 32][D]
    if (lane < G) {
#pragma unroll
        for (int e = 0; e < VW; ++e) wa[warp * D + d0 + e] = acc[e];
    }
    if (lane == 0) {
        wm[warp] = wmax;
        ws[warp] = wsum;
    }
    __syncthreads();
    PHASE(3);
    float m = F_NEG_INF;
#pragma unroll
    for (int w = 0; w < AF_T / 32; ++w) m = fmaxf(m, wm[w]);
    float s = 0.0f, y = 0.0f;
#pragma unroll
    for (int w = 0; w < AF_T / 32; ++w) {
        const float f = wm[w] != F_NEG_INF ? expf(wm[w] - m) : 0.0f;
        s = fmaf(ws[w], f, s);
        if (tid < D) y = fmaf(wa[w * D + tid], f, y);
    }
    if (tid < D) {
        y = s > 0.0f ? y / s : 0.0f;
        if (write_o) o[h * o_hs + tid * o_ds] = y;
        if (has_cpy) c[h * c_hs + tid * c_ds] = y;
    }
    if (write_p && lead) {
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
#pragma unroll 1
        for (int l = kg; l < L; l += KP) {
            const float lv = ph[l * p_ls];
            ph[l * p_ls] = lv != F_NEG_INF ? expf(lv - m) * inv : 0.0f;
        }
    }
}

#define AF_PARAMS                                                                               \
    int L, int D, float scale, const float *q, int q_hs, int q_ds, int dtkv, const void *k,     \
        int k_hs, int k_ls, int k_div, const void *v, int v_hs, int v_ls, int v_div,            \
        const float *mask, int m_hs, int m_ls, int has_mask, float *kq, int kq_hs, int kq_ls,   \
        int write_kq, float *p, int p_hs, int p_ls, int write_p, float *o, int o_hs, int o_ds, \
        int write_o, float *c, int c_hs, int c_ds, int has_cpy, int rehearse, int mask_ahead
// Both entry points below. LIST: `attn_fast_long` (lsh: AF_LSH words of shared memory).
//
// mask_ahead: the mask is no kernel's output that may still be running (the host checked that
// no node of the graph writes it; decode's mask is uploaded before the graph starts), so the
// listing a rehearsal made of a window of one listing is the real pass's too: the real pass
// skips it and issues q's and the listed keys' K and V loads together — one memory round trip
// after the wait instead of two.
template <bool LIST>
__device__ __forceinline__ void attn_fast_run(AF_PARAMS, float* sh, int* lsh) {
    PHASE_ENTRY();
    PHASE(0);
    const bool reuse = LIST && rehearse && mask_ahead && L <= AF_LS;
    // A window of one chunk reads its masked keys' rows too (one round trip); longer ones
    // read the mask first.
    const bool spec = L <= (AF_T / (D / (dtkv == DT_F32 ? 4 : 8))) * AF_P;
#define AF_ARGS                                                                                 \
    L, scale, q, q_hs, q_ds, k, k_hs, k_ls, k_div, v, v_hs, v_ls, v_div, mask, m_hs, m_ls,      \
        has_mask, kq, kq_hs, kq_ls, wkq, p, p_hs, p_ls, wp, o, o_hs, o_ds, wo, c, c_hs, c_ds, wc, \
        sh
#define AF_SPEC(DT, G)                                                                          \
    if (LIST) {                                                                                 \
        attn_fast_body<DT, G, false, true>(AF_ARGS, lsh, reuse && real);                        \
    } else if (spec) {                                                                          \
        attn_fast_body<DT, G, true>(AF_ARGS);                                                   \
    } else {                                                                                    \
        attn_fast_body<DT, G, false>(AF_ARGS);                                                  \
    }
#define AF_CASE(DT, VW)                                                                         \
    switch (D / VW) {                                                                           \
        case 4: AF_SPEC(DT, 4); break;                                                          \
        case 8: AF_SPEC(DT, 8); break;                                                          \
        case 16: AF_SPEC(DT, 16); break;                                                        \
        default: AF_SPEC(DT, 32); break;                                                        \
    }
    // With `rehearse` (a launch ahead of its producer), a rehearsal first (see `pdl_entry`):
    // the whole path on the inputs as they are, no global stores.
#pragma unroll 1
    for (int pass = rehearse ? 0 : 1; pass < 2; ++pass) {
        const int real = pass;
        if (real) {
            pdl_entry();
            PHASE(1);
        }
        const int wkq = write_kq && real, wp = write_p && real, wo = write_o && real;
        const int wc = has_cpy && real;
        switch (dtkv) {
            case DT_F16: AF_CASE(DT_F16, 8); break;
            case DT_BF16: AF_CASE(DT_BF16, 8); break;
            default: AF_CASE(DT_F32, 4); break;
        }
        // The real pass reuses the shared partials: every rehearsal read of them comes first.
        if (!real) __syncthreads();
    }
#undef AF_CASE
#undef AF_SPEC
#undef AF_ARGS
    PHASE(4);
    PHASE_EXIT();
}

extern "C" __global__ void __launch_bounds__(AF_T) attn_fast(AF_PARAMS) {
    __shared__ float sh[AF_T / 16 + (AF_T / 32) * ATT_MAXD];
    attn_fast_run<false>(L, D, scale, q, q_hs, q_ds, dtkv, k, k_hs, k_ls, k_div, v, v_hs, v_ls,
                         v_div, mask, m_hs, m_ls, has_mask, kq, kq_hs, kq_ls, write_kq, p, p_hs,
                         p_ls, write_p, o, o_hs, o_ds, write_o, c, c_hs, c_ds, has_cpy, rehearse,
                         mask_ahead, sh, nullptr);
}

// A window with a mask, where neither the raw scores nor p are written (the host's condition,
// decode's case, at any window length; write_kq and write_p are ignored): the valid keys are
// listed first (LIST above), so masked keys cost no round trips. Its own entry point, so that
// the listing's registers and shared memory never touch `attn_fast`'s.
extern "C" __global__ void __maxnreg__(168) attn_fast_long(AF_PARAMS) {
    __shared__ float sh[AF_T / 16 + (AF_T / 32) * ATT_MAXD];
    __shared__ int lsh[AF_LSH];
    attn_fast_run<true>(L, D, scale, q, q_hs, q_ds, dtkv, k, k_hs, k_ls, k_div, v, v_hs, v_ls,
                        v_div, mask, m_hs, m_ls, 1, kq, kq_hs, kq_ls, 0, p, p_hs, p_ls, 0, o,
                        o_hs, o_ds, write_o, c, c_hs, c_ds, has_cpy, rehearse, mask_ahead, sh,
                        lsh);
}
#undef AF_PARAMS
