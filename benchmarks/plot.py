"""Plot benchmark CSVs into PNGs under docs/.

Command:  python3 benchmarks/plot.py benchmarks/results/bench_step_h200.csv [docs/] [--sha 0eb731e] [--only peers]
          python3 benchmarks/plot.py benchmarks/results/bench_train_h200x2.csv [docs/]
          python3 benchmarks/plot.py benchmarks/results/bench_capacity_h200.csv [docs/]
Needs matplotlib (the `bench` extra). Reads both the current CSV layout (median, p20, p80) and the first one
(value). A CSV collects the rows of several runs: --sha keeps one commit's rows, otherwise the newest row of each
measurement is drawn and the title names the commits of the rows read. --only draws some charts (by the part of
their name after "bench_", e.g. step_peers, or a prefix such as step). Draws:
    bench_step_chunks.png  step time against chunk size, AdamW, with the duplex floor and full reload;
    bench_step_peers.png   the time each offloader adds to a resident AdamW iteration, side by side;
    bench_step_floor.png   every variant as a multiple of the duplex floor;
    bench_train.png        exposed optimizer time per iteration against tokens per iteration, with the floor;
    bench_train_kept.png   the share of resident iterations/s each variant keeps, peers (DeepSpeed, torchao) beside;
    bench_capacity.png     the largest model each variant trains, and the GPU and host memory it takes.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(src: Path, sha: str | None = None) -> tuple[dict[tuple[str, str, str], float], str]:
    """The newest value of each (workload, variant, metric), and a title naming the GPU, torch and the commits."""
    rows: dict[tuple[str, str, str], dict[str, str]] = {}
    for r in csv.DictReader(src.open()):
        if sha is None or r["sha"] == sha:
            rows[(r["workload"], r["variant"], r["metric"])] = r
    if not rows:
        raise SystemExit(f"{src} has no rows" + (f" of commit {sha}" if sha else ""))
    values = {key: float(r.get("median") or r["value"]) for key, r in rows.items()}
    describe = {k: ", ".join(dict.fromkeys(r[k] for r in rows.values())) for k in ("gpu", "torch", "sha")}
    plural = "s" if "," in describe["sha"] else ""
    return values, f"{describe['gpu']}, torch {describe['torch']}, commit{plural} {describe['sha']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="?", type=Path, default=Path("benchmarks/results/bench_step_h200.csv"))
    parser.add_argument("out", nargs="?", type=Path, default=Path("docs"))
    parser.add_argument("--sha", help="draw only the rows of this commit (the CSV's sha column)")
    parser.add_argument("--only", nargs="+", default=[""], help="draw only the charts whose name starts so")
    args = parser.parse_args()
    out: Path = args.out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values, title = load(args.csv, args.sha)
    out.mkdir(parents=True, exist_ok=True)

    def save(fig: Any, name: str) -> None:
        if any(name.removeprefix("bench_").startswith(prefix) for prefix in args.only):
            fig.suptitle(title, fontsize=9)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            print(f"wrote {out / name}")
        plt.close(fig)

    chunks = sorted(
        (float(v.removeprefix("chunked-").removesuffix("MB")), values[(w, v, m)])
        for (w, v, m) in values
        if w == "adamw" and m == "step_s" and v.startswith("chunked-") and v.endswith("MB")
    )
    if chunks:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs, ys = zip(*chunks, strict=True)
        ax.plot(xs, ys, "o-", label="chunked (ours)")
        floor = [y / values[("adamw", f"chunked-{x:g}MB", "x_duplex_floor")] for x, y in chunks]
        ax.plot(xs, floor, "k--", label="duplex floor")
        reload = values.get(("adamw", "full-reload", "step_s"))
        if reload:
            ax.axhline(reload, color="#999", label="full reload")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk_size_mb")
        ax.set_ylabel("seconds per step (1e9 params)")
        ax.set_ylim(0, None)
        ax.legend()
        save(fig, "bench_step_chunks.png")

    peers = {v: values[(w, v, m)] for (w, v, m) in values if w == "peers" and m == "added_s_vs_resident"}
    if peers:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = sorted(peers, key=peers.get)  # type: ignore[arg-type]
        ax.bar(
            range(len(names)),
            [peers[n] for n in names],
            color=["#2a7" if n.startswith("chunked") else "#999" for n in names],
        )
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel("seconds added to a resident AdamW iteration")
        save(fig, "bench_step_peers.png")

    ratio: dict[str, dict[str, float]] = defaultdict(dict)
    for (w, v, m), x in values.items():
        if m == "x_duplex_floor":
            ratio[w][v] = x
    if ratio:
        fig, axes = plt.subplots(1, len(ratio), figsize=(5 * len(ratio), 4), squeeze=False)
        for ax, (workload, variants) in zip(axes[0], ratio.items(), strict=True):
            names = list(variants)
            ax.bar(
                range(len(names)),
                [variants[n] for n in names],
                color=["#2a7" if "chunked-" in n and "serial" not in n else "#999" for n in names],
            )
            ax.axhline(1.0, color="k", linewidth=0.8)
            ax.axhline(1.05, color="r", linewidth=0.8, linestyle="--")
            ax.set_xticks(range(len(names)), [n.replace("chunked-", "") for n in names], rotation=45, ha="right")
            ax.set_title(workload)
            ax.set_ylabel("step time / duplex floor")
        save(fig, "bench_step_floor.png")

    def plain(workload: str) -> bool:  # bench_train's eager, unsharded runs
        return not workload.endswith(("-fsdp2", "-blocks")) and "-compile-" not in workload

    exposed: dict[str, list[tuple[int, float]]] = defaultdict(list)
    floor_s = None
    for (w, v, m), x in values.items():
        if not plain(w):
            continue
        if m.startswith("exposed_x_floor@"):
            exposed[v].append((int(m.split("@")[1]), x))
        elif m == "step_floor_s":
            floor_s = x
    if exposed and floor_s:
        fig, ax = plt.subplots(figsize=(6, 4))
        for variant, points in sorted(exposed.items()):
            xs, ys = zip(*sorted(points), strict=True)
            peer = variant in ("deepspeed", "torchao")
            ax.plot(xs, [y * floor_s for y in ys], "o--" if peer else "o-", label=variant + ("" if peer else " (ours)"))
            tokens = xs
        ax.axhline(floor_s, color="k", linestyle="--", label="step transfer floor")
        ax.axhline(0.5 * floor_s, color="r", linewidth=0.8, linestyle=":", label="0.5 x floor (target, overlap)")
        ax.axhline(0.25 * floor_s, color="m", linewidth=0.8, linestyle=":", label="0.25 x floor (target, backward)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.set_xlabel("tokens per iteration")
        ax.set_ylabel("exposed optimizer seconds per iteration")
        ax.legend()
        save(fig, "bench_train.png")

    kept: dict[str, dict[int, float]] = defaultdict(dict)
    for (w, v, m), x in values.items():
        if m.startswith("kept@") and plain(w):
            kept[v][int(m.split("@")[1])] = x
    if kept:
        fig, ax = plt.subplots(figsize=(7, 4))
        sizes = sorted({t for row in kept.values() for t in row})
        width = 0.8 / len(kept)
        order = ("sync", "overlap", "backward", "backward-auto", "torchao", "deepspeed")  # ours, then the peers
        ranked = sorted(kept.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
        for k, (variant, row) in enumerate(ranked):
            xs = [i + (k - (len(kept) - 1) / 2) * width for i, t in enumerate(sizes) if t in row]
            peer = variant in ("deepspeed", "torchao")
            bars = ax.bar(xs, [100 * row[t] for t in sizes if t in row], width, label=variant,
                          hatch="//" if peer else None, alpha=0.6 if peer else 1.0)  # fmt: skip
            ax.bar_label(bars, fmt="%.1f", fontsize=6)
        ax.axhline(100, color="k", linewidth=0.8)
        ax.set_xticks(range(len(sizes)), [f"{t} tokens" for t in sizes])
        ax.set_ylabel("% of resident iterations/s kept")
        ax.set_ylim(0, 110)
        ax.legend(fontsize=7, ncol=3, loc="lower right")
        save(fig, "bench_train_kept.png")

    capacity = {v: {m: x for (_, vv, m), x in values.items() if vv == v} for (_, v, m) in values if m == "peak_gpu_gib"}
    if capacity:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, row in capacity.items():
            params = row["params"] / 1e9
            ax.bar([params - 0.15], [row["peak_gpu_gib"]], width=0.3, color="#2a7", label=f"{name}: GPU peak")
            ax.bar([params + 0.15], [row["host_rss_gib"]], width=0.3, color="#999", label=f"{name}: host RSS")
            ax.annotate(name, (params, max(row["peak_gpu_gib"], row["host_rss_gib"]) + 3), ha="center")
        ax.set_xlabel("largest model that trains (B params)")
        ax.set_ylabel("GiB")
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[:2], ["GPU peak", "host RSS"])
        save(fig, "bench_capacity.png")


if __name__ == "__main__":
    main()
