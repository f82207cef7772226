"""Text to token ids and back, from a GGUF file's tokenizer metadata, the way llama.cpp does it.

Why: a model in a GGUF file is only usable from text if its ids are the ones llama.cpp's
`llama_tokenize` gives and its text is what `llama_detokenize` gives; anything else is a
different prompt. The vocabulary, merges, scores and token types are all in the file's
`tokenizer.*` keys, so no `tokenizer.json` or network is needed.

Strategy: the BPE and regex machinery is the Hugging Face `tokenizers` library (a prebuilt
wheel), configured from the metadata; what is llama.cpp-specific is written here, once:
- `tokenizer.ggml.model` "gpt2": byte-level BPE with `tokenizer.ggml.merges` (ranked by their
  order) after a pre-tokenizer chosen by `tokenizer.ggml.pre` — a sequence of regex splits that
  keep both the matches and the text between them (`_PRE`, the regexes of llama.cpp's
  `llm_tokenizer_bpe`). An unknown `pre` is refused, never guessed.
- "llama" (SentencePiece BPE): llama.cpp merges the adjacent pair whose concatenation is the
  vocabulary entry with the highest score; that is BPE whose merges are every split of every
  entry into two entries, ranked by the entry's score (`_spm_merges`), with byte fallback to
  the `<0xNN>` tokens. Spaces become U+2581 and a space is prefixed to text that starts the
  input or follows a special token (`add_space_prefix`).
- "gemma4": BPE over raw UTF-8 with U+2581 for spaces and `<0xNN>` byte fallback; runs of
  newlines are split off and a run that is itself a token is that token.
- Special tokens: control / user-defined / unknown tokens written in the text are cut out
  before the BPE (longest first, as llama.cpp's `tokenizer_st_partition`); user-defined tokens
  always, control and unknown ones only with `parse_special`.
- Token attributes, the end-of-generation set and BOS/EOS defaults follow llama.cpp's
  `llama_vocab::load` (end tokens found by their text when the file does not name them).
- Decoding joins each token's piece (byte-level BPE pieces mapped back to bytes, U+2581 back to
  spaces, `<0xNN>` to its byte), applies llama.cpp's `clean_spaces` rules where the vocabulary
  has them, and decodes UTF-8 with U+FFFD for invalid bytes. `IncrementalDetokenizer` gives the
  same text piece by piece, holding back bytes that a later token could still change.

Invariants: `encode` takes any text (a `str` without lone surrogates) and `decode` any ids in
the vocabulary; anything else, and every problem with the metadata, is a `TokenizerError`
naming the source and the key; nothing here reads tensor data.
"""

from __future__ import annotations

import codecs
import itertools
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _hf_models
from tokenizers import pre_tokenizers as _hf_pre

from lowsync._native import LowsyncError

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError", "TokenizerWarning"]


class TokenizerError(LowsyncError, ValueError):
    """A vocabulary lowsync cannot use, or a bad call: the message names the file and the key."""


class TokenizerWarning(UserWarning):
    """A vocabulary that loads, but the way llama.cpp loads it with a warning (no `pre`)."""


# GGUF token types (`tokenizer.ggml.token_type`).
_TYPE_UNDEFINED, _TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL = 0, 1, 2, 3
_TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = 4, 5, 6

# Token attributes (bit flags, llama.cpp's `llama_token_attr`).
_UNKNOWN, _UNUSED, _NORMAL, _CONTROL = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_USER_DEFINED, _BYTE, _LSTRIP, _RSTRIP = 1 << 4, 1 << 5, 1 << 7, 1 << 8
_HIDDEN = _UNKNOWN | _CONTROL  # not rendered by `skip_special`; matched only by `parse_special`
# The attribute of each token type, indexed by the type (an unknown type is undefined: 0).
_TYPE_ATTRS = np.zeros(7, np.int64)
_TYPE_ATTRS[[_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED]] = [
    _NORMAL,
    _UNKNOWN,
    _CONTROL,
    _USER_DEFINED,
]
_TYPE_ATTRS[[_TYPE_UNUSED, _TYPE_BYTE]] = [_UNUSED, _BYTE]

_SPACE = "\u2581"  # SentencePiece's visible space
_C_SPACES = " \t\n\v\f\r"  # C's isspace in the "C" locale: what llama.cpp's lstrip/rstrip strip

