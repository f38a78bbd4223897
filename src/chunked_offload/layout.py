"""Layout: every param's bundle and where each of its tensors lives between steps (its home, in a store)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .adapters import Adapter
from .dtensor import like_param, local, same_tensor
from .host_arena import typed_view
from .masters import MASTER, MasterMode, needs_master
from .planner import Chunk, ChunkPlan, Home, Role, TensorSpec, dense_spec
from .state_table import bind
from .storage import DeviceStore, HostStore, Store

__all__ = [
    "BACKUP",
    "IncompatibleStateError",
    "Layout",
    "ParamInfo",
    "Views",
    "chunk_views",
    "rehome_state",
    "signature",
    "stale_reason",
    "stepped_like",
]

_MOVING = tuple(role for role in Role if role.moves)  # what a home holds: scratch lives in the slots only

# Per parameter index: spec key -> tensor. Device views while a chunk runs, home views between steps.
Views = dict[int, dict[str, torch.Tensor]]

# The param's own bytes, copied into the slot before its step so that a failed chunk can be rolled back.
BACKUP = "~backup"

Signature = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


class IncompatibleStateError(RuntimeError, KeyError):
    """Existing state that the inner optimizer cannot step (plain torch fails on it too, often with a KeyError)."""

    def __str__(self) -> str:
        return str(self.args[0])


def signature(p: torch.Tensor) -> Signature:
    """What the plan assumed about a param: shape, strides, dtype and device."""
    return (tuple(p.shape), tuple(p.stride()), p.dtype, p.device)


@dataclass(frozen=True)
class ParamInfo:
    """A parameter and what the wrapper knows about it.

    Attributes:
        index: position in ``param_groups`` order.
        param: the parameter.
        group_index: the param group it belongs to.
        specs: its bundle's tensors (of the local shard, for a DTensor param).
        signature: the param's shape, strides, dtype and device when it was planned.
        weight: bytes it counts for when packing chunks, where that is not its real bytes (see
            :func:`planning_weight`).
    """

    index: int
    param: torch.Tensor
    group_index: int
    specs: tuple[TensorSpec, ...]
    signature: Signature
    weight: int | None = None

    @cached_property  # read per param per chunk on every step; specs never change
    def state_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(s for s in self.specs if s.role is Role.STATE)

    @cached_property
    def state_keys(self) -> frozenset[str]:
        return frozenset(s.key for s in self.state_specs)

    @cached_property
    def has_master(self) -> bool:
        return any(s.key == MASTER for s in self.specs)


@dataclass
class Layout:
    """Where every bundle tensor lives between steps.

    Attributes:
        plan: the chunk plan.
        infos: every parameter, by index.
        homes: the home of every moving bundle tensor: a view of its chunk's store.
        stores: each home's store ([Note: Storage seam] in storage.py): the host arena, the resident chunks' device
            buffer (on the host after ``offload()``), and those of the tiers behind the host.
        group_signatures: the adapter's layout signature of each param group when this layout was planned.
        bound: what a state entry holds for each home between steps: the home, or for a DTensor param a DTensor
            over it (see :func:`like_param`).
    """

    plan: ChunkPlan
    infos: list[ParamInfo]
    homes: Views
    stores: dict[Home, Store]
    group_signatures: list[Hashable]
    bound: Views
    stale: str | None = None  # why the next step must re-plan (``relayout``)

    @property
    def host(self) -> HostStore:
        store = self.stores[Home.HOST]
        assert isinstance(store, HostStore)
        return store

    @property
    def resident(self) -> DeviceStore:
        store = self.stores[Home.DEVICE]
        assert isinstance(store, DeviceStore)
        return store

    def store(self, chunk: Chunk) -> Store:
        """Where ``chunk``'s moving bytes live between steps ([Note: Storage seam] in storage.py)."""
        return self.stores[chunk.home]

    def commit(self, chunk: Chunk, state: Mapping[torch.Tensor, Any]) -> None:
        """The chunk's landed write-back becomes its state in its store; its homes move with it if the store says so
        (and the entries that held them are rebound)."""
        flat = self.stores[chunk.home].commit(chunk)
        if flat is not None:
            self.move_chunk(chunk, flat, state)

    def check(self) -> None:
        """Raise if a store's homes cannot be read ([Note: Chunk integrity] in bounced.py)."""
        for store in self.stores.values():
            if (why := store.check()) is not None:
                raise RuntimeError(f"the optimizer state cannot be read: {why}")

    def rebind(self, index: int) -> None:
        """Recompute what entries hold for param ``index`` after its homes moved."""
        param = self.infos[index].param
        self.bound[index] = {key: like_param(home, param) for key, home in self.homes[index].items()}

    def relayout(self, index: int, key: str, stride: tuple[int, ...]) -> torch.Tensor:
        """View a home's bytes with other (dense) strides, which the inner optimizer gave the state; the layout is
        stale from then on, so that the next step re-plans with them."""
        home = self.homes[index][key]
        self.homes[index][key] = home.as_strided(home.shape, stride)
        self.rebind(index)
        self.stale = f"state {key!r} of param {index} took the layout of its grad"
        return self.homes[index][key]

    def move_resident(self, flat: torch.Tensor, state: Mapping[torch.Tensor, Any]) -> None:
        """Make ``flat`` (a copy of the resident store's memory elsewhere) the resident chunks' memory; rebind their
        entries."""
        for chunk in self.plan.resident_chunks:
            self.move_chunk(chunk, flat, state, shift=-chunk.home_offset)
        self.resident.flat = flat

    def move_chunk(self, chunk: Chunk, flat: torch.Tensor, state: Mapping[torch.Tensor, Any], shift: int = 0) -> None:
        """Make ``flat`` (from byte ``-shift``) the memory of ``chunk``'s homes; rebind the entries that held them."""
        views = chunk_views(chunk, self.infos, flat, shift=shift, roles=_MOVING)
        for i, new_homes in views.items():
            home, old_bound = self.homes[i], dict(self.bound[i])
            for key in list(home):
                home[key] = new_homes[key]
            self.rebind(i)
            entry = state.get(self.infos[i].param)
            for key, held in old_bound.items():
                if entry and entry.get(key) is held:
                    bind(entry, key, self.bound[i][key])


