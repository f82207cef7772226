"""Per-kernel device time of a decoded token on CUDA, inside the replayed graph.

Needs the CUPTI activity library `scripts/gpu/cupti_kernels.c` injected by the driver
(`CUDA_INJECTION64_PATH`; `scripts/gpu/h200_all.sh ktrace` builds and sets it). For each model
the script generates `-n` tokens once to capture, then again while CUPTI records every kernel's
start and end, and prints per kernel name: launches per token, device µs per token and per
launch; then per graph launch (one token): the span from its first kernel's start to its last
kernel's end, the sum of kernel durations, and the difference — time in which no kernel of the
token ran (launch latency between dependent kernels), negative when kernels overlap; and the
time between steps (one step's last kernel to the next one's first). With `KTRACE_MEMCPY=1` the
library records memory copies too, and the copies between steps are listed in order, each with
its start after the earlier step's end and its duration. With `KTRACE_API=1` it records the
host's driver calls too, and the script prints when the host launched each step's graph
relative to the end of the step before (the launch lead: positive when the step was queued
while the one before still ran, as launch-ahead intends) and the driver calls made between two
steps' kernels, in order.

Variants (`--variant NAME=SETTING,...`, repeatable; a SETTING is `VAR=value` or a tuning key
`key=value` of `LOWSYNC_CUDA_TUNE`, docs/tuning.md) compare backend settings side by side in
one process: the model is built once, each variant gets its own session (its backend reads the
variables when it is created), and `--rounds` traces them in turn, A B A B, so that a drift of
the machine touches every variant alike. A last table puts their spans side by side, as ratios
to the first variant. Without `--variant` the one configuration is the environment's; a
variant's tuning keys override those of the environment's `LOWSYNC_CUDA_TUNE` and keep the rest.

Run: `python benches/profile/kernel_trace.py --models 1b -n 64 --csv-dir /tmp/kt`, or
`... --variant base --variant nopdl=pdl=0 --variant b3=pdl=1,gemv_blocks=3 --rounds 3`; a GGUF
file (llama-quantize's Q4_K_M, say) with `--models "" --files PATH` (the CSVs are named by the
file's stem).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

Row = tuple[str, int, int, int]  # kernel name, start ns, end ns, correlation id (launch)

_VAR = re.compile(r"[A-Z][A-Z0-9_]*")
_KEY = re.compile(r"[a-z][a-z0-9_]*")
TUNE = "LOWSYNC_CUDA_TUNE"


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME` or `NAME=SETTING,SETTING,...` -> (name, variables). A SETTING is `VAR=value` (an
    environment variable) or `key=value` (a key of `LOWSYNC_CUDA_TUNE`, docs/tuning.md); the
    keys are joined into that variable. A malformed one is an error that names it."""
    name, _, rest = text.partition("=")
    if not re.fullmatch(r"[\w.+-]+", name):
        raise ValueError(f"variant {text!r}: expected NAME or NAME=SETTING,...")
    env: dict[str, str] = {}
    tune: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if eq and key == TUNE:
            raise ValueError(f"variant {text!r}: give {TUNE}'s keys as key=value, not {item!r}")
        if eq and _VAR.fullmatch(key):
            env[key] = value
        elif eq and value and _KEY.fullmatch(key):
            tune[key] = value
        else:
            raise ValueError(f"variant {text!r}: {item!r} is not VAR=value or key=value")
    if tune:
        env[TUNE] = ",".join(f"{k}={v}" for k, v in tune.items())
    return name, env


def tune_items(value: str) -> dict[str, str]:
    """`LOWSYNC_CUDA_TUNE`'s `key=value,...` as a dict (an item without `=` keeps its text as
    the key, for the backend to reject)."""
    items = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        key, _, v = item.partition("=")
        items[key] = v
    return items


def with_tune(env: dict[str, str], ambient: str) -> dict[str, str]:
    """A variant's variables over the environment's: its tuning keys override those of the
    `LOWSYNC_CUDA_TUNE` the process runs under (`ambient`) and keep the others."""
    if TUNE not in env or not ambient:
        return env
    merged = {**tune_items(ambient), **tune_items(env[TUNE])}
    return {**env, TUNE: ",".join(f"{k}={v}" if v else k for k, v in merged.items())}


def settings(env: dict[str, str]) -> str:
    """A variant's variables as VAR=value,... ("-" for none)."""
    return ",".join(f"{k}={v}" for k, v in env.items()) or "-"


