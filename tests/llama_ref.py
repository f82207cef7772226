"""An independent numpy reference of llama-family decoders, and GGUF files to test against it.

Nothing here calls lowsync: the reference forward pass is written from the model definitions
(RMSNorm, RoPE normal/neox, grouped-query attention with a causal mask, SwiGLU) in float64, and
the model files are written with the `gguf` package's own `GGUFWriter`, so lowsync's loader,
graph and session are checked against code that shares nothing with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class Spec:
    """Hyper-parameters and variant of a test model (GGUF architecture and tensor types)."""

    arch: str = "llama"
    n_vocab: int = 300
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 96
    head_dim: int = 16
    rope_dims: int = 16
    theta: float = 10000.0
    eps: float = 1e-5
    bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    wtype: str = "F32"  # type of the 2-D tensors: F32, F16, BF16, or one gguf quantizes (Q8_0)
    extra_keys: dict[str, Any] = field(default_factory=dict)  # str, float, int or list

    @property
    def neox(self) -> bool:
        return self.arch in ("qwen2", "qwen3")

    def with_(self, **kw: Any) -> Spec:
        return replace(self, **kw)


# The architecture variants the suite checks, each small enough to run in milliseconds.
VARIANTS: dict[str, Spec] = {
    "llama": Spec(),
    "mistral": Spec(arch="mistral", n_head_kv=1, theta=1e6),
    "qwen2": Spec(arch="qwen2", bias=True, theta=1e6, eps=1e-6),
    "qwen3": Spec(arch="qwen3", qk_norm=True, head_dim=32, rope_dims=32, eps=1e-6),
    "tied": Spec(tied=True, n_head_kv=4),
    "partial_rope": Spec(rope_dims=8),
}


def spec_of(cfg: Any) -> Spec:
    """The Spec of a model configuration (an object with lowsync `LlamaConfig`'s fields; read
    by name, so nothing of lowsync is imported)."""
    return Spec(
        arch=cfg.arch,
        n_vocab=cfg.n_vocab,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_head_kv=cfg.n_head_kv,
        n_ff=cfg.n_ff,
        head_dim=cfg.head_dim,
        rope_dims=cfg.rope_dims,
        theta=cfg.rope_theta,
        eps=cfg.rms_eps,
        tied=cfg.tied_embeddings,
    )


def random_weights(spec: Spec, seed: int = 0) -> dict[str, Array]:
    """float32 weights in numpy order ([out, in]) under GGUF names."""
    rng = np.random.default_rng(seed)
    d, hd = spec.n_embd, spec.head_dim
    q, kv = spec.n_head * hd, spec.n_head_kv * hd

    def mat(*shape: int) -> Array:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def vec(n: int, around: float) -> Array:
        return (around + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, Array] = {"token_embd.weight": mat(spec.n_vocab, d)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = vec(d, 1.0)
        w[p + "attn_q.weight"] = mat(q, d)
        w[p + "attn_k.weight"] = mat(kv, d)
        w[p + "attn_v.weight"] = mat(kv, d)
        if spec.bias:
            w[p + "attn_q.bias"] = vec(q, 0.0)
            w[p + "attn_k.bias"] = vec(kv, 0.0)
            w[p + "attn_v.bias"] = vec(kv, 0.0)
        if spec.qk_norm:
            w[p + "attn_q_norm.weight"] = vec(hd, 1.0)
            w[p + "attn_k_norm.weight"] = vec(hd, 1.0)
        w[p + "attn_output.weight"] = mat(d, q)
        w[p + "ffn_norm.weight"] = vec(d, 1.0)
        w[p + "ffn_gate.weight"] = mat(spec.n_ff, d)
        w[p + "ffn_up.weight"] = mat(spec.n_ff, d)
        w[p + "ffn_down.weight"] = mat(d, spec.n_ff)
    w["output_norm.weight"] = vec(d, 1.0)
    if not spec.tied:
        w["output.weight"] = mat(spec.n_vocab, d)
    return w


def stored(spec: Spec, weights: dict[str, Array]) -> dict[str, Array]:
    """The values a file of `spec.wtype` holds (2-D tensors rounded to the type, as float64)."""
    qt = gguf.GGMLQuantizationType
    out = {}
    for name, w in weights.items():
        if w.ndim == 2 and spec.wtype != "F32":
            t = qt[spec.wtype]
            w = gguf.quants.dequantize(gguf.quants.quantize(w, t), t)
        out[name] = np.asarray(w, np.float64)
    return out


def write_gguf(path: Path, spec: Spec, weights: dict[str, Array], vocab: bool = True) -> Path:
    """Writes a model file with `gguf.GGUFWriter`."""
    qt = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(f"test-{spec.arch}")
    w.add_context_length(512)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    if spec.head_dim * spec.n_head != spec.n_embd:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.rope_dims)
    w.add_rope_freq_base(spec.theta)
    w.add_layer_norm_rms_eps(spec.eps)
    for key, value in spec.extra_keys.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    if vocab:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"t{i}" for i in range(spec.n_vocab)])
        w.add_token_types([1] * spec.n_vocab)
    for name, data in weights.items():
        if data.ndim == 2 and spec.wtype != "F32":
            t = qt[spec.wtype]
            w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the reference forward pass ----------------------------------------------------------------


def _rms(x: Array, eps: float) -> Array:
    out: Array = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return out


def _rope(x: Array, pos: Array, n_rot: int, theta: float, neox: bool) -> Array:
    """x [T, H, D]: rotate the first n_rot dims of each head by angle pos * theta^(-2i/n_rot)."""
    half = n_rot // 2
    ang = pos[:, None] * theta ** (-2.0 * np.arange(half) / n_rot)  # [T, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def forward(spec: Spec, w: dict[str, Array], tokens: list[int], kv_round: Any = None) -> Array:
    """Logits [len(tokens), n_vocab] (float64) of one sequence at positions 0, 1, ...

    `kv_round` (e.g. `np.float16`) rounds K and V as a cache of that dtype would store them.
    """
    n, hd = len(tokens), spec.head_dim
    pos = np.arange(n, dtype=np.float64)
    x = w["token_embd.weight"][tokens]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        h = _rms(x, spec.eps) * w[p + "attn_norm.weight"]
        q, k, v = (h @ w[p + f"attn_{c}.weight"].T for c in "qkv")
        if spec.bias:
            q, k, v = (t + w[p + f"attn_{c}.bias"] for t, c in zip((q, k, v), "qkv", strict=True))
        q = q.reshape(n, spec.n_head, hd)
        k = k.reshape(n, spec.n_head_kv, hd)
        v = v.reshape(n, spec.n_head_kv, hd)
        if spec.qk_norm:
            q = _rms(q, spec.eps) * w[p + "attn_q_norm.weight"]
            k = _rms(k, spec.eps) * w[p + "attn_k_norm.weight"]
        q = _rope(q, pos, spec.rope_dims, spec.theta, spec.neox)
        k = _rope(k, pos, spec.rope_dims, spec.theta, spec.neox)
        if kv_round is not None:
            k = k.astype(kv_round).astype(np.float64)
            v = v.astype(kv_round).astype(np.float64)
        heads = []
        group = spec.n_head // spec.n_head_kv
        for hh in range(spec.n_head):
            kk, vv = k[:, hh // group], v[:, hh // group]
            s = q[:, hh] @ kk.T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            heads.append((s / s.sum(axis=-1, keepdims=True)) @ vv)
        att = np.stack(heads, axis=1).reshape(n, spec.n_head * hd)
        x = x + att @ w[p + "attn_output.weight"].T
        h = _rms(x, spec.eps) * w[p + "ffn_norm.weight"]
        g = h @ w[p + "ffn_gate.weight"].T
        u = h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    x = _rms(x, spec.eps) * w["output_norm.weight"]
    out: Array = x @ w["output.weight" if not spec.tied else "token_embd.weight"].T
    return out


def rel_err(out: npt.ArrayLike, ref: npt.ArrayLike) -> float:
    """max |out - ref| / max |ref|."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert o.shape == r.shape, f"shape {o.shape} != reference {r.shape}"
    return float(np.max(np.abs(o - r)) / np.max(np.abs(r)))
