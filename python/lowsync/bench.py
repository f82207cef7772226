"""`lowsync bench` and `lowsync batched-bench`: throughput and host-side counters of real decodes.

Why: lowsync's claim is "fewer host waits per token, same results". The bench shows it the way
llama-bench would: a model (the built-in "tiny" by default, or a GGUF file) decodes a prompt and
then generates tokens greedily, on each backend under each sync policy, and one row reports
prompt and generation speed next to what the backends counted per generated token — host
waits, driver syncs, elided syncs, submits, empty submits, H2D and D2H copies, reallocations.

Strategy: each (backend, policy) pair gets its own `Session` (one context, plans compiled once,
one output row per graph since only the last prompt token's output is read),
a warm-up, then `-r` repetitions of: clear the cache, decode `-p` prompt tokens (reading the
first generated token), generate `-n` more tokens one step at a time. The warm-up repeats a
short prompt + generation round (at least twice) until a round captures no CUDA graph: a graph
runs eagerly once and is captured on its second run, so one round would leave captures (of the
prompt graph at least) inside the first timed repetition. The counters are the backends' own
(`Context.stats()`, names from `stat_names()`); this module only takes differences over the
generation steps and divides by their number (ARCHITECTURE §3 "per token"). `stock` rows turn
on the legacy switches of their backends (`LOWSYNC_CUDA_SYNC_ELISION=0` for CUDA,
`LOWSYNC_VK_LEGACY_SUBMITS=1` for Vulkan) while their session exists, so they show ggml's
behaviour end to end; such rows are labelled `stock*`, with a footnote. `staged` runs twice
where the backend can launch ahead (`--launch-ahead 0,1`): the plain loop and `staged+ahead`,
side by side. `batched-bench` mirrors llama-batched-bench: `npl` sequences, a prompt of `npp`
tokens each (or one prompt shared through `seq_cp` with `-pps`), then `ntg` steps that decode
one token of every sequence in one ubatch; it reports the reallocations of each run, which
must be zero.

Invariants: a session's plans are compiled once, before any measurement; no graph capture
happens in a timed repetition unless the warm-up's bound ran out (the JSON row's
`graph_captures` says); the same prompt (seeded) is used for every row, so rows differ only in
backend and policy.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

import numpy as np

from lowsync.models.llama import Llama
from lowsync.session import TOKEN_COUNTERS, Session

POLICIES: tuple[str, ...] = ("stock", "relaxed", "staged")

# Per-token counters shown in the table, in column order: a choice among the core's counters
# (`stat_names()`, which `TOKEN_COUNTERS` is); the JSON row carries all of them.
_COLUMNS: tuple[str, ...] = (
    "host_waits",
    "driver_syncs",
    "elided_syncs",
    "submits",
    "empty_submits",
    "h2d_copies",
    "d2h_copies",
    "reallocs",
    "d2d_copies",
    "kernel_launches",
    "graph_launches",
)
_missing = [c for c in _COLUMNS if c not in TOKEN_COUNTERS]
if _missing:  # a counter renamed in the core: fail at import, not with a KeyError mid-bench
    raise ImportError(f"lowsync.bench: the core has no counter {', '.join(_missing)}")
COUNTERS: tuple[str, ...] = _COLUMNS

# Switches that make a backend behave as ggml does, per backend family; the bench sets them for
# `stock` rows of that backend.
LEGACY_ENV: dict[str, dict[str, str]] = {
    "cuda": {"LOWSYNC_CUDA_SYNC_ELISION": "0"},
    "vulkan": {"LOWSYNC_VK_LEGACY_SUBMITS": "1"},
}

# The warm-up: rounds of the prompt and at most this many generated tokens (so the decode graph
# runs eagerly, is captured and replays, and launch-ahead's fed step runs), until a round
# captures nothing or the bound is reached.
WARMUP_TOKENS = 4
WARMUP_MAX_ROUNDS = 6


@contextmanager
def env_vars(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for a block (backends read theirs when they are created),
    restoring the previous values afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def legacy_env(policy: str, backends: Sequence[str]) -> dict[str, str]:
    """The legacy switches a `policy` row on `backends` runs with: those of each backend's
    family (`cuda:1` is `cuda`) for `stock`, none otherwise."""
    if policy != "stock":
        return {}
    out: dict[str, str] = {}
    for b in backends:
        out.update(LEGACY_ENV.get(b.split(":", 1)[0], {}))
    return out


@contextmanager
def legacy_switches(policy: str, backends: Sequence[str]) -> Iterator[None]:
    """Sets `legacy_env(policy, backends)` for a block (restoring the environment afterwards)."""
    with env_vars(legacy_env(policy, backends)):
        yield


def parse_backends(values: Sequence[str]) -> list[list[str]]:
    """`--backend` values: a comma separates rows, a `+` joins backends of one context.

    ``["cpu-async,cpu", "cuda+cpu"]`` -> ``[["cpu-async"], ["cpu"], ["cuda", "cpu"]]``.
    """
    out: list[list[str]] = []
    for value in values:
        for item in value.split(","):
            if item.strip():
                out.append([b.strip() for b in item.split("+") if b.strip()])
    return out


class Progress:
    """A plain-text progress bar on a stream, drawn only once a run has lasted a second.

    On a terminal the bar is redrawn in place and erased at the end; elsewhere (logs, CI) each
    update after the first second is one line.
    """

    def __init__(self, total: int, stream: TextIO | None = None, delay_s: float = 1.0) -> None:
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = delay_s
        self.start = time.perf_counter()
        self.done = 0
        self.drawn = False
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, label: str, steps: int = 1) -> None:
        """Counts `steps` more units done and redraws when the run is past the delay."""
        self.done = min(self.done + steps, self.total)
        if time.perf_counter() - self.start < self.delay_s:
            return
        width = 24
        filled = width * self.done // self.total
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            self.stream.write("\r" + bar.ljust(79)[:79])
        else:
            self.stream.write(bar + "\n")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """Erases the bar (on a terminal); it is drawn again by the next update."""
        if self.drawn and self.tty:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
            self.drawn = False


@dataclass(frozen=True)
class BenchRow:
    """One (backend, policy) run: speeds and counters per generated token."""

    model: str
    params: int
    wtype: str
    backend: str
    policy: str
    n_prompt: int
    n_gen: int
    reps: int
    pp_tps: float
    pp_tps_std: float
    tg_tps: float
    tg_tps_std: float
    per_token: dict[str, float] = field(default_factory=dict)
    launch_ahead: bool = False
    legacy: tuple[str, ...] = ()  # the legacy switches it ran with, as VAR=value
    warmup_rounds: int = 1
    kv_dtype: str = "f32"

    @property
    def label(self) -> str:
        """The policy column: the policy, `+ahead` when the decode loop launched ahead, `*`
        when it ran with legacy switches (the table's footnote lists them)."""
        return self.policy + ("+ahead" if self.launch_ahead else "") + ("*" if self.legacy else "")

    def as_dict(self) -> dict[str, Any]:
        """The JSON row: identification, speeds, then one float per counter (every counter of
        `TOKEN_COUNTERS`, not only the table's)."""
        row: dict[str, Any] = {
            "model": self.model,
            "params": self.params,
            "wtype": self.wtype,
            "backend": self.backend,
            "policy": self.policy,
            "launch_ahead": self.launch_ahead,
            "legacy_switches": list(self.legacy),
            "n_prompt": self.n_prompt,
            "n_gen": self.n_gen,
            "reps": self.reps,
            "warmup_rounds": self.warmup_rounds,
            "kv_dtype": self.kv_dtype,
            "pp_tps": self.pp_tps,
            "pp_tps_std": self.pp_tps_std,
            "tg_tps": self.tg_tps,
            "tg_tps_std": self.tg_tps_std,
        }
        row.update({c: float(v) for c, v in self.per_token.items()})
        return row


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


class _Warmable(Protocol):
    def clear(self) -> None: ...
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]: ...
    def stats(self) -> dict[str, dict[str, int]]: ...


