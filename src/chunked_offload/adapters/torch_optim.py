"""Explicit adapters for every per-parameter optimizer in torch.optim."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..planner import Role, TensorSpec, dense_spec
from .base import Adapter, KeyedAdapter

__all__ = ["AdafactorAdapter", "SGDAdapter", "torch_adapter"]


def _adam_keys(group: dict[str, Any]) -> list[str]:
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad", False) else [])


def _sgd_keys(group: dict[str, Any]) -> list[str]:
    return ["momentum_buffer"] if group.get("momentum", 0) != 0 else []


def _rmsprop_keys(group: dict[str, Any]) -> list[str]:
    keys = ["square_avg"]
    if group.get("momentum", 0) > 0:
        keys.append("momentum_buffer")
    if group.get("centered", False):
        keys.append("grad_avg")
    return keys


def _fused(group: dict[str, Any]) -> bool:
    """torch's fused Adam and AdamW check everything, then update each device and dtype in one op."""
    return bool(group.get("fused"))


def _fixed(*keys: str) -> Callable[[dict[str, Any]], list[str]]:
    return lambda group: list(keys)


class SGDAdapter(KeyedAdapter):
    """torch.optim.SGD: a momentum buffer, created lazily, and torch's group-wide choice of code path.

    With ``foreach``, torch updates the momentum buffers of a (device, dtype) group with ``_foreach`` kernels only
    when every param of the call has one; if any is missing (its first grad came late) the whole group takes the
    per-tensor path, which rounds differently in bf16. Chunking splits the call, so each chunk's call gets a
    throwaway param without a buffer wherever the whole group would have taken the per-tensor path. Fused SGD
    raises when buffers are mixed; the wrapper raises the same error before anything is modified. Where some params
    of such a group have a buffer and some do not, the choice depends on grads a step in the backward has not seen
    yet: the group :meth:`couples` ([Note: Coupled params] in in_backward.py).
    """

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__(inner, _sgd_keys, "torch.SGD", lazy=["momentum_buffer"], strict=True)
        self._per_tensor: set[tuple[int, torch.dtype, torch.device]] = set()
        self._coupled: set[int] = set()

    def begin_step(self, stepped_dtype: Callable[[torch.Tensor], torch.dtype]) -> None:
        self._per_tensor, self._coupled = set(), set()
        for gi, group in enumerate(self.inner.param_groups):
            if group.get("momentum", 0) == 0:
                continue
            missing, present = self._buffers(group, stepped_dtype, lambda p: p.requires_grad)
            if missing & present and (group.get("fused") or self._uses_foreach(group, group["params"])):
                self._coupled.add(gi)  # a param without a buffer may yet get its first grad in this step
            self._decide(gi, group, stepped_dtype)

    def couples(self, group_index: int) -> bool:
        return group_index in self._coupled

    def grads_final(self, stepped_dtype: Callable[[torch.Tensor], torch.dtype]) -> None:
        for gi in self._coupled:
            self._decide(gi, self.inner.param_groups[gi], stepped_dtype)

    def _decide(self, gi: int, group: dict[str, Any], stepped_dtype: Callable[[torch.Tensor], torch.dtype]) -> None:
        """The group's path per (dtype, device), from the params that have grads now."""
        missing, present = self._buffers(group, stepped_dtype, lambda p: p.grad is not None)
        if group.get("fused") and missing and present:
            raise TypeError(
                f"fused SGD cannot step param group {gi}: some of its params have a momentum buffer and some do "
                "not (their first grad came late), and torch's fused kernel raises on that mix; plain torch "
                "fails here too. Use foreach=True, or give every param a grad on the first step"
            )
        self._per_tensor = {k for k in self._per_tensor if k[0] != gi} | {(gi, *key) for key in missing}

    def _buffers(
        self,
        group: dict[str, Any],
        stepped_dtype: Callable[[torch.Tensor], torch.dtype],
        counted: Callable[[torch.Tensor], bool],
    ) -> tuple[set[tuple[torch.dtype, torch.device]], set[tuple[torch.dtype, torch.device]]]:
        """The (dtype, device) keys of the ``counted`` params without a momentum buffer, and of those with one."""
        missing: set[tuple[torch.dtype, torch.device]] = set()
        present: set[tuple[torch.dtype, torch.device]] = set()
        for p in group["params"]:
            if counted(p):
                entry = self.inner.state.get(p)
                has = entry is not None and entry.get("momentum_buffer") is not None
                (present if has else missing).add((stepped_dtype(p), p.device))
        return missing, present

    def extra_params(self, group_index: int, chunk_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        group = self.inner.param_groups[group_index]
        if group.get("momentum", 0) == 0 or group.get("fused") or not self._uses_foreach(group, chunk_params):
            return []
        state = self.inner.state
        extras = []
        keys = {(p.dtype, p.device) for p in chunk_params if p.grad is not None}
        for dtype, device in sorted(keys, key=str):
            if (group_index, dtype, device) not in self._per_tensor:
                continue
            group_params = [p for p in chunk_params if p.grad is not None and (p.dtype, p.device) == (dtype, device)]
            if all((state.get(p) or {}).get("momentum_buffer") is not None for p in group_params):
                dummy = torch.zeros(1, dtype=dtype, device=device)
                dummy.grad = torch.zeros(1, dtype=dtype, device=device)
                extras.append(dummy)
        return extras

    @staticmethod
    def _uses_foreach(group: dict[str, Any], params: Sequence[torch.Tensor]) -> bool:
        foreach = group.get("foreach")
        if foreach is None:
            from torch.optim.optimizer import _default_to_fused_or_foreach

            _, foreach = _default_to_fused_or_foreach(list(params), group.get("differentiable", False), False)
        return bool(foreach)


class AdafactorAdapter(Adapter):
    """torch.optim.Adafactor: factored second moments (a row and a column vector) for params of 2+ dims."""

    name = "torch.Adafactor"
    strict = True

    def _predict(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        if stepped.dim() <= 1:
            return [dense_spec("variance", Role.STATE, stepped, stepped.dtype)]
        shape = tuple(stepped.shape)
        row, col = shape[:-1] + (1,), shape[:-2] + (1,) + shape[-1:]
        return [_contiguous("row_var", row, stepped.dtype), _contiguous("col_var", col, stepped.dtype)]

    def layout_signature(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("variance", "row_var", "col_var")


def _contiguous(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
    stride = tuple(torch.empty(shape, device="meta").stride())
    return TensorSpec(key, Role.STATE, shape, stride, dtype)


def _known() -> list[tuple[type, Callable[[torch.optim.Optimizer], Adapter]]]:
    def keyed(keys: Callable[[dict[str, Any]], list[str]], name: str, **kw: Any) -> Callable[..., Adapter]:
        return lambda inner: KeyedAdapter(inner, keys, name, strict=True, **kw)

    optim = torch.optim
    table: list[tuple[type, Callable[[torch.optim.Optimizer], Adapter]]] = [
        (optim.AdamW, keyed(_adam_keys, "torch.AdamW", one_op=_fused)),
        (optim.Adam, keyed(_adam_keys, "torch.Adam", one_op=_fused)),
        (optim.SGD, SGDAdapter),
        (optim.RMSprop, keyed(_rmsprop_keys, "torch.RMSprop")),
        (optim.Adagrad, keyed(_fixed("sum"), "torch.Adagrad")),
        (optim.NAdam, keyed(_fixed("exp_avg", "exp_avg_sq"), "torch.NAdam")),
        (optim.RAdam, keyed(_fixed("exp_avg", "exp_avg_sq"), "torch.RAdam")),
        (optim.Adamax, keyed(_fixed("exp_avg", "exp_inf"), "torch.Adamax")),
        (optim.ASGD, keyed(_fixed("ax"), "torch.ASGD")),
        (optim.Rprop, keyed(_fixed("prev", "step_size"), "torch.Rprop")),
        (optim.Adadelta, keyed(_fixed("square_avg", "acc_delta"), "torch.Adadelta")),
    ]
    if hasattr(optim, "Adafactor"):
        table.append((optim.Adafactor, AdafactorAdapter))
    if hasattr(optim, "Muon"):
        muon = keyed(_fixed("momentum_buffer"), "torch.Muon", lazy=["momentum_buffer"], whole_params=True)
        table.append((optim.Muon, muon))
    return table


def torch_adapter(inner: torch.optim.Optimizer) -> Adapter | None:
    """The explicit adapter for a torch.optim optimizer (exact class match), or None."""
    for cls, make in _known():
        if type(inner) is cls:
            return make(inner)
    return None