def read_rows(text: str) -> list[Row]:
    """The CUPTI library's CSV: name,start_ns,end_ns,correlation_id (names may hold commas)."""
    rows = []
    for line in text.splitlines():
        kname, s, e, c = line.rsplit(",", 3)
        rows.append((kname, int(s), int(e), int(c)))
    return rows


def is_api(r: Row) -> bool:
    """A host driver call's row (`KTRACE_API=1`): named api:<function>."""
    return r[0].startswith("api:")


def launch_leads(steps: list[list[Row]], apis: list[Row]) -> list[float]:
    """For consecutive steps, how long before the earlier step's last kernel ended the host's
    call that launched the later one returned (µs; negative: the device waited for the host)."""
    launch = {r[3]: r for r in apis}
    order = sorted(steps, key=lambda st: st[0][1])
    leads = []
    for a, b in itertools.pairwise(order):
        call = launch.get(b[0][3])
        if call is not None:
            leads.append((max(r[2] for r in a) - call[2]) / 1e3)
    return leads


def is_copy(r: Row) -> bool:
    """A memory copy's row (`KTRACE_MEMCPY=1`): named memcpy:<kind>:<bytes>."""
    return r[0].startswith("memcpy:")


def outside_steps(rows: list[Row], steps: list[list[Row]]) -> list[Row]:
    """The rows that belong to no decode step: memory copies (`KTRACE_MEMCPY=1`) and kernels
    launched on their own, such as the copy kernels that run between two steps' graphs."""
    inside = {r[3] for step in steps for r in step}
    return [r for r in rows if r[3] not in inside]


def step_gaps(steps: list[list[Row]]) -> list[tuple[int, int]]:
    """(last kernel end, next step's first kernel start) in ns for consecutive steps in time
    order."""
    order = sorted(steps, key=lambda st: st[0][1])
    return [(max(r[2] for r in a), b[0][1]) for a, b in itertools.pairwise(order)]


def between_copies(steps: list[list[Row]], copies: list[Row]) -> list[tuple[str, float, float]]:
    """The copies (or other rows outside the steps: `outside_steps`) that run between
    consecutive steps, in order: (name, start after the earlier step's last kernel, duration),
    medians in µs over the gaps with the most common sequence (which leaves out the gaps between
    rounds of a trace, where the next prompt runs)."""
    seqs = []
    for end, nxt in step_gaps(steps):
        inside = sorted((c for c in copies if end <= c[1] < nxt), key=lambda c: c[1])
        seqs.append([(c[0], (c[1] - end) / 1e3, (c[2] - c[1]) / 1e3) for c in inside])
    if not seqs:
        return []
    kinds = Counter(tuple(x[0] for x in q) for q in seqs).most_common(1)[0][0]
    same = [q for q in seqs if tuple(x[0] for x in q) == kinds]
    return [
        (k, statistics.median(q[i][1] for q in same), statistics.median(q[i][2] for q in same))
        for i, k in enumerate(kinds)
    ]


def decode_steps(rows: list[Row]) -> tuple[list[list[Row]], int, int]:
    """The decode steps among the traced launches, each a list of its kernels by start time;
    the kernels per step and the number of launches. Steps are the most common launch size among
    launches of more than one kernel (a prompt's graph has another size, and a prompt run
    eagerly — one kernel per launch — can outnumber the steps)."""
    by_corr: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        if not is_copy(r):
            by_corr[r[3]].append(r)
    sizes = [len(v) for v in by_corr.values() if len(v) > 1] or [1]
    mode = statistics.mode(sizes)
    steps = [sorted(v, key=lambda r: r[1]) for v in by_corr.values() if len(v) == mode]
    return steps, mode, len(by_corr)


@dataclass
class Summary:
    """What the traced steps of one configuration say (µs)."""

    steps: int
    kernels_per_step: int
    span: float  # median first start -> last end per step
    busy: float  # median sum of kernel durations per step
    per_name: dict[str, list[float]] = field(default_factory=dict)  # every launch's duration
    positions: list[tuple[str, float, float]] = field(default_factory=list)  # name, dur, exposed
    exposed: dict[str, float] = field(default_factory=dict)  # per name, summed over positions
    # median from one step's last kernel end to the next step's first kernel start (what a
    # token spends outside its graph's kernels: copies, graph launch); None with one step
    between: float | None = None