def warm_up(
    sess: _Warmable,
    prompt: Sequence[int],
    max_new_tokens: int,
    max_rounds: int = WARMUP_MAX_ROUNDS,
) -> int:
    """Runs rounds of `prompt` + `max_new_tokens` generated tokens (cache cleared before each):
    two, then more until a round captures no graph, at most `max_rounds`; returns the rounds.

    A CUDA graph runs eagerly the first time and is captured the second (ARCHITECTURE §5), so
    by the end of round two every plan a round uses has been captured; one more round with
    nothing captured shows it (a graph captured again, e.g. after a reallocation, keeps the
    loop going). Backends without graph replay never capture: two rounds. `max_new_tokens`
    is at least 2, so that the decode graph runs too."""
    if max_new_tokens < 2:
        raise ValueError(f"warm_up: max_new_tokens must be at least 2, got {max_new_tokens}")
    for rounds in range(1, max_rounds + 1):
        sess.clear()
        before = sess.stats()["total"]["graph_captures"]
        sess.generate(prompt, max_new_tokens)
        if rounds >= 2 and sess.stats()["total"]["graph_captures"] == before:
            return rounds
    return max_rounds


def run_bench(
    model: Llama,
    backends: Sequence[str],
    policy: str,
    n_prompt: int = 32,
    n_gen: int = 32,
    reps: int = 1,
    n_ubatch: int = 32,
    seed: int = 0,
    on_rep: Callable[[], None] | None = None,
    launch_ahead: bool = False,
    kv_dtype: str = "f32",
) -> BenchRow | None:
    """Runs one bench row: the warm-up (`warm_up`), then `reps` times prompt + `n_gen`
    generated tokens.

    `backends` is one context's backend list. Per-token counters are the deltas over the
    `n_gen` generation steps (after the prompt), averaged over the repetitions. With
    `launch_ahead` the decode loop queues step t+1 before it reads token t; None when the
    session cannot (not `staged`, or a backend without stream-ordered copies and reads).
    `kv_dtype` is the KV cache's dtype (f32, f16 or bf16).
    """
    if n_prompt < 1 or n_gen < 1 or reps < 1:
        raise ValueError("n_prompt, n_gen and reps must be at least 1")
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.config.n_vocab, size=n_prompt).tolist()
    legacy = legacy_env(policy, backends)
    with env_vars(legacy):
        sess = Session(
            model,
            backends=list(backends),
            n_ctx=n_prompt + n_gen,
            n_seq=1,
            n_ubatch=min(n_ubatch, n_prompt),
            policy=policy,
            launch_ahead=launch_ahead,
            kv_dtype=kv_dtype,
            # Only the prompt's last token is read (as llama-bench reads it): one output row per
            # graph, not a row of logits per prompt token (memory and pp time both).
            n_outputs=1,
        )
        if launch_ahead and not sess.launch_ahead:
            return None
        rounds = warm_up(sess, prompt, min(n_gen + 1, WARMUP_TOKENS))
        pp, tg = [], []
        totals = dict.fromkeys(TOKEN_COUNTERS, 0.0)
        for _ in range(reps):
            sess.clear()
            sess.generate(prompt, n_gen + 1)  # the prompt's token, then n_gen steps
            st = sess.last_generate
            assert st is not None
            assert st.n_steps == n_gen
            pp.append(st.pp_tps)
            tg.append(st.tg_tps)
            for c in TOKEN_COUNTERS:
                totals[c] += st.per_token[c]
            if on_rep is not None:
                on_rep()
    pp_mean, pp_std = _mean_std(pp)
    tg_mean, tg_std = _mean_std(tg)
    return BenchRow(
        model=model.name,
        params=model.n_params,
        wtype=model.weight_type,
        backend="+".join(backends),
        policy=sess.policy,
        n_prompt=n_prompt,
        n_gen=n_gen,
        reps=reps,
        pp_tps=pp_mean,
        pp_tps_std=pp_std,
        tg_tps=tg_mean,
        tg_tps_std=tg_std,
        per_token={c: totals[c] / reps for c in TOKEN_COUNTERS},
        launch_ahead=sess.launch_ahead,
        legacy=tuple(f"{k}={v}" for k, v in sorted(legacy.items())),
        warmup_rounds=rounds,
        kv_dtype=kv_dtype,
    )


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _fmt_tps(mean: float, std: float, reps: int) -> str:
    if not math.isfinite(mean):
        return "inf"
    return f"{mean:.1f} ± {std:.1f}" if reps > 1 else f"{mean:.1f}"


