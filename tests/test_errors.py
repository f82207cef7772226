"""Bad input gives a clear error of the right class, and never a crash, a hang or corrupted
state: after each error the same context and plan still compute correctly (invariant 14)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import lowsync as ls
from helpers import randn, run

# ---- graph building: GraphError names the op and the shapes -------------------------------------


def test_mul_mat_inner_dimension_mismatch() -> None:
    g = ls.Graph()
    a, b = g.input("a", [2, 3]), g.input("b", [4, 5])
    with pytest.raises(ls.GraphError, match=r"mul_mat.*\[2, 3\].*\[4, 5\]"):
        g.mul_mat(a, b)
    with pytest.raises(ls.GraphError, match="mul_mat"):
        _ = a @ b
    # The graph is still usable after the failed node.
    g.output("y", a @ g.input("c", [3, 5]))
    out = run(g, "cpu", {"a": np.ones((2, 3), np.float32), "c": np.ones((3, 5), np.float32)})
    np.testing.assert_array_equal(out["y"], 3.0)


def test_mul_mat_batch_axes_that_do_not_divide() -> None:
    g = ls.Graph()
    with pytest.raises(ls.GraphError, match="mul_mat"):
        g.mul_mat(g.input("a", [3, 2, 4]), g.input("b", [2, 4, 5]))


@pytest.mark.parametrize(
    ("build", "op"),
    [
        (lambda g: g.add(g.input("a", [4, 3]), g.input("b", [4, 2])), "add"),
        (lambda g: g.mul(g.input("a", [4]), g.input("b", [4, 4])), "mul"),
        (lambda g: g.swiglu(g.input("a", [4, 3]), g.input("b", [3, 4])), "swiglu"),
        (lambda g: g.get_rows(g.input("t", [4, 3]), g.input("i", [2])), "get_rows"),
        (lambda g: g.get_rows(g.input("t", [4]), g.input("i", [2], "i32")), "get_rows"),
        (lambda g: g.rope(g.input("x", [2, 3, 8]), g.input("p", [3], "i32")), "rope"),
        (lambda g: g.rope(g.input("x", [2, 3, 8]), g.input("p", [2])), "rope"),
        (lambda g: g.rope(g.input("x", [2, 3, 8]), g.input("p", [2], "i32"), n_dims=5), "rope"),
        (lambda g: g.soft_max(g.input("x", [2, 8]), g.input("m", [3, 8])), "soft_max"),
        (lambda g: g.concat(g.input("a", [2, 3]), g.input("b", [3, 3]), 1), "concat"),
        (lambda g: g.concat(g.input("a", [2, 3]), g.input("b", [2, 3], "f16"), 0), "concat"),
        (lambda g: g.cpy(g.input("a", [2, 3]), "i32"), "cpy"),
        (lambda g: g.argmax(g.input("a", [3], "i32")), "argmax"),
        (lambda g: g.reshape(g.input("a", [2, 3]), [4, 2]), "reshape"),
        (lambda g: g.permute(g.input("a", [2, 3]), [0, 0]), "permute"),
        (lambda g: g.slice(g.input("a", [2, 3]), 1, 2, 5), "slice"),
        (
            lambda g: g.set_rows(
                g.input("d", [4, 3]), g.input("s", [1, 3]), g.input("i", [1], "i32")
            ),
            "set_rows",
        ),
        (
            lambda g: g.mul_mat_id(
                g.input("e", [4, 8, 3]),
                g.input("x", [2, 7]),
                g.input("ids", [2, 1], "i32"),
                g.input("w", [2, 1]),
            ),
            "mul_mat_id",
        ),
    ],
)
def test_graph_error_names_the_op(build: Callable[[ls.Graph], ls.Tensor], op: str) -> None:
    g = ls.Graph()
    with pytest.raises(ls.GraphError, match=op) as info:
        build(g)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ls.LowsyncError)


def test_unknown_dtype_and_duplicate_name() -> None:
    g = ls.Graph()
    with pytest.raises(ValueError, match="f64"):
        g.input("x", [2], "f64")
    g.input("x", [2])
    with pytest.raises(ls.GraphError, match="x"):
        g.input("x", [3])


def test_weight_with_unsupported_array_dtype() -> None:
    g = ls.Graph()
    with pytest.raises((TypeError, ValueError), match="float64"):
        g.weight("w", np.ones(3, np.float64))


# ---- set_input / get_output: InputError ---------------------------------------------------------


def _graph() -> ls.Graph:
    g = ls.Graph()
    x = g.input("x", [2, 4])
    ids = g.input("ids", [2], "i32")
    g.output("y", g.get_rows(g.weight("table", np.eye(4, dtype=np.float32)), ids) + x)
    return g


def _plan(backend: str) -> ls.Plan:
    return ls.Context([backend]).compile(_graph())


def _step(plan: ls.Plan) -> None:
    plan.compute()
    plan.get_output("y")


def _check_plan_works(plan: ls.Plan) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    plan.set_input("x", x)
    plan.set_input("ids", np.array([3, 1], np.int32))
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("y"), x + np.eye(4, dtype=np.float32)[[3, 1]])


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("x", np.zeros((2, 5), np.float32), r"x.*\(2, 4\)|x.*\[2, 4\]"),
        ("x", np.zeros((8,), np.float32), "x"),
        ("x", np.zeros((2, 4), np.float64), "float64|f64"),
        ("x", np.zeros((2, 4), np.float16), "float16|f16"),
        ("ids", np.zeros(2, np.int64), "int64|i64"),
        ("ids", np.zeros(2, np.float32), "ids"),
        ("nope", np.zeros((2, 4), np.float32), "nope"),
    ],
)
def test_set_input_errors(backend: str, name: str, data: np.ndarray, match: str) -> None:
    plan = _plan(backend)
    _check_plan_works(plan)
    with pytest.raises(ls.InputError, match=match):
        plan.set_input(name, data)
    _check_plan_works(plan)


def test_get_output_unknown_name(backend: str) -> None:
    plan = _plan(backend)
    with pytest.raises(ls.InputError, match="nope"):
        plan.get_output("nope")
    _check_plan_works(plan)


# ---- backends and environment -------------------------------------------------------------------


def test_unknown_backend() -> None:
    g = ls.Graph()
    g.output("y", g.silu(g.input("x", [2])))
    with pytest.raises(ls.UnknownBackendError, match="tpu"):
        ls.Context(["tpu"]).compile(g)
    with pytest.raises(ValueError, match="tpu"):
        ls.Context(["tpu"]).compile(g)


def test_a_backend_listed_twice_is_an_input_error() -> None:
    with pytest.raises(ls.InputError, match="listed twice"):
        ls.Context(["cpu", "cpu"])
    ctx = ls.Context(["cpu-async", "cpu"])  # several distinct backends are fine
    g = ls.Graph()
    g.output("y", g.silu(g.input("x", [2])))
    plan = ctx.compile(g)
    plan.set_input("x", np.zeros(2, np.float32))
    plan.compute()
    assert plan.get_output("y").tolist() == [0.0, 0.0]


def test_bad_policy_argument() -> None:
    with pytest.raises(ValueError, match="eager") as info:
        ls.Context(policy="eager")
    assert isinstance(info.value, ls.LowsyncError)


def test_bad_sync_policy_env_names_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    good = ls.Context(["cpu-async"])  # made before the variable goes bad
    plan = good.compile(_graph())
    clean_env.setenv("LOWSYNC_SYNC_POLICY", "fastest")
    with pytest.raises(ls.EnvError, match="LOWSYNC_SYNC_POLICY") as info:
        ls.Context(["cpu-async"]).compile(_graph())
    assert "fastest" in str(info.value)
    assert isinstance(info.value, ValueError)
    # An explicit policy does not read the variable; existing contexts and plans keep working.
    assert ls.Context(["cpu-async"], policy="staged").policy == "staged"
    _check_plan_works(plan)
    _check_plan_works(good.compile(_graph()))
    clean_env.delenv("LOWSYNC_SYNC_POLICY")
    assert ls.Context().policy == "staged"


# ---- kernel errors at run time ------------------------------------------------------------------


def test_get_rows_index_out_of_range(backend: str) -> None:
    plan = _plan(backend)
    rng = np.random.default_rng(0)
    plan.set_input("x", randn(rng, 2, 4))
    plan.set_input("ids", np.array([1, 4], np.int32))  # the table has 4 rows
    # cpu fails in compute; cpu-async may fail there or when the result is read.
    with pytest.raises(ls.BackendError, match="get_rows"):
        _step(plan)
    _check_plan_works(plan)
    plan.set_input("ids", np.array([-1, 0], np.int32))
    with pytest.raises(ls.BackendError, match="get_rows"):
        _step(plan)
    _check_plan_works(plan)
    _check_plan_works(plan)


@pytest.mark.parametrize("backend", ["cpu", "cpu-async"])
def test_state_larger_than_memory_is_a_clear_error_and_the_context_stays_usable(
    backend: str,
) -> None:
    ctx = ls.Context([backend])
    g = ls.Graph()
    huge = g.persistent("huge", (1 << 20, 1 << 20, 64))  # 256 TiB of f32
    g.output("y", g.scale(huge, 1.0))
    with pytest.raises(ls.BackendError, match="out of host memory"):
        ctx.compile(g)
    with pytest.raises(ls.GraphError, match="too large"):
        ls.Graph().persistent("absurd", (1 << 40, 1 << 40))
    g2 = ls.Graph()
    x = g2.input("x", (4,))
    g2.output("y", x * 2.0)
    plan = ctx.compile(g2)
    plan.set_input("x", np.ones(4, np.float32))
    plan.compute()
    assert plan.get_output("y").tolist() == [2.0] * 4
