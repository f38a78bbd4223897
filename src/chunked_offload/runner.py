"""StepRunner: the step's runtime; it drives outer steps in every mode and owns the wrapper's phase."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from . import backward_watch as refusals
from .adapters import Adapter
from .backward_watch import ObservedBackward
from .budget import AutoBudget
from .checks import check_grads
from .context import StepContext, skipped_by_scaler
from .dtensor import local
from .gate import StepGate
from .in_backward import BackwardOrder, BackwardStep
from .inputs import GradRecord, GroupSnapshot
from .mode import StepMode
from .notices import Notices, warn
from .phase import Phase, PhaseMachine
from .pipeline import ChunkPipeline
from .placement import Placement
from .planner import Chunk
from .schedule import StepSchedule
from .telemetry import StepRecord, StepStats
from .transfer import MoveHandle

__all__ = ["StepRunner"]

logger = logging.getLogger(__name__)

_MIB = 2**20


class StepRunner:
    """Runs the wrapper's outer steps, in whichever mode, and everything that must wait for them.

    [Note: Step modes]
    - ``step()`` opens a step (``StepContext``), and the ordered driver (``StepSchedule``) steps the chunks with a
      grad in parameter order, or in the order the forward reads them ([Note: Read order]). With ``overlap=True``
      they run on the gate's stream; with an attached model only the first ``num_slots`` are enqueued and the rest
      are *deferred* to the forward hooks that read their params (phase DEFERRED). Without an attached model the
      caller's stream waits for the whole step.
    - With ``step_in_backward=True`` the first backward observes the loop and its ``step()`` is a plain one ([Note:
      Observed backward]). In the backward passes after it the first final grad opens the step, and the event-driven
      driver (``BackwardStep``) steps each chunk once its grads are final (phase IN_BACKWARD); ``step()`` then
      compares the grads and groups with what the chunks read ([Note: Inputs of a step]).
    - Every call that reads or writes what a step touches first enqueues what is deferred (``flush``) and orders
      the caller's stream after the step (``join``); ``synchronize`` waits on the host.

    Args:
        inner: the wrapped optimizer.
        adapter: its adapter.
        placement: the layout's owner.
        context: opens and closes steps.
        schedule: the ordered driver.
        phase: the wrapper's phase.
        notices: one-time warnings.
        mode: how steps run beside the caller's code.
        post_hooks: the wrapper's own step post-hooks (a step does not defer while any post-hook is registered).
        budget: with ``gpu_budget_mb="auto"``, re-plans the resident share before a step ([Note: Auto budget]).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        adapter: Adapter,
        placement: Placement,
        context: StepContext,
        schedule: StepSchedule,
        phase: PhaseMachine,
        notices: Notices,
        *,
        mode: StepMode,
        post_hooks: Mapping[int, Any],
        budget: AutoBudget | None = None,
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.placement = placement
        self.context = context
        self.schedule = schedule
        self.phase = phase
        self.notices = notices
        self.mode = mode
        self.overlap = mode is StepMode.OVERLAP
        self.step_in_backward = mode is StepMode.IN_BACKWARD
        self.post_hooks = post_hooks
        self.budget = budget
        self.opened = 0  # steps opened so far
        self.last_step: StepRecord | None = None
        self.backward: BackwardStep | None = None  # while IN_BACKWARD
        self.order = BackwardOrder()  # [Note: Backward order]
        self.observing = self.step_in_backward  # [Note: Observed backward]: the next backward observes, steps nothing
        self.observation: ObservedBackward | None = None
        self._groups_after: GroupSnapshot | None = None  # the groups as the last in-backward step left them
        self._suspended = 0  # inside step(closure): backward passes do not step

    @property
    def pipeline(self) -> ChunkPipeline:
        return self.schedule.pipeline

    @property
    def gate(self) -> StepGate:
        return self.pipeline.gate

    # ------------------------------------------------------------------ step()
    def step(self, closure: Callable[[], Any] | None, scaler: Mapping[str, torch.Tensor]) -> Any:
        """One outer step ([Note: Step modes]); ``scaler`` holds GradScaler's tensors set on the wrapper."""
        self._reap()
        self.phase.require("step()", Phase.IDLE, Phase.OFFLOADED, Phase.DEFERRED, Phase.IN_BACKWARD, Phase.ACCUMULATING)
        args = (closure,) if closure is not None else ()
        args, kwargs = self.context.run_inner_hooks("_optimizer_step_pre_hooks", args, {})
        closure = args[0] if args else kwargs.get("closure")
        if self.phase.resting is Phase.IN_BACKWARD:  # inside accumulating() too
            if closure is not None:
                raise ValueError(
                    "step(closure) after a backward pass that stepped (step_in_backward=True): the update has run "
                    "already. Call step() without a closure after that backward, or run the closure's backward only"
                )
            self._finish_in_backward(scaler)
            self.context.run_inner_hooks("_optimizer_step_post_hooks", args, kwargs)
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad(), self._suspend():  # the closure's backward does not step: this step() does
                loss = closure()
        observed = self._check_observation(scaler)
        chunks = self.chunks_to_step()
        skip_staged = skipped_by_scaler(scaler)
        defer = self._may_defer(skip_staged, scaler)
        detached = self.overlap and self.gate.gating  # the caller's stream goes on without the whole step
        eager = sum(1 for c in chunks if self.schedule.eager(c)) if detached else 0
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
        self.observing = self.observing and not observed  # after an observed step, the next backward steps
        record = self.last_step = step.record
        if self.overlap:
            self.schedule.reads.start()  # the next forward's reads order the next step's chunks
        if self.overlap and not self.gate.attached:
            self.notices.warn(
                "overlap-unattached",
                "overlap=True without an attached model: step() makes the caller's stream wait for the whole step, "
                "so nothing overlaps it. Call opt.attach(model) so that each module's forward waits for its own params",
            )
        if not detached:
            self.gate.join()  # the caller's next work (a forward, grads zeroed in place) waits for the whole step
        elif eager:  # no attached forward waits for the params of these chunks: the caller's stream does, now
            self.gate.wait_params([i for c in chunks[:eager] for i in c.params])
        logger.debug(
            "step: %d of %d chunks, %.1f MiB H2D, %.1f MiB D2H, %.1f MiB D2D, window %.1f MiB",
            record.chunks, len(self.placement.plan.all_chunks), record.h2d / _MIB, record.d2h / _MIB,
            record.d2d / _MIB, record.window / _MIB,
        )  # fmt: skip
        self.context.run_inner_hooks("_optimizer_step_post_hooks", args, kwargs)
        return loss

    def chunks_to_step(self) -> list[Chunk]:
        """Check that a step can run, bring the layout up to date; the chunks with at least one grad, in the order
        the step runs them ([Note: Read order])."""
        self._prepare()
        check_grads(self.placement.infos, self.adapter)
        chunks = [c for c in self.placement.plan.all_chunks if self.pipeline.grads(c)]
        if self.overlap and self.gate.gating:
            self.schedule.reads.sort(chunks)  # [Note: Read order]
            chunks.sort(key=lambda c: not self.schedule.eager(c))  # stable: the eager chunks first, in that order
        return chunks

    def _prepare(self) -> None:
        """Before a step opens: deferred chunks go first, the layout is brought up to date, resident state is back."""
        self.flush()
        self.schedule.watch.settle()
        self.context.prepare()
        if self.phase.resting is Phase.OFFLOADED:
            self.placement.reload(non_blocking=False)
        if self.budget is not None:
            self.budget.before_step(self.opened)

    def _may_defer(self, skip_staged: bool, scaler: Mapping[str, torch.Tensor]) -> bool:
        """Whether this step may leave its later chunks to the forwards that read them ([Note: Deferred chunks])."""
        return (
            self.overlap
            and self.gate.gating
            and not skip_staged
            and not scaler
            # A post-hook expects the step done (an EMA of the weights).
            and not (self.post_hooks or getattr(self.inner, "_optimizer_step_post_hooks", {}))
            and not torch_optimizer._global_optimizer_post_hooks
        )

    def prefetch(self) -> None:
        if self.step_in_backward:
            return  # the backward pass brings the chunks in itself
        self.schedule.prefetch(self.chunks_to_step())

    # ------------------------------------------------------------------ the step in the backward pass
    def grad_final(self, param: torch.Tensor) -> None:
        """A param's grad is final in this backward pass ([Note: Step in backward])."""
        self._reap()
        if self._suspended or self.phase.phase is Phase.ACCUMULATING:
            return
        index = self.placement.binding.index_of(param)
        if index is None:
            return
        if self.observing:
            if self.observation is None:
                self.flush()
                indices = [i for c in self.placement.plan.all_chunks for i in c.params]
                self.observation = ObservedBackward(self.pipeline.grad_of, indices, self.inner.param_groups)
            self.observation.grad_ready(index)
            return
        backward = self.backward
        if backward is None:
            backward = self._open_backward()
        elif backward.closed:
            raise RuntimeError(refusals.SECOND_BACKWARD)
        backward.close_with_backward()
        backward.grad_ready(index)

    def _open_backward(self) -> BackwardStep:
        """The first final grad of a backward: the checks and opening of ``step()``, then the first H2D."""
        self._prepare()  # a step() of grads set by hand may have deferred chunks: they go first
        self.phase.require("a backward pass that steps", Phase.IDLE)
        self.pipeline.drop_prefetch()
        self.context.run_inner_hooks("_optimizer_step_pre_hooks", (), {})
        self.phase.to(Phase.IN_BACKWARD)
        try:
            step = self.context.open({})
        except BaseException:
            self.phase.to(Phase.IDLE)
            raise
        self.opened += 1
        ref = weakref.ref(self)  # the step holds this callback: no cycle back to the runner

        def on_close(backward: BackwardStep, aborted: bool) -> None:
            step.close()
            runner = ref()
            if runner is not None:
                runner._backward_closed(backward, aborted)

        expected, not_ahead = self.order.expected(self.placement.plan.all_chunks)
        backward = BackwardStep(self.pipeline, expected, step, on_close, not_ahead, self.order.accumulations)
        self.backward = backward
        self.last_step = step.record
        backward.begin()
        return backward

    def _backward_closed(self, backward: BackwardStep, aborted: bool) -> None:
        if aborted:  # the exception leaves the backward; a later step() steps what has grads, as plain torch
            self.backward = None
            self.phase.rest(Phase.IDLE)
            return
        self.order.learn(backward.arrivals, backward.counts)
        self._groups_after = GroupSnapshot(self.inner.param_groups)
        # The caller's code after backward() (clipping, zeroing) must not write grads the step stream still reads.
        self.gate.join()

    def _reap(self) -> None:
        """Close a step whose backward pass raised after some chunks had stepped ([Note: Watching the backward])."""
        observation = self.observation
        if observation is not None and observation.watch.aborted:
            self.observation = None  # a plain step() of what has grads follows, as after any failed backward
        backward = self.backward
        if backward is None or backward.closed or not backward.watch.aborted:
            return
        stepped = backward.stepped
        backward.abort(None)
        warn(refusals.aborted_note(stepped, len(self.placement.plan.all_chunks)))

    @contextmanager
    def _suspend(self) -> Iterator[None]:
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _check_observation(self, scaler: Mapping[str, torch.Tensor]) -> bool:
        """Before a plain step: refuse, with nothing updated, a loop that cannot step in the backward ([Note:
        Observed backward]); whether an observation was checked."""
        observation, self.observation = self.observation, None
        if observation is None or not observation.complete:
            return False
        message = observation.refusal(bool(scaler)) or self._changes(observation.grads, observation.groups, False)
        if message:
            raise RuntimeError(message)
        self.order.learn(observation.arrivals, observation.counts)
        return True

    def _finish_in_backward(self, scaler: Mapping[str, torch.Tensor]) -> None:
        """``step()`` after a backward that stepped: refuse what changed the grads or the groups after the update."""
        backward = self.backward
        if backward is not None and not backward.closed:
            backward.close()  # its backward was nested in one that never reached a hook (checkpointing)
        self.backward = None
        self.phase.rest(Phase.IDLE)
        message = refusals.SCALED_IN_BACKWARD if scaler else None
        if message is None and backward is not None:
            message = self._changes(backward.grads, self._groups_after, True)
        if message:
            self.observing = True  # the next backward observes the loop again
            raise RuntimeError(message)
        if not self.gate.attached:
            self.gate.join()  # no module waits for its own params: the next forward waits for the whole step

    def _changes(self, grads: GradRecord, groups: GroupSnapshot | None, stepped: bool) -> str | None:
        """Why a step whose grads or group values changed since the backward is refused, or None ([Note: Inputs of a
        step])."""
        indices = [i for c in self.placement.plan.all_chunks for i in c.params]
        with self.gate.stepping():  # after the caller's work and after the step stream's own records
            changed = grads.changed(self.pipeline.grad_of, indices)
        written = groups.changes(self.inner.param_groups) if groups is not None else []
        return refusals.changes_refusal(changed, written, stepped=stepped)

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside do not step (``step_in_backward``); the phase goes back where it was after."""
        if not self.step_in_backward:
            self.notices.warn(
                "accumulating",
                "opt.accumulating() does nothing without step_in_backward=True: backward passes never step then, "
                "and step() steps with the accumulated grads. Leave the block out",
            )
            yield
            return
        self.flush()
        outer = self.phase.phase
        if outer is Phase.ACCUMULATING:
            yield
            return
        self.phase.require("opt.accumulating()", Phase.IDLE, Phase.OFFLOADED, Phase.IN_BACKWARD)
        self.phase.resume = outer
        self.phase.to(Phase.ACCUMULATING)
        try:
            yield
        finally:
            self.phase.to(self.phase.resume)

    # ------------------------------------------------------------------ waiting for the step
    def flush(self) -> None:
        """Enqueue every deferred chunk of the last step (and close a step whose backward raised)."""
        self._reap()
        if self.phase.phase is Phase.DEFERRED:
            self.schedule.advance(None)

    def join(self) -> None:
        """Order the caller's stream after the whole last step."""
        self.flush()
        self.gate.join()
        self.schedule.watch.settle()  # the caller's stream is ordered after every update now

    def current_phase(self) -> Phase:
        self._reap()  # a backward that raised has closed its step
        return self.phase.phase

    def before_zero_grad(self, set_to_none: bool) -> None:
        """Refused after a backward that stepped; an observed backward's grads are gone; zeroing in place joins the
        step, so that the grads' memory is reused after it (the step reads copies: [Note: Inputs of a step])."""
        self.between_steps("opt.zero_grad()")
        self.observation = None
        if not set_to_none:
            self.join()

    def between_steps(self, what: str) -> None:
        """Refuse ``what`` between a backward pass that stepped and ``step()``: it would act after the update."""
        self._reap()
        if self.phase.resting is Phase.IN_BACKWARD:
            raise RuntimeError(refusals.between_steps(what))

    def synchronize(self) -> None:
        """Block the host until the last step's updates and write-backs have landed."""
        self.flush()
        self.placement.synchronize()

    def land_held_write_back(self) -> None:
        """Block the host until a write-back held from the last step has landed ([Note: Held write-back])."""
        if self.pipeline.held_slot is not None:
            self.pipeline.synchronize()

    def wait_for(self, indices: list[int], streams: Sequence[torch.cuda.Stream] = ()) -> None:
        """Before a forward reads these params: enqueue their deferred chunks, and wait for their updates."""
        self.schedule.reads.record(indices)
        if self.phase.phase is Phase.DEFERRED:
            self.schedule.advance(indices)
        self.schedule.watch.check(indices)
        self.gate.wait_params(indices, streams)
        self.schedule.watch.forget(indices)  # the forward reads them after their updates: writes may follow

    def index_of(self, param: torch.Tensor) -> int | None:  # the hooks' lookup
        return self.placement.binding.index_of(param)

    def forward_compiled(self) -> None:
        """Dynamo traced a gate: from now on steps finish before returning ([Note: Gates in compiled graphs])."""
        self.gate.compiled_forward = True
        self.join()

    def forward_done(self) -> None:
        """An attached model's forward returned: the caller's stream goes on after the step; keep its read order."""
        self.join()
        self.schedule.reads.forward_done()

    def attached(self, handle: int, params: list[torch.Tensor] | None) -> None:
        """Attach handle ``handle`` now gates ``params`` (None: it was removed)."""
        if params is None:
            self.gate.gated.pop(handle, None)
        else:
            self.gate.gated[handle] = params
            self.schedule.reads.start()

    def stats(self) -> StepStats | None:
        self.flush()
        p, step = self.placement, self.last_step
        return None if step is None else step.stats(p.resident_device_bytes, p.plan.resident_share, p.pinned_host_bytes)

    # ------------------------------------------------------------------ moving the resident state
    def offload(self, non_blocking: bool) -> MoveHandle:
        self.join()
        self.phase.require("offload()", Phase.IDLE, Phase.OFFLOADED, Phase.ACCUMULATING)
        self.placement.sync()
        self.pipeline.flush_write_back()  # its slot's memory goes back too
        return self.placement.offload(non_blocking)

    def reload(self, non_blocking: bool) -> MoveHandle:
        self.join()
        self.phase.require("reload()", Phase.IDLE, Phase.OFFLOADED, Phase.ACCUMULATING)
        return self.placement.reload(non_blocking)
