"""lowsync against PyTorch (transformers `generate`) on one GPU, in one process, per token.

Why: lowsync's decode speed means little on its own. This script puts it next to the usual
PyTorch paths on the same device, the same weights and the same prompt, and next to the floor
the memory system sets: a decode step must read every weight once, so tokens/s can be at most
(read bandwidth) / (bytes per token). Each row reports its tokens/s and its % of that floor.

How: for each model (built-in random configs, `lowsync.Llama.random(name, seed)`, F16
matrices by default), the lowsync model is written with `save_gguf` and the same file is
loaded into transformers (`from_pretrained(dir, gguf_file=...)`, which un-permutes Q/K from
GGUF's rotary layout), so both hold identical weights. Every row generates greedily from the
same prompt; warm-up runs are excluded; each timed run starts from a fresh cache, and the time
per token is `(t(n_long) - t(n_short)) / (n_long - n_short)`, which cancels the prompt, the
first token and every fixed cost of a call (medians over `--reps`, short and long interleaved).
Rows:

- `lowsync`: a `Session` on `cuda` with the default settings (graph replay on, launch-ahead on);
  `lowsync-noahead` sets `LOWSYNC_LAUNCH_AHEAD=0` (the step loop reads token t before it queues
  step t+1), `lowsync-nographs` sets `LOWSYNC_CUDA_GRAPHS=0`, and a `-timing` suffix sets
  `LOWSYNC_CUDA_TIMING=1` (`lowsync-timing`, `lowsync-nographs-timing`). The variables are
  read when a backend is created, i.e. when a `Session` makes its `Context`, so each row has
  its own session, made while its variables are set. Counter deltas (`Context.stats()`) give
  host waits, copies, kernel and graph launches per generated token; with timing on, the
  `device_ns` counter gives device time per token and the rest of the wall time is the host's.
- `hf-eager`: `generate(do_sample=False, min_new_tokens=max_new_tokens=n)`, dynamic cache.
- `hf-compile`: static cache and `torch.compile(mode="reduce-overhead")` (CUDA graphs):
  through `generate(cache_implementation="static", compile_config=CompileConfig(...))` where
  transformers has it (>= 4.47), else by compiling `model.forward` by hand. `--hf-compile-api`
  forces either; the row says which ran and whether a compiled call was really used.

Every row compares its greedy tokens (the first 32 of the short run) with `hf-eager`'s.
The floor: read bandwidth is measured in this process over a >= 4 GB device tensor, timed with
CUDA events: the best of several `sum`/`amax` passes with torch and of reads by our own streaming
kernel (`benches/profile/stream_probe.py`, through NVRTC; 10-15% faster than torch's reductions
on an H200, so floors before it was added are that much lower); bytes per token are every
weight tensor once, `token_embd` as one row, plus the KV cache read at the timed window's
mean position (layers x 2 x n_head_kv x head_dim x position x KV element size).

`--device cpu` runs lowsync's `cpu` backend and transformers on the CPU (no compile row unless
asked for, host bandwidth measured with torch or numpy), so the script can be tried without a
GPU. One row's failure is reported in the table and the JSON; the other rows still run.

Run (GPU; lowsync and gguf on PYTHONPATH, e.g. /tmp/site of scripts/gpu/h200_all.sh):
    python benches/python/compare_torch.py --models tiny,1b --json /tmp/compare_torch.json
Try (no GPU):
    python benches/python/compare_torch.py --device cpu --models tiny --rows lowsync,hf-eager
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import lowsync as ls
from lowsync.bench import env_vars, format_table

LOWSYNC_ROWS = (
    "lowsync",
    "lowsync-noahead",
    "lowsync-nographs",
    "lowsync-timing",
    "lowsync-nographs-timing",
)
HF_ROWS = ("hf-eager", "hf-compile")
PROFILE = Path(__file__).resolve().parents[1] / "profile"  # stream_probe.py, cuda_driver.py
DEFAULT_ROWS = {
    "cuda": "lowsync,lowsync-noahead,lowsync-nographs,lowsync-timing,hf-eager,hf-compile",
    # No compile row on the CPU by default: inductor's CPU build is slow and CUDA graphs
    # (the point of reduce-overhead) do not exist there.
    "cpu": "lowsync,hf-eager",
}
# Counters reported per generated token for lowsync rows (a name the wheel lacks is skipped).
COUNTERS = (
    "host_waits",
    "h2d_copies",
    "d2h_copies",
    "kernel_launches",
    "graph_launches",
    "graph_captures",
    "d2d_copies",
)
N_COMPARE = 32  # greedy tokens compared with hf-eager's
BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,1b", help="built-in models, comma-separated")
    ap.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated subset of {', '.join(LOWSYNC_ROWS + HF_ROWS)} "
        f"(default on cuda: {DEFAULT_ROWS['cuda']}; on cpu: {DEFAULT_ROWS['cpu']})",
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--n-short", type=int, default=32)
    ap.add_argument("--n-long", type=int, default=160)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1, help="weights and prompt")
    ap.add_argument("--dtype", default="f16", choices=("f16", "bf16", "f32"), help="matrices")
    ap.add_argument(
        "--kv-dtype",
        default="f16",
        choices=("f16", "bf16", "f32"),
        help="lowsync's KV cache (Session's own default is f32; f16 matches transformers' cache "
        "for an f16 model)",
    )
    ap.add_argument("--reps", type=int, default=3, help="timed runs per length (median)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed runs per length and row (lowsync captures a plan's CUDA graph on its "
        "second run; each generate runs the prompt plan once)",
    )
    ap.add_argument(
        "--compile-warmup",
        type=int,
        default=3,
        help="untimed runs per length for hf-compile (they include compilation and capture)",
    )
    ap.add_argument(
        "--hf-compile-api",
        default="auto",
        choices=("auto", "compile_config", "manual"),
        help="compile_config: generate(compile_config=CompileConfig(...)); manual: "
        "torch.compile(model.forward); auto: the first where transformers has it",
    )
    ap.add_argument(
        "--no-fullgraph",
        action="store_true",
        help="compile with fullgraph=False at once (default: fullgraph=True, falling back)",
    )
    ap.add_argument("--lowsync-backend", default=None, help="default: cuda, or cpu on --device cpu")
    ap.add_argument(
        "--bw-gb",
        type=float,
        default=None,
        help="size of the bandwidth probe in GB (default 4.5 on cuda, 1 on cpu; 0: skip)",
    )
    ap.add_argument("--bw-reps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args()
    if not 0 < args.n_short < args.n_long:
        ap.error("need 0 < --n-short < --n-long")
    if args.prompt_len < 1 or args.reps < 1 or args.warmup < 0 or args.compile_warmup < 1:
        ap.error("--prompt-len and --reps must be >= 1, --warmup >= 0, --compile-warmup >= 1")
    rows = [r.strip() for r in (args.rows or DEFAULT_ROWS[args.device]).split(",") if r.strip()]
    unknown = [r for r in rows if r not in LOWSYNC_ROWS + HF_ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {', '.join(LOWSYNC_ROWS + HF_ROWS)}")
    args.rows = rows
    if args.lowsync_backend is None:
        args.lowsync_backend = "cuda" if args.device == "cuda" else "cpu"
    if args.bw_gb is None:
        args.bw_gb = 4.5 if args.device == "cuda" else 1.0
    return args


# ---- helpers ------------------------------------------------------------------------------------


def _torch() -> Any:
    """torch, or None when it is not installed (the lowsync rows still run)."""
    try:
        import torch
    except ModuleNotFoundError:
        return None
    return torch


def _sync(device: str) -> None:
    torch = _torch()
    if device == "cuda" and torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _error(e: BaseException) -> str:
    """A one-line error for the table; the full traceback goes to stderr."""
    traceback.print_exc(file=sys.stderr)
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def timed_pairs(
    run: Callable[[int], dict[str, Any]], n_short: int, n_long: int, reps: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`reps` timed runs of each length, short and long interleaved so drift hits both."""
    shorts, longs = [], []
    for _ in range(reps):
        shorts.append(run(n_short))
        longs.append(run(n_long))
    return shorts, longs


