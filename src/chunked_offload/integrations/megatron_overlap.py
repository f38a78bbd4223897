"""Megatron-Core with ``overlap=True``: Megatron's readers of the param buffer wait for the chunks they read."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..optimizer import ChunkedOffloadOptimizer

__all__ = ["bucket_groups", "gate", "ranks", "shard"]

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
# The step reads the grads in place, in Megatron's grad buffer ([Note: Inputs of a step]): no copy of them lives
# beside the next forward. Megatron writes them once before that forward's end, in ``zero_grad_buffer()`` as the
# iteration starts: each buffer's reset is held until the step is joined (the model chunk's forward end, or the next
# ``prepare_grads()``, Megatron's first read of them), and any other write to them before then is refused there.
# ``offload_grad_buffers()`` (the RL path frees the grad buffer) joins the step first.


def bucket_groups(d: Any) -> list[Any]:
    """The bucket groups of ``d``'s model chunks."""
    return [
        group
        for chunk in d.model_chunks
        for group in [*chunk.bucket_groups, *getattr(chunk, "expert_parallel_bucket_groups", [])]
    ]


def ranks(group: Any) -> int:
    return int(group.intra_distributed_optimizer_instance_size)


def gate(d: Any) -> None:
    """Order Megatron's readers of the param buffer after the chunks they read ([Note: Megatron overlapped step])."""
    wrapper = d.optimizer
    views = {p: shard(d, p) for p in d.model_param_group_index_map}
    for chunk in d.model_chunks:
        held = {p: views[p] for p in chunk.parameters() if p in views}
        if held:
            handle = wrapper.attach(chunk, views=held)
            for name in ("parameters", "named_parameters", "state_dict", "sharded_state_dict", "offload_grad_buffers"):
                setattr(chunk, name, _JoinFirst(wrapper, getattr(chunk, name)))
            for buffer in [*chunk.buffers, *getattr(chunk, "expert_parallel_buffers", [])]:
                buffer.reset = handle.zero_grads_with(buffer.reset)  # another wrapper's, where it holds one too
    d.prepare_grads = _JoinFirst(wrapper, d.prepare_grads)  # its first read of the grads
    for group in bucket_groups(d):
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
        if ranks(group) == 1:  # the all-gather of one rank's shard onto itself
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


def shard(d: Any, model_param: torch.Tensor) -> torch.Tensor:
    """The tensor ``d``'s inner optimizer steps for ``model_param``: its shard of the param buffer."""
    group_index, group_order = d.model_param_group_index_map[model_param]
    return d.optimizer.param_groups[group_index]["params"][group_order]  # type: ignore[no-any-return]