def _format_line(line: Sequence[str], widths: Sequence[int], n_left: int) -> str:
    # A cell wider than its column widens only its own line (a streamed row may not fit the
    # widths chosen before it ran); markdown does not care.
    cells = [
        cell.ljust(w) if i < n_left else cell.rjust(w)
        for i, (cell, w) in enumerate(zip(line, widths, strict=True))
    ]
    return "| " + " | ".join(cells) + " |"


def _format_rule(widths: Sequence[int], n_left: int) -> str:
    return (
        "| "
        + " | ".join("-" * w if i < n_left else "-" * (w - 1) + ":" for i, w in enumerate(widths))
        + " |"
    )


def format_table(header: Sequence[str], body: Sequence[Sequence[str]], n_left: int) -> str:
    """A markdown table like llama-bench's: the first `n_left` columns left-aligned."""
    widths = [max(3, *(len(line[i]) for line in [header, *body])) for i in range(len(header))]
    lines = [_format_line(header, widths, n_left), _format_rule(widths, n_left)]
    return "\n".join([*lines, *(_format_line(line, widths, n_left) for line in body)])


BENCH_HEADER: tuple[str, ...] = (
    "model",
    "params",
    "type",
    "backend",
    "policy",
    "pp t/s",
    "tg t/s",
    *COUNTERS,
)
_BENCH_LEFT = 5  # identification columns, left-aligned


