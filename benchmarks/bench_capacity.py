"""Capacity: the largest Llama-shaped model that trains with full AdamW and fp32 masters, resident against ours.

Question: how many more parameters can one GPU train when the AdamW state and the fp32 masters live in host memory,
and the GPU memory the training leaves unused holds what the host cannot?

Workload: HF ``transformers`` LlamaForCausalLM from a config (random init), bf16 params, fused AdamW on fp32
masters, batch 1 x 2048 tokens, width fixed (4096, intermediate 11008, vocab 32000), depth searched.
    resident  fp32 masters, fp32 grads and the AdamW moments on the GPU (18 bytes per param, the usual mixed-precision
              layout: the bf16 grad of each param is freed as it is converted);
    ours      ChunkedOffloadOptimizer(master_weights="remainder"): the fp32 masters kept losslessly as the bf16 param
              plus a 16-bit remainder (results bitwise identical to fp32 masters), with the moments in pinned host
              memory; 10.125 bytes per param of state, params and grads on the GPU.
    te6       Transformer Engine FusedAdam(master_weights=True, store_param_remainders=True, bf16 moments) wrapped:
              6 bytes per param of state (when transformer_engine is importable).
Ours run with gpu_budget_mb set from a first forward and backward without optimizer state: what the GPU has
beside that peak, less --gpu-headroom-gib, holds the state of the first params ([Note: What stays resident]); the
rest is in the host arena. --no-budget keeps all of it on the host.
Each trial is a fresh process that builds the model and runs ``--steps`` real steps. The search starts at the depth
the memory arithmetic predicts, grows by one layer until a trial fails, and steps back down on failure. A trial of
ours is not started when its host arena would leave less than ``--host-headroom-gib`` of RAM available (pinning the
last gigabytes invites the OOM killer).

Commands:
    python3 benchmarks/bench_capacity.py                      # on a GPU: the search; on the CPU: one tiny trial each
    python3 benchmarks/bench_capacity.py --csv benchmarks/results/bench_capacity_h200.csv
    python3 benchmarks/bench_capacity.py --modes ours,te6 --max-trials 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunked_offload import ChunkedOffloadOptimizer  # noqa: E402
from chunked_offload.host_arena import available_host_bytes  # noqa: E402
from common import Recorder, device_name, git_sha  # noqa: E402

RESIDENT_BYTES = 18  # bf16 param 2 + fp32 grad 4 + fp32 master 4 + moments 8
STATE_BYTES = {"ours": 10.125, "te6": 6.0}  # moments 8 + remainder 2 + tie bits 0.125; bf16 moments 4 + remainder 2
DEVICE_BYTES = 4  # ours: the bf16 param and its bf16 grad
GIB = 2**30
MIB = 2**20


def params_of(layers: int, args: argparse.Namespace) -> int:
    h, i, v = args.hidden, args.intermediate, args.vocab
    return layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h


class ResidentMasters:
    """fp32 masters, fp32 grads and AdamW state on the GPU; each bf16 grad is freed as it is converted."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, lr=1e-4, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        self.inner.step()
        torch._foreach_copy_([p.detach() for p in self.params], self.masters)
        for m in self.masters:
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def trial(mode: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build the model with ``layers`` layers and train ``args.steps`` steps; what fit and what it took."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if mode == "te6":  # before CUDA and cuDNN are initialised: a later import loads a mismatched libcudnn
        import transformer_engine.pytorch.optimizers  # noqa: F401
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = params_of(layers, args)
    out: dict[str, Any] = {"mode": mode, "layers": layers, "params": n}
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq,
    )
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
        model.config.use_cache = False
        if mode == "resident":
            opt: Any = ResidentMasters(model)
        else:
            budget = spare_after_first_iteration(model, device, args) if args.budget else 0
            need, available = n * STATE_BYTES[mode] - budget, available_host_bytes() or 0
            if need > available - args.host_headroom_gib * GIB:
                why = f"host: needs {need / GIB:.1f} GiB of {available / GIB:.1f} GiB"
                return {**out, "fits": False, "why": why}
            # A budget below the staging window (two 1 GiB slots and a workspace) is refused: then all on the host.
            opt = make_ours(mode, model, device, budget if budget >= 4 * GIB else None)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {**out, "fits": False, "why": "gpu: out of memory"}
    except RuntimeError as exc:  # the host arena's preflight
        if "host" not in str(exc) and "RLIMIT_MEMLOCK" not in str(exc):
            raise
        return {**out, "fits": False, "why": str(exc).split(";")[0]}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    rss = int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
    ours = isinstance(opt, ChunkedOffloadOptimizer)
    pinned = opt.plan.host_nbytes if ours else 0
    step_s = min(times[1:]) if len(times) > 1 else times[0]
    return {
        **out,
        "fits": True,
        "peak_gpu_gib": peak / GIB,
        "host_rss_gib": rss / GIB,
        "pinned_gib": pinned / GIB,
        "host_left_gib": (available_host_bytes() or 0) / GIB,
        "resident_share": opt.plan.resident_share if ours else 1.0,
        "tokens_per_s": args.batch * args.seq / step_s,
    }


