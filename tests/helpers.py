"""Helpers of the Python suite: numpy references, dtype rounding, NMSE, one-shot runs."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

import lowsync as ls

Array = npt.NDArray[np.generic]

# NMSE bounds against a float64 reference, keyed by the lowest-precision dtype involved.
NMSE_MAX = {"f32": 1e-7, "f16": 1e-5, "bf16": 1e-4}


def nmse(out: npt.ArrayLike, ref: npt.ArrayLike) -> float:
    """sum((out - ref)^2) / sum(ref^2), in float64."""
    o = np.asarray(out, np.float64)
    r = np.asarray(ref, np.float64)
    assert o.shape == r.shape, f"shape {o.shape} != reference {r.shape}"
    den = float(np.sum(r * r))
    num = float(np.sum((o - r) ** 2))
    return num / den if den > 0 else num


def assert_nmse(out: npt.ArrayLike, ref: npt.ArrayLike, dtype: str = "f32") -> None:
    err = nmse(out, ref)
    assert err <= NMSE_MAX[dtype], f"NMSE {err:.3g} > {NMSE_MAX[dtype]:g} ({dtype})"


def bf16_round(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def host_array(x: npt.ArrayLike, dtype: str) -> Array:
    """What the host passes for a lowsync dtype: float16 for f16, float32 for f32 and bf16
    (already representable in bf16, so the graph sees exactly these values), int32 for i32."""
    if dtype == "f32":
        return np.asarray(x, np.float32)
    if dtype == "f16":
        return np.asarray(x, np.float16)
    if dtype == "bf16":
        return bf16_round(x)
    if dtype == "i32":
        return np.asarray(x, np.int32)
    raise ValueError(dtype)


def randn(rng: np.random.Generator, *shape: int, dtype: str = "f32") -> Array:
    return host_array(rng.standard_normal(shape), dtype)


def weight(g: ls.Graph, name: str, data: Array, dtype: str) -> ls.Tensor:
    """A weight of `dtype` whose values are exactly `data` (as made by `host_array`)."""
    return g.weight(name, data, dtype="bf16" if dtype == "bf16" else None)


def run(
    g: ls.Graph,
    backend: str,
    inputs: Mapping[str, npt.ArrayLike] | None = None,
    policy: str | None = None,
) -> dict[str, Array]:
    """Compiles `g` for one backend, writes `inputs`, computes once, reads every output."""
    plan = ls.Context([backend], policy=policy).compile(g)
    for name, data in (inputs or {}).items():
        plan.set_input(name, np.asarray(data))
    plan.compute()
    return {name: plan.get_output(name) for name in plan.outputs}


def steps_queued(n_steps: int, launch_ahead: bool) -> list[int]:
    """How many decode steps each decode step's window of `GenerateStats.steps` queues:
    without launch-ahead its own; with it one ahead, except the first (which also holds step 1,
    queued before the loop) and the last (nothing left to queue)."""
    if not launch_ahead or n_steps == 1:
        return [1] * n_steps
    return [2, *[1] * (n_steps - 2), 0]


def assert_step_counts(
    stats: ls.session.GenerateStats,
    launch_ahead: bool,
    per_queued: Mapping[str, int] | None = None,
) -> None:
    """Each decode step's own counts, exactly (not averaged, so a steady 1 and an alternating
    0/2 are told apart): one host wait; per step queued one upload (every input in one staged
    copy) and one 4-byte read (queued with its step, `Plan.compute_read_async`, under
    launch-ahead); no empty submit, no realloc; under launch-ahead the token's device copy
    into every step after step 1. `per_queued`: further counters, per step queued
    (e.g. the kernel launches of one step)."""
    assert len(stats.steps) == stats.n_steps, stats
    queued = steps_queued(stats.n_steps, launch_ahead)
    fed = [min(q, 1) if launch_ahead and stats.n_steps > 1 else 0 for q in queued]
    extra = dict(per_queued or {})
    names = ("host_waits", "h2d_copies", "d2h_copies", "d2h_bytes", "d2d_copies")
    names += ("empty_submits", "reallocs", *extra)
    got = [tuple(d[c] for c in names) for d in stats.steps]
    want = [
        (1, q, q, 4 * q, f, 0, 0, *(q * v for v in extra.values()))
        for q, f in zip(queued, fed, strict=True)
    ]
    assert got == want, f"per step {names}"
