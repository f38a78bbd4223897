"""Layout: describe params as bundles, plan them, and give every bundle tensor a home in host or device memory."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from .adapters import Adapter, spec_of
from .dtensor import like_param, local, planning_weight, same_tensor
from .host_arena import HostArena, typed_view
from .masters import MASTER, REMAINDER, TIE_BITS, MasterMode, codec_workspace, master_specs, needs_master
from .planner import Bundle, Chunk, ChunkPlan, Home, Role, TensorSpec, dense_spec, plan_chunks
from .state_table import bind

__all__ = [
    "BACKUP",
    "IncompatibleStateError",
    "Layout",
    "ParamInfo",
    "Views",
    "chunk_views",
    "describe",
    "place",
    "plan_layout",
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
        homes: the home of every moving bundle tensor: a host view (offloaded chunks) or a device view (resident
            chunks).
        bound: what a state entry holds for each home between steps: the home, or for a DTensor param a DTensor
            over it (see :func:`like_param`).
        arena: the host arena holding the offloaded chunks.
        resident_flat: the memory of the resident chunks (on the device, or on the host after ``offload()``).
        group_signatures: the adapter's layout signature of each param group when this layout was planned.
    """

    plan: ChunkPlan
    infos: list[ParamInfo]
    homes: Views
    arena: HostArena
    resident_flat: torch.Tensor | None
    group_signatures: list[Hashable]
    bound: Views
    stale: str | None = None  # why the next step must re-plan (``relayout``)

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
        """Make ``flat`` (a copy of ``resident_flat`` elsewhere) the resident chunks' memory; rebind their entries."""
        for chunk in self.plan.resident_chunks:
            views = chunk_views(chunk, self.infos, flat, shift=-chunk.home_offset, roles=_MOVING)
            for i, new_homes in views.items():
                home, old_bound = self.homes[i], dict(self.bound[i])
                for key in list(home):
                    home[key] = new_homes[key]
                self.rebind(i)
                entry = state.get(self.infos[i].param)
                for key, held in old_bound.items():
                    if entry and entry.get(key) is held:
                        bind(entry, key, self.bound[i][key])
        self.resident_flat = flat


def stepped_like(p: torch.Tensor, mode: MasterMode) -> torch.Tensor:
    """A meta tensor like the tensor the inner optimizer steps for ``p``: its fp32 master, or ``p`` itself."""
    p = local(p)
    if needs_master(p, mode):
        spec = dense_spec(MASTER, Role.MASTER, p, torch.float32)
        return torch.empty_strided(spec.shape, spec.stride, dtype=torch.float32, device="meta")
    return torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=p.dtype, device="meta")


def describe(
    groups: Sequence[Mapping[str, Any]],
    state_of: Callable[[torch.Tensor], Mapping[str, Any] | None],
    adapter: Adapter,
    mode: MasterMode,
) -> list[ParamInfo]:
    """Every parameter's bundle: its state, its master tensors and its backup, checked against the inner optimizer.

    A param with state keeps its existing state (plus lazily created keys it lacks); one without gets the adapter's
    prediction for its group's hyperparameters.

    Raises:
        IncompatibleStateError: for a strict adapter, a param's state lacks a key the inner optimizer requires, or a
            state tensor has another shape or dtype than the inner optimizer would create. Nothing is modified.
    """
    infos: list[ParamInfo] = []
    for gi, group in enumerate(groups):
        for p in group["params"]:
            index = len(infos)
            predicted = adapter.predict_state(stepped_like(p, mode), dict(group))
            entry = state_of(p)
            if entry:
                existing = [spec_of(k, local(v)) for k, v in entry.items() if adapter.is_offloaded(k, v)]
                if adapter.strict:
                    _check_existing(index, p, entry, predicted, adapter.lazy_keys(dict(group)), adapter)
                keys = {s.key for s in existing}
                specs = existing + [s for s in predicted if s.key not in keys]
            else:
                specs = predicted
            shard = local(p)
            own = [*master_specs(shard, mode), dense_spec(BACKUP, Role.SCRATCH, shard, p.dtype)]
            all_specs = (*specs, *own)
            infos.append(ParamInfo(index, p, gi, all_specs, signature(p), planning_weight(p, all_specs)))
    return infos


