// The decode kernels of ../kernels and ../src/fusion run on the CPU (cuda_shim.h) and checked against float64
// references by NMSE: rms_norm_mul, fused_gemv / fused_gemv8, fused_gemv1 (with and without
// its norm prologue; its row-pair mode with the Rope and KV-cache row epilogues),
// mul_mat_vec_k / mul_mat_vec_k4, mul_mat_vec_1, rope_rows, attn_decode and attn_prefill
// (masked rows poisoned with NaN: they must not be read), soft_max and argmax (exact), and the small copies
// small_copy and copy_batch (exact, in order), and the sampler's penalize and sample against the
// answers of lowsync_graph::sampling in sample_cases.txt (exact), and the kernels on GGUF block
// weights (quant.cu) against gguf-py's dequantization in quant_cases.txt (bit-exact values;
// products by NMSE against float64 of those values), and fused_gemv1_q (the fused decode
// products and their epilogues on such weights, of mixed block types). Built and run by
// scripts/kernel_emu.sh with this folder as its argument; exits non-zero on any failure.
#include "cuda_shim.h"
#include "attention.cu"
#include "elementwise.cu"
#include "quant.cuh"  // before gemv.cu, whose fused_gemv1_q decodes blocks
#include "gemv.cu"
#include "matmul.cu"
#include "quant.cu"
#include "norm.cu"
#include "norm_mul.cu"
#include "rope_rows.cu"
#include "sample.cu"

#include <array>
#include <random>
#include <string>

namespace {

std::mt19937 rng(7);

float rnd(float s) { return std::uniform_real_distribution<float>(-s, s)(rng); }

int esz(int dt) { return dt == DT_F32 || dt == DT_I32 ? 4 : 2; }

// A typed host array, zeroed, 64-byte aligned (the kernels' 16-byte loads need 16).
struct Buf {
    int dt;
    i64 n;
    std::unique_ptr<unsigned char, decltype(&free)> mem;
    Buf(int dt_, i64 n_)
        : dt(dt_), n(n_), mem(nullptr, &free) {
        const size_t bytes = ((size_t)n * esz(dt) / 64 + 1) * 64;
        mem.reset((unsigned char*)aligned_alloc(64, bytes));
        memset(mem.get(), 0, bytes);
    }
    unsigned char* p() const { return mem.get(); }
    float get(i64 i) const { return ld(p(), dt, i); }
    void set(i64 i, float v) { st(p(), dt, i, v); }
    void rand(float s = 1.0f) {
        for (i64 i = 0; i < n; ++i) set(i, rnd(s));
    }
};

// `v` rounded to dtype `dt` and back.
double rounded(int dt, float v) {
    Buf b(dt, 1);
    b.set(0, v);
    return b.get(0);
}

int fails = 0;

void check(const std::string& what, const std::vector<double>& want, const std::vector<double>& got,
           double bound) {
    double num = 0, den = 0;
    bool nan = false;
    for (size_t i = 0; i < want.size(); ++i) {
        if (std::isnan(got[i]) != std::isnan(want[i])) nan = true;
        if (std::isnan(want[i])) continue;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    const double e = den > 0 ? num / den : num;
    if (nan || !(e <= bound)) {
        ++fails;
        printf("FAIL %s: nmse %g (bound %g), nan mismatch %d\n", what.c_str(), e, bound, nan);
    }
}

// The kernel before, still running when a rehearsing kernel starts (programmatic dependent
// launch): `inputs` hold garbage (all bits set: NaN for floats) until the first wait of the
// launch, where the hook puts their real values back and checks that no byte of `outputs`
// changed before it — a rehearsal stores nothing, and the real pass uses nothing it computed.
// Blocks run one after another, so block 0 rehearses on the garbage and later blocks on the
// real values.
struct Producer {
    std::vector<Buf*> inputs, outputs;
    std::vector<std::vector<unsigned char>> real, before;
    bool fired = false, clean = true;
    static std::vector<unsigned char> bytes(const Buf* b) {
        return std::vector<unsigned char>(b->p(), b->p() + b->n * esz(b->dt));
    }
    Producer(std::vector<Buf*> in, std::vector<Buf*> out) : inputs(std::move(in)), outputs(std::move(out)) {
        for (Buf* b : inputs) {
            real.push_back(bytes(b));
            memset(b->p(), 0xff, b->n * esz(b->dt));
        }
        for (Buf* b : outputs) before.push_back(bytes(b));
        emu_on_wait = [this] {
            if (fired) return;
            fired = true;
            for (size_t i = 0; i < outputs.size(); ++i) clean = clean && bytes(outputs[i]) == before[i];
            for (size_t i = 0; i < inputs.size(); ++i) memcpy(inputs[i]->p(), real[i].data(), real[i].size());
        };
    }
    Producer(const Producer&) = delete;
    ~Producer() { emu_on_wait = nullptr; }
    void check(const std::string& tag) {
        emu_on_wait = nullptr;
        if (!fired || !clean) {
            ++fails;
            printf("FAIL %s: %s\n", tag.c_str(), !fired ? "the kernel never waited" : "stored before its wait");
        }
    }
};

i64 pow2(i64 x) {
    i64 p = 1;
    while (p < x) p <<= 1;
    return p;
}

// The fused products' lane group per output column (as src/matmul.rs `mmv_group`).
i64 group(i64 k, i64 vw) { return std::min<i64>(32, pow2(std::max<i64>(1, k / vw))); }

void test_norm_mul() {
    for (int xdt : {DT_F32, DT_F16})
        for (int ndt : {DT_F32, DT_F16})
            for (int in_place : {0, 1}) {
                const i64 rows = 3, len = 300;
                Buf x(xdt, rows * len);  // transposed: element (r, c) at c * rows + r
                x.rand(2);
                Buf w(DT_BF16, len);
                w.rand(1.5);
                Buf nd(ndt, rows * len), od_own(ndt, rows * len);
                Buf& od = in_place ? nd : od_own;
                Lay L{};
                L.nd = 1;
                L.shape[0] = rows;
                L.st[0][0] = len;
                L.st[1][0] = 1;
                L.st[2][0] = len;
                const unsigned block = (unsigned)std::clamp<i64>(pow2(len), 32, 256);
                launch(rows, block, [&] {
                    rms_norm_mul(rows, len, L, nd.p(), ndt, 1, x.p(), xdt, rows, 1e-5f, od.p(), ndt, 1,
                                 w.p(), DT_BF16, 1);
                });
                std::vector<double> wn, gn, wo, go;
                for (i64 r = 0; r < rows; ++r) {
                    double s = 0;
                    for (i64 c = 0; c < len; ++c) s += (double)x.get(c * rows + r) * x.get(c * rows + r);
                    const double inv = 1.0 / std::sqrt(s / len + 1e-5);
                    for (i64 c = 0; c < len; ++c) {
                        const double n = rounded(ndt, (float)(x.get(c * rows + r) * inv));
                        if (!in_place) {
                            wn.push_back(n);
                            gn.push_back(nd.get(r * len + c));
                        }
                        wo.push_back(n * w.get(c));
                        go.push_back(od.get(r * len + c));
                    }
                }
                const double b = ndt == DT_F16 ? 1e-6 : 1e-10;
                const std::string tag = "rms_norm_mul x " + std::to_string(xdt) + " norm " +
                                        std::to_string(ndt) + " in_place " + std::to_string(in_place);
                if (!in_place) check(tag + ": norm", wn, gn, b);
                check(tag + ": product", wo, go, b);
            }
}

// One fused product set: `nseg` weights [n, ldw] of dtype wdt (rows padded by `pad`), the
// first with a broadcast f16 Add, the second with a full Add; or a gate/up pair into a SwiGlu.
struct Products {
    FgSet S{};
    std::vector<std::unique_ptr<Buf>> w, out, add, sum;
    std::unique_ptr<Buf> sw;
    i64 ns[3];
    int nseg, pair;
    i64 ldw, rows;

    Products(int wdt, i64 M, i64 K, int pair_, i64 pad, const std::array<i64, 3>& n)
        : nseg(pair_ ? 2 : 3), pair(pair_), ldw(K + pad), rows(M) {
        S.nseg = nseg;
        S.pair = pair;
        S.wnorm = 1;
        for (int s = 0; s < nseg; ++s) {
            ns[s] = pair && s == 1 ? n[0] : n[s];
            w.push_back(std::make_unique<Buf>(wdt, ns[s] * ldw));
            w[s]->rand(0.1f);
            out.push_back(std::make_unique<Buf>(DT_F32, M * ns[s]));
            FgSeg& g = S.seg[s];
            g.n = ns[s];
            g.w = (u64)w[s]->p();
            g.w_rs = ldw;
            g.out = (u64)out[s]->p();
            g.o_rs = ns[s];
            g.o_cs = 1;
            g.wout = 1;
            g.wsum = 1;
            if (!pair && s < 2) {
                add.push_back(std::make_unique<Buf>(s == 0 ? DT_F16 : DT_F32, s == 0 ? ns[s] : M * ns[s]));
                add[s]->rand();
                sum.push_back(std::make_unique<Buf>(DT_F32, M * ns[s]));
                g.add = (u64)add[s]->p();
                g.add_dt = add[s]->dt;
                g.a_rs = s == 0 ? 0 : ns[s];
                g.a_cs = 1;
                g.sum = (u64)sum[s]->p();
                g.sum_dt = DT_F32;
                g.s_rs = ns[s];
                g.s_cs = 1;
            }
        }
        if (pair) {
            sw = std::make_unique<Buf>(DT_F32, M * ns[0]);
            S.sw = (u64)sw->p();
            S.sw_dt = DT_F32;
            S.sw_rs = ns[0];
            S.sw_cs = 1;
        }
    }

    i64 units() const { return pair ? ns[0] : ns[0] + ns[1] + (nseg > 2 ? ns[2] : 0); }

    // Checks every written tensor against activation rows act(i, k).
    // `bound`: of every check (NMSE).
    template <class A>
    void check_all(const std::string& tag, i64 K, A act, double bound = 1e-10) const {
        std::vector<double> prod[3];
        for (int s = 0; s < nseg; ++s) {
            std::vector<double> got, ws, gs;
            for (i64 i = 0; i < rows; ++i)
                for (i64 j = 0; j < ns[s]; ++j) {
                    double acc = 0;
                    for (i64 k = 0; k < K; ++k) acc += act(i, k) * w[s]->get(j * ldw + k);
                    prod[s].push_back(acc);
                    got.push_back(out[s]->get(i * ns[s] + j));
                    if (!pair && s < 2) {
                        ws.push_back(acc + add[s]->get(s == 0 ? j : i * ns[s] + j));
                        gs.push_back(sum[s]->get(i * ns[s] + j));
                    }
                }
            check(tag + ": product " + std::to_string(s), prod[s], got, bound);
            if (!pair && s < 2) check(tag + ": add " + std::to_string(s), ws, gs, bound);
        }
        if (pair) {
            std::vector<double> want, got;
            for (i64 i = 0; i < rows * ns[0]; ++i) {
                const double g = prod[0][i], u = prod[1][i];
                want.push_back(g / (1 + std::exp(-g)) * u);
                got.push_back(sw->get(i));
            }
            check(tag + ": swiglu", want, got, bound);
        }
    }
};

bool aligned16(const void* p) { return (u64)p % 16 == 0; }

// Decode's row (one contiguous f32 row, f32 weight): rms_norm_mul's short path, with the
// block size the host picks (a quarter of the row, rounded up to a power of two).
void test_norm_mul_row() {
    for (i64 len : {300, 2048})
        for (int in_place : {0, 1}) {
            Buf x(DT_F32, len), w(DT_F32, len), nd(DT_F32, len), od_own(DT_F32, len);
            x.rand(2);
            w.rand(1.5);
            Buf& od = in_place ? nd : od_own;
            Lay L{};
            L.nd = 1;
            L.shape[0] = 1;
            const unsigned block = (unsigned)std::clamp<i64>(pow2((len + 3) / 4), 32, 1024);
            launch(1, block, [&] {
                rms_norm_mul(1, len, L, nd.p(), DT_F32, 1, x.p(), DT_F32, 1, 1e-5f, od.p(), DT_F32, 1, w.p(),
                             DT_F32, 1);
            });
            std::vector<double> wn, gn, wo, go;
            double s = 0;
            for (i64 c = 0; c < len; ++c) s += (double)x.get(c) * x.get(c);
            const double inv = 1.0 / std::sqrt(s / len + 1e-5);
            for (i64 c = 0; c < len; ++c) {
                const double n = x.get(c) * inv;
                if (!in_place) {
                    wn.push_back(n);
                    gn.push_back(nd.get(c));
                }
                wo.push_back(n * w.get(c));
                go.push_back(od.get(c));
            }
            const std::string tag = "rms_norm_mul row " + std::to_string(len) + " in_place " + std::to_string(in_place);
            if (!in_place) check(tag + ": norm", wn, gn, 1e-10);
            check(tag + ": product", wo, go, 1e-10);
        }
}

void test_fused_gemv() {
    for (int wdt : {DT_F32, DT_F16, DT_BF16})
        for (i64 M : {1, 3, 8})
            for (i64 K : {64, 2050, 7})
                for (int pair : {0, 1})
                    for (i64 pad : {0, 1}) {
                        const i64 lda = K + pad;
                        Buf a(DT_F32, M * lda);
                        a.rand();
                        Products P(wdt, M, K, pair, pad, {pair ? 40 : 96, 40, 33});
                        const int e = esz(wdt);
                        int vec = aligned16(a.p()) && (M == 1 || (lda * 4) % 16 == 0);
                        for (int s = 0; s < P.nseg; ++s)
                            vec &= aligned16(P.w[s]->p()) && (P.ns[s] == 1 || (P.ldw * e) % 16 == 0);
                        const i64 G = group(K, 16 / e);
                        const unsigned blocks = (unsigned)((P.units() + 128 / G - 1) / (128 / G));
                        launch(blocks, 128, [&] {
                            if (M <= 2) {
                                fused_gemv(M, K, (const float*)a.p(), lda, P.S, wdt, (int)G, vec);
                            } else {
                                fused_gemv8(M, K, (const float*)a.p(), lda, P.S, wdt, (int)G, vec);
                            }
                        });
                        const std::string tag = "fused_gemv w " + std::to_string(wdt) + " M " +
                                                std::to_string(M) + " K " + std::to_string(K) +
                                                " pair " + std::to_string(pair) + " pad " + std::to_string(pad);
                        P.check_all(tag, K, [&](i64 i, i64 k) { return (double)a.get(i * lda + k); });
                    }
}

// Decode's products: one row, every weight row 16-byte aligned; the norm prologue computes the
// row (block 0 writes the norm and its product).
void test_fused_gemv1() {
    struct Case {
        int wdt;
        i64 K;
        int pair, norm;
    };
    // K 2052 / 4100: a K % 8 tail after the split staging; 4100: two batches per unit.
    // grid: 0, a warp per unit (unstreamed); 1 and 3 blocks streamed (each warp strides over
    // several units, the refills crossing from one unit to the next); 99: a streamed grid
    // larger than needed (idle warps).
    for (Case c : {Case{DT_F16, 2052, 0, 0}, Case{DT_F32, 1100, 0, 1}, Case{DT_F16, 4100, 0, 1},
                   Case{DT_BF16, 2052, 1, 0}, Case{DT_F16, 1024, 1, 1}, Case{DT_F16, 64, 0, 0},
                   Case{DT_BF16, 1000, 0, 1}})
        for (int grid : {0, 1, 3, 99}) {
        const i64 K = c.K;
        Buf x(DT_F32, K), nw(DT_F32, K), nd(DT_F32, K), a(DT_F32, K);
        x.rand(2.0f);
        nw.rand(1.5f);
        if (!c.norm) a.rand();
        Products P(c.wdt, 1, K, c.pair, 0, {37, 21, 12});
        launch(grid ? (unsigned)grid : (unsigned)((P.units() + 7) / 8), 256, [&] {
            // The host launches the pair modes through their own entry point.
            auto* kernel = c.pair ? fused_gemv1_pair : fused_gemv1;
            kernel(K, (const float*)a.p(), P.S, c.wdt, 1, 1, grid != 0, c.norm ? (const float*)x.p() : nullptr,
                   1e-5f, c.norm ? nd.p() : nullptr, DT_F32, nw.p(), DT_F32);
        });
        const std::string tag = "fused_gemv1 w " + std::to_string(c.wdt) + " K " + std::to_string(K) +
                                " pair " + std::to_string(c.pair) + " norm " + std::to_string(c.norm) +
                                " grid " + std::to_string(grid);
        std::vector<double> act(K);
        if (c.norm) {
            double ss = 0;
            for (i64 k = 0; k < K; ++k) ss += (double)x.get(k) * x.get(k);
            const double inv = 1.0 / std::sqrt(ss / K + 1e-5);
            std::vector<double> wn, gn, ga;
            for (i64 k = 0; k < K; ++k) {
                act[k] = x.get(k) * inv * nw.get(k);
                wn.push_back(x.get(k) * inv);
                gn.push_back(nd.get(k));
                ga.push_back(a.get(k));
            }
            check(tag + ": norm", wn, gn, 1e-10);
            check(tag + ": norm product", act, ga, 1e-10);
        } else {
            for (i64 k = 0; k < K; ++k) act[k] = a.get(k);
        }
        P.check_all(tag, K, [&](i64, i64 k) { return act[k]; });
        if (grid == 0) continue;
        // The streamed path's own entry point for this weight dtype (the host launches it for
        // streamed, staged products; gate/up's with SwiGlu in pair mode): the same bytes in
        // every result, written again from NaN.
        std::vector<Buf*> res;
        for (auto& b : P.out) res.push_back(b.get());
        for (auto& b : P.sum) res.push_back(b.get());
        if (c.pair) res.push_back(P.sw.get());
        std::vector<std::vector<float>> before;
        for (Buf* b : res) {
            before.emplace_back();
            for (i64 i = 0; i < b->n; ++i) {
                before.back().push_back(b->get(i));
                b->set(i, NAN);
            }
        }
        auto* own = c.pair ? (c.wdt == DT_F16    ? fused_gemv1_gu16
                              : c.wdt == DT_BF16 ? fused_gemv1_gub16
                                                 : fused_gemv1_gu32)
                           : (c.wdt == DT_F16    ? fused_gemv1_s16
                              : c.wdt == DT_BF16 ? fused_gemv1_sb16
                                                 : fused_gemv1_s32);
        launch((unsigned)grid, 256, [&] {
            own(K, (const float*)a.p(), P.S, c.wdt, 1, 1, 1, c.norm ? (const float*)x.p() : nullptr, 1e-5f,
                c.norm ? nd.p() : nullptr, DT_F32, nw.p(), DT_F32);
        });
        for (size_t r = 0; r < res.size(); ++r)
            for (i64 i = 0; i < res[r]->n; ++i)
                if (const float g = res[r]->get(i); memcmp(&before[r][i], &g, 4) != 0) {
                    ++fails;
                    printf("FAIL %s: streamed entry point differs at result %zu element %lld\n", tag.c_str(), r,
                           (long long)i);
                    break;
                }
    }
}

// fused_gemv1_q's typed entry point for segments of the block types `types` on arithmetic `qm`
// (1: q16, `fused_gemv1_q4_0` ...; 2: q8, `fused_gemv1_q4_0_q8` ...), as the host's
// `Kernel::typed_q` picks it, or null where they have none.
using FqKernel = void (*)(i64, const float*, FgSet, const float*, float, void*, int, const void*, int, int, int);
FqKernel fq_typed(const std::vector<int>& types, int qm) {
    if (types.empty() || (qm != 1 && qm != 2)) return nullptr;
    const bool q8 = qm == 2;
    if (std::all_of(types.begin(), types.end(), [&](int t) { return t == types[0]; })) {
        switch (types[0]) {
            case DT_Q4_0: return q8 ? fused_gemv1_q4_0_q8 : fused_gemv1_q4_0;
            case DT_Q4_1: return q8 ? fused_gemv1_q4_1_q8 : fused_gemv1_q4_1;
            case DT_Q8_0: return q8 ? fused_gemv1_q8_0_q8 : fused_gemv1_q8_0;
            case DT_Q4_K: return q8 ? fused_gemv1_q4_k_q8 : fused_gemv1_q4_k;
            case DT_Q6_K: return q8 ? fused_gemv1_q6_k_q8 : fused_gemv1_q6_k;
            default: return nullptr;
        }
    }
    const bool k46 = std::all_of(types.begin(), types.end(), [](int t) { return t == DT_Q4_K || t == DT_Q6_K; });
    return !k46 ? nullptr : q8 ? fused_gemv1_q4_k_q6_k_q8 : fused_gemv1_q4_k_q6_k;
}

// The bytes of the buffers a kernel writes, taken before the generic kernel's launch; `typed`
// then, where the segments' one block type has a typed entry point, puts them back and runs it
// (`run(kernel, pf)`: `pf` bit 2 set or not, a unit's rows interleaved or one after the other;
// bit 3, the row quantized straight from global memory where there is no norm prologue; bit 4,
// the norm prologue's products quantized from registers where there is one) and
// checks that it wrote every buffer to the generic kernel's bytes, each way. `same` reruns the
// generic kernel another way (`pf` bit 3) and checks the same.
struct TypedCheck {
    std::vector<Buf*> outs;
    std::vector<std::vector<unsigned char>> start;
    // The arithmetic (1: q16, 2: q8) whose typed entry points `typed` runs.
    int qm = 1;
    explicit TypedCheck(std::vector<Buf*> o) : outs(std::move(o)) {
        for (Buf* b : outs) start.push_back(Producer::bytes(b));
    }
    template <class Run>
    void typed(const std::string& tag, const std::vector<int>& types, Run run) {
        const FqKernel k = fq_typed(types, qm);
        if (!k) return;
        std::vector<std::vector<unsigned char>> want;
        for (Buf* b : outs) want.push_back(Producer::bytes(b));
        for (int pf : {0, 4, 8, 16}) {
            for (size_t i = 0; i < outs.size(); ++i) memcpy(outs[i]->p(), start[i].data(), start[i].size());
            run(k, pf);
            for (size_t i = 0; i < outs.size(); ++i) {
                if (Producer::bytes(outs[i]) != want[i]) {
                    ++fails;
                    printf("FAIL %s pf %d: the typed entry point wrote buffer %zu differently\n", tag.c_str(), pf, i);
                }
            }
        }
    }
    template <class Rerun>
    void same(const std::string& tag, Rerun rerun) {
        std::vector<std::vector<unsigned char>> want;
        for (Buf* b : outs) want.push_back(Producer::bytes(b));
        for (size_t i = 0; i < outs.size(); ++i) memcpy(outs[i]->p(), start[i].data(), start[i].size());
        rerun();
        for (size_t i = 0; i < outs.size(); ++i) {
            if (Producer::bytes(outs[i]) != want[i]) {
                ++fails;
                printf("FAIL %s: wrote buffer %zu differently\n", tag.c_str(), i);
            }
            memcpy(outs[i]->p(), want[i].data(), want[i].size());  // the later checks' bytes
        }
    }
};

// Decode's row-pair mode (pair 2): one unit is columns j, j + 1 of one segment. Segments as a
// layer's attention inputs: q (hq heads of hd dims, Rope only), k (one head, Rope and a cache
// row), v (one head, cache row only); each with or without a broadcast bias Add (`add`, a
// mask over the segments). `wout` / `wsum` (masks) and `wnorm` off: those results are dead and
// must keep their NaN sentinels. `bad`: k's row index is c_n (1) or v's is -1 (2): the error
// word gets that segment's tag and its cache is left as it was.
// `qset` != 0: quantized weights of the block types `q_sets[qset]` (q, k, v; wdt unused),
// through `fused_gemv1_q` (`own`: one warp per unit; else a grid of 2 blocks whose warps stride
// over the units).
struct RpCase {
    int wdt;
    i64 K, hd, n_dims, hq;
    int add, sum_dt, r_dt, c_dt, norm, wout, wsum, wnorm, bad, ahead, pos;
    double theta;
    int qset = 0;
};

// Per-segment block types of the quantized row-pair cases (a Q4_K_M layer: Q4_K q/k, Q6_K v).
const int q_sets[][3] = {{0, 0, 0},
                         {DT_Q4_K, DT_Q4_K, DT_Q6_K},
                         {DT_Q8_0, DT_Q5_1, DT_IQ4_NL},
                         {DT_Q3_K, DT_IQ4_XS, DT_Q2_K},
                         {DT_Q4_0, DT_Q5_K, DT_Q4_1},
                         {DT_Q4_0, DT_Q4_0, DT_Q4_0},
                         {DT_Q6_K, DT_Q6_K, DT_Q6_K},
                         {DT_Q4_1, DT_Q4_1, DT_Q4_1}};

// One block type's cases from quant_cases.txt: blocks and gguf-py's values of them.
struct QCase {
    std::string name;
    int qt = 0;
    i64 nblocks = 0;
    std::vector<unsigned char> bytes;
    std::vector<float> vals;  // gguf's values, in order
    i64 qb() const { return (i64)vals.size() / nblocks; }
    i64 bb() const { return (i64)bytes.size() / nblocks; }
};

std::vector<QCase> quant_cases() {
    static std::vector<QCase> cases;
    if (!cases.empty()) return cases;
    const std::string path = std::string(LOWSYNC_EMU_DIR) + "/quant_cases.txt";
    FILE* f = fopen(path.c_str(), "r");
    if (!f) {
        ++fails;
        printf("FAIL quant: cannot read %s\n", path.c_str());
        return cases;
    }
    std::string line;
    auto next = [&](std::string& out) {
        out.clear();
        int ch;
        while ((ch = fgetc(f)) != EOF && ch != '\n') out.push_back((char)ch);
        return ch != EOF || !out.empty();
    };
    while (next(line)) {
        if (line.empty() || line[0] == '#') continue;
        QCase c;
        char name[32];
        long long nb = 0;
        if (sscanf(line.c_str(), "%31s %d %lld", name, &c.qt, &nb) != 3) break;
        c.name = name;
        c.nblocks = nb;
        std::string hex, vals;
        next(hex);
        next(vals);
        for (size_t i = 0; i + 1 < hex.size(); i += 2) c.bytes.push_back((unsigned char)std::stoul(hex.substr(i, 2), nullptr, 16));
        for (size_t i = 0; i + 8 <= vals.size(); i += 9) c.vals.push_back(__uint_as_float((unsigned)std::stoul(vals.substr(i, 8), nullptr, 16)));
        cases.push_back(std::move(c));
    }
    fclose(f);
    if (cases.size() != 12) {
        ++fails;
        printf("FAIL quant: %zu block types in %s, want 12\n", cases.size(), path.c_str());
    }
    return cases;
}

const QCase& quant_case(int qt) {
    static const std::vector<QCase> cases = quant_cases();
    for (const QCase& c : cases)
        if (c.qt == qt) return c;
    fprintf(stderr, "quant_cases.txt has no block type %d\n", qt);
    exit(2);
}

// A quantized weight [n, K] (K a whole number of blocks) of random blocks of one gguf case,
// rows back to back, starting `off` bytes past a 16-byte boundary (the bytes around poisoned);
// `vals` (f32 [n, K]) gets gguf's values of them.
struct QRows {
    std::vector<unsigned char> mem;
    unsigned char* p = nullptr;
    i64 rs = 0;  // bytes per row
};
QRows q_rows(int qt, i64 n, i64 K, Buf& vals, int off) {
    const QCase& c = quant_case(qt);
    const i64 qb = c.qb(), bb = c.bb(), kb = K / qb;
    QRows r;
    r.rs = kb * bb;
    r.mem.assign((size_t)(n * r.rs + 32), 0xee);
    r.p = r.mem.data() + (16 - (u64)r.mem.data() % 16) % 16 + off;
    for (i64 j = 0; j < n; ++j)
        for (i64 b = 0; b < kb; ++b) {
            const i64 src = (i64)(rng() % (unsigned)c.nblocks);
            memcpy(r.p + j * r.rs + b * bb, c.bytes.data() + src * bb, bb);
            for (i64 e = 0; e < qb; ++e) vals.set(j * K + b * qb + e, c.vals[src * qb + e]);
        }
    return r;
}

// The integer path's activation row: the CPU backend's q16 blocks of x (backend-cpu
// kernels/quant/q16.rs; K a multiple of 32), computed in f32 as that code does, and returned
// dequantized in float64 (d * q per value); `ds` and `qs` (if given) get every block's d and
// every value's q. The references of the q16 products: (a) tight (NMSE 1e-10, the bound of the
// f32 path: only f32 rounding of the per-chunk scales and sums separates the kernel from
// float64) against gguf's values times these; (b) loose against the unquantized row, NMSE
// 1e-6 (the GPU tests' bound against the CPU oracle): q16 rounds each value by at most
// d / 2 = amax / 65534 of its block, an NMSE of about (amax / rms)^2 / (12 * 32767^2), 2e-10 to
// 4e-9 for these rows (uniform, or a norm of them); the cases draw a row's blocks from a few
// distinct gguf blocks, so one row's outputs are few independent samples, and a 256-value
// IQ4_XS row dominated by one block measured 6e-8.
std::vector<double> q16_values(const std::vector<float>& x, std::vector<float>* ds = nullptr,
                               std::vector<int>* qs = nullptr) {
    std::vector<double> out(x.size());
    for (size_t b = 0; b + 32 <= x.size(); b += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[b + i]));  // NaN skipped
        const float d = amax / 32767.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; ++i) {
            const float r = std::round(x[b + i] * id);  // half away from zero
            const int q = std::isnan(r) ? 0 : (int)std::clamp(r, -32767.0f, 32767.0f);
            out[b + i] = (double)d * q;
            if (qs) qs->push_back(q);
        }
        if (ds) ds->push_back(d);
    }
    return out;
}

