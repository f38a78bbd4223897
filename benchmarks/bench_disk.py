"""The disk tier ([Note: Disk tier]): the disk's own GB/s, then the step with a share of the state on disk, against
the floor set by the slowest tier's bytes, and a capacity trial past the host budget.

Question: what does a step cost when part of the optimizer state lives in files under ``spill_dir``, and how close
does it come to what the disk and the link allow?

Workloads:
    disk      the disk alone: a --probe-gib file written buffered (fsync, then the page cache dropped) and as the
              tier writes (O_DIRECT where the filesystem takes it), then read back buffered (one and two reader
              threads, as the tier reads) and with O_DIRECT, and half read while another half is written (each
              rate, and both bytes over the wall time: whether the disk reads and writes at full speed at once).
              Then the tier's pattern alone: up to 8 files of a chunk each read, rewritten (into the blocks of the
              generation the previous rename replaced, as the tier does: [Note: Spare generation]) and renamed over
              it, one at a time, against the floor of those bytes (what the disk gives the step's files, with no GPU
              and no overlap). And the CRC-32's GB/s, on one thread and in pieces on 4 as the tier sums (sums.py).
    step      fp32 matrices, fused AdamW, all state offloaded, with --shares of it on disk (0: host only). Each share
              runs in a process of its own (peak RSS is per process). Its floor is the larger of the link's (the
              bytes each way over the duplex bandwidth) and the disk's (bytes read over the read GB/s plus bytes
              written over the write GB/s, measured above). Final params are compared bitwise with resident AdamW.
    capacity  (--capacity-params N) bf16 params, remainder masters, a real forward and backward through a chain of
              matrices, the host arena capped at --capacity-host-gib and the rest on disk, for 2 steps.

Commands:
    PYTHONPATH=src:tests:benchmarks python3 benchmarks/bench_disk.py                  # GPU: 1e9 params; CPU: tiny
    PYTHONPATH=src:tests:benchmarks python3 benchmarks/bench_disk.py --capacity-params 1.1e10 --capacity-host-gib 64
    PYTHONPATH=src:tests:benchmarks python3 benchmarks/bench_disk.py --writes buffered   # the A/B of the tier's writes
    PYTHONPATH=src:tests:benchmarks python3 benchmarks/bench_disk.py --shares 0.25 --ab-rounds 3   # the checksums' A/B
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import chunked_offload.disk as disk_io
import chunked_offload.sums as sums
from chunked_offload import ChunkedOffloadOptimizer
from common import make_matrices, measure_link, set_random_grads, synchronize
from reference import spill_budget

GiB, MiB = 2**30, 2**20


def rss() -> dict[str, int]:
    """VmHWM (peak), VmRSS, RssAnon and RssFile of this process, in bytes."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class RssPeaks:
    """The highest RssAnon and RssFile of this process between ``start()`` and ``stop()``, each sampled every
    ``interval`` s (VmHWM is their sum's peak: this tells page-locked and heap memory from pages of mapped files, such
    as the kernel images of CUDA libraries read on first use)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.anon, self.file = interval, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            now = rss()
            self.anon, self.file = max(self.anon, now["RssAnon"]), max(self.file, now["RssFile"])
            if self._done.wait(self.interval):
                return

    def start(self) -> RssPeaks:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


# ------------------------------------------------------------------------------------------------ the disk alone
def _direct_read(path: Path, buf: mmap.mmap | memoryview) -> None:
    """Read the first ``len(buf)`` bytes of ``path`` into the page-aligned ``buf`` with O_DIRECT."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        view, done = memoryview(buf), 0
        while done < len(view):
            n = os.readv(fd, [view[done : done + 64 * MiB]])
            if not n:
                break
            done += n
    finally:
        os.close(fd)


