"""Canonical host storage: one exact-size byte buffer, page-locked piecewise, laid out in chunk order."""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Sequence

import torch

from .planner import TensorSpec

__all__ = [
    "MAX_REGISTER_BYTES",
    "HostArena",
    "available_host_bytes",
    "check_host_budget",
    "is_page_locked",
    "registered_bytes",
    "registration_pieces",
]

logger = logging.getLogger(__name__)

# [Note: Registration pieces]
# A copy whose host range spans two cudaHostRegister registrations fails with cudaErrorInvalidValue (measured on an
# H200, torch 2.11), and one registration of 512 GiB or more fails on some drivers. So the arena is registered in
# pieces of at most MAX_REGISTER_BYTES that each cover whole chunks: every transfer copies within one chunk, hence
# within one registration. Zero-filling first lets torch's intra-op threads fault the pages in parallel;
# registering touched pages is then cheap (8 GiB: 0.38 s fill + 0.35 s register, against 2.3 s untouched and
# 0.35 s/GiB for pin_memory=True).
MAX_REGISTER_BYTES = 256 * 2**30
_ALIGN = 2 * 1024 * 1024
_CAP_IPC_LOCK = 14

_registered = {"bytes": 0}  # page-locked bytes of all live arenas in this process


def registered_bytes() -> int:
    """Bytes page-locked by every live :class:`HostArena` of this process."""
    return _registered["bytes"]


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


def _can_lock_without_limit() -> bool:
    """Whether the process has CAP_IPC_LOCK, under which RLIMIT_MEMLOCK does not apply."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def check_host_budget(nbytes: int, *, pin: bool) -> None:
    """Fail before allocating when ``nbytes`` exceeds available RAM, or, to page-lock, ``RLIMIT_MEMLOCK``.

    Raises:
        RuntimeError: naming the numbers and how to change them. Nothing has been allocated.
    """
    gib = 2**30
    available = available_host_bytes()
    if available is not None and nbytes > available:
        raise RuntimeError(
            f"the host arena needs {nbytes} bytes ({nbytes / gib:.2f} GiB) of host RAM but only {available} bytes "
            f"({available / gib:.2f} GiB) are available (MemAvailable); lower offload_fraction, offload fewer "
            "parameters, or free host memory"
        )
    if not pin:
        return
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and nbytes > soft and not _can_lock_without_limit():
        raise RuntimeError(
            f"the host arena needs {nbytes} bytes ({nbytes / gib:.2f} GiB) of page-locked memory but "
            f"RLIMIT_MEMLOCK (ulimit -l) is {soft} bytes and the process lacks CAP_IPC_LOCK; raise the limit "
            "(`ulimit -l unlimited`, `memlock` in /etc/security/limits.conf, or `docker run --ulimit memlock=-1`), "
            "or pass pin_memory=False to run from pageable memory (several times slower)"
        )


def registration_pieces(nbytes: int, boundaries: Sequence[int], max_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges to register: whole chunks (``boundaries`` are chunk starts) of at most ``max_bytes`` each.

    A chunk larger than ``max_bytes`` is registered alone. The ranges tile ``[0, nbytes)``.
    """
    cuts = sorted({b for b in boundaries if 0 < b < nbytes})
    pieces: list[tuple[int, int]] = []
    start = 0
    previous = 0
    for cut in [*cuts, nbytes]:
        if cut - start > max_bytes and previous > start:
            pieces.append((start, previous))
            start = previous
        previous = cut
    if nbytes > start:
        pieces.append((start, nbytes))
    return pieces


def _unregister(ptrs: list[tuple[int, int]], buffer: torch.Tensor) -> None:
    # `buffer` is held by this finalizer only to keep the memory alive until it is unregistered.
    for ptr, size in ptrs:
        try:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:  # interpreter shutdown: the CUDA context may already be gone
            pass
        _registered["bytes"] -= size
    del buffer


_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked host memory, allocated or registered


def is_page_locked(t: torch.Tensor) -> bool:
    """Whether the CUDA driver treats ``t``'s memory as page-locked.

    ``torch.Tensor.is_pinned()`` only recognises memory from torch's caching host allocator and answers False for
    memory registered with ``cudaHostRegister``, such as the host arena; this asks the runtime instead.
    """
    if t.device.type != "cpu" or not torch.cuda.is_available():
        return False
    # cudaPointerAttributes starts with its cudaMemoryType; the buffer is larger than any version of the struct.
    # Unlike cudaHostGetFlags, this succeeds on pageable memory (type 0), so no API error is raised and cleared
    # (compute-sanitizer reports each one).
    attributes = (ctypes.c_int * 64)()
    err = int(_libcudart().cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(t.data_ptr())))
    if err != 0:
        raise RuntimeError(f"cudaPointerGetAttributes failed with error {err} for a host tensor at {t.data_ptr():#x}")
    return attributes[0] == _CUDA_MEMORY_TYPE_HOST


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
    arena takes a plain allocation of the exact size and page-locks it with ``cudaHostRegister`` in pieces aligned
    to chunk boundaries (see [Note: Registration pieces]). Use :func:`is_page_locked` to check it: torch's
    ``is_pinned()`` does not see registered memory. Without CUDA the memory is left pageable and the same code runs.

    Args:
        nbytes: bytes to allocate.
        pin: page-lock the memory (needs CUDA).
        boundaries: byte offsets where chunks start; no registration piece splits a chunk.
        max_register_bytes: the largest single registration (default ``MAX_REGISTER_BYTES``).

    Raises:
        RuntimeError: too little host RAM or locked-memory allowance (checked first), or a registration failed;
            nothing stays allocated or registered.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pin: bool,
        boundaries: Sequence[int] = (),
        max_register_bytes: int | None = None,
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self.pinned = pin and nbytes > 0
        check_host_budget(nbytes, pin=self.pinned)
        slack = _ALIGN if self.pinned else 0
        raw = torch.empty(nbytes + slack, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _ALIGN if self.pinned else 0
        self._buffer = raw[start : start + nbytes]
        self._storage, self._start = raw.untyped_storage(), start
        limit = MAX_REGISTER_BYTES if max_register_bytes is None else max_register_bytes
        self.pieces = registration_pieces(nbytes, boundaries, limit)
        if self.pinned:
            self._buffer.zero_()  # fault the pages in on all intra-op threads before registering
            base = self._buffer.data_ptr()
            done: list[tuple[int, int]] = []
            for lo, hi in self.pieces:
                err = torch.cuda.cudart().cudaHostRegister(base + lo, hi - lo, 0)
                if int(err) != 0:
                    _unregister(done, raw)
                    raise RuntimeError(
                        f"cudaHostRegister of {hi - lo} bytes of the {nbytes}-byte host arena failed with {err}; "
                        "the locked-memory limit (ulimit -l) or the driver's registration size may be too small. "
                        "Pass pin_memory=False to run from pageable memory (slower)"
                    )
                done.append((base + lo, hi - lo))
                _registered["bytes"] += hi - lo
            self._finalizer = weakref.finalize(self, _unregister, done, raw)
            logger.debug("registered %d bytes of host memory in %d pieces", nbytes, len(done))

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
