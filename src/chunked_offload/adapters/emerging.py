"""NVIDIA Emerging-Optimizers: the orthogonalized Muon."""

from __future__ import annotations

import torch

from .base import Adapter, KeyedAdapter

__all__ = ["emerging_adapter"]


def emerging_adapter(inner: torch.optim.Optimizer) -> Adapter | None:
    """The adapter for ``emerging_optimizers`` Muon (exact class), without importing the package; else None.

    Its state is one ``momentum_buffer`` per (2-D) param, created when the param's state is empty. Chunks hold
    whole matrices, so the Newton-Schulz orthogonalization sees exactly what it sees unwrapped. Under ``"l2"``
    weight decay it adds the decay into ``p.grad`` in place, as it does unwrapped.
    """
    cls = type(inner)
    if cls.__name__ == "Muon" and cls.__module__.startswith("emerging_optimizers."):
        return KeyedAdapter(
            inner, lambda group: ["momentum_buffer"], "emerging_optimizers.Muon", strict=True, whole_params=True
        )
    return None
