"""Attention kernel lab: phases of attn_decode (clock64, block 0) warm vs after an i-cache flush."""
import ctypes, ctypes.util, glob, os, sys, struct, time
import numpy as np

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
kdir = os.path.join(root, "crates/backend-cuda/kernels")
cuda = ctypes.CDLL("libcuda.so.1")
nvl = None
for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
    for f in glob.glob(os.path.join(d, "libnvrtc.so*")):
        if "builtins" not in f:
            nvl = f
nvrtc = ctypes.CDLL(nvl)

def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: {r}")

def compile_src(src, name, arch):
    prog = ctypes.c_void_p()
    ck(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None), "create")
    opts = [f"--gpu-architecture={arch}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if r != 0:
        print(log.value.decode()[:4000])
        raise RuntimeError("compile")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetCUBIN(prog, buf)
    return buf.raw

ck(cuda.cuInit(0), "init")
dev = ctypes.c_int()
ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p()
ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
ck(cuda.cuCtxSetCurrent(ctx), "setcur")
clk = ctypes.c_int()
cuda.cuDeviceGetAttribute(ctypes.byref(clk), 13, dev)  # CLOCK_RATE kHz
mhz = clk.value / 1000
print("clock MHz", mhz)

def alloc(nbytes, data=None):
    p = ctypes.c_uint64()
    ck(cuda.cuMemAlloc_v2(ctypes.byref(p), max(nbytes, 16)), "alloc")
    if data is not None:
        b = np.ascontiguousarray(data).tobytes()
        ck(cuda.cuMemcpyHtoD_v2(p, b, len(b)), "h2d")
    else:
        cuda.cuMemsetD8_v2(p, 0, max(nbytes, 16))
    return p.value

def module(cubin):
    m = ctypes.c_void_p()
    ck(cuda.cuModuleLoadData(ctypes.byref(m), cubin), "load")
    return m

def func(m, name):
    f = ctypes.c_void_p()
    ck(cuda.cuModuleGetFunction(ctypes.byref(f), m, name.encode()), "getfn " + name)
    return f

def launch(f, grid, block, args, smem=0):
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    ck(cuda.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, smem, None, ptrs, None), "launch")

def sync():
    ck(cuda.cuCtxSynchronize(), "sync")

def dglobal(m, name, n):
    p = ctypes.c_uint64(); sz = ctypes.c_size_t()
    ck(cuda.cuModuleGetGlobal_v2(ctypes.byref(p), ctypes.byref(sz), m, name.encode()), "global")
    out = np.zeros(n, np.uint64)
    ck(cuda.cuMemcpyDtoH_v2(out.ctypes.data, p, n * 8), "d2h")
    return out

I64, I32, F32, P = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64

PRE = r'''
__device__ unsigned long long lab_ts[64];
__device__ unsigned long long lab_g[4096];
__device__ __forceinline__ unsigned long long gtime() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
#define LAB(n) do { if (threadIdx.x == 0 && blockIdx.x == 0) lab_ts[n] = clock64(); } while (0)
'''

def patched(fused, marks):
    for a, b in marks:
        assert fused.count(a) == 1, a
        fused = fused.replace(a, b)
    return fused

MARKS = [
    ("int narrow) {\n    pdl_entry();", "int narrow) {\n    LAB(0); if (threadIdx.x == 0) lab_g[2 * blockIdx.x] = gtime(); pdl_entry(); LAB(1);"),
    ("        vf[tid] = valid;\n        __syncthreads();\n", "        vf[tid] = valid;\n        __syncthreads();\n        LAB(2);\n"),
    ("        if (write_kq && in) kq[", "        LAB(3);\n        if (write_kq && in) kq["),
    ("block_max(lg));\n", "block_max(lg));\n        LAB(4);\n"),
    ("const float chunk_sum = block_sum(ex);  // its barriers also publish es\n", "const float chunk_sum = block_sum(ex);  // its barriers also publish es\n        LAB(5);\n"),
    ("        __syncthreads();  // es and vf are rewritten by the next chunk\n    }\n", "        __syncthreads();  // es and vf are rewritten by the next chunk\n    }\n    LAB(6);\n"),
    ("    for (int e = 0; e < 8; ++e) red[tid * 8 + e] = acc[e];\n    __syncthreads();\n", "    for (int e = 0; e < 8; ++e) red[tid * 8 + e] = acc[e];\n    __syncthreads();\n    LAB(7);\n"),
    ("#undef ATT_ARGS\n}", "#undef ATT_ARGS\n    LAB(8); __syncthreads(); if (threadIdx.x == 0) lab_g[2 * blockIdx.x + 1] = gtime();\n}"),
]

def flush_src(n):
    body = "\n".join(f"    x = fmaf(x, {1.0 + i * 1e-7:.9f}f, {i * 1e-6:.8f}f);" for i in range(n))
    return f'extern "C" __global__ void flush(float* out) {{\n    float x = threadIdx.x;\n{body}\n    if (x == 12345.f) out[0] = x;\n}}\n'


MARKS_FAST = [
    ("    int write_o, float* c, int c_hs, int c_ds, int has_cpy) {\n    pdl_entry();",
     "    int write_o, float* c, int c_hs, int c_ds, int has_cpy) {\n    LAB(10); if (threadIdx.x == 0) lab_g[128 + 2 * blockIdx.x] = gtime(); pdl_entry(); LAB(11);"),
    ("    // The warp's key groups meet: lanes with the same dims, in xor order.\n", "    LAB(12);\n"),
    ("    __syncthreads();\n    float m = F_NEG_INF;", "    __syncthreads();\n    LAB(13);\n    float m = F_NEG_INF;"),
    ("#undef AF_CASE\n#undef AF_SPEC\n#undef AF_ARGS\n}", "#undef AF_CASE\n#undef AF_SPEC\n#undef AF_ARGS\n    LAB(14); __syncthreads(); if (threadIdx.x == 0) lab_g[128 + 2 * blockIdx.x + 1] = gtime();\n}"),
]

