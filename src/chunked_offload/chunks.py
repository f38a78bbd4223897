"""The chunk plan's data: homes, chunks and the plan (``planner.plan_chunks`` makes one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .specs import Bundle, whole_pages

__all__ = ["Chunk", "ChunkPlan", "Home"]


class Home(str):
    """Where a chunk's moving bytes live between steps: a name, with one store per home ([Note: Storage seam] in
    storage.py). The wrapper's own are ``HOST`` (the host arena: offloaded), ``DEVICE`` (a device buffer: resident,
    ``offload_fraction < 1``, staged by device-to-device copies) and ``DISK`` (a file per chunk under ``spill_dir``:
    [Note: Disk tier]); a tier behind the host names its own (``Home("name")``)."""

    __slots__ = ()
    HOST: ClassVar[Home]
    DEVICE: ClassVar[Home]
    DISK: ClassVar[Home]

    @property
    def value(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"Home({str(self)!r})"


Home.HOST, Home.DEVICE, Home.DISK = Home("host"), Home("device"), Home("disk")


@dataclass(frozen=True)
class Chunk:
    """A run of whole bundles that is staged, stepped and written back together.

    Attributes:
        index: position in the plan, in parameter order.
        params: parameter indices, in ``param_groups`` order.
        home: where the chunk's moving bytes live between steps.
        home_offset: byte offset of the chunk's moving bytes in its home buffer (host arena or device buffer).
        region_nbytes: bytes of the three regions (state, wrapper-owned, scratch).
        offsets: byte offset of each tensor inside the chunk, keyed by ``(param index, key)``.
    """

    index: int
    params: tuple[int, ...]
    home: Home
    home_offset: int
    region_nbytes: tuple[int, int, int]
    offsets: dict[tuple[int, str], int] = field(repr=False, compare=False)

    @property
    def state_nbytes(self) -> int:
        return self.region_nbytes[0]

    @property
    def transfer_nbytes(self) -> int:
        """Bytes copied each way: the state and wrapper-owned regions."""
        return self.region_nbytes[0] + self.region_nbytes[1]

    @property
    def device_nbytes(self) -> int:
        """Bytes of staging memory the chunk needs on the device."""
        return sum(self.region_nbytes)


@dataclass(frozen=True)
class ChunkPlan:
    """The deterministic schedule of what moves together.

    Attributes:
        chunks: offloaded chunks in parameter order; their moving bytes tile the host arena in this order.
        resident_chunks: chunks of the bundles kept on the device (``offload_fraction < 1``: the last bundles;
            ``resident_budget``: the first ones), in parameter order;
            their moving bytes tile one device buffer. They are staged and stepped like offloaded chunks, with
            device-to-device copies, so a failed step can roll them back too.
        bundles: every bundle, by parameter index.
        chunk_bytes: the requested chunk size in bytes.
        num_slots: staging slots on the device.
        workspace_nbytes: device memory a chunk's step takes beside the slots, at most (the caller's estimate,
            ``layout.step_workspace``; 0 from ``plan_chunks``).
    """

    chunks: tuple[Chunk, ...]
    resident_chunks: tuple[Chunk, ...]
    bundles: tuple[Bundle, ...]
    chunk_bytes: int
    num_slots: int
    workspace_nbytes: int = 0

    @property
    def all_chunks(self) -> tuple[Chunk, ...]:
        """Every chunk, in parameter order (the order a step runs them)."""
        if self.resident_chunks and self.chunks and self.resident_chunks[0].params[0] < self.chunks[0].params[0]:
            return self.resident_chunks + self.chunks
        return self.chunks + self.resident_chunks

    @property
    def host_nbytes(self) -> int:
        """Size of the host arena."""
        return max((c.home_offset + c.transfer_nbytes for c in self.chunks if c.home == Home.HOST), default=0)

    @property
    def tier_chunks(self) -> tuple[Chunk, ...]:
        """The offloaded chunks behind the host arena: in a tier's store, staged through bounce buffers."""
        return tuple(c for c in self.chunks if c.home != Home.HOST)

    @property
    def disk_chunks(self) -> tuple[Chunk, ...]:
        """The offloaded chunks whose home is a file ([Note: Disk tier])."""
        return tuple(c for c in self.chunks if c.home == Home.DISK)

    @property
    def disk_nbytes(self) -> int:
        """Bytes of the chunks' files."""
        return sum(c.transfer_nbytes for c in self.disk_chunks)

    @property
    def bounce_nbytes(self) -> int:
        """Bytes of one page-locked bounce buffer: the largest chunk behind the host, in whole pages (O_DIRECT writes
        them)."""
        return whole_pages(max((c.transfer_nbytes for c in self.tier_chunks), default=0))

    @property
    def resident_nbytes(self) -> int:
        """Size of the device buffer that holds the resident chunks between steps."""
        return max((c.home_offset + c.transfer_nbytes for c in self.resident_chunks), default=0)

    @property
    def resident_share(self) -> float:
        """Share of the state's bytes that stay resident on the device."""
        total = self.resident_nbytes + self.host_nbytes + sum(c.transfer_nbytes for c in self.tier_chunks)
        return self.resident_nbytes / total if total else 0.0

    @property
    def largest_bundle_nbytes(self) -> int:
        return max((b.device_nbytes for b in self.bundles), default=0)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one staging slot: the largest chunk."""
        return max((c.device_nbytes for c in self.all_chunks), default=0)

    @property
    def window_bound_nbytes(self) -> int:
        """The device memory a step takes beside the resident state, at most ([Note: Window bound]): ``num_slots``
        slots of the largest chunk, and the workspace of the chunk step that takes the most beside them."""
        return self.num_slots * self.slot_nbytes + self.workspace_nbytes

    def chunk_of(self, param_index: int) -> Chunk | None:
        for c in self.all_chunks:
            if param_index in c.params:
                return c
        return None

    def _tiers(self) -> dict[Home, list[Chunk]]:
        tiers: dict[Home, list[Chunk]] = {}
        for c in self.tier_chunks:
            tiers.setdefault(c.home, []).append(c)
        return tiers

    def summary(self) -> str:
        """A short human-readable description."""
        mib = 2**20
        lines = [
            f"ChunkPlan: {len(self.chunks)} offloaded chunks over {sum(len(c.params) for c in self.chunks)} params"
            f" + {len(self.resident_chunks)} resident chunks, host arena {self.host_nbytes / mib:.1f} MiB, "
            f"resident {self.resident_nbytes / mib:.1f} MiB, slot {self.slot_nbytes / mib:.1f} MiB x "
            f"{self.num_slots}, window bound {self.window_bound_nbytes / mib:.1f} MiB"
            + "".join(
                f", {len(cs)} chunks on {home} ({sum(c.transfer_nbytes for c in cs) / mib:.1f} MiB)"
                for home, cs in self._tiers().items()
            )
            + (f", bounce {self.bounce_nbytes / mib:.1f} MiB x {self.num_slots + 1}" if self.tier_chunks else "")
        ]
        for c in self.all_chunks:
            lines.append(
                f"  chunk {c.index} ({c.home}): params {c.params[0]}..{c.params[-1]} ({len(c.params)}), "
                f"moves {c.transfer_nbytes / mib:.2f} MiB, slot {c.device_nbytes / mib:.2f} MiB"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
