"""Capacity: the largest Llama-shaped model that trains with full AdamW and fp32 masters, resident against ours.

Question: how many more parameters can one GPU train when the AdamW state and the fp32 masters live in host memory?

Workload: HF ``transformers`` LlamaForCausalLM from a config (random init), bf16 params, fused AdamW on fp32
masters, batch 1 x 2048 tokens, width fixed (4096, intermediate 11008, vocab 32000), depth searched.
    resident  fp32 masters, fp32 grads and the AdamW moments on the GPU (18 bytes per param, the usual mixed-precision
              layout: the bf16 grad of each param is freed as it is converted);
    ours      ChunkedOffloadOptimizer(master_weights="remainder"): the fp32 masters kept losslessly as the bf16 param
              plus a 16-bit remainder (results bitwise identical to fp32 masters), with the moments in pinned host
              memory; 10.125 bytes per param on the host, params and grads on the GPU.
Each trial is a fresh process that builds the model and runs ``--steps`` real steps. The search starts at the depth
the memory arithmetic predicts, grows by one layer until a trial fails, and steps back down on failure. A trial of
ours is not started when its host arena would leave less than ``--host-headroom-gib`` of RAM available (pinning the
last gigabytes invites the OOM killer).

Commands:
    python3 benchmarks/bench_capacity.py                      # on a GPU: the search; on the CPU: one tiny trial each
    python3 benchmarks/bench_capacity.py --csv benchmarks/results/bench_capacity_h200.csv
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
OURS_HOST_BYTES = 10.125  # moments 8 + remainder 2 + tie bits 0.125
GIB = 2**30


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

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = params_of(layers, args)
    out: dict[str, Any] = {"mode": mode, "layers": layers, "params": n}
    if mode == "ours":
        need = n * OURS_HOST_BYTES
        available = available_host_bytes() or 0
        if need > available - args.host_headroom_gib * GIB:
            return {**out, "fits": False, "why": f"host: needs {need / GIB:.1f} GiB of {available / GIB:.1f} GiB"}
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
            inner = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=1024, master_weights="remainder")
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
    pinned = opt.plan.host_nbytes if isinstance(opt, ChunkedOffloadOptimizer) else 0
    step_s = min(times[1:]) if len(times) > 1 else times[0]
    return {
        **out,
        "fits": True,
        "peak_gpu_gib": peak / GIB,
        "host_rss_gib": rss / GIB,
        "pinned_gib": pinned / GIB,
        "tokens_per_s": args.batch * args.seq / step_s,
    }


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
    parser.add_argument("--trial", choices=["resident", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-trials", type=int, default=4)
    parser.add_argument("--host-headroom-gib", type=float, default=8.0)
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
        for k in ("hidden", "intermediate", "heads", "vocab", "seq", "batch", "steps", "host-headroom-gib")
    ]
    if args.trial:
        print(json.dumps(trial(args.trial, args.layers, args)))
        return 0

    per_layer = params_of(1, args) - params_of(0, args)
    if gpu:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        host_bytes = (available_host_bytes() or 0) - args.host_headroom_gib * GIB
        starts = {
            "resident": int((0.95 * gpu_bytes / RESIDENT_BYTES - params_of(0, args)) // per_layer),
            "ours": int((host_bytes / OURS_HOST_BYTES - params_of(0, args)) // per_layer),
        }
    else:
        starts = {"resident": 2, "ours": 2}
        args.max_trials = 1
    print(
        f"{device_name(torch.device('cuda' if gpu else 'cpu'))}, torch {torch.__version__}, commit {git_sha()}; host "
        f"RAM available {(available_host_bytes() or 0) / GIB:.1f} GiB; width {args.hidden}, batch {args.batch} x "
        f"{args.seq}; search starts: {starts}",
        flush=True,
    )
    best = {mode: search(mode, start, args) for mode, start in starts.items()}
    rec = Recorder(torch.device("cuda" if gpu else "cpu"))
    print(
        f"\n{'mode':>8} {'layers':>6} {'params':>9} {'peak GPU GiB':>12} {'host RSS GiB':>12} {'pinned GiB':>10} "
        f"{'tokens/s':>9}"
    )
    for mode, result in best.items():
        if result is None:
            print(f"{mode:>8}  nothing fit")
            continue
        print(
            f"{mode:>8} {result['layers']:>6} {result['params'] / 1e9:>8.2f}B {result['peak_gpu_gib']:>12.1f} "
            f"{result['host_rss_gib']:>12.1f} {result['pinned_gib']:>10.1f} {result['tokens_per_s']:>9.0f}"
        )
        for metric in ("params", "layers", "peak_gpu_gib", "host_rss_gib", "pinned_gib", "tokens_per_s"):
            rec.add(f"llama-w{args.hidden}-b{args.batch}x{args.seq}", mode, metric, float(result[metric]))
    if best["resident"] and best["ours"]:
        ratio = best["ours"]["params"] / best["resident"]["params"]
        print(f"ours trains {ratio:.2f}x the params of resident")
        rec.add(f"llama-w{args.hidden}-b{args.batch}x{args.seq}", "ours", "x_resident_params", ratio)
    if args.csv:
        rec.write(args.csv)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
