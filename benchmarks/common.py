"""Shared benchmark pieces: workloads, link measurement, timing, the full-reload baseline, CSV rows."""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from chunked_offload.host_arena import HostArena  # noqa: E402


def git_sha() -> str:
    """The commit measured: ``CHUNKED_OFFLOAD_SHA`` (set by scripts/gpu_check.sh for copies without .git), else git."""
    if os.environ.get("CHUNKED_OFFLOAD_SHA"):
        return os.environ["CHUNKED_OFFLOAD_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def progress(iterable: Any, desc: str, total: int | None = None) -> Any:
    """A tqdm progress bar on stderr when it is a terminal and tqdm is installed; the plain iterable otherwise (a bar
    written to a file would interleave with the results)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    if not sys.stderr.isatty():
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


@dataclass
class Stats:
    median: float
    p20: float
    p80: float

    @classmethod
    def of(cls, xs: list[float]) -> Stats:
        qs = statistics.quantiles(xs, n=5) if len(xs) >= 2 else [xs[0]] * 4
        return cls(statistics.median(xs), qs[0], qs[3])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, side_streams: tuple[Any, ...] = ()
) -> list[float]:
    """Seconds per call: CUDA events on a GPU (each call synchronised), perf_counter on the CPU.

    ``side_streams`` are joined before the end event, so that work ``fn`` leaves in flight there (the last
    chunk's D2H) is inside the measurement: steps are timed to their last byte.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            for stream in side_streams:
                torch.cuda.current_stream(device).wait_stream(stream)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


@dataclass
class Link:
    h2d: float  # bytes/s, pinned host -> device
    d2h: float  # bytes/s, device -> pinned host
    duplex: float  # bytes/s each way, both directions at once


def at_once(device: torch.device, h2d: Callable[[], None], d2h: Callable[[], None]) -> Callable[[], None]:
    """A call that runs ``h2d`` and ``d2h`` on two streams of their own at once, inside the caller's stream's order.

    Both start after what the caller's stream has enqueued (the timing event), and the caller's stream waits for
    both (the end event covers them).
    """
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    def both() -> None:
        main = torch.cuda.current_stream(device)
        for s in streams:
            s.wait_stream(main)
        with torch.cuda.stream(streams[0]):
            h2d()
        with torch.cuda.stream(streams[1]):
            d2h()
        for s in streams:
            main.wait_stream(s)

    return both


def measure_link(device: torch.device, nbytes: int, iters: int = 5) -> Link:
    """Pinned host <-> device bandwidth in one direction and in both at once (two streams)."""
    pin = device.type == "cuda"
    arenas = [HostArena(nbytes, pin=pin) for _ in range(2)]  # kept alive: dropping one unregisters its memory
    host = [a.region(0, nbytes) for a in arenas]
    for h in host:
        h.fill_(1)
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]

    def h2d() -> None:
        dev[0].copy_(host[0], non_blocking=True)

    def d2h() -> None:
        host[1].copy_(dev[1], non_blocking=True)

    if device.type != "cuda":
        t_h2d = statistics.median(time_calls(h2d, device, 1, iters))
        t_d2h = statistics.median(time_calls(d2h, device, 1, iters))
        return Link(nbytes / t_h2d, nbytes / t_d2h, nbytes / max(t_h2d, t_d2h))
    both = at_once(device, h2d, d2h)
    t_h2d = statistics.median(time_calls(h2d, device, 2, iters))
    t_d2h = statistics.median(time_calls(d2h, device, 2, iters))
    t_both = statistics.median(time_calls(both, device, 2, iters))
    return Link(nbytes / t_h2d, nbytes / t_d2h, nbytes / t_both)


def arena_duplex_seconds(arena: HostArena, device: torch.device, piece: int = 256 * 2**20, iters: int = 3) -> float:
    """Seconds to copy a whole host arena to the device and back at once, in ``piece``-byte copies.

    The floor of a step over exactly the pages it moves: two runs of the same benchmark get different physical host
    pages, whose link speed differs by a few percent, so a step's ratio to this floor is steadier than its ratio to
    a link measured once on other memory. The device->host copies overwrite the arena: call it once the arena's
    contents are no longer needed.
    """
    n = arena.nbytes
    if device.type != "cuda" or n == 0:
        return 0.0
    size = min(piece, n)
    bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
    starts = list(range(0, n, size))

    def h2d() -> None:
        for lo in starts:
            m = min(size, n - lo)
            bufs[0][:m].copy_(arena.region(lo, m), non_blocking=True)

    def d2h() -> None:
        for lo in reversed(starts):  # from the other end, as a step's H2D and D2H touch different chunks
            m = min(size, n - lo)
            arena.region(lo, m).copy_(bufs[1][:m], non_blocking=True)

    return statistics.median(time_calls(at_once(device, h2d, d2h), device, 1, iters))


def make_matrices(
    n_params: float, dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> list[torch.nn.Parameter]:
    """``round(n_params / dim**2)`` square matrices (at least one)."""
    count = max(1, round(n_params / dim**2))
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(dim, dim, generator=gen, device=device, dtype=torch.float32).to(dtype) * 0.02)
        for _ in range(count)
    ]


