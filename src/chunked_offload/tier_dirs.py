"""The disk tier's directories under ``spill_dir``: made with an owner mark, and reclaimed once their owner is gone."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

__all__ = ["OWNER", "PREFIX", "boot_id", "make_tier_dir", "reclaim_stale", "start_time", "tier_dirs"]

logger = logging.getLogger(__name__)

PREFIX = "chunked_offload-"
OWNER = "owner.json"

# [Note: Tier directories]
# Each wrapper's disk tier lives in a directory of its own, ``spill_dir/chunked_offload-XXXX``, which the process that
# made it removes when the wrapper goes (only that process: a fork's child exiting leaves it). A run killed with
# SIGKILL removes nothing, so the directory carries an owner mark (host, boot, pid and the process's start time).
# A wrapper built on the same ``spill_dir`` reclaims the directories whose owner is certainly gone: made on this host
# since its last boot by a process that no longer runs, or made before that boot. It logs each one it removes and
# never reads their bytes as state. A directory of another host, of a live process, or without a mark is left alone;
# the free-space check names them when the disk is short.


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), counted after the command's parentheses


def _mark() -> dict[str, str | int | None]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": boot_id(), "pid": pid, "started": start_time(pid)}


def make_tier_dir(spill_dir: Path) -> Path:
    """A new directory for one wrapper's files, with its owner mark."""
    directory = Path(tempfile.mkdtemp(prefix=PREFIX, dir=spill_dir))
    (directory / OWNER).write_text(json.dumps(_mark()))
    return directory


def tier_dirs(spill_dir: Path) -> list[Path]:
    """Every tier directory in ``spill_dir``."""
    try:
        return sorted(p for p in spill_dir.iterdir() if p.name.startswith(PREFIX) and p.is_dir())
    except OSError:
        return []


def _gone(directory: Path) -> bool:
    """Whether the owner of ``directory`` is certainly gone ([Note: Tier directories])."""
    try:
        owner = json.loads((directory / OWNER).read_text())
    except (OSError, ValueError):
        return False  # no mark (or one being written): not ours to judge
    if owner.get("host") != socket.gethostname():
        return False
    if owner.get("boot") != boot_id():
        return True  # made before this boot: every process of then is gone
    return start_time(int(owner.get("pid", -1))) != owner.get("started")  # not running, or its pid reused


def reclaim_stale(spill_dir: Path) -> list[Path]:
    """Remove the tier directories in ``spill_dir`` whose owner is gone; returns them."""
    removed = []
    for directory in tier_dirs(spill_dir):
        if _gone(directory):
            nbytes = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
            shutil.rmtree(directory, ignore_errors=True)
            logger.warning(
                "chunked_offload: removed %s (%.1f MiB), the disk tier of a run on this host that no longer runs",
                directory,
                nbytes / 2**20,
            )
            removed.append(directory)
    return removed
