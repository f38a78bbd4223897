"""Placement: the layout's lifecycle (build, re-plan, offload, reload, re-home) and the state table's binding."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .adapters import Adapter, check_groups
from .checks import check_params, check_sharding
from .dtensor import like_param, local
from .gate import StepGate
from .layout import IncompatibleStateError, Layout, ParamInfo, rehome_state, stale_reason
from .masters import MasterMode, needs_master, read_master, write_master
from .pipeline import ChunkPipeline
from .planner import ChunkPlan
from .planning import describe, place, plan_layout
from .state_table import StateBinding, StateTable
from .stepping import ChunkStepper
from .storage import Tier
from .transfer import MoveHandle, TransferEngine

__all__ = ["PlanOptions", "Placement", "Prepared"]

logger = logging.getLogger(__name__)

_MIB = 2**20


@dataclass(frozen=True)
class PlanOptions:
    """What the chunk plan is made from, besides the params and their state (the wrapper's options, in bytes)."""

    chunk_bytes: int
    num_slots: int
    offload_fraction: float
    gpu_budget: int | None  # device bytes the wrapper may hold; None: by ``offload_fraction``
    tiers: tuple[Tier, ...] = ()  # the stores behind the host and their planner rules ([Note: Storage seam])


@dataclass
class Prepared:
    """A layout built for given groups and state, not installed yet."""

    infos: list[ParamInfo]
    layout: Layout
    new_memory: bool


class Placement:
    """Owns where every bundle tensor lives, from one step to the next.

    [Note: Layout lifecycle]
    ``build`` describes the params, plans the chunks and places the homes (host arena, resident device buffer) for
    given groups and state without modifying the optimizer; ``install`` moves every state tensor into its new home
    and binds the pipeline to the layout. ``sync``, before every step and every read or write of the state, checks
    cheaply that the layout still fits (``layout.stale_reason``) and re-plans (or refuses, before anything is
    modified) when it does not. ``offload``/``reload`` move the resident state between device and host memory and
    re-home it. The state table absorbs assigned tensors into the homes through ``binding`` ([Note: Absorbing
    writes]).

    Args:
        inner: the wrapped optimizer.
        adapter: its adapter.
        mode: the master-weights mode.
        options: planning options.
        device: the params' device.
        pin: page-lock the host arena.
        binding: the state table's binding to the homes.
        pipeline: the chunk pipeline (drained before homes move; bound to each new layout).
        gate: the step stream's events (forgotten when the layout changes).

    Attributes:
        offloaded: whether ``offload()`` moved the resident state to the host (until ``reload()``, or a re-plan
            that places it on the device again); the runner reads it to move the phase.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        adapter: Adapter,
        mode: MasterMode,
        options: PlanOptions,
        *,
        device: torch.device,
        pin: bool,
        binding: StateBinding,
        pipeline: ChunkPipeline,
        gate: StepGate,
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.mode = mode
        self.options = options
        self.device = device
        self.pin = pin
        self.binding = binding
        self.pipeline = pipeline
        self.gate = gate
        self.offloaded = False
        self.layout: Layout | None = None
        self.last_move = MoveHandle()

    def set_budget(self, budget: int | None) -> int | None:
        """Plan with ``budget`` device bytes from the next re-plan on; returns the budget it replaces."""
        before = self.options.gpu_budget
        self.options = replace(self.options, gpu_budget=budget)
        return before

    @property
    def engine(self) -> TransferEngine:
        return self.pipeline.engine

    def require(self) -> Layout:
        if self.layout is None:
            raise RuntimeError("the chunk plan has not been built")
        return self.layout

    @property
    def plan(self) -> ChunkPlan:
        return self.require().plan

    @property
    def infos(self) -> list[ParamInfo]:
        return self.require().infos

    def stepped_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype the inner optimizer steps for ``p``: fp32 under a wrapper master, else the param's own."""
        return torch.float32 if needs_master(p, self.mode) else p.dtype

    # ------------------------------------------------------------------ building and installing
    def adopt_state(self) -> None:
        """Make the inner's ``state`` this wrapper's :class:`StateTable` (after a swap by the inner or a user)."""
        state = self.inner.state
        if not (isinstance(state, StateTable) and state.binding is self.binding):
            self.inner.state = StateTable(self.binding, list(state.items()))  # type: ignore[assignment]
            self.binding.dirty = True

    def install_first(self) -> None:
        """Adopt the inner's state and install the first layout; on failure the inner is as it was."""
        original_state = self.inner.state
        try:
            self.adopt_state()
            self.install(self.build(self.inner.param_groups, self.inner.state))
        except BaseException:
            self.inner.state = original_state  # nothing was copied anywhere
            raise

    def sync(self, *, force: bool = False, strict: bool = True) -> bool:
        """Bring the layout in line with the inner optimizer before anything is modified ([Note: Absorbing writes]);
        whether a new layout was installed.

        With ``strict=False`` (reading a state dict) state the inner optimizer could not step is reported as it is,
        with the current layout, instead of raising.
        """
        self.adopt_state()
        groups = self.inner.param_groups
        layout = self.require()
        reason = "forced" if force else None
        if self.binding.dirty:
            reason = "state was assigned that does not fit its home"
        reason = reason or stale_reason(layout, groups, self.inner.state, self.adapter)
        if reason is None:
            return False
        logger.debug("re-planning: %s", reason)
        check_groups(self.inner)
        check_params(groups)
        check_sharding(groups, self.adapter)
        try:
            prepared = self.build(groups, self.inner.state)
        except IncompatibleStateError:
            if strict:
                raise
            return False
        self.install(prepared)
        return True

    def build(self, groups: Sequence[Mapping[str, Any]], state: Mapping[torch.Tensor, Any]) -> Prepared:
        """Describe, plan and place a layout for ``groups`` and ``state``; modifies nothing of the optimizer."""
        options = self.options
        infos = describe(groups, state.get, self.adapter, self.mode)
        plan = plan_layout(
            infos,
            groups,
            self.adapter,
            self.mode,
            chunk_bytes=options.chunk_bytes,
            num_slots=options.num_slots,
            offload_fraction=options.offload_fraction,
            gpu_budget=options.gpu_budget,
        )
        for tier in options.tiers:
            plan = tier.assign(plan)  # before anything is allocated
        signatures = [self.adapter.layout_signature(dict(g)) for g in groups]
        old = self.layout
        same_params = (
            old is not None
            and len(old.infos) == len(infos)
            and all(a.param is b.param for a, b in zip(old.infos, infos, strict=True))  # identity: == compares values
        )
        reusable = old is not None and old.stale is None and not self.offloaded
        if old is not None and reusable and same_params and plan == old.plan:
            same = Layout(plan, infos, old.homes, old.stores, signatures, old.bound)
            return Prepared(infos, same, False)
        self.pipeline.drain()  # the previous layout's homes are read below; no write-back may still be in flight
        layout = place(
            plan, infos, old, signatures, pin=self.pin, device=self.device, mode=self.mode, tiers=options.tiers
        )
        return Prepared(infos, layout, True)

    def install(self, prepared: Prepared) -> None:
        """Switch to a prepared layout: move every state tensor into its new home."""
        self.pipeline.ahead.drop()
        self.pipeline.drain()
        self.gate.clear()
        layout = prepared.layout
        rehome_state(self.inner.state, layout)
        if prepared.new_memory:
            self.offloaded = False  # the new layout placed the resident state on the device
        self.layout = layout
        binding = self.binding
        binding.homes, binding.bound = layout.homes, layout.bound
        binding.index_by_id = {id(info.param): info.index for info in prepared.infos}
        binding.dirty = False
        self.pipeline.bind(layout, ChunkStepper(self.inner, self.adapter, self.mode, layout))

    def trim(self) -> None:
        """What the host wrote into the homes goes where each store keeps its bytes ([Note: Storage seam]); placing
        and re-homing do it chunk by chunk, a load after writing the masters."""
        if self.layout is not None:
            for store in self.layout.stores.values():
                store.trim()

    # ------------------------------------------------------------------ offload / reload
    def offload(self, non_blocking: bool) -> MoveHandle:
        """Move the resident state to page-locked host memory on a copy stream and re-home it there."""
        if self.offloaded:
            return self.last_move
        self.pipeline.ahead.drop()
        return self._move_resident(True, non_blocking)

    def reload(self, non_blocking: bool) -> MoveHandle:
        """Bring the resident state back to the device on a copy stream; the caller's stream is ordered after it."""
        if not self.offloaded:
            return self.last_move
        return self._move_resident(False, non_blocking)

    def _move_resident(self, offload: bool, non_blocking: bool) -> MoveHandle:
        layout = self.require()
        handle = MoveHandle()
        flat = layout.resident.flat
        target = torch.device("cpu") if offload else self.device
        if flat is not None and flat.device != target:
            pin = self.pin and target.type == "cpu"
            moved = torch.empty(flat.numel(), dtype=torch.uint8, device=target, pin_memory=pin)
            handle = self.engine.move(moved, flat)
            layout.move_resident(moved, self.inner.state)
        self.offloaded = offload
        self.last_move = handle.wait() if not non_blocking else handle
        return handle

    def synchronize(self) -> None:
        """Block until every enqueued write-back into the homes has landed (the homes can be read)."""
        self.gate.synchronize()
        self.pipeline.synchronize()

    # ------------------------------------------------------------------ masters
    def masters(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, fp32 master)`` of every param with a wrapper-owned master, read from its home."""
        for info in self.infos:
            if info.has_master:
                yield info.param, self.read_master(info)

    def info_of(self, param: torch.Tensor) -> ParamInfo | None:
        """The info of one of the wrapper's params (by identity), or None."""
        index = self.binding.index_of(param)
        return None if index is None or self.infos[index].param is not param else self.infos[index]

    def read_master(self, info: ParamInfo) -> torch.Tensor:
        """A param's master (of its local shard, for a DTensor param) as the next step will use it."""
        return read_master(self.require().homes[info.index], local(info.param), self.mode)

    def write_master(self, info: ParamInfo, master: torch.Tensor) -> None:
        """Set a param's master and the param itself (``master`` of its local shard, or a DTensor)."""
        write_master(self.require().homes[info.index], local(info.param), local(master), self.mode)

    def exported(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """``value`` for a state dict: a home of param ``index`` on a storage of its own (``Store.export``: a
        ``torch.save`` of it writes nothing else of its store), anything else as it is."""
        layout = self.require()
        tensor = local(value)
        chunk = layout.plan.chunk_of(index)
        if chunk is None or not any(tensor is home for home in layout.homes[index].values()):
            return value
        own = layout.store(chunk).export(tensor)
        return value if own is tensor else like_param(own, value)

    # ------------------------------------------------------------------ figures
    @property
    def resident_device_bytes(self) -> int:
        return self.require().resident.device_nbytes

    @property
    def pinned_host_bytes(self) -> int:
        return self.require().host.pinned_nbytes
