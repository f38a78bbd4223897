"""Stores: where a chunk's moving bytes live between steps, behind one interface (the storage seam), and the tiers
that add a store behind the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .host_arena import HostArena, typed_view
from .planner import Chunk, ChunkPlan, Home, TensorSpec

__all__ = ["DeviceStore", "HostStore", "IOStats", "InPlaceStore", "Store", "Tier"]


@dataclass
class IOStats:
    """What a store behind the host read and wrote (cumulative; ``StepStats`` reports a step's share)."""

    read_nbytes: int = 0
    written_nbytes: int = 0
    read_seconds: float = 0.0  # on the reader threads
    write_seconds: float = 0.0
    wait_seconds: float = 0.0  # the step waited for a read: the store's exposed time
    checksum_seconds: float = 0.0  # reads and writes waited for their checksums (their cost on the store's path)


class Store(Protocol):
    """Where the moving bytes of the chunks of one :class:`~chunked_offload.planner.Home` live between steps.

    [Note: Storage seam]
    Each chunk of a plan has a home (``Chunk.home``: the planner's rule), and each home one store (``Layout.stores``).
    Every part that touches a chunk's bytes goes through its store, which owns the chunk's whole trip:
    - between steps: the homes' views (``view``, and ``export`` for a state dict: a storage of the tensor's own),
      the bytes a placement writes (``region``), what it holds (``nbytes``) and ``trim`` (what the host wrote into
      the homes goes where the store keeps it; ``check``: the homes can be read, else why not);
    - in a step: ``begin_step`` (the chunks of this store the step will stage, in order: a store can read ahead),
      ``source`` (the bytes a stage copies to the device), ``landing`` (where the write-back lands; ``in_landing``
      finds one home tensor's bytes there), ``commit`` (the landed write-back becomes the chunk's state; a new memory
      for its homes, or None), ``release`` (a stage dropped or a chunk failed) and ``end_step``;
    - what it did: ``io`` (None for memory) and whether its copies cross the host-device link (``crosses_link``:
      telemetry counts them as H2D and D2H, and only such a write-back is held after a step in the backward).
    ``lands_apart`` tells the pipeline whether a chunk's landing is a buffer of the store's own rather than its homes:
    then a stage that is dropped waits for its H2D before ``release``, and the chunk is committed only once its
    write-back has landed and ``commit`` has returned. A tier behind the host (the disk: disk.py) is a store and a
    planner rule (a :class:`Tier`), not a branch in the pipeline; ``bounced.BouncedStore`` is the base for those that
    read into page-locked bounce buffers.
    """

    home: Home
    crosses_link: bool
    lands_apart: bool

    @property
    def nbytes(self) -> int: ...

    @property
    def io(self) -> IOStats | None: ...

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of flat uint8 memory of the homes from byte ``offset``."""
        ...

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """A tensor of ``spec`` at byte ``offset``: a home of one bundle tensor."""
        ...

    def export(self, home: torch.Tensor) -> torch.Tensor:
        """``home`` (one of this store's home views) on a storage of its own, for a state dict."""
        ...

    def check(self) -> str | None:
        """Why the homes cannot be read now (a failed check of the store's files), or None."""
        ...

    def trim(self, index: int | None = None) -> None:
        """What the host wrote into the homes (of chunk ``index``, or all) goes where the store keeps its bytes."""
        ...

    def begin_step(self, chunks: Sequence[Chunk]) -> None: ...

    def source(self, chunk: Chunk) -> torch.Tensor: ...

    def landing(self, chunk: Chunk) -> torch.Tensor: ...

    def in_landing(self, chunk: Chunk, home: torch.Tensor) -> torch.Tensor: ...

    def commit(self, chunk: Chunk) -> torch.Tensor | None: ...

    def release(self, chunk: Chunk) -> None: ...

    def end_step(self) -> None: ...

    def close(self) -> None: ...


class Tier(Protocol):
    """A store behind the host and the planner rule that gives it chunks ([Note: Storage seam]).

    ``assign`` moves offloaded chunks of a plan to ``home`` (before anything is allocated; raises ``ValueError`` when
    the plan cannot fit), ``check_room`` raises ``ValueError`` when a new store for such a plan has no room (before
    anything is allocated; a re-plan that keeps the tier's chunks as they were reuses its store and checks nothing),
    and ``open`` makes the store.
    """

    home: Home

    def assign(self, plan: ChunkPlan) -> ChunkPlan: ...

    def check_room(self, plan: ChunkPlan) -> None: ...

    def open(self, plan: ChunkPlan, pin: bool) -> Store: ...


class InPlaceStore:
    """A store whose homes are memory the copies read and write directly: no step I/O of its own."""

    lands_apart = False
    io: IOStats | None = None

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def export(self, home: torch.Tensor) -> torch.Tensor:
        return home

    def check(self) -> str | None:
        return None

    def trim(self, index: int | None = None) -> None:
        pass

    def begin_step(self, chunks: Sequence[Chunk]) -> None:
        pass

    def source(self, chunk: Chunk) -> torch.Tensor:
        return self.region(chunk.home_offset, chunk.transfer_nbytes)

    landing = source

    def in_landing(self, chunk: Chunk, home: torch.Tensor) -> torch.Tensor:
        return home

    def commit(self, chunk: Chunk) -> torch.Tensor | None:
        return None

    def release(self, chunk: Chunk) -> None:
        pass

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass


class HostStore(InPlaceStore):
    """The offloaded chunks: one exact-size host arena, page-locked on a GPU host ([Note: Registration pieces])."""

    home = Home.HOST
    crosses_link = True

    def __init__(self, arena: HostArena) -> None:
        self.arena = arena

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    @property
    def pinned_nbytes(self) -> int:
        return self.arena.nbytes if self.arena.pinned else 0

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.arena.region(offset, nbytes)

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        return self.arena.view(offset, spec)  # a storage of its own already


class DeviceStore(InPlaceStore):
    """The resident chunks: one device buffer (on the host between ``offload()`` and ``reload()``), or none."""

    home = Home.DEVICE
    crosses_link = False  # a step reloads the resident state first: its copies stay on the device

    def __init__(self, flat: torch.Tensor | None) -> None:
        self.flat = flat

    @property
    def nbytes(self) -> int:
        return 0 if self.flat is None else self.flat.numel()

    @property
    def device_nbytes(self) -> int:
        """The bytes held on the device (none after ``offload()``)."""
        return 0 if self.flat is None or self.flat.device.type == "cpu" else self.flat.numel()

    def _require(self) -> torch.Tensor:
        if self.flat is None:
            raise RuntimeError("the resident chunks have no memory; call opt.reload()")
        return self.flat

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._require()[offset : offset + nbytes]

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        return typed_view(self._require(), offset, spec)
