"""`lowsync.LLM`: completions and chat completions shaped as llama-cpp-python's, streaming,
stop strings split across tokens, UTF-8 that never breaks, seeds, Ctrl-C, prefix reuse, and
the engine's counts per generated token.

Most tests run a small random model with a synthetic byte-level BPE vocabulary
(`text_models.byte_bpe_metadata`), so they need no file. The text-handling tests replace the
session's `generate_iter` by a script of token ids, so the text they check is known exactly;
the rest run the real session. The SmolLM2 tests need the fetched model (skipped without it).
"""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import lowsync as ls
from lowsync import llm as llm_module
from lowsync.llm import LLM, LLMError, default_backend
from lowsync.models.llama import Llama, LlamaConfig
from lowsync.tokenizer import Tokenizer
from testdata import llama_cpp_models
from text_models import random_text_model, runnable_smollm2

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def model() -> Llama:
    return random_text_model(seed=1)


@pytest.fixture
def llm(model: Llama, clean_env: pytest.MonkeyPatch) -> LLM:
    return LLM(model, backend="cpu-async", n_ctx=128, seed=0)


def _text(llm: LLM, s: str) -> list[int]:
    return llm.tokenize(s, add_bos=False)


def script(llm: LLM, monkeypatch: pytest.MonkeyPatch, ids: Sequence[int]) -> list[int]:
    """Makes the session "generate" `ids` (as far as `max_new_tokens` and its stop ids let
    it); returns a list that receives each call's `max_new_tokens`."""
    asked: list[int] = []

    def generate_iter(
        prompt: Sequence[int],
        max_new_tokens: int,
        seq_id: int = 0,
        stop: Sequence[int] = (),
        sampler: Any = None,
    ) -> Iterator[int]:
        asked.append(max_new_tokens)
        for t in list(ids)[:max_new_tokens]:
            yield t
            if t in stop:
                return

    monkeypatch.setattr(llm.session, "generate_iter", generate_iter)
    return asked


