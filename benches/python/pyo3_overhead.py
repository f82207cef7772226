"""PyO3 overhead of the per-step calls, measured from Python on the `noop` backend.

`noop` runs no kernels, so a call's time is the binding's cost plus the Rust executor's own
(which the criterion bench `executor` measures alone: `cargo bench -p lowsync-benches`).
Run: `python benches/python/pyo3_overhead.py`.
"""

from __future__ import annotations

import functools
import time

import numpy as np

import lowsync as ls


def build(n_inputs: int = 6) -> ls.Graph:
    g = ls.Graph()
    acc = g.input("x0", (1, 64))
    for i in range(1, n_inputs):
        acc = acc + g.input(f"x{i}", (1, 64))
    g.output("y", g.argmax(acc))
    return g


def per_call_ns(fn: object, n: int) -> float:
    assert callable(fn)
    for _ in range(1000):
        fn()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def main() -> None:
    n = 200_000
    for policy in ("stock", "relaxed", "staged"):
        ctx = ls.Context(backends=["noop"], policy=policy)
        plan = ctx.compile(build())
        x = np.ones((1, 64), np.float32)
        noop_call = per_call_ns(lambda: None, n)
        compute = per_call_ns(plan.compute, n)
        set_input = per_call_ns(functools.partial(plan.set_input, "x0", x), n)
        get_output = per_call_ns(functools.partial(plan.get_output, "y"), n // 4)
        print(
            f"{policy:8s} compute {compute / 1e3:6.3f} us  set_input {set_input / 1e3:6.3f} us  "
            f"get_output {get_output / 1e3:6.3f} us  (empty Python call {noop_call / 1e3:.3f} us)"
        )


if __name__ == "__main__":
    main()
