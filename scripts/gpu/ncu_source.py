"""Summary of an `ncu --page source --csv --print-source sass` export: the instructions with the
most warp stall samples, and the samples per stall reason.

Run: `python scripts/gpu/ncu_source.py src-attn_decode.csv`.
"""

from __future__ import annotations

import csv
import sys
from collections import Counter


def num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.reader(f))
    head_at = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    head = rows[head_at]
    body = [r for r in rows[head_at + 1 :] if len(r) == len(head)]
    col = {name: i for i, name in enumerate(head)}
    src = next(i for n, i in col.items() if n == "Source")
    samp = next(
        (i for n, i in col.items() if n.startswith("Warp Stall Sampling (All")),
        next((i for n, i in col.items() if "Sampling" in n), None),
    )
    if samp is None:
        print("columns:", head)
        return
    total = sum(num(r[samp]) for r in body)
    print(f"{len(body)} SASS lines, {total:.0f} stall samples; columns: {len(head)}")
    reasons: Counter[str] = Counter()
    for n, i in col.items():
        if n.startswith("stall_") or ("Stall" in n and n != head[samp] and "Sampling" not in n):
            reasons[n] = int(sum(num(r[i]) for r in body))
    for n, v in reasons.most_common(8):
        print(f"  {n}: {v}")
    top = sorted(range(len(body)), key=lambda k: -num(body[k][samp]))[:20]
    for k in sorted(top):
        r = body[k]
        print(f"  [{k:5d}] {num(r[samp]):6.0f}  {r[src][:90]}")


if __name__ == "__main__":
    main()
