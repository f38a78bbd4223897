"""AutoBudget: ``gpu_budget_mb="auto"``, the device memory the training leaves unused given to resident state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .notices import Notices
from .placement import Placement

__all__ = [
    "DEFAULT_HEADROOM_MB",
    "AutoBudget",
    "MemoryReading",
    "auto_budget",
    "budget_options",
    "read_device_memory",
    "release_cached_memory",
]

logger = logging.getLogger(__name__)

_MIB = 2**20

# [Note: Headroom]
# What the budget leaves free beside the peak it measured. The peak is the allocator's reserved peak, so its own
# rounding and fragmentation are inside it already; the headroom is for what comes later and outside it: cuBLAS
# workspaces of new streams (up to 32 MiB each on Hopper), NCCL communicators created after the measurement (a few
# hundred MiB each), CUDA-graph pools, and a new segment the allocator cannot carve out of fragmented free memory.
# 2 GiB is 1.4% of an H200 and 8% of a 24 GiB card.
DEFAULT_HEADROOM_MB = 2048.0


def budget_options(
    gpu_budget_mb: float | str | None, gpu_headroom_mb: float | None
) -> tuple[float | None, float | None]:
    """The wrapper's (checked) options as the budget to plan with first, and the headroom of ``"auto"`` (else None)."""
    if gpu_budget_mb == "auto":
        return None, DEFAULT_HEADROOM_MB if gpu_headroom_mb is None else float(gpu_headroom_mb)
    return None if gpu_budget_mb is None else float(gpu_budget_mb), None


@dataclass(frozen=True)
class MemoryReading:
    """What the device's memory looks like to this process, in bytes.

    Attributes:
        capacity: what this process's allocator could hold now (the free device memory plus what it reserved).
        peak: the most it has reserved so far (over whole iterations: the allocator keeps the peak).
    """

    capacity: int
    peak: int