def probe_disk(directory: Path, nbytes: int, pin: bool) -> dict[str, float]:
    """GB/s of the disk alone: the tier's buffered I/O and O_DIRECT, writes then reads."""
    nbytes -= nbytes % (4 * MiB)
    data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    data.random_(0, 255)
    out: dict[str, float] = {}
    path = directory / "probe.bin"

    def timed(key: str, fn: Any) -> None:
        t0 = time.perf_counter()
        fn()
        out[key] = nbytes / (time.perf_counter() - t0) / 1e9

    path.unlink(missing_ok=True)
    timed("write buffered+fsync", lambda: disk_io.write_new_file(path, data, direct=False))
    timed("read buffered, 1 thread", lambda: disk_io.read_file_into(path, data))
    halves = [data[: nbytes // 2], data[nbytes // 2 :]]
    paths = [directory / "probe0.bin", directory / "probe1.bin"]
    for p, h in zip(paths, halves, strict=True):
        p.unlink(missing_ok=True)
        disk_io.write_new_file(p, h)
    with ThreadPoolExecutor(2) as pool:
        timed("read buffered, 2 threads", lambda: list(pool.map(disk_io.read_file_into, paths, halves)))
    aligned = mmap.mmap(-1, nbytes)  # page-aligned, as a bounce buffer
    pages = torch.frombuffer(aligned, dtype=torch.uint8)
    pages.copy_(data)
    path.unlink()
    timed("write (the tier's)", lambda: disk_io.write_new_file(path, pages))  # O_DIRECT where the filesystem takes it
    if hasattr(os, "O_DIRECT"):
        try:
            timed("read O_DIRECT", lambda: _direct_read(path, aligned))
        except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
            print(f"# O_DIRECT: {e}")
        else:
            out.update(read_and_write_at_once(directory, path, aligned))
    for p in (path, *paths):
        p.unlink(missing_ok=True)
    out.update(probe_sums(data))
    return out


def probe_sums(data: torch.Tensor) -> dict[str, float]:
    """GB/s of the CRC-32 on one thread, and in pieces on SUM_THREADS as a store sums (the same value, or it raises)."""
    t0 = time.perf_counter()
    whole = sums.checksum(data)
    t1 = time.perf_counter()
    with ThreadPoolExecutor(sums.SUM_THREADS) as pool:
        pieces = sums.PieceSums(pool)
        pieces.add(data)
        joined = pieces.result()
    t2 = time.perf_counter()
    if joined != whole:
        raise RuntimeError(f"the CRC-32 joined from pieces is {joined:#010x}, zlib's over the whole {whole:#010x}")
    n = data.numel()
    return {"CRC-32 on 1 thread": n / (t1 - t0) / 1e9, f"CRC-32 in pieces on {sums.SUM_THREADS}": n / (t2 - t1) / 1e9}


def read_and_write_at_once(directory: Path, path: Path, aligned: mmap.mmap) -> dict[str, float]:
    """GB/s of each when half of ``path`` is read (O_DIRECT) while another half is written as the tier writes, on two
    threads at once: what a step that reads chunks while it writes others can get from the disk."""
    half = len(aligned) // 2 - len(aligned) // 2 % disk_io.ALIGN
    into, source = memoryview(aligned)[:half], torch.frombuffer(aligned, dtype=torch.uint8)[half : 2 * half]
    target = directory / "probe_w.bin"
    target.unlink(missing_ok=True)

    def rate(work: Any) -> float:
        t0 = time.perf_counter()
        work()
        return half / (time.perf_counter() - t0) / 1e9

    with ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        r = pool.submit(rate, lambda: _direct_read(path, into))
        w = pool.submit(rate, lambda: disk_io.write_new_file(target, source))
        rates = {"at once: read O_DIRECT": r.result(), "at once: write (the tier's)": w.result()}
        rates["at once: both"] = 2 * half / (time.perf_counter() - t0) / 1e9
    target.unlink()
    return rates


def tier_pattern(directory: Path, file_nbytes: int, files: int) -> tuple[float, int]:
    """The tier's disk work on ``files`` chunk files, without the GPU: each read into a bounce, then written into the
    spare's blocks and renamed over it, one after the other. Returns the seconds and the bytes of each file: what the
    disk alone gives for the step's pattern, to hold against the floor from the probe's rates."""
    file_nbytes -= file_nbytes % disk_io.ALIGN
    aligned = mmap.mmap(-1, file_nbytes)
    bounce = torch.frombuffer(aligned, dtype=torch.uint8)
    bounce.random_(0, 255)
    paths = [directory / f"pattern{k}.bin" for k in range(files)]
    for path in paths:
        path.unlink(missing_ok=True)
        disk_io.write_new_file(path, bounce)
    spare = directory / disk_io.SPARE
    t0 = time.perf_counter()
    for path in paths:
        disk_io.read_file_into(path, bounce)
        tmp = path.with_suffix(".tmp")
        if spare.exists():
            os.replace(spare, tmp)
        disk_io.write_new_file(tmp, bounce)
        os.link(path, spare)
        disk_io.replace_file(tmp, path)
    spare.unlink()  # as at a step's end
    seconds = time.perf_counter() - t0
    for path in paths:
        path.unlink(missing_ok=True)
    return seconds, file_nbytes


# ------------------------------------------------------------------------------------------------ one step variant
def warm_up(device: torch.device, spill_dir: Path, dim: int) -> None:
    """Load the CUDA context and the kernels the run uses (their images take host memory on first use), through two
    steps of a small wrapper with a chunk on disk and of the reference at the run's matrix size, then drop them: the
    base of the peak RSS is the process before the wrapper's memory, not before CUDA and the step's code."""
    fused = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(64, 64, device=device)) for _ in range(4)]
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(params, fused=fused), chunk_size_mb=0.02, spill_dir=spill_dir, host_budget_mb=0.15
    )
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, device=device)
        opt.step()
    opt.synchronize()
    del opt, params
    torch.randn(64, 64, device=device, dtype=torch.bfloat16) @ torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    full = make_matrices(2 * dim**2, dim, torch.float32, device)
    reference = torch.optim.AdamW(full, lr=1e-3, fused=fused)
    for step in range(2):
        set_random_grads(full, seed=step)
        reference.step()
    torch.equal(full[0], full[1])
    del reference, full
    synchronize(device)


