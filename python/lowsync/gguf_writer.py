"""Writing a llama-family model as a GGUF file llama.cpp loads: `save_gguf(model, path)`.

Why: a model lowsync made or changed (a random model, a loaded one under another config) is
compared with llama.cpp by running the same file in both, so lowsync writes the file.

Strategy: the `gguf` package's `GGUFWriter` (imported on first use) writes the file; this
module maps the model's config to llama.cpp's `<arch>.*` keys and its weights to GGUF tensors
(numpy order `[out, in]` is what the writer expects). It reads the model only through the
`SavableModel` protocol, so it imports nothing from `lowsync.models`: `Llama.save_gguf` calls
down into it and `lowsync.gguf` (the loader, which builds a `Llama`) sits above both, so there
is no import circle.

Invariants: a file is written only when llama.cpp can load it (partial RoPE is refused before
anything is written); tokenizer fields a model was loaded with are written back unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from lowsync.gguf_reader import GGUFError

Array = npt.NDArray[Any]

# Architectures saved under another name: mistral files use llama's tensors and keys.
_SAVE_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class SavableConfig(Protocol):
    """The hyper-parameters `save_gguf` writes (`lowsync.LlamaConfig` has them)."""

    @property
    def arch(self) -> str: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_head_kv(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rope_dims(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rms_eps(self) -> float: ...
    @property
    def n_ctx_train(self) -> int: ...


class SavableModel(Protocol):
    """What `save_gguf` reads from a model (`lowsync.Llama` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> SavableConfig: ...
    @property
    def weights(self) -> Mapping[str, Array]: ...
    @property
    def dtypes(self) -> Mapping[str, str]: ...
    @property
    def metadata(self) -> Mapping[str, tuple[Any, int, int | None]]: ...
    @property
    def weight_type(self) -> str: ...


def _gguf() -> Any:
    try:
        import gguf
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "saving GGUF files needs the `gguf` package: pip install 'lowsync[gguf]' (or gguf)",
            name="gguf",
        ) from e
    return gguf


def save_gguf(model: SavableModel, path: str | os.PathLike[str]) -> None:
    """Writes `model` as a GGUF file that llama.cpp loads.

    The architecture is the model's (mistral is written as llama). Weights keep their dtypes
    (f32, f16, bf16); quantized weights (raw GGUF blocks) are written back byte for byte. A
    model loaded from GGUF keeps its tokenizer fields; any other model gets
    a byte-level SPM vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then filler
    pieces up to `n_vocab`.

    Example::

        lowsync.Llama.random("tiny", seed=0).save_gguf("tiny.gguf")
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
    w.add_file_type(int(_file_type(gguf, model.weight_type)))

    if any(k.startswith("tokenizer.ggml.") for k in model.metadata):
        for key, (value, vtype, sub) in model.metadata.items():
            w.add_key_value(
                key,
                # The loader keeps arrays of numbers as numpy arrays; the writer takes sequences.
                value.tolist() if isinstance(value, np.ndarray) else value,
                gguf.GGUFValueType(vtype),
                sub_type=None if sub is None else gguf.GGUFValueType(sub),
            )
    else:
        _add_byte_vocab(w, cfg.n_vocab)

    for name, data in model.weights.items():
        if model.dtypes[name] not in ("f32", "f16", "bf16"):
            # Raw blocks in GGUF's byte shape: the writer takes them as they are.
            qtype = gguf.GGMLQuantizationType[model.dtypes[name].upper()]
            w.add_tensor(name, np.ascontiguousarray(data, np.uint8), raw_dtype=qtype)
        elif model.dtypes[name] == "bf16":
            bits = (np.ascontiguousarray(data, np.float32).view(np.uint32) >> 16).astype(np.uint16)
            w.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _file_type(gguf: Any, weight_type: str) -> Any:
    """`general.file_type` (llama.cpp's `LLAMA_FTYPE_*`) of a model whose projections have
    dtype `weight_type`; K-quant files are their `_M` mix, as llama-quantize names them."""
    t = gguf.LlamaFileType
    names = {
        "f32": "ALL_F32",
        "f16": "MOSTLY_F16",
        "bf16": "MOSTLY_BF16",
        "q3_k": "MOSTLY_Q3_K_M",
        "q4_k": "MOSTLY_Q4_K_M",
        "q5_k": "MOSTLY_Q5_K_M",
    }
    name = names.get(weight_type, "MOSTLY_" + weight_type.upper())
    return getattr(t, name, t.MOSTLY_BF16)


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
