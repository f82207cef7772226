"""Checks for a GPU machine, printed as JSON lines: the three policies give bit-identical
logits and tokens on each backend (and the same greedy tokens as `cpu`), per-token counts per
policy, and a model or cache larger than the device gives a clear error after which the context
still works.

Run: `python benches/python/gpu_checks.py --backends cuda,vulkan`.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import lowsync as ls

POLICIES = ("stock", "relaxed", "staged")


def decode(model: ls.Llama, backend: str, policy: str, n: int) -> dict[str, object]:
    sess = ls.Session(model, backends=backend.split("+"), n_ctx=256, policy=policy)
    prompt = [5, 17, 300, 42, 7, 1000]
    logits = sess.decode(prompt, seq_id=0, logits="all")
    assert logits is not None
    sess.seq_rm(0)
    tokens = sess.generate(prompt, max_new_tokens=n, seq_id=0)
    stats = sess.last_generate
    assert stats is not None
    return {"tokens": tokens, "logits": logits, "per_token": stats.per_token}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="cuda")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("-n", type=int, default=32)
    args = ap.parse_args()
    model = ls.Llama.random(args.model, seed=5, dtype="f16")
    cpu = decode(model, "cpu", "staged", args.n)
    for backend in args.backends.split(","):
        runs = {p: decode(model, backend, p, args.n) for p in POLICIES}
        ref = runs["staged"]
        assert isinstance(ref["logits"], np.ndarray)
        row = {
            "backend": backend,
            "model": args.model,
            "policies_bit_identical": all(
                np.array_equal(r["logits"], ref["logits"]) and r["tokens"] == ref["tokens"]
                for r in runs.values()
            ),
            "same_greedy_tokens_as_cpu": ref["tokens"] == cpu["tokens"],
            "per_token": {
                p: {
                    k: v
                    for k, v in r["per_token"].items()  # type: ignore[attr-defined]
                    if k in ("host_waits", "driver_syncs", "h2d_copies", "d2h_copies", "d2h_bytes")
                }
                for p, r in runs.items()
            },
        }
        print(json.dumps(row))
        # A persistent tensor larger than the device: a clear error, then the context works.
        ctx = ls.Context([backend])
        g = ls.Graph()
        huge = g.persistent("huge", (1 << 16, 1 << 20))  # 256 GiB of f32
        g.output("y", g.scale(huge, 1.0))
        try:
            ctx.compile(g)
            oom = "no error"
        except ls.LowsyncError as e:
            oom = f"{type(e).__name__}: {e}"
        g2 = ls.Graph()
        x = g2.input("x", (4,))
        g2.output("y", x * 2.0)
        plan = ctx.compile(g2)
        plan.set_input("x", np.ones(4, np.float32))
        plan.compute()
        ok = plan.get_output("y").tolist() == [2.0] * 4
        print(json.dumps({"backend": backend, "oversized_model": oom, "usable_after": ok}))


if __name__ == "__main__":
    main()
