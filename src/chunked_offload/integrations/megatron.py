"""Megatron-Core: the fp32 main params and the moments of Megatron's ``DistributedOptimizer`` in host memory.

Megatron stays an optional dependency: nothing here imports it at import time.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

from ..adapters import resolve_adapter
from ..optimizer import ChunkedOffloadOptimizer

__all__ = ["wrap_megatron_optimizer"]

# [Note: Megatron main params]
# Megatron's DistributedOptimizer steps an inner optimizer over fp32 main shards of the 16-bit model params (its
# "default path") and copies them into the model's param buffer after the step. Its precision-aware path instead
# gives the inner the 16-bit shards themselves (views into the DDP param buffer), their fp32 grads as
# ``decoupled_grad``, and leaves the masters to the inner optimizer (TE's FusedAdam with master_weights=True).
# ``wrap_megatron_optimizer`` moves each DistributedOptimizer onto that path with the wrapper as the inner: the
# inner optimizer steps the 16-bit shard views, the wrapper keeps their fp32 masters (seeded from Megatron's main
# params, which are then freed) and the moments in host memory, reads the fp32 grads from ``decoupled_grad``, and
# rounds each chunk's masters into the param buffer on the GPU. Megatron's clip, found-inf check and zeroing read
# ``decoupled_grad`` on that path; its checkpoint hooks (``_get/_set_main_param_and_optimizer_states``) are
# replaced by ones that read and write the wrapper's masters and state, in the default path's format
# (``param`` is the fp32 master), so a checkpoint moves between a wrapped and a resident run.


def wrap_megatron_optimizer(optimizer: Any, **options: Any) -> Any:
    """Keep the fp32 main params and the optimizer state of Megatron-Core's DistributedOptimizer(s) in host memory,
    stepped chunk by chunk on the GPU ([Note: Megatron main params]).

    Call it on what ``get_megatron_optimizer`` returns (a ``ChainedOptimizer`` or one ``DistributedOptimizer``),
    before the ``OptimizerParamScheduler`` is built; Megatron's own calls (``step``, ``zero_grad``, clipping,
    ``state_dict``, ``sharded_state_dict``, ``offload_to_cpu``) keep working on the returned object.

    Args:
        optimizer: a ``DistributedOptimizer`` or a ``ChainedOptimizer`` of them.
        **options: the wrapper's options (``chunk_size_mb``, ``gpu_budget_mb``, ``num_slots``, ``spill_dir``, ...).

    Returns:
        ``optimizer``, with each DistributedOptimizer's inner optimizer wrapped in place.

    Raises:
        TypeError, ValueError: what cannot be wrapped, and what to do instead; nothing is modified then.
    """
    for name in ("overlap", "step_in_backward"):
        if options.get(name):
            raise ValueError(
                f"{name}=True is not supported under Megatron-Core yet: Megatron's forward reads the param buffer, "
                "which no attach() gate orders. Leave it out (the step runs in optimizer.step())"
            )
    for name in ("master_weights", "adapter"):
        if name in options:
            raise ValueError(f"wrap_megatron_optimizer() sets {name} itself (fp32 masters of Megatron's mains)")
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    for part in parts:
        _check(part)
    for part in parts:
        if not getattr(part, "is_stub_optimizer", False):
            _wrap(part, options)
    return optimizer


def _check(d: Any) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(d, DistributedOptimizer):
        raise TypeError(
            f"wrap_megatron_optimizer() takes Megatron's DistributedOptimizer (or a ChainedOptimizer of them), got "
            f"{type(d).__name__}: build it with OptimizerConfig(use_distributed_optimizer=True)"
        )
    if getattr(d, "is_stub_optimizer", False):
        return
    if isinstance(d.optimizer, ChunkedOffloadOptimizer):
        raise ValueError("this DistributedOptimizer is wrapped already")
    cfg, ddp = d.config, d.ddp_config
    why = None
    if ddp.use_megatron_fsdp:
        why = "Megatron-FSDP keeps its own buffers: use Megatron's DDP with use_distributed_optimizer=True"
    elif cfg.use_precision_aware_optimizer or cfg.optimizer_cpu_offload:
        why = (
            "use_precision_aware_optimizer and optimizer_cpu_offload keep the masters elsewhere already: leave them "
            "off (the wrapper keeps fp32 masters of the mains in host memory)"
        )
    elif ddp.fp8_param_gather or getattr(ddp, "fp4_param_gather", False):
        why = "fp8/fp4 param gather quantizes the mains into the buffer: not supported; leave it off"
    if why is None:
        for model_group in d.model_float16_groups:
            for p in model_group:
                if getattr(p, "main_grad", None) is not None and p.main_grad.dtype != torch.float32:
                    why = (
                        "16-bit params need fp32 grads (Megatron's default path clips an fp32 copy): set "
                        "DistributedDataParallelConfig(grad_reduce_in_fp32=True) (--accumulate-allreduce-grads-in-fp32)"
                    )
    if why is None:
        for g, group in enumerate(d.optimizer.param_groups):
            mains = list(d.shard_fp32_groups[g]) + list(d.shard_fp32_from_float16_groups[g])  # Megatron's order
            params = group["params"]
            if len(params) != len(mains) or any(a is not b for a, b in zip(params, mains, strict=True)):
                why = f"its inner optimizer's param group {g} is not Megatron's main params in Megatron's order"
    if why is not None:
        raise ValueError(f"wrap_megatron_optimizer() cannot wrap this DistributedOptimizer: {why}")


def _wrap(d: Any, options: dict[str, Any]) -> None:
    inner = d.optimizer
    views = [list(f) + list(h) for f, h in zip(d.shard_fp32_groups, d.shard_float16_groups, strict=True)]
    mains = {}
    for g, group in enumerate(inner.param_groups):
        for main, view in zip(group["params"], views[g], strict=True):
            if main in inner.state:
                inner.state[view] = inner.state.pop(main)
            if main is not view:
                mains[view] = main
        group["params"] = views[g]
    adapter = resolve_adapter(inner)
    adapter.grad_attr = "decoupled_grad"  # the path's fp32 grads ([Note: Megatron main params])
    wrapper = ChunkedOffloadOptimizer(inner, master_weights="fp32", adapter=adapter, **options)
    for view, main in mains.items():
        if (view in wrapper.state and wrapper.state[view]) or not torch.equal(main, view.float()):
            wrapper.set_master(view, main)
    d.optimizer = wrapper
    d.config = copy.copy(d.config)
    d.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    for model_group, shard_group in zip(d.model_float16_groups, d.shard_fp32_from_float16_groups, strict=True):
        for model_param in model_group:
            model_param.main_param = None
        shard_group[:] = [None] * len(shard_group)  # the GPU's fp32 mains are gone
    d._copy_model_grads_to_main_grads = types.MethodType(_copy_grads, d)
    d._get_main_param_and_optimizer_states = types.MethodType(_get_states, d)
    d._set_main_param_and_optimizer_states = types.MethodType(_set_states, d)
    d._init_optimizer_states_with_dummy_values = types.MethodType(lambda self: None, d)  # _set_states makes them
    d.offload_to_cpu = types.MethodType(lambda self: self.optimizer.offload(), d)
    d.restore_from_cpu = types.MethodType(lambda self: self.optimizer.reload(), d)


def _copy_grads(self: Any) -> None:
    """Megatron's copy of the main grads into ``decoupled_grad``; torch's inner reads ``.grad`` of fp32 shards."""
    type(self)._copy_model_grads_to_main_grads(self)
    for group in self.shard_fp32_groups:
        for view in group:
            view.grad = getattr(view, "decoupled_grad", None)


def _shard(d: Any, model_param: torch.Tensor) -> torch.Tensor:
    group_index, group_order = d.model_param_group_index_map[model_param]
    return d.optimizer.param_groups[group_index]["params"][group_order]  # type: ignore[no-any-return]


def _get_states(self: Any, model_param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The default path's checkpoint tensors of ``model_param``'s shard: its fp32 main param and its state."""
    view = _shard(self, model_param)
    tensors = {"param": view if view.dtype == torch.float32 else self.optimizer.master_of(view)}
    for key, value in self.optimizer.state[view].items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
    return tensors


def _set_states(self: Any, model_param: torch.Tensor, tensors: dict[str, Any]) -> None:
    """Load the default path's checkpoint tensors of ``model_param``'s shard into the wrapper."""
    view, wrapper = _shard(self, model_param), self.optimizer
    for key, value in tensors.items():
        # ``step`` comes from the checkpoint's param groups (Megatron's load_state_dict sets it before this runs).
        if not isinstance(value, torch.Tensor) or key == "step":
            continue
        if key == "param":
            if view.dtype == torch.float32:
                view.detach().copy_(value)
            else:
                wrapper.set_master(view, value.detach().to(torch.float32))
            continue
        entry = wrapper.state[view]
        if key in entry and entry[key].shape == value.shape and entry[key].dtype == value.dtype:
            entry[key].copy_(value)  # into its home
        else:
            entry[key] = value.detach().clone()  # placed in a home by the next step's re-plan
