"""A `Session` never corrupts its cache: a failure or Ctrl-C anywhere in a step — while writing
an input, in compute, in a read, between any two lines of Python — leaves the cells as they were
(no cell held for a step that did not run, no position given twice), the next decode gives
exactly the logits of a session that never saw the failure, and threads may share a session.

Failures are injected by wrapping the session's plans (`_Flaky`) so that the k-th call of one
method raises, for every k the call reaches; interrupts between lines by a trace function."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import numpy as np
import pytest

import lowsync as ls
from lowsync.models.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
PROMPT = [12, 7, 250, 3, 3, 99, 41, 0, 18, 77, 5, 6, 140, 29, 8, 201]
ERRORS = [ls.BackendError("device lost"), KeyboardInterrupt()]


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama.random(CONFIG, seed=3)


def _session(model: Llama, **kw: Any) -> ls.Session:
    args: dict[str, Any] = {"backends": ["cpu-async"], "n_ctx": 32, "n_seq": 2, "n_ubatch": 4}
    args.update(kw)
    return ls.Session(model, **args)


def _state(sess: ls.Session) -> tuple[int, list[int], list[list[int]]]:
    n_free = sess.n_free  # a public call: repairs what an interrupt outside a handler left
    sess._cells.check()  # no open step, free stack and masks consistent with the cells
    return (
        n_free,
        [sess.seq_pos_max(s) for s in range(sess.n_seq)],
        [sess.seq_cells(s) for s in range(sess.n_seq)],
    )


class _Flaky:
    """A plan whose calls of `method` are counted across every plan of a session (`counts`);
    the `fail_at`-th raises `error` (before calling the real plan)."""

    def __init__(self, plan: Any, counts: dict[str, int], method: str, fail_at: int, error: Any):
        self._plan, self._counts = plan, counts
        self._method, self._fail_at, self._error = method, fail_at, error
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._plan, name)
        if name != self._method:
            return real

        def call(*args: Any) -> Any:
            self._counts[name] = self._counts.get(name, 0) + 1
            if self._counts[name] == self._fail_at:
                self._counts["fired"] = 1
                raise self._error
            return real(*args)

        return call


@contextmanager
def _failing(sess: ls.Session, method: str, fail_at: int, error: Any) -> Iterator[dict[str, int]]:
    """Every plan of `sess` fails at the `fail_at`-th call of `method` (counted over all)."""
    counts: dict[str, int] = {}
    real = [b.plan for b in sess._buckets]
    for b in sess._buckets:
        b.plan = _Flaky(b.plan, counts, method, fail_at, error)  # type: ignore[assignment]
    try:
        yield counts
    finally:
        for b, p in zip(sess._buckets, real, strict=True):
            b.plan = p


@pytest.mark.parametrize("error", ERRORS, ids=["backend-error", "ctrl-c"])
@pytest.mark.parametrize("method", ["set_input", "compute", "get_output"])
def test_a_failed_decode_holds_no_cell_and_the_next_gives_fresh_logits(
    model: Llama, method: str, error: BaseException, clean_env: pytest.MonkeyPatch
) -> None:
    """A decode of 6 tokens (ubatches of 4 and 2) failing at each call of `method` it makes:
    the cache is as before, and the same decode then gives the logits of a twin session that
    never failed, bit for bit."""
    sess, twin = _session(model), _session(model)
    for s in (sess, twin):
        s.decode(PROMPT[:5], logits="last")
    before = _state(sess)
    want = twin.decode(PROMPT[5:11], logits="all")
    k = 0
    while True:
        k += 1
        with _failing(sess, method, k, error) as counts:
            try:
                sess.decode(PROMPT[5:11], logits="all")
            except type(error):
                pass
        if not counts.get("fired"):
            break
        assert _state(sess) == before, (method, k)
        got = sess.decode(PROMPT[5:11], logits="all")
        assert np.array_equal(got, want), (method, k)
        sess.seq_rm(0, 5)
        assert _state(sess) == before
    assert k > 1  # the failure fired at least once


# The plain loop never feeds; under `staged` it queues each step with its read.
GENERATE_CALLS = [
    *((m, False) for m in ("set_input", "compute", "get_output", "compute_read_async")),
    *((m, True) for m in ("set_input", "compute", "get_output", "compute_read_async", "feed")),
]


@pytest.mark.parametrize("error", ERRORS, ids=["backend-error", "ctrl-c"])
@pytest.mark.parametrize(
    ("method", "ahead"),
    GENERATE_CALLS,
    ids=[f"{m}-{'ahead' if a else 'plain'}" for m, a in GENERATE_CALLS],
)
def test_a_failed_generate_keeps_only_steps_that_were_read(
    model: Llama, method: str, ahead: bool, error: BaseException, clean_env: pytest.MonkeyPatch
) -> None:
    """`generate` failing at each call of `method`: the steps whose token was read keep their
    cells and nothing else does (no stale cell, no armed feed left behind), and a decode after
    it gives exactly what a twin that generated as far without failing gives."""
    sess = _session(model, launch_ahead=ahead)
    assert sess.launch_ahead == ahead
    twin = _session(model, launch_ahead=False)
    k = 0
    while True:
        k += 1
        sess.clear()
        with _failing(sess, method, k, error) as counts:
            try:
                sess.generate(PROMPT[:4], max_new_tokens=6, seq_id=1)
            except type(error):
                pass
        if not counts.get("fired"):
            break
        state = _state(sess)
        kept = sess.seq_pos_max(1) + 1
        assert state[0] == 32 - kept
        twin.clear()
        if kept:
            # The twin holds what `sess` kept, computed the same way: the prompt and the steps
            # that were read (generating m tokens decodes m - 1 of them).
            twin.generate(PROMPT[:4], max_new_tokens=kept - 3, seq_id=1)
        assert _state(twin) == state, (method, k)
        got = sess.decode([7, 9], seq_id=1, logits="all")
        assert np.array_equal(got, twin.decode([7, 9], seq_id=1, logits="all")), (method, k)
        one = sess.decode([5], seq_id=1, logits="last")  # the 1-token plan: no feed armed
        assert np.array_equal(one, twin.decode([5], seq_id=1, logits="last")), (method, k)
    assert k > 1


def test_ctrl_c_frees_cells_of_steps_never_waited_for(
    model: Llama, clean_env: pytest.MonkeyPatch
) -> None:
    """Ctrl-C cancels queued work: a `logits="none"` decode that nothing waited for may never
    have written its KV rows, so an interrupt in the next call frees its cells too; a backend
    error does not cancel queued work and leaves them."""
    sess, twin = _session(model), _session(model)
    want = twin.decode(PROMPT[:6], logits="all")
    sess.decode(PROMPT[:6], logits="none")
    lost = ls.BackendError("device lost")
    with _failing(sess, "get_output", 1, lost), pytest.raises(ls.BackendError):
        sess.decode(PROMPT[6:8], logits="last")
    assert sess.seq_pos_max(0) == 5  # kept: its work still runs
    with _failing(sess, "get_output", 1, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        sess.decode(PROMPT[6:8], logits="last")
    assert _state(sess) == (32, [-1, -1], [[], []])
    assert np.array_equal(sess.decode(PROMPT[:6], logits="all"), want)
    # Once a read completed, the earlier steps are known to have run: nothing is freed.
    sess.decode(PROMPT[6:8], logits="none")
    sess.decode(PROMPT[8:9], seq_id=1, logits="last")
    with _failing(sess, "get_output", 1, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        sess.decode(PROMPT[9:10], logits="last")
    assert (sess.seq_pos_max(0), sess.seq_pos_max(1)) == (7, 0)


class _InterruptAtLine:
    """Raises KeyboardInterrupt at the `n`-th line event in lowsync's session and kv_cells."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.fired = n, 0, False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if name.endswith(("lowsync/session.py", "lowsync/kv_cells.py")):
            if event == "line":
                self.seen += 1
                if self.seen == self.n:
                    self.fired = True
                    raise KeyboardInterrupt
            return self
        return None


