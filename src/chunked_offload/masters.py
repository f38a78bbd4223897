"""Optional fp32 masters for 16-bit params, and the lossless 16-bit remainder encoding of an fp32 master."""

from __future__ import annotations

import enum
import math

import torch

from .planner import Role, TensorSpec

__all__ = [
    "GRAD32",
    "MASTER",
    "REMAINDER",
    "TIE_BITS",
    "MasterMode",
    "decode_remainder",
    "encode_remainder",
    "master_specs",
    "needs_master",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Keys of the wrapper-owned tensors in a bundle; "~" keeps them apart from any inner-optimizer state key.
MASTER, GRAD32, REMAINDER, TIE_BITS = "~master", "~grad32", "~remainder", "~tie_bits"


class MasterMode(enum.Enum):
    """Where the fp32 master of a 16-bit param lives.

    [Note: Remainder encoding]
    A bf16 param ``P`` is its fp32 master ``x`` rounded to nearest even, i.e. ``P`` is the upper 16 bits of ``x``
    after rounding. As int32 bit patterns, ``d = bits(x) - P * 65536`` lies in ``[-32768, 32768]``: the lower 16
    bits and the rounding direction. ``d = +32768`` occurs exactly at a tie that rounded down (``P`` even); it does
    not fit an int16, and at the same ``P`` the tie that rounded up gives ``d = -32768``. So the host keeps
    ``d`` as an int16 with ``+32768`` stored as ``-32768``, plus one "tie" bit per element (packed 8 per byte)
    that adds 65536 back. ``bits(x) = P * 65536 + d`` rebuilds the master exactly: 2.125 bytes per element
    instead of 4. No step overflows int32 (``P * 65536`` and ``bits(x)`` are both representable). NaN masters
    decode to a NaN, not necessarily with the same payload.
    """

    NONE = "none"
    FP32 = "fp32"
    REMAINDER = "remainder"


def needs_master(param: torch.Tensor, mode: MasterMode) -> bool:
    """Whether ``param`` gets a wrapper-owned master under ``mode``."""
    return mode is not MasterMode.NONE and param.dtype in LOW_PRECISION


def master_specs(param: torch.Tensor, mode: MasterMode) -> list[TensorSpec]:
    """The wrapper-owned tensors of ``param``'s bundle: master or remainder, and the fp32 grad scratch."""
    if not needs_master(param, mode):
        return []
    shape, stride = tuple(param.shape), tuple(param.stride())
    specs = []
    if mode is MasterMode.FP32:
        specs.append(TensorSpec(MASTER, Role.MASTER, shape, stride, torch.float32))
    else:
        n_tie_bytes = math.ceil(param.numel() / 8)
        specs += [
            TensorSpec(REMAINDER, Role.REMAINDER, shape, stride, torch.int16),
            TensorSpec(TIE_BITS, Role.TIE_BITS, (n_tie_bytes,), (1,), torch.uint8),
            TensorSpec(MASTER, Role.SCRATCH, shape, stride, torch.float32),
        ]
    specs.append(TensorSpec(GRAD32, Role.SCRATCH, shape, stride, torch.float32))
    return specs


def _flat(t: torch.Tensor) -> torch.Tensor:
    # Logical (row-major) order, the same on encode and decode whatever the strides.
    return t.reshape(-1)


def encode_remainder(
    master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor, tie_bits: torch.Tensor, work: torch.Tensor
) -> None:
    """Write the remainder and tie bits of ``master`` relative to ``param`` (see [Note: Remainder encoding]).

    Args:
        master: fp32 master.
        param: bf16 param, equal to ``master`` rounded to nearest even.
        remainder: int16 output, same shape.
        tie_bits: uint8 output of ``ceil(numel / 8)`` bytes.
        work: fp32 scratch of the same shape (its bytes are overwritten).
    """
    n = master.numel()
    diff = work.view(torch.int32)
    diff.copy_(param.view(torch.int16))
    diff.mul_(65536)
    torch.sub(master.view(torch.int32), diff, out=diff)
    ties = torch.zeros(8 * tie_bits.numel(), dtype=torch.bool, device=master.device)
    torch.eq(_flat(diff), 32768, out=ties[:n])
    diff.masked_fill_(ties[:n].view(master.shape), -32768)
    remainder.copy_(diff)
    grouped = ties.view(torch.uint8).view(-1, 8)
    tie_bits.copy_(grouped[:, 0])
    for k in range(1, 8):
        tie_bits.bitwise_or_(grouped[:, k] << k)


def decode_remainder(param: torch.Tensor, remainder: torch.Tensor, tie_bits: torch.Tensor, out: torch.Tensor) -> None:
    """Rebuild the exact fp32 master into ``out`` from ``param``'s bits, the remainder and the tie bits."""
    n = out.numel()
    bits = out.view(torch.int32)
    bits.copy_(param.view(torch.int16))
    bits.mul_(65536)
    bits.add_(remainder)
    ties = torch.empty(8 * tie_bits.numel(), dtype=torch.uint8, device=out.device).view(-1, 8)
    for k in range(8):
        torch.bitwise_and(tie_bits >> k, 1, out=ties[:, k])
    bits.add_(ties.view(-1)[:n].view(out.shape), alpha=65536)
