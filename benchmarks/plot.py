"""Plot bench_step CSV rows: step time as a multiple of the duplex floor, per variant.

Command:  python3 benchmarks/plot.py benchmarks/results/bench_step_h200.csv docs/bench_step_h200.png
Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/bench_step_h200.csv")
    dst = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/bench_step_h200.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(src.open()))
    ratio: dict[str, dict[str, float]] = defaultdict(dict)
    gpu = torch_version = ""
    for r in rows:
        if r["metric"] == "x_duplex_floor":
            ratio[r["workload"]][r["variant"]] = float(r["value"])
            gpu, torch_version = r["gpu"], r["torch"]
    fig, axes = plt.subplots(1, len(ratio), figsize=(5 * len(ratio), 4), squeeze=False)
    for ax, (workload, variants) in zip(axes[0], ratio.items(), strict=True):
        names = list(variants)
        colors = ["#999" if "reload" in n else "#2a7" for n in names]
        ax.bar(range(len(names)), [variants[n] for n in names], color=colors)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.axhline(1.05, color="r", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), [n.replace("chunked-", "") for n in names], rotation=45, ha="right")
        ax.set_title(workload)
        ax.set_ylabel("step time / duplex floor")
    fig.suptitle(f"{gpu}, torch {torch_version}: step time to the last byte (lower is better; red: 1.05x)")
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
