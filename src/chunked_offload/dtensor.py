"""DTensor params (FSDP2): each rank offloads its local shards; the helpers that look through a DTensor."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .planner import TensorSpec, align

__all__ = ["is_dtensor", "like_param", "local", "planning_weight", "rewrap", "same_tensor", "show"]


def _dtensor_module() -> Any:
    """``torch.distributed.tensor`` if it is imported, else None: a DTensor exists only once it is, and importing it
    costs 0.7 s, so ``import chunked_offload`` leaves it to the code that makes DTensors (FSDP2)."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t: object) -> bool:
    module = _dtensor_module()
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores and moves), or the tensor itself."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def like_param(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` (a local tensor) as the inner optimizer keeps state for ``param``: a DTensor placed like a DTensor param.

    This is what ``torch.zeros_like(param)`` gives a DTensor param: the same mesh, placements, global shape and strides,
    over ``t`` itself. ``DTensor.from_local`` would copy a host ``t`` to the mesh's device; the DTensor is built
    directly instead, so a host home stays on the host (as DCP's own CPU offload builds them).
    """
    if not is_dtensor(param):
        return t
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    p: Any = param
    spec = DTensorSpec(p.device_mesh, tuple(p.placements), tensor_meta=TensorMeta(p.shape, p.stride(), t.dtype))
    return _dtensor_module().DTensor(t, spec, requires_grad=False)


def rewrap(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a local tensor, a copy of ``like``'s) as ``like`` is: a DTensor with ``like``'s spec, or ``t`` itself."""
    if not is_dtensor(like):
        return t
    d: Any = like
    return _dtensor_module().DTensor(t, d._spec, requires_grad=False)


def show(param: torch.Tensor, data: torch.Tensor, parts: Any = None) -> Any:
    """Make ``param`` show ``data`` (``param.data = data``) and return what it showed before, for a later call.

    A DTensor keeps its local tensor and spec outside what ``.data`` swaps, so for a DTensor param they are swapped
    too (to ``parts`` when given, else to ``data``'s): the param then is a DTensor over ``data``'s local tensor.
    """
    param.data = data
    if not is_dtensor(param):
        return None
    p: Any = param
    before = (p._local_tensor, p._spec)
    p._local_tensor, p._spec = parts if parts is not None else (data._local_tensor, data._spec)  # type: ignore
    return before


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of the same bytes with the same layout (a DTensor's local view, say)."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    )


def planning_weight(p: torch.Tensor, specs: Sequence[TensorSpec]) -> int | None:
    """The bytes a DTensor param's bundle counts for when packing chunks: the same on every rank.

    Uneven shards differ in size between ranks; packing by their padded size (``ceil(size / shards)`` along each
    sharded dimension) gives every rank the same chunk membership, which tensor-parallel inner optimizers need.
    None for a plain tensor (pack by its real bytes).
    """
    if not is_dtensor(p):
        return None
    d: Any = p
    shape = list(d.shape)
    shard = _dtensor_module().Shard
    for mesh_dim, placement in enumerate(d.placements):
        if isinstance(placement, shard):
            shape[placement.dim] = -(-shape[placement.dim] // d.device_mesh.size(mesh_dim))
    numel = math.prod(shape)
    return sum(align(numel * s.dtype.itemsize) for s in specs)
