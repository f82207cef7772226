"""`lowsync.Tokenizer` against llama.cpp: its own vocabularies and expected ids (b11434's
`models/ggml-vocab-*.gguf` with the `.inp` / `.out` cases of `tests/test-tokenizer-0.cpp`),
round trips, streaming detokenization, special tokens and errors.

The real data comes from `scripts/fetch_test_data.py` (see `tests/testdata.py`); the tests
that need it skip without it unless `LOWSYNC_REQUIRE_TEST_DATA=1`. A small synthetic
vocabulary covers the error paths everywhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowsync.gguf_reader import GGUFFile
from lowsync.tokenizer import _BYTE_TO_CHAR, Tokenizer, TokenizerError, TokenizerWarning
from testdata import llama_cpp_models, smollm2_gguf

# Every vocabulary of b11434 with test cases whose `tokenizer.ggml.model` lowsync supports.
SUPPORTED = (
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)
UNSUPPORTED = {"bert-bge": "bert"}  # vocabulary -> its `tokenizer.ggml.model`
# Byte-level BPE vocabularies; those whose decoding does not apply llama.cpp's clean_spaces
# give back exactly the text they were given.
BYTE_LEVEL = (
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gpt-2",
    "llama-bpe",
    "mpt",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)
NO_CLEAN_SPACES = ("command-r", "deepseek-coder", "deepseek-llm", "qwen2", "qwen35")
SEP = "\n__ggml_vocab_test__\n"


def read_cases(path: Path) -> list[tuple[str, list[int]]]:
    """The `.inp` / `.out` pairs as llama.cpp's test-tokenizer-0 reads them: inputs split on
    the separator, one line of space-separated ids per input."""
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    lines = Path(f"{path}.out").read_bytes().decode("utf-8").split("\n")
    inputs: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{path}: {len(inputs)} inputs, {len(lines)} outputs"
    return [(s, [int(t) for t in o.split()]) for s, o in zip(inputs, lines, strict=True)]


@pytest.fixture(scope="module", params=SUPPORTED)
def vocab(request: pytest.FixtureRequest) -> Iterator[tuple[str, Path, Tokenizer]]:
    """One llama.cpp vocabulary and its tokenizer, loaded once for every test that uses it."""
    name: str = request.param
    path = llama_cpp_models() / f"ggml-vocab-{name}.gguf"
    return name, path, Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf())


@pytest.fixture(scope="module")
def llama_spm() -> Tokenizer:
    """A second copy of the small SentencePiece vocabulary, for tests of it alone."""
    return Tokenizer.from_gguf(llama_cpp_models() / "ggml-vocab-llama-spm.gguf")


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return Tokenizer.from_gguf(llama_cpp_models() / "ggml-vocab-gpt-2.gguf")


# ------------------------------------------------------------------- llama.cpp's own cases


def test_ids_are_llama_cpps_for_every_case(vocab: tuple[str, Path, Tokenizer]) -> None:
    name, path, tok = vocab
    cases = read_cases(path)
    assert len(cases) >= 46
    wrong = [
        (text, got, want)
        for text, want in cases
        if (got := tok.encode(text, add_special=False, parse_special=False)) != want
    ]
    assert not wrong, f"{name}: {len(wrong)}/{len(cases)} cases differ, e.g. {wrong[:3]}"


def test_the_data_holds_exactly_the_known_vocabularies() -> None:
    models = llama_cpp_models()
    found = {p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in models.glob("*.gguf.inp")}
    assert found == set(SUPPORTED) | set(UNSUPPORTED)


@pytest.mark.parametrize(("name", "model"), sorted(UNSUPPORTED.items()))
def test_an_unsupported_model_type_is_refused_by_name(name: str, model: str) -> None:
    path = llama_cpp_models() / f"ggml-vocab-{name}.gguf"
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.model") as e:
        Tokenizer.from_gguf(path)
    assert str(path) in str(e.value)
    assert repr(model) in str(e.value)


# What llama.cpp's `llama_vocab::load` makes of each file: the model type and space prefix,
# add_bos, BOS / EOS / EOT texts, and the whole end-of-generation set. Found by text where the
# file does not name them: `<|eot_id|>`, `<|im_end|>`, `<|end|>`, `<|endoftext|>` ... as
# end-of-turn; FIM pad / repo / file-separator tokens (command-r's `<PAD>`, refact's
# `<reponame>`) and every token with an end-like text (`</s>` in qwen2 and phi-3) also end
# generation.
SPECIALS_OF = {
    "command-r": ("gpt2", True, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", None,
                  {"<PAD>", "<|END_OF_TURN_TOKEN|>"}),
    "deepseek-coder": ("gpt2", True, "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                       "<\uff5cend\u2581of\u2581sentence\uff5c>",
                       "<\uff5cend\u2581of\u2581sentence\uff5c>",
                       {"<\uff5cend\u2581of\u2581sentence\uff5c>"}),
    "deepseek-llm": ("gpt2", True, "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                     "<\uff5cend\u2581of\u2581sentence\uff5c>",
                     "<\uff5cend\u2581of\u2581sentence\uff5c>",
                     {"<\uff5cend\u2581of\u2581sentence\uff5c>"}),
    "falcon": ("gpt2", False, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>",
               {"<|endoftext|>"}),
    "gemma-4": ("gemma4", True, "<bos>", "<eos>", None, {"<eos>", "<turn|>", "<|tool_response>"}),
    "gpt-2": ("gpt2", False, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>",
              {"<|endoftext|>"}),
    "llama-bpe": ("gpt2", False, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                  {"<|end_of_text|>", "<|eot_id|>"}),
    "llama-spm": ("llama", True, "<s>", "</s>", None, {"</s>"}),
    "mpt": ("gpt2", False, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>",
            {"<|endoftext|>"}),
    "phi-3": ("llama", True, "<s>", "<|endoftext|>", "<|end|>",
              {"</s>", "<|endoftext|>", "<|end|>"}),
    "qwen2": ("gpt2", False, "<|endoftext|>", "<|endoftext|>", "<|im_end|>",
              {"</s>", "<|endoftext|>", "<|im_end|>"}),
    "qwen35": ("gpt2", False, "<|endoftext|>", "<|endoftext|>", "<|im_end|>",
               {"</s>", "<|endoftext|>", "<|im_end|>"}),
    "refact": ("gpt2", False, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>",
               {"<fim_pad>", "<reponame>", "<|endoftext|>"}),
    "starcoder": ("gpt2", False, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>",
                  {"<fim_pad>", "<|endoftext|>"}),
}  # fmt: skip


def test_special_tokens_are_llama_cpps(vocab: tuple[str, Path, Tokenizer]) -> None:
    name, _, tok = vocab
    model, add_bos, bos, eos, eot, eog = SPECIALS_OF[name]

    def text(i: int | None) -> str | None:
        return None if i is None else tok.token_text(i)

    assert (tok.model, tok.add_bos, tok.add_eos) == (model, add_bos, False)
    assert tok.add_space_prefix == (model == "llama")
    assert (text(tok.bos_id), text(tok.eos_id), text(tok.eot_id)) == (bos, eos, eot)
    assert {tok.token_text(i) for i in tok.eog_ids} == eog
    # add_special adds BOS exactly where the file (or llama.cpp's default for its type) says
    with_bos = tok.encode("Hi")
    assert with_bos == ([tok.bos_id] if add_bos else []) + tok.encode("Hi", add_special=False)


# ------------------------------------------------------------------- round trips


@settings(max_examples=40)
@given(text=st.text(max_size=60))
def test_byte_level_pieces_are_the_texts_bytes(
    vocab: tuple[str, Path, Tokenizer], text: str
) -> None:
    name, _, tok = vocab
    if name not in BYTE_LEVEL:
        return
    ids = tok.encode(text, add_special=False)
    # a byte whose character the vocabulary lacks is dropped, by llama.cpp too (falcon, mpt,
    # refact and starcoder lack some)
    missing = missing_bytes(tok)
    want = bytes(b for b in text.encode() if b not in missing)
    assert b"".join(tok.token_to_bytes(i) for i in ids) == want
    if name in NO_CLEAN_SPACES:
        assert not missing
        assert tok.decode(ids) == text


def missing_bytes(tok: Tokenizer) -> frozenset[int]:
    """The bytes whose byte-level character is not in the vocabulary."""
    return frozenset(b for b in range(256) if _BYTE_TO_CHAR[b] not in tok._ids)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  leading spaces\tand\ttabs\n\nnew lines  ",
        "Ünïcödé ½ €100, 3.14159",
        "日本語のテキストと한국어",
        "emoji 🦙🚀 and a family 👨‍👩‍👧 and 😶‍🌫️",
        "code: def f(x):\n    return x ** 2  # comment",
    ],
)
def test_smollm2_decodes_what_it_encodes(smollm2: Tokenizer, text: str) -> None:
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text


def test_spm_decoding_removes_the_space_it_prefixed(llama_spm: Tokenizer) -> None:
    tok = llama_spm
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_id == 1
    assert tok.decode(ids[1:]) == "Hello world"
    # llama.cpp's common_detokenize: the space is removed from the first piece only, and the
    # first piece here is BOS (rendered as its text, or nothing with skip_special)
    assert tok.decode(ids) == "<s> Hello world"
    assert tok.decode(ids, skip_special=True) == " Hello world"


def test_clean_spaces_follows_llama_cpp(gpt2: Tokenizer) -> None:
    tok = gpt2
    ids = tok.encode("Hello , world ! It ' s what we 've got . Isn 't it ?")
    assert tok.decode(ids) == "Hello, world! It's what we've got. Isn 't it?"


# ------------------------------------------------------------------- streaming


STREAM_TEXTS = [
    "🦙 llamas 🚀 rockets",
    "日本語のテキストと한국어と中文",
    "a family 👨‍👩‍👧, a flag 🏳️‍🌈, combining e\u0301",
    "Hello , world ! It ' s fine . Isn 't it ? We 're here 'm 've",
    "\x00\x01 control bytes \x7f and \u2581 a visible space",
]


def check_stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> None:
    whole = tok.decode(ids, skip_special=skip_special)
    d = tok.detokenizer(skip_special=skip_special)
    chunks = [d.push(i) for i in ids]
    chunks.append(d.flush())
    assert "".join(chunks) == whole
    if "\ufffd" not in whole:
        # a chunk never ends inside a character: no replacement character appears early
        assert all("\ufffd" not in c for c in chunks)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streamed_text_joins_to_the_decoded_text(
    vocab: tuple[str, Path, Tokenizer], text: str
) -> None:
    _, _, tok = vocab
    ids = tok.encode(text)
    check_stream(tok, ids)
    check_stream(tok, ids, skip_special=True)


def test_byte_fallback_pieces_wait_for_the_whole_character(llama_spm: Tokenizer) -> None:
    tok = llama_spm
    ids = tok.encode("🦙", add_special=False)
    byte_ids = [
        i for i in ids if len(tok.token_to_bytes(i)) == 1 and tok.token_to_bytes(i)[0] > 127
    ]
    assert len(byte_ids) == 4  # the llama is not in the vocabulary: four <0xNN> tokens
    d = tok.detokenizer()
    out = [d.push(i) for i in ids]
    assert out[-1].endswith("🦙")
    assert all(o in ("", " ") for o in out[:-1])
    assert d.flush() == ""


@settings(max_examples=25)
@given(text=st.text(max_size=40))
def test_streaming_any_text(vocab: tuple[str, Path, Tokenizer], text: str) -> None:
    _, _, tok = vocab
    check_stream(tok, tok.encode(text))


@settings(max_examples=25)
@given(ids=st.lists(st.integers(min_value=0, max_value=255), max_size=30))
def test_streaming_any_ids(vocab: tuple[str, Path, Tokenizer], ids: list[int]) -> None:
    # low ids are byte tokens in SPM vocabularies: arbitrary, often invalid, UTF-8
    _, _, tok = vocab
    check_stream(tok, ids)


def test_flush_replaces_an_unfinished_character(llama_spm: Tokenizer) -> None:
    tok = llama_spm
    first_byte = tok.encode("🦙", add_special=False)[1]  # after the space: <0xF0>
    d = tok.detokenizer()
    assert d.push(first_byte) == ""
    assert d.flush() == "\ufffd"


# ------------------------------------------------------------------- special tokens


def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    tok = smollm2
    assert (tok.bos_id, tok.eos_id, tok.eot_id) == (1, 2, 2)
    assert tok.token_text(1) == "<|im_start|>"
    assert tok.token_text(2) == "<|im_end|>"
    # <|endoftext|>, <|im_end|>, and <reponame>: llama.cpp's FIM repo token ends generation
    assert {tok.token_text(i) for i in tok.eog_ids} == {"<|endoftext|>", "<|im_end|>", "<reponame>"}
    assert not tok.add_bos
    assert not tok.add_eos
    text = "<|im_start|>user\nHi<|im_end|>\n"
    parsed = tok.encode(text, parse_special=True)
    assert parsed[0] == 1
    assert 2 in parsed
    plain = tok.encode(text)
    assert 1 not in plain
    assert 2 not in plain
    assert tok.decode(parsed) == tok.decode(plain) == text
    assert tok.decode(parsed, skip_special=True) == "user\nHi\n"


def test_llama_metadata_gives_the_same_tokenizer(smollm2: Tokenizer) -> None:
    # `Llama.metadata`'s shape: the tokenizer.* keys as (value, gguf type, element type)
    fields = GGUFFile(smollm2_gguf()).fields
    meta = {
        k: (f.value, int(f.type), None if f.item_type is None else int(f.item_type))
        for k, f in fields.items()
        if k.startswith("tokenizer.")
    }
    tok = Tokenizer.from_metadata(meta, source="SmolLM2")
    text = "<|im_start|>user\nHow many r's in strawberry? 🍓<|im_end|>\n"
    assert tok.encode(text, parse_special=True) == smollm2.encode(text, parse_special=True)
    assert (tok.bos_id, tok.eos_id, tok.eot_id, tok.eog_ids) == (
        smollm2.bos_id,
        smollm2.eos_id,
        smollm2.eot_id,
        smollm2.eog_ids,
    )
    assert tok.chat_template == smollm2.chat_template


# ------------------------------------------------------------------- errors (no data needed)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def synthetic(**override: Any) -> dict[str, Any]:
    """A small byte-level BPE vocabulary in `Llama.metadata`'s shape: the three ChatML
    control tokens, the 256 byte characters, and the merges of "hello"."""
    chars = [_BYTE_TO_CHAR[b] for b in range(256)]
    words = ["he", "ll", "hell", "hello", "Ġhello"]
    tokens = SPECIALS + chars + words
    types = [3] * len(SPECIALS) + [1] * (len(chars) + len(words))
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": ("gpt2", 8, None),
        "tokenizer.ggml.pre": ("gpt-2", 8, None),
        "tokenizer.ggml.tokens": (tokens, 9, 8),
        "tokenizer.ggml.token_type": (types, 9, 5),
        "tokenizer.ggml.merges": (["h e", "l l", "he ll", "hell o", "Ġ hello"], 9, 8),
        "tokenizer.ggml.bos_token_id": (1, 4, None),
        "tokenizer.ggml.eos_token_id": (0, 4, None),
    }
    for k, v in override.items():
        key = "tokenizer.ggml." + k
        if v is None:
            meta.pop(key, None)
        else:
            meta[key] = v
    return meta


def test_synthetic_vocabulary_works() -> None:
    tok = Tokenizer.from_metadata(synthetic(), source="synthetic")
    hello = tok.n_vocab - 2
    assert tok.encode("hello hello") == [hello, hello + 1]
    assert tok.decode(tok.encode("hello <|im_end|>!")) == "hello <|im_end|>!"
    assert tok.encode("<|im_end|>", parse_special=True) == [2]
    assert tok.eot_id == 2
    assert tok.eog_ids == {0, 2}
    plain = {k: v[0] for k, v in synthetic().items()}
    assert Tokenizer.from_metadata(plain).encode("hello hello") == [hello, hello + 1]


def test_an_unknown_pre_tokenizer_is_refused_not_guessed() -> None:
    with pytest.raises(TokenizerError, match=r"synthetic: key `tokenizer\.ggml\.pre`.*'tekkenx'"):
        Tokenizer.from_metadata(synthetic(pre=("tekkenx", 8, None)), source="synthetic")


def test_a_missing_pre_tokenizer_warns_and_uses_llama_cpps_default() -> None:
    with pytest.warns(TokenizerWarning, match="tokenizer.ggml.pre"):
        tok = Tokenizer.from_metadata(synthetic(pre=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = Tokenizer.from_metadata(synthetic(pre=("default", 8, None)))
    text = "hello, hello 123456 world!?"
    assert tok.encode(text) == default.encode(text)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"model": None}, "tokenizer.ggml.model"),
        ({"model": ("rwkv", 8, None)}, "tokenizer.ggml.model"),
        ({"tokens": None}, "tokenizer.ggml.tokens"),
        ({"merges": None}, "tokenizer.ggml.merges"),
        ({"tokens": (["a", "b", "a"], 9, 8), "token_type": None}, "tokenizer.ggml.tokens"),
        ({"token_type": ([1, 1], 9, 5)}, "tokenizer.ggml.token_type"),
        ({"bos_token_id": ("one", 8, None)}, "tokenizer.ggml.bos_token_id"),
    ],
)
def test_bad_metadata_is_a_clear_error(override: dict[str, Any], key: str) -> None:
    with pytest.raises(TokenizerError, match=rf"^synthetic: key `{key}`"):
        Tokenizer.from_metadata(synthetic(**override), source="synthetic")


def test_out_of_range_ids_are_a_clear_error() -> None:
    tok = Tokenizer.from_metadata(synthetic())
    for bad in (tok.n_vocab, -1, 10**12):
        with pytest.raises(TokenizerError, match=rf"token id {bad} is out of range"):
            tok.decode([0, bad])
        with pytest.raises(TokenizerError, match="out of range"):
            tok.token_to_bytes(bad)
        with pytest.raises(TokenizerError, match="out of range"):
            tok.detokenizer().push(bad)


def test_text_that_is_not_unicode_is_refused() -> None:
    tok = Tokenizer.from_metadata(synthetic())
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.encode("a\ud800b")


def test_lazy_top_level_export() -> None:
    import lowsync

    assert lowsync.Tokenizer is Tokenizer
