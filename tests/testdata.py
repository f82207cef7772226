"""Where the real test data is: the folder `scripts/fetch_test_data.py` fills from PyPI.

`LOWSYNC_TEST_DATA` names the folder (default `~/.cache/lowsync-data`, the script's default).
A test that needs data the folder lacks is skipped with the reason — or fails, when
`LOWSYNC_REQUIRE_TEST_DATA=1` (set by `.ci/run`, which fetches the data first).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA_ENV = "LOWSYNC_TEST_DATA"
REQUIRE_ENV = "LOWSYNC_REQUIRE_TEST_DATA"
LLAMA_CPP_MODELS = Path("llama.cpp-b11434", "models")
SMOLLM2_GGUF = Path("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def data_dir() -> Path:
    """The data folder (it may not exist)."""
    env = os.environ.get(DATA_ENV)
    return Path(env) if env else Path.home() / ".cache" / "lowsync-data"


def need(relative: Path) -> Path:
    """The path of one piece of test data; skips the test (fails under
    `LOWSYNC_REQUIRE_TEST_DATA=1`) when it is missing."""
    path = data_dir() / relative
    if path.exists():
        return path
    msg = (
        f"test data {path} is missing: run `python scripts/fetch_test_data.py` "
        f"(or set {DATA_ENV} to the folder it filled)"
    )
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {msg}")
    pytest.skip(msg)


def llama_cpp_models() -> Path:
    """llama.cpp b11434's `models/` folder: `ggml-vocab-*.gguf` with their `.inp` / `.out`
    cases, and `templates/*.jinja`."""
    return need(LLAMA_CPP_MODELS)


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 (gpt2 BPE, pre `smollm`, a ChatML template)."""
    return need(SMOLLM2_GGUF)
