"""`lowsync bench`: one row per backend x policy, counters per step, table or JSON."""

from __future__ import annotations

import json

import pytest

import lowsync as ls
from lowsync.bench import COUNTERS
from lowsync.cli import main


def test_bench_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "-n", "3", "--backend", "cpu-async", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["backend"], r["policy"]) for r in rows] == [
        ("cpu-async", "stock"),
        ("cpu-async", "relaxed"),
        ("cpu-async", "staged"),
    ]
    for row in rows:
        assert row["steps"] == 3
        assert row["steps_per_s"] > 0
        assert set(COUNTERS) <= row.keys()
        assert row["reallocs"] == 0
        assert row["host_waits"] >= 1  # reading the sampled token waits
    staged = rows[2]
    assert staged["host_waits"] <= min(r["host_waits"] for r in rows)


def test_bench_default_backends_skip_noop(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "-n", "1", "--policy", "staged", "--json"]) == 0
    backends = [r["backend"] for r in json.loads(capsys.readouterr().out)]
    assert backends == [b for b in ls.available_backends() if b != "noop"]


def test_bench_table_on_noop(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "-n", "2", "--backend", "noop", "--policy", "staged"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "steps/s" in lines[0]
    for column in COUNTERS:
        assert column in lines[0]
    assert len(lines) == 3
    assert "noop" in lines[2]
    assert "staged" in lines[2]


def test_bench_unknown_backend_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "-n", "1", "--backend", "tpu"]) == 1
    assert "tpu" in capsys.readouterr().err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err
