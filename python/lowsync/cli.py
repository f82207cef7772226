"""The `lowsync` command line: `lowsync bench` (the main job) and `lowsync batched-bench`.

`lowsync bench` decodes a prompt and generates tokens with a model (the built-in "tiny" unless
`-m FILE.gguf`) on every usable backend under every sync policy and prints one row per pair as
it finishes: prompt and generation tokens/s and, per generated token, host waits, driver syncs,
elided syncs, submits, empty submits, H2D and D2H copies and reallocations. Stopped by Ctrl-C or
`--timeout`, it keeps (and with `--json` prints) the rows finished so far. `lowsync
batched-bench` mirrors llama-batched-bench (`-npp`, `-ntg`, `-npl`, `-pps`) and fails when a
run reallocates.

By default the bench runs every available backend except those that would read as nonsense or
take minutes next to the others: `noop` (runs no kernel) and Vulkan devices of CPU type (a
software rasteriser such as lavapipe). Either runs when named with `--backend`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from lowsync import _native
from lowsync._native import LowsyncError, available_backends, version
from lowsync.bench import (
    POLICIES,
    BatchedRow,
    BenchRow,
    Progress,
    RowPrinter,
    batched_n_ctx,
    format_batched,
    legacy_env,
    legacy_switches,
    parse_backends,
    run_batched,
    run_bench,
)
from lowsync.models.llama import BUILTIN_CONFIGS, Llama
from lowsync.quants import QUANTIZABLE

# Backends the bench skips unless asked for by name: `noop` runs no kernel, so its rows measure
# host overhead alone and would read as absurd throughput next to real backends.
_OPT_IN_BACKENDS = frozenset({"noop"})

# Exit statuses of a bench stopped part-way (as a shell reports Ctrl-C and timeout(1) a timeout).
EXIT_INTERRUPTED = 130
EXIT_TIMEOUT = 124


class BenchTimeout(Exception):
    """`--timeout` ran out (raised in the main thread by SIGALRM, also inside a native wait)."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _ahead_list(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        if item.strip() not in ("0", "1"):
            raise argparse.ArgumentTypeError(f"expected a list of 0 and 1, got {text!r}")
        out.append(int(item))
    return sorted(set(out))


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        metavar="MODEL",
        default="tiny",
        help=f"a GGUF file, or a built-in model ({', '.join(BUILTIN_CONFIGS)}); default: tiny",
    )
    p.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="backend to run (repeatable or comma list; `a+b` is one context of several "
        "backends); default: every available backend except noop",
    )
    p.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help="sync policy (repeatable or comma list); default: stock, relaxed and staged",
    )
    p.add_argument(
        "-ub",
        "--n-ubatch",
        type=_positive,
        default=32,
        metavar="N",
        help="tokens per ubatch (the prefill graph's size); default: 32",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt and built-in weights")
    p.add_argument(
        "-t",
        "--type",
        choices=("f32", "f16", "bf16", *QUANTIZABLE),
        default="f32",
        help="weight type of a built-in model (default: f32; the q* types are quantized with the "
        "gguf package; GGUF files keep their own)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowsync", description="lowsync command line")
    parser.add_argument("--version", action="version", version=f"lowsync {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="prompt and generation speed with host-side counters per generated token",
        description=(
            "Decodes a prompt and generates tokens greedily on each backend under each sync "
            "policy; prints pp and tg tokens/s and, per generated token, the backends' counters."
        ),
    )
    _add_common(bench)
    bench.add_argument("-p", "--n-prompt", type=_positive, default=32, help="prompt tokens (32)")
    bench.add_argument("-n", "--n-gen", type=_positive, default=32, help="generated tokens (32)")
    bench.add_argument("-r", "--repetitions", type=_positive, default=1, help="repetitions (1)")
    bench.add_argument(
        "--launch-ahead",
        type=_ahead_list,
        default=[0, 1],
        metavar="0,1",
        help="staged rows without (0) and with (1) launch-ahead: step t+1 queued before token "
        "t is read, fed on the device; a backend that cannot gets no 1 row (default: 0,1)",
    )
    bench.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="stop after SECONDS (also inside a row) and keep the rows finished by then "
        "(exit status 124); default: no limit",
    )

    batched = sub.add_parser(
        "batched-bench",
        help="llama-batched-bench: parallel sequences, optionally sharing one prompt",
        description=(
            "For each PP x TG x B: decode B prompts of PP tokens (or one shared through seq_cp "
            "with -pps), then TG steps of B tokens; reports speeds and reallocations (must be 0)."
        ),
    )
    _add_common(batched)
    batched.add_argument("-npp", type=_int_list, default=[128], help="prompt tokens (list)")
    batched.add_argument("-ntg", type=_int_list, default=[32], help="generated tokens (list)")
    batched.add_argument("-npl", type=_int_list, default=[1, 2, 4], help="parallel sequences")
    batched.add_argument("-pps", action="store_true", help="share one prompt between sequences")
    batched.add_argument("-c", "--n-ctx", type=_positive, help="KV cells (default: what fits)")
    return parser


