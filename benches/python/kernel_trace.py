"""Per-kernel device time of a decoded token on CUDA, inside the replayed graph.

Needs the CUPTI activity library `scripts/gpu/cupti_kernels.c` injected by the driver
(`CUDA_INJECTION64_PATH`; `scripts/gpu/h200_all.sh ktrace` builds and sets it). For each model
the script generates `-n` tokens once to capture, then again while CUPTI records every kernel's
start and end, and prints per kernel name: launches per token, device µs per token and per
launch; then per graph launch (one token): the span from its first kernel's start to its last
kernel's end, the sum of kernel durations, and the difference — time in which no kernel of the
token ran (launch latency between dependent kernels), negative when kernels overlap.

Run: `python benches/python/kernel_trace.py --models 1b -n 64 --csv-dir /tmp/kt`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
from collections import defaultdict
from pathlib import Path

import lowsync as ls
from lowsync.bench import env_vars


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="1b")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--csv-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--n-ctx", type=int, default=0, help="KV cache rows (default: just enough)")
    args = ap.parse_args()
    lib_path = os.environ.get("CUDA_INJECTION64_PATH")
    if not lib_path:
        raise SystemExit("CUDA_INJECTION64_PATH is not set: build scripts/gpu/cupti_kernels.c")
    lib = ctypes.CDLL(lib_path)
    lib.lowsync_ktrace_end.restype = ctypes.c_long
    lib.lowsync_ktrace_end.argtypes = [ctypes.c_char_p]
    for name in args.models.split(","):
        model = ls.Llama.random(name, seed=1, dtype=args.dtype)
        with env_vars({"LOWSYNC_CUDA_GRAPHS": "1"}):
            n_ctx = args.n_ctx or 4 + args.n + 8
            sess = ls.Session(model, backends=["cuda"], n_ctx=n_ctx, policy="staged")
        if not lib.lowsync_ktrace_active():
            raise SystemExit("CUPTI injection is not active (the driver did not load the library)")
        prompt = [1, 2, 3, 4]
        sess.generate(prompt, max_new_tokens=args.n, seq_id=0)
        sess.seq_rm(0)
        lib.lowsync_ktrace_begin()
        sess.generate(prompt, max_new_tokens=args.n, seq_id=0)
        csv = args.csv_dir / f"ktrace-{name}-pdl{os.environ.get('LOWSYNC_CUDA_PDL', '1')}.csv"
        nrec = lib.lowsync_ktrace_end(str(csv).encode())
        st = sess.last_generate
        assert st is not None
        rows = []
        for line in csv.read_text().splitlines():
            kname, s, e, c = line.rsplit(",", 3)
            rows.append((kname, int(s), int(e), int(c)))
        by_corr: dict[int, list[tuple[str, int, int, int]]] = defaultdict(list)
        for r in rows:
            by_corr[r[3]].append(r)
        # Tokens: the decode steps' graph launches (prompt launches have other kernel counts;
        # a prompt run eagerly, one kernel per launch, can outnumber them).
        sizes = [len(v) for v in by_corr.values() if len(v) > 1] or [1]
        mode = statistics.mode(sizes)
        steps = [sorted(v, key=lambda r: r[1]) for v in by_corr.values() if len(v) == mode]
        print(
            f"{name}: {nrec} kernel records, {len(by_corr)} launches, {len(steps)} decode "
            f"steps of {mode} kernels; {st.tg_tps:.1f} tok/s"
        )
        per_name: dict[str, list[float]] = defaultdict(list)
        spans, busy = [], []
        for step in steps:
            spans.append((max(r[2] for r in step) - step[0][1]) / 1e3)
            busy.append(sum(r[2] - r[1] for r in step) / 1e3)
            for r in step:
                per_name[r[0]].append((r[2] - r[1]) / 1e3)
        ns = len(steps)
        print("| kernel | per token | us/token | us/launch |")
        print("| --- | ---: | ---: | ---: |")
        for k, v in sorted(per_name.items(), key=lambda kv: -sum(kv[1])):
            print(f"| {k[:40]} | {len(v) / ns:.0f} | {sum(v) / ns:.1f} | {sum(v) / len(v):.2f} |")
        # Exposed time: how far each kernel moves the token's end past every kernel before it
        # (with programmatic dependent launch kernels start early and overlap, so a duration
        # alone overstates what a kernel costs the token).
        print("| pos | kernel | us (median) | exposed us (median) |")
        print("| ---: | --- | ---: | ---: |")
        n_k = len(steps[0])
        exposed_by_name: dict[str, float] = defaultdict(float)
        for i in range(n_k):
            durs, exps = [], []
            for step in steps:
                prev_end = max((r[2] for r in step[:i]), default=step[0][1])
                durs.append((step[i][2] - step[i][1]) / 1e3)
                exps.append(max(step[i][2] - prev_end, 0) / 1e3)
            exposed_by_name[steps[0][i][0]] += statistics.median(exps)
            if i < 20 or i >= n_k - 6:
                print(
                    f"| {i} | {steps[0][i][0][:40]} | {statistics.median(durs):.2f} | "
                    f"{statistics.median(exps):.2f} |"
                )
        print("| kernel | exposed us/token |")
        print("| --- | ---: |")
        for k, e in sorted(exposed_by_name.items(), key=lambda kv: -kv[1]):
            print(f"| {k[:40]} | {e:.1f} |")
        sp, bu = statistics.median(spans), statistics.median(busy)
        print(
            f"per token (median): span {sp:.1f} us, kernels {bu:.1f} us, between kernels "
            f"{sp - bu:.1f} us ({(sp - bu) / max(mode - 1, 1):.2f} us per boundary)"
        )


if __name__ == "__main__":
    main()
