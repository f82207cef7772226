"""Sampling on the device: `Graph.penalize` / `Graph.sample` on `cpu` against a numpy
transcription of the reference algorithm (`lowsync_graph::sampling`), the sampler's
distribution against the softmax it promises, `SamplerParams`, and `Session(sampling=True)`:
seeded runs reproducible across launch-ahead, backends and buckets, the penalty window and key
of every step checked against the reference, and the counts of a sampled step.

The transcription computes `exp` and `ln` in float64 and rounds to float32 (what a correctly
rounded libm gives); every other operation is float32 in the reference's order, so tokens are
compared exactly.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import lowsync as ls
from helpers import assert_step_counts
from lowsync.models.llama import Llama, LlamaConfig
from lowsync.sampling import SamplerError, SamplerParams
from lowsync.session import SessionError

F32 = np.float32
U32 = 0xFFFFFFFF

# ---- the reference, transcribed ---------------------------------------------------------------

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(ctr: Any, key: Any) -> list[npt.NDArray[np.uint64]]:
    """Philox4x32-10, vectorised over arrays of u32 values held in uint64."""
    c = [np.asarray(x, np.uint64) & U32 for x in ctr]
    k = [np.asarray(x, np.uint64) & U32 for x in key]
    for r in range(10):
        if r:
            k = [(k[0] + PHILOX_W[0]) & U32, (k[1] + PHILOX_W[1]) & U32]
        p0 = np.uint64(PHILOX_M[0]) * c[0]
        p1 = np.uint64(PHILOX_M[1]) * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & U32, (p0 >> 32) ^ c[3] ^ k[1], p0 & U32]
    return c


def uniform(seed: int, counter: int, n: int) -> npt.NDArray[np.float32]:
    i = np.arange(n, dtype=np.uint64)
    zero = np.zeros(n, np.uint64)
    w = philox4x32_10([i, zero + counter, zero, zero], [zero + seed, zero])[0]
    u = ((w >> 8).astype(F32) + F32(0.5)) * F32(1.0 / 16777216.0)
    return np.minimum(u, np.nextafter(F32(1), F32(0)))  # the top bucket would round to 1.0


def _ln(x: Any) -> Any:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.asarray(x, np.float64)).astype(F32)


def _exp(x: Any) -> Any:
    return np.exp(np.asarray(x, np.float64)).astype(F32)


def gumbel(u: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return -_ln(-_ln(u))


def order_key(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint64]:
    b = np.ascontiguousarray(x, F32).view(np.uint32).astype(np.uint64)
    k = np.where(b & 0x80000000, ~b & U32, b | 0x80000000)
    return np.where(np.isnan(x), np.uint64(0), k).astype(np.uint64)


def argmax_ref(x: npt.NDArray[np.float32]) -> int:
    ok = ~np.isnan(x)
    if not ok.any():
        return 0
    m = x[ok].max()
    return int(np.flatnonzero(ok & (x == m))[0])


def penalize_ref(
    row: npt.NDArray[np.float32], hist: Any, repeat: float, freq: float, presence: float
) -> npt.NDArray[np.float32]:
    out = np.array(row, F32)
    h = [int(t) for t in hist]
    for j, t in enumerate(h):
        if t < 0 or t >= out.size or t in h[:j]:
            continue
        c = F32(h[j:].count(t))
        x = out[t]
        x = x * F32(repeat) if x <= 0 else x / F32(repeat)
        out[t] = x - (c * F32(freq) + F32(presence))
    return out


def row_max(x: npt.NDArray[np.float32]) -> tuple[int, F32]:
    """The row's largest order key and the value it stands for."""
    key_max = int(order_key(x).max())
    bits = key_max & 0x7FFFFFFF if key_max & 0x80000000 else ~key_max & U32
    return key_max, np.array([bits], np.uint32).view(F32)[0]