// The q8 path's activation row: the CPU backend's 8-bit blocks of x (backend-cpu
// kernels/quant/q8.rs, its scalar `quantize_block`; K a multiple of 32) in f32 as that code
// computes them, returned dequantized in float64; `ds` and `qs` as `q16_values`'s. The products'
// references as q16's: (a) tight (NMSE 1e-10) against gguf's values times these; (b) against
// the unquantized row within `Q8_RAW_NMSE`: q8 rounds each value by at most d / 2 = amax / 254
// of its block, an NMSE of about (amax / rms)^2 / (12 * 127^2), 1.5e-5 for a uniform row (a
// dot product's relative error about 4e-3) and more after a norm with random weights. These
// cases measured up to 3e-4 (a 256-value Q4_K row whose 37 columns repeat a few distinct
// blocks: few independent samples; a 256-value Q6_K row reached 4e-3 in one draw, so
// `test_quant_mmv` checks q8 against the unquantized row on its long rows only) and 4e-4 for
// a SwiGlu of two q8 products; most stay below 1e-4.
std::vector<double> q8_values(const std::vector<float>& x, std::vector<float>* ds = nullptr,
                              std::vector<int>* qs = nullptr) {
    std::vector<double> out(x.size());
    for (size_t b = 0; b + 32 <= x.size(); b += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[b + i]));  // NaN skipped
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; ++i) {
            const float r = std::round(x[b + i] * id);  // half away from zero
            const int q = std::isnan(r) ? 0 : (int)std::clamp(r, -127.0f, 127.0f);
            out[b + i] = (double)d * q;
            if (qs) qs->push_back(q);
        }
        if (ds) ds->push_back(d);
    }
    return out;
}
const double Q8_RAW_NMSE = 1e-3;

// The row as integer path `qm` (1: q16, 2: q8) quantizes it, dequantized in float64.
std::vector<double> q_values(const std::vector<float>& x, int qm) { return qm == 2 ? q8_values(x) : q16_values(x); }
// The bound of a `qm` product against the unquantized row.
double q_raw_bound(int qm) { return qm == 2 ? Q8_RAW_NMSE : 1e-6; }

