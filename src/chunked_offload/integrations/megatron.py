"""Megatron-Core: the fp32 main params and the moments of Megatron's ``DistributedOptimizer`` in host memory.

Megatron stays an optional dependency: nothing here imports it at import time.
"""

from __future__ import annotations

import copy
import types
import weakref
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
    if options.get("step_in_backward"):
        raise ValueError(
            "step_in_backward=True is not supported under Megatron-Core: Megatron reduces and clips the grads after "
            "the backward, so no chunk may step inside it. Pass overlap=True instead (the step runs beside the next "
            "forward)"
        )
    for name in ("master_weights", "adapter"):
        if name in options:
            raise ValueError(f"wrap_megatron_optimizer() sets {name} itself (fp32 masters of Megatron's mains)")
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    for part in parts:
        _check(part, bool(options.get("overlap")))
    for part in parts:
        if not getattr(part, "is_stub_optimizer", False):
            _wrap(part, options)
            if options.get("overlap"):
                _gate(part)
    return optimizer


def _check(d: Any, overlap: bool) -> None:
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
    if why is None and overlap and not ddp.overlap_param_gather and any(_ranks(g) > 1 for g in _bucket_groups(d)):
        why = (
            "overlap=True at a data-parallel size above 1 needs DistributedDataParallelConfig(overlap_param_gather="
            "True) (--overlap-param-gather): then each bucket's all-gather waits for its own chunks in the next "
            "forward, where without it every all-gather runs in step() and waits for the whole step"
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
    for g, ranges in enumerate(getattr(d, "opt_group_ranges", ())):  # Megatron's copy of the groups (the mains)
        ranges["orig_group"]["params"] = views[g]
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
    d._copy_model_params_to_main_params = types.MethodType(_reload_mains, d)
    d.offload_to_cpu = types.MethodType(lambda self: self.optimizer.offload(), d)
    d.restore_from_cpu = types.MethodType(lambda self: self.optimizer.reload(), d)


# [Note: Megatron overlapped step]
# With overlap=True the wrapper's step() returns before its chunks have run ([Note: Overlapped step]), and the next
# forward runs beside them. Megatron reads a chunk's params in three places before that forward's modules do, and
# each waits for exactly the chunks it reads:
# - each model chunk (its DDP module) is attached with ``views``: a module's forward waits for the shard views of its
#   own params (at one rank the shard is the whole param);
# - a bucket group's ``start_param_sync`` (the all-gather of the param buffer, dispatched by the next forward's
#   pre-hooks with ``overlap_param_gather=True``) first orders the current stream, on which NCCL enqueues, after the
#   chunks of the group's local shards. At one rank that all-gather copies the shard onto itself: it is skipped, so
#   that a step() without ``overlap_param_gather`` does not wait for every chunk. At more ranks without
#   ``overlap_param_gather`` every all-gather runs in step(), so that is refused;
# - reads of the whole model outside the forward (``parameters()`` and ``named_parameters()``, as
#   ``calc_params_l2_norm`` for --log-params-norm reads them; ``sharded_state_dict()`` and ``state_dict()``, as a
#   checkpoint does) wait for the whole step first, and the checkpoint hooks below wait on the host.
# The grads need nothing: the step reads copies of them ([Note: Inputs of a step]), so ``zero_grad_buffer()`` may
# follow at once.


def _bucket_groups(d: Any) -> list[Any]:
    """The bucket groups of ``d``'s model chunks."""
    return [
        group
        for chunk in d.model_chunks
        for group in [*chunk.bucket_groups, *getattr(chunk, "expert_parallel_bucket_groups", [])]
    ]


def _ranks(group: Any) -> int:
    return int(group.intra_distributed_optimizer_instance_size)


def _gate(d: Any) -> None:
    """Order Megatron's readers of the param buffer after the chunks they read ([Note: Megatron overlapped step])."""
    wrapper = d.optimizer
    views = {p: _shard(d, p) for p in d.model_param_group_index_map}
    for chunk in d.model_chunks:
        held = {p: views[p] for p in chunk.parameters() if p in views}
        if held:
            wrapper.attach(chunk, views=held)
            for name in ("parameters", "named_parameters", "state_dict", "sharded_state_dict"):
                setattr(chunk, name, _JoinFirst(wrapper, getattr(chunk, name)))
    for group in _bucket_groups(d):
        shards = [views[p] for bucket in group.buckets for p in bucket.params_list if p in views]
        if shards:
            group.start_param_sync = _ParamSync(wrapper, group, shards)


class _ParamSync:
    """A bucket group's ``start_param_sync``, after the chunks of its local shards ([Note: Megatron overlapped
    step])."""

    def __init__(self, wrapper: ChunkedOffloadOptimizer, group: Any, shards: list[torch.Tensor]) -> None:
        self._wrapper, self._group, self._shards = weakref.ref(wrapper), group, shards

    def __call__(self, force_sync: bool = False) -> None:
        group = self._group
        if _ranks(group) == 1:  # the all-gather of one rank's shard onto itself
            group.param_gather_dispatched, group.param_gather_handle = True, None
            if force_sync and group.ddp_config.overlap_param_gather:
                group._post_param_sync()
            return
        wrapper = self._wrapper()
        if wrapper is not None:
            wrapper.wait_step(self._shards)
        type(group).start_param_sync(group, force_sync=force_sync)


class _JoinFirst:
    """A model chunk's method that reads all of its params: it waits for the whole step first."""

    def __init__(self, wrapper: ChunkedOffloadOptimizer, method: Any) -> None:
        self._wrapper, self._method = weakref.ref(wrapper), method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        wrapper = self._wrapper()
        if wrapper is not None:
            wrapper.wait_step()
        return self._method(*args, **kwargs)


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
                shard = source.get(model_param, model_param).detach().view(-1)[where.start : where.end]
                view = _shard(self, model_param)
                if not torch.equal(shard.to(view.dtype), view):
                    raise ValueError(
                        "reload_model_params(state_dict): a tensor of the state dict does not round to its model "
                        f"param (shape {tuple(model_param.shape)}), and the wrapper keeps each param the rounding of "
                        "its fp32 master. Load the model params from the same checkpoint first, or call "
                        "reload_model_params() without a state dict"
                    )
                pairs.append((view, shard))
    for view, shard in pairs:
        _set_main(self.optimizer, view, shard)


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


def _shard(d: Any, model_param: torch.Tensor) -> torch.Tensor:
    group_index, group_order = d.model_param_group_index_map[model_param]
    return d.optimizer.param_groups[group_index]["params"][group_order]  # type: ignore[no-any-return]


def _get_states(self: Any, model_param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The default path's checkpoint tensors of ``model_param``'s shard: its fp32 main param and its state."""
    self.optimizer.synchronize()  # an overlapped step's chunks have written their state back
    view = _shard(self, model_param)
    tensors = {"param": view if view.dtype == torch.float32 else self.optimizer.master_of(view)}
    for key, value in self.optimizer.state[view].items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
    return tensors


def _set_states(self: Any, model_param: torch.Tensor, tensors: dict[str, Any]) -> None:
    """Load the default path's checkpoint tensors of ``model_param``'s shard into the wrapper."""
    view, wrapper = _shard(self, model_param), self.optimizer
    wrapper.synchronize()  # no chunk of an overlapped step writes back over what is loaded
    for key, value in tensors.items():
        # ``step`` comes from the checkpoint's param groups (Megatron's load_state_dict sets it before this runs).
        if not isinstance(value, torch.Tensor) or key == "step":
            continue
        if key == "param":
            _set_main(wrapper, view, value)
            continue
        entry = wrapper.state[view]
        if key in entry and entry[key].shape == value.shape and entry[key].dtype == value.dtype:
            entry[key].copy_(value)  # into its home
        else:
            entry[key] = value.detach().clone()  # placed in a home by the next step's re-plan
