"""One-pass GPU kernel for the masters' reconcile ([Note: Edited params] in masters.py), through Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reconcile_dense"]

# [Note: Fused reconcile]
# ``masters.reconcile_masters`` runs before every step of every param with a master, edited or not. As torch
# operations it is six passes over memory (about 44 bytes per element); this kernel is one: it reads the master
# and the param (6 bytes per element), writes the param's backup (2), and writes the master only where the rule
# changes it (nowhere, for a param the step left as it was). Each element goes through the same steps as the
# torch operations, with the GPU's own roundings (``cvt.rn``, what torch's CUDA casts run), so the results are
# bitwise the same: the CUDA tests compare the two on edits, ties, NaNs, infinities, subnormals and signed zeros.
# ``masters`` uses it for CUDA tensors that share one dense layout, and the torch operations otherwise.

_BLOCK = 2048


@triton.jit
def _reconcile_kernel(  # type: ignore[no-untyped-def]
    master_ptr, param_ptr, backup_ptr, n, BF16: tl.constexpr, BACK_UP: tl.constexpr, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    stored = tl.load(master_ptr + offsets, mask=inside).to(tl.uint32, bitcast=True)
    param16 = tl.load(param_ptr + offsets, mask=inside)
    if BACK_UP:
        tl.store(backup_ptr + offsets, param16, mask=inside)
    param = param16.to(tl.uint16, bitcast=True).to(tl.uint32)
    master = stored
    if BF16:
        # Keep the master's low 16 bits; its high 16 go up by P - round(x), modulo 2**16.
        rounded = master.to(tl.float32, bitcast=True).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        master = ((((master >> 16) + param - rounded) & 0xFFFF) << 16) | (master & 0xFFFF)
        rounded = master.to(tl.float32, bitcast=True).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        exact = param << 16
    else:
        rounded = master.to(tl.float32, bitcast=True).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        exact = param16.to(tl.float16, bitcast=True).to(tl.float32).to(tl.uint32, bitcast=True)
    # Where the master still does not round to the param, it becomes the param exactly.
    master = tl.where(rounded == param, master, exact)
    tl.store(master_ptr + offsets, master.to(tl.int32, bitcast=True), mask=inside & (master != stored))


def reconcile_dense(master: torch.Tensor, param: torch.Tensor, backup: torch.Tensor, back_up: bool = True) -> None:
    """Apply [Note: Edited params] to the fp32 ``master`` of the 16-bit ``param`` and copy ``param`` into ``backup``
    (unless ``back_up`` is False), in one pass. The three are CUDA tensors in one dense layout (equal strides), so
    that memory order matches."""
    n = master.numel()
    flat = [t.as_strided((n,), (1,)) for t in (master, param, backup)]
    grid = (triton.cdiv(n, _BLOCK),)
    with torch.cuda.device(master.device):
        _reconcile_kernel[grid](
            flat[0].view(torch.int32),
            flat[1].view(torch.int16),
            flat[2].view(torch.int16),
            n,
            BF16=param.dtype == torch.bfloat16,
            BACK_UP=back_up,
            BLOCK=_BLOCK,
        )
