"""torchtitan's training step with the optimizer state offloaded: its Llama 3, parallelize_llama (each block compiled,
FSDP2), its AdamW container, LR schedule, loss and gradient clipping; the wrapper goes in between the optimizers and
the LR schedulers (``chunked_offload.torchtitan.wrap_optimizers``).

    torchrun --nproc-per-node 1 examples/train_torchtitan.py --steps 20            # a GPU, torchtitan 0.3
    python3 examples/train_torchtitan.py --steps 4 --no-compile                      # the CPU (gloo, one rank)

torchtitan clips in every step, so the mode is ``overlap=True`` (``--mode backward`` runs without the clip: with it,
the first step() refuses). On the CPU torchtitan's attention kernels (flex) have no backward: the example swaps each
block's inner attention for causal SDPA there.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist

from chunked_offload.torchtitan import wrap_optimizers


class CausalSdpa(torch.nn.Module):
    """Causal SDPA over torchtitan's ``(batch, length, heads, head_dim)`` layout, for the CPU."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=kwargs.get("scale"), enable_gqa=kwargs.get("enable_gqa", False)
        )
        return out.transpose(1, 2)


def build(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any, int]:
    """torchtitan's Llama 3, parallelized by torchtitan, its AdamW container, and the vocabulary size."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as tools
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    if device.type == "cpu":
        tools.device_type = parallel_dims_module.device_type = "cpu"  # torchtitan assumes a GPU otherwise
    spec = model_registry(args.flavor, attn_backend="flex")
    with torch.device("meta"):
        model = spec.model.build()
    if device.type == "cpu":
        for block in model.layers.values():
            block.attention.inner_attention = CausalSdpa()
    world = dist.get_world_size()
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor"
    )
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="bfloat16", mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=not args.no_compile),
        ac_config=None,
        dump_folder="/tmp",
    )
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, default_adamw(lr=args.lr).build(model_parts=[model]), spec.model.vocab_size


def train(args: argparse.Namespace) -> tuple[list[float], torch.nn.Module]:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.distributed.utils import clip_grad_norm_

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    model, optimizers, vocab = build(args, device)
    if args.mode != "plain":
        wrap_optimizers(
            optimizers, [model], overlap=args.mode == "overlap", step_in_backward=args.mode == "backward",
            gpu_budget_mb="auto" if args.auto else None, chunk_size_mb=args.chunk_mb,
        )  # fmt: skip
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=args.steps
    )
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=vocab))
    losses = []
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        optimizers.zero_grad()
        loss, _ = loss_fn(model(tokens[:, :-1], None), tokens[:, 1:], torch.tensor(tokens[:, 1:].numel()))
        loss.backward()
        if args.mode != "backward":
            clip_grad_norm_(list(model.parameters()), max_norm=1.0, foreach=True)
        optimizers.step()
        schedulers.step()
        losses.append(loss.item())
        if step % args.log_every == 0 and dist.get_rank() == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    return losses, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="overlap", choices=["plain", "sync", "overlap", "backward"])
    parser.add_argument("--auto", action="store_true", help='gpu_budget_mb="auto"')
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=8e-4)
    parser.add_argument("--chunk-mb", type=float, default=64.0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
