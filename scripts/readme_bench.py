"""Runs `lowsync bench` and puts its table into README.md, between the bench markers.

Why: README shows one current `lowsync bench` table; copied by hand it goes stale as soon as the
bench gains a column. This script is the only way the table gets there, and
tests/test_readme.py checks that the table's header row is the real bench's.

Run from the repository root, with lowsync installed (or `PYTHONPATH=python` beside a built
native module): `python scripts/readme_bench.py` (default `--backend cpu,cpu-async`; any other
`lowsync bench` arguments after `--`, e.g. `-- --backend cpu,cpu-async,vulkan -n 64`).
`--print` shows the block without touching README.md.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN = "<!-- bench:begin (scripts/readme_bench.py writes this block) -->"
END = "<!-- bench:end -->"
DEFAULT_ARGS = ("--backend", "cpu,cpu-async")


def run_bench(args: Sequence[str]) -> str:
    """The bench's stdout (the table and its note line); the progress bar on stderr is dropped."""
    argv = [sys.executable, "-m", "lowsync.cli", "bench", *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"lowsync bench failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout.strip()


def block(args: Sequence[str], output: str) -> str:
    """The README block: the command as a user types it, then what it printed."""
    command = shlex.join(["lowsync", "bench", *args])
    return f"{BEGIN}\n```text\n$ {command}\n{output}\n```\n{END}"


def replace_block(text: str, new_block: str) -> str:
    """`text` with the part from the begin marker through the end marker replaced."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {BEGIN!r} ... {END!r} block")
    return text[:start] + new_block + text[end + len(END) :]


def table_header(text: str) -> list[str]:
    """The column names of the first markdown table inside the bench block."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError("no bench block")
    for line in text[start:end].splitlines():
        if line.startswith("|"):
            return [c.strip() for c in line.strip().strip("|").split("|")]
    raise ValueError("the bench block holds no table")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--print", action="store_true", help="print the block, leave README alone")
    ap.add_argument("bench_args", nargs="*", help="lowsync bench arguments (after --)")
    args = ap.parse_args()
    bench_args = args.bench_args or list(DEFAULT_ARGS)
    new = block(bench_args, run_bench(bench_args))
    if args.print:
        print(new)
        return
    README.write_text(replace_block(README.read_text(), new))
    print(f"{README}: bench table replaced ({len(new.splitlines())} lines)")


if __name__ == "__main__":
    main()
