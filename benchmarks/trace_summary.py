"""Summarise profiler traces (``bench_train.py --trace DIR``): GPU idle per iteration and host ms per chunk.

    python benchmarks/trace_summary.py DIR [--iters 2] [--ops 12] [--kernels 12] [--gaps 6]

GPU idle is the part of the span from the first to the last GPU activity (kernels, copies, memsets, on any stream)
in which none runs, divided by the iterations traced. The main stream is the one with the most kernel time (the
caller's): its busy ms per iteration grows where its kernels run longer or more of them run there, its idle ms where
it waits for the host or for another stream (a step's exposed tail). Host ms per chunk is the duration of the
``chunked_offload::chunk`` scope: the host's work to stage, step and commit one chunk. ``--ops N`` also lists, per
trace, the N host ops with the most self time inside those scopes (ms per chunk, calls per chunk): where the host
time of a chunk goes. ``--kernels N`` lists, per trace, the N kernel names with the most GPU time per iteration,
and the N with the most GPU idle just before them (which work the GPU waited for: compare a mode with resident).
``--gaps N`` lists, per trace, the main stream's N longest gaps, the work on either side of each, and what the other
streams ran inside it: what the caller's stream waited for (a step's kernels, or a copy that a small device-to-host
read of the caller queued behind on the copy engine).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
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


def _stream(e: dict[str, Any]) -> Any:
    return e.get("args", {}).get("stream", e.get("tid"))


def _main_stream(events: list[dict[str, Any]]) -> Any:
    """The stream with the most kernel time: the caller's."""
    kernel_us: dict[Any, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            stream = _stream(e)
            kernel_us[stream] = kernel_us.get(stream, 0.0) + e["dur"]
    return max(kernel_us, key=kernel_us.__getitem__, default=None)


def summarise(path: Path, iters: int) -> dict[str, float]:
    events = _events(path)
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU]
    chunks = [e["dur"] for e in events if e.get("name") == CHUNK and e.get("cat") == "user_annotation"]
    span = max(b for _, b in gpu) - min(a for a, _ in gpu) if gpu else 0.0
    main = _main_stream(events)
    main_busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU and _stream(e) == main])
    return {
        "span_ms": span / 1e3 / iters,
        "idle_ms": (span - busy_us(gpu)) / 1e3 / iters,
        "main_busy_ms": main_busy / 1e3 / iters,
        "main_idle_ms": (span - main_busy) / 1e3 / iters,
        "chunks": len(chunks) / iters,
        "host_ms_per_chunk": statistics.mean(chunks) / 1e3 if chunks else 0.0,
    }


