"""DTensor params (FSDP2): each rank offloads its local shards; the helpers that look through a DTensor."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .planner import TensorSpec, align

__all__ = ["is_dtensor", "like_param", "local", "planning_weight", "rewrap", "same_tensor", "show"]

try:  # DTensor params (FSDP2): the wrapper offloads each rank's local shard
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed
    DTensor = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


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
    return DTensor(t, spec, requires_grad=False)


def rewrap(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a local tensor, a copy of ``like``'s) as ``like`` is: a DTensor with ``like``'s spec, or ``t`` itself."""
    if not is_dtensor(like):
        return t
    d: Any = like
    return DTensor(t, d._spec, requires_grad=False)


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
    for mesh_dim, placement in enumerate(d.placements):
        if Shard is not None and isinstance(placement, Shard):
            shape[placement.dim] = -(-shape[placement.dim] // d.device_mesh.size(mesh_dim))
    numel = math.prod(shape)
    return sum(align(numel * s.dtype.itemsize) for s in specs)
