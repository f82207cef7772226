"""`Session`: KV cells and sequences, ubatches, greedy generation on the device, streaming with
`generate_iter`, the counts each policy gives per generated token, the no-realloc invariant
(S2) and bad input.

Counts per generated token on `cpu-async`, one backend, the decode graph's U = 5 user inputs
(tokens, pos, kv_idx, kq_mask, out_ids), reading only `next`:
- staged: 1 host wait (the read), 1 H2D copy (the packed input arena), 1 D2H copy;
- relaxed: 2 host waits (the sync before the graph, the read), U H2D copies;
- stock: U + 1 host waits (a blocking write per input, the read), U H2D copies.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import lowsync as ls
from helpers import assert_step_counts
from llama_ref import Spec, forward, rel_err
from lowsync.models.llama import Llama, LlamaConfig
from lowsync.session import ContextFullError, SessionError

CONFIG = LlamaConfig(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
PROMPT = [12, 7, 250, 3, 3, 99, 41, 0, 18, 77, 5, 6, 140, 29, 8, 201, 64, 2, 9, 33]


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama.random(CONFIG, seed=1)


def _ref(model: Llama, tokens: list[int]) -> np.ndarray:
    c = model.config
    spec = Spec(
        n_vocab=c.n_vocab,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_head_kv=c.n_head_kv,
        n_ff=c.n_ff,
        head_dim=c.head_dim,
        rope_dims=c.rope_dims,
        theta=c.rope_theta,
        eps=c.rms_eps,
    )
    return forward(spec, {k: np.asarray(v, np.float64) for k, v in model.weights.items()}, tokens)


def _greedy_matches(ref: np.ndarray, tokens: list[int], start: int) -> None:
    """tokens[i + 1] is the argmax of reference row i for every generated position whose top
    two logits are not a near-tie."""
    scale = float(np.max(np.abs(ref)))
    for i in range(start, len(tokens) - 1):
        top2 = np.sort(ref[i])[-2:]
        if top2[1] - top2[0] > 1e-3 * scale:
            assert tokens[i + 1] == int(np.argmax(ref[i])), i


def _reallocs(sess: ls.Session) -> int:
    return sess.stats()["total"]["reallocs"]


# ---- decoding -------------------------------------------------------------------------------


def test_decode_logits_modes(model: Llama) -> None:
    sess = ls.Session(model, backends=["cpu"], n_ctx=64, n_seq=4, n_ubatch=8)
    ref = _ref(model, PROMPT)
    last = sess.decode(PROMPT[:10], seq_id=0, logits="last")
    assert last is not None
    assert last.shape == (300,)
    assert sess.decode(PROMPT[:10], seq_id=1, logits="none") is None
    every = sess.decode(PROMPT[:10], seq_id=2, logits="all")
    assert every is not None
    assert every.shape == (10, 300)
    some = sess.decode(PROMPT[:10], seq_id=3, logits=[i % 4 == 3 for i in range(10)])
    assert some is not None
    assert some.shape == (2, 300)
    assert rel_err(last, ref[9]) <= 1e-4
    assert rel_err(every, ref[:10]) <= 1e-4
    assert rel_err(some, ref[[3, 7]]) <= 1e-4
    assert [sess.seq_pos_max(s) for s in range(4)] == [9, 9, 9, 9]
    assert sess.n_free == 64 - 40


def test_generate_is_greedy_and_stops(model: Llama) -> None:
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=8)
    out = sess.generate(PROMPT[:9], max_new_tokens=12)
    assert len(out) == 12
    _greedy_matches(_ref(model, PROMPT[:9] + out), PROMPT[:9] + out, start=8)
    st = sess.last_generate
    assert st is not None
    assert (st.n_prompt, st.n_gen, st.n_steps) == (9, 12, 11)
    assert st.pp_tps > 0
    assert st.tg_tps > 0
    # Without a 1-token graph every step runs padded through the ubatch graph: same tokens.
    single = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=8, buckets=())
    assert len(single.plans) == 1
    assert single.generate(PROMPT[:9], max_new_tokens=12) == out
    sess.clear()
    stopped = sess.generate(PROMPT[:9], max_new_tokens=12, stop=[out[3]])
    assert stopped == out[: out.index(out[3]) + 1]
    assert sess.seq_pos_max(0) == 9 + len(stopped) - 2  # the last token is not decoded


def test_step_runs_parallel_sequences(model: Llama) -> None:
    sess = ls.Session(model, backends=["cpu"], n_ctx=64, n_seq=3, n_ubatch=8, buckets=(1, 2))
    a, b, c = PROMPT[:6], PROMPT[6:11], PROMPT[11:14]
    sess.decode(a, seq_id=0, logits="none")
    sess.decode(b, seq_id=1, logits="none")
    sess.decode(c, seq_id=2, logits="none")
    nxt = sess.step({0: 1, 1: 2, 2: 3})  # three tokens: the 8-token graph, padded
    for s, toks in ((0, [*a, 1]), (1, [*b, 2]), (2, [*c, 3])):
        assert nxt[s] == int(np.argmax(_ref(model, toks)[-1]))
    nxt2 = sess.step({2: 4, 0: 5})  # two tokens: the 2-token bucket
    assert nxt2[0] == int(np.argmax(_ref(model, [*a, 1, 5])[-1]))
    assert nxt2[2] == int(np.argmax(_ref(model, [*c, 3, 4])[-1]))


# ---- counts per generated token ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["stock", "relaxed", "staged"])
def test_counts_per_generated_token_on_cpu_async_tiny(
    clean_env: pytest.MonkeyPatch, policy: str
) -> None:
    tiny = Llama.random("tiny", seed=0)
    sess = ls.Session(tiny, backends=["cpu-async"], n_ctx=64, policy=policy)
    assert len(sess.plans[0].inputs) == 5
    u = 4  # the one-token graph declares `out_ids` but does not read it: never uploaded
    sess.generate(PROMPT[:8], max_new_tokens=2)  # warm-up
    sess.clear()
    sess.generate(PROMPT[:8], max_new_tokens=9)
    st = sess.last_generate
    assert st is not None
    assert st.n_steps == 8
    assert sess.launch_ahead == (policy == "staged")
    if policy == "staged":
        assert_step_counts(st, launch_ahead=True)
        return
    want = {"relaxed": (2, u), "stock": (u + 1, u)}[policy]
    # Every step on its own, not an average: waits, uploads, one read of `next` only.
    got = {(d["host_waits"], d["h2d_copies"], d["d2h_copies"], d["reallocs"]) for d in st.steps}
    assert got == {(*want, 1, 0)}, st.steps
    assert st.per_token["empty_submits"] == 0.0


# ---- launch-ahead ----------------------------------------------------------------------------


def _cache_state(sess: ls.Session) -> tuple[int, list[int], list[list[int]]]:
    return (
        sess.n_free,
        [sess.seq_pos_max(s) for s in range(sess.n_seq)],
        [sess.seq_cells(s) for s in range(sess.n_seq)],
    )


@pytest.mark.parametrize(
    "backend",
    ["cpu-async", "cpu-async+cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)],
)
def test_launch_ahead_gives_the_same_tokens_cache_and_next_logits(
    model: Llama, backend: str, clean_env: pytest.MonkeyPatch
) -> None:
    """Step t+1 queued before token t is read, its token fed on the device: the same tokens,
    the same cache (a stop token's speculative step gives its cell back), the same logits of a
    decode after it, and per token one wait, one upload, one 4-byte read and one device copy."""
    backends = backend.split("+")
    ahead = ls.Session(model, backends=backends, n_ctx=64, n_ubatch=8, launch_ahead=True)
    plain = ls.Session(model, backends=backends, n_ctx=64, n_ubatch=8, launch_ahead=False)
    assert ahead.launch_ahead
    assert not plain.launch_ahead
    full = plain.generate(PROMPT[:6], max_new_tokens=10)
    plain.clear()
    stop_at = [[], [full[0]], [full[1]], [full[4]], [full[9]]]
    for n in (1, 2, 3, 10):
        for stop in stop_at:
            got = ahead.generate(PROMPT[:6], max_new_tokens=n, seq_id=1, stop=stop)
            want = plain.generate(PROMPT[:6], max_new_tokens=n, seq_id=1, stop=stop)
            assert got == want, (n, stop)
            assert _cache_state(ahead) == _cache_state(plain), (n, stop)
            after_a = ahead.decode([5, 9], seq_id=1, logits="all")
            after_p = plain.decode([5, 9], seq_id=1, logits="all")
            assert np.array_equal(after_a, after_p), (n, stop)
            ahead.clear()
            plain.clear()
    ahead.generate(PROMPT[:6], max_new_tokens=10)
    st = ahead.last_generate
    assert st is not None
    assert st.n_steps == 9
    assert_step_counts(st, launch_ahead=True)


def test_launch_ahead_needs_staged_and_an_async_backend(
    model: Llama, clean_env: pytest.MonkeyPatch
) -> None:
    assert not ls.Session(model, backends=["cpu"], n_ctx=16, n_ubatch=4).launch_ahead
    stock = ls.Session(model, backends=["cpu-async"], n_ctx=16, n_ubatch=4, policy="stock")
    assert not stock.launch_ahead
    assert ls.Session(model, backends=["cpu-async"], n_ctx=16, n_ubatch=4).launch_ahead
    clean_env.setenv("LOWSYNC_LAUNCH_AHEAD", "0")
    assert not ls.Session(model, backends=["cpu-async"], n_ctx=16, n_ubatch=4).launch_ahead
    clean_env.setenv("LOWSYNC_LAUNCH_AHEAD", "yes")
    with pytest.raises(ls.EnvError, match="LOWSYNC_LAUNCH_AHEAD"):
        ls.Session(model, backends=["cpu-async"], n_ctx=16, n_ubatch=4)
    with pytest.raises(SessionError, match="launch_ahead must be a bool"):
        ls.Session(model, n_ctx=16, n_ubatch=4, launch_ahead=1)  # type: ignore[arg-type]


class _FailingRead:
    """A pending read whose wait raises."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self) -> Any:
        raise self.error


class _PlanFailingReads:
    """A plan whose `fail_at`-th read of `next` (`read_async`, the read of
    `compute_read_async`, or `get_output`) fails."""

    def __init__(self, plan: ls.Plan, fail_at: int, error: BaseException) -> None:
        self.plan, self.fail_at, self.error, self.reads = plan, fail_at, error, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plan, name)

    def _fails(self) -> bool:
        self.reads += 1
        return self.reads == self.fail_at

    def read_async(self, name: str) -> Any:
        return _FailingRead(self.error) if self._fails() else self.plan.read_async(name)

    def compute_read_async(self, name: str) -> Any:
        if self._fails():
            self.plan.compute()  # the step is queued; its read is what fails
            return _FailingRead(self.error)
        return self.plan.compute_read_async(name)

    def get_output(self, name: str) -> Any:
        if self._fails():
            raise self.error
        return self.plan.get_output(name)


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("error", [ls.BackendError("device lost"), KeyboardInterrupt()])
def test_a_failed_read_gives_back_the_cells_of_unread_steps(
    model: Llama, error: BaseException, ahead: bool, clean_env: pytest.MonkeyPatch
) -> None:
    """Only steps the device is known to have finished (their token was read) keep their
    cells: the step whose read failed gives its cell back, and so does the one queued ahead of
    it (Ctrl-C cancels queued work, so neither KV row may have been written)."""
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=32, n_ubatch=4, launch_ahead=ahead)
    assert sess.launch_ahead == ahead
    sess.decode(PROMPT[:5], logits="none")  # 5 cells
    bucket = sess._buckets[0]
    real = bucket.plan
    bucket.plan = _PlanFailingReads(real, 3, error)  # type: ignore[assignment]
    with pytest.raises(type(error)):
        sess.generate(PROMPT[5:9], max_new_tokens=8, seq_id=1)
    # Prompt (4 tokens, one ubatch of 4: no read of the decode plan), steps 1 and 2 read and
    # kept; step 3's read failed (and step 4, queued ahead, never was read).
    assert sess.n_free == 32 - 5 - 4 - 2
    assert sess.seq_pos_max(1) == 5
    bucket.plan = real
    sess.seq_rm(1)
    again = sess.generate(PROMPT[5:9], max_new_tokens=8, seq_id=1)
    plain = ls.Session(model, backends=["cpu-async"], n_ctx=32, n_ubatch=4, launch_ahead=False)
    assert again == plain.generate(PROMPT[5:9], max_new_tokens=8)


