"""Step time and GPU window of ChunkedOffloadOptimizer vs the resident optimizer and a full-reload baseline.

Command (the README's `make bench` runs it with the defaults for the machine it finds):
    PYTHONPATH=src python3 benchmarks/bench_step.py                      # GPU: 1e9 params, 4096^2 matrices
    PYTHONPATH=src python3 benchmarks/bench_step.py --workloads adamw --chunks-mb 64,256,1024

Every variant starts from the same params and takes the same steps with the same grads, so the final params must
be bitwise equal to the resident run ("exact" column). Times are CUDA-event medians (p20/p80 in the CSV); the
floor is the bytes each step moves each way divided by the measured bidirectional bandwidth of this link.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chunked_offload import ChunkedOffloadOptimizer
from common import (
    ROOT,
    FullReload,
    Stats,
    append_csv,
    device_name,
    git_sha,
    make_matrices,
    measure_link,
    peak_extra_bytes,
    set_random_grads,
    synchronize,
    time_calls,
)

MiB = 2**20


@dataclass
class Workload:
    name: str
    dtype: torch.dtype
    make_inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    state_bytes_per_param: float  # inner state bytes that move each way, per param
    modes: list[str]  # master_weights modes to run through the wrapper
    baselines: bool  # also run resident and full reload


def workloads(device: torch.device) -> dict[str, Workload]:
    fused = device.type == "cuda"

    def adamw(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=fused)

    def muon(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Muon(ps, lr=1e-3, weight_decay=0.01)

    return {
        "adamw": Workload("adamw", torch.float32, adamw, 8, ["none"], True),
        "adamw-bf16-masters": Workload("adamw-bf16-masters", torch.bfloat16, adamw, 8, ["fp32", "remainder"], False),
        "muon": Workload("muon", torch.float32, muon, 4, ["none"], True),
    }


# Bytes a wrapper-owned master adds each way per param: an fp32 master, or an int16 remainder plus one tie bit.
MASTER_BYTES = {"none": 0.0, "fp32": 4.0, "remainder": 2.125}


@dataclass
class Row:
    workload: str
    variant: str
    stats: Stats
    floor_s: float | None
    first_peak: int
    peak: int
    bound: int | None
    exact: bool | None
    build_s: float


def run_variant(
    make_opt: Callable[[], Any],
    params: list[torch.nn.Parameter],
    init: list[torch.Tensor],
    device: torch.device,
    args: Any,
) -> tuple[Stats, int, int, list[torch.Tensor], float, Any]:
    with torch.no_grad():
        for p, x in zip(params, init, strict=True):
            p.copy_(x)
    set_random_grads(params)
    synchronize(device)
    t0 = time.perf_counter()
    opt = make_opt()
    build_s = time.perf_counter() - t0
    first_peak = peak_extra_bytes(opt.step, device)
    engine = getattr(opt, "_engine", None)
    side = (engine.d2h_stream,) if engine is not None and engine.d2h_stream is not None else ()
    times = time_calls(opt.step, device, args.warmup, args.iters, side)
    pool = getattr(opt, "_pool", None)
    held = pool.slot_nbytes * len(pool.slots) if pool is not None else 0
    peak = peak_extra_bytes(opt.step, device, held)
    final = [p.detach().to("cpu") for p in params]
    return Stats.of(times), first_peak, peak, final, build_s, opt


def bench_workload(
    wl: Workload, n_params: float, dim: int, chunks: list[float], duplex: float, device: torch.device, args: Any
) -> list[Row]:
    """Resident, full reload (when ``wl.baselines``) and the wrapper in each master mode and chunk size."""
    params = make_matrices(n_params, dim, wl.dtype, device)
    init = [p.detach().clone().cpu() for p in params]
    numel = sum(p.numel() for p in params)
    dtype = str(wl.dtype).removeprefix("torch.")
    print(f"# workload {wl.name}: {len(params)} x {dim}^2 {dtype} = {numel / 1e9:.3f}e9 params", flush=True)
    rows: list[Row] = []
    reference: list[torch.Tensor] | None = None

    def run(variant: str, make_opt: Callable[[], Any], floor_s: float | None) -> Row:
        nonlocal reference
        stats, first_peak, peak, final, build_s, opt = run_variant(make_opt, params, init, device, args)
        bound = opt.plan.window_bound_nbytes if isinstance(opt, ChunkedOffloadOptimizer) else None
        exact = None if reference is None else all(torch.equal(a, b) for a, b in zip(reference, final, strict=True))
        if reference is None:
            reference = final  # the first variant (resident, or the fp32-master run) is the reference
        row = Row(wl.name, variant, stats, floor_s, first_peak, peak, bound, exact, build_s)
        print(f"#   {variant}: {stats.median:.4f} s", flush=True)
        return row

    if wl.baselines:
        rows.append(run("resident", lambda: wl.make_inner(params), None))
        floor = numel * wl.state_bytes_per_param / duplex
        rows.append(run("full-reload", lambda: FullReload(wl.make_inner(params)), floor))
    for mode in wl.modes:
        floor = numel * (wl.state_bytes_per_param + MASTER_BYTES[mode]) / duplex
        for chunk in chunks:
            variant = f"chunked-{chunk:g}MB" + ("" if mode == "none" else f"-{mode}")

            def make(chunk: float = chunk, mode: str = mode) -> ChunkedOffloadOptimizer:
                return ChunkedOffloadOptimizer(wl.make_inner(params), chunk_size_mb=chunk, master_weights=mode)

            rows.append(run(variant, make, floor))
            gc.collect()
    return rows


def record_row(r: Row, record: Callable[[str, str, str, float], None]) -> None:
    record(r.workload, r.variant, "step_s_median", r.stats.median)
    record(r.workload, r.variant, "step_s_p20", r.stats.p20)
    record(r.workload, r.variant, "step_s_p80", r.stats.p80)
    record(r.workload, r.variant, "peak_extra_MiB_first_step", r.first_peak / MiB)
    record(r.workload, r.variant, "peak_extra_MiB", r.peak / MiB)
    record(r.workload, r.variant, "build_s", r.build_s)
    if r.floor_s:
        record(r.workload, r.variant, "x_duplex_floor", r.stats.median / r.floor_s)
    if r.bound is not None:
        record(r.workload, r.variant, "window_bound_MiB", r.bound / MiB)
    if r.exact is not None:
        record(r.workload, r.variant, "bitwise_equal", float(r.exact))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=None, help="parameters per workload (default 1e9 GPU, 2e6 CPU)")
    parser.add_argument("--dim", type=int, default=None, help="square matrix size (default 4096 GPU, 512 CPU)")
    parser.add_argument("--chunks-mb", default=None, help="chunk sizes for the adamw workload")
    parser.add_argument("--master-chunk-mb", type=float, default=256.0, help="chunk size for the other workloads")
    parser.add_argument("--workloads", default=None, help="default: all on a GPU; adamw and masters on the CPU")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--link-mb", type=int, default=None)
    parser.add_argument("--csv", type=Path, default=ROOT / "benchmarks" / "results" / "bench_step.csv")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    n_params = args.params or (1e9 if gpu else 2e6)
    dim = args.dim or (4096 if gpu else 512)
    chunks = [float(c) for c in (args.chunks_mb or ("64,128,256,512,1024,2048" if gpu else "1,4,64")).split(",")]
    if not gpu:
        args.master_chunk_mb = min(args.master_chunk_mb, 4.0)
    # Muon's Newton-Schulz runs in bf16, which a CPU without bf16 matrix units does slowly: GPU only by default.
    args.workloads = args.workloads or ("adamw,adamw-bf16-masters,muon" if gpu else "adamw,adamw-bf16-masters")

    meta = {"gpu": device_name(device), "torch": torch.__version__, "sha": git_sha()}
    csv_rows: list[dict[str, Any]] = []

    def record(workload: str, variant: str, metric: str, value: float) -> None:
        csv_rows.append(
            {
                "workload": workload,
                "variant": variant,
                "metric": metric,
                "value": value,
                **meta,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        )

    link = measure_link(device, (args.link_mb or (1024 if gpu else 64)) * MiB)
    print(f"# {meta['gpu']}, torch {meta['torch']}, {meta['sha']}")
    print(
        f"# link (pinned): H2D {link.h2d / 1e9:.1f} GB/s, D2H {link.d2h / 1e9:.1f} GB/s, "
        f"both at once {link.duplex / 1e9:.1f} GB/s each way"
    )
    for metric, value in (("h2d_GBps", link.h2d), ("d2h_GBps", link.d2h), ("duplex_GBps", link.duplex)):
        record("link", "pinned", metric, value / 1e9)

    rows: list[Row] = []
    for name in args.workloads.split(","):
        wl = workloads(device)[name]
        for row in bench_workload(
            wl, n_params, dim, chunks if name == "adamw" else [args.master_chunk_mb], link.duplex, device, args
        ):
            rows.append(row)
            record_row(row, record)
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()

    append_csv(args.csv, csv_rows)
    print()
    header = (
        f"{'workload':<20} {'variant':<28} {'step s':>8} {'x floor':>8} {'peak MiB':>9} {'1st MiB':>9} "
        f"{'bound MiB':>9} {'build s':>8} {'exact':>6}"
    )
    print(header)
    print("-" * len(header))
    resident = {r.workload: r.stats.median for r in rows if r.variant == "resident"}
    for r in rows:
        xf = f"{r.stats.median / r.floor_s:.3f}" if r.floor_s else "-"
        bound = f"{r.bound / MiB:.0f}" if r.bound is not None else "-"
        exact = "-" if r.exact is None else ("yes" if r.exact else "NO")
        print(
            f"{r.workload:<20} {r.variant:<28} {r.stats.median:>8.4f} {xf:>8} {r.peak / MiB:>9.1f} "
            f"{r.first_peak / MiB:>9.1f} {bound:>9} {r.build_s:>8.2f} {exact:>6}"
        )
    for wl_name, t_res in resident.items():
        full = [r.stats.median for r in rows if r.workload == wl_name and r.variant == "full-reload"]
        best = min(
            (r.stats.median for r in rows if r.workload == wl_name and r.variant.startswith("chunked")), default=None
        )
        if full and best:
            print(f"# {wl_name}: full reload / best chunked = {full[0] / best:.2f}x; resident step {t_res:.4f} s")
    masters = {r.variant.rsplit("-", 1)[-1]: r.stats.median for r in rows if r.workload == "adamw-bf16-masters"}
    if "fp32" in masters and "remainder" in masters:
        print(f"# masters: remainder / fp32 step time = {masters['remainder'] / masters['fp32']:.3f}")
    if not gpu:
        print("# CPU run: 'copies' are memcpy, so the floor is not a link floor; this run checks exactness and wiring")
    print(f"# CSV rows appended to {args.csv}")


if __name__ == "__main__":
    main()
