"""GenericAdapter: find the state layout of an unknown per-parameter optimizer by stepping a throwaway instance."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import torch

from ..planner import Role, TensorSpec, dense_spec
from .base import Adapter, hparams_signature

__all__ = ["GenericAdapter", "forget_probes"]

# Probe results per (optimizer class, ndim, dtype, device type, hyperparameters): every wrapper of that class
# shares them, so each configuration is stepped once per process.
_PROBES: dict[Hashable, list[tuple[str, torch.dtype]]] = {}

# Attributes every torch.optim.Optimizer has; anything else that holds per-parameter data is foreign state.
_OPTIMIZER_ATTRS = {"state", "param_groups", "defaults"}


class GenericAdapter(Adapter):
    """Any per-parameter optimizer whose state is shaped like its param: the layout is found by a probe.

    [Note: Probing]
    For each distinct (ndim, dtype, hyperparameters) a fresh instance of the inner optimizer's class, built with
    the group's hyperparameters over one small throwaway parameter **on the params' own device**, takes one step.
    The probe is never given a host tensor when the params live on a GPU: CUDA-only optimizers (Transformer
    Engine, apex) read raw pointers, and a host pointer there is an illegal memory access that breaks the whole
    CUDA context. What the probe creates is accepted only if it can be mapped to any param without guessing:

    - every state tensor with at least one dimension is shaped like the param (its dtype may differ);
    - no two state tensors share memory, and none shares memory with the optimizer's other attributes
      (bitsandbytes' shared quantization maps);
    - nothing keyed by the param lives outside ``state`` (Transformer Engine's ``_scales`` for fp16/fp8 moments).

    Anything else is refused with an error that asks for an explicit adapter. This assumes that each parameter's
    update depends on that parameter alone, which no probe can check: optimizers with cross-parameter reductions
    must not use it (see adapters/__init__.py).

    Args:
        inner: the wrapped optimizer.
        device: where to probe; by default the device of the inner optimizer's first param.
    """

    name = "generic"

    def __init__(self, inner: torch.optim.Optimizer, device: torch.device | None = None) -> None:
        super().__init__(inner)
        if device is None:
            params = [p for g in inner.param_groups for p in g["params"]]
            device = params[0].device if params else torch.device("cpu")
        self.device = device

    def _predict(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        hparams = {k: v for k, v in group.items() if k != "params"}
        cls = type(self.inner)
        key = (cls, stepped.dim(), stepped.dtype, self.device.type, hparams_signature(group))
        if key not in _PROBES:
            _PROBES[key] = _probe(cls, stepped, hparams, self.device)
        return [dense_spec(k, Role.STATE, stepped, dtype) for k, dtype in _PROBES[key]]


def forget_probes() -> None:
    """Drop every cached probe result (each configuration is probed again on its next use)."""
    _PROBES.clear()


def _probe(cls: Any, stepped: torch.Tensor, hparams: dict[str, Any], device: torch.device) -> list[tuple[str, Any]]:
    shape = tuple(min(size, 3) for size in stepped.shape)
    what = f"{cls.__module__}.{cls.__qualname__}"
    advice = "Pass adapter=<an Adapter subclass instance> that predicts its state (docs/adapters.md)"
    param = torch.nn.Parameter(torch.zeros(shape, dtype=stepped.dtype, device=device))
    param.grad = torch.full_like(param, 1e-3)
    try:
        probe = cls([{**hparams, "params": [param]}])
        probe.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an asynchronous kernel error is reported here, against the probe
    except Exception as exc:
        raise TypeError(
            f"cannot infer the state layout of {what}: one step of a fresh instance on a {device.type} tensor of "
            f"shape {shape} and dtype {stepped.dtype} failed ({type(exc).__name__}: {exc}). {advice}"
        ) from exc

    entry = probe.state.get(param, {})
    found: list[tuple[str, Any]] = []
    seen: dict[int, str] = {}
    for k, v in entry.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        if tuple(v.shape) != shape:
            raise TypeError(
                f"{what} keeps state {k!r} of shape {tuple(v.shape)} for a param of shape {shape}; the generic "
                f"adapter only maps state shaped like its param. {advice}"
            )
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            raise TypeError(f"{what} keeps states {seen[ptr]!r} and {k!r} in shared memory. {advice}")
        seen[ptr] = k
        found.append((k, v.dtype))
    for name, value in vars(probe).items():
        if name in _OPTIMIZER_ATTRS or name.startswith("_optimizer_"):
            continue
        if isinstance(value, Mapping) and any(key is param for key in value):
            raise TypeError(
                f"{what} keeps per-parameter data outside `state` (attribute {name!r}), which offloading would not "
                f"move with the param. {advice}"
            )
        for t in _tensors(value):
            if t.dim() > 0 and t.untyped_storage().data_ptr() in seen:
                raise TypeError(
                    f"{what} keeps state {seen[t.untyped_storage().data_ptr()]!r} in memory it shares with its "
                    f"attribute {name!r}. {advice}"
                )
    return found


def _tensors(value: Any, depth: int = 2) -> Iterator[torch.Tensor]:
    """Tensors reachable from an attribute value through a few levels of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v, depth - 1)
    elif depth > 0 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth - 1)