def keep_cut(x: npt.NDArray[np.float32], params: Any) -> tuple[int, F32]:
    """The key threshold of the truncations and the row's maximum (`sample_row`'s cuts)."""
    _, top_k, top_p, min_p = (F32(p) for p in params)
    keys = order_key(x)
    _, m = row_max(x)
    cut = 1
    k = int(top_k) if np.isfinite(top_k) else 0
    if 1 <= k < x.size:
        cut = max(cut, int(np.sort(keys)[::-1][k - 1]))
    if top_p < 1:
        kept = keys >= cut
        e = _exp(x[kept] - m)
        z = np.cumsum(e, dtype=F32)[-1]
        target = F32(top_p) * z
        order = np.argsort(keys[kept], kind="stable")[::-1]
        ks, mass = keys[kept][order], np.cumsum(e[order], dtype=F32)
        group_end = np.append(ks[1:] != ks[:-1], True)
        hit = np.flatnonzero(group_end & (mass >= target))
        if hit.size:
            cut = max(cut, int(ks[hit[0]]))
    if min_p > 0:
        cut = max(cut, int(order_key(np.array([m + _ln(min_p)], F32))[0]))
    # The maximum is always kept (min_p > 1 would otherwise cut above it).
    cut = min(cut, int(order_key(np.array([m], F32))[0]))
    return cut, m


def sample_ref(x: Any, params: Any, seed: int, counter: int) -> int:
    x = np.asarray(x, F32)
    temperature = F32(params[0])
    key_max, m = row_max(x)
    if np.isnan(temperature) or temperature <= 0 or key_max == 0 or m == -np.inf:
        return argmax_ref(x)
    cut, m = keep_cut(x, params)
    kept = np.flatnonzero(order_key(x) >= cut)
    with np.errstate(invalid="ignore", over="ignore"):
        s = (x - m) / temperature + gumbel(uniform(seed, counter, x.size))
    first = kept[0]
    if np.isnan(s[first]):
        return int(first)
    best = np.nanmax(s[kept])
    return int(kept[np.flatnonzero(s[kept] == best)[0]])


# ---- op level ---------------------------------------------------------------------------------


def test_the_transcription_gives_random123s_known_answers() -> None:
    got = philox4x32_10([0, 0, 0, 0], [0, 0])
    assert [int(w) for w in got] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    got = philox4x32_10([U32] * 4, [U32] * 2)
    assert [int(w) for w in got] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


class _Sampler:
    """`sample(penalize(logits, hist, pen), params, key)` compiled once for [rows, vocab]."""

    def __init__(self, backend: str, rows: int, vocab: int, window: int) -> None:
        g = ls.Graph()
        logits = g.input("logits", [rows, vocab])
        hist = g.input("hist", [rows, window], "i32")
        pen = g.input("pen", [rows, 3])
        params = g.input("params", [rows, 4])
        key = g.input("key", [rows, 2], "i32")
        penalized = g.penalize(logits, hist, pen)
        g.output("penalized", penalized)
        g.output("token", g.sample(penalized, params, key))
        self.plan = ls.Context([backend]).compile(g)

    def __call__(self, **inputs: Any) -> tuple[Any, Any]:
        for name, data in inputs.items():
            self.plan.set_input(name, np.ascontiguousarray(data))
        self.plan.compute()
        return self.plan.get_output("penalized"), self.plan.get_output("token")


def _keys(seeds: Any, counters: Any) -> npt.NDArray[np.int32]:
    return np.stack([np.asarray(seeds, np.uint32), np.asarray(counters, np.uint32)], 1).view(
        np.int32
    )


def _rows(rng: np.random.Generator, rows: int, vocab: int) -> npt.NDArray[np.float32]:
    """Logits with what the truncations must handle: ties, -inf, NaN, signed zeros."""
    x = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4, (rows, 1))).astype(F32)
    x[rng.random((rows, vocab)) < 0.05] = -np.inf
    x[rng.random((rows, vocab)) < 0.02] = np.nan
    for r in range(0, rows, 3):  # a tie of the largest values in every third row
        top = np.argsort(np.nan_to_num(x[r], nan=-np.inf))[-3:]
        x[r, top] = x[r, top[-1]]
    x[1::7, :4] = [-0.0, 0.0, -0.0, 0.0]
    return x


