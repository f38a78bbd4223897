"""BackwardLoop: what a ``step_in_backward`` wrapper carries from one backward pass to the next, and its checks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from . import backward_watch as refusals
from .backward_watch import ObservedBackward
from .in_backward import BackwardOrder, BackwardSchedule
from .inputs import GradComparison, GradRecord, GroupSnapshot
from .mode import StepMode
from .pipeline import ChunkPipeline
from .planner import Chunk

__all__ = ["BackwardLoop"]


class BackwardLoop:
    """Whether the next backward observes or steps, what it observed, the grad order it learned, and the checks
    ``step()`` makes of the loop's code between the backward and ``step()``.

    The first backward of a wrapper, and the first after a refusal, observes ([Note: Observed backward]); the backward
    passes after it step, in the order the last one showed ([Note: Backward order]). ``step()`` after either compares
    the grads and group values with what the update read ([Note: Inputs of a step]). The step runner moves the phase
    around all of it.

    Args:
        mode: the wrapper's step mode (only ``step_in_backward`` ever observes or steps in a backward).
        pipeline: the per-chunk operations (the grads the inner reads, the step stream).
        groups: the inner optimizer's param groups.
    """

    def __init__(self, mode: StepMode, pipeline: ChunkPipeline, groups: list[dict[str, Any]]) -> None:
        self.pipeline = pipeline
        self.groups = groups
        self.order = BackwardOrder()
        self.observing = mode.in_backward  # the next backward observes, steps nothing
        self.observation: ObservedBackward | None = None
        self._groups_after: GroupSnapshot | None = None  # the groups as the last step in the backward left them
        self._suspended = 0  # inside step(closure): backward passes do not step
        self._pending: GradComparison | None = None  # the last step()'s comparison, while its outcome is unread

    def _indices(self) -> list[int]:
        return [i for c in self.chunks() for i in c.params]

    def chunks(self) -> Sequence[Chunk]:
        return self.pipeline.require_layout().plan.all_chunks

    # ------------------------------------------------------------------ observing
    def observe(self, index: int) -> None:
        """A final grad in a backward that observes."""
        if self.observation is None:
            self.observation = ObservedBackward(self.pipeline.grad_of, self._indices(), self.groups)
        self.observation.grad_ready(index)

    def forget_observation(self, aborted_only: bool = False) -> None:
        """Drop the observation (its grads are gone, or its backward raised: a plain ``step()`` follows)."""
        if self.observation is not None and (not aborted_only or self.observation.watch.aborted):
            self.observation = None

    def check_observation(self, scaled: bool) -> bool:
        """Before a plain step: refuse, with nothing updated, a loop that cannot step in the backward; whether an
        observation was checked (once that step has run, the next backward steps)."""
        observation, self.observation = self.observation, None
        if observation is None or not observation.complete:
            return False
        message = observation.refusal(scaled) or self._changes(observation.grads, observation.groups, stepped=False)
        if message:
            raise RuntimeError(message)
        self.order.learn(observation.arrivals, observation.counts)
        return True

    @property
    def suspended(self) -> bool:
        return self._suspended > 0

    @contextmanager
    def suspend(self) -> Iterator[None]:
        """Backward passes inside do not step (``step(closure)``: its backward does not step; the step() does)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # ------------------------------------------------------------------ stepping
    def expected(self) -> tuple[list[Chunk], frozenset[int], Mapping[int, int]]:
        """The chunks in the order the next backward should finish them, those not to stage ahead, and the params
        expected more than once ([Note: Backward order])."""
        expected, not_ahead = self.order.expected(self.chunks())
        return expected, not_ahead, self.order.accumulations

    def learn(self, backward: BackwardSchedule) -> None:
        """A backward that stepped ended: keep its order and the groups it left."""
        self.order.learn(backward.arrivals, backward.counts)
        self._groups_after = GroupSnapshot(self.groups)

    def finish(self, backward: BackwardSchedule | None, scaled: bool) -> None:
        """``step()`` after a backward that stepped: refuse what changed the grads or the groups after the update
        (the next backward then observes the loop again). The grads are compared on the device; the outcome is read
        now if it is there, else before the next update ([Note: Checks off the host])."""
        self.settle()
        message = refusals.SCALED_IN_BACKWARD if scaled else None
        if message is None and backward is not None:
            written = self._groups_after.changes(self.groups) if self._groups_after is not None else []
            message = refusals.changes_refusal([], written, stepped=True)
            if message is None:
                # On the caller's stream: after its own work, and after the records (the end of the backward ordered
                # it after the step stream); what it enqueues next (a zero_grad, a graph replay) comes after.
                self._pending = backward.grads.compare(self.pipeline.grad_of, self._indices())
                self.settle(wait=False)
        if message:
            self.observing = True
            raise RuntimeError(message)

    def settle(self, wait: bool = True) -> None:
        """Read the outcome of the last ``step()``'s comparison of the grads, and refuse a change; ``wait=False``:
        only if the device has computed it."""
        pending = self._pending
        if pending is None or not (wait or pending.ready()):
            return
        self._pending = None
        message = refusals.changes_refusal(pending.result(), [], stepped=True)
        if message:
            self.observing = True
            raise RuntimeError(message if not wait else message + refusals.FOUND_LATE)

    def _changes(self, grads: GradRecord, groups: GroupSnapshot | None, *, stepped: bool) -> str | None:
        """Why a step whose grads or group values changed since the backward is refused, or None."""
        with self.pipeline.gate.stepping():  # after the caller's work and after the step stream's own records
            changed = grads.changed(self.pipeline.grad_of, self._indices())
        written = groups.changes(self.groups) if groups is not None else []
        return refusals.changes_refusal(changed, written, stepped=stepped)
