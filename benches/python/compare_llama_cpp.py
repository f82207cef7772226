"""lowsync against llama.cpp (through llama-cpp-python) on the identical GGUF file.

Writes a random model with `save_gguf`, loads the file in both, and compares the last-token
logits of a prompt and the greedy tokens that follow; with `--speed` it also times CPU decode
(tokens/s over `-n` generated tokens after a warm-up) with the same thread count in both,
side by side in this one process. llama-cpp-python is an optional benchmark dependency.

Run: `python benches/python/compare_llama_cpp.py --model tiny --speed`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import lowsync as ls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from llama_cpp import Llama as LlamaCpp

    model = ls.Llama.random(args.model, seed=3, dtype=args.dtype)
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(300, model.config.n_vocab, args.prompt_len)]
    row: dict[str, object] = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.gguf"
        model.save_gguf(path)
        cpp = LlamaCpp(
            model_path=str(path),
            n_ctx=512,
            n_batch=64,
            n_threads=args.threads,
            logits_all=True,
            verbose=False,
        )
        cpp.eval(prompt)
        ref_logits = np.array(cpp.scores[len(prompt) - 1], dtype=np.float64)
        ref_tokens = []
        for _ in range(args.n):
            tok = int(np.argmax(cpp.scores[cpp.n_tokens - 1]))
            ref_tokens.append(tok)
            cpp.eval([tok])
        sess = ls.Session(model, backends=["cpu"], n_ctx=512, policy="staged")
        logits = sess.decode(prompt, seq_id=0, logits="last")
        assert logits is not None
        row["logits_max_rel_diff"] = float(
            np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits))
        )
        sess.seq_rm(0)
        tokens = sess.generate(prompt, max_new_tokens=args.n, seq_id=0)
        row["same_greedy_tokens"] = tokens == ref_tokens
        row["lowsync_tokens"] = tokens
        row["llama_cpp_tokens"] = ref_tokens
        if args.speed:
            cpp.reset()
            cpp.eval(prompt)
            t0 = time.perf_counter()
            tok = prompt[-1]
            for _ in range(args.n):
                cpp.eval([tok])
                tok = int(np.argmax(cpp.scores[cpp.n_tokens - 1]))
            row["llama_cpp_tg_tps"] = args.n / (time.perf_counter() - t0)
            sess.seq_rm(0)
            sess.generate(prompt, max_new_tokens=4, seq_id=0)  # warm-up
            sess.seq_rm(0)
            sess.generate(prompt, max_new_tokens=args.n + 1, seq_id=0)
            stats = sess.last_generate
            assert stats is not None
            row["lowsync_cpu_tg_tps"] = stats.n_steps / stats.decode_s
    print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
