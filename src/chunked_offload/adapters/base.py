"""The Adapter contract: which state keys move, how lazily-created state looks, what the inner can do."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from ..planner import Role, TensorSpec, dense_spec
from ..specs import is_dense

__all__ = ["Adapter", "KeyedAdapter", "hparams_signature", "is_dense", "spec_of"]


def spec_of(key: str, t: torch.Tensor) -> TensorSpec:
    """The TensorSpec of a home for an existing state tensor: its layout where dense, else contiguous."""
    return dense_spec(key, Role.STATE, t, t.dtype)


def hparams_signature(group: dict[str, Any]) -> Hashable:
    """A hashable summary of a param group's hyperparameters (tensors by dtype and shape, not value)."""

    def norm(v: Any) -> Hashable:
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, tuple(v.shape))
        if isinstance(v, (list, tuple)):
            return tuple(norm(x) for x in v)
        try:
            hash(v)
        except TypeError:
            return repr(v)
        return v  # type: ignore[no-any-return]

    return tuple(sorted((k, norm(v)) for k, v in group.items() if k != "params"))


class Adapter:
    """How the wrapper treats one family of inner optimizers.

    Subclasses say which state tensors the inner optimizer creates lazily for a parameter (so the host arena can be
    laid out before the first step) and refuse what cannot be chunked. Everything else is shared: a state value
    moves when it is a tensor with at least one dimension; 0-dim tensors (Adam's ``step``, the moments of a 0-dim
    param) and non-tensors stay where the inner optimizer put them (the contract "small scalar state stays where the
    inner expects it").

    Args:
        inner: the wrapped optimizer.
    """

    name = "base"
    #: Existing state that does not match :meth:`predict_state` (a missing required key, another shape or dtype)
    #: makes the inner optimizer fail; the wrapper then refuses the step before anything is modified.
    strict = False
    #: The update of a param needs the whole param (Muon orthogonalizes whole matrices): DTensor params sharded by
    #: FSDP2 are refused, unless the inner optimizer gathers them itself (then set this False).
    whole_params = False
    #: The attribute of a param the inner optimizer reads its gradient from (Transformer Engine can read
    #: ``decoupled_grad``); a deferred chunk puts the step's grads back there ([Note: Deferred chunks]).
    grad_attr = "grad"

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.one_op_refuted = False  # a step updated a chunk in more than one op ([Note: One-op updates])

    def updates_in_one_op(self, group: dict[str, Any]) -> bool:
        """Whether the inner's step updates a group's params and state in one op per device and dtype, after all of
        its checks, so that a resident chunk needs no copy to be rolled back ([Note: One-op updates] in
        stepping.py). Never again once a step has shown otherwise."""
        return not self.one_op_refuted and self._one_op(group)

    def _one_op(self, group: dict[str, Any]) -> bool:
        return False

    def watching(self, watch: Any) -> contextlib.AbstractContextManager[Any]:
        """Around a one-op chunk's inner step: report to ``watch`` (``transaction.UpdateWatch.kernel``) each call of
        a kernel that the dispatcher does not see (an extension's); default: none."""
        return contextlib.nullcontext()

    def predict_state(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        """Specs of the state that moves for a tensor like ``stepped`` (a meta tensor); 0-dim state excluded."""
        return [s for s in self._predict(stepped, group) if s.dim > 0]

    def _predict(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        raise NotImplementedError

    def layout_signature(self, group: dict[str, Any]) -> Hashable:
        """Changes whenever :meth:`predict_state` may change for this group (a hyperparameter that adds state)."""
        return hparams_signature(group)

    def lazy_keys(self, group: dict[str, Any]) -> frozenset[str]:
        """Predicted keys the inner optimizer creates on any step when they are missing (SGD's momentum buffer)."""
        return frozenset()

    def is_offloaded(self, key: str, value: object) -> bool:
        """Whether a state value moves to the host arena."""
        return isinstance(value, torch.Tensor) and value.dim() > 0

    def owns_masters(self) -> bool:
        """Whether the inner optimizer keeps fp32 masters itself (then the wrapper must not add its own)."""
        return False

    def check_config(self) -> None:
        """Refuse inner-optimizer settings that cannot be chunked (raise TypeError / ValueError)."""

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the inner optimizer reads for ``param``."""
        grad: torch.Tensor | None = getattr(param, self.grad_attr, None)
        return grad

    def verify_bound(self, params: Sequence[torch.Tensor], state: Mapping[torch.Tensor, Any]) -> None:
        """Check the state of a chunk's params right before the inner step (after binding the device views)."""

    def after_load(self, params: Sequence[torch.Tensor]) -> None:
        """Called after ``load_state_dict`` installed state for ``params`` without the inner's own load."""

    def to_checkpoint(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """A state tensor as the inner optimizer's own ``state_dict()`` would return it (default: as it is)."""
        return value

    def from_checkpoint(self, key: str, value: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """A checkpoint's state tensor as the inner optimizer keeps it while stepping (default: as it is)."""
        return value

    def begin_step(self, stepped_dtype: Callable[[torch.Tensor], torch.dtype]) -> None:
        """Called once per outer step before any chunk: decide what the inner optimizer decides per group."""

    def couples(self, group_index: int) -> bool:
        """Whether, in this step, the update of a param of the group may depend on which of its other params have
        grads (torch SGD's group-wide choice of code path). A step in the backward steps such a group's chunks once
        every grad is final, after :meth:`grads_final` ([Note: Coupled params] in in_backward.py)."""
        return False

    def grads_final(self, stepped_dtype: Callable[[torch.Tensor], torch.dtype]) -> None:
        """A step in the backward: every grad is final; decide again for the groups that :meth:`couples`."""

    def workspace_nbytes(self, stepped: Sequence[tuple[dict[str, Any], int]]) -> int:
        """Device bytes the inner's own step takes beside its state, at most, for a chunk of params stepped as
        ``(group, bytes of the stepped tensor)`` ([Note: Window bound]).

        Fused kernels take none. Otherwise the estimate is twice the chunk's stepped bytes: torch's foreach Adam makes
        one temporary the size of the chunk's params, its for-loop one makes two the size of one param. An inner
        that orthogonalizes whole matrices (Muon) takes a few matrices' worth per param, one param at a time.
        """
        if all(group.get("fused") for group, _ in stepped):
            return 0
        if self.whole_params:
            return 4 * max((nbytes for _, nbytes in stepped), default=0)
        return 2 * sum(nbytes for _, nbytes in stepped)

    def extra_params(self, group_index: int, chunk_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Throwaway params to add to one group of one chunk's call so that it takes the whole group's code path.

        Their state is dropped after the chunk. The default adds none.
        """
        return []


def like(keys: Sequence[str], stepped: torch.Tensor) -> list[TensorSpec]:
    """Specs for state tensors created as ``torch.zeros_like(stepped)`` (or a clone of its grad)."""
    return [dense_spec(k, Role.STATE, stepped, stepped.dtype) for k in keys]


class KeyedAdapter(Adapter):
    """An adapter whose lazily-created state is a list of keys shaped like the stepped tensor.

    Args:
        inner: the wrapped optimizer.
        keys_for_group: the state keys the inner optimizer creates, given a param group's hyperparameters.
        name: adapter name, for messages.
        lazy: keys the inner optimizer creates whenever they are missing, even in a non-empty state entry.
        strict: whether existing state must match the prediction (see :attr:`Adapter.strict`).
        whole_params: whether the update needs whole params (see :attr:`Adapter.whole_params`).
        one_op: which groups the inner updates in one op (see :meth:`Adapter.updates_in_one_op`); None: none.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        keys_for_group: Callable[[dict[str, Any]], list[str]],
        name: str,
        *,
        lazy: Sequence[str] = (),
        strict: bool = False,
        whole_params: bool = False,
        one_op: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        super().__init__(inner)
        self._keys_for_group = keys_for_group
        self._one_op_groups = one_op
        self._lazy = frozenset(lazy)
        self.name = name
        self.strict = strict
        self.whole_params = whole_params

    def _predict(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        return like(self._keys_for_group(group), stepped)

    def layout_signature(self, group: dict[str, Any]) -> Hashable:
        return tuple(self._keys_for_group(group))

    def lazy_keys(self, group: dict[str, Any]) -> frozenset[str]:
        return self._lazy

    def _one_op(self, group: dict[str, Any]) -> bool:
        return self._one_op_groups is not None and self._one_op_groups(group)
