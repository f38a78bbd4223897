"""Canonical host storage: one exact-size byte buffer, page-locked piecewise, laid out in chunk order."""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from .planner import TensorSpec

__all__ = ["HostArena", "available_host_bytes"]

logger = logging.getLogger(__name__)

# Pieces are registered concurrently: registering page-locks and touches every page, which one thread does at a
# few GB/s. 2 MiB-aligned pieces never share a page, so they can be registered independently.
_PIECE_ALIGN = 2 * 1024 * 1024
_PIECE_BYTES = 256 * 1024 * 1024
_REGISTER_THREADS = 8


def available_host_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister({nbytes} bytes) failed with CUDA error {int(err)}")


def _unregister(ptrs: list[int], buffer: torch.Tensor) -> None:
    # `buffer` is held by this finalizer only to keep the memory alive until it is unregistered.
    for ptr in ptrs:
        try:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:  # interpreter shutdown: the CUDA context may already be gone
            pass
    del buffer


class HostArena:
    """Exact-size host memory for every offloaded chunk, page-locked on CUDA machines.

    The caching host allocator (``torch.empty(pin_memory=True)``) rounds each block up to a power of two and costs
    about 0.67 s/GiB; this arena takes a plain allocation of the exact size and page-locks it with
    ``cudaHostRegister`` in 2 MiB-aligned pieces on several threads. Without CUDA the memory is left pageable and
    the same code runs.

    Args:
        nbytes: bytes to allocate.
        pin: page-lock the memory (needs CUDA).
    """

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        available = available_host_bytes()
        if available is not None and nbytes > available:
            raise RuntimeError(
                f"the host arena needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of host RAM but only {available} "
                f"bytes ({available / 2**30:.2f} GiB) are available; lower offload_fraction, offload fewer "
                "parameters, or free host memory"
            )
        self.nbytes = nbytes
        self.pinned = pin and nbytes > 0
        slack = _PIECE_ALIGN if self.pinned else 0
        raw = torch.empty(nbytes + slack, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PIECE_ALIGN if self.pinned else 0
        self._buffer = raw[start : start + nbytes]
        if self.pinned:
            base = self._buffer.data_ptr()
            pieces = [(base + off, min(_PIECE_BYTES, nbytes - off)) for off in range(0, nbytes, _PIECE_BYTES)]
            with ThreadPoolExecutor(max_workers=min(_REGISTER_THREADS, len(pieces))) as pool:
                list(pool.map(lambda piece: _register(*piece), pieces))
            self._finalizer = weakref.finalize(self, _unregister, [p for p, _ in pieces], raw)
            logger.debug("registered %d bytes of host memory in %d pieces", nbytes, len(pieces))

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 view of ``nbytes`` bytes at ``offset``."""
        return self._buffer[offset : offset + nbytes]

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """A tensor view with ``spec``'s shape, strides and dtype at byte ``offset``."""
        return typed_view(self._buffer, offset, spec)

    def close(self) -> None:
        """Unregister the memory now; views stay valid as ordinary pageable memory."""
        if self.pinned:
            self._finalizer()


def typed_view(flat: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """View ``spec.nbytes`` bytes of the uint8 tensor ``flat`` at ``offset`` as ``spec`` describes."""
    raw = flat[offset : offset + spec.nbytes]
    if spec.numel == 0:
        return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=flat.device)
    return raw.view(spec.dtype).as_strided(spec.shape, spec.stride)
