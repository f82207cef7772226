"""Registers, stack and local-memory instructions of every kernel in lowsync's precompiled cubins.

The decode products are held to register budgets (`fused_gemv1_q`'s typed entry points to 80, so
three blocks of 8 warps fit a multiprocessor), and a change to a shared helper can move them or
add a spill. This prints, per kernel, what `cuobjdump -res-usage` reports and how many local-memory
loads and stores (`LDL`/`STL`: spills, or a local array) its SASS holds, so the numbers a note
quotes come from one command.

Run: `python scripts/gpu/cubin_regs.py DIR_OR_TXZ [--only NAME,...] [--cuobjdump PATH]`
(a folder of `.cubin` files, or `.carry/cubins.txz` from `make_carry.sh cubins`). `cuobjdump`
(and the nvdisasm beside it) comes from the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm`
wheels; `make_carry.sh cubins` fetches them next to NVRTC.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOOL = Path.home() / ".cache/lowsync-nvrtc/x/nvidia/cu13/bin/cuobjdump"


@dataclass(frozen=True)
class Usage:
    kernel: str
    regs: int
    stack: int
    shared: int


def parse_res_usage(text: str) -> list[Usage]:
    """The kernels of one `cuobjdump -res-usage` listing, in its order."""
    out: list[Usage] = []
    name = None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+?):?\s*$", line)
        if m:
            name = m.group(1)
            continue
        if name is not None:
            f = dict(re.findall(r"([A-Z]+):(\d+)", line))
            if "REG" in f:
                stack, shared = int(f.get("STACK", 0)), int(f.get("SHARED", 0))
                out.append(Usage(name, int(f["REG"]), stack, shared))
                name = None
    return out


def local_ops(sass: str) -> dict[str, int]:
    """Local-memory loads and stores per function of one `cuobjdump -sass` listing."""
    counts: dict[str, int] = {}
    name = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            counts[name] = 0
        elif name is not None and re.search(r"\b(LDL|STL)(\.\w+)*\s", line):
            counts[name] += 1
    return counts


def cubins(src: Path, tmp: Path) -> list[Path]:
    if src.is_dir():
        return sorted(src.rglob("*.cubin"))
    with tarfile.open(src) as t:
        t.extractall(tmp, filter="data")
    return sorted(tmp.rglob("*.cubin"))


def dump(tool: Path, flag: str, cubin: Path) -> str:
    # `-sass` runs nvdisasm, which the wheels put beside cuobjdump.
    env = {**os.environ, "PATH": f"{tool.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(
        [str(tool), flag, str(cubin)], capture_output=True, text=True, check=True, env=env
    )
    return run.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path, help="a folder of .cubin files or a .txz of them")
    ap.add_argument("--only", default="", help="comma-separated kernel-name prefixes")
    ap.add_argument("--cuobjdump", type=Path, default=DEFAULT_TOOL)
    args = ap.parse_args()
    if not args.cuobjdump.is_file():
        sys.exit(f"cubin_regs: no cuobjdump at {args.cuobjdump} (make_carry.sh cubins fetches it)")
    only = [p for p in args.only.split(",") if p]
    print("| kernel | registers | stack | shared | LDL/STL | cubin |")
    print("|---|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for cubin in cubins(args.src, Path(tmp)):
            spills = local_ops(dump(args.cuobjdump, "-sass", cubin))
            for u in parse_res_usage(dump(args.cuobjdump, "-res-usage", cubin)):
                if only and not any(u.kernel.startswith(p) for p in only):
                    continue
                module = cubin.name.rsplit("-sm_", 1)[0]
                ldl = spills.get(u.kernel, 0)
                print(f"| {u.kernel} | {u.regs} | {u.stack} | {u.shared} | {ldl} | {module} |")


if __name__ == "__main__":
    main()
