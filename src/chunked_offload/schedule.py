"""StepSchedule: the driver that steps chunks in parameter order, leaving the later ones to the next forward."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.autograd.profiler import record_function

from .adapters import Adapter
from .context import GroupCounters, OpenStep
from .failures import note_failure
from .inputs import KeptGrads, OwnedGrads, ParamWatch
from .pipeline import ChunkPipeline, Event, Pending
from .planner import Chunk, Home
from .staging import fit_order
from .telemetry import CHUNK_SCOPE, StepRecord

__all__ = ["ReadOrder", "StepSchedule"]

logger = logging.getLogger(__name__)


class ReadOrder:
    """The order in which the forward after a step first asks for each param.

    [Note: Read order]
    An overlapped step is only as early as the chunk the next forward waits for first. That is not always the first
    chunk: FSDP2's root unit all-gathers the embedding, the final norm and the LM head before the first layer runs, so
    its forward waited for the last chunk, that is for the whole step (measured: 1.11x of the floor exposed on the
    H200, more than the synchronous step). So the pre-hooks of an attached model record the order in which the
    forward after a step first asks for each param, and the next overlapped steps run their chunks in that order
    (params never asked for last, in parameter order). Each chunk's update is the same whatever the order (the
    inner steps each param on its own, as in the backward's order of ``step_in_backward``), so this is bitwise.
    """

    def __init__(self) -> None:
        self.last: dict[int, int] = {}  # param index -> rank of its first read in the last whole forward
        self._recording: dict[int, int] | None = None

    def start(self) -> None:
        """Record the next forward's reads."""
        self._recording = {}

    def record(self, indices: Sequence[int]) -> None:
        if self._recording is not None:
            for i in indices:
                self._recording.setdefault(i, len(self._recording))

    def forward_done(self) -> None:
        """An attached model's forward returned: its reads order the next steps."""
        if self._recording:
            self.last, self._recording = self._recording, None

    def sort(self, chunks: list[Chunk]) -> None:
        """Order ``chunks`` by their first read in the last forward (chunks never read last, in their order)."""
        if self.last:
            unread = len(self.last)
            chunks.sort(key=lambda c: min(self.last.get(i, unread) for i in c.params))


