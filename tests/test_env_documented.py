"""Every `LOWSYNC_*` environment variable the code reads is documented for users: in README.md's
variables table or in docs/tuning.md. And the README table lists no variable that nothing reads.

How a variable is found in the sources: the code names each one as a string literal where it
reads it (`lowsync_backend::env::{flag, choice, unsigned}("LOWSYNC_...")`, `std::env::var(...)`,
`os.environ...("LOWSYNC_...")`, `_native.env_flag("LOWSYNC_...")`), and shell scripts set them as
`LOWSYNC_X=...`. C preprocessor names passed as `-DLOWSYNC_...` are macros, not variables, and a
word-boundary rule leaves them out.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUOTED = re.compile(r"""["'](LOWSYNC_[A-Z0-9_]+)["']""")
SHELL_SET = re.compile(r"(?<![\w-])(LOWSYNC_[A-Z0-9_]+)=")
README_ROW = re.compile(r"^\| `(LOWSYNC_[A-Z0-9_]+)` \|", re.M)


def _sources() -> list[Path]:
    files = [*ROOT.glob("crates/**/*.rs"), *ROOT.glob("python/**/*.py")]
    files += ROOT.glob("benches/**/*.py")
    files += (p for p in ROOT.glob("scripts/**/*") if p.is_file())
    return sorted(p for p in files if "target" not in p.relative_to(ROOT).parts)


def variables_in_code() -> dict[str, list[str]]:
    """Variable name -> the files that name it."""
    found: dict[str, list[str]] = {}
    for path in _sources():
        text = path.read_text(errors="replace")
        names = set(QUOTED.findall(text))
        if path.suffix in ("", ".sh"):
            names |= set(SHELL_SET.findall(text))
        for name in names:
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_the_scan_finds_variables_as_the_code_reads_them() -> None:
    # Variables every version of the tree reads, each through a different route.
    code = variables_in_code()
    assert "crates/scheduler/src/policy.rs" in code["LOWSYNC_SYNC_POLICY"]  # env::choice
    assert "LOWSYNC_REQUIRE_VULKAN" in code  # std::env::var in the Vulkan tests
    assert "LOWSYNC_LAUNCH_AHEAD" in code  # the Python package
    assert any(f.endswith(".sh") for f in code["LOWSYNC_REQUIRE_CUDA"])  # set in a script
    assert not any(n.startswith(("LOWSYNC_EMU", "LOWSYNC_WEIGHT")) for n in code), "a -D macro"
    assert SHELL_SET.findall("cc -DLOWSYNC_EMU x.c; LOWSYNC_A=1 run") == ["LOWSYNC_A"]


def test_every_variable_the_code_reads_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    tuning = ROOT / "docs" / "tuning.md"
    docs = readme + (tuning.read_text() if tuning.exists() else "")
    missing = {n: f for n, f in sorted(variables_in_code().items()) if n not in docs}
    assert not missing, "not in README.md or docs/tuning.md: " + "; ".join(
        f"{n} (read in {', '.join(f)})" for n, f in missing.items()
    )


def test_every_variable_in_the_readme_table_is_read_by_the_code() -> None:
    listed = README_ROW.findall((ROOT / "README.md").read_text())
    # README keeps the user-facing variables (six today); the rest live in docs/tuning.md.
    assert len(listed) >= 5, "README's variables table was not found"
    code = variables_in_code()
    unread = [n for n in listed if n not in code]
    assert not unread, f"README lists variables no code reads: {unread}"