// `own`: through the row-pair path's own entry point for the weight dtype (`fused_gemv1_rp16`
// and kin, what the host launches), else through `fused_gemv1_pair`. `q16` (quantized weights
// only): `fused_gemv1_q`'s integer path (1: q16, 2: q8), checked as `q_values` says.
void rowpair_case(const RpCase& c, bool own, int q16 = 0) {
    const bool q = c.qset != 0;
    const int wdt = q ? DT_F32 : c.wdt;  // quantized: w holds gguf's values of the blocks
    const i64 K = c.K, e = esz(wdt);
    // Rows 16-byte aligned (K 202: a K % VW tail).
    const i64 ldw = q ? K : (K * e + 15) / 16 * 16 / e;
    const i64 n[3] = {c.hq * c.hd, c.hd, c.hd};
    const i64 tail = 8;                             // sentinels past every row the kernel writes
    // Caches of cn rows longer than n, between two guard rows (rows -1 and cn: a bad index's).
    const i64 cn = 5, crs[3] = {0, n[1] + 8, n[2] + 6};
    const int tags[3] = {0, 21, 22};
    const int rows[3] = {0, c.bad == 1 ? (int)cn : 3, c.bad == 2 ? -1 : 1};
    auto nan_fill = [](Buf& b) {
        for (i64 i = 0; i < b.n; ++i) b.set(i, NAN);
    };
    Buf x(DT_F32, K), nw(DT_F32, K), nd(DT_F32, K), a(DT_F32, K), pos(DT_I32, 1);
    Buf idx_k(DT_I32, 1), idx_v(DT_I32, 1);
    x.rand(2.0f);
    nw.rand(1.5f);
    nan_fill(nd);
    if (c.norm) {
        nan_fill(a);  // the prologue's product: written only with wnorm, never read by the products
    } else {
        a.rand();
    }
    ((int*)pos.p())[0] = c.pos;
    ((int*)idx_k.p())[0] = rows[1];
    ((int*)idx_v.p())[0] = rows[2];
    unsigned err = 0;
    FgSet S{};
    S.nseg = 3;
    S.pair = 2;
    S.wnorm = c.wnorm;
    S.err = (u64)&err;
    std::unique_ptr<Buf> w[3], out[3], add[3], sum[3], r[3], cache[3];
    QRows qw[3];
    std::vector<double> cache0[3];
    for (int s = 0; s < 3; ++s) {
        FgSeg& g = S.seg[s];
        w[s] = std::make_unique<Buf>(wdt, n[s] * ldw);
        w[s]->rand(0.1f);
        out[s] = std::make_unique<Buf>(DT_F32, n[s] + tail);
        nan_fill(*out[s]);
        g.n = n[s];
        g.w = (u64)w[s]->p();
        g.w_rs = ldw;
        if (q) {
            qw[s] = q_rows(q_sets[c.qset][s], n[s], K, *w[s], 2 * s);
            g.w = (u64)qw[s].p;
            g.w_rs = qw[s].rs;
            g.qt = q_sets[c.qset][s];
        }
        g.out = (u64)out[s]->p();
        g.o_rs = n[s];
        g.o_cs = 1;
        g.wout = (c.wout >> s) & 1;
        g.wsum = (c.wsum >> s) & 1;
        if ((c.add >> s) & 1) {
            add[s] = std::make_unique<Buf>(s == 0 ? DT_F16 : DT_F32, n[s]);
            add[s]->rand();
            sum[s] = std::make_unique<Buf>(c.sum_dt, n[s] + tail);
            nan_fill(*sum[s]);
            g.add = (u64)add[s]->p();
            g.add_dt = add[s]->dt;
            g.a_rs = 0;
            g.a_cs = 1;
            g.sum = (u64)sum[s]->p();
            g.sum_dt = c.sum_dt;
            g.s_rs = n[s];
            g.s_cs = 1;
        }
        if (s < 2) {
            r[s] = std::make_unique<Buf>(c.r_dt, n[s] + tail);
            nan_fill(*r[s]);
            g.r = (u64)r[s]->p();
            g.r_dt = c.r_dt;
            g.hd = c.hd;
            g.n_dims = c.n_dims;
            g.l2theta = std::log2(c.theta);
            g.pos = (u64)pos.p();
        }
        if (s > 0) {
            cache[s] = std::make_unique<Buf>(c.c_dt, (cn + 2) * crs[s]);
            cache[s]->rand();
            for (i64 i = 0; i < cache[s]->n; ++i) cache0[s].push_back(cache[s]->get(i));
            g.c = (u64)(cache[s]->p() + crs[s] * esz(c.c_dt));
            g.c_dt = c.c_dt;
            g.c_rs = crs[s];
            g.c_cs = 1;
            g.c_n = cn;
            g.idx = (u64)(s == 1 ? idx_k : idx_v).p();
            g.tag = tags[s];
        }
    }
    const i64 units = (n[0] + n[1] + n[2]) / 2;
    std::vector<Buf*> written = {&a, &nd};
    for (auto* set : {out, sum, r, cache})
        for (int s = 0; s < 3; ++s)
            if (set[s]) written.push_back(set[s].get());
    TypedCheck typed(written);
    typed.qm = q16;
    auto run_qw = [&](FqKernel kernel, int pf, unsigned warps) {
        launch(own ? (unsigned)((units + warps - 1) / warps) : 2u, 32 * warps, [&] {
            kernel(K, (const float*)a.p(), S, c.norm ? (const float*)x.p() : nullptr, 1e-5f, nd.p(), DT_F32, nw.p(),
                   DT_F32, q16, 1 | pf);
        });
    };
    auto run_q = [&](FqKernel kernel, int pf) { run_qw(kernel, pf, 8); };
    if (q) {
        run_q(fused_gemv1_q, 0);
    } else launch((unsigned)((units + 7) / 8), 256, [&] {
        // stream 1: row pairs are never streamed (the whole grid is launched).
        auto* kernel = !own ? fused_gemv1_pair
                       : c.wdt == DT_F16 ? fused_gemv1_rp16
                       : c.wdt == DT_BF16 ? fused_gemv1_rpb16
                                          : fused_gemv1_rp32;
        kernel(K, (const float*)a.p(), S, c.wdt, 1, c.ahead, 1, c.norm ? (const float*)x.p() : nullptr, 1e-5f,
               nd.p(), DT_F32, nw.p(), DT_F32);
    });
    const std::string kname = q ? (own ? "fused_gemv1_q" : "fused_gemv1_q strided") : own ? "fused_gemv1_rp"
                                                                                            : "fused_gemv1_pair";
    const std::string tag = kname + " row pairs w " + (q ? "q" + std::to_string(c.qset) : std::to_string(c.wdt)) +
                            " K " + std::to_string(K) +
                            " hd " + std::to_string(c.hd) + " n_dims " + std::to_string(c.n_dims) + " add " +
                            std::to_string(c.add) + " sum " + std::to_string(c.sum_dt) + " rope " +
                            std::to_string(c.r_dt) + " cache " + std::to_string(c.c_dt) + " norm " +
                            std::to_string(c.norm) + " wout " + std::to_string(c.wout) + " wsum " +
                            std::to_string(c.wsum) + " wnorm " + std::to_string(c.wnorm) + " bad " +
                            std::to_string(c.bad) + (q16 == 2 ? " q8" : q16 ? " q16" : "");
    // The activation row, and the prologue's results (NaN where they must not be written).
    std::vector<double> act(K), wn(K, NAN), wa(K, NAN), gn, ga;
    if (c.norm) {
        double ss = 0;
        for (i64 k = 0; k < K; ++k) ss += (double)x.get(k) * x.get(k);
        const double inv = 1.0 / std::sqrt(ss / K + 1e-5);
        for (i64 k = 0; k < K; ++k) {
            act[k] = x.get(k) * inv * nw.get(k);
            if (c.wnorm) {
                wn[k] = x.get(k) * inv;
                wa[k] = act[k];
            }
        }
    } else {
        for (i64 k = 0; k < K; ++k) act[k] = wa[k] = a.get(k);
    }
    for (i64 k = 0; k < K; ++k) {
        gn.push_back(nd.get(k));
        ga.push_back(a.get(k));
    }
    check(tag + ": norm", wn, gn, 1e-10);
    check(tag + ": norm product", wa, ga, 1e-10);
    // With q16 the products' references take the quantized row: the kernel's own f32 row where
    // it was written (its norm product), else the row rounded to f32.
    std::vector<double> ref = act;
    // Where the row was not written, the reference quantizes the float64 norm rounded to f32,
    // which can differ from the kernel's f32 norm by an ulp, and so a q16 value by one step.
    const double tight = q16 && c.norm && !c.wnorm ? 1e-8 : 1e-10;
    if (q16) {
        std::vector<float> row(K);
        for (i64 k = 0; k < K; ++k) row[k] = c.norm && c.wnorm ? a.get(k) : (float)act[k];
        ref = q_values(row, q16);
    }
    auto got_of = [](const Buf& b) {
        std::vector<double> v;
        for (i64 i = 0; i < b.n; ++i) v.push_back(b.get(i));
        return v;
    };
    // The Rope of pair (j, j + 1) of v as the rope kernel computes it: the angle in f64, its
    // sine and cosine rounded to f32, dims at or past n_dims copied; rounded to r_dt.
    auto rope = [&](const std::vector<double>& v, i64 j, double& r0, double& r1) {
        const i64 d = j % c.hd;
        r0 = v[j];
        r1 = v[j + 1];
        if (d < c.n_dims) {
            const double ang = (double)c.pos * std::pow(c.theta, -2.0 * (double)(d / 2) / (double)c.n_dims);
            const double sn = (float)std::sin(ang), cs = (float)std::cos(ang);
            r0 = v[j] * cs - v[j + 1] * sn;
            r1 = v[j] * sn + v[j + 1] * cs;
        }
        r0 = rounded(c.r_dt, (float)r0);
        r1 = rounded(c.r_dt, (float)r1);
    };
    for (int s = 0; s < 3; ++s) {
        const std::string st = tag + ": seg " + std::to_string(s);
        const bool has_add = (c.add >> s) & 1;
        // Any 16-bit rounding on the way to a value: a rare one-ulp flip against the float64 chain.
        bool rounded_chain = has_add && c.sum_dt != DT_F32;
        std::vector<double> prod(n[s]), val(n[s]), wout_v(n[s] + tail, NAN), wsum_v(n[s] + tail, NAN);
        std::vector<double> raw(n[s] + tail, NAN);
        for (i64 j = 0; j < n[s]; ++j) {
            double acc = 0, acc_raw = 0;
            for (i64 k = 0; k < K; ++k) {
                acc += ref[k] * w[s]->get(j * ldw + k);
                acc_raw += act[k] * w[s]->get(j * ldw + k);
            }
            if ((c.wout >> s) & 1) raw[j] = acc_raw;
            prod[j] = acc;
            val[j] = acc;
            if (has_add) val[j] = rounded(c.sum_dt, (float)(acc + add[s]->get(j)));
            if ((c.wout >> s) & 1) wout_v[j] = prod[j];
            if (has_add && ((c.wsum >> s) & 1)) wsum_v[j] = val[j];
        }
        const std::vector<double> gout = got_of(*out[s]), gsum = has_add ? got_of(*sum[s]) : gout;
        check(st + " product", wout_v, gout, tight);
        if (q16) check(st + " product against the unquantized row", raw, gout, q_raw_bound(q16));
        if (has_add) check(st + " add", wsum_v, gsum, rounded_chain ? 1e-6 : tight);
        // Exactly: each stored value is its source as stored, added to / rounded as the unfused
        // chain's next node reads it back (`src`: what the cache row holds, where it is stored).
        std::vector<double> src(n[s], NAN), want_sum, got_sum;
        if (has_add && ((c.wout >> s) & 1) && ((c.wsum >> s) & 1))
            for (i64 j = 0; j < n[s]; ++j) {
                want_sum.push_back(rounded(c.sum_dt, (float)gout[j] + (float)add[s]->get(j)));
                got_sum.push_back(gsum[j]);
            }
        check(st + " add of the stored product", want_sum, got_sum, 0);
        if ((has_add ? c.wsum >> s : c.wout >> s) & 1)
            for (i64 j = 0; j < n[s]; ++j) src[j] = has_add ? gsum[j] : gout[j];
        std::vector<double> cval = val;
        if (s < 2) {
            std::vector<double> wr(n[s] + tail, NAN);
            for (i64 j = 0; j < n[s]; j += 2) {
                rope(val, j, wr[j], wr[j + 1]);
                cval[j] = wr[j];
                cval[j + 1] = wr[j + 1];
            }
            rounded_chain |= c.r_dt != DT_F32;
            const std::vector<double> grope = got_of(*r[s]);
            check(st + " rope", wr, grope, rounded_chain ? 1e-6 : tight);
            // The Rope of the value as stored (where it is): no rounding flips before it.
            std::vector<double> wsr(n[s]), gsr(grope.begin(), grope.begin() + n[s]);
            for (i64 j = 0; j < n[s]; j += 2) rope(src, j, wsr[j], wsr[j + 1]);
            if (!std::isnan(src[0])) check(st + " rope of the stored value", wsr, gsr, c.r_dt == DT_F32 ? 1e-12 : 1e-6);
            for (i64 j = 0; j < n[s]; ++j) src[j] = grope[j];
        }
        if (s > 0) {
            // The row written (unless the index is bad), and the rest of the cache exactly as it was.
            const bool ok = rows[s] >= 0 && rows[s] < cn;
            std::vector<double> wrow, grow, wrest, grest, wsrc, gsrc;
            const std::vector<double> got = got_of(*cache[s]);
            for (i64 i = 0; i < cache[s]->n; ++i) {
                const i64 row = i / crs[s] - 1, col = i % crs[s];
                if (ok && row == rows[s] && col < n[s]) {
                    wrow.push_back(rounded(c.c_dt, (float)cval[col]));
                    grow.push_back(got[i]);
                    if (!std::isnan(src[col])) {
                        wsrc.push_back(rounded(c.c_dt, (float)src[col]));
                        gsrc.push_back(got[i]);
                    }
                } else {
                    wrest.push_back(cache0[s][i]);
                    grest.push_back(got[i]);
                }
            }
            rounded_chain |= c.c_dt != DT_F32;
            if (ok) check(st + " cache row", wrow, grow, rounded_chain ? 1e-6 : tight);
            check(st + " cache row of the stored value", wsrc, gsrc, 0);
            check(st + " cache rest", wrest, grest, 0);
        }
    }
    const unsigned want_err = c.bad == 1 ? 21u : c.bad == 2 ? 22u : 0u;
    if (err != want_err) {
        ++fails;
        printf("FAIL %s: error word %u, want %u\n", tag.c_str(), err, want_err);
    }
    const int* qs = q_sets[c.qset];
    if (q && q16) {
        typed.typed(tag + " typed", {qs[0], qs[1], qs[2]}, [&](FqKernel kernel, int pf) {
            err = 0;
            run_q(kernel, pf);
        });
        if (err != want_err) {
            ++fails;
            printf("FAIL %s typed: error word %u, want %u\n", tag.c_str(), err, want_err);
        }
        // Blocks of 12 warps (`CudaConfig::q_warps_norm`): the same bytes and error word.
        auto run12 = [&](FqKernel kernel, int pf) {
            err = 0;
            run_qw(kernel, pf, 12);
        };
        typed.same(tag + " 12 warps", [&] { run12(fused_gemv1_q, 0); });
        if (c.norm) {
            typed.same(tag + " direct norm", [&] {
                err = 0;
                run_q(fused_gemv1_q, 16);
            });
        }
        typed.typed(tag + " typed 12 warps", {qs[0], qs[1], qs[2]}, run12);
        if (err != want_err) {
            ++fails;
            printf("FAIL %s 12 warps: error word %u, want %u\n", tag.c_str(), err, want_err);
        }
    }
}

void test_fused_gemv1_rowpair() {
    const int F32 = DT_F32, F16 = DT_F16, BF16 = DT_BF16;
    // wdt, K, hd, n_dims, q heads, add, sum_dt, r_dt, c_dt, norm, wout, wsum, wnorm, bad, ahead,
    // pos, theta. hd 20: 50 units, the last block's warps partly idle.
    const RpCase cases[] = {
        {F16, 64, 16, 16, 2, 0, F32, F32, F16, 0, 7, 7, 1, 0, 1, 37, 10000.0},
        {BF16, 202, 16, 8, 3, 7, F32, F16, BF16, 1, 7, 7, 1, 0, 0, 5, 10000.0},
        {F32, 202, 64, 64, 2, 7, F16, F32, F32, 0, 5, 6, 1, 0, 1, 1000, 1000000.0},
        {F16, 2048, 64, 32, 2, 7, F32, F16, F16, 1, 0, 0, 0, 0, 1, 37, 10000.0},
        {F32, 64, 16, 8, 2, 0, F32, F16, BF16, 1, 7, 7, 1, 1, 1, 11, 10000.0},
        {BF16, 64, 64, 64, 2, 7, F16, F16, F32, 0, 2, 5, 1, 2, 1, 123, 500000.0},
        {F16, 202, 20, 10, 3, 4, F16, F32, F16, 1, 6, 7, 0, 0, 0, 70, 10000.0},
        {F32, 202, 16, 16, 1, 7, F32, F16, BF16, 0, 7, 7, 1, 1, 1, 3, 10000.0},
        {BF16, 202, 64, 32, 2, 0, F32, F32, F16, 1, 1, 0, 1, 2, 1, 4095, 10000.0},
    };
    for (const RpCase& c : cases)
        for (bool own : {true, false}) rowpair_case(c, own);
}

// The general matrix-vector kernels: one column per lane group (m <= 2) or four columns and
// eight rows per pass, b's k axis contiguous (columns `ldb` apart), no batch axes.
void test_mul_mat_vec_k() {
    for (int wdt : {DT_F32, DT_F16, DT_BF16})
        for (i64 M : {1, 5})
            for (i64 K : {7, 64, 2050})
                for (i64 pad : {0, 1}) {
                    const i64 N = 37, lda = K + pad, ldb = K + pad;
                    Buf a(DT_F32, M * lda), b(wdt, N * ldb), d(DT_F32, M * N);
                    a.rand();
                    b.rand(0.1f);
                    const int e = esz(wdt);
                    const int vec = aligned16(a.p()) && aligned16(b.p()) && (M == 1 || (lda * 4) % 16 == 0) &&
                                    (ldb * e) % 16 == 0;
                    const i64 G = group(K, 16 / e);
                    const int nc = M <= 2 ? 1 : 4;
                    const i64 cols_per_block = 4 * (32 / G) * nc;
                    MmBatch B{};
                    launch((unsigned)((N + cols_per_block - 1) / cols_per_block), 128, [&] {
                        if (nc == 1) {
                            mul_mat_vec_k(M, N, K, 1, B, (float*)d.p(), N, 1, (const float*)a.p(), lda, b.p(), wdt,
                                          ldb, (int)G, vec);
                        } else {
                            mul_mat_vec_k4(M, N, K, 1, B, (float*)d.p(), N, 1, (const float*)a.p(), lda, b.p(), wdt,
                                           ldb, (int)G, vec);
                        }
                    });
                    std::vector<double> want, got;
                    for (i64 i = 0; i < M; ++i)
                        for (i64 j = 0; j < N; ++j) {
                            double acc = 0;
                            for (i64 k = 0; k < K; ++k) acc += (double)a.get(i * lda + k) * b.get(j * ldb + k);
                            want.push_back(acc);
                            got.push_back(d.get(i * N + j));
                        }
                    check("mul_mat_vec_k w " + std::to_string(wdt) + " M " + std::to_string(M) + " K " +
                              std::to_string(K) + " pad " + std::to_string(pad),
                          want, got, 1e-10);
                }
}

void test_mul_mat_vec_1() {
    for (int wdt : {DT_F32, DT_F16, DT_BF16})
        for (i64 K : {64, 2052, 4100})
            for (int staged : {0, 1}) {
                const i64 N = 45;
                Buf x(DT_F32, K), w(wdt, N * K), d(DT_F32, N * 2);
                x.rand();
                w.rand(0.1f);
                launch((unsigned)((N + 7) / 8), 256, [&] {
                    mul_mat_vec_1(N, K, (float*)d.p(), 2, (const float*)x.p(), w.p(), wdt, K, staged, 1);
                });
                std::vector<double> want, got;
                for (i64 j = 0; j < N; ++j) {
                    double acc = 0;
                    for (i64 k = 0; k < K; ++k) acc += (double)x.get(k) * w.get(j * K + k);
                    want.push_back(acc);
                    got.push_back(d.get(j * 2));
                }
                check("mul_mat_vec_1 w " + std::to_string(wdt) + " K " + std::to_string(K) + " staged " +
                          std::to_string(staged),
                      want, got, 1e-10);
            }
}

// The head's product with its argmax folded in, then `argmax_take`: the logits as
// `mul_mat_vec_1` writes them, the index as `argmax` would give over them (ties, NaN rows, an
// all-NaN row, -0 against +0), and the key back at 0 — checked over two launches with one key.
void test_mul_mat_vec_1_argmax() {
    // The key's order is `better`'s: value, then the lower row; -0 ties +0; NaN below -inf.
    const bool order = argmax_key(-0.0f, 5) == argmax_key(0.0f, 5) && argmax_key(1.0f, 3) > argmax_key(-1.0f, 2) &&
                       argmax_key(-1.0f, 3) > argmax_key(-2.0f, 2) && argmax_key(2.0f, 1) > argmax_key(2.0f, 4) &&
                       argmax_key(-INFINITY, 7) > argmax_key(NAN, 0) && argmax_key(NAN, 0) > argmax_key(NAN, 1) &&
                       argmax_key(INFINITY, 9) > argmax_key(3e38f, 0) && (argmax_key(NAN, 0) >> 32) == 0;
    if (!order) {
        ++fails;
        printf("FAIL argmax_key order\n");
    }
    for (int wdt : {DT_F32, DT_F16, DT_BF16})
        for (i64 N : {45, 203})
            for (int kind = 0; kind < 5; ++kind) {
                const i64 K = 2052;
                const unsigned grid = (unsigned)((N + 7) / 8);
                Buf x(DT_F32, K), w(wdt, N * K), d(DT_F32, N), am(DT_I32, 1);
                unsigned long long key = 0;
                x.rand();
                w.rand(0.1f);
                if (kind == 1) {  // ties: two equal rows, far apart, with the largest sums
                    for (i64 k = 0; k < K; ++k) {
                        const float v = x.get(k) > 0 ? 0.5f : -0.5f;
                        w.set(3 * K + k, v);
                        w.set((N - 2) * K + k, v);
                    }
                }
                if (kind == 2) {  // NaN logits, the largest among them
                    for (i64 j = 0; j < N; j += 3) w.set(j * K + 7, NAN);
                }
                if (kind == 3) x.set(5, NAN);  // every logit NaN
                if (kind == 4) {  // every logit 0: a tie of all rows, row 0 wins
                    for (i64 k = 0; k < K; ++k) x.set(k, 0.0f);
                }
                for (int rep = 0; rep < 2; ++rep) {
                    ((int*)am.p())[0] = -1;
                    launch(grid, 256, [&] {
                        mul_mat_vec_1_argmax(N, K, (float*)d.p(), 1, (const float*)x.p(), w.p(), wdt, K, 1, 1,
                                             &key);
                    });
                    launch(1, 32, [&] { argmax_take(&key, (int*)am.p()); });
                    std::vector<double> want, got;
                    i64 best = -1;
                    for (i64 j = 0; j < N; ++j) {
                        double acc = 0;
                        for (i64 k = 0; k < K; ++k) acc += (double)x.get(k) * w.get(j * K + k);
                        const float v = d.get(j);
                        if (acc == acc) {
                            want.push_back(acc);
                            got.push_back(v);
                        }
                        if (v == v && (best < 0 || v > d.get(best))) best = j;
                    }
                    const std::string what = "mul_mat_vec_1_argmax w " + std::to_string(wdt) + " N " +
                                             std::to_string(N) + " kind " + std::to_string(kind);
                    if (kind != 4) check(what, want, got, 1e-10);  // (NMSE of all zeros: 0/0)
                    const int want_i = best < 0 ? 0 : (int)best;
                    const int got_i = ((int*)am.p())[0];
                    const bool special = (kind == 1 && got_i != 3) || (kind == 4 && got_i != 0);
                    if (got_i != want_i || key != 0 || special) {
                        ++fails;
                        printf("FAIL %s launch %d: index %d, want %d; key %llu\n", what.c_str(), rep, got_i,
                               want_i, key);
                    }
                }
            }
}

