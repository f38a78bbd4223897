"""Canonical host storage: one exact-size byte buffer, page-locked piecewise, laid out in chunk order."""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch

from .planner import TensorSpec

__all__ = ["HostArena", "available_host_bytes", "is_page_locked"]

logger = logging.getLogger(__name__)

# cudaHostRegister page-locks in one call: a copy whose host range spans two registrations fails with
# cudaErrorInvalidValue (measured on an H200, torch 2.11), so the arena is exactly one registration. Zero-filling
# first lets torch's intra-op threads fault the pages in parallel; registering touched pages is then cheap
# (8 GiB: 0.38 s fill + 0.35 s register, against 2.3 s untouched and 0.35 s/GiB for pin_memory=True).
_ALIGN = 2 * 1024 * 1024


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


def _unregister(ptr: int, buffer: torch.Tensor) -> None:
    # `buffer` is held by this finalizer only to keep the memory alive until it is unregistered.
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the CUDA context may already be gone
        pass
    del buffer


def is_page_locked(t: torch.Tensor) -> bool:
    """Whether the CUDA driver treats ``t``'s memory as page-locked.

    ``torch.Tensor.is_pinned()`` only recognises memory from torch's caching host allocator and answers False for
    memory registered with ``cudaHostRegister``, such as the host arena; this asks the runtime instead.
    """
    if t.device.type != "cpu" or not torch.cuda.is_available():
        return False
    cudart = _libcudart()
    flags = ctypes.c_uint(0)
    locked = int(cudart.cudaHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(t.data_ptr()))) == 0
    # Without this the runtime keeps cudaErrorInvalidValue as its last error, and torch's next kernel launch
    # check reports it as if that kernel had failed.
    cudart.cudaGetLastError()
    return locked


def _libcudart() -> ctypes.CDLL:
    torch.cuda.init()  # loads the CUDA runtime torch was built with, so dlopen finds it by name below
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"cannot load the CUDA runtime library (tried libcudart.so.{major} and libcudart.so)")


class HostArena:
    """Exact-size host memory for every offloaded chunk, page-locked on CUDA machines.

    The caching host allocator (``torch.empty(pin_memory=True)``) rounds each block up to a power of two; this
    arena takes a plain allocation of the exact size and page-locks it with one ``cudaHostRegister`` call (see the
    note on ``_ALIGN``). Use :func:`is_page_locked` to check it: torch's ``is_pinned()`` does not see registered
    memory. Without CUDA the memory is left pageable and the same code runs.

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
        slack = _ALIGN if self.pinned else 0
        raw = torch.empty(nbytes + slack, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _ALIGN if self.pinned else 0
        self._buffer = raw[start : start + nbytes]
        self._storage, self._start = raw.untyped_storage(), start
        if self.pinned:
            self._buffer.zero_()  # fault the pages in on all intra-op threads before registering
            ptr = self._buffer.data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of the {nbytes}-byte host arena failed with {err}; the locked-memory limit "
                    "(ulimit -l) may be too low. Pass pin_memory=False to run from pageable memory (slower)"
                )
            self._finalizer = weakref.finalize(self, _unregister, ptr, raw)
            logger.debug("registered %d bytes of host memory", nbytes)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 view of ``nbytes`` bytes at ``offset``."""
        return self._buffer[offset : offset + nbytes]

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """A tensor with ``spec``'s shape, strides and dtype at byte ``offset``, on a storage of its own.

        The storage covers exactly the tensor's bytes (and keeps the arena alive), so ``torch.save`` of a state dict
        writes the state and nothing else of the arena: no remainders, tie bits or other params' bytes.
        """
        if spec.numel == 0:
            return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype)
        begin = self._start + offset
        own = torch.empty(0, dtype=torch.uint8).set_(self._storage[begin : begin + spec.nbytes])
        return own.view(spec.dtype).as_strided(spec.shape, spec.stride)

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
