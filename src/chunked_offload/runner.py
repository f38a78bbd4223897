"""StepRunner: drives the outer steps in every mode, and is the only code that changes the wrapper's phase."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from . import backward_watch as refusals
from . import notices
from .backward_loop import BackwardLoop
from .budget import AutoBudget
from .checks import check_grads
from .context import StepContext, skipped_by_scaler
from .dtensor import local
from .gate import StepGate
from .grad_hooks import GradHooks
from .in_backward import BackwardSchedule
from .layout import Layout
from .mode import StepMode
from .notices import Notices, warn
from .phase import Phase, PhaseMachine
from .pipeline import ChunkPipeline
from .placement import Placement
from .planner import Chunk
from .schedule import StepSchedule
from .telemetry import StepRecord
from .transfer import MoveHandle

__all__ = ["StepRunner"]


class StepRunner:
    """Runs the wrapper's outer steps in its mode ([Note: Step modes] in mode.py), and what must wait for them.

    It alone moves the phase ([Note: Phases]): the parts it drives (the schedules, the placement) report what they
    did. Every call that reads or writes what a step touches first enqueues what is deferred (``flush``) and orders
    the caller's stream after the step (``join``); ``synchronize`` waits on the host.

    Args:
        parts: what it drives (``wiring.build_parts``): the inner optimizer, its placement, the step context, the
            ordered schedule, the phase, the one-time notices.
        mode: how steps run beside the caller's code.
        post_hooks: the wrapper's own step post-hooks (a step does not defer while any post-hook is registered).
        grad_hooks: with ``step_in_backward``, put on the params of each new layout.
        budget: with ``gpu_budget_mb="auto"``, re-plans the resident share before a step ([Note: Auto budget]).
    """

    def __init__(
        self,
        placement: Placement,
        context: StepContext,
        schedule: StepSchedule,
        phase: PhaseMachine,
        notices: Notices,
        *,
        mode: StepMode,
        post_hooks: Mapping[int, Any],
        grad_hooks: GradHooks,
        budget: AutoBudget | None = None,
    ) -> None:
        self.inner = placement.inner
        self.placement = placement
        self.context = context
        self.schedule = schedule
        self.pipeline: ChunkPipeline = schedule.pipeline
        self.gate: StepGate = schedule.pipeline.gate
        self.phase = phase
        self.notices = notices
        self.mode = mode  # asked, never copied: what each mode does differently reads it
        self.post_hooks = post_hooks
        self.grad_hooks = grad_hooks
        self.budget = budget
        self.opened = 0  # steps opened so far
        self.last_step: StepRecord | None = None
        self.loop = BackwardLoop(mode, schedule.pipeline, self.inner.param_groups)
        self.backward: BackwardSchedule | None = None  # while IN_BACKWARD
        self._layout: Layout | None = None  # the layout the grad hooks and the phase were last brought in line with
        self._grads_seen = False  # in the backward mode: a grad hook of its params ran since the last step

    # ------------------------------------------------------------------ step()
    def step(self, closure: Callable[[], Any] | None, scaler: Mapping[str, torch.Tensor]) -> Any:
        """One outer step ([Note: Step modes]); ``scaler`` holds GradScaler's tensors set on the wrapper."""
        self.reap()
        self.phase.require("step()", Phase.IDLE, Phase.OFFLOADED, Phase.DEFERRED, Phase.IN_BACKWARD, Phase.ACCUMULATING)
        args = (closure,) if closure is not None else ()
        args, kwargs = self.context.run_inner_hooks("_optimizer_step_pre_hooks", args, {})
        closure = args[0] if args else kwargs.get("closure")
        loss = None
        if self.phase.resting is Phase.IN_BACKWARD:  # inside accumulating() too
            if closure is not None:
                raise ValueError(refusals.CLOSURE_AFTER_BACKWARD)
            self._finish_in_backward(scaler)
        else:
            if closure is not None:
                with torch.enable_grad(), self.loop.suspend():  # the closure's backward does not step: step() does
                    loss = closure()
            self._run_step(scaler)
        self.context.run_inner_hooks("_optimizer_step_post_hooks", args, kwargs)
        self._grads_seen = False
        return loss

    def _run_step(self, scaler: Mapping[str, torch.Tensor]) -> None:
        """A step of what has grads now, by the ordered schedule ([Note: Step schedule])."""
        observed = self.loop.check_observation(bool(scaler))
        chunks = self.chunks_to_step()
        if self.mode.in_backward and self.opened and chunks and not self._grads_seen:
            self.notices.warn("no-grad-hooks", notices.NO_GRAD_HOOKS)
        skip_staged = skipped_by_scaler(scaler)
        gated = self.mode.defers and self.gate.gating
        eager = sum(1 for c in chunks if self.schedule.eager(c)) if gated else len(chunks)
        detached = eager < len(chunks)  # else it runs on the caller's stream ([Note: Overlapped step])
        # [Note: Deferred chunks]: a post-hook expects the step done (an EMA of the weights).
        defer = detached and not skip_staged and not scaler and not self.context.has_post_hooks(self.post_hooks)
        if detached:
            self.gate.keep_alive(local(g) for c in chunks for _, g in self.pipeline.grads(c))
        resting = self.phase.phase
        self.phase.to(Phase.STEPPING)
        try:
            step = self.context.open(scaler)
            self.opened += 1
            try:
                self.schedule.run(chunks, step, skip_staged=skip_staged, defer=defer, own=detached, eager=eager)
            finally:
                step.close()
        except BaseException:
            self.phase.to(Phase.IDLE)
            if resting is Phase.ACCUMULATING:
                self.phase.to(Phase.ACCUMULATING)
            self.gate.join()  # the caller's stream goes on only after whatever the failed step enqueued
            raise
        self.phase.to(Phase.DEFERRED if self.schedule.deferred is not None else Phase.IDLE)
        if resting is Phase.ACCUMULATING:  # a plain step inside the block: nothing is left deferred past it
            self.flush()
            self.phase.to(Phase.ACCUMULATING)
        self.loop.observing = self.loop.observing and not observed  # after an observed step, the next backward steps
        self.last_step = step.record
        self._after_step(chunks[:eager] if detached else None)

    def _after_step(self, eager: list[Chunk] | None) -> None:
        """Order the caller's stream after what it reads next: the whole step, or (``eager``: the step runs on)
        the chunks no attached forward waits for."""
        if self.mode.defers:
            self.schedule.reads.start()  # the next forward's reads order the next step's chunks
            if not self.gate.attached:
                self.notices.warn("overlap-unattached", notices.UNATTACHED)
        if eager is None:
            self.gate.join()  # the caller's next work (a forward, grads zeroed in place) waits for the whole step
        elif eager:  # no attached forward waits for the params of these chunks: the caller's stream does, now
            self.gate.wait_params([i for c in eager for i in c.params])
        if self.last_step is not None:
            self.last_step.log(len(self.placement.plan.all_chunks))

    def chunks_to_step(self) -> list[Chunk]:
        """Check that a step can run, bring the layout up to date; the chunks with at least one grad, in the order
        the step runs them ([Note: Read order])."""
        self._prepare()
        check_grads(self.placement.infos, self.placement.adapter)
        chunks = [c for c in self.placement.plan.all_chunks if self.pipeline.grads(c)]
        if self.mode.defers and self.gate.gating:
            self.schedule.order(chunks)
        return chunks

    def _prepare(self) -> None:
        """Before a step opens: deferred chunks go first, the layout is brought up to date, resident state is back."""
        self.flush()
        self.schedule.watch.settle()
        self.schedule.kept.settle()  # the last step's kept grads are read: their held writes run before this one's
        with self.installing():
            self.context.prepare()
            self.placement.reload(non_blocking=False)  # a no-op unless offloaded
            if self.budget is not None:
                self.budget.before_step(self.opened)

    def prefetch(self) -> None:
        if self.mode.in_backward:
            return  # the backward pass brings the chunks in itself
        self.schedule.prefetch(self.chunks_to_step())

    # ------------------------------------------------------------------ the step in the backward pass
    def grad_final(self, param: torch.Tensor) -> None:
        """A param's grad is final in this backward pass ([Note: Step in backward])."""
        self.reap()
        index = self.placement.binding.index_of(param)
        if index is None:
            return
        self._grads_seen = True
        if self.loop.suspended or self.phase.phase is Phase.ACCUMULATING:
            return
        if self.loop.observing:
            if self.loop.observation is None:
                self.flush()  # before its grads are recorded: a deferred chunk still reads the last step's copies
            self.loop.observe(index)
            return
        backward = self.backward
        if backward is None:
            backward = self._open_backward()
        elif backward.closed:
            raise RuntimeError(refusals.SECOND_BACKWARD)
        backward.close_with_backward()
        backward.grad_ready(index)

    def _open_backward(self) -> BackwardSchedule:
        """The first final grad of a backward: the checks and opening of ``step()``, then the first H2D."""
        self._prepare()  # a step() of grads set by hand may have deferred chunks: they go first
        self.phase.require("a backward pass that steps", Phase.IDLE)
        self.pipeline.ahead.drop()
        self.context.run_inner_hooks("_optimizer_step_pre_hooks", (), {})
        self.phase.to(Phase.IN_BACKWARD)
        try:
            step = self.context.open({})
        except BaseException:
            self.phase.to(Phase.IDLE)
            raise
        self.opened += 1
        ref = weakref.ref(self)  # the step holds this callback: no cycle back to the runner

        def on_close(backward: BackwardSchedule, aborted: bool) -> None:
            step.close()
            runner = ref()
            if runner is not None:
                runner._backward_closed(backward, aborted)

        expected, not_ahead, accumulations = self.loop.expected()
        backward = BackwardSchedule(self.pipeline, expected, step, on_close, not_ahead, accumulations)
        self.backward = backward
        self.last_step = step.record
        backward.begin()
        return backward

    def _backward_closed(self, backward: BackwardSchedule, aborted: bool) -> None:
        if aborted:  # the exception leaves the backward; a later step() steps what has grads, as plain torch
            self.backward = None
            self.phase.rest(Phase.IDLE)
            return
        self.loop.learn(backward)
        # The caller's code after backward() (clipping, zeroing) must not write grads the step stream still reads.
        self.gate.join()

    def reap(self) -> None:
        """Close a step whose backward pass raised after some chunks had stepped ([Note: Watching the backward])."""
        self.loop.forget_observation(aborted_only=True)  # a plain step() of what has grads follows
        backward = self.backward
        if backward is None or backward.closed or not backward.watch.aborted:
            return
        stepped = backward.stepped
        backward.abort(None)
        warn(refusals.aborted_note(stepped, len(self.placement.plan.all_chunks)))

    def _finish_in_backward(self, scaler: Mapping[str, torch.Tensor]) -> None:
        """``step()`` after a backward that stepped: refuse what changed the grads or the groups after the update."""
        backward = self.backward
        if backward is not None and not backward.closed:
            backward.close()  # its backward was nested in one that never reached a hook (checkpointing)
        self.backward = None
        self.phase.rest(Phase.IDLE)
        self.loop.finish(backward, bool(scaler))
        if not self.gate.attached:
            self.gate.join()  # no module waits for its own params: the next forward waits for the whole step

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside do not step (``step_in_backward``); the phase goes back where it was after."""
        if not self.mode.in_backward:
            self.notices.warn("accumulating", notices.NOT_ACCUMULATING)
            yield
            return
        self.flush()
        if self.phase.phase is Phase.ACCUMULATING:
            yield
            return
        self.phase.require("opt.accumulating()", Phase.IDLE, Phase.OFFLOADED, Phase.IN_BACKWARD)
        with self.phase.accumulating():
            yield

    # ------------------------------------------------------------------ waiting for the step
    def flush(self) -> None:
        """Read the last step's checks, enqueue its deferred chunks (and close a step whose backward raised)."""
        self.loop.settle()  # [Note: Checks off the host]
        self.reap()
        if self.phase.phase is Phase.DEFERRED:
            self.advance(None)

    def advance(self, indices: Sequence[int] | None) -> None:
        """Enqueue the deferred chunks a forward reading ``indices`` needs (None: all) ([Note: Deferred chunks])."""
        if self.phase.phase is not Phase.DEFERRED:
            return
        until = self.schedule.due(indices)
        if until is None:
            return
        self.phase.to(Phase.STEPPING)
        try:
            self.schedule.advance(until)
        finally:
            self.phase.to(Phase.DEFERRED if self.schedule.deferred is not None else Phase.IDLE)

    def join(self) -> None:
        """Order the caller's stream after the whole last step."""
        self.flush()
        self.gate.join()
        self.schedule.watch.settle()  # the caller's stream is ordered after every update now
        self.schedule.kept.settle()

    def synchronize(self) -> None:
        """Block the host until the last step's updates and write-backs have landed."""
        self.flush()
        self.placement.synchronize()

    # ------------------------------------------------------------------ the layout and the resident state
    @contextmanager
    def installing(self) -> Iterator[None]:
        """Around code that may install a new layout: then the grad hooks go on its params, and the phase leaves
        OFFLOADED when the layout placed the resident state on the device."""
        try:
            yield
        finally:
            layout = self.placement.layout
            if layout is not None and layout is not self._layout:
                self._layout = layout
                if self.mode.in_backward:
                    self.grad_hooks.set([info.param for info in layout.infos], self)
            self._rest_where_placed()

    def sync(self, *, force: bool = False, strict: bool = True) -> None:
        """Bring the layout in line with the inner optimizer (``Placement.sync``)."""
        with self.installing():
            self.placement.sync(force=force, strict=strict)

    def _rest_where_placed(self) -> None:
        offloaded = self.placement.offloaded
        if offloaded != (self.phase.resting is Phase.OFFLOADED):
            self.phase.rest(Phase.OFFLOADED if offloaded else Phase.IDLE)

    def move_resident(self, offload: bool, non_blocking: bool) -> MoveHandle:
        """``offload()`` (to page-locked host memory) or ``reload()``; the phase follows where the state is."""
        self.join()
        self.phase.require("offload()" if offload else "reload()", Phase.IDLE, Phase.OFFLOADED, Phase.ACCUMULATING)
        if offload:
            self.sync()
            self.pipeline.flush_write_back()  # its slot's memory goes back too
        try:
            return self.placement.offload(non_blocking) if offload else self.placement.reload(non_blocking)
        finally:
            self._rest_where_placed()