@pytest.mark.parametrize("backend", ["cpu", "cpu-async"])
def test_sample_and_penalize_match_the_reference_token_for_token(backend: str) -> None:
    rows, vocab, window = 64, 97, 12
    rng = np.random.default_rng(5)
    op = _Sampler(backend, rows, vocab, window)
    drawn = 0
    for trial in range(12):
        x = _rows(rng, rows, vocab)
        hist = rng.integers(-3, vocab + 3, (rows, window)).astype(np.int32)
        pen = np.stack(
            [rng.uniform(0.5, 2, rows), rng.uniform(-1, 1, rows), rng.uniform(-1, 1, rows)], 1
        ).astype(F32)
        params = np.stack(
            [
                rng.choice([0.0, 0.3, 0.8, 1.0, 2.5], rows),
                rng.choice([0, 1, 2, 5, 40, 200, -1], rows),
                rng.choice([1.0, 0.0, 0.5, 0.9, 0.95, 1.5], rows),
                rng.choice([0.0, 0.05, 0.2, 1.0, -1.0], rows),
            ],
            1,
        ).astype(F32)
        keys = _keys(rng.integers(0, 2**32, rows), rng.integers(0, 2**32, rows))
        penalized, tokens = op(logits=x, hist=hist, pen=pen, params=params, key=keys)
        u = keys.view(np.uint32)
        for r in range(rows):
            want = penalize_ref(x[r], hist[r], *pen[r])
            np.testing.assert_array_equal(penalized[r], want, err_msg=f"trial {trial} row {r}")
            t = sample_ref(want, params[r], int(u[r, 0]), int(u[r, 1]))
            assert tokens[r] == t, (trial, r, params[r])
            drawn += params[r, 0] > 0
    assert drawn > 500  # most rows were draws, not the argmax


def test_one_key_is_one_token_and_keys_differ() -> None:
    op = _Sampler("cpu", 200, 50, 1)
    x = np.tile(np.linspace(-1, 1, 50, dtype=F32), (200, 1))
    params = np.tile(F32([1.0, 0, 1.0, 0]), (200, 1))
    hist = np.full((200, 1), -1, np.int32)
    pen = np.tile(F32([1, 0, 0]), (200, 1))
    same = _keys([7] * 200, [3] * 200)
    _, a = op(logits=x, hist=hist, pen=pen, params=params, key=same)
    assert len(set(a.tolist())) == 1
    _, b = op(key=_keys([7] * 200, range(200)))
    _, c = op(key=_keys(range(200), [3] * 200))
    assert len(set(b.tolist())) > 20
    assert len(set(c.tolist())) > 20


def _expected(x: npt.NDArray[np.float32], params: Any) -> npt.NDArray[np.float64]:
    """The distribution `sample` promises: softmax(x / T) over the tokens the cuts keep."""
    cut, m = keep_cut(x, params)
    kept = order_key(x) >= cut
    logits = np.where(kept, (x.astype(np.float64) - float(m)) / float(params[0]), -np.inf)
    p = np.exp(logits - logits.max())
    return p / p.sum()


DISTRIBUTIONS = {
    "plain": (1.0, 0, 1.0, 0.0),
    "hot": (2.0, 0, 1.0, 0.0),
    "cold": (0.5, 0, 1.0, 0.0),
    "top_k": (1.0, 4, 1.0, 0.0),
    "top_p": (1.0, 0, 0.7, 0.0),
    "min_p": (1.0, 0, 1.0, 0.2),
    "all": (0.8, 6, 0.9, 0.05),
}


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_draws_follow_the_truncated_softmax(name: str) -> None:
    """20,000 draws from fixed logits (fixed keys, so deterministic): no truncated token ever,
    and every frequency within 5 standard deviations of its probability (total variation
    under 0.02)."""
    vocab, n = 10, 20_000
    x = F32([2.0, 1.6, 1.5, 1.0, 0.7, 0.5, 0.0, -0.4, -1.0, -3.0])
    params = F32(DISTRIBUTIONS[name])
    want = _expected(x, params)
    op = _Sampler("cpu", n, vocab, 1)
    _, tokens = op(
        logits=np.tile(x, (n, 1)),
        hist=np.full((n, 1), -1, np.int32),
        pen=np.tile(F32([1, 0, 0]), (n, 1)),
        params=np.tile(params, (n, 1)),
        key=_keys(np.full(n, 1234), np.arange(n)),
    )
    freq = np.bincount(tokens, minlength=vocab) / n
    assert not np.any(freq[want == 0]), (freq, want)
    sigma = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-12), (freq, want)
    assert 0.5 * np.abs(freq - want).sum() < 0.02
    assert (want > 0).sum() >= 2  # something was drawn among several tokens


