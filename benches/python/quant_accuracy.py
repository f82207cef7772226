"""Logits of llama.cpp-quantized files of every block type, on every backend, against a float64
reference over gguf-py-dequantized weights.

Why: the quantization issue's accuracy goal is stated on files made by llama.cpp's own
`llama-quantize` (not lowsync's quantizers), measured against an independent reference: a
float64 forward pass (`tests/llama_ref.py`, which shares no code with lowsync) over weights
dequantized by `gguf.quants.dequantize`. The bound is 3e-2 relative where activations are
quantized to 8 bits and 1e-3 where they are not: lowsync's CPU prefill products (6 or more
tokens in a ubatch, as `--tokens` 8 is) over Q4_0, Q4_K and Q6_K take 8-bit activation blocks
(`LOWSYNC_CPU_PREFILL_ACT` in docs/tuning.md; `q16` keeps 16 bits, `q8` takes 8 bits on Q4_1 and
Q8_0 too where the CPU lacks AVX-512 VNNI), and so do decode products (fewer tokens in a
ubatch) with `LOWSYNC_CPU_DECODE_ACT=q8` on CPUs without AVX-512 VNNI, so those rows are held
to 3e-2; every other row, and every prefill row with `LOWSYNC_CPU_PREFILL_ACT=q16`, to 1e-3.
CUDA's one-row (decode) products take 8-bit activation blocks with
`LOWSYNC_CUDA_TUNE=qdot=q8`: its `cuda` rows are held to 3e-2 when that is set and `--ubatch 1`
makes every product one row. `--bound` sets one bound for every row.

Strategy: the built-in model (`--model`, random weights, `--seed`) is written as F32 by
`save_gguf`; `llama-quantize --pure` makes one file per type from it (every 2-D tensor of that
type; the types llama.cpp chooses where a tensor's row does not fit a 256-value super-block are
reported as they are). Each file is loaded with `lowsync.load_gguf`, decoded on each backend of
`--backends` (`Session.decode(..., logits="all")` over `--tokens` fixed tokens), and compared
with the reference: max |got - want| / max |want| over all logits, and whether the argmax of
every row agrees.

Run (the lowsync wheel on PYTHONPATH; llama-quantize from compare_llama_cpp_cpu.py's build):
    python benches/python/quant_accuracy.py --backends cpu,vulkan
    python benches/python/quant_accuracy.py --llama-quantize /tmp/lcpp-cuda/bin/llama-quantize \\
        --backends cpu,cuda --json /tmp/quant-accuracy.json
    # CUDA's decode products (one row each) with 8-bit activations:
    LOWSYNC_CUDA_TUNE=qdot=q8 python benches/python/quant_accuracy.py --backends cuda --ubatch 1 \\
        --llama-quantize /tmp/lcpp-cuda/bin/llama-quantize

Prints one JSON line per file and backend, then a markdown table; exits 1 if a row exceeds the
bound or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from llama_ref import forward, rel_err, spec_of  # the independent float64 reference  # noqa: E402

# The types whose CPU prefill products take 8-bit activation blocks by default, those that may
# take them with LOWSYNC_CPU_PREFILL_ACT=q8 or LOWSYNC_CPU_DECODE_ACT=q8 (Q4_1 and Q8_0 only on
# CPUs without AVX-512 VNNI), and the tokens in a ubatch from which a product is a prefill.
CPU_Q8_TYPES = {"Q4_0", "Q4_K", "Q6_K"}
CPU_Q8_OPT_IN_TYPES = {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"}
CPU_PREFILL_MIN_TOKENS = 6

# llama-quantize's names for a file of one block type (with --pure), and the type they give.
TYPES = {
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q8_0": "Q8_0",
    "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_S",
    "Q4_K": "Q4_K_S",
    "Q5_K": "Q5_K_S",
    "Q6_K": "Q6_K",
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_q = Path.home() / ".cache" / "llama.cpp-b11434-build" / "bin" / "llama-quantize"
    ap.add_argument("--llama-quantize", type=Path, default=default_q)
    ap.add_argument("--types", default=",".join(TYPES), help=", ".join(TYPES))
    ap.add_argument("--backends", default="cpu", help="lowsync backends, comma-separated")
    ap.add_argument("--model", default="tiny", help="built-in model (tiny)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8, help="tokens decoded (8)")
    ap.add_argument(
        "--ubatch",
        type=int,
        default=None,
        help="tokens per ubatch (default: --tokens, one ubatch; 1: every product one row, "
        "as in decode)",
    )
    ap.add_argument(
        "--bound",
        type=float,
        default=None,
        help="one relative error bound for every row (default: 3e-2 for rows with 8-bit "
        "activations, 1e-3 for the others)",
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/lowsync-quant-accuracy"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    bad = [t for t in args.types.split(",") if t not in TYPES]
    if bad:
        ap.error(f"--types: unknown {', '.join(bad)} (known: {', '.join(TYPES)})")
    if not args.llama_quantize.is_file():
        ap.error(
            f"--llama-quantize {args.llama_quantize}: not found (build it with "
            "benches/python/compare_llama_cpp_cpu.py)"
        )
    return args


def bound_for(t: str, backend: str, args: argparse.Namespace) -> float:
    """The relative error bound of type `t` on `backend`: 3e-2 where the CPU products or CUDA's
    one-row products may quantize the activations to 8 bits, 1e-3 elsewhere, or `--bound`."""
    if args.bound is not None:
        return float(args.bound)
    if ubatch(args) >= CPU_PREFILL_MIN_TOKENS:
        act = os.environ.get("LOWSYNC_CPU_PREFILL_ACT", "").strip()
        q8 = t in CPU_Q8_OPT_IN_TYPES if act == "q8" else t in CPU_Q8_TYPES and act != "q16"
    else:
        act = os.environ.get("LOWSYNC_CPU_DECODE_ACT", "").strip()
        q8 = t in CPU_Q8_OPT_IN_TYPES and act == "q8"
    q8 = q8 and backend.split(":")[0] in ("cpu", "cpu-async")
    q8 = q8 or (
        backend.split(":")[0] == "cuda"
        and ubatch(args) == 1
        and "qdot=q8" in os.environ.get("LOWSYNC_CUDA_TUNE", "").replace(" ", "").split(",")
    )
    return 3e-2 if q8 else 1e-3


def ubatch(args: argparse.Namespace) -> int:
    """Tokens per ubatch: `--ubatch`, else all of `--tokens`."""
    return int(args.ubatch) if args.ubatch else int(args.tokens)


def reference_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """float64 logits of `model`'s stored weights, dequantized by gguf-py."""
    import gguf

    w = {}
    for name, v in model.weights.items():
        dt = model.dtypes[name]
        if dt in ("f32", "f16", "bf16"):
            w[name] = np.asarray(v, np.float64)
        else:
            qt = gguf.GGMLQuantizationType[dt.upper()]
            w[name] = np.asarray(gguf.quants.dequantize(np.asarray(v), qt), np.float64)
    return forward(spec_of(model.config), w, tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import lowsync as ls

    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / f"{args.model}-f32-seed{args.seed}.gguf"
    if not src.is_file():
        ls.save_gguf(ls.Llama.random(args.model, seed=args.seed, dtype="f32"), src)
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    for t in args.types.split(","):
        path = args.work / f"{args.model}-{t.lower()}-seed{args.seed}.gguf"
        if not path.is_file():
            cmd = [str(args.llama_quantize), "--pure", str(src), str(path), TYPES[t]]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                rows.append({"type": t, "error": done.stderr.strip().splitlines()[-3:]})
                print(json.dumps(rows[-1]), flush=True)
                continue
        model = ls.load_gguf(path)
        tokens = [int(x) for x in rng.integers(1, model.config.n_vocab, args.tokens)]
        want = reference_logits(model, tokens)
        kinds = sorted({d for n, d in model.dtypes.items() if n.endswith("weight")})
        for b in args.backends.split(","):
            row: dict[str, Any] = {"type": t, "backend": b, "dtypes": kinds}
            row["bound"] = bound_for(t, b, args)
            try:
                sess = ls.Session(model, backends=[b], n_ctx=32, n_ubatch=ubatch(args))
                got = sess.decode(tokens, logits="all")
                row["rel_err"] = float(f"{rel_err(got, want):.3g}")
                row["argmax_agrees"] = bool((np.argmax(got, -1) == np.argmax(want, -1)).all())
                row["ok"] = row["rel_err"] <= row["bound"]
            except Exception as e:  # a backend that fails is a row, not a crash
                row["error"] = f"{type(e).__name__}: {e}"
                row["ok"] = False
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| type | backend | weight dtypes | rel. error | bound | argmax agrees |")
    print("|---|---|---|---:|---:|---|")
    for r in rows:
        err = r.get("rel_err", r.get("error", "-"))
        dts = " ".join(r.get("dtypes", []))
        agrees = r.get("argmax_agrees", "-")
        bound = r.get("bound", "-")
        print(f"| {r['type']} | {r.get('backend', '-')} | {dts} | {err} | {bound} | {agrees} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
