"""The GPU bench and profiling scripts, checked without a GPU: the raw argument lists they
launch kernels with stay in step with the kernels' signatures (they otherwise drift silently),
the trace script's parsing and plumbing work, and the comparison script's lowsync rows run."""

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

import pytest

import lowsync as ls

ROOT = Path(__file__).resolve().parents[1]
CUDA_CRATE = ROOT / "crates" / "backend-cuda"
PROFILE = ROOT / "benches" / "profile"


def _module(name: str, folder: Path = PROFILE) -> ModuleType:
    if str(PROFILE) not in sys.path:
        sys.path.insert(0, str(PROFILE))  # the profiling scripts import `cuda_driver`
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _kernel_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(CUDA_CRATE.rglob("*.cu*"))}


def _codes(kernel: str) -> str:
    """`pack` type codes of an `extern "C"` kernel's parameters, wherever in the CUDA backend's
    kernel sources it is defined."""
    srcs = _kernel_sources()
    attrs = r"(?:__\w+__\([^)]*\)\s*)*"  # __launch_bounds__(...), __maxnreg__(...)
    pat = re.compile(r'extern "C" __global__ void\s*' + attrs + kernel + r"\(([^)]*)\)")
    found = [m for src in srcs.values() if (m := pat.search(src))]
    assert len(found) == 1, f"{kernel}: {len(found)} definitions under {CUDA_CRATE}"
    params = found[0].group(1).strip()
    if re.fullmatch(r"\w+", params):  # a macro of the parameter list (several entry points)
        macro = re.compile(r"#define " + params + r"((?:[^\n]*\\\n)*[^\n]*)")
        defs = [d for src in srcs.values() if (d := macro.search(src))]
        assert len(defs) == 1, f"{kernel}: macro {params}: {len(defs)} definitions"
        params = defs[0].group(1).replace("\\\n", " ")
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
    # The script finds each kernel's file and compiles it with the shared header in front, as
    # the backend does, wherever the backend's layout puts them.
    for kernel in ("attn_decode", "attn_fast", "attn_fast_long"):
        path = attn.kernel_file(kernel)
        assert path.suffix == ".cu"
        assert CUDA_CRATE in path.parents
        src, dirs = attn.module_source(path)
        assert "struct Lay" in src, "common.cuh is not in the module's source"
        assert "PHASE_MARKS" in src
        assert src.endswith(path.read_text())
        assert path.parent in dirs


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
    # Tuning keys (lower case) join into LOWSYNC_CUDA_TUNE; variables (upper case) stay apart.
    assert kt.parse_variant("pf=pdl=0,LOWSYNC_CUDA_GRAPHS=0,gemv_blocks=3") == (
        "pf",
        {"LOWSYNC_CUDA_GRAPHS": "0", "LOWSYNC_CUDA_TUNE": "pdl=0,gemv_blocks=3"},
    )
    for bad in ["", "a b", "x=PDL", "x=Lower=1", "x==1", "x=pdl=", "x=LOWSYNC_CUDA_TUNE=pdl=0"]:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            kt.parse_variant(bad)


