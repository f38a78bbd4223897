"""Adapters for torch.optim: explicit layouts for the common families, a probing adapter for the rest."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..planner import TensorSpec
from .base import Adapter, KeyedAdapter, spec_of

__all__ = ["GenericAdapter", "torch_adapter"]

logger = logging.getLogger(__name__)


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


def _adagrad_keys(group: dict[str, Any]) -> list[str]:
    return ["sum"]


def _muon_keys(group: dict[str, Any]) -> list[str]:
    return ["momentum_buffer"]


def _known() -> list[tuple[type, Any, str]]:
    table: list[tuple[type, Any, str]] = [
        (torch.optim.AdamW, _adam_keys, "torch.AdamW"),
        (torch.optim.Adam, _adam_keys, "torch.Adam"),
        (torch.optim.SGD, _sgd_keys, "torch.SGD"),
        (torch.optim.RMSprop, _rmsprop_keys, "torch.RMSprop"),
        (torch.optim.Adagrad, _adagrad_keys, "torch.Adagrad"),
    ]
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None:
        table.append((muon, _muon_keys, "torch.Muon"))
    return table


def torch_adapter(inner: torch.optim.Optimizer) -> Adapter | None:
    """The explicit adapter for a torch.optim family (exact class match), or None."""
    for cls, keys, name in _known():
        if type(inner) is cls:
            return KeyedAdapter(inner, keys, name)
    return None


class GenericAdapter(Adapter):
    """Any per-parameter optimizer: the state layout is found by stepping a probe.

    For each distinct (shape, strides, dtype, hyperparameters) a fresh instance of the inner optimizer's class,
    built with the group's hyperparameters over one CPU tensor of that shape, takes one step; the state it creates
    is the layout. This assumes the update of each parameter depends on that parameter alone, which the wrapper
    cannot check: optimizers with cross-parameter reductions must not use it (see adapters/__init__.py).
    """

    name = "generic"

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__(inner)
        self._cache: dict[tuple[Any, ...], list[TensorSpec]] = {}

    def predict_state(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        hparams = {k: v for k, v in group.items() if k != "params"}
        key = (tuple(stepped.shape), tuple(stepped.stride()), stepped.dtype, repr(sorted(hparams.items())))
        if key not in self._cache:
            self._cache[key] = self._probe(stepped, hparams)
        return self._cache[key]

    def _probe(self, stepped: torch.Tensor, hparams: dict[str, Any]) -> list[TensorSpec]:
        cls: Any = type(self.inner)
        probe_param = torch.zeros_like(stepped, device="cpu")
        probe_param.grad = torch.full_like(probe_param, 1e-3)
        try:
            probe = cls([{"params": [probe_param], **hparams}])
            probe.step()
        except Exception as exc:
            raise TypeError(
                f"cannot infer the state layout of {cls.__module__}.{cls.__qualname__}: one step of a fresh "
                f"instance on a CPU tensor of shape {tuple(stepped.shape)} failed ({type(exc).__name__}: {exc}). "
                "Pass adapter=<an Adapter subclass instance> that predicts its state"
            ) from exc
        return [spec_of(k, v) for k, v in probe.state[probe_param].items() if self.is_offloaded(k, v)]