# ---- generate_iter ----------------------------------------------------------------------------


def _full_state(sess: ls.Session) -> tuple[Any, ...]:
    return (*_cache_state(sess), [sess.seq_tokens(s) for s in range(sess.n_seq)])


class _Stop(Exception):
    """The consumer's own error."""


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("how", ["break", "close", "error", "ctrl-c"])
def test_a_generate_iter_left_early_leaves_what_a_shorter_generate_leaves(
    model: Llama, how: str, ahead: bool, clean_env: pytest.MonkeyPatch
) -> None:
    """The consumer stops after k tokens (break, close(), its own exception, Ctrl-C): the
    cache is exactly what `generate(..., max_new_tokens=k)` leaves (the step queued ahead is
    rolled back), `last_generate` covers the k tokens, and the session goes on as a twin that
    generated k tokens does."""
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=8, launch_ahead=ahead)
    twin = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=8, launch_ahead=False)
    full = twin.generate(PROMPT[:6], max_new_tokens=10, seq_id=1)
    assert sess.generate(PROMPT[:6], max_new_tokens=10, seq_id=1) == full
    for k in (1, 2, 5, 10):
        for s in (sess, twin):
            s.clear()
            s.decode(PROMPT[10:13], seq_id=0, logits="none")  # another sequence, untouched
        got: list[int] = []
        try:
            if how == "close":
                it = sess.generate_iter(PROMPT[:6], 10, seq_id=1)
                got = [next(it) for _ in range(k)]
                it.close()
                del it
            else:
                for tok in sess.generate_iter(PROMPT[:6], 10, seq_id=1):
                    got.append(tok)
                    if len(got) == k:
                        if how == "break":
                            break
                        raise _Stop if how == "error" else KeyboardInterrupt
        except (_Stop, KeyboardInterrupt):
            pass
        assert got == full[:k]
        st = sess.last_generate
        assert st is not None
        assert (st.n_gen, st.n_steps, len(st.steps)) == (k, k - 1, k - 1)
        assert twin.generate(PROMPT[:6], max_new_tokens=k, seq_id=1) == got
        assert _full_state(sess) == _full_state(twin), (how, k)
        sess._cells.check()
        assert sess.seq_tokens(1) == PROMPT[:6] + got[:-1]
        after = sess.generate([got[-1], 4, 5], max_new_tokens=6, seq_id=1)
        assert after == twin.generate([got[-1], 4, 5], max_new_tokens=6, seq_id=1)
        assert np.array_equal(
            sess.decode([9], seq_id=1, logits="last"), twin.decode([9], seq_id=1, logits="last")
        )


