"""`LLM`: text in, text out — a model, its tokenizer, one cached sequence and the chat template.

Why: lowsync's `Session` takes token ids and gives token ids. A user with a GGUF file wants
what llama-cpp-python's `Llama` gives: `llm("The capital of France is", max_tokens=8)` returning
an OpenAI-shaped dict, a stream of chunks, chat completions with the model's own template. This
module is that surface, with the same names and shapes, so its users feel at home; the work per
token stays the engine's (sampling on the device: one host wait and one 4-byte read per token
under `staged`).

Strategy: the LLM owns a `Tokenizer` (from the GGUF metadata), one `Session` with device-side
sampling and a single sequence (seq 0), and its chat template. A call turns text into ids,
keeps the longest prefix of them already in seq 0's cache (`Session.seq_tokens`), removes the
rest (`seq_rm`) and lets `Session.generate_iter` decode only the new suffix; when the whole
prompt is cached its last token is decoded again, since the logits of the next token are
needed. Generated ids go through the incremental detokenizer (only complete UTF-8 comes out)
and a stop-string scanner that holds back any tail that could still become a stop string, so a
stream never shows text past a stop, even when the stop string is split across tokens.

Invariants: the cache of seq 0 is the session's, never mirrored here, so whatever a call leaves
behind (a finished run, a stream closed early, Ctrl-C inside a native wait) is what the next
call matches its prompt against; at most one stream is open at a time (a new call closes the
previous stream first, which ends its `generate_iter` and leaves the session consistent);
the text of a result is exactly the concatenation of its stream chunks for the same seed.
"""

from __future__ import annotations

import os
import random
import sys
import time
import uuid
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any

from lowsync._native import LowsyncError, available_backends, device_type
from lowsync.models.llama import Llama
from lowsync.sampling import SamplerParams
from lowsync.session import GenerateStats, Session
from lowsync.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["LLM", "LLMError", "default_backend"]

# Backends by preference when the user names none: a GPU first, then the asynchronous CPU
# stream (it queues a step while the host detokenizes the last token), then the host itself.
_CPU_DEFAULTS = ("cpu-async", "cpu")

Completion = dict[str, Any]


class LLMError(LowsyncError, ValueError):
    """A bad argument to `LLM` or one of its calls (a prompt longer than the context, a model
    without a tokenizer, a backend that does not exist)."""


def default_backend() -> str:
    """The backend `LLM(backend=None)` runs on: the first CUDA device, else the first Vulkan
    device that is not of CPU type (a software rasteriser such as lavapipe is slower than the
    CPU backends), else `cpu-async`, else `cpu`."""
    names = available_backends()
    for kind in ("cuda", "vulkan"):
        for name in names:
            if name.split(":", 1)[0] != kind:
                continue
            if kind == "vulkan" and device_type(name) == "cpu":
                continue
            return name
    return next(b for b in (*_CPU_DEFAULTS, names[0]) if b in names)


class _StopScanner:
    """Finds the first stop string in a stream of text pieces and releases only text that can
    no longer be part of one.

    `push` returns the text that is safe to show: everything before the earliest stop string
    once one is found (then `hit` is set and later text is dropped), otherwise everything but
    the longest tail that is a proper prefix of some stop string. The held tail is never
    longer than the longest stop string, so a search only ever looks at it plus the new piece.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self._hit = False

    @property
    def hit(self) -> bool:
        """Whether a stop string was found (the text ends before it)."""
        return self._hit

    def push(self, text: str) -> str:
        if self._hit:
            return ""
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return buf
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self._hit = True
            self.held = ""
            return buf[: min(found)]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held tail, at the end of the text (it never became a stop string)."""
        out, self.held = ("" if self._hit else self.held), ""
        return out


class _Run:
    """What one generation produced, filled in while its text streams."""

    def __init__(self, n_prompt: int, n_reused: int) -> None:
        self.n_prompt = n_prompt
        self.n_reused = n_reused
        self.n_completion = 0
        self.finish_reason = "length"

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.n_prompt,
            "completion_tokens": self.n_completion,
            "total_tokens": self.n_prompt + self.n_completion,
        }