# The pre-tokenizer regexes of llama.cpp's `llm_tokenizer_bpe` (src/llama-vocab.cpp, b11434),
# applied in order, each splitting every piece the previous ones left.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
# (Non-ASCII characters as escapes: an editor's Unicode normalisation must not change them.)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+\z",  # llama.cpp's `\s+$` under std::regex: the end of the piece, not of a line
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_BLOOM = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",)


@dataclass(frozen=True)
class _Pre:
    """What a `tokenizer.ggml.pre` value means for a "gpt2" vocabulary."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # llama.cpp's `clean_spaces`: applied when decoding
    ignore_merges: bool = False  # a word that is a token is that token, merges or not


def _pres(names: Iterable[str], pre: _Pre) -> dict[str, _Pre]:
    return dict.fromkeys(names, pre)


# Every `pre` name llama.cpp maps to one of the pre-tokenizers above, with its flags.
_PRE: dict[str, _Pre] = {
    **_pres(["default"], _Pre(_DEFAULT)),
    **_pres(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _Pre((_LLAMA3,), ignore_merges=True),
    ),
    **_pres(["dbrx", "smaug-bpe"], _Pre((_LLAMA3,))),
    **_pres(["deepseek-llm"], _Pre(_DEEPSEEK_LLM, clean_spaces=False)),
    **_pres(["deepseek-coder"], _Pre(_DEEPSEEK_CODER, clean_spaces=False)),
    **_pres(["falcon"], _Pre(_FALCON)),
    **_pres(
        ["mpt", "gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "olmo", "jais"],
        _Pre((_GPT2,)),
    ),
    **_pres(["trillion", "granite-docling"], _Pre((_GPT2,), clean_spaces=False)),
    **_pres(
        ["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"],
        _Pre(_STARCODER),
    ),
    **_pres(["command-r", "smollm"], _Pre(_STARCODER, clean_spaces=False)),
    **_pres(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], _Pre((_QWEN2,), clean_spaces=False)),
    **_pres(["stablelm2", "megrez"], _Pre((_QWEN2,))),
    **_pres(["qwen35"], _Pre((_QWEN35,), clean_spaces=False)),
    **_pres(["poro-chat"], _Pre(_BLOOM, clean_spaces=False)),
    **_pres(["bloom", "gpt3-finnish"], _Pre(_BLOOM)),
}

#: The `tokenizer.ggml.pre` values this module knows (for "gpt2" vocabularies).
SUPPORTED_PRE: tuple[str, ...] = tuple(sorted(_PRE))
#: The `tokenizer.ggml.model` values this module knows.
SUPPORTED_MODELS: tuple[str, ...] = ("gemma4", "gpt2", "llama")

# Token texts llama.cpp takes as end-of-turn / end-of-message / fill-in-the-middle tokens when
# the file does not name them, in the order they are tried here (llama.cpp takes whichever
# its hash map yields first; the order below puts the chat end markers first).
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>",
        "\u2581<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>",
        "\u2581<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<\uff5cfim\u2581end\uff5c>",
        "<MID>",
        "\u2581<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Token texts that end generation wherever they are in the vocabulary.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    }
)
# gpt-oss's message framing tokens: rendered as text, never end generation (llama.cpp's rule).
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
    bytes for the code points from U+0100 up, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
# str.translate table from byte-level characters to the Latin-1 character of their byte.
_CHAR_TO_LATIN1 = {ord(c): chr(b) for b, c in _BYTE_TO_CHAR.items()}


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's `clean_spaces` passes on decoded text: no space before `?!.,`, a lone `'`
    between spaces loses both, no space before `'s`, `'m`, `'re`, `'ve`."""
    data = re.sub(rb" ([?!.,])", rb"\1", data)
    data = re.sub(rb" ' ", b"'", data)
    return re.sub(rb" '(?=s|m|re|ve)", b"'", data)


# A cut after which `_clean_spaces` of the two sides joins to that of the whole: none of the
# last three bytes before it is a space or an apostrophe (every rule starts with a space and
# spans at most four bytes).
_CLEAN_CONTEXT = 3


def _value(metadata: Mapping[str, Any], key: str) -> Any:
    """A key's value from either metadata shape: `key -> (value, gguf type, subtype)` (as in
    `Llama.metadata`) or `key -> value`."""
    v = metadata[key]
    if isinstance(v, tuple) and len(v) == 3 and isinstance(v[1], int):
        return v[0]
    return v


