"""The disk tier's plan: which offloaded chunks go to files, the host budget "auto", and the checks of
``spill_dir`` before anything is allocated ([Note: Disk tier] in disk.py)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from .planner import ChunkPlan, Home
from .specs import whole_pages
from .tier_dirs import tier_dirs

__all__ = ["auto_host_budget", "check_free_space", "check_spill_dir", "filesystem_of", "meminfo", "spill"]

_MIB = 2**20
_WARN_FILESYSTEMS = {"tmpfs", "ramfs", "nfs", "nfs4", "cifs", "smb3", "fuse.sshfs", "9p", "overlay"}


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` is on (from /proc/mounts), or "" where unknown."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def check_spill_dir(spill_dir: Path) -> str | None:
    """Check ``spill_dir`` when the wrapper is built: it exists and is a writable directory. Returns a warning for a
    filesystem that is not a local disk.

    Raises:
        ValueError: what is wrong, and what to do.
    """
    if not spill_dir.exists():
        raise ValueError(f"spill_dir={str(spill_dir)!r} does not exist: create it (on a local disk), or pass another")
    if not spill_dir.is_dir():
        raise ValueError(f"spill_dir={str(spill_dir)!r} is not a directory: pass a directory on a local disk")
    try:
        _probe_write(spill_dir)
    except OSError as e:
        raise ValueError(
            f"spill_dir={str(spill_dir)!r} is not writable by this process ({e.strerror or e}): pass a writable "
            "directory on a local disk"
        ) from e
    kind = filesystem_of(spill_dir)
    if kind in _WARN_FILESYSTEMS:
        return (
            f"spill_dir={str(spill_dir)!r} is on a {kind} filesystem: a disk tier there is slow (network) or takes "
            "host memory after all (tmpfs); a local disk is what it is for"
        )
    return None


def _probe_write(directory: Path) -> None:
    """Create and remove a file in ``directory`` (permissions alone miss read-only mounts and root)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(13, "permission denied")
    fd, name = tempfile.mkstemp(prefix=".chunked_offload-probe-", dir=directory)
    os.close(fd)
    os.unlink(name)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return info


def check_free_space(spill_dir: Path, plan: ChunkPlan) -> None:
    """Before the files of ``plan`` are made: ``spill_dir`` has room for them and one more generation of the largest
    (a step writes a chunk's new file beside the old one).

    Raises:
        ValueError: how much is free and needed, and what to do.
    """
    free = shutil.disk_usage(spill_dir).free
    need = plan.disk_nbytes + plan.bounce_nbytes
    if free < need:
        others = [(d.name, sum(f.stat().st_size for f in d.iterdir() if f.is_file())) for d in tier_dirs(spill_dir)]
        held = ""
        if others:
            held = (
                f"; {len(others)} tier directories there hold {sum(n for _, n in others) / _MIB:.1f} MiB "
                f"({', '.join(name for name, _ in others[:3])}): runs still running, of another host, or without an "
                "owner mark, which no run removes for them"
            )
        raise ValueError(
            f"spill_dir={str(spill_dir)!r} has {free / _MIB:.1f} MiB free, but the disk tier needs "
            f"{need / _MIB:.1f} MiB (the state on disk, {plan.disk_nbytes / _MIB:.1f} MiB, and one more generation "
            f"of its largest chunk){held}: free space there, pass another directory, or raise host_budget_mb"
        )


def auto_host_budget(headroom_share: float = 0.1, min_headroom: int = 4 * 2**30) -> int:
    """``host_budget_mb="auto"`` in bytes: the host memory available now (``MemAvailable``), less a headroom (10% of
    the total, at least 4 GiB), divided among the ranks of this node (``LOCAL_WORLD_SIZE``)."""
    info = meminfo()
    page = os.sysconf("SC_PAGE_SIZE")
    available = info.get("MemAvailable", os.sysconf("SC_AVPHYS_PAGES") * page)
    total = info.get("MemTotal", os.sysconf("SC_PHYS_PAGES") * page)
    headroom = max(min_headroom, int(total * headroom_share))
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(0, available - headroom) // ranks


def spill(plan: ChunkPlan, host_budget: int) -> ChunkPlan:
    """``plan`` with its last offloaded chunks on disk: the host keeps the longest run of offloaded chunks from the
    first whose arena, with ``num_slots + 1`` bounce buffers of the largest chunk on disk (in whole pages), fits
    ``host_budget`` bytes ([Note: Disk tier]).

    Raises:
        ValueError: not even the bounce buffers fit.
    """
    host = [c for c in plan.chunks if c.home == Home.HOST]
    bounces = plan.num_slots + 1
    for keep in range(len(host), -1, -1):
        disk = host[keep:]
        arena = max((c.home_offset + c.transfer_nbytes for c in host[:keep]), default=0)
        window = bounces * whole_pages(max((c.transfer_nbytes for c in disk), default=0))
        if arena + window <= host_budget:
            break
    else:
        largest = whole_pages(max((c.transfer_nbytes for c in host), default=0))
        least = math.ceil(bounces * largest / 2**20 * 100) / 100  # rounded up: the value given back must be enough
        raise ValueError(
            f"host_budget_mb={host_budget / 2**20:.2f} holds not even the {bounces} bounce buffers of the disk tier "
            f"(num_slots + 1 of the largest chunk, {largest / 2**20:.2f} MiB): raise host_budget_mb to at least "
            f"{least:.2f}, or lower chunk_size_mb"
        )
    if not disk:
        return plan
    base = disk[0].home_offset
    moved = {c.index: replace(c, home=Home.DISK, home_offset=c.home_offset - base) for c in disk}
    chunks = tuple(moved.get(c.index, c) for c in plan.chunks)
    return replace(plan, chunks=chunks)