def per_token_from(
    shorts: list[dict[str, Any]], longs: list[dict[str, Any]], n_short: int, n_long: int
) -> dict[str, Any]:
    """The row's timing figures: medians of each length and their difference per token."""
    ts = [r["t"] for r in shorts]
    tl = [r["t"] for r in longs]
    per_token = (statistics.median(tl) - statistics.median(ts)) / (n_long - n_short)
    return {
        "t_short_s": ts,
        "t_long_s": tl,
        "t_short_median_s": statistics.median(ts),
        "t_long_median_s": statistics.median(tl),
        "per_token_ms": per_token * 1e3,
        "tok_s": 1.0 / per_token if per_token > 0 else None,
    }


# ---- bandwidth and bytes per token --------------------------------------------------------------


def measure_bandwidth(device: str, gb: float, reps: int) -> dict[str, Any]:
    """Read bandwidth in this process: the best of `reps` reductions over a `gb` GB tensor.

    A reduction reads its input once and writes one value, so bytes / time is the streaming
    read rate that a decode step's weight reads can reach. float32 keeps the element count
    below 2**31 for up to 8 GB, so the reduction runs as one kernel.
    """
    if gb <= 0:
        return {"skipped": "--bw-gb 0"}
    torch = _torch()
    n = int(gb * 1e9) // 4
    if device == "cuda":
        if torch is None:
            return {"error": "torch is not installed"}
        return {"bytes": n * 4, **_device_bandwidth(torch, n, reps)}
    if torch is None:
        # Without torch: numpy's sum, one thread, so this understates the host's bandwidth.
        best = min(_wall(np.ones(n, np.float32).sum) for _ in range(reps))
        method = "numpy.sum (1 thread)"
    else:
        x = torch.ones(n, dtype=torch.float32)
        best = min(_wall(x.sum) for _ in range(reps))
        method = f"torch.sum on the CPU ({torch.get_num_threads()} threads), best of {reps}"
    return {"bytes": n * 4, "method": method, "best_s": best, "gb_s": n * 4 / best / 1e9}


