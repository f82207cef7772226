"""Checks on the Python sources themselves that the linters do not make.

A module-level function or class defined twice in one file silently replaces the first
definition: every caller, also those above the second one, gets the later body. ruff flags a
redefinition only while the first is unused, and a test helper is used by the tests above it, so
two helpers of the same name in one long test file went unnoticed twice (the earlier tests then
ran the later helper). `typing.overload` stubs are the one legitimate repetition.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("python", "tests", "benches", "scripts")


def _is_overload(node: ast.AST) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any(
        (isinstance(d, ast.Name) and d.id == "overload")
        or (isinstance(d, ast.Attribute) and d.attr == "overload")
        for d in decorators
    )


def _redefinitions(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    lines: dict[str, list[int]] = defaultdict(list)
    for node in tree.body:
        if isinstance(node, defs) and not _is_overload(node):
            lines[node.name].append(node.lineno)
    return [
        f"{path.relative_to(root)}: {name} at lines {at}"
        for name, at in lines.items()
        if len(at) > 1
    ]


def test_no_module_level_function_or_class_is_defined_twice_in_one_file() -> None:
    files = [p for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50, f"found only {len(files)} Python files under {SOURCES}"
    found = [r for p in files for r in _redefinitions(p)]
    assert not found, "defined twice (the later one replaces the earlier):\n" + "\n".join(found)


def test_the_check_sees_a_redefinition_and_lets_overloads_be(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import overload\n"
        "def helper():\n    return 1\n"
        "def test_a():\n    assert helper() == 1\n"
        "@overload\ndef f(x: int) -> int: ...\n"
        "@overload\ndef f(x: str) -> str: ...\n"
        "def f(x):\n    return x\n"
        "def helper():\n    return 2\n"
    )
    assert _redefinitions(src, tmp_path) == ["m.py: helper at lines [2, 12]"]
