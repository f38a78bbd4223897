"""Wiring: a wrapper's parts, built from its checked options in the order they depend on each other."""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .adapters import Adapter
from .budget import auto_budget, budget_options
from .callbacks import prepare_for_dynamo
from .context import StepContext
from .disk import DiskTier
from .gate import StepGate
from .grad_hooks import GradHooks
from .hooks import HookSet
from .masters import MasterMode
from .mode import StepMode
from .notices import Notices, warn
from .phase import PhaseMachine
from .pipeline import ChunkPipeline
from .placement import Placement, PlanOptions
from .runner import StepRunner
from .schedule import StepSchedule
from .spill import auto_host_budget, check_spill_dir
from .staging import StagingPool
from .state_table import StateBinding
from .storage import Tier
from .streams import StreamContext
from .tier_dirs import reclaim_stale
from .transfer import TransferEngine
from .waits import StepWaits

__all__ = ["Options", "Parts", "build_parts"]

_MIB = 2**20


@dataclass(frozen=True)
class Options:
    """A wrapper's options, checked (``checks.check_options``), in the units the parts use.

    Attributes:
        plan: what the chunk plan is made from (bytes).
        masters: the master-weights mode.
        mode: the step mode.
        pin: page-lock the host arena.
        headroom: with ``gpu_budget_mb="auto"``, the bytes left free beside the measured peak; else None.
        budget_mb: ``gpu_budget_mb`` as the wrapper shows it (a number of MiB, "auto" or None).
        headroom_mb: ``gpu_headroom_mb`` as the wrapper shows it (with "auto": the default if not given).
    """

    plan: PlanOptions
    masters: MasterMode
    mode: StepMode
    pin: bool
    headroom: int | None
    budget_mb: float | str | None
    headroom_mb: float | None

    @classmethod
    def parse(
        cls,
        device: torch.device,
        *,
        chunk_size_mb: float,
        offload_fraction: float | None,
        num_slots: int,
        pin_memory: bool | None,
        master_weights: str,
        gpu_budget_mb: float | str | None,
        overlap: bool,
        step_in_backward: bool,
        gpu_headroom_mb: float | None,
        spill_dir: str | os.PathLike[str] | None = None,
        host_budget_mb: float | str | None = None,
    ) -> Options:
        budget_mb, headroom_mb = budget_options(gpu_budget_mb, gpu_headroom_mb)  # "auto": planned offloaded first
        # Resolved once: a later os.chdir() must not move the tier's files, nor leak them.
        spill_path = None if spill_dir is None else Path(spill_dir).resolve()
        if spill_path is not None and (warning := check_spill_dir(spill_path)) is not None:
            warn(warning)  # at the caller's line, in the category users filter
        if spill_path is not None:
            reclaim_stale(spill_path)  # a killed run's files ([Note: Tier directories] in tier_dirs.py)
        tiers: tuple[Tier, ...] = ()
        if spill_path is not None:  # [Note: Disk tier]: the host budget measured once, at construction
            auto = host_budget_mb is None or host_budget_mb == "auto"
            host_budget = auto_host_budget() if auto else int(float(host_budget_mb) * _MIB)  # type: ignore[arg-type]
            tiers = (DiskTier(spill_path, host_budget),)
        plan = PlanOptions(
            chunk_bytes=max(1, int(chunk_size_mb * _MIB)),
            num_slots=num_slots,
            offload_fraction=1.0 if offload_fraction is None else float(offload_fraction),
            gpu_budget=None if budget_mb is None else int(budget_mb * _MIB),
            tiers=tiers,
        )
        return cls(
            plan=plan,
            masters=MasterMode(master_weights),
            mode=StepMode.of(overlap=overlap, step_in_backward=step_in_backward),
            pin=device.type == "cuda" if pin_memory is None else pin_memory,
            headroom=None if headroom_mb is None else int(headroom_mb * _MIB),
            budget_mb=budget_mb if headroom_mb is None else "auto",
            headroom_mb=headroom_mb,
        )


@dataclass
class Parts:
    """The parts of one wrapper; none holds the wrapper, and none but the hooks holds the runner (weakly, through
    ``waits``)."""

    notices: Notices
    phase: PhaseMachine
    streams: StreamContext
    engine: TransferEngine
    pool: StagingPool
    gate: StepGate
    pipeline: ChunkPipeline
    hooks: HookSet
    binding: StateBinding
    placement: Placement
    context: StepContext
    schedule: StepSchedule
    runner: StepRunner
    waits: StepWaits


def build_parts(
    inner: torch.optim.Optimizer,
    adapter: Adapter,
    device: torch.device,
    options: Options,
    post_hooks: Mapping[int, Any],
) -> Parts:
    """Build the parts, bottom up; the layout is installed by the caller."""
    prepare_for_dynamo()  # [Note: Opaque to dynamo]: before any hook or method of the parts can run
    notices, phase = Notices(), PhaseMachine()
    streams = StreamContext(device, options.mode)
    engine = TransferEngine(streams)
    pool = StagingPool(options.plan.num_slots, device)
    gate = StepGate(streams, options.mode)
    pipeline = ChunkPipeline(engine, pool, gate)
    grad_hooks = GradHooks()
    hooks = HookSet(grad_hooks)
    runner_ref: weakref.ref[StepRunner] | None = None

    def before_home_write() -> None:  # a cycle would keep the parts (and the host memory) alive until gc runs
        target = runner_ref() if runner_ref is not None else None
        if target is not None:
            target.flush()  # a deferred chunk must not stage what the caller writes after the step
        pipeline.before_home_write()

    binding = StateBinding(before_home_write, adapter.is_offloaded, lambda: phase.stepping)
    placement = Placement(
        inner, adapter, options.masters, options.plan, device=device, pin=options.pin, binding=binding,
        pipeline=pipeline, gate=gate,
    )  # fmt: skip
    context = StepContext(inner, adapter, placement, gate, engine)
    schedule = StepSchedule(pipeline, adapter, device)
    runner = StepRunner(
        placement, context, schedule, phase, notices, mode=options.mode, post_hooks=post_hooks, grad_hooks=grad_hooks,
        budget=auto_budget(placement, options.headroom, notices, fast=options.mode is not StepMode.SYNC),
    )  # fmt: skip
    runner_ref = weakref.ref(runner)
    return Parts(
        notices, phase, streams, engine, pool, gate, pipeline, hooks, binding, placement, context, schedule, runner,
        StepWaits(runner),
    )  # fmt: skip
