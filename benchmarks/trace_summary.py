"""Summarise profiler traces (``bench_train.py --trace DIR``): GPU idle per iteration and host ms per chunk.

    python benchmarks/trace_summary.py DIR [--iters 2]

GPU idle is the part of the span from the first to the last GPU activity (kernels, copies, memsets, on any stream)
in which none runs, divided by the iterations traced. Host ms per chunk is the duration of the
``chunked_offload::chunk`` scope: the host's work to stage, step and commit one chunk.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

GPU = {"kernel", "gpu_memcpy", "gpu_memset"}
CHUNK = "chunked_offload::chunk"


def _events(path: Path) -> list[dict[str, Any]]:
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(path: Path, iters: int) -> dict[str, float]:
    events = _events(path)
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU]
    chunks = [e["dur"] for e in events if e.get("name") == CHUNK and e.get("cat") == "user_annotation"]
    span = max(b for _, b in gpu) - min(a for a, _ in gpu) if gpu else 0.0
    return {
        "span_ms": span / 1e3 / iters,
        "idle_ms": (span - busy_us(gpu)) / 1e3 / iters,
        "chunks": len(chunks) / iters,
        "host_ms_per_chunk": statistics.mean(chunks) / 1e3 if chunks else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path, help="a directory of *.json.gz traces, or one trace")
    parser.add_argument("--iters", type=int, default=2, help="iterations in each trace (bench_train traces 2)")
    args = parser.parse_args()
    paths = sorted(args.traces.glob("*.json*")) if args.traces.is_dir() else [args.traces]
    print(f"{'trace':>34} {'ms/iter':>8} {'GPU idle ms/iter':>17} {'chunks/iter':>12} {'host ms/chunk':>14}")
    for path in paths:
        s = summarise(path, args.iters)
        name = path.name.removesuffix(".gz").removesuffix(".json")
        print(f"{name:>34} {s['span_ms']:8.1f} {s['idle_ms']:17.2f} {s['chunks']:12.1f} {s['host_ms_per_chunk']:14.3f}")


if __name__ == "__main__":
    main()
