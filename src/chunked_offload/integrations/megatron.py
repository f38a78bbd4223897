"""Megatron-Core: the fp32 main params and the moments of Megatron's ``DistributedOptimizer`` in host memory.

Megatron stays an optional dependency: nothing here imports it at import time.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

from ..adapters import resolve_adapter
from ..adapters.transformer_engine import is_te_fused_adam
from ..layout import stepped_like
from ..masters import MasterMode
from ..optimizer import ChunkedOffloadOptimizer
from ..planner import TensorSpec
from .megatron_overlap import bucket_groups, gate, ranks, shard

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
# A DistributedOptimizer already on the precision-aware path (``use_precision_aware_optimizer=True``, TE's
# ``FusedAdam(master_weights=True)``) keeps it: the wrapper wraps that FusedAdam as it is (the TE adapter), so its
# masters (fp32, or int16 remainders) and moments (fp32 or bf16) are its host state, and the checkpoint hooks give
# them in that path's format (``param`` is TE's ``master_param``).


def wrap_megatron_optimizer(optimizer: Any, **options: Any) -> Any:
    """Keep the fp32 main params and the optimizer state of Megatron-Core's DistributedOptimizer(s) in host memory,
    stepped chunk by chunk on the GPU ([Note: Megatron main params]).

    Call it on what ``get_megatron_optimizer`` returns (a ``ChainedOptimizer`` or one ``DistributedOptimizer``),
    before the ``OptimizerParamScheduler`` is built; Megatron's own calls (``step``, ``zero_grad``, clipping,
    ``state_dict``, ``sharded_state_dict``, ``offload_to_cpu``) keep working on the returned object.

    Args:
        optimizer: a ``DistributedOptimizer`` or a ``ChainedOptimizer`` of them.
        **options: the wrapper's options (``chunk_size_mb``, ``gpu_budget_mb``, ``num_slots``, ``spill_dir``, ...);
            ``master_weights``: ``"fp32"`` (default) keeps Megatron's fp32 mains, ``"remainder"`` (bf16 params) a
            16-bit remainder of each, as exact (not on the precision-aware path, where TE's FusedAdam keeps them).

    Returns:
        ``optimizer``, with each DistributedOptimizer's inner optimizer wrapped in place.

    Raises:
        TypeError, ValueError: what cannot be wrapped, and what to do instead; nothing is modified then.
    """
    if options.get("step_in_backward"):
        raise ValueError(
            "step_in_backward=True is not supported under Megatron-Core: Megatron reduces and clips the grads after "
            "the backward, so no chunk may step inside it. Pass overlap=True instead (the step runs beside the next "
            "forward)"
        )
    if "adapter" in options:
        raise ValueError("wrap_megatron_optimizer() sets adapter itself (fp32 masters of Megatron's mains)")
    if options.get("master_weights", "fp32") not in ("fp32", "remainder"):
        raise ValueError(
            f"wrap_megatron_optimizer() keeps Megatron's fp32 mains as masters: master_weights='fp32' (the default) "
            f"or 'remainder' (bf16 params: a 16-bit remainder each, as exact), got {options['master_weights']!r}"
        )
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    for part in parts:
        _check(part, options)
    for part in parts:
        if not getattr(part, "is_stub_optimizer", False):
            _wrap(part, options)
            if options.get("overlap"):
                gate(part)
    return optimizer


_NOT_DISTRIBUTED = (
    "wrap_megatron_optimizer() takes Megatron's DistributedOptimizer (or a ChainedOptimizer of them), got {}: build "
    "it with OptimizerConfig(use_distributed_optimizer=True) (--use-distributed-optimizer). Megatron builds Muon "
    "without one (optimizer='muon': Float16OptimizerWithFloat16Params; layer-wise: LayerWiseDistributedOptimizer), "
    "which is not supported yet: use Adam, or wrap Emerging-Optimizers' Muon with ChunkedOffloadOptimizer outside "
    "Megatron"
)


def _check(d: Any, options: dict[str, Any]) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(d, DistributedOptimizer):
        raise TypeError(_NOT_DISTRIBUTED.format(type(d).__name__))
    if getattr(d, "is_stub_optimizer", False):
        return
    if isinstance(d.optimizer, ChunkedOffloadOptimizer):
        raise ValueError("this DistributedOptimizer is wrapped already")
    cfg, ddp = d.config, d.ddp_config
    te_masters = bool(cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8)  # the path where the inner keeps masters
    why, overlap = None, bool(options.get("overlap"))
    if te_masters and "master_weights" in options:
        why = (
            "on the precision-aware path TE's FusedAdam keeps the masters (--store-param-remainders: remainders); "
            "leave master_weights out"
        )
    elif ddp.use_megatron_fsdp:
        why = "Megatron-FSDP keeps its own buffers: use Megatron's DDP with use_distributed_optimizer=True"
    elif cfg.optimizer_cpu_offload:
        why = (
            "optimizer_cpu_offload steps Megatron's HybridDeviceOptimizer on the CPU: leave it off (the wrapper "
            "keeps the masters and moments in host memory and steps them on the GPU)"
        )
    elif te_masters and not (is_te_fused_adam(d.optimizer) and getattr(d.optimizer, "master_weights", False)):
        why = (
            "use_precision_aware_optimizer=True needs Transformer Engine's FusedAdam(master_weights=True) as the "
            f"inner optimizer, got {type(d.optimizer).__name__}: install Transformer Engine, or leave "
            "use_precision_aware_optimizer off (the wrapper then keeps fp32 masters of Megatron's mains)"
        )
    elif ddp.fp8_param_gather or getattr(ddp, "fp4_param_gather", False):
        why = "fp8/fp4 param gather quantizes the mains into the buffer: not supported; leave it off"
    if why is None and not te_masters:
        for model_group in d.model_float16_groups:
            for p in model_group:
                if getattr(p, "main_grad", None) is not None and p.main_grad.dtype != torch.float32:
                    why = (
                        "16-bit params need fp32 grads (Megatron's default path clips an fp32 copy): set "
                        "DistributedDataParallelConfig(grad_reduce_in_fp32=True) (--accumulate-allreduce-grads-in-fp32)"
                    )
    if why is None and options.get("master_weights") == "remainder":
        other = {str(p.dtype) for group in d.model_float16_groups for p in group if p.dtype != torch.bfloat16}
        if other:
            why = f"master_weights='remainder' needs bf16 params (--bf16), got {', '.join(sorted(other))}: leave it out"
    if why is None and overlap and not ddp.overlap_param_gather and any(ranks(g) > 1 for g in bucket_groups(d)):
        why = (
            "overlap=True at a data-parallel size above 1 needs DistributedDataParallelConfig(overlap_param_gather="
            "True) (--overlap-param-gather): then each bucket's all-gather waits for its own chunks in the next "
            "forward, where without it every all-gather runs in step() and waits for the whole step"
        )
    shards = d.shard_float16_groups if te_masters else d.shard_fp32_from_float16_groups
    for g, group in enumerate(d.optimizer.param_groups):
        expected = [*d.shard_fp32_groups[g], *shards[g]]  # Megatron's order
        if why is None and list(map(id, group["params"])) != list(map(id, expected)):
            why = f"its inner optimizer's param group {g} is not Megatron's shards in Megatron's order"
    if why is not None:
        raise ValueError(f"wrap_megatron_optimizer() cannot wrap this DistributedOptimizer: {why}")


def _wrap(d: Any, options: dict[str, Any]) -> None:
    inner = d.optimizer
    if d.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:  # TE's FusedAdam steps the shards, keeps masters
        d.optimizer = ChunkedOffloadOptimizer(inner, **options)
        _replace_checkpoint_hooks(d)
        return
    views = [list(f) + list(h) for f, h in zip(d.shard_fp32_groups, d.shard_float16_groups, strict=True)]
    mains = {}
    for g, group in enumerate(inner.param_groups):
        for main, view in zip(group["params"], views[g], strict=True):
            if main in inner.state:
                inner.state[view] = inner.state.pop(main)
            if main is not view:
                mains[view] = main
        group["params"] = views[g]
    for g, ranges in enumerate(getattr(d, "opt_group_ranges", ())):  # Megatron's copy of the groups (the mains)
        ranges["orig_group"]["params"] = views[g]
    adapter = resolve_adapter(inner)
    adapter.grad_attr = "decoupled_grad"  # the path's fp32 grads ([Note: Megatron main params])
    wrapper = ChunkedOffloadOptimizer(inner, **{"master_weights": "fp32", **options}, adapter=adapter)
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
    d._copy_model_params_to_main_params = types.MethodType(_reload_mains, d)
    _replace_checkpoint_hooks(d)


def _replace_checkpoint_hooks(d: Any) -> None:
    """Megatron's per-shard checkpoint hooks and its RL offload, on the wrapper's host copies."""
    d._get_main_param_and_optimizer_states = types.MethodType(_get_states, d)
    d._set_main_param_and_optimizer_states = types.MethodType(_set_states, d)
    d._init_optimizer_states_with_dummy_values = types.MethodType(lambda self: None, d)  # _set_states makes them
    d.load_state_dict = types.MethodType(_load_state_dict, d)
    d.offload_to_cpu = types.MethodType(lambda self: self.optimizer.offload(), d)
    d.restore_from_cpu = types.MethodType(lambda self: self.optimizer.reload(), d)


def _reload_mains(self: Any, state_dict: Any = None) -> None:
    """Megatron's copy of the model params into the main params (``reload_model_params()``, after a load without the
    optimizer's state), which its precision-aware path skips: the wrapper's masters become the params' shards, or
    the tensors ``state_dict`` holds for them. The wrapper keeps each param its master's rounding, so a state dict
    whose tensors do not round to the params is refused, before any master changes."""
    source = {} if state_dict is None else self._build_model_param_to_state_dict_param_map(state_dict)
    pairs = []
    for groups in (self.model_float16_groups, self.model_fp32_groups):
        for group in groups:
            for model_param in group:
                where = self._get_model_param_range_map(model_param)["param"]
                loaded = source.get(model_param, model_param).detach().view(-1)[where.start : where.end]
                view = shard(self, model_param)
                if not torch.equal(loaded.to(view.dtype), view):
                    raise ValueError(
                        "reload_model_params(state_dict): a tensor of the state dict does not round to its model "
                        f"param (shape {tuple(model_param.shape)}), and the wrapper keeps each param the rounding of "
                        "its fp32 master. Load the model params from the same checkpoint first, or call "
                        "reload_model_params() without a state dict"
                    )
                pairs.append((view, loaded))
    for view, loaded in pairs:
        _set_main(self.optimizer, view, loaded)


def _copy_grads(self: Any) -> None:
    """Megatron's copy of the main grads into ``decoupled_grad``; torch's inner reads ``.grad`` of fp32 shards."""
    type(self)._copy_model_grads_to_main_grads(self)
    for group in self.shard_fp32_groups:
        for view in group:
            view.grad = getattr(view, "decoupled_grad", None)


def _set_main(wrapper: ChunkedOffloadOptimizer, view: torch.Tensor, main: torch.Tensor) -> None:
    """Make ``main`` the fp32 main param of the shard ``view``: the shard itself if fp32, else its wrapper master."""
    if view.dtype == torch.float32:
        view.detach().copy_(main)
    else:
        wrapper.set_master(view, main.detach().to(torch.float32))


def _get_states(self: Any, model_param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of ``model_param``'s shard, as Megatron's resident optimizer gives them: its state in
    the inner's checkpoint dtypes, and ``param``, its master (TE's ``master_param``, or the fp32 main)."""
    wrapper = self.optimizer
    wrapper.synchronize()  # an overlapped step's chunks have written their state back
    view = shard(self, model_param)
    tensors = {}
    for key, value in wrapper.state[view].items():
        if isinstance(value, torch.Tensor):
            tensors[key] = wrapper.adapter.to_checkpoint(key, value)
    if wrapper.adapter.owns_masters():  # TE's master_param (the precision-aware path)
        tensors["param"] = tensors.pop("master_param")
    else:
        tensors["param"] = view if view.dtype == torch.float32 else wrapper.master_of(view)
    return tensors


def _load_state_dict(self: Any, state_dict: Any) -> None:
    """Megatron's ``load_state_dict``. For an optimizer without state Megatron first makes placeholder state on the
    GPU for every shard, for the checkpoint to load into, which would not fit where the state was offloaded for want
    of room: a wrapper that has not stepped gets its placeholders (zeros) in host memory instead, and the checkpoint
    loads into its host copies."""
    wrapper = self.optimizer
    if len(wrapper.state) == 0:
        for group in wrapper.param_groups:
            for view in group["params"]:
                specs = _specs(wrapper, view, group).values()
                wrapper.state[view] = {s.key: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    type(self).load_state_dict(self, state_dict)


def _specs(wrapper: ChunkedOffloadOptimizer, view: torch.Tensor, group: dict[str, Any]) -> dict[str, TensorSpec]:
    """The state the inner keeps for the shard ``view``, by key: for the tensor it steps, the shard itself where the
    inner keeps the masters (TE's path), else the shard's fp32 master."""
    mode = MasterMode.NONE if wrapper.adapter.owns_masters() else MasterMode.FP32
    return {s.key: s for s in wrapper.adapter.predict_state(stepped_like(view, mode), group)}


def _set_states(self: Any, model_param: torch.Tensor, tensors: dict[str, Any]) -> None:
    """Load the checkpoint tensors of ``model_param``'s shard (as :func:`_get_states` gives them) into the wrapper.
    A tensor of another shape or dtype than the run keeps is refused, as Megatron's own copy would refuse it."""
    view, wrapper = shard(self, model_param), self.optimizer
    wrapper.synchronize()  # no chunk of an overlapped step writes back over what is loaded
    te_masters = wrapper.adapter.owns_masters()
    specs = _specs(wrapper, view, wrapper.param_groups[self.model_param_group_index_map[model_param][0]])
    for key, value in tensors.items():
        # ``step`` comes from the checkpoint's param groups (Megatron's load_state_dict sets it before this runs).
        if not isinstance(value, torch.Tensor) or key == "step":
            continue
        if key == "param" and not te_masters:
            _set_main(wrapper, view, value)
            continue
        key = "master_param" if key == "param" else key
        if key in specs:
            value = wrapper.adapter.from_checkpoint(key, value, specs[key])  # as _get_states' to_checkpoint, back
        entry = wrapper.state[view]
        home = entry.get(key)
        if home is None:
            entry[key] = value.detach().clone()  # placed in a home by the next step's re-plan
        elif home.shape == value.shape and home.dtype == value.dtype:
            home.copy_(value)
        else:
            raise ValueError(
                f"the checkpoint's {key!r} of a shard of shape {tuple(view.shape)} is {value.dtype} "
                f"{tuple(value.shape)}, where this run keeps {home.dtype} {tuple(home.shape)}: load a checkpoint "
                "saved with the same optimizer settings (exp_avg_dtype, store_param_remainders, ...)"
            )
