"""BackwardStep: one outer step driven by the backward pass, each chunk stepped as soon as its grads are final."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .context import OpenStep
from .dtensor import local
from .pipeline import ChunkPipeline, Event, Pending, note_failure
from .planner import Chunk
from .staging import Slot

__all__ = ["BackwardStep"]

logger = logging.getLogger(__name__)


class BackwardStep:
    """Steps the chunks of one outer step from post-accumulate-grad hooks, during the backward pass.

    [Note: Step in backward]
    With ``step_in_backward=True`` every param has a post-accumulate-grad hook. The first hook of a backward opens a
    step (the checks, copies and group counters of ``step()``, the slots' memory) and starts the H2D of the chunk
    expected first ([Note: Backward order] in runner.py). Each hook marks its param's grad final. Once every param of
    a chunk is final, the chunk is stepped on the gate's stream, which first waits for the backward's stream up to
    that point, and written back; then the H2D of the next expected chunk starts in the other slot. A chunk that
    arrives out of the expected order takes the slot over (its H2D queues behind the one it replaces). At the end of
    the backward an autograd callback steps the chunks still open (some of their params got no grad, as a plain step
    would skip them) and closes the step.

    Reentrant activation checkpointing runs a nested backward for each checkpointed segment, and the grads of the
    params inside it arrive there. A callback queued from a hook goes to the backward the hook runs in, so each
    backward a hook runs in gets one; the callback of a nested backward (it ends while an enclosing autograd node
    still runs) leaves the step open. If no hook ran in the outermost backward, ``step()`` closes the step.

    Each chunk runs the inner step on the same bytes as ``step()`` would; only the order of the chunks differs, and
    the inner's update of a param depends on that param alone. So the result is bitwise that of the plain loop, for
    a loop without gradient clipping or loss scaling: their changes to the grads come after the update.

    Args:
        pipeline: the per-chunk operations ([Note: Chunk pipeline]).
        expected: the chunks to expect, in the order the backward should finish them.
        step: the outer step, opened by the caller.
        on_close: called once the step is closed (False) or aborted (True): the caller's own clean-up.
    """

    def __init__(
        self,
        pipeline: ChunkPipeline,
        expected: Sequence[Chunk],
        step: OpenStep,
        on_close: Callable[[bool], None],
    ) -> None:
        self.pipeline = pipeline
        self.expected = list(expected)
        self.counters = step.counters
        self.record = step.record
        self._on_close = on_close
        self._chunk_of = {i: c for c in self.expected for i in c.params}
        self._open = {c.index: set(c.params) for c in self.expected}
        self._fresh = {c.index: not pipeline.has_state(c) for c in self.expected}
        self._done: list[Chunk] = []
        self._staged: tuple[Chunk, Event] | None = None  # (chunk, H2D event) in the next slot
        self._first_open = 0  # position in ``expected`` before which every chunk has stepped
        self.closed = False
        self._watched: set[int] = set()  # graph tasks (backward passes) whose end calls close_at_end
        self.arrivals: dict[int, int] = {}  # param index -> rank of its final grad in this backward
        self.versions: dict[int, int] = {}  # param index -> its grad's version when the chunk was stepped

    # ------------------------------------------------------------------ driven by the hooks
    def begin(self) -> None:
        """Take the slots' memory and start the H2D of the chunk expected first."""
        try:
            self.pipeline.start(self.expected, [self._fresh[c.index] for c in self.expected], depth=0)
            self._stage_next()
        except BaseException:
            self.abort(None)
            raise

    def grad_ready(self, index: int) -> None:
        """Param ``index`` has its final grad; step its chunk once all of the chunk's params do."""
        if self.closed:
            return
        self.arrivals.setdefault(index, len(self.arrivals))
        chunk = self._chunk_of.get(index)
        if chunk is None:
            return
        waiting = self._open.get(chunk.index)
        if waiting is None:
            return  # stepped already (a param whose grad is accumulated twice in one backward)
        waiting.discard(index)
        if not waiting:
            self._run(chunk)

    def close_with_backward(self) -> None:
        """Close the step at the end of the backward pass the current hook runs in, unless it is a nested one."""
        task = torch._C._current_graph_task_id()
        if task not in self._watched:
            self._watched.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._close_at_end)

    def _close_at_end(self) -> None:
        if torch._C._current_autograd_node() is None:  # the outermost backward ends: every grad is final
            self.close()

    def close(self) -> None:
        """End of the backward: step the chunks still open that have grads, then give the memory back."""
        if self.closed:
            return
        for chunk in self.expected:
            if chunk.index in self._open and self.pipeline.grads(chunk):
                self._run(chunk)
        with self.pipeline.gate.stepping():
            self.record.compute_done()
        if self._staged is not None:
            # A chunk was brought in but got no grad: its H2D may still write the slot, which the finish below
            # would not order against (it records the D2H stream only).
            self.record.add_dropped_stage(self._staged[0])
            self._staged = None
            self.pipeline.drain()
        self.pipeline.finish()
        self.record.transfers_done()
        self.closed = True
        self._on_close(False)

    def abort(self, pending: Pending | None) -> bool:
        """Roll the failing chunk back (or forward), let committed write-backs land, free the slots."""
        forward = self.pipeline.abort(pending)
        self.closed = True
        self._on_close(True)
        return forward

    # ------------------------------------------------------------------ one chunk
    def _run(self, chunk: Chunk) -> None:
        pipeline = self.pipeline
        del self._open[chunk.index]
        self._keep_grads_alive(chunk)
        position = len(self._done)
        slot = pipeline.slot_for(position)
        fresh = self._fresh[chunk.index]
        pending: Pending | None = None
        try:
            matched, event = self._take_staged(chunk, slot)
            with pipeline.gate.stepping():
                if not fresh and not matched:
                    event = pipeline.stage(chunk, slot)
                pending = pipeline.step(chunk, slot, fresh, event, self.counters)
                pipeline.commit(chunk, pending)
                pending = None
            self._record_versions(chunk)
            self._done.append(chunk)
            self.record.add_chunk(chunk, fresh, pipeline.pool)
            self._stage_next()
        except BaseException as exc:
            committed = len(self._done) + (1 if self.abort(pending) else 0)
            note_failure(exc, self._done + [chunk], position, committed)
            raise

    def _keep_grads_alive(self, chunk: Chunk) -> None:
        self.pipeline.gate.keep_alive(local(g) for _, g in self.pipeline.grads(chunk))

    def _record_versions(self, chunk: Chunk) -> None:
        """Each grad's version after its update: a later change (clipping, unscaling) is refused at ``step()``."""
        for i, grad in self.pipeline.grads(chunk):
            self.versions[i] = grad._version

    def _take_staged(self, chunk: Chunk, slot: Slot) -> tuple[bool, Event]:
        """Whether ``chunk`` is the one staged in its slot, and its H2D event; otherwise the slot is handed over."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[0].index == chunk.index:
            return True, staged[1]
        if staged is not None:
            self.pipeline.release_staged(slot)
            self.record.add_dropped_stage(staged[0])
        return False, None

    def _stage_next(self) -> None:
        """Start the H2D of the next expected chunk (if it has state) in the slot of the next position."""
        expected = self.expected
        while self._first_open < len(expected) and expected[self._first_open].index not in self._open:
            self._first_open += 1  # chunks never reopen: the scan resumes where the last one stopped
        if self._first_open < len(expected):
            chunk = expected[self._first_open]
            if not self._fresh[chunk.index] and chunk.transfer_nbytes:
                self._staged = (chunk, self.pipeline.stage(chunk, self.pipeline.slot_for(len(self._done))))