def stepped_like(p: torch.Tensor, mode: MasterMode) -> torch.Tensor:
    """A meta tensor like the tensor the inner optimizer steps for ``p``: its fp32 master, or ``p`` itself."""
    p = local(p)
    if needs_master(p, mode):
        spec = dense_spec(MASTER, Role.MASTER, p, torch.float32)
        return torch.empty_strided(spec.shape, spec.stride, dtype=torch.float32, device="meta")
    return torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=p.dtype, device="meta")


def rehome_state(state: Mapping[torch.Tensor, Any], layout: Layout) -> None:
    """Copy every offloadable state tensor that is not in its home yet into it, and bind the home in its place."""
    for chunk in layout.plan.all_chunks:
        for i in chunk.params:
            info = layout.infos[i]
            entry = state.get(info.param)
            if not entry:
                continue
            for spec in info.state_specs:
                value, bound = entry.get(spec.key), layout.bound[i][spec.key]
                if value is not None and value is not bound:
                    home = layout.homes[i][spec.key]
                    if not same_tensor(local(value), home):
                        home.copy_(local(value))
                    bind(entry, spec.key, bound)
        layout.store(chunk).trim(chunk.index)  # one chunk's pages of a tier in memory at a time ([Note: Disk tier])


def stale_reason(
    layout: Layout,
    groups: Sequence[Mapping[str, Any]],
    state: Mapping[torch.Tensor, Any],
    adapter: Adapter,
) -> str | None:
    """Why ``layout`` no longer fits the inner optimizer, or None: the per-step check, before anything is modified.

    The layout is stale when the params changed (added, removed, reordered, resized, converted), a state tensor is
    not its home (assigned by hand, or a state container swapped in), or the hyperparameters now predict other
    state for params that have none yet.
    """
    if layout.stale is not None:
        return layout.stale
    infos, bound = layout.infos, layout.bound
    position = 0
    for gi, group in enumerate(groups):
        params = group["params"]
        if gi >= len(layout.group_signatures) or adapter.layout_signature(dict(group)) != layout.group_signatures[gi]:
            return f"param group {gi} was added, or its hyperparameters now create other state"
        for p in params:
            if position >= len(infos) or infos[position].param is not p:
                return "param_groups changed"
            info = infos[position]
            position += 1
            if signature(p) != info.signature:
                return f"param {info.index} changed its shape, strides, dtype or device"
            entry = state.get(p)
            if not entry:
                continue
            held = bound[info.index]
            for k, v in entry.items():
                if adapter.is_offloaded(k, v) and held.get(k) is not v:
                    return f"state {k!r} of param {info.index} was replaced"
    if position != len(infos):
        return "param_groups changed"
    return None


def chunk_views(
    chunk: Chunk, infos: list[ParamInfo], flat: torch.Tensor, shift: int = 0, roles: tuple[Role, ...] | None = None
) -> Views:
    """Typed views of every tensor of ``chunk`` in ``flat`` (which starts at chunk byte ``shift``).

    ``flat`` is a uint8 buffer whose size is a multiple of the planner's alignment; one reinterpretation per dtype
    serves all of its tensors, so a view costs one ``as_strided``.
    """
    by_dtype: dict[torch.dtype, torch.Tensor] = {}
    views: Views = {}
    for i in chunk.params:
        views[i] = {}
        for s in infos[i].specs:
            if roles is not None and s.role not in roles:
                continue
            offset = chunk.offsets[(i, s.key)] - shift
            if s.numel == 0 or flat.numel() % s.dtype.itemsize:
                views[i][s.key] = typed_view(flat, offset, s)
                continue
            base = by_dtype.get(s.dtype)
            if base is None:
                base = by_dtype[s.dtype] = flat.view(s.dtype)
            views[i][s.key] = base.as_strided(s.shape, s.stride, base.storage_offset() + offset // s.dtype.itemsize)
    return views
