"""Step time and GPU window of ChunkedOffloadOptimizer against the resident optimizer and the usual alternatives.

Command (the README's `make bench` runs it with the defaults for the machine it finds):
    PYTHONPATH=src python3 benchmarks/bench_step.py                      # GPU: 1e9 params, 4096^2 matrices
    PYTHONPATH=src python3 benchmarks/bench_step.py --workloads adamw --chunks-mb 64,256,1024

Workloads:
    adamw               fp32 params, fused AdamW: resident (the reference), full reload, serial chunked, and the
                        wrapper at each chunk size; step() alone.
    adamw-bf16-masters  bf16 params, fused AdamW on fp32 masters: the wrapper's fp32 mode (the reference) and its
                        remainder mode, each run --repeat times to show run-to-run spread.
    muon                fp32 params, torch.optim.Muon: resident (the reference), full reload and the wrapper.
    peers               fp32 params, AdamW, a whole iteration (backward + step): resident (the reference), the
                        wrapper, serial chunked, and torchao's CPUOffloadOptimizer (Adam on the CPU) when torchao is
                        importable. Reports the time each adds to the resident iteration.
    budget              fp32 params, fused AdamW: the wrapper with gpu_budget_mb set to its staging window plus 0,
                        25, 50, 75 and 100% of the state, against resident: what stays resident is copied on the
                        device instead of over the link, so the step time falls with the resident share.

Every variant starts from the same params and takes the same steps with the same grads, so its final params must be
bitwise equal to the reference's ("exact"); the script exits with status 1 if any of ours is not. torchao steps on
the CPU, whose AdamW rounds differently, so its column shows the largest difference instead. Times are CUDA-event
medians with p20/p80 in the CSV; the floor is the bytes each step moves each way over the measured bidirectional
bandwidth of this link. Our rows also show "x arena": the step against copying its own host arena both ways at once
(the same pages; physical host pages differ in link speed by a few percent between runs, which this ratio cancels).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chunked_offload import ChunkedOffloadOptimizer
from common import (
    ROOT,
    FullReload,
    Recorder,
    SerialChunked,
    Stats,
    arena_duplex_seconds,
    make_matrices,
    measure_link,
    peak_extra_bytes,
    progress,
    set_random_grads,
    synchronize,
    time_calls,
)
from reference import internals

MiB = 2**20
# Bytes a wrapper-owned master adds each way per param: an fp32 master, or an int16 remainder plus one tie bit.
MASTER_BYTES = {"none": 0.0, "fp32": 4.0, "remainder": 2.125}


@dataclass
class Variant:
    name: str
    make: Callable[[list[torch.nn.Parameter]], Any]
    floor_bytes: float | None = None  # bytes moved each way per param, for the floor
    reference: bool = False
    exact_expected: bool = True
    prepare: Callable[[list[torch.nn.Parameter]], None] | None = None  # before ``make``, outside its timing


@dataclass
class Row:
    workload: str
    variant: str
    stats: Stats
    floor_s: float | None
    first_peak: int
    peak: int
    bound: int | None
    exact: str
    build_s: float
    arena_floor_s: float | None = None  # ours: the whole arena both ways at once, on its own pages
    link_bytes: int | None = None  # ours: bytes the last step copied host -> device
    added_s: float | None = None


def _adamw(fused: bool) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=fused)


def _wrapper(make_inner: Callable[..., Any], chunk: float, mode: str = "none") -> Callable[..., Any]:
    return lambda ps: ChunkedOffloadOptimizer(make_inner(ps), chunk_size_mb=chunk, master_weights=mode)


def _budgets(make_inner: Callable[..., Any], chunk: float, shares: Sequence[float]) -> list[Variant]:
    """The wrapper with a GPU budget of its staging window plus each share of the state's bytes.

    Both sizes come from the plan of a wrapper that offloads everything, built once for all shares (it pins a host
    arena as large as the state) and before the first share's timed build.
    """
    sizes: dict[str, int] = {}

    def probe(ps: list[torch.nn.Parameter]) -> None:
        if not sizes:
            plan = ChunkedOffloadOptimizer(make_inner(ps), chunk_size_mb=chunk).plan
            sizes.update(window=plan.window_bound_nbytes, state=plan.host_nbytes)

    def wrapper(share: float) -> Callable[[list[torch.nn.Parameter]], ChunkedOffloadOptimizer]:
        def make(ps: list[torch.nn.Parameter]) -> ChunkedOffloadOptimizer:
            budget = sizes["window"] + share * sizes["state"]
            return ChunkedOffloadOptimizer(make_inner(ps), chunk_size_mb=chunk, gpu_budget_mb=budget / MiB)

        return make

    return [
        Variant(f"budget-{share:.0%}-resident", wrapper(share), 8 * (1 - share) or None, prepare=probe)
        for share in shares
    ]


def _torchao(ps: list[torch.nn.Parameter]) -> Any:
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(ps, torch.optim.AdamW, lr=1e-3, weight_decay=0.01, fused=True)


def variants(name: str, gpu: bool, chunks: list[float], master_chunk: float, repeat: int) -> list[Variant]:
    adamw = _adamw(gpu)
    if name == "adamw":
        out = [
            Variant("resident", adamw, reference=True),
            Variant("full-reload", lambda ps: FullReload(adamw(ps)), 8),
            Variant(
                f"serial-chunked-{master_chunk:g}MB", lambda ps: SerialChunked(adamw(ps), int(master_chunk * MiB)), 8
            ),
        ]
        return out + [Variant(f"chunked-{c:g}MB", _wrapper(adamw, c), 8) for c in chunks]
    if name == "adamw-bf16-masters":
        out = []
        for run in range(repeat):
            for mode in ("fp32", "remainder"):
                label = f"chunked-{master_chunk:g}MB-{mode}" + (f"-run{run + 1}" if repeat > 1 else "")
                out.append(Variant(label, _wrapper(adamw, master_chunk, mode), 8 + MASTER_BYTES[mode], not out))
        return out
    if name == "muon":

        def muon(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.Muon(ps, lr=1e-3, weight_decay=0.01)

        return [
            Variant("resident", muon, reference=True),
            Variant("full-reload", lambda ps: FullReload(muon(ps)), 4),
            Variant(f"chunked-{master_chunk:g}MB", _wrapper(muon, master_chunk), 4),
        ]
    if name == "peers":
        out = [
            Variant("resident", adamw, reference=True),
            Variant(f"chunked-{master_chunk:g}MB", _wrapper(adamw, master_chunk), 8),
            Variant(
                f"serial-chunked-{master_chunk:g}MB", lambda ps: SerialChunked(adamw(ps), int(master_chunk * MiB)), 8
            ),
        ]
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            print("# torchao is not importable: its CPUOffloadOptimizer row is skipped", flush=True)
        else:
            if gpu:
                out.append(Variant("torchao-CPUOffloadOptimizer", _torchao, 8, exact_expected=False))
        return out
    if name == "budget":
        return [Variant("resident", adamw, reference=True)] + _budgets(adamw, master_chunk, (0.0, 0.25, 0.5, 0.75, 1.0))
    raise ValueError(f"unknown workload {name!r}; choose from adamw, adamw-bf16-masters, muon, peers, budget")


def run_variant(
    variant: Variant,
    params: list[torch.nn.Parameter],
    init: list[torch.Tensor],
    device: torch.device,
    iteration: bool,
    args: Any,
) -> tuple[Stats, int, int, list[torch.Tensor], float, float | None, Any]:
    with torch.no_grad():
        for p, x in zip(params, init, strict=True):
            p.copy_(x)
    if variant.prepare is not None:
        variant.prepare(params)
    synchronize(device)
    t0 = time.perf_counter()
    opt = variant.make(params)
    build_s = time.perf_counter() - t0
    if iteration:  # backward (it writes the grads, which torchao's hooks copy out) and step

        def call() -> None:
            loss = sum((p * p).sum() for p in params) * 1e-6
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        set_random_grads(params)
        call = opt.step
    first_peak = peak_extra_bytes(call, device)
    engine = internals(opt).engine if isinstance(opt, ChunkedOffloadOptimizer) else None
    side = (engine.d2h_stream,) if engine is not None and engine.d2h_stream is not None else ()
    times = time_calls(call, device, args.warmup, args.iters, side)
    peak = peak_extra_bytes(call, device)
    final = [p.detach().to("cpu") for p in params]
    arena_floor = None
    if isinstance(opt, ChunkedOffloadOptimizer) and device.type == "cuda":
        opt.synchronize()
        arena = internals(opt).placement.require().host.arena
        arena_floor = arena_duplex_seconds(arena, device)  # overwrites the host state
    return Stats.of(times), first_peak, peak, final, build_s, arena_floor, opt


def bench_workload(
    name: str, gpu: bool, n_params: float, dim: int, duplex: float, device: torch.device, args: Any
) -> list[Row]:
    dtype = torch.bfloat16 if name == "adamw-bf16-masters" else torch.float32
    params = make_matrices(n_params, dim, dtype, device)
    init = [p.detach().clone().cpu() for p in params]
    numel = sum(p.numel() for p in params)
    print(f"# workload {name}: {len(params)} x {dim}^2 {str(dtype)[6:]} = {numel / 1e9:.3f}e9 params", flush=True)
    chunks = args.chunks if name == "adamw" else []
    rows: list[Row] = []
    reference: list[torch.Tensor] | None = None
    for v in progress(variants(name, gpu, chunks, args.master_chunk_mb, args.repeat), desc=name):
        stats, first_peak, peak, final, build_s, arena_floor, opt = run_variant(
            v, params, init, device, name == "peers", args
        )
        if v.reference:
            reference, exact = final, "(reference)"
        elif reference is None:
            exact = "-"
        else:
            same = all(torch.equal(a, b) for a, b in zip(reference, final, strict=True))
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(reference, final, strict=True))
            exact = ("yes" if same else "NO") if v.exact_expected else f"max|d| {diff:.1e}"
        bound = opt.plan.window_bound_nbytes if isinstance(opt, ChunkedOffloadOptimizer) else None
        floor = numel * v.floor_bytes / duplex if v.floor_bytes else None
        moved = opt.stats.h2d_bytes if isinstance(opt, ChunkedOffloadOptimizer) and opt.stats is not None else None
        rows.append(Row(name, v.name, stats, floor, first_peak, peak, bound, exact, build_s, arena_floor, moved))
        print(f"#   {v.name}: done", flush=True)  # its figures are in the table at the end
        del opt
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    base = next((r.stats.median for r in rows if r.exact == "(reference)" and r.variant == "resident"), None)
    for r in rows:
        if base is not None and r.variant != "resident":
            r.added_s = r.stats.median - base
    return rows


def record_row(r: Row, rec: Recorder) -> None:
    rec.add(r.workload, r.variant, "step_s", r.stats)
    rec.add(r.workload, r.variant, "peak_extra_MiB_first_step", r.first_peak / MiB)
    rec.add(r.workload, r.variant, "peak_extra_MiB", r.peak / MiB)
    rec.add(r.workload, r.variant, "build_s", r.build_s)
    if r.floor_s:
        rec.add(r.workload, r.variant, "x_duplex_floor", r.stats.median / r.floor_s)
    if r.link_bytes is not None:
        rec.add(r.workload, r.variant, "h2d_GB", r.link_bytes / 1e9)
    if r.arena_floor_s:
        rec.add(r.workload, r.variant, "arena_floor_s", r.arena_floor_s)
        rec.add(r.workload, r.variant, "x_arena_floor", r.stats.median / r.arena_floor_s)
    if r.bound is not None:
        rec.add(r.workload, r.variant, "window_bound_MiB", r.bound / MiB)
    if r.added_s is not None:
        rec.add(r.workload, r.variant, "added_s_vs_resident", r.added_s)
    if r.exact in ("yes", "NO"):
        rec.add(r.workload, r.variant, "bitwise_equal", float(r.exact == "yes"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=None, help="parameters per workload (default 1e9 GPU, 2e6 CPU)")
    parser.add_argument("--dim", type=int, default=None, help="square matrix size (default 4096 GPU, 512 CPU)")
    parser.add_argument("--chunks-mb", default=None, help="chunk sizes for the adamw workload")
    parser.add_argument("--master-chunk-mb", type=float, default=256.0, help="chunk size for the other workloads")
    parser.add_argument("--workloads", default=None, help="default: all on a GPU; all but muon on a CPU")
    parser.add_argument("--repeat", type=int, default=2, help="runs of the masters workload, to show the spread")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--link-mb", type=int, default=None)
    parser.add_argument("--csv", type=Path, default=ROOT / "out" / "bench_step.csv", help="CSV rows are appended here")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    n_params = args.params or (1e9 if gpu else 2e6)
    dim = args.dim or (4096 if gpu else 512)
    args.chunks = [float(c) for c in (args.chunks_mb or ("64,128,256,512,1024,2048" if gpu else "1,4,64")).split(",")]
    if not gpu:
        args.master_chunk_mb = min(args.master_chunk_mb, 4.0)
        args.repeat = 1
    # Muon's Newton-Schulz runs in bf16, which a CPU without bf16 matrix units does slowly: GPU only by default.
    default = "adamw,adamw-bf16-masters,muon,peers,budget" if gpu else "adamw,adamw-bf16-masters,peers,budget"
    names = (args.workloads or default).split(",")

    rec = Recorder(device)
    link = measure_link(device, (args.link_mb or (1024 if gpu else 64)) * MiB)
    print(f"# {rec.meta['gpu']}, torch {rec.meta['torch']}, commit {rec.meta['sha']}")
    print(
        f"# link (pinned): H2D {link.h2d / 1e9:.1f} GB/s, D2H {link.d2h / 1e9:.1f} GB/s, "
        f"both at once {link.duplex / 1e9:.1f} GB/s each way"
    )
    for metric, value in (("h2d_GBps", link.h2d), ("d2h_GBps", link.d2h), ("duplex_GBps", link.duplex)):
        rec.add("link", "pinned", metric, value / 1e9)

    rows: list[Row] = []
    for name in names:
        for row in bench_workload(name, gpu, n_params, dim, link.duplex, device, args):
            rows.append(row)
            record_row(row, rec)
    rec.write(args.csv)

    print()
    # On the CPU the copies are memcpy: a floor of the "link" would mean nothing, so those columns are left out.
    floors = f"{'x floor':>8} {'x arena':>8} " if gpu else ""
    header = (
        f"{'workload':<19} {'variant':<34} {'s/step':>8} {floors}{'+s vs res':>9} "
        f"{'peak MiB':>9} {'1st MiB':>8} {'bound':>7} {'build s':>7}  exact"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        xf = f"{r.stats.median / r.floor_s:.3f}" if r.floor_s else "-"
        xa = f"{r.stats.median / r.arena_floor_s:.3f}" if r.arena_floor_s else "-"
        ratios = f"{xf:>8} {xa:>8} " if gpu else ""
        added = f"{r.added_s:.4f}" if r.added_s is not None else "-"
        bound = f"{r.bound / MiB:.0f}" if r.bound is not None else "-"
        print(
            f"{r.workload:<19} {r.variant:<34} {r.stats.median:>8.4f} {ratios}{added:>9} {r.peak / MiB:>9.1f} "
            f"{r.first_peak / MiB:>8.1f} {bound:>7} {r.build_s:>7.2f}  {r.exact}"
        )
    _summaries(rows)
    if not gpu:
        print("# CPU run: the copies are memcpy, not a link; this run checks exactness and wiring")
    failed = [f"{r.workload}/{r.variant}" for r in rows if r.exact == "NO"]
    if failed:
        print(f"# EXACTNESS FAILED: {', '.join(failed)}")
        return 1
    return 0


def _summaries(rows: list[Row]) -> None:
    def med(workload: str, prefix: str) -> list[float]:
        return [r.stats.median for r in rows if r.workload == workload and r.variant.startswith(prefix)]

    chunked, full, serial = med("adamw", "chunked"), med("adamw", "full-reload"), med("adamw", "serial")
    if chunked and full:
        print(f"# adamw: full reload / best chunked = {full[0] / min(chunked):.2f}x", end="")
        print(f"; serial chunked / best chunked = {serial[0] / min(chunked):.2f}x" if serial else "")
    for mode in ("fp32", "remainder"):
        runs = [r for r in rows if r.workload == "adamw-bf16-masters" and f"-{mode}" in r.variant]
        if len(runs) > 1:
            secs = [r.stats.median for r in runs]
            listed = ", ".join(f"{t:.4f}" for t in secs)
            print(f"# masters {mode}: runs {listed} s, spread {max(secs) / min(secs) - 1:.1%}", end="")
            ratios = [r.stats.median / r.arena_floor_s for r in runs if r.arena_floor_s]
            if len(ratios) == len(runs):
                listed = ", ".join(f"{x:.3f}" for x in ratios)
                print(f"; x arena floor {listed}, spread {max(ratios) / min(ratios) - 1:.1%}", end="")
            print()
    fp32, rem = med("adamw-bf16-masters", "chunked-256MB-fp32"), med("adamw-bf16-masters", "chunked-256MB-remainder")
    if fp32 and rem:
        print(f"# masters: remainder / fp32 step time = {min(rem) / min(fp32):.3f}")
    budget = [r for r in rows if r.workload == "budget" and r.variant.startswith("budget")]
    if budget:
        listed = ", ".join(
            f"{r.variant.split('-')[1]} {r.stats.median:.4f} s ({(r.link_bytes or 0) / 1e9:.3f} GB H2D)" for r in budget
        )
        print(f"# budget, step time by resident share: {listed}")
    peers = {r.variant.split("-")[0]: r.added_s for r in rows if r.workload == "peers" and r.added_s is not None}
    if "chunked" in peers and "torchao" in peers and peers["chunked"]:
        print(f"# peers: time added per iteration, torchao / ours = {peers['torchao'] / peers['chunked']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
