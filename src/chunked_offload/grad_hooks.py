"""GradHooks: the post-accumulate-grad hooks through which the backward pass steps (``step_in_backward``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .callbacks import Call

__all__ = ["GradHooks"]

# Params stepped in the backward by a live wrapper (id -> the param, weakly, and that wrapper's hooks): a second
# wrapper would step them twice in each backward.
_STEPPED_IN_BACKWARD: dict[int, tuple[weakref.ref[torch.Tensor], GradHooks]] = {}


class Stepper(Protocol):
    """What the hooks call: the step runner, which also joins the step (``copy.deepcopy`` of a hook)."""

    def grad_final(self, param: torch.Tensor) -> None: ...

    def join(self) -> None: ...


def _grad_final(target: Stepper, param: torch.Tensor) -> None:
    target.grad_final(param)


class GradHooks:
    """A post-accumulate-grad hook on every param of the layout that requires grad ([Note: Step in backward]).

    Each holds the runtime weakly, so that params do not keep the wrapper alive. ``set`` replaces them after each
    new layout (``StepRunner``); ``remove`` takes them off (the wrapper's finalizer).
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def set(self, params: Sequence[torch.Tensor], runtime: Stepper) -> None:
        """Put the hooks on ``params``, instead of those on the previous ones; refuse params another wrapper steps."""
        for p in params:
            param, other = _STEPPED_IN_BACKWARD.get(id(p), (None, None))
            if other is not None and other is not self and param is not None and param() is p:
                raise ValueError(
                    f"a param (shape {tuple(p.shape)}) is already stepped in the backward by another live "
                    "ChunkedOffloadOptimizer (step_in_backward=True); both would step it. Drop the other wrapper "
                    "first, or wrap disjoint params"
                )
        self.remove()
        hook = Call(_grad_final, weakref.ref(runtime))
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
        for p in params:
            _STEPPED_IN_BACKWARD[id(p)] = (weakref.ref(p), self)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for key in [k for k, (_, owner) in _STEPPED_IN_BACKWARD.items() if owner is self]:
            del _STEPPED_IN_BACKWARD[key]