def summarize(steps: list[list[Row]]) -> Summary:
    """Medians over `steps` (all of one size). A kernel's exposed time is how far it moves the
    step's end past every kernel before it: with programmatic dependent launch kernels start
    early and overlap, so a duration alone overstates what a kernel costs the token."""
    if not steps:
        raise ValueError("no decode steps were traced")
    per_name: dict[str, list[float]] = defaultdict(list)
    spans, busy = [], []
    for step in steps:
        spans.append((max(r[2] for r in step) - step[0][1]) / 1e3)
        busy.append(sum(r[2] - r[1] for r in step) / 1e3)
        for r in step:
            per_name[r[0]].append((r[2] - r[1]) / 1e3)
    positions = []
    exposed: dict[str, float] = defaultdict(float)
    for i in range(len(steps[0])):
        durs, exps = [], []
        for step in steps:
            prev_end = max((r[2] for r in step[:i]), default=step[0][1])
            durs.append((step[i][2] - step[i][1]) / 1e3)
            exps.append(max(step[i][2] - prev_end, 0) / 1e3)
        name = steps[0][i][0]
        positions.append((name, statistics.median(durs), statistics.median(exps)))
        exposed[name] += statistics.median(exps)
    gaps = [(nxt - end) / 1e3 for end, nxt in step_gaps(steps)]
    return Summary(
        between=statistics.median(gaps) if gaps else None,
        steps=len(steps),
        kernels_per_step=len(steps[0]),
        span=statistics.median(spans),
        busy=statistics.median(busy),
        per_name=dict(per_name),
        positions=positions,
        exposed=dict(exposed),
    )


def report(s: Summary) -> None:
    ns = s.steps
    print("| kernel | per token | us/token | us/launch |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in sorted(s.per_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {k[:40]} | {len(v) / ns:.0f} | {sum(v) / ns:.1f} | {sum(v) / len(v):.2f} |")
    print("| pos | kernel | us (median) | exposed us (median) |")
    print("| ---: | --- | ---: | ---: |")
    n_k = len(s.positions)
    for i, (name, dur, exp) in enumerate(s.positions):
        if i < 20 or i >= n_k - 6:
            print(f"| {i} | {name[:40]} | {dur:.2f} | {exp:.2f} |")
    print("| kernel | exposed us/token |")
    print("| --- | ---: |")
    for k, e in sorted(s.exposed.items(), key=lambda kv: -kv[1]):
        print(f"| {k[:40]} | {e:.1f} |")
    gap = s.span - s.busy
    print(
        f"per token (median): span {s.span:.1f} us, kernels {s.busy:.1f} us, between kernels "
        f"{gap:.1f} us ({gap / max(s.kernels_per_step - 1, 1):.2f} us per boundary)"
    )
    if s.between is not None:
        print(
            f"between steps (median): {s.between:.1f} us from a step's last kernel to the next "
            "step's first (the copies between graphs and the graph launch)"
        )