def test_generate_iter_streams_what_generate_returns(
    model: Llama, clean_env: pytest.MonkeyPatch
) -> None:
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=8)
    want = sess.generate(PROMPT[:6], max_new_tokens=10, stop=[7])
    sess.clear()
    it = sess.generate_iter(PROMPT[:6], max_new_tokens=10, stop=[7])
    assert sess.n_free == 64  # nothing runs before the first next()
    assert list(it) == want
    st = sess.last_generate
    assert st is not None
    assert st.n_gen == len(want)
    # Arguments are checked at the call, not at the first next().
    with pytest.raises(SessionError, match="max_new_tokens must be >= 1"):
        sess.generate_iter(PROMPT[:6], max_new_tokens=0)
    with pytest.raises(ContextFullError, match="needs 73 free KV cells"):
        sess.generate_iter(PROMPT[:4], max_new_tokens=70)


def test_a_suspended_generate_iter_holds_the_session(
    model: Llama, clean_env: pytest.MonkeyPatch
) -> None:
    """While a generate_iter is suspended, a call from its own thread is a SessionError (it
    would roll back the step queued ahead) and another thread's call waits; once the iterator
    is closed both go on."""
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=8)
    twin = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=8)
    it = sess.generate_iter(PROMPT[:6], max_new_tokens=10)
    first = next(it)
    for call in (
        lambda: sess.decode([1]),
        lambda: sess.generate([1], 2, seq_id=1),
        lambda: sess.generate_iter([1], 2, seq_id=1),
        lambda: sess.seq_rm(0),
        lambda: sess.n_free,
    ):
        with pytest.raises(SessionError, match="generate_iter of this session is suspended"):
            call()
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(sess.n_free))
    other.start()
    other.join(timeout=0.5)
    assert seen == []  # still waiting for the lock (whatever the timing, it cannot have run)
    assert next(it) == twin.generate(PROMPT[:6], max_new_tokens=2)[1]
    it.close()
    other.join(timeout=60)
    assert not other.is_alive()
    assert seen == [64 - 7]  # the prompt and the first token: the step ahead was rolled back
    assert twin.n_free == seen[0]
    assert first == twin.seq_tokens(0)[6]
    assert sess.decode([3], logits="none") is None  # usable again