def test_a_token_with_negligible_probability_is_never_drawn() -> None:
    # Under key (seed 5, counter 33670) element 428's Philox word has its top 24 bits set.
    seed, counter, i = 5, 33670, 428
    zero = np.zeros(1, np.uint64)
    w = philox4x32_10([zero + i, zero + counter, zero, zero], [zero + seed, zero])[0]
    assert int(w[0]) >> 8 == (1 << 24) - 1
    x = np.full((1, i + 1), -np.inf, F32)
    x[0, 0] = 0.0
    x[0, i] = -60.0  # probability e^-60 against token 0
    op = _Sampler("cpu", 1, i + 1, 1)
    _, t = op(
        logits=x,
        hist=np.full((1, 1), -1, np.int32),
        pen=F32([[1, 0, 0]]),
        params=F32([[1.0, 0, 1.0, 0.0]]),
        key=_keys([seed], [counter]),
    )
    assert t[0] == 0


# ---- SamplerParams ----------------------------------------------------------------------------


def test_sampler_params_are_checked() -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"top_k": True}, "top_k must be an int"),
        ({"top_p": -0.1}, "top_p must be >= 0"),
        ({"top_p": float("nan")}, "top_p must be finite"),
        ({"min_p": 1.5}, "min_p must be at most 1"),
        ({"min_p": float("nan")}, "min_p must be finite"),
        ({"repeat_penalty": 0.0}, "repeat_penalty must be > 0"),
        ({"repeat_penalty": float("inf")}, "repeat_penalty must be finite"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be finite"),
        ({"frequency_penalty": None}, "frequency_penalty must be a number"),
        ({"seed": 1.0}, "seed must be an int or None"),
    ]
    for kw, pattern in bad:
        with pytest.raises(SamplerError, match=pattern):
            SamplerParams(**kw)
    assert issubclass(SamplerError, SessionError)
    assert issubclass(SamplerError, ls.LowsyncError)
    assert issubclass(SamplerError, ValueError)
    sp = SamplerParams(top_k=-1, top_p=1.5, min_p=-1.0, seed=2**40 + 5)
    assert sp.params_row() == (0.8, 0.0, 1.5, -1.0)
    assert sp.resolve_seed() == 5
    assert SamplerParams(top_k=10**9).params_row()[1] == 2.0**24
    assert SamplerParams(seed=-1).resolve_seed() == 2**32 - 1
    assert SamplerParams(seed=None).resolve_seed() != SamplerParams(seed=None).resolve_seed()
    assert SamplerParams(temperature=0).is_greedy
    assert not SamplerParams(temperature=0, repeat_penalty=1.1).is_greedy
    assert not SamplerParams().is_greedy
    assert ls.SamplerParams is SamplerParams


# ---- Session ----------------------------------------------------------------------------------

