"""torchtitan's own training step with the wrapper: which share of the resident iterations/s each mode keeps.

Question: in torchtitan's loop (its Llama 3, ``parallelize_llama`` with selective activation checkpointing, each block
compiled, FSDP2; ``build_optimizers``, its LR schedule, its loss and its ``clip_grad_norm_`` in every step), what does
offloading the optimizer state cost?

Workload: torchtitan 0.2's Llama 3 (the API this script speaks; the GPU's torch 2.11 runs 0.2.2), bf16 params with fp32
masters in the wrapper, fused AdamW, world size 1 (NCCL; torchtitan applies no FSDP there, so fp32 params would
compute in fp32: 10x slower, measured at e1919fb). Variants, in one process, each against the resident loop of the
same run:
    resident      torchtitan's AdamW in its OptimizersContainer on the same bf16 params, state on the GPU and no
                  masters: the same forward and backward, and a cheaper step than a resident fp32-master one, so
                  the share kept is a lower bound;
    resident-masters  the same AdamW stepping resident fp32 copies of the bf16 params, each param the rounded
                  result: the recipe the wrapper reproduces bitwise, all on the GPU (kept is against this row too);
    sync          chunked_offload.torchtitan.wrap_optimizers(container), with torchtitan's clip;
    overlap       the same with overlap=True (each compiled block gated at its boundary);
    overlap-auto  overlap=True, gpu_budget_mb="auto": what the GPU has room for stays resident;
    backward      step_in_backward=True, without the clip (with it, the first step() refuses: test_torchtitan.py).
Reported: s/iter (median of the timed iterations, run back to back as torchtitan's trainer runs them, so that an
overlapped step runs under the next forward; p20/p80), the share of the resident iterations/s kept, and the peak
memory. The bitwise check runs each variant for a few steps in deterministic mode (torchtitan's debug.deterministic)
against the synchronous wrapper with the same clip choice (bf16 shards with fp32 masters are another recipe than
FSDP2's fp32 shards; tests/ check the wrapper against plain fp32-master loops), and that against itself as the
control.

With ``--fsdp`` torchtitan's own ``apply_fsdp`` shards the model on a 1-rank mesh (FSDP2: each block, the embedding,
[norm, output] as one unit, the root), with fp32 shards computing in bf16 (its MixedPrecisionPolicy), and the
variants are those of FSDP2 users: resident (AdamW on the fp32 shards), overlap (blocks=True, as wrap_optimizers
attaches), overlap-modules (blocks=False), overlap-auto, and overlap-masters (bf16 shards, fp32 masters) against
resident-masters. The bitwise check then compares each with the plain loop it reproduces (losses and params, every
chunk's step slowed on the GPU so that a missing wait shows), and that loop with itself as the control.

Commands:
    python3 benchmarks/bench_titan.py                                  # ~1 B params at 16 x 2048 on a GPU
    python3 benchmarks/bench_titan.py --fsdp --batch 8 --exact-steps 10  # FSDP2: overlap bitwise, and its share kept
    python3 benchmarks/bench_titan.py --batch 16 --csv benchmarks/results/bench_titan_h200.csv
Wheels for the GPU (torchtitan 0.2.2 and what it imports beyond the image): scripts/titan-prepare.sh.
Exits nonzero if a variant is not bitwise equal to the resident run.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, Stats, device_name, git_sha  # noqa: E402  (it puts src/ and tests/ on the path)
from reference import ResidentMasters as MasterLoop  # noqa: E402

VARIANTS = ("resident", "resident-masters", "sync", "overlap", "overlap-auto", "backward")
FSDP_VARIANTS = ("resident", "resident-masters", "overlap", "overlap-modules", "overlap-auto", "overlap-masters")
REFERENCES = ("resident", "resident-masters")


def bf16_shards(variant: str, args: argparse.Namespace) -> bool:
    """Whether the variant's params are bf16 (else fp32 shards that FSDP2 casts for the compute)."""
    return not args.fsdp or variant.endswith("masters")


def reference_of(variant: str, args: argparse.Namespace) -> str:
    """The loop ``variant`` reproduces bitwise: the synchronous wrapper, or with --fsdp the plain loop."""
    if not args.fsdp:
        return "sync"
    return "resident-masters" if bf16_shards(variant, args) else "resident"