def main():
    maj = ctypes.c_int(); mnr = ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(maj), 75, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(mnr), 76, dev)
    arch = f"sm_{maj.value}{mnr.value}"
    common = open(os.path.join(kdir, "common.cuh")).read()
    fused = open(os.path.join(kdir, "fused.cu")).read()
    src = common + PRE + patched(patched(fused, MARKS), MARKS_FAST)
    t = time.time(); mod = module(compile_src(src, "fused.cu", arch)); print("compile %.1fs" % (time.time() - t))
    fl = module(compile_src(flush_src(int(os.environ.get("FLUSH_N", "12000"))), "flush.cu", arch))
    attn = func(mod, "attn_decode"); fast = func(mod, "attn_fast"); flush = func(fl, "flush")
    Hq, Hk, D = 32, 8, int(os.environ.get("D", "64"))
    L = int(os.environ.get("L", "72")); nvalid = int(os.environ.get("NVALID", "40"))
    rng = np.random.default_rng(0)
    ldkv = Hk * D
    K = rng.standard_normal((L, Hk, D)).astype(np.float16); V = rng.standard_normal((L, Hk, D)).astype(np.float16)
    Q = rng.standard_normal((Hq, D)).astype(np.float32)
    m = np.where(np.arange(L) < nvalid, 0.0, -np.inf).astype(np.float32)
    m[3] = -np.inf
    K[3] = np.nan; V[3] = np.nan; K[nvalid:] = np.nan; V[nvalid:] = np.nan
    kc = alloc(K.nbytes, K); vc = alloc(V.nbytes, V); q = alloc(Q.nbytes, Q); mk = alloc(L * 4, m)
    p = alloc(Hq * L * 4); o = alloc(Hq * D * 4); c = alloc(Hq * D * 4); fo = alloc(64)
    # reference
    ref = np.zeros((Hq, D))
    for h in range(Hq):
        kh = h // (Hq // Hk)
        ok = m == 0
        lg = (K[ok, kh].astype(np.float64) @ Q[h].astype(np.float64)) * D ** -0.5
        pr = np.exp(lg - lg.max()); pr /= pr.sum()
        ref[h] = pr @ V[ok, kh].astype(np.float64)
    G = D // 8; TC = G
    old_args = [I64(L), I64(D), F32(D ** -0.5), P(q), I32(0), I64(D), I64(1), I32(1), P(kc), I64(D), I64(ldkv), I64(Hq // Hk), I32(1), I32(G),
            P(vc), I64(D), I64(ldkv), I64(Hq // Hk), I32(1), I32(TC), P(mk), I32(0), I64(0), I64(1), I32(1),
            P(0), I64(L), I64(1), I32(0), P(p), I64(L), I64(1), P(o), I64(D), I64(1), P(c), I32(0), I64(1), I64(Hq), I32(1), I32(1)]
    fast_args = [I32(L), I32(D), F32(D ** -0.5), P(q), I32(D), I32(1), I32(1), P(kc), I32(D), I32(ldkv), I32(Hq // Hk),
                 P(vc), I32(D), I32(ldkv), I32(Hq // Hk), P(mk), I32(0), I32(1), I32(1), P(0), I32(L), I32(1), I32(0), P(p), I32(L), I32(1), I32(0), P(o), I32(D), I32(1), I32(1),
                 P(c), I32(1), I32(Hq), I32(1)]
    fargs = [P(fo)]
    def one(kern, args, marks, gofs, cold):
        if cold:
            launch(flush, 132 * 4, 256, fargs)
        launch(kern, Hq, 256, args)
        sync()
        ts = dglobal(mod, "lab_ts", 16).astype(np.int64)[marks]
        g = dglobal(mod, "lab_g", 256).astype(np.int64)[gofs:gofs + 2 * Hq]
        ph = np.diff(ts) / mhz
        span = (g[1::2].max() - g[0::2].min()) / 1e3
        return ph, (ts[-1] - ts[0]) / mhz, span
    for name, kern, args, marks, gofs in (("old", attn, old_args, list(range(9)), 0), ("fast", fast, fast_args, [10, 11, 12, 13, 14], 128)):
        cuda.cuMemsetD8_v2(ctypes.c_uint64(c), 0, Hq * D * 4)
        for cold in (False, True):
            res = [one(kern, args, marks, gofs, cold) for _ in range(30)]
            ph = np.median(np.array([r[0] for r in res]), axis=0)
            tot = np.median([r[1] for r in res]); span = np.median([r[2] for r in res])
            print(f"{name} {'cold' if cold else 'warm'}: block0 {tot:6.2f} us  grid span {span:6.2f} us  phases " + " ".join(f"{x:5.2f}" for x in ph))
        out = np.zeros(Hq * D, np.float32); cuda.cuMemcpyDtoH_v2(out.ctypes.data, ctypes.c_uint64(c), Hq * D * 4)
        got = out.reshape(D, Hq).T
        nmse = ((got - ref) ** 2).sum() / (ref ** 2).sum()
        print(f"{name}: nmse vs f64 reference {nmse:.3e}, max abs err {np.abs(got - ref).max():.3e}")

main()
