// Fused attention: q @ K^T -> SoftMax -> p @ V (-> the Cpy of a permutation) in one launch.
// Decode (one query row per head), a block per query head: `attn_decode`, and the short paths
// `attn_fast` and `attn_fast_long`; `attn_split`, several blocks per head over its valid keys.
// Prefill (several rows per head): `attn_prefill`, at the end.
// The host side (patterns, preconditions, launch): src/fusion/attention.rs.
// Like every fused kernel it writes each tensor its nodes would have written (unless the host
// proved a result dead), in the nodes' order within the thread that owns an element, so later
// readers see what the unfused chain would have left; arithmetic is f32 in fixed summation
// orders that depend only on the shapes (no float atomics), so results are deterministic run to
// run. One NVRTC module, compiled with kernels/common.cuh in front of it.
// NaN follows soft_max: a NaN logit at a position the mask admits (NaN in q, in that K row or
// in the mask entry; or +inf meeting +inf) makes every p, o and copy element of its head NaN;
// fmaxf skips NaN in the running max, so the running sum carries it and the end tests the sum.
// A NaN in V reaches the columns it multiplies. Positions the mask excludes are never read
// (unless raw scores are written, which keep their NaN), so a NaN there reaches nothing — where
// the unfused chain's soft_max, adding -inf to a NaN score, would still give a NaN row.

#define F_NEG_INF (-__int_as_float(0x7f800000))

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
        // A NaN logit of a valid position (NaN in q, its K row or its mask entry) is skipped by
        // fmaxf, so the sum carries it (also when every logit so far is NaN and the max is
        // still -inf): the head's outputs then come out NaN, as soft_max's row does.
        const float ex = !valid                   ? 0.0f
                         : new_max != F_NEG_INF ? expf(lg - new_max)
                         : lg != lg             ? lg
                                                : 0.0f;
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
    // run_sum (the same in every thread: block sums) is NaN iff a valid logit was NaN, or a +inf
    // met another: then every p, o and copy of the head is NaN, as soft_max's NaN row is (and
    // so would the unfused chain's be).
    const bool row_nan = run_sum != run_sum;
    const float inv = row_nan ? run_sum : run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