CONFIG = LlamaConfig(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
PROMPT = [12, 7, 250, 3, 3, 99, 41, 0, 18, 77, 5, 6]
HOT = SamplerParams(temperature=1.5, top_k=50, top_p=0.95, min_p=0.0, seed=11)
PENALISED = SamplerParams(
    temperature=0.9,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repeat_penalty=1.5,
    frequency_penalty=0.3,
    presence_penalty=0.2,
    seed=2**32 - 3,  # the key's seed word has its sign bit set
)


@pytest.fixture(scope="module")
def model() -> Llama:
    # Logits of a random model are nearly flat; a larger output head gives them a perplexity
    # near 10, where truncations and penalties both change what is drawn.
    m = Llama.random(CONFIG, seed=1)
    m.weights["output.weight"] = m.weights["output.weight"] * np.float32(20)
    return m


def _session(model: Llama, backend: str = "cpu-async", **kw: Any) -> ls.Session:
    args: dict[str, Any] = {"n_ctx": 96, "n_seq": 2, "n_ubatch": 8, "sampling": True}
    args.update(kw)
    return ls.Session(model, backends=backend.split("+"), **args)


def test_a_seeded_generation_is_reproducible_everywhere(
    model: Llama, clean_env: pytest.MonkeyPatch
) -> None:
    """The same seed gives the same tokens: again, in a new session, with launch-ahead on and
    off, on cpu, cpu-async and both, and whichever bucket decoded the prompt; another seed
    gives other tokens."""
    runs: dict[str, list[int]] = {}
    for backend in ("cpu", "cpu-async", "cpu-async+cpu"):
        for ahead in (True, False):
            for buckets in ((1,), (), (1, 2)):
                sess = _session(model, backend, launch_ahead=ahead, buckets=buckets)
                for sampler in (HOT, PENALISED):
                    key = f"{backend} ahead={ahead} buckets={buckets} seed={sampler.seed}"
                    runs[key] = sess.generate(PROMPT, 24, sampler=sampler)
                    sess.clear()
                    assert sess.generate(PROMPT, 24, sampler=sampler) == runs[key], key
                    sess.clear()
    hot = {k: v for k, v in runs.items() if k.endswith("seed=11")}
    assert len({tuple(v) for v in hot.values()}) == 1, hot
    pen = {k: v for k, v in runs.items() if k.endswith(f"seed={PENALISED.seed}")}
    assert len({tuple(v) for v in pen.values()}) == 1, pen
    greedy = _session(model).generate(PROMPT, 24)
    other = _session(model).generate(PROMPT, 24, sampler=SamplerParams(temperature=1.5, seed=12))
    first = next(iter(hot.values()))
    assert first != greedy
    assert other != first
    assert len(set(first)) > 8  # a real draw, not a loop of one token


def _window(seq: list[int], p: int, n: int) -> list[int]:
    """The penalty window of the token at position p: positions p - n + 1 .. p, -1 before 0."""
    return [seq[q] if q >= 0 else -1 for q in range(p - n + 1, p + 1)]


@pytest.mark.parametrize("n_prompt", [5, 9])
@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("sampler", [PENALISED, HOT], ids=["penalties", "hot"])
def test_every_step_draws_what_the_reference_draws(
    model: Llama, sampler: SamplerParams, ahead: bool, n_prompt: int, clean_env: pytest.MonkeyPatch
) -> None:
    """Each generated token is the reference's draw from the logits of its row (read back by
    a twin without sampling), with the penalty window of the sequence up to that row — the
    prompt included, -1 before position 0 — and the key (seed, the token's position): so the
    window's last column (fed on the device under launch-ahead) and the key are right. A
    prompt of 9 tokens ends in a one-token ubatch: its token is drawn by the one-token graph."""
    n = 10
    sess = _session(model, launch_ahead=ahead, penalty_last_n=n)
    prompt = PROMPT[:n_prompt]
    out = sess.generate(prompt, 20, sampler=sampler)
    seq = prompt + out
    twin = ls.Session(model, backends=["cpu-async"], n_ctx=96, n_ubatch=8)
    logits = twin.decode(seq[:-1], logits="all")
    assert logits is not None
    params = sampler.params_row()
    for j, tok in enumerate(out):
        p = len(prompt) - 1 + j  # the position of the token whose row drew `tok`
        row = penalize_ref(logits[p], _window(seq, p, n), *sampler.penalty_row())
        assert tok == sample_ref(row, params, sampler.resolve_seed(), p + 1), j
    assert sess.seq_tokens(0) == seq[:-1]


def test_temperature_zero_through_the_sampler_is_the_argmax_graph(
    model: Llama, clean_env: pytest.MonkeyPatch
) -> None:
    plain = ls.Session(model, backends=["cpu-async"], n_ctx=96, n_ubatch=8)
    want = plain.generate(PROMPT, 16)
    cold = SamplerParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1, seed=1)
    assert cold.is_greedy
    # A greedy sampler on a session without sampling runs the argmax graph.
    assert plain.generate(PROMPT, 16, seq_id=1, sampler=cold) == want
    sess = _session(model)
    assert sess.generate(PROMPT, 16) == want  # no sampler: greedy rows
    sess.clear()
    assert sess.generate(PROMPT, 16, sampler=cold) == want
    sess.clear()
    # Drawn then greedy again: the greedy rows are rewritten.
    sess.generate(PROMPT, 4, sampler=HOT)
    sess.clear()
    assert sess.generate(PROMPT, 16) == want
    # decode and step are greedy on a sampling session too.
    assert sess.step({1: PROMPT[0]})[1] == plain.step({2: PROMPT[0]})[2]  # both empty before


