"""The Python surface: exports, the README example, properties, stats layout, and the host-wait
counts each sync policy promises on `cpu-async`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lowsync as ls
from helpers import Array, assert_nmse, randn, run
from lowsync.models.synthetic import StepInputs, SyntheticConfig, build_synthetic_llama

README = Path(__file__).resolve().parent.parent / "README.md"

STAT_NAMES = [
    "host_waits",
    "driver_syncs",
    "elided_syncs",
    "device_waits",
    "submits",
    "empty_submits",
    "h2d_copies",
    "h2d_bytes",
    "d2h_copies",
    "d2h_bytes",
    "d2d_copies",
    "d2d_bytes",
    "kernel_launches",
    "graph_captures",
    "graph_launches",
    "device_ns",
    "staging_bytes_in_use",
    "reserves",
    "reallocs",
]


# ---- package surface ----------------------------------------------------------------------------


def test_readme_examples_run() -> None:
    """Every ```python block of the README runs, in order, in one namespace."""
    text = README.read_text()
    blocks = list(re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL))
    assert blocks, "README.md has no ```python example"
    namespace: dict[str, object] = {"__name__": "readme_example"}
    for found in blocks:
        # Pad with blank lines so a traceback points at the README's own line numbers.
        source = "\n" * text[: found.start(1)].count("\n") + found.group(1)
        exec(compile(source, str(README), "exec"), namespace)


def test_exports_and_version() -> None:
    for name in ls.__all__:
        assert hasattr(ls, name), name
    assert ls.__version__ == ls.version()
    assert importlib.metadata.version("lowsync") == ls.__version__
    assert issubclass(ls.GraphError, ls.LowsyncError)
    assert issubclass(ls.GraphError, ValueError)
    assert issubclass(ls.InputError, ValueError)
    assert issubclass(ls.UnknownBackendError, ValueError)
    assert issubclass(ls.EnvError, ValueError)
    assert issubclass(ls.BackendError, RuntimeError)
    assert issubclass(ls.UnsupportedError, ls.BackendError)
    assert issubclass(ls.BackendUnavailableError, ls.BackendError)
    assert issubclass(ls.ReallocError, RuntimeError)
    assert issubclass(ls.ReallocError, ls.LowsyncError)