#pragma unroll 1
    for (I base = 0; base < L; base += ATT_T) {
        const I l = base + tid;
        if (l < L) {
            const float lg = base == 0 ? lg0 : ph[l * p_ls];
            ph[l * p_ls] = row_nan ? run_sum : lg != F_NEG_INF ? expf(lg - run_max) * inv : 0.0f;
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
#if LS_PART(4)
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
#endif

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
#define AF_PW (ATT_MAXD + 4)    // floats of one partials slot of attn_split: m, s, y[D], pad
#define AF_MC 8                 // attn_split's merge: up to this many chunks' partials loaded at once

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

// The end of an `attn_split` block whose head's keys run in nc > 1 chunks: it writes its chunk's
// max m, sum s and unnormalized p @ V row y (y: thread tid < D's dim) to its partials slot,
// then takes a ticket of its head; the head's last block to arrive merges the nc partials in
// chunk order — the merge of the warps above, one level up: weights exp(m_c - M), NaN carried
// by the sums — writes o and the copy, and sets the ticket back to 0 for the next launch.
// `live` off (a rehearsal) stores nothing and takes no ticket. `flag`: one shared int.
// Partials are read through L2 (ld_cg): other multiprocessors wrote them.
template <int D>
__device__ __forceinline__ void af_combine(int h, int chunk, int nc, int nsplit, float m, float s,
                                           float y, float* part, unsigned* ticket, int live,
                                           float* o, int o_hs, int o_ds, int write_o, float* c,
                                           int c_hs, int c_ds, int has_cpy, int* flag) {
    if (!live) return;
    const int tid = threadIdx.x;
    float* mine = part + (h * nsplit + chunk) * AF_PW;
    if (tid < D) mine[2 + tid] = y;
    if (tid == 0) {
        mine[0] = m;
        mine[1] = s;
    }
    // The block's partials, stored before the barrier, are released by the ticket's add; the
    // last block's add acquires the others', and its barrier orders every thread's reads after.
    __syncthreads();
    if (tid == 0) *flag = ticket_add(ticket + h, 1u) == (unsigned)(nc - 1);
    __syncthreads();
    if (!*flag) return;
    const float* ph = part + h * nsplit * AF_PW;
    float gm = F_NEG_INF, gs = 0.0f, gy = 0.0f;
    if (nc <= AF_MC) {
        // Every partial loaded at once (one trip through L2 instead of two a chunk: this
        // block's merge is the last link of the head's chain, which the next kernel waits for),
        // then the same operations in the same order as the loop below.
        float mk[AF_MC], sk[AF_MC], yk[AF_MC];
#pragma unroll
        for (int k = 0; k < AF_MC; ++k) {
            if (k < nc) {
                mk[k] = ld_cg(ph + k * AF_PW);
                sk[k] = ld_cg(ph + k * AF_PW + 1);
                yk[k] = tid < D ? ld_cg(ph + k * AF_PW + 2 + tid) : 0.0f;
            }
        }
#pragma unroll
        for (int k = 0; k < AF_MC; ++k) {
            if (k < nc) gm = fmaxf(gm, mk[k]);
        }
#pragma unroll
        for (int k = 0; k < AF_MC; ++k) {
            if (k < nc) {
                const float f = mk[k] != F_NEG_INF ? expf(mk[k] - gm) : 0.0f;
                gs = fmaf(sk[k], f, gs);
                if (tid < D) gy = fmaf(yk[k], f, gy);
            }
        }
    } else {
#pragma unroll 1
        for (int k = 0; k < nc; ++k) gm = fmaxf(gm, ld_cg(ph + k * AF_PW));
#pragma unroll 1
        for (int k = 0; k < nc; ++k) {
            const float mk = ld_cg(ph + k * AF_PW);
            const float f = mk != F_NEG_INF ? expf(mk - gm) : 0.0f;
            gs = fmaf(ld_cg(ph + k * AF_PW + 1), f, gs);
            if (tid < D) gy = fmaf(ld_cg(ph + k * AF_PW + 2 + tid), f, gy);
        }
    }
    const bool row_nan = gs != gs;
    if (tid < D) {
        gy = row_nan ? gs : gs > 0.0f ? gy / gs : 0.0f;
        if (write_o) o[h * o_hs + tid * o_ds] = gy;
        if (has_cpy) c[h * c_hs + tid * c_ds] = gy;
    }
    if (tid == 0) ticket[h] = 0u;
}

template <int DT, int G, bool SPEC, bool LIST = false, bool SPLIT = false>
__device__ __forceinline__ void attn_fast_body(int L, float scale, const float* q, int q_hs,
                                               int q_ds, const void* k, int k_hs, int k_ls,
                                               int k_div, const void* v, int v_hs, int v_ls,
                                               int v_div, const float* mask, int m_hs, int m_ls,
                                               int has_mask, float* kq, int kq_hs, int kq_ls,
                                               int write_kq, float* p, int p_hs, int p_ls,
                                               int write_p, float* o, int o_hs, int o_ds,
                                               int write_o, float* c, int c_hs, int c_ds,
                                               int has_cpy, float* sh, int* lsh = nullptr,
                                               bool listed = false, int nsplit = 1,
                                               int ns = 1, float* part = nullptr,
                                               unsigned* ticket = nullptr, int live = 0,
                                               bool light = false) {
    constexpr int VW = DT == DT_F32 ? 4 : 8;
    constexpr int ESZ = DT == DT_F32 ? 4 : 2;
    constexpr int D = G * VW;
    constexpr int KP = AF_T / G;  // keys per pass
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kg = tid / G, d0 = (tid % G) * VW;
    // SPLIT: block (h, chunk) of a grid of nsplit chunks per head, heads fastest (chunk 0 of
    // every head is in the first wave).
    const int nh = SPLIT ? (int)gridDim.x / nsplit : 0;
    const int h = SPLIT ? (int)blockIdx.x % nh : (int)blockIdx.x;
    const int chunk = SPLIT ? (int)blockIdx.x / nh : 0;
    int nc = 1;  // chunks of the head's listed keys (SPLIT; 1 otherwise)
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
        // `light`: a rehearsal that only lists the keys (for the real pass to reuse) stops here.
        if (LIST && light && !live) return;
        // SPLIT: this block's share [j0, j1) of the list. One chunk up to a round trip of
        // keys, else chunks of at least half one, at most ns (block-uniform: n is shared).
        int j0 = 0, j1 = n;
        if (SPLIT) {
            constexpr int RT = KP * AF_P;
            nc = n <= RT ? 1 : min(ns, (2 * n + RT - 1) / RT);
            if (chunk >= nc) return;
            j0 = (int)((long long)chunk * n / nc);
            j1 = (int)((long long)(chunk + 1) * n / nc);
        }
#pragma unroll 1
        for (int base = j0; base < j1; base += KP * AF_P) {
            uint4 kr[AF_P], vr[AF_P];
            float lg[AF_P];
            bool alive[AF_P];
            // Passes past the window (or the list) are skipped whole (a block-uniform branch):
            // short windows run and fetch only the code of the passes they use.
            const int np = min(AF_P, (j1 - base + KP - 1) / KP);
            if (LIST) {
#pragma unroll
                for (int t = 0; t < AF_P; ++t) {
                    alive[t] = t < np;
                    if (t < np) {
                        const int j = base + kg + KP * t;
                        const bool in = j < j1;
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
    if (SPLIT && nc > 1) {
        af_combine<D>(h, chunk, nc, nsplit, m, s, y, part, ticket, live, o, o_hs, o_ds, write_o,
                      c, c_hs, c_ds, has_cpy, lsh + AF_LSH);
        return;
    }
    // s (the same in every thread) is NaN iff a valid logit was NaN (its weight is NaN whatever
    // the max, and NaN survives every rescale), or a +inf met another: every output of the head
    // is NaN then, as soft_max's NaN row is.
    const bool row_nan = s != s;
    if (tid < D) {
        y = row_nan ? s : s > 0.0f ? y / s : 0.0f;
        if (write_o) o[h * o_hs + tid * o_ds] = y;
        if (has_cpy) c[h * c_hs + tid * c_ds] = y;
    }
    if (write_p && lead) {
        const float inv = row_nan ? s : s > 0.0f ? 1.0f / s : 0.0f;
#pragma unroll 1
        for (int l = kg; l < L; l += KP) {
            const float lv = ph[l * p_ls];
            ph[l * p_ls] = row_nan ? s : lv != F_NEG_INF ? expf(lv - m) * inv : 0.0f;
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
template <bool LIST, bool SPLIT = false>
__device__ __forceinline__ void attn_fast_run(AF_PARAMS, float* sh, int* lsh, int nsplit = 1,
                                              float* part = nullptr, unsigned* ticket = nullptr) {
    PHASE_ENTRY();
    PHASE(0);
    // rehearse 2: where the real pass reuses the listing, the rehearsal only lists the keys
    // (no K/V loads: a rehearsal that starts late delays the real pass by its whole path).
    const bool reuse = LIST && rehearse && mask_ahead && L <= AF_LS;
    // SPLIT: chunks of one listing only (the host launches it for such windows; past one, a
    // head's chunk 0 would take the whole window and the others none).
    const int ns = SPLIT && L <= AF_LS ? nsplit : 1;
    // A window of one chunk reads its masked keys' rows too (one round trip); longer ones
    // read the mask first.
    const bool spec = L <= (AF_T / (D / (dtkv == DT_F32 ? 4 : 8))) * AF_P;
#define AF_ARGS                                                                                 \
    L, scale, q, q_hs, q_ds, k, k_hs, k_ls, k_div, v, v_hs, v_ls, v_div, mask, m_hs, m_ls,      \
        has_mask, kq, kq_hs, kq_ls, wkq, p, p_hs, p_ls, wp, o, o_hs, o_ds, wo, c, c_hs, c_ds, wc, \
        sh
#define AF_SPEC(DT, G)                                                                          \
    if (LIST) {                                                                                 \
        attn_fast_body<DT, G, false, true, SPLIT>(AF_ARGS, lsh, reuse && real, nsplit, ns,      \
                                                  part, ticket, real, reuse && rehearse == 2);  \
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

#if LS_PART(1)
extern "C" __global__ void __launch_bounds__(AF_T) attn_fast(AF_PARAMS) {
    __shared__ float sh[AF_T / 16 + (AF_T / 32) * ATT_MAXD];
    attn_fast_run<false>(L, D, scale, q, q_hs, q_ds, dtkv, k, k_hs, k_ls, k_div, v, v_hs, v_ls,
                         v_div, mask, m_hs, m_ls, has_mask, kq, kq_hs, kq_ls, write_kq, p, p_hs,
                         p_ls, write_p, o, o_hs, o_ds, write_o, c, c_hs, c_ds, has_cpy, rehearse,
                         mask_ahead, sh, nullptr);
}
#endif

// A window with a mask, where neither the raw scores nor p are written (the host's condition,
// decode's case, at any window length; write_kq and write_p are ignored): the valid keys are
// listed first (LIST above), so masked keys cost no round trips. Its own entry point, so that
// the listing's registers and shared memory never touch `attn_fast`'s.
#if LS_PART(2)
extern "C" __global__ void __maxnreg__(168) attn_fast_long(AF_PARAMS) {
    __shared__ float sh[AF_T / 16 + (AF_T / 32) * ATT_MAXD];
    __shared__ int lsh[AF_LSH];
    attn_fast_run<true>(L, D, scale, q, q_hs, q_ds, dtkv, k, k_hs, k_ls, k_div, v, v_hs, v_ls,
                        v_div, mask, m_hs, m_ls, 1, kq, kq_hs, kq_ls, 0, p, p_hs, p_ls, 0, o,
                        o_hs, o_ds, write_o, c, c_hs, c_ds, has_cpy, rehearse, mask_ahead, sh,
                        lsh);
}
#endif

// Decode attention split over keys (flash-decoding): `attn_fast_long`'s case — a mask, neither
// the raw scores nor p written — with nsplit blocks per query head instead of one.
//
// Why: one block per head is 32 blocks for a 1B model on an H200's 132 multiprocessors, each
// walking every valid key of its head in turn: at the bench's depth (512-640 valid keys) a
// head takes 2-3 dependent round trips of K/V loads on one multiprocessor while the rest of
// the device idles.
//
// Strategy: block (h, chunk), heads fastest in the grid. Every block lists its head's valid
// keys over the whole window (one listing, as `attn_fast_long`; under `mask_ahead` while it
// rehearses) and so knows their number n; the head's keys then run in nc chunks — one chunk
// while n fits a round trip of passes (today's single block: blocks past the first exit, and
// no partials or ticket are touched), else min(nsplit, ceil(2n / round trip)) chunks, so that
// a chunk is at least half a round trip. The count is worked out on the device at every launch
// from the mask, so a captured graph stays right as the valid length grows step to step, and a
// short valid part of a long window keeps a single block. Each chunk is an online softmax over
// its contiguous share of the listed keys (the same passes as `attn_fast_long`); chunk blocks
// write (max, sum, unnormalized p @ V) to a partials slot and take a ticket of their head (an
// integer atomic), and the last of the head's chunks to arrive merges the partials
// (`af_combine`). The combine rides in the same kernel rather than a second launch: the
// attention stays one node of the decode graph (a second kernel would add a launch and a
// dependent-launch gap per layer), and the merge is nc partials of D floats, read from L2 by
// one block while the others have finished.
//
// Invariants: the result does not depend on which block finishes last — the merge reads the
// partials in chunk order, and every chunk's arithmetic is fixed by n and the shapes — so it is
// deterministic; it differs from `attn_fast_long`'s only in summation order (within f32). NaN
// follows `attn_fast`: a NaN logit makes its chunk's sum NaN, and a NaN sum survives the merge.
// The host gives a window of at most one listing (AF_LS keys; longer ones are taken as
// `attn_fast_long` does, by chunk 0 alone), `part` room for gridDim.x slots of AF_PW floats
// and `ticket` one zeroed word per head; the last block sets its head's word back to 0, so the
// words are zero between launches. Launches run one after another on the stream (a kernel's
// real pass starts after the one before it completed), so every attention of a graph may share
// one ticket array and one partials block.
#if LS_PART(3)
extern "C" __global__ void __maxnreg__(168) attn_split(AF_PARAMS, int nsplit, float* part,
                                                       unsigned* ticket) {
    __shared__ float sh[AF_T / 16 + (AF_T / 32) * ATT_MAXD];
    __shared__ int lsh[AF_LSH + 1];  // af_list's words, then af_combine's flag
    attn_fast_run<true, true>(L, D, scale, q, q_hs, q_ds, dtkv, k, k_hs, k_ls, k_div, v, v_hs,
                              v_ls, v_div, mask, m_hs, m_ls, 1, kq, kq_hs, kq_ls, 0, p, p_hs, p_ls,
                              0, o, o_hs, o_ds, write_o, c, c_hs, c_ds, has_cpy, rehearse,
                              mask_ahead, sh, lsh, nsplit, part, ticket);
}
#endif
#undef AF_PARAMS

// ---------------------------------------------------------------------------------------------
// Prefill attention (`attn_prefill`): the same chain for n_q query rows per head — kq = q @ K^T,
// p = softmax(kq * scale + mask), o = p @ V and optionally the Cpy of a permuted view of o —
// flash-attention style: one block per (head, tile of AP_Q query rows), the keys in tiles of
// AP_K with an online softmax, so the scores and p never leave the multiprocessor. The host
// takes this kernel only where both are dead (nothing reads them later); o is written only
// when something reads it besides the copy (`write_o`).
//
// Built for throughput: a 512-token prefill of a 1B model runs 32 heads x 32 query tiles per
// layer, each over up to a few hundred keys. Per key tile the block loads the tile's mask
// entries (a 16 x 32 window of the mask), marks the key columns some row of the tile admits,
// and skips the tile outright when none does (causal masks: every tile past the diagonal); it
// then loads the admitted K and V rows (f32, f16 or bf16, converted to f32 in shared memory;
// columns no row admits are zero and never read from memory), computes the logits, and folds
// them into each row's running max and sum. Thread t owns query row t / 8 of the tile: its
// logits of keys t % 8 + 8 j (j < 4) and its output dims 4 (t % 8 + 8 j) + e (e < 4); the
// eight threads of a row are adjacent lanes of one warp, so a row's max and sum are three
// shuffles. Shared memory is read 16 bytes at a time (q and K rows in the logits, p and V rows
// in p @ V): one 16-byte load of q feeds 16 FMAs, and a V load 4 per weight.
// Accumulation is f32 in orders fixed by the shapes (deterministic). The rounding differs from
// the unfused chain's (cuBLAS products, `soft_max`), within f32 precision.
//
// NaN follows `attn_decode`: a NaN logit at a position the mask admits makes its query row's o
// and copy NaN (fmaxf skips NaN in the running max, so the running sum carries it); a NaN in V
// reaches the rows whose p at its key is non-zero; a position the mask excludes is never read
// from K or V (unless another row of the tile admits it, and then its p is zero and the product
// is skipped), so a NaN there reaches nothing.
//
// Invariants: D <= AP_MAXD and D a multiple of 4 (the host checks). Every read of q precedes
// every write of the block, and block (h, tile) reads only q rows of its tile and head: the
// host may let o or the copy lie over q when element (h, i, d) of the write is element
// (h, i, d) of q.
#define AP_T 128
#define AP_Q 16
#define AP_K 32
#define AP_MAXD 128
#define AP_RT (AP_T / AP_Q)           // threads per query row (8)
#define AP_KJ (AP_K / AP_RT)          // logits per thread (4)
#define AP_DJ (AP_MAXD / (4 * AP_RT)) // 4-dim groups of o per thread, at most (4)
#define AP_S (AP_MAXD + 4)            // shared row stride of q, K and V (16-byte rows; the
                                      // eight rows a warp's lanes read start in other banks)
#define AP_PS (AP_K + 4)              // shared row stride of p

template <int DT>
__device__ __forceinline__ void attn_prefill_body(
    i64 L, i64 NQ, i64 D, float scale, const void* q, int dtq, i64 q_hs, i64 q_qs, i64 q_ds,
    const void* k, i64 k_hs, i64 k_ls, i64 k_div, const void* v, i64 v_hs, i64 v_ls, i64 v_div,
    int kvec, const void* mask, int dtm, i64 m_hs, i64 m_qs, i64 m_ls, int has_mask, float* o,
    i64 o_hs, i64 o_qs, i64 o_ds, int write_o, void* c, int dtc, i64 c_hs, i64 c_qs, i64 c_ds,
    int has_cpy, float* qs, float* ks, float* vs, float* ms, float* ps, int* colv, int* anyv) {
    const int tid = threadIdx.x;
    const int r = tid / AP_RT, sub = tid % AP_RT;
    const int D4 = (int)D / 4;  // D is a multiple of 4 (the host checks)
    // Later query tiles (more admitted keys under a causal mask) start first.
    const i64 ntq = (NQ + AP_Q - 1) / AP_Q;
    const i64 h = (i64)blockIdx.x / ntq;
    const i64 q0 = (ntq - 1 - (i64)blockIdx.x % ntq) * AP_Q;
    const i64 qi = q0 + r;
    const bool qin = qi < NQ;
    const char* kb = (const char*)k + (h / k_div) * k_hs * (DT == DT_F32 ? 4 : 2);
    const char* vb = (const char*)v + (h / v_div) * v_hs * (DT == DT_F32 ? 4 : 2);
#pragma unroll 1
    for (int e = tid; e < AP_Q * (int)D; e += AP_T) {
        const int rr = e / (int)D, d = e % (int)D;
        qs[rr * AP_S + d] = q0 + rr < NQ ? ld(q, dtq, h * q_hs + (q0 + rr) * q_qs + d * q_ds) : 0.0f;
    }
    // o's running value: dims 4 (sub + AP_RT j) + e of row r.
    float acc[AP_DJ][4];
#pragma unroll
    for (int j = 0; j < AP_DJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    float run_max = F_NEG_INF, run_sum = 0.0f;
#pragma unroll 1
    for (i64 base = 0; base < L; base += AP_K) {
        // The tile's mask entries (-inf: excluded, also past the window and past the queries).
#pragma unroll
        for (int j = 0; j < AP_KJ; ++j) {
            const int cc = sub + AP_RT * j;
            const i64 l = base + cc;
            float mv = F_NEG_INF;
            if (qin && l < L) mv = has_mask ? ld(mask, dtm, h * m_hs + qi * m_qs + l * m_ls) : 0.0f;
            ms[r * AP_K + cc] = mv;
        }
        __syncthreads();
        // Key columns some row admits; the tile is skipped when none is.
        if (tid < AP_K) {
            int any = 0;
#pragma unroll 1
            for (int rr = 0; rr < AP_Q; ++rr) any |= ms[rr * AP_K + tid] != F_NEG_INF;
            colv[tid] = any;
            const unsigned vote = __ballot_sync(0xffffffffu, any);
            if (tid == 0) *anyv = vote != 0;
        }
        __syncthreads();
        if (!*anyv) continue;
        // K and V rows of the admitted columns, as f32 (zeros elsewhere): 16 bytes per load
        // where every row is aligned (`kvec`), else one element.
        if (kvec) {
            const int VW = DT == DT_F32 ? 4 : 8, ESZ = DT == DT_F32 ? 4 : 2;
            const int nch = (int)D / VW;
#pragma unroll 1
            for (int e = tid; e < AP_K * nch; e += AP_T) {
                const int cc = e / nch, ch = e % nch;
                float kf[8], vf[8];
                if (colv[cc]) {
                    const i64 l = base + cc;
                    unpack16<DT>(*(const uint4*)(kb + (l * k_ls + ch * VW) * ESZ), kf);
                    unpack16<DT>(*(const uint4*)(vb + (l * v_ls + ch * VW) * ESZ), vf);
                } else {
#pragma unroll
                    for (int x = 0; x < 8; ++x) kf[x] = vf[x] = 0.0f;
                }
                float4* kd = (float4*)(ks + cc * AP_S + ch * VW);
                float4* vd = (float4*)(vs + cc * AP_S + ch * VW);
#pragma unroll
                for (int x = 0; x < VW / 4; ++x) {
                    kd[x] = make_float4(kf[4 * x], kf[4 * x + 1], kf[4 * x + 2], kf[4 * x + 3]);
                    vd[x] = make_float4(vf[4 * x], vf[4 * x + 1], vf[4 * x + 2], vf[4 * x + 3]);
                }
            }
        } else {
#pragma unroll 1
            for (int e = tid; e < AP_K * (int)D; e += AP_T) {
                const int cc = e / (int)D, d = e % (int)D;
                float kx = 0.0f, vx = 0.0f;
                if (colv[cc]) {
                    const i64 l = base + cc;
                    kx = ld(kb, DT, l * k_ls + d);
                    vx = ld(vb, DT, l * v_ls + d);
                }
                ks[cc * AP_S + d] = kx;
                vs[cc * AP_S + d] = vx;
            }
        }
        __syncthreads();
        // This thread's logits (keys sub + AP_RT j), 4 dims per shared load.
        float dot[AP_KJ];
#pragma unroll
        for (int j = 0; j < AP_KJ; ++j) dot[j] = 0.0f;
        const float4* qr = (const float4*)(qs + r * AP_S);
#pragma unroll 4
        for (int d4 = 0; d4 < D4; ++d4) {
            const float4 a = qr[d4];
#pragma unroll
            for (int j = 0; j < AP_KJ; ++j) {
                const float4 b = ((const float4*)(ks + (sub + AP_RT * j) * AP_S))[d4];
                dot[j] = fmaf(a.x, b.x, dot[j]);
                dot[j] = fmaf(a.y, b.y, dot[j]);
                dot[j] = fmaf(a.z, b.z, dot[j]);
                dot[j] = fmaf(a.w, b.w, dot[j]);
            }
        }
        float lg[AP_KJ];
        float tmax = F_NEG_INF;
#pragma unroll
        for (int j = 0; j < AP_KJ; ++j) {
            const float mv = ms[r * AP_K + sub + AP_RT * j];
            lg[j] = mv != F_NEG_INF ? dot[j] * scale + mv : F_NEG_INF;
            tmax = fmaxf(tmax, lg[j]);
        }
#pragma unroll
        for (int off = AP_RT / 2; off > 0; off /= 2) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
        const float new_max = fmaxf(run_max, tmax);
        float tsum = 0.0f;
#pragma unroll
        for (int j = 0; j < AP_KJ; ++j) {
            const float x = lg[j];
            const float ex = x == F_NEG_INF ? 0.0f : new_max != F_NEG_INF ? expf(x - new_max) : x != x ? x : 0.0f;
            ps[r * AP_PS + sub + AP_RT * j] = ex;
            tsum += ex;
        }
#pragma unroll
        for (int off = AP_RT / 2; off > 0; off /= 2) tsum += __shfl_xor_sync(0xffffffffu, tsum, off);
        const float rescale = run_max != F_NEG_INF ? expf(run_max - new_max) : 0.0f;
        run_sum = run_sum * rescale + tsum;
        run_max = new_max;
        __syncthreads();  // ps complete
        // This tile's p @ V, keys in ascending order; a zero weight (an excluded key) is
        // skipped, so its V row reaches nothing.
#pragma unroll
        for (int j = 0; j < AP_DJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] *= rescale;
        const float4* pr = (const float4*)(ps + r * AP_PS);
#pragma unroll 1
        for (int c4 = 0; c4 < AP_K / 4; ++c4) {
            const float4 p4 = pr[c4];
            const float pw[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (pw[u] != 0.0f) {
                    const float4* vr = (const float4*)(vs + (4 * c4 + u) * AP_S);
#pragma unroll
                    for (int j = 0; j < AP_DJ; ++j) {
                        if (sub + AP_RT * j < D4) {
                            const float4 b = vr[sub + AP_RT * j];
                            acc[j][0] = fmaf(pw[u], b.x, acc[j][0]);
                            acc[j][1] = fmaf(pw[u], b.y, acc[j][1]);
                            acc[j][2] = fmaf(pw[u], b.z, acc[j][2]);
                            acc[j][3] = fmaf(pw[u], b.w, acc[j][3]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // ks, vs, ps and colv are rewritten by the next tile
    }
    if (!qin) return;
    // run_sum (the same in the row's eight threads: shuffles) is NaN iff an admitted logit was
    // NaN, or +inf met +inf: the row's o and copy are NaN then, as soft_max's NaN row makes them.
    const bool row_nan = run_sum != run_sum;
    const float inv = row_nan ? run_sum : run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
#pragma unroll
    for (int j = 0; j < AP_DJ; ++j) {
        if (sub + AP_RT * j < D4) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const i64 d = 4 * (sub + AP_RT * j) + e;
                const float y = row_nan ? run_sum : acc[j][e] * inv;
                if (write_o) o[h * o_hs + qi * o_qs + d * o_ds] = y;
                if (has_cpy) st(c, dtc, h * c_hs + qi * c_qs + d * c_ds, y);
            }
        }
    }
}

// One block of AP_T threads per (head, tile of AP_Q query rows): grid heads * ceil(NQ / AP_Q).
// K and V share one dtype (dtkv); q, the mask and the copy may be f32, f16 or bf16; o is f32.
// `kvec`: every K and V row start (of each kv head) is 16-byte aligned and D a multiple of the
// elements in 16 bytes, checked on the host.
#if LS_PART(4)
extern "C" __global__ void __launch_bounds__(AP_T) attn_prefill(
    i64 L, i64 NQ, i64 D, float scale, const void* q, int dtq, i64 q_hs, i64 q_qs, i64 q_ds,
    int dtkv, const void* k, i64 k_hs, i64 k_ls, i64 k_div, const void* v, i64 v_hs, i64 v_ls,
    i64 v_div, int kvec, const void* mask, int dtm, i64 m_hs, i64 m_qs, i64 m_ls, int has_mask,
    float* o, i64 o_hs, i64 o_qs, i64 o_ds, int write_o, void* c, int dtc, i64 c_hs, i64 c_qs,
    i64 c_ds, int has_cpy) {
    pdl_entry();
    // Declared as float4 for their 16-byte alignment; used as floats.
    __shared__ float4 qs4[AP_Q * AP_S / 4];
    __shared__ float4 ks4[AP_K * AP_S / 4];
    __shared__ float4 vs4[AP_K * AP_S / 4];
    __shared__ float ms[AP_Q * AP_K];
    __shared__ float4 ps4[AP_Q * AP_PS / 4];
    float* qs = (float*)qs4;
    float* ks = (float*)ks4;
    float* vs = (float*)vs4;
    float* ps = (float*)ps4;
    __shared__ int colv[AP_K];
    __shared__ int anyv;
#define AP_ARGS                                                                                \
    L, NQ, D, scale, q, dtq, q_hs, q_qs, q_ds, k, k_hs, k_ls, k_div, v, v_hs, v_ls, v_div, kvec, \
        mask, dtm, m_hs, m_qs, m_ls, has_mask, o, o_hs, o_qs, o_ds, write_o, c, dtc, c_hs, c_qs,  \
        c_ds, has_cpy, qs, ks, vs, ms, ps, colv, &anyv
    switch (dtkv) {
        case DT_F16: attn_prefill_body<DT_F16>(AP_ARGS); break;
        case DT_BF16: attn_prefill_body<DT_BF16>(AP_ARGS); break;
        default: attn_prefill_body<DT_F32>(AP_ARGS); break;
    }
#undef AP_ARGS
}
#endif
