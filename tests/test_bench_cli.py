"""`lowsync bench` and `lowsync batched-bench`: rows per backend x policy, the per-token counts
each policy gives, JSON and table output, GGUF models, progress, and clean failures."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

import lowsync as ls
from lowsync.bench import COUNTERS, LEGACY_ENV, Progress, legacy_switches, parse_backends
from lowsync.cli import main
from lowsync.models.llama import Llama, LlamaConfig

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
    assert [r["backend"] for r in rows] == [b for b in ls.available_backends() if b != "noop"]


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


def test_stock_rows_turn_on_legacy_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWSYNC_CUDA_SYNC_ELISION", "1")
    monkeypatch.delenv("LOWSYNC_VK_LEGACY_SUBMITS", raising=False)
    with legacy_switches("stock"):
        assert {k: os.environ[k] for k in LEGACY_ENV} == LEGACY_ENV
    assert os.environ["LOWSYNC_CUDA_SYNC_ELISION"] == "1"
    assert "LOWSYNC_VK_LEGACY_SUBMITS" not in os.environ
    with legacy_switches("staged"):
        assert "LOWSYNC_VK_LEGACY_SUBMITS" not in os.environ


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
