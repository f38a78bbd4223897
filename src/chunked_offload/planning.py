"""Planning: describe the params as bundles, plan their chunks, and place the plan in memory (a new layout)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from .adapters import Adapter, spec_of
from .dtensor import local, planning_weight
from .host_arena import HostArena
from .layout import BACKUP, IncompatibleStateError, Layout, ParamInfo, Views, signature, stepped_like
from .masters import MASTER, REMAINDER, TIE_BITS, MasterMode, codec_workspace, master_specs
from .planner import Bundle, Chunk, ChunkPlan, Home, Role, TensorSpec, dense_spec, plan_chunks
from .storage import DeviceStore, HostStore, Store, Tier

__all__ = ["describe", "place", "plan_layout", "step_workspace"]


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
        raise ValueError(_below_window(plan, infos, gpu_budget, chunk_bytes))
    resident_budget = gpu_budget - plan.window_bound_nbytes
    while True:  # a partial plan packs other chunks: shrink until its window and its resident state both fit
        plan = planned(resident_budget=resident_budget)
        if plan.resident_nbytes + plan.window_bound_nbytes <= gpu_budget or not plan.resident_chunks:
            return plan
        resident_budget = plan.resident_nbytes - 1


def _below_window(plan: ChunkPlan, infos: Sequence[ParamInfo], gpu_budget: int, chunk_bytes: int) -> str:
    """The refusal of a budget below the window: what the window is made of, and which knob moves it."""
    mib = 2**20
    largest = max(plan.all_chunks, key=lambda c: c.device_nbytes)
    window = (
        f"gpu_budget_mb={gpu_budget / mib:.2f} is below the staging window this plan needs ({plan.num_slots} slots x "
        f"{plan.slot_nbytes / mib:.2f} MiB + {plan.workspace_nbytes / mib:.2f} MiB of step workspace = "
        f"{plan.window_bound_nbytes / mib:.2f} MiB). "
    )
    if len(largest.params) == 1 and largest.device_nbytes > chunk_bytes:
        p = infos[largest.params[0]].param
        return window + (
            f"The slot is set by param {largest.params[0]} (shape {tuple(p.shape)}, {p.dtype}), whose state alone is "
            f"{largest.device_nbytes / mib:.2f} MiB, more than chunk_size_mb={chunk_bytes / mib:.2f}: a smaller "
            f"chunk_size_mb gives the same window. Raise gpu_budget_mb to at least "
            f"{plan.window_bound_nbytes / mib:.2f}, or lower num_slots (at least 1)"
        )
    return window + (
        f"The slot is set by chunk_size_mb={chunk_bytes / mib:.2f}: raise gpu_budget_mb to at least "
        f"{plan.window_bound_nbytes / mib:.2f}, lower chunk_size_mb, or lower num_slots (at least 1)"
    )


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
    tiers: Sequence[Tier] = (),
) -> Layout:
    """Allocate the stores of ``plan`` (host arena, resident buffer, those of the tiers behind the host) and carry
    wrapper-owned masters over from ``previous``.

    A previous store is reused where every moving tensor keeps its offset in it (no re-pinning after a chunk-size
    change without masters; no new files for a load of the wrapper's own checkpoint), and a tier checks its room
    for a new store before anything is allocated. Inner-optimizer state is moved by :func:`rehome_state`. Nothing is
    modified if an allocation fails.
    """
    stores = _stores(plan, previous, tiers, pin=pin, device=device)
    homes: Views = {}
    for chunk in plan.all_chunks:
        store = stores[chunk.home]
        for i in chunk.params:
            homes[i] = {}
            for s in infos[i].specs:
                if s.role.moves:
                    homes[i][s.key] = store.view(chunk.home_offset + chunk.offsets[(i, s.key)], s)
    old_homes = {} if previous is None else {id(info.param): previous.homes[info.index] for info in previous.infos}
    for chunk in plan.all_chunks:
        for i in chunk.params:
            if infos[i].has_master:
                _seed_master(infos[i], homes[i], old_homes.get(id(infos[i].param)), mode)
        stores[chunk.home].trim(chunk.index)  # one chunk's pages of a tier in memory at a time ([Note: Disk tier])
    layout = Layout(plan, infos, homes, stores, group_signatures, {})
    for info in infos:
        layout.rebind(info.index)
    return layout


def _stores(
    plan: ChunkPlan, previous: Layout | None, tiers: Sequence[Tier], *, pin: bool, device: torch.device
) -> dict[Home, Store]:
    """Each home's store for ``plan``: a previous one where its layout is the same, else a new one (the tiers check
    their room first)."""
    kept = {} if previous is None else {
        home: store for home, store in previous.stores.items()
        if home != Home.DEVICE and _store_layout(plan, home) == _store_layout(previous.plan, home)
    }  # fmt: skip
    opening = [t for t in tiers if t.home not in kept and any(c.home == t.home for c in plan.chunks)]
    for tier in opening:
        tier.check_room(plan)
    host = kept.get(Home.HOST)
    if host is None:
        host_chunks = [c for c in plan.chunks if c.home == Home.HOST]
        host = HostStore(HostArena(plan.host_nbytes, pin=pin, boundaries=[c.home_offset for c in host_chunks]))
    flat = torch.empty(plan.resident_nbytes, dtype=torch.uint8, device=device) if plan.resident_chunks else None
    stores: dict[Home, Store] = {Home.HOST: host, Home.DEVICE: DeviceStore(flat)}
    stores.update({h: s for h, s in kept.items() if h != Home.HOST and any(c.home == h for c in plan.chunks)})
    try:
        for tier in opening:
            stores[tier.home] = tier.open(plan, pin)
        if missing := {c.home for c in plan.chunks} - set(stores):
            raise RuntimeError(f"the plan has chunks on {sorted(missing)}, which no tier of this wrapper stores")
    except BaseException:
        for tier in opening:
            if tier.home in stores:
                stores[tier.home].close()
        raise
    return stores


def _store_layout(plan: ChunkPlan, home: Home) -> list[tuple[int, int, str, int, int]]:
    """Where every moving tensor of the chunks of ``home`` sits in its store: equal layouts can share one store (a
    tier's, chunk by chunk: its chunks keep their index and size)."""
    specs = {b.index: b.specs for b in plan.bundles}
    whole = home == Home.HOST  # one arena: chunks may be renumbered
    return [
        (-1 if whole else c.index, i, s.key, c.home_offset + c.offsets[(i, s.key)], 0 if whole else c.transfer_nbytes)
        for c in plan.chunks
        if c.home == home
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
