"""The disk tier's file I/O, one function each (the benchmarks time them; fault-injection tests replace them in
``disk``, whose ``DiskStore`` calls them through its own names)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import torch

from .planner import PAGE
from .specs import whole_pages

__all__ = ["ALIGN", "PIECE", "aligned_buffer", "drop_cache", "read_file_into", "replace_file", "write_new_file"]


PIECE = 32 * 2**20  # a read reports its progress every PIECE bytes (the checksum of a piece runs under the next read)


def read_file_into(path: Path, out: torch.Tensor, progress: Callable[[int], None] | None = None) -> None:
    """Read the whole file ``path`` into the uint8 tensor ``out``; ``progress(n)`` after each piece: the first ``n``
    bytes are in."""
    view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + PIECE])
            if not n:
                raise OSError(f"{path}: the file ends after {done} of {len(view)} bytes")
            done += n
            if progress is not None:
                progress(done)
        drop_cache(f.fileno())


ALIGN = PAGE  # O_DIRECT moves whole blocks: the buffer's address, the file offset and the length are multiples of it


def write_new_file(path: Path, data: torch.Tensor, nbytes: int | None = None, *, direct: bool = True) -> None:
    """Write the first ``nbytes`` (default all) of the uint8 tensor ``data`` to the file ``path``, flushed to the
    disk: a new file, or a spare one that ``DiskStore`` renamed there, overwritten in place (its blocks are reused).
    Through O_DIRECT (1.36x the buffered rate on the H200's disk) where ``data`` is whole blocks from a block
    boundary (a bounce) and the filesystem takes it, else buffered (always, with ``direct=False``: bench_disk's A/B)."""
    nbytes = data.numel() if nbytes is None else nbytes
    view = memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]
    padded = whole_pages(nbytes)
    direct = direct and hasattr(os, "O_DIRECT") and data.data_ptr() % ALIGN == 0 and len(view) >= padded
    if not (direct and _write(path, view[:padded], nbytes, os.O_DIRECT)):
        _write(path, view[:nbytes], nbytes, 0)


def _write(path: Path, view: memoryview, nbytes: int, flags: int) -> bool:
    """Write ``view`` to a new file, cut it to ``nbytes``, flush it; False, and no file, where the filesystem
    refuses ``flags`` (EINVAL: O_DIRECT on tmpfs, or blocks larger than ``ALIGN``)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)  # no O_TRUNC: a spare's blocks stay allocated
    except OSError as e:
        if flags and e.errno == errno.EINVAL:
            return False
        raise
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done : done + 2**28])
        os.ftruncate(fd, nbytes)  # the last block's padding goes (and what a larger spare held beyond)
        os.fsync(fd)
        drop_cache(fd)
    except OSError as e:
        if not (flags and e.errno == errno.EINVAL):
            raise
        path.unlink()
        return False
    finally:
        os.close(fd)
    return True


def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of uint8 from a page boundary (page-locked memory starts on one), so that O_DIRECT can move it."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if buffer.data_ptr() % ALIGN:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
        start = -raw.data_ptr() % ALIGN
        buffer = raw[start : start + nbytes]
    return buffer


def replace_file(source: Path, target: Path) -> None:
    os.replace(source, target)


def drop_cache(fd: int) -> None:
    """The page cache of a file the tier has read or flushed holds nothing the host budget counts on."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
