"""Layout: describe params as bundles, plan them, and give every bundle tensor a home in host or device memory."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .adapters import Adapter, spec_of
from .host_arena import HostArena, typed_view
from .masters import MASTER, REMAINDER, TIE_BITS, MasterMode, master_specs, needs_master
from .planner import Bundle, Chunk, ChunkPlan, Role, TensorSpec, plan_chunks

__all__ = ["Layout", "ParamInfo", "Views", "chunk_views", "describe", "place", "rehome_state", "stepped_like"]

# Per parameter index: spec key -> tensor. Device views while a chunk runs, host views ("homes") between steps.
Views = dict[int, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class ParamInfo:
    """A parameter and what the wrapper knows about it.

    Attributes:
        index: position in ``param_groups`` order.
        param: the parameter.
        group_index: the param group it belongs to.
        specs: its bundle's tensors.
    """

    index: int
    param: torch.Tensor
    group_index: int
    specs: tuple[TensorSpec, ...]

    @cached_property  # read per param per chunk on every step; specs never change
    def state_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(s for s in self.specs if s.role is Role.STATE)

    @cached_property
    def has_master(self) -> bool:
        return any(s.key == MASTER for s in self.specs)


@dataclass
class Layout:
    """Where every bundle tensor lives between steps.

    Attributes:
        plan: the chunk plan.
        infos: every parameter, by index.
        homes: host views (offloaded params) or device views (resident params) of every bundle tensor; scratch
            tensors have homes only for resident params.
        arena: the host arena holding the offloaded chunks.
        resident_flat: device memory of the resident chunk, or None.
    """

    plan: ChunkPlan
    infos: list[ParamInfo]
    homes: Views
    arena: HostArena
    resident_flat: torch.Tensor | None


def stepped_like(p: torch.Tensor, mode: MasterMode) -> torch.Tensor:
    """A meta tensor like the tensor the inner optimizer steps for ``p``: its fp32 master, or ``p`` itself."""
    dtype = torch.float32 if needs_master(p, mode) else p.dtype
    return torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=dtype, device="meta")


def describe(inner: torch.optim.Optimizer, adapter: Adapter, mode: MasterMode) -> list[ParamInfo]:
    """Every parameter's bundle: its existing state (or the adapter's prediction), plus its master tensors."""
    infos: list[ParamInfo] = []
    for gi, group in enumerate(inner.param_groups):
        for p in group["params"]:
            state = inner.state.get(p)
            if state:
                specs = [spec_of(k, v) for k, v in state.items() if adapter.is_offloaded(k, v)]
            else:
                specs = adapter.predict_state(stepped_like(p, mode), group)
            infos.append(ParamInfo(len(infos), p, gi, tuple(specs) + tuple(master_specs(p, mode))))
    return infos


def plan_layout(infos: list[ParamInfo], *, chunk_bytes: int, num_slots: int, offload_fraction: float) -> ChunkPlan:
    """The chunk plan of every parameter's bundle."""
    bundles = [Bundle(info.index, info.specs) for info in infos]
    return plan_chunks(bundles, chunk_bytes=chunk_bytes, num_slots=num_slots, offload_fraction=offload_fraction)


def place(
    plan: ChunkPlan,
    infos: list[ParamInfo],
    previous: Layout | None,
    *,
    pin: bool,
    device: torch.device,
    mode: MasterMode,
) -> Layout:
    """Allocate host and resident memory for ``plan`` and carry wrapper-owned masters over from ``previous``.

    The previous arena is reused when every moving tensor keeps its host offset (no re-pinning, for example after
    a chunk-size change without masters). Inner-optimizer state is moved by :func:`rehome_state`.
    """
    if previous is not None and _host_layout(plan) == _host_layout(previous.plan):
        arena = previous.arena
    else:
        arena = HostArena(plan.host_nbytes, pin=pin)
    homes: Views = {}
    for chunk in plan.chunks:
        for i in chunk.params:
            homes[i] = {
                s.key: arena.view(chunk.host_offset + chunk.offsets[(i, s.key)], s)
                for s in infos[i].specs
                if s.role.moves
            }
    resident_flat = None
    if plan.resident is not None:
        resident_flat = torch.empty(plan.resident.device_nbytes, dtype=torch.uint8, device=device)
        homes.update(chunk_views(plan.resident, infos, resident_flat))
    old_homes = {} if previous is None else {id(info.param): previous.homes[info.index] for info in previous.infos}
    for info in infos:
        if info.has_master:
            _seed_master(info, homes[info.index], old_homes.get(id(info.param)), mode)
    return Layout(plan, infos, homes, arena, resident_flat)


def rehome_state(inner: torch.optim.Optimizer, infos: list[ParamInfo], homes: Views) -> None:
    """Copy every offloadable state tensor that is not in its home yet into it, and bind the home in its place."""
    for info in infos:
        state = inner.state.get(info.param)
        if not state:
            continue
        for spec in info.state_specs:
            value, home = state.get(spec.key), homes[info.index][spec.key]
            if value is not None and value is not home:
                home.copy_(value)
                state[spec.key] = home


def chunk_views(
    chunk: Chunk, infos: list[ParamInfo], flat: torch.Tensor, shift: int = 0, roles: tuple[Role, ...] | None = None
) -> Views:
    """Typed views of every tensor of ``chunk`` in ``flat`` (which starts at chunk byte ``shift``)."""
    return {
        i: {
            s.key: typed_view(flat, chunk.offsets[(i, s.key)] - shift, s)
            for s in infos[i].specs
            if roles is None or s.role in roles
        }
        for i in chunk.params
    }


def _host_layout(plan: ChunkPlan) -> list[tuple[int, str, int]]:
    """Where every moving tensor sits in the host arena: equal layouts can share one arena (no re-pinning)."""
    specs = {b.index: b.specs for b in plan.bundles}
    return [
        (i, s.key, c.host_offset + c.offsets[(i, s.key)])
        for c in plan.chunks
        for i in c.params
        for s in specs[i]
        if s.role.moves
    ]


def _seed_master(
    info: ParamInfo, home: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None, mode: MasterMode
) -> None:
    """Fill a param's master in a fresh layout: from its previous home, or from the param (exact upcast)."""
    keys = [MASTER] if mode is MasterMode.FP32 else [REMAINDER, TIE_BITS]
    for key in keys:
        if old is not None and key in old:
            home[key].copy_(old[key])
        elif key == MASTER:
            home[key].copy_(info.param.detach().to(home[key].device))
        else:
            home[key].zero_()  # the master equals the param exactly: remainder 0, no ties
