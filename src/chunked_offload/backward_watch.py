"""Watching the backward pass: its end, its abort, and the first pass of a wrapper, which observes the loop."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .inputs import GradRecord, GroupSnapshot

__all__ = [
    "CLOSURE_AFTER_BACKWARD",
    "FOUND_LATE",
    "SCALED_IN_BACKWARD",
    "SECOND_BACKWARD",
    "ObservedBackward",
    "TaskWatch",
    "aborted_note",
    "between_steps",
    "changes_refusal",
]


class TaskWatch:
    """Says when the outermost backward pass that a hook ran in has ended, and whether any such pass aborted.

    [Note: Watching the backward]
    ``arm()``, called from a hook, queues a callback at the end of the backward pass (the autograd graph task) the hook
    runs in, once per pass. The callback of the outermost pass calls ``on_end``. A nested pass (the one reentrant
    activation checkpointing runs for a segment) ends while a node of the enclosing pass still runs: its callback puts
    a post-hook on that node, which arms the enclosing pass, so the outermost pass is watched even when every hook ran
    in nested ones. A pass that raises (a tensor hook's exception, an OOM) never runs its callbacks; the engine drops
    them with the graph task, and a finalizer on each callback object then marks the watch ``aborted`` (the owner
    closes its step at its next call: a finalizer is no place to free device memory). Finalizers run when the last
    reference goes, without the garbage collector.

    Args:
        on_end: a bound method, called when the outermost watched pass has ended normally (held weakly: its object
            owns the watch).
    """

    def __init__(self, on_end: Callable[[], None]) -> None:
        self._on_end = weakref.WeakMethod(on_end)  # type: ignore[arg-type]
        self._tasks: set[int] = set()
        self.aborted = False
        self.ended = False

    def arm(self) -> None:
        """Watch the backward pass the calling hook runs in (once per pass)."""
        task = torch._C._current_graph_task_id()
        if task < 0 or task in self._tasks:
            return
        self._tasks.add(task)
        ran = [False]
        callback = _EndOfPass(weakref.ref(self), ran)
        weakref.finalize(callback, _dropped, weakref.ref(self), ran)
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    def _pass_ended(self) -> None:
        node = torch._C._current_autograd_node()
        if node is None:  # the outermost pass: every grad of this backward is final
            self.ended = True
            if (on_end := self._on_end()) is not None:
                on_end()
            return
        ref = weakref.ref(self)

        def enclosing(grad_inputs: Any, grad_outputs: Any) -> None:
            watch = ref()
            if watch is not None:
                watch.arm()

        node.register_hook(enclosing)


class _EndOfPass:
    """The callback queued at the end of one backward pass; its finalizer tells an abort from an end."""

    __slots__ = ("_watch", "_ran", "__weakref__")

    def __init__(self, watch: weakref.ref[TaskWatch], ran: list[bool]) -> None:
        self._watch = watch
        self._ran = ran

    def __call__(self) -> None:
        self._ran[0] = True
        watch = self._watch()
        if watch is not None:
            watch._pass_ended()


def _dropped(watch: weakref.ref[TaskWatch], ran: list[bool]) -> None:
    if not ran[0] and (target := watch()) is not None:
        target.aborted = True


class ObservedBackward:
    """The first backward pass of a ``step_in_backward`` wrapper: it steps nothing, and records what a step in it
    would have read.

    [Note: Observed backward]
    A step in the backward updates the params before the loop's code between ``backward()`` and ``step()`` runs. A
    loop whose code there changes what the update reads (clipping, unscaling, DDP's all-reduce, an lr write, a second
    backward before ``step()``) cannot step in the backward. That is a property of the loop, not of one iteration, so
    the first backward of a wrapper (and the first after a refusal) only observes: each hook records its param's grad
    (a fingerprint, [Note: Inputs of a step] in inputs.py), how many grads it accumulated, and in which order they
    became final; the end of the pass records the grads no hook saw and the group values. ``step()`` then compares:
    any difference is refused before anything is updated, and otherwise that step runs as a plain ``step()``. The
    backward passes after it step in the backward, expecting each param's grad as often as this one saw it (a layer
    shared by two reentrant-checkpointed segments gets two), in the order it saw them ([Note: Backward order] in
    above).

    Args:
        grad_of: the grad the inner reads for a param index.
        indices: every param index of the plan.
        groups: the inner's param groups.
    """

    def __init__(
        self,
        grad_of: Callable[[int], torch.Tensor | None],
        indices: Sequence[int],
        groups: Sequence[Mapping[str, Any]],
    ) -> None:
        self._grad_of = grad_of
        self._indices = indices
        self._groups = groups
        self.watch = TaskWatch(self._pass_ended)
        self.grads = GradRecord()
        self.counts: dict[int, int] = {}
        self.arrivals: dict[int, int] = {}
        self.passes = 0  # outermost backward passes observed before step()
        self.groups: GroupSnapshot | None = None

    def grad_ready(self, index: int) -> None:
        self.watch.arm()
        self.counts[index] = self.counts.get(index, 0) + 1
        self.arrivals.pop(index, None)
        self.arrivals[index] = len(self.arrivals)  # its last grad counts (the order of final grads)
        self.grads.record([(index, self._grad_of(index))])

    def _pass_ended(self) -> None:
        self.passes += 1
        unseen = [(i, g) for i in self._indices if i not in self.grads and (g := self._grad_of(i)) is not None]
        self.grads.record(unseen)
        self.groups = GroupSnapshot(self._groups)

    @property
    def complete(self) -> bool:
        return self.watch.ended and not self.watch.aborted

    def refusal(self, scaled: bool) -> str | None:
        """Why the loop observed cannot step in the backward, before its grads are compared; or None."""
        if scaled:
            return (
                "GradScaler with step_in_backward=True: a step in the backward would update the params with the "
                "scaled grads, before the scaler can unscale them or skip the step. Nothing was updated. Use "
                "step_in_backward=False with loss scaling"
            )
        if self.passes > 1:
            return (
                f"{self.passes} backward passes ran before step() (step_in_backward=True): each would step. Nothing "
                "was updated. Run all but the last backward of a step inside opt.accumulating(); a loop that skips "
                "steps (zero_grad() instead of step() on a bad loss) cannot step in the backward: use "
                "step_in_backward=False"
            )
        return None


SECOND_BACKWARD = (
    "a second backward pass would step again before step() was called for the first (step_in_backward=True); call "
    "step() after each backward, and run the backward passes that must not step inside opt.accumulating(). A loop "
    "that skips steps (GradScaler finding an inf, a NaN loss) cannot step in the backward: use step_in_backward=False"
)

CLOSURE_AFTER_BACKWARD = (
    "step(closure) after a backward pass that stepped (step_in_backward=True): the update has run already. Call "
    "step() without a closure after that backward, or run the closure's backward only"
)

SCALED_IN_BACKWARD = (
    "GradScaler with step_in_backward=True: the backward pass stepped with the scaled grads before the scaler could "
    "unscale them or skip the step. Use step_in_backward=False with loss scaling"
)


def changes_refusal(changed: Sequence[int], written: Sequence[str], *, stepped: bool) -> str | None:
    """Why a step is refused whose grads (``changed`` param indices) or group values (``written``) changed between
    the backward pass and ``step()``, after the backward stepped or when it was observed; None if nothing changed."""
    if not (changed or written):
        return None
    when = (
        "the backward pass has already updated the params with the grads and values as it left them, so this step "
        "did not see the change"
        if stepped
        else "a step in the backward would update the params before that change. Nothing was updated"
    )
    if changed:
        what = (
            f"the grads of {len(changed)} params (first: param {min(changed)}) changed between the backward pass and "
            "step() (gradient clipping, GradScaler's unscale_, a DDP or hand-written all-reduce, zero_grad, or a grad "
            "set or replaced by hand)"
        )
        fix = "Use step_in_backward=False for this loop (overlap=True hides most of the step: docs/modes.md)"
    else:
        what = "param_groups were written between the backward pass and step(): " + "; ".join(written[:3])
        fix = (
            "Change the groups before the backward (an LR scheduler's step() right after opt.step() does), or use "
            "step_in_backward=False"
        )
    return f"step_in_backward=True: {what}; {when}. {fix}"


FOUND_LATE = (
    ". This was found after that step() had returned (step() does not wait for the device to compare the grads); no "
    "param has been updated since"
)


def aborted_note(stepped: int, total: int) -> str:
    """What a step whose backward raised after ``stepped`` of ``total`` chunks had stepped did."""
    return (
        f"the backward pass that stepped in the backward (step_in_backward=True) raised after {stepped} of the {total} "
        f"chunks had stepped: those {stepped} are committed (their params and state updated), the other "
        f"{total - stepped} untouched; a plain loop whose backward raised would have updated none. The next backward "
        "steps as usual"
    )


def between_steps(what: str) -> str:
    """Why ``what`` is refused between a backward pass that stepped and ``step()``."""
    return (
        f"{what} between a backward pass that stepped and step() (step_in_backward=True): that backward has updated "
        "the params and state already, so plain torch, which updates at step(), would see something else. Call step() "
        f"first; for a loop that calls {what} there (skipping a step on a NaN loss, checkpointing before the step), "
        "use step_in_backward=False"
    )
