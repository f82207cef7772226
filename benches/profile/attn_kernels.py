"""Decode attention kernels side by side: `attn_decode` (general), `attn_fast` (short path) and,
for windows past one chunk of keys, `attn_fast_long` (valid keys listed first).

Why: a decoded token waits on each layer's attention, whose time is a chain of latencies (a
memory round trip, barriers, fetching the kernel's instructions), not bytes. Inside the replayed
graph (`kernel_trace.py`) one only sees a kernel's whole time; this script compiles the CUDA
modules itself with `PHASE_MARKS` (common.cuh), so the kernels record `clock64()` at their phase
marks (thread 0 of block 0) and every block its `%globaltimer` at entry and exit, and launches
both kernels on the same inputs in one process: warm (back to back) and cold (after a kernel
with 12,000 distinct instructions, which pushes the attention out of the SMs' instruction
caches, as the decode step's other kernels do). Each result is checked against a float64
reference (NMSE), masked K/V rows are NaN, so a kernel that used them would fail.

Needs an NVIDIA GPU, libcuda and libnvrtc (on LD_LIBRARY_PATH); no lowsync wheel. Run:
`python benches/profile/attn_kernels.py --windows 72:40,172:100,2048:100`
(each window: cache rows L and valid rows; 32 query heads, 8 KV heads, head size 64, f16 KV).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import time
from pathlib import Path

import numpy as np
from cuda_driver import PTR, Cuda, pack

CUDA_CRATE = Path(__file__).resolve().parents[2] / "crates" / "backend-cuda"
_ATTRS = r"(?:__\w+__\([^)]*\)\s*)*"  # __launch_bounds__(...), __maxnreg__(...)


def kernel_file(kernel: str) -> Path:
    """The `.cu` file of the CUDA backend that defines the `extern "C"` kernel `kernel`."""
    pat = re.compile(r'extern "C" __global__ void\s*' + _ATTRS + re.escape(kernel) + r"\(")
    hits = [p for p in sorted(CUDA_CRATE.rglob("*.cu")) if pat.search(p.read_text())]
    if len(hits) != 1:
        raise SystemExit(f"{kernel}: defined in {len(hits)} .cu files under {CUDA_CRATE}")
    return hits[0]


def module_source(path: Path) -> tuple[str, list[Path]]:
    """A kernel file as the backend compiles it, `common.cuh` first, and the folders NVRTC
    searches for anything it includes."""
    (common,) = CUDA_CRATE.rglob("common.cuh")
    src = path.read_text()
    if '#include "common.cuh"' not in src:
        src = common.read_text() + src
    return src, sorted({path.parent, common.parent})


# The kernels' parameter lists as `pack` type strings (tests/test_bench_scripts.py checks them
# against the kernels' source).
DECODE_TYPES = "llfpillipllliipllliipillipllipllpllpillii"
FAST_TYPES = "iifpiiipiiipiiipiiipiiipiiipiiipiiiii"


def flush_source(n: int) -> str:
    body = "\n".join(f"    x = fmaf(x, {1.0 + i * 1e-7:.9f}f, {i * 1e-6:.8f}f);" for i in range(n))
    head = 'extern "C" __global__ void flush(float* out) {\n    float x = threadIdx.x;\n'
    return head + body + "\n    if (x == 12345.f) out[0] = x;\n}\n"


def run_window(
    cuda: Cuda,
    mods: dict[str, ctypes.c_void_p],
    flush: ctypes.c_void_p,
    L: int,
    nvalid: int,
    reps: int,
) -> None:
    hq, hk, d = 32, 8, 64
    rng = np.random.default_rng(0)
    k = rng.standard_normal((L, hk, d)).astype(np.float16)
    v = rng.standard_normal((L, hk, d)).astype(np.float16)
    q = rng.standard_normal((hq, d)).astype(np.float32)
    mask = np.where(np.arange(L) < nvalid, 0.0, -np.inf).astype(np.float32)
    if nvalid > 4:
        mask[3] = -np.inf  # a hole
    bad = mask == -np.inf
    k[bad] = np.nan
    v[bad] = np.nan
    ref = np.zeros((hq, d))
    for h in range(hq):
        kh = h // (hq // hk)
        lg = k[~bad, kh].astype(np.float64) @ q[h].astype(np.float64) * d**-0.5
        pr = np.exp(lg - lg.max())
        ref[h] = (pr / pr.sum()) @ v[~bad, kh].astype(np.float64)
    kc, vc, qd, md = cuda.upload(k), cuda.upload(v), cuda.upload(q), cuda.upload(mask)
    p, o, c = (
        cuda.upload(None, hq * L * 4),
        cuda.upload(None, hq * d * 4),
        cuda.upload(None, hq * d * 4),
    )
    fo = cuda.upload(None, 64)
    ld, div, scale = hk * d, hq // hk, d**-0.5
    # Arguments as the backend passes them (fusion.rs, launch_attention); the copy is [d, hq].
    general = pack(
        DECODE_TYPES,
        *(L, d, scale, qd, 0, d, 1, 1, kc, d, ld, div, 1, 8, vc, d, ld, div, 1, 8),
        *(md, 0, 0, 1, 1, 0, L, 1, 0, p, L, 1, o, d, 1, c, 0, 1, hq, 1, 1),
    )
    # The last two arguments, `rehearse` and `mask_ahead`, are 0: no launch runs ahead of a
    # producer here.
    short = pack(
        FAST_TYPES,
        *(L, d, scale, qd, d, 1, 1, kc, d, ld, div, vc, d, ld, div, md, 0, 1, 1),
        *(0, L, 1, 0, p, L, 1, 0, o, d, 1, 1, c, 1, hq, 1, 0, 0),
    )
    print(f"window {L} rows, {int((~bad).sum())} valid; µs: block 0 | all blocks | phases")
    kernels = [("attn_decode", 9, general), ("attn_fast", 5, short)]
    if L > 256:  # past one chunk of keys (head size 64, f16): the listing path too
        kernels.append(("attn_fast_long", 5, short))
    for name, marks, args in kernels:
        mod = mods[name]
        f = cuda.func(mod, name)
        cuda.ck(cuda.cu.cuMemsetD8_v2(ctypes.c_uint64(c), 0, hq * d * 4), "cuMemsetD8")
        for cold in (False, True):
            rows = []
            for _ in range(reps):
                if cold:
                    cuda.launch(flush, cuda.sms * 4, 256, [PTR(fo)])
                cuda.launch(f, hq, 256, args)
                cuda.sync()
                clk = cuda.global_u64(mod, "phase_clk", marks).astype(np.int64)
                g = cuda.global_u64(mod, "phase_g", 2 * hq).astype(np.int64)
                block0 = (clk[-1] - clk[0]) / cuda.mhz
                grid = (g[1::2].max() - g[0::2].min()) / 1e3
                rows.append(np.concatenate([[block0, grid], np.diff(clk) / cuda.mhz]))
            med = np.median(np.array(rows), axis=0)
            phases = " ".join(f"{x:5.2f}" for x in med[2:])
            how = "cold" if cold else "warm"
            print(f"  {name:11s} {how}: {med[0]:6.2f} | {med[1]:6.2f} | {phases}")
        out = np.zeros(hq * d, np.float32)
        cuda.download(c, out)
        got = out.reshape(d, hq).T
        nmse = float(((got - ref) ** 2).sum() / (ref**2).sum())
        print(f"  {name:11s} NMSE against float64: {nmse:.2e}")
        if not nmse < 1e-10:
            raise SystemExit(f"{name}: wrong result (NMSE {nmse:.2e})")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--windows", default="72:40,172:100,2048:100", help="L:valid,...")
    ap.add_argument("--reps", type=int, default=30, help="launches per setting (median)")
    args = ap.parse_args()
    windows = []
    for w in args.windows.split(","):
        L, _, n = w.partition(":")
        if not (L.isdigit() and n.isdigit() and 1 <= int(n) <= int(L)):
            raise SystemExit(f"--windows: {w!r} is not L:valid with 1 <= valid <= L")
        windows.append((int(L), int(n)))
    cuda = Cuda()
    t = time.time()
    # One module per kernel file, as the backend builds them (the kernels may share one).
    by_file: dict[Path, ctypes.c_void_p] = {}
    mods = {}
    for name in ("attn_decode", "attn_fast", "attn_fast_long"):
        path = kernel_file(name)
        if path not in by_file:
            src, dirs = module_source(path)
            by_file[path] = cuda.compile(src, path.name, ["PHASE_MARKS"], dirs)
        mods[name] = by_file[path]
    flush = cuda.func(cuda.compile(flush_source(12000), "flush.cu", []), "flush")
    print(f"{cuda.arch}, {cuda.sms} SMs, {cuda.mhz:.0f} MHz; compiled in {time.time() - t:.1f} s")
    for L, n in windows:
        run_window(cuda, mods, flush, L, n, args.reps)


if __name__ == "__main__":
    main()
