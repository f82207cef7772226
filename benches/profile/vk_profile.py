"""Where a decoded token's device time goes on Vulkan: device time per kernel variant.

The script decodes `-n` tokens of a built-in model twice on one Session with
`LOWSYNC_VK_PROFILE=1` (the backend writes a timestamp after every dispatch and sums each
kernel variant's device time), resets the figures after the warm-up pass, and prints the
second pass's table sorted by device time: dispatches per step, microseconds per step and per
dispatch, the share of the step's device time, and for the products (`mul_mat*`) the effective
bandwidth, bytes bound for reading (the weight, plus a small activation) over device time.
It then times the same decode on an unprofiled session, for reference.

A dispatch's time runs from the end of the command before it to its own end, so the barrier
before it counts towards it and the rows add up to the step's device time. A timestamp waits
for the commands before it on most drivers, so dispatches that would overlap run one after
another while profiling; profiling also records each step's commands afresh (no replay), so
the wall-clock tok/s it prints is below the unprofiled bench's.

Run: `python benches/profile/vk_profile.py --model 1b --dtype f16 -n 64` (`--prefill -p 128`:
the 128-token prompt's one forward pass instead, its tok/s the prompt's); add
`LOWSYNC_VK_VALIDATION=1` to run it under the validation layer, `LOWSYNC_VK_QV=block` for the
whole-block mat-vec body (docs/tuning.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lowsync as ls
from lowsync.bench import env_vars


def _prompt(model: ls.Llama, prompt_len: int) -> list[int]:
    """The first `prompt_len` tokens of a fixed sequence (token 1 alone when it is 0 or 1)."""
    return [1 + (7 * i + 3) % (model.config.n_vocab - 1) for i in range(max(prompt_len, 1))]


def _session(
    model: ls.Llama, backend: str, n: int, prompt_len: int, kv: str, prof: str
) -> ls.Session:
    with env_vars({"LOWSYNC_VK_PROFILE": prof}):
        return ls.Session(
            model,
            backends=[backend],
            n_ctx=prompt_len + n + 8,
            n_ubatch=max(prompt_len, 1),
            policy="staged",
            kv_dtype=kv,
        )


def _decode_pass(sess: ls.Session, prompt: list[int], n: int) -> float:
    """The prompt but its last token as one forward pass, then `n` tokens generated from its
    last token, so the stats reset between them count the decode steps alone (and the last
    token's forward pass). Returns the process's CPU seconds over the generation."""
    sess.seq_rm(0)
    if len(prompt) > 1:
        sess.decode(prompt[:-1], seq_id=0, logits="none")
    sess.context.synchronize()
    sess.context.reset_stats()
    cpu0 = time.process_time()
    sess.generate(prompt[-1:], max_new_tokens=n, seq_id=0)
    cpu = time.process_time() - cpu0
    sess.context.synchronize()
    return cpu


def profile(
    model: ls.Llama, backend: str, n: int, prompt_len: int = 1, kv: str = "f32"
) -> tuple[dict[str, float], list[dict]]:
    """Decodes `n` tokens after a `prompt_len`-token prompt, twice; returns the second pass's
    summary and kernel times (one step is the prompt's last token's forward pass plus each
    decode step)."""
    sess = _session(model, backend, n, prompt_len, kv, "1")
    prompt = _prompt(model, prompt_len)
    _decode_pass(sess, prompt, n)  # warm-up: pipelines, plans
    _decode_pass(sess, prompt, n)
    st = sess.last_generate
    assert st is not None
    times = sess.context.kernel_times()
    steps = st.n_steps + 1
    plain, cpu_ms = plain_tok_s(model, backend, n, prompt_len, kv)
    summary = {
        "tok_s": st.tg_tps,
        "steps": float(steps),
        "plain_tok_s": plain,
        "plain_cpu_ms_per_token": cpu_ms,
    }
    return summary, times


def profile_prefill(
    model: ls.Llama, backend: str, prompt_len: int, kv: str = "f32"
) -> tuple[dict[str, float], list[dict]]:
    """The prompt as one ubatch, twice on one session (the second pass profiled, after a
    warm-up that compiles the pipelines); returns its summary (prompt tok/s profiled and not)
    and kernel times, the pass being the table's one "step"."""
    rates = []
    times: list[dict] = []
    for prof in ("1", "0"):
        sess = _session(model, backend, 1, prompt_len, kv, prof)
        prompt = _prompt(model, prompt_len)
        for _ in range(2):
            sess.seq_rm(0)
            sess.context.synchronize()
            sess.context.reset_stats()
            t0 = time.perf_counter()
            sess.decode(prompt, seq_id=0, logits="last")
            sess.context.synchronize()
            dt = time.perf_counter() - t0
        rates.append(len(prompt) / dt)
        if prof == "1":
            times = sess.context.kernel_times()
    summary = {
        "tok_s": rates[0],
        "steps": 1.0,
        "plain_tok_s": rates[1],
        "plain_cpu_ms_per_token": float("nan"),
    }
    return summary, times


def plain_tok_s(
    model: ls.Llama, backend: str, n: int, prompt_len: int = 1, kv: str = "f32"
) -> tuple[float, float]:
    """Decode tok/s of the same run without profiling (the second of two passes), and the
    process's CPU time per token over that pass (every thread: on lavapipe the device's
    workers are threads of this process, so this is what a token costs the machine)."""
    sess = _session(model, backend, n, prompt_len, kv, "0")
    prompt = _prompt(model, prompt_len)
    _decode_pass(sess, prompt, n)
    cpu_ms = _decode_pass(sess, prompt, n) * 1e3 / n
    st = sess.last_generate
    assert st is not None
    return st.tg_tps, cpu_ms


def table(times: list[dict], steps: int) -> list[dict[str, object]]:
    """Rows of the printed table, longest first."""
    total_ns = sum(t["device_ns"] for t in times) or 1
    rows = []
    for t in times:
        ns, count, nbytes = t["device_ns"], t["count"], t["read_bytes"]
        rows.append(
            {
                "kernel": t["name"],
                "per_step": count / steps,
                "us_per_step": ns / steps / 1e3,
                "us_per_call": ns / count / 1e3 if count else 0.0,
                "share": ns / total_ns,
                "mb_per_call": nbytes / count / 1e6 if count else 0.0,
                "gb_s": nbytes / ns if t["name"].startswith("mul_mat") and ns > 0 else None,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1b", help="built-in model: tiny, small, 1b")
    ap.add_argument("--dtype", default="f16", help="weight dtype: f16, q4_0, ...")
    ap.add_argument("--backend", default="vulkan")
    ap.add_argument("-n", type=int, default=64, help="tokens decoded per pass")
    ap.add_argument("-p", "--prompt-len", type=int, default=1, help="prompt tokens before them")
    ap.add_argument("--kv-dtype", default="f32", help="KV-cache dtype: f32, f16, bf16")
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="profile the prompt's forward pass (one ubatch of -p tokens) instead of decoding",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = ls.Llama.random(args.model, seed=1, dtype=args.dtype)
    if args.prefill:
        summary, times = profile_prefill(model, args.backend, args.prompt_len, args.kv_dtype)
    else:
        summary, times = profile(model, args.backend, args.n, args.prompt_len, args.kv_dtype)
    if not times:
        raise SystemExit(
            f"no kernel times from {args.backend}: its compute queue writes no timestamps "
            "(or the backend does not profile)"
        )
    steps = int(summary["steps"])
    rows = table(times, steps)
    device_us = sum(t["device_ns"] for t in times) / steps / 1e3
    print(
        f"{args.model} {args.dtype} on {args.backend}: {summary['tok_s']:.1f} tok/s profiled "
        f"({summary['plain_tok_s']:.1f} without, "
        f"{summary['plain_cpu_ms_per_token']:.2f} CPU ms/token), "
        f"device {device_us:.1f} us/step over {steps} steps"
    )
    print(
        f"{'kernel':44} {'n/step':>6} {'us/step':>9} {'share':>6} {'us/call':>8} "
        f"{'MB/call':>8} {'GB/s':>7}"
    )
    for r in rows:
        gbs = f"{r['gb_s']:7.1f}" if r["gb_s"] is not None else f"{'':>7}"
        print(
            f"{r['kernel']:44} {r['per_step']:6.1f} {r['us_per_step']:9.1f} "
            f"{r['share']:6.1%} {r['us_per_call']:8.2f} {r['mb_per_call']:8.2f} {gbs}"
        )
    if args.json:
        out = {"model": args.model, "dtype": args.dtype, "backend": args.backend, **summary}
        out["device_us_per_step"] = device_us
        out["rows"] = rows
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
