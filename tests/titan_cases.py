"""torchtitan's own pieces with the wrapper, run in spawned ranks (tests/test_torchtitan.py).

torchtitan's Llama 3 (its debug model, two layers), its ``parallelize_llama`` (per-block compile in place, FSDP2), its
``OptimizersContainer`` and LR schedule, its loss and its ``clip_grad_norm_``; the wrapper goes in with
``chunked_offload.torchtitan.wrap_optimizers``. On the CPU torchtitan's attention kernels (flex, varlen) have no
backward, so each block's inner attention is swapped for causal SDPA: the same model otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

STEPS = 4
BATCH, SEQ = 2, 32


class _CausalAttention(torch.nn.Module):
    """Inner attention on the CPU: causal SDPA over torchtitan's ``(B, L, N, H)`` layout."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=kwargs.get("scale"),
            enable_gqa=kwargs.get("enable_gqa", False),
        )  # fmt: skip
        return out.transpose(1, 2)


def _titan(world: int, dtype: str, compile: bool) -> tuple[torch.nn.Module, Any]:
    """torchtitan's debug Llama 3 on the CPU, parallelized by torchtitan, and its AdamW container."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as tools

    tools.device_type = parallel_dims_module.device_type = "cpu"  # torchtitan assumes a GPU
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel", attn_backend="flex")
    config = spec.model
    config.layers = config.layers[:2]
    with torch.device("meta"):
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            model = config.build()
        finally:
            torch.set_default_dtype(torch.float32)
    for block in model.layers.values():
        block.attention.inner_attention = _CausalAttention()
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor"
    )
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=dtype, mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=compile),
        ac_config=None,
        dump_folder="/tmp",
    )
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM, which torchtitan's division setting asks for
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, default_adamw(lr=8e-4).build(model_parts=[model])


def _loop(model: torch.nn.Module, optimizers: Any, rank: int, clip: bool) -> None:
    """torchtitan's train step: zero_grad, forward, its loss, backward, its clip, step, the LR schedule."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.distributed.utils import clip_grad_norm_

    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=STEPS
    )
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=2048))
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=gen)
        optimizers.zero_grad()
        loss, _ = loss_fn(model(tokens[:, :-1], None), tokens[:, 1:])
        loss.backward()
        if clip:
            clip_grad_norm_([p for p in model.parameters()], max_norm=1.0, foreach=True)
        optimizers.step()
        schedulers.step()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def titan_parity(rank: int, world: int, port: int, backend: str, variants: list[str], result: Any) -> None:
    """Each variant (the wrapper's mode and what the loop does, as ``mode/flag/...``) against torchtitan's own loop
    with the plain optimizer: "bitwise", "differs", or the refusal."""
    from chunked_offload.torchtitan import wrap_optimizers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    outcomes = {}
    try:
        for variant in variants:
            mode, *flags = variant.split("/")
            clip, compile = "clip" in flags, "compiled" in flags
            dtype = "bfloat16" if "masters" in flags else "float32"
            torch._dynamo.reset()
            plain_model, plain_opts = _titan(world, dtype, compile)
            if dtype == "bfloat16":  # the plain reference keeps fp32 masters too: the synchronous wrapper
                wrap_optimizers(plain_opts, master_weights="fp32", chunk_size_mb=0.05)
            _loop(plain_model, plain_opts, rank, clip)
            model, opts = _titan(world, dtype, compile)
            options: dict[str, Any] = dict(chunk_size_mb=0.05, overlap=mode == "overlap")
            options["step_in_backward"] = mode == "backward"
            if dtype == "bfloat16":
                options["master_weights"] = "fp32"
            wrap_optimizers(opts, [model], **options)
            try:
                _loop(model, opts, rank, clip)
            except RuntimeError as exc:
                outcomes[variant] = f"refused: {exc}"
                continue
            for opt in opts.optimizers:
                opt.synchronize()
            same = all(
                torch.equal(_local(a.detach()), _local(b.detach()))
                for a, b in zip(plain_model.parameters(), model.parameters(), strict=True)
            )
            outcomes[variant] = "bitwise" if same else "differs"
        result[rank] = outcomes
    finally:
        dist.destroy_process_group()