def test_outputs_bit_identical_across_policies_and_backends(model: Llama) -> None:
    results: dict[tuple[str, str], tuple[Any, list[int]]] = {}
    for backends in (["cpu"], ["cpu-async"], ["cpu-async", "cpu"]):
        for policy in ("stock", "relaxed", "staged"):
            sess = ls.Session(model, backends=backends, n_ctx=64, n_ubatch=8, policy=policy)
            logits = sess.decode(PROMPT, seq_id=0, logits="all")
            tokens = sess.generate(PROMPT[:5], max_new_tokens=8, seq_id=1)
            results["+".join(backends), policy] = (logits, tokens)
    first_logits, first_tokens = next(iter(results.values()))
    for key, (logits, tokens) in results.items():
        assert np.array_equal(logits, first_logits), key
        assert tokens == first_tokens, key


# ---- invariant 11: no reallocation after the reserve --------------------------------------


def test_shared_sequences_do_not_reallocate(model: Llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """S2's regression: a prompt in seq 0, shared with seq 1 by seq_cp, then both decoded for 64
    steps — through the 1-token graph and the ubatch graph — under debug-realloc level 1."""
    monkeypatch.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "1")
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=256, n_seq=2, n_ubatch=8)
    one, ubatch = ((p.n_nodes, p.n_leafs) for p in sess.plans)
    assert one == (ubatch[0] - 1, ubatch[1])  # the 1-token graph selects no output row
    before = _reallocs(sess)
    last = sess.decode(PROMPT, seq_id=0, logits="last")
    assert last is not None
    sess.seq_cp(0, 1)
    assert sess.seq_cells(1) == sess.seq_cells(0)  # shared cells, no copy
    seqs = {0: [*PROMPT, int(np.argmax(last))], 1: [*PROMPT, (int(np.argmax(last)) + 1) % 300]}
    for i in range(64):
        if i % 2:  # both in one ubatch (the 8-token graph, padded)
            nxt = sess.step({0: seqs[0][-1], 1: seqs[1][-1]})
        else:  # one at a time (the 1-token graph)
            nxt = {s: sess.step({s: seqs[s][-1]})[s] for s in (0, 1)}
        for s in (0, 1):
            seqs[s].append(nxt[s])
    assert _reallocs(sess) == before
    assert [(p.n_nodes, p.n_leafs) for p in sess.plans] == [one, ubatch]
    for s in (0, 1):
        out = sess.decode([seqs[s][-1]], seq_id=s, logits="last")
        ref = _ref(model, seqs[s])
        assert rel_err(out, ref[-1]) <= 1e-4
        _greedy_matches(ref, seqs[s], start=len(PROMPT))
    assert sess.seq_pos_max(0) == sess.seq_pos_max(1) == len(PROMPT) + 64
    assert sess.n_free == 256 - (len(PROMPT) + 2 * 65)  # the prompt's cells are shared


