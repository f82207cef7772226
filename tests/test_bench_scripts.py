"""The GPU bench scripts, checked without a GPU: the raw argument lists they launch kernels with
stay in step with the kernels' signatures (they otherwise drift silently), and the comparison
script's lowsync rows run."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FUSED = ROOT / "crates" / "backend-cuda" / "kernels" / "fused.cu"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benches" / "python" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
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
    # attn_fast ends with `rehearse, mask_ahead`: a list one short (the drift this file guards)
    # differs.
    assert _codes("attn_fast").endswith("pi" + "iiii")
    assert len(_codes("attn_fast")) == 37


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


def test_kernel_trace_parses_variants_and_rejects_bad_ones() -> None:
    kt = _module("kernel_trace")
    assert kt.parse_variant("base") == ("base", {})
    assert kt.parse_variant("pf=LOWSYNC_CUDA_PDL=0,LOWSYNC_CUDA_GEMV_BLOCKS=3") == (
        "pf",
        {"LOWSYNC_CUDA_PDL": "0", "LOWSYNC_CUDA_GEMV_BLOCKS": "3"},
    )
    for bad in ["", "a b", "x=PDL", "x=lower=1", "x==1"]:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            kt.parse_variant(bad)


def test_kernel_trace_finds_the_decode_steps_and_their_exposed_time() -> None:
    """Synthetic CUPTI rows: an eager prompt (one kernel per launch, more launches than steps),
    a 2-kernel prompt graph, and three 3-kernel decode steps whose second kernel starts before
    the first ends (dependent launch)."""
    kt = _module("kernel_trace")
    lines = [f"eager_{i},{i * 10_000},{i * 10_000 + 1_000},{100 + i}" for i in range(5)]
    lines += ["pp_a,60000,61000,200", "pp_b,61000,62000,200"]
    for t in range(3):
        base, corr = 100_000 * (t + 1), 300 + t
        # a: 0-4 us; b (a comma in its name): 3-10 us, then 1 us later per step; c: 1.5 us
        lines += [
            f"a,{base},{base + 4_000},{corr}",
            f"b<float, 2>,{base + 3_000},{base + 10_000 + t * 1_000},{corr}",
            f"c,{base + 10_500 + t * 1_000},{base + 12_000 + t * 1_000},{corr}",
        ]
    steps, mode, launches = kt.decode_steps(kt.read_rows("\n".join(lines)))
    assert (mode, launches, len(steps)) == (3, 9, 3)
    s = kt.summarize(steps)
    assert [p[0] for p in s.positions] == ["a", "b<float, 2>", "c"]
    # Medians over the steps: b ends 10, 11, 12 us after the step's start.
    assert s.positions[1] == ("b<float, 2>", 8.0, 7.0)
    assert s.positions[2] == ("c", 1.5, 2.0)  # ends 2 us after b
    assert s.span == 13.0
    assert s.busy == 4.0 + 8.0 + 1.5
    assert s.exposed == {"a": 4.0, "b<float, 2>": 7.0, "c": 2.0}
    # Steps start 100 us apart and end 12, 13, 14 us after their start: gaps 88 and 87 us.
    assert s.between == 87.5
    # Copies between the steps (KTRACE_MEMCPY=1) are no launch of a step and show in order.
    copies = [
        "memcpy:DtoH:4,113000,114000,900",
        "memcpy:HtoD:64,116000,118000,901",
        "memcpy:DtoH:4,214000,215000,902",
        "memcpy:HtoD:64,218000,220000,903",
    ]
    rows = kt.read_rows("\n".join(lines + copies))
    with_copies, _, launches = kt.decode_steps(rows)
    assert (len(with_copies), launches) == (3, 9)
    got = kt.between_copies(with_copies, [r for r in rows if kt.is_copy(r)])
    assert got == [("memcpy:DtoH:4", 1.0, 1.0), ("memcpy:HtoD:64", 4.5, 2.0)]
    # Kernels launched on their own between the steps (the copy batch) are listed the same way;
    # the prompt's eager kernels before the first step are not between two steps.
    batch = ["copy_batch,115000,116500,910", "copy_batch,215000,216000,911"]
    rows = kt.read_rows("\n".join(lines + batch))
    got_steps, _, _ = kt.decode_steps(rows)
    outside = kt.outside_steps(rows, got_steps)
    assert {r[0] for r in outside} == {"copy_batch", "pp_a", "pp_b"} | {
        f"eager_{i}" for i in range(5)
    }
    assert kt.between_copies(got_steps, outside) == [("copy_batch", 2.5, 1.25)]
    with pytest.raises(ValueError, match="no decode steps"):
        kt.summarize([])


_FAKE_CUPTI = r"""
#include <stdio.h>
int lowsync_ktrace_active(void) { return 1; }
void lowsync_ktrace_begin(void) {}
long lowsync_ktrace_end(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    for (int t = 0; t < 3; ++t) {
        long b = 100000L * (t + 1);
        fprintf(f, "a,%ld,%ld,%d\nb,%ld,%ld,%d\n", b, b + 4000, t, b + 3000, b + 10000, t);
    }
    fclose(f);
    return 6;
}
"""


def test_kernel_trace_runs_variants_side_by_side(tmp_path: Path) -> None:
    """The trace script's plumbing (a session per variant, rounds in turn, a CSV per trace, the
    side-by-side table) on `cpu`, with a stand-in for the CUPTI library that reports the same
    three 2-kernel steps for every trace."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in trace library")
    src, lib = tmp_path / "fake.c", tmp_path / "libfake.so"
    src.write_text(_FAKE_CUPTI)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    argv = [sys.executable, str(ROOT / "benches" / "python" / "kernel_trace.py")]
    argv += ["--backend", "cpu", "--models", "tiny", "-n", "3", "--csv-dir", str(tmp_path)]
    argv += ["--variant", "base", "--variant", "other=LOWSYNC_CUDA_PDL=0", "--rounds", "2"]
    env = {**os.environ, "CUDA_INJECTION64_PATH": str(lib)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("decode steps of 2 kernels") == 4, out
    assert sorted(p.name for p in tmp_path.glob("ktrace-*.csv")) == [
        f"ktrace-tiny-pdl1-{v}-r{r}.csv" for v in ("base", "other") for r in (0, 1)
    ]
    table = out[out.index("variants side by side") :]
    assert "| base | - | 10.0 | 11.0 | 1.000 |" in table, table
    assert "| other | LOWSYNC_CUDA_PDL=0 | 10.0 | 11.0 | 1.000 |" in table, table
    bad = subprocess.run(
        [*argv[:2], "--variant", "x=oops"], capture_output=True, text=True, env=env, check=False
    )
    assert bad.returncode != 0
    assert "'x=oops'" in bad.stderr


def test_ring_bench_streams_the_matrices_of_1b() -> None:
    """`ring_decode.py`'s step reads, in f16, every matrix the "1b" decode step reads in full
    (all but the embedding table, of which decode reads one row), in the order of a layer."""
    sys.path.insert(0, str(ROOT / "benches" / "python"))  # its `from attn_kernels import`
    ring = _module("ring_decode")
    from lowsync.models.llama import BUILTIN_CONFIGS

    shapes = BUILTIN_CONFIGS["1b"].weight_shapes()
    want = sum(r * k * 2 for n, (r, *k_) in shapes.items() for k in k_ if n != "token_embd.weight")
    phases = ring.phases_1b(BUILTIN_CONFIGS["1b"].n_layer)
    assert sum(rows * k * 2 for rows, k, _ in phases) == want
    # q/k/v, the attention-like phase, o, gate/up, down; the head last.
    assert [kind for _, _, kind in phases[:5]] == [0, 1, 0, 0, 0]
    assert phases[-1] == (32000, 2048, 0)


def test_cluster_bench_lays_out_the_matrices_of_a_1b_layer() -> None:
    """`cluster_decode.py`'s two kernels read, per layer, exactly the bytes of "1b"'s layer
    matrices, in its own block layout: packing then unpacking gives back every matrix, and each
    block starts where the kernels expect (group rows, o's row slice, FFN rows, down's columns)."""
    sys.path.insert(0, str(ROOT / "benches" / "python"))  # its `from attn_kernels import`
    cd = _module("cluster_decode")
    from lowsync.models.llama import BUILTIN_CONFIGS

    cfg = BUILTIN_CONFIGS["1b"]
    shapes = cfg.weight_shapes()
    layer = sum(r * k * 2 for n, (r, *k_) in shapes.items() for k in k_ if n.startswith("blk.0."))
    assert layer == cd.NG * cd.CA * cd.WA_BYTES + cd.NB * cd.WB_BYTES
    assert (
        cfg.n_embd,
        cfg.head_dim,
        cfg.n_head,
        cfg.n_head_kv,
        cfg.n_ff,
    ) == (cd.D, cd.HD, cd.NG * cd.QPG, cd.NG, cd.NB * cd.FR)
    rng = np.random.default_rng(0)
    ng, nb = 2, 16  # a small layer: two KV groups, 1,024 FFN rows

    def m(r: int, c: int) -> np.ndarray:
        return rng.standard_normal((r, c)).astype(np.float16)

    wq, wk, wv, wo = m(ng * 256, cd.D), m(ng * 64, cd.D), m(ng * 64, cd.D), m(cd.D, ng * 256)
    wa = cd.pack_attn(wq, wk, wv, wo)
    assert wa.shape == (ng * cd.CA, cd.WA_BYTES // 2)
    for got, want in zip(cd.unpack_attn(wa.ravel(), ng), (wq, wk, wv, wo), strict=True):
        np.testing.assert_array_equal(got, want)
    g, r = 1, 11  # block (g, r): group rows 264.. (k rows 8..), o rows 1408.. at g's columns
    np.testing.assert_array_equal(wa[g * cd.CA + r, : cd.D], wk[g * 64 + 24 * r - 256])
    o = wa[g * cd.CA + r, cd.RA * cd.D :].reshape(cd.OR, cd.OC)
    np.testing.assert_array_equal(o, wo[128 * r : 128 * r + 128, 256 * g : 256 * g + 256])
    gate, up, down = m(nb * 64, cd.D), m(nb * 64, cd.D), m(cd.D, nb * 64)
    wb = cd.pack_ffn(gate, up, down)
    assert wb.shape == (nb, cd.WB_BYTES // 2)
    for got, want in zip(cd.unpack_ffn(wb.ravel(), nb), (gate, up, down), strict=True):
        np.testing.assert_array_equal(got, want)
    b = 9  # block b: gate row 64b, then up row 64b, ...; down's column 64b after 128 rows
    np.testing.assert_array_equal(wb[b, : cd.D], gate[64 * b])
    np.testing.assert_array_equal(wb[b, cd.D : 2 * cd.D], up[64 * b])
    np.testing.assert_array_equal(wb[b, 128 * cd.D : 129 * cd.D], down[:, 64 * b])


def test_ffn_chain_lays_out_the_ffn_of_a_1b_layer() -> None:
    """`ffn_chain.py`'s fused kernel reads, per layer, exactly the bytes of "1b"'s FFN matrices in
    either block layout: packing then unpacking gives back gate, up and down, and the elements
    sit where the kernel's address arithmetic (`GU_STEP`, `DN_STEP`, layout 1) looks for them."""
    sys.path.insert(0, str(ROOT / "benches" / "python"))  # its `from attn_kernels import`
    fc = _module("ffn_chain")
    from lowsync.models.llama import BUILTIN_CONFIGS

    cfg = BUILTIN_CONFIGS["1b"]
    assert (cfg.n_embd, cfg.n_ff) == (fc.D, fc.F)
    shapes = cfg.weight_shapes()
    ffn = sum(
        r * k * 2
        for n, (r, *k_) in shapes.items()
        for k in k_
        if n.startswith("blk.0.ffn_") and not n.endswith("norm.weight")
    )
    assert ffn == 3 * fc.F * fc.D * 2
    rng = np.random.default_rng(0)
    f, d, fr = 256, fc.D, fc.FR  # 8 blocks of 32 FFN rows
    gate, up = rng.standard_normal((f, d)), rng.standard_normal((f, d))
    down = rng.standard_normal((d, f))
    for layout in (0, 1):
        w = fc.pack_fused(gate, up, down, layout)
        assert w.size == 3 * f * d
        for got, want in zip(fc.unpack_fused(w, f, d, layout), (gate, up, down), strict=True):
            np.testing.assert_array_equal(got, want)
    w, nb = fc.pack_fused(gate, up, down, 1), f // fr
    # gate/up step s of (block b, warp wp), lane l: 16-byte vector ((s nb + b) 8 + wp) 64 +
    # c 32 + l, the 8 values at columns (s % 8) 256 + 8 l of FFN row b fr + wp fr / 8 + s // 8
    for s, b, wp, c, lane in ((0, 0, 0, 0, 0), (5, 1, 3, 1, 7), (31, nb - 1, 7, 1, 31)):
        at = ((((s * nb + b) * 8 + wp) * 64) + c * 32 + lane) * 8
        row, col = b * fr + wp * (fr // 8) + s // 8, (s % 8) * 256 + 8 * lane
        np.testing.assert_array_equal(w[at : at + 8], (gate, up)[c][row, col : col + 8])
    # down step i of block b, thread t: vector nb fr d / 4 + (i nb + b) d / 4 + c d / 8 + t,
    # rows 8t .. 8t + 7 of down at column b fr + 2i + c
    for i, b, c, t in ((0, 0, 0, 0), (3, 2, 1, 100), (15, nb - 1, 1, 255)):
        at = (nb * fr * d // 4 + (i * nb + b) * d // 4 + c * d // 8 + t) * 8
        np.testing.assert_array_equal(w[at : at + 8], down[8 * t : 8 * t + 8, b * fr + 2 * i + c])
