"""How fast the host arena is created, and how much host memory it wastes, against pinning tensor by tensor.

Command:
    PYTHONPATH=src python3 benchmarks/bench_arena.py                   # GPU: 1, 4, 16 and 32 GB
    PYTHONPATH=src python3 benchmarks/bench_arena.py --sizes-gb 1,8

For each size, the same Llama-like list of tensors (the state of some 7B-shaped layers, in fp32) is given host homes
twice: as one HostArena (exact size, zero-filled in parallel, page-locked with cudaHostRegister in chunk-aligned
pieces), and as one ``torch.empty(..., pin_memory=True)`` per tensor (torch's caching host allocator, which rounds
every block up to a power of two). Speed is requested bytes over wall time; waste is what the process holds over
what was requested (for the per-tensor baseline, the allocator's reserved bytes; for the arena, its allocation).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from chunked_offload.host_arena import HostArena
from common import ROOT, Recorder, progress

GB = 10**9
# Shapes of the per-layer state tensors of a 7B Llama (4096 hidden, 11008 intermediate): not powers of two.
LAYER = [(4096, 4096)] * 4 + [(11008, 4096)] * 3 + [(4096,)] * 2


def tensor_sizes(total: int) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < total:
        for shape in LAYER:
            n = 4
            for d in shape:
                n *= d
            sizes.append(n)
    return sizes


def arena(sizes: list[int], pin: bool) -> tuple[float, float]:
    gc.collect()
    t0 = time.perf_counter()
    a = HostArena(sum(sizes), pin=pin)
    seconds = time.perf_counter() - t0
    held = a._storage.nbytes()
    del a
    return seconds, held


def _host_reserved() -> int | None:
    stats = torch.cuda.host_memory_stats()
    for key in ("reserved_bytes.current", "segment.current", "allocated_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


def per_tensor(sizes: list[int]) -> tuple[float, float]:
    gc.collect()
    torch.cuda.empty_cache()
    before = _host_reserved()
    t0 = time.perf_counter()
    tensors = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    for t in tensors:
        t.zero_()
    seconds = time.perf_counter() - t0
    after = _host_reserved()
    # The caching host allocator's own count where this torch reports it; else its rounding rule (powers of two).
    held = after - before if after is not None and before is not None else sum(1 << (n - 1).bit_length() for n in sizes)
    del tensors
    torch.cuda.empty_cache()  # also empties the caching host allocator
    return seconds, held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", default=None, help="default 1,4,16,32 on a GPU, 0.25,1 on a CPU")
    parser.add_argument("--csv", type=Path, default=ROOT / "out" / "bench_arena.csv")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    sizes_gb = [float(s) for s in (args.sizes_gb or ("1,4,16,32" if gpu else "0.25,1")).split(",")]
    rec = Recorder(device)
    print(f"# {rec.meta['gpu']}, torch {rec.meta['torch']}, commit {rec.meta['sha']}")
    rows = []
    for gb in progress(sizes_gb, desc="sizes"):
        sizes = tensor_sizes(int(gb * GB))
        requested = sum(sizes)
        variants = [("arena", lambda s=sizes: arena(s, pin=gpu))]
        if gpu:
            variants.append(("pin_memory-per-tensor", lambda s=sizes: per_tensor(s)))
        for name, fn in variants:
            seconds, held = fn()
            rows.append((gb, name, requested, seconds, held))
            rec.add(f"{gb:g}GB", name, "GBps", requested / seconds / GB)
            rec.add(f"{gb:g}GB", name, "waste_ratio", held / requested)
    rec.write(args.csv)
    print(f"\n{'size':>6} {'variant':<24} {'tensors':>8} {'seconds':>8} {'GB/s':>7} {'held/requested':>15}")
    for gb, name, requested, seconds, held in rows:
        print(
            f"{gb:>5g}G {name:<24} {len(tensor_sizes(int(gb * GB))):>8} {seconds:>8.2f} "
            f"{requested / seconds / GB:>7.2f} {held / requested:>15.4f}"
        )
    if not gpu:
        print("# CPU run: the arena is not page-locked here; the per-tensor baseline needs CUDA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
