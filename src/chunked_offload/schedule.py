"""StepSchedule: the driver that steps chunks in parameter order, leaving the later ones to the next forward."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .adapters import Adapter
from .context import GroupCounters, OpenStep
from .phase import Phase, PhaseMachine
from .pipeline import ChunkPipeline, Event, Pending, note_failure
from .planner import Chunk
from .telemetry import StepRecord

__all__ = ["StepSchedule"]

logger = logging.getLogger(__name__)


@dataclass
class _Run:
    """One outer step's progress through its chunks: what is enqueued, what waits ([Note: Deferred chunks])."""

    chunks: list[Chunk]
    fresh: list[bool]
    record: StepRecord
    counters: GroupCounters
    events: dict[int, Event] = field(default_factory=dict)
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)  # of the deferred chunks' params
    next: int = 0  # the first chunk not enqueued yet
    position: int = -1  # the chunk being enqueued (for the failure note)
    committed: int = 0
    pending: Pending | None = None

    @cached_property
    def position_of(self) -> dict[int, int]:
        """Param index -> position of its chunk (built once, when the step defers)."""
        return {i: pos for pos, chunk in enumerate(self.chunks) for i in chunk.params}


class StepSchedule:
    """Steps the chunks of ``step()`` in parameter order through the pipeline ([Note: Chunk pipeline]).

    [Note: Step schedule]
    1. Each chunk with at least one grad runs either *staged* (it has state: its bytes come in from its home) or
       *fresh* (no state yet: the inner optimizer creates it on the device, inside the window).
    2. The pipeline starts: the slots take their memory if any chunk is staged, and the H2D of the first
       ``num_slots - 1`` staged chunks starts (both may have run early, in ``prefetch()``). The chunk loop runs on
       the gate's stream ([Note: Overlapped step]).
    3. For each chunk ``i``: the H2D of chunk ``i + num_slots - 1`` starts, then chunk ``i`` is stepped and
       committed. A deferring step stops after the first ``num_slots`` chunks; ``advance`` runs this loop for the
       rest later ([Note: Deferred chunks]).
    4. After the last chunk the pipeline finishes: fresh tensors and the slots' memory go back to the allocator.

    [Note: Deferred chunks]
    A step is a few thousand operations (copies and events per piece, backups, master passes, the inner's kernels),
    more than the device's launch queue holds: enqueued at once, ``step()`` blocks the host until the link has
    nearly finished, and the next forward starts late (measured on the H200: 302 ms of "Command Buffer Full" in one
    iteration). So with ``overlap=True`` and an attached model the step enqueues its first ``num_slots`` chunks and
    the rest wait in ``deferred``; each attached module's pre-hook enqueues the chunks of its own params and the
    ``num_slots`` after them, and the model's forward hook enqueues what is left. A deferred chunk steps exactly as
    inside ``step()``: with the step's grads (kept in the run and put back on the params around it), the group values
    of the step's start (``GroupCounters.deferred``), under ``no_grad`` with autocast off, and on the step stream
    without waiting for the caller's stream again. A step does not defer on its first step (fresh state), with
    GradScaler's tensors, with step post-hooks, without an attached model, or when the inner keeps counters in its
    groups (seen after the first chunk).

    On failure the pipeline aborts (the failing chunk is rolled back, or forward), and the exception propagates with
    a note that says which chunks were committed. Chunks after the failing one are untouched: their H2D only read
    their homes. A later ``step()`` behaves as plain torch would from that state.

    Args:
        pipeline: the per-chunk operations.
        phase: the wrapper's phase (this class moves it between DEFERRED and STEPPING).
        adapter: where the inner optimizer reads grads (a deferred chunk puts the step's grads back there).
        device: the params' device (deferred chunks run with autocast off on it).
    """

    def __init__(self, pipeline: ChunkPipeline, phase: PhaseMachine, adapter: Adapter, device: torch.device) -> None:
        self.pipeline = pipeline
        self.phase = phase
        self.adapter = adapter
        self.device = device
        self.deferred: _Run | None = None  # a step whose last chunks are not enqueued yet

    def run(self, chunks: Sequence[Chunk], step: OpenStep, *, skip_staged: bool = False, defer: bool = False) -> None:
        """Step ``chunks`` (each has at least one grad); ``skip_staged`` steps only chunks without state yet.

        With ``defer`` the step may return after enqueuing only its first chunks; the rest wait in ``deferred``
        for ``advance`` ([Note: Deferred chunks]). It defers only chunks that all have state, and only while the
        inner optimizer leaves the groups' values alone.
        """
        pipeline = self.pipeline
        fresh = [not pipeline.has_state(c) for c in chunks]
        if skip_staged:
            chunks = [c for c, f in zip(chunks, fresh, strict=True) if f]
            fresh = [True] * len(chunks)
        events = pipeline.take_prefetch(chunks, fresh)
        if not chunks:
            pipeline.require_stepper().run_empty(step.counters)
            return
        run = _Run(list(chunks), fresh, step.record, step.counters)
        try:
            run.events = events if events is not None else pipeline.start(chunks, fresh, pipeline.lookahead)
        except BaseException as exc:
            self._fail(run, exc)
            raise
        slots = len(pipeline.pool.slots)
        head = len(chunks) if not defer or any(fresh) else min(len(chunks), slots)
        self._advance(run, head - 1, first=True)
        if run.next < len(chunks):
            if run.counters.changed():  # the inner keeps counters in the groups: every chunk runs now, in order
                self._advance(run, len(chunks) - 1, first=False)
            else:
                run.grads = {i: pipeline.grad_of(i) for c in run.chunks[run.next :] for i in c.params}
                self.deferred = run

    def advance(self, indices: Sequence[int] | None) -> None:
        """Enqueue the deferred chunks that hold ``indices`` and the next ``num_slots`` after them (None: all)."""
        run = self.deferred
        if run is None:
            return
        until = len(run.chunks) - 1
        if indices is not None:
            last = max((run.position_of.get(i, -1) for i in indices), default=-1)
            if last < run.next:
                return
            until = min(until, last + len(self.pipeline.pool.slots))  # the link keeps working ahead of the forward
        infos, attr = self.pipeline.require_layout().infos, self.adapter.grad_attr
        swapped = []
        for c in run.chunks[run.next : until + 1]:
            for i in c.params:
                param, grad = infos[i].param, run.grads[i]
                if getattr(param, attr, None) is not grad:
                    swapped.append((param, getattr(param, attr, None)))
                    setattr(param, attr, grad)  # the grad of the step, which the caller may have let go since
        self.phase.to(Phase.STEPPING)
        try:
            # As inside step(): a forward's autocast must not change the inner's arithmetic, nor its grad mode ours.
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False), run.counters.deferred():
                self._advance(run, until, first=False)
        finally:
            for param, grad in swapped:
                setattr(param, attr, grad)
            self.phase.to(Phase.DEFERRED if self.deferred is not None else Phase.IDLE)

    def _advance(self, run: _Run, last: int, *, first: bool) -> None:
        """Enqueue chunks ``run.next .. last`` on the gate's stream; finish the step after the last chunk."""
        pipeline = self.pipeline
        events, chunks, fresh = run.events, run.chunks, run.fresh
        try:
            with pipeline.gate.stepping(wait_caller=first):
                for pos in range(run.next, last + 1):
                    run.position = pos
                    chunk = chunks[pos]
                    ahead = pos + pipeline.lookahead
                    if ahead < len(chunks) and not fresh[ahead] and ahead not in events:
                        events[ahead] = pipeline.stage(chunks[ahead], pipeline.slot_for(ahead))
                    slot = pipeline.slot_for(pos)
                    if not fresh[pos] and pos not in events:
                        events[pos] = pipeline.stage(chunk, slot)
                    run.pending = pipeline.step(chunk, slot, fresh[pos], events.pop(pos, None), run.counters)
                    pipeline.commit(chunk, run.pending)
                    run.pending = None
                    run.committed += 1
                    run.next = pos + 1
                    run.record.add_chunk(chunk, fresh[pos], pipeline.pool)
                if run.next == len(chunks):
                    run.record.compute_done()
        except BaseException as exc:
            self._fail(run, exc)
            raise
        if run.next == len(chunks):
            self.deferred = None
            pipeline.finish()
            run.record.transfers_done()

    def prefetch(self, chunks: Sequence[Chunk]) -> None:
        """Start bringing in the first chunks of the next step now (the pipeline hands them to ``run``)."""
        self.pipeline.prefetch(chunks)

    def _fail(self, run: _Run, exc: BaseException) -> None:
        """Abort ``run`` after ``exc``: roll its failing chunk back (or forward), note in ``exc`` what happened."""
        self.deferred = None
        if self.pipeline.abort(run.pending):
            run.committed += 1
        note_failure(exc, run.chunks, run.position, run.committed)
