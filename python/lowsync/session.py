"""`Session`: a model, a KV cache with sequences, and the decode loop over fixed-shape graphs.

Why: the graph contract (ARCHITECTURE §6) moves everything that changes between steps out of
the graph and into small host-written inputs. Something must own that state — which KV-cache
cell holds which position of which sequences — and turn it into inputs every step, without
ever rebuilding a graph. The state is `lowsync.kv_cells.KvCells`; this module turns it into
inputs and runs the plans; the graph itself is `lowsync.models.llama`.

Strategy: one `Context` per session (the user's backend list is passed straight through) and
one compiled plan per shape bucket, compiled once in `__init__`, largest first (reserve once):
by default a 1-token decode graph and an `n_ubatch`-token graph, each with `n_outputs` output
rows at most (a ubatch ends early once it holds that many tokens whose output is wanted, so a
prompt read only for its last token needs one row of logits, not one per token). All plans
name the same
weights and persistent KV tensors, which the context shares between its plans. The cache
tensors have one more row than there are cells: the scratch row that padded tokens of a short
ubatch write to. Per ubatch the host fills `tokens`, `pos`, `kv_idx`, `kq_mask` and `out_ids`
(padded to the bucket) and computes; a greedy step reads only `next` (4 bytes per output row),
so under the `staged` policy a generated token costs one host wait. With launch-ahead
(`staged`, a backend with stream-ordered copies and reads) `generate` queues step t+1 before it
reads token t: the decode plan's `tokens` input is fed on the device from the step before's
`next`, and the read of token t is waited for on its own, so the device runs step after step
while the host reads and checks tokens. With `sampling=True` every bucket draws `next` on the
device (`lowsync.sampling`, docs/sampling.md): the sampler's parameters, key and penalty window
are four more inputs in the same staged upload, the window built from the token id each KV
cell holds (`KvCells`), and in the one-token graph closed by the step's own `tokens` input, so
launch-ahead works unchanged. `generate_iter` is the same loop as a generator: each token is
yielded once read, and closing it early rolls back only the step queued ahead.

Invariants: every public method validates its arguments before it changes any state; every
step is a transaction on the cells (`KvCells.begin` .. `commit` / `rollback`), so a step that
fails anywhere — a bad input, a backend error, Ctrl-C between any two lines — leaves the cells
as they were before it; after Ctrl-C (which cancels queued work) the cells of steps never
waited for are freed too, since their rows may not have been written; and what an interrupt
outside any handler leaves (an open step, an armed feed) is repaired on entry to the next call
(invariant 14). Calls are serialised by a lock, so threads may share a session; a suspended
`generate_iter` holds the lock (other threads wait for it, and a call from its own thread is a
`SessionError`, since it would roll back the step queued ahead). Shapes never depend on state,
so steps after `seq_cp` and ubatches without outputs run the same plans (invariants 11, 12).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt

from lowsync._native import Context, LowsyncError, PendingOutput, Plan, env_flag, stat_names
from lowsync.kv_cells import ContextFullError, KvCells, SessionError, Step
from lowsync.models.llama import (
    OUTPUT_LOGITS,
    OUTPUT_NEXT,
    SAMPLE_HIST,
    SAMPLE_KEY,
    SAMPLE_PARAMS,
    SAMPLE_PENALTY,
    Llama,
)
from lowsync.sampling import SamplerParams

__all__ = ["TOKEN_COUNTERS", "ContextFullError", "GenerateStats", "Session", "SessionError"]

LogitsMode = Literal["last", "all", "none"]

# Every counter of `Context.stats()`, in the core's order: `GenerateStats` reports each of them
# for the prompt and per generated token (`staging_bytes_in_use` is a level, so its "per token"
# figure is its growth per token, 0 while staging stays bounded).
TOKEN_COUNTERS: tuple[str, ...] = tuple(stat_names())

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _serialised(
    method: Callable[Concatenate[Session, _P], _R],
) -> Callable[Concatenate[Session, _P], _R]:
    """Runs `method` under the session's lock (one call at a time, whichever thread)."""

    @functools.wraps(method)
    def locked(self: Session, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            self._enter()
            return method(self, *args, **kwargs)

    return locked


@dataclass(frozen=True)
class GenerateStats:
    """Timing and counters of one `Session.generate` call.

    The prompt phase (`prefill_s`, `prefill`) decodes the prompt and reads the first generated
    token; the decode phase is the `n_steps` one-token steps after it, and `per_token` holds its
    counter deltas divided by `n_steps` (the "per generated token" figures of the bench). Both
    hold every counter of `TOKEN_COUNTERS`.

    `steps` holds each decode step's own counter deltas, cut where its token's read completed;
    the last runs to the end of the call (so together they are the decode phase, and a step
    queued ahead of a stop token counts in the last). Without launch-ahead each queues its
    step and reads its token. With it each queues one step ahead, with the read of that
    step's token behind it (`Plan.compute_read_async`), except the first, which also holds
    step 1 (queued before the loop: the pipeline filling, two steps), and the last, which
    queues none (draining). Taking them costs one
    `Context.counters()` call per step. `decode_s` of a `generate_iter` includes the time its
    consumer held each token.
    """

    n_prompt: int
    n_gen: int
    n_steps: int
    prefill_s: float
    decode_s: float
    prefill: dict[str, int]
    per_token: dict[str, float]
    steps: list[dict[str, int]] = field(default_factory=list)

    @property
    def pp_tps(self) -> float:
        """Prompt tokens per second."""
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def tg_tps(self) -> float:
        """Generated tokens per second over the decode steps."""
        return self.n_steps / self.decode_s if self.decode_s > 0 else float("inf")


def _launch_ahead_setting(value: bool | None) -> bool:
    """`launch_ahead` as given, or `LOWSYNC_LAUNCH_AHEAD` (0 or 1, default 1) when None; the
    variable goes through the core's parser, so a bad value is an `EnvError` naming it."""
    if value is None:
        return env_flag("LOWSYNC_LAUNCH_AHEAD", True)
    if not isinstance(value, bool):
        raise SessionError(f"Session: launch_ahead must be a bool or None, got {value!r}")
    return value


# The sampler rows of an output that is not drawn: the argmax, no penalty (any window, any key).
_GREEDY_PARAMS = SamplerParams.greedy().params_row()
_NO_PENALTY = SamplerParams.greedy().penalty_row()
# `_Bucket.drawing` when an interrupted write may have left the sampler inputs half written.
_UNKNOWN = ("unknown",)


@dataclass(frozen=True)
class _Draw:
    """The sampler of one `generate` call: its parameters and the seed of its keys."""

    sampler: SamplerParams
    seed: int

    @property
    def rows(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return self.sampler.penalty_row(), self.sampler.params_row()


class _Bucket:
    """One compiled graph of fixed token count, with the host buffers of its inputs.

    With sampling (`window` is the penalty window N, None without), the sampler's inputs too:
    `hist` has N - 1 columns in the one-token graph (its token closes the window on the
    device) and N elsewhere; `drawing` records what the sampler inputs in the plan hold (None:
    greedy rows everywhere), so the hot path rewrites the parameter rows only when they change.
    """

    def __init__(
        self, plan: Plan, n_tokens: int, n_out: int, n_rows: int, window: int | None
    ) -> None:
        self.plan = plan
        self.n_tokens = n_tokens
        self.n_out = n_out
        self.tokens = np.zeros(n_tokens, np.int32)
        self.pos = np.zeros(n_tokens, np.int32)
        self.kv_idx = np.zeros(n_tokens, np.int32)
        self.kq_mask = np.full((n_tokens, n_rows), -np.inf, np.float32)
        self.out_ids = np.zeros(n_out, np.int32)
        plan.set_input("out_ids", self.out_ids)
        self.sampling = window is not None
        self.hist_cols = 0 if not window else (window - 1 if n_tokens == 1 else window)
        self.has_hist = SAMPLE_HIST in plan.inputs
        self.has_penalty = SAMPLE_PENALTY in plan.inputs
        self.hist = np.full((n_out, self.hist_cols), -1, np.int32)
        self.penalty = np.zeros((n_out, 3), np.float32)
        self.params = np.zeros((n_out, 4), np.float32)
        self.key = np.zeros((n_out, 2), np.int32)
        self.drawing: object = _UNKNOWN
        if self.sampling:
            self.write_greedy()

    def write_greedy(self) -> None:
        """Every row greedy, no penalty: what an output not drawn by a sampler needs."""
        self.drawing = _UNKNOWN  # until every write below is done
        self.penalty[:] = _NO_PENALTY
        self.params[:] = _GREEDY_PARAMS
        self.write_sampler_inputs()
        self.drawing = None

    def write_sampler_inputs(self) -> None:
        plan = self.plan
        plan.set_input(SAMPLE_PARAMS, self.params)
        plan.set_input(SAMPLE_KEY, self.key)
        if self.has_penalty:
            plan.set_input(SAMPLE_PENALTY, self.penalty)
        if self.has_hist:
            plan.set_input(SAMPLE_HIST, self.hist)


class Session:
    """A model on a context, with a unified KV cache of `n_ctx` cells shared by `n_seq` sequences.

    `backends` goes to `lowsync.Context` as given; `policy` is "stock", "relaxed", "staged" or
    None (`LOWSYNC_SYNC_POLICY`, default staged). A prompt is split into ubatches of at most
    `n_ubatch` tokens, and a ubatch ends early once it holds `n_outputs` tokens whose output
    is wanted (default `n_ubatch`: never early): each graph has at most `n_outputs` rows of
    logits, so `n_outputs=1` suits a session that only generates (each prompt is read for its
    last token), at the cost of one ubatch per token for `decode(..., logits="all")`.
    `kv_dtype` is the cache's dtype. One graph is compiled per size in
    `buckets` plus one of `n_ubatch` tokens, all at creation; a ubatch runs on the smallest that
    holds it, padded. The default `(1,)` gives single-token steps their own graph; `()` runs
    everything through the `n_ubatch` graph; e.g. `(1, 2, 4)` suits 4 parallel sequences.

    `sampling=True` builds every graph with the sampler after the output head, so `generate`
    can draw tokens on the device with a `SamplerParams` (top-k, top-p, min-p, temperature,
    and llama.cpp's repeat / frequency / presence penalties over the last `penalty_last_n`
    tokens of the sequence, prompt included; 0 turns penalties off). Without it `generate`
    serves only greedy samplers, through the argmax.

    A call that raises — bad input, a backend error, KeyboardInterrupt — leaves the cache as it
    was before the call, and the session stays usable. One exception to "as it was": when a
    call is interrupted (Ctrl-C), cells of earlier calls whose device work was never waited
    for (a `decode(..., logits="none")` not followed by any read) are freed too, since the
    backends cancel queued work on Ctrl-C and those KV rows may never have been written;
    `seq_pos_max` shows what each sequence still holds.

    `layer_split` places the model's layers across the backends as a pipeline, as llama.cpp's
    `--tensor-split` (layer mode) does: one non-negative weight per backend of `backends`, in
    order (`[1, 1]` halves the layers between two GPUs; `"even"` gives every backend an equal
    share), each backend taking a contiguous run of layers with their weights and KV cache
    (the embedding goes with the first layer, the output head with the last). Activations cross
    each stage boundary by the scheduler's copies, ordered by events on the devices, so a token
    still costs the host one wait. None (the default) lets the scheduler place the weights.

    Threads may share a session: its calls are serialised by a lock (a second thread's call
    waits until the first returns), so each call sees and leaves a consistent cache.

    Example::

        sess = Session(Llama.random("tiny", seed=0), backends=["cpu-async"], n_ctx=256)
        logits = sess.decode([1, 5, 300, 7], seq_id=0, logits="all")  # [4, n_vocab]
        ids = sess.generate([1, 5, 300], max_new_tokens=8, seq_id=1)  # greedy, on the device
        sess.seq_cp(1, 2)  # seq 2 shares seq 1's cells; no data is copied

        drawn = Session(model, backends=["cpu-async"], sampling=True)
        for tok in drawn.generate_iter([1, 5], 16, sampler=SamplerParams(seed=7)):
            print(tok)  # each token as soon as it is read
    """

    def __init__(
        self,
        model: Llama,
        backends: Sequence[str] = ("cpu",),
        n_ctx: int = 2048,
        n_seq: int = 4,
        n_ubatch: int = 32,
        policy: str | None = None,
        kv_dtype: str = "f32",
        buckets: Sequence[int] = (1,),
        launch_ahead: bool | None = None,
        sampling: bool = False,
        penalty_last_n: int = 64,
        layer_split: Sequence[float] | Literal["even"] | None = None,
        n_outputs: int | None = None,
    ) -> None:
        if not isinstance(model, Llama):
            raise SessionError(
                f"Session: model must be a lowsync Llama (Llama.random or load_gguf), "
                f"got {type(model).__name__}"
            )
        for what, v in (("n_ctx", n_ctx), ("n_seq", n_seq), ("n_ubatch", n_ubatch)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SessionError(f"Session: {what} must be a positive integer, got {v!r}")
        if n_outputs is None:
            n_outputs = n_ubatch
        if (
            isinstance(n_outputs, bool)
            or not isinstance(n_outputs, int)
            or not 1 <= n_outputs <= n_ubatch
        ):
            raise SessionError(
                f"Session: n_outputs must be an int from 1 to n_ubatch ({n_ubatch}), "
                f"got {n_outputs!r}"
            )
        bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if bad or any(b > n_ubatch for b in buckets):
            raise SessionError(
                f"Session: buckets must be positive ints of at most n_ubatch ({n_ubatch}), "
                f"got {list(buckets)}"
            )
        launch_ahead = _launch_ahead_setting(launch_ahead)
        if not isinstance(sampling, bool):
            raise SessionError(f"Session: sampling must be a bool, got {sampling!r}")
        if (
            isinstance(penalty_last_n, bool)
            or not isinstance(penalty_last_n, int)
            or penalty_last_n < 0
        ):
            raise SessionError(
                f"Session: penalty_last_n must be an int >= 0 (0: no penalties), "
                f"got {penalty_last_n!r}"
            )
        if kv_dtype not in ("f32", "f16", "bf16"):
            raise SessionError(f"Session: kv_dtype must be f32, f16 or bf16, got {kv_dtype!r}")
        if isinstance(backends, str):
            backends = [backends]
        layer_backends = _layer_backends(list(backends), layer_split, model.config.n_layer)
        self.model = model
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.n_ubatch = n_ubatch
        self.n_outputs = n_outputs
        self.n_vocab = model.config.n_vocab
        self.sampling = sampling
        self.penalty_last_n = penalty_last_n
        self._lock = threading.RLock()
        # The open `generate_iter`s: while one is suspended, its thread may not call in.
        self._iterators: weakref.WeakSet[Generator[int, None, None]] = weakref.WeakSet()
        self._cells = KvCells(n_ctx, n_seq)
        self.context = Context(list(backends), policy=policy)
        n_rows = self._cells.n_rows
        # Largest bucket first: its compile is the worst-case reserve, and every smaller graph
        # (same nodes, smaller tensors) then fits it without reallocating (invariant 11).
        sizes = sorted({*buckets, n_ubatch}, reverse=True)
        compiled: list[_Bucket] = []
        window = penalty_last_n if sampling else None
        # Quantized weights the backends cannot read are widened here, once for every bucket.
        graph_model = model.prepared_for(self.context)
        for size in sizes:
            n_out = min(size, n_outputs)
            graph = graph_model.build_graph(
                size,
                n_rows,
                n_out,
                kv_dtype=kv_dtype,
                sampling=sampling,
                penalty_last_n=penalty_last_n,
                layer_backends=layer_backends,
            )
            compiled.append(_Bucket(self.context.compile(graph), size, n_out, n_rows, window))
            del graph  # the context holds the uploaded weights; drop the graph's copy now
        del graph_model
        self._buckets = compiled[::-1]  # smallest first, for `_bucket_for`
        decode = self._buckets[0].plan
        self._launch_ahead = (
            launch_ahead
            and decode.policy == "staged"
            and decode.can_feed("tokens", OUTPUT_NEXT)
            and decode.can_read_async(OUTPUT_NEXT)
        )
        # Under `staged`, the loop without launch-ahead also queues each step with its token's
        # read (one submission where the backend can) instead of a blocking read after it.
        self._read_with_step = decode.policy == "staged" and decode.can_read_async(OUTPUT_NEXT)
        # Set from just before a feed is armed until the compute that takes it returned: while
        # set outside a call, a feed may be armed for whatever computes next (`_recover`).
        self._feed_armed = False
        self.last_generate: GenerateStats | None = None

    # ---- facts --------------------------------------------------------------------------------

    @property
    def policy(self) -> str:
        """The context's sync policy."""
        return self.context.policy

    @property
    def backends(self) -> list[str]:
        """The context's backends."""
        return self.context.backends

    @property
    def launch_ahead(self) -> bool:
        """Whether `generate` queues step t+1 before it reads token t (the token reaches step
        t+1 on the device). Asked for with `launch_ahead` or `LOWSYNC_LAUNCH_AHEAD` (default
        on); it needs the `staged` policy and a backend with stream-ordered copies and reads.
        A sampler with penalties takes the plain loop on a session without a one-token bucket
        (`buckets=()`): only the one-token graph closes the penalty window with the fed token.
        """
        return self._launch_ahead

    @property
    def n_free(self) -> int:
        """KV cells not used by any sequence."""
        with self._lock:
            self._enter()
            return self._cells.n_free

    @property
    def plans(self) -> list[Plan]:
        """The compiled plans, smallest bucket first (compiled once, at creation)."""
        return [b.plan for b in self._buckets]

    @_serialised
    def seq_pos_max(self, seq_id: int) -> int:
        """The largest position held by `seq_id`, or -1 when it holds none."""
        return self._cells.pos_max(seq_id)

    @_serialised
    def seq_cells(self, seq_id: int) -> list[int]:
        """The cells `seq_id` holds, in cell order (cells may be shared with other sequences)."""
        return self._cells.cells(seq_id)

    @_serialised
    def seq_tokens(self, seq_id: int) -> list[int]:
        """The token ids `seq_id`'s cells hold, in position order: what the sequence decoded
        (a generation's last token is not among them: it was never decoded). For prefix reuse,
        e.g. keep the common prefix with ``seq_rm(seq_id, p0=n_common)``."""
        return self._cells.tokens(seq_id)

    @_serialised
    def stats(self) -> dict[str, dict[str, int]]:
        """Cumulative counters of the context: per backend and `"total"`."""
        return self.context.stats()

    # ---- sequences ----------------------------------------------------------------------------

    @_serialised
    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int | None = None) -> None:
        """Makes `dst` share `src`'s cells with positions in [p0, p1): no data is copied."""
        self._cells.copy(src, dst, p0, p1)

    @_serialised
    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None) -> None:
        """Removes `seq_id` from its cells with positions in [p0, p1); frees cells left empty."""
        self._cells.remove(seq_id, p0, p1)

    @_serialised
    def seq_keep(self, seq_id: int) -> None:
        """Removes every other sequence from the cache."""
        self._cells.keep(seq_id)

    @_serialised
    def clear(self) -> None:
        """Empties the cache (every sequence)."""
        self._cells.clear()

    # ---- decoding -----------------------------------------------------------------------------

    @_serialised
    def decode(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer[Any]],
        seq_id: int | Sequence[int] = 0,
        logits: LogitsMode | Sequence[bool] = "last",
    ) -> npt.NDArray[np.float32] | None:
        """Appends `tokens` to sequence `seq_id` (or to `seq_id[i]` per token) and runs them.

        The tokens are split into ubatches of at most `n_ubatch`. `logits`: "last" returns the
        last token's logits [n_vocab]; "all" returns [n_tokens, n_vocab]; "none" returns None
        and does not wait for the device; a sequence of bools selects rows ([n_true, n_vocab]).
        Positions continue each sequence (its largest position + 1).
        """
        toks = self._check_tokens(tokens)
        seqs = self._check_seq_ids(seq_id, len(toks))
        flags = self._output_flags(logits, len(toks))
        rows = self._run(toks, seqs, flags, want="logits")
        if logits == "none" or (not isinstance(logits, str) and not any(flags)):
            return None
        assert rows is not None
        out = np.concatenate(rows) if len(rows) > 1 else rows[0]
        return out[-1] if logits == "last" else out

    @_serialised
    def step(self, tokens: Mapping[int, int]) -> dict[int, int]:
        """Decodes one token for each of several sequences in one ubatch; returns each
        sequence's greedy next token (argmax on the device: only `next` is read back).

        Example: ``nxt = sess.step({0: 17, 1: 17})`` then ``sess.step(nxt)``.
        """
        seqs = list(tokens)
        if not seqs:
            raise SessionError("step: no sequences given")
        for s in seqs:
            self._check_seq(s)
        toks = self._check_tokens([tokens[s] for s in seqs])
        nxt = self._run(toks, seqs, [True] * len(seqs), want="next")
        assert nxt is not None
        ids = np.concatenate(nxt)
        return {s: int(t) for s, t in zip(seqs, ids, strict=True)}

    @_serialised
    def generate(
        self,
        prompt: Sequence[int] | npt.NDArray[np.integer[Any]],
        max_new_tokens: int,
        seq_id: int = 0,
        stop: Iterable[int] = (),
        sampler: SamplerParams | None = None,
    ) -> list[int]:
        """Generation on the device: decodes `prompt` into `seq_id`, then feeds each generated
        token back, one step per token; returns the generated tokens.

        `sampler` None is greedy (the argmax); a `SamplerParams` draws each token on the device
        (a session built with `sampling=True`; without it only a greedy sampler is served).
        Each step reads only the sampled token (one host wait under `staged`). With
        `launch_ahead`, step t+1 is queued before token t is read, its token copied on the
        device from step t's output, so the device never waits for the host; when token t is a
        stop token, step t+1 ran for nothing and its cell is given back. Generation ends
        after `max_new_tokens` tokens or at a token in `stop`. The cache must have room for the
        prompt and every generated token but the last, checked before anything runs. Timing and
        counters of the call are kept in `last_generate`. If a step fails, the steps whose
        token was read keep their cells (`seq_pos_max` shows how far it got) and the failed
        step gives its cell back. `generate(...)` is ``list(generate_iter(...))``.
        """
        args = self._check_generate(prompt, max_new_tokens, seq_id, stop, sampler)
        return list(self._generation(*args))

    @_serialised
    def generate_iter(
        self,
        prompt: Sequence[int] | npt.NDArray[np.integer[Any]],
        max_new_tokens: int,
        seq_id: int = 0,
        stop: Iterable[int] = (),
        sampler: SamplerParams | None = None,
    ) -> Generator[int, None, None]:
        """`generate`, streaming: yields each token as soon as it is read.

        The arguments are checked now; the work starts at the first `next`. Closing the
        iterator early (``break``, `close()`, an exception or Ctrl-C in the consumer) leaves the
        session as ``generate(..., max_new_tokens=<tokens yielded>)`` would have: the step
        queued ahead is rolled back. `last_generate` is set when it finishes or is closed.
        While it is suspended it holds the session: another thread's call waits for it, and a
        call from the consuming thread is a `SessionError` (close it first). Consume it from
        the thread that started it (the session's lock belongs to that thread).

        Example::

            for tok in sess.generate_iter(prompt, 64, sampler=SamplerParams(seed=1)):
                print(tokenizer.decode([tok]), end="", flush=True)
        """
        args = self._check_generate(prompt, max_new_tokens, seq_id, stop, sampler)
        gen = self._generation(*args)
        self._iterators.add(gen)
        return gen

    def _check_generate(
        self,
        prompt: Sequence[int] | npt.NDArray[np.integer[Any]],
        max_new_tokens: int,
        seq_id: int,
        stop: Iterable[int],
        sampler: SamplerParams | None,
    ) -> tuple[list[int], int, int, set[int], _Draw | None]:
        toks = self._check_tokens(prompt)
        self._check_seq(seq_id)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise SessionError(f"generate: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise SessionError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(toks) == 0:
            raise SessionError("generate: the prompt is empty")
        self._check_room(len(toks), max_new_tokens)
        stops = {int(t) for t in stop}
        draw: _Draw | None = None
        if sampler is not None:
            if not isinstance(sampler, SamplerParams):
                raise SessionError(
                    f"generate: sampler must be a SamplerParams or None, got "
                    f"{type(sampler).__name__}"
                )
            if not sampler.is_greedy:
                if not self.sampling:
                    raise SessionError(
                        "generate: this session was built without sampling, so it serves only "
                        "greedy samplers (temperature <= 0, no penalty); build it with "
                        "Session(..., sampling=True) to draw tokens"
                    )
                draw = _Draw(sampler, sampler.resolve_seed())
        return toks, max_new_tokens, seq_id, stops, draw

    def _check_room(self, n_prompt: int, max_new_tokens: int) -> None:
        need = n_prompt + max_new_tokens - 1
        if need > self._cells.n_free:
            raise ContextFullError(
                f"generate: needs {need} free KV cells ({n_prompt} prompt tokens + "
                f"{max_new_tokens - 1} fed back), the cache has {self._cells.n_free} of "
                f"{self.n_ctx}"
            )

    def _generation(
        self,
        toks: list[int],
        max_new_tokens: int,
        seq_id: int,
        stops: set[int],
        draw: _Draw | None,
    ) -> Generator[int, None, None]:
        """The body of `generate` and `generate_iter`: the prompt, then the decode loop, each
        token yielded once read; records `last_generate` however it ends."""
        with self._lock:
            self._enter()
            self._check_room(len(toks), max_new_tokens)  # the cache may have changed since
            reads: list[list[int]] = []  # the counters as each step's read completed
            out: list[int] = []
            before = self._counters()
            t0 = time.perf_counter()
            t1 = 0.0
            mid: list[int] | None = None
            try:
                flags = [False] * len(toks)
                flags[-1] = True
                first = self._run(toks, [seq_id] * len(toks), flags, want="next", draw=draw)
                assert first is not None
                out.append(int(first[-1][0]))
                self._check_device_token(out[-1])
                t1 = time.perf_counter()
                mid = self._counters()

                def on_read() -> None:
                    # Kept raw, the deltas taken at the end: one cheap native call a step.
                    reads.append(self._counters())

                decode = self._buckets[0]
                ahead = self._launch_ahead and _window_closes_on_device(decode, draw)
                loop = self._decode_ahead if ahead else self._decode_plain
                yield from loop(decode, seq_id, max_new_tokens, stops, out, draw, on_read)
            finally:
                if mid is not None:
                    self._record(len(toks), out, reads, t0, t1, before, mid)

    def _record(
        self,
        n_prompt: int,
        out: list[int],
        reads: list[list[int]],
        t0: float,
        t1: float,
        before: list[int],
        mid: list[int],
    ) -> None:
        t2 = time.perf_counter()
        after = self._counters()
        n = len(reads)
        # The last step ends with the call: it also holds what was queued after its read (the
        # step queued ahead of a stop token or of a closed iterator), so the steps add up to
        # the decode phase.
        cuts = [mid, *reads[:-1], after] if reads else []
        steps = [_delta(a, b) for a, b in itertools.pairwise(cuts)]
        self.last_generate = GenerateStats(
            n_prompt=n_prompt,
            n_gen=len(out),
            n_steps=n,
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            prefill=_delta(before, mid),
            per_token={c: v / max(n, 1) for c, v in _delta(mid, after).items()},
            steps=steps,
        )

    def _counters(self) -> list[int]:
        """The context's counters (total over backends), in `TOKEN_COUNTERS` order."""
        return self.context.counters()

    # ---- validation ---------------------------------------------------------------------------

    def _check_seq(self, seq_id: int) -> None:
        self._cells.pos_max(seq_id)  # raises SessionError naming the valid ids

    def _check_seq_ids(self, seq_id: int | Sequence[int], n: int) -> list[int]:
        if isinstance(seq_id, int | np.integer) and not isinstance(seq_id, bool):
            self._check_seq(int(seq_id))
            return [int(seq_id)] * n
        seqs = list(seq_id)  # type: ignore[arg-type]
        if len(seqs) != n:
            raise SessionError(f"decode: {len(seqs)} sequence ids for {n} tokens")
        for s in set(seqs):
            self._check_seq(s)
        return [int(s) for s in seqs]

    def _check_tokens(self, tokens: Sequence[int] | npt.NDArray[np.integer[Any]]) -> list[int]:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size > 0 and arr.dtype.kind not in "iu"):
            raise SessionError(
                f"tokens must be a 1-D sequence of ints, got {arr.dtype} of shape {arr.shape}"
            )
        if arr.size == 0:
            return []
        bad = np.flatnonzero((arr < 0) | (arr >= self.n_vocab))
        if bad.size:
            i = int(bad[0])
            raise SessionError(
                f"token id {int(arr[i])} at index {i} is out of range for the model's "
                f"vocabulary of {self.n_vocab} tokens (valid: 0..{self.n_vocab - 1})"
            )
        return [int(t) for t in arr]

    def _check_device_token(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:  # only a broken backend could produce this
            raise SessionError(f"the device returned token id {token}, outside the vocabulary")

    def _output_flags(self, logits: LogitsMode | Sequence[bool], n: int) -> list[bool]:
        if n == 0:
            raise SessionError("decode: no tokens given")
        if isinstance(logits, str):
            if logits == "all":
                return [True] * n
            if logits == "none":
                return [False] * n
            if logits == "last":
                return [False] * (n - 1) + [True]
            raise SessionError(
                f"decode: logits must be 'last', 'all', 'none' or a sequence of bools, "
                f"got {logits!r}"
            )
        flags = [bool(f) for f in logits]
        if len(flags) != n:
            raise SessionError(f"decode: {len(flags)} logits flags for {n} tokens")
        return flags

    # ---- running ------------------------------------------------------------------------------

    def _enter(self) -> None:
        """What every call does first, under the lock: refuse to run inside a suspended
        `generate_iter` of this thread (its step queued ahead is open), then repair."""
        if any(inspect.getgeneratorstate(g) == inspect.GEN_SUSPENDED for g in self._iterators):
            raise SessionError(
                "a generate_iter of this session is suspended in this thread: exhaust it or "
                "close() it (or leave its loop) before calling the session again"
            )
        self._recover()

    def _bucket_for(self, n: int) -> _Bucket:
        return next(b for b in self._buckets if b.n_tokens >= n)

    def _abort(self, error: BaseException, *steps: Step) -> None:
        """After `error`: undoes the open `steps` (newest first). An interruption (Ctrl-C, or
        any exception a signal handler raised inside a native wait) makes the backends cancel
        their queued work, so the cells of committed steps that were never waited for are
        freed too; a lowsync error leaves queued work to run."""
        self._cells.rollback(*steps)
        if not isinstance(error, LowsyncError):
            self._cells.invalidate_pending()

    def _run(
        self,
        tokens: list[int],
        seqs: list[int],
        flags: list[bool],
        want: Literal["logits", "next"],
        draw: _Draw | None = None,
    ) -> list[npt.NDArray[Any]] | None:
        """Runs the tokens in ubatches, as one step of the cells; returns the wanted output rows
        of each ubatch that has any (None when no token wants an output). `draw`: the sampler
        of the output rows (greedy without)."""
        if len(tokens) > self._cells.n_free:
            raise ContextFullError(
                f"decode: {len(tokens)} tokens need as many free KV cells; the cache has "
                f"{self._cells.n_free} free of {self.n_ctx} (free some with seq_rm, or use a "
                f"larger n_ctx)"
            )
        step = self._cells.begin()
        results: list[npt.NDArray[Any]] = []
        waited = False  # whether the last ubatch's output was read (so all of them ran)
        try:
            for start, stop in self._ubatches(flags):
                sub_seqs = seqs[start:stop]
                sub_tokens = tokens[start:stop]
                rows = [i for i, f in enumerate(flags[start:stop]) if f]
                bucket = self._bucket_for(stop - start)
                cells, positions = self._cells.take(sub_seqs, step, sub_tokens)
                self._fill(bucket, sub_tokens, sub_seqs, rows, cells, positions, draw)
                bucket.plan.compute()
                waited = False
                if rows:
                    name = OUTPUT_LOGITS if want == "logits" else OUTPUT_NEXT
                    results.append(bucket.plan.get_output(name)[: len(rows)])
                    waited = True
        except BaseException as e:
            self._abort(e, step)
            raise
        self._cells.commit(step, confirmed=waited)
        return results or None

    def _ubatches(self, flags: list[bool]) -> Iterator[tuple[int, int]]:
        """The (start, stop) of each ubatch of tokens with these output flags: at most
        `n_ubatch` tokens, ending after the `n_outputs`-th token whose output is wanted."""
        n, start = len(flags), 0
        while start < n:
            stop = min(start + self.n_ubatch, n)
            if self.n_outputs < stop - start:
                wanted = itertools.accumulate(flags[start:stop])
                full = next((i for i, c in enumerate(wanted) if c == self.n_outputs), None)
                if full is not None:
                    stop = start + full + 1
            yield start, stop
            start = stop

    def _fill(
        self,
        bucket: _Bucket,
        tokens: list[int],
        seqs: list[int],
        rows: list[int],
        cells: list[int],
        positions: list[int],
        draw: _Draw | None = None,
        hist: npt.NDArray[np.int32] | None = None,
    ) -> None:
        """Writes the bucket's inputs for one ubatch (padded to its size) into its plan.
        `hist`: the one-token graph's penalty window, when the caller keeps it."""
        m, size, plan = len(tokens), bucket.n_tokens, bucket.plan
        if size == 1:
            # The decode step, the hot path: item writes, and the sequence's own mask row
            # (a view: set_input copies it straight into the input pack).
            bucket.tokens[0], bucket.pos[0], bucket.kv_idx[0] = tokens[0], positions[0], cells[0]
            mask = self._cells.mask_row(seqs[0])
        else:
            bucket.tokens[:m] = tokens
            bucket.tokens[m:] = 0
            bucket.pos[:m] = positions
            bucket.pos[m:] = 0
            bucket.kv_idx[:m] = cells
            bucket.kv_idx[m:] = self._cells.scratch  # padding writes the scratch row
            mask = bucket.kq_mask
            if all(s == seqs[0] for s in seqs):
                mask[:m] = self._cells.mask_row(seqs[0])
            else:
                mask[:m] = self._cells.mask_rows(seqs)
            # A token must not see the cells of later tokens of this ubatch: those are of its
            # own sequence with larger positions, or of another sequence (already -inf).
            if m > 1:
                later_i, later_j = np.triu_indices(m, 1)
                mask[later_i, np.asarray(cells)[later_j]] = -np.inf
            mask[m:] = -np.inf  # padded rows attend nothing and give zeros
        plan.set_input("tokens", bucket.tokens)
        plan.set_input("pos", bucket.pos)
        plan.set_input("kv_idx", bucket.kv_idx)
        plan.set_input("kq_mask", mask)
        if size > 1:  # a 1-token graph's output row is always row 0, written once at creation
            bucket.out_ids[: len(rows)] = rows
            bucket.out_ids[len(rows) :] = 0
            plan.set_input("out_ids", bucket.out_ids)
        if bucket.sampling:
            self._fill_sampler(bucket, seqs, rows, positions, draw, hist)

    def _fill_sampler(
        self,
        bucket: _Bucket,
        seqs: list[int],
        rows: list[int],
        positions: list[int],
        draw: _Draw | None,
        hist: npt.NDArray[np.int32] | None,
    ) -> None:
        """Writes the sampler's inputs: greedy rows without `draw`; with it, each output row's
        parameters, its key (seed, the position its token will take) and its penalty window
        (the sequence's tokens up to and including the row's own; in the one-token graph the
        window's last column is the `tokens` input, so the host writes the rest)."""
        if draw is None:
            if bucket.drawing is not None:
                bucket.write_greedy()
            return
        n_cols = bucket.hist_cols
        if bucket.n_tokens == 1:
            p = positions[0]
            if bucket.drawing != draw.rows:
                bucket.drawing = _UNKNOWN  # until both rows are written
                bucket.penalty[0], bucket.params[0] = draw.rows
                bucket.plan.set_input(SAMPLE_PARAMS, bucket.params)
                if bucket.has_penalty:
                    bucket.plan.set_input(SAMPLE_PENALTY, bucket.penalty)
                bucket.drawing = draw.rows
            bucket.key[0] = (np.uint32(draw.seed).view(np.int32), p + 1)
            bucket.plan.set_input(SAMPLE_KEY, bucket.key)
            if bucket.has_hist:
                if hist is None:
                    hist = self._cells.window(seqs[0], p - 1, n_cols)
                bucket.hist[0] = hist
                bucket.plan.set_input(SAMPLE_HIST, bucket.hist)
            return
        # A larger graph: output row j is ubatch row rows[j]; rows not drawn stay greedy.
        bucket.drawing = _UNKNOWN
        bucket.penalty[:] = _NO_PENALTY
        bucket.params[:] = _GREEDY_PARAMS
        bucket.hist[:] = -1
        bucket.key[:] = 0
        seed = np.uint32(draw.seed).view(np.int32)
        for j, i in enumerate(rows):
            bucket.penalty[j], bucket.params[j] = draw.rows
            bucket.key[j] = (seed, positions[i] + 1)
            if n_cols:
                bucket.hist[j] = self._cells.window(seqs[i], positions[i], n_cols)
        bucket.write_sampler_inputs()
        bucket.drawing = draw.rows if rows else None

    def _queue_one(
        self,
        bucket: _Bucket,
        token: int | None,
        seq_id: int,
        step: Step,
        draw: _Draw | None = None,
        hist: npt.NDArray[np.int32] | None = None,
        read: bool = False,
    ) -> tuple[int, PendingOutput | None]:
        """Queues one decode step of `generate` in `step`: one token of one sequence; returns
        its cell, and with `read` the read of its `next` queued behind it (in the step's own
        submission where the backend can), else None. With `token` None the token comes from
        the previous step's `next`, on the device (the cell's token id is then set once the
        host reads it)."""
        cells, positions = self._cells.take([seq_id], step, [-1 if token is None else token])
        # The host's token of a fed step is a placeholder: the feed overwrites it on the device.
        self._fill(
            bucket, [0 if token is None else token], [seq_id], [0], cells, positions, draw, hist
        )
        plan = bucket.plan
        if token is not None:
            if read:
                return cells[0], plan.compute_read_async(OUTPUT_NEXT)
            plan.compute()
            return cells[0], None
        # Armed last, right before the compute that takes it: a failure in the writes above
        # arms nothing. Until that compute has returned the feed may still be armed (a compute
        # that raised may not have got to take it): `_recover` then lets a harmless step take
        # it before the next real one.
        self._feed_armed = True
        plan.feed("tokens", OUTPUT_NEXT)
        pending = plan.compute_read_async(OUTPUT_NEXT) if read else None
        if not read:
            plan.compute()
        self._feed_armed = False
        return cells[0], pending

    def _recover(self) -> None:
        """Repairs what a failure left behind, before a call uses the session: open steps of
        the cells that an interrupt outside any handler left (rolled back), and a feed that may
        still be armed because its compute failed or never started, which would otherwise
        replace the host's tokens of the next real step. That feed is taken by a step that
        writes only the scratch row (no mask admits it) and whose output nobody reads."""
        self._cells.recover()
        if self._feed_armed:
            b = self._buckets[0]
            b.tokens[:] = 0
            b.pos[:] = 0
            b.kv_idx[:] = self._cells.scratch
            b.kq_mask[:] = -np.inf
            b.out_ids[:] = 0
            for name, data in (
                ("tokens", b.tokens),
                ("pos", b.pos),
                ("kv_idx", b.kv_idx),
                ("kq_mask", b.kq_mask),
                ("out_ids", b.out_ids),
            ):
                b.plan.set_input(name, data)
            b.plan.compute()
            self._feed_armed = False

    def _decode_window(
        self, bucket: _Bucket, seq_id: int, draw: _Draw | None
    ) -> npt.NDArray[np.int32] | None:
        """The penalty window the host writes for the first decode step of `generate` (the
        tokens before the position it decodes), or None when the plan has none to write. The
        loops then shift in each token as it becomes known, instead of searching the cells."""
        if draw is None or bucket.n_tokens > 1 or not bucket.has_hist:
            return None  # a larger graph's window is read from the cells, row by row
        return self._cells.window(seq_id, self._cells.pos_max(seq_id), bucket.hist_cols)

    def _decode_plain(
        self,
        decode: _Bucket,
        seq_id: int,
        max_new_tokens: int,
        stops: set[int],
        out: list[int],
        draw: _Draw | None,
        on_read: Callable[[], None],
    ) -> Iterator[int]:
        """The decode steps of `generate` without launch-ahead: queue, read, repeat (under
        `staged` the read is queued with its step). `out` holds the prompt's token; yields it,
        then each token read (appended to `out`)."""
        token = out[-1]
        hist = self._decode_window(decode, seq_id, draw)
        yield token
        while len(out) < max_new_tokens and token not in stops:
            self._check_device_token(token)
            step = self._cells.begin()
            try:
                read = self._read_with_step
                _, pending = self._queue_one(decode, token, seq_id, step, draw, hist, read=read)
                # The step's one wait.
                out_next = (
                    decode.plan.get_output(OUTPUT_NEXT) if pending is None else pending.wait()
                )
                token = int(out_next[0])
            except BaseException as e:
                self._abort(e, step)
                raise
            self._cells.commit(step, confirmed=True)
            out.append(token)
            on_read()
            if hist is not None:  # the step's own token joins the next step's window
                _shift_in(hist, out[-2])
            yield token

    def _decode_ahead(
        self,
        decode: _Bucket,
        seq_id: int,
        max_new_tokens: int,
        stops: set[int],
        out: list[int],
        draw: _Draw | None,
        on_read: Callable[[], None],
    ) -> Iterator[int]:
        """The decode steps of `generate` with launch-ahead. `out` holds the prompt's token;
        yields it, then each token read (appended to `out`).

        Step k takes token k-1; step 1's comes from the host (the prompt's output), every later
        one is fed on the device from the step before. Step k+1 is queued before token k is
        read, so each iteration's one host wait finds the next step already queued. A step is
        committed when its token is read; on a failure the open steps (the one whose read
        failed and the one queued ahead of it) are rolled back, and so is the step queued
        ahead when the consumer stops at a yield. Step k+1's penalty window ends with token
        k-1, which the host has read by then; token k closes it on the device.
        """
        token = out[-1]
        if len(out) >= max_new_tokens or token in stops:
            yield token
            return
        self._check_device_token(token)
        hist = self._decode_window(decode, seq_id, draw)
        current = self._cells.begin()
        try:
            _, first = self._queue_one(decode, token, seq_id, current, draw, hist, read=True)
            assert first is not None
            pending = first
        except BaseException as e:
            self._abort(e, current)
            raise
        ahead: Step | None = None
        try:
            yield token
            while True:
                # `pending` holds token len(out); one more step is needed after it only if the
                # output is not full once it is read.
                ahead = None
                follow = None
                try:
                    if len(out) + 1 < max_new_tokens:
                        if hist is not None:
                            _shift_in(hist, out[-1])
                        ahead = self._cells.begin()
                        cell, follow = self._queue_one(
                            decode, None, seq_id, ahead, draw, hist, read=True
                        )
                    token = int(pending.wait()[0])  # the one wait of the step
                    self._check_device_token(token)
                    on_read()
                except BaseException as e:
                    self._abort(e, *(s for s in (ahead, current) if s is not None))
                    raise
                self._cells.commit(current, confirmed=True)
                out.append(token)
                if ahead is None:
                    yield token
                    return
                self._cells.set_token(cell, token)  # the token the step queued ahead decodes
                if token in stops:
                    # The step queued ahead took a stop token: give back its cell (its KV row is
                    # masked from now on, and whoever takes the cell next overwrites it).
                    self._cells.rollback(ahead)
                    yield token
                    return
                yield token
                assert follow is not None
                pending, current = follow, ahead
        finally:
            # Stopped at a yield (closed, or the consumer's exception): the step queued ahead
            # of the last token yielded is rolled back, as if it had never been queued. Also
            # whatever an interrupt between two lines left open, newest first (a step already
            # committed or rolled back is no longer open and is left alone).
            self._cells.rollback(*(s for s in (ahead, current) if s and self._cells.is_open(s)))


def _layer_backends(
    backends: list[str], split: Sequence[float] | str | None, n_layer: int
) -> list[str] | None:
    """The backend of each layer under `layer_split` (see `Session`), or None without one.

    Backend k takes layers [round(n_layer * c_{k-1} / total), round(n_layer * c_k / total)),
    c_k the running sum of the weights: contiguous runs, in the order of `backends`."""
    if split is None:
        return None
    if isinstance(split, str):
        if split != "even":
            raise SessionError(f'Session: layer_split must be "even" or weights, got {split!r}')
        weights = [1.0] * len(backends)
    else:
        try:
            weights = [float(w) for w in split]
        except (TypeError, ValueError):
            raise SessionError(
                f"Session: layer_split must be one number per backend, got {split!r:.100}"
            ) from None
    if len(weights) != len(backends):
        raise SessionError(
            f"Session: layer_split has {len(weights)} weights for {len(backends)} backends "
            f"{backends}; give one per backend (0 for a backend that takes no layers)"
        )
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise SessionError(
            f"Session: layer_split weights must be finite, >= 0 and not all 0, got {weights}"
        )
    total = sum(weights)
    bounds, running = [], 0.0
    for w in weights:
        running += w
        bounds.append(round(n_layer * running / total))
    return [backends[next(k for k, b in enumerate(bounds) if i < b)] for i in range(n_layer)]


def _delta(earlier: list[int], later: list[int]) -> dict[str, int]:
    """Counter deltas between two `Context.counters()` lists, by name."""
    return {c: b - a for c, a, b in zip(TOKEN_COUNTERS, earlier, later, strict=True)}


def _window_closes_on_device(decode: _Bucket, draw: _Draw | None) -> bool:
    """Whether a decode step fed its token on the device still gets the right penalty window:
    the one-token graph takes the window's last column from its `tokens` input, a larger graph
    from the host, which does not know a fed token."""
    return (
        draw is None
        or decode.n_tokens == 1
        or not decode.has_hist
        or not draw.sampler.has_penalties
    )


def _shift_in(hist: npt.NDArray[np.int32], token: int) -> None:
    """Slides a penalty window one position on: the oldest token out, `token` in."""
    hist[:-1] = hist[1:]
    hist[-1] = token