def _check_existing(
    index: int,
    p: torch.Tensor,
    entry: Mapping[str, Any],
    predicted: list[TensorSpec],
    lazy: frozenset[str],
    adapter: Adapter,
) -> None:
    where = f"param {index} (shape {tuple(p.shape)}, dtype {p.dtype})"
    missing = sorted(s.key for s in predicted if s.key not in entry and s.key not in lazy)
    if missing:
        raise IncompatibleStateError(
            f"{where} has state {sorted(map(str, entry))} without {missing}, which {type(adapter.inner).__name__} "
            "needs with its current hyperparameters (for example amsgrad, momentum or centered switched on after "
            "the first step); plain torch raises KeyError here. Switch the hyperparameter back, or clear this "
            "param's state (opt.state[p].clear()) to start it afresh"
        )
    for s in predicted:
        value = entry.get(s.key)
        if isinstance(value, torch.Tensor):
            value = local(value)
        if isinstance(value, torch.Tensor) and (tuple(value.shape) != s.shape or value.dtype != s.dtype):
            raise IncompatibleStateError(
                f"{where} has state {s.key!r} of shape {tuple(value.shape)} and dtype {value.dtype}, but "
                f"{type(adapter.inner).__name__} steps it as shape {s.shape} and dtype {s.dtype} (the param was "
                "resized or converted after its state was created?); plain torch fails on this too. Convert the "
                "state to match, or clear this param's state (opt.state[p].clear())"
            )


def plan_layout(
    infos: list[ParamInfo],
    groups: Sequence[Mapping[str, Any]],
    adapter: Adapter,
    mode: MasterMode,
    *,
    chunk_bytes: int,
    num_slots: int,
    offload_fraction: float,
    gpu_budget: int | None = None,
) -> ChunkPlan:
    """The chunk plan of every parameter's bundle, with its window bound ([Note: Window bound]).

    With ``gpu_budget`` (bytes) the staging window comes first, and the longest prefix of params whose resident state
    fits in what the window leaves stays resident ([Note: What stays resident]).
    """
    bundles = [Bundle(info.index, info.specs, info.weight) for info in infos]

    def planned(**residency: Any) -> ChunkPlan:
        plan = plan_chunks(bundles, chunk_bytes=chunk_bytes, num_slots=num_slots, **residency)
        workspace = max((step_workspace(c, infos, groups, adapter, mode) for c in plan.all_chunks), default=0)
        return replace(plan, workspace_nbytes=workspace)

    if gpu_budget is None:
        return planned(offload_fraction=offload_fraction)
    plan = planned()  # everything offloaded: the window this budget must hold first
    if gpu_budget < plan.window_bound_nbytes:
        mib = 2**20
        raise ValueError(
            f"gpu_budget_mb={gpu_budget / mib:.2f} is below the staging window this plan needs "
            f"({num_slots} slots x {plan.slot_nbytes / mib:.2f} MiB, its largest chunk with chunk "
            f"{chunk_bytes / mib:.2f} MiB, + {plan.workspace_nbytes / mib:.2f} MiB of step workspace = "
            f"{plan.window_bound_nbytes / mib:.2f} MiB); raise gpu_budget_mb or lower chunk_size_mb"
        )
    resident_budget = gpu_budget - plan.window_bound_nbytes
    while True:  # a partial plan packs other chunks: shrink until its window and its resident state both fit
        plan = planned(resident_budget=resident_budget)
        if plan.resident_nbytes + plan.window_bound_nbytes <= gpu_budget or not plan.resident_chunks:
            return plan
        resident_budget = plan.resident_nbytes - 1


# [Note: Window bound]
# What a step takes on the device beside the resident state, at most: num_slots slots of the plan's largest chunk
# (a first step's fresh chunks, retained until their D2H, never take more than the slots would), plus the workspace
# of the chunk step that takes the most beside them: state the inner creates while the slots are held (a param's
# first step in a staged chunk), the master codec's temporaries (masters.codec_workspace), the inner's own
# temporaries (Adapter.workspace_nbytes: none for fused kernels, an estimate for the others) and the caching
# allocator's rounding of each block to 512 bytes. Measured on the H200 (tests/cuda: fused AdamW, fp32 and remainder
# masters, FSDP2) the peak stays under it with no allowance.
_BLOCK = 512


