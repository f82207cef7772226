"""lowsync's own CUDA counters against CUPTI's count of the driver calls, per generated token.

The driver loads `scripts/gpu/cupti_counter.c` (built as a shared library) through
`CUDA_INJECTION64_PATH`; this script reads its counts with ctypes around a decode loop and
prints, per policy, both sides per generated token. Host waits should equal stream + event +
context synchronizations seen by CUPTI; H2D/D2H copies the HtoD/DtoH memcpy calls. The
copies are checked on the copy-engine path (`LOWSYNC_CUDA_TUNE=copy_kernel=0`, set here): by
default small copies ride in one `copy_batch` kernel launch, which CUPTI sees as a launch, not
a memcpy.

A last row decodes with the layers split over two CUDA backends of one device ("cuda" and
"cuda:0", each its own stream, standing in for two GPUs; docs/multi-gpu.md): there each
boundary copy is one device-to-device `cuMemcpy*` call ordered by one `cuStreamWaitEvent` on
either stream, and the host waits are still one per token.

Run: `CUDA_INJECTION64_PATH=/tmp/libcupti_counter.so python benches/python/cupti_check.py`.
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import Literal

import lowsync as ls

FIELDS = (
    "stream_syncs",
    "event_syncs",
    "ctx_syncs",
    "memcpys",
    "memcpy_htod",
    "memcpy_dtoh",
    "memcpy_dtod",
    "stream_wait_events",
)
LOWSYNC = (
    "host_waits",
    "driver_syncs",
    "elided_syncs",
    "h2d_copies",
    "d2h_copies",
    "d2d_copies",
    "device_waits",
)


def main() -> None:
    lib = ctypes.CDLL(os.environ["CUDA_INJECTION64_PATH"])
    counts = (ctypes.c_ulong * len(FIELDS))()

    def cupti() -> dict[str, int]:
        lib.lowsync_cupti_counts(counts)
        return dict(zip(FIELDS, counts, strict=True))

    os.environ["LOWSYNC_CUDA_TUNE"] = "copy_kernel=0"  # copies as cuMemcpy calls (see above)
    model = ls.Llama.random(os.environ.get("MODEL", "tiny"), seed=2, dtype="f16")
    n = 64
    rows: list[tuple[str, str, list[str]]] = [
        (policy, policy, ["cuda"]) for policy in ("stock", "relaxed", "staged")
    ]
    rows.append(("staged, two stages", "staged", ["cuda", "cuda:0"]))
    for label, policy, backends in rows:
        env = {"stock": "0"}.get(policy, "1")
        os.environ["LOWSYNC_CUDA_SYNC_ELISION"] = env
        split: Literal["even"] | None = "even" if len(backends) > 1 else None
        sess = ls.Session(model, backends=backends, n_ctx=256, policy=policy, layer_split=split)
        sess.generate([1, 2, 3, 4], max_new_tokens=4, seq_id=0)  # warm-up
        sess.seq_rm(0)
        prompt = [5, 6, 7, 8]
        sess.decode(prompt, seq_id=0, logits="none")
        before_ls, before_cu = sess.stats()["total"], cupti()
        tok = 9
        for _ in range(n):
            tok = sess.step({0: tok})[0]
        after_ls, after_cu = sess.stats()["total"], cupti()
        row = {
            "policy": label,
            "active": bool(lib.lowsync_cupti_active()),
            "lowsync": {k: (after_ls[k] - before_ls[k]) / n for k in LOWSYNC},
            "cupti": {k: (after_cu[k] - before_cu[k]) / n for k in FIELDS},
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