def set_random_grads(params: list[torch.nn.Parameter], seed: int = 1) -> None:
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).to(p.dtype) * 1e-3


class FullReload:
    """Baseline: all state H2D, the resident step, all D2H (as Megatron's ``--offload-optimizer-states``).

    The first step creates the state on the device; afterwards every state tensor lives in pinned host memory
    between steps and is copied in and out whole around each step.
    """

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.host: dict[tuple[int, str], torch.Tensor] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def _tensors(self) -> list[tuple[tuple[int, str], dict[str, Any], str]]:
        out = []
        for i, p in enumerate(q for g in self.inner.param_groups for q in g["params"]):
            state = self.inner.state.get(p, {})
            out += [((i, k), state, k) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    @torch.no_grad()
    def step(self) -> None:
        if self.host is None:
            self.inner.step()
            pin = _device_of(self.inner).type == "cuda"
            self.host = {
                key: (state[k].to("cpu").pin_memory() if pin else state[k].to("cpu", copy=True))
                for key, state, k in self._tensors()
            }
            for key, state, k in self._tensors():
                state[k] = self.host[key]
            return
        for key, state, k in self._tensors():
            state[k] = self.host[key].to(_device_of(self.inner), non_blocking=True)
        self.inner.step()
        for key, state, k in self._tensors():
            self.host[key].copy_(state[k], non_blocking=True)
            state[k] = self.host[key]
        synchronize(_device_of(self.inner))


def _device_of(opt: torch.optim.Optimizer) -> torch.device:
    return opt.param_groups[0]["params"][0].device


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device, held: int = 0) -> int:
    """Peak device memory allocated during ``fn`` above what was allocated before it, plus ``held`` bytes that
    the optimizer already held before the call (its staging slots), so the figure is the whole step window."""
    if device.type != "cuda":
        return 0
    synchronize(device)
    base = torch.cuda.memory_allocated(device) - held
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


class SerialChunked:
    """Baseline: the first chunked offloaders' loop. Per chunk: H2D its state, step it, D2H it, wait on the host.

    Nothing overlaps: the link idles during each step and the GPU idles during each copy.
    """

    def __init__(self, inner: torch.optim.Optimizer, chunk_bytes: int) -> None:
        self.inner = inner
        self.chunks: list[list[torch.Tensor]] = [[]]
        nbytes = 0
        for p in (q for g in inner.param_groups for q in g["params"]):
            if self.chunks[-1] and nbytes + 8 * p.numel() * p.element_size() > chunk_bytes:
                self.chunks.append([])
                nbytes = 0
            self.chunks[-1].append(p)
            nbytes += 8 * p.numel() * p.element_size()
        self.host: dict[tuple[int, str], torch.Tensor] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        device = _device_of(self.inner)
        groups = self.inner.param_groups
        saved = [g["params"] for g in groups]
        try:
            for chunk in self.chunks:
                members = {id(p) for p in chunk}
                for g, params in zip(groups, saved, strict=True):
                    g["params"] = [p for p in params if id(p) in members]
                for p in chunk:
                    state = self.inner.state.get(p, {})
                    for k in [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]:
                        state[k] = self.host[(id(p), k)].to(device, non_blocking=True)
                self.inner.step()
                states = [(id(p), self.inner.state[p]) for p in chunk if p in self.inner.state]
                for pid, state in states:
                    for k, v in [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]:
                        if (pid, k) not in self.host:
                            self.host[(pid, k)] = torch.empty_like(v, device="cpu", pin_memory=device.type == "cuda")
                        self.host[(pid, k)].copy_(v, non_blocking=True)
                        state[k] = self.host[(pid, k)]
                synchronize(device)
        finally:
            for g, params in zip(groups, saved, strict=True):
                g["params"] = params


CSV_FIELDS = ["workload", "variant", "metric", "median", "p20", "p80", "gpu", "torch", "sha", "time"]


class Recorder:
    """CSV rows, one per measurement: a distribution (median, p20, p80) or a single value (all three equal)."""

    def __init__(self, device: torch.device) -> None:
        self.meta = {"gpu": device_name(device), "torch": torch.__version__, "sha": git_sha()}
        self.rows: list[dict[str, Any]] = []

    def add(self, workload: str, variant: str, metric: str, value: float | Stats) -> None:
        stats = value if isinstance(value, Stats) else Stats(value, value, value)
        self.rows.append(
            {
                "workload": workload,
                "variant": variant,
                "metric": metric,
                "median": stats.median,
                "p20": stats.p20,
                "p80": stats.p80,
                **self.meta,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        )

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(self.rows)
        print(f"# {len(self.rows)} CSV rows appended to {path}")