def test_a_huge_penalty_never_repeats_a_token_within_the_window(
    model: Llama, clean_env: pytest.MonkeyPatch
) -> None:
    n = 16
    for ahead in (True, False):
        sess = _session(model, launch_ahead=ahead, penalty_last_n=n)
        prompt = [5, 5, 9]
        greedy = sess.generate(prompt, 40)
        seq = prompt + greedy
        assert any(seq[i] in seq[max(i - n, 0) : i] for i in range(3, len(seq))), seq
        sess.clear()
        never = SamplerParams(temperature=0.0, presence_penalty=1e6, seed=0)
        out = sess.generate(prompt, 40, sampler=never)
        seq = prompt + out
        for i in range(len(prompt), len(seq)):
            assert seq[i] not in seq[max(i - n, 0) : i], (ahead, i, seq)


def test_penalty_last_n_zero_and_one(model: Llama, clean_env: pytest.MonkeyPatch) -> None:
    """No window: penalties do nothing (llama.cpp's penalty_last_n = 0), and the graphs have
    no penalty inputs; a window of one is the decoded token alone (no host columns)."""
    off = _session(model, penalty_last_n=0)
    assert not any(i.startswith(("sample_hist", "sample_penalty")) for i in off.plans[0].inputs)
    drawn = SamplerParams(temperature=0.9, seed=4)
    want = off.generate(PROMPT, 12, sampler=drawn)
    off.clear()
    punished = SamplerParams(temperature=0.9, seed=4, repeat_penalty=3.0, presence_penalty=5)
    assert off.generate(PROMPT, 12, sampler=punished) == want
    one = _session(model, penalty_last_n=1)
    assert "sample_hist" not in one.plans[0].inputs
    assert "sample_hist" in one.plans[1].inputs
    never = SamplerParams(temperature=0.0, presence_penalty=1e6, seed=0)
    out = one.generate(PROMPT, 30, sampler=never)
    seq = PROMPT + out
    assert all(seq[i] != seq[i - 1] for i in range(len(PROMPT), len(seq))), seq