def test_ubatches_with_zero_outputs_do_not_reallocate(
    model: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "1")
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=64, n_ubatch=4)
    before = _reallocs(sess)
    assert sess.decode(PROMPT[:10], logits="none") is None  # three ubatches, no outputs
    flags = [False] * 10
    flags[9] = True  # of the ubatches 4 + 4 + 2, only the last has an output
    out = sess.decode(PROMPT[10:20], logits=flags)
    assert out is not None
    assert rel_err(out[0], _ref(model, PROMPT)[19]) <= 1e-4
    assert _reallocs(sess) == before


# ---- sequences ------------------------------------------------------------------------------


def test_seq_rm_keep_and_cp_ranges(model: Llama) -> None:
    sess = ls.Session(model, backends=["cpu"], n_ctx=64, n_seq=3, n_ubatch=8)
    sess.decode(PROMPT[:10], seq_id=0, logits="none")
    sess.seq_cp(0, 1)
    sess.decode([201], seq_id=1, logits="none")
    sess.seq_rm(1, 5)  # seq 1 keeps positions 0..4 (cells shared with seq 0)
    assert sess.seq_pos_max(1) == 4
    assert sess.n_free == 64 - 10  # seq 1's own cell at position 10 was freed
    out = sess.decode([44, 45], seq_id=1, logits="all")
    assert rel_err(out, _ref(model, [*PROMPT[:5], 44, 45])[5:]) <= 1e-4
    sess.seq_cp(0, 2, p0=0, p1=3)
    assert sess.seq_pos_max(2) == 2
    sess.seq_keep(1)
    assert sess.seq_pos_max(0) == -1
    assert sess.seq_pos_max(2) == -1
    assert sess.n_free == 64 - 7  # positions 0..4 shared before, plus 44 and 45
    out = sess.decode([46], seq_id=1, logits="last")
    assert rel_err(out, _ref(model, [*PROMPT[:5], 44, 45, 46])[-1]) <= 1e-4
    sess.clear()
    assert sess.n_free == 64
    assert sess.seq_pos_max(1) == -1


