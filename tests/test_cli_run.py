"""`lowsync run` and `lowsync chat` as a user runs them: a subprocess, text on stdout as it is
generated, the counts line on stderr, a chat fed through a pipe, and one-line errors.

The fast tests use a random model with the synthetic byte-level vocabulary written as a GGUF
file; the acceptance test of issue 30 runs SmolLM2-135M-Instruct (skipped without the data).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowsync.llm import LLM
from text_models import random_text_model, runnable_smollm2

# Host waits per generated token as the engine counts them: `cpu-async` blocks once per token,
# on the read of the sampled token; `cpu` is the host itself (each step computes on the calling
# thread, so the read waits for nothing) and counts none.
WAITS_PER_TOKEN = {"cpu": 0.0, "cpu-async": 1.0, "cuda": 1.0, "vulkan": 1.0}
# Every backend the acceptance test runs on: the device ones where the machine has them.
ALL_BACKENDS = [
    "cpu",
    "cpu-async",
    pytest.param("cuda", marks=pytest.mark.cuda),
    pytest.param("vulkan", marks=pytest.mark.vulkan_gpu),
]

STATS = re.compile(
    r"^\[(\d+) tokens, [0-9.]+ tok/s, ([0-9.]+) host waits/token \(([a-z0-9:+-]+), (\w+)\)\]$"
)


def lowsync(
    *args: str, stdin: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWSYNC_")}
    return subprocess.run(
        [sys.executable, "-m", "lowsync.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "random-bpe.gguf"
    random_text_model(seed=2, n_ctx_train=256).save_gguf(path)
    return path


def _one_line_error(res: subprocess.CompletedProcess[str], command: str) -> str:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"lowsync {command}: "), res.stderr
    return lines[0]


@pytest.mark.parametrize("backend", ["cpu", "cpu-async"])
def test_run_streams_the_text_and_ends_with_the_counts(model_file: Path, backend: str) -> None:
    res = lowsync(
        "run", "-m", str(model_file), "-p", "the cat", "-n", "8", "--temp", "0",
        "--backend", backend,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    m = STATS.match(res.stderr.strip().splitlines()[-1])
    assert m, res.stderr
    n_tokens, waits, where, policy = int(m[1]), float(m[2]), m[3], m[4]
    assert (where, policy) == (backend, "staged")
    assert 1 <= n_tokens <= 8
    if n_tokens >= 2:
        assert waits == WAITS_PER_TOKEN[backend]
    # stdout is the model's text alone (and a final newline): what the API gives.
    llm = LLM(model_file, backend=backend, n_ctx=256)
    text = llm("the cat", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert res.stdout == text + "\n"


def test_run_with_a_seed_is_reproducible_and_chat_mode_works(model_file: Path) -> None:
    args = ["run", "-m", str(model_file), "-p", "hello", "-n", "6", "--seed", "7"]
    a, b = lowsync(*args), lowsync(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    c = lowsync(*args, "--chat", "--system", "be brief", "--top-k", "5", "--repeat-penalty", "1.2")
    assert c.returncode == 0, c.stderr
    assert STATS.match(c.stderr.strip().splitlines()[-1]), c.stderr


def test_chat_through_a_pipe_keeps_the_conversation(model_file: Path) -> None:
    res = lowsync(
        "chat", "-m", str(model_file), "--system", "you are terse", "-n", "6", "--seed", "1",
        "--backend", "cpu-async",
        stdin="hello there\n\nhow are you?\n/exit\nnever read\n",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    stats = [line for line in res.stderr.splitlines() if STATS.match(line) or "tokens (" in line]
    assert len(stats) == 2  # two messages answered; the empty line is skipped, /exit ends it
    assert res.stdout.count("\n") >= 2


def test_chat_ends_at_end_of_input(model_file: Path) -> None:
    res = lowsync("chat", "-m", str(model_file), "-n", "3", stdin="one message")
    assert res.returncode == 0, res.stderr
    assert res.stdout.endswith("\n")
    empty = lowsync("chat", "-m", str(model_file), stdin="")
    assert empty.returncode == 0
    assert empty.stdout == ""


def test_bad_files_are_one_line_errors(tmp_path: Path, model_file: Path) -> None:
    line = _one_line_error(lowsync("run", "-m", str(tmp_path / "missing.gguf"), "-p", "x"), "run")
    assert "does not exist" in line
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    _one_line_error(lowsync("run", "-m", str(junk), "-p", "x"), "run")
    _one_line_error(lowsync("chat", "-m", str(junk), stdin="hi\n"), "chat")
    line = _one_line_error(
        lowsync("run", "-m", str(model_file), "-p", "x", "--backend", "nope"), "run"
    )
    assert "nope" in line


def test_a_model_without_a_chat_template_is_a_one_line_error_for_chat(tmp_path: Path) -> None:
    model = random_text_model(seed=3)
    del model.metadata["tokenizer.chat_template"]
    path = tmp_path / "no-template.gguf"
    model.save_gguf(path)
    res = lowsync("chat", "-m", str(path), "-n", "2", stdin="hi\n")
    line = _one_line_error(res, "chat")
    assert "template" in line.lower()
    assert res.stdout == ""  # refused before reading a message
    # `run` needs no template.
    assert lowsync("run", "-m", str(path), "-p", "hi", "-n", "2").returncode == 0


@pytest.mark.parametrize(
    "args",
    [
        ["run", "-p", "x"],  # no model
        ["run", "-m", "f.gguf"],  # no prompt
        ["run", "-m", "f.gguf", "-p", "x", "--temp", "-1"],
        ["run", "-m", "f.gguf", "-p", "x", "--top-p", "2"],
        ["run", "-m", "f.gguf", "-p", "x", "-n", "0"],
        ["run", "-m", "f.gguf", "-p", "x", "--ctx", "0"],
        ["chat", "-m", "f.gguf", "--policy", "fast"],
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str]) -> None:
    res = lowsync(*args)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "error:" in res.stderr


# ---- the acceptance test of issue 30 --------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return runnable_smollm2(tmp_path_factory.getbasetemp())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_run_smollm2_says_paris_with_the_engines_host_waits_per_token(
    smollm2: Path, backend: str
) -> None:
    res = lowsync(
        "run", "-m", str(smollm2), "-p", "The capital of France is", "-n", "8", "--temp", "0",
        "--backend", backend,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(" Paris"), res.stdout
    last = res.stderr.strip().splitlines()[-1]
    m = STATS.match(last)
    assert m, last
    assert float(m[2]) == WAITS_PER_TOKEN[backend], last
    assert m[3] == backend, last
