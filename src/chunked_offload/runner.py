"""StepRunner: the step's runtime; it drives outer steps in every mode and owns the wrapper's phase."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from .adapters import Adapter
from .budget import AutoBudget
from .checks import check_grads
from .context import StepContext, skipped_by_scaler
from .dtensor import local
from .in_backward import BackwardStep
from .notices import Notices
from .overlap import StepGate
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
    - With ``step_in_backward=True`` the first final grad of a backward opens the step, and the event-driven driver
      (``BackwardStep``) steps each chunk once its grads are final (phase IN_BACKWARD); ``step()`` then only checks
      that nothing changed the grads afterwards.
    - Every call that reads or writes what a step touches first enqueues what is deferred (``flush``) and orders
      the caller's stream after the step (``join``); ``synchronize`` waits on the host.

    [Note: Read order]
    An overlapped step is only as early as the chunk the next forward waits for first. That is not always the first
    chunk: FSDP2's root unit all-gathers the embedding, the final norm and the LM head before the first layer runs, so
    its forward waited for the last chunk, that is for the whole step (measured: 1.11x of the floor exposed on the
    H200, more than the synchronous step). So the pre-hooks of an attached model record the order in which the
    forward after a step first asks for each param, and the next overlapped steps run their chunks in that order
    (params never asked for last, in parameter order). Each chunk's update is the same whatever the order (the
    inner steps each param on its own, as in the backward's order of ``step_in_backward``), so this is bitwise.

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

    Args:
        inner: the wrapped optimizer.
        adapter: its adapter.
        placement: the layout's owner.
        context: opens and closes steps.
        schedule: the ordered driver.
        phase: the wrapper's phase.
        notices: one-time warnings.
        overlap: whether steps overlap the caller's stream.
        step_in_backward: whether the backward pass steps.
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
        overlap: bool,
        step_in_backward: bool,
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
        self.overlap = overlap
        self.step_in_backward = step_in_backward
        self.post_hooks = post_hooks
        self.budget = budget
        self.opened = 0  # steps opened so far
        self.last_step: StepRecord | None = None
        self.backward: BackwardStep | None = None  # while IN_BACKWARD
        # [Note: Read order]: param index -> rank of its first read in the forward being recorded, and in the last
        # whole forward of an attached model.
        self._reads: dict[int, int] | None = None
        self.read_order: dict[int, int] = {}
        self.grad_order: dict[int, int] = {}  # [Note: Backward order]: param index -> rank, in the last backward

    @property
    def pipeline(self) -> ChunkPipeline:
        return self.schedule.pipeline

    @property
    def gate(self) -> StepGate:
        return self.pipeline.gate

    # ------------------------------------------------------------------ step()
    def step(self, closure: Callable[[], Any] | None, scaler: Mapping[str, torch.Tensor]) -> Any:
        """One outer step ([Note: Step modes]); ``scaler`` holds GradScaler's tensors set on the wrapper."""
        self.phase.require("step()", Phase.IDLE, Phase.OFFLOADED, Phase.DEFERRED, Phase.IN_BACKWARD, Phase.ACCUMULATING)
        args = (closure,) if closure is not None else ()
        args, kwargs = self.context.run_inner_hooks("_optimizer_step_pre_hooks", args, {})
        closure = args[0] if args else kwargs.get("closure")
        if self.phase.resting is Phase.IN_BACKWARD:  # inside accumulating() too
            if closure is not None:
                raise ValueError("step(closure) with step_in_backward=True: the backward pass has already stepped")
            self._finish_in_backward(scaler)
            self.context.run_inner_hooks("_optimizer_step_post_hooks", args, kwargs)
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunks = self.chunks_to_step()
        skip_staged = skipped_by_scaler(scaler)
        defer = self._may_defer(skip_staged, scaler)
        self.gate.keep_alive(local(g) for c in chunks for _, g in self.pipeline.grads(c))
        resting = self.phase.phase
        self.phase.to(Phase.STEPPING)
        try:
            step = self.context.open(scaler)
            self.opened += 1
            try:
                self.schedule.run(chunks, step, skip_staged=skip_staged, defer=defer)
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
        record = self.last_step = step.record
        if self.overlap:
            self._reads = {}  # the next forward's reads order the next step's chunks
        if self.overlap and not self.gate.attached:
            self.notices.warn(
                "overlap-unattached",
                "overlap=True without an attached model: step() makes the caller's stream wait for the whole step, "
                "so nothing overlaps it. Call opt.attach(model) so that each module's forward waits for its own params",
            )
            self.gate.join()  # no module waits for its own params: the next forward must wait for the whole step
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
        if self.overlap and self.gate.attached and self.read_order:
            unread = len(self.read_order)
            chunks.sort(key=lambda c: min(self.read_order.get(i, unread) for i in c.params))
        return chunks

    def _prepare(self) -> None:
        """Before a step opens: deferred chunks go first, the layout is brought up to date, resident state is back."""
        self.flush()
        self.context.prepare()
        if self.phase.resting is Phase.OFFLOADED:
            self.placement.reload(non_blocking=False)
        if self.budget is not None:
            self.budget.before_step(self.opened)

    def _may_defer(self, skip_staged: bool, scaler: Mapping[str, torch.Tensor]) -> bool:
        """Whether this step may leave its later chunks to the forwards that read them ([Note: Deferred chunks])."""
        return (
            self.overlap
            and self.gate.attached > 0
            and not skip_staged
            and not scaler
            and not self._has_post_hooks()  # a post-hook expects the step done (an EMA of the weights)
        )

    def _has_post_hooks(self) -> bool:
        inner_hooks = getattr(self.inner, "_optimizer_step_post_hooks", {})
        return bool(self.post_hooks or inner_hooks or torch_optimizer._global_optimizer_post_hooks)

    def prefetch(self) -> None:
        if self.step_in_backward:
            return  # the backward pass brings the chunks in itself
        self.schedule.prefetch(self.chunks_to_step())

    # ------------------------------------------------------------------ the step in the backward pass
    def grad_final(self, param: torch.Tensor) -> None:
        """A param's grad is final in this backward pass ([Note: Step in backward])."""
        if self.phase.phase is Phase.ACCUMULATING:
            return
        index = self.placement.binding.index_of(param)
        if index is None:
            return
        backward = self.backward
        if backward is None:
            backward = self._open_backward()
        elif backward.closed:
            raise RuntimeError(
                "a second backward pass would step again before step() was called for the first; call step() after "
                "each backward, or run the backward passes that must not step inside opt.accumulating()"
            )
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

        def on_close(aborted: bool) -> None:
            step.close()
            if aborted:  # the exception leaves the backward; a later step() steps what has grads, as plain torch
                self.backward = None
                self.phase.to(Phase.IDLE)
            else:
                self.grad_order = backward.arrivals

        expected, not_ahead = self._backward_order()
        backward = self.backward = BackwardStep(self.pipeline, expected, step, on_close, not_ahead)
        self.last_step = step.record
        backward.begin()
        return backward

    def _backward_order(self) -> tuple[list[Chunk], frozenset[int]]:
        """The chunks in the order the backward is expected to finish them, and those not to stage ahead
        ([Note: Backward order])."""
        chunks = list(reversed(self.placement.plan.all_chunks))
        order = self.grad_order
        if not order:
            return chunks, frozenset()
        unseen = len(order)
        chunks.sort(key=lambda c: max(order.get(i, unseen) for i in c.params))
        return chunks, frozenset(c.index for c in chunks if not any(i in order for i in c.params))

    def _finish_in_backward(self, scaler: Mapping[str, torch.Tensor]) -> None:
        """``step()`` after a backward that stepped: refuse what changed the grads after their update."""
        backward = self.backward
        if backward is not None and not backward.closed:
            backward.close()  # its backward was nested in one that never reached a hook (checkpointing)
        self.backward = None
        self.phase.rest(Phase.IDLE)
        if scaler:
            raise RuntimeError(
                "GradScaler with step_in_backward=True: the backward pass stepped with the scaled grads before the "
                "scaler could unscale them or skip the step. Use step_in_backward=False with loss scaling"
            )
        versions = backward.versions if backward is not None else {}
        changed = [i for i, v in versions.items() if (g := self.pipeline.grad_of(i)) is not None and g._version != v]
        if changed:
            raise RuntimeError(
                f"the grads of {len(changed)} params (first: param {changed[0]}) were changed after the backward pass "
                "had stepped with them (gradient clipping or unscaling, or a second backward before step()?); with "
                "step_in_backward=True the update uses the grads as the backward leaves them. Use "
                "step_in_backward=False to clip"
            )
        if not self.gate.attached:
            self.gate.join()  # no module waits for its own params: the next forward waits for the whole step

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
        """Enqueue every deferred chunk of the last step."""
        if self.phase.phase is Phase.DEFERRED:
            self.schedule.advance(None)

    def join(self) -> None:
        """Order the caller's stream after the whole last step."""
        self.flush()
        self.gate.join()

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
        if self._reads is not None:
            for i in indices:
                self._reads.setdefault(i, len(self._reads))
        if self.phase.phase is Phase.DEFERRED:
            self.schedule.advance(indices)
        self.gate.wait_params(indices, streams)

    def index_of(self, param: torch.Tensor) -> int | None:
        return self.placement.binding.index_of(param)

    def forward_done(self) -> None:
        """An attached model's forward returned: the caller's stream goes on after the step; keep its read order."""
        self.join()
        if self._reads:
            self.read_order, self._reads = self._reads, None

    def attached(self, delta: int) -> None:
        self.gate.attached += delta
        if delta > 0 and self.overlap:
            self._reads = {}

    def stats(self) -> StepStats | None:
        self.flush()
        if self.last_step is None:
            return None
        placement = self.placement
        return self.last_step.stats(
            placement.resident_device_bytes, placement.plan.resident_share, placement.pinned_host_bytes
        )

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
