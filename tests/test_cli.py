"""The `lowsync` command line outside its benches (those are in test_bench_cli.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lowsync as ls
from lowsync.cli import main


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "bench" in err
    assert "batched-bench" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert ls.__version__ in capsys.readouterr().out


def test_module_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lowsync.cli", "bench", "--help"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for option in ("-p", "-n", "-r", "--policy", "--backend", "--json", "-m"):
        assert option in out
