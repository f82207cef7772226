"""GGUF files in and out: `load_gguf(path) -> Llama` and `save_gguf(model, path)`.

Why: GGUF is the file format llama.cpp users have their models in; reading it directly lets
lowsync run the identical file llama.cpp runs, which is how its results and speed are compared.
Anything this loader cannot run faithfully must be refused with a message that names the file,
the key or tensor, and what is supported — never loaded approximately.

Strategy: `lowsync.gguf_reader` parses and checks the file, memory-mapped, in time and memory
proportional to its size; this module turns it into a `Llama`. Hyper-parameters come from
`<arch>.*` keys and the variant from which tensors exist (q/k/v biases: qwen2; q/k norms:
qwen3; no `output.weight`: tied embeddings). GGUF lists dimensions ne0 first; reversed, that is
numpy order (`[out, in]` for a projection), which is what `lowsync.models.llama` consumes, so
F32 and F16 tensors stay memory-mapped views. BF16 is widened to float32 (marked bf16,
uploaded as bf16). Quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL,
IQ4_XS) stay quantized: their raw blocks are memory-mapped `uint8` views of GGUF's byte shape,
uploaded as they are (a backend without kernels for them gets them widened at graph build,
`Llama.prepared_for`).
Saving is `lowsync.gguf_writer` (re-exported here); the layering is reader/writer below
`lowsync.models` below this module, so nothing imports in a circle.

Invariants: a loaded model's config and tensor shapes agree (checked here, per tensor); every
error is a `GGUFError` (a `LowsyncError` and a `ValueError`), except a path that does not
exist (`FileNotFoundError`) or cannot be opened (the `OSError` naming it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lowsync.gguf_reader import GGUFError, GGUFFile, TensorInfo, ValueType
from lowsync.gguf_writer import save_gguf
from lowsync.models.llama import ARCH_ROPE, Llama, LlamaConfig
from lowsync.quants import QUANT_DTYPES, byte_shape

Array = npt.NDArray[Any]

__all__ = ["SUPPORTED_TYPES", "GGUFError", "load_gguf", "save_gguf"]

SUPPORTED_TYPES = ("F32", "F16", "BF16", *(q.upper() for q in QUANT_DTYPES))


class _File:
    """A checked GGUF file and typed access to its keys, with errors naming the file."""

    def __init__(self, path: Path) -> None:
        self.f = GGUFFile(path)
        self.path = path
        self.tensors = self.f.tensors
        self.fields = self.f.fields
        self.arch_hint = "llama-family"

    def err(self, msg: str) -> GGUFError:
        return self.f.err(msg)

    def scalar(self, key: str, kind: type, default: Any = None) -> Any:
        """The value of a scalar key as `kind` (int, float or str); `default` when absent
        (an error when the default is None)."""
        field = self.fields.get(key)
        if field is None:
            if default is None:
                raise self.err(f"missing key `{key}`, which a {self.arch_hint} model needs")
            return default
        if field.type == ValueType.ARRAY:
            raise self.err(
                f"key `{key}` is an array (per-layer values?); lowsync supports one value for "
                "every layer"
            )
        value = field.value
        ok = (
            (kind is str and isinstance(value, str))
            or (kind is int and isinstance(value, int) and not isinstance(value, bool))
            or (kind is float and isinstance(value, int | float) and not isinstance(value, bool))
        )
        if not ok:
            raise self.err(f"key `{key}` holds {value!r:.80}; expected {kind.__name__}")
        if kind is float and field.type == ValueType.FLOAT32:
            # The shortest decimal that is this float32 (1e-5, not 9.99999974e-06): the value the
            # writer meant, and the same float32 once a graph op takes it.
            return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
        return kind(value)


def load_gguf(path: str | os.PathLike[str]) -> Llama:
    """Loads a llama, mistral, qwen2 or qwen3 decoder from a GGUF file.

    Weights in F32, F16, BF16 or a block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
    Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS: kept quantized, as raw blocks). F32/F16 and quantized
    tensors stay memory-mapped: a session on `cpu`/`cpu-async` reads them in place (the file's
    pages are the only copy), other backends upload them straight from the map. Raises
    `GGUFError` naming the tensor and its type for anything else.

    Example::

        model = lowsync.load_gguf("qwen2-0.5b-f16.gguf")
        sess = lowsync.Session(model, backends=["cpu"])
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"GGUF file {p} does not exist")
    f = _File(p)

    arch = f.scalar("general.architecture", str)
    if arch not in ARCH_ROPE:
        raise f.err(
            f"`general.architecture` is {arch!r}; lowsync supports {', '.join(ARCH_ROPE)} "
            "(llama-layout decoders)"
        )
    f.arch_hint = arch
    scaling = f.scalar(f"{arch}.rope.scaling.type", str, "none")
    if scaling != "none":
        raise f.err(
            f"key `{arch}.rope.scaling.type` is {scaling!r}; lowsync supports only unscaled RoPE"
        )
    if "rope_freqs.weight" in f.tensors:
        raise f.err(
            "tensor `rope_freqs.weight` (RoPE frequency factors, e.g. Llama 3.1 scaling) is not "
            "supported yet"
        )

    n_embd = f.scalar(f"{arch}.embedding_length", int)
    n_head = f.scalar(f"{arch}.attention.head_count", int)
    head_dim = f.scalar(f"{arch}.attention.key_length", int, 0)
    if not head_dim and n_head and n_embd % n_head:
        raise f.err(
            f"`{arch}.embedding_length` ({n_embd}) is not a multiple of "
            f"`{arch}.attention.head_count` ({n_head}) and no `attention.key_length` is given"
        )
    v_dim = f.scalar(f"{arch}.attention.value_length", int, 0)
    k_dim = head_dim or (n_embd // n_head if n_head else 0)
    if v_dim and v_dim != k_dim:
        raise f.err(
            f"K heads have {k_dim} dims but `{arch}.attention.value_length` is {v_dim}; lowsync "
            "supports equal K and V head sizes"
        )
    n_layer = f.scalar(f"{arch}.block_count", int)
    if n_layer > len(f.tensors):
        # Each block has several tensors: a count past the table is corrupt, and listing the
        # tensors such a count would need costs time in the count, not in the file's size.
        raise f.err(
            f"`{arch}.block_count` is {n_layer} but the file has only {len(f.tensors)} tensors"
        )

    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise f.err("missing tensor `token_embd.weight`")
    n_vocab = embd.ne[1] if len(embd.ne) == 2 else 0
    tokens_field = f.fields.get("tokenizer.ggml.tokens")
    if tokens_field is not None and len(tokens_field) != n_vocab:
        raise f.err(
            f"the vocabulary (`tokenizer.ggml.tokens`) has {len(tokens_field)} tokens but "
            f"`token_embd.weight` has {n_vocab} rows"
        )
    vocab_key = f.scalar(f"{arch}.vocab_size", int, 0)
    if vocab_key and vocab_key != n_vocab:
        raise f.err(
            f"`{arch}.vocab_size` is {vocab_key} but `token_embd.weight` has {n_vocab} rows"
        )

    try:
        config = LlamaConfig(
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=f.scalar(f"{arch}.attention.head_count_kv", int, n_head),
            n_ff=f.scalar(f"{arch}.feed_forward_length", int),
            head_dim=head_dim,
            rope_theta=f.scalar(f"{arch}.rope.freq_base", float, 10000.0),
            rope_dims=f.scalar(f"{arch}.rope.dimension_count", int, 0),
            rope_mode=ARCH_ROPE[arch],
            rms_eps=f.scalar(f"{arch}.attention.layer_norm_rms_epsilon", float),
            arch=arch,
            n_ctx_train=f.scalar(f"{arch}.context_length", int, 2048),
            qkv_bias="blk.0.attn_q.bias" in f.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
            tied_embeddings="output.weight" not in f.tensors,
        )
    except ValueError as e:
        raise f.err(f"inconsistent hyper-parameters ({arch}.* keys): {e}") from e

    want = config.weight_shapes()
    missing = [n for n in want if n not in f.tensors]
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise f.err(
            f"missing tensors {', '.join(f'`{n}`' for n in missing[:6])}{more} "
            f"(a {arch} model with {config.n_layer} layers needs them)"
        )
    extra = [n for n in f.tensors if n not in want]
    if extra:
        raise f.err(
            f"tensors {', '.join(f'`{n}`' for n in extra[:6])} are not part of a {arch} model "
            f"with {config.n_layer} layers as lowsync runs it (MoE, extra blocks or other "
            "features are not supported)"
        )

    weights: dict[str, Array] = {}
    dtypes: dict[str, str] = {}
    for name, shape in want.items():
        weights[name], dtypes[name] = _read_tensor(f, f.tensors[name], shape)

    metadata: dict[str, tuple[Any, int, int | None]] = {}
    for key, field in f.fields.items():
        if key.startswith("tokenizer."):
            sub = None if field.item_type is None else int(field.item_type)
            metadata[key] = (field.value, int(field.type), sub)

    name = f.scalar("general.name", str, p.stem)
    try:
        return Llama(config, weights, name=name, dtypes=dtypes, metadata=metadata, source=str(p))
    except ValueError as e:  # pragma: no cover - shapes were checked above
        raise f.err(str(e)) from e


def _read_tensor(f: _File, t: TensorInfo, shape: tuple[int, ...]) -> tuple[Array, str]:
    """One tensor as a numpy array in numpy order, and its lowsync dtype."""
    if t.shape != shape:
        raise f.err(
            f"tensor `{t.name}` has ne {list(t.ne)} (numpy shape {t.shape}); the model's "
            f"hyper-parameters need numpy shape {shape}"
        )
    kind = t.type.name
    if kind not in SUPPORTED_TYPES:
        raise f.err(
            f"tensor `{t.name}` has type {kind}, which lowsync does not load yet "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    data = f.f.tensor_data(t)  # the reader checked that these bytes lie inside the file
    if kind == "F32":
        return data.view("<f4").reshape(shape), "f32"
    if kind == "F16":
        return data.view("<f2").reshape(shape), "f16"
    if kind == "BF16":
        bits = data.view("<u2").astype(np.uint32)
        np.left_shift(bits, 16, out=bits)
        return bits.view(np.float32).reshape(shape), "bf16"
    # A block type: the raw blocks, memory-mapped, in GGUF's byte shape (the reader checked
    # that rows are whole blocks and that the bytes lie inside the file).
    dtype = kind.lower()
    return data.view(np.uint8).reshape(byte_shape(shape, dtype)), dtype
