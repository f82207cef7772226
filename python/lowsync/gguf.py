"""GGUF files in and out: `load_gguf(path) -> Llama` and `save_gguf(model, path)`.

Why: GGUF is the file format llama.cpp users have their models in; reading it directly lets
lowsync run the identical file llama.cpp runs, which is how its results and speed are compared.
Anything this loader cannot run faithfully must be refused with a message that names the file,
the key or tensor, and what is supported — never loaded approximately.

Strategy: the `gguf` package (imported on first use, so `import lowsync` stays light) reads the
file memory-mapped. Hyper-parameters come from `<arch>.*` keys and the variant from which
tensors exist (q/k/v biases: qwen2; q/k norms: qwen3; no `output.weight`: tied embeddings).
GGUF lists dimensions ne0 first; the reader already exposes numpy order (`[out, in]` for a
projection), which is what `lowsync.models.llama` consumes, so F32 and F16 tensors stay
memory-mapped views. BF16 is widened to float32 (marked bf16, uploaded as bf16) and Q8_0 is
dequantised to f16 at load (this round has no quantised kernels). `save_gguf` writes the same
layout with `gguf.GGUFWriter`, plus a byte-level SPM vocabulary when the model has none.

Invariants: a loaded model's config and tensor shapes agree (checked here, per tensor); every
error is a `GGUFError` (a `LowsyncError` and a `ValueError`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from lowsync._native import LowsyncError
from lowsync.models.llama import ARCH_ROPE, Llama, LlamaConfig

if TYPE_CHECKING:
    import gguf

Array = npt.NDArray[Any]

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0")
# Architectures saved under another name: mistral files use llama's tensors and keys.
_SAVE_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class GGUFError(LowsyncError, ValueError):
    """A GGUF file lowsync cannot load: the message names the file, the key or tensor, and
    what is supported."""


def _gguf() -> Any:
    try:
        import gguf
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "lowsync.gguf needs the `gguf` package: pip install 'lowsync[gguf]' (or gguf)",
            name="gguf",
        ) from e
    return gguf


class _File:
    """A memory-mapped GGUF file and typed access to its fields, with errors naming it."""

    def __init__(self, path: Path) -> None:
        lib = _gguf()
        self.path = path
        try:
            self.reader: gguf.GGUFReader = lib.GGUFReader(path)
        except Exception as e:  # the reader raises ValueError, IndexError, struct errors, ...
            raise GGUFError(
                f"{path}: not a readable GGUF file (corrupt or truncated?): {type(e).__name__}: {e}"
            ) from e
        self.tensors = {t.name: t for t in self.reader.tensors}

    def err(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def scalar(self, key: str, kind: type, default: Any = None) -> Any:
        """The value of a scalar key as `kind` (int, float or str); `default` when absent
        (an error when the default is None)."""
        gguf = _gguf()
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise self.err(f"missing key `{key}`, which a {self.arch_hint} model needs")
            return default
        vtype = field.types[0] if field.types else None
        if vtype == gguf.GGUFValueType.ARRAY:
            raise self.err(
                f"key `{key}` is an array (per-layer values?); lowsync supports one value for "
                "every layer"
            )
        value = field.contents()
        ok = (
            (kind is str and isinstance(value, str))
            or (kind is int and isinstance(value, int) and not isinstance(value, bool))
            or (kind is float and isinstance(value, int | float) and not isinstance(value, bool))
        )
        if not ok:
            raise self.err(f"key `{key}` holds {value!r}; expected {kind.__name__}")
        if kind is float and vtype == gguf.GGUFValueType.FLOAT32:
            # The shortest decimal that is this float32 (1e-5, not 9.99999974e-06): the value the
            # writer meant, and the same float32 once a graph op takes it.
            return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
        return kind(value)

    arch_hint = "llama-family"


def load_gguf(path: str | os.PathLike[str]) -> Llama:
    """Loads a llama, mistral, qwen2 or qwen3 decoder from a GGUF file.

    Weights in F32, F16, BF16 or Q8_0 (dequantised to f16). F32/F16 tensors stay memory-mapped
    until a session uploads them. Raises `GGUFError` for anything else.

    Example::

        model = lowsync.load_gguf("qwen2-0.5b-f16.gguf")
        sess = lowsync.Session(model, backends=["cpu"])
    """
    p = Path(path)
    if not p.is_file():
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

    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise f.err("missing tensor `token_embd.weight`")
    n_vocab = int(embd.shape[1]) if len(embd.shape) == 2 else 0
    tokens_field = f.reader.fields.get("tokenizer.ggml.tokens")
    if tokens_field is not None and len(tokens_field.data) != n_vocab:
        raise f.err(
            f"the vocabulary (`tokenizer.ggml.tokens`) has {len(tokens_field.data)} tokens but "
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
            n_layer=f.scalar(f"{arch}.block_count", int),
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
        weights[name], dtypes[name] = _read_tensor(f, name, shape)

    metadata: dict[str, tuple[Any, int, int | None]] = {}
    for key, field in f.reader.fields.items():
        if key.startswith("tokenizer."):
            sub = int(field.types[-1]) if len(field.types) > 1 else None
            metadata[key] = (field.contents(), int(field.types[0]), sub)

    name = f.scalar("general.name", str, p.stem)
    try:
        return Llama(config, weights, name=name, dtypes=dtypes, metadata=metadata, source=str(p))
    except ValueError as e:  # pragma: no cover - shapes were checked above
        raise f.err(str(e)) from e


def _read_tensor(f: _File, name: str, shape: tuple[int, ...]) -> tuple[Array, str]:
    """One tensor as a numpy array in numpy order, and its lowsync dtype."""
    gguf = _gguf()
    qt = gguf.GGMLQuantizationType
    t = f.tensors[name]
    ne = [int(d) for d in t.shape]
    if tuple(reversed(ne)) != shape:
        raise f.err(
            f"tensor `{name}` has ne {ne} (numpy shape {tuple(reversed(ne))}); the model's "
            f"hyper-parameters need numpy shape {shape}"
        )
    ttype = t.tensor_type
    type_name = getattr(ttype, "name", str(ttype))
    if type_name not in SUPPORTED_TYPES:
        raise f.err(
            f"tensor `{name}` has type {type_name}, which lowsync does not load yet "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    data: Array = t.data
    block, type_size = gguf.GGML_QUANT_SIZES[ttype]
    if data.nbytes != t.n_elements * type_size // block or t.n_bytes != data.nbytes:
        raise f.err(f"tensor `{name}`: the file ends inside its data (truncated)")
    if ttype == qt.F32:
        return data.astype(np.float32, copy=False).reshape(shape), "f32"
    if ttype == qt.F16:
        return data.astype(np.float16, copy=False).reshape(shape), "f16"
    if ttype == qt.BF16:
        bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape), "bf16"
    # Q8_0: blocks of 32 weights, each an f16 scale followed by 32 int8 values.
    blocks = np.ascontiguousarray(data).reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (q * scale).astype(np.float16).reshape(shape), "f16"


def save_gguf(model: Llama, path: str | os.PathLike[str]) -> None:
    """Writes `model` as a GGUF file that llama.cpp loads.

    The architecture is the model's (mistral is written as llama). Weights keep their dtypes
    (f32, f16, bf16). A model loaded from GGUF keeps its tokenizer fields; any other model gets
    a byte-level SPM vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then filler
    pieces up to `n_vocab`.
    """
    gguf = _gguf()
    cfg = model.config
    arch = _SAVE_ARCH[cfg.arch]
    if cfg.rope_dims != cfg.head_dim:
        # llama.cpp refuses (llama) or asserts on (qwen2/qwen3) partial rotary embeddings.
        raise GGUFError(
            f"{os.fspath(path)}: cannot save a model with partial RoPE ({arch}.rope."
            f"dimension_count = {cfg.rope_dims}, head size = {cfg.head_dim}): llama.cpp's "
            f"{arch} architecture requires the rotary dimension count to equal the head size"
        )
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_name(model.name)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    if cfg.head_dim != cfg.n_embd // cfg.n_head or cfg.n_embd % cfg.n_head:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rope_dims)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.n_vocab)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
    w.add_file_type(int(file_type.get(model.weight_type, gguf.LlamaFileType.MOSTLY_BF16)))

    if any(k.startswith("tokenizer.ggml.") for k in model.metadata):
        for key, (value, vtype, sub) in model.metadata.items():
            w.add_key_value(
                key,
                value,
                gguf.GGUFValueType(vtype),
                sub_type=None if sub is None else gguf.GGUFValueType(sub),
            )
    else:
        _add_byte_vocab(w, cfg.n_vocab)

    for name, data in model.weights.items():
        if model.dtypes[name] == "bf16":
            bits = (np.ascontiguousarray(data, np.float32).view(np.uint32) >> 16).astype(np.uint16)
            w.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_byte_vocab(w: Any, n_vocab: int) -> None:
    """A byte-level SPM ("llama") vocabulary of exactly `n_vocab` tokens."""
    gguf = _gguf()
    tt = gguf.TokenType
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [int(tt.UNKNOWN), int(tt.CONTROL), int(tt.CONTROL)]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [int(tt.BYTE)] * 256
    filler = n_vocab - len(tokens)
    tokens += [_filler_piece(i) for i in range(max(filler, 0))]
    types += [int(tt.NORMAL)] * max(filler, 0)
    tokens, types = tokens[:n_vocab], types[:n_vocab]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def _filler_piece(i: int) -> str:
    """A unique lowercase piece for filler token `i`: "▁a", "▁b", ..., "▁ba", ..."""
    letters = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        letters = chr(ord("a") + r) + letters
    return "\u2581" + letters