def one_step_variant(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    warm_up(device, args.spill_dir, args.dim)
    at_base = rss()
    base = at_base["VmRSS"]
    params = make_matrices(args.params, args.dim, torch.float32, device)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    inner = torch.optim.AdamW(params, lr=1e-3, fused=device.type == "cuda")
    options: dict[str, Any] = {"chunk_size_mb": args.chunk_mb}
    if args.host_budget is not None:
        options.update(spill_dir=args.spill_dir, host_budget_mb=args.host_budget / MiB)
    peaks = RssPeaks().start()
    opt = ChunkedOffloadOptimizer(inner, **options)
    built = rss()["VmRSS"]  # the arena (page-locked) and the bounces, before any step
    ref = torch.optim.AdamW(reference, lr=1e-3, fused=device.type == "cuda")
    times, stats = [], []
    for step in range(args.iters + 1):
        set_random_grads(params, seed=step)
        synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        opt.synchronize()
        times.append(time.perf_counter() - t0)
        stats.append(opt.stats)
        opt.zero_grad()
        set_random_grads(reference, seed=step)
        ref.step()
        ref.zero_grad()
    synchronize(device)
    peaks.stop()
    exact = all(torch.equal(a, b) for a, b in zip(params, reference, strict=True))
    last = stats[-1]
    plan = opt.plan
    bound = plan.host_nbytes + (plan.num_slots + 1) * plan.bounce_nbytes * bool(plan.disk_chunks)
    shares = [float(x) for x in args.shares.split(",")]
    return {
        "budgets": {str(x): spill_budget(plan, x) for x in shares} if args.host_budget is None else {},
        "first_s": times[0],
        "step_s": statistics.median(times[1:]),
        "h2d": last.h2d_bytes,
        "d2h": last.d2h_bytes,
        "disk_read": last.disk_read_bytes,
        "disk_written": last.disk_written_bytes,
        "disk_gbps": last.disk_gbps,
        "disk_exposed_s": last.disk_exposed_seconds,
        "disk_checksum_s": last.disk_checksum_seconds,
        "state": plan.host_nbytes + plan.disk_nbytes,
        "on_disk": plan.disk_nbytes,
        "host_bound": bound,
        "rss_base": base,
        "rss_built": built,
        "anon_base": at_base["RssAnon"],
        "file_base": at_base["RssFile"],
        "anon_peak": peaks.anon,
        "file_peak": peaks.file,
        **{k.lower(): v for k, v in rss().items()},
        "exact": exact,
        "checksums": args.checksums,  # as the child ran (the A/B's check that its options reached it)
        "writes": args.writes,
    }


def capacity_trial(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """bf16 matrices, remainder masters, real forward/backward through the chain, host capped, 2 steps."""
    warm_up(device, args.spill_dir, args.dim)
    at_base = rss()
    base = at_base["VmRSS"]
    params = make_matrices(args.capacity_params, args.dim, torch.bfloat16, device)
    inner = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    opt = ChunkedOffloadOptimizer(
        inner,
        chunk_size_mb=args.chunk_mb,
        master_weights="remainder",
        spill_dir=args.spill_dir,
        host_budget_mb=args.capacity_host_gib * 1024,
    )
    x = torch.randn(8, args.dim, device=device, dtype=torch.bfloat16)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        h = x
        for w in params:
            h = torch.tanh(h @ w)
        h.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        times.append(time.perf_counter() - t0)
    plan = opt.plan
    return {
        "params": sum(p.numel() for p in params),
        "iter_s": times,
        "host_arena": plan.host_nbytes,
        "on_disk": plan.disk_nbytes,
        "host_bound": plan.host_nbytes + (plan.num_slots + 1) * plan.bounce_nbytes,
        "rss_base": base,
        # On the CPU the "device" is host memory: the params and their grads count in the RSS there.
        "device_in_rss": 0 if device.type == "cuda" else sum(2 * p.numel() * p.element_size() for p in params),
        **{k.lower(): v for k, v in rss().items()},
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
    }


# ------------------------------------------------------------------------------------------------ the driver
def child(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--params", str(args.params), "--dim", str(args.dim)]
    cmd += ["--chunk-mb", str(args.chunk_mb), "--iters", str(args.iters), "--spill-dir", str(args.spill_dir)]
    cmd += ["--shares", args.shares, "--writes", args.writes, "--checksums", args.checksums]
    cmd += extra  # last: what it sets wins over the run's own options (the A/B's "--checksums off")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def checksum_cost(args: argparse.Namespace, budget: int, on: dict[str, Any]) -> list[float]:
    """The step with checksums against the same share with them replaced by a constant, in ``args.ab_rounds`` rounds
    each run on, off, off, on (the first round's first ``on`` is ``on``): a disk that slows over the runs (its write
    cache filling) weighs on both sides alike. One cost per round; their spread shows the A/B's noise."""
    costs = []
    for round_ in range(args.ab_rounds):
        first = on if round_ == 0 else child(args, ["--one", "--host-budget", str(budget)])
        offs = [child(args, ["--one", "--host-budget", str(budget), "--checksums", "off"]) for _ in range(2)]
        if any(off["checksums"] != "off" for off in offs):
            raise RuntimeError(f"the A/B's runs without checksums ran with checksums {[o['checksums'] for o in offs]}")
        again = child(args, ["--one", "--host-budget", str(budget)])
        costs.append((first["step_s"] + again["step_s"]) / (offs[0]["step_s"] + offs[1]["step_s"]) - 1)
    return costs


def main() -> int:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9 if gpu else 2e6)
    parser.add_argument("--dim", type=int, default=4096 if gpu else 256)
    parser.add_argument("--chunk-mb", type=float, default=256 if gpu else 1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--shares", default="0,0.25,0.5")
    parser.add_argument("--probe-gib", type=float, default=8 if gpu else 0.05)
    parser.add_argument("--spill-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--capacity-params", type=float, default=0)
    parser.add_argument("--capacity-host-gib", type=float, default=64)
    parser.add_argument(
        "--writes", choices=["tier", "buffered"], default="tier",
        help="buffered: the tier writes its files buffered, then fsync (an A/B against its O_DIRECT on one machine)",
    )  # fmt: skip
    parser.add_argument(
        "--checksums", choices=["on", "off"], default="on",
        help="off: the tier's CRC-32 of each chunk replaced by a constant (the A/B of [Note: Chunk integrity])",
    )  # fmt: skip
    parser.add_argument(
        "--ab-rounds", type=int, default=1,
        help="rounds of the checksum A/B (on, off, off, on each); the median is shown",
    )  # fmt: skip
    parser.add_argument("--host-budget", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--capacity", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device("cuda" if gpu else "cpu")
    if args.one or args.capacity:
        if args.writes == "buffered":
            disk_io.write_new_file = functools.partial(disk_io.write_new_file, direct=False)
        if args.checksums == "off":
            sums.checksum = lambda data: 0
        print(json.dumps(capacity_trial(args, device) if args.capacity else one_step_variant(args, device)))
        return 0

    disk = probe_disk(args.spill_dir, int(args.probe_gib * GiB), pin=gpu)
    print("disk alone (GB/s):", ", ".join(f"{k} {v:.2f}" for k, v in disk.items()))
    link = measure_link(device, 256 * MiB) if gpu else None
    duplex = link.duplex if link is not None else float("inf")
    if link is not None:
        print(f"link (GB/s): H2D {link.h2d / 1e9:.1f}, D2H {link.d2h / 1e9:.1f}, each way at once {duplex / 1e9:.1f}")
    written = "write (the tier's)" if args.writes == "tier" else "write buffered+fsync"
    read_bw, write_bw = disk["read buffered, 2 threads"] * 1e9, disk[written] * 1e9
    files = max(1, min(8, int(args.probe_gib * GiB // (args.chunk_mb * MiB))))
    seconds, nbytes = tier_pattern(args.spill_dir, int(args.chunk_mb * MiB), files)
    pattern_floor = files * nbytes * (1 / read_bw + 1 / write_bw)
    print(
        f"the tier's pattern alone ({files} files of {nbytes / MiB:.0f} MiB, each read, rewritten and renamed, one "
        f"at a time): {seconds:.3f} s, {seconds / pattern_floor:.2f}x the floor of its bytes"
    )
    host_only = child(args, ["--one"])  # its plan sets the host budgets of the other shares
    direct_read, direct_write = disk.get("read O_DIRECT", disk["read buffered, 2 threads"]) * 1e9, write_bw
    rows, ok = [], True
    for share in (float(s) for s in args.shares.split(",")):
        budget = host_only["budgets"][str(share)]
        row = host_only if share == 0 else child(args, ["--one", "--host-budget", str(budget)])
        if share and args.checksums == "on":
            row["checksum_costs"] = checksum_cost(args, budget, row)
            row["checksum_cost"] = statistics.median(row["checksum_costs"])
        link_floor = max(row["h2d"], row["d2h"]) / duplex
        disk_floor = row["disk_read"] / read_bw + row["disk_written"] / write_bw
        row["direct_floor"] = max(row["disk_read"] / direct_read, row["disk_written"] / direct_write, link_floor)
        at_once = disk.get("at once: read O_DIRECT"), disk.get("at once: write (the tier's)")
        row["at_once_floor"] = (
            max(row["disk_read"] / (at_once[0] * 1e9), row["disk_written"] / (at_once[1] * 1e9), link_floor)
            if at_once[0] and at_once[1]
            else float("nan")
        )
        floor = max(link_floor, disk_floor)
        rows.append((share, row, floor, "disk" if disk_floor > link_floor else "link"))
        ok &= row["exact"]
    print(
        "\nfloor: the link's, or the disk's read then written bytes at the rates above; x direct: against the larger "
        "of the bytes read over the O_DIRECT read rate and the bytes written over the tier's write rate (both at "
        "once); x at once: the same with the rates the disk gave while reading and writing at once; checksum: the step "
        "against the same share with the checksums off (run on, off, off, on; the median of --ab-rounds); sum "
        "waits: the time the disk's reads and writes waited for their checksums, a share of the step"
    )
    print(f"{'on disk':>8} {'step s':>8} {'floor s':>8} {'x floor':>8} {'bound':>5} {'x direct':>8} {'x at once':>9} "
          f"{'disk GB/s':>9} "
          f"{'exposed':>8} {'checksum':>8} {'sum waits':>9} {'peak RSS - base GiB':>20} {'built - base':>12} "
          f"{'host bound GiB':>15} "
          f"{'exact':>6}")  # fmt: skip
    for _share, row, floor, tier in rows:
        peak = (row["vmhwm"] - row["rss_base"]) / GiB
        cost = f"{row['checksum_cost']:+.1%}" if "checksum_cost" in row else "-"
        direct = row["step_s"] / row["direct_floor"] if row["direct_floor"] else float("nan")
        print(
            f"{row['on_disk'] / max(row['state'], 1):>8.0%} {row['step_s']:>8.3f} {floor:>8.3f} "
            f"{row['step_s'] / floor if floor else float('nan'):>8.2f} {tier:>5} {direct:>8.2f} "
            f"{row['step_s'] / row['at_once_floor'] if row['at_once_floor'] else float('nan'):>9.2f} "
            f"{row['disk_gbps']:>9.2f} {row['disk_exposed_s']:>8.3f} {cost:>8} "
            f"{row['disk_checksum_s'] / row['step_s']:>9.2%} {peak:>20.3f} "
            f"{(row['rss_built'] - row['rss_base']) / GiB:>12.3f} "
            f"{row['host_bound'] / GiB:>15.3f} {row['exact']!s:>6}"
        )
    if args.ab_rounds > 1:
        print("checksum A/B, each round (on, off, off, on): " + "; ".join(
            f"{row['on_disk'] / max(row['state'], 1):.0%} on disk: "
            + ", ".join(f"{c:+.1%}" for c in row["checksum_costs"])
            for _share, row, _floor, _tier in rows if "checksum_costs" in row
        ))  # fmt: skip
    print("peaks over the base, sampled every 2 ms (GiB): " + "; ".join(
        f"{row['on_disk'] / max(row['state'], 1):.0%} on disk: anonymous "
        f"{(row['anon_peak'] - row['anon_base']) / GiB:.3f} (bound {row['host_bound'] / GiB:.3f}), file-backed "
        f"{(row['file_peak'] - row['file_base']) / GiB:+.3f}"
        for _share, row, _floor, _tier in rows
    ))  # fmt: skip
    if args.capacity_params:
        cap = child(args, ["--capacity", "--capacity-params", str(args.capacity_params),
                           "--capacity-host-gib", str(args.capacity_host_gib)])  # fmt: skip
        print(
            f"\ncapacity: {cap['params'] / 1e9:.2f} B params, remainder masters, host arena "
            f"{cap['host_arena'] / GiB:.1f} GiB + {cap['on_disk'] / GiB:.1f} GiB on disk; iterations "
            + ", ".join(f"{t:.1f} s" for t in cap["iter_s"])
            + f"; peak RSS {cap['vmhwm'] / GiB:.1f} GiB (base {cap['rss_base'] / GiB:.1f}, bound "
            f"{cap['host_bound'] / GiB:.1f} + base"
            + (
                f" + {cap['device_in_rss'] / GiB:.1f} of params and grads, the CPU's device"
                if cap["device_in_rss"]
                else ""
            )
            + f"); params finite: {cap['finite']}"
        )
    print("\nexact: every variant bitwise equal to resident AdamW" if ok else "\nNOT EXACT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
