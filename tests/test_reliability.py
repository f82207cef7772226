"""Misuse that used to crash the process or return silent garbage: each case is now a clear
exception of a `LowsyncError` subclass (or the right result), and the graph, plan and context
stay usable afterwards (invariant 14).

Cases that crashed (SIGSEGV, SIGABRT) or hung run in a subprocess, so a regression fails the
test instead of killing pytest; the child asserts the exception class, then that its objects
still work, and prints ``OK``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lowsync as ls
from lowsync import _native

# The child's common start: a helper that proves a context still compiles and runs a graph.
PRELUDE = """
import numpy as np
import lowsync as ls

def works(ctx, tag="ok"):
    g = ls.Graph()
    x = g.input("x_" + tag, [3])
    g.output("y", g.scale(x, 2.0))
    plan = ctx.compile(g)
    plan.set_input("x_" + tag, np.arange(3, dtype=np.float32))
    plan.compute()
    assert plan.get_output("y").tolist() == [0.0, 2.0, 4.0]

def raises(cls, fn, match):
    try:
        fn()
    except cls as e:
        assert match in str(e), f"{match!r} not in {e}"
        return e
    raise AssertionError(f"expected {cls.__name__}")
"""


def isolated(body: str, env: dict[str, str] | None = None, timeout: float = 120) -> None:
    """Runs `body` after PRELUDE in a fresh interpreter; it must exit 0 and print OK."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("LOWSYNC_")}
    child_env.update(env or {})
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
    )
    report = (
        f"child exited with {r.returncode} (negative: killed by signal {-r.returncode})\n"
        f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"
    )
    assert r.returncode == 0, report
    assert r.stdout.strip().endswith("OK"), report


# ---- 29.1: size arithmetic that wrapped ---------------------------------------------------------


def test_reshape_whose_element_count_wraps_is_a_graph_error_not_a_segfault() -> None:
    # (2^63 + 1) * 2 wraps to 2 elements; get_rows then read row 2^30 of a 2-element weight.
    isolated("""
    g = ls.Graph()
    w = g.weight("w", np.ones(2, np.float32))
    raises(ls.GraphError, lambda: g.reshape(w, [2**63 + 1, 2]), "too large")
    ids = g.input("i", [1], "i32")
    g.output("y", g.get_rows(g.reshape(w, [1, 2]), ids))
    plan = ls.Context(["cpu"]).compile(g)
    plan.set_input("i", np.array([2**30], np.int32))
    raises(ls.BackendError, plan.compute, "get_rows")
    plan.set_input("i", np.array([0], np.int32))
    plan.compute()
    assert plan.get_output("y").tolist() == [[1.0, 1.0]]
    """)


@pytest.mark.parametrize(
    ("build", "op"),
    [
        # [2^31, 2^31] f32 is 2^64 bytes: it compiled to a 0-byte tensor.
        (lambda g: g.input("a", [2**31, 0]) @ g.input("b", [0, 2**31]), "mul_mat"),
        (lambda g: g.concat(g.input("a", [2**60, 0]), g.input("b", [2**60, 0]), 0), "concat"),
        (lambda g: g.input("a", [2**62, 4]), "input"),
        (lambda g: g.persistent("a", [2**40, 0, 2**40]), "persistent"),
    ],
)
def test_a_size_that_wraps_is_refused_when_the_node_is_built(
    build: object, op: str, backend: str
) -> None:
    g = ls.Graph()
    with pytest.raises(ls.GraphError, match=rf"{op}.*too large"):
        build(g)  # type: ignore[operator]
    x = g.input("x", [2])
    g.output("y", g.scale(x, 3.0))
    plan = ls.Context([backend]).compile(g)
    plan.set_input("x", np.ones(2, np.float32))
    plan.compute()
    assert plan.get_output("y").tolist() == [3.0, 3.0]


# ---- 29.2: allocations that aborted -------------------------------------------------------------


def test_weight_from_a_huge_broadcast_view_is_an_error_not_an_abort() -> None:
    # A stride-0 view: 4 bytes of memory, 2^48 elements (1 PiB) logically.
    isolated("""
    g = ls.Graph()
    huge = np.broadcast_to(np.float32(0), (2**24, 2**24))
    e = raises(ls.BackendError, lambda: g.weight("w", huge), "out of host memory")
    assert str(2**50) in str(e), e
    small = np.broadcast_to(np.float32(2), (2, 3))
    g.weight("w", small)  # the name is still free, and a small broadcast view is fine
    ctx = ls.Context(["cpu"])
    works(ctx)
    """)