def _gen(m: int) -> Callable[[ls.Session], Any]:
    return lambda s: s.generate(PROMPT[5:8], m, seq_id=1)


# Each call, and the calls whose end states are also acceptable after an interrupt: `generate`
# keeps the steps whose token was read, so it may stop after the prompt or after any step.
CALLS: dict[str, tuple[Callable[[ls.Session], Any], list[Callable[[ls.Session], Any]]]] = {
    "decode": (lambda s: s.decode(PROMPT[5:11], logits="all"), []),
    "step": (lambda s: s.step({0: 17, 1: 4}), []),
    "generate": (_gen(3), [_gen(1), _gen(2)]),
    "seq_cp": (lambda s: s.seq_cp(0, 1), []),
    "seq_rm": (lambda s: s.seq_rm(0, 2), []),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_ctrl_c_between_any_two_lines_leaves_a_consistent_cache(
    model: Llama, name: str, clean_env: pytest.MonkeyPatch
) -> None:
    """Ctrl-C at every line the call runs (in session.py and kv_cells.py, launch-ahead on):
    afterwards the cache is as before the call, or — when it landed after the call's work was
    done — as after it, and a decode then gives exactly the logits of a session in that same
    state (so no feed is left armed either)."""
    call, partial = CALLS[name]

    def base() -> ls.Session:
        sess = _session(model, launch_ahead=True)
        sess.decode(PROMPT[:5], logits="last")
        return sess

    outcomes: list[tuple[Any, Any]] = []  # (state, the probe's logits) of each acceptable end
    for run in [None, *partial, call]:
        twin = base()
        if run is not None:
            run(twin)
        outcomes.append((_state(twin), twin.decode([33], seq_id=0, logits="last")))
    sess = base()
    n = 0
    while True:
        n += 1
        trace = _InterruptAtLine(n)
        sys.settrace(trace)
        try:
            call(sess)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        state = _state(sess)
        probes = [p for st, p in outcomes if st == state]
        assert probes, (n, state)
        assert np.array_equal(sess.decode([33], seq_id=0, logits="last"), probes[0]), n
        if not trace.fired:
            break
        sess.clear()
        sess.decode(PROMPT[:5], logits="last")
    assert n > 5


def test_threads_sharing_a_session_are_serialised(model: Llama) -> None:
    """Two threads generate on their own sequences of one session at the same time: no
    "Already borrowed", each gets the tokens it gets alone, and the cache is consistent."""
    sess = _session(model, n_ctx=128, n_seq=2)
    alone = [_session(model, n_ctx=128).generate(PROMPT[i : i + 4], 6) for i in (0, 4)]
    results: dict[int, list[list[int]]] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(seq: int) -> None:
        try:
            start.wait()
            for _ in range(4):
                results[seq].append(sess.generate(PROMPT[seq * 4 : seq * 4 + 4], 6, seq_id=seq))
                sess.seq_rm(seq)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    assert errors == []
    assert results == {0: [alone[0]] * 4, 1: [alone[1]] * 4}
    assert _state(sess) == (128, [-1, -1], [[], []])
