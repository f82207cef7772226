"""Decode (tg) and prompt (pp) tokens/s of backend settings side by side, in one process, on the
same models: the A/B of a tuning key or an environment variable.

Why: a key such as `LOWSYNC_CUDA_TUNE=gemv_q_typed=0` or `LOWSYNC_VK_ATTN_VEC=1` changes one
kernel; its effect on a token is a few percent, under the drift between two processes on a
shared machine. Here the model is loaded once, each variant runs `lowsync.bench.run_bench` (its
own session: the backend reads the variables when it is created) and the rounds take the
variants in turn, A B C A B C, so a drift of the machine touches each alike.

Strategy: for each model (`--files`, GGUF paths; `--models`, built-in names with `--dtype`),
`--rounds` rounds; in each, every variant in order gets one `run_bench` row (`staged`,
launch-ahead, `-p` prompt tokens in one ubatch, `-n` steps, `--kv-dtype`). A variant is
`NAME` or `NAME=SETTING,...`, a SETTING `VAR=value` or a `LOWSYNC_CUDA_TUNE` key `key=value`
(as `kernel_trace.py` reads them). Reported: per model and variant the median tg and pp over
the rounds, and both as ratios to the first variant's.

Invariants: every variant of a model runs the same weights, prompt and lengths; a variant that
cannot launch ahead (the backend lacks stream-ordered reads) falls back to the plain loop, and
the row says so. `--tokens N` first generates N greedy tokens after the same `-p`-token prompt
under each variant (a fresh session each) and reports whether they equal the first variant's:
most switches promise the same bits, and a timing of a variant that computes something else
means nothing.

Run (the lowsync wheel on PYTHONPATH, on the GPU machine):
    python benches/profile/variants_tg.py --backend cuda --files /tmp/gpucmp/1b-q4_0-seed3.gguf \\
        --variant typed --variant generic=gemv_q_typed=0 --rounds 3 --json /tmp/ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_trace import TUNE, parse_variant, settings, with_tune


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--files", default="", help="GGUF files, comma-separated")
    ap.add_argument("--models", default="", help="built-in models, comma-separated")
    ap.add_argument("--dtype", default="f16", help="weights of the built-in models")
    ap.add_argument("--variant", action="append", default=[], help="NAME or NAME=SETTING,...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--kv-dtype", default="f16", choices=["f32", "f16", "bf16"])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--tokens", type=int, default=0, help="greedy tokens compared with the first variant's"
    )
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.n_prompt < 1 or args.n_gen < 1 or args.tokens < 0:
        ap.error("--rounds, -p and -n must be at least 1, --tokens at least 0")
    try:
        variants = [parse_variant(v) for v in args.variant] or [("default", {})]
    except ValueError as e:
        ap.error(str(e))
    if len({v[0] for v in variants}) != len(variants):
        ap.error("variant names must differ")
    import lowsync as ls
    from lowsync.bench import env_vars, run_bench

    sources: list[tuple[str, Any]] = []
    for f in filter(None, args.files.split(",")):
        sources.append((Path(f).name, lambda f=f: ls.load_gguf(f)))
    for m in filter(None, args.models.split(",")):
        sources.append((f"{m} {args.dtype}", lambda m=m: ls.Llama.random(m, 1, args.dtype)))
    if not sources:
        ap.error("give --files or --models")
    ambient = os.environ.get(TUNE, "")
    rows: list[dict[str, Any]] = []
    for label, load in sources:
        model = load()
        same: dict[str, bool | None] = {v[0]: None for v in variants}
        if args.tokens:
            first: list[int] | None = None
            for name, env in variants:
                with env_vars(with_tune(env, ambient)):
                    toks = greedy(ls, model, args)
                first = toks if first is None else first
                same[name] = toks == first
                print(f"{label} {name}: {len(toks)} greedy tokens, same as the first: {same[name]}")
        tg: dict[str, list[float]] = {v[0]: [] for v in variants}
        pp: dict[str, list[float]] = {v[0]: [] for v in variants}
        ahead: dict[str, bool] = {}
        for rnd in range(args.rounds):
            for name, env in variants:
                row = None
                with env_vars(with_tune(env, ambient)):
                    # Launch-ahead where the backend can, else the plain loop.
                    for ahead_ok in (True, False):
                        row = row or run_bench(
                            model,
                            [args.backend],
                            "staged",
                            n_prompt=args.n_prompt,
                            n_gen=args.n_gen,
                            n_ubatch=args.n_prompt,
                            launch_ahead=ahead_ok,
                            kv_dtype=args.kv_dtype,
                        )
                assert row is not None
                tg[name].append(row.tg_tps)
                pp[name].append(row.pp_tps)
                ahead[name] = row.launch_ahead
                print(f"{label} {name} round {rnd}: tg {row.tg_tps:.1f} pp {row.pp_tps:.1f}")
        base = statistics.median(tg[variants[0][0]])
        base_pp = statistics.median(pp[variants[0][0]])
        for name, env in variants:
            r = {
                "model": label,
                "variant": name,
                "settings": settings(env),
                "tg_tps": statistics.median(tg[name]),
                "pp_tps": statistics.median(pp[name]),
                "tg_all": tg[name],
                "pp_all": pp[name],
                "launch_ahead": ahead[name],
                "tokens_same": same[name],
            }
            r["tg_ratio"] = r["tg_tps"] / base
            r["pp_ratio"] = r["pp_tps"] / base_pp
            rows.append(r)
            print(json.dumps(r))
        del model
    print("| model | variant | settings | tg tok/s | tg ratio | pp tok/s | pp ratio | tokens |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        tokens = {None: "-", True: "same", False: "DIFFER"}[r["tokens_same"]]
        print(
            f"| {r['model']} | {r['variant']} | {r['settings']} | {r['tg_tps']:.1f} | "
            f"{r['tg_ratio']:.3f} | {r['pp_tps']:.0f} | {r['pp_ratio']:.3f} | {tokens} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def greedy(ls: Any, model: Any, args: argparse.Namespace) -> list[int]:
    """`args.tokens` greedy tokens after a fixed `-p`-token prompt, on a fresh staged session
    of `args.backend` (created under the caller's variables)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.n_vocab, size=args.n_prompt).tolist()
    sess = ls.Session(
        model,
        backends=[args.backend],
        n_ctx=args.n_prompt + args.tokens,
        n_ubatch=args.n_prompt,
        policy="staged",
        kv_dtype=args.kv_dtype,
    )
    return [int(t) for t in sess.generate(prompt, max_new_tokens=args.tokens)]


if __name__ == "__main__":
    raise SystemExit(main())