void test_rope_rows() {
    for (int cdt : {DT_F32, DT_F16, DT_BF16})
        for (int neox : {0, 1})
            for (i64 n_dims : {64, 32})
                for (int plain : {0, 1})
                    for (i64 T : {1, 3}) {
                        const i64 H = 2, D = 64, n = 24, d = H * D;
                        Buf x(DT_F32, T * H * D), pos(DT_I32, T), idx(DT_I32, T);
                        x.rand();
                        int pv[3] = {5, 6, 17}, iv[3] = {9, 4, 9};  // row 9 twice: the last wins
                        if (T == 1) {
                            pv[0] = 17;
                            iv[0] = 3;
                        }
                        for (i64 t = 0; t < T; ++t) {
                            ((int*)pos.p())[t] = pv[t];
                            ((int*)idx.p())[t] = iv[t];
                        }
                        Buf r(DT_F32, T * H * D), c(cdt, n * d), c2(cdt, n * d), s2(DT_F32, T * d);
                        c.rand();
                        c2.rand();
                        s2.rand();
                        std::vector<double> want_c(n * d), want_c2(n * d);
                        for (i64 i = 0; i < n * d; ++i) {
                            want_c[i] = c.get(i);
                            want_c2[i] = c2.get(i);
                        }
                        unsigned err = 0;
                        const i64 items = T * H * (n_dims / 2 + D - n_dims) + (plain ? T * d : 0);
                        launch((unsigned)((items + 255) / 256), 256, [&] {
                            rope_rows(T, H, D, r.p(), DT_F32, H * D, D, 1, x.p(), DT_F32, H * D, D, 1,
                                      (const int*)pos.p(), 1, n_dims, 10000.0, neox, c.p(), cdt, d, 1, n,
                                      (const int*)idx.p(), 1, 11u, plain ? T : 0, plain ? d : 0, c2.p(), cdt,
                                      d, 1, n, s2.p(), DT_F32, d, 1, (const int*)idx.p(), 1, 12u, &err);
                        });
                        std::vector<double> want_r(T * H * D), got_r, got_c, got_c2;
                        for (i64 t = 0; t < T; ++t)
                            for (i64 h = 0; h < H; ++h) {
                                const i64 b = (t * H + h) * D;
                                for (i64 k = 0; k < n_dims / 2; ++k) {
                                    const double ang = pv[t] * std::pow(10000.0, -2.0 * k / n_dims);
                                    const float sn = (float)std::sin(ang), cs = (float)std::cos(ang);
                                    const i64 ia = neox ? k : 2 * k, ib = neox ? k + n_dims / 2 : 2 * k + 1;
                                    const float xa = x.get(b + ia), xb = x.get(b + ib);
                                    want_r[b + ia] = xa * cs - xb * sn;
                                    want_r[b + ib] = xa * sn + xb * cs;
                                }
                                for (i64 k = n_dims; k < D; ++k) want_r[b + k] = x.get(b + k);
                            }
                        for (i64 t = 0; t < T; ++t)
                            for (i64 j = 0; j < d; ++j) {
                                want_c[iv[t] * d + j] = rounded(cdt, (float)want_r[t * d + j]);
                                if (plain) want_c2[iv[t] * d + j] = rounded(cdt, s2.get(t * d + j));
                            }
                        for (i64 i = 0; i < T * H * D; ++i) got_r.push_back(r.get(i));
                        for (i64 i = 0; i < n * d; ++i) {
                            got_c.push_back(c.get(i));
                            got_c2.push_back(c2.get(i));
                        }
                        const std::string tag = "rope_rows cache " + std::to_string(cdt) + " neox " +
                                                std::to_string(neox) + " n_dims " + std::to_string(n_dims) +
                                                " T " + std::to_string(T) + " plain " + std::to_string(plain);
                        check(tag + ": rope", want_r, got_r, 1e-12);
                        check(tag + ": cache", want_c, got_c, cdt == DT_F32 ? 1e-12 : 1e-6);
                        check(tag + ": second cache", want_c2, got_c2, 1e-12);
                        if (err) {
                            ++fails;
                            printf("FAIL %s: error word %u\n", tag.c_str(), err);
                        }
                    }
}

// Mask modes: 0 a prefix of 37 with a hole at 5 (shared by the heads), 1 all valid, 2 all
// masked, 3 a prefix per head, 4 every third position masked and the tail (several chunks).
bool valid_at(int mode, i64 h, i64 j) {
    switch (mode) {
        case 0: return j < 37 && j != 5;
        case 1: return true;
        case 2: return false;
        case 3: {
            const i64 v[4] = {3, 60, 100, 1};
            return j < v[h % 4];
        }
        default: return j % 3 != 0 && j < 550;
    }
}

// `narrow`: the kernel's short path (32-bit offsets, f32 q, mask and copy), else the general
// one (64-bit offsets, an f16 copy). `nan_at` (issue 29.8, soft_max's rule through the online
// softmax): 1 puts a NaN in kv head 0's K row at the last position head 0 admits, so every
// head over kv head 0 that admits it has NaN p, o and copy rows; 2 a NaN in q of the last head
// (every logit of that head); 3 a NaN in kv head 0's V row there (the one column it reaches).
// A NaN the mask excludes is never read (the poison above), so it reaches nothing.
void attention_case(int kvdt, i64 Hq, i64 Hk, i64 D, int wkq, int mode, i64 pad, i64 L, int narrow,
                    int nan_at = 0) {
    const i64 ld_kv = Hk * D + pad;  // cache row stride (pad: unaligned rows)
    Buf kc(kvdt, L * ld_kv), vc(kvdt, L * ld_kv), q(DT_F32, Hq * D);
    kc.rand();
    vc.rand();
    q.rand();
    const i64 mh = mode == 3 ? Hq : 1;
    Buf m(DT_F32, mh * L);
    for (i64 h = 0; h < mh; ++h)
        for (i64 j = 0; j < L; ++j) m.set(h * L + j, valid_at(mode, h, j) ? 0.0f : -INFINITY);
    // Masked rows are never read unless the raw scores are written: poison them.
    if (!wkq && mode != 3) {
        for (i64 j = 0; j < L; ++j)
            if (!valid_at(mode, 0, j))
                for (i64 c = 0; c < Hk * D; ++c) {
                    kc.set(j * ld_kv + c, NAN);
                    vc.set(j * ld_kv + c, NAN);
                }
    }
    i64 jn = L - 1;
    while (jn > 0 && !valid_at(mode, 0, jn)) --jn;
    if (nan_at == 1) kc.set(jn * ld_kv + D - 1, NAN);
    if (nan_at == 2) q.set((Hq - 1) * D + D / 2, NAN);
    if (nan_at == 3) vc.set(jn * ld_kv, NAN);
    const int cdt = narrow ? DT_F32 : DT_F16;
    Buf kq(DT_F32, Hq * L), p(DT_F32, Hq * L), o(DT_F32, Hq * D), cp(cdt, Hq * D);
    const int e = esz(kvdt), vw = 16 / e;
    const int kvec = aligned16(kc.p()) && (ld_kv * e) % 16 == 0 && (Hk == 1 || (D * e) % 16 == 0);
    const int vvec = D % vw == 0 && aligned16(vc.p()) && (Hk == 1 || (D * e) % 16 == 0) && (ld_kv * e) % 16 == 0;
    const int G = (int)std::min<i64>(32, pow2((D + vw - 1) / vw));
    const int TC = (int)pow2(vvec ? D / vw : D);
    const float scale = 1.0f / std::sqrt((float)D);
    // The copy's destination is [D, Hq] (strides 1 and Hq): a permuted view.
    launch((unsigned)Hq, 256, [&] {
        attn_decode(L, D, scale, q.p(), DT_F32, D, 1, kvdt, kc.p(), D, ld_kv, Hq / Hk, kvec, G, vc.p(), D, ld_kv,
                    Hq / Hk, vvec, TC, m.p(), DT_F32, mode == 3 ? L : 0, 1, 1, (float*)kq.p(), L, 1, wkq,
                    (float*)p.p(), L, 1, (float*)o.p(), D, 1, cp.p(), cdt, 1, Hq, 1, narrow);
    });
    std::vector<double> wkq_v, gkq, wp, gp, wo, go, wc, gc;
    for (i64 h = 0; h < Hq; ++h) {
        const i64 kh = h / (Hq / Hk);
        std::vector<double> lg(L);
        double mx = -INFINITY;
        bool row_nan = false;  // soft_max's rule: a NaN logit it admits makes the row NaN
        for (i64 j = 0; j < L; ++j) {
            const bool ok = valid_at(mode, mode == 3 ? h : 0, j);
            double s = 0;
            if (ok || wkq)
                for (i64 dd = 0; dd < D; ++dd) s += (double)q.get(h * D + dd) * kc.get(j * ld_kv + kh * D + dd);
            if (wkq) {
                wkq_v.push_back(s);
                gkq.push_back(kq.get(h * L + j));
            }
            lg[j] = ok ? s * scale : -INFINITY;
            if (std::isnan(lg[j])) row_nan = true;
            if (!row_nan) mx = std::max(mx, lg[j]);
        }
        double sum = 0;
        for (i64 j = 0; j < L; ++j) sum += mx == -INFINITY ? 0 : std::exp(lg[j] - mx);
        std::vector<double> pr(L);
        for (i64 j = 0; j < L; ++j) {
            pr[j] = row_nan ? NAN : mx == -INFINITY ? 0 : std::exp(lg[j] - mx) / sum;
            wp.push_back(pr[j]);
            gp.push_back(p.get(h * L + j));
        }
        for (i64 dd = 0; dd < D; ++dd) {
            double acc = row_nan ? NAN : 0;
            for (i64 j = 0; j < L && !row_nan; ++j)
                if (pr[j] != 0) acc += pr[j] * vc.get(j * ld_kv + kh * D + dd);
            wo.push_back(acc);
            go.push_back(o.get(h * D + dd));
            wc.push_back(rounded(cdt, o.get(h * D + dd)));
            gc.push_back(cp.get(dd * Hq + h));
        }
    }
    const std::string tag = "attn_decode kv " + std::to_string(kvdt) + " heads " + std::to_string(Hq) + "/" +
                            std::to_string(Hk) + " D " + std::to_string(D) + " scores " + std::to_string(wkq) +
                            " mode " + std::to_string(mode) + " pad " + std::to_string(pad) + " L " +
                            std::to_string(L) + " narrow " + std::to_string(narrow) + " nan_at " +
                            std::to_string(nan_at);
    if (wkq) check(tag + ": scores", wkq_v, gkq, 1e-10);
    check(tag + ": p", wp, gp, 1e-10);
    check(tag + ": o", wo, go, 1e-10);
    check(tag + ": copy", wc, gc, 0);
    // The short path (attn_fast), where the host would take it: the same o and copy.
    const int G2 = (int)(D / vw);
    if (narrow && kvec && vvec && D % vw == 0 && (G2 == 4 || G2 == 8 || G2 == 16 || G2 == 32)) {
        for (int write_o : {1, 0})
            for (int rehearse : {0, 1}) {
            const int write_p = write_o;  // both ways with and without p
            Buf o2(DT_F32, Hq * D), c2(DT_F32, Hq * D), kq2(DT_F32, Hq * L), p2(DT_F32, Hq * L);
            for (i64 i = 0; i < Hq * D; ++i) o2.set(i, 7.0f);
            // Rehearsing, it starts while q, the caches and the mask are garbage.
            Producer pr(rehearse ? std::vector<Buf*>{&q, &kc, &vc, &m} : std::vector<Buf*>{}, {&o2, &c2, &kq2, &p2});
            launch((unsigned)Hq, 256, [&] {
                attn_fast((int)L, (int)D, scale, (const float*)q.p(), (int)D, 1, kvdt, kc.p(), (int)D, (int)ld_kv,
                          (int)(Hq / Hk), vc.p(), (int)D, (int)ld_kv, (int)(Hq / Hk), (const float*)m.p(),
                          mode == 3 ? (int)L : 0, 1, 1, (float*)kq2.p(), (int)L, 1, wkq, (float*)p2.p(),
                          (int)L, 1, write_p, (float*)o2.p(), (int)D, 1, write_o,
                          (float*)c2.p(), 1, (int)Hq, 1, rehearse, 0);
            });
            std::vector<double> go2, gc2, wc2, wkeep, gkq2, gp2;
            for (i64 h = 0; h < Hq; ++h) {
                for (i64 dd = 0; dd < D; ++dd) {
                    go2.push_back(o2.get(h * D + dd));
                    gc2.push_back(c2.get(dd * Hq + h));
                }
                for (i64 j = 0; j < L; ++j) {
                    gkq2.push_back(kq2.get(h * L + j));
                    gp2.push_back(p2.get(h * L + j));
                }
            }
            const std::string t2 = "attn_fast" + tag.substr(11) + " write_o " + std::to_string(write_o) +
                                   " rehearse " + std::to_string(rehearse);
            pr.check(t2);
            check(t2 + ": copy", wo, gc2, 1e-10);
            if (wkq) check(t2 + ": scores", wkq_v, gkq2, 1e-10);
            if (write_p) check(t2 + ": p", wp, gp2, 1e-10);
            if (write_o) {
                check(t2 + ": o", wo, go2, 1e-10);
            } else {
                for (i64 i = 0; i < Hq * D; ++i) wkeep.push_back(7.0);
                check(t2 + ": o untouched", wkeep, go2, 0);
            }
        }
        // The listing path (attn_fast_long; the host takes it for windows past one chunk with
        // neither scores nor p written): the same o and copy, and it never writes scores or p
        // even when asked (its contract), nor reads a masked row (poisoned above).
        // With mask_ahead (the mask is no running kernel's output), the real pass takes the
        // rehearsal's listing: the producer then swaps q and the caches only.
        for (int write_o : {1, 0})
            for (int rehearse : {0, 1, 2})
            for (int mask_ahead : {0, 1}) {
                if (mask_ahead && !rehearse) continue;
                Buf o3(DT_F32, Hq * D), c3(DT_F32, Hq * D), kq3(DT_F32, Hq * L), p3(DT_F32, Hq * L);
                for (i64 i = 0; i < Hq * D; ++i) o3.set(i, 7.0f);
                for (i64 i = 0; i < Hq * L; ++i) {
                    kq3.set(i, NAN);
                    p3.set(i, NAN);
                }
                Producer pr(!rehearse ? std::vector<Buf*>{}
                            : mask_ahead ? std::vector<Buf*>{&q, &kc, &vc}
                                         : std::vector<Buf*>{&q, &kc, &vc, &m},
                            {&o3, &c3, &kq3, &p3});
                launch((unsigned)Hq, 256, [&] {
                    attn_fast_long((int)L, (int)D, scale, (const float*)q.p(), (int)D, 1, kvdt, kc.p(), (int)D,
                                   (int)ld_kv, (int)(Hq / Hk), vc.p(), (int)D, (int)ld_kv, (int)(Hq / Hk),
                                   (const float*)m.p(), mode == 3 ? (int)L : 0, 1, 1, (float*)kq3.p(), (int)L, 1, 1,
                                   (float*)p3.p(), (int)L, 1, 1, (float*)o3.p(), (int)D, 1, write_o,
                                   (float*)c3.p(), 1, (int)Hq, 1, rehearse, mask_ahead);
                });
                std::vector<double> go3, gc3, wkeep, untouched, gkp;
                for (i64 h = 0; h < Hq; ++h)
                    for (i64 dd = 0; dd < D; ++dd) {
                        go3.push_back(o3.get(h * D + dd));
                        gc3.push_back(c3.get(dd * Hq + h));
                        wkeep.push_back(7.0);
                    }
                for (i64 i = 0; i < Hq * L; ++i) {
                    untouched.push_back(std::isnan(kq3.get(i)) && std::isnan(p3.get(i)) ? 1.0 : 0.0);
                    gkp.push_back(1.0);
                }
                const std::string t3 = "attn_fast_long" + tag.substr(11) + " write_o " + std::to_string(write_o) +
                                       " rehearse " + std::to_string(rehearse) + " mask_ahead " +
                                       std::to_string(mask_ahead);
                pr.check(t3);
                check(t3 + ": copy", wo, gc3, 1e-10);
                check(t3 + (write_o ? ": o" : ": o untouched"), write_o ? wo : wkeep, go3, write_o ? 1e-10 : 0);
                check(t3 + ": scores and p untouched", gkp, untouched, 0);
            }
    }
}

void test_attention() {
    const std::array<i64, 3> shapes[] = {{8, 2, 64}, {4, 4, 128}, {6, 3, 80}, {2, 1, 256}, {3, 3, 20}};
    for (int kvdt : {DT_F32, DT_F16, DT_BF16})
        for (const auto& s : shapes) {
            for (int mode = 0; mode < 5; ++mode)
                attention_case(kvdt, s[0], s[1], s[2], 0, mode, 0, 100, (mode + kvdt) % 2);
            attention_case(kvdt, s[0], s[1], s[2], 1, 0, 0, 100, 1);    // scores written
            attention_case(kvdt, s[0], s[1], s[2], 1, 0, 0, 100, 0);
            attention_case(kvdt, s[0], s[1], s[2], 0, 0, 1, 100, 1);    // unaligned rows
            attention_case(kvdt, s[0], s[1], s[2], 0, 4, 0, 600, 1);    // three chunks
            attention_case(kvdt, s[0], s[1], s[2], 0, 4, 0, 600, 0);
            attention_case(kvdt, s[0], s[1], s[2], 1, 1, 1, 600, 1);    // ... scores, unaligned
        }
    // Past one listing (2048 keys): sparse, dense (several chunks of valid keys per listing),
    // per-head masks, and none valid.
    for (int mode : {4, 1, 3, 2}) attention_case(DT_F16, 8, 2, 64, 0, mode, 0, 2500, 1);
    attention_case(DT_F32, 4, 4, 128, 0, 0, 0, 2049, 1);
}

// Issue 29.8: a NaN the mask admits turns its head's rows NaN, as soft_max does.
void test_attention_nan() {
    // NaN through the online softmax, on every path: one chunk (attn_fast's speculative
    // window), three chunks with the NaN in the last (the rescaled running sums; raw scores
    // written), and past one listing (attn_fast_long).
    for (int nan_at : {1, 2, 3})
        for (int mode : {0, 1, 3, 4}) {
            attention_case(DT_F16, 8, 2, 64, 0, mode, 0, 100, 1, nan_at);
            attention_case(DT_F32, 8, 2, 64, 0, mode, 0, 100, 0, nan_at);
            attention_case(DT_F16, 6, 3, 80, 1, mode, 0, 600, 1, nan_at);
            attention_case(DT_BF16, 8, 2, 64, 0, mode, 0, 600, 1, nan_at);
        }
    for (int nan_at : {1, 2, 3}) attention_case(DT_F16, 8, 2, 64, 0, 4, 0, 2500, 1, nan_at);
}

