"""lowsync against Hugging Face transformers on the identical GGUF file.

transformers reads llama GGUF files itself (`from_pretrained(dir, gguf_file=...)`, un-permuting
Q/K for its rotary convention), so it is an implementation independent of lowsync's reader,
graph and kernels. The script writes a random model with `save_gguf`, then compares greedy
tokens and last-token logits of a prompt on every lowsync backend given. It needs torch,
transformers and gguf (the GPU machine has the first two; the third travels as a wheel).

Run: `python benches/python/compare_transformers.py --model tiny --backends cpu,cuda`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import lowsync as ls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backends", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    model = ls.Llama.random(args.model, seed=1)
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(3, model.config.n_vocab, args.prompt_len)]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.gguf"
        model.save_gguf(path)
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, torch_dtype=torch.float32)
        hf.eval()
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref_logits = hf(ids).logits[0, -1].double().numpy()
            out = hf.generate(ids, max_new_tokens=args.n, do_sample=False, num_beams=1)
            ref_tokens = [int(t) for t in out[0, len(prompt) :]]
        for backend in args.backends.split(","):
            sess = ls.Session(model, backends=backend.split("+"), n_ctx=256, policy="staged")
            logits = sess.decode(prompt, seq_id=0, logits="last")
            assert logits is not None
            rel = float(np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits)))
            sess.seq_rm(0)
            tokens = sess.generate(prompt, max_new_tokens=args.n, seq_id=0)
            row = {
                "model": args.model,
                "backend": backend,
                "logits_max_rel_diff": rel,
                "same_greedy_tokens": tokens == ref_tokens,
                "first_divergence": next(
                    (i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b),
                    None,
                ),
                "lowsync_tokens": tokens,
                "transformers_tokens": ref_tokens,
            }
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
