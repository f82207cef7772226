"""README.md is the package page: its examples run, its commands exist, its bench table has the
real bench's columns, and it stays a short page without references a reader cannot follow."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from lowsync import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", TEXT, re.S | re.M)


def _readme_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_bench", ROOT / "scripts/readme_bench.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LAB_REFERENCES = [
    (r"(?<![\w&])#\d+\b", "an issue number"),
    (r"\bissue \d+", "an issue number"),
    (r"\bsession \d+", "a work-log reference"),
    (r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", "a commit hash"),
]
DOCS = sorted((ROOT / "docs").rglob("*.md"))


def test_readme_is_a_short_page_without_lab_references() -> None:
    assert len(TEXT.splitlines()) <= 150
    for pattern, what in LAB_REFERENCES:
        found = re.search(pattern, TEXT)
        assert found is None, f"README holds {what}: {found.group(0)!r}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_pages_link_to_files_and_hold_no_lab_references(page: Path) -> None:
    text = page.read_text()
    for pattern, what in LAB_REFERENCES:
        found = re.search(pattern, text)
        assert found is None, f"{page.name} holds {what}: {found.group(0)!r}"
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_docs_have_the_mechanism_pages() -> None:
    names = {str(p.relative_to(ROOT / "docs")) for p in DOCS}
    for page in [
        "README.md",
        "architecture.md",
        "staged-writes.md",
        "sync-elision.md",
        "transfer-crossover.md",
        "launch-ahead.md",
        "cuda-decode.md",
        "notes/decode-experiments.md",
    ]:
        assert page in names, f"docs/{page} is missing"


def test_readme_has_the_two_set_up_commands() -> None:
    commands = [line.split("#")[0].strip() for b in _blocks("sh") for line in b.splitlines()]
    assert "pip install . && lowsync bench" in commands
    assert "bash .ci/run" in commands


@pytest.mark.usefixtures("clean_env")  # a developer's LOWSYNC_* variables must not matter
@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_readme_python_block_runs(index: int) -> None:
    """Each ```python block is a whole program (its own imports) and runs in a fresh namespace;
    the asserts inside them are the README's claims (one host wait per step or token)."""
    code = compile(_blocks("python")[index], f"README.md python block {index}", "exec")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__readme__"})


def _commands() -> list[str]:
    """Every command the README tells a user to type: lines of ```sh blocks (split at `&&`) and
    inline code that starts with `lowsync `."""
    out = []
    for block in _blocks("sh"):
        for line in block.splitlines():
            out += [c.strip() for c in line.split("#")[0].split("&&") if c.strip()]
    out += re.findall(r"`(lowsync [^`]+)`", TEXT)
    return out


def test_readme_commands_exist_and_parse() -> None:
    """`lowsync ...` commands parse with the real command line (each flag exists and takes the
    value shown), scripts exist, `pip install` extras are declared, variables are documented."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["lowsync"] == "lowsync.cli:main"
    extras = set(project["optional-dependencies"])
    commands = _commands()
    assert any(c.startswith("lowsync bench") for c in commands)
    for command in commands:
        argv = shlex.split(command)
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            var = argv.pop(0).partition("=")[0]
            assert f"| `{var}` |" in TEXT, f"{command!r}: {var} is not in the variables table"
        tool, args = argv[0], argv[1:]
        if tool == "lowsync":
            try:
                with contextlib.redirect_stderr(io.StringIO()) as err:
                    cli._parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"README command {command!r} does not parse: {err.getvalue()}")
        elif tool == "bash":
            assert (ROOT / args[0]).is_file(), f"{command!r}: no {args[0]}"
        elif tool == "pip":
            assert args[0] == "install", command
            for spec in args[1:]:
                m = re.fullmatch(r"\.(?:\[(\w+)\])?", spec)
                assert m, f"{command!r}: installs {spec!r}, not this checkout"
                assert m.group(1) is None or m.group(1) in extras, f"{command!r}: no such extra"
        else:
            pytest.fail(f"README command {command!r}: the test does not know {tool!r}")


def test_readme_links_point_at_files() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", TEXT):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_readme_bench_table_has_the_real_bench_columns() -> None:
    """A cheap real run of `lowsync bench`; README's table (written by scripts/readme_bench.py)
    must have exactly its header row, and every row of it that many cells."""
    argv = [sys.executable, "-m", "lowsync.cli", "bench", "-p", "4", "-n", "4", "--backend", "cpu"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("| model"))
    real = [c.strip() for c in header.strip().strip("|").split("|")]
    rb = _readme_bench()
    assert rb.table_header(TEXT) == real, "rerun scripts/readme_bench.py"
    block = TEXT[TEXT.index(rb.BEGIN) : TEXT.index(rb.END)]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, "the bench block holds no rows"
    assert all(len(row.strip().strip("|").split("|")) == len(real) for row in rows)
    assert "$ lowsync bench" in block


def test_readme_bench_script_replaces_only_its_block() -> None:
    rb = _readme_bench()
    table = "| model | policy |\n| ----- | ------ |\n| tiny  | staged |"
    new = rb.block(["--backend", "cpu"], table)
    text = f"# t\nbefore\n{rb.BEGIN}\nold table\n{rb.END}\nafter\n"
    out = rb.replace_block(text, new)
    assert out == f"# t\nbefore\n{new}\nafter\n"
    assert "$ lowsync bench --backend cpu\n| model" in out
    assert rb.table_header(out) == ["model", "policy"]
    assert rb.replace_block(out, new) == out  # idempotent
    with pytest.raises(ValueError, match="bench:begin"):
        rb.replace_block("no markers here", new)