def test_import_is_light() -> None:
    # `import lowsync` loads the native module only; gguf, the bench and the CLI load on use.
    code = (
        "import sys, lowsync\n"
        "heavy = [m for m in ('gguf', 'lowsync.bench', 'lowsync.cli', 'lowsync.gguf') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_and_not_yet_written_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = ls.no_such_name
    # `load_gguf` and `Llama` are served lazily once lowsync.gguf / lowsync.models exist; until
    # then they are a clear AttributeError (so `from lowsync import Llama` is an ImportError).
    for name, module in [("load_gguf", "lowsync.gguf"), ("Llama", "lowsync.models")]:
        assert name not in ls.__all__
        if importlib.util.find_spec(module) is None:
            with pytest.raises(AttributeError, match=f"{name} is not available"):
                getattr(ls, name)


def test_available_backends_and_stat_names() -> None:
    assert {"cpu", "cpu-async", "noop"} <= set(ls.available_backends())
    assert ls.stat_names() == STAT_NAMES


# ---- graph, tensor, plan ------------------------------------------------------------------------


def test_tensor_properties_and_operators() -> None:
    g = ls.Graph()
    x = g.input("x", [2, 3, 4])
    w = g.weight("w", np.ones((4, 5), np.float32))
    assert x.shape == (2, 3, 4)
    assert x.dtype == "f32"
    assert x.name == "x"
    assert isinstance(x.id, int)
    assert x.id != w.id
    assert isinstance(repr(x), str)
    assert (x @ w).shape == (2, 3, 5)
    assert (x + x).shape == (2, 3, 4)
    assert (x * x).shape == (2, 3, 4)
    assert (x * 2.0).shape == (2, 3, 4)
    assert (0.5 * x).shape == (2, 3, 4)
    assert x.T.shape == (2, 4, 3)
    assert g.argmax(x).dtype == "i32"
    assert g.input("h", [4], "f16").dtype == "f16"
    assert g.weight("wh", np.ones(3, np.float16)).dtype == "f16"
    assert g.weight("wi", np.ones(3, np.int32)).dtype == "i32"
    assert g.weight("wb", np.ones(3, np.float32), dtype="bf16").dtype == "bf16"
    assert g.persistent("kv", [8, 4], "f16").shape == (8, 4)


def test_graph_and_plan_properties(clean_env: pytest.MonkeyPatch) -> None:
    g = ls.Graph()
    x = g.input("x", [2, 4])
    ids = g.input("ids", [1], "i32")
    w = g.weight("w", np.ones((4, 3), np.float32))
    y = x @ w
    g.output("y", y)
    g.output("row", g.get_rows(y, ids))
    assert g.n_leafs == 3
    assert g.n_nodes == 2
    plan = ls.Context(["cpu-async"]).compile(g)
    assert sorted(plan.inputs) == ["ids", "x"]
    assert plan.outputs == ["y", "row"]
    assert plan.backend == "cpu-async"
    assert plan.policy == "staged"
    assert plan.n_nodes >= 2
    assert plan.n_leafs >= 3


def test_context_policy_default_env_and_argument(clean_env: pytest.MonkeyPatch) -> None:
    ctx = ls.Context()
    assert ctx.backends == ["cpu"]
    assert ctx.policy == "staged"
    clean_env.setenv("LOWSYNC_SYNC_POLICY", "relaxed")
    assert ls.Context().policy == "relaxed"
    assert ls.Context(policy="stock").policy == "stock"  # an explicit policy wins over the env
    for policy in ("stock", "relaxed", "staged"):
        assert ls.Context(["cpu-async"], policy=policy).compile(_small_graph()).policy == policy


def _small_graph() -> ls.Graph:
    g = ls.Graph()
    g.output("y", g.silu(g.input("x", [2, 4])))
    return g


def test_weight_data_is_copied(backend: str) -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    g = ls.Graph()
    g.output("y", g.input("x", [2, 3]) @ g.weight("w", data))
    expect = np.ones((2, 3)) @ data
    data[:] = -1  # the graph kept its own copy
    assert_nmse(run(g, backend, {"x": np.ones((2, 3), np.float32)})["y"], expect)


def test_set_input_accepts_non_contiguous_arrays(backend: str) -> None:
    rng = np.random.default_rng(0)
    base = randn(rng, 8, 6)
    strided = base.T[:, ::2]  # [6, 4], neither C- nor F-contiguous
    assert not strided.flags.c_contiguous
    g = ls.Graph()
    g.output("y", g.scale(g.input("x", [6, 4]), 1.0))
    np.testing.assert_array_equal(run(g, backend, {"x": strided})["y"], strided)


def test_input_buffer_may_be_overwritten_after_compute(backend: str) -> None:
    # Invariant 1: once compute returned, the caller may reuse its buffer; the step still sees
    # the old values (cpu-async may not even have started the step yet).
    g = ls.Graph()
    g.output("y", g.scale(g.input("x", [64, 64]), 2.0))
    plan = ls.Context([backend]).compile(g)
    buf = np.ones((64, 64), np.float32)
    plan.set_input("x", buf)
    plan.compute()
    buf[:] = 100.0
    np.testing.assert_array_equal(plan.get_output("y"), 2.0)


def test_outputs_are_owned_arrays(backend: str) -> None:
    g = ls.Graph()
    g.output("y", g.scale(g.input("x", [4]), 3.0))
    plan = ls.Context([backend]).compile(g)
    plan.set_input("x", np.ones(4, np.float32))
    plan.compute()
    first = plan.get_output("y")
    first[:] = 0  # writable, and not the plan's memory
    plan.set_input("x", np.full(4, 2.0, np.float32))
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("y"), 6.0)
    np.testing.assert_array_equal(first, 0.0)


def test_compute_without_reading_then_read_latest(backend: str) -> None:
    # Several steps queued back to back (no read in between); the read sees the last one.
    g = ls.Graph()
    cache = g.persistent("cache", [1, 4])
    g.output("acc", g.set_rows(cache, g.input("x", [1, 4]), g.input("slot", [1], "i32")))
    plan = ls.Context([backend]).compile(g)
    plan.set_input("slot", np.zeros(1, np.int32))
    for i in range(5):
        plan.set_input("x", np.full((1, 4), float(i), np.float32))
        plan.compute()
    plan.synchronize()
    np.testing.assert_array_equal(plan.get_output("acc"), 4.0)


# ---- stats --------------------------------------------------------------------------------------


def test_stats_layout_and_reset() -> None:
    ctx = ls.Context(["cpu-async"])
    plan = ctx.compile(_small_graph())
    plan.set_input("x", np.ones((2, 4), np.float32))
    plan.compute()
    plan.get_output("y")
    stats = ctx.stats()
    assert "cpu-async" in ctx.backends
    assert set(stats) == {"total", *ctx.backends}
    for counters in stats.values():
        assert list(counters) == ls.stat_names()
        assert all(isinstance(v, int) and v >= 0 for v in counters.values())
    for name in ls.stat_names():
        assert stats["total"][name] == sum(stats[b][name] for b in ctx.backends), name
    total = stats["total"]
    assert total["kernel_launches"] == 1
    assert total["d2h_copies"] == 1
    assert total["host_waits"] == 1  # reading the output waited for the step

    ctx.reset_stats()
    after = ctx.stats()
    for counters in after.values():
        for name, value in counters.items():
            if name != "staging_bytes_in_use":  # a gauge, not a counter
                assert value == 0, name


