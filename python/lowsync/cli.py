"""The `lowsync` command line.

`lowsync bench` runs the host-overhead bench (`lowsync.bench`) for every usable backend under
every sync policy and prints one row per pair: steps per second and, per step, host waits,
driver syncs, elided syncs, submits, H2D and D2H copies and reallocations.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lowsync._native import LowsyncError, available_backends, version
from lowsync.bench import POLICIES, BenchRow, format_table, run_bench

# Backends the bench skips unless asked for by name: `noop` runs no kernel, so its rows measure
# host overhead alone and would read as absurd throughput next to real backends.
_OPT_IN_BACKENDS = frozenset({"noop"})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowsync", description="lowsync command line")
    parser.add_argument("--version", action="version", version=f"lowsync {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="host-overhead bench on a llama-shaped synthetic decoder",
        description=(
            "Greedy-decodes a llama-shaped synthetic model on each backend under each sync "
            "policy and prints steps/s and per-step counters."
        ),
    )
    bench.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="backend to run (repeatable); default: every available backend except noop",
    )
    bench.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help="sync policy to run (repeatable); default: stock, relaxed and staged",
    )
    bench.add_argument(
        "-n",
        "--steps",
        type=int,
        default=32,
        help="measured steps per row, after 2 warm-up steps (default: 32)",
    )
    bench.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    return parser


def _bench(args: argparse.Namespace) -> int:
    backends: list[str] = args.backend or [
        b for b in available_backends() if b not in _OPT_IN_BACKENDS
    ]
    policies: list[str] = args.policy or list(POLICIES)
    rows: list[BenchRow] = []
    for backend in backends:
        for policy in policies:
            try:
                rows.append(run_bench(backend, policy, n_steps=args.steps))
            except LowsyncError as e:
                print(f"lowsync bench: {backend}/{policy}: {e}", file=sys.stderr)
                return 1
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print(format_table(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lowsync` script; returns the exit status.

    Example: ``lowsync bench --backend cpu-async --policy staged -n 64``.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        if args.steps < 1:
            parser.error("-n must be at least 1")
        return _bench(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