// Split-decode masks (attn_split): 0 a causal prefix of 600 (the bench's depth), 1 every fifth
// key masked up to 1500, 2 a prefix per head — none, 300, 257, all (fully masked heads beside
// split ones), 3 every key masked, 4 every key valid, 5 a prefix of 100 (one chunk: the single
// block path inside the split grid).
bool split_valid(int mode, i64 h, i64 j, i64 L) {
    switch (mode) {
        case 0: return j < 600;
        case 1: return j % 5 != 2 && j < 1500;
        case 2: {
            const i64 v[4] = {0, 300, 257, L};
            return j < v[h % 4];
        }
        case 3: return false;
        case 4: return true;
        default: return j < 100;
    }
}

// attn_split with `nsplit` chunks per head against float64 and against attn_fast_long (one
// block per head) on q [Hq, D] f32, K/V caches [L, Hk * D] of dtype kvdt, a mask [L] (or
// [Hq, L] in mode 2), o [Hq, D] and its copy [D, Hq]. Masked rows of a shared mask are NaN
// (never read). `nan_at` as attention_case: 1 a NaN in kv head 0's K row at the last valid
// key, 2 in q of the last head, 3 in kv head 0's V row there. The split's o must not depend
// on which block of a head finishes last (blocks run ascending, descending and shuffled, bit
// for bit), its tickets are all 0 after every launch, and rehearsing (with and without the
// rehearsal's listing reused) stores nothing before the wait. Without `full` (the emulation is
// slow: a thread per CUDA thread), only ascending blocks and the reused listing run.
void split_case(int kvdt, i64 Hq, i64 Hk, i64 D, i64 L, int mode, int nsplit, int nan_at = 0,
                bool full = false) {
    const i64 ld_kv = Hk * D;
    Buf kc(kvdt, L * ld_kv), vc(kvdt, L * ld_kv), q(DT_F32, Hq * D);
    kc.rand();
    vc.rand();
    q.rand();
    const i64 mh = mode == 2 ? Hq : 1;
    Buf m(DT_F32, mh * L);
    for (i64 h = 0; h < mh; ++h)
        for (i64 j = 0; j < L; ++j) m.set(h * L + j, split_valid(mode, h, j, L) ? 0.0f : -INFINITY);
    if (mode != 2) {
        for (i64 j = 0; j < L; ++j)
            if (!split_valid(mode, 0, j, L))
                for (i64 c = 0; c < ld_kv; ++c) {
                    kc.set(j * ld_kv + c, NAN);
                    vc.set(j * ld_kv + c, NAN);
                }
    }
    i64 jn = L - 1;
    while (jn > 0 && !split_valid(mode, mode == 2 ? 1 : 0, jn, L)) --jn;
    if (nan_at == 1) kc.set(jn * ld_kv + D - 1, NAN);
    if (nan_at == 2) q.set((Hq - 1) * D + D / 2, NAN);
    if (nan_at == 3) vc.set(jn * ld_kv, NAN);
    const float scale = 1.0f / std::sqrt((float)D);
    // float64 reference (soft_max's NaN rule: a NaN logit the mask admits makes the row NaN).
    std::vector<double> want;
    for (i64 h = 0; h < Hq; ++h) {
        const i64 kh = h / (Hq / Hk);
        std::vector<double> lg(L);
        double mx = -INFINITY;
        bool row_nan = false;
        for (i64 j = 0; j < L; ++j) {
            const bool ok = split_valid(mode, h, j, L);
            double sdot = 0;
            if (ok)
                for (i64 dd = 0; dd < D; ++dd) sdot += (double)q.get(h * D + dd) * kc.get(j * ld_kv + kh * D + dd);
            lg[j] = ok ? sdot * scale : -INFINITY;
            if (std::isnan(lg[j])) row_nan = true;
            if (!row_nan) mx = std::max(mx, lg[j]);
        }
        double sum = 0;
        for (i64 j = 0; j < L; ++j) sum += mx == -INFINITY ? 0 : std::exp(lg[j] - mx);
        for (i64 dd = 0; dd < D; ++dd) {
            double acc = row_nan ? NAN : 0;
            for (i64 j = 0; j < L && !row_nan; ++j)
                if (lg[j] != -INFINITY) acc += std::exp(lg[j] - mx) / sum * vc.get(j * ld_kv + kh * D + dd);
            want.push_back(acc);
        }
    }
    const std::string tag = "attn_split kv " + std::to_string(kvdt) + " heads " + std::to_string(Hq) + "/" +
                            std::to_string(Hk) + " D " + std::to_string(D) + " L " + std::to_string(L) + " mode " +
                            std::to_string(mode) + " nsplit " + std::to_string(nsplit) + " nan_at " +
                            std::to_string(nan_at);
    auto gather = [&](const Buf& o, const Buf& c, std::vector<double>& go, std::vector<double>& gc) {
        go.clear();
        gc.clear();
        for (i64 h = 0; h < Hq; ++h)
            for (i64 dd = 0; dd < D; ++dd) {
                go.push_back(o.get(h * D + dd));
                gc.push_back(c.get(dd * Hq + h));
            }
    };
    // The single block per head.
    Buf o1(DT_F32, Hq * D), c1(DT_F32, Hq * D);
    launch((unsigned)Hq, 256, [&] {
        attn_fast_long((int)L, (int)D, scale, (const float*)q.p(), (int)D, 1, kvdt, kc.p(), (int)D, (int)ld_kv,
                       (int)(Hq / Hk), vc.p(), (int)D, (int)ld_kv, (int)(Hq / Hk), (const float*)m.p(),
                       mode == 2 ? (int)L : 0, 1, 1, nullptr, (int)L, 1, 0, nullptr, (int)L, 1, 0,
                       (float*)o1.p(), (int)D, 1, 1, (float*)c1.p(), 1, (int)Hq, 1, 0, 0);
    });
    std::vector<double> go1, gc1;
    gather(o1, c1, go1, gc1);
    check(tag + ": attn_fast_long o", want, go1, 1e-10);
    const unsigned grid = (unsigned)(Hq * nsplit);
    std::vector<unsigned> orders[3];
    for (unsigned b = 0; b < grid; ++b) {
        orders[1].push_back(grid - 1 - b);
        orders[2].push_back(b);
    }
    std::shuffle(orders[2].begin(), orders[2].end(), rng);
    std::vector<double> first;
    for (int variant = 0; variant < 6; ++variant) {
        if (!full && variant != 0 && variant < 4) continue;
        // 0-2: block orders; 3: rehearsing; 4: rehearsing with the listing reused (mask_ahead);
        // 5: as 4, the rehearsal stopping after the listing (rehearse 2).
        const int order = variant < 3 ? variant : 0;
        const int rehearse = variant == 5 ? 2 : variant >= 3, mask_ahead = variant >= 4;
        std::vector<float> part((size_t)grid * AF_PW, 7.0f);
        std::vector<unsigned> ticket((size_t)Hq, 0u);
        Buf o(DT_F32, Hq * D), c(DT_F32, Hq * D);
        Producer pr(!rehearse ? std::vector<Buf*>{}
                    : mask_ahead ? std::vector<Buf*>{&q, &kc, &vc}
                                 : std::vector<Buf*>{&q, &kc, &vc, &m},
                    {&o, &c});
        emu_block_order = orders[order];
        launch(grid, 256, [&] {
            attn_split((int)L, (int)D, scale, (const float*)q.p(), (int)D, 1, kvdt, kc.p(), (int)D, (int)ld_kv,
                       (int)(Hq / Hk), vc.p(), (int)D, (int)ld_kv, (int)(Hq / Hk), (const float*)m.p(),
                       mode == 2 ? (int)L : 0, 1, 1, nullptr, (int)L, 1, 0, nullptr, (int)L, 1, 0,
                       (float*)o.p(), (int)D, 1, 1, (float*)c.p(), 1, (int)Hq, 1, rehearse, mask_ahead, nsplit,
                       part.data(), ticket.data());
        });
        emu_block_order.clear();
        const std::string t = tag + " variant " + std::to_string(variant);
        if (rehearse) pr.check(t);
        std::vector<double> go, gc;
        gather(o, c, go, gc);
        check(t + ": o", want, go, 1e-10);
        check(t + ": copy", want, gc, 1e-10);
        check(t + ": o against attn_fast_long", go1, go, 1e-11);
        if (variant == 0) {
            first = go;
        } else {
            check(t + ": o bit for bit against ascending blocks", first, go, 0);
            for (size_t i = 0; i < go.size(); ++i)
                if (std::isnan(go[i]) != std::isnan(first[i]) || (!std::isnan(go[i]) && go[i] != first[i])) {
                    ++fails;
                    printf("FAIL %s: o[%zu] differs from the ascending run's\n", t.c_str(), i);
                    break;
                }
        }
        for (i64 h = 0; h < Hq; ++h)
            if (ticket[h] != 0) {
                ++fails;
                printf("FAIL %s: head %lld's ticket is %u after the launch\n", t.c_str(), (long long)h, ticket[h]);
            }
    }
}

void test_attention_split() {
    // Lengths not multiples of a chunk, GQA, f32 and f16 caches, head sizes 64 and 128 (2 to
    // 32 lanes per key), and a window past one listing (chunk 0 takes it alone).
    for (int kvdt : {DT_F16, DT_F32})
        for (int mode = 0; mode < 6; ++mode) split_case(kvdt, 4, 2, 64, 777, mode, 4);
    split_case(DT_F16, 4, 2, 64, 640, 0, 4, 0, true);
    split_case(DT_BF16, 6, 3, 64, 1001, 2, 5, 0, true);
    split_case(DT_F16, 2, 2, 128, 2048, 1, 7);
    split_case(DT_F32, 2, 1, 128, 1000, 4, 3);
    split_case(DT_F16, 2, 1, 64, 2500, 4, 3);
    // More chunks than the merge loads at once (AF_MC): its loop over the partials.
    split_case(DT_F16, 2, 1, 64, 3000, 0, 12);
    split_case(DT_F16, 2, 1, 64, 3000, 2, 12, 2);
    // NaN through the partials and the merge: in one chunk of several, and in a single chunk.
    for (int nan_at : {1, 2, 3})
        for (int mode : {0, 2}) split_case(DT_F16, 4, 2, 64, 700, mode, 4, nan_at);
    split_case(DT_F32, 4, 2, 64, 700, 5, 3, 1);
}

// Prefill mask modes over NQ query rows after P cached positions (query i sits at P + i):
// 0 causal (key j admitted when j <= P + i); 1 causal with holes (every 7th key) and rows
// 3, 11, 19, ... fully masked (-inf rows: zeros); 2 every key of the window; 3 causal with a
// per-head offset (head h admits j <= P + i - 3 h: rows with nothing admitted at the top);
// 4 causal with finite additive entries (a per-(query, key) bias, as ALiBi's).
float prefill_mask(int mode, i64 h, i64 i, i64 j, i64 P) {
    const bool causal = j <= P + i;
    switch (mode) {
        case 0: return causal ? 0.0f : -INFINITY;
        case 1: return causal && j % 7 != 4 && i % 8 != 3 ? 0.0f : -INFINITY;
        case 2: return 0.0f;
        case 3: return j <= P + i - 3 * h ? 0.0f : -INFINITY;
        default: return causal ? -0.05f * (float)((P + i - j) % 9) : -INFINITY;
    }
}

// attn_prefill on q [NQ, Hq, D] (f32, seen as [Hq, NQ, D]), K/V caches [L, Hk * D + pad] of
// dtype kvdt, a mask [NQ, L] (or [Hq, NQ, L] in mode 3), o [Hq, NQ, D] and the copy
// [NQ, Hq, D] (cdt), against float64. Cache rows no query admits are NaN (never read).
// `over_q`: the copy is written over q itself (same layout, f32), as the host allows.
// `nan_at`: 1 a NaN in kv head 0's K row at key P (admitted by every row of modes 0, 2, 4):
// those heads' rows NaN; 2 a NaN in q of row 3 of the last head: that row NaN; 3 a NaN in kv
// head 0's V row at key P + 5, dim 0: that column of the rows admitting it.
void prefill_case(int kvdt, i64 Hq, i64 Hk, i64 D, i64 NQ, i64 P, i64 extra, int mode, i64 pad, int cdt,
                  int write_o, int over_q = 0, int nan_at = 0) {
    const i64 L = P + NQ + extra, ld_kv = Hk * D + pad;
    Buf kc(kvdt, L * ld_kv), vc(kvdt, L * ld_kv), q(DT_F32, NQ * Hq * D);
    kc.rand();
    vc.rand();
    q.rand();
    const i64 mh = mode == 3 ? Hq : 1;
    Buf m(DT_F32, mh * NQ * L);
    for (i64 h = 0; h < mh; ++h)
        for (i64 i = 0; i < NQ; ++i)
            for (i64 j = 0; j < L; ++j) m.set((h * NQ + i) * L + j, prefill_mask(mode, h, i, j, P));
    auto admitted = [&](i64 h, i64 i, i64 j) { return m.get(((mode == 3 ? h : 0) * NQ + i) * L + j) != -INFINITY; };
    for (i64 j = 0; j < L; ++j) {
        bool any = false;
        for (i64 h = 0; h < Hq; ++h)
            for (i64 i = 0; i < NQ; ++i) any = any || admitted(h, i, j);
        if (!any)
            for (i64 cc = 0; cc < Hk * D; ++cc) {
                kc.set(j * ld_kv + cc, NAN);
                vc.set(j * ld_kv + cc, NAN);
            }
    }
    if (nan_at == 1) kc.set(P * ld_kv + D - 1, NAN);
    if (nan_at == 2) q.set(3 * Hq * D + (Hq - 1) * D + D / 2, NAN);
    if (nan_at == 3) vc.set((P + 5) * ld_kv, NAN);
    Buf q_in(DT_F32, NQ * Hq * D);
    memcpy(q_in.p(), q.p(), NQ * Hq * D * 4);
    const int cd = over_q ? DT_F32 : cdt;
    Buf o(DT_F32, Hq * NQ * D), cpb(cd, NQ * Hq * D);
    for (i64 x = 0; x < Hq * NQ * D; ++x) o.set(x, 7.0f);
    void* cp = over_q ? q.p() : cpb.p();
    const float scale = 1.0f / std::sqrt((float)D);
    const unsigned grid = (unsigned)(Hq * ((NQ + AP_Q - 1) / AP_Q));
    // 16-byte K/V loads where the host would take them (every row and head start aligned).
    const int e = esz(kvdt), vw = 16 / e;
    const int kvec = D % vw == 0 && (ld_kv * e) % 16 == 0 && (Hk == 1 || (D * e) % 16 == 0);
    launch(grid, AP_T, [&] {
        attn_prefill(L, NQ, D, scale, q.p(), DT_F32, D, Hq * D, 1, kvdt, kc.p(), D, ld_kv, Hq / Hk, vc.p(), D,
                     ld_kv, Hq / Hk, kvec, m.p(), DT_F32, mode == 3 ? NQ * L : 0, L, 1, 1, (float*)o.p(), NQ * D, D,
                     1, write_o, cp, cd, D, Hq * D, 1, 1);
    });
    std::vector<double> wo, go, wc, gc, keep;
    for (i64 h = 0; h < Hq; ++h) {
        const i64 kh = h / (Hq / Hk);
        for (i64 i = 0; i < NQ; ++i) {
            std::vector<double> lg(L);
            double mx = -INFINITY;
            bool row_nan = false;
            for (i64 j = 0; j < L; ++j) {
                lg[j] = -INFINITY;
                if (!admitted(h, i, j)) continue;
                double s = 0;
                for (i64 dd = 0; dd < D; ++dd)
                    s += (double)q_in.get((i * Hq + h) * D + dd) * kc.get(j * ld_kv + kh * D + dd);
                lg[j] = s * scale + m.get(((mode == 3 ? h : 0) * NQ + i) * L + j);
                if (std::isnan(lg[j])) row_nan = true;
                if (!row_nan) mx = std::max(mx, lg[j]);
            }
            double sum = 0;
            for (i64 j = 0; j < L; ++j) sum += mx == -INFINITY ? 0 : std::exp(lg[j] - mx);
            for (i64 dd = 0; dd < D; ++dd) {
                double acc = row_nan ? NAN : 0;
                for (i64 j = 0; j < L && !row_nan && mx != -INFINITY; ++j) {
                    const double pj = std::exp(lg[j] - mx) / sum;
                    if (pj != 0) acc += pj * vc.get(j * ld_kv + kh * D + dd);
                }
                const float got_o = o.get((h * NQ + i) * D + dd);
                wo.push_back(write_o ? acc : 7.0);
                go.push_back(got_o);
                wc.push_back(acc);
                gc.push_back(over_q ? q.get((i * Hq + h) * D + dd) : cpb.get((i * Hq + h) * D + dd));
                if (write_o) {
                    keep.push_back(rounded(cd, got_o));
                }
            }
        }
    }
    const std::string tag = "attn_prefill kv " + std::to_string(kvdt) + " heads " + std::to_string(Hq) + "/" +
                            std::to_string(Hk) + " D " + std::to_string(D) + " NQ " + std::to_string(NQ) + " P " +
                            std::to_string(P) + " L " + std::to_string(L) + " mode " + std::to_string(mode) +
                            " pad " + std::to_string(pad) + " cdt " + std::to_string(cd) + " write_o " +
                            std::to_string(write_o) + " over_q " + std::to_string(over_q) + " nan_at " +
                            std::to_string(nan_at) + " kvec " + std::to_string(kvec);
    check(tag + (write_o ? ": o" : ": o untouched"), wo, go, write_o ? 1e-10 : 0);
    check(tag + ": copy", wc, gc, cd == DT_F32 ? 1e-10 : 1e-6);
    // The copy is o rounded to its dtype, element for element.
    if (write_o) check(tag + ": copy is o", keep, gc, 0);
}

void test_attention_prefill() {
    const std::array<i64, 3> shapes[] = {{8, 2, 64}, {4, 4, 128}, {6, 3, 80}, {3, 3, 20}};
    for (int kvdt : {DT_F32, DT_F16, DT_BF16})
        for (const auto& s : shapes) {
            for (int mode = 0; mode < 5; ++mode)
                prefill_case(kvdt, s[0], s[1], s[2], 37, 13, 7, mode, 0, DT_F32, (mode + kvdt) % 2);
            prefill_case(kvdt, s[0], s[1], s[2], 16, 0, 0, 0, 0, DT_F16, 1);    // whole tiles, no past
            prefill_case(kvdt, s[0], s[1], s[2], 50, 70, 3, 1, 1, DT_F32, 1);   // unaligned rows
            prefill_case(kvdt, s[0], s[1], s[2], 1, 40, 9, 4, 0, DT_F32, 1);    // one query row
            prefill_case(kvdt, s[0], s[1], s[2], 33, 5, 30, 0, 0, DT_F32, 0, 1);  // copy over q
        }
}

