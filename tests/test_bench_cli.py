"""`lowsync bench` and `lowsync batched-bench`: rows per backend x policy, the per-token counts
each policy gives, JSON and table output, GGUF models, progress, the warm-up past graph capture,
rows printed as they finish and kept on Ctrl-C or a timeout, `stock*` rows, the default
backends, and clean failures."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import lowsync as ls
from lowsync import cli
from lowsync.bench import (
    BENCH_HEADER,
    COUNTERS,
    LEGACY_ENV,
    BatchedRow,
    BenchRow,
    Progress,
    RowPrinter,
    format_batched,
    format_rows,
    legacy_env,
    legacy_switches,
    parse_backends,
    run_bench,
    warm_up,
)
from lowsync.cli import EXIT_INTERRUPTED, EXIT_TIMEOUT, main
from lowsync.models.llama import Llama, LlamaConfig
from lowsync.session import TOKEN_COUNTERS

JSON_FIELDS = {"model", "backend", "policy", "n_prompt", "n_gen", "pp_tps", "tg_tps", *COUNTERS}


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, object]]:
    assert main(argv) == 0, capsys.readouterr().err
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def test_bench_json_rows_and_counts(capsys: pytest.CaptureFixture[str], clean_env: object) -> None:
    rows = _json(capsys, ["bench", "-p", "8", "-n", "4", "--backend", "cpu-async", "--json"])
    assert [(r["backend"], r["policy"], r["launch_ahead"]) for r in rows] == [
        ("cpu-async", "stock", False),
        ("cpu-async", "relaxed", False),
        ("cpu-async", "staged", False),
        ("cpu-async", "staged", True),
    ]
    for row in rows:
        assert row.keys() >= JSON_FIELDS
        assert row["model"] == "tiny"
        assert (row["n_prompt"], row["n_gen"]) == (8, 4)
        assert all(isinstance(row[c], float) for c in COUNTERS)
        assert isinstance(row["pp_tps"], float)
        assert isinstance(row["tg_tps"], float)
        assert row["pp_tps"] > 0
        assert row["tg_tps"] > 0
        assert row["reallocs"] == 0.0
        assert row["d2h_copies"] == 1.0
    # Per generated token on cpu-async, U = 4 inputs the decode graph reads (it declares
    # `out_ids` but, with one token, selects no row): stock U + 1 waits, relaxed 2, staged 1.
    # Launch-ahead keeps staged's counts and adds the token's device-side copy (every step
    # after the first of the n = 4).
    assert [(r["host_waits"], r["h2d_copies"], r["d2d_copies"]) for r in rows] == [
        (5.0, 4.0, 0.0),
        (2.0, 4.0, 0.0),
        (1.0, 1.0, 0.0),
        (1.0, 1.0, 0.75),
    ]


def test_bench_default_backends_skip_noop(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "-p", "4", "-n", "2", "--policy", "staged", "--launch-ahead", "0", "--json"]
    rows = _json(capsys, argv)
    # A CPU-type Vulkan device (lavapipe in CI) is left out unless named.
    names = [b for b in ls.available_backends() if b != "noop"]
    soft = cli.software_devices(names)
    assert [r["backend"] for r in rows] == [b for b in names if b not in soft]
    if "vulkan:0" in names and ls._native.device_type("vulkan:0") == "cpu":
        assert "vulkan:0" in soft


def test_bench_table_on_noop(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "-p", "4", "-n", "3", "-r", "2", "--backend", "noop", "--policy", "staged"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    for column in ("model", "backend", "policy", "pp t/s", "tg t/s", *COUNTERS):
        assert column in lines[0]
    assert len(lines) == 5  # header, rule, staged without and with launch-ahead, the note
    assert "| tiny" in lines[2]
    assert "noop" in lines[2]
    assert "| staged " in lines[2]
    assert "| staged+ahead " in lines[3]
    assert "±" in lines[2]  # -r 2: mean ± standard deviation
    assert "4 prompt tokens" in lines[4]


def test_bench_backend_and_policy_lists(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "-p", "2", "-n", "2", "--json"]
    argv += [
        "--backend",
        "cpu,cpu-async",
        "--backend",
        "cpu-async+cpu",
        "--policy",
        "relaxed,staged",
    ]
    rows = _json(capsys, argv)
    # Launch-ahead rows (staged only) where the backend can: not on the synchronous `cpu`.
    assert [(r["backend"], r["policy"], r["launch_ahead"]) for r in rows] == [
        ("cpu", "relaxed", False),
        ("cpu", "staged", False),
        ("cpu-async", "relaxed", False),
        ("cpu-async", "staged", False),
        ("cpu-async", "staged", True),
        ("cpu-async+cpu", "relaxed", False),
        ("cpu-async+cpu", "staged", False),
        ("cpu-async+cpu", "staged", True),
    ]
    one = ["bench", "-p", "2", "-n", "2", "--json", "--backend", "cpu-async"]
    rows = _json(capsys, [*one, "--launch-ahead", "1"])
    assert [(r["policy"], r["launch_ahead"]) for r in rows] == [
        ("stock", False),
        ("relaxed", False),
        ("staged", True),
    ]
    assert parse_backends(["a,b", "c+d"]) == [["a"], ["b"], ["c", "d"]]


def test_bench_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    """`-ctk` (llama-bench's flag) sets the KV cache's dtype; the row says which it ran."""
    argv = ["bench", "-p", "4", "-n", "2", "--backend", "cpu", "--policy", "staged", "--json"]
    assert [r["kv_dtype"] for r in _json(capsys, argv)] == ["f32"]
    assert [r["kv_dtype"] for r in _json(capsys, [*argv, "-ctk", "f16"])] == ["f16"]
    with pytest.raises(SystemExit):
        main([*argv, "-ctk", "q8_0"])


def test_bench_on_a_gguf_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = Llama.random(LlamaConfig(300, 64, 2, 4, 2, 96), seed=0, dtype="f16")
    model.save_gguf(tmp_path / "m.gguf")
    argv = ["bench", "-m", str(tmp_path / "m.gguf"), "-p", "4", "-n", "2", "--json"]
    rows = _json(capsys, [*argv, "--backend", "cpu", "--policy", "staged"])
    assert rows[0]["model"] == "custom"
    assert rows[0]["wtype"] == "f16"
    assert rows[0]["params"] == model.n_params


def test_bench_failures_are_clean(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "-p", "2", "-n", "1", "--backend", "tpu"]) == 1
    assert "tpu" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 8)
    assert main(["bench", "-m", str(bad)]) == 1
    assert "bad.gguf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--policy", "eager"])
    assert "unknown policy 'eager'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "-n", "0"])
    with pytest.raises(SystemExit):
        main(["bench", "--launch-ahead", "2"])
    assert "expected a list of 0 and 1" in capsys.readouterr().err


def test_stock_rows_turn_on_the_legacy_switches_of_their_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOWSYNC_CUDA_SYNC_ELISION", "1")
    monkeypatch.delenv("LOWSYNC_VK_LEGACY_SUBMITS", raising=False)
    with legacy_switches("stock", ["cuda:1", "vulkan"]):
        assert os.environ["LOWSYNC_CUDA_SYNC_ELISION"] == "0"
        assert os.environ["LOWSYNC_VK_LEGACY_SUBMITS"] == "1"
    assert os.environ["LOWSYNC_CUDA_SYNC_ELISION"] == "1"
    assert "LOWSYNC_VK_LEGACY_SUBMITS" not in os.environ
    assert legacy_env("stock", ["vulkan:0", "cpu"]) == LEGACY_ENV["vulkan"]
    assert legacy_env("stock", ["cpu-async"]) == {}
    assert legacy_env("staged", ["cuda"]) == {}
    with legacy_switches("staged", ["vulkan"]):
        assert "LOWSYNC_VK_LEGACY_SUBMITS" not in os.environ


def _row(backend: str, policy: str, legacy: tuple[str, ...] = (), ahead: bool = False) -> BenchRow:
    return BenchRow(
        model="tiny",
        params=1_000_000,
        wtype="f32",
        backend=backend,
        policy=policy,
        n_prompt=4,
        n_gen=2,
        reps=1,
        pp_tps=100.0,
        pp_tps_std=0.0,
        tg_tps=50.0,
        tg_tps_std=0.0,
        per_token=dict.fromkeys(TOKEN_COUNTERS, 1.0),
        launch_ahead=ahead,
        legacy=legacy,
    )


def test_stock_rows_with_legacy_switches_are_starred_with_a_footnote() -> None:
    rows = [
        _row("cuda", "stock", ("LOWSYNC_CUDA_SYNC_ELISION=0",)),
        _row("cpu", "stock"),
        _row("cuda", "staged", ahead=True),
    ]
    assert [r.label for r in rows] == ["stock*", "stock", "staged+ahead"]
    lines = format_rows(rows).splitlines()
    assert "| stock* " in lines[2]
    assert "| stock " in lines[3]
    assert lines[-1] == (
        "*: stock with the backends' legacy switches (ggml's behaviour): "
        "LOWSYNC_CUDA_SYNC_ELISION=0"
    )
    assert rows[0].as_dict()["legacy_switches"] == ["LOWSYNC_CUDA_SYNC_ELISION=0"]
    assert "*" not in format_rows(rows[1:])  # no starred row, no footnote


def test_rows_are_printed_as_they_finish() -> None:
    model = Llama.random("tiny", seed=0)
    out = io.StringIO()
    printer = RowPrinter(out, model, [("cpu", "stock"), ("cuda", "staged+ahead")], reps=1)
    assert out.getvalue() == ""
    printer.add(_row("cpu", "stock"))
    first = out.getvalue().splitlines()
    assert len(first) == 3  # header, rule, the row
    assert [c.strip() for c in first[0].strip("|").split("|")] == list(BENCH_HEADER)
    printer.add(_row("cuda", "staged", ahead=True))
    printer.close()
    lines = out.getvalue().splitlines()
    assert lines[:3] == first
    assert len(lines) == 5
    assert "| staged+ahead " in lines[3]
    assert lines[4].startswith("pp: 4 prompt tokens")
    # Columns line up: every line has its separators at the same places.
    bars = {tuple(i for i, ch in enumerate(line) if ch == "|") for line in lines[:4]}
    assert len(bars) == 1


class _CountingSession:
    """A session whose plans capture a graph on their second run, as CUDA's do: the prompt
    graph runs once per generate, the decode graph once per generated token after the first."""

    def __init__(self, recapture_every: int = 0) -> None:
        self.runs = {"prompt": 0, "decode": 0}
        self.captures = 0
        self.rounds = 0
        self.recapture_every = recapture_every

    def clear(self) -> None:
        self.rounds += 1
        if self.recapture_every and self.rounds % self.recapture_every == 0:
            self.runs = {"prompt": 0, "decode": 0}  # memory moved: every graph again

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        for graph in ["prompt"] + ["decode"] * (max_new_tokens - 1):
            self.runs[graph] += 1
            self.captures += self.runs[graph] == 2
        return [0] * max_new_tokens

    def stats(self) -> dict[str, dict[str, int]]:
        return {"total": {"graph_captures": self.captures}}


@pytest.mark.parametrize("max_new", [2, 4, 8])
def test_warm_up_runs_until_a_round_captures_nothing(max_new: int) -> None:
    sess = _CountingSession()
    assert warm_up(sess, [1, 2, 3], max_new) == 3  # eager, captures, nothing new
    before = sess.captures
    sess.clear()
    sess.generate([1, 2, 3], 8)  # what a timed repetition runs
    assert sess.captures == before  # nothing captured in it
    assert warm_up(_CountingSession(recapture_every=1), [1], 4, max_rounds=5) == 5  # bounded
    with pytest.raises(ValueError, match="at least 2"):
        warm_up(_CountingSession(), [1], 1)  # the decode graph would never run


def test_warm_up_on_a_backend_without_graphs_is_two_rounds(
    capsys: pytest.CaptureFixture[str], clean_env: object
) -> None:
    rows = _json(capsys, ["bench", "-p", "4", "-n", "3", "--backend", "cpu-async", "--json"])
    assert {r["warmup_rounds"] for r in rows} == {2}
    assert {r["graph_captures"] for r in rows} == {0.0}


def test_counters_come_from_the_core() -> None:
    assert tuple(ls.stat_names()) == TOKEN_COUNTERS
    assert set(COUNTERS) <= set(TOKEN_COUNTERS)
    row = _row("cpu", "staged").as_dict()
    assert set(ls.stat_names()) <= row.keys()


class _StopAt:
    """`run_bench` that raises `error` in its `n`-th call, after the real rows before it."""

    def __init__(self, n: int, error: Callable[[], BaseException]) -> None:
        self.n, self.error, self.calls = n, error, 0

    def __call__(self, *args: Any, **kwargs: Any) -> BenchRow | None:
        self.calls += 1
        if self.calls == self.n:
            raise self.error()
        return run_bench(*args, **kwargs)


def _sleep_forever() -> BaseException:
    while True:  # the alarm's handler raises out of this loop
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("error", "status"),
    [(KeyboardInterrupt, EXIT_INTERRUPTED), (_sleep_forever, EXIT_TIMEOUT)],
    ids=["ctrl-c", "timeout"],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_a_stopped_bench_keeps_the_finished_rows(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: Callable[[], BaseException],
    status: int,
    as_json: bool,
) -> None:
    monkeypatch.setattr(cli, "run_bench", _StopAt(3, error))
    argv = ["bench", "-p", "4", "-n", "2", "--backend", "cpu", "--timeout", "2"]
    assert main(argv + (["--json"] if as_json else [])) == status
    captured = capsys.readouterr()
    if as_json:
        rows = json.loads(captured.out)
        assert [r["policy"] for r in rows] == ["stock", "relaxed"]
    else:
        lines = captured.out.splitlines()
        assert len(lines) == 2 + 2 + 1  # header, rule, two rows, the note
        assert "| stock " in lines[2]
        assert "| relaxed " in lines[3]
    assert "2 finished row(s) kept" in captured.err
    assert ("timed out after 2 s" in captured.err) == (status == EXIT_TIMEOUT)
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL  # the alarm's handler is gone
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_timeout_stops_a_native_wait(capsys: pytest.CaptureFixture[str]) -> None:
    """The alarm lands inside a row far too long to finish (in its native calls, which poll
    the signal handlers): the bench stops there, not after the row."""
    argv = ["bench", "-p", "512", "-n", "4096", "--backend", "cpu", "--policy", "staged"]
    assert main([*argv, "-r", "50", "--timeout", "1", "--json"]) == EXIT_TIMEOUT
    captured = capsys.readouterr()
    assert json.loads(captured.out) == []
    assert "timed out after 1 s, in cpu/staged" in captured.err


def test_default_backends_skip_cpu_type_vulkan_devices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    types = {"vulkan:0": "cpu", "vulkan:1": "discrete_gpu"}
    monkeypatch.setattr(cli, "available_backends", lambda: ["cpu", "noop", *types])
    monkeypatch.setattr(ls._native, "device_type", types.__getitem__, raising=False)
    args = cli._parser().parse_args(["bench"])
    assert cli._backends(args) == [["cpu"], ["vulkan:1"]]
    assert "skipping vulkan:0: a CPU-type Vulkan device" in capsys.readouterr().err
    named = cli._parser().parse_args(["bench", "--backend", "vulkan:0,noop"])
    assert cli._backends(named) == [["vulkan:0"], ["noop"]]
    assert cli.software_devices(["cpu", "vulkan:0", "vulkan:1"]) == ["vulkan:0"]
    monkeypatch.delattr(ls._native, "device_type")
    assert cli.software_devices(["vulkan:0"]) == []  # a native module that cannot tell


def test_progress_bar_only_after_the_delay() -> None:
    quiet = io.StringIO()
    p = Progress(4, stream=quiet, delay_s=3600)
    p.update("cpu/staged")
    p.close()
    assert quiet.getvalue() == ""

    log = io.StringIO()
    p = Progress(2, stream=log, delay_s=0)
    p.update("cpu/stock")
    p.update("cpu/staged")
    p.close()
    assert log.getvalue().splitlines() == [
        "[############............] 1/2 cpu/stock",
        "[########################] 2/2 cpu/staged",
    ]

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = Progress(2, stream=tty, delay_s=0)
    p.update("x")
    p.close()
    assert tty.getvalue().startswith("\r[############")
    assert tty.getvalue().endswith("\r")


def test_batched_bench_shared_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["batched-bench", "-npp", "12", "-ntg", "4", "-npl", "1,3", "-pps", "--json"]
    rows = _json(capsys, [*argv, "--backend", "cpu-async", "--policy", "staged"])
    assert [(r["npp"], r["ntg"], r["npl"], r["n_kv"]) for r in rows] == [
        (12, 4, 1, 16),
        (12, 4, 3, 24),
    ]
    for row in rows:
        assert row["reallocs"] == 0
        assert row["pps"] is True
        assert row["host_waits_per_step"] == 1.0  # one `next` read per step, all sequences
        assert row["s_tg"] > 0


def test_batched_bench_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["batched-bench", "-npp", "5", "-ntg", "3", "-npl", "2", "-ub", "4", "--backend", "cpu"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    for column in ("PP", "TG", "B", "N_KV", "S_PP t/s", "S_TG t/s", "reallocs"):
        assert column in lines[0]
    assert len(lines) == 2 + 3  # three policies
    assert all(line.rstrip().endswith("0 |") for line in lines[2:])  # no reallocation
    with pytest.raises(SystemExit):
        main(["batched-bench", "-npp", "5", "-npl", "2", "-c", "4"])
    assert "too small" in capsys.readouterr().err


def test_batched_stock_rows_with_legacy_switches_are_starred() -> None:
    common: dict[str, Any] = {
        "npp": 4,
        "ntg": 2,
        "npl": 1,
        "shared_prompt": False,
        "n_kv": 6,
        "t_pp": 0.1,
        "t_tg": 0.1,
        "reallocs": 0,
        "host_waits_per_step": 1.0,
    }
    rows = [
        BatchedRow(
            backend="vulkan", policy="stock", legacy=("LOWSYNC_VK_LEGACY_SUBMITS=1",), **common
        ),
        BatchedRow(backend="cpu", policy="stock", **common),
    ]
    lines = format_batched(rows).splitlines()
    assert "| stock* " in lines[2]
    assert "| stock " in lines[3]
    assert lines[4] == "*: stock with the backends' legacy switches: LOWSYNC_VK_LEGACY_SUBMITS=1"
    assert rows[0].as_dict()["legacy_switches"] == ["LOWSYNC_VK_LEGACY_SUBMITS=1"]
