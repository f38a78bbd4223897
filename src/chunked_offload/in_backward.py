"""BackwardSchedule: one outer step driven by the backward pass, each chunk stepped as soon as its grads are final."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from torch.autograd.profiler import record_function

from .backward_watch import TaskWatch
from .context import OpenStep
from .dtensor import local
from .failures import note_failure
from .inputs import GradRecord
from .pipeline import ChunkPipeline, Event, Pending
from .planner import Chunk
from .staging import Slot
from .telemetry import CHUNK_SCOPE

__all__ = ["BackwardOrder", "BackwardSchedule"]

logger = logging.getLogger(__name__)


class BackwardOrder:
    """What the last backward showed: the order its grads became final, and how many each param accumulated.

    [Note: Backward order]
    A step in the backward stages chunks ahead of the one it steps, so it must guess which chunks the backward
    finishes next; a wrong guess brings a chunk in for nothing and queues the right one behind it. The first
    backward is expected to finish chunks last to first (grads come in about reverse parameter order). That is off
    wherever a chunk boundary cuts a block whose params are not declared in the order the backward reaches them: an
    HF decoder layer declares its norms after its MLP but gets their grads last, so the chunk holding them finishes
    after the one before it (measured on the H200: 16.6 GB H2D per step for 11.4 GB of state, and the next forward
    waiting 25 ms for the last chunk). So each backward records the order in which its params' grads became final,
    and the next expects each chunk when its last param was final in that order (chunks with a param that got no
    final grad last, as before; a chunk none of whose params got one is not staged ahead at all). Chunks step in
    whatever order their grads are final either way: the order changes what is staged ahead, never a result.

    The link runs up to ``num_slots`` chunks ahead: each slot that holds no staged chunk takes the next expected one
    at once, behind the write-back of the chunk that last used it, instead of one chunk being staged after each
    step (measured: the H2D link idle about 40% of the backward, and the last chunk brought in after the backward).

    A param whose grad accumulated more than once in the last backward (a layer shared by two reentrant-checkpointed
    segments) is expected as often in the next ([Note: Observed backward]).
    """

    def __init__(self) -> None:
        self.arrivals: dict[int, int] = {}  # param index -> rank of its final grad, in the last backward
        self.accumulations: dict[int, int] = {}  # param index -> grads accumulated per backward, where not 1

    def learn(self, arrivals: dict[int, int], counts: Mapping[int, int]) -> None:
        self.arrivals = arrivals
        self.accumulations = {i: n for i, n in counts.items() if n != 1}

    def expected(self, chunks: Sequence[Chunk]) -> tuple[list[Chunk], frozenset[int]]:
        """``chunks`` in the order the backward is expected to finish them, and those not to stage ahead."""
        ordered = list(reversed(chunks))
        order = self.arrivals
        if not order:
            return ordered, frozenset()
        unseen = len(order)
        ordered.sort(key=lambda c: max(order.get(i, unseen) for i in c.params))
        return ordered, frozenset(c.index for c in ordered if not any(i in order for i in c.params))


class BackwardSchedule:
    """Steps the chunks of one outer step from post-accumulate-grad hooks, during the backward pass.

    [Note: Step in backward]
    With ``step_in_backward=True`` every param has a post-accumulate-grad hook. The first hook of a backward opens a
    step (the checks, copies and group counters of ``step()``, the slots' memory) and starts the H2D of the chunks
    expected first, one per slot ([Note: Backward order]). Each hook marks its param's grad final. Once
    every param of a chunk is final, the chunk is stepped on the gate's stream, which first waits for the backward's
    stream up to that point, and written back; then its slot takes the next expected chunk not yet staged. A chunk
    that is not staged when its grads are final takes a slot that holds none, or else the slot of the staged chunk
    expected last (its H2D queues behind the one it replaces; the other is staged again later). At the end of the
    backward an autograd callback steps the chunks still open (some of their params got no grad, as a plain step
    would skip them) and closes the step.

    Reentrant activation checkpointing runs a nested backward for each checkpointed segment, and the grads of the
    params inside it arrive there. A callback queued from a hook goes to the backward the hook runs in, so each
    backward a hook runs in gets one; the callback of a nested backward (it ends while an enclosing autograd node
    still runs) leaves the step open. If no hook ran in the outermost backward, ``step()`` closes the step.

    Each chunk runs the inner step on the same bytes as ``step()`` would; only the order of the chunks differs, and
    the inner's update of a param depends on that param alone. So the result is bitwise that of the plain loop, for
    a loop without gradient clipping or loss scaling: their changes to the grads come after the update.

    [Note: Coupled params]
    Some inners choose a code path per group from which of its params have grads: torch's SGD with momentum and
    ``foreach`` takes the per-tensor path, which rounds differently in bf16, for a whole (dtype, device) group if
    any param with a grad has no momentum buffer yet. A param without one (its first grad comes late, or never) may
    get its grad after the other chunks of its group are final, so the adapter says which groups couple
    (``Adapter.couples``), and their chunks wait for the end of the backward, where ``Adapter.grads_final``
    decides again before the first of them steps. The other groups step as their grads arrive.

    Args:
        pipeline: the per-chunk operations ([Note: Chunk pipeline]).
        expected: the chunks to expect, in the order the backward should finish them.
        step: the outer step, opened by the caller.
        not_ahead: chunks never staged ahead (none of their params got a grad in the last backward); they are
            brought in if they do get one.
        on_close: called once the step is closed (False) or aborted (True): the caller's own clean-up.
    """

    def __init__(
        self,
        pipeline: ChunkPipeline,
        expected: Sequence[Chunk],
        step: OpenStep,
        on_close: Callable[[BackwardSchedule, bool], None],
        not_ahead: frozenset[int] = frozenset(),
        accumulations: Mapping[int, int] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.expected = list(expected)
        self.counters = step.counters
        self.record = step.record
        self.record.overlapped = pipeline.gate.detaches  # its time is the backward's: no exposed time
        self._on_close = on_close
        self._chunk_of = {i: c for c in self.expected for i in c.params}
        self._open = {c.index: set(c.params) for c in self.expected}
        self._fresh = {c.index: not pipeline.has_state(c) for c in self.expected}
        coupled = []
        if step.coupled:
            infos = pipeline.require_layout().infos
            coupled = [c.index for c in self.expected if any(infos[i].group_index in step.coupled for i in c.params)]
        self._at_end = frozenset(coupled)  # [Note: Coupled params]: stepped once every grad is final
        self._grads_final: Callable[[], None] | None = step.grads_final if coupled else None
        self._position = {c.index: k for k, c in enumerate(self.expected)}
        self._not_ahead = not_ahead
        self._done: list[Chunk] = []
        self._staged: dict[int, tuple[Chunk, Event]] = {}  # slot index -> the chunk staged there, its H2D event
        self._cursor = 0  # position in ``expected`` before which no chunk is left to stage ahead
        self._last_used: dict[int, int] = {}  # slot index -> position of the last chunk stepped in it
        self.closed = False
        self.watch = TaskWatch(self.close)
        self._accumulations = accumulations or {}  # param index -> grads accumulated per backward, if not 1
        self.counts: dict[int, int] = {}  # param index -> grads accumulated in this backward so far
        self.arrivals: dict[int, int] = {}  # param index -> rank of its final grad in this backward
        self.grads = GradRecord()  # what each chunk read ([Note: Inputs of a step])

    # ------------------------------------------------------------------ driven by the hooks
    def begin(self) -> None:
        """Take the slots' memory and start the H2D of the chunks expected first, one per slot."""
        for held in self.pipeline.held.slots:
            self._last_used[held.index] = -1  # its write-back is enqueued now, last: it stages last
        try:
            self.pipeline.start(self.expected, [self._fresh[c.index] for c in self.expected], depth=0)
            self._fill()
        except BaseException as exc:  # the slots, the first H2Ds, a write-back held from the last step
            self.abort(None)
            note_failure(exc, None, 0, 0, len(self.expected))
            raise

    def grad_ready(self, index: int) -> None:
        """Param ``index`` has its final grad; step its chunk once all of the chunk's params do."""
        if self.closed:
            return
        count = self.counts[index] = self.counts.get(index, 0) + 1
        if count < self._accumulations.get(index, 1):
            return  # more grads arrive for it in this backward (a layer shared by checkpointed segments)
        self.arrivals.setdefault(index, len(self.arrivals))
        chunk = self._chunk_of.get(index)
        if chunk is None:
            return
        waiting = self._open.get(chunk.index)
        if waiting is None:
            return  # stepped already (a param whose grad is accumulated twice in one backward)
        waiting.discard(index)
        if not waiting and chunk.index not in self._at_end:
            left = sum(c != chunk.index and c not in self._not_ahead for c in self._open)
            self._run(chunk, hold=left < self.pipeline.held.limit)

    def close_with_backward(self) -> None:
        """Close the step at the end of the outermost backward pass ([Note: Watching the backward])."""
        self.watch.arm()

    def close(self) -> None:
        """End of the backward: step the chunks still open that have grads, then give the memory back."""
        if self.closed:
            return
        remaining = [c for c in self.expected if c.index in self._open and self.pipeline.grads(c)]
        for k, chunk in enumerate(remaining):
            self._run(chunk, hold=len(remaining) - 1 - k < self.pipeline.held.limit)
        with self.pipeline.gate.stepping():
            self.record.compute_done()
        if self._staged:
            # Chunks were brought in but got no grad: their H2D may still write the slots, which the finish below
            # would not order against (it records the D2H stream only).
            for chunk, _ in self._staged.values():
                self.record.add_dropped_stage(chunk, self.pipeline.store(chunk))
            self._staged.clear()
            self.pipeline.drain()
        self.pipeline.finish()
        self.record.transfers_done()
        self.closed = True
        self._on_close(self, False)

    def abort(self, pending: Pending | None) -> bool:
        """Roll the failing chunk back (or forward), let committed write-backs land, free the slots."""
        forward = self.pipeline.abort(pending)
        self.closed = True
        self._on_close(self, True)
        return forward

    @property
    def stepped(self) -> int:
        """Chunks committed so far."""
        return len(self._done)

    # ------------------------------------------------------------------ one chunk
    def _run(self, chunk: Chunk, hold: bool) -> None:
        """Step ``chunk``; ``hold``: fewer than ``held.limit`` other chunks are expected in this backward, so its
        write-back is held ([Note: Held write-back] in held.py)."""
        pipeline = self.pipeline
        del self._open[chunk.index]
        self._keep_grads_alive(chunk)
        position = len(self._done)
        fresh = self._fresh[chunk.index]
        pending: Pending | None = None
        try:
            with record_function(CHUNK_SCOPE):
                if self._grads_final is not None and chunk.index in self._at_end:
                    self._grads_final()  # the first coupled chunk, at the end of the backward
                    self._grads_final = None
                # Chunks held as the last ones were not (all of them, unless this one is held too): a slot is needed.
                pipeline.flush_write_back(keep=pipeline.held.limit - 1 if hold else 0)
                slot, matched, event = self._slot_for(chunk)
                with pipeline.gate.stepping():
                    if not fresh and not matched:
                        event = pipeline.stage(chunk, slot)
                    pending = pipeline.step(chunk, slot, fresh, event, self.counters)
                    pipeline.commit(chunk, pending, hold=hold)
                    pending = None
                    self.grads.record([(i, pipeline.grad_of(i)) for i in chunk.params])
                self._last_used[slot.index] = position
                self._done.append(chunk)
                self.record.add_chunk(chunk, pipeline.store(chunk), fresh, pipeline.pool)
                self._fill()
        except BaseException as exc:
            committed = len(self._done) + (1 if self.abort(pending) else 0)
            note_failure(exc, chunk, position, committed, len(self.expected))
            raise

    def _keep_grads_alive(self, chunk: Chunk) -> None:
        self.pipeline.gate.keep_alive(local(g) for _, g in self.pipeline.grads(chunk))

    def _slot_for(self, chunk: Chunk) -> tuple[Slot, bool, Event]:
        """The slot ``chunk`` steps in, whether it is staged there, and the H2D event: its own slot if it is staged;
        else a slot that holds no staged chunk; else the one whose chunk is expected last, which gives it up (its
        H2D queues behind the one it replaces, and it is staged again later)."""
        slots = self.pipeline.pool.slots
        for index, (staged, event) in self._staged.items():
            if staged.index == chunk.index:
                del self._staged[index]
                return slots[index], True, event
        idle = self._idle_slots()
        if idle:
            return idle[0], False, None
        index = max(self._staged, key=lambda k: self._position[self._staged[k][0].index])
        dropped, dropped_event = self._staged.pop(index)
        self.pipeline.release_staged(slots[index], dropped, dropped_event)
        self.record.add_dropped_stage(dropped, self.pipeline.store(dropped))
        self._cursor = min(self._cursor, self._position[dropped.index])
        return slots[index], False, None

    def _fill(self) -> None:
        """Start the H2D of the next expected chunks into the slots that hold none, the one used longest ago first
        (its write-back is the furthest along): the link runs up to ``num_slots`` chunks ahead of the backward."""
        for slot in self._idle_slots():
            chunk = self._next_to_stage()
            if chunk is None:
                return
            self._staged[slot.index] = (chunk, self.pipeline.stage(chunk, slot))

    def _idle_slots(self) -> list[Slot]:
        """The slots that hold neither a staged chunk nor a held write-back, the one whose last write-back was
        enqueued first (the furthest along) first."""
        held = self.pipeline.held.slots
        idle = [s for s in self.pipeline.pool.slots if s.index not in self._staged and not any(s is h for h in held)]
        return sorted(idle, key=lambda s: self._last_used.get(s.index, -2))

    def _next_to_stage(self) -> Chunk | None:
        """The first expected chunk that is open, not staged, and has bytes to bring in; the scan resumes where the
        last one stopped (only a chunk that gave up its slot moves it back)."""
        staged = {c.index for c, _ in self._staged.values()}
        expected = self.expected
        while self._cursor < len(expected):
            chunk = expected[self._cursor]
            self._cursor += 1
            index = chunk.index
            if (
                index in self._open
                and index not in staged
                and index not in self._not_ahead
                and not self._fresh[index]
                and chunk.transfer_nbytes
            ):
                return chunk
        return None
