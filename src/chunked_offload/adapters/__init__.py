"""Adapters: one per inner-optimizer family, chosen by ``resolve_adapter``."""

from __future__ import annotations

import torch

from ..notices import warn
from .base import Adapter, KeyedAdapter, hparams_signature, is_dense, spec_of
from .emerging import emerging_adapter
from .generic import GenericAdapter
from .torch_optim import torch_adapter
from .transformer_engine import TEFusedAdamAdapter, is_te_fused_adam

__all__ = [
    "Adapter",
    "GenericAdapter",
    "KeyedAdapter",
    "TEFusedAdamAdapter",
    "check_groups",
    "hparams_signature",
    "is_dense",
    "refusal_reason",
    "resolve_adapter",
    "spec_of",
]

# (substring of the lower-cased class name, why it cannot be chunked): the contract "refuse what cannot be chunked".
_REFUSED_NAMES = [
    ("lbfgs", "it keeps one history over the flattened gradient of every parameter and re-evaluates closures"),
    ("sparseadam", "it needs sparse gradients, which cannot be staged as dense chunks"),
    ("lamb", "LAMB-style optimizers reduce a global gradient norm over all parameters before updating any"),
    ("lars", "LARS-style optimizers compute trust ratios from norms that span the whole model"),
    ("novograd", "NovoGrad keeps per-layer norms computed over all parameters before the update"),
    ("paged", "paged optimizers keep their state in managed memory that the driver moves on its own"),
    ("zeroredundancy", "it shards state across ranks and broadcasts parameters inside step()"),
    ("distributed", "distributed optimizers shard parameters or matrices across ranks inside step()"),
]


def refusal_reason(inner: torch.optim.Optimizer) -> str | None:
    """Why ``inner`` cannot be stepped chunk by chunk, or None if it can."""
    name = type(inner).__name__.lower()
    for needle, why in _REFUSED_NAMES:
        if needle in name:
            return why
    if getattr(inner, "is_paged", False):
        return _REFUSED_NAMES[5][1]
    return None


def check_groups(inner: torch.optim.Optimizer) -> None:
    """Refuse group settings that no adapter can chunk; raise before anything is modified.

    Raises:
        ValueError: ``differentiable=True`` (the update is part of an autograd graph across all params).
    """
    for gi, group in enumerate(inner.param_groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"param group {gi} has differentiable=True: a differentiable step builds one autograd graph "
                "through the update of every parameter, and chunked offload swaps the state tensors under it. "
                "Use differentiable=False (the default)"
            )


def resolve_adapter(inner: torch.optim.Optimizer, adapter: Adapter | None = None) -> Adapter:
    """The adapter for ``inner``: the one given, an explicit adapter, or the probing generic adapter.

    Raises:
        TypeError: ``inner`` cannot be chunked correctly.
    """
    cls = type(inner)
    why = refusal_reason(inner)
    if why is not None:
        raise TypeError(
            f"ChunkedOffloadOptimizer cannot wrap {cls.__module__}.{cls.__qualname__}: {why}. Only optimizers whose "
            "update of each parameter depends on that parameter alone can be stepped chunk by chunk"
        )
    if adapter is not None:
        if not isinstance(adapter, Adapter):
            raise TypeError(f"adapter must be an Adapter instance, got {type(adapter).__name__}")
        if adapter.inner is not inner:
            raise ValueError("adapter was built for a different optimizer instance than the one being wrapped")
        return adapter
    explicit = torch_adapter(inner) or emerging_adapter(inner)
    if explicit is not None:
        return explicit
    if is_te_fused_adam(inner):
        return TEFusedAdamAdapter(inner)
    warn(
        f"no explicit adapter for {cls.__module__}.{cls.__qualname__}; assuming a per-parameter update and probing "
        "its state layout. Pass adapter=... to make this explicit (docs/adapters.md)"
    )
    return GenericAdapter(inner)