// A NaN the mask admits makes the rows that admit it NaN (soft_max's rule); one it excludes
// (the poisoned rows) reaches nothing.
void test_attention_prefill_nan() {
    for (int nan_at : {1, 2, 3})
        for (int mode : {0, 2, 4}) {
            prefill_case(DT_F16, 8, 2, 64, 37, 13, 7, mode, 0, DT_F32, 1, 0, nan_at);
            prefill_case(DT_F32, 6, 3, 80, 40, 0, 5, mode, 0, DT_F16, 1, 0, nan_at);
        }
}

// One row per block: rows of `len` contiguous values, the destination's rows `d_rs` apart.
Lay rows_lay(i64 rows, i64 len, i64 d_rs) {
    Lay L{};
    L.nd = 1;
    L.shape[0] = rows;
    L.st[0][0] = d_rs;
    L.st[1][0] = len;
    L.st[2][0] = 0;  // soft_max's mask: one row for all
    return L;
}

// soft_max, and soft_max_rows (a warp per row, rows up to 1024; the host's grid: 8 rows per
// block of 256) with one block fewer than the rows need, so warps take a second row.
void test_soft_max() {
    for (int warp_rows : {0, 1})
    for (int has_mask : {0, 1})
        for (i64 len : {7, 300, 1024, 4100}) {
            if (warp_rows && len > 1024) continue;
            const i64 rows = 19;
            Buf x(DT_F32, rows * len), mask(DT_F32, len), d(DT_F32, rows * len);
            x.rand(4);
            for (i64 c = 0; c < len; ++c) mask.set(c, c % 5 == 1 ? -INFINITY : rnd(1));
            if (warp_rows) {
                launch((unsigned)((rows + 7) / 8 - 1), 256, [&] {
                    soft_max_rows(rows, len, rows_lay(rows, len, len), d.p(), DT_F32, 1, x.p(), DT_F32, 1, mask.p(),
                                  DT_F32, 1, has_mask, 0.5f);
                });
            } else {
                launch(rows, 256, [&] {
                    soft_max(rows, len, rows_lay(rows, len, len), d.p(), DT_F32, 1, x.p(), DT_F32, 1, mask.p(), DT_F32, 1,
                             has_mask, 0.5f);
                });
            }
            std::vector<double> want, got;
            for (i64 r = 0; r < rows; ++r) {
                std::vector<double> v(len);
                double mx = -INFINITY, sum = 0;
                for (i64 c = 0; c < len; ++c) {
                    v[c] = x.get(r * len + c) * 0.5 + (has_mask ? mask.get(c) : 0.0);
                    mx = std::max(mx, v[c]);
                }
                for (i64 c = 0; c < len; ++c) sum += std::exp(v[c] - mx);
                for (i64 c = 0; c < len; ++c) {
                    want.push_back(std::exp(v[c] - mx) / sum);
                    got.push_back(d.get(r * len + c));
                }
            }
            check(std::string(warp_rows ? "soft_max_rows" : "soft_max") + " mask " + std::to_string(has_mask) + " len " +
                      std::to_string(len),
                  want, got, 1e-10);
        }
    // soft_max_rows: a row holding a NaN is all NaN, a fully masked row all zeros, next to a
    // normal row.
    const i64 len = 40;
    Buf x(DT_F32, 3 * len), mask(DT_F32, 3 * len), d(DT_F32, 3 * len);
    x.rand(5);
    for (i64 i = 0; i < 3 * len; ++i) mask.set(i, i >= 2 * len ? -INFINITY : 0.0f);
    x.set(len + 33, NAN);
    Lay L = rows_lay(3, len, len);
    L.st[2][0] = len;  // a mask row per row
    launch(1, 256, [&] {
        soft_max_rows(3, len, L, d.p(), DT_F32, 1, x.p(), DT_F32, 1, mask.p(), DT_F32, 1, 1, 1.0f);
    });
    double sum0 = 0;
    int bad = 0;
    for (i64 c = 0; c < len; ++c) {
        sum0 += d.get(c);
        bad += !std::isnan(d.get(len + c)) + (d.get(2 * len + c) != 0.0f);
    }
    if (bad || std::fabs(sum0 - 1.0) > 1e-5) {
        printf("FAIL soft_max_rows special rows: %d wrong, normal row sums to %g\n", bad, sum0);
        ++fails;
    }
}

// The largest value's index, the lowest on ties, NaN below every number, an all-NaN row 0.
void test_argmax() {
    for (int xdt : {DT_F16, DT_F32})
    for (i64 len : {7, 1000, 32000, 32003, 100000})  // 32003: a tail, and row 1 unaligned
        for (int kind = 0; kind < 4; ++kind) {
            const i64 rows = 2;
            Buf x(xdt, rows * len), d(DT_I32, rows);
            x.rand(8);
            std::vector<int> want(rows);
            for (i64 r = 0; r < rows; ++r) {
                if (kind == 1) {  // ties: the maximum at two places
                    x.set(r * len + len / 3, 100.0f);
                    x.set(r * len + len - 1, 100.0f);
                }
                if (kind == 2) {  // NaNs around the maximum
                    for (i64 c = 0; c < len; c += 3) x.set(r * len + c, NAN);
                }
                if (kind == 3) {  // all NaN
                    for (i64 c = 0; c < len; ++c) x.set(r * len + c, NAN);
                }
                i64 best = -1;
                for (i64 c = 0; c < len; ++c) {
                    const float v = x.get(r * len + c);
                    if (v == v && (best < 0 || v > x.get(r * len + best))) best = c;
                }
                want[r] = best < 0 ? 0 : (int)best;
            }
            // The backend's block: 1024 threads for rows of 8192 values or more, else 256.
            launch(rows, len >= 8192 ? 1024 : 256, [&] { argmax(rows, len, rows_lay(rows, len, 1), (int*)d.p(), x.p(), xdt, 1); });
            for (i64 r = 0; r < rows; ++r) {
                const int got = ((int*)d.p())[r];
                if (got != want[r]) {
                    ++fails;
                    printf("FAIL argmax dtype %d len %lld kind %d row %lld: %d, want %d\n", xdt, (long long)len,
                           kind, (long long)r, got, want[r]);
                }
            }
        }
}

}  // namespace