def test_context_full_is_an_error_and_recoverable(model: Llama) -> None:
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=12, n_seq=2, n_ubatch=4)
    sess.decode(PROMPT[:8], seq_id=0, logits="none")
    with pytest.raises(ContextFullError, match=r"5 tokens.*4 free of 12"):
        sess.decode(PROMPT[8:13], seq_id=1)
    with pytest.raises(ContextFullError, match="needs 6 free KV cells"):
        sess.generate(PROMPT[:3], max_new_tokens=4, seq_id=1)
    assert sess.n_free == 4
    assert sess.seq_pos_max(1) == -1
    sess.seq_rm(0, 4)
    out = sess.decode(PROMPT[4:12], seq_id=0, logits="all")  # exactly fills the cache again
    assert sess.n_free == 0
    assert rel_err(out, _ref(model, PROMPT[:12])[4:]) <= 1e-4


# ---- bad input ------------------------------------------------------------------------------


def test_bad_inputs_raise_and_leave_the_session_usable(model: Llama) -> None:
    sess = ls.Session(model, backends=["cpu-async"], n_ctx=32, n_seq=2, n_ubatch=4)
    twin = ls.Session(model, backends=["cpu-async"], n_ctx=32, n_seq=2, n_ubatch=4)
    for s in (sess, twin):
        s.decode(PROMPT[:6], seq_id=0, logits="none")
    bad_calls: list[tuple[Any, str]] = [
        (lambda: sess.decode([1, 300]), r"token id 300 at index 1.*0\.\.299"),
        (lambda: sess.decode([-1]), "token id -1"),
        (lambda: sess.decode([1.5, 2]), "1-D sequence of ints"),
        (lambda: sess.decode([[1, 2]]), "1-D sequence of ints"),
        (lambda: sess.decode([]), "no tokens"),
        (lambda: sess.decode([1], seq_id=2), r"unknown sequence id 2.*0\.\.1"),
        (lambda: sess.decode([1, 2], seq_id=[0, -1]), "unknown sequence id -1"),
        (lambda: sess.decode([1, 2], seq_id=[0]), "1 sequence ids for 2 tokens"),
        (lambda: sess.decode([1], logits="first"), "logits must be"),
        (lambda: sess.decode([1, 2], logits=[True]), "1 logits flags for 2 tokens"),
        (lambda: sess.seq_cp(0, 7), "unknown sequence id 7"),
        (lambda: sess.seq_rm(3), "unknown sequence id 3"),
        (lambda: sess.seq_rm(0, 5, 2), "empty or negative"),
        (lambda: sess.seq_keep(-2), "unknown sequence id -2"),
        (lambda: sess.step({5: 1}), "unknown sequence id 5"),
        (lambda: sess.step({0: 999}), "token id 999"),
        (lambda: sess.generate([1], 0), "max_new_tokens must be >= 1"),
        (lambda: sess.generate([], 3), "prompt is empty"),
        (lambda: sess.generate([1], 3, seq_id=9), "unknown sequence id 9"),
        (lambda: sess.decode(list(range(27))), "27 tokens need as many free KV cells"),
    ]
    for call, pattern in bad_calls:
        with pytest.raises(SessionError, match=pattern):
            call()
    assert sess.n_free == twin.n_free
    assert sess.seq_pos_max(0) == twin.seq_pos_max(0) == 5
    # Still decodes, exactly as a session that never saw the bad calls.
    a = sess.decode(PROMPT[6:10], seq_id=0, logits="all")
    b = twin.decode(PROMPT[6:10], seq_id=0, logits="all")
    assert np.array_equal(a, b)
    assert sess.generate([3, 4], 4, seq_id=1) == twin.generate([3, 4], 4, seq_id=1)


