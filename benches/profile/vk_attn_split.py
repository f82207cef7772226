"""The Vulkan decode attention split over keys against one workgroup per head, at two depths.

For each `LOWSYNC_VK_ATTN_SPLIT` value asked for and each prompt length P, the script runs a
fresh Session: `generate(P-token prompt, 1)` (the warm-up, which leaves the cache at depth
P + 1), `reset_stats()`, `generate([1], n)`, and prints the attention's device time per decode
step from `kernel_times()` under `LOWSYNC_VK_PROFILE=1`: `attn_dec` (unsplit) or `attn_split`
(split; a head's last chunk merges) or `attn_split_g` (split, grouped) or `attn_split_v`
(16-byte K and V loads), per step and per dispatch. A second, unprofiled run of the same steps
gives the wall and process CPU milliseconds per token (on lavapipe the device is the CPU, so
the CPU time is what the split costs or saves there).

Run: `python benches/profile/vk_attn_split.py --model 1b --dtype f16 --kv f16 --split 0,1,4
--group 0,1 --vec 0,1` (`LOWSYNC_VK_ATTN_GROUP`: the grouped split, `attn_split_g`;
`LOWSYNC_VK_ATTN_VEC`: `attn_split_v`) (the H200); `--model tiny` on lavapipe.
"""

from __future__ import annotations

import argparse
import time

import lowsync as ls
from lowsync.bench import env_vars

ATTN = ("attn_dec", "attn_split", "attn_split_g", "attn_split_v")


def run(
    model: ls.Llama,
    split: str,
    group: str,
    vec: str,
    prompt_len: int,
    n: int,
    kv: str,
    n_ctx: int,
    profile: bool,
) -> tuple[dict[str, tuple[float, float]], float, float]:
    """Attention kernels' (dispatches, µs) per step (profiled runs), and wall and CPU ms per
    token of the `n` decode steps after a `prompt_len`-token prompt."""
    env = {
        "LOWSYNC_VK_ATTN_SPLIT": split,
        "LOWSYNC_VK_ATTN_GROUP": group,
        "LOWSYNC_VK_ATTN_VEC": vec,
        "LOWSYNC_VK_PROFILE": "1" if profile else "0",
    }
    with env_vars(env):
        sess = ls.Session(model, backends=["vulkan"], n_ctx=n_ctx, policy="staged", kv_dtype=kv)
    prompt = [(7 * i + 3) % model.config.n_vocab for i in range(prompt_len)]
    sess.generate(prompt, max_new_tokens=1, seq_id=0)
    sess.context.synchronize()
    sess.context.reset_stats()
    wall, cpu = time.perf_counter(), time.process_time()
    sess.generate([1], max_new_tokens=n, seq_id=0)
    sess.context.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    per: dict[str, tuple[float, float]] = {}
    for t in sess.context.kernel_times():
        name = t["name"].split(".")[0]
        if name in ATTN:
            c, us = per.get(name, (0.0, 0.0))
            per[name] = (c + t["count"] / n, us + t["device_ns"] / 1e3 / n)
    return per, 1e3 * wall / n, 1e3 * cpu / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1b", help="built-in model: tiny, small, 1b")
    ap.add_argument("--dtype", default="f16", help="weight dtype: f16, q4_0, ...")
    ap.add_argument("--kv", default="f16", help="KV-cache dtype")
    ap.add_argument("--split", default="0,1", help="LOWSYNC_VK_ATTN_SPLIT values, comma-separated")
    ap.add_argument("--group", default="0", help="LOWSYNC_VK_ATTN_GROUP values, comma-separated")
    ap.add_argument("--vec", default="0", help="LOWSYNC_VK_ATTN_VEC values, comma-separated")
    ap.add_argument("--depths", default="16,160", help="prompt lengths P, comma-separated")
    ap.add_argument("-n", type=int, default=32, help="decode steps measured")
    ap.add_argument("--n-ctx", type=int, default=512, help="KV-cache rows (the window)")
    args = ap.parse_args()
    model = ls.Llama.random(args.model, seed=1, dtype=args.dtype)
    print(f"{args.model} {args.dtype}, kv {args.kv}, n_ctx {args.n_ctx}, {args.n} steps")
    print("split group vec  P    attention µs/step (dispatches/step, µs each)", end="")
    print("  wall ms/tok  CPU ms/tok")
    for p in (int(x) for x in args.depths.split(",")):
        for split in args.split.split(","):
            for group in args.group.split(","):
                for vec in args.vec.split(","):
                    a = (model, split, group, vec, p, args.n, args.kv, args.n_ctx)
                    per, _, _ = run(*a, profile=True)
                    _, wall, cpu = run(*a, profile=False)
                    total = sum(us for _, us in per.values())
                    parts = ", ".join(
                        f"{k} {c:.0f} x {us / c:.1f}" for k, (c, us) in per.items() if c
                    )
                    print(
                        f"{split:>5} {group:>5} {vec:>3} {p:>4}  {total:8.1f} ({parts})"
                        f"{wall:>14.3f}{cpu:>12.3f}"
                    )


if __name__ == "__main__":
    main()
