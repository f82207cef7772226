"""Models with tokenizers for the text tests (`test_llm.py`, `test_cli_run.py`).

`byte_bpe_metadata()` is a small GPT-2-style byte-level BPE vocabulary written as GGUF tokenizer
metadata (the 256 byte symbols, a few merges, ChatML's control tokens and template), so a random
model gets a real tokenizer with no file: every byte is a token, a multi-byte character spans
several tokens. `runnable_smollm2()` gives SmolLM2-135M-Instruct (fetched by
scripts/fetch_test_data.py, see `testdata`) in a form lowsync loads: the file itself once
quantized weights load, else an F16 copy dequantised with the `gguf` package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lowsync.gguf_reader import ValueType
from lowsync.models.llama import Llama, LlamaConfig
from testdata import smollm2_gguf

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Merges of the synthetic vocabulary, in rank order (GPT-2's byte symbols: "Ġ" is a space).
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def byte_bpe_metadata() -> dict[str, tuple[Any, int, int | None]]:
    """GGUF tokenizer metadata (as `Llama.metadata` holds it) of a ~270-token byte-level BPE
    vocabulary with ChatML control tokens; EOS is <|endoftext|>, <|im_end|> ends a turn."""
    tokens = _byte_symbols() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # normal, control
    arr, string, u32, i32 = int(ValueType.ARRAY), int(ValueType.STRING), 4, 5
    return {
        "tokenizer.ggml.model": ("gpt2", string, None),
        "tokenizer.ggml.pre": ("gpt-2", string, None),
        "tokenizer.ggml.tokens": (tokens, arr, string),
        "tokenizer.ggml.token_type": (np.asarray(types, np.int32), arr, i32),
        "tokenizer.ggml.merges": (list(MERGES), arr, string),
        "tokenizer.ggml.bos_token_id": (tokens.index("<|endoftext|>"), u32, None),
        "tokenizer.ggml.eos_token_id": (tokens.index("<|endoftext|>"), u32, None),
        "tokenizer.ggml.add_bos_token": (False, int(ValueType.BOOL), None),
        "tokenizer.chat_template": (CHATML, string, None),
    }


def random_text_model(seed: int = 0, n_ctx_train: int = 512) -> Llama:
    """A small random llama with the synthetic byte-level vocabulary."""
    meta = byte_bpe_metadata()
    n_vocab = len(meta["tokenizer.ggml.tokens"][0])
    config = LlamaConfig(
        n_vocab=n_vocab, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128,
        n_ctx_train=n_ctx_train,
    )  # fmt: skip
    model = Llama.random(config, seed=seed)
    return Llama(config, model.weights, name="random-bpe", dtypes=model.dtypes, metadata=meta)


def runnable_smollm2(tmp_dir: Path) -> Path:
    """A SmolLM2 file lowsync loads (skips the test when the data is absent): the Q4_1 file
    itself when lowsync loads its types, else an F16 copy written into `tmp_dir`."""
    from lowsync.gguf import GGUFError, load_gguf

    src = smollm2_gguf()  # skips (or fails under LOWSYNC_REQUIRE_TEST_DATA=1) when absent
    try:
        load_gguf(src)
        return src
    except GGUFError as e:
        if "Q4_1" not in str(e):
            raise
    dst = tmp_dir / "SmolLM2-135M-Instruct.F16.gguf"
    if not dst.exists():  # written once per test session (`tmp_dir` is the session's)
        part = dst.with_suffix(".part")
        _dequantized_copy(src, part)
        part.rename(dst)
    return dst


def _dequantized_copy(src: Path, dst: Path) -> None:
    """`src` with every quantized tensor dequantised to F16 (F32 tensors kept), its metadata
    unchanged but the file type."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            data = np.asarray(t.data)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
