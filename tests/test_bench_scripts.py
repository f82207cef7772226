"""The GPU bench scripts launch kernels through raw argument lists; these checks (no GPU) keep
those lists in step with the kernels' signatures, which they otherwise drift from silently."""

from __future__ import annotations

import importlib.util
import re
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
