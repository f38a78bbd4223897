"""StepWaits: what the caller's code and the hooks wait on, and what they may not do while a step is open."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import backward_watch as refusals
from .phase import Phase
from .runner import StepRunner
from .telemetry import StepStats

__all__ = ["StepWaits"]


class StepWaits:
    """The waiting side of the step runner: the hooks' runtime ([Note: Attached forward] in hooks.py) and the waits
    and refusals of the wrapper's methods.

    A forward's module waits for the updates of its own params (``wait_for``), enqueuing them first if the step
    deferred them; the model's forward hook joins the rest (``forward_done``). Methods that read what a step wrote
    join it first (``join``), or wait on the host (``synchronize``); between a backward that stepped and ``step()``
    the calls that would act after the update are refused (``between_steps``).

    Args:
        runner: the step runner (it moves the phase; this class only reads it).
    """

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.schedule = runner.schedule
        self.gate = runner.gate
        self.mode = runner.mode  # the hooks ask it (attach() refuses DDP in the backward)

    # ------------------------------------------------------------------ what the hooks call
    def wait_for(self, indices: list[int], streams: Sequence[torch.cuda.Stream] = ()) -> None:
        """Before a forward reads these params: enqueue their deferred chunks, and wait for their updates."""
        self.schedule.reads.record(indices)
        self.runner.advance(indices)
        self.schedule.watch.check(indices)
        self.gate.wait_params(indices, streams)
        self.schedule.watch.forget(indices)  # the forward reads them after their updates: writes may follow

    def flush(self) -> None:
        self.runner.flush()

    def join(self) -> None:
        self.runner.join()

    def grad_final(self, param: torch.Tensor) -> None:
        self.runner.grad_final(param)

    def index_of(self, param: torch.Tensor) -> int | None:
        return self.runner.placement.binding.index_of(param)

    def forward_compiled(self) -> None:
        """Dynamo traced a gate: from now on steps finish before returning ([Note: Gates in compiled graphs])."""
        self.gate.compiled_forward = True
        self.runner.join()

    def forward_done(self) -> None:
        """An attached model's forward returned: the caller's stream goes on after the step; keep its read order."""
        self.runner.join()
        self.schedule.reads.forward_done()

    def attached(self, handle: int, params: list[torch.Tensor] | None) -> None:
        """Attach handle ``handle`` now gates ``params`` (None: it was removed)."""
        if params is None:
            self.gate.gated.pop(handle, None)
        else:
            self.gate.gated[handle] = params
            self.schedule.reads.start()

    def keep_grads(self, keep: bool) -> None:
        """Whether an overlapped step reads its grads in place, not copies ([Note: Inputs of a step])."""
        if not keep:
            self.runner.join()  # what the last step kept is read; its held writes run
        self.schedule.keep_grads = keep

    def hold(self, write: Callable[[], None]) -> None:
        """Run ``write`` to the grads once no step reads them in place: now, or when the step is joined."""
        self.schedule.kept.hold(write)

    # ------------------------------------------------------------------ what the wrapper's methods call
    def synchronize(self) -> None:
        """Block the host until the last step's updates and write-backs have landed."""
        self.runner.synchronize()

    def land_held_write_back(self) -> None:
        """Block the host until a write-back held from the last step has landed ([Note: Held write-back])."""
        pipeline = self.runner.pipeline
        if pipeline.held.slots:
            pipeline.synchronize()

    def current_phase(self) -> Phase:
        self.runner.reap()  # a backward that raised has closed its step
        return self.runner.phase.phase

    def between_steps(self, what: str) -> None:
        """Refuse ``what`` between a backward pass that stepped and ``step()``: it would act after the update."""
        self.runner.reap()
        if self.runner.phase.resting is Phase.IN_BACKWARD:
            raise RuntimeError(refusals.between_steps(what))

    def before_zero_grad(self, set_to_none: bool) -> None:
        """Refused after a backward that stepped; an observed backward's grads are gone; zeroing in place joins the
        step, so that the grads' memory is reused after it (the step reads copies: [Note: Inputs of a step])."""
        self.between_steps("opt.zero_grad()")
        self.runner.loop.forget_observation()
        if not set_to_none:
            self.runner.join()

    def stats(self) -> StepStats | None:
        self.runner.flush()
        p, step = self.runner.placement, self.runner.last_step
        return None if step is None else step.stats(p.resident_device_bytes, p.plan.resident_share, p.pinned_host_bytes)
