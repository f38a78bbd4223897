"""FSDP2 units: the params each ``fully_shard`` unit all-gathers, and a hook that runs before every all-gather.

The FSDP2 names this library relies on that torch does not document (``_get_fsdp_state``, ``_fsdp_param_group(s)``,
``fsdp_params``, ``sharded_param``, ``comm_ctx``, ``FSDPParamGroup.unshard``) are read here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Unit", "UnshardHook", "all_gather_streams", "params_of", "units"]

# [Note: FSDP2 reads deferred params]
# An FSDP2 unit reads its sharded params when it unshards them (``FSDPParamGroup.unshard``, then ``wait_for_unshard``):
# - where: at world size 1 the copy into the unsharded params runs on the stream that calls ``wait_for_unshard`` (the
#   caller's); at world size > 1 the copy-in runs on the all-gather copy-in stream (or, with ``async_op``, the
#   current stream), and the all-gather on the all-gather stream;
# - when: in the unit's forward pre-hook, but also earlier: a unit of several modules (``fully_shard([norm,
#   output])``, as torchtitan wraps its head) unshards all of them when the first one's forward starts; an explicit
#   forward prefetch (``set_modules_to_forward_prefetch``) unshards the next unit in this unit's pre-hook; the
#   backward unshards again (``reshard_after_forward=True``, activation checkpointing) and prefetches; a user may call
#   ``unshard()`` at any time.
# So a forward pre-hook on the unit's modules is too late or too narrow (it raced in torchtitan: the head's params were
# copied in the norm's pre-hook, before the head's own gate). Instead ``attach()`` hooks the unshard itself: before
# every ``unshard()`` of a unit's param group, its hook enqueues the deferred chunks of the group's params and makes
# the current stream and the group's all-gather streams wait for their updates. Every reader of the sharded params
# is then ordered after the update, whichever hook, prefetch or user call started the unshard. The modules inside a
# unit gate only the params FSDP2 does not manage (``ignored_params``).


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit (the state of one ``fully_shard`` call).

    Attributes:
        modules: the modules it was applied to (several for ``fully_shard([a, b])``).
        groups: its param groups, whose ``unshard`` reads their params (``params_of``).
    """

    modules: tuple[torch.nn.Module, ...]
    groups: list[Any]


def units(model: torch.nn.Module) -> list[Unit]:
    """The FSDP2 units of ``model``, in ``model.modules()`` order (none without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return []
    found: dict[int, Unit] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) not in found:
            groups = _groups(state)
            found[id(state)] = Unit(tuple(getattr(state, "_modules", (module,))), groups)
    return list(found.values())


def _groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a unit may hold several
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def params_of(group: Any) -> list[torch.Tensor]:
    """The sharded params a param group's all-gathers read (the module's params outside forward and backward)."""
    return [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]


def all_gather_streams(group: Any) -> list[torch.cuda.Stream]:
    """The group's all-gather streams (made at the root's first forward), which read its shards beside the forward."""
    context = getattr(group, "comm_ctx", None)
    names = ("all_gather_copy_in_stream", "all_gather_stream")
    return [s for s in (getattr(context, n, None) for n in names) if isinstance(s, torch.cuda.Stream)]


class _Unshard:
    """What a hooked group's ``unshard`` is: its hooks, then the class's own ``unshard``."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.hooks: list[Callable[[], None]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in list(self.hooks):
            hook()
        return type(self.group).unshard(self.group, *args, **kwargs)


class UnshardHook:
    """Runs ``hook`` before every ``unshard()`` of ``group`` ([Note: FSDP2 reads deferred params]); ``remove()`` takes
    it off, and the group's own method back once no hook is left."""

    def __init__(self, group: Any, hook: Callable[[], None]) -> None:
        shim = group.__dict__.get("unshard")
        if not isinstance(shim, _Unshard):
            shim = _Unshard(group)
            group.unshard = shim  # an instance attribute: FSDP2 calls ``group.unshard(...)`` and finds it first
        shim.hooks.append(hook)
        self._group, self._hook = group, hook

    def remove(self) -> None:
        shim = self._group.__dict__.get("unshard")
        if isinstance(shim, _Unshard) and self._hook in shim.hooks:
            shim.hooks.remove(self._hook)
            if not shim.hooks:
                del self._group.unshard
