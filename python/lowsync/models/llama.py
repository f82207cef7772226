"""Llama-family decoders (llama, mistral, qwen2, qwen3) as lowsync graphs, one per shape bucket.

Why: a runtime that keeps the host out of the device's way needs graphs whose shapes never
change between steps (ARCHITECTURE §6, S2): then a graph is placed, allocated and uploaded once
per bucket, and each step only writes a few small inputs. This module owns that graph contract
for the llama family; `lowsync.Session` owns the KV-cache bookkeeping that fills the inputs.

Strategy: weights are numpy arrays in numpy order with GGUF tensor names (`blk.0.attn_q.weight`
is `[n_head * head_dim, n_embd]`, i.e. `[out, in]`, exactly as the GGUF reader exposes it), so a
projection is `x @ w.T` over a transposed view and no weight is copied or transposed at load.
`Llama.build_graph(n_tokens, n_ctx, n_out)` builds one bucket:

- inputs (written by the host every step): `tokens` i32 [T], `pos` i32 [T], `kv_idx` i32 [T]
  (the KV-cache row each token's K and V are written to, with `set_rows`), `kq_mask` f32
  [T, n_ctx] (0 where a token may attend a cache row, -inf elsewhere; a fully masked row gives
  zeros) and `out_ids` i32 [n_out] (the token rows whose logits are computed; a one-token
  graph with one output has only row 0 and does not read it);
- persistent state: per layer `cache_k_l{i}` and `cache_v_l{i}`, [n_ctx, n_head_kv * head_dim];
- outputs: `logits` f32 [n_out, n_vocab] and `next` i32 [n_out], the greedy token of each output
  row (argmax on the device, so a decode step reads back 4 bytes).

With `sampling=True`, `next` is drawn on the device instead (`lowsync.sampling`): `next =
sample(penalize(logits, hist, sample_penalty), sample_params, sample_key)`, from four more
host inputs that ride in the same staged upload: `sample_penalty` f32 [n_out, 3] (repeat,
frequency, presence), `sample_params` f32 [n_out, 4] (temperature, top_k, top_p, min_p),
`sample_key` i32 [n_out, 2] (seed, counter) and `sample_hist` i32, the recent tokens of each
output row's sequence (-1: an empty slot). `hist` is `sample_hist` [n_out, N] (N =
`penalty_last_n`), except in the one-token graph, where the host may not know the token it
decodes (launch-ahead feeds it on the device into `tokens`): there `sample_hist` is
[1, N - 1] and the window's last column is the `tokens` input itself, `hist = concat(
sample_hist, reshape(tokens, [1, 1]))` (with N = 1 there is no `sample_hist`). With N = 0
there is no penalty window: no `penalize`, no `sample_hist`, no `sample_penalty`.

Quantized weights (GGUF block dtypes, `lowsync.quants`) are `uint8` arrays of GGUF's byte shape
with their dtype in `Llama.dtypes`; they go into the graph as raw blocks with their logical
shape, and only `get_rows` (the embedding) and the projections read them. A backend without
quantized kernels gets them widened once (`Llama.prepared_for`).

Invariants: the node and leaf counts are a function of the config and (T, n_ctx, n_out) only —
never of positions, sequences, shared cells or how many outputs a step wants (S2, invariant 12);
attention always spans all n_ctx rows and validity travels in `kq_mask`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from lowsync import quants
from lowsync._native import Context, Graph, LowsyncError, Tensor
from lowsync.gguf_writer import save_gguf

_log = logging.getLogger("lowsync")


class ModelError(LowsyncError, ValueError):
    """A bad model argument: an unknown built-in name, a weight dtype lowsync does not have."""


Array = npt.NDArray[Any]
RopeMode = Literal["normal", "neox"]

# Names of the graph's host inputs, persistent tensors and outputs (the Session writes these).
INPUTS: tuple[str, ...] = ("tokens", "pos", "kv_idx", "kq_mask", "out_ids")
# The sampler's inputs of a graph built with `sampling=True` (see the module docstring).
SAMPLE_HIST = "sample_hist"
SAMPLE_PENALTY = "sample_penalty"
SAMPLE_PARAMS = "sample_params"
SAMPLE_KEY = "sample_key"
OUTPUT_LOGITS = "logits"
OUTPUT_NEXT = "next"

# Architectures whose GGUF tensors follow llama's layout, with the RoPE variant llama.cpp assigns.
ARCH_ROPE: dict[str, RopeMode] = {
    "llama": "normal",
    "mistral": "normal",
    "qwen2": "neox",
    "qwen3": "neox",
}

WEIGHT_DTYPES: tuple[str, ...] = ("f32", "f16", "bf16")
# Every dtype a weight may have: the plain ones and the GGUF block types.
ALL_WEIGHT_DTYPES: tuple[str, ...] = WEIGHT_DTYPES + quants.QUANT_DTYPES


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a llama-family decoder.

    `head_dim` and `rope_dims` default (0) to `n_embd // n_head` and `head_dim`. `qkv_bias`
    (qwen2), `qk_norm` (qwen3: RMS norm of each q and k head before RoPE) and
    `tied_embeddings` (no `output.weight`: logits use `token_embd.weight`) select the variant.
    """

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_dims: int = 0
    rope_mode: RopeMode = "normal"
    rms_eps: float = 1e-5
    arch: str = "llama"
    n_ctx_train: int = 2048
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.n_head > 0:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.rope_dims == 0:
            object.__setattr__(self, "rope_dims", self.head_dim)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"LlamaConfig.{f.name} must be a positive integer, got {value!r}")
        if self.arch not in ARCH_ROPE:
            raise ValueError(
                f"LlamaConfig.arch {self.arch!r} is not supported (supported: "
                f"{', '.join(ARCH_ROPE)})"
            )
        if self.rope_mode not in ("normal", "neox"):
            raise ValueError(
                f"LlamaConfig.rope_mode must be 'normal' or 'neox', got {self.rope_mode!r}"
            )
        if self.n_head % self.n_head_kv != 0:
            raise ValueError(
                f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_head_kv "
                f"({self.n_head_kv})"
            )
        if self.rope_dims % 2 != 0 or self.rope_dims > self.head_dim:
            raise ValueError(
                f"LlamaConfig.rope_dims ({self.rope_dims}) must be even and at most head_dim "
                f"({self.head_dim})"
            )
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"LlamaConfig.rope_theta must be positive, got {self.rope_theta}")
        if not (self.rms_eps > 0 and math.isfinite(self.rms_eps)):
            raise ValueError(f"LlamaConfig.rms_eps must be positive, got {self.rms_eps}")

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, GGUF name -> numpy shape, in file order."""
        d, hd = self.n_embd, self.head_dim
        q, kv = self.n_head * hd, self.n_head_kv * hd
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, d)}
        for i in range(self.n_layer):
            p = f"blk.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            shapes[p + "attn_q.weight"] = (q, d)
            shapes[p + "attn_k.weight"] = (kv, d)
            shapes[p + "attn_v.weight"] = (kv, d)
            if self.qkv_bias:
                shapes[p + "attn_q.bias"] = (q,)
                shapes[p + "attn_k.bias"] = (kv,)
                shapes[p + "attn_v.bias"] = (kv,)
            if self.qk_norm:
                shapes[p + "attn_q_norm.weight"] = (hd,)
                shapes[p + "attn_k_norm.weight"] = (hd,)
            shapes[p + "attn_output.weight"] = (d, q)
            shapes[p + "ffn_norm.weight"] = (d,)
            shapes[p + "ffn_gate.weight"] = (self.n_ff, d)
            shapes[p + "ffn_up.weight"] = (self.n_ff, d)
            shapes[p + "ffn_down.weight"] = (d, self.n_ff)
        shapes["output_norm.weight"] = (d,)
        if not self.tied_embeddings:
            shapes["output.weight"] = (self.n_vocab, d)
        return shapes


# The built-in random models (`Llama.random`), as issue 4 defines them.
BUILTIN_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(n_vocab=4096, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=768),
    "small": LlamaConfig(n_vocab=32000, n_embd=768, n_layer=12, n_head=12, n_head_kv=4, n_ff=2048),
    "1b": LlamaConfig(n_vocab=32000, n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192),
}


def _dtype_of(name: str, data: Array, declared: str | None) -> str:
    if declared in quants.QUANT_DTYPES:
        if data.dtype != np.uint8:
            raise ValueError(
                f"weight {name!r} is {declared}: its data must be the raw blocks as uint8, got "
                f"numpy {data.dtype}"
            )
        return declared
    if declared is not None and declared not in WEIGHT_DTYPES:
        raise ValueError(
            f"weight {name!r} has dtype {declared!r}; weight dtypes are "
            f"{', '.join(ALL_WEIGHT_DTYPES)}"
        )
    if data.dtype == np.float16:
        if declared not in (None, "f16"):
            raise ValueError(f"weight {name!r}: float16 data cannot be {declared}")
        return "f16"
    if data.dtype == np.float32:
        if declared not in (None, "f32", "bf16"):
            raise ValueError(f"weight {name!r}: float32 data cannot be {declared}")
        return declared or "f32"
    raise ValueError(
        f"weight {name!r} has numpy dtype {data.dtype}; lowsync weights are float32 (f32, or "
        "bf16 values held in float32) or float16"
    )


@dataclass
class Llama:
    """A llama-family decoder: a config and its weights (numpy arrays, GGUF names, numpy order).

    Make one with `Llama.random("tiny", seed=0)` or `lowsync.load_gguf(path)`; run it with
    `lowsync.Session(model)`. `dtypes` maps a weight name to "f32", "f16" or "bf16" (bf16
    weights are float32 arrays whose values are bf16-representable), or to a block dtype
    ("q4_0", "q4_k", ...: the weight is its raw blocks, a uint8 array of GGUF's byte shape
    `[..., row_bytes]`); it defaults from the arrays' numpy dtypes. `metadata` keeps GGUF
    tokenizer fields so `save_gguf` can write them back (key -> (value, GGUF value type, array
    item type)).

    Example::

        model = Llama.random("tiny", seed=0)
        g = model.build_graph(n_tokens=1, n_ctx=64, n_out=1)
    """

    config: LlamaConfig
    weights: dict[str, Array]
    name: str = "llama"
    dtypes: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, tuple[Any, int, int | None]] = field(default_factory=dict)
    source: str | None = None

    def __post_init__(self) -> None:
        want = self.config.weight_shapes()
        missing = [n for n in want if n not in self.weights]
        if missing:
            raise ValueError(f"model {self.name!r} lacks weights {missing[:8]}")
        extra = [n for n in self.weights if n not in want]
        if extra:
            raise ValueError(
                f"model {self.name!r} has weights the {self.config.arch} graph does not use: "
                f"{extra[:8]}"
            )
        for n, shape in want.items():
            data = self.weights[n]
            self.dtypes[n] = dtype = _dtype_of(n, data, self.dtypes.get(n))
            if dtype in quants.QUANT_DTYPES:
                shape = quants.byte_shape(shape, dtype)
            if tuple(data.shape) != shape:
                quant = dtype in quants.QUANT_DTYPES
                kind = f" (the byte shape of {dtype} blocks)" if quant else ""
                raise ValueError(
                    f"weight {n!r} has shape {tuple(data.shape)}, the config needs {shape}{kind}"
                )

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def random(cls, name: str | LlamaConfig, seed: int = 0, dtype: str = "f32") -> Llama:
        """A model with weights drawn from N(0, 0.02) and norm weights of one.

        `name` is a built-in model ("tiny", "small", "1b"; see `BUILTIN_CONFIGS`) or a
        `LlamaConfig`. `dtype` ("f32", "f16", "bf16", or a block dtype lowsync quantizes:
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0") applies to the matrices; 1-D weights (norms,
        biases) stay f32, as in GGUF files. Quantizing uses the `gguf` package.
        """
        if isinstance(name, LlamaConfig):
            config, label = name, "custom"
        else:
            if name not in BUILTIN_CONFIGS:
                raise ModelError(
                    f"unknown built-in model {name!r} (built-in: {', '.join(BUILTIN_CONFIGS)})"
                )
            config, label = BUILTIN_CONFIGS[name], name
        if dtype not in WEIGHT_DTYPES + quants.QUANTIZABLE:
            more = (
                f" (lowsync does not quantize to {dtype}; load such a model from a GGUF file)"
                if dtype in quants.QUANT_DTYPES
                else ""
            )
            raise ModelError(
                f"dtype must be one of {WEIGHT_DTYPES + quants.QUANTIZABLE}, got {dtype!r}{more}"
            )
        if dtype in quants.QUANTIZABLE:
            bad = [
                n
                for n, s in config.weight_shapes().items()
                if len(s) == 2 and s[-1] % quants.block_facts(dtype)[0]
            ]
            if bad:
                raise ModelError(
                    f"cannot make {dtype} weights: the rows of {bad[:4]} are not whole "
                    f"{quants.block_facts(dtype)[0]}-element blocks"
                )
        rng = np.random.default_rng(seed)
        weights: dict[str, Array] = {}
        dtypes: dict[str, str] = {}
        for n, shape in config.weight_shapes().items():
            if n.endswith("norm.weight"):
                weights[n] = np.ones(shape, np.float32)
                dtypes[n] = "f32"
                continue
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            if len(shape) == 1:
                weights[n], dtypes[n] = w, "f32"
            elif dtype == "f16":
                weights[n], dtypes[n] = w.astype(np.float16), "f16"
            elif dtype == "bf16":
                weights[n], dtypes[n] = _round_bf16(w), "bf16"
            elif dtype in quants.QUANTIZABLE:
                weights[n], dtypes[n] = quants.quantize(w, dtype), dtype
            else:
                weights[n], dtypes[n] = w, "f32"
        return cls(config, weights, name=label, dtypes=dtypes)

    # ---- facts --------------------------------------------------------------------------------

    @property
    def n_params(self) -> int:
        """Number of weight elements (logical elements for quantized weights)."""
        return sum(math.prod(s) for s in self.config.weight_shapes().values())

    @property
    def weight_type(self) -> str:
        """The dtype of the projection matrices ("f32", "f16", "bf16", "q4_0", ...), for
        reports."""
        return self.dtypes.get("blk.0.attn_q.weight", "f32")

    def weight_uses(self, name: str) -> list[tuple[str, str, list[str]]]:
        """How the decoder graph reads weight `name`: `(op, result dtype, source dtypes)` for
        each op that reads it (what a context is asked before a quantized weight is kept)."""
        dt = self.dtypes[name]
        uses: list[tuple[str, str, list[str]]] = []
        if name == "token_embd.weight":
            uses.append(("get_rows", "f32", [dt, "i32"]))
            if self.config.tied_embeddings:
                uses.append(("mul_mat", "f32", ["f32", dt]))
        elif len(self.config.weight_shapes()[name]) == 2:
            uses.append(("mul_mat", "f32", ["f32", dt]))
        return uses

    def prepared_for(self, context: Context) -> Llama:
        """This model, or a copy in which every quantized weight some backend of `context`
        cannot read is widened to f16 (f32 where a value exceeds f16's range).

        Called once per session (`lowsync.Session`), so the widening happens once; it logs one
        line on the `lowsync` logger naming the weights' types and the backends.
        """
        widen = [
            n
            for n, dt in self.dtypes.items()
            if dt in quants.QUANT_DTYPES
            and not all(context.supports(op, dst, srcs) for op, dst, srcs in self.weight_uses(n))
        ]
        if not widen:
            return self
        kinds = sorted({self.dtypes[n] for n in widen})
        _log.info(
            "lowsync: widening %d quantized weights (%s) of model %r to f16 for backends %s, "
            "which have no kernels for them",
            len(widen),
            ", ".join(kinds),
            self.name,
            context.backends,
        )
        weights, dtypes = dict(self.weights), dict(self.dtypes)
        for n in widen:
            weights[n], dtypes[n] = quants.widen(self.weights[n], self.dtypes[n])
        return Llama(
            self.config,
            weights,
            name=self.name,
            dtypes=dtypes,
            metadata=self.metadata,
            source=self.source,
        )

    def with_config(self, **changes: Any) -> Llama:
        """The same weights under a config with `changes` applied (e.g. `rope_theta=1e6`)."""
        return Llama(
            replace(self.config, **changes),
            self.weights,
            name=self.name,
            dtypes=dict(self.dtypes),
            metadata=self.metadata,
            source=self.source,
        )

    def save_gguf(self, path: str | Path) -> None:
        """Writes the model to a GGUF file llama.cpp can load (see `lowsync.gguf_writer`)."""
        save_gguf(self, path)

    # ---- graph --------------------------------------------------------------------------------

    def build_graph(
        self,
        n_tokens: int,
        n_ctx: int,
        n_out: int,
        kv_dtype: str = "f32",
        backend: str | None = None,
        sampling: bool = False,
        penalty_last_n: int = 64,
        layer_backends: Sequence[str] | None = None,
    ) -> Graph:
        """The decoder graph of one shape bucket (see the module docstring for its contract).

        `n_tokens` tokens per step, `n_ctx` KV-cache rows spanned by attention, `n_out` output
        rows; `kv_dtype` ("f32", "f16" or "bf16") is the cache's dtype. `backend` pins the
        weights to one backend (default: let the scheduler place them). `layer_backends` (one
        backend name per layer) pins each layer's weights and KV cache to its backend instead,
        the embedding to the first layer's and the output head to the last layer's (a tied
        head, one tensor, to the last): a pipeline of stages across devices, whose activations
        the scheduler copies at each stage boundary. `sampling` draws `next` with penalties over
        a window of `penalty_last_n` recent tokens instead of the argmax.
        """
        if layer_backends is not None:
            layer_backends = list(layer_backends)
            if backend is not None:
                raise ValueError("pass backend or layer_backends, not both")
            if len(layer_backends) != self.config.n_layer or not all(
                isinstance(b, str) and b for b in layer_backends
            ):
                raise ValueError(
                    f"layer_backends must name a backend for each of the {self.config.n_layer} "
                    f"layers, got {layer_backends!r:.200}"
                )
        for what, v in (("n_tokens", n_tokens), ("n_ctx", n_ctx), ("n_out", n_out)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{what} must be a positive integer, got {v!r}")
        if kv_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"kv_dtype must be one of {WEIGHT_DTYPES}, got {kv_dtype!r}")
        if isinstance(penalty_last_n, bool) or not isinstance(penalty_last_n, int):
            raise ValueError(f"penalty_last_n must be an int, got {penalty_last_n!r}")
        if penalty_last_n < 0:
            raise ValueError(f"penalty_last_n must be >= 0 (0: no penalties), got {penalty_last_n}")
        builder = _GraphBuilder(self, n_tokens, n_ctx, n_out, kv_dtype, backend, layer_backends)
        return builder.build(penalty_last_n if sampling else None)


def _round_bf16(x: Array) -> Array:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    out: Array = rounded.astype(np.uint32).view(np.float32)
    return out


class _GraphBuilder:
    """Builds one bucket's graph; holds the graph and the weight tensors made so far."""

    def __init__(
        self,
        model: Llama,
        t: int,
        n_ctx: int,
        n_out: int,
        kv_dtype: str,
        backend: str | None,
        layer_backends: list[str] | None = None,
    ) -> None:
        self.model = model
        self.cfg = model.config
        self.t, self.n_ctx, self.n_out = t, n_ctx, n_out
        self.kv_dtype = kv_dtype
        self.backend = backend
        self.layer_backends = layer_backends
        self.g = Graph()
        self._made: dict[str, Tensor] = {}

    def backend_of(self, name: str) -> str | None:
        """Where weight (or cache) `name` is pinned: its layer's backend under a layer split
        (`blk.{i}.*`, `cache_*_l{i}`), the first layer's for the embedding, the last layer's for
        the output norm and head; else the one `backend` for weights (None for caches, and for
        weights without it: the scheduler's choice)."""
        stages = self.layer_backends
        if stages is None:
            return None if name.startswith("cache_") else self.backend
        if name.startswith("blk."):
            return stages[int(name.split(".", 2)[1])]
        if name.startswith("cache_"):
            return stages[int(name.rsplit("_l", 1)[1])]
        if name == "token_embd.weight" and not self.cfg.tied_embeddings:
            return stages[0]
        return stages[-1]

    def w(self, name: str) -> Tensor:
        """The weight called `name`, added to the graph on first use."""
        made = self._made.get(name)
        if made is None:
            data = self.model.weights[name]
            dtype = self.model.dtypes[name]
            backend = self.backend_of(name)
            if dtype in quants.QUANT_DTYPES:
                made = self.g.weight(
                    name,
                    data,
                    backend=backend,
                    dtype=dtype,
                    shape=self.cfg.weight_shapes()[name],
                )
            else:
                made = self.g.weight(
                    name, data, backend=backend, dtype="bf16" if dtype == "bf16" else None
                )
            self._made[name] = made
        return made

    def linear(self, x: Tensor, name: str, bias: bool = False) -> Tensor:
        """`x @ W.T (+ b)` for a GGUF weight `W [out, in]`."""
        y = x @ self.w(name + ".weight").T
        return y + self.w(name + ".bias") if bias else y

    def norm(self, x: Tensor, name: str) -> Tensor:
        return self.g.rms_norm(x, self.cfg.rms_eps) * self.w(name)

    def build(self, penalty_last_n: int | None) -> Graph:
        """The graph; `next` is the argmax, or drawn by the sampler when `penalty_last_n` (the
        penalty window) is given."""
        g, cfg, t, n_ctx = self.g, self.cfg, self.t, self.n_ctx
        hd, n_h, n_kv = cfg.head_dim, cfg.n_head, cfg.n_head_kv

        tokens = g.input("tokens", [t], "i32")
        pos = g.input("pos", [t], "i32")
        kv_idx = g.input("kv_idx", [t], "i32")
        kq_mask = g.input("kq_mask", [t, n_ctx])
        out_ids = g.input("out_ids", [self.n_out], "i32")

        x = g.get_rows(self.w("token_embd.weight"), tokens)  # [T, d]
        for il in range(cfg.n_layer):
            p = f"blk.{il}."
            h = self.norm(x, p + "attn_norm.weight")
            q = g.reshape(self.linear(h, p + "attn_q", cfg.qkv_bias), [t, n_h, hd])
            k = g.reshape(self.linear(h, p + "attn_k", cfg.qkv_bias), [t, n_kv, hd])
            v = self.linear(h, p + "attn_v", cfg.qkv_bias)  # [T, n_kv * hd]
            if cfg.qk_norm:
                q = self.norm(q, p + "attn_q_norm.weight")
                k = self.norm(k, p + "attn_k_norm.weight")
            q = g.rope(q, pos, cfg.rope_dims, cfg.rope_theta, cfg.rope_mode)
            k = g.rope(k, pos, cfg.rope_dims, cfg.rope_theta, cfg.rope_mode)

            # This step's K and V go into their cache rows; attention then reads every row
            # (through the set_rows results, so it runs after the writes) under the mask.
            k_name, v_name = f"cache_k_l{il}", f"cache_v_l{il}"
            k_cache = g.persistent(
                k_name, [n_ctx, n_kv * hd], self.kv_dtype, backend=self.backend_of(k_name)
            )
            v_cache = g.persistent(
                v_name, [n_ctx, n_kv * hd], self.kv_dtype, backend=self.backend_of(v_name)
            )
            k_all = g.set_rows(k_cache, g.reshape(k, [t, n_kv * hd]), kv_idx)
            v_all = g.set_rows(v_cache, v, kv_idx)
            keys = g.permute(g.reshape(k_all, [n_ctx, n_kv, hd]), [1, 2, 0])  # [n_kv, hd, n_ctx]
            values = g.permute(g.reshape(v_all, [n_ctx, n_kv, hd]), [1, 0, 2])  # [n_kv, n_ctx, hd]
            queries = g.permute(q, [1, 0, 2])  # [n_h, T, hd]; head h reads kv head h // n_gqa
            kq = g.soft_max(queries @ keys, kq_mask, scale=1.0 / math.sqrt(hd))  # [n_h, T, n_ctx]
            att = g.cont(g.permute(kq @ values, [1, 0, 2]))  # [T, n_h, hd]
            x = x + self.linear(g.reshape(att, [t, n_h * hd]), p + "attn_output")

            h = self.norm(x, p + "ffn_norm.weight")
            ff = g.swiglu(self.linear(h, p + "ffn_gate"), self.linear(h, p + "ffn_up"))
            x = x + self.linear(ff, p + "ffn_down")

        x = self.norm(x, "output_norm.weight")
        # One token, one output: the row is x itself (decode's head then starts with the product,
        # which the CUDA backend runs together with its argmax).
        rows = x if t == 1 and self.n_out == 1 else g.get_rows(x, out_ids)  # [n_out, d]
        out_name = "token_embd" if cfg.tied_embeddings else "output"
        logits = self.linear(rows, out_name)  # [n_out, n_vocab]
        g.output(OUTPUT_LOGITS, logits)
        if penalty_last_n is None:
            g.output(OUTPUT_NEXT, g.argmax(logits))
        else:
            g.output(OUTPUT_NEXT, self.sampler(logits, tokens, penalty_last_n))
        return g

    def sampler(self, logits: Tensor, tokens: Tensor, n: int) -> Tensor:
        """`next` drawn from `logits` [n_out, n_vocab] with penalties over a window of `n`."""
        g, r = self.g, self.n_out
        penalty = g.input(SAMPLE_PENALTY, [r, 3]) if n > 0 else None
        params = g.input(SAMPLE_PARAMS, [r, 4])
        key = g.input(SAMPLE_KEY, [r, 2], "i32")
        if penalty is not None:
            if self.t == 1 and r == 1:
                # The decoded token closes its own window: under launch-ahead only the device
                # knows it (fed into `tokens`), so it is taken from there, not from the host.
                last = g.reshape(tokens, [1, 1])
                hist = (
                    last
                    if n == 1
                    else g.concat(g.input(SAMPLE_HIST, [1, n - 1], "i32"), last, axis=1)
                )
            else:
                hist = g.input(SAMPLE_HIST, [r, n], "i32")
            logits = g.penalize(logits, hist, penalty)
        return g.sample(logits, params, key)