def _counts_graph(n_inputs: int) -> ls.Graph:
    g = ls.Graph()
    acc = g.input("x0", [4, 8])
    for i in range(1, n_inputs):
        acc = acc + g.input(f"x{i}", [4, 8])
    g.output("y", g.silu(acc))
    return g


def _delta(ctx: ls.Context, before: dict[str, int]) -> dict[str, int]:
    now = ctx.stats()["total"]
    return {k: now[k] - before[k] for k in now}


@pytest.mark.parametrize("n_inputs", [1, 3, 6])
@pytest.mark.parametrize("policy", ["stock", "relaxed", "staged"])
def test_cpu_async_sync_counts_per_step(policy: str, n_inputs: int) -> None:
    """Host waits, elided syncs and copies of one step with U user inputs, one split on
    cpu-async, reading one output per step (which waits for the step: one host wait).

    Formulas (per step, steady state; the lead reconciles exact numbers with the scheduler):
    - staged:  compute makes no host wait; the U inputs go as 1 staged H2D copy; the read is
               exactly 1 host wait.
    - relaxed: sync at split start (elided: the previous read left nothing outstanding), U
               async H2D writes, sync before the graph (1 host wait), graph; the read is 1 wait.
    - stock:   per input, synchronize (elided: nothing outstanding) then a blocking write
               (1 H2D copy, 1 host wait each), then the graph; the read is 1 wait.
    """
    u = n_inputs
    expected_compute = {
        # policy: (host_waits before the read, elided_syncs, h2d_copies)
        "staged": (0, 0, 1),
        "relaxed": (1, 1, u),
        "stock": (u, u, u),
    }[policy]
    ctx = ls.Context(["cpu-async"], policy=policy)
    plan = ctx.compile(_counts_graph(u))
    rng = np.random.default_rng(0)

    def step() -> tuple[dict[str, int], dict[str, int]]:
        before = ctx.stats()["total"]
        for i in range(u):
            plan.set_input(f"x{i}", randn(rng, 4, 8))
        plan.compute()
        computed = _delta(ctx, before)
        mid = ctx.stats()["total"]
        plan.get_output("y")
        return computed, _delta(ctx, mid)

    for _ in range(2):  # warm-up: reserve, weights, first staging
        step()
    for _ in range(3):
        computed, read = step()
        host_waits, elided, h2d = expected_compute
        assert computed["host_waits"] == host_waits, computed
        assert computed["elided_syncs"] == elided, computed
        assert computed["reallocs"] == 0
        assert read["host_waits"] == 1, read  # the one wait a read needs
        assert read["d2h_copies"] == 1, read
        # H2D copies may be counted when queued or when the worker runs them: take the step.
        assert computed["h2d_copies"] + read["h2d_copies"] == h2d, (computed, read)


# ---- policies and backends agree ----------------------------------------------------------------


def test_synthetic_decoder_tokens_agree_across_backends_and_policies() -> None:
    cfg = SyntheticConfig(n_layer=2, n_ctx=16, n_embd=64, n_ff=128, n_vocab=128)
    runs: dict[tuple[str, str], list[int]] = {}
    for backend in ("cpu", "cpu-async"):
        for policy in ("stock", "relaxed", "staged"):
            plan = ls.Context([backend], policy=policy).compile(build_synthetic_llama(cfg))
            inputs = StepInputs(cfg)
            token, tokens = 1, []
            for pos in range(20):  # past n_ctx: the KV ring wraps
                for name, data in inputs.fill(pos, token).items():
                    plan.set_input(name, data)
                plan.compute()
                token = int(plan.get_output("token")[0])
                tokens.append(token)
            runs[backend, policy] = tokens
    first = next(iter(runs.values()))
    assert all(0 <= t < cfg.n_vocab for t in first)
    for key, tokens in runs.items():
        assert tokens == first, key


def test_noop_backend_runs_a_plan_with_the_same_surface() -> None:
    # noop runs no kernel (its outputs are meaningless), but inputs, outputs and shapes behave
    # as on a real backend, so the bench can measure host overhead alone.
    ctx = ls.Context(["noop"])
    plan = ctx.compile(_small_graph())
    for _ in range(2):
        plan.set_input("x", np.ones((2, 4), np.float32))
        plan.compute()
        y: Array = plan.get_output("y")
        assert y.shape == (2, 4)
        assert y.dtype == np.float32
    assert ctx.stats()["total"]["d2h_copies"] == 2
