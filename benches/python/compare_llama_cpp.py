"""lowsync against llama.cpp on the identical GGUF file, through a small C++ driver.

The driver, `benches/llama_cpp/compare.cpp` (built with `benches/llama_cpp/build.sh` into
`/tmp/llamacpp-build/compare`), calls llama.cpp's public C API: it loads a GGUF file on the
CPU, decodes a prompt in one batch, writes the last token's logits, generates greedily one
`llama_decode` per token and reports the decode time. This script writes each model's file,
runs the driver on it in a subprocess and loads the same file with `lowsync.load_gguf`, then
compares the last-token logits (max |Δ| / max |ref|) and the greedy tokens. With `--speed` it
also compares CPU decode tokens/s with the same thread count (`RAYON_NUM_THREADS` for lowsync,
`n_threads` for llama.cpp) and the same context size and KV-cache dtype.

Models: `--models tiny,small` are built-in random models (`Llama.random(name, dtype=...)`)
written with `save_gguf`; `--variants qwen2,qwen3,tied` (or `all`) are the small variant files
of `tests/llama_ref.py` (qwen2 with q/k/v biases and neox RoPE, qwen3 with q/k norms, tied
embeddings, ...), written with `gguf.GGUFWriter`. When llama.cpp cannot load a file, the row
says so and the end of llama.cpp's log is printed to stderr.

Prints one JSON line per model and dtype.

Run:
    benches/llama_cpp/build.sh
    python benches/python/compare_llama_cpp.py --models tiny --dtypes f32,f16 --variants
    python benches/python/compare_llama_cpp.py --models small --dtypes f16 --speed --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BIN = Path("/tmp/llamacpp-build/compare")
DEFAULT_VARIANTS = "qwen2,qwen3,tied"
# Dtypes of the 2-D weights: lowsync's name -> the GGUF type name `tests/llama_ref.py` uses.
DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny", help="built-in models, comma-separated ('' none)")
    ap.add_argument("--dtypes", default="f32", help="weight dtypes, comma-separated: f32,f16,bf16")
    ap.add_argument(
        "--variants",
        nargs="?",
        const=DEFAULT_VARIANTS,
        default="",
        help=f"tests/llama_ref.py variants, comma-separated or 'all' (flag alone: "
        f"{DEFAULT_VARIANTS})",
    )
    ap.add_argument("--bin", type=Path, default=DEFAULT_BIN, help="the compare binary")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("-n", type=int, default=32, help="decode steps (greedy tokens after the first)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--kv-dtype", default="f32", choices=("f32", "f16"))
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--speed", action="store_true", help="also time CPU decode tokens/s")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the GGUF files in this folder")
    ap.add_argument("--json", type=Path, default=None, help="also write all rows to this file")
    return ap.parse_args()


class LlamaCppError(RuntimeError):
    """The compare binary failed (e.g. llama.cpp refused the file); carries its log."""

    def __init__(self, rc: int, log: str) -> None:
        super().__init__(f"llama.cpp compare exited with status {rc}")
        self.rc = rc
        self.log = log


def run_llama_cpp(
    args: argparse.Namespace, path: Path, prompt: list[int], n_gen: int, quiet: bool
) -> dict[str, Any]:
    """Runs the compare binary on `path`; returns its JSON with `logits` as a numpy array."""
    logits_path = path.with_suffix(".logits.f32")
    cmd = [
        str(args.bin),
        str(path),
        str(args.threads),
        ",".join(str(t) for t in prompt),
        str(n_gen),
        "--logits-out",
        str(logits_path),
        "--kv",
        args.kv_dtype,
        "--n-ctx",
        str(args.n_ctx),
    ]
    if quiet:
        cmd.append("--quiet")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LlamaCppError(proc.returncode, proc.stderr + proc.stdout)
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["logits"] = np.fromfile(logits_path, dtype="<f4").astype(np.float64)
    out["log"] = proc.stderr
    if out["logits"].size != out["n_vocab"]:
        raise LlamaCppError(0, f"logits file has {out['logits'].size} values\n{proc.stderr}")
    return out


def compare_file(
    args: argparse.Namespace, label: dict[str, Any], path: Path, ls: Any
) -> dict[str, Any]:
    """Compares lowsync and llama.cpp on one GGUF file; returns the row."""
    row: dict[str, Any] = {**label, "threads": args.threads, "kv": args.kv_dtype}
    try:
        model = ls.load_gguf(path)
    except ValueError as e:
        row["lowsync_error"] = str(e)
        return row
    n_vocab = model.config.n_vocab
    rng = np.random.default_rng(11)
    low = 300 if n_vocab > 600 else 3
    prompt = [int(t) for t in rng.integers(low, n_vocab, args.prompt_len)]
    n_gen = args.n + 1  # the first token comes from the prompt, then n one-token decode steps

    try:
        ref = run_llama_cpp(args, path, prompt, n_gen, quiet=False)
    except LlamaCppError as e:
        row["llama_cpp_error"] = (
            f"killed by {signal.Signals(-e.rc).name}" if e.rc < 0 else f"exit status {e.rc}"
        )
        lines = e.log.strip().splitlines()
        keys = ("error", "failed", "GGML_ASSERT", "invalid", "unknown")
        row["llama_cpp_log"] = [ln for ln in lines if any(k in ln for k in keys)] or lines[-8:]
        print(f"--- llama.cpp log for {path} ---\n{e.log}", file=sys.stderr)
        return row

    sess = ls.Session(
        model, backends=["cpu"], n_ctx=args.n_ctx, policy="staged", kv_dtype=args.kv_dtype
    )
    logits = sess.decode(prompt, seq_id=0, logits="last")
    assert logits is not None
    ref_logits = ref["logits"]
    diff = np.abs(np.asarray(logits, np.float64) - ref_logits)
    row["logits_max_rel_diff"] = float(np.max(diff) / np.max(np.abs(ref_logits)))
    row["same_argmax"] = int(np.argmax(logits)) == int(np.argmax(ref_logits))
    sess.seq_rm(0)
    tokens = sess.generate(prompt, max_new_tokens=n_gen, seq_id=0)
    sess.seq_rm(0)
    same = tokens == ref["tokens"]
    row["same_greedy_tokens"] = same
    if not same:
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, ref["tokens"], strict=False)) if a != b),
            min(len(tokens), len(ref["tokens"])),
        )
        row["first_token_mismatch"] = first
        row["lowsync_tokens"] = tokens
        row["llama_cpp_tokens"] = ref["tokens"]

    if args.speed:
        cpp_tps = [ref["tg_tps"]]
        for _ in range(args.repeats - 1):
            cpp_tps.append(run_llama_cpp(args, path, prompt, n_gen, quiet=True)["tg_tps"])
        ls_tps = []
        for _ in range(args.repeats):
            sess.generate(prompt, max_new_tokens=n_gen, seq_id=0)
            sess.seq_rm(0)
            stats = sess.last_generate
            assert stats is not None
            ls_tps.append(stats.n_steps / stats.decode_s)
        row["decode_steps"] = args.n
        row["n_ctx"] = args.n_ctx
        row["llama_cpp_tg_tps"] = round(median(cpp_tps), 2)
        row["lowsync_cpu_tg_tps"] = round(median(ls_tps), 2)
        row["lowsync_over_llama_cpp"] = round(median(ls_tps) / median(cpp_tps), 3)
        row["llama_cpp_tg_tps_runs"] = [round(x, 2) for x in cpp_tps]
        row["lowsync_cpu_tg_tps_runs"] = [round(x, 2) for x in ls_tps]
    return row


Writer = tuple[dict[str, Any], Callable[[Path], None]]


def writers(args: argparse.Namespace, ls: Any) -> list[Writer]:
    """(label, write(path)) for every model file to compare."""
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        sys.exit(f"unknown dtypes {bad}; supported: {', '.join(DTYPES)}")
    out: list[Writer] = []
    for name in (m for m in args.models.split(",") if m):
        for dtype in dtypes:

            def write_builtin(path: Path, name: str = name, dtype: str = dtype) -> None:
                ls.Llama.random(name, seed=args.seed, dtype=dtype).save_gguf(path)

            out.append(({"model": name, "dtype": dtype, "writer": "save_gguf"}, write_builtin))
    if args.variants:
        sys.path.insert(0, str(REPO / "tests"))
        import llama_ref

        names = list(llama_ref.VARIANTS) if args.variants == "all" else args.variants.split(",")
        unknown = [v for v in names if v not in llama_ref.VARIANTS]
        if unknown:
            sys.exit(f"unknown variants {unknown}; known: {', '.join(llama_ref.VARIANTS)}")
        for variant in names:
            for dtype in dtypes:

                def write_variant(path: Path, variant: str = variant, dtype: str = dtype) -> None:
                    spec = llama_ref.VARIANTS[variant].with_(wtype=DTYPES[dtype])
                    llama_ref.write_gguf(path, spec, llama_ref.random_weights(spec, args.seed))

                label = {"model": variant, "dtype": dtype, "writer": "tests/llama_ref.py"}
                out.append((label, write_variant))
    return out


def main() -> None:
    args = parse_args()
    # lowsync's CPU kernels run on rayon's global pool, sized on first use.
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import lowsync as ls

    if not args.bin.is_file():
        sys.exit(f"{args.bin} does not exist; build it with benches/llama_cpp/build.sh")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for label, write in writers(args, ls):
            path = folder / f"{label['model']}-{label['dtype']}.gguf"
            t0 = time.perf_counter()
            write(path)
            row = compare_file(args, label, path, ls)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
