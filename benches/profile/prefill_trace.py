"""Per-kernel device time of a prompt's prefill on CUDA: where a pp512 goes.

Needs the CUPTI activity library `scripts/gpu/cupti_kernels.c` injected by the driver
(`CUDA_INJECTION64_PATH`; `scripts/gpu/h200_all.sh pftrace` builds and sets it), as
`kernel_trace.py` does for decode steps. For each model and weight dtype the script builds a
`Session` whose ubatch holds the whole prompt, prefills it once (warm-up: modules, cuBLAS
handles, scratch), then `--rounds` times more while CUPTI records every kernel, and prints per
kernel name: launches per prefill, device µs per prefill and its share of the kernel time, and
the prefill's span (first kernel start to last kernel end) against the wall time of the
`decode` call.

Run: `python benches/profile/prefill_trace.py --models 1b --dtypes q4_0,f16 -p 512`.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from kernel_trace import Row, ktrace_lib, read_rows  # the CUPTI library, as for decode steps


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list (cuBLAS names are long)."""
    for sep in ("<", "("):
        name = name.split(sep, 1)[0]
    return name[:48]


def report(model: str, dtype: str, rounds: list[tuple[list[Row], float]]) -> None:
    per: dict[str, list[float]] = defaultdict(list)
    spans, walls, busy = [], [], []
    for rows, wall in rounds:
        kern = [r for r in rows if not r[0].startswith("memcpy:")]
        spans.append((max(r[2] for r in kern) - min(r[1] for r in kern)) / 1e3)
        busy.append(sum(r[2] - r[1] for r in kern) / 1e3)
        walls.append(wall * 1e6)
        for r in kern:
            per[short(r[0])].append((r[2] - r[1]) / 1e3)
    n = len(rounds)
    total = sum(busy) / n
    print(
        f"== {model} {dtype}: span {min(spans):.0f} us, kernels {min(busy):.0f} us, "
        f"wall {min(walls):.0f} us (best of {n})"
    )
    print("| kernel | launches | us/prefill | share |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:25]:
        us = sum(v) / n
        print(f"| {k} | {len(v) // n} | {us:.0f} | {us / total:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="1b")
    ap.add_argument("--dtypes", default="q4_0", help="Llama.random dtypes, comma-separated")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (one ubatch)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--csv-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--backend", default="cuda")
    args = ap.parse_args()
    lib = ktrace_lib()
    import lowsync as ls

    prompt = [1 + i % 1000 for i in range(args.p)]
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            model = ls.Llama.random(name, seed=1, dtype=dtype)
            sess = ls.Session(
                model, backends=[args.backend], n_ctx=args.p + 8, n_ubatch=args.p, policy="staged"
            )
            if not lib.lowsync_ktrace_active():
                raise SystemExit("CUPTI injection is not active (the driver did not load it)")
            sess.decode(prompt)  # warm-up
            sess.seq_rm(0)
            rounds = []
            for rnd in range(args.rounds):
                lib.lowsync_ktrace_begin()
                t0 = time.perf_counter()
                sess.decode(prompt)
                wall = time.perf_counter() - t0
                csv = args.csv_dir / f"pftrace-{name}-{dtype}-r{rnd}.csv"
                lib.lowsync_ktrace_end(str(csv).encode())
                sess.seq_rm(0)
                rounds.append((read_rows(csv.read_text()), wall))
            report(name, dtype, rounds)
            del sess, model


if __name__ == "__main__":
    main()
