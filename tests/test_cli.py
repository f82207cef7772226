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


def test_commands_turn_on_the_kernel_compile_notice_once() -> None:
    """A command turns lowsync's tracing on, filtered to the CUDA backend's "compiling kernels"
    message, so a first CUDA run that compiles for tens of seconds says so on stderr. A second
    command in the same process keeps it as it is (no error), and tracing stays one per process:
    a later `enable_tracing` is refused with an `InputError`."""
    code = (
        "import lowsync as ls\n"
        "from lowsync.cli import _kernel_compile_notices as notices\n"
        "notices()\n"
        "notices()\n"
        "try:\n"
        "    ls.enable_tracing('lowsync_scheduler=debug')\n"
        "except ls.InputError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert "refused: tracing is already enabled" in out