// small_copy at each alignment path, and copy_batch: host bytes in its parameter (16-byte
// aligned and odd), a device copy reading what an earlier copy of the batch wrote (order), and
// nothing past `n` run.
void test_copies() {
    std::vector<unsigned char> src(4096), dst(4096, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = (unsigned char)(i * 13 + 5);
    for (auto [off, len] : {std::pair<int, int>{0, 512}, {64, 12}, {3, 7}}) {
        std::fill(dst.begin(), dst.end(), 0);
        launch(1, 128, [&] { small_copy((u64)(dst.data() + off), (u64)(src.data() + off), len); });
        bool ok = std::equal(src.begin() + off, src.begin() + off + len, dst.begin() + off) &&
                  std::all_of(dst.begin() + off + len, dst.end(), [](unsigned char c) { return c == 0; });
        if (!ok) {
            printf("FAIL small_copy %d bytes at %d\n", len, off);
            ++fails;
        }
    }
    CopyBatch b{};
    std::vector<unsigned char> a(256, 0), c(256, 0), d(256, 0);
    for (int i = 0; i < 48; ++i) b.data[i] = (unsigned char)(200 - i);
    for (int i = 0; i < 7; ++i) b.data[48 + i] = (unsigned char)(i + 1);
    b.items[0] = BatchItem{(u64)a.data(), 0, 48, 0};         // host bytes, 16-byte path
    b.items[1] = BatchItem{(u64)(c.data() + 3), 0, 7, 48};   // host bytes, odd
    b.items[2] = BatchItem{(u64)d.data(), (u64)a.data(), 48, 0};  // reads item 0's result
    b.items[3] = BatchItem{(u64)d.data(), (u64)src.data(), 200, 0};  // past n: must not run
    b.n = 3;
    launch(1, 128, [&] { copy_batch(b); });
    bool ok = true;
    for (int i = 0; i < 48; ++i) ok &= a[i] == 200 - i && d[i] == 200 - i;
    for (int i = 0; i < 7; ++i) ok &= c[3 + i] == i + 1;
    ok &= c[2] == 0 && c[10] == 0 && a[48] == 0 && d[48] == 0;
    if (!ok) {
        printf("FAIL copy_batch\n");
        ++fails;
    }
}

// The sampler (kernels/sample.cu) against lowsync_graph::sampling's answers: the cases are
// written by crates/backend-cuda/tests/sample.rs into sample_cases.txt (rows by a generator both
// sides share, checked here by hash), tokens and penalized rows must match exactly. Rows are
// read through a padded row stride and the settings through a transposed layout, with the
// block size each case names.
namespace smp {

u32 xs_next(u32& s) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return s;
}

// tests/sample.rs `emu_row`.
std::vector<float> row(u32 gen, i64 v, int kind, int scale) {
    u32 s = (gen * 0x9E3779B9u) | 1u;
    const float unit = __uint_as_float((u32)(127 + scale - 23) << 23);
    const float top = __uint_as_float((u32)(127 + scale) << 23);
    std::vector<float> x(v);
    for (i64 i = 0; i < v; ++i) {
        float y = (float)((int)(xs_next(s) >> 8) - (1 << 23)) * unit;
        if ((kind == 1 && i % 3 == 1) || kind == 2) y = NAN;
        else if (kind == 3 || (kind == 4 && i % 4 == 0)) y = -INFINITY;
        else if (kind == 5 && i == v / 2) y = INFINITY;
        else if (kind == 6 && (i == v / 3 || i == v - 1)) y = top;
        else if (kind == 7) y = 1.0f;
        else if (kind == 8 && i % 5 == 0) y = 0.0f;
        else if (kind == 8 && i % 5 == 1) y = -0.0f;
        else if (kind == 8 && i % 7 == 3) y = NAN;
        x[i] = y;
    }
    return x;
}

// tests/sample.rs `emu_hist`.
std::vector<int> hist(u32 gen, i64 v, i64 n) {
    u32 s = ((gen ^ 0xA5A5A5A5u) * 0x9E3779B9u) | 1u;
    std::vector<int> h(n);
    for (i64 i = 0; i < n; ++i) h[i] = (int)(xs_next(s) % (u32)(v + 4)) - 2;
    return h;
}

// tests/sample.rs `row_hash`.
u32 hash(const float* x, i64 n, i64 stride) {
    u32 h = 0x811c9dc5u;
    for (i64 i = 0; i < n; ++i) {
        const float v = x[i * stride];
        h = (h ^ (v != v ? 0x7fc00000u : __float_as_uint(v))) * 0x01000193u;
    }
    return h;
}

void philox_known_answers() {
    struct Kat {
        uint4 c;
        u32 k0, k1;
        uint4 want;
    } kats[] = {
        {{0, 0, 0, 0}, 0, 0, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{~0u, ~0u, ~0u, ~0u}, ~0u, ~0u, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
         0xa4093822,
         0x299f31d0,
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (const Kat& k : kats) {
        const uint4 g = philox4x32_10(k.c, k.k0, k.k1);
        if (g.x != k.want.x || g.y != k.want.y || g.z != k.want.z || g.w != k.want.w) {
            ++fails;
            printf("FAIL philox4x32_10 known answer: %08x %08x %08x %08x\n", g.x, g.y, g.z, g.w);
        }
    }
}

}  // namespace smp

void test_sample(const std::string& dir) {
    smp::philox_known_answers();
    const std::string path = dir + "/sample_cases.txt";
    FILE* f = fopen(path.c_str(), "r");
    if (!f) {
        ++fails;
        printf("FAIL sampler: cannot read %s\n", path.c_str());
        return;
    }
    char line[512];
    int launches = 0, rows_seen = 0;
    while (fgets(line, sizeof line, f)) {
        long long v, a, b;
        int kind, scale, n;
        unsigned block;
        if (sscanf(line, "sample %lld %d %d %u %d", &v, &kind, &scale, &block, &n) == 5) {
            const i64 pad = 3, xs = v + pad;
            std::vector<float> x(n * xs, INFINITY), prm(4 * n);
            std::vector<int> key(2 * n), want(n), dst(n, 12345);
            std::vector<u32> gens(n), sums(n);
            for (int r = 0; r < n; ++r) {
                u32 g, p[4], seed, ctr, h;
                int tok;
                if (!fgets(line, sizeof line, f) ||
                    sscanf(line, "%x %x %x %x %x %x %x %d %x", &g, &p[0], &p[1], &p[2], &p[3], &seed, &ctr,
                           &tok, &h) != 9) {
                    ++fails;
                    printf("FAIL sampler: bad row line in %s\n", path.c_str());
                    fclose(f);
                    return;
                }
                const std::vector<float> xr = smp::row(g, v, kind, scale);
                std::copy(xr.begin(), xr.end(), x.begin() + r * xs);
                if (smp::hash(xr.data(), v, 1) != h) {
                    ++fails;
                    printf("FAIL sampler: row generator differs from tests/sample.rs (gen %x)\n", g);
                }
                for (int c = 0; c < 4; ++c) prm[c * n + r] = __uint_as_float(p[c]);  // transposed
                key[2 * r] = (int)seed;
                key[2 * r + 1] = (int)ctr;
                want[r] = tok;
                gens[r] = g;
            }
            ++launches;
            launch(n, block, [&] {
                sample(n, v, dst.data(), 1, x.data(), xs, 1, prm.data(), 1, n, key.data(), 2, 1);
            });
            for (int r = 0; r < n; ++r) {
                ++rows_seen;
                if (dst[r] != want[r]) {
                    ++fails;
                    printf("FAIL sample V %lld kind %d scale %d block %u row gen %x: %d, want %d\n", v, kind,
                           scale, block, gens[r], dst[r], want[r]);
                }
            }
        } else if (sscanf(line, "penalize %lld %lld %u %d", &a, &b, &block, &n) == 4) {
            const i64 vv = a, nh = b;
            std::vector<float> x(n * vv), prm(3 * n), out(n * vv, NAN);
            std::vector<int> h(std::max<i64>(1, n * nh));
            std::vector<u32> want(n), gens(n);
            for (int r = 0; r < n; ++r) {
                u32 g, p[3], hv;
                if (!fgets(line, sizeof line, f) ||
                    sscanf(line, "%x %x %x %x %x", &g, &p[0], &p[1], &p[2], &hv) != 5) {
                    ++fails;
                    printf("FAIL penalize: bad row line in %s\n", path.c_str());
                    fclose(f);
                    return;
                }
                const std::vector<float> xr = smp::row(g, vv, 8, 2);
                std::copy(xr.begin(), xr.end(), x.begin() + r * vv);
                const std::vector<int> hr = smp::hist(g, vv, nh);
                std::copy(hr.begin(), hr.end(), h.begin() + r * nh);
                for (int c = 0; c < 3; ++c) prm[3 * r + c] = __uint_as_float(p[c]);
                want[r] = hv;
                gens[r] = g;
            }
            ++launches;
            launch(n, block, [&] {
                penalize(n, vv, nh, out.data(), vv, 1, x.data(), vv, 1, h.data(), nh, 1, prm.data(), 3, 1);
            });
            for (int r = 0; r < n; ++r) {
                ++rows_seen;
                const u32 got = smp::hash(out.data() + r * vv, vv, 1);
                if (got != want[r]) {
                    ++fails;
                    printf("FAIL penalize V %lld N %lld block %u row gen %x: hash %x, want %x\n", a, b, block,
                           gens[r], got, want[r]);
                }
            }
        }
    }
    fclose(f);
    if (launches < 25 || rows_seen < 200) {
        ++fails;
        printf("FAIL sampler: only %d launches, %d rows read from %s\n", launches, rows_seen, path.c_str());
    }
}

// ---------------------------------------------------------------------------------------------
// GGUF block weights (kernels/quant.cuh, quant.cu) against gguf-py: quant_cases.txt holds
// random blocks of every type and `gguf.quants.dequantize` of them (scripts/gen_quant_cases.py).

// q16_half (quant.cuh) against the CPU backend's quantization (`q16_values`), bit for bit: the
// records' values, d and per-half d * sum(q), on a row with a zero block, NaN and infinities,
// subnormal values, values on rounding ties (x * id = n + 1/2 exactly) and random blocks.
void test_quant_q16_rows() {
    const i64 K = 32 * 12;
    std::vector<float> x(K);
    for (i64 k = 0; k < K; ++k) x[k] = rnd(3.0f);
    for (i64 k = 0; k < 32; ++k) x[k] = 0.0f;                        // block 0: all zero
    x[40] = NAN;                                                        // block 1: NaN skipped, to 0
    x[70] = INFINITY;                                                   // block 2: d = inf, all 0
    for (i64 k = 96; k < 128; ++k) x[k] = (float)(k - 110) * 1e-42f;  // block 3: subnormal
    // Block 4: amax 32767 (d = 1, id = 1): halves round away from zero.
    for (i64 k = 128; k < 160; ++k) x[k] = (float)(k - 144) + 0.5f;
    x[128] = 32767.0f;
    x[200] = -INFINITY;  // block 6
    std::vector<float> ds;
    std::vector<int> qs;
    q16_values(x, &ds, &qs);
    std::vector<unsigned char> rec((size_t)(K / 32 * Q16_REC + 16));
    unsigned char* r = rec.data() + (16 - (u64)rec.data() % 16) % 16;
    launch(1, 64, [&] {
        const int nh = (int)(K / 16);
        for (int h0 = 0; h0 < nh; h0 += 64) {
            const int h = h0 + (int)threadIdx.x;
            const bool live = h < nh;
            float v[16];
            for (int e = 0; e < 16; ++e) v[e] = live ? x[16 * h + e] : 0.0f;
            q16_half(v, r + Q16_REC * (h / 2), h, live);
        }
    });
    i64 bad = 0;
    for (i64 b = 0; b < K / 32; ++b) {
        const unsigned char* rb = r + Q16_REC * b;
        float d, sx[2];
        memcpy(&d, rb + 64, 4);
        memcpy(sx, rb + 68, 8);
        bad += __float_as_uint(d) != __float_as_uint(ds[b]);
        for (int h = 0; h < 2; ++h) {
            int sum = 0;
            for (int i = 0; i < 16; ++i) {
                short q;
                memcpy(&q, rb + 2 * (16 * h + i), 2);
                bad += q != qs[32 * b + 16 * h + i];
                sum += qs[32 * b + 16 * h + i];
            }
            bad += __float_as_uint(sx[h]) != __float_as_uint(ds[b] * (float)sum);
        }
    }
    if (bad) {
        ++fails;
        printf("FAIL quant_dequant q16 records: %lld fields differ from the CPU's quantization\n", (long long)bad);
    }
}

// q8_half (quant.cuh) against the CPU backend's 8-bit quantization (`q8_values`), bit for bit:
// the records' values, d, d * sum(q) of the block and of each half, on the same kinds of
// blocks as `test_quant_q16_rows` (ties at amax 127), at a row length that fills a 64-thread
// round and one that leaves lanes past the row.
void test_quant_q8_rows() {
    for (const i64 K : {(i64)32 * 12, (i64)32 * 32}) {
        std::vector<float> x(K);
        for (i64 k = 0; k < K; ++k) x[k] = rnd(3.0f);
        for (i64 k = 0; k < 32; ++k) x[k] = 0.0f;                        // block 0: all zero
        x[40] = NAN;                                                        // block 1: NaN skipped, to 0
        x[70] = INFINITY;                                                   // block 2: d = inf, all 0
        for (i64 k = 96; k < 128; ++k) x[k] = (float)(k - 110) * 1e-42f;  // block 3: subnormal
        // Block 4: amax 127 (d = 1, id = 1): halves round away from zero.
        for (i64 k = 128; k < 160; ++k) x[k] = (float)(k - 144) + 0.5f;
        x[128] = 127.0f;
        x[200] = -INFINITY;  // block 6
        std::vector<float> ds;
        std::vector<int> qs;
        q8_values(x, &ds, &qs);
        std::vector<unsigned char> rec((size_t)(K / 32 * Q8_REC + 16), 0xee);
        unsigned char* r = rec.data() + (16 - (u64)rec.data() % 16) % 16;
        launch(1, 64, [&] {
            const int nh = (int)(K / 16);
            for (int h0 = 0; h0 < nh; h0 += 64) {
                const int h = h0 + (int)threadIdx.x;
                const bool live = h < nh;
                float v[16];
                for (int e = 0; e < 16; ++e) v[e] = live ? x[16 * h + e] : 0.0f;
                q8_half(v, r + Q8_REC * (h / 2), h, live);
            }
        });
        i64 bad = 0;
        for (i64 b = 0; b < K / 32; ++b) {
            const unsigned char* rb = r + Q8_REC * b;
            float f[4];
            memcpy(f, rb + 32, 16);
            bad += __float_as_uint(f[0]) != __float_as_uint(ds[b]);
            int total = 0;
            for (int h = 0; h < 2; ++h) {
                int sum = 0;
                for (int i = 0; i < 16; ++i) {
                    bad += (signed char)rb[16 * h + i] != qs[32 * b + 16 * h + i];
                    sum += qs[32 * b + 16 * h + i];
                }
                total += sum;
                bad += __float_as_uint(f[2 + h]) != __float_as_uint(ds[b] * (float)sum);
            }
            bad += __float_as_uint(f[1]) != __float_as_uint(ds[b] * (float)total);
        }
        // Nothing past the last record.
        for (size_t i = (size_t)(r - rec.data()) + K / 32 * Q8_REC; i < rec.size(); ++i) bad += rec[i] != 0xee;
        if (bad) {
            ++fails;
            printf("FAIL quant_dequant q8 records K %lld: %lld fields differ from the CPU's quantization\n",
                   (long long)K, (long long)bad);
        }
    }
}

// Every block type's sizes, dq16 of every chunk of every block bit for bit, and iq16's integer
// form of it: d * w_i + m in float64 within 2^-22 of |d * w_i| + |m| of gguf's value (gguf rounds
// d * q and subtracts the min in f32: two roundings of at most 2^-24 of those terms).
// Whether `iq32` gives piece p of the block at blk exactly as two `iq16` calls give its chunks.
template <int QT>
bool iq32_matches(const unsigned char* blk, int p) {
    u32 w[2][4], v[2][4];
    float d[2], m[2], e[2], n[2];
    iq32<QT>(blk, p, w[0], w[1], d[0], m[0], d[1], m[1]);
    iq16<QT>(blk, 2 * p, v[0], e[0], n[0]);
    iq16<QT>(blk, 2 * p + 1, v[1], e[1], n[1]);
    bool same = true;
    for (int h = 0; h < 2; ++h) {
        same &= __float_as_uint(d[h]) == __float_as_uint(e[h]) && __float_as_uint(m[h]) == __float_as_uint(n[h]);
        for (int t = 0; t < 4; ++t) same &= w[h][t] == v[h][t];
    }
    return same;
}

// iq64 (a pair's four chunks, `q_paired` types) against iq16 of the pair's pieces, bit for bit
// (called for the paired types only; the switch instantiates it for every type).
template <int QT>
bool iq64_matches(const unsigned char* blk, int q) {
    if (!q_paired(QT)) return false;
    u32 w[4][4], v[4];
    float d[4], m[4], e, n;
    iq64<QT>(blk, q, w, d, m);
    bool same = true;
    for (int k = 0; k < 4; ++k) {
        const int piece = q_pair_piece<QT>(q, k / 2);  // pair q of block 0: the block's pieces
        iq16<QT>(blk, 2 * piece + (k & 1), v, e, n);
        same &= __float_as_uint(d[k]) == __float_as_uint(e) && __float_as_uint(m[k]) == __float_as_uint(n);
        for (int t = 0; t < 4; ++t) same &= w[k][t] == v[t];
    }
    return same;
}

void test_quant_dequant() {
    test_quant_q16_rows();
    test_quant_q8_rows();
    for (const QCase& c : quant_cases()) {
        const i64 qb = c.qb(), bb = c.bb(), nchunk = c.nblocks * qb / 16;
        if (q_block_size(c.qt) != qb || q_block_bytes(c.qt) != bb) {
            ++fails;
            printf("FAIL quant_dequant %s: sizes %d/%d, gguf's %lld/%lld\n", c.name.c_str(), q_block_size(c.qt),
                   q_block_bytes(c.qt), (long long)qb, (long long)bb);
            continue;
        }
        std::vector<float> got(c.vals.size(), NAN);
        launch((unsigned)((nchunk + 63) / 64), 64, [&] {
            const i64 u = blockIdx.x * 64 + threadIdx.x;
            if (u >= nchunk) return;
            const unsigned char* blk = c.bytes.data() + (u * 16 / qb) * bb;
            const int ch = (int)(u % (qb / 16));
            QUANT_SWITCH(c.qt, dq16<QTV>(blk, ch, got.data() + u * 16))
        });
        i64 bad = 0, first = -1;
        for (size_t i = 0; i < got.size(); ++i) {
            if (__float_as_uint(got[i]) != __float_as_uint(c.vals[i])) {
                if (first < 0) first = (i64)i;
                ++bad;
            }
        }
        if (bad) {
            ++fails;
            printf("FAIL quant_dequant %s: %lld of %zu values differ from gguf (first at %lld: %g, want %g)\n",
                   c.name.c_str(), (long long)bad, got.size(), (long long)first, got[first], c.vals[first]);
        }
        std::vector<double> gi(c.vals.size(), NAN), tol(c.vals.size(), 0.0);
        launch((unsigned)((nchunk + 63) / 64), 64, [&] {
            const i64 u = blockIdx.x * 64 + threadIdx.x;
            if (u >= nchunk) return;
            const unsigned char* blk = c.bytes.data() + (u * 16 / qb) * bb;
            const int ch = (int)(u % (qb / 16));
            u32 w[4];
            float d = NAN, m = NAN;
            QUANT_SWITCH(c.qt, iq16<QTV>(blk, ch, w, d, m))
            for (int i = 0; i < 16; ++i) {
                const double dw = (double)d * (signed char)(w[i / 4] >> (8 * (i % 4)));
                gi[u * 16 + i] = dw + m;
                tol[u * 16 + i] = std::ldexp(std::fabs(dw) + std::fabs((double)m), -22);
            }
        });
        bad = 0;
        first = -1;
        for (size_t i = 0; i < gi.size(); ++i) {
            if (!(std::fabs(gi[i] - c.vals[i]) <= tol[i])) {
                if (first < 0) first = (i64)i;
                ++bad;
            }
        }
        if (bad) {
            ++fails;
            printf("FAIL quant_dequant iq16 %s: %lld of %zu values off gguf's (first at %lld: %.9g, want %.9g)\n",
                   c.name.c_str(), (long long)bad, gi.size(), (long long)first, gi[first], c.vals[first]);
        }
        // iq32 (a piece's two chunks at once, with the loads of the types that have their own)
        // against iq16, bit for bit, with the blocks 16-byte aligned and 2 bytes past that.
        for (int shift : {0, 2}) {
            std::vector<uint4> store(c.bytes.size() / 16 + 2);
            unsigned char* base = (unsigned char*)store.data() + shift;
            std::memcpy(base, c.bytes.data(), c.bytes.size());
            i64 differ = 0;
            const i64 npiece = c.nblocks * qb / 32;
            for (i64 u = 0; u < npiece; ++u) {
                const unsigned char* blk = base + (u * 32 / qb) * bb;
                const int pc = (int)(u % (qb / 32));
                bool same = false;
                QUANT_SWITCH(c.qt, same = iq32_matches<QTV>(blk, pc))
                differ += !same;
            }
            if (differ) {
                ++fails;
                printf("FAIL quant_dequant iq32 %s at offset %d: %lld of %lld pieces differ from iq16's\n",
                       c.name.c_str(), shift, (long long)differ, (long long)npiece);
            }
            // iq64 over every pair of every block (each block its pieces' four pairs).
            differ = 0;
            for (i64 b = 0; b < c.nblocks && q_paired(c.qt); ++b) {
                for (int q = 0; q < 4; ++q) {
                    bool same = false;
                    QUANT_SWITCH(c.qt, same = iq64_matches<QTV>(base + b * bb, q))
                    differ += !same;
                }
            }
            if (differ) {
                ++fails;
                printf("FAIL quant_dequant iq64 %s at offset %d: %lld pairs differ from iq16's\n", c.name.c_str(),
                       shift, (long long)differ);
            }
        }
    }
}

// get_rows_q (f32 rows: exact; f16 rows: gguf's values rounded once) with a bad index, whose
// row is skipped and reported; dequant_rows over a strided row set (f16, exact after rounding).
void test_quant_rows() {
    for (const QCase& c : quant_cases()) {
        const i64 qb = c.qb(), bb = c.bb();
        const i64 bpr = 2;  // blocks per table row
        const i64 n_table = c.nblocks / bpr, d = bpr * qb;
        const std::vector<int> ids = {(int)n_table - 1, 0, (int)(1 % n_table), 99, (int)n_table - 1};
        for (int dtd : {DT_F32, DT_F16}) {
            const i64 rows = (i64)ids.size();
            Buf dst(dtd, rows * d);
            u32 err = 0;
            Lay L{};
            L.nd = 1;
            L.shape[0] = rows;
            L.st[0][0] = d;
            L.st[1][0] = 1;
            launch((unsigned)((rows * d / 16 + 127) / 128), 128, [&] {
                get_rows_q(rows, d, L, dst.p(), dtd, 1, c.bytes.data(), c.qt, bpr * bb, n_table, ids.data(), &err, 7);
            });
            i64 bad = 0;
            for (i64 r = 0; r < rows; ++r) {
                for (i64 e = 0; e < d; ++e) {
                    const float got = dst.get(r * d + e);
                    const bool oob = ids[r] < 0 || ids[r] >= n_table;
                    const float want = oob ? 0.0f : (float)rounded(dtd, c.vals[ids[r] * d + e]);
                    bad += __float_as_uint(got) != __float_as_uint(want);
                }
            }
            if (bad || err != 7) {
                ++fails;
                printf("FAIL quant_rows get_rows_q %s dst %d: %lld values differ, error word %u\n", c.name.c_str(), dtd,
                       (long long)bad, err);
            }
        }
        // Rows 0, 2, 4 ... of the blocks seen as a [n_table, d] table: element stride 2 * d.
        const i64 rows = n_table / 2;
        Buf out(DT_F16, rows * d);
        Lay L{};
        L.nd = 1;
        L.shape[0] = rows;
        L.st[0][0] = 2 * d;
        launch((unsigned)((rows * d / 16 + 127) / 128), 128,
               [&] { dequant_rows(rows, d, L, (u16*)out.p(), c.bytes.data(), c.qt); });
        i64 bad = 0;
        for (i64 r = 0; r < rows; ++r)
            for (i64 e = 0; e < d; ++e)
                bad += __float_as_uint(out.get(r * d + e)) != __float_as_uint((float)rounded(DT_F16, c.vals[2 * r * d + e]));
        if (bad) {
            ++fails;
            printf("FAIL quant_rows dequant_rows %s: %lld values differ\n", c.name.c_str(), (long long)bad);
        }
    }
}

// mul_mat_vec_q / _q8 against float64 sums of gguf's values: weights are rows of the case's
// blocks in a shuffled order (in one case the rows are a block apart and the weight starts off a
// 16-byte boundary, the bytes around it poisoned), a is f32 with padded rows, two batches with b
// broadcast (GQA-style divisor) and the weight read ahead of the wait (a poisoned until then)
// in one case; k of one block to past one staged segment. One-row products also take the q16
// and q8 paths (`q16` 1, 2: one batch; read ahead in the padded case), checked as `q16_values`
// and `q8_values` say.
void test_quant_mmv() {
    for (const QCase& c : quant_cases()) {
        const i64 qb = c.qb(), bb = c.bb();
        for (i64 kb : {(i64)1, (i64)3, 1280 / qb})
            for (i64 M : {1, 3, 9})
                for (int pad : {0, 1})
                    for (int q16 : {0, 1, 2}) {
                    if (q16 && M != 1) continue;
                    const i64 K = kb * qb, N = 37, nbatch = pad && !q16 ? 2 : 1;
                    const i64 row_blocks = kb + pad, b_cs = row_blocks * bb;
                    // The padded case also starts the weight 2 bytes past a 16-byte boundary.
                    std::vector<unsigned char> wbuf((size_t)(N * b_cs + 16), 0xee);
                    unsigned char* const wp = wbuf.data() + (16 - (u64)wbuf.data() % 16) % 16 + 2 * pad;
                    std::vector<i64> src((size_t)(N * kb));  // case block behind each weight block
                    for (i64 n = 0; n < N; ++n)
                        for (i64 j = 0; j < kb; ++j) {
                            const i64 s = (i64)(rng() % (unsigned)c.nblocks);
                            src[n * kb + j] = s;
                            memcpy(wp + n * b_cs + j * bb, c.bytes.data() + s * bb, bb);
                        }
                    const i64 lda = K + 4 * pad;
                    // The padded q16 case starts a one float past a 16-byte boundary (no float4 loads).
                    const i64 a0 = q16 && pad ? 1 : 0;
                    Buf a(DT_F32, nbatch * M * lda), dst(DT_F32, nbatch * M * N);
                    a.rand();
                    MmBatch B{};
                    if (nbatch > 1) {
                        B.nd = 1;
                        B.shape[0] = nbatch;
                        B.st[0][0] = M * N;
                        B.st[1][0] = M * lda;
                        B.st[2][0] = 0;
                        B.div[0][0] = 1;
                        B.div[1][0] = 1;
                        B.div[2][0] = nbatch;
                    }
                    const i64 blocks = (N + MVQ_WARPS - 1) / MVQ_WARPS * nbatch;
                    // Read ahead in the padded case: a holds garbage until the first wait.
                    const int ahead = pad;
                    std::unique_ptr<Producer> prod;
                    if (ahead) prod = std::make_unique<Producer>(std::vector<Buf*>{&a}, std::vector<Buf*>{&dst});
                    launch((unsigned)blocks, 32 * MVQ_WARPS, [&] {
                        if (M == 1)
                            mul_mat_vec_q(M, N, K, nbatch, B, (float*)dst.p(), N, 1, (const float*)a.p() + a0, lda, wp,
                                          c.qt, b_cs, ahead, q16);
                        else
                            mul_mat_vec_q8(M, N, K, nbatch, B, (float*)dst.p(), N, 1, (const float*)a.p(), lda, wp,
                                           c.qt, b_cs, ahead);
                    });
                    if (prod) prod->check("quant_mmv ahead " + c.name + " K " + std::to_string(K));
                    // q16: the row as the kernel quantized it (one row, one batch).
                    std::vector<float> row(K);
                    for (i64 k = 0; k < K; ++k) row[k] = a.get(a0 + k);
                    const std::vector<double> deq = q_values(row, q16);
                    std::vector<double> want, got, want_raw;
                    for (i64 bt = 0; bt < nbatch; ++bt)
                        for (i64 i = 0; i < M; ++i)
                            for (i64 n = 0; n < N; ++n) {
                                double acc = 0, acc_raw = 0;
                                for (i64 k = 0; k < K; ++k) {
                                    const double w = c.vals[src[n * kb + k / qb] * qb + k % qb];
                                    acc_raw += (double)a.get(a0 + bt * M * lda + i * lda + k) * w;
                                    acc += (q16 ? deq[k] : (double)a.get(a0 + bt * M * lda + i * lda + k)) * w;
                                }
                                want.push_back(acc);
                                want_raw.push_back(acc_raw);
                                got.push_back(dst.get(bt * M * N + i * N + n));
                            }
                    const std::string tag = "quant_mmv " + c.name + " K " + std::to_string(K) + " M " +
                                            std::to_string(M) + " pad " + std::to_string(pad) + " qm " +
                                            std::to_string(q16);
                    check(tag, want, got, 1e-10);
                    // q8 against the unquantized row only on the long rows (40 activation blocks):
                    // a 256-value row of one Q6_K or IQ4_XS block, its 37 columns a few distinct
                    // blocks, measured up to 4e-3 (few samples); the tight check above holds.
                    if (q16 && (q16 != 2 || K >= 1024)) check(tag + " (unquantized row)", want_raw, got, q_raw_bound(q16));
                }
    }
}

// Two rounds of a quantized head with its argmax on N random rows (45 unless given) of c's
// blocks (K two blocks): `head(w, rb, K, a, d, key, am)` launches the kernel under test (logits
// into d, its argmax key into key[0]; a launch that takes the index itself writes am, with
// key[1] its ticket), then `argmax_take` (unless am was written) and `mul_mat_vec_q` on a
// (into ref) run, and `verify(round, d, ref, am, best, key[0])` checks them, `best` the
// `better` argmax of d. The ticket must be 0 again. The second round copies the best row's
// blocks below it (a tie the lower row must win).
template <class Head, class Verify>
void head_rounds(const QCase& c, int q16, Head head, Verify verify, i64 N = 45) {
    const i64 qb = c.qb(), bb = c.bb(), K = 2 * qb, rb = 2 * bb;
    std::vector<unsigned char> w((size_t)(N * rb));
    for (i64 b = 0; b < N * 2; ++b) memcpy(w.data() + b * bb, c.bytes.data() + (rng() % c.nblocks) * bb, bb);
    Buf a(DT_F32, K), d(DT_F32, N), ref(DT_F32, N);
    a.rand();
    u64 key[2] = {0, 0};
    for (int round = 0; round < 2; ++round) {
        int am = -1;
        head(w.data(), rb, K, a, d, key, am);
        if (am < 0) launch(1, 32, [&] { argmax_take(key, &am); });
        if (key[1] != 0) {
            ++fails;
            printf("FAIL head %s qm %d round %d: ticket %llu left\n", c.name.c_str(), q16, round,
                   (unsigned long long)key[1]);
        }
        MmBatch B{};
        launch((unsigned)((N + MVQ_WARPS - 1) / MVQ_WARPS), 32 * MVQ_WARPS, [&] {
            mul_mat_vec_q(1, N, K, 1, B, (float*)ref.p(), N, 1, (const float*)a.p(), K, w.data(), c.qt, rb, 0, q16);
        });
        i64 best = 0;
        for (i64 j = 1; j < N; ++j)
            if (better(d.get(j), j, d.get(best), best)) best = j;
        verify(round, d, ref, am, best, key[0]);
        const i64 lower = best > 0 ? best / 2 : 0;
        if (best > 0) memcpy(w.data() + lower * rb, w.data() + best * rb, rb);
    }
}

// The quantized head with its argmax folded in, then `argmax_take`: the logits as
// `mul_mat_vec_q` writes them, the index as the `argmax` kernel would take it over them (the
// lower column on a tie, made by copying the best column's blocks below it), the key back at 0;
// on the f32, q16 and q8 paths.
void test_quant_head_argmax() {
    for (int q16 : {0, 1, 2})
    for (const QCase& c : quant_cases()) {
        auto head = [&](const unsigned char* w, i64 rb, i64 K, Buf& a, Buf& d, u64* key, int&) {
            const i64 N = d.n;
            MmBatch B{};
            launch((unsigned)((N + MVQ_WARPS - 1) / MVQ_WARPS), 32 * MVQ_WARPS, [&] {
                mul_mat_vec_q_argmax(1, N, K, 1, B, (float*)d.p(), N, 1, (const float*)a.p(), K, w, c.qt, rb, 0,
                                     key, q16);
            });
        };
        head_rounds(c, q16, head, [&](int round, Buf& d, Buf& ref, int am, i64 best, u64 key) {
            bool same = true;
            for (i64 j = 0; j < d.n; ++j) same = same && __float_as_uint(d.get(j)) == __float_as_uint(ref.get(j));
            if (!same || am != (int)best || key != 0) {
                ++fails;
                printf("FAIL quant_head_argmax %s qm %d round %d: logits %s, index %d want %lld, key %llu\n",
                       c.name.c_str(), q16, round, same ? "equal" : "differ", am, (long long)best,
                       (unsigned long long)key);
            }
        });
    }
}

// fused_gemv1_q without row pairs: three products (broadcast and full Adds) or gate/up with
// SwiGlu, each segment of its own block type (every type in some case), against float64 over
// gguf's values of the blocks; with and without the norm prologue, one warp per unit or a small
// grid whose warps stride over the units, K from fewer chunks than a warp's lanes (96) to several
// chunks per lane (2304). The activation (or the norm's input) is garbage until the kernel's
// wait (`Producer`): nothing is stored before it.
void test_fused_gemv1_q() {
    struct Case {
        std::array<int, 3> qt;
        i64 K;
        int pair, norm;
    };
    const Case cases[] = {
        {{DT_Q4_0, DT_Q8_0, DT_Q6_K}, 512, 0, 0},  {{DT_Q4_K, DT_Q6_K, DT_IQ4_XS}, 768, 0, 1},
        {{DT_Q2_K, DT_Q3_K, DT_Q5_K}, 2304, 0, 1}, {{DT_Q4_1, DT_Q5_0, DT_Q5_1}, 96, 0, 0},
        {{DT_IQ4_NL, DT_Q8_0, DT_Q4_0}, 1056, 0, 1}, {{DT_Q4_K, DT_Q6_K, 0}, 512, 1, 1},
        {{DT_Q8_0, DT_Q4_0, 0}, 96, 1, 0},          {{DT_Q5_K, DT_Q5_K, 0}, 1280, 1, 1},
        // One block type throughout: the typed entry points too (q16 and q8), bit for bit.
        {{DT_Q4_0, DT_Q4_0, DT_Q4_0}, 1056, 0, 1},  {{DT_Q8_0, DT_Q8_0, 0}, 96, 1, 0},
        {{DT_Q4_1, DT_Q4_1, DT_Q4_1}, 576, 0, 0},   {{DT_Q4_1, DT_Q4_1, 0}, 1536, 1, 1},
        {{DT_Q4_K, DT_Q4_K, DT_Q4_K}, 2304, 0, 0},  {{DT_Q6_K, DT_Q6_K, 0}, 1536, 1, 1},
        // Rows of several rounds of four pieces a lane (264 pieces), the last round partly past the row.
        {{DT_Q4_0, DT_Q4_0, DT_Q4_0}, 8448, 0, 1},  {{DT_Q6_K, DT_Q6_K, DT_Q6_K}, 8448, 0, 0},
    };
    for (const Case& c : cases)
        for (int grid : {0, 1, 3})
            for (int q16 : {0, 1, 2}) {
            const i64 K = c.K;
            Buf x(DT_F32, K), nw(DT_F32, K), nd(DT_F32, K), a(DT_F32, K);
            x.rand(2.0f);
            nw.rand(1.5f);
            if (!c.norm) a.rand();
            // f32 weights without padding: P.w[s] holds gguf's values of segment s's blocks.
            Products P(DT_F32, 1, K, c.pair, 0, {37, 21, 12});
            QRows qw[3];
            for (int s = 0; s < P.nseg; ++s) {
                qw[s] = q_rows(c.qt[s], P.ns[s], K, *P.w[s], 2 * s);
                P.S.seg[s].w = (u64)qw[s].p;
                P.S.seg[s].w_rs = qw[s].rs;
                P.S.seg[s].qt = c.qt[s];
            }
            std::vector<Buf*> res;
            for (auto& b : P.out) res.push_back(b.get());
            for (auto& b : P.sum) res.push_back(b.get());
            if (c.pair) res.push_back(P.sw.get());
            res.push_back(&nd);
            std::vector<Buf*> written = res;
            if (c.norm) written.push_back(&a);
            TypedCheck typed(written);
            typed.qm = q16;
            Producer prod({c.norm ? &x : &a}, res);
            // `warps` per block: 8, or 12 (`CudaConfig::q_warps`, `q_warps_norm`).
            auto run_w = [&](FqKernel kernel, int pf, unsigned warps) {
                launch(grid ? (unsigned)grid : (unsigned)((P.units() + warps - 1) / warps), 32 * warps, [&] {
                    kernel(K, (const float*)a.p(), P.S, c.norm ? (const float*)x.p() : nullptr, 1e-5f,
                           c.norm ? nd.p() : nullptr, DT_F32, nw.p(), DT_F32, q16, (grid == 3 ? 3 : 1) | pf);
                });
            };
            auto run = [&](FqKernel kernel, int pf) { run_w(kernel, pf, 8); };
            auto run12 = [&](FqKernel kernel, int pf) { run_w(kernel, pf, 12); };
            run(fused_gemv1_q, 0);
            std::string tag = "fused_gemv1_q K " + std::to_string(K) + " pair " + std::to_string(c.pair) + " norm " +
                              std::to_string(c.norm) + " grid " + std::to_string(grid) + " qm " +
                              std::to_string(q16) + " types";
            for (int s = 0; s < P.nseg; ++s) tag += " " + quant_case(c.qt[s]).name;
            prod.check(tag);
            if (q16) typed.same(tag + " direct", [&] { run(fused_gemv1_q, 8); });
            if (q16 && c.norm) typed.same(tag + " direct norm", [&] { run(fused_gemv1_q, 16); });
            // Blocks of 12 warps: the units' owners change, not their sums; the norm's sum
            // still runs over the first 8 warps' threads.
            const bool wide = q16 && grid == 3;
            if (wide) typed.same(tag + " 12 warps", [&] { run12(fused_gemv1_q, 0); });
            std::vector<double> act(K);
            if (c.norm) {
                double ss = 0;
                for (i64 k = 0; k < K; ++k) ss += (double)x.get(k) * x.get(k);
                const double inv = 1.0 / std::sqrt(ss / K + 1e-5);
                std::vector<double> wn, gn, ga;
                for (i64 k = 0; k < K; ++k) {
                    act[k] = x.get(k) * inv * nw.get(k);
                    wn.push_back(x.get(k) * inv);
                    gn.push_back(nd.get(k));
                    ga.push_back(a.get(k));
                }
                check(tag + ": norm", wn, gn, 1e-10);
                check(tag + ": norm product", act, ga, 1e-10);
            } else {
                for (i64 k = 0; k < K; ++k) act[k] = a.get(k);
            }
            if (!q16) {
                P.check_all(tag, K, [&](i64, i64 k) { return act[k]; });
                continue;
            }
            // The row the kernel quantized: a (its norm product, written: S.wnorm is 1).
            std::vector<float> row(K);
            for (i64 k = 0; k < K; ++k) row[k] = a.get(k);
            const std::vector<double> deq = q_values(row, q16);
            P.check_all(tag, K, [&](i64, i64 k) { return deq[k]; });
            P.check_all(tag + " (unquantized row)", K, [&](i64, i64 k) { return act[k]; }, q_raw_bound(q16));
            const std::vector<int> types(c.qt.begin(), c.qt.begin() + P.nseg);
            if (q16) typed.typed(tag + " typed", types, run);
            if (wide) typed.typed(tag + " typed 12 warps", types, run12);
        }
}

// Decode's head through fused_gemv1_q (one segment, `FgSet::amax` set; the host's
// `launch_head_q`): every block type and integer path, one warp per row or a grid of 2 blocks
// whose warps stride over the rows (each warp asking its next row into L2 first). The word
// `argmax_take` turns into the index names the `better` argmax of the logits the kernel wrote,
// and is 0 again after it; the logits match `mul_mat_vec_q`'s within the block type's rounding
// (another summation order). A second round copies the best row below it: the tie goes to the
// lower row.
void test_fused_gemv1_q_head() {
    // pairs: the head's rows two to a unit (`CudaConfig::q_head_pairs`: row pairs without a
    // Rope or a cache row), over 44 rows. fold (`CudaConfig::q_head_fold`): the final norm as
    // the prologue (its product written to a, which `mul_mat_vec_q` then reads) and the index
    // taken by the launch (`FgSet::take`).
    for (int fold : {0, 1})
    for (int pairs : {0, 1})
    for (int grid : {0, 2})
    for (int q16 : {0, 1, 2})
    for (const QCase& c : quant_cases()) {
        Buf x(DT_F32, 2 * c.qb()), nw(DT_F32, 2 * c.qb()), nd(DT_F32, 2 * c.qb());
        x.rand(2.0f);
        nw.rand(1.5f);
        auto head = [&](const unsigned char* w, i64 rb, i64 K, Buf& a, Buf& d, u64* key, int& am) {
            FgSet S{};
            S.nseg = 1;
            S.amax = (u64)key;
            S.take = fold ? (u64)&am : 0;
            S.wnorm = fold;
            S.pair = pairs ? 2 : 0;
            FgSeg& g = S.seg[0];
            g.n = d.n;
            g.w = (u64)w;
            g.w_rs = rb;
            g.qt = c.qt;
            g.out = (u64)d.p();
            g.o_rs = d.n;
            g.o_cs = 1;
            g.wout = 1;
            TypedCheck typed(fold ? std::vector<Buf*>{&d, &a, &nd} : std::vector<Buf*>{&d});
            typed.qm = q16;
            const u64 key0 = key[0];
            // With fold, a is garbage until the kernel's wait: the kernel writes it, reads x.
            std::unique_ptr<Producer> prod;
            if (fold) prod = std::make_unique<Producer>(std::vector<Buf*>{&x}, std::vector<Buf*>{&d, &a, &nd});
            auto run = [&](FqKernel kernel, int pf) {
                launch(grid ? (unsigned)grid : (unsigned)((d.n + 7) / 8), 256, [&] {
                    kernel(K, (const float*)a.p(), S, fold ? (const float*)x.p() : nullptr, 1e-5f,
                           fold ? nd.p() : nullptr, DT_F32, fold ? nw.p() : nullptr, DT_F32, q16, 1 | pf);
                });
            };
            run(fused_gemv1_q, 0);
            const std::string name = "fused_gemv1_q head " + c.name + " grid " + std::to_string(grid) + " pairs " +
                                     std::to_string(pairs) + " fold " + std::to_string(fold);
            if (prod) prod->check(name);
            if (q16) {
                // The typed entry point from the same start: the same logits and the same word
                // (with fold: the same index, the word and the ticket back at 0).
                const u64 want = key[0];
                const int want_am = am;
                typed.typed(name + " typed", {c.qt}, [&](FqKernel kernel, int pf) {
                    key[0] = key0;
                    am = -1;
                    run(kernel, pf);
                });
                if (key[0] != want || am != want_am || key[1] != 0) {
                    ++fails;
                    printf("FAIL %s typed: argmax word %llu, want %llu; index %d, want %d; ticket %llu\n",
                           name.c_str(), (unsigned long long)key[0], (unsigned long long)want, am, want_am,
                           (unsigned long long)key[1]);
                }
            }
        };
        head_rounds(c, q16, head, [&](int round, Buf& d, Buf& ref, int am, i64 best, u64 key) {
            std::vector<double> got(d.n), want(d.n);
            for (i64 j = 0; j < d.n; ++j) got[j] = d.get(j), want[j] = ref.get(j);
            const std::string tag = "fused_gemv1_q head " + c.name + " qm " + std::to_string(q16) + " grid " +
                                    std::to_string(grid) + " pairs " + std::to_string(pairs) + " fold " +
                                    std::to_string(fold) + " round " + std::to_string(round);
            check(tag + ": logits against mul_mat_vec_q", want, got, 1e-9);
            if (am != (int)best || key != 0) {
                ++fails;
                printf("FAIL %s: index %d want %lld, key %llu\n", tag.c_str(), am, (long long)best,
                       (unsigned long long)key);
            }
        }, pairs ? 44 : 45);
    }
}

// fused_gemv1_q's row pairs: `rowpair_case` on quantized q/k/v weights of mixed block types.
void test_fused_gemv1_q_rowpair() {
    const int F32 = DT_F32, F16 = DT_F16, BF16 = DT_BF16;
    // As `test_fused_gemv1_rowpair`'s cases (wdt unused), the last field the block types.
    const RpCase cases[] = {
        {F32, 512, 64, 64, 2, 7, F32, F32, F16, 1, 7, 7, 1, 0, 1, 37, 10000.0, 1},
        {F32, 256, 16, 8, 3, 5, F16, F16, BF16, 0, 7, 6, 1, 1, 1, 5, 500000.0, 2},
        {F32, 768, 20, 10, 3, 0, F32, F32, F32, 1, 6, 7, 0, 2, 1, 70, 10000.0, 3},
        {F32, 1024, 64, 32, 2, 2, F32, F16, F16, 1, 0, 0, 0, 0, 1, 4095, 10000.0, 4},
        // One block type for q, k and v: the typed entry points too (q16 and q8), bit for bit.
        {F32, 512, 64, 64, 2, 7, F32, F32, F16, 1, 7, 7, 1, 1, 1, 37, 10000.0, 5},
        {F32, 1024, 32, 32, 2, 1, F32, F16, F16, 0, 7, 7, 0, 0, 1, 300, 10000.0, 6},
        {F32, 576, 64, 64, 3, 7, F32, F32, F16, 1, 7, 7, 1, 0, 1, 37, 10000.0, 7},
        // One head of 576 dims, all rotated (288 pairs a unit's lane computes).
        {F32, 256, 576, 576, 1, 7, F32, F32, F16, 0, 7, 7, 1, 0, 1, 99, 10000.0, 5},
    };
    for (const RpCase& c : cases)
        for (bool own : {true, false})
            for (int q16 : {0, 1, 2}) rowpair_case(c, own, q16);
}

// Every test group, by name; `kernels_test NAME...` runs only the groups named.
int main(int argc, char** argv) {
    const std::pair<const char*, void (*)()> groups[] = {
        // The sampler's cases live beside this file; kernel_emu.sh passes its folder.
        {"sample", [] { test_sample(LOWSYNC_EMU_DIR); }},
        {"copies", test_copies},
        {"norm_mul", test_norm_mul},
        {"fused_gemv", test_fused_gemv},
        {"norm_mul_row", test_norm_mul_row},
        {"fused_gemv1", test_fused_gemv1},
        {"fused_gemv1_rowpair", test_fused_gemv1_rowpair},
        {"mul_mat_vec_k", test_mul_mat_vec_k},
        {"mul_mat_vec_1", test_mul_mat_vec_1},
        {"rope_rows", test_rope_rows},
        {"attention", test_attention},
        {"attention_nan", test_attention_nan},
        {"attention_split", test_attention_split},
        {"attention_prefill", test_attention_prefill},
        {"attention_prefill_nan", test_attention_prefill_nan},
        {"soft_max", test_soft_max},
        {"argmax", test_argmax},
        {"mul_mat_vec_1_argmax", test_mul_mat_vec_1_argmax},
        {"quant_dequant", test_quant_dequant},
        {"quant_rows", test_quant_rows},
        {"quant_mmv", test_quant_mmv},
        {"quant_head_argmax", test_quant_head_argmax},
        {"fused_gemv1_q", test_fused_gemv1_q},
        {"fused_gemv1_q_rowpair", test_fused_gemv1_q_rowpair},
        {"fused_gemv1_q_head", test_fused_gemv1_q_head},
    };
    int ran = 0;
    for (const auto& [name, run] : groups) {
        bool asked = argc == 1;
        for (int i = 1; i < argc; ++i) asked |= std::string(argv[i]) == name;
        if (asked) {
            // Each group draws from the same seed, so a group run alone (`kernel_emu.sh NAME`)
            // meets the data it meets in the whole suite.
            rng.seed(7);
            run();
            ++ran;
        }
    }
    if (ran == 0) {
        printf("kernel emulation: no test group named");
        for (int i = 1; i < argc; ++i) printf(" %s", argv[i]);
        printf("\n");
        return 2;
    }
    printf("kernel emulation: %d group(s), %d failure(s)\n", ran, fails);
    return fails != 0;
}
