"""One graph across `cpu-async` and `cpu`: splits, copies, policies and the reserve.

The Rust suite (`crates/scheduler/tests/multi.rs`) proves the ordering invariants with the test
gate and the W0-W6 counts; these tests check the same behaviour through the Python API.
"""

from __future__ import annotations

import numpy as np
import pytest

import lowsync as ls

POLICIES = ("stock", "relaxed", "staged")


def two_backend_graph(w: np.ndarray, w_host: np.ndarray) -> ls.Graph:
    """x (from the host) @ w (on cpu-async), rms-normed, then scaled by a host weight."""
    g = ls.Graph()
    x = g.input("x", (4, 64))
    wt = g.weight("w", w, backend="cpu-async")
    scale = g.weight("s", w_host, backend="cpu")
    y = g.rms_norm(x @ wt, eps=1e-5)
    g.output("y", g.mul(y, scale))
    return g


def reference(x: np.ndarray, w: np.ndarray, s: np.ndarray) -> np.ndarray:
    h = x.astype(np.float64) @ w.astype(np.float64)
    h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-5)
    return h * s


@pytest.mark.parametrize("policy", POLICIES)
def test_a_graph_splits_across_backends_and_matches_numpy(
    policy: str, clean_env: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    s = rng.standard_normal(64).astype(np.float32)
    ctx = ls.Context(backends=["cpu-async", "cpu"], policy=policy)
    plan = ctx.compile(two_backend_graph(w, s))
    assert plan.split_backends == ["cpu-async", "cpu"]
    for _ in range(3):
        x = rng.random((4, 64), dtype=np.float32)
        plan.set_input("x", x)
        plan.compute()
        got = plan.get_output("y")
        ref = reference(x, w, s)
        assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-5


def test_policies_and_copy_counts_give_bit_identical_outputs(
    clean_env: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    s = rng.standard_normal(64).astype(np.float32)
    xs = [rng.random((4, 64), dtype=np.float32) for _ in range(4)]
    results = []
    for policy in POLICIES:
        for n_copies in (1, 4):
            ctx = ls.Context(["cpu-async", "cpu"], policy=policy, n_copies=n_copies)
            plan = ctx.compile(two_backend_graph(w, s))
            outs = []
            for x in xs:
                plan.set_input("x", x)
                plan.compute()
                outs.append(plan.get_output("y"))
            results.append(np.stack(outs))
    for r in results[1:]:
        assert np.array_equal(r, results[0])


def test_staged_device_step_makes_one_host_wait_the_read(clean_env: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    g = ls.Graph()
    x = g.input("x", (1, 64))
    pos = g.input("pos", (1,), "i32")
    w = g.weight("w", rng.standard_normal((64, 64)).astype(np.float32), backend="cpu-async")
    h = g.rope(g.reshape(x @ w, (1, 4, 16)), pos)
    g.output("next", g.argmax(g.reshape(h, (1, 64))))
    ctx = ls.Context(["cpu-async", "cpu"], policy="staged")
    plan = ctx.compile(g)
    # Each step on its own (a steady 1 and an alternating 0/2 have the same total).
    for step in range(10):
        before = ctx.stats()["total"]
        plan.set_input("x", rng.random((1, 64), dtype=np.float32))
        plan.set_input("pos", np.array([step], np.int32))
        plan.compute()
        plan.get_output("next")
        after = ctx.stats()["total"]
        got = {k: after[k] - before[k] for k in ("host_waits", "h2d_copies", "reallocs")}
        # One wait (the read) and one staged write of both inputs.
        assert got == {"host_waits": 1, "h2d_copies": 1, "reallocs": 0}, (step, got)


def test_pinning_to_a_backend_outside_the_context_is_a_graph_error(
    clean_env: pytest.MonkeyPatch,
) -> None:
    ctx = ls.Context(["cpu"])
    g = ls.Graph()
    w = g.weight("w", np.ones(4, np.float32), backend="cpu-async")
    g.output("y", w * 2.0)
    with pytest.raises(ls.GraphError, match="cpu-async"):
        ctx.compile(g)
    g2 = ls.Graph()
    x = g2.input("x", (4,))
    g2.output("y", x * 3.0)
    plan = ctx.compile(g2)
    plan.set_input("x", np.ones(4, np.float32))
    plan.compute()
    assert plan.get_output("y").tolist() == [3.0] * 4


def test_bad_debug_realloc_value_names_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "3")
    with pytest.raises(ls.EnvError, match="LOWSYNC_SCHED_DEBUG_REALLOC"):
        ls.Context(["cpu"])


def chain(rows: int, extra: int = 0) -> ls.Graph:
    g = ls.Graph()
    h = g.input("x", (rows, 16)) @ g.weight("w", np.eye(16, dtype=np.float32))
    for _ in range(2 + extra):
        h = g.silu(h)
    g.output("y", h)
    return g


def test_debug_realloc_level_2_rejects_a_plan_beyond_the_reserve(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "2")
    ctx = ls.Context(["cpu-async"])
    ctx.reserve(chain(8))
    with pytest.raises(ls.ReallocError, match="DEBUG_REALLOC=2"):
        ctx.compile(chain(64))
    plan = ctx.compile(chain(8))  # within the reserve: fine, and the context still works
    plan.set_input("x", np.ones((8, 16), np.float32))
    plan.compute()
    assert plan.get_output("y").shape == (8, 16)
    assert ctx.stats()["total"]["reallocs"] == 0


def test_a_plan_beyond_the_reserve_counts_a_realloc_without_debug(
    clean_env: pytest.MonkeyPatch,
) -> None:
    ctx = ls.Context(["cpu-async"])
    ctx.reserve(chain(8))
    ctx.compile(chain(64))
    assert ctx.stats()["total"]["reallocs"] == 1
    ctx.compile(chain(8))
    ctx.compile(chain(64))
    assert ctx.stats()["total"]["reallocs"] == 1  # never shrinks, so no second realloc
