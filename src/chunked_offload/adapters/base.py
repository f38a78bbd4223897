"""The Adapter contract: which state keys move, how lazily-created state looks, and group counters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..planner import Role, TensorSpec

__all__ = ["Adapter", "GroupCounters", "is_dense", "spec_of"]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` consecutive elements in some dimension order (no gaps, no overlap)."""
    if t.layout != torch.strided:
        return False
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def spec_of(key: str, t: torch.Tensor) -> TensorSpec:
    """The TensorSpec of an existing state tensor."""
    if not is_dense(t):
        raise ValueError(
            f"state tensor {key!r} with shape {tuple(t.shape)} and strides {tuple(t.stride())} is not dense; "
            "chunked offload keeps each state tensor as one dense block"
        )
    return TensorSpec(key, Role.STATE, tuple(t.shape), tuple(t.stride()), t.dtype)


class Adapter:
    """How the wrapper treats one family of inner optimizers.

    Subclasses say which state tensors the inner optimizer creates lazily for a parameter (so the host arena can be
    laid out before the first step) and refuse what cannot be chunked. Everything else is shared: a state value
    moves when it is a tensor with at least one dimension; 0-dim tensors (Adam's ``step``) and non-tensors stay
    where the inner optimizer put them (contract 5 in DESIGN.md).

    Args:
        inner: the wrapped optimizer.
    """

    name = "base"

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner

    def predict_state(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        """Specs of the state the inner optimizer will create for a tensor like ``stepped`` (a meta tensor)."""
        raise NotImplementedError

    def is_offloaded(self, key: str, value: object) -> bool:
        """Whether a state value moves to the host arena."""
        return isinstance(value, torch.Tensor) and value.dim() > 0

    def owns_masters(self) -> bool:
        """Whether the inner optimizer keeps fp32 masters itself (then the wrapper must not add its own)."""
        return False


def like(keys: Sequence[str], stepped: torch.Tensor) -> list[TensorSpec]:
    """Specs for state tensors created as ``torch.zeros_like(stepped)`` (or a clone of its grad)."""
    return [TensorSpec(k, Role.STATE, tuple(stepped.shape), tuple(stepped.stride()), stepped.dtype) for k in keys]


class KeyedAdapter(Adapter):
    """An adapter whose lazily-created state is a list of keys shaped like the stepped tensor.

    Args:
        inner: the wrapped optimizer.
        keys_for_group: the state keys the inner optimizer creates, given a param group's hyperparameters.
        name: adapter name, for messages.
    """

    def __init__(
        self, inner: torch.optim.Optimizer, keys_for_group: Callable[[dict[str, Any]], list[str]], name: str
    ) -> None:
        super().__init__(inner)
        self._keys_for_group = keys_for_group
        self.name = name

    def predict_state(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        return like(self._keys_for_group(group), stepped)


class GroupCounters:
    """Keeps group-level values (Transformer Engine's ``group["step"]``, ...) advancing once per outer step.

    The inner optimizer's step runs once per chunk. Before every chunk the groups are restored to their values at
    the start of the outer step; after a chunk, each group that had params in it remembers its values; at the end
    every group gets the values from the last chunk that stepped it.

    Args:
        groups: the inner optimizer's ``param_groups``.
    """

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self._groups = groups
        self._start = [self._snapshot(g) for g in groups]
        self._final: list[dict[str, Any] | None] = [None] * len(groups)

    @staticmethod
    def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    @staticmethod
    def _restore(group: dict[str, Any], values: dict[str, Any]) -> None:
        for k in [k for k in group if k != "params" and k not in values]:
            del group[k]
        group.update(values)

    def before_chunk(self) -> None:
        for group, values in zip(self._groups, self._start, strict=True):
            self._restore(group, values)

    def after_chunk(self, stepped_groups: Sequence[int]) -> None:
        for gi in stepped_groups:
            self._final[gi] = self._snapshot(self._groups[gi])

    def finish(self) -> None:
        for gi, group in enumerate(self._groups):
            final = self._final[gi]
            self._restore(group, final if final is not None else self._start[gi])