class Tokenizer:
    """A GGUF model's tokenizer: text to ids and back, as llama.cpp does it.

    Example::

        tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
        ids = tok.encode("Hello world")          # BOS as the file says, then the text
        text = tok.decode(ids, skip_special=True)
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
        ids = tok.encode(prompt, add_special=False, parse_special=True)
    """

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    model: str
    pre: str | None
    source: str

    def __init__(self) -> None:
        raise TypeError("use Tokenizer.from_gguf(path) or Tokenizer.from_metadata(metadata)")

    # ----------------------------------------------------------------------------- loading

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a GGUF file, from its metadata only (no tensor data is read).

        Raises `TokenizerError` for a file without a usable vocabulary, `GGUFError` for a file
        that is not valid GGUF.
        """
        from lowsync.gguf_reader import GGUFFile

        f = GGUFFile(path)
        metadata = {k: (fld.value, int(fld.type), None) for k, fld in f.fields.items()}
        return cls.from_metadata(metadata, source=str(path))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source: str = "<metadata>") -> Tokenizer:
        """The tokenizer described by GGUF metadata: `key -> (value, gguf type, subtype)` as in
        `Llama.metadata`, or plain `key -> value`. `source` names it in error messages."""
        self = object.__new__(cls)
        self.source = source
        self._load(metadata)
        return self

    def _err(self, key: str, msg: str) -> TokenizerError:
        return TokenizerError(f"{self.source}: key `{key}`: {msg}")

    def _get(self, meta: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
        if key not in meta:
            return default
        value = _value(meta, key)
        if isinstance(value, np.generic):
            value = value.item()
        ok = (
            isinstance(value, bool)
            if kind is bool
            else (isinstance(value, int) and not isinstance(value, bool))
            if kind is int
            else isinstance(value, kind)
        )
        if not ok:
            raise self._err(key, f"holds {value!r:.80}; expected {kind.__name__}")
        return value

    def _array(self, meta: Mapping[str, Any], key: str, n: int) -> Any:
        if key not in meta:
            return None
        value = _value(meta, key)
        if isinstance(value, str) or not hasattr(value, "__len__"):
            raise self._err(key, f"holds {value!r:.80}; expected an array")
        if len(value) < n:
            raise self._err(key, f"has {len(value)} entries for a vocabulary of {n} tokens")
        return value

    def _load(self, meta: Mapping[str, Any]) -> None:
        # 1. the vocabulary
        if "tokenizer.ggml.model" not in meta:
            raise self._err("tokenizer.ggml.model", "missing: this file has no vocabulary")
        model = self._get(meta, "tokenizer.ggml.model", str)
        if model not in SUPPORTED_MODELS:
            raise self._err(
                "tokenizer.ggml.model",
                f"is {model!r}; lowsync tokenizes {', '.join(map(repr, SUPPORTED_MODELS))}",
            )
        self.model = model
        if "tokenizer.ggml.tokens" not in meta:
            raise self._err("tokenizer.ggml.tokens", "missing: this file has no vocabulary")
        raw_tokens = _value(meta, "tokenizer.ggml.tokens")
        texts = _strings(raw_tokens)
        if texts is None:
            raise self._err("tokenizer.ggml.tokens", "is not an array of strings")
        if "" in texts:
            # llama.cpp names an empty entry this way, so that every token has a distinct text
            texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(texts)]
        n = len(texts)
        if n == 0:
            raise self._err("tokenizer.ggml.tokens", "is empty")
        ids = dict(zip(texts, range(n), strict=True))
        if len(ids) != n:
            dup = next(t for i, t in enumerate(texts) if ids[t] != i)
            raise self._err("tokenizer.ggml.tokens", f"holds {dup!r:.60} twice")
        self.n_vocab = n
        self._texts = texts
        self._ids = ids
        types = self._array(meta, "tokenizer.ggml.token_type", n)
        if types is None:
            attrs = [_NORMAL] * n
        else:
            try:
                codes = np.asarray(types[:n], dtype=np.int64)
            except (TypeError, ValueError):
                raise self._err(
                    "tokenizer.ggml.token_type", "is not an array of integers"
                ) from None
            known = (codes >= 0) & (codes < len(_TYPE_ATTRS))
            attrs = np.where(known, _TYPE_ATTRS[np.where(known, codes, 0)], 0).tolist()
        self._attrs = attrs

        # 2. the kind of vocabulary and its defaults (llama.cpp's per-type defaults)
        self.pre = self._get(meta, "tokenizer.ggml.pre", str)
        spm = model == "llama"
        self._escape_spaces = model in ("llama", "gemma4")
        self._pre: _Pre | None = None
        if model == "gpt2":
            if self.pre is None:
                warnings.warn(
                    f"{self.source}: no `tokenizer.ggml.pre`; using llama.cpp's 'default' "
                    "pre-tokenizer as llama.cpp does (its ids for this model are then what "
                    "llama.cpp gives, which may not be the model's own)",
                    TokenizerWarning,
                    stacklevel=3,
                )
                self._pre = _PRE["default"]
            elif self.pre in _PRE:
                self._pre = _PRE[self.pre]
            else:
                raise self._err(
                    "tokenizer.ggml.pre",
                    f"is {self.pre!r}, a pre-tokenizer lowsync does not know (it never guesses "
                    f"one); known: {', '.join(SUPPORTED_PRE)}",
                )
        self._clean = (self._pre.clean_spaces if self._pre else False) or model == "gemma4"
        defaults: dict[str, int | None] = (
            {"bos": 1, "eos": 2, "unk": 0}
            if spm
            else {"bos": 11, "eos": 11, "unk": None}
            if model == "gpt2"
            else {"bos": None, "eos": None, "unk": None}
        )
        self.add_bos = spm or model == "gemma4"
        self.add_eos = False
        self.add_space_prefix = self._get(meta, "tokenizer.ggml.add_space_prefix", bool, spm)
        self.add_bos = self._get(meta, "tokenizer.ggml.add_bos_token", bool, self.add_bos)
        self.add_eos = self._get(meta, "tokenizer.ggml.add_eos_token", bool, self.add_eos)
        if model == "gemma4":
            self.add_bos = True  # llama.cpp overrides a false add_bos_token for Gemma 4

        # 3. special token ids: the file's, else the type's default, each within the vocabulary
        def special(name: str, key: str) -> int | None:
            default = defaults.get(name)
            if default is not None and default >= n:
                default = None
            value = self._get(meta, key, int)
            if value is None:
                return default
            return int(value) if 0 <= value < n else default

        self.bos_id = special("bos", "tokenizer.ggml.bos_token_id")
        self.eos_id = special("eos", "tokenizer.ggml.eos_token_id")
        self.unk_id = special("unk", "tokenizer.ggml.unknown_token_id")
        self.eot_id = special("eot", "tokenizer.ggml.eot_token_id")
        self.eom_id = special("eom", "tokenizer.ggml.eom_token_id")
        fim = {k: special(k, f"tokenizer.ggml.{k}_token_id") for k in _FIM_TEXTS}
        for k, old in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
            # the deprecated keys, read after the new ones as llama.cpp does
            value = special(k, f"tokenizer.ggml.{old}_token_id")
            fim[k] = fim[k] if value is None else value

        # 4. end-of-turn, end-of-message and FIM tokens found by their text, marked control
        def find(candidates: Iterable[str]) -> int | None:
            for text in candidates:
                i = ids.get(text)
                if i is not None:
                    attrs[i] |= _CONTROL
                    return i
            return None

        if self.eot_id is None:
            self.eot_id = find(_EOT_TEXTS)
        if self.eom_id is None:
            self.eom_id = find(_EOM_TEXTS)
        for k, candidates in _FIM_TEXTS.items():
            if fim[k] is None:
                fim[k] = find(candidates)

        # 5. the end-of-generation set
        eog: set[int] = set()
        for k in ("fim_pad", "fim_rep", "fim_sep"):
            fim_id = fim[k]
            if fim_id is not None:
                eog.add(fim_id)
        for text in _EOG_TEXTS:
            i = ids.get(text)
            if i is not None:
                eog.add(i)
                attrs[i] |= _CONTROL
        for text in _ALWAYS_USER_DEFINED:
            if text in ids:
                attrs[ids[text]] = _USER_DEFINED
        for special_id in (self.eos_id, self.eot_id, self.eom_id):
            if special_id is not None:
                eog.add(special_id)
        eog_texts = {texts[i] for i in eog}
        has_call = bool(eog_texts & {"<|call|>", "<|calls|>"})
        if "<|end|>" in eog_texts and has_call and eog_texts & {"<|return|>", "<|flush|>"}:
            # o200k_harmony / solar-open: `<|end|>` ends a message, not the generation
            end = ids["<|end|>"]
            eog.discard(end)
            attrs[end] = _USER_DEFINED
        if "</s>" in eog_texts and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
            s = ids["</s>"]  # gemma4 and plamo have an ordinary `</s>`
            eog.discard(s)
            attrs[s] = _NORMAL
        self.eog_ids = frozenset(eog)

        # 6. per-model strip attributes (llama.cpp sets these by name)
        mask = _CONTROL | _USER_DEFINED | _UNKNOWN
        specials: list[int] = np.flatnonzero(np.asarray(attrs) & mask).tolist()
        name = str(self._get(meta, "general.name", str, "")).lower()
        arch = str(self._get(meta, "general.architecture", str, ""))
        pre = self.pre or ""
        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
        ):
            if "<mask>" in ids:
                attrs[ids["<mask>"]] |= _LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in specials:
                attrs[i] |= _RSTRIP
            if "</s>" in ids:
                attrs[ids["</s>"]] |= _RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in ids:
                    attrs[ids[text]] &= ~_RSTRIP
        elif "modern-bert" in name and "[MASK]" in ids:
            attrs[ids["[MASK]"]] |= _LSTRIP

        # 7. special tokens, longest (in bytes) first, as the partition tries them
        order = sorted(specials, key=lambda i: (-len(texts[i].encode()), i))
        self._special_texts = [(i, texts[i]) for i in order]
        self._user_texts = [(i, t) for i, t in self._special_texts if not attrs[i] & _HIDDEN]
        self._pieces: list[bytes | None] = [None] * n

        # 8. the BPE model
        self._hf = self._build_bpe(meta, texts)
        self.chat_template = self._get(meta, "tokenizer.chat_template", str)

    def _build_bpe(self, meta: Mapping[str, Any], texts: list[str]) -> _HFTokenizer:
        vocab = self._ids
        if self.model == "llama":
            scores = self._array(meta, "tokenizer.ggml.scores", self.n_vocab)
            score_list = (
                [0.0] * self.n_vocab
                if scores is None
                else np.asarray(scores[: self.n_vocab], np.float64).tolist()
            )
            merges = _spm_merges(texts, score_list, vocab)
            tok = _HFTokenizer(
                _hf_models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False)
            )
            return tok
        key = "tokenizer.ggml.merges"
        raw = self._array(meta, key, 0)
        if raw is None:
            raise self._err(key, f"missing: a {self.model!r} vocabulary needs its BPE merges")
        lines = _strings(raw)
        if lines is None:
            raise self._err(key, "is not an array of strings")
        merges = []
        for a, space, b in map(str.partition, lines, itertools.repeat(" ")):
            if not a:
                # llama.cpp cuts a merge at its first space after the first character
                a, space, b = b.partition(" ")
                a = " " + a
            # `tokenizers` requires both sides and the result in the vocabulary; llama.cpp
            # could apply such a merge but never emits its result, so it is left out.
            if space and a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
        if self.model == "gemma4":
            return _HFTokenizer(
                _hf_models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False)
            )
        assert self._pre is not None
        tok = _HFTokenizer(
            _hf_models.BPE(vocab=vocab, merges=merges, ignore_merges=self._pre.ignore_merges)
        )
        splits = [_hf_pre.Split(Regex(r), behavior="isolated") for r in self._pre.regexes]
        tok.pre_tokenizer = _hf_pre.Sequence(
            [
                *splits,
                _hf_pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        return tok

    # ----------------------------------------------------------------------------- encoding

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize`.

        `add_special` adds BOS / EOS where the vocabulary asks for them (`add_bos`, `add_eos`).
        `parse_special` turns control tokens written in the text (`<|im_start|>`) into their
        ids; without it they are tokenized as text. User-defined tokens are always matched,
        as llama.cpp and Hugging Face do.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(
                f"text holds {text[e.start : e.end]!r}, which is not valid Unicode text "
                "(a lone surrogate)"
            ) from None
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self._required(self.bos_id, "bos", "add_bos_token"))
        prev_special = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out += self._hf.encode(frag.replace(" ", _SPACE), add_special_tokens=False).ids
            elif self.model == "gemma4":
                out += self._encode_gemma4(frag.replace(" ", _SPACE))
            else:
                out += self._hf.encode(frag, add_special_tokens=False).ids
            prev_special = False
        if add_special and self.add_eos:
            out.append(self._required(self.eos_id, "eos", "add_eos_token"))
        return out

    def _required(self, tid: int | None, what: str, flag: str) -> int:
        if tid is None:
            raise TokenizerError(
                f"{self.source}: `tokenizer.ggml.{flag}` asks for a {what.upper()} token, but "
                f"the vocabulary has none (`tokenizer.ggml.{what}_token_id`)"
            )
        return tid

    def _encode_gemma4(self, text: str) -> list[int]:
        out: list[int] = []
        for run in re.findall(r"\n+|[^\n]+", text):
            if run[0] == "\n" and run in self._ids:
                out.append(self._ids[run])
            else:
                out += self._hf.encode(run, add_special_tokens=False).ids
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """`text` cut into plain text and special token ids, as llama.cpp's
        `tokenizer_st_partition`: each special token in turn (longest first) is cut out of
        every piece of text left, with its lstrip / rstrip attributes."""
        frags: list[str | int] = [text] if text else []
        # every piece of text left is a part of `text`: a token not in `text` is in none
        candidates = self._special_texts if parse_special else self._user_texts
        for tid, piece in [c for c in candidates if c[1] in text]:
            attr = self._attrs[tid]
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or piece not in f:
                    out.append(f)
                    continue
                rest = f
                while (at := rest.find(piece)) >= 0:
                    left = rest[:at]
                    if attr & _LSTRIP:
                        left = left.rstrip(_C_SPACES)
                    if left:
                        out.append(left)
                    out.append(tid)
                    rest = rest[at + len(piece) :]
                    if attr & _RSTRIP:
                        rest = rest.lstrip(_C_SPACES)
                if rest:
                    out.append(rest)
            frags = out
        return frags

    # ----------------------------------------------------------------------------- decoding

    def token_to_bytes(self, id: int) -> bytes:
        """The raw bytes of one token's piece (control tokens as their text), as llama.cpp's
        `llama_token_to_piece(..., special=true)`. May be part of a UTF-8 sequence."""
        self._check_id(id)
        return self._piece(id)

    def _check_id(self, tid: int) -> None:
        if not isinstance(tid, int | np.integer) or isinstance(tid, bool):
            raise TokenizerError(f"a token id is an int, not {type(tid).__name__}")
        if not 0 <= tid < self.n_vocab:
            raise TokenizerError(
                f"token id {tid} is out of range: this vocabulary has {self.n_vocab} tokens "
                f"(ids 0..{self.n_vocab - 1})"
            )

    def _piece(self, tid: int) -> bytes:
        piece = self._pieces[tid]
        if piece is None:
            piece = self._pieces[tid] = self._make_piece(tid)
        return piece

    def _make_piece(self, tid: int) -> bytes:
        attr, text = self._attrs[tid], self._texts[tid]
        if attr & (_UNKNOWN | _CONTROL | _USER_DEFINED):
            return text.encode()
        if attr & _NORMAL:
            if self._escape_spaces:
                return text.replace(_SPACE, " ").encode()
            latin = text.translate(_CHAR_TO_LATIN1)
            try:
                return latin.encode("latin-1")
            except UnicodeEncodeError:
                # llama.cpp writes a character outside the byte-level alphabet this way
                out = bytearray()
                for ch in text:
                    if ord(ch) in _CHAR_TO_LATIN1:
                        out += _CHAR_TO_LATIN1[ord(ch)].encode("latin-1")
                    else:
                        out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
                return bytes(out)
        if attr & _BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b"\x00"  # llama.cpp's strtol of a malformed `<0xNN>`
        return b""  # undefined or unused tokens have no text

    def _is_hidden(self, tid: int) -> bool:
        return bool(self._attrs[tid] & _HIDDEN)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`, as llama.cpp's `common_detokenize`: control tokens as their text,
        or dropped with `skip_special`; invalid UTF-8 becomes U+FFFD.

        Raises `TokenizerError` for an id outside the vocabulary.
        """
        pieces = []
        for i in ids:
            self._check_id(i)
            tid = int(i)
            pieces.append(b"" if skip_special and self._is_hidden(tid) else self._piece(tid))
        data = b"".join(pieces)
        if self.add_space_prefix and pieces and pieces[0][:1] == b" ":
            data = data[1:]  # llama.cpp removes the space it prefixed to the first piece
        if self._clean:
            data = _clean_spaces(data)
        return data.decode("utf-8", errors="replace")

    def detokenizer(self, skip_special: bool = False) -> IncrementalDetokenizer:
        """A detokenizer for streaming: `push(id)` returns the text that is complete so far,
        `flush()` the rest; the pieces join to `decode(ids, skip_special)`."""
        return IncrementalDetokenizer(self, skip_special)

    # ----------------------------------------------------------------------------- chat

    def token_text(self, id: int) -> str:
        """A token's text as stored in the vocabulary (`<|im_end|>`, `Ġthe`, `▁the`)."""
        self._check_id(id)
        return self._texts[id]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for a conversation, rendered from `tokenizer.chat_template` (or
        `template`, e.g. `lowsync.chat_template.CHATML_TEMPLATE`) as Hugging Face
        transformers renders it. Tokenize it with `encode(text, add_special=False,
        parse_special=True)` (the template writes BOS itself when the model wants one).

        Raises `TokenizerError` when the model has no template and none is given, or when the
        template fails (its own `raise_exception` included).
        """
        from lowsync.chat_template import render_chat_template

        origin = f"{self.source}: the given chat template"
        if template is None:
            template = self.chat_template
            origin = f"{self.source}: key `tokenizer.chat_template`"
            if template is None:
                raise TokenizerError(
                    f"{self.source}: key `tokenizer.chat_template` is missing: this model has "
                    "no chat template; pass template=... (e.g. "
                    "lowsync.chat_template.CHATML_TEMPLATE if the model was trained on ChatML)"
                )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self._texts[self.bos_id] if self.bos_id is not None else "",
            eos_token=self._texts[self.eos_id] if self.eos_id is not None else "",
            source=origin,
            **extra,
        )

    def __repr__(self) -> str:
        pre = f", pre={self.pre!r}" if self.pre else ""
        return f"Tokenizer({self.source!r}, model={self.model!r}{pre}, n_vocab={self.n_vocab})"


def _strings(value: Any) -> list[str] | None:
    """`value` as a list of str, or None when it is not a sequence of str."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        return None
    items = list(value)
    try:
        "".join(items)  # a TypeError, at C speed, if any item is not a str
    except TypeError:
        return None
    return items


