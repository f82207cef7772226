"""`Session`: a model, a KV cache with sequences, and the decode loop over fixed-shape graphs.

Why: the graph contract (ARCHITECTURE §6) moves everything that changes between steps out of
the graph and into small host-written inputs. Something must own that state — which KV-cache
cell holds which position of which sequences — and turn it into inputs every step, without
ever rebuilding a graph. The state is `lowsync.kv_cells.KvCells`; this module turns it into
inputs and runs the plans; the graph itself is `lowsync.models.llama`.

Strategy: one `Context` per session (the user's backend list is passed straight through) and
one compiled plan per shape bucket, compiled once in `__init__`, largest first (reserve once):
by default a 1-token decode graph and an `n_ubatch`-token graph. All plans name the same
weights and persistent KV tensors, which the context shares between its plans. The cache
tensors have one more row than there are cells: the scratch row that padded tokens of a short
ubatch write to. Per ubatch the host fills `tokens`, `pos`, `kv_idx`, `kq_mask` and `out_ids`
(padded to the bucket) and computes; a greedy step reads only `next` (4 bytes per output row),
so under the `staged` policy a generated token costs one host wait. With launch-ahead
(`staged`, a backend with stream-ordered copies and reads) `generate` queues step t+1 before it
reads token t: the decode plan's `tokens` input is fed on the device from the step before's
`next`, and the read of token t is waited for on its own, so the device runs step after step
while the host reads and checks tokens.

Invariants: every public method validates its arguments before it changes any state; every
step is a transaction on the cells (`KvCells.begin` .. `commit` / `rollback`), so a step that
fails anywhere — a bad input, a backend error, Ctrl-C between any two lines — leaves the cells
as they were before it; after Ctrl-C (which cancels queued work) the cells of steps never
waited for are freed too, since their rows may not have been written; and what an interrupt
outside any handler leaves (an open step, an armed feed) is repaired on entry to the next call
(invariant 14). Calls are serialised by a lock, so threads may share a session. Shapes never
depend on state, so steps after `seq_cp` and ubatches without outputs run the same plans
(invariants 11, 12).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt

from lowsync._native import Context, LowsyncError, Plan, env_flag, stat_names
from lowsync.kv_cells import ContextFullError, KvCells, SessionError, Step
from lowsync.models.llama import OUTPUT_LOGITS, OUTPUT_NEXT, Llama

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
            self._recover()
            return method(self, *args, **kwargs)

    return locked


@dataclass(frozen=True)
class GenerateStats:
    """Timing and counters of one `Session.generate` call.

    The prompt phase (`prefill_s`, `prefill`) decodes the prompt and reads the first generated
    token; the decode phase is the `n_steps` one-token steps after it, and `per_token` holds its
    counter deltas divided by `n_steps` (the "per generated token" figures of the bench). Both
    hold every counter of `TOKEN_COUNTERS`.
    """

    n_prompt: int
    n_gen: int
    n_steps: int
    prefill_s: float
    decode_s: float
    prefill: dict[str, int]
    per_token: dict[str, float]

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


class _Bucket:
    """One compiled graph of fixed token count, with the host buffers of its inputs."""

    def __init__(self, plan: Plan, n_tokens: int, n_rows: int) -> None:
        self.plan = plan
        self.n_tokens = n_tokens
        self.tokens = np.zeros(n_tokens, np.int32)
        self.pos = np.zeros(n_tokens, np.int32)
        self.kv_idx = np.zeros(n_tokens, np.int32)
        self.kq_mask = np.full((n_tokens, n_rows), -np.inf, np.float32)
        self.out_ids = np.zeros(n_tokens, np.int32)
        plan.set_input("out_ids", self.out_ids)


class Session:
    """A model on a context, with a unified KV cache of `n_ctx` cells shared by `n_seq` sequences.

    `backends` goes to `lowsync.Context` as given; `policy` is "stock", "relaxed", "staged" or
    None (`LOWSYNC_SYNC_POLICY`, default staged). A prompt is split into ubatches of at most
    `n_ubatch` tokens. `kv_dtype` is the cache's dtype. One graph is compiled per size in
    `buckets` plus one of `n_ubatch` tokens, all at creation; a ubatch runs on the smallest that
    holds it, padded. The default `(1,)` gives single-token steps their own graph; `()` runs
    everything through the `n_ubatch` graph; e.g. `(1, 2, 4)` suits 4 parallel sequences.

    A call that raises — bad input, a backend error, KeyboardInterrupt — leaves the cache as it
    was before the call, and the session stays usable. One exception to "as it was": when a
    call is interrupted (Ctrl-C), cells of earlier calls whose device work was never waited
    for (a `decode(..., logits="none")` not followed by any read) are freed too, since the
    backends cancel queued work on Ctrl-C and those KV rows may never have been written;
    `seq_pos_max` shows what each sequence still holds.

    Threads may share a session: its calls are serialised by a lock (a second thread's call
    waits until the first returns), so each call sees and leaves a consistent cache.

    Example::

        sess = Session(Llama.random("tiny", seed=0), backends=["cpu-async"], n_ctx=256)
        logits = sess.decode([1, 5, 300, 7], seq_id=0, logits="all")  # [4, n_vocab]
        ids = sess.generate([1, 5, 300], max_new_tokens=8, seq_id=1)  # greedy, on the device
        sess.seq_cp(1, 2)  # seq 2 shares seq 1's cells; no data is copied
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
    ) -> None:
        if not isinstance(model, Llama):
            raise SessionError(
                f"Session: model must be a lowsync Llama (Llama.random or load_gguf), "
                f"got {type(model).__name__}"
            )
        for what, v in (("n_ctx", n_ctx), ("n_seq", n_seq), ("n_ubatch", n_ubatch)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SessionError(f"Session: {what} must be a positive integer, got {v!r}")
        bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if bad or any(b > n_ubatch for b in buckets):
            raise SessionError(
                f"Session: buckets must be positive ints of at most n_ubatch ({n_ubatch}), "
                f"got {list(buckets)}"
            )
        launch_ahead = _launch_ahead_setting(launch_ahead)
        if kv_dtype not in ("f32", "f16", "bf16"):
            raise SessionError(f"Session: kv_dtype must be f32, f16 or bf16, got {kv_dtype!r}")
        if isinstance(backends, str):
            backends = [backends]
        self.model = model
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.n_ubatch = n_ubatch
        self.n_vocab = model.config.n_vocab
        self._lock = threading.RLock()
        self._cells = KvCells(n_ctx, n_seq)
        self.context = Context(list(backends), policy=policy)
        n_rows = self._cells.n_rows
        # Largest bucket first: its compile is the worst-case reserve, and every smaller graph
        # (same nodes, smaller tensors) then fits it without reallocating (invariant 11).
        sizes = sorted({*buckets, n_ubatch}, reverse=True)
        compiled: list[_Bucket] = []
        # Quantized weights the backends cannot read are widened here, once for every bucket.
        graph_model = model.prepared_for(self.context)
        for size in sizes:
            graph = graph_model.build_graph(size, n_rows, size, kv_dtype=kv_dtype)
            compiled.append(_Bucket(self.context.compile(graph), size, n_rows))
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
        on); it needs the `staged` policy and a backend with stream-ordered copies and reads."""
        return self._launch_ahead

    @property
    def n_free(self) -> int:
        """KV cells not used by any sequence."""
        with self._lock:
            self._recover()
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
    ) -> list[int]:
        """Greedy generation on the device: decodes `prompt` into `seq_id`, then feeds each
        generated token back, one step per token; returns the generated tokens.

        Each step reads only the sampled token (one host wait under `staged`). With
        `launch_ahead`, step t+1 is queued before token t is read, its token copied on the
        device from step t's output, so the device never waits for the host; when token t is a
        stop token, step t+1 ran for nothing and its cell is given back. Generation ends
        after `max_new_tokens` tokens or at a token in `stop`. The cache must have room for the
        prompt and every generated token but the last, checked before anything runs. Timing and
        counters of the call are kept in `last_generate`. If a step fails, the steps whose
        token was read keep their cells (`seq_pos_max` shows how far it got) and the failed
        step gives its cell back.
        """
        toks = self._check_tokens(prompt)
        self._check_seq(seq_id)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise SessionError(f"generate: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise SessionError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(toks) == 0:
            raise SessionError("generate: the prompt is empty")
        need = len(toks) + max_new_tokens - 1
        if need > self._cells.n_free:
            raise ContextFullError(
                f"generate: needs {need} free KV cells ({len(toks)} prompt tokens + "
                f"{max_new_tokens - 1} fed back), the cache has {self._cells.n_free} of "
                f"{self.n_ctx}"
            )
        stops = {int(t) for t in stop}

        before = self.context.stats()["total"]
        t0 = time.perf_counter()
        flags = [False] * len(toks)
        flags[-1] = True
        first = self._run(toks, [seq_id] * len(toks), flags, want="next")
        assert first is not None
        token = int(first[-1][0])
        out = [token]
        t1 = time.perf_counter()
        mid = self.context.stats()["total"]
        decode = self._buckets[0]
        if self._launch_ahead:
            steps = self._generate_ahead(decode, token, seq_id, max_new_tokens, stops, out)
        else:
            steps = self._generate_plain(decode, token, seq_id, max_new_tokens, stops, out)
        t2 = time.perf_counter()
        after = self.context.stats()["total"]
        self.last_generate = GenerateStats(
            n_prompt=len(toks),
            n_gen=len(out),
            n_steps=steps,
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            prefill={c: mid[c] - before[c] for c in TOKEN_COUNTERS},
            per_token={c: (after[c] - mid[c]) / max(steps, 1) for c in TOKEN_COUNTERS},
        )
        return out

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
    ) -> list[npt.NDArray[Any]] | None:
        """Runs the tokens in ubatches, as one step of the cells; returns the wanted output rows
        of each ubatch that has any (None when no token wants an output)."""
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
            for start in range(0, len(tokens), self.n_ubatch):
                stop = min(start + self.n_ubatch, len(tokens))
                sub_seqs = seqs[start:stop]
                rows = [i for i, f in enumerate(flags[start:stop]) if f]
                bucket = self._bucket_for(stop - start)
                cells, positions = self._cells.take(sub_seqs, step)
                self._fill(bucket, tokens[start:stop], sub_seqs, rows, cells, positions)
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

    def _fill(
        self,
        bucket: _Bucket,
        tokens: list[int],
        seqs: list[int],
        rows: list[int],
        cells: list[int],
        positions: list[int],
    ) -> None:
        """Writes the bucket's inputs for one ubatch (padded to its size) into its plan."""
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

    def _queue_one(
        self, bucket: _Bucket, token: int, seq_id: int, step: Step, feed: bool = False
    ) -> None:
        """Queues one decode step of `generate` in `step`: one token of one sequence, no read.
        With `feed` the token comes from the previous step's `next`, on the device."""
        cells, positions = self._cells.take([seq_id], step)
        self._fill(bucket, [token], [seq_id], [0], cells, positions)
        if not feed:
            bucket.plan.compute()
            return
        # Armed last, right before the compute that takes it: a failure in the writes above
        # arms nothing. Until that compute has returned the feed may still be armed (a compute
        # that raised may not have got to take it): `_recover` then lets a harmless step take
        # it before the next real one.
        self._feed_armed = True
        bucket.plan.feed("tokens", OUTPUT_NEXT)
        bucket.plan.compute()
        self._feed_armed = False

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

    def _generate_plain(
        self,
        decode: _Bucket,
        token: int,
        seq_id: int,
        max_new_tokens: int,
        stops: set[int],
        out: list[int],
    ) -> int:
        """The decode steps of `generate` without launch-ahead: queue, read, repeat. Appends
        to `out`; returns the number of steps."""
        steps = 0
        while len(out) < max_new_tokens and token not in stops:
            self._check_device_token(token)
            step = self._cells.begin()
            try:
                self._queue_one(decode, token, seq_id, step)
                token = int(decode.plan.get_output(OUTPUT_NEXT)[0])  # the step's one wait
            except BaseException as e:
                self._abort(e, step)
                raise
            self._cells.commit(step, confirmed=True)
            out.append(token)
            steps += 1
        return steps

    def _generate_ahead(
        self,
        decode: _Bucket,
        token: int,
        seq_id: int,
        max_new_tokens: int,
        stops: set[int],
        out: list[int],
    ) -> int:
        """The decode steps of `generate` with launch-ahead; appends to `out`, returns the
        number of steps whose token was read.

        Step k takes token k-1; step 1's comes from the host (the prompt's output), every later
        one is fed on the device from the step before. Step k+1 is queued before token k is
        read, so each iteration's one host wait finds the next step already queued. A step is
        committed when its token is read; on a failure the open steps (the one whose read
        failed and the one queued ahead of it) are rolled back.
        """
        if len(out) >= max_new_tokens or token in stops:
            return 0
        self._check_device_token(token)
        plan = decode.plan
        current = self._cells.begin()
        try:
            self._queue_one(decode, token, seq_id, current)
            pending = plan.read_async(OUTPUT_NEXT)
        except BaseException as e:
            self._abort(e, current)
            raise
        steps = 0
        while True:
            # `pending` holds token len(out); one more step is needed after it only if the
            # output is not full once it is read.
            ahead: Step | None = None
            try:
                if len(out) + 1 < max_new_tokens:
                    ahead = self._cells.begin()
                    # The host's token is a placeholder: the feed overwrites it on the device.
                    self._queue_one(decode, 0, seq_id, ahead, feed=True)
                token = int(pending.wait()[0])  # the one wait of the step
                self._check_device_token(token)
                follow = plan.read_async(OUTPUT_NEXT) if ahead is not None else None
            except BaseException as e:
                self._abort(e, *(s for s in (ahead, current) if s is not None))
                raise
            self._cells.commit(current, confirmed=True)
            out.append(token)
            steps += 1
            if ahead is None:
                return steps
            if token in stops:
                # The step queued ahead took a stop token: give back its cell (its KV row is
                # masked from now on, and whoever takes the cell next overwrites it).
                self._cells.rollback(ahead)
                return steps
            assert follow is not None
            pending, current = follow, ahead
