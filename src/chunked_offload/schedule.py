"""StepSchedule: one outer step's chunks over the staging slots and the copy streams, with rollback on failure."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .adapters import GroupCounters
from .layout import Layout, Views, chunk_views
from .overlap import StepGate
from .planner import Chunk, Home, Role
from .staging import Slot, SlotState, StagingPool
from .stepping import ChunkStepper, ChunkTxn
from .telemetry import StepRecord
from .transfer import TransferEngine

__all__ = ["StepSchedule"]

logger = logging.getLogger(__name__)

_NON_STATE = (Role.MASTER, Role.REMAINDER, Role.TIE_BITS, Role.SCRATCH)

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
_Events = dict[int, torch.cuda.Event | None]  # chunk position -> the event of its H2D


@dataclass
class _Prefetch:
    """The H2D copies ``prefetch()`` started: which chunks, and the version of the homes they read."""

    chunk_indices: list[int]
    fresh: list[bool]
    events: _Events
    home_version: int


@dataclass
class _Pending:
    """A stepped chunk whose write-back is not enqueued yet."""

    slot: Slot
    txn: ChunkTxn
    pairs: Pairs
    retain: list[torch.Tensor] = field(default_factory=list)
    committing: bool = False


@dataclass
class _Run:
    """One outer step's progress through its chunks: what is enqueued, what waits ([Note: Deferred chunks])."""

    chunks: list[Chunk]
    fresh: list[bool]
    record: StepRecord
    counters: GroupCounters
    events: _Events = field(default_factory=dict)
    next: int = 0  # the first chunk not enqueued yet
    position: int = -1  # the chunk being enqueued (for the failure note)
    committed: int = 0
    pending: _Pending | None = None

    @cached_property
    def position_of(self) -> dict[int, int]:
        """Param index -> position of its chunk (built once, when the step defers)."""
        return {i: pos for pos, chunk in enumerate(self.chunks) for i in chunk.params}


