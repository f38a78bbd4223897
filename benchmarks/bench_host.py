"""What the host's memory sustains: the ceiling for several GPUs of one host that offload at once.

Question: when every GPU of a host copies its optimizer state over its own link at the same time, they share the
host's DRAM bandwidth. How much does this host give, and how much do concurrent copies to and from one GPU take?

Measures, on the machine it runs on:
    host copy     pinned -> pinned memcpy of a 1 GiB buffer split over 1, 2, 4, 8 and 16 threads (torch copies in
                  worker threads; each thread copies its own slice), GB/s of bytes copied (each byte is read once
                  and written once, so DRAM traffic is twice that);
    link          H2D, D2H, and both at once, over 1, 2 and 4 concurrent streams per direction, from pinned memory.

Command:
    PYTHONPATH=src python3 benchmarks/bench_host.py [--gib 1] [--csv out/bench_host.csv]
The model in docs/distributed.md turns these into what N GPUs of such a host can sustain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, device_name  # noqa: E402


def host_copy_gbps(nbytes: int, threads: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).fill_(1)
    dst = torch.empty_like(src, pin_memory=torch.cuda.is_available())
    bounds = [nbytes * k // threads for k in range(threads + 1)]
    torch.set_num_threads(1)  # one OS thread per slice: the threads below, not torch's pool

    def work(k: int) -> None:
        dst[bounds[k] : bounds[k + 1]].copy_(src[bounds[k] : bounds[k + 1]])

    seconds = []
    for _ in range(repeats):
        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        seconds.append(time.perf_counter() - t0)
    return nbytes / statistics.median(seconds) / 1e9


def link_gbps(nbytes: int, streams: int, direction: str, repeats: int = 5) -> float:
    """Bytes per second over the link with ``streams`` streams per direction (both: H2D and D2H at once)."""
    device = torch.device("cuda")
    piece = nbytes // streams
    ways = ["h2d", "d2h"] if direction == "both" else [direction]
    host = {w: [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(streams)] for w in ways}
    dev = {w: [torch.empty(piece, dtype=torch.uint8, device=device) for _ in range(streams)] for w in ways}
    pool = {w: [torch.cuda.Stream(device) for _ in range(streams)] for w in ways}
    seconds = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for w in ways:
            for s, h, d in zip(pool[w], host[w], dev[w], strict=True):
                with torch.cuda.stream(s):
                    (d.copy_(h, non_blocking=True) if w == "h2d" else h.copy_(d, non_blocking=True))
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    moved = piece * streams * len(ways)
    return moved / statistics.median(seconds[1:]) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per measurement, in GiB")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    rec = Recorder(device)
    print(f"{device_name(device)}, torch {torch.__version__}, {nbytes / 2**30:.2f} GiB per measurement")
    print(f"{'host copy threads':>18} {'GB/s':>8}")
    for threads in (1, 2, 4, 8, 16):
        gbps = host_copy_gbps(nbytes, threads)
        rec.add("host", f"copy-{threads}-threads", "gbps", gbps)
        print(f"{threads:>18} {gbps:>8.1f}")
    if gpu:
        print(f"\n{'link':>6} {'streams':>8} {'GB/s':>8}")
        for direction in ("h2d", "d2h", "both"):
            for streams in (1, 2, 4):
                gbps = link_gbps(nbytes, streams, direction)
                rec.add("link", f"{direction}-{streams}-streams", "gbps", gbps)
                print(f"{direction:>6} {streams:>8} {gbps:>8.1f}")
    else:
        print("\nno GPU: the link was not measured")
    if args.csv:
        rec.write(args.csv)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