class ResidentMasters(torch.optim.Optimizer):
    """An optimizer of torchtitan's container moved onto resident fp32 copies of its bf16 params: the tests'
    ``reference.ResidentMasters`` loop (the one ``master_weights="fp32"`` reproduces bitwise, all on the GPU) as an
    Optimizer, so that torchtitan's LR schedulers take it."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        params = [p for g in inner.param_groups for p in g["params"]]

        def onto(masters: list[torch.Tensor]) -> torch.optim.Optimizer:
            by_param = dict(zip(map(id, params), masters, strict=True))
            for group in inner.param_groups:
                group["params"] = [by_param[id(p)] for p in group["params"]]
            return inner

        self.loop = MasterLoop(params, onto)
        super().__init__(self.loop.masters, inner.defaults)
        self.param_groups, self.state = inner.param_groups, inner.state

    def step(self, closure: Any = None) -> None:
        self.loop.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.loop.zero_grad()


def job_config(args: argparse.Namespace, deterministic: bool) -> Any:
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.training.local_batch_size = args.batch
    job.training.seq_len = args.seq
    job.training.max_norm = 1.0
    job.training.mixed_precision_param = "bfloat16"
    job.training.mixed_precision_reduce = "float32"
    job.compile.enable = not args.no_compile
    job.compile.components = ["model"]
    job.activation_checkpoint.mode = "selective"
    job.activation_checkpoint.selective_ac_option = "op"
    job.optimizer.lr = 3e-4
    job.optimizer.implementation = "fused"
    job.lr_scheduler.warmup_steps = 2
    job.debug.deterministic = deterministic
    job.debug.seed = 0
    return job


def build(args: argparse.Namespace, deterministic: bool, bf16: bool = True) -> tuple[torch.nn.Module, Any]:
    """torchtitan's Llama 3 with bf16 (or fp32) params, parallelized by torchtitan (with --fsdp also sharded by its
    ``apply_fsdp`` on a 1-rank mesh), and its optimizer container."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    job = job_config(args, deterministic)
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist_utils.set_determinism(dims, device, job.debug, distinct_seed_mesh_dims=["pp"])
    model_args = TransformerModelArgs(
        dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads, vocab_size=args.vocab,
        multiple_of=256, ffn_dim_multiplier=1.3, rope_theta=500000,
    )  # fmt: skip
    model_args.update_from_config(job)
    with torch.device("meta"):
        torch.set_default_dtype(torch.bfloat16 if bf16 else torch.float32)
        try:
            model = Transformer(model_args)
        finally:
            torch.set_default_dtype(torch.float32)
    model = parallelize_llama(model, dims, job)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.models.llama3.infra.parallelize import apply_fsdp

        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    with torch.no_grad():
        torch.manual_seed(0)
        model.init_weights(buffer_device=None)
    model.train()
    return model, build_optimizers([model], job.optimizer, dims)


def make(variant: str, args: argparse.Namespace, deterministic: bool = False) -> tuple[torch.nn.Module, Any, Any]:
    from torchtitan.components.lr_scheduler import build_lr_schedulers

    from chunked_offload.torchtitan import wrap_optimizers

    bf16 = bf16_shards(variant, args)
    model, optimizers = build(args, deterministic, bf16)
    if variant == "resident-masters":
        optimizers.optimizers[:] = [ResidentMasters(o) for o in optimizers.optimizers]
    elif variant != "resident":
        mode = variant.split("-")[0]
        wrap_optimizers(
            optimizers, [model], blocks=variant != "overlap-modules", chunk_size_mb=args.chunk_mb,
            num_slots=args.num_slots, master_weights="fp32" if bf16 else "none", overlap=mode == "overlap",
            step_in_backward=mode == "backward", gpu_budget_mb="auto" if variant.endswith("-auto") else None,
        )  # fmt: skip
    job = job_config(args, deterministic)
    return model, optimizers, build_lr_schedulers(optimizers, job.lr_scheduler, args.warmup + args.iters)


def train_step(
    model: torch.nn.Module, optimizers: Any, schedulers: Any, tokens: torch.Tensor, clip: bool
) -> torch.Tensor:
    """torchtitan's train_step for one micro-batch: zero_grad, forward, its loss, backward, its clip, step, LR."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    optimizers.zero_grad()
    pred = model(tokens[:, :-1])
    loss = cross_entropy_loss(pred, tokens[:, 1:])
    del pred
    loss.backward()
    if clip:
        dist_utils.clip_grad_norm_([p for p in model.parameters()], 1.0, foreach=True)
    optimizers.step()
    schedulers.step()
    return loss.detach()


def batches(args: argparse.Namespace, count: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(1)
    return [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen, device=device) for _ in range(count)
    ]


def wait_steps(optimizers: Any) -> None:
    for opt in getattr(optimizers, "optimizers", []):
        if hasattr(opt, "wait_step"):
            opt.wait_step()


def timed(variant: str, args: argparse.Namespace) -> tuple[list[float], int]:
    model, optimizers, schedulers = make(variant, args)
    device = next(model.parameters()).device
    data = batches(args, args.warmup + args.iters, device)
    clip = variant != "backward"
    for tokens in data[: args.warmup]:
        train_step(model, optimizers, schedulers, tokens, clip)
    wait_steps(optimizers)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    marks = []
    for tokens in data[args.warmup :]:  # back to back, as torchtitan's trainer runs them: a step overlaps the forward
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        train_step(model, optimizers, schedulers, tokens, clip)
    wait_steps(optimizers)  # the last step's updates are part of its iteration
    marks.append(torch.cuda.Event(enable_timing=True))
    marks[-1].record()
    torch.cuda.synchronize()
    seconds = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
    peak = torch.cuda.max_memory_allocated()
    del model, optimizers, schedulers
    gc.collect()
    torch.cuda.empty_cache()
    return seconds, peak


def run_exact(variant: str, args: argparse.Namespace, clip: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``args.exact_steps`` deterministic steps of ``variant``, each chunk's step slowed (``torch.cuda._sleep``) so
    that a reader that does not wait for the step stream overtakes it: the losses and the params."""
    from reference import slowed_chunk_steps

    model, optimizers, schedulers = make(variant, args, deterministic=True)
    with slowed_chunk_steps():
        losses = [train_step(model, optimizers, schedulers, tokens, clip)
                  for tokens in batches(args, args.exact_steps, next(model.parameters()).device)]  # fmt: skip
    for opt in getattr(optimizers, "optimizers", []):
        if hasattr(opt, "synchronize"):
            opt.synchronize()
    params = [(p.detach().to_local() if hasattr(p, "to_local") else p.detach()).clone() for p in model.parameters()]
    del model, optimizers, schedulers
    gc.collect()
    torch.cuda.empty_cache()
    return torch.stack(losses).cpu(), params