def test_sampling_errors(model: Llama, clean_env: pytest.MonkeyPatch) -> None:
    plain = ls.Session(model, backends=["cpu"], n_ctx=32, n_ubatch=4)
    with pytest.raises(SessionError, match="built without sampling"):
        plain.generate(PROMPT[:3], 4, sampler=HOT)
    with pytest.raises(SessionError, match="built without sampling"):
        plain.generate(PROMPT[:3], 4, sampler=SamplerParams(temperature=0, repeat_penalty=1.2))
    with pytest.raises(SessionError, match="sampler must be a SamplerParams"):
        plain.generate(PROMPT[:3], 4, sampler={"temperature": 1.0})  # type: ignore[arg-type]
    assert plain.n_free == 32
    with pytest.raises(SessionError, match="penalty_last_n"):
        ls.Session(model, sampling=True, penalty_last_n=-1)
    with pytest.raises(SessionError, match="sampling must be a bool"):
        ls.Session(model, sampling=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("ahead", [True, False])
def test_a_sampled_step_costs_what_a_greedy_one_does(
    model: Llama, ahead: bool, clean_env: pytest.MonkeyPatch
) -> None:
    """Sampling with penalties under `staged` on cpu-async: per step exactly one host wait,
    one upload (every input, the sampler's too, in one staged copy), one 4-byte read, and
    the token's device copy under launch-ahead — counted step by step — and the kernels of
    the greedy step with its argmax replaced by concat (the window's last column), penalize
    and sample. No reallocation either (debug-realloc level 1)."""
    clean_env.setenv("LOWSYNC_SCHED_DEBUG_REALLOC", "1")
    greedy = _session(model, sampling=False, launch_ahead=False)
    greedy.generate(PROMPT, 3)
    assert greedy.last_generate is not None
    argmax_step = greedy.last_generate.steps[0]["kernel_launches"]
    sess = _session(model, launch_ahead=ahead)
    assert sess.launch_ahead == ahead
    sess.generate(PROMPT, 3, sampler=PENALISED)  # warm-up
    sess.clear()
    sess.generate(PROMPT, 17, sampler=PENALISED)
    st = sess.last_generate
    assert st is not None
    assert st.n_steps == 16
    launches = argmax_step - 1 + 3
    assert_step_counts(st, ahead, per_queued={"kernel_launches": launches})
    sess.decode(PROMPT[:3], seq_id=1, logits="all")
    assert sess.stats()["total"]["reallocs"] == 0


class _InterruptAtLine:
    """Raises KeyboardInterrupt at the `n`-th line event in lowsync's session and kv_cells."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.fired = n, 0, False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.endswith(("lowsync/session.py", "lowsync/kv_cells.py")):
            if event == "line":
                self.seen += 1
                if self.seen == self.n:
                    self.fired = True
                    raise KeyboardInterrupt
            return self
        return None


def _sampled(m: int) -> Callable[[ls.Session], Any]:
    return lambda s: s.generate(PROMPT[5:8], m, seq_id=1, sampler=PENALISED)


def _streamed_two(s: ls.Session) -> Any:
    it = s.generate_iter(PROMPT[5:8], 4, seq_id=1, sampler=PENALISED)
    try:
        return list(itertools.islice(it, 2))
    finally:
        # Closed here, not by the garbage collector: an interrupt inside the close then
        # reaches the caller (at collection Python could only print it).
        it.close()


@pytest.mark.parametrize(
    ("call", "ends"),
    [
        (_sampled(3), [_sampled(1), _sampled(2)]),
        (_streamed_two, [_sampled(1)]),
    ],
    ids=["generate", "generate_iter-left-after-two"],
)
def test_ctrl_c_between_any_two_lines_of_a_sampled_generation(
    model: Llama,
    call: Callable[[ls.Session], Any],
    ends: list[Callable[[ls.Session], Any]],
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C at every line a sampled generation runs (launch-ahead on; the second call stops
    reading after two tokens, so its iterator is closed with a step queued ahead): the cache is
    as before, or as after a shorter generation, token ids included, and the next sampled
    generation draws exactly what a session in that state draws."""

    def base() -> ls.Session:
        sess = _session(model, n_ctx=32, launch_ahead=True)
        sess.decode(PROMPT[:5], logits="last")
        return sess

    def state(sess: ls.Session) -> Any:
        n_free = sess.n_free  # a public call: repairs what an interrupt outside a handler left
        sess._cells.check()
        return n_free, [sess.seq_tokens(s) for s in range(sess.n_seq)]

    def probe(sess: ls.Session) -> list[int]:
        return sess.generate([33], 3, seq_id=0, sampler=HOT)

    outcomes = []
    for run in [None, *ends, call]:
        twin = base()
        if run is not None:
            run(twin)
        outcomes.append((state(twin), probe(twin)))
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
        got = state(sess)
        probes = [p for st, p in outcomes if st == got]
        assert probes, (n, got)
        assert probe(sess) == probes[0], n
        if not trace.fired:
            break
        sess.clear()
        sess.decode(PROMPT[:5], logits="last")
    assert n > 20


def test_min_p_above_one_still_draws_a_token_of_the_row() -> None:
    op = _Sampler("cpu", 1, 5, 1)
    _, t = op(
        logits=F32([[1, 2, 3, 0, -1]]),
        hist=np.full((1, 1), -1, np.int32),
        pen=F32([[1, 0, 0]]),
        params=F32([[1.0, 0, 1.0, 1.5]]),
        key=_keys([1], [2]),
    )
    assert 0 <= t[0] < 5