def spare_after_first_iteration(model: torch.nn.Module, device: torch.device, args: argparse.Namespace) -> int:
    """Bytes of device memory beside the peak of one forward and backward (no optimizer state yet), less headroom."""
    if device.type != "cuda":
        return 0
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    spare = free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_reserved(device)
    return max(0, int(spare - args.gpu_headroom_gib * GIB))


def make_ours(mode: str, model: torch.nn.Module, device: torch.device, budget: int | None) -> ChunkedOffloadOptimizer:
    budget_mb = None if budget is None else budget / MIB
    if mode == "te6":
        from transformer_engine.pytorch.optimizers import FusedAdam

        inner: Any = FusedAdam(
            model.parameters(), lr=1e-4, master_weights=True, store_param_remainders=True,
            exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
        )  # fmt: skip
        return ChunkedOffloadOptimizer(inner, chunk_size_mb=1024, gpu_budget_mb=budget_mb)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return ChunkedOffloadOptimizer(inner, chunk_size_mb=1024, master_weights="remainder", gpu_budget_mb=budget_mb)


def te_importable() -> bool:
    try:
        import transformer_engine.pytorch.optimizers  # noqa: F401
    except Exception:
        return False
    return True


def run_trial(mode: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One trial in a fresh process (clean allocator, pinned memory returned on exit)."""
    cmd = [sys.executable, __file__, "--trial", mode, "--layers", str(layers), *args.passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        result = {"mode": mode, "layers": layers, "params": params_of(layers, args), "fits": False, "why": tail[0]}
    else:
        result = json.loads(lines[-1])
    verdict = "fits" if result["fits"] else f"does not fit ({result['why']})"
    print(f"  {mode:8s} {layers:3d} layers, {result['params'] / 1e9:6.2f} B params: {verdict}", flush=True)
    return result


def search(mode: str, start: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """Grow from ``start`` while trials fit, step down while they fail; the deepest trial that fit."""
    best: dict[str, Any] | None = None
    layers, trials = max(1, start), 0
    result = run_trial(mode, layers, args)
    trials += 1
    direction = 1 if result["fits"] else -1
    if result["fits"]:
        best = result
    while trials < args.max_trials and layers + direction >= 1:
        layers += direction
        result = run_trial(mode, layers, args)
        trials += 1
        if result["fits"]:
            best = result
            if direction < 0:
                break
        elif direction > 0:
            break
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trial", choices=["resident", *STATE_BYTES], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-trials", type=int, default=4)
    parser.add_argument("--host-headroom-gib", type=float, default=8.0, help="host RAM a trial leaves available")
    parser.add_argument("--gpu-headroom-gib", type=float, default=4.0, help="GPU memory the budget leaves free")
    parser.add_argument("--no-budget", dest="budget", action="store_false", help="ours: all state on the host")
    parser.add_argument("--modes", default="resident,ours,te6", help="comma-separated, of resident, ours, te6")
    parser.add_argument("--starts", default="", help="depths to start the search at, e.g. ours=84,te6=115")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    defaults = dict(hidden=4096, intermediate=11008, heads=32, vocab=32000, seq=2048)
    if not gpu:
        defaults = dict(hidden=64, intermediate=128, heads=4, vocab=256, seq=32)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.passthrough = [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in ("hidden", "intermediate", "heads", "vocab", "seq", "batch", "steps", "host-headroom-gib",
                  "gpu-headroom-gib")
    ] + ([] if args.budget else ["--no-budget"])  # fmt: skip
    if args.trial:
        print(json.dumps(trial(args.trial, args.layers, args)))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    if "te6" in modes and not te_importable():
        print("te6: skipped, transformer_engine is not importable")
        modes.remove("te6")
    per_layer = params_of(1, args) - params_of(0, args)
    starts = {m: 2 for m in modes}
    if gpu:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        host_bytes = (available_host_bytes() or 0) - args.host_headroom_gib * GIB
        # Activations of one layer (bf16, batch x seq tokens) measured at width 4096: about 11 bytes per token-width.
        act = 11 * args.batch * args.seq * args.hidden
        for m in modes:
            if m == "resident":
                room, per_param, per_layer_act = gpu_bytes - 2 * GIB, RESIDENT_BYTES, 0
            else:  # the state fills the host arena and what the GPU leaves beside params, grads and the window
                # 4 GiB for the window, 10 more that the first iteration's reserved peak held beyond the estimate
                # (the CUDA context, the allocator's segments, logits): 84 and >= 116 layers fit at dda96b8/3813fb0.
                spare = gpu_bytes - (args.gpu_headroom_gib + 14) * GIB if args.budget else 0
                room, per_param, per_layer_act = host_bytes + spare, STATE_BYTES[m] + DEVICE_BYTES, act
            fixed = params_of(0, args) * per_param
            starts[m] = int((room - fixed) // (per_layer * per_param + per_layer_act))
    else:
        args.max_trials = 1
    for item in filter(None, args.starts.split(",")):
        mode, layers = item.split("=")
        starts[mode] = int(layers)
    print(
        f"{device_name(torch.device('cuda' if gpu else 'cpu'))}, torch {torch.__version__}, commit {git_sha()}; host "
        f"RAM available {(available_host_bytes() or 0) / GIB:.1f} GiB; width {args.hidden}, batch {args.batch} x "
        f"{args.seq}; search starts: {starts}",
        flush=True,
    )
    best = {mode: search(mode, start, args) for mode, start in starts.items()}
    rec = Recorder(torch.device("cuda" if gpu else "cpu"))
    workload = f"llama-w{args.hidden}-b{args.batch}x{args.seq}"
    print(
        f"\n{'mode':>8} {'layers':>6} {'params':>9} {'B/param':>7} {'peak GPU GiB':>12} {'host RSS GiB':>12} "
        f"{'pinned GiB':>10} {'host left GiB':>13} {'resident':>8} {'tokens/s':>9}"
    )
    metrics = ("params", "layers", "peak_gpu_gib", "host_rss_gib", "pinned_gib", "host_left_gib", "resident_share",
               "tokens_per_s")  # fmt: skip
    for mode, result in best.items():
        if result is None:
            print(f"{mode:>8}  nothing fit")
            continue
        per_param = RESIDENT_BYTES if mode == "resident" else STATE_BYTES[mode]
        print(
            f"{mode:>8} {result['layers']:>6} {result['params'] / 1e9:>8.2f}B {per_param:>7g} "
            f"{result['peak_gpu_gib']:>12.1f} {result['host_rss_gib']:>12.1f} {result['pinned_gib']:>10.1f} "
            f"{result['host_left_gib']:>13.1f} {result['resident_share']:>8.0%} {result['tokens_per_s']:>9.0f}"
        )
        for metric in metrics:
            rec.add(workload, mode, metric, float(result[metric]))
    resident = best.get("resident")
    for mode, result in best.items():
        if mode != "resident" and result and resident:
            ratio = result["params"] / resident["params"]
            print(f"{mode} trains {ratio:.2f}x the params of resident")
            rec.add(workload, mode, "x_resident_params", ratio)
    if args.csv:
        rec.write(args.csv)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