def test_n_copies_out_of_range_is_an_input_error_not_a_hang() -> None:
    isolated("""
    for n in (2**40, 17, 0, -1, 2**70):
        raises(ls.InputError, lambda: ls.Context(["cpu"], n_copies=n), "n_copies")
    works(ls.Context(["cpu-async", "cpu"], n_copies=16))
    """)


@pytest.mark.parametrize("backends", [["cpu"], ["cpu-async", "cpu"]])
def test_a_huge_input_at_compile_is_an_error_and_the_context_stays_usable(
    backends: list[str],
) -> None:
    isolated(f"""
    ctx = ls.Context({backends!r})
    g = ls.Graph()
    a = g.input("a", [2**45])  # 128 TiB
    g.output("big", g.scale(a, 2.0))
    raises(ls.BackendError, lambda: ctx.compile(g), "out of host memory")
    works(ctx)
    """)


# ---- 29.3: non-C-contiguous arrays --------------------------------------------------------------


def _layouts() -> list[np.ndarray]:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    return [
        np.asfortranarray(base),  # column-major: was read in memory order (transposed)
        np.ascontiguousarray(base.T).T,  # the same, made by a transpose
        np.arange(24, dtype=np.float32).reshape(3, 8)[:, ::2],  # strided
        base[::-1][::-1],  # negative strides undone
        np.flip(np.flip(base, 0), 0),
        np.broadcast_to(base[:1], (3, 4)),  # stride 0
    ]


@pytest.mark.parametrize("i", range(6))
def test_set_input_reads_any_layout_in_c_order(i: int, backend: str) -> None:
    arr = _layouts()[i]
    g = ls.Graph()
    x = g.input("x", [3, 4])
    g.output("y", g.scale(x, 1.0))
    plan = ls.Context([backend]).compile(g)
    plan.set_input("x", arr)
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("y"), np.ascontiguousarray(arr))


@pytest.mark.parametrize("i", range(6))
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_weight_reads_any_layout_in_c_order(i: int, dtype: str) -> None:
    arr = _layouts()[i]
    if dtype == "f16":
        arr = arr.astype(np.float16, order="K")  # keeps a Fortran layout Fortran
    g = ls.Graph()
    w = g.weight("w", arr, dtype=dtype)
    g.output("y", g.cpy(w, "f32"))
    plan = ls.Context(["cpu"]).compile(g)
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("y"), np.ascontiguousarray(arr, np.float32))


# ---- 29.8: NaN propagates -----------------------------------------------------------------------


def test_soft_max_propagates_nan_and_argmax_ranks_nan_lowest(backend: str) -> None:
    x = np.array(
        [[np.nan, np.nan, np.nan], [1.0, np.nan, 3.0], [1.0, 2.0, 3.0], [3.0, 1.0, np.nan]],
        np.float32,
    )
    g = ls.Graph()
    a = g.input("a", [4, 3])
    g.output("p", g.soft_max(a))
    g.output("i", g.argmax(a))
    plan = ls.Context([backend]).compile(g)
    plan.set_input("a", x)
    plan.compute()
    p = plan.get_output("p")
    assert np.isnan(p[[0, 1, 3]]).all(), p  # an all-NaN row used to come out as zeros
    np.testing.assert_allclose(p[2], np.exp(x[2]) / np.exp(x[2]).sum(), rtol=1e-6)
    # argmax ranks NaN below every number (all backends' kernels agree); all-NaN gives 0.
    np.testing.assert_array_equal(plan.get_output("i"), [0, 2, 2, 0])


# ---- 29.10: smaller misuse ----------------------------------------------------------------------


def test_context_takes_one_backend_name_as_a_str() -> None:
    ctx = ls.Context("cpu")
    assert ctx.backends == ["cpu"]
    assert ls.Context().backends == ["cpu"]
    with pytest.raises(TypeError, match="backend name or a list of names"):
        ls.Context(5)  # type: ignore[arg-type]
    with pytest.raises(ls.UnknownBackendError):
        ls.Context("tpu")