def read_device_memory(device: torch.device) -> MemoryReading | None:
    """The device's memory as the caching allocator sees it, within ``set_per_process_memory_fraction``; None on
    the CPU (nothing to fill)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    capacity = free + torch.cuda.memory_reserved(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        capacity = min(capacity, int(fraction(index) * total))
    return MemoryReading(capacity, torch.cuda.max_memory_reserved(index))


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's unused blocks back to the driver, on the GPU ([Note: Auto budget])."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class AutoBudget:
    """Re-plans the resident share so that the wrapper fills the device memory the training leaves unused.

    [Note: Auto budget]
    The first step runs fully offloaded. From the second step on (the third with ``overlap=True`` or
    ``step_in_backward=True``), before the step opens (between steps only), the budget reads the allocator's reserved
    peak ``P`` over the iterations so far, and what the process could hold,
    ``C`` (free device memory plus what the allocator reserved). The training's own peak is ``U = P - R``, ``R``
    the resident state the wrapper held meanwhile; ``U`` includes the staging window when the peak fell inside a
    step, and bounds the step's memory when it did not. So resident state may take ``C - headroom - U``, and the
    budget is that plus the staging window: never below the window. The plan keeps as many leading params resident
    as it allows ([Note: What stays resident]).

    - The first reading must follow a step that ran as the later ones will. The first step of the fast modes runs
      as a synchronous one, so only the interval after the second holds what they keep across the forward or the
      backward (the slots of deferred chunks and the step's copies of their grads, the slot whose write-back waits):
      in the overlapped auto-budget test of ``tests/cuda/test_iteration_cuda.py`` on an H100, the peak read after
      the first step was 4318 MiB, after the second 5662 MiB.
    - It grows once resident state may take at least one slot more than it holds, and only until it has shrunk
      once: after a shrink, an interval whose training peak grew by less than the state that left the device
      does not raise ``P``, so ``U`` can no longer be told from above.
    - A re-plan's own transient allocations raise ``P`` too: the reading after it is the new baseline, so only a
      peak above it counts as the training's.
    - A re-plan empties the allocator's cache before it builds the new homes and after it freed the old ones. The
      reserved peak counts cached blocks that no request of the new layout fits, and the allocator would give them
      back only at an out-of-memory error: without this, in the overlapped auto-budget test on an H100, growing to
      half the state made the next intervals reserve 4508 MiB for 2756 MiB allocated, and the budget shrank to
      nothing; with it they reserved 2780 MiB. A re-plan is rare (once or twice a run), so the cost is a few
      ``cudaFree`` and ``cudaMalloc`` calls.
    - It shrinks when ``P`` rose since the last reading (the training grew: the new ``U`` is measured) so that the
      wrapper's device bytes no longer fit: the state moves back to the host at this step, before the step or the
      next forward allocates anything.
    - It cannot protect against a peak that grows within one iteration past what is free (a larger batch, a longer
      sequence): that is an out-of-memory error in the forward or backward, as without the wrapper.
    - A re-plan that fails leaves the old layout installed and the budget as it was; a growth that finds no device
      memory is logged and not tried again, anything else propagates.

    Args:
        placement: owns the layout; its budget (``Placement.set_budget``) is what this class sets.
        headroom: bytes left free beside the measured peak ([Note: Headroom]).
        first: the number of steps opened before the first reading (1; 2 in the fast modes).
        read: reads the device's memory (tests pass their own).
        release: gives the allocator's cached blocks back around a re-plan (tests pass their own).
    """

    def __init__(
        self,
        placement: Placement,
        headroom: int,
        first: int = 1,
        read: Callable[[torch.device], MemoryReading | None] = read_device_memory,
        release: Callable[[torch.device], None] = release_cached_memory,
    ) -> None:
        self.placement = placement
        self.headroom = headroom
        self.first = first
        self.read = read
        self.release = release
        self.checked = -1  # the number of steps opened when the memory was last read
        self.usage = 0  # the training's own peak, U
        self.seen_peak = 0
        self.may_grow = True  # until a shrink, or a growth that found no device memory

    def before_step(self, opened: int) -> None:
        """Before a step opens, with ``opened`` steps opened before it: read the memory, and re-plan when the
        budget moved ([Note: Auto budget]). Once per step (``prefetch()`` comes here too)."""
        if opened < self.first or opened == self.checked:
            return
        self.checked = opened
        reading = self.read(self.placement.device)
        if reading is None:
            return
        placement = self.placement
        plan = placement.plan
        resident = plan.resident_nbytes  # on the device: an offloaded wrapper was reloaded before this
        if reading.peak != self.seen_peak:  # it rose in the interval with ``resident`` held, or was reset since
            self.usage = max(self.usage, reading.peak - resident)
            self.seen_peak = reading.peak
        room = max(0, reading.capacity - self.headroom - self.usage)  # for resident state
        growing = room >= resident
        if not growing:
            self.may_grow = False
        elif not self.may_grow or room - resident < plan.slot_nbytes or not plan.chunks:
            return
        budget = room + plan.window_bound_nbytes
        before, planned = plan.resident_nbytes, placement.set_budget(budget)
        self.release(placement.device)
        try:
            placement.sync(force=True)  # builds the new homes first: on failure the old layout stays installed
        except BaseException as exc:
            placement.set_budget(planned)
            if growing and isinstance(exc, torch.OutOfMemoryError):
                self.may_grow = False  # the estimate was wrong: stay where it is
                logger.warning("gpu_budget_mb='auto': no device memory for %.0f MiB of resident state; stays at "
                               "%.0f MiB", budget / _MIB, before / _MIB)  # fmt: skip
                return
            self.checked = -1  # the next step tries again (a shrink that failed: before anything else allocates)
            raise
        self.release(placement.device)
        after = placement.plan
        moved = self.read(placement.device)
        if moved is not None:  # what the re-plan itself allocated on the way is not the training's
            self.seen_peak = moved.peak
        logger.info(
            "gpu_budget_mb='auto': peak %.0f MiB, of which training %.0f MiB, capacity %.0f MiB, headroom %.0f MiB: "
            "budget %.0f MiB; resident state %.0f -> %.0f MiB (%.1f%% of the state), window %.0f MiB",
            reading.peak / _MIB, self.usage / _MIB, reading.capacity / _MIB, self.headroom / _MIB, budget / _MIB,
            before / _MIB, after.resident_nbytes / _MIB, 100 * after.resident_share, after.window_bound_nbytes / _MIB,
        )  # fmt: skip


def auto_budget(placement: Placement, headroom: int | None, notices: Notices, *, fast: bool) -> AutoBudget | None:
    """The budget of ``gpu_budget_mb="auto"`` (None without it, ``headroom`` in bytes; ``fast``: overlap or in the
    backward); without a GPU it has nothing to fill, and says so."""
    if headroom is None:
        return None
    if placement.device.type != "cuda":
        notices.warn(
            "auto-cpu",
            f"gpu_budget_mb='auto' does nothing with params on {placement.device}: it fills free GPU memory with "
            "resident state. Leave it out on the CPU",
        )
    return AutoBudget(placement, headroom, first=2 if fast else 1)