def _load_model(spec: str, seed: int, command: str, dtype: str = "f32") -> Llama | None:
    """The model named on the command line, or None after printing why it cannot be loaded."""
    if spec in BUILTIN_CONFIGS:
        return Llama.random(spec, seed=seed, dtype=dtype)
    from lowsync.gguf import load_gguf

    try:
        return load_gguf(spec)
    except (LowsyncError, OSError) as e:
        print(f"lowsync {command}: {e}", file=sys.stderr)
        return None


def software_devices(names: Sequence[str]) -> list[str]:
    """The Vulkan devices among `names` whose device type is CPU (a software rasteriser such
    as lavapipe), as the native module reports it.

    The type comes from `lowsync._native.device_type(name)` (VkPhysicalDeviceType: "cpu",
    "discrete_gpu", ...), never from a device name; a native module without that function
    cannot tell, and then no device counts as one."""
    device_type = getattr(_native, "device_type", None)
    if device_type is None:
        return []
    return [b for b in names if b.split(":", 1)[0] == "vulkan" and device_type(b) == "cpu"]


def _backends(args: argparse.Namespace) -> list[list[str]]:
    if args.backend:
        return parse_backends(args.backend)
    names = [b for b in available_backends() if b not in _OPT_IN_BACKENDS]
    skipped = software_devices(names)
    if skipped:
        print(
            f"lowsync {args.command}: skipping {', '.join(skipped)}: a CPU-type Vulkan device "
            "(software rasteriser); name it with --backend to run it",
            file=sys.stderr,
        )
    return [[b] for b in names if b not in skipped]