class _FailingPlan:
    """Stands in for a compiled plan whose compute fails (a backend error, Ctrl-C)."""

    def __init__(self, plan: ls.Plan, error: BaseException) -> None:
        self.plan, self.error = plan, error

    def set_input(self, name: str, data: Any) -> None:
        self.plan.set_input(name, data)

    def compute(self) -> None:
        raise self.error


@pytest.mark.parametrize("error", [ls.BackendError("device lost"), KeyboardInterrupt()])
def test_failed_step_gives_its_cells_back(model: Llama, error: BaseException) -> None:
    sess = ls.Session(model, backends=["cpu"], n_ctx=32, n_ubatch=4)
    sess.decode(PROMPT[:5], logits="last")  # read: its cells are known to be written
    free, pos = sess.n_free, sess.seq_pos_max(0)
    bucket = sess._buckets[0]  # the 1-token graph
    real = bucket.plan
    bucket.plan = _FailingPlan(real, error)  # type: ignore[assignment]
    with pytest.raises(type(error)):
        sess.decode(PROMPT[5:10], logits="all")  # ubatches of 4 (runs) and 1 (fails)
    assert (sess.n_free, sess.seq_pos_max(0)) == (free, pos)
    bucket.plan = real
    out = sess.decode(PROMPT[5:10], logits="all")
    assert rel_err(out, _ref(model, PROMPT[:10])[5:]) <= 1e-4


def test_session_arguments_are_checked(model: Llama) -> None:
    with pytest.raises(SessionError, match="n_ctx"):
        ls.Session(model, n_ctx=0)
    with pytest.raises(SessionError, match="buckets"):
        ls.Session(model, n_ubatch=4, buckets=(8,))
    with pytest.raises(SessionError, match="kv_dtype"):
        ls.Session(model, kv_dtype="q8_0")
    with pytest.raises(ls.UnknownBackendError, match="tpu"):
        ls.Session(model, backends=["tpu"])
    assert issubclass(ContextFullError, SessionError)
    assert issubclass(SessionError, ls.LowsyncError)
    assert issubclass(SessionError, ValueError)


def test_smaller_graph_first_would_reallocate(
    model: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control of the tests above: in one context, a 2-token graph compiled before
    the 8-token graph of the same node count makes the second compile re-reserve, which level 1
    rejects — which is why a session compiles its largest bucket first. (The 1-token graph has
    one node fewer, no output-row selection, so level 1 takes it for another graph.)"""
    monkeypatch.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "1")
    ctx = ls.Context(["cpu-async"])
    ctx.compile(model.build_graph(2, 65, 2))
    with pytest.raises(ls.ReallocError, match="LOWSYNC_SCHED_DEBUG_REALLOC=1"):
        ctx.compile(model.build_graph(8, 65, 8))