@dataclass
class _Run:
    """One outer step's progress through its chunks: what is enqueued, what waits ([Note: Deferred chunks])."""

    chunks: list[Chunk]
    fresh: list[bool]
    record: StepRecord
    counters: GroupCounters
    owned: OwnedGrads
    own: bool  # on the gate's stream, the caller's going on without it; else on the caller's stream
    events: dict[int, Event] = field(default_factory=dict)
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
       rest later ([Note: Deferred chunks]), the runner moving the phase to
       STEPPING and back to DEFERRED around it.
    4. After the last chunk the pipeline finishes: fresh tensors and the slots' memory go back to the allocator.

    [Note: Deferred chunks]
    A step is a few thousand operations (copies and events per piece, backups, master passes, the inner's kernels),
    more than the device's launch queue holds: enqueued at once, ``step()`` blocks the host until the link has
    nearly finished, and the next forward starts late (measured on the H200: 302 ms of "Command Buffer Full" in one
    iteration). So with ``overlap=True`` and an attached model the step enqueues its first ``num_slots`` chunks and
    the rest wait in ``deferred``; each attached module's pre-hook enqueues the chunks of its own params and the
    ``num_slots`` after them, and the model's forward hook enqueues what is left. A deferred chunk steps exactly as
    inside ``step()``: with the step's grads (copies kept in the run and shown to the inner around it), the group values
    of the step's start (``GroupCounters.deferred``), under ``no_grad`` with autocast off, and on the step stream
    without waiting for the caller's stream again. Its grads are the step's own copies, and its params must not have
    been written since ``step()`` ([Note: Inputs of a step] in inputs.py). A step does not defer on its first step
    (fresh state), with GradScaler's tensors, with step post-hooks, without an attached model, or when the inner keeps
    counters in its groups (seen after the first chunk). *Eager* chunks, first in the order, are never deferred: those
    with a param that no attached forward waits for, and resident ones. A resident chunk moves nothing over the link,
    so under the forward its kernels would only share the device with the forward's; inside ``step()`` it runs alone,
    as in the synchronous step, and the caller's stream waits for it. Nor are its grads copied. (bench_train on the
    H200, all state resident, two runs: 97.5-98.0% of the resident iterations/s kept at 8 x 2048, 98.4-98.9% at 16;
    deferred, 95.4-98.9% and 97.4-99.4%.)

    On failure the pipeline aborts (the failing chunk is rolled back, or forward), and the exception propagates with
    a note that says which chunks were committed. Chunks after the failing one are untouched: their H2D only read
    their homes. A later ``step()`` behaves as plain torch would from that state.

    Args:
        pipeline: the per-chunk operations.
        adapter: where the inner optimizer reads grads (a chunk shows it the step's own copies there).
        device: the params' device (deferred chunks run with autocast off on it).
    """

    def __init__(self, pipeline: ChunkPipeline, adapter: Adapter, device: torch.device) -> None:
        self.pipeline = pipeline
        self.adapter = adapter
        self.device = device
        self.deferred: _Run | None = None  # a step whose last chunks are not enqueued yet
        self.watch = ParamWatch()  # params updated after step() returned, not read by a forward since
        self.kept = KeptGrads(pipeline.gate.join)  # grads read in place, while any ([Note: Inputs of a step])
        self.keep_grads = False  # an overlapped step reads its grads in place, not copies
        self.reads = ReadOrder()

    def run(
        self,
        chunks: Sequence[Chunk],
        step: OpenStep,
        *,
        skip_staged: bool = False,
        defer: bool = False,
        own: bool = False,
        eager: int = 0,
    ) -> None:
        """Step ``chunks`` (each has at least one grad); ``skip_staged`` steps only chunks without state yet.

        With ``defer`` the step may return after enqueuing only its first chunks; the rest wait in ``deferred``
        for ``advance`` ([Note: Deferred chunks]). It defers only chunks that all have state, only while the
        inner optimizer leaves the groups' values alone, and never the first ``eager`` chunks. With ``own`` the
        chunks run on the gate's stream and the caller's stream goes on without waiting for the step: every chunk
        that steps after ``step()`` has returned (on a GPU, all but the eager ones) reads copies of its grads, and
        its params are watched ([Note: Inputs of a step]). Without it they run on the caller's stream.
        """
        pipeline = self.pipeline
        fresh = [not pipeline.has_state(c) for c in chunks]
        if skip_staged:
            chunks = [c for c, f in zip(chunks, fresh, strict=True) if f]
            fresh = [True] * len(chunks)
        events = pipeline.ahead.take(chunks, fresh)
        if not chunks:
            pipeline.require_stepper().run_empty(step.counters)
            return
        run = _Run(list(chunks), fresh, step.record, step.counters, OwnedGrads(pipeline.gate.keep_alive), own)
        step.record.overlapped = own and pipeline.gate.detaches  # its time is not the caller's: no exposed time
        slots = len(pipeline.pool.slots)
        head = len(chunks) if not defer or any(fresh) else min(len(chunks), eager + slots)
        later = (eager if pipeline.gate.stream is not None else head) if own else len(chunks)
        try:
            # On the caller's stream, before the step stream waits for it: the copies read the grads as they are now
            # (kept grads are read in place, their writes held: [Note: Inputs of a step]).
            grads = [(i, g) for c in run.chunks[later:] for i, g in pipeline.grads(c)]
            run.owned.take(grads, copy=not self.keep_grads)
            if self.keep_grads:
                self.kept.record(grads)
            if events is None:
                events = pipeline.start(chunks, fresh, pipeline.lookahead, in_order=True)
            run.events = events
        except BaseException as exc:
            self._fail(run, exc)
            raise
        self._advance(run, head - 1, first=True)
        if run.next < len(chunks) and run.counters.changed():
            self._advance(run, len(chunks) - 1, first=False)  # the inner keeps counters in the groups: all run now
        if run.next < len(chunks):
            self.deferred = run
        self.watch.record((i, self._param(i)) for c in run.chunks[later:] for i in c.params)

    def due(self, indices: Sequence[int] | None) -> int | None:
        """The last deferred chunk to enqueue before a forward reads ``indices`` (None: all), or None: none is due.

        Those that hold ``indices`` and the next ``num_slots`` after them: the link keeps working ahead of the forward.
        """
        run = self.deferred
        if run is None:
            return None
        until = len(run.chunks) - 1
        if indices is not None:
            last = max((run.position_of.get(i, -1) for i in indices), default=-1)
            if last < run.next:
                return None
            until = min(until, last + len(self.pipeline.pool.slots))
        return until

    def advance(self, until: int) -> None:
        """Enqueue the deferred chunks up to position ``until`` (``due``); the caller's phase is STEPPING."""
        run = self.deferred
        if run is None:
            return
        ran = [i for c in run.chunks[run.next : until + 1] for i in c.params]
        try:
            run.position = run.next  # a refusal: nothing of it ran
            self.watch.check(ran)
            self.kept.check(ran)
        except BaseException as exc:
            self._fail(run, exc)
            raise
        # As inside step(): a forward's autocast must not change the inner's arithmetic, nor its grad mode ours.
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False), run.counters.deferred():
            self._advance(run, until, first=False)
        if self.pipeline.gate.stream is not None:
            self.watch.record((i, self._param(i)) for i in ran)  # still running; our update bumped their versions
        else:
            self.watch.forget(ran)  # updated already: a write from now on comes after the update, as in plain torch

    def _advance(self, run: _Run, last: int, *, first: bool) -> None:
        """Enqueue chunks ``run.next .. last`` on the gate's stream; finish the step after the last chunk."""
        pipeline = self.pipeline
        events, chunks, fresh = run.events, run.chunks, run.fresh
        try:
            with pipeline.gate.stepping(wait_caller=first, own=run.own):
                for pos in range(run.next, last + 1):
                    run.position = pos
                    chunk = chunks[pos]
                    with record_function(CHUNK_SCOPE):
                        ahead = pos + pipeline.lookahead
                        if ahead < len(chunks) and not fresh[ahead] and ahead not in events:
                            events[ahead] = pipeline.stage(chunks[ahead], pipeline.slot_for(ahead))
                        slot = pipeline.slot_for(pos)
                        if not fresh[pos] and pos not in events:
                            events[pos] = pipeline.stage(chunk, slot)
                        with self._owned_grads(run, chunk):
                            run.pending = pipeline.step(chunk, slot, fresh[pos], events.pop(pos, None), run.counters)
                        pipeline.commit(chunk, run.pending)
                        run.pending = None
                        run.owned.release(chunk.params)
                        run.committed += 1
                        run.next = pos + 1
                        run.record.add_chunk(chunk, pipeline.store(chunk), fresh[pos], pipeline.pool)
                if run.next == len(chunks):
                    run.record.compute_done()
        except BaseException as exc:
            self._fail(run, exc)
            raise
        if run.next == len(chunks):
            self.deferred = None
            pipeline.finish()
            run.record.transfers_done()

    def order(self, chunks: list[Chunk]) -> None:
        """Sort the chunks of an overlapped step with an attached model: eager ones first, then by the last forward's
        reads ([Note: Read order]); chunks larger than the rest step early, in one slot (``fit_order``)."""
        self.reads.sort(chunks)
        eager = {c.index for c in chunks if self.eager(c)}
        chunks.sort(key=lambda c: c.index not in eager)  # stable: the eager chunks first, in that order
        slots = len(self.pipeline.pool.slots)
        window = slots * self.pipeline.require_layout().plan.slot_nbytes
        order = fit_order([c.device_nbytes for c in chunks], slots, window, start=len(eager))
        chunks[:] = [chunks[p] for p in order]

    def eager(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` steps inside ``step()`` ([Note: Deferred chunks]): it is resident, or a param of it with a
        grad is read by no attached forward that waits for it (one no gate holds, or one the last forward did not ask
        for)."""
        if chunk.home == Home.DEVICE:
            return True
        gated = {id(p) for params in self.pipeline.gate.gated.values() for p in params}
        read = self.reads.last
        return any(
            id(self._param(i)) not in gated or (read and i not in read)
            for i in chunk.params
            if self.pipeline.grad_of(i) is not None
        )

    def _param(self, index: int) -> torch.Tensor:
        return self.pipeline.require_layout().infos[index].param

    @contextmanager
    def _owned_grads(self, run: _Run, chunk: Chunk) -> Iterator[None]:
        """Show the inner the step's own copies of the chunk's grads, where it has them."""
        attr, owned = self.adapter.grad_attr, run.owned.grads
        shown = [(self._param(i), owned[i]) for i in chunk.params if i in owned]
        saved = [(p, getattr(p, attr, None)) for p, _ in shown]
        for p, copy in shown:
            setattr(p, attr, copy)
        try:
            yield
        finally:
            for p, grad in saved:
                setattr(p, attr, grad)

    def prefetch(self, chunks: Sequence[Chunk]) -> None:
        """Start bringing in the first chunks of the next step now (the pipeline hands them to ``run``)."""
        self.pipeline.ahead.prefetch(chunks)

    def _fail(self, run: _Run, exc: BaseException) -> None:
        """Abort ``run`` after ``exc``: roll its failing chunk back (or forward), note in ``exc`` what happened."""
        self.deferred = None
        run.owned.clear()
        self.watch.forget()  # a rollback writes params too; what is committed from here on the caller's stream sees
        if self.pipeline.abort(run.pending):
            run.committed += 1
        self.kept.release()  # its held writes run after whatever the step enqueued
        chunk = run.chunks[run.position] if run.position >= 0 else None
        total = len(self.pipeline.require_layout().plan.all_chunks)
        note_failure(exc, chunk, run.position, run.committed, total, len(run.chunks))
