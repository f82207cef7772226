"""The GPU bench scripts, checked without a GPU: the raw argument lists they launch kernels with
stay in step with the kernels' signatures (they otherwise drift silently), and the comparison
script's lowsync rows run."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
FUSED = ROOT / "crates" / "backend-cuda" / "kernels" / "fused.cu"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benches" / "python" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _codes(kernel: str) -> str:
    """`pack` type codes of an `extern "C"` kernel's parameters in fused.cu."""
    src = FUSED.read_text()
    attrs = r"(?:__\w+__\([^)]*\)\s*)*"  # __launch_bounds__(...), __maxnreg__(...)
    m = re.search(r'extern "C" __global__ void\s*' + attrs + kernel + r"\(([^)]*)\)", src)
    assert m, f"{kernel} not found in {FUSED}"
    params = m.group(1).strip()
    if re.fullmatch(r"\w+", params):  # a macro of the parameter list (several entry points)
        d = re.search(r"#define " + params + r"((?:[^\n]*\\\n)*[^\n]*)", src)
        assert d, f"{kernel}: macro {params} not found"
        params = d.group(1).replace("\\\n", " ")
    out = []
    for param in params.split(","):
        decl = param.strip()
        if "*" in decl:
            out.append("p")
        elif decl.startswith("i64"):
            out.append("l")
        elif decl.startswith("int"):
            out.append("i")
        elif decl.startswith("float"):
            out.append("f")
        else:
            raise AssertionError(f"{kernel}: no pack code for parameter {decl!r}")
    return "".join(out)


def test_attention_bench_arguments_match_the_kernels() -> None:
    attn = _module("attn_kernels")
    assert _codes("attn_decode") == attn.DECODE_TYPES
    assert _codes("attn_fast") == attn.FAST_TYPES
    assert _codes("attn_fast_long") == attn.FAST_TYPES


def test_the_signature_reader_sees_every_parameter() -> None:
    # attn_fast ends with `rehearse`: a list one short (the drift this file guards) differs.
    assert _codes("attn_fast").endswith("pi" + "iii")
    assert len(_codes("attn_fast")) == 36


def test_compare_torch_lowsync_rows_run_without_torch(tmp_path: Path) -> None:
    """The comparison script's lowsync rows (the closing figures come from its GPU runs) on
    `cpu-async`: with and without launch-ahead, the same tokens, the counts per token, and the
    JSON the notes quote. Runs with or without torch installed."""
    out = tmp_path / "ct.json"
    argv = [sys.executable, str(ROOT / "benches" / "python" / "compare_torch.py")]
    argv += ["--device", "cpu", "--models", "tiny", "--rows", "lowsync,lowsync-noahead"]
    argv += ["--lowsync-backend", "cpu-async", "--n-short", "2", "--n-long", "6", "--reps", "1"]
    argv += ["--warmup", "0", "--bw-gb", "0.05", "--bw-reps", "1", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["models"][0]["rows"]
    ahead, plain = rows["lowsync"], rows["lowsync-noahead"]
    assert (ahead["launch_ahead"], plain["launch_ahead"]) == (True, False)
    assert ahead["tokens"] == plain["tokens"]
    for row, d2d in ((ahead, 1.0), (plain, 0.0)):
        pt = row["per_token"]
        assert (pt["host_waits"], pt["h2d_copies"], pt["d2h_copies"]) == (1.0, 1.0, 1.0), pt
        assert pt["d2d_copies"] == d2d, pt
