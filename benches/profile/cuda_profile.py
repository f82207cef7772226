"""Where a decoded token's time goes on CUDA: device (kernel) time vs host time, per setting.

For each model and each setting (graph replay on/off, fusion on/off), the script generates
`-n` tokens twice on one Session (the first pass captures the graphs), with
`LOWSYNC_CUDA_TIMING=1` so the backend times every compute graph with CUDA events around it,
and reports per generated token: wall time, device time (`device_ns`), the rest (host work and
gaps: Python, the staged input copy, the launch, the 4-byte read and its wait), and the counts.

Run: `python benches/profile/cuda_profile.py --models tiny,1b -n 128 --json out.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lowsync as ls
from lowsync.bench import env_vars

SETTINGS: dict[str, dict[str, str]] = {
    "graphs+fused": {"LOWSYNC_CUDA_GRAPHS": "1", "LOWSYNC_CUDA_FUSION": "1"},
    "graphs+unfused": {"LOWSYNC_CUDA_GRAPHS": "1", "LOWSYNC_CUDA_FUSION": "0"},
    "eager+fused": {"LOWSYNC_CUDA_GRAPHS": "0", "LOWSYNC_CUDA_FUSION": "1"},
    "eager+unfused": {"LOWSYNC_CUDA_GRAPHS": "0", "LOWSYNC_CUDA_FUSION": "0"},
}


def profile(model: ls.Llama, setting: str, n: int, n_ctx: int) -> dict[str, object]:
    """One Session under `setting` (the backend reads the variables when it is created)."""
    with env_vars({**SETTINGS[setting], "LOWSYNC_CUDA_TIMING": "1"}):
        sess = ls.Session(model, backends=["cuda"], n_ctx=n_ctx, policy="staged")
    prompt = [1, 2, 3, 4]
    sess.generate(prompt, max_new_tokens=n, seq_id=0)  # warm-up: first run and capture
    sess.seq_rm(0)
    tokens = sess.generate(prompt, max_new_tokens=n, seq_id=0)
    st = sess.last_generate
    assert st is not None
    wall_us = st.decode_s / st.n_steps * 1e6
    device_us = st.per_token["device_ns"] / 1e3
    return {
        "setting": setting,
        "tok_s": st.tg_tps,
        "wall_us": wall_us,
        "device_us": device_us,
        "host_and_gaps_us": wall_us - device_us,
        "device_share": device_us / wall_us if wall_us > 0 else 0.0,
        "per_token": st.per_token,
        "tokens": tokens[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="tiny,1b")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--n-ctx", type=int, default=0, help="KV cells (default: prompt + n + 8)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    rows = []
    for name in args.models.split(","):
        model = ls.Llama.random(name, seed=1, dtype=args.dtype)
        n_ctx = args.n_ctx or 4 + args.n + 8
        for setting in settings:
            r = profile(model, setting, args.n, n_ctx)
            r["model"] = name
            rows.append(r)
            pt = r["per_token"]
            assert isinstance(pt, dict)
            print(
                f"{name:5} {setting:18} {r['tok_s']:8.1f} tok/s  wall {r['wall_us']:7.1f} us  "
                f"device {r['device_us']:7.1f} us  host+gaps {r['host_and_gaps_us']:7.1f} us  "
                f"waits {pt['host_waits']:.2f} h2d {pt['h2d_copies']:.2f} "
                f"d2h {pt['d2h_copies']:.2f} "
                f"kernels {pt['kernel_launches']:.1f} graphs {pt['graph_launches']:.2f}",
                flush=True,
            )
        same = {str(r["tokens"]) for r in rows if r["model"] == name}
        print(f"{name}: same tokens under every setting: {len(same) == 1}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