@pytest.mark.parametrize(
    ("shape", "dim", "why"),
    [([-1, 2], 0, "negative"), ([2, 2**70], 1, "more than"), ([2, 1.5], 1, "not an integer")],
)
def test_a_bad_dim_is_a_graph_error_naming_it(shape: list[object], dim: int, why: str) -> None:
    g = ls.Graph()
    for make in (
        lambda: g.input("d", shape),  # type: ignore[arg-type]
        lambda: g.persistent("p", shape),  # type: ignore[arg-type]
        lambda: g.reshape(g.input("r", [4]), shape),  # type: ignore[arg-type]
    ):
        with pytest.raises(ls.GraphError, match=rf"dim {dim} .*{why}"):
            make()
    with pytest.raises(ls.GraphError, match="sequence of integers"):
        g.input("s", "12")  # type: ignore[arg-type]
    assert g.input("d", np.array([2, 3])).shape == (2, 3)


def test_get_output_before_any_compute_is_an_input_error(backend: str) -> None:
    g = ls.Graph()
    x = g.input("x", [2])
    g.output("y", g.scale(x, 2.0))
    g.output("x_out", x)
    plan = ls.Context([backend]).compile(g)
    for name in ("y", "x_out"):
        with pytest.raises(ls.InputError, match=f"output `{name}` holds no result yet"):
            plan.get_output(name)
    plan.set_input("x", np.ones(2, np.float32))
    plan.compute()
    assert plan.get_output("y").tolist() == [2.0, 2.0]


@pytest.mark.parametrize("base", [0.0, -10000.0, float("nan"), float("inf")])
def test_rope_base_that_gives_nan_is_refused_at_build(base: float) -> None:
    g = ls.Graph()
    x, pos = g.input("x", [1, 2, 4]), g.input("p", [1], "i32")
    with pytest.raises(ls.GraphError, match="theta_base"):
        g.rope(x, pos, theta_base=base)
    g.rope(x, pos, theta_base=10000.0)


def test_debug_realloc_2_accepts_a_default_session() -> None:
    # Its buckets compile largest first; the one-token graph has a node fewer and fits the
    # memory already reserved, so no reallocation happens and level 2 has nothing to refuse.
    isolated(
        """
    sess = ls.Session(ls.Llama.random("tiny", seed=0), backends=["cpu-async"])
    assert sess.stats()["total"]["reallocs"] == 0
    sess.generate([1, 2, 3], max_new_tokens=4)
    assert sess.stats()["total"]["reallocs"] == 0
    """,
        env={"LOWSYNC_SCHED_DEBUG_REALLOC": "2"},
    )


def test_debug_realloc_2_still_refuses_a_graph_beyond_an_explicit_reserve(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "2")
    ctx = ls.Context(["cpu"])

    def chain(n: int) -> ls.Graph:
        g = ls.Graph()
        h = g.input("x", [4])
        for _ in range(n):
            h = g.scale(h, 2.0)
        g.output("y", h)
        return g

    ctx.reserve(chain(3))
    with pytest.raises(ls.ReallocError, match="DEBUG_REALLOC=2"):
        ctx.compile(chain(2))
    ctx.compile(chain(3))


# ---- 28.6: the CUDA fusion plan is a module function --------------------------------------------


def test_cuda_fusion_plan_is_a_module_function_of_any_plan() -> None:
    g = ls.Graph()
    x = g.input("x", [2, 4])
    w = g.weight("w", np.ones((4, 3), np.float32))
    g.output("y", x @ w)
    plan = ls.Context(["noop"]).compile(g)
    assert not hasattr(plan, "cuda_fusion_plan")
    # The wheel is built with the `cuda` feature; no device is needed to plan the launches.
    launches = _native.cuda_fusion_plan(plan)
    assert launches, launches
    assert all(isinstance(s, str) for s in launches), launches
    with pytest.raises(ls.InputError, match="split 1 does not exist"):
        _native.cuda_fusion_plan(plan, 1)
    assert plan.can_read_async("y") in (True, False)
    assert not plan.can_read_async("nope")


def test_device_type_tells_a_software_vulkan_device_from_a_gpu() -> None:
    assert _native.device_type("cpu") == "cpu"
    assert _native.device_type("cpu-async") == "cpu"
    assert _native.device_type("cuda:0") == "gpu"
    with pytest.raises(ls.UnknownBackendError):
        _native.device_type("tpu")
    for name in (b for b in ls.available_backends() if b.startswith("vulkan")):
        kind = _native.device_type(name)
        assert kind in {"cpu", "discrete_gpu", "integrated_gpu", "virtual_gpu", "other"}