def _row_cells(r: BenchRow) -> list[str]:
    return [
        r.model,
        _fmt_params(r.params),
        r.wtype.upper(),
        r.backend,
        r.label,
        _fmt_tps(r.pp_tps, r.pp_tps_std, r.reps),
        _fmt_tps(r.tg_tps, r.tg_tps_std, r.reps),
        *(f"{r.per_token[c]:.2f}" for c in COUNTERS),
    ]


def bench_note(rows: Sequence[BenchRow]) -> str:
    """The lines under the table: the token counts, and the footnote of `*` rows."""
    if not rows:
        return ""
    note = f"pp: {rows[0].n_prompt} prompt tokens, tg: {rows[0].n_gen} generated tokens"
    legacy = sorted({s for r in rows for s in r.legacy})
    if legacy:
        note += (
            f"\n*: stock with the backends' legacy switches (ggml's behaviour): {', '.join(legacy)}"
        )
    return note


def format_rows(rows: Sequence[BenchRow]) -> str:
    """The `lowsync bench` table; counters are per generated token."""
    note = bench_note(rows)
    table = format_table(BENCH_HEADER, [_row_cells(r) for r in rows], n_left=_BENCH_LEFT)
    return table + ("\n" + note if note else "")


class RowPrinter:
    """The `lowsync bench` table printed a row at a time, as each run finishes (so rows of a
    bench stopped part-way are on screen). Column widths are chosen up front from what is
    known before running: the header, the model and backend names, and the policy labels."""

    def __init__(
        self,
        stream: TextIO,
        model: Llama,
        runs: Sequence[tuple[str, str]],
        reps: int,
    ) -> None:
        """`runs`: the (backend, policy label) of each planned row."""
        known = [
            model.name,
            _fmt_params(model.n_params),
            model.weight_type.upper(),
            max((b for b, _ in runs), key=len, default=""),
            max((p for _, p in runs), key=len, default=""),
            "0.0 ± 0.0" if reps > 1 else "0.0",
            "0.0 ± 0.0" if reps > 1 else "0.0",
        ]
        numeric = 8 if reps == 1 else 15  # room for "12345.6" or "12345.6 ± 123.4"
        self.widths = [max(3, len(h), len(k)) for h, k in zip(BENCH_HEADER, known, strict=False)]
        self.widths[5:7] = [max(w, numeric) for w in self.widths[5:7]]
        self.widths += [max(len(c), 6) for c in COUNTERS]  # "123.45"
        self.stream = stream
        self.rows: list[BenchRow] = []

    def add(self, row: BenchRow) -> None:
        """Prints `row` (after the header, for the first)."""
        if not self.rows:
            self.stream.write(_format_line(BENCH_HEADER, self.widths, _BENCH_LEFT) + "\n")
            self.stream.write(_format_rule(self.widths, _BENCH_LEFT) + "\n")
        self.rows.append(row)
        self.stream.write(_format_line(_row_cells(row), self.widths, _BENCH_LEFT) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Prints the note under the table (nothing when no row finished)."""
        note = bench_note(self.rows)
        if note:
            self.stream.write(note + "\n")
            self.stream.flush()


# ---- batched bench --------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchedRow:
    """One llama-batched-bench row: `npl` sequences, prompt `npp`, `ntg` generated each."""

    backend: str
    policy: str
    npp: int
    ntg: int
    npl: int
    shared_prompt: bool
    n_kv: int
    t_pp: float
    t_tg: float
    reallocs: int
    host_waits_per_step: float
    legacy: tuple[str, ...] = ()  # the legacy switches it ran with, as VAR=value

    @property
    def pp_tokens(self) -> int:
        return self.npp if self.shared_prompt else self.npp * self.npl

    @property
    def s_pp(self) -> float:
        return self.pp_tokens / self.t_pp if self.t_pp > 0 else math.inf

    @property
    def s_tg(self) -> float:
        return self.npl * self.ntg / self.t_tg if self.t_tg > 0 else math.inf

    @property
    def s_total(self) -> float:
        t = self.t_pp + self.t_tg
        return self.n_kv / t if t > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        """The JSON row."""
        return {
            "backend": self.backend,
            "policy": self.policy,
            "npp": self.npp,
            "ntg": self.ntg,
            "npl": self.npl,
            "pps": self.shared_prompt,
            "n_kv": self.n_kv,
            "t_pp": self.t_pp,
            "s_pp": self.s_pp,
            "t_tg": self.t_tg,
            "s_tg": self.s_tg,
            "t": self.t_pp + self.t_tg,
            "s": self.s_total,
            "reallocs": self.reallocs,
            "host_waits_per_step": self.host_waits_per_step,
            "legacy_switches": list(self.legacy),
        }


def batched_n_ctx(npp: Sequence[int], ntg: Sequence[int], npl: Sequence[int], pps: bool) -> int:
    """KV cells the largest combination needs."""
    return max((p if pps else p * b) + b * t for p in npp for t in ntg for b in npl)


def run_batched(
    sess: Session,
    npp: int,
    ntg: int,
    npl: int,
    shared_prompt: bool,
    seed: int = 0,
) -> BatchedRow:
    """One llama-batched-bench combination on an existing session (its cache is cleared)."""
    if npl > sess.n_seq:
        raise ValueError(f"npl {npl} exceeds the session's n_seq {sess.n_seq}")
    rng = np.random.default_rng(seed)
    sess.clear()
    total = sess.stats()["total"]
    t0 = time.perf_counter()
    if shared_prompt:
        prompt = rng.integers(0, sess.n_vocab, size=npp).tolist()
        last = sess.decode(prompt, seq_id=0, logits="last")
        assert last is not None
        first = int(np.argmax(last))
        for s in range(1, npl):
            sess.seq_cp(0, s)
        nxt = dict.fromkeys(range(npl), first)
    else:
        tokens = rng.integers(0, sess.n_vocab, size=npp * npl).tolist()
        seqs = [s for s in range(npl) for _ in range(npp)]
        flags = [(i + 1) % npp == 0 for i in range(npp * npl)]
        rows = sess.decode(tokens, seq_id=seqs, logits=flags)
        assert rows is not None
        nxt = {s: int(np.argmax(rows[s])) for s in range(npl)}
    t1 = time.perf_counter()
    mid = sess.stats()["total"]
    for _ in range(ntg):
        nxt = sess.step(nxt)
    t2 = time.perf_counter()
    end = sess.stats()["total"]
    n_kv = (npp if shared_prompt else npp * npl) + npl * ntg
    return BatchedRow(
        backend="+".join(sess.backends),
        policy=sess.policy,
        npp=npp,
        ntg=ntg,
        npl=npl,
        shared_prompt=shared_prompt,
        n_kv=n_kv,
        t_pp=t1 - t0,
        t_tg=t2 - t1,
        reallocs=end["reallocs"] - total["reallocs"],
        host_waits_per_step=(end["host_waits"] - mid["host_waits"]) / max(ntg, 1),
    )


def format_batched(rows: Sequence[BatchedRow]) -> str:
    """The `lowsync batched-bench` table (llama-batched-bench's columns plus reallocations);
    rows run with legacy switches are `stock*`, with a footnote."""
    header = [
        "backend",
        "policy",
        "PP",
        "TG",
        "B",
        "N_KV",
        "T_PP s",
        "S_PP t/s",
        "T_TG s",
        "S_TG t/s",
        "T s",
        "S t/s",
        "waits/step",
        "reallocs",
    ]
    body = [
        [
            r.backend,
            r.policy + ("*" if r.legacy else ""),
            str(r.npp),
            str(r.ntg),
            str(r.npl),
            str(r.n_kv),
            f"{r.t_pp:.3f}",
            f"{r.s_pp:.2f}",
            f"{r.t_tg:.3f}",
            f"{r.s_tg:.2f}",
            f"{r.t_pp + r.t_tg:.3f}",
            f"{r.s_total:.2f}",
            f"{r.host_waits_per_step:.2f}",
            str(r.reallocs),
        ]
        for r in rows
    ]
    legacy = sorted({s for r in rows for s in r.legacy})
    note = f"\n*: stock with the backends' legacy switches: {', '.join(legacy)}" if legacy else ""
    return format_table(header, body, n_left=2) + note
