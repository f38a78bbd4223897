"""TensorSpec and Bundle: the tensors of one param (shape, strides, dtype, role) and the bytes they take, aligned."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = ["ALIGNMENT", "PAGE", "Bundle", "Role", "TensorSpec", "align", "dense_spec", "is_dense", "whole_pages"]

# Every tensor starts on a 256-byte boundary inside a chunk: enough for any dtype view and for the
# 16-byte vector loads that fused kernels (torch, Transformer Engine) issue on raw pointers.
ALIGNMENT = 256
# Every chunk starts on a page in its home, so that host registrations can begin at any chunk (see
# [Note: Registration pieces] in host_arena.py); at most 4 KiB of padding per chunk.
PAGE = 4096


class Role(enum.Enum):
    """What a tensor in a bundle is, which decides where it lives and whether it crosses the link."""

    STATE = "state"  # an inner-optimizer state tensor (Adam moments, Muon momentum); moves both ways
    MASTER = "master"  # a wrapper-owned fp32 master ("fp32" mode); moves both ways
    REMAINDER = "remainder"  # int16 low half of the fp32 master ("remainder" mode); moves both ways
    TIE_BITS = "tie_bits"  # one bit per element that disambiguates the remainder at ties; moves both ways
    SCRATCH = "scratch"  # device-only working memory (the fp32 grad, the rebuilt master, the param backup); never moves

    @property
    def moves(self) -> bool:
        return self is not Role.SCRATCH


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the tensor alignment inside a chunk."""
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return (nbytes + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True)
class TensorSpec:
    """Shape, strides and dtype of one tensor of a bundle.

    Attributes:
        key: the state key (``"exp_avg"``) or the wrapper's own name (``"master"``, ``"grad32"``).
        role: where the tensor lives and whether it moves.
        shape: the tensor's shape.
        stride: the tensor's strides; they describe a dense, non-overlapping layout.
        dtype: the element type.
    """

    key: str
    role: Role
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def padded_nbytes(self) -> int:
        return align(self.nbytes)


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


def dense_spec(key: str, role: Role, like: torch.Tensor, dtype: torch.dtype) -> TensorSpec:
    """The spec of ``torch.empty_like(like, dtype=dtype)``: ``like``'s layout where it is dense, else contiguous.

    A param that is a slice with gaps (``nn.Parameter(W[:, :k])``) gets dense state, as ``torch.zeros_like``
    gives it; planning with the param's own strides would make neighbouring homes overlap.
    """
    meta = torch.empty_strided(tuple(like.shape), tuple(like.stride()), dtype=like.dtype, device="meta")
    out = torch.empty_like(meta, dtype=dtype)
    return TensorSpec(key, role, tuple(out.shape), tuple(out.stride()), dtype)


@dataclass(frozen=True)
class Bundle:
    """Everything that belongs to one parameter: its offloadable state, its master, its scratch.

    Attributes:
        index: the parameter's position in ``param_groups`` order (the id used by ``state_dict``).
        specs: the bundle's tensors, in a fixed order.
        weight: the bytes the bundle counts for when chunks are packed, when that differs from its slot bytes (a
            DTensor shard counts as its padded size, so every rank packs the same params together); None: its slot
            bytes.
    """

    index: int
    specs: tuple[TensorSpec, ...]
    weight: int | None = None

    @property
    def packing_nbytes(self) -> int:
        return self.device_nbytes if self.weight is None else self.weight

    @property
    def device_nbytes(self) -> int:
        """Bytes the bundle occupies in a staging slot."""
        return sum(s.padded_nbytes for s in self.specs)

    @property
    def host_nbytes(self) -> int:
        """Bytes the bundle occupies in the host arena (and moves each way)."""
        return sum(s.padded_nbytes for s in self.specs if s.role.moves)