def step_workspace(
    chunk: Chunk, infos: list[ParamInfo], groups: Sequence[Mapping[str, Any]], adapter: Adapter, mode: MasterMode
) -> int:
    """Device bytes a chunk's step takes beside the slots, at most ([Note: Window bound]).

    State the inner creates while the slots are held (a param's first step, when its chunk is staged), the
    temporaries of the master codec and of the inner's own step, and the allocator's rounding of each block.
    """
    members = [infos[i] for i in chunk.params]
    codec = max((codec_workspace(local(m.param).numel(), mode) for m in members if m.has_master), default=0)
    stepped = [(dict(groups[m.group_index]), stepped_like(m.param, mode).nbytes) for m in members]
    blocks = sum(len(m.specs) for m in members) + 4 * len(members) + 16
    return chunk.state_nbytes + codec + adapter.workspace_nbytes(stepped) + blocks * _BLOCK


def place(
    plan: ChunkPlan,
    infos: list[ParamInfo],
    previous: Layout | None,
    group_signatures: list[Hashable],
    *,
    pin: bool,
    device: torch.device,
    mode: MasterMode,
) -> Layout:
    """Allocate host and resident memory for ``plan`` and carry wrapper-owned masters over from ``previous``.

    The previous arena is reused when every moving tensor keeps its host offset (no re-pinning, for example after
    a chunk-size change without masters). Inner-optimizer state is moved by :func:`rehome_state`. Nothing is
    modified if an allocation fails.
    """
    if previous is not None and _host_layout(plan) == _host_layout(previous.plan):
        arena = previous.arena
    else:
        arena = HostArena(plan.host_nbytes, pin=pin, boundaries=[c.home_offset for c in plan.chunks])
    resident_flat = None
    if plan.resident_chunks:
        resident_flat = torch.empty(plan.resident_nbytes, dtype=torch.uint8, device=device)
    homes: Views = {}
    for chunk in plan.all_chunks:
        for i in chunk.params:
            homes[i] = {}
            for s in infos[i].specs:
                if not s.role.moves:
                    continue
                offset = chunk.home_offset + chunk.offsets[(i, s.key)]
                if chunk.home is Home.HOST:
                    homes[i][s.key] = arena.view(offset, s)
                else:
                    homes[i][s.key] = typed_view(resident_flat, offset, s)  # type: ignore[arg-type]
    old_homes = {} if previous is None else {id(info.param): previous.homes[info.index] for info in previous.infos}
    for info in infos:
        if info.has_master:
            _seed_master(info, homes[info.index], old_homes.get(id(info.param)), mode)
    layout = Layout(plan, infos, homes, arena, resident_flat, group_signatures, {})
    for info in infos:
        layout.rebind(info.index)
    return layout


def rehome_state(state: Mapping[torch.Tensor, Any], layout: Layout) -> None:
    """Copy every offloadable state tensor that is not in its home yet into it, and bind the home in its place."""
    for info in layout.infos:
        entry = state.get(info.param)
        if not entry:
            continue
        for spec in info.state_specs:
            value, bound = entry.get(spec.key), layout.bound[info.index][spec.key]
            if value is not None and value is not bound:
                home = layout.homes[info.index][spec.key]
                if not same_tensor(local(value), home):
                    home.copy_(local(value))
                bind(entry, spec.key, bound)


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


def _host_layout(plan: ChunkPlan) -> list[tuple[int, str, int]]:
    """Where every moving tensor sits in the host arena: equal layouts can share one arena (no re-pinning)."""
    specs = {b.index: b.specs for b in plan.bundles}
    return [
        (i, s.key, c.home_offset + c.offsets[(i, s.key)])
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
            home[key].copy_(local(info.param).detach())
        else:
            home[key].zero_()  # the master equals the param exactly: remainder 0, no ties