def test_kernel_trace_variants_override_the_environments_tuning_keys() -> None:
    kt = _module("kernel_trace")
    _, env = kt.parse_variant("v=gemv_blocks=3,pdl=0")
    merged = kt.with_tune(env, "pdl=1,copy_kernel=0")
    assert kt.tune_items(merged["LOWSYNC_CUDA_TUNE"]) == {
        "pdl": "0",
        "copy_kernel": "0",
        "gemv_blocks": "3",
    }
    assert kt.with_tune({"LOWSYNC_CUDA_GRAPHS": "0"}, "pdl=0") == {"LOWSYNC_CUDA_GRAPHS": "0"}
    assert kt.with_tune(env, "") == env


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
    # Driver calls (KTRACE_API=1): each step's graph launch (its correlation id) returned 30 us
    # before the step ahead of it ended (launch-ahead) for the second step, 5 us after it for
    # the third; API rows are no kernels of any step.
    apis = [
        "api:cuGraphLaunch,80000,82000,301",  # step 1 ends at 112 us: lead 30 us
        "api:cuGraphLaunch,212000,218000,302",  # step 2 ends at 213 us: lead -5 us
        "api:cuLaunchKernel,214000,215000,912",
    ]
    rows = kt.read_rows("\n".join(lines + apis))
    api_rows = [r for r in rows if kt.is_api(r)]
    assert len(api_rows) == 3
    kernel_rows = [r for r in rows if not kt.is_api(r)]
    api_steps, _, _ = kt.decode_steps(kernel_rows)
    assert kt.launch_leads(api_steps, api_rows) == [30.0, -5.0]


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
    argv = [sys.executable, str(PROFILE / "kernel_trace.py")]
    argv += ["--backend", "cpu", "--models", "tiny", "-n", "3", "--csv-dir", str(tmp_path)]
    argv += ["--variant", "base", "--variant", "other=pdl=0", "--rounds", "2"]
    env = {**os.environ, "CUDA_INJECTION64_PATH": str(lib)}
    env.pop("LOWSYNC_CUDA_TUNE", None)  # the file names carry the environment's pdl key
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("decode steps of 2 kernels") == 4, out
    assert sorted(p.name for p in tmp_path.glob("ktrace-*.csv")) == [
        f"ktrace-tiny-pdl1-{v}-r{r}.csv" for v in ("base", "other") for r in (0, 1)
    ]
    table = out[out.index("variants side by side") :]
    assert "| base | - | 10.0 | 11.0 | 1.000 |" in table, table
    assert "| other | LOWSYNC_CUDA_TUNE=pdl=0 | 10.0 | 11.0 | 1.000 |" in table, table
    bad = subprocess.run(
        [*argv[:2], "--variant", "x=oops"], capture_output=True, text=True, env=env, check=False
    )
    assert bad.returncode != 0
    assert "'x=oops'" in bad.stderr
    # A GGUF file instead of a built-in model: traced alike, its CSVs named by the file's stem.
    gguf = tmp_path / "micro.gguf"
    ls.save_gguf(ls.Llama.random("tiny", seed=2, dtype="f32"), gguf)
    argv = [sys.executable, str(PROFILE / "kernel_trace.py"), "--backend", "cpu", "-n", "3"]
    argv += ["--models", "", "--files", str(gguf), "--csv-dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "micro round 0: " in done.stdout
    assert (tmp_path / "ktrace-micro-pdl1-r0.csv").is_file()


def test_variants_tg_runs_variants_in_turn_and_reports_ratios(tmp_path: Path) -> None:
    """The A/B script on `cpu`: every variant of every round gets a row, the JSON holds each
    variant's settings, its tg and pp per round and their ratios to the first's, and a bad
    variant is an argument error that names it."""
    argv = [sys.executable, str(PROFILE / "variants_tg.py"), "--backend", "cpu"]
    argv += ["--models", "tiny", "--dtype", "q8_0", "-p", "8", "-n", "4", "--rounds", "2"]
    argv += ["--variant", "a", "--variant", "b=LOWSYNC_CPU_THREADS=1", "--tokens", "3"]
    argv += ["--json", str(tmp_path / "ab.json")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    for v in ("a", "b"):
        for r in (0, 1):
            assert f"tiny q8_0 {v} round {r}: tg " in done.stdout
    rows = json.loads((tmp_path / "ab.json").read_text())
    assert [(r["variant"], r["settings"]) for r in rows] == [
        ("a", "-"),
        ("b", "LOWSYNC_CPU_THREADS=1"),
    ]
    assert rows[0]["tg_ratio"] == 1.0
    assert rows[0]["pp_ratio"] == 1.0
    for r in rows:
        assert len(r["tg_all"]) == 2
        assert len(r["pp_all"]) == 2
        assert all(t > 0 for t in r["tg_all"] + r["pp_all"])
        assert r["tg_tps"] > 0
        assert r["pp_tps"] > 0
    assert rows[1]["tg_ratio"] == pytest.approx(rows[1]["tg_tps"] / rows[0]["tg_tps"])
    assert rows[1]["pp_ratio"] == pytest.approx(rows[1]["pp_tps"] / rows[0]["pp_tps"])
    assert "| tiny q8_0 | b | LOWSYNC_CPU_THREADS=1 |" in done.stdout
    # One thread or several: the CPU backend's greedy tokens do not change.
    assert "tiny q8_0 b: 3 greedy tokens, same as the first: True" in done.stdout
    assert [r["tokens_same"] for r in rows] == [True, True]
    assert done.stdout.rstrip().endswith("| same |")
    bad = subprocess.run(
        [*argv[:4], "--models", "tiny", "--variant", "x=oops"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0
    assert "'x=oops'" in bad.stderr


def _gpu_compare() -> ModuleType:
    return _module("compare_llama_cpp_gpu", ROOT / "benches" / "python")


def test_gpu_compare_warms_each_engine_up_once_and_survives_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The unrecorded first run: each engine once on the given file, in order, and a failing
    child is reported, not raised (the measured runs report it again)."""
    gc = _gpu_compare()
    args = gc.parse_args(["--backend", "vulkan"])
    calls: list[tuple[str, Path]] = []

    def lowsync_run(a: object, path: Path) -> dict[str, float]:
        calls.append(("lowsync", path))
        return {"tg_tps": 1.0}

    def llama_run(a: object, path: Path) -> dict[str, float]:
        calls.append(("llama.cpp", path))
        child = gc.cpu.Child(["llama-bench"], 1, "", "no device", 0.0, 0.0, 0.0)
        raise gc.cpu.ChildError(child, "llama-bench")

    monkeypatch.setattr(gc, "run_lowsync", lowsync_run)
    monkeypatch.setattr(gc, "run_llama_bench", llama_run)
    gc.warm_up(args, Path("first.gguf"))
    assert calls == [("lowsync", Path("first.gguf")), ("llama.cpp", Path("first.gguf"))]
    assert "warm-up (llama.cpp): llama-bench: exit status 1" in capsys.readouterr().err
    assert gc.parse_args(["--backend", "cuda", "--no-warmup"]).no_warmup


def test_gpu_compare_warms_up_on_the_first_file_of_each_weight_type() -> None:
    """A Vulkan engine compiles a weight type's pipelines when it first meets the type, so the
    warm-up runs on each type's first file, in the files' order, and on each extra file."""
    gc = _gpu_compare()
    paths = {
        "1b Q4_0": Path("1b-q4_0.gguf"),
        "1b F16": Path("1b-f16.gguf"),
        "tiny Q4_0": Path("tiny-q4_0.gguf"),
        "tiny F16": Path("tiny-f16.gguf"),
        "model.gguf": Path("/data/model.gguf"),
    }
    assert gc.warm_up_files(paths) == [
        Path("1b-q4_0.gguf"),
        Path("1b-f16.gguf"),
        Path("/data/model.gguf"),
    ]
    assert gc.warm_up_files({}) == []


def test_gpu_compare_checks_its_arguments() -> None:
    mod = _gpu_compare()
    args = mod.parse_args(["--backend", "cuda", "--types", "f16,q4_k_m"])
    assert args.build_dir.name == "llama.cpp-b11434-cuda"
    with pytest.raises(SystemExit):
        mod.parse_args(["--backend", "cuda", "--types", "q4_k_s"])  # not one it makes
    with pytest.raises(SystemExit):
        mod.parse_args(["--backend", "metal"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--backend", "vulkan", "--repeats", "0"])


def test_gpu_compare_guards_the_layer_settings_use(tmp_path: Path) -> None:
    """The Vulkan build's one source patch: the chained VK_EXT_layer_settings info compiles only
    where the header defines the extension, and a second call leaves the file as it is."""
    mod = _gpu_compare()
    src = tmp_path / "src"
    f = src / mod.VK_LAYER_SETTINGS_FILE
    f.parent.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    use = (
        "    VkBool32 enable_best_practice = layer_settings;\n"
        "    std::vector<vk::LayerSettingEXT> settings = {\n"
        '        { "VK_LAYER_KHRONOS_validation", "validate_best_practices", '
        "vk::LayerSettingTypeEXT::eBool32, 1, &enable_best_practice },\n"
        "    };\n"
        "    vk::LayerSettingsCreateInfoEXT layer_setting_info(settings);\n"
        "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, "
        "layers, extensions, &layer_setting_info);\n"
        "    vk_instance.instance = vk::createInstance(instance_create_info);\n"
    )
    f.write_text(use)
    args = mod.parse_args(["--backend", "vulkan", "--build-dir", str(tmp_path / "build")])
    copy = mod.vulkan_source(src, args)
    assert copy != src
    assert f.read_text() == use
    patched = (copy / mod.VK_LAYER_SETTINGS_FILE).read_text()
    lines = patched.splitlines()
    guard = lines.index("#ifdef VK_EXT_layer_settings // lowsync bench")
    assert lines[guard + 1].lstrip().startswith("std::vector<vk::LayerSettingEXT>")
    other = lines.index("#else")
    assert "&layer_setting_info" in lines[other - 1]
    assert lines[other + 1].endswith("layers, extensions);")
    assert lines[other + 2] == "#endif"
    assert lines[-1].lstrip().startswith("vk_instance.instance")
    assert mod.vulkan_source(src, args) == copy
    assert (copy / mod.VK_LAYER_SETTINGS_FILE).read_text() == patched
    f2 = tmp_path / "other" / mod.VK_LAYER_SETTINGS_FILE
    f2.parent.mkdir(parents=True)
    f2.write_text("// a release without the use\n")
    (tmp_path / "other" / "CMakeLists.txt").write_text("")
    args2 = mod.parse_args(["--backend", "vulkan", "--build-dir", str(tmp_path / "b2")])
    with pytest.raises(SystemExit, match="not where b11434 has it"):
        mod.vulkan_source(tmp_path / "other", args2)


def test_gpu_compare_counts_the_weights_a_step_reads(tmp_path: Path) -> None:
    """Every tensor but the embedding (one row of it per step), the embedding too when the head
    is tied to it."""
    import lowsync

    mod = _gpu_compare()
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    lowsync.save_gguf(lowsync.Llama.random("tiny", seed=1, dtype="f16"), path)
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    emb = tensors["token_embd.weight"]
    expected = sum(tensors.values()) - emb
    if "output.weight" not in tensors:
        expected += emb
    assert mod.weight_bytes_per_token(path) == expected
    assert 0 < expected < path.stat().st_size


def test_prefill_trace_sums_each_kernel_over_a_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    pt = _module("prefill_trace")
    assert pt.short("void gemm<float, 2>(int)") == "void gemm"
    rows = pt.read_rows("a,0,4000,1\nb<x, y>,4000,10000,2\na,10000,12000,3\nmemcpy:HtoD:8,0,500,4")
    pt.report("m", "q4_0", [(rows, 0.02)])
    out = capsys.readouterr().out
    assert "span 12 us, kernels 12 us, wall 20000 us" in out
    assert "| b | 1 | 6 | 50.0% |" in out
    assert "| a | 2 | 6 | 50.0% |" in out


def test_nvrtc_precompile_names_cubins_as_the_backend_does() -> None:
    """`scripts/gpu/nvrtc_precompile.py` finds every module of kernels.rs with the source the
    backend compiles (common.cuh, a newline, the module's parts) and hashes it with the
    backend's FNV-1a (the Rust unit test's vector), so its cubins carry the cache's names."""
    pre = _module("nvrtc_precompile", ROOT / "scripts" / "gpu")
    assert pre.fnv1a([b"ab", b"c"]) == 0x20BA9B3025A8B421
    assert pre.fnv1a([b"a", b"bc"]) != pre.fnv1a([b"ab", b"c"])
    rs = (CUDA_CRATE / "src" / "kernels.rs").read_text()
    block = rs[rs.index("const MODULES") :]
    listed = re.findall(r'^\s*\(\s*"(\w+)",', block[: block.index("\n];")], re.M)
    mods = pre.modules()
    assert sorted(mods) == sorted(listed)
    assert {"quant", "fused_gemv", "fused_attention"} <= set(mods)
    common = (CUDA_CRATE / "kernels" / "common.cuh").read_text()
    quant_h = (CUDA_CRATE / "kernels" / "quant.cuh").read_text()
    gemv = (CUDA_CRATE / "src" / "fusion" / "gemv.cu").read_text()
    assert mods["fused_gemv"] == f"{common}\n{quant_h}\n{gemv}"
    assert mods["norm"] == f"{common}\n" + (CUDA_CRATE / "kernels" / "norm.cu").read_text()
    # The per-type modules: once per block type, with the option kernels.rs adds (its unit test
    # asserts the same options and the `quant-qt4-sm_90-` file name).
    units = {label: (src, opts) for label, src, opts in pre.units("sm_90")}
    typed = [label for label in units if label.startswith("quant")]
    assert typed == [f"quant-qt{q}" for q in range(4, 16)]
    assert units["quant-qt4"] == (mods["quant"], ["--gpu-architecture=sm_90", "-DLOWSYNC_QT=4"])
    assert units["norm"] == (mods["norm"], ["--gpu-architecture=sm_90"])
    parted = [label for label in units if label.startswith("fused_gemv")]
    assert parted == [f"fused_gemv-part{p}" for p in range(1, 7)]
    assert units["fused_attention-part4"] == (
        mods["fused_attention"],
        ["--gpu-architecture=sm_90", "-DLOWSYNC_PART=4"],
    )
    assert "quant" not in units
    assert len(units) == len(mods) - 3 + 12 + 6 + 4


def test_cubin_regs_reads_cuobjdumps_listings() -> None:
    """`scripts/gpu/cubin_regs.py` takes each kernel's registers, stack and shared memory from
    `cuobjdump -res-usage` and counts the local-memory loads and stores in its SASS."""
    regs = _module("cubin_regs", ROOT / "scripts" / "gpu")
    usage = """
Resource usage:
 Common:
  GLOBAL:145 CONSTANT[4]:16
 Function fused_gemv1_q4_0:
  REG:76 STACK:40 SHARED:1536 LOCAL:0 CONSTANT[2]:468 CONSTANT[0]:1628 TEXTURE:0 SURFACE:0
 Function fused_gemv1_q6_k:
  REG:80 STACK:48 SHARED:0 LOCAL:0 CONSTANT[0]:1628 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    assert regs.parse_res_usage(usage) == [
        regs.Usage("fused_gemv1_q4_0", 76, 40, 1536),
        regs.Usage("fused_gemv1_q6_k", 80, 48, 0),
    ]
    sass = """
		Function : fused_gemv1_q4_0
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*06a0*/                   STL [R1+0x28], R4 ;
		Function : fused_gemv1_q6_k
        /*8fe0*/                   LDL R2, [R1+0x28] ;
        /*26ed0*/                  STL.64 [R0], R6 ;
        /*26f80*/              @P2 LDL.64 R6, [R1+0x10] ;
        /*26f90*/                  LDS.128 R16, [R13] ;
"""
    assert regs.local_ops(sass) == {"fused_gemv1_q4_0": 1, "fused_gemv1_q6_k": 3}