def _stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    stops = list(stop)
    bad = [s for s in stops if not isinstance(s, str)]
    if bad:
        raise LLMError(f"stop must be a string or a list of strings, got {bad[0]!r} in it")
    return [s for s in stops if s]


class LLM:
    """A GGUF model ready for text: tokenizer, device-side sampling, chat template, one cached
    sequence. Shaped like llama-cpp-python's `Llama`.

    `model` is a GGUF path or a `lowsync.Llama` (its tokenizer comes from the GGUF metadata the
    model was loaded with, or from `tokenizer`). `backend=None` picks `default_backend()`: a
    CUDA device, a Vulkan GPU, else `cpu-async`. `n_ctx` is the number of KV cells (0: the
    model's training context). `policy` is the sync policy (None: `LOWSYNC_SYNC_POLICY`,
    default staged). `seed` seeds the calls that pass none: the same seed and the same calls
    give the same texts (None: a fresh random seed). `chat_template` replaces the model's.

    One generation runs at a time: a new call first closes a stream left unfinished. Example::

        llm = lowsync.LLM("SmolLM2-135M-Instruct.gguf", seed=0)
        out = llm("The capital of France is", max_tokens=8, temperature=0)
        print(out["choices"][0]["text"])  # " Paris. ..."
        for chunk in llm.create_chat_completion(
            [{"role": "user", "content": "Hi!"}], stream=True
        ):
            print(chunk["choices"][0]["delta"].get("content", ""), end="", flush=True)
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Llama,
        backend: str | Sequence[str] | None = None,
        n_ctx: int = 2048,
        policy: str | None = None,
        n_ubatch: int = 64,
        seed: int | None = None,
        verbose: bool = False,
        tokenizer: Tokenizer | None = None,
        chat_template: str | None = None,
        kv_dtype: str = "f32",
        penalty_last_n: int = 64,
        launch_ahead: bool | None = None,
    ) -> None:
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 0:
            raise LLMError(f"LLM: n_ctx must be a non-negative integer, got {n_ctx!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise LLMError(f"LLM: seed must be an integer or None, got {seed!r}")
        if isinstance(model, Llama):
            self.model = model
            self.model_path = model.source or model.name
        elif isinstance(model, str | os.PathLike):
            from lowsync.gguf import load_gguf

            self.model = load_gguf(model)
            self.model_path = os.fspath(model)
        else:
            raise LLMError(
                f"LLM: model must be a GGUF path or a lowsync Llama, got {type(model).__name__}"
            )
        if tokenizer is None:
            if not any(k.startswith("tokenizer.ggml.") for k in self.model.metadata):
                raise LLMError(
                    f"LLM: model {self.model_path!r} carries no tokenizer (no tokenizer.ggml.* "
                    "metadata); load it from a GGUF file or pass tokenizer="
                )
            tokenizer = Tokenizer.from_metadata(self.model.metadata, self.model_path)
        if tokenizer.n_vocab != self.model.config.n_vocab:
            raise LLMError(
                f"LLM: the tokenizer has {tokenizer.n_vocab} tokens but the model's vocabulary "
                f"has {self.model.config.n_vocab}"
            )
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.verbose = verbose
        self._n_ctx = n_ctx or self.model.config.n_ctx_train
        if backend is None:
            backends = [default_backend()]
        elif isinstance(backend, str):
            backends = [backend]
        else:
            backends = list(backend)
        self._session = Session(
            self.model,
            backends=backends,
            n_ctx=self._n_ctx,
            n_seq=1,
            n_ubatch=min(n_ubatch, self._n_ctx),
            policy=policy,
            kv_dtype=kv_dtype,
            launch_ahead=launch_ahead,
            sampling=True,
            penalty_last_n=penalty_last_n,
            # Generation reads the output of a prompt's last token only: one output row per
            # graph, not a row of logits (and of sampling) per prompt token.
            n_outputs=1,
        )
        self._rng = random.Random(seed)
        self._active: weakref.ref[Generator[Any, None, None]] | None = None
        self._last: _Run | None = None
        if verbose:
            print(
                f"lowsync.LLM: {self.model_path} ({self.model.config.n_layer} layers, "
                f"{self.model.weight_type}), n_ctx {self._n_ctx}, backends "
                f"{'+'.join(self._session.backends)}, policy {self._session.policy}",
                file=sys.stderr,
            )

    # ---- facts --------------------------------------------------------------------------------

    @property
    def session(self) -> Session:
        """The session underneath (its counters: `session.stats()`, `session.last_generate`).
        Its graphs have one output row (`n_outputs=1`): `decode(..., logits="all")` on it runs
        a ubatch per token."""
        return self._session

    @property
    def backends(self) -> list[str]:
        """The backends the model runs on."""
        return self._session.backends

    @property
    def policy(self) -> str:
        """The sync policy."""
        return self._session.policy

    @property
    def last_stats(self) -> GenerateStats | None:
        """Timing and per-token counters of the last generation (the session's
        `last_generate`), or None before the first."""
        return self._session.last_generate

    @property
    def last_prompt_reused(self) -> int:
        """Tokens of the last call's prompt that were already in the cache (not decoded)."""
        return 0 if self._last is None else self._last.n_reused

    def n_ctx(self) -> int:
        """The context size in tokens (KV cells)."""
        return self._n_ctx

    def n_vocab(self) -> int:
        """The vocabulary size."""
        return self.tokenizer.n_vocab

    def token_bos(self) -> int | None:
        """The beginning-of-sequence token id (None when the vocabulary has none)."""
        return self.tokenizer.bos_id

    def token_eos(self) -> int | None:
        """The end-of-sequence token id (None when the vocabulary has none)."""
        return self.tokenizer.eos_id

    # ---- tokens -------------------------------------------------------------------------------

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of `text` (bytes are UTF-8). `add_bos` adds the special tokens the model
        asks for (BOS and/or EOS, as llama.cpp's `add_special`); `special` turns control tokens
        written in the text (e.g. "<|im_start|>") into their ids."""
        if isinstance(text, bytes | bytearray):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise LLMError(f"tokenize: the text is not valid UTF-8 ({e})") from None
        if not isinstance(text, str):
            raise LLMError(f"tokenize: text must be str or bytes, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special=add_bos, parse_special=special))

    def detokenize(
        self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None, special: bool = False
    ) -> bytes:
        """The UTF-8 bytes of `tokens`; `special` renders control tokens as their text.
        With `prev_tokens`, only the bytes `tokens` add after them (so a leading space that
        depends on what came before comes out right)."""
        ids = [int(t) for t in tokens]
        bad = [t for t in ids if not 0 <= t < self.tokenizer.n_vocab]
        if bad:
            raise LLMError(
                f"detokenize: token id {bad[0]} is outside the vocabulary of "
                f"{self.tokenizer.n_vocab} tokens"
            )
        if prev_tokens:
            prev = [int(t) for t in prev_tokens]
            head = self.detokenize(prev, special=special)
            whole = self.detokenize(prev + ids, special=special)
            return whole[len(head) :] if whole.startswith(head) else whole
        text: str = self.tokenizer.decode(ids, skip_special=not special)
        return text.encode("utf-8", errors="surrogatepass")

    def reset(self) -> None:
        """Empties the cache: the next call decodes its whole prompt."""
        self._close_stream()
        self._session.clear()

    # ---- completions --------------------------------------------------------------------------

    def __call__(self, prompt: str | Sequence[int], **kwargs: Any) -> Any:
        """`create_completion(prompt, ...)`."""
        return self.create_completion(prompt, **kwargs)

    def create_completion(
        self,
        prompt: str | Sequence[int],
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
    ) -> Any:
        """Continues `prompt` (text, or token ids) by up to `max_tokens` tokens (None or <= 0:
        until the context is full); returns an OpenAI `text_completion` dict, or with
        `stream=True` an iterator of chunks of the same shape whose texts join to the text.

        Generation stops at the model's end-of-generation tokens (EOS, end of turn) and before
        the first of the `stop` strings; `finish_reason` is "stop" then and "length" when
        `max_tokens` or the context ran out. temperature 0 is greedy. A text prompt gets the
        model's BOS as its `add_bos_token` says; control tokens written in it are parsed.
        """
        ids = self._prompt_ids(prompt)
        return self._complete(
            ids,
            max_tokens,
            self._sampler(
                temperature,
                top_k,
                top_p,
                min_p,
                repeat_penalty,
                presence_penalty,
                frequency_penalty,
                seed,
            ),
            _stop_list(stop),
            stream,
            chat=False,
        )

    def create_chat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int | None = None,
        temperature: float = 0.2,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
    ) -> Any:
        """The assistant's reply to `messages` (dicts with "role" and "content"), rendered
        with the model's chat template (or the LLM's `chat_template`); returns an OpenAI
        `chat.completion` dict (`choices[0]["message"]`), or with `stream=True` an iterator of
        `chat.completion.chunk` dicts with `delta`s (the role first, then content, then an
        empty delta with the `finish_reason`). Defaults as llama-cpp-python's: temperature 0.2,
        no token limit but the context. A conversation that grows turn by turn decodes only
        what is new: the earlier turns are in the cache.
        """
        given: object = messages  # checked as the caller may have passed anything
        if not isinstance(given, Sequence) or isinstance(given, str):
            raise LLMError("create_chat_completion: messages must be a list of dicts")
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, template=self.chat_template
        )
        ids = self._chat_ids(text)
        return self._complete(
            ids,
            max_tokens,
            self._sampler(
                temperature,
                top_k,
                top_p,
                min_p,
                repeat_penalty,
                presence_penalty,
                frequency_penalty,
                seed,
            ),
            _stop_list(stop),
            stream,
            chat=True,
        )

    # ---- internals ----------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_bos=True, special=True)
            if not ids:  # an empty prompt starts from BOS, as in llama-cpp-python
                bos = self.tokenizer.bos_id
                if bos is None:
                    raise LLMError("the prompt is empty and the model has no BOS token")
                ids = [bos]
            return ids
        ids = [int(t) for t in prompt]
        if not ids:
            raise LLMError("the prompt is an empty list of tokens")
        bad = [t for t in ids if not 0 <= t < self.tokenizer.n_vocab]
        if bad:
            raise LLMError(
                f"prompt token id {bad[0]} is outside the vocabulary of "
                f"{self.tokenizer.n_vocab} tokens"
            )
        return ids

    def _chat_ids(self, text: str) -> list[int]:
        """A rendered conversation's ids: control tokens parsed; BOS added when the model asks
        for one and the template did not already write it (no doubled BOS)."""
        ids = list(self.tokenizer.encode(text, add_special=False, parse_special=True))
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        if not ids:
            raise LLMError("the chat template rendered an empty prompt")
        return ids

    def _sampler(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        repeat_penalty: float,
        presence_penalty: float,
        frequency_penalty: float,
        seed: int | None,
    ) -> SamplerParams:
        if seed is None:
            seed = self._rng.getrandbits(32)
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise LLMError(f"seed must be an integer or None, got {seed!r}")
        return SamplerParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
        )

    def _close_stream(self) -> None:
        """Closes a stream a caller left unfinished, so its generation ends before a new one."""
        stream = self._active() if self._active is not None else None
        self._active = None
        if stream is not None:
            stream.close()

    def _start(self, ids: list[int], max_tokens: int | None) -> tuple[_Run, list[int], int]:
        """Matches `ids` against the cache and trims it; returns the run, the ids still to
        decode and how many tokens may be generated."""
        if isinstance(max_tokens, bool) or not (max_tokens is None or isinstance(max_tokens, int)):
            raise LLMError(f"max_tokens must be an integer or None, got {max_tokens!r}")
        if len(ids) > self._n_ctx:
            raise LLMError(
                f"the prompt has {len(ids)} tokens, more than the context of {self._n_ctx} "
                "(make n_ctx larger or the prompt shorter)"
            )
        self._close_stream()
        cached = self._session.seq_tokens(0)
        n_keep = 0
        for a, b in zip(cached, ids, strict=False):
            if a != b:
                break
            n_keep += 1
        # The next token's logits come from decoding the prompt's last token: keep it out of
        # the reused prefix even when the whole prompt is cached.
        n_keep = min(n_keep, len(ids) - 1)
        self._session.seq_rm(0, n_keep, None)
        suffix = ids[n_keep:]
        # Every generated token but the last is decoded into the cache.
        room = self._session.n_free - len(suffix) + 1
        n_new = room if max_tokens is None or max_tokens <= 0 else min(max_tokens, room)
        return _Run(len(ids), n_keep), suffix, n_new

    def _continuation_detokenizer(self) -> IncrementalDetokenizer:
        """A detokenizer for text that continues a prompt (control tokens dropped).

        A vocabulary that prefixes a space to a text (SPM's `add_space_prefix`) has the
        detokenizer drop that space from the first piece it sees; a continuation's first piece
        is not the start of a text (" Paris" continues "The capital of France is"), so the
        first-piece rule is spent on BOS, whose text (hidden, or "<s>"-like: no space, no
        partial UTF-8) leaves nothing pending and is discarded."""
        detok = self.tokenizer.detokenizer(skip_special=True)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_space_prefix and bos is not None:
            detok.push(bos)
        return detok

    def _pieces(
        self, run: _Run, tokens: Iterator[int], stops: list[str]
    ) -> Generator[str, None, None]:
        """The text of the session's generated `tokens` in safe pieces (complete UTF-8, nothing
        that may still become a stop string, nothing past one); fills `run` as it goes."""
        eog = self.tokenizer.eog_ids
        scanner = _StopScanner(stops)
        detok = self._continuation_detokenizer()
        try:
            for token in tokens:
                if token in eog:
                    run.finish_reason = "stop"
                    break
                run.n_completion += 1
                text = scanner.push(detok.push(token))
                if text:
                    yield text
                if scanner.hit:
                    run.finish_reason = "stop"
                    break
            stopped_by_string = scanner.hit
            if not stopped_by_string:  # the end: what the detokenizer and the scanner held
                text = scanner.push(detok.flush()) + scanner.flush()
                if scanner.hit:
                    run.finish_reason = "stop"
                if text:
                    yield text
        finally:
            # Ends the session's generation here (a stop string, the consumer's break or
            # exception): the tokens it produced stay in the cache, the rest is given back.
            close = getattr(tokens, "close", None)
            if close is not None:
                close()

    def _complete(
        self,
        ids: list[int],
        max_tokens: int | None,
        params: SamplerParams,
        stops: list[str],
        stream: bool,
        chat: bool,
    ) -> Any:
        run, suffix, n_new = self._start(ids, max_tokens)
        self._last = run
        kind = "chat.completion" if chat else "text_completion"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_path,
        }
        # Created now, so its arguments are checked by this call; it runs on the first `next`.
        tokens = self._session.generate_iter(
            suffix, n_new, seq_id=0, stop=tuple(sorted(self.tokenizer.eog_ids)), sampler=params
        )
        pieces = self._pieces(run, tokens, stops)
        if stream:
            chunks = (
                self._chat_chunks(head, run, pieces) if chat else self._chunks(head, run, pieces)
            )
            self._active = weakref.ref(chunks)
            return chunks
        text = "".join(pieces)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": run.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**head, "choices": [choice], "usage": run.usage()}

    @staticmethod
    def _chunks(
        head: dict[str, Any], run: _Run, pieces: Generator[str, None, None]
    ) -> Generator[Completion, None, None]:
        def chunk(text: str, finish: str | None) -> Completion:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
            return {**head, "choices": [choice]}

        with closing(pieces):
            for text in pieces:
                yield chunk(text, None)
        yield {**chunk("", run.finish_reason), "usage": run.usage()}

    @staticmethod
    def _chat_chunks(
        head: dict[str, Any], run: _Run, pieces: Generator[str, None, None]
    ) -> Generator[Completion, None, None]:
        head = {**head, "object": "chat.completion.chunk"}

        def chunk(delta: dict[str, str], finish: str | None) -> Completion:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**head, "choices": [choice]}

        with closing(pieces):
            yield chunk({"role": "assistant"}, None)
            for text in pieces:
                yield chunk({"content": text}, None)
        yield {**chunk({}, run.finish_reason), "usage": run.usage()}
