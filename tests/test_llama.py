"""Llama-family graphs against the independent numpy reference in `llama_ref.py`.

Bounds (max |Δ| / max |ref|, float64 reference on the values the file stores):
- f32 KV cache, any weight type (F32, F16, BF16, Q8_0 dequantised to f16): ≤ 1e-4;
- f16 weights with an f16 KV cache: ≤ 1e-3 against the reference that rounds K and V to f16 as
  the cache does (measured ≤ 4e-5), and ≤ 5e-3 against exact math (measured ≤ 1.2e-3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lowsync as ls
from llama_ref import VARIANTS, Spec, forward, random_weights, rel_err, stored, write_gguf
from lowsync.models.llama import BUILTIN_CONFIGS, INPUTS, Llama, LlamaConfig

PROMPT = [5, 17, 3, 299, 42, 0, 7, 8, 100, 200, 11]  # 11 tokens: ubatches of 4, 4 and 3 (padded)
F32_BOUND = 1e-4


def _model(tmp_path: Path, spec: Spec, seed: int = 0) -> tuple[ls.Llama, dict[str, np.ndarray]]:
    w = random_weights(spec, seed)
    path = write_gguf(tmp_path / f"{spec.arch}-{spec.wtype}.gguf", spec, w)
    return ls.load_gguf(path), stored(spec, w)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_reference(tmp_path: Path, variant: str) -> None:
    spec = VARIANTS[variant]
    model, w = _model(tmp_path, spec)
    ref = forward(spec, w, PROMPT)
    sess = ls.Session(model, backends=["cpu"], n_ctx=32, n_seq=2, n_ubatch=4)
    # Prefill: one call, three ubatches (the last one padded), every row's logits.
    prefill = sess.decode(PROMPT, seq_id=0, logits="all")
    assert prefill is not None
    assert prefill.shape == (len(PROMPT), spec.n_vocab)
    assert rel_err(prefill, ref) <= F32_BOUND
    # Step by step in another sequence of the same cache: the 1-token graph, one row per step.
    steps = [sess.decode([t], seq_id=1, logits="last") for t in PROMPT]
    assert rel_err(np.stack(steps), ref) <= F32_BOUND  # type: ignore[arg-type]


@pytest.mark.parametrize("wtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q5_1"])
def test_weight_types_match_reference(tmp_path: Path, wtype: str) -> None:
    spec = VARIANTS["qwen2"].with_(wtype=wtype)
    model, w = _model(tmp_path, spec, seed=3)
    assert model.weight_type == wtype.lower()
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=16, n_ubatch=4)
    out = sess.decode(PROMPT, logits="all")
    # Quantized weights: the CPU's default products quantize activations to 16-bit blocks.
    bound = 1e-3 if wtype.startswith("Q") else F32_BOUND
    assert rel_err(out, forward(spec, w, PROMPT)) <= bound


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_f16_kv_cache_within_stated_bound(tmp_path: Path, variant: str) -> None:
    spec = VARIANTS[variant].with_(wtype="F16")
    model, w = _model(tmp_path, spec, seed=1)
    sess = ls.Session(model, backends=["cpu"], n_ctx=32, n_seq=2, n_ubatch=4, kv_dtype="f16")
    prefill = sess.decode(PROMPT, seq_id=0, logits="all")
    steps = np.stack([sess.decode([t], seq_id=1) for t in PROMPT])  # type: ignore[arg-type]
    rounded = forward(spec, w, PROMPT, kv_round=np.float16)
    exact = forward(spec, w, PROMPT)
    for out in (prefill, steps):
        assert rel_err(out, rounded) <= 1e-3
        assert rel_err(out, exact) <= 5e-3


def test_builtin_tiny_matches_reference() -> None:
    model = Llama.random("tiny", seed=0)
    cfg = model.config
    spec = Spec(
        n_vocab=cfg.n_vocab,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_head_kv=cfg.n_head_kv,
        n_ff=cfg.n_ff,
        head_dim=cfg.head_dim,
        rope_dims=cfg.head_dim,
    )
    w = {k: np.asarray(v, np.float64) for k, v in model.weights.items()}
    tokens = [1, 4095, 17, 300, 9, 9, 2048]
    out = ls.Session(model, backends=["cpu"], n_ctx=16, n_ubatch=8).decode(tokens, logits="all")
    assert rel_err(out, forward(spec, w, tokens)) <= F32_BOUND


def test_builtin_configs() -> None:
    want = {
        "tiny": (2, 256, 4, 2, 768, 4096),
        "small": (12, 768, 12, 4, 2048, 32000),
        "1b": (16, 2048, 32, 8, 8192, 32000),
    }
    for name, (n_layer, d, h, kv, ff, vocab) in want.items():
        c = BUILTIN_CONFIGS[name]
        assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.n_ff, c.n_vocab) == (
            n_layer,
            d,
            h,
            kv,
            ff,
            vocab,
        )
        assert (c.rope_theta, c.rms_eps, c.tied_embeddings) == (10000.0, 1e-5, False)
    tiny = Llama.random("tiny", seed=0)
    proj = tiny.weights["blk.0.attn_q.weight"]
    assert proj.dtype == np.float32
    assert proj.shape == (256, 256)
    assert abs(float(proj.std()) - 0.02) < 0.001
    assert "output.weight" in tiny.weights
    assert tiny.n_params == sum(int(np.prod(s)) for s in tiny.config.weight_shapes().values())
    f16 = Llama.random("tiny", seed=0, dtype="f16")
    assert f16.weights["blk.0.ffn_up.weight"].dtype == np.float16
    assert f16.weights["blk.0.ffn_norm.weight"].dtype == np.float32  # 1-D stays f32, as in GGUF
    # The same seed gives the same model.
    again = Llama.random("tiny", seed=0)
    assert np.array_equal(again.weights["output.weight"], tiny.weights["output.weight"])
    with pytest.raises(ValueError, match="unknown built-in model"):
        Llama.random("7b")


def test_graph_counts_depend_only_on_context_constants() -> None:
    model = Llama.random(LlamaConfig(300, 64, 2, 4, 2, 96), seed=0)
    counts = set()
    for n_tokens, n_out in [(1, 2), (4, 4), (4, 1), (32, 32), (32, 7)]:
        g = model.build_graph(n_tokens, 65, n_out)
        counts.add((g.n_nodes, g.n_leafs))
    assert len(counts) == 1, counts
    # One token with one output: the same graph less the output-row selection (its only row is
    # row 0), and the same inputs (`out_ids` is declared, not read).
    ((nodes, leafs),) = counts
    one = model.build_graph(1, 65, 1)
    assert (one.n_nodes, one.n_leafs) == (nodes - 1, leafs)
    for g in (model.build_graph(4, 65, 4), one):
        plan = ls.Context(["cpu"]).compile(g)
        assert sorted(plan.inputs) == sorted(INPUTS)
        assert sorted(plan.outputs) == ["logits", "next"]


# Per layer of the decode graph, what the CUDA backend launches (ARCHITECTURE: 5 per layer).
DECODE_LAYER_LAUNCHES = [
    "fused gemv+norm+tails [rms_norm,mul,mul_mat,mul_mat,mul_mat,rope,rope,set_rows,set_rows]",
    "fused attention+cpy [mul_mat,soft_max,mul_mat,cpy]",
    "fused gemv [mul_mat,add]",
    "fused gemv+norm+swiglu [rms_norm,mul,mul_mat,mul_mat,swiglu]",
    "fused gemv [mul_mat,add]",
]


@pytest.mark.parametrize("n_ctx", [64, 4096])
def test_cuda_decode_plan_is_five_launches_per_layer_at_any_cache_size(n_ctx: int) -> None:
    """The decode graph's CUDA launches, worked out without a device (`cuda_fusion_plan`, on a
    plan compiled for `noop`: the same nodes; CUDA aligns scratch to 256 bytes, noop to 64):
    the embedding row, five fused launches per layer, the final norm, and the head with its
    argmax folded in and the one-thread take of the index (a one-token graph selects no output
    row, and no kernel reads the logits back). The last layer's attention
    writes no scores (nothing reads them after the graph), at a small cache and a large one
    alike."""
    model = Llama.random(LlamaConfig(300, 128, 3, 4, 2, 256), seed=0, dtype="f16")
    sess = ls.Session(model, backends=["noop"], n_ctx=n_ctx, n_ubatch=4, kv_dtype="f16")
    launches = ls._native.cuda_fusion_plan(sess.plans[0])
    head = ["fused norm_mul [rms_norm,mul]", "fused gemv+argmax [mul_mat,argmax]", "argmax_take"]
    assert launches == ["get_rows", *DECODE_LAYER_LAUNCHES * 3, *head], launches
    with pytest.raises(ls.InputError, match="split 1 does not exist"):
        ls._native.cuda_fusion_plan(sess.plans[0], 1)


def test_cuda_decode_plan_of_a_quantized_head_is_one_launch() -> None:
    """On quantized weights the head takes the final norm as its prologue and the index itself
    (`gemv_q_head_fold`, on by default): after the layers, one launch where a plain head has
    three. Needs `gguf` to quantize the random weights."""
    pytest.importorskip("gguf")
    model = Llama.random(LlamaConfig(256, 128, 2, 4, 2, 256), seed=0, dtype="q4_0")
    sess = ls.Session(model, backends=["noop"], n_ctx=64, n_ubatch=4, kv_dtype="f16")
    launches = ls._native.cuda_fusion_plan(sess.plans[0])
    head = ["fused norm+gemv+argmax [rms_norm,mul,mul_mat,argmax]"]
    assert launches == ["get_rows", *DECODE_LAYER_LAUNCHES * 2, *head], launches


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_cuda_prefill_plan_fuses_each_layers_attention(kv_dtype: str) -> None:
    """The prefill graph's CUDA launches, worked out without a device: each layer's attention
    (scores, softmax, p @ V and the permuting copy) is one `attn_prefill` launch, its scores
    and p never written (dead after it), with either cache dtype."""
    model = Llama.random(LlamaConfig(300, 128, 3, 4, 2, 256), seed=0, dtype="f16")
    sess = ls.Session(model, backends=["noop"], n_ctx=80, n_ubatch=40, kv_dtype=kv_dtype)
    launches = ls._native.cuda_fusion_plan(sess.plans[-1])
    fused = "fused attention_prefill+cpy [mul_mat,soft_max,mul_mat,cpy]"
    assert launches.count(fused) == 3, launches
    assert "soft_max" not in launches, launches


def test_config_and_weight_errors() -> None:
    with pytest.raises(ValueError, match="n_head_kv"):
        LlamaConfig(300, 64, 2, 4, 3, 96)
    with pytest.raises(ValueError, match="rope_dims"):
        LlamaConfig(300, 64, 2, 4, 2, 96, rope_dims=7)
    with pytest.raises(ValueError, match="arch"):
        LlamaConfig(300, 64, 2, 4, 2, 96, arch="gpt2")
    with pytest.raises(ValueError, match="n_embd"):
        LlamaConfig(300, 0, 2, 4, 2, 96)
    model = Llama.random(LlamaConfig(300, 64, 1, 4, 2, 96), seed=0)
    weights = dict(model.weights)
    weights["blk.0.ffn_up.weight"] = np.zeros((95, 64), np.float32)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*\(95, 64\)"):
        Llama(model.config, weights)
    del weights["blk.0.ffn_up.weight"]
    with pytest.raises(ValueError, match="lacks weights"):
        Llama(model.config, weights)
    with pytest.raises(ValueError, match="n_tokens"):
        model.build_graph(0, 16, 1)


def test_an_unknown_builtin_model_is_a_lowsync_error_naming_the_choices() -> None:
    with pytest.raises(ls.ModelError, match="tiny") as info:
        ls.Llama.random("huge")
    assert isinstance(info.value, ls.LowsyncError)
    with pytest.raises(ls.ModelError, match="dtype"):
        ls.Llama.random("tiny", dtype="q4")
