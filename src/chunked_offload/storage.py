"""Stores: where a chunk's moving bytes live between steps, behind one small interface (the storage seam)."""

from __future__ import annotations

from typing import Protocol

import torch

from .host_arena import HostArena, typed_view
from .planner import Home, TensorSpec

__all__ = ["DeviceStore", "HostStore", "Store", "stores_by_home"]


class Store(Protocol):
    """Where the moving bytes of the chunks of one :class:`~chunked_offload.planner.Home` live between steps.

    [Note: Storage seam]
    Each chunk of a plan has a home (``Chunk.home``: the planner's rule), and each home one store. The parts that move
    a chunk's bytes go through its store: the homes' views (``view``), the ranges a stage and a write-back copy
    (``region``), whether those copies cross the host-device link (``crosses_link``: telemetry counts them as H2D and
    D2H, and only such a write-back is held after a step in the backward) and the bytes it holds (``nbytes``). A new
    tier (a disk behind the host) is then a store and a planner rule, not a branch in each part.
    """

    home: Home

    @property
    def crosses_link(self) -> bool:
        """Whether copies between this store and a staging slot cross the host-device link."""
        ...

    @property
    def nbytes(self) -> int: ...

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of flat uint8 memory from byte ``offset``: what one chunk's copy reads or writes."""
        ...

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """A tensor of ``spec`` at byte ``offset``: a home of one bundle tensor."""
        ...


class HostStore:
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
        return self.arena.view(offset, spec)


class DeviceStore:
    """The resident chunks: one device buffer (on the host between ``offload()`` and ``reload()``), or none."""

    home = Home.DEVICE

    def __init__(self, flat: torch.Tensor | None) -> None:
        self.flat = flat

    @property
    def crosses_link(self) -> bool:
        return False  # a step reloads the resident state first: its copies stay on the device

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


def stores_by_home(host: HostStore, resident: DeviceStore, disk: Store | None = None) -> dict[Home, Store]:
    """Each home's store: the planner's rule gives a chunk its home, this gives the home its memory."""
    stores: dict[Home, Store] = {Home.HOST: host, Home.DEVICE: resident}
    if disk is not None:
        stores[Home.DISK] = disk  # a DiskStore (disk.py): [Note: Disk tier]
    return stores