def exact(variant: str, reference: str, args: argparse.Namespace, runs: dict[str, Any], clip: bool = True) -> bool:
    """``variant`` against ``reference`` with the same clip choice, bitwise in losses and params. A reference runs once
    (kept in ``runs``); ``variant == reference`` runs it again: the control."""
    clip = clip and variant != "backward"
    if reference not in runs:
        runs[reference] = run_exact(reference, args, clip)
    losses_a, params_a = runs[reference]
    losses_b, params_b = run_exact(variant, args, clip)
    same = torch.equal(losses_a, losses_b) and all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    if not same:
        print(f"  {variant} against {reference}: losses {losses_a.tolist()} vs {losses_b.tolist()}")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--exact-steps", type=int, default=3)
    parser.add_argument("--chunk-mb", type=float, default=1024.0)
    parser.add_argument("--num-slots", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--skip-exact", action="store_true")
    parser.add_argument("--variants", default=None, help="default: every variant of the mode")
    parser.add_argument("--fsdp", action="store_true", help="shard with torchtitan's apply_fsdp on a 1-rank mesh")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args()
    default = FSDP_VARIANTS if args.fsdp else VARIANTS
    variants = [v for v in (args.variants or ",".join(default)).split(",") if v]
    if not torch.cuda.is_available():
        print("bench_titan needs a GPU (torchtitan's kernels and FSDP2 over NCCL)")
        return 0
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    import torchtitan

    print(
        f"{device_name(device)}, torch {torch.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')}, "
        f"commit {git_sha()}: Llama 3 dim {args.dim}, {args.layers} layers, {args.batch} x {args.seq} tokens, "
        f"chunk {args.chunk_mb:g} MB x {args.num_slots}, compile {not args.no_compile}, FSDP2 {args.fsdp}"
    )
    recorder = Recorder(device)
    ok = True
    if not args.skip_exact:
        checked = [v for v in variants if v != reference_of(v, args) and v not in ("resident", "sync")]
        runs: dict[str, Any] = {}
        for control in sorted({reference_of(v, args) for v in checked}):
            same = exact(control, control, args, runs)
            print(f"control: {control} against itself, deterministic: {'bitwise' if same else 'DIFFERS'}")
        for v in checked:  # resident-masters against sync too: the same recipe
            same = exact(v, reference_of(v, args), args, runs)
            ok = ok and same
            print(f"bitwise {v} against {reference_of(v, args)}: {'yes' if same else 'NO'}")
    results = {v: timed(v, args) for v in variants}
    bases = {r: statistics.median(results[r][0]) for r in REFERENCES if r in results}
    print(f"{'variant':16s} {'s/iter':>8s} {'p20':>8s} {'p80':>8s}", *(f"{'kept vs ' + r:>24s}" for r in bases),
          f"{'peak GiB':>9s}")  # fmt: skip
    for v, (seconds, peak) in results.items():
        q = statistics.quantiles(seconds, n=5) if len(seconds) > 1 else [seconds[0]] * 4
        med = statistics.median(seconds)
        kept = [f"{base / med:24.1%}" for base in bases.values()]
        print(f"{v:16s} {med:8.4f} {q[0]:8.4f} {q[3]:8.4f}", *kept, f"{peak / 2**30:9.2f}")
        workload = f"titan-{args.batch}x{args.seq}"
        recorder.add(workload, v, "s_per_iter", Stats(med, q[0], q[3]))
        for r, base in bases.items():
            recorder.add(workload, v, "kept" if r == "resident" else f"kept_vs_{r}", base / med)
        recorder.add(workload, v, "peak_bytes", peak)
    if args.csv is not None:
        recorder.write(args.csv)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