def chunk_ops(path: Path) -> list[tuple[str, float, float]]:
    """``(name, self ms per chunk, calls per chunk)`` of the host ops inside the chunk scopes, most self time first.

    Self time is an op's duration less that of the ops directly inside it (on the same thread).
    """
    events = _events(path)
    host = sorted(
        (e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")),
        key=lambda e: (e["tid"], e["ts"], -e["dur"]),
    )
    totals: dict[str, list[float]] = {}
    chunks = 0
    stack: list[tuple[dict[str, Any], list[float]]] = []  # (event, [children's duration]) of the open scopes

    def close(until: float, tid: Any) -> None:
        while stack and (stack[-1][0]["tid"] != tid or stack[-1][0]["ts"] + stack[-1][0]["dur"] <= until):
            event, children = stack.pop()
            if any(e["name"] == CHUNK for e, _ in stack) or event["name"] == CHUNK:
                entry = totals.setdefault(re.sub(r" at 0x[0-9a-f]+", "", event["name"]), [0.0, 0.0])
                entry[0] += event["dur"] - children[0]
                entry[1] += 1
            if stack:
                stack[-1][1][0] += event["dur"]

    for e in host:
        close(e["ts"], e["tid"])
        chunks += e["name"] == CHUNK
        stack.append((e, [0.0]))
    close(float("inf"), None)
    n = max(chunks, 1)
    rows = [(name, us / 1e3 / n, calls / n) for name, (us, calls) in totals.items()]
    return sorted(rows, key=lambda r: -r[1])


def _short(name: str) -> str:
    return re.sub(r"<.*", "", name)[:60]


def kernel_rows(path: Path, iters: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Per kernel name, ms per iteration: GPU time, and the GPU idle (no activity on any stream) just before it."""
    events = sorted((e for e in _events(path) if e.get("cat") in GPU), key=lambda e: e["ts"])
    time: dict[str, float] = {}
    idle_before: dict[str, float] = {}
    end = float("-inf")
    for e in events:
        name = _short(e["name"]) if e.get("cat") == "kernel" else e.get("cat", "")
        time[name] = time.get(name, 0.0) + e["dur"]
        if e["ts"] > end > float("-inf"):
            idle_before[name] = idle_before.get(name, 0.0) + e["ts"] - end
        end = max(end, e["ts"] + e["dur"])

    def rows(totals: dict[str, float]) -> list[tuple[str, float]]:
        return sorted(((k, v / 1e3 / iters) for k, v in totals.items()), key=lambda r: -r[1])

    return rows(time), rows(idle_before)


def main_gaps(path: Path, n: int, least_us: float = 300.0) -> list[tuple[float, str, str, list[tuple[str, float]]]]:
    """The main stream's ``n`` longest gaps of at least ``least_us``: ``(ms, work before, work after, [(stream: work,
    ms inside the gap)])``, longest first; other streams' work is summed by stream and name, most time first."""
    gpu = [e for e in _events(path) if e.get("cat") in GPU]
    main = _main_stream(gpu)
    mine = sorted((e for e in gpu if _stream(e) == main), key=lambda e: e["ts"])
    found = []
    for a, b in zip(mine, mine[1:], strict=False):
        start, end = a["ts"] + a["dur"], b["ts"]
        if end - start < least_us:
            continue
        inside: dict[str, float] = {}
        for e in gpu:
            overlap = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
            if _stream(e) != main and overlap > 0:
                key = f"{_stream(e)}: {_short(e['name'])}"
                inside[key] = inside.get(key, 0.0) + overlap / 1e3
        found.append(
            ((end - start) / 1e3, _short(a["name"]), _short(b["name"]), sorted(inside.items(), key=lambda r: -r[1]))
        )
    return sorted(found, key=lambda r: -r[0])[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path, help="a directory of *.json.gz traces, or one trace")
    parser.add_argument("--iters", type=int, default=2, help="iterations in each trace (bench_train traces 2)")
    parser.add_argument("--ops", type=int, default=0, metavar="N", help="the N host ops with most self time per chunk")
    parser.add_argument("--kernels", type=int, default=0, metavar="N", help="the N kernels with most time, idle before")
    parser.add_argument("--gaps", type=int, default=0, metavar="N", help="the main stream's N longest gaps, and why")
    args = parser.parse_args()
    paths = sorted(args.traces.glob("*.json*")) if args.traces.is_dir() else [args.traces]
    print(
        f"{'trace':>34} {'ms/iter':>8} {'GPU idle ms/iter':>17} {'main busy':>10} {'main idle':>10} "
        f"{'chunks/iter':>12} {'host ms/chunk':>14}"
    )
    for path in paths:
        s = summarise(path, args.iters)
        name = path.name.removesuffix(".gz").removesuffix(".json")
        print(
            f"{name:>34} {s['span_ms']:8.1f} {s['idle_ms']:17.2f} {s['main_busy_ms']:10.1f} {s['main_idle_ms']:10.2f} "
            f"{s['chunks']:12.1f} {s['host_ms_per_chunk']:14.3f}"
        )
    for path in paths if args.ops else []:
        rows = chunk_ops(path)
        if rows:
            print(f"\n{path.name}: host self ms per chunk, calls per chunk")
            for op, ms, calls in rows[: args.ops]:
                print(f"  {op[:60]:60} {ms:8.3f} {calls:8.1f}")
    for path in paths if args.kernels else []:
        time, idle = kernel_rows(path, args.iters)
        print(f"\n{path.name}: GPU ms per iteration by kernel | GPU idle ms per iteration just before it")
        for row in range(min(args.kernels, len(time))):
            (k1, t), (k2, i) = time[row], idle[row] if row < len(idle) else ("", 0.0)
            print(f"  {k1:60} {t:8.2f} | {k2:60} {i:7.2f}")
    for path in paths if args.gaps else []:
        print(f"\n{path.name}: the main stream's longest gaps (ms), and the other streams' work inside them (ms)")
        for ms, before, after, inside in main_gaps(path, args.gaps):
            print(f"  {ms:6.2f} after {before!r}, before {after!r}")
            for work, overlap in inside[:4]:
                print(f"         {overlap:6.2f} {work}")


if __name__ == "__main__":
    main()