def _policies(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    if not args.policy:
        return list(POLICIES)
    out = [p.strip() for v in args.policy for p in v.split(",") if p.strip()]
    for p in out:
        if p not in POLICIES:
            parser.error(f"unknown policy {p!r} (choose from {', '.join(POLICIES)})")
    return out


@contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raises `BenchTimeout` in the block once `seconds` have passed: through SIGALRM, so a
    native wait is interrupted too (it polls Python's signal handlers). Outside the main thread,
    or without `setitimer`, nothing is armed and the caller checks between rows."""
    if (
        seconds is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def ring(signum: int, frame: FrameType | None) -> None:
        raise BenchTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    policies = _policies(args, parser)
    model = _load_model(args.model, args.seed, "bench", args.type)
    if model is None:
        return 1
    # Launch-ahead needs the staged policy: other policies run the plain loop only.
    runs = [
        (b, p, ahead)
        for b in _backends(args)
        for p in policies
        for ahead in (args.launch_ahead if p == "staged" else [0])
    ]
    labels = [
        (
            "+".join(b),
            p + ("+ahead" if ahead else "") + ("*" if legacy_env(p, b) else ""),
        )
        for b, p, ahead in runs
    ]
    progress = Progress(len(runs) * args.repetitions)
    printer = None if args.json else RowPrinter(sys.stdout, model, labels, args.repetitions)
    rows: list[BenchRow] = []
    label = ""
    status, stopped = 0, ""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        with _deadline(args.timeout):
            for backends, policy, ahead in runs:
                if deadline is not None and time.monotonic() >= deadline:
                    raise BenchTimeout(f"timed out after {args.timeout:g} s")
                label = f"{'+'.join(backends)}/{policy}{'+ahead' if ahead else ''}"
                row = run_bench(
                    model,
                    backends,
                    policy,
                    n_prompt=args.n_prompt,
                    n_gen=args.n_gen,
                    reps=args.repetitions,
                    n_ubatch=args.n_ubatch,
                    seed=args.seed,
                    on_rep=functools.partial(progress.update, label),
                    launch_ahead=bool(ahead),
                )
                if row is not None:
                    rows.append(row)
                    if printer is not None:
                        progress.close()  # the bar (stderr) off the line the row goes on
                        printer.add(row)
    except LowsyncError as e:
        status, stopped = 1, f"{label}: {e}"
    except KeyboardInterrupt:
        status, stopped = EXIT_INTERRUPTED, f"interrupted in {label}"
    except BenchTimeout as e:
        status, stopped = EXIT_TIMEOUT, f"{e}, in {label}"
    progress.close()
    if printer is not None:
        printer.close()
    elif status != 1:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    if stopped:
        kept = f"; {len(rows)} finished row(s) kept" if status != 1 else ""
        print(f"lowsync bench: {stopped}{kept}", file=sys.stderr)
    return status


def _batched(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lowsync.session import Session

    policies = _policies(args, parser)
    model = _load_model(args.model, args.seed, "batched-bench", args.type)
    if model is None:
        return 1
    need = batched_n_ctx(args.npp, args.ntg, args.npl, args.pps)
    n_ctx = args.n_ctx or need
    if n_ctx < need:
        parser.error(f"-c {n_ctx} is too small: the largest run needs {need} KV cells")
    combos = [(p, t, b) for p in args.npp for t in args.ntg for b in args.npl]
    pairs = [(b, p) for b in _backends(args) for p in policies]
    progress = Progress(len(pairs) * len(combos))
    rows: list[BatchedRow] = []
    label = ""
    try:
        for backends, policy in pairs:
            label = f"{'+'.join(backends)}/{policy}"
            with legacy_switches(policy, backends):
                sess = Session(
                    model,
                    backends=backends,
                    n_ctx=n_ctx,
                    n_seq=max(args.npl),
                    n_ubatch=args.n_ubatch,
                    policy=policy,
                    # A graph per batch size, so a TG step of B sequences is not padded to -ub.
                    buckets=sorted({1, *(b for b in args.npl if b <= args.n_ubatch)}),
                )
                legacy = tuple(f"{k}={v}" for k, v in sorted(legacy_env(policy, backends).items()))
                for npp, ntg, npl in combos:
                    row = run_batched(sess, npp, ntg, npl, args.pps, seed=args.seed)
                    rows.append(dataclasses.replace(row, legacy=legacy))
                    progress.update(f"{label} pp{npp} tg{ntg} b{npl}")
    except LowsyncError as e:
        progress.close()
        print(f"lowsync batched-bench: {label}: {e}", file=sys.stderr)
        return 1
    progress.close()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print(format_batched(rows))
    bad = [r for r in rows if r.reallocs]
    if bad:
        print(
            f"lowsync batched-bench: {len(bad)} run(s) reallocated after the reserve "
            "(expected 0; see LOWSYNC_SCHED_DEBUG_REALLOC)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lowsync` script; returns the exit status.

    Examples: ``lowsync bench``, ``lowsync bench -m model.gguf --backend cpu-async -p 64 -n 64
    --json``, ``lowsync batched-bench -npp 128 -ntg 32 -npl 1,2,4 -pps``.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args, parser)
    if args.command == "batched-bench":
        return _batched(args, parser)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
