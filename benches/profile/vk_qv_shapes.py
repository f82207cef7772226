"""Device time of one decode product per weight shape on Vulkan, under each block mat-vec body.

Why: `LOWSYNC_VK_QV` picks how the one-row mat-vec over block weights splits a row among a
subgroup's lanes (`group`: a 16-element group per lane, `mul_mat_vec_qv`; `block`: 32
consecutive elements per lane, a whole Q4_0 block, `mul_mat_vec_qb`). A decode step mixes
five product shapes, and the step's total (`vk_profile.py`) hides which shapes a body wins;
this script times each shape alone, so the default can be set from the shapes that matter.

Strategy: per round, per body, per dtype and shape, a fresh Context (the backend reads
`LOWSYNC_VK_QV` and `LOWSYNC_VK_PROFILE=1` when it is created) compiles one graph, `x [1, k]
@ w.T` with `w [n, k]` pinned to the device (random quants, small finite scales), computes it
twice to warm up, then `--repeats` times, and reads the product's device time per dispatch
from `kernel_times()`. Bodies alternate within a round, so slow drift of the device (clocks,
other work) falls on both. Each figure is the median over rounds of the per-round mean;
profiling adds a timestamp per dispatch, so small shapes read a few µs long.

Run (the H200, the built-in "1b" model's shapes, the default):
`python benches/profile/vk_qv_shapes.py`; `--dtypes f16,q4_0,q4_k` adds the float kernel as a
reference (it ignores the body) and a super-block type; `--shapes` takes other shapes
(TinyLlama's are in `--help`); `--model tiny --repeats 5` is a quick check on lavapipe.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

import lowsync as ls
from lowsync.bench import env_vars
from lowsync.models.llama import BUILTIN_CONFIGS

# TinyLlama-1.1B's products (n x k: gate/up, down, q/o, k/v, output head), the shapes of the
# per-shape table in docs/notes/gpu-vs-llama-cpp.md.
SHAPES_TINYLLAMA = "5632x2048,2048x5632,2048x2048,256x2048,32000x2048"

# (elements, bytes) per block, and the byte offsets of a block's f16 fields (scale, then min).
BLOCKS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "q4_0": (32, 18, (0,)),
    "q4_1": (32, 20, (0, 2)),
    "q5_0": (32, 22, (0,)),
    "q5_1": (32, 24, (0, 2)),
    "q8_0": (32, 34, (0,)),
    "iq4_nl": (32, 18, (0,)),
    "q2_k": (256, 84, (80, 82)),
    "q3_k": (256, 110, (108,)),
    "q4_k": (256, 144, (0, 2)),
    "q5_k": (256, 176, (0, 2)),
    "q6_k": (256, 210, (208,)),
    "iq4_xs": (256, 136, (0,)),
}


def weight_bytes(dtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random `[n, k]` weight data of `dtype`: f16 values, or blocks with random quants and
    f16 scales around 0.01 (finite, so every product is)."""
    if dtype == "f16":
        return rng.standard_normal((n, k), dtype=np.float32).astype(np.float16)
    qk, qb, fields = BLOCKS[dtype]
    if k % qk:
        raise SystemExit(f"k = {k} is not a whole number of {dtype} blocks of {qk}")
    blocks = rng.integers(0, 256, size=(n * k // qk, qb), dtype=np.uint8)
    scales = (0.01 + 0.005 * rng.standard_normal((blocks.shape[0], len(fields)))).astype(np.float16)
    for i, off in enumerate(fields):
        blocks[:, off : off + 2] = scales[:, i : i + 1].view(np.uint8)
    return blocks.reshape(n, k // qk * qb)


def model_shapes(name: str) -> list[tuple[int, int]]:
    """The distinct `[n, k]` matrix shapes of built-in model `name` (its decode products, the
    embedding table being the tied output head)."""
    shapes = BUILTIN_CONFIGS[name].weight_shapes().values()
    return list(dict.fromkeys((s[0], s[1]) for s in shapes if len(s) == 2))


def time_product(
    backend: str, body: str, dtype: str, n: int, k: int, repeats: int
) -> tuple[str, float, float]:
    """(kernel variant, device µs per dispatch, GB/s) of `x [1, k] @ w.T` under body `body`."""
    rng = np.random.default_rng(n * 7919 + k)
    with env_vars({"LOWSYNC_VK_PROFILE": "1", "LOWSYNC_VK_QV": body}):
        ctx = ls.Context([backend])
    g = ls.Graph()
    x = g.input("x", [1, k])
    data = weight_bytes(dtype, n, k, rng)
    w = g.weight("w", data, backend=backend, dtype=dtype, shape=[n, k])
    g.output("y", x @ w.T)
    plan = ctx.compile(g)
    plan.set_input("x", rng.standard_normal((1, k), dtype=np.float32))
    for _ in range(2):
        plan.compute()
    ctx.synchronize()
    ctx.reset_stats()
    for _ in range(repeats):
        plan.compute()
    ctx.synchronize()
    rows = [t for t in ctx.kernel_times() if t["name"].startswith("mul_mat")]
    if len(rows) != 1:
        raise SystemExit(f"expected one product kernel, got {[t['name'] for t in rows]}")
    t = rows[0]
    return t["name"], t["device_ns"] / t["count"] / 1e3, t["read_bytes"] / t["device_ns"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="vulkan")
    ap.add_argument("--dtypes", default="q4_0,q8_0", help="f16 and block types, comma-separated")
    ap.add_argument("--model", default="1b", help="built-in model whose shapes to time")
    ap.add_argument(
        "--shapes",
        default=None,
        help=f"n x k of w, comma-separated, instead of the model's (TinyLlama: {SHAPES_TINYLLAMA})",
    )
    ap.add_argument("--bodies", default="group,block", help="LOWSYNC_VK_QV values to compare")
    ap.add_argument("--repeats", type=int, default=50, help="timed products per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, bodies alternating")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    bodies = args.bodies.split(",")
    shapes = model_shapes(args.model)
    if args.shapes:
        shapes = [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes.split(",")]
    cases = [(d, n, k) for d in args.dtypes.split(",") for n, k in shapes]
    us: dict[tuple[str, str, int, int], list[float]] = {}
    gbs: dict[tuple[str, str, int, int], list[float]] = {}
    kernel: dict[tuple[str, str, int, int], str] = {}
    for _ in range(args.rounds):
        for d, n, k in cases:
            for body in bodies:
                key = (body, d, n, k)
                name, t_us, rate = time_product(args.backend, body, d, n, k, args.repeats)
                us.setdefault(key, []).append(t_us)
                gbs.setdefault(key, []).append(rate)
                kernel[key] = name
    head = f"{'dtype':7} {'n x k':>12}"
    for body in bodies:
        head += f" {body + ' us':>10} {'GB/s':>7}"
    if len(bodies) == 2:
        head += f" {bodies[1] + '/' + bodies[0]:>12}"
    print(f"device µs per product, median of {args.rounds} rounds of {args.repeats}")
    print(head + "  kernels (" + " / ".join(bodies) + ")")
    out = []
    for d, n, k in cases:
        line = f"{d:7} {f'{n}x{k}':>12}"
        med = {}
        for body in bodies:
            key = (body, d, n, k)
            med[body] = statistics.median(us[key])
            line += f" {med[body]:10.2f} {statistics.median(gbs[key]):7.1f}"
        if len(bodies) == 2:
            line += f" {med[bodies[1]] / med[bodies[0]]:12.3f}"
        print(line + "  " + " / ".join(kernel[(b, d, n, k)].split(".")[0] for b in bodies))
        out.append(
            {
                "dtype": d,
                "n": n,
                "k": k,
                "us": {b: us[(b, d, n, k)] for b in bodies},
                "kernel": {b: kernel[(b, d, n, k)] for b in bodies},
            }
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
