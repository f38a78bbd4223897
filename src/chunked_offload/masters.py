"""Optional fp32 masters for 16-bit params, and the lossless 16-bit remainder encoding of an fp32 master."""

from __future__ import annotations

import enum
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from .planner import Role, TensorSpec, dense_spec
from .specs import is_dense

__all__ = [
    "GRAD32",
    "MASTER",
    "REMAINDER",
    "TIE_BITS",
    "MasterMode",
    "codec_workspace",
    "decode_remainder",
    "encode_remainder",
    "master_specs",
    "needs_master",
    "read_master",
    "reconcile_and_back_up",
    "reconcile_master",
    "reconcile_masters",
    "write_master",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Keys of the wrapper-owned tensors in a bundle; "~" keeps them apart from any inner-optimizer state key.
MASTER, GRAD32, REMAINDER, TIE_BITS = "~master", "~grad32", "~remainder", "~tie_bits"

# Elementwise passes over a master run in pieces of this many elements, so that their temporaries (masks, tie
# bits) stay a few MiB whatever the param size. A multiple of 8 keeps tie-bit bytes aligned with the pieces.
_PIECE_ELEMS = 1 << 24
# The int16 half of an fp32 element that holds its sign, exponent and upper mantissa bits.
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


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

    [Note: Edited params]
    A param may be written between steps (pretrained weights loaded after wrapping, a row zeroed by hand). Both
    modes then follow one rule, applied elementwise at the start of the param's next step: the master keeps its
    low 16 bits (its remainder ``d``) and takes its high part from the param, ``bits(x') = P * 65536 + d``; where
    ``x'`` does not round to ``P`` (a tie), the master becomes ``P`` exactly. For a param that was not edited this
    changes nothing. Masters are seeded with ``d = 0``, so an edit before the first step gives the master ``P``
    exactly. The remainder mode can follow no other rule (it stores ``d`` and nothing about the old ``P``), and the
    fp32 mode follows the same one, so the two stay bitwise identical. fp16 params (fp32 mode only) take ``P``
    exactly wherever the master no longer rounds to it.
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
    specs = []
    if mode is MasterMode.FP32:
        specs.append(dense_spec(MASTER, Role.MASTER, param, torch.float32))
    else:
        n_tie_bytes = math.ceil(param.numel() / 8)
        specs += [
            dense_spec(REMAINDER, Role.REMAINDER, param, torch.int16),
            TensorSpec(TIE_BITS, Role.TIE_BITS, (n_tie_bytes,), (1,), torch.uint8),
            dense_spec(MASTER, Role.SCRATCH, param, torch.float32),
        ]
    specs.append(dense_spec(GRAD32, Role.SCRATCH, param, torch.float32))
    return specs


def codec_workspace(numel: int, mode: MasterMode) -> int:
    """Device bytes the temporaries of one master's rebuild and re-encoding take at most (beside its scratch).

    Per piece of up to ``_PIECE_ELEMS`` elements: the mask of [Note: Edited params] (a byte each); in remainder mode
    also the tie bits unpacked to a byte each and one shifted copy of the packed bits (an eighth).
    """
    n = -(-min(numel, _PIECE_ELEMS) // 8) * 8
    return n if mode is MasterMode.FP32 else n + n // 8


def _flat_pieces(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Matching flat pieces of same-shaped tensors in logical (row-major) order.

    Contiguous tensors are cut into views of at most ``_PIECE_ELEMS`` elements; otherwise the whole tensors come
    as one piece (``reshape`` may copy, so callers write results back through the originals).
    """
    n = tensors[0].numel()
    if all(t.is_contiguous() for t in tensors):
        flats = [t.view(-1) for t in tensors]
        for lo in range(0, n, _PIECE_ELEMS):
            yield tuple(f[lo : lo + _PIECE_ELEMS] for f in flats)
    else:
        yield tuple(t.reshape(-1) for t in tensors)


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
    diff = work.view(torch.int32)
    diff.copy_(param.view(torch.int16))
    diff.mul_(65536)
    torch.sub(master.view(torch.int32), diff, out=diff)
    tie_bits.zero_()
    for lo, (d,) in _offsets(_flat_pieces(diff)):
        ties = torch.zeros(-(-d.numel() // 8) * 8, dtype=torch.bool, device=d.device)
        torch.eq(d, 32768, out=ties[: d.numel()])
        d.masked_fill_(ties[: d.numel()], -32768)
        grouped = ties.view(torch.uint8).view(-1, 8)
        out = tie_bits[lo // 8 : lo // 8 + grouped.shape[0]]
        for k in range(8):
            out.bitwise_or_(grouped[:, k] << k)
        if not diff.is_contiguous():
            diff.copy_(d.view(diff.shape))
    remainder.copy_(diff)


def decode_remainder(param: torch.Tensor, remainder: torch.Tensor, tie_bits: torch.Tensor, out: torch.Tensor) -> None:
    """Rebuild the exact fp32 master into ``out`` from ``param``'s bits, the remainder and the tie bits."""
    bits = out.view(torch.int32)
    bits.copy_(param.view(torch.int16))
    bits.mul_(65536)
    bits.add_(remainder)
    for lo, (b,) in _offsets(_flat_pieces(bits)):
        tie_bytes = tie_bits[lo // 8 : lo // 8 + -(-b.numel() // 8)]
        ties = torch.empty((tie_bytes.numel(), 8), dtype=torch.uint8, device=b.device)
        for k in range(8):
            torch.bitwise_and(tie_bytes >> k, 1, out=ties[:, k])
        b.add_(ties.view(-1)[: b.numel()], alpha=65536)
        if not bits.is_contiguous():
            bits.copy_(b.view(bits.shape))


def reconcile_master(param: torch.Tensor, master: torch.Tensor, rounded: torch.Tensor) -> None:
    """Apply [Note: Edited params] to ``master`` in place: after it, ``master`` rounds to ``param`` everywhere.

    Args:
        param: the 16-bit param as it is now.
        master: fp32 master: the stored one (fp32 mode) or the one decoded against ``param`` (remainder mode).
        rounded: scratch of ``param``'s dtype, shaped like ``param``.
    """
    reconcile_masters([param], [master], [rounded])


def reconcile_masters(
    params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor], rounded: Sequence[torch.Tensor]
) -> None:
    """:func:`reconcile_master` on each ``(param, master, rounded)``, with one call per pass for all of them.

    It runs before every step of every param with a master, edited or not, so it makes few passes over memory: a
    rounding, an int16 subtraction and a subtraction from the master's high halves, then a rounding, a compare and
    a select (about 44 bytes moved per element). The passes but the last run as foreach calls over all the masters
    (their host cost is paid per call, not per param).
    """
    triples = [(p, m, r) for p, m, r in zip(params, masters, rounded, strict=True) if m.numel()]
    if not triples:
        return
    bf16 = [(p, m, r) for p, m, r in triples if p.dtype == torch.bfloat16]
    if bf16:
        # bits(x') = bits(x) - (round(x) - P) * 65536, which keeps the master's low 16 bits and adds P - round(x)
        # to its high 16 (modulo 2**16, as int16 arithmetic wraps): x itself wherever the param was not edited.
        torch._foreach_copy_([r for _, _, r in bf16], [m for _, m, _ in bf16])
        diffs = [r.view(torch.int16) for _, _, r in bf16]
        torch._foreach_sub_(diffs, [p.view(torch.int16) for p, _, _ in bf16])
        highs = [_high_halves(m, d) for (_, m, _), d in zip(bf16, diffs, strict=True)]
        torch._foreach_sub_([h for h, _ in highs], [d for _, d in highs])
    # Where the master still does not round to the param (a tie; any fp16 edit), it becomes the param exactly.
    torch._foreach_copy_([r for _, _, r in triples], [m for _, m, _ in triples])
    for param, master, r in triples:
        for m, r_, p in _flat_pieces(master, r, param):
            torch.where(r_.view(torch.int16) == p.view(torch.int16), m, p, out=m)
            if not master.is_contiguous():
                master.copy_(m.view(master.shape))


# Whether CUDA masters reconcile through the one-pass kernel of [Note: Fused reconcile] where Triton is present (the
# benchmarks turn it off to time the torch operations).
FUSED_RECONCILE = True
# Masters smaller than this take the torch operations: a foreach call per pass serves all of them, where the kernel's
# launch costs each about 90 us of host time on an H100 host, and their bytes are few (a layer norm's, a bias's).
FUSED_MIN_NUMEL = 2**22
_fused_kernel: list[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None] | None] = []


def reconcile_and_back_up(
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    backups: Sequence[torch.Tensor],
    *,
    back_up: bool = True,
) -> None:
    """:func:`reconcile_masters` with ``backups`` as its scratch, then each param copied into its backup (unless
    ``back_up`` is False: a chunk updated in one op needs none, [Note: One-op updates] in stepping.py).

    CUDA masters of ``FUSED_MIN_NUMEL`` elements or more in their param's dense layout go through the one-pass kernel
    of [Note: Fused reconcile]; the rest through the torch operations. Both leave the same bits, and both may be run
    again on what either left.
    """
    rest = []
    for p, m, b in zip(params, masters, backups, strict=True):
        kernel = _kernel() if m.is_cuda and m.numel() >= max(FUSED_MIN_NUMEL, 1) and FUSED_RECONCILE else None
        if kernel is None or not (m.stride() == p.stride() == b.stride() and is_dense(m)):
            rest.append((p, m, b))
            continue
        try:
            kernel(m, p, b, back_up)
        except Exception as e:  # Triton without a working compiler: the torch operations, from here on
            warnings.warn(f"chunked_offload: the fused reconcile failed ({e}); using torch operations", stacklevel=2)
            _fused_kernel[0] = None
            rest.append((p, m, b))
    if rest:
        ps, ms, bs = ([t[k] for t in rest] for k in range(3))
        reconcile_masters(ps, ms, bs)
        if back_up:
            torch._foreach_copy_(bs, ps)


def _kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None] | None:
    if not _fused_kernel:
        try:
            from .fused import reconcile_dense
        except Exception:  # no Triton (or one that does not import)
            reconcile_dense = None  # type: ignore[assignment]
        _fused_kernel.append(reconcile_dense)
    return _fused_kernel[0]


def _high_halves(t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The upper 16 bits of each element of the dense fp32 tensor ``t``, as an int16 view, and ``like`` (shaped as
    ``t``) viewed so that its elements line up with them."""
    if t.numel() == 1:  # any strides (or none): one element
        t, like = t.view(1), like.view(1)
    order = sorted(range(t.dim()), key=t.stride, reverse=True)  # in memory order, ``t`` is contiguous
    t, like = t.permute(order), like.permute(order)
    return t.view(torch.int16)[..., _HIGH_HALF::2], like


def _offsets(pieces: Iterator[tuple[torch.Tensor, ...]]) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    lo = 0
    for piece in pieces:
        yield lo, piece
        lo += piece[0].numel()


def read_master(home: Mapping[str, torch.Tensor], param: torch.Tensor, mode: MasterMode) -> torch.Tensor:
    """A param's master as the next step will use it ([Note: Edited params]), from its home; nothing on the GPU."""
    device = home[MASTER if mode is MasterMode.FP32 else REMAINDER].device
    param = param.detach().to(device)
    rounded = torch.empty_like(param)
    if mode is MasterMode.FP32:
        master = home[MASTER]
        rounded.copy_(master)
        if torch.equal(rounded.view(torch.int16), param.view(torch.int16)):
            return master  # not edited since its last step: the stored master itself
        master = master.clone()
    else:
        like = home[REMAINDER]
        master = torch.empty_strided(tuple(like.shape), like.stride(), dtype=torch.float32, device=device)
        decode_remainder(param, home[REMAINDER], home[TIE_BITS], master)
    reconcile_master(param, master, rounded=rounded)
    return master


def write_master(home: Mapping[str, torch.Tensor], param: torch.Tensor, master: torch.Tensor, mode: MasterMode) -> None:
    """Set a param's master in its home, and the param itself to the master rounded to nearest even."""
    device = home[MASTER if mode is MasterMode.FP32 else REMAINDER].device
    master = master.to(device=device, dtype=torch.float32)
    rounded = master.to(param.dtype)
    param.detach().copy_(rounded)
    if mode is MasterMode.FP32:
        home[MASTER].copy_(master)
    else:
        encode_remainder(master, rounded, home[REMAINDER], home[TIE_BITS], work=torch.empty_like(master))
