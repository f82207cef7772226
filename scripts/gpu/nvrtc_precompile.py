"""Compiles lowsync's CUDA kernel modules into cubins named as the CUDA backend's on-disk cache
names them, so a fresh GPU machine loads them instead of compiling.

Why: NVRTC compiles each module on its first use and the quantized modules take minutes of one
core; a GPU machine that starts bare pays that on every start. The cache file name is
`{module}-{arch}-{key:016x}.cubin` (`{module}-qt{code}-...` for a module of `PER_BLOCK_TYPE`,
compiled once per block type with `-DLOWSYNC_QT={code}`, and `{module}-part{n}-...` for one
of `PARTS`, compiled in parts with `-DLOWSYNC_PART={n}`), with `key` the FNV-1a hash
`kernels.rs` computes over the module's full source and its options; any NVRTC 13 writes a
cubin the driver loads.

Strategy: read the module list from `crates/backend-cuda/src/kernels.rs` (each module is
`common.cuh` + its `include_str!` parts joined by newlines), hash as `kernels::fnv1a` does, and
compile the modules missing from the output folder with NVRTC through ctypes, one process per
module.

Run (NVRTC from the `nvidia-cuda-nvrtc` wheel):
    LD_LIBRARY_PATH=.../nvidia/cu13/lib python scripts/gpu/nvrtc_precompile.py OUT_DIR \
        [--arch sm_90] [--only quant,fused_gemv]
Copy OUT_DIR's files to `~/.cache/lowsync/cuda/` on the GPU machine.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "crates" / "backend-cuda" / "src"


def fnv1a(parts: list[bytes]) -> int:
    h = 0xCBF29CE484222325
    for p in parts:
        for b in p:
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ 0xFF) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def modules() -> dict[str, str]:
    """name -> full source (common.cuh, a newline, the module's parts) as kernels.rs builds it;
    the modules compiled per block type appear once here (`units` expands them)."""
    text = (SRC / "kernels.rs").read_text()
    common = (SRC / re.search(r'COMMON: &str = include_str!\("([^"]+)"\)', text)[1]).read_text()
    block = text[text.index("const MODULES") :]
    block = block[: block.index("\n];")]
    out: dict[str, str] = {}
    entry = r'\(\s*"(\w+)",\s*(include_str!\("[^"]+"\)|concat!\((.*?)\)),?\s*\)'
    for m in re.finditer(entry, block, re.S):
        body = m[2]
        pieces = re.findall(r'include_str!\("([^"]+)"\)|"(\\n)"', body)
        src = "".join((SRC / f).read_text() if f else "\n" for f, _ in pieces)
        out[m[1]] = f"{common}\n{src}"
    if not out:
        sys.exit("no modules found in kernels.rs")
    return out


def builds() -> tuple[list[str], list[int], dict[str, int]]:
    """kernels.rs's `PER_BLOCK_TYPE` module names, `BLOCK_TYPES` codes and `PARTS`."""
    text = (SRC / "kernels.rs").read_text()
    names = re.search(r"const PER_BLOCK_TYPE: &\[&str\] = &\[([^\]]*)\];", text)
    codes = re.search(r"const BLOCK_TYPES: \[i32; \d+\] = \[([^\]]*)\];", text)
    parts = re.search(r"const PARTS: &\[\(&str, u8\)\] = &\[(.*?)\];", text, re.S)
    if not names or not codes or not parts:
        sys.exit("PER_BLOCK_TYPE, BLOCK_TYPES or PARTS not found in kernels.rs")
    typed = re.findall(r'"(\w+)"', names[1])
    split = {m[0]: int(m[1]) for m in re.findall(r'\(\s*"(\w+)",\s*(\d+)\s*\)', parts[1])}
    return typed, [int(c) for c in codes[1].split(",") if c.strip()], split


def units(arch: str, kdefs: Sequence[str] = ()) -> list[tuple[str, str, list[str]]]:
    """(label, full source, NVRTC options) of every module as kernels.rs compiles it, with the
    kernel source variants `kdefs` (`LOWSYNC_CUDA_TUNE=kdef=`)."""
    typed, codes, split = builds()
    out = []
    extra = [f"-DLS_KDEF_{d}" for d in kdefs]
    for name, src in modules().items():
        base = [f"--gpu-architecture={arch}"]
        if name in typed:
            out += [(f"{name}-qt{q}", src, [*base, f"-DLOWSYNC_QT={q}", *extra]) for q in codes]
        elif name in split:
            n = split[name]
            out += [
                (f"{name}-part{p}", src, [*base, f"-DLOWSYNC_PART={p}", *extra])
                for p in range(1, n + 1)
            ]
        else:
            out.append((name, src, [*base, *extra]))
    return out


def compile_one(name: str, src: str, options: list[str], dest: Path) -> str:
    nvrtc = ctypes.CDLL("libnvrtc.so.13")
    prog = ctypes.c_void_p()
    ck = lambda r, what: r == 0 or sys.exit(f"{name}: {what} failed ({r})")  # noqa: E731
    created = nvrtc.nvrtcCreateProgram(
        ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None
    )
    ck(created, "create")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    if nvrtc.nvrtcCompileProgram(prog, len(options), opts) != 0:
        n = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        return f"{name}: compile failed\n{log.value.decode(errors='replace')}"
    n = ctypes.c_size_t()
    ck(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "cubin size")
    buf = ctypes.create_string_buffer(n.value)
    ck(nvrtc.nvrtcGetCUBIN(prog, buf), "cubin")
    dest.write_bytes(buf.raw)
    return f"{dest.name}: {n.value} bytes"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--only", default="", help="comma-separated module names (default: all)")
    ap.add_argument(
        "--kdef",
        default="",
        help="kernel source variants, +-separated (LOWSYNC_CUDA_TUNE's kdef), built into every "
        "module (--only limits them)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = {m for m in args.only.split(",") if m}
    jobs = []
    for label, src, options in units(args.arch, [d for d in args.kdef.split("+") if d]):
        if only and re.split(r"-qt|-part", label)[0] not in only:
            continue
        key = fnv1a([src.encode(), "".join(options).encode()])
        dest = args.out / f"{label}-{args.arch}-{key:016x}.cubin"
        if dest.is_file():
            print(f"{dest.name}: present")
            continue
        jobs.append((label, src, options, dest))
    with ProcessPoolExecutor() as pool:
        for line in pool.map(compile_one, *zip(*jobs, strict=True)) if jobs else []:
            print(line, flush=True)


if __name__ == "__main__":
    main()
