"""Other inner optimizers, wrapped: Transformer Engine FusedAdam and Emerging-Optimizers Muon, against resident.

Command (needs a GPU; Transformer Engine and emerging-optimizers where installed, see scripts/gpu_check.sh):
    PYTHONPATH=src python3 benchmarks/bench_inners.py
    PYTHONPATH=src python3 benchmarks/bench_inners.py --workloads te --params 5e8

Workloads:
    te   1e9 bf16 params (4096^2 matrices), FusedAdam(master_weights=True): TE keeps fp32 masters and fp32 moments,
         12 B per param each way. Then bf16 moments with store_param_remainders=True: 6 B per param each way, the
         cheapest configuration exact to TE. Each against the resident FusedAdam of the same configuration, and the
         GPU memory state_dict() allocates: TE's own unscales bf16 moments into fp32 copies on the GPU.
    eo   1e9 fp32 params, emerging_optimizers Muon: resident against wrapped.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import torch

from bench_step import Row, Variant, record_row, run_variant
from chunked_offload import ChunkedOffloadOptimizer
from common import ROOT, Recorder, make_matrices, measure_link, peak_extra_bytes, progress, set_random_grads

MiB = 2**20


def te_variants(chunk: float) -> list[tuple[str, list[Variant]]]:
    from transformer_engine.pytorch.optimizers import FusedAdam

    twelve: dict[str, Any] = {"master_weights": True}
    six: dict[str, Any] = {
        "master_weights": True,
        "store_param_remainders": True,
        "exp_avg_dtype": torch.bfloat16,
        "exp_avg_sq_dtype": torch.bfloat16,
    }

    def make(kw: dict[str, Any]) -> Any:
        return lambda ps: FusedAdam(ps, lr=1e-4, weight_decay=0.01, **kw)

    def wrapped(kw: dict[str, Any]) -> Any:
        return lambda ps: ChunkedOffloadOptimizer(FusedAdam(ps, lr=1e-4, weight_decay=0.01, **kw), chunk_size_mb=chunk)

    return [
        (
            "te-12B",
            [Variant("resident", make(twelve), reference=True), Variant(f"chunked-{chunk:g}MB", wrapped(twelve), 12)],
        ),
        ("te-6B", [Variant("resident", make(six), reference=True), Variant(f"chunked-{chunk:g}MB", wrapped(six), 6)]),
    ]


def eo_variants(chunk: float) -> list[tuple[str, list[Variant]]]:
    from emerging_optimizers.orthogonalized_optimizers import Muon

    def make(ps: list[torch.nn.Parameter]) -> Any:
        return Muon(ps, lr=1e-3, weight_decay=0.01)

    return [
        (
            "eo-muon",
            [
                Variant("resident", make, reference=True),
                Variant(f"chunked-{chunk:g}MB", lambda ps: ChunkedOffloadOptimizer(make(ps), chunk_size_mb=chunk), 4),
            ],
        )
    ]


def state_dict_spike(make: Any, params: list[torch.nn.Parameter]) -> int:
    """GPU bytes allocated during ``state_dict()`` after two steps."""
    opt = make(params)
    for _ in range(2):
        set_random_grads(params)
        opt.step()
    spike = peak_extra_bytes(opt.state_dict, torch.device("cuda"))
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    return spike


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="te,eo")
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--chunk-mb", type=float, default=256.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--csv", type=Path, default=ROOT / "out" / "bench_inners.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("# bench_inners needs a GPU (Transformer Engine and the timings are CUDA-only)")
        return 0
    device = torch.device("cuda")
    rec = Recorder(device)
    link = measure_link(device, 1024 * MiB)
    print(f"# {rec.meta['gpu']}, torch {rec.meta['torch']}, commit {rec.meta['sha']}")
    print(f"# link: both at once {link.duplex / 1e9:.1f} GB/s each way")
    rec.add("link", "pinned", "duplex_GBps", link.duplex / 1e9)

    groups: list[tuple[str, list[Variant], torch.dtype]] = []
    for name in args.workloads.split(","):
        try:
            found = te_variants(args.chunk_mb) if name == "te" else eo_variants(args.chunk_mb)
        except ImportError as exc:
            print(f"# {name}: skipped ({exc})")
            continue
        groups += [(w, vs, torch.bfloat16 if name == "te" else torch.float32) for w, vs in found]

    rows: list[Row] = []
    spikes: dict[str, int] = {}
    for workload, vs, dtype in groups:
        params = make_matrices(args.params, args.dim, dtype, device)
        init = [p.detach().clone().cpu() for p in params]
        numel = sum(p.numel() for p in params)
        print(f"# workload {workload}: {numel / 1e9:.3f}e9 {str(dtype)[6:]} params", flush=True)
        reference = None
        for v in progress(vs, desc=workload):
            stats, first_peak, peak, final, build_s, opt = run_variant(v, params, init, device, False, args)
            if v.reference:
                reference, exact = final, "(reference)"
            else:
                assert reference is not None
                exact = "yes" if all(torch.equal(a, b) for a, b in zip(reference, final, strict=True)) else "NO"
            bound = opt.plan.window_bound_nbytes if isinstance(opt, ChunkedOffloadOptimizer) else None
            floor = numel * v.floor_bytes / link.duplex if v.floor_bytes else None
            rows.append(Row(workload, v.name, stats, floor, first_peak, peak, bound, exact, build_s))
            print(f"#   {v.name}: {stats.median:.4f} s, exact {exact}", flush=True)
            del opt
            gc.collect()
            torch.cuda.empty_cache()
        if workload == "te-6B":  # bf16 moments: TE's own state_dict() builds fp32 copies on the GPU
            for v in vs:
                spikes[v.name] = state_dict_spike(v.make, params)
                rec.add(workload, v.name, "state_dict_spike_MiB", spikes[v.name] / MiB)
        del params
        gc.collect()
        torch.cuda.empty_cache()
    for r in rows:
        base = next(x.stats.median for x in rows if x.workload == r.workload and x.variant == "resident")
        r.added_s = r.stats.median - base if r.variant != "resident" else None
        record_row(r, rec)
    rec.write(args.csv)

    print(
        f"\n{'workload':<10} {'variant':<16} {'s/step':>8} {'x floor':>8} {'x resident':>10} {'peak MiB':>9} "
        f"{'bound':>7}  exact"
    )
    for r in rows:
        base = next(x.stats.median for x in rows if x.workload == r.workload and x.variant == "resident")
        xf = f"{r.stats.median / r.floor_s:.3f}" if r.floor_s else "-"
        bound = f"{r.bound / MiB:.0f}" if r.bound is not None else "-"
        print(
            f"{r.workload:<10} {r.variant:<16} {r.stats.median:>8.4f} {xf:>8} {r.stats.median / base:>10.3f} "
            f"{r.peak / MiB:>9.1f} {bound:>7}  {r.exact}"
        )
    twelve = [r.stats.median for r in rows if r.workload == "te-12B" and r.variant != "resident"]
    six = [r.stats.median for r in rows if r.workload == "te-6B" and r.variant != "resident"]
    if twelve and six:
        print(f"# TE: 6 B/param configuration / 12 B/param configuration = {six[0] / twelve[0]:.3f}")
    for name, spike in spikes.items():
        print(f"# TE bf16 moments, state_dict() GPU spike, {name}: {spike / MiB:.0f} MiB")
    return 1 if any(r.exact == "NO" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