def stream_texts(chunks: Iterator[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The texts of a completion stream, and its last chunk."""
    texts, last = [], {}
    for c in chunks:
        texts.append(c["choices"][0]["text"])
        last = c
    return texts, last


# ---- text: stop strings, UTF-8, end of generation (scripted tokens) --------------------------


def test_stop_string_split_across_tokens_stops_at_the_right_place(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _text(llm, "one E two EN three END four")
    script(llm, monkeypatch, ids)
    out = llm(PROMPT, max_tokens=100, stop=["END"])
    assert out["choices"][0]["text"] == "one E two EN three "
    assert out["choices"][0]["finish_reason"] == "stop"
    # Tokens up to the one that completed "END" were generated; none after it.
    n_upto_d = len(_text(llm, "one E two EN three END"))
    assert out["usage"]["completion_tokens"] == n_upto_d

    texts, last = stream_texts(llm(PROMPT, max_tokens=100, stop=["END"], stream=True))
    assert "".join(texts) == "one E two EN three "
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["usage"] == out["usage"]
    # A tail that could start the stop string is held back until it cannot: "E" and "EN" are
    # released only once the next character rules "END" out.
    shown = ""
    for t in texts:
        shown += t
        assert "one E two EN three ".startswith(shown)


def test_text_held_for_a_stop_string_comes_out_at_the_end(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    eos = llm.tokenizer.eos_id
    assert eos is not None
    for ids, max_tokens, reason in (
        ([*_text(llm, "ends in EN"), eos], 50, "stop"),  # an end-of-generation token
        (_text(llm, "ends in EN"), len(_text(llm, "ends in EN")), "length"),
    ):
        script(llm, monkeypatch, ids)
        out = llm(PROMPT, max_tokens=max_tokens, stop="END")
        assert out["choices"][0]["text"] == "ends in EN"
        assert out["choices"][0]["finish_reason"] == reason
        texts, last = stream_texts(llm(PROMPT, max_tokens=max_tokens, stop="END", stream=True))
        assert "".join(texts) == "ends in EN"
        # "EN" is held back until the end, then comes the final chunk with the reason.
        assert texts[-2].endswith("EN")
        assert texts[-1] == ""
        assert last["choices"][0]["finish_reason"] == reason


def test_earliest_of_several_stop_strings_wins(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    script(llm, monkeypatch, _text(llm, "alpha beta gamma delta"))
    out = llm(PROMPT, max_tokens=100, stop=["delta", "ta g", "zzz"])
    assert out["choices"][0]["text"] == "alpha be"
    texts, _ = stream_texts(llm(PROMPT, max_tokens=100, stop="ta g", stream=True))
    assert "".join(texts) == "alpha be"


def test_streamed_text_never_breaks_a_utf8_sequence(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "héllo → 世界 🎉 ok"
    ids = _text(llm, text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    script(llm, monkeypatch, ids)
    texts, last = stream_texts(llm(PROMPT, max_tokens=len(ids), stream=True))
    assert "".join(texts) == text
    assert not any("\ufffd" in t for t in texts)
    assert last["choices"][0]["finish_reason"] == "length"
    assert llm(PROMPT, max_tokens=len(ids))["choices"][0]["text"] == text
    # A stop string made of multi-byte characters, split across byte tokens.
    out = llm(PROMPT, max_tokens=len(ids), stop=["界 🎉"])
    assert out["choices"][0]["text"] == "héllo → 世"


def test_end_of_generation_tokens_stop_and_are_not_counted(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = llm.tokenizer
    im_end = tok.encode("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1
    assert im_end[0] in tok.eog_ids
    assert tok.eos_id in tok.eog_ids
    for eog in (im_end[0], tok.eos_id):
        script(llm, monkeypatch, [*_text(llm, "hi there"), eog, *_text(llm, "after")])
        out = llm(PROMPT, max_tokens=50)
        assert out["choices"][0]["text"] == "hi there"
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == len(_text(llm, "hi there"))


def test_max_tokens_and_the_context_limit(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _text(llm, "a b c d e f g h i j k l m n o p")
    asked = script(llm, monkeypatch, ids)
    out = llm(PROMPT, max_tokens=5)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    n_prompt = len(llm.tokenize(PROMPT))
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["total_tokens"] == n_prompt + 5
    # None or <= 0: until the context is full (every generated token but the last is cached).
    for limit in (None, 0, -1):
        llm(PROMPT, max_tokens=limit)
        assert asked[-1] == llm.n_ctx() - n_prompt + 1
    assert asked[0] == 5


def test_a_continuation_keeps_the_leading_space_of_an_spm_vocabulary(
    monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch
) -> None:
    """An SPM vocabulary prefixes a space to a text and drops it when decoding one; generated
    text continues the prompt, so its first space stays (" Paris", as llama-cpp-python)."""
    tok = Tokenizer.from_gguf(llama_cpp_models() / "ggml-vocab-llama-spm.gguf")
    assert tok.add_space_prefix
    config = LlamaConfig(
        n_vocab=tok.n_vocab, n_embd=32, n_layer=1, n_head=2, n_head_kv=1, n_ff=64
    )  # fmt: skip
    llm = LLM(Llama.random(config), backend="cpu", n_ctx=64, tokenizer=tok)
    ids = tok.encode("Paris is nice", add_special=False)
    assert tok.token_text(ids[0]) == "\u2581Paris"
    script(llm, monkeypatch, ids)
    assert llm("The capital of France is", max_tokens=10)["choices"][0]["text"] == " Paris is nice"
    texts, _ = stream_texts(llm("The capital of France is", max_tokens=10, stream=True))
    assert "".join(texts) == " Paris is nice"
    prompt = llm.tokenize("The capital of France is")
    assert llm.detokenize(ids, prev_tokens=prompt) == b" Paris is nice"


# ---- the real session -----------------------------------------------------------------------


def test_completion_is_openai_shaped(llm: LLM) -> None:
    out = llm.create_completion(PROMPT, max_tokens=6, temperature=0)
    assert out["object"] == "text_completion"
    assert out["id"].startswith("cmpl-")
    assert isinstance(out["created"], int)
    assert out["model"] == "random-bpe"
    (choice,) = out["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["index"] == 0
    assert choice["logprobs"] is None
    assert choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(llm.tokenize(PROMPT))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 6
    assert llm("x", max_tokens=1)["usage"]["completion_tokens"] <= 1


def test_stream_chunks_join_to_the_text_for_the_same_seed(llm: LLM) -> None:
    kw: dict[str, Any] = {"max_tokens": 24, "temperature": 0.9, "seed": 1234, "top_k": 0}
    llm.reset()
    whole = llm(PROMPT, **kw)
    llm.reset()
    texts, last = stream_texts(llm(PROMPT, stream=True, **kw))
    assert "".join(texts) == whole["choices"][0]["text"]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert last["usage"] == whole["usage"]
    assert all(c == "" or isinstance(c, str) for c in texts)


def test_seeded_runs_are_reproducible(model: Llama, clean_env: pytest.MonkeyPatch) -> None:
    def texts(seed: int) -> list[str]:
        llm = LLM(model, backend="cpu-async", n_ctx=128, seed=seed)
        out = []
        for p in (PROMPT, "hello", PROMPT):
            llm.reset()
            out.append(llm(p, max_tokens=12, temperature=1.0)["choices"][0]["text"])
        llm.reset()
        out.append(llm(PROMPT, max_tokens=12, temperature=1.0, seed=99)["choices"][0]["text"])
        return out

    a, b, c = texts(5), texts(5), texts(6)
    assert a == b
    assert a[3] == c[3]  # an explicit seed wins over the LLM's
    assert a[:3] != c[:3]


def test_prefix_reuse_decodes_only_the_new_suffix(llm: LLM) -> None:
    ids = llm.tokenize(PROMPT)
    out = llm(PROMPT, max_tokens=4, temperature=0)
    st = llm.last_stats
    assert st is not None
    assert st.n_prompt == len(ids)
    assert llm.last_prompt_reused == 0

    # The prompt again: everything is cached, only its last token is decoded again.
    llm(PROMPT, max_tokens=4, temperature=0)
    assert llm.last_stats is not None
    assert llm.last_stats.n_prompt == 1
    assert llm.last_prompt_reused == len(ids) - 1

    # The prompt, what came out, and more: only what is not in the cache is decoded.
    longer = PROMPT + out["choices"][0]["text"] + " and then the dog"
    ids2 = llm.tokenize(longer)
    cached = llm.session.seq_tokens(0)
    common = next(
        (i for i, (a, b) in enumerate(zip(cached, ids2, strict=False)) if a != b),
        min(len(cached), len(ids2)),
    )
    assert common >= len(ids) - 1
    llm(longer, max_tokens=3, temperature=0)
    assert llm.last_prompt_reused == common
    assert llm.last_stats is not None
    assert llm.last_stats.n_prompt == len(ids2) - common

    # A prompt that diverges early drops the rest of the cache.
    llm("a different start", max_tokens=2, temperature=0)
    assert llm.last_prompt_reused <= 1
    assert llm.session.seq_tokens(0)[: len(llm.tokenize("a different start"))] == llm.tokenize(
        "a different start"
    )


def test_prefix_reuse_gives_the_text_a_fresh_cache_gives(model: Llama, llm: LLM) -> None:
    llm(PROMPT, max_tokens=8, temperature=0)
    reused = llm(PROMPT + " again", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert llm.last_prompt_reused > 0
    fresh = LLM(model, backend="cpu-async", n_ctx=128)
    assert fresh(PROMPT + " again", max_tokens=8, temperature=0)["choices"][0]["text"] == reused


def test_chat_completion_uses_the_template_and_reuses_earlier_turns(llm: LLM) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    out = llm.create_chat_completion(messages, max_tokens=10, seed=3)
    assert out["object"] == "chat.completion"
    assert out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant"
    answer = choice["message"]["content"]
    assert isinstance(answer, str)
    rendered = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
    rendered += "<|im_start|>assistant\n"
    turn1 = llm.tokenize(rendered, add_bos=False, special=True)
    assert out["usage"]["prompt_tokens"] == len(turn1)

    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"},
    ]
    chunks = list(llm.create_chat_completion(messages, max_tokens=10, seed=3, stream=True))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # Turn 2 decoded only what turn 1 had not: the first turn's prompt was in the cache.
    assert llm.last_prompt_reused >= len(turn1)
    st = llm.last_stats
    assert st is not None
    assert st.n_prompt == chunks[-1]["usage"]["prompt_tokens"] - llm.last_prompt_reused

    # The stream's content is the non-streamed answer for the same seed.
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    llm.reset()
    again = llm.create_chat_completion(messages, max_tokens=10, seed=3)
    llm.reset()
    streamed = llm.create_chat_completion(messages, max_tokens=10, seed=3, stream=True)
    joined = "".join(c["choices"][0]["delta"].get("content", "") for c in streamed)
    assert joined == again["choices"][0]["message"]["content"]
    assert isinstance(text, str)


def _cache_is_consistent(llm: LLM) -> None:
    toks = llm.session.seq_tokens(0)
    assert llm.session.seq_pos_max(0) == len(toks) - 1
    assert llm.session.n_free == llm.n_ctx() - len(toks)


def test_ctrl_c_in_the_consumer_keeps_the_llm_usable(llm: LLM) -> None:
    got: list[str] = []
    stream = llm(PROMPT, max_tokens=40, temperature=0, stream=True)

    def consume() -> None:
        for i, chunk in enumerate(stream):
            got.append(chunk["choices"][0]["text"])
            if i == 3:
                raise KeyboardInterrupt  # as Ctrl-C in the consumer's own code

    with pytest.raises(KeyboardInterrupt):
        consume()
    assert len(got) == 4  # what was produced was kept by the consumer
    # The unfinished stream is closed by the next call; the cache holds the prompt and what
    # was generated, so the next call reuses it.
    out = llm(PROMPT, max_tokens=5, temperature=0)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert llm.last_prompt_reused == len(llm.tokenize(PROMPT)) - 1
    _cache_is_consistent(llm)


def test_ctrl_c_during_generation_keeps_the_llm_usable(llm: LLM) -> None:
    """A real interrupt (SIGINT's KeyboardInterrupt, raised wherever the main thread is: in the
    session's native wait, in the LLM's code or in the consumer's)."""

    def consume(stream: Iterator[dict[str, Any]], interrupt_at: int) -> None:
        for i, _ in enumerate(stream):
            if i == interrupt_at:
                threading.Thread(target=_thread.interrupt_main).start()
        while True:  # the stream ended first: the interrupt lands here
            time.sleep(0.01)

    for interrupt_at in (1, 5):
        stream = llm(PROMPT, max_tokens=None, temperature=0.8, stream=True)
        with pytest.raises(KeyboardInterrupt):
            consume(stream, interrupt_at)
        del stream
        _cache_is_consistent(llm)
        out = llm(PROMPT, max_tokens=4, temperature=0)
        assert out["usage"]["completion_tokens"] <= 4
        assert llm.last_prompt_reused == len(llm.tokenize(PROMPT)) - 1
        _cache_is_consistent(llm)


def test_a_new_call_closes_an_unfinished_stream(llm: LLM) -> None:
    first = llm(PROMPT, max_tokens=30, temperature=0, stream=True)
    next(first)
    out = llm("hello", max_tokens=3, temperature=0)
    assert out["usage"]["prompt_tokens"] == len(llm.tokenize("hello"))
    assert list(first) == []  # closed: it yields nothing more
    _cache_is_consistent(llm)


@pytest.mark.parametrize("stream", [False, True])
def test_counts_per_generated_token_with_sampling_on_cpu_async(
    model: Llama, clean_env: pytest.MonkeyPatch, stream: bool
) -> None:
    llm = LLM(model, backend="cpu-async", n_ctx=128, policy="staged", seed=0)
    kw: dict[str, Any] = {
        "max_tokens": 10,
        "temperature": 0.8,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.02,
        "repeat_penalty": 1.1,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.1,
    }
    llm(PROMPT, **kw)  # warm-up
    for _ in range(3):  # generations that stop at an end-of-generation token count fewer steps
        llm.reset()
        out = llm(PROMPT, stream=stream, **kw)
        if stream:
            list(out)
        st = llm.last_stats
        assert st is not None
        if st.n_steps >= 2:
            break
    assert st.n_steps >= 2, "every run ended at once at an end-of-generation token"
    per = st.per_token
    assert (per["host_waits"], per["h2d_copies"], per["d2h_copies"]) == (1.0, 1.0, 1.0), per
    if "d2h_bytes" in per:
        assert per["d2h_bytes"] == 4.0  # the sampled token, nothing else
    assert per["reallocs"] == 0.0


# ---- tokens ---------------------------------------------------------------------------------


def test_tokenize_and_detokenize_as_llama_cpp_python(llm: LLM) -> None:
    ids = llm.tokenize(b"h\xc3\xa9llo world")
    assert ids == llm.tokenize("héllo world")
    assert llm.detokenize(ids) == "héllo world".encode()
    special = llm.tokenize("<|im_start|>user", add_bos=False, special=True)
    plain = llm.tokenize("<|im_start|>user", add_bos=False, special=False)
    assert len(special) < len(plain)
    assert llm.detokenize(special, special=True) == b"<|im_start|>user"
    assert llm.detokenize(special) == b"user"
    head = llm.tokenize("hello", add_bos=False)
    tail = llm.tokenize(" world", add_bos=False)
    assert llm.detokenize(tail, prev_tokens=head) == b" world"
    assert llm.n_vocab() == llm.model.config.n_vocab
    assert llm.token_eos() == llm.tokenizer.eos_id


# ---- errors and choices ---------------------------------------------------------------------


def test_bad_arguments_are_clear_errors(llm: LLM, model: Llama) -> None:
    with pytest.raises(LLMError, match="more than the context of 128"):
        llm("word " * 200, max_tokens=1)
    with pytest.raises(LLMError, match="stop must be"):
        llm(PROMPT, stop=["ok", 3])  # type: ignore[list-item]
    with pytest.raises(LLMError, match="outside the vocabulary"):
        llm([1, 2, 10**6])
    with pytest.raises(LLMError, match="max_tokens"):
        llm(PROMPT, max_tokens="8")  # type: ignore[arg-type]
    with pytest.raises(LLMError, match="carries no tokenizer"):
        LLM(Llama.random("tiny"), backend="cpu")
    with pytest.raises(LLMError, match="GGUF path or a lowsync Llama"):
        LLM(42, backend="cpu")  # type: ignore[arg-type]
    with pytest.raises(ls.UnknownBackendError):
        LLM(model, backend="nope")
    with pytest.raises(FileNotFoundError):
        LLM("/nonexistent/model.gguf")
    # The LLM is still usable after a refused call.
    assert llm(PROMPT, max_tokens=2, temperature=0)["object"] == "text_completion"


def test_default_backend_prefers_a_gpu_and_skips_software_vulkan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def machine(names: list[str], types: dict[str, str]) -> None:
        monkeypatch.setattr(llm_module, "available_backends", lambda: names)
        monkeypatch.setattr(llm_module, "device_type", lambda n: types.get(n, "cpu"))

    machine(["cpu", "cpu-async", "noop", "vulkan:0"], {"vulkan:0": "cpu"})
    assert default_backend() == "cpu-async"
    machine(["cpu", "cpu-async", "vulkan:0", "vulkan:1"], {"vulkan:1": "discrete_gpu"})
    assert default_backend() == "vulkan:1"
    machine(["cpu", "cpu-async", "vulkan:0", "cuda:0"], {"vulkan:0": "discrete_gpu"})
    assert default_backend() == "cuda:0"
    machine(["cpu", "noop"], {})
    assert default_backend() == "cpu"


def test_default_backend_on_this_machine(model: Llama, clean_env: pytest.MonkeyPatch) -> None:
    llm = LLM(model, n_ctx=64)
    assert llm.backends == [default_backend()]
    assert ls.LLM is LLM


# ---- SmolLM2 (real weights and vocabulary) -------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return runnable_smollm2(tmp_path_factory.getbasetemp())


@pytest.mark.parametrize(
    "backend",
    [
        "cpu",
        "cpu-async",
        pytest.param("cuda", marks=pytest.mark.cuda),
        pytest.param("vulkan", marks=pytest.mark.vulkan_gpu),
    ],
)
def test_smollm2_greedy_continues_the_capital_of_france_with_paris(
    smollm2: Path, backend: str, clean_env: pytest.MonkeyPatch
) -> None:
    llm = LLM(smollm2, backend=backend, n_ctx=256)
    out = llm("The capital of France is", max_tokens=8, temperature=0)
    assert out["choices"][0]["text"].startswith(" Paris"), out
    st = llm.last_stats
    assert st is not None
    # The asynchronous backends wait once per token (the read); `cpu` computes on the calling
    # thread: none.
    assert st.per_token["host_waits"] == (0.0 if backend == "cpu" else 1.0)


def test_smollm2_chat_answers_with_its_template(
    smollm2: Path, clean_env: pytest.MonkeyPatch
) -> None:
    llm = LLM(smollm2, backend="cpu-async", n_ctx=512)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.create_chat_completion(messages, max_tokens=48, temperature=0)
    answer = out["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert "<|im_end|>" not in answer
    assert "<|im_start|>" not in answer
    first = out["usage"]["prompt_tokens"]
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Italy?"},
    ]
    llm.create_chat_completion(messages, max_tokens=16, temperature=0)
    assert llm.last_prompt_reused >= first
