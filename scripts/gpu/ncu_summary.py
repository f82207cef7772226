"""Aggregates an `ncu --csv` report (one row per kernel launch and metric) by kernel name:
launches, total and mean time, mean DRAM throughput (% of peak) and bytes read per launch."""

import csv
import sys
from collections import defaultdict

with open(sys.argv[1]) as f:
    rows = list(csv.DictReader(line for line in f if line.startswith('"')))
per: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
for r in rows:
    unit = r.get("Metric Unit", "")
    v = float(r["Metric Value"].replace(",", "") or 0)
    if unit in ("usecond",):
        v *= 1e3
    elif unit in ("msecond",):
        v *= 1e6
    elif unit == "Kbyte":
        v *= 1e3
    elif unit == "Mbyte":
        v *= 1e6
    elif unit == "Gbyte":
        v *= 1e9
    per[(r["ID"], r["Kernel Name"])][r["Metric Name"]] = v
agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
for (_, name), m in per.items():
    a = agg[name.split("(")[0]]
    a[0] += 1
    a[1] += m.get("gpu__time_duration.sum", 0.0)
    a[2] += m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", 0.0)
    a[3] += m.get("dram__bytes_read.sum", 0.0)
total = sum(a[1] for a in agg.values())
print(f"{len(per)} launches, {total / 1e3:.1f} us of kernel time")
for name, (n, t, pct, rd) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(
        f"{name:32} n={n:4d} total {t / 1e3:8.1f} us  mean {t / n / 1e3:7.2f} us  "
        f"dram {pct / n:5.1f}%  read {rd / n / 1e6:8.3f} MB/launch"
    )