def side_by_side(model: str, results: list[tuple[str, dict[str, str], Summary, float]]) -> None:
    """One row per variant: span and kernel time per token, and the span's ratio to the
    first variant's."""
    print(f"{model}: variants side by side (one process, rounds interleaved)")
    print("| variant | settings | span us/token | kernels us/token | span vs first | tok/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    first = results[0][2].span
    for name, env, s, tps in results:
        print(
            f"| {name} | {settings(env)} | {s.span:.1f} | {s.busy:.1f} | {s.span / first:.3f} | "
            f"{tps:.1f} |"
        )


def ktrace_lib() -> ctypes.CDLL:
    """The CUPTI library the driver injected (`CUDA_INJECTION64_PATH`), its calls typed."""
    lib_path = os.environ.get("CUDA_INJECTION64_PATH")
    if not lib_path:
        raise SystemExit("CUDA_INJECTION64_PATH is not set: build scripts/gpu/cupti_kernels.c")
    lib = ctypes.CDLL(lib_path)
    lib.lowsync_ktrace_end.restype = ctypes.c_long
    lib.lowsync_ktrace_end.argtypes = [ctypes.c_char_p]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="1b", help="built-in models (random weights, --dtype)")
    ap.add_argument("--files", default="", help="GGUF files, comma-separated (after --models)")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--csv-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--n-ctx", type=int, default=0, help="KV cache rows (default: just enough)")
    ap.add_argument("--prompt-len", type=int, default=4, help="prompt tokens before decoding")
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "f16", "bf16"])
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME or NAME=SETTING,... (VAR=value, or key=value of LOWSYNC_CUDA_TUNE): a "
        "configuration traced side by side",
    )
    ap.add_argument("--rounds", type=int, default=1, help="traces per variant, interleaved")
    ap.add_argument("--backend", default="cuda", help="backend of the sessions (tests: cpu)")
    args = ap.parse_args()
    try:
        variants = [parse_variant(v) for v in args.variant] or [("", {})]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if len({v[0] for v in variants}) != len(variants):
        raise SystemExit("variant names must differ")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if args.prompt_len < 1:
        raise SystemExit("--prompt-len must be at least 1")
    lib = ktrace_lib()
    import lowsync as ls
    from lowsync.bench import env_vars

    prompt = [1 + i % 1000 for i in range(args.prompt_len)]
    ambient = os.environ.get(TUNE, "")
    sources = [
        (m, lambda m=m: ls.Llama.random(m, seed=1, dtype=args.dtype))
        for m in args.models.split(",")
        if m
    ]
    sources += [(Path(f).stem, lambda f=f: ls.load_gguf(f)) for f in args.files.split(",") if f]
    for name, load in sources:
        model = load()
        n_ctx = args.n_ctx or args.prompt_len + args.n + 8
        sessions = []
        for _, env in variants:
            with env_vars({"LOWSYNC_CUDA_GRAPHS": "1", **with_tune(env, ambient)}):
                sess = ls.Session(
                    model,
                    backends=[args.backend],
                    n_ctx=n_ctx,
                    policy="staged",
                    kv_dtype=args.kv_dtype,
                )
            if not lib.lowsync_ktrace_active():
                raise SystemExit(
                    "CUPTI injection is not active (the driver did not load the library)"
                )
            sess.generate(prompt, max_new_tokens=args.n, seq_id=0)  # capture
            sess.seq_rm(0)
            sessions.append(sess)
        steps: list[list[list[Row]]] = [[] for _ in variants]
        copies: list[list[Row]] = [[] for _ in variants]
        api_rows: list[list[Row]] = [[] for _ in variants]
        tps: list[list[float]] = [[] for _ in variants]
        pdl = tune_items(ambient).get("pdl", "1")
        for rnd in range(args.rounds):
            for i, ((vname, _), sess) in enumerate(zip(variants, sessions, strict=True)):
                lib.lowsync_ktrace_begin()
                sess.generate(prompt, max_new_tokens=args.n, seq_id=0)
                tag = f"-{vname}" if vname else ""
                csv = args.csv_dir / f"ktrace-{name}-pdl{pdl}{tag}-r{rnd}.csv"
                nrec = lib.lowsync_ktrace_end(str(csv).encode())
                sess.seq_rm(0)
                st = sess.last_generate
                assert st is not None
                rows = read_rows(csv.read_text())
                api_rows[i].extend(r for r in rows if is_api(r))
                rows = [r for r in rows if not is_api(r)]
                got, mode, launches = decode_steps(rows)
                copies[i].extend(outside_steps(rows, got))
                print(
                    f"{name}{' ' + vname if vname else ''} round {rnd}: {nrec} kernel records, "
                    f"{launches} launches, {len(got)} decode steps of {mode} kernels; "
                    f"{st.tg_tps:.1f} tok/s"
                )
                steps[i].extend(got)
                tps[i].append(st.tg_tps)
        results = []
        for (vname, env), vsteps, vcopies, vtps, vapis in zip(
            variants, steps, copies, tps, api_rows, strict=True
        ):
            sizes = {len(s) for s in vsteps}
            if len(sizes) > 1:
                raise SystemExit(f"{name} {vname}: rounds traced steps of sizes {sorted(sizes)}")
            s = summarize(vsteps)
            if vname:
                print(f"== {name} {vname} ({settings(env)})")
            report(s)
            for cname, at, dur in between_copies(vsteps, vcopies):
                print(f"  between steps: {cname} from {at:.1f} us after a step's end, {dur:.1f} us")
            leads = launch_leads(vsteps, vapis)
            if leads:
                lead = statistics.median(leads)
                print(
                    f"launch lead (median): a step's graph launch returned {lead:.1f} us before "
                    "the step ahead of it ended (negative: after; the device waited)"
                )
                for cname, at, dur in between_copies(vsteps, vapis):
                    print(f"  host call: {cname} from {at:.1f} us after a step's end, {dur:.1f} us")
            results.append((vname, env, s, statistics.median(vtps)))
        if len(variants) > 1:
            side_by_side(name, results)


if __name__ == "__main__":
    main()
