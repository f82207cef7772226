"""Every op on `cpu` and `cpu-async` against numpy in float64 (NMSE per dtype, as ggml's
test-backend-ops), and `cpu` vs `cpu-async` bit-identical on random graphs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowsync as ls
from helpers import Array, assert_nmse, host_array, randn, run, weight

FLOAT_DTYPES = ["f32", "f16", "bf16"]
F64 = np.float64


def f64(x: Array) -> Array:
    return np.asarray(x, F64)


# ---- mul_mat ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mul_mat_matches_numpy(backend: str, dtype: str) -> None:
    rng = np.random.default_rng(1)
    a = randn(rng, 5, 64, dtype=dtype)
    b = randn(rng, 64, 7, dtype=dtype)
    g = ls.Graph()
    x = g.input("a", a.shape, dtype)
    g.output("y", x @ weight(g, "b", b, dtype))
    y = run(g, backend, {"a": a})["y"]
    assert y.dtype == np.float32
    assert_nmse(y, f64(a) @ f64(b), dtype)


def test_mul_mat_broadcasts_batch_axes(backend: str) -> None:
    rng = np.random.default_rng(2)
    a = randn(rng, 3, 2, 5, 16)
    b = randn(rng, 16, 6)
    c = randn(rng, 1, 16, 4)
    g = ls.Graph()
    x = g.input("a", a.shape)
    g.output("ab", g.mul_mat(x, g.weight("b", b)))
    g.output("ac", g.mul_mat(x, g.weight("c", c)))
    out = run(g, backend, {"a": a})
    assert_nmse(out["ab"], f64(a) @ f64(b))
    assert_nmse(out["ac"], f64(a) @ f64(c))


@pytest.mark.parametrize(("na", "nb"), [(4, 2), (2, 4), (6, 2)])
def test_mul_mat_gqa_broadcast_uses_index_div_ratio(backend: str, na: int, nb: int) -> None:
    # Batch index i of the larger operand pairs with i // ratio of the smaller one (GQA:
    # query heads 0, 1 share KV head 0, heads 2, 3 share KV head 1).
    rng = np.random.default_rng(3)
    a = randn(rng, na, 3, 8)
    b = randn(rng, nb, 8, 5)
    g = ls.Graph()
    g.output("y", g.input("a", a.shape) @ g.input("b", b.shape))
    y = run(g, backend, {"a": a, "b": b})["y"]
    n = max(na, nb)
    ref = np.repeat(f64(a), n // na, axis=0) @ np.repeat(f64(b), n // nb, axis=0)
    assert y.shape == (n, 3, 5)
    assert_nmse(y, ref)


def test_mul_mat_reads_transposed_views(backend: str) -> None:
    rng = np.random.default_rng(4)
    x = randn(rng, 5, 16)
    w = randn(rng, 7, 16)  # stored [out, in] as GGUF does; used transposed
    g = ls.Graph()
    t = g.input("x", x.shape)
    wt = g.weight("w", w)
    g.output("y", t @ wt.T)
    g.output("z", g.mul_mat(wt, g.transpose(t)))
    out = run(g, backend, {"x": x})
    assert_nmse(out["y"], f64(x) @ f64(w).T)
    assert_nmse(out["z"], f64(w) @ f64(x).T)


# ---- element-wise -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("b_shape", [(6, 32), (32,), (6, 1), (1, 32)])
def test_add_and_mul_broadcast_b(backend: str, dtype: str, b_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(5)
    a = randn(rng, 6, 32, dtype=dtype)
    b = randn(rng, *b_shape, dtype=dtype)
    g = ls.Graph()
    x = g.input("a", a.shape, dtype)
    w = weight(g, "b", b, dtype)
    g.output("sum", x + w)
    g.output("prod", x * w)
    g.output("sum_fn", g.add(x, w))
    g.output("prod_fn", g.mul(x, w))
    out = run(g, backend, {"a": a})
    for name, ref in [("sum", f64(a) + f64(b)), ("prod", f64(a) * f64(b))]:
        assert_nmse(out[name], ref, dtype)
        assert out[name].tobytes() == out[name + "_fn"].tobytes()


def test_scale(backend: str) -> None:
    rng = np.random.default_rng(6)
    a = randn(rng, 4, 9)
    g = ls.Graph()
    x = g.input("a", a.shape)
    g.output("s", g.scale(x, -3.0))
    g.output("rmul", 0.5 * x)
    g.output("mul", x * 0.25)
    g.output("imul", x * 2)
    out = run(g, backend, {"a": a})
    assert_nmse(out["s"], -3.0 * f64(a))
    assert_nmse(out["rmul"], 0.5 * f64(a))
    assert_nmse(out["mul"], 0.25 * f64(a))
    assert_nmse(out["imul"], 2.0 * f64(a))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm(backend: str, dtype: str, eps: float) -> None:
    rng = np.random.default_rng(7)
    a = randn(rng, 2, 3, 48, dtype=dtype)
    g = ls.Graph()
    g.output("y", g.rms_norm(g.input("a", a.shape, dtype), eps=eps))
    y = run(g, backend, {"a": a})["y"]
    ref = f64(a) / np.sqrt(np.mean(f64(a) ** 2, axis=-1, keepdims=True) + eps)
    assert_nmse(y, ref, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_silu_gelu_swiglu(backend: str, dtype: str) -> None:
    rng = np.random.default_rng(8)
    a = host_array(3 * rng.standard_normal((5, 40)), dtype)
    b = randn(rng, 5, 40, dtype=dtype)
    g = ls.Graph()
    x = g.input("a", a.shape, dtype)
    y = g.input("b", b.shape, dtype)
    g.output("silu", g.silu(x))
    g.output("gelu", g.gelu(x))
    g.output("swiglu", g.swiglu(x, y))
    out = run(g, backend, {"a": a, "b": b})
    xa = f64(a)
    silu = xa / (1 + np.exp(-xa))
    gelu = 0.5 * xa * (1 + np.tanh(math.sqrt(2 / math.pi) * (xa + 0.044715 * xa**3)))
    assert_nmse(out["silu"], silu, dtype)
    assert_nmse(out["gelu"], gelu, dtype)
    assert_nmse(out["swiglu"], silu * f64(b), dtype)


def test_output_dtypes_follow_the_graph(backend: str) -> None:
    # f16 comes back as float16, bf16 as float32, i32 as int32; mul_mat and get_rows give f32.
    rng = np.random.default_rng(9)
    g = ls.Graph()
    h = g.input("h", [2, 4], "f16")
    bf = g.input("bf", [2, 4], "bf16")
    g.output("f16", g.silu(h))
    g.output("bf16", g.silu(bf))
    g.output("i32", g.argmax(h))
    g.output("mm", h @ g.weight("w", randn(rng, 4, 3, dtype="f16")))
    out = run(g, backend, {"h": randn(rng, 2, 4, dtype="f16"), "bf": randn(rng, 2, 4)})
    assert out["f16"].dtype == np.float16
    assert out["bf16"].dtype == np.float32
    assert out["i32"].dtype == np.int32
    assert out["mm"].dtype == np.float32


# ---- rope ---------------------------------------------------------------------------------------


def rope_ref(x: Array, pos: Array, n_dims: int, base: float, mode: str) -> Array:
    out = f64(x).copy()
    i = np.arange(n_dims // 2)
    theta = f64(pos)[:, None] * base ** (-2.0 * i / n_dims)  # [T, n_dims/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if mode == "normal":  # adjacent pairs (x[2i], x[2i+1])
        lo, hi = slice(0, n_dims, 2), slice(1, n_dims, 2)
    else:  # neox: halves (x[i], x[i + n_dims/2])
        lo, hi = slice(0, n_dims // 2), slice(n_dims // 2, n_dims)
    x0, x1 = f64(x)[..., lo], f64(x)[..., hi]
    out[..., lo] = x0 * cos - x1 * sin
    out[..., hi] = x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_dims", [None, 8])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope(backend: str, mode: str, n_dims: int | None, base: float) -> None:
    rng = np.random.default_rng(10)
    t, h, d = 5, 3, 16
    x = randn(rng, t, h, d)
    pos = rng.integers(0, 200, t).astype(np.int32)
    g = ls.Graph()
    y = g.rope(g.input("x", x.shape), g.input("pos", [t], "i32"), n_dims, base, mode)
    g.output("y", y)
    out = run(g, backend, {"x": x, "pos": pos})["y"]
    assert_nmse(out, rope_ref(x, pos, n_dims or d, base, mode))
    if n_dims is not None:  # dims past n_dims pass through untouched
        np.testing.assert_array_equal(out[..., n_dims:], x[..., n_dims:])


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_rope_low_precision(backend: str, dtype: str) -> None:
    rng = np.random.default_rng(11)
    x = randn(rng, 4, 2, 32, dtype=dtype)
    pos = np.array([0, 1, 7, 63], np.int32)
    g = ls.Graph()
    g.output("y", g.rope(g.input("x", x.shape, dtype), g.input("pos", [4], "i32"), mode="neox"))
    out = run(g, backend, {"x": x, "pos": pos})["y"]
    assert_nmse(out, rope_ref(x, pos, 32, 10000.0, "neox"), dtype)


# ---- soft_max -----------------------------------------------------------------------------------


def soft_max_ref(x: Array, mask: Array | None, scale: float) -> Array:
    z = f64(x) * scale
    if mask is not None:
        z = z + np.broadcast_to(f64(mask), z.shape)
    out = np.zeros_like(z)
    live = ~np.all(np.isneginf(z), axis=-1)  # fully masked rows give zeros
    zl = z[live]
    e = np.exp(zl - zl.max(axis=-1, keepdims=True))
    out[live] = e / e.sum(axis=-1, keepdims=True)
    return out


def test_soft_max_without_mask(backend: str) -> None:
    rng = np.random.default_rng(12)
    x = randn(rng, 3, 17)
    g = ls.Graph()
    g.output("y", g.soft_max(g.input("x", x.shape)))
    y = run(g, backend, {"x": x})["y"]
    assert_nmse(y, soft_max_ref(x, None, 1.0))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_soft_max_with_broadcast_mask_and_fully_masked_row(backend: str, dtype: str) -> None:
    rng = np.random.default_rng(13)
    h, t, n = 4, 3, 10
    x = randn(rng, h, t, n, dtype=dtype)
    mask = np.zeros((t, n), np.float32)
    mask[0, 5:] = -np.inf  # causal-like
    mask[1, :] = -np.inf  # a fully masked row (padding): must give zeros, not NaN
    mask[2, ::3] = -np.inf
    g = ls.Graph()
    xs = g.input("x", x.shape, dtype)
    g.output("y", g.soft_max(xs, g.input("mask", mask.shape), scale=0.125))
    y = run(g, backend, {"x": x, "mask": mask})["y"]
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y[:, 1, :], 0)
    assert_nmse(y, soft_max_ref(x, mask, 0.125), dtype)


# ---- copies, concat -----------------------------------------------------------------------------


@pytest.mark.parametrize(("src", "dst"), [("f32", "f16"), ("f32", "bf16"), ("f16", "f32")])
def test_cpy_converts(backend: str, src: str, dst: str) -> None:
    rng = np.random.default_rng(14)
    x = randn(rng, 6, 10, dtype=src)
    g = ls.Graph()
    g.output("y", g.cpy(g.input("x", x.shape, src), dst))
    y = run(g, backend, {"x": x})["y"]
    assert y.dtype == {"f32": np.float32, "f16": np.float16, "bf16": np.float32}[dst]
    lowest = "bf16" if "bf16" in (src, dst) else "f16"
    assert_nmse(y, f64(x), lowest)
    if dst == "bf16":  # exactly the round-to-nearest-even values
        np.testing.assert_array_equal(y, host_array(x, "bf16"))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_concat(backend: str, axis: int) -> None:
    rng = np.random.default_rng(15)
    a = randn(rng, 2, 3, 4)
    shape_b = [2, 3, 4]
    shape_b[axis] = 5
    b = randn(rng, *shape_b)
    g = ls.Graph()
    g.output("y", g.concat(g.input("a", a.shape), g.input("b", b.shape), axis))
    y = run(g, backend, {"a": a, "b": b})["y"]
    np.testing.assert_array_equal(y, np.concatenate([a, b], axis=axis))


# ---- views --------------------------------------------------------------------------------------


def test_views_match_numpy(backend: str) -> None:
    rng = np.random.default_rng(16)
    x = randn(rng, 2, 3, 4, 5)
    g = ls.Graph()
    t = g.input("x", x.shape)
    g.output("transpose", g.cont(g.transpose(t)))
    g.output("transpose02", g.cont(g.transpose(t, 0, 2)))
    g.output("T", g.cont(t.T))
    g.output("permute", g.cont(g.permute(t, [3, 1, 0, 2])))
    g.output("slice", g.cont(g.slice(t, 2, 1, 3)))
    g.output("reshape", g.reshape(t, [6, 20]))
    g.output("chain", g.cont(g.slice(g.permute(g.reshape(t, [6, 4, 5]), [2, 0, 1]), 1, 2, 5)))
    out = run(g, backend, {"x": x})
    refs = {
        "transpose": np.swapaxes(x, -2, -1),
        "transpose02": np.swapaxes(x, 0, 2),
        "T": np.swapaxes(x, -2, -1),
        "permute": np.transpose(x, [3, 1, 0, 2]),
        "slice": x[:, :, 1:3],
        "reshape": x.reshape(6, 20),
        "chain": np.transpose(x.reshape(6, 4, 5), [2, 0, 1])[:, 2:5],
    }
    for name, ref in refs.items():
        np.testing.assert_array_equal(out[name], ref, err_msg=name)


def test_view_outputs_come_back_as_numpy_layout(backend: str) -> None:
    rng = np.random.default_rng(17)
    x = randn(rng, 3, 4, 5)
    g = ls.Graph()
    t = g.input("x", x.shape)
    s = g.silu(t)  # a computed tensor, viewed without a copy
    g.output("permuted", g.permute(s, [2, 0, 1]))
    g.output("sliced", g.slice(s, 1, 1, 3))
    out = run(g, backend, {"x": x})
    silu = f64(x) / (1 + np.exp(-f64(x)))
    assert_nmse(out["permuted"], np.transpose(silu, [2, 0, 1]))
    assert_nmse(out["sliced"], silu[:, 1:3])


def test_ops_read_strided_views(backend: str) -> None:
    rng = np.random.default_rng(18)
    x = randn(rng, 6, 8)
    g = ls.Graph()
    t = g.input("x", x.shape)
    v = g.slice(g.transpose(t), 0, 2, 6)  # [4, 6], strided
    g.output("silu", g.silu(v))
    g.output("norm", g.rms_norm(v))
    g.output("add", g.add(v, v))
    xv = f64(x).T[2:6]
    out = run(g, backend, {"x": x})
    assert_nmse(out["silu"], xv / (1 + np.exp(-xv)))
    assert_nmse(out["norm"], xv / np.sqrt(np.mean(xv**2, axis=-1, keepdims=True) + 1e-5))
    assert_nmse(out["add"], 2 * xv)


# ---- indexing: get_rows, set_rows, argmax -------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("ids_shape", [(3,), (2, 3)])
def test_get_rows(backend: str, dtype: str, ids_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(19)
    table = randn(rng, 10, 12, dtype=dtype)
    ids = rng.integers(0, 10, ids_shape).astype(np.int32)
    g = ls.Graph()
    g.output("y", g.get_rows(weight(g, "table", table, dtype), g.input("ids", ids_shape, "i32")))
    y = run(g, backend, {"ids": ids})["y"]
    assert y.dtype == np.float32
    assert y.shape == (*ids_shape, 12)
    np.testing.assert_array_equal(y, np.asarray(table, np.float32)[ids])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_set_rows_persists_across_computes(backend: str, dtype: str) -> None:
    n, d = 8, 6
    g = ls.Graph()
    cache = g.persistent("cache", [n, d], dtype)
    src = g.input("src", [2, d])
    idx = g.input("idx", [2], "i32")
    written = g.set_rows(cache, src, idx)
    g.output("all_rows", g.cpy(written, "f32"))
    g.output("rows", g.get_rows(written, g.input("read", [3], "i32")))
    plan = ls.Context([backend]).compile(g)
    expect = np.zeros((n, d), np.float64)  # persistent tensors start zeroed
    rng = np.random.default_rng(20)
    # Each step writes two rows and reads rows written by this step and by earlier ones.
    steps = [([1, 3], [1, 3, 0]), ([0, 6], [0, 1, 6]), ([3, 7], [3, 6, 1])]
    for rows, read in steps:
        data = randn(rng, 2, d)
        plan.set_input("src", data)
        plan.set_input("idx", np.array(rows, np.int32))
        plan.set_input("read", np.array(read, np.int32))
        plan.compute()
        expect[rows] = f64(data)
        assert_nmse(plan.get_output("all_rows"), expect, dtype)
        assert_nmse(plan.get_output("rows"), expect[read], dtype)


def test_argmax_ties_go_to_lowest_index(backend: str) -> None:
    x = np.array(
        [[1, 5, 5, 0], [7, 7, 7, 7], [-1, -3, -1, -2], [0, 0, 0, 9]],
        np.float32,
    )
    rng = np.random.default_rng(21)
    r = randn(rng, 5, 300)
    g = ls.Graph()
    g.output("ties", g.argmax(g.input("x", x.shape)))
    g.output("rand", g.argmax(g.input("r", r.shape)))
    out = run(g, backend, {"x": x, "r": r})
    np.testing.assert_array_equal(out["ties"], [1, 0, 0, 3])
    np.testing.assert_array_equal(out["rand"], np.argmax(r, axis=-1))
    assert out["ties"].dtype == np.int32


# ---- mixture of experts -------------------------------------------------------------------------


def mul_mat_id_ref(experts: Array, x: Array, ids: Array, w: Array) -> Array:
    out = np.zeros((x.shape[0], experts.shape[2]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += f64(w)[t, j] * (f64(x)[t] @ f64(experts)[ids[t, j]])
    return out


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mul_mat_id_with_experts_that_get_no_rows(backend: str, dtype: str) -> None:
    rng = np.random.default_rng(22)
    e, k, n, t, top = 6, 16, 8, 5, 2
    experts = randn(rng, e, k, n, dtype=dtype)
    x = randn(rng, t, k)
    ids = np.stack([rng.choice([0, 2, 5], top, replace=False) for _ in range(t)]).astype(np.int32)
    w = rng.random((t, top)).astype(np.float32)  # experts 1, 3 and 4 get zero rows
    g = ls.Graph()
    y = g.mul_mat_id(
        weight(g, "experts", experts, dtype),
        g.input("x", x.shape),
        g.input("ids", ids.shape, "i32"),
        g.input("w", w.shape),
    )
    g.output("y", y)
    out = run(g, backend, {"x": x, "ids": ids, "w": w})["y"]
    assert out.shape == (t, n)
    assert_nmse(out, mul_mat_id_ref(experts, x, ids, w), dtype)


def test_mul_mat_id_with_zero_tokens(backend: str) -> None:
    # A ubatch with no rows (invariant 11's "zero outputs"): an empty result, no error.
    rng = np.random.default_rng(23)
    g = ls.Graph()
    y = g.mul_mat_id(
        g.weight("experts", randn(rng, 4, 8, 3)),
        g.input("x", [0, 8]),
        g.input("ids", [0, 2], "i32"),
        g.input("w", [0, 2]),
    )
    g.output("y", y)
    inputs = {
        "x": np.zeros((0, 8), np.float32),
        "ids": np.zeros((0, 2), np.int32),
        "w": np.zeros((0, 2), np.float32),
    }
    out = run(g, backend, inputs)["y"]
    assert out.shape == (0, 3)
    assert out.dtype == np.float32


# ---- cpu vs cpu-async: bit-identical on random graphs -------------------------------------------

T, D = 4, 16
RANDOM_OPS = [
    "add",
    "mul",
    "scale",
    "rms_norm",
    "silu",
    "gelu",
    "swiglu",
    "matmul",
    "soft_max",
    "rope",
    "transpose2",
    "f16_roundtrip",
    "concat_slice",
]


def random_graph(ops: list[str], seed: int) -> tuple[ls.Graph, dict[str, Array]]:
    """A graph of `ops` over [T, D] tensors; each op takes operands from earlier results."""
    rng = np.random.default_rng(seed)
    g = ls.Graph()
    pool = [g.input("x0", [T, D]), g.input("x1", [T, D])]
    pos = g.input("pos", [T], "i32")
    mask = g.input("mask", [T, D])
    for i, op in enumerate(ops):
        a, b = (pool[int(j)] for j in rng.integers(0, len(pool), 2))
        if op == "add":
            y = a + b
        elif op == "mul":
            y = a * b
        elif op == "scale":
            y = float(rng.uniform(-2, 2)) * a
        elif op == "rms_norm":
            y = g.rms_norm(a)
        elif op == "silu":
            y = g.silu(a)
        elif op == "gelu":
            y = g.gelu(a)
        elif op == "swiglu":
            y = g.swiglu(a, b)
        elif op == "matmul":
            y = a @ g.weight(f"w{i}", randn(rng, D, D) / 4)
        elif op == "soft_max":
            y = g.soft_max(a, mask, scale=0.5)
        elif op == "rope":
            y = g.reshape(g.rope(g.reshape(a, [T, 2, D // 2]), pos, mode="neox"), [T, D])
        elif op == "transpose2":
            y = g.cont(g.transpose(g.cont(g.transpose(a))))
        elif op == "f16_roundtrip":
            y = g.cpy(g.cpy(a, "f16"), "f32")
        else:
            y = g.cont(g.slice(g.concat(a, b, 1), 1, D // 2, D // 2 + D))
        pool.append(y)
    g.output("last", pool[-1])
    g.output("sum", pool[-1] + pool[len(pool) // 2])
    mask_data = np.where(rng.random((T, D)) < 0.2, -np.inf, 0.0).astype(np.float32)
    inputs = {
        "x0": randn(rng, T, D),
        "x1": randn(rng, T, D),
        "pos": rng.integers(0, 100, T).astype(np.int32),
        "mask": mask_data,
    }
    return g, inputs


@settings(max_examples=30)
@given(
    ops=st.lists(st.sampled_from(RANDOM_OPS), min_size=1, max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpu_and_cpu_async_are_bit_identical(ops: list[str], seed: int) -> None:
    results = []
    for backend, policy in [("cpu", None), ("cpu-async", "staged"), ("cpu-async", "stock")]:
        g, inputs = random_graph(ops, seed)
        results.append(run(g, backend, inputs, policy=policy))
    first = results[0]
    for other in results[1:]:
        assert first.keys() == other.keys()
        for name in first:
            assert first[name].dtype == other[name].dtype
            assert first[name].tobytes() == other[name].tobytes(), name