def _spm_merges(
    texts: list[str], scores: list[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: llama.cpp joins the adjacent pair whose concatenation is
    the entry with the highest score, so every split of an entry into two entries is a merge
    ranked by that entry's score (ties: lower id first, then shorter left side)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, t in enumerate(texts):
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, k, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


class IncrementalDetokenizer:
    """Text of a token stream, piece by piece: `push(id)` returns what is complete, never a
    broken UTF-8 sequence; `flush()` returns the rest (invalid bytes as U+FFFD). The pieces
    join to `Tokenizer.decode` of the same ids.

    Example::

        d = tok.detokenizer(skip_special=True)
        for t in sess.generate(prompt_ids, max_new_tokens=64):
            print(d.push(t), end="", flush=True)
        print(d.flush())
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        # llama.cpp removes one leading space of the first piece where it added one
        self._first = True
        self._pending = b""  # bytes `clean_spaces` could still change
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        """Adds one token; returns the text now complete (possibly empty)."""
        tok = self._tok
        tok._check_id(id)
        tid = int(id)
        piece = b"" if self._skip and tok._is_hidden(tid) else tok._piece(tid)
        if self._first:
            self._first = False
            if tok.add_space_prefix and piece[:1] == b" ":
                piece = piece[1:]
        if not tok._clean:
            return self._utf8.decode(piece)
        data = self._pending + piece
        cut = len(data)
        while cut > 0 and not _safe_cut(data, cut):
            cut -= 1
        self._pending = data[cut:]
        return self._utf8.decode(_clean_spaces(data[:cut]))

    def flush(self) -> str:
        """The text still held back; the detokenizer starts over afterwards."""
        data = _clean_spaces(self._pending) if self._tok._clean else b""
        self._pending = b""
        out = self._utf8.decode(data, final=True)
        self._first = True
        return out


def _safe_cut(data: bytes, cut: int) -> bool:
    tail = data[max(0, cut - _CLEAN_CONTEXT) : cut]
    return b" " not in tail and b"'" not in tail