def _device_bandwidth(torch: Any, n: int, reps: int) -> dict[str, Any]:
    free, total = torch.cuda.mem_get_info()
    if n * 4 > free - (1 << 30):
        return {"error": f"{n * 4 / 1e9:.1f} GB does not fit ({free / 1e9:.1f} GB free)"}
    x = torch.ones(n, dtype=torch.float32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_kernel: dict[str, float] = {}
    for name, fn in (("sum", x.sum), ("amax", x.amax)):
        fn()  # first launch: kernel load, allocator
        torch.cuda.synchronize()
        best_ms = float("inf")
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            best_ms = min(best_ms, start.elapsed_time(end))
        per_kernel[name] = n * 4 / (best_ms / 1e3) / 1e9
    probe_error = None
    try:  # our own streaming read (stream_probe.py): faster than torch's reductions on an H200
        sys.path.insert(0, str(PROFILE))
        from cuda_driver import Cuda
        from stream_probe import StreamRead

        def timer(call: Callable[[], Any]) -> float:
            start.record()
            call()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        per_kernel["stream_read"] = StreamRead(Cuda()).best_gb_s(x.data_ptr(), n * 4, reps, timer)
    except Exception as e:  # no NVRTC: the floor rests on torch's reductions alone
        probe_error = _error(e)
    del x, fn  # give the memory back before the models load
    torch.cuda.empty_cache()
    best = max(per_kernel, key=lambda k: per_kernel[k])
    how = "stream_probe.py's kernel" if best == "stream_read" else f"torch.{best}"
    return {
        "method": f"{how} over a float32 device tensor, CUDA events, best of {reps} "
        f"(of {', '.join(per_kernel)})",
        "gb_s_per_kernel": per_kernel,
        **({"stream_read_error": probe_error} if probe_error else {}),
        "gb_s": per_kernel[best],
        "device_total_bytes": total,
    }


def _wall(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bytes_per_token(model: ls.Llama, mean_pos: float, kv_bytes: int) -> dict[str, float]:
    """Bytes one decode step must read at least: each weight once (the embedding table only
    for its one row, unless the output projection reuses it) and the KV cache up to `mean_pos`.
    """
    cfg = model.config
    weights = 0
    for name, w in model.weights.items():
        nbytes = int(w.nbytes)
        if name == "token_embd.weight" and not cfg.tied_embeddings:
            nbytes = int(w.shape[1]) * w.itemsize  # get_rows reads one row
        elif model.dtypes.get(name) == "bf16":
            nbytes = int(w.size) * 2  # bf16 values are held in float32 arrays
        weights += nbytes
    kv = cfg.n_layer * 2 * cfg.n_head_kv * cfg.head_dim * mean_pos * kv_bytes
    return {"weights": float(weights), "kv": float(kv), "total": float(weights + kv)}


# ---- lowsync rows -------------------------------------------------------------------------------


def lowsync_row(
    args: argparse.Namespace, model: ls.Llama, prompt: list[int], row: str
) -> dict[str, Any]:
    """One lowsync row: its own Session, made while the row's CUDA variables are set."""
    flags = set(row.split("-")[1:])
    env = {
        "LOWSYNC_CUDA_GRAPHS": "0" if "nographs" in flags else "1",
        "LOWSYNC_CUDA_TIMING": "1" if "timing" in flags else "0",
        "LOWSYNC_LAUNCH_AHEAD": "0" if "noahead" in flags else "1",
    }
    out: dict[str, Any] = {"env": env, "backend": args.lowsync_backend, "kv_dtype": args.kv_dtype}
    if flags - {"noahead"} and not args.lowsync_backend.startswith("cuda"):
        out["skipped"] = "the CUDA variables do nothing on " + args.lowsync_backend
        return out
    names = set(ls.stat_names())
    counters = [c for c in COUNTERS if c in names]
    timing = "timing" in flags and "device_ns" in names
    if "timing" in flags and not timing:
        out["note"] = "this lowsync build has no device_ns counter"
    with env_vars(env):
        sess = ls.Session(
            model,
            backends=[args.lowsync_backend],
            n_ctx=args.prompt_len + args.n_long,
            n_seq=1,
            n_ubatch=args.prompt_len,
            kv_dtype=args.kv_dtype,
        )
    out["policy"] = sess.policy
    out["launch_ahead"] = sess.launch_ahead
    # lowsync's attention spans every cache row under a mask (fixed shapes), not the position.
    out["kv_rows_attended"] = args.prompt_len + args.n_long + 1
    try:
        out.update(time_session(args, sess, prompt, counters, timing))
    finally:
        del sess  # frees the row's device memory before the next row makes its own
        gc.collect()
    return out


def time_session(
    args: argparse.Namespace,
    sess: ls.Session,
    prompt: list[int],
    counters: list[str],
    timing: bool,
) -> dict[str, Any]:
    want = [*counters, "device_ns"] if timing else counters

    def run(n: int) -> dict[str, Any]:
        sess.clear()  # fresh state: every cell free, the prompt decoded again
        sess.context.synchronize()
        before = sess.stats()["total"]
        t0 = time.perf_counter()
        tokens = sess.generate(prompt, max_new_tokens=n)
        sess.context.synchronize()  # generate's last read has waited; this one is elided
        t = time.perf_counter() - t0
        after = sess.stats()["total"]
        if len(tokens) != n:
            raise RuntimeError(f"generate returned {len(tokens)} tokens, asked for {n}")
        return {"t": t, "tokens": tokens, "d": {c: after[c] - before[c] for c in want}}

    for _ in range(args.warmup):
        run(args.n_long)
        run(args.n_short)
    shorts, longs = timed_pairs(run, args.n_short, args.n_long, args.reps)
    out = per_token_from(shorts, longs, args.n_short, args.n_long)
    out["tokens"] = shorts[0]["tokens"][:N_COMPARE]
    span = args.n_long - args.n_short
    # Counts do not depend on timing: one short and one long run give them exactly.
    out["per_token"] = {c: (longs[0]["d"][c] - shorts[0]["d"][c]) / span for c in counters}
    if timing:
        dev_s = statistics.median(r["d"]["device_ns"] for r in shorts)
        dev_l = statistics.median(r["d"]["device_ns"] for r in longs)
        device_ms = (dev_l - dev_s) / span / 1e6
        out["device_ms_per_token"] = device_ms
        out["host_ms_per_token"] = out["per_token_ms"] - device_ms
    return out


# ---- transformers rows --------------------------------------------------------------------------


class HF:
    """The transformers model loaded from the lowsync model's GGUF file, and its generate."""

    def __init__(self, args: argparse.Namespace, model: ls.Llama, prompt: list[int]) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.args = args
        self.device = args.device
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
        # transformers 4.56 renamed `torch_dtype` to `dtype` (the old name still works, warning).
        major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "model.gguf"
            model.save_gguf(path)
            hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, **{dtype_kw: dtype})
        self.model = hf.to(args.device).eval()
        # No early stop: the GGUF's eos id would make min_new_tokens mask that token, and
        # lowsync's greedy choice must not be masked. Generation then stops at max_new_tokens.
        self.model.generation_config.eos_token_id = None
        self.ids = torch.tensor([prompt], device=args.device)
        self.mask = torch.ones_like(self.ids)
        self.attn = getattr(hf.config, "_attn_implementation", None)

    def generate(self, n: int, **extra: Any) -> dict[str, Any]:
        _sync(self.device)
        t0 = time.perf_counter()
        # generate runs under no_grad itself; no inference_mode around it, as users call it.
        out = self.model.generate(
            input_ids=self.ids,
            attention_mask=self.mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
        _sync(self.device)
        t = time.perf_counter() - t0
        tokens = [int(v) for v in out[0, self.ids.shape[1] :].tolist()]
        if len(tokens) != n:
            raise RuntimeError(f"generate returned {len(tokens)} tokens, asked for {n}")
        return {"t": t, "tokens": tokens}

    def eager(self) -> dict[str, Any]:
        a = self.args
        for _ in range(a.warmup):
            self.generate(a.n_long)
            self.generate(a.n_short)
        shorts, longs = timed_pairs(self.generate, a.n_short, a.n_long, a.reps)
        out = per_token_from(shorts, longs, a.n_short, a.n_long)
        out.update(tokens=shorts[0]["tokens"][:N_COMPARE], attn_implementation=self.attn)
        return out

    def compiled(self) -> dict[str, Any]:
        """Static cache + reduce-overhead compile; tries fullgraph=True first unless told not to.

        The first warm-up generate is the long one: transformers keeps a static cache at least
        as long as the longest request so far (and sizes new ones to that), so every later
        call reuses the same cache shape and no timed call recompiles.
        """
        api = self._compile_api()
        out: dict[str, Any] = {"api": api, "attn_implementation": self.attn}
        attempts = (False,) if self.args.no_fullgraph else (True, False)
        for i, fullgraph in enumerate(attempts):
            try:
                out.update(self._compiled_once(api, fullgraph))
            except Exception as e:
                if i == len(attempts) - 1:
                    raise
                # A graph break under fullgraph=True: say so, and compile with breaks allowed.
                out["fullgraph_error"] = _error(e)
                self.torch._dynamo.reset()
                continue
            out["fullgraph"] = fullgraph
            break
        return out

    def _compile_api(self) -> str:
        if self.args.hf_compile_api != "auto":
            return str(self.args.hf_compile_api)
        try:
            from transformers import CompileConfig, GenerationConfig  # noqa: F401
        except ImportError:
            return "manual"
        return "compile_config" if hasattr(GenerationConfig(), "compile_config") else "manual"

    def _compiled_once(self, api: str, fullgraph: bool) -> dict[str, Any]:
        torch, a, hf = self.torch, self.args, self.model
        counters = _dynamo_counters(torch)
        extra: dict[str, Any] = {"cache_implementation": "static"}
        restore: Callable[[], None] = lambda: None  # noqa: E731
        if api == "compile_config":
            from transformers import CompileConfig

            cc = CompileConfig(mode="reduce-overhead", fullgraph=fullgraph)
            if self.device != "cuda":
                # generate compiles on the CPU only when asked to (a testing switch).
                cc._compile_all_devices = True
            extra["compile_config"] = cc
        else:
            # Older transformers: generate compiles nothing; compile the forward it calls. A
            # newer one would also compile generate's call around it: `disable_compile` stops
            # that where it exists.
            from transformers import GenerationConfig

            if hasattr(GenerationConfig(), "disable_compile"):
                extra["disable_compile"] = True
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=fullgraph)

            def restore() -> None:
                del hf.forward  # the instance attribute; the class's forward shows again

        try:
            c0 = counters()
            for _ in range(a.compile_warmup):
                self.generate(a.n_long, **extra)
                self.generate(a.n_short, **extra)
            c1 = counters()
            shorts, longs = timed_pairs(
                lambda n: self.generate(n, **extra), a.n_short, a.n_long, a.reps
            )
            c2 = counters()
        finally:
            restore()
        out = per_token_from(shorts, longs, a.n_short, a.n_long)
        out["tokens"] = shorts[0]["tokens"][:N_COMPARE]
        # Evidence that compiled code ran (dynamo built a graph during warm-up, or generate
        # kept its compiled call) and was not rebuilt while timed.
        out["compiled_call_used"] = c1.get("unique_graphs", 0) > c0.get("unique_graphs", 0) or (
            api == "compile_config" and getattr(hf, "_compiled_call", None) is not None
        )
        out["dynamo_during_warmup"] = {k: c1[k] - c0.get(k, 0) for k in c1}
        out["dynamo_during_timing"] = {k: c2[k] - c1.get(k, 0) for k in c2}
        notes = []
        if not out["compiled_call_used"]:
            notes.append("generate did not use a compiled forward (criteria not met)")
        if out["dynamo_during_timing"].get("unique_graphs", 0):
            notes.append("torch.compile built new graphs during the timed runs")
        skips = out["dynamo_during_warmup"].get("cudagraph_skips", 0)
        if skips and self.device == "cuda":
            notes.append(f"inductor skipped CUDA graphs {skips} time(s) (see stderr)")
        if notes:
            out["note"] = "; ".join(notes)
        return out


def _dynamo_counters(torch: Any) -> Callable[[], dict[str, int]]:
    """A snapshot function of the dynamo/inductor counters that show recompiles and skipped
    CUDA graphs (empty when this torch does not have them)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return dict

    def snap() -> dict[str, int]:
        return {
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "calls_captured": int(counters["stats"]["calls_captured"]),
            "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        }

    return snap


# ---- one model ----------------------------------------------------------------------------------


def run_model(args: argparse.Namespace, name: str, bandwidth: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = ls.Llama.random(name, seed=args.seed, dtype=args.dtype)
    rng = np.random.default_rng(args.seed)
    # Ids from 3: no special token (and never 0, the pad id given to generate).
    prompt = [int(t) for t in rng.integers(3, model.config.n_vocab, args.prompt_len)]
    # The timed window is the steps that make tokens n_short+1 .. n_long; the step making
    # token i (i >= 2) attends prompt_len + i - 1 positions.
    mean_pos = args.prompt_len + (args.n_short + args.n_long - 1) / 2
    result: dict[str, Any] = {
        "model": name,
        "params": model.n_params,
        "weight_dtype": model.weight_type,
        "config": dict(vars(model.config)),
        "prompt": prompt,
        "mean_kv_position": mean_pos,
        "weight_bytes_per_token": bytes_per_token(model, 0.0, 0)["weights"],
        "rows": {},
    }
    print(f"[{name}] built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows: dict[str, dict[str, Any]] = result["rows"]

    for row in (r for r in args.rows if r in LOWSYNC_ROWS):
        print(f"[{name}] {row}", file=sys.stderr)
        try:
            rows[row] = lowsync_row(args, model, prompt, row)
        except Exception as e:
            rows[row] = {"error": _error(e)}

    hf_rows = [r for r in args.rows if r in HF_ROWS]
    if hf_rows:
        hf: HF | None = None
        try:
            print(f"[{name}] loading the GGUF into transformers", file=sys.stderr)
            hf = HF(args, model, prompt)
        except Exception as e:
            err = _error(e)
            for row in hf_rows:
                rows[row] = {"error": "loading: " + err}
        if hf is not None:
            # Eager first: the manual compile path replaces model.forward while it runs.
            for row in sorted(hf_rows, key=HF_ROWS.index):
                print(f"[{name}] {row}", file=sys.stderr)
                try:
                    rows[row] = hf.eager() if row == "hf-eager" else hf.compiled()
                except Exception as e:
                    rows[row] = {"error": _error(e)}
            del hf
            torch = _torch()
            if torch is not None:
                # Compiled code and CUDA-graph pools keep the model alive until dynamo forgets.
                torch._dynamo.reset()
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()

    # Greedy tokens against hf-eager's, and the floor for each row's KV dtype.
    ref = rows.get("hf-eager", {}).get("tokens")
    gb_s = bandwidth.get("gb_s")
    floors: dict[str, Any] = {}
    for row, r in rows.items():
        if ref is not None and "tokens" in r:
            r["tokens_equal_hf_eager"] = r["tokens"] == ref
            r["first_divergence"] = first_divergence(r["tokens"], ref)
        kv = args.kv_dtype if row.startswith("lowsync") else args.dtype
        b = bytes_per_token(model, mean_pos, BYTES[kv])
        r["bytes_per_token"] = b
        if gb_s:
            floor = gb_s * 1e9 / b["total"]
            r["floor_tok_s"] = floor
            floors[kv] = floor
            if r.get("tok_s"):
                r["pct_of_floor"] = 100.0 * r["tok_s"] / floor
    result["floor_tok_s"] = floors
    return result


# ---- output -------------------------------------------------------------------------------------


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_tables(results: list[dict[str, Any]], bandwidth: dict[str, Any], args: Any) -> None:
    span = f"per token = (t({args.n_long}) - t({args.n_short})) / {args.n_long - args.n_short}"
    print(f"\nprompt {args.prompt_len} tokens; {span}; medians of {args.reps} runs")
    if "gb_s" in bandwidth:
        print(f"read bandwidth: {bandwidth['gb_s']:.0f} GB/s ({bandwidth['method']})")
    else:
        print(f"read bandwidth: not measured ({bandwidth})")
    for res in results:
        floors = ", ".join(f"{v:.0f} tok/s (KV {k})" for k, v in res["floor_tok_s"].items())
        print(
            f"\n{res['model']}: {res['params'] / 1e6:.1f} M params, {res['weight_dtype']}; "
            f"bytes/token {res['weight_bytes_per_token'] / 1e6:.1f} MB weights + KV at mean "
            f"position {res['mean_kv_position']:g}; floor {floors or '-'}"
        )
        header = ["row", "ms/tok", "tok/s", "% floor", f"t({args.n_short}) ms"]
        header += [f"t({args.n_long}) ms", "= eager"]
        body, notes = [], []
        for row, r in res["rows"].items():
            note = r.get("error") or r.get("skipped") or r.get("note") or ""
            if row == "hf-compile" and "api" in r:
                note = f"{r['api']}, fullgraph={r.get('fullgraph')}" + (f"; {note}" if note else "")
            if note:
                notes.append(f"  {row}: {note}")
            eq = r.get("tokens_equal_hf_eager")
            t_s, t_l = r.get("t_short_median_s"), r.get("t_long_median_s")
            body.append(
                [
                    row,
                    _f(r.get("per_token_ms"), ".3f"),
                    _f(r.get("tok_s"), ".1f"),
                    _f(r.get("pct_of_floor"), ".1f"),
                    _f(None if t_s is None else t_s * 1e3, ".1f"),
                    _f(None if t_l is None else t_l * 1e3, ".1f"),
                    "-" if eq is None else ("yes" if eq else f"no (@{r['first_divergence']})"),
                ]
            )
        print(format_table(header, body, n_left=1))
        if notes:
            print("\n".join(notes))
        ls_rows = {k: v for k, v in res["rows"].items() if "per_token" in v}
        if ls_rows:
            names = list(next(iter(ls_rows.values()))["per_token"])
            header = ["lowsync row", *names, "wall ms/tok", "device ms/tok", "host ms/tok"]
            body = [
                [
                    row,
                    *(f"{r['per_token'][c]:.2f}" for c in names),
                    _f(r.get("per_token_ms"), ".3f"),
                    _f(r.get("device_ms_per_token"), ".3f"),
                    _f(r.get("host_ms_per_token"), ".3f"),
                ]
                for row, r in ls_rows.items()
            ]
            print("counters per generated token:")
            print(format_table(header, body, n_left=1))


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"lowsync": ls.__version__, "python": sys.version.split()[0]}
    torch = _torch()
    if torch is not None:
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ModuleNotFoundError:
        pass
    return out


def main() -> None:
    args = parse_args()
    if any(r in HF_ROWS for r in args.rows):
        try:
            import transformers

            # generate's per-call advice (flags, cache notes) would bury the table; errors stay.
            transformers.logging.set_verbosity_error()
        except ModuleNotFoundError:
            print("transformers is not installed: its rows will report errors", file=sys.stderr)
    try:
        bandwidth = measure_bandwidth(args.device, args.bw_gb, args.bw_reps)
    except Exception as e:
        bandwidth = {"error": _error(e)}
    results = []
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        results.append(run_model(args, name, bandwidth))
    print_tables(results, bandwidth, args)
    if args.json:
        report = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "versions": versions(),
            "lowsync_env": {k: v for k, v in os.environ.items() if k.startswith("LOWSYNC_")},
            "bandwidth": bandwidth,
            "models": results,
        }
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
