"""S2's bug class through the Python API: a model whose graph shape depends on runtime state.

llama.cpp's k-pool models branched on `cache_safe` (false once `seq_cp` shares cells) and sized a
gather path by the current number of cells. Rebuilding such a graph per step makes the
scheduler re-reserve for the current state; the next step has the same graph size but bigger
tensors, which `LOWSYNC_SCHED_DEBUG_REALLOC=1` reports. The same decode loop with a
state-independent graph (always the dense path over a fixed window, validity in the mask) runs
clean and never reallocates.
"""

from __future__ import annotations

import numpy as np
import pytest

import lowsync as ls

D, N_CTX = 16, 32


def attention_step(n_tokens: int, n_kv: int, gather: bool) -> ls.Graph:
    """One attention layer over a persistent K cache.

    Dense path: scores over all N_CTX rows, masked. Gather path (the state-dependent one): pick
    `n_kv` rows with `get_rows` first — its node count and sizes depend on the state.
    """
    g = ls.Graph()
    q = g.input("q", (n_tokens, D))
    k = g.persistent("k_cache", (N_CTX, D))
    if gather:
        rows = g.input("rows", (n_kv,), "i32")
        keys = g.get_rows(k, rows)
        scores = g.soft_max(q @ keys.T, scale=0.25)
    else:
        mask = g.input("mask", (n_tokens, N_CTX))
        scores = g.soft_max(q @ k.T, mask=mask, scale=0.25)
    g.output("next", g.argmax(scores))
    return g


def step(ctx: ls.Context, graph: ls.Graph, n_tokens: int, n_kv: int) -> None:
    plan = ctx.compile(graph)
    plan.set_input("q", np.ones((n_tokens, D), np.float32))
    if "rows" in plan.inputs:
        plan.set_input("rows", np.arange(n_kv, dtype=np.int32))
    else:
        mask = np.full((n_tokens, N_CTX), -np.inf, np.float32)
        mask[:, :n_kv] = 0.0
        plan.set_input("mask", mask)
    plan.compute()
    plan.get_output("next")


def decode(ctx: ls.Context, state_dependent: bool) -> None:
    """Prefill 8 tokens into seq 0, share its cells with seq 1 (`seq_cp`), decode 8 steps."""
    ctx.reserve(attention_step(8, N_CTX, gather=False))  # the worst case: a full prefill
    step(ctx, attention_step(8, N_CTX, gather=False), 8, 8)
    shared = True  # after seq_cp the cells are shared
    for n_kv in range(9, 17):
        gather = state_dependent and shared
        step(ctx, attention_step(1, n_kv, gather=gather), 1, n_kv)


def test_state_dependent_graph_is_caught_at_level_1(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "1")
    ctx = ls.Context(["cpu-async"])
    with pytest.raises(ls.ReallocError, match="depends on runtime state"):
        decode(ctx, state_dependent=True)
    # The first mismatch (another graph size) was an expected re-reserve; the second was not.
    assert ctx.stats()["total"]["reallocs"] == 1
    # The context stays usable for graphs that fit.
    step(ctx, attention_step(1, 9, gather=True), 1, 9)


def test_state_independent_graph_runs_clean_at_levels_1_and_2(
    clean_env: pytest.MonkeyPatch,
) -> None:
    for level in ("1", "2"):
        clean_env.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", level)
        ctx = ls.Context(["cpu-async"])
        decode(ctx, state_dependent=False)
        assert ctx.stats()["total"]["reallocs"] == 0


def test_without_debug_the_state_dependent_graph_reallocates_and_counts(
    clean_env: pytest.MonkeyPatch,
) -> None:
    ctx = ls.Context(["cpu-async"])
    decode(ctx, state_dependent=True)
    # One per gather step (8): the first for its new node count, each later one because its
    # tensors outgrew the previous (never shrinking) reserve by a row.
    assert ctx.stats()["total"]["reallocs"] == 8
