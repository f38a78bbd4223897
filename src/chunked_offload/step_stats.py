"""StepStats: the figures of one ``step()`` (``opt.stats``), as users read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .storage import IOStats

__all__ = ["StepStats", "io_figures"]


@dataclass(frozen=True)
class StepStats:
    """Figures of one ``step()`` (``opt.stats``).

    Attributes:
        chunks: chunks stepped.
        h2d_bytes: bytes copied host -> device (offloaded chunks; in a backward step also those staged ahead and
            then not stepped from that slot, [Note: Backward order]).
        d2h_bytes: bytes copied device -> host (offloaded chunks, and the state a first step creates).
        d2d_bytes: bytes copied within the device each way (resident chunks).
        seconds: from the start of the step to the last write-back landing (device time on a GPU).
        link_gbps: ``(h2d_bytes + d2h_bytes) / seconds`` in GB/s (1e9 bytes).
        exposed_seconds: how long the step held the caller's stream, which the next forward waits for; None when
            the step overlaps it (``overlap=True``), where it depends on the forward.
        window_bytes: peak device memory the step took beside the resident state (slots and fresh state).
        resident_bytes: device memory holding resident state between steps.
        resident_share: share of the state's bytes resident on the device (``gpu_budget_mb="auto"`` moves it).
        pinned_host_bytes: page-locked host memory of the arena.
        disk_read_bytes: bytes read from the stores behind the host: the disk tier's files ([Note: Disk tier]);
            0 without ``spill_dir``.
        disk_written_bytes: bytes written to them.
        disk_gbps: ``(disk_read_bytes + disk_written_bytes)`` over the seconds the disk spent on them, in GB/s.
        disk_exposed_seconds: how long the step's host thread waited for the disk (reads not done ahead, and the
            writes, which a chunk's commit waits for).
        disk_checksum_seconds: how long the disk's reads and writes waited for their checksums (a CRC-32 of each
            piece runs beside the next piece's read, and beside a write): at most what the checksums add to the
            step (the other reader thread may keep the disk busy meanwhile).
    """

    chunks: int
    h2d_bytes: int
    d2h_bytes: int
    d2d_bytes: int
    seconds: float
    link_gbps: float
    exposed_seconds: float | None
    window_bytes: int
    resident_bytes: int
    resident_share: float
    pinned_host_bytes: int
    disk_read_bytes: int = 0
    disk_written_bytes: int = 0
    disk_gbps: float = 0.0
    disk_exposed_seconds: float = 0.0
    disk_checksum_seconds: float = 0.0


def io_figures(start: IOStats, end: IOStats) -> dict[str, Any]:
    """The ``disk_*`` fields of a step whose stores behind the host did ``end`` less ``start``."""
    moved = end.read_nbytes - start.read_nbytes + end.written_nbytes - start.written_nbytes
    seconds = end.read_seconds - start.read_seconds + end.write_seconds - start.write_seconds
    return {
        "disk_read_bytes": end.read_nbytes - start.read_nbytes,
        "disk_written_bytes": end.written_nbytes - start.written_nbytes,
        "disk_gbps": moved / seconds / 1e9 if seconds > 0 else 0.0,
        "disk_exposed_seconds": end.wait_seconds - start.wait_seconds + end.write_seconds - start.write_seconds,
        "disk_checksum_seconds": end.checksum_seconds - start.checksum_seconds,
    }