class StepSchedule:
    """Runs one outer step: every chunk with a grad is staged, stepped by the inner optimizer and written back.

    [Note: Step schedule]
    The steps of one outer step, in order:
    1. Each chunk with at least one grad runs either *staged* (it has state: its bytes come in from its home) or
       *fresh* (no state yet: the inner optimizer creates it on the device, inside the window).
    2. If any chunk is staged, the slots take their memory ([Note: Slot memory between steps]).
    3. The H2D of the first ``num_slots - 1`` staged chunks starts (steps 2-3 may have run early, in
       ``prefetch()``). The chunk loop below runs on the gate's stream ([Note: Overlapped step]).
    4. For each chunk ``i``: the H2D of chunk ``i + num_slots - 1`` starts; the compute stream waits for chunk
       ``i``'s H2D; the stepper runs the inner step on it as a transaction ([Note: Chunk transactions]); its
       write-back is enqueued on the D2H stream. From that moment the chunk is committed, and the gate marks its
       params updated. A deferring step stops after the first ``num_slots`` chunks; ``advance`` runs this loop
       for the rest later ([Note: Deferred chunks]).
    5. Fresh tensors and the slots' memory go back to the allocator, recorded on the D2H stream.
    The waits between the streams are those of [Note: Two-slot staging] (staging.py), made in transfer.py.

    On failure (an exception in the inner step, an interrupt, an OOM while taking memory) the failing chunk is
    rolled back, or rolled forward if its write-back was already being enqueued; the write-backs of the committed
    chunks land; the slots return to FREE and their memory to the allocator; and the exception propagates with a
    note that says which chunks were committed. Chunks after the failing one are untouched: their H2D only read
    their homes. A later ``step()`` behaves as plain torch would from that state.

    Args:
        layout: the homes and the plan.
        stepper: runs the inner step on one chunk.
        engine: the copy streams.
        pool: the staging slots.
        gate: the stream the chunk loop runs on, and the events readers of the params wait for.
    """

    def __init__(
        self, layout: Layout, stepper: ChunkStepper, engine: TransferEngine, pool: StagingPool, gate: StepGate
    ) -> None:
        self.layout = layout
        self.stepper = stepper
        self.engine = engine
        self.pool = pool
        self.gate = gate
        self._prefetched: _Prefetch | None = None
        self.deferred: _Run | None = None  # a step whose last chunks are not enqueued yet

    def run(
        self, chunks: Sequence[Chunk], counters: GroupCounters, *, skip_staged: bool = False, defer: bool = False
    ) -> StepRecord:
        """Step ``chunks`` (each has at least one grad); ``skip_staged`` steps only chunks without state yet.

        With ``defer`` the step may return after enqueuing only its first chunks; the rest wait in ``deferred``
        for ``advance`` ([Note: Deferred chunks]). It defers only chunks that all have state, and only while the
        inner optimizer leaves the groups' values alone.
        """
        fresh = [not self._has_state(c) for c in chunks]
        if skip_staged:
            chunks = [c for c, f in zip(chunks, fresh, strict=True) if f]
            fresh = [True] * len(chunks)
        record = StepRecord(self.engine, self.pool.device)
        events = self._take_prefetch(chunks, fresh)
        if not chunks:
            self.stepper.run_empty(counters)
            return record
        run = _Run(list(chunks), fresh, record, counters)
        try:
            run.events = events if events is not None else self._start(chunks, fresh, len(self.pool.slots) - 1)
        except BaseException as exc:
            self._fail(run, exc)
            raise
        head = len(chunks) if not defer or any(fresh) else min(len(chunks), len(self.pool.slots))
        self._advance(run, head - 1, first=True)
        if run.next < len(chunks):
            if counters.changed():  # the inner keeps counters in the groups: every chunk runs now, in order
                self._advance(run, len(chunks) - 1, first=False)
            else:
                self.deferred = run
        return record

    def advance(self, until: int | None) -> None:
        """Enqueue the deferred chunks up to position ``until`` (all with None)."""
        run = self.deferred
        if run is None:
            return
        last = len(run.chunks) - 1 if until is None else min(until, len(run.chunks) - 1)
        if last >= run.next:
            self._advance(run, last, first=False)

    def deferred_position(self, param_indices: Iterable[int]) -> int:
        """The last position of a chunk of the deferred step that holds any of these params (-1: none)."""
        run = self.deferred
        if run is None:
            return -1
        where = run.position_of
        last = max((where.get(i, -1) for i in param_indices), default=-1)
        return last if last >= run.next else -1

    def _advance(self, run: _Run, last: int, *, first: bool) -> None:
        """Enqueue chunks ``run.next .. last`` on the gate's stream; finish the step after the last chunk."""
        engine, pool = self.engine, self.pool
        events, chunks, fresh = run.events, run.chunks, run.fresh
        lookahead = len(pool.slots) - 1
        try:
            with self.gate.stepping(wait_caller=first):
                for pos in range(run.next, last + 1):
                    run.position = pos
                    chunk = chunks[pos]
                    ahead = pos + lookahead
                    if ahead < len(chunks) and not fresh[ahead] and ahead not in events:
                        events[ahead] = self._stage(chunks[ahead], pool.slot_for(ahead))
                    slot = pool.slot_for(pos)
                    if not fresh[pos] and pos not in events:
                        events[pos] = self._stage(chunk, slot)
                    run.pending = self._step_one(chunk, slot, fresh[pos], events.pop(pos, None), run.counters)
                    self._commit(chunk, run.pending)
                    run.pending = None
                    run.committed += 1
                    run.next = pos + 1
                    run.record.add_chunk(chunk, fresh[pos], pool)
                if run.next == len(chunks):
                    run.record.compute_done()
        except BaseException as exc:
            self._fail(run, exc)
            raise
        if run.next == len(chunks):
            self.deferred = None
            engine.end_step(pool.slots)
            pool.release(engine.d2h_stream)
            run.record.transfers_done()

    def prefetch(self, chunks: Sequence[Chunk]) -> None:
        """Start the H2D of the first chunks the next ``run(chunks)`` will stage; ``run`` takes it over.

        The slots hold their memory from now until that step. If the step turns out to need other chunks, or the
        homes are written in between, the staged bytes are dropped and the step stages them again.
        """
        self.drop_prefetch()
        fresh = [not self._has_state(c) for c in chunks]
        if not chunks or fresh[0]:
            return  # a first step creates its state on the device: nothing to bring in early
        depth = max(1, len(self.pool.slots) - 1)
        try:
            events = self._start(chunks, fresh, depth)
        except BaseException:
            # Nothing was modified (an H2D only reads the homes): free the slots, and the step stages again.
            self.engine.drain(self.pool.slots)
            self.pool.release(None)
            raise
        self._prefetched = _Prefetch([c.index for c in chunks[:depth]], fresh[:depth], events, self.engine.home_version)

    def drop_prefetch(self) -> None:
        """Give back what ``prefetch`` took: wait for its copies, free the slots."""
        if self._prefetched is not None:
            self._prefetched = None
            self.engine.drain(self.pool.slots)
            self.pool.release(None)

    def _take_prefetch(
        self, chunks: Sequence[Chunk], fresh: Sequence[bool]
    ) -> dict[int, torch.cuda.Event | None] | None:
        """The H2D events of a prefetch that matches this step's first chunks, or None (after dropping any other)."""
        taken = self._prefetched
        if taken is None:
            return None
        n = len(taken.chunk_indices)
        if (
            taken.home_version == self.engine.home_version
            and [c.index for c in chunks[:n]] == taken.chunk_indices
            and list(fresh[:n]) == taken.fresh
        ):
            self._prefetched = None
            return taken.events
        self.drop_prefetch()
        return None

    def _start(self, chunks: Sequence[Chunk], fresh: Sequence[bool], depth: int) -> _Events:
        """Take the slots' memory (if any chunk is staged) and start the H2D of the first ``depth`` chunks.

        Runs on the caller's stream: the slots' blocks come from its pool, so that forward and backward reuse them
        between steps ([Note: Slot memory between steps]).
        """
        pool, engine = self.pool, self.engine
        if not all(fresh):
            pool.acquire(self.layout.plan.slot_nbytes)
        engine.begin_step()
        events: _Events = {}
        for pos in range(min(depth, len(chunks))):
            if not fresh[pos]:
                events[pos] = self._stage(chunks[pos], pool.slot_for(pos))
        return events

    # ------------------------------------------------------------------ one chunk
    def _home_region(self, chunk: Chunk, nbytes: int, offset: int = 0) -> torch.Tensor:
        """``nbytes`` of the chunk's moving bytes in its home, from chunk byte ``offset``."""
        start = chunk.home_offset + offset
        if chunk.home is Home.HOST:
            return self.layout.arena.region(start, nbytes)
        flat = self.layout.resident_flat
        if flat is None:
            raise RuntimeError("the resident chunks have no memory; call opt.reload()")
        return flat[start : start + nbytes]

    def _stage(self, chunk: Chunk, slot: Slot) -> torch.cuda.Event | None:
        """The H2D (a D2D for resident chunks) of a chunk that has state; see [Note: Two-slot staging]."""
        n = chunk.transfer_nbytes
        buffer = slot.buffer
        if buffer is None:
            raise RuntimeError("the staging slots have no memory while a chunk is staged")
        return self.engine.stage_in(slot, [(buffer[:n], self._home_region(chunk, n))] if n else [])

    def _step_one(
        self, chunk: Chunk, slot: Slot, fresh: bool, h2d_event: torch.cuda.Event | None, counters: GroupCounters
    ) -> _Pending:
        """Step one chunk in ``slot``: a fresh one in memory of its own, a staged one after its H2D (started)."""
        if fresh:
            return self._step_fresh(chunk, slot, counters)
        return self._step_staged(chunk, slot, h2d_event, counters)

    def _commit(self, chunk: Chunk, pending: _Pending) -> None:
        """Enqueue a stepped chunk's write-back: from here on it is committed, and its params count as updated."""
        pending.committing = True
        self.gate.mark_ready(chunk.params, self.engine.write_back(pending.slot, pending.pairs, pending.retain))

    def _step_staged(
        self, chunk: Chunk, slot: Slot, h2d_event: torch.cuda.Event | None, counters: GroupCounters
    ) -> _Pending:
        self.engine.wait_staged(slot, h2d_event)
        buffer = slot.buffer
        if buffer is None:
            raise RuntimeError("the staging slots have no memory while a chunk is staged")
        views = chunk_views(chunk, self.layout.infos, buffer)
        _, txn = self.stepper.run(chunk, views, counters, fresh=False)
        n = chunk.transfer_nbytes
        return _Pending(slot, txn, [(self._home_region(chunk, n), buffer[:n])] if n else [])

    def _step_fresh(self, chunk: Chunk, slot: Slot, counters: GroupCounters) -> _Pending:
        """First step of a chunk: the inner optimizer creates its state on the device; D2H reads it directly."""
        engine = self.engine
        engine.reclaim(slot)  # bound: at most num_slots chunks of fresh tensors exist at once
        wrapper_nbytes = chunk.region_nbytes[1]
        extra = wrapper_nbytes + chunk.region_nbytes[2]
        device = self.pool.device
        temp = torch.empty(extra, dtype=torch.uint8, device=device) if extra else None
        wrapper_home = self._home_region(chunk, wrapper_nbytes, offset=chunk.state_nbytes)
        h2d = [(temp[:wrapper_nbytes], wrapper_home)] if temp is not None and wrapper_nbytes else []
        event = engine.stage_in(slot, h2d, fresh_memory=True)
        engine.wait_staged(slot, event)
        if temp is None:
            views: Views = {i: {} for i in chunk.params}
        else:
            views = chunk_views(chunk, self.layout.infos, temp, shift=chunk.state_nbytes, roles=_NON_STATE)
        fresh_pairs, txn = self.stepper.run(chunk, views, counters, fresh=True)
        pairs = list(fresh_pairs)
        retain = [t for _, t in fresh_pairs]
        if temp is not None:
            if wrapper_nbytes:
                pairs.append((wrapper_home, temp[:wrapper_nbytes]))
            retain.append(temp)
        return _Pending(slot, txn, pairs, retain)

    def _has_state(self, chunk: Chunk) -> bool:
        if chunk.state_nbytes == 0:
            return True
        state, infos = self.stepper.inner.state, self.layout.infos
        for i in chunk.params:
            info = infos[i]
            entry = state.get(info.param)
            if entry and any(key in entry for key in info.state_keys):
                return True
        return False

    # ------------------------------------------------------------------ failure
    def _fail(self, run: _Run, exc: BaseException) -> None:
        """Abort ``run`` after ``exc``: roll its failing chunk back (or forward), note in ``exc`` what happened."""
        self.deferred = None
        if self._abort(run.pending):
            run.committed += 1
        _annotate(exc, run.chunks, run.position, run.committed)

    def _abort(self, pending: _Pending | None) -> bool:
        """Roll the failing chunk back (or forward), let committed write-backs land, free every slot.

        Returns whether the failing chunk was rolled forward (committed).
        """
        self.gate.join()  # the rollback below runs on the caller's stream, after what the step stream enqueued
        forward = pending is not None and pending.committing
        if pending is not None:
            if forward:
                # Its write-back was being enqueued: the slot holds the committed bytes, so enqueue it in full.
                pending.slot.state = SlotState.READY
                self.engine.write_back(pending.slot, pending.pairs, pending.retain)
            else:
                pending.txn.rollback()
        self.engine.drain(self.pool.slots)
        self.pool.release(None)
        return forward


def _annotate(exc: BaseException, chunks: Sequence[Chunk], position: int, committed: int) -> None:
    if position < 0:
        note = "chunked_offload: step() failed before any chunk was stepped; nothing was modified"
    else:
        chunk = chunks[position]
        fate = "was committed too (its write-back was being enqueued)" if committed > position else "was rolled back"
        note = (
            f"chunked_offload: step() failed in chunk {chunk.index} (params {chunk.params[0]}..{chunk.params[-1]}), "
            f"chunk {position + 1} of the {len(chunks)} with grads: the {position} before it were committed, it "
            f"{fate}, and the {len(chunks) - position - 1} after it are untouched"
        )
    logger.warning("%s (%s: %s)", note, type(exc).__name__, exc)
    if hasattr(exc, "add_note"):
        exc.add_note(note)
