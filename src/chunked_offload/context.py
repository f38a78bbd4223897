"""StepContext: opening and closing one outer step, the same for ``step()`` and for a step in the backward pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from .adapters import Adapter
from .gate import StepGate
from .placement import Placement
from .telemetry import StepRecord
from .transfer import TransferEngine

__all__ = ["GRAD_SCALER_ATTRS", "GroupCounters", "OpenStep", "StepContext", "scaler_tensors", "skipped_by_scaler"]

# What torch.amp.GradScaler sets on an optimizer whose step supports AMP scaling (fused torch optimizers), before
# calling its step(): the scale the grads carry and whether they hold an inf or a NaN.
GRAD_SCALER_ATTRS = ("grad_scale", "found_inf")


class GroupCounters:
    """Keeps group-level values (Transformer Engine's ``group["step"]``, ...) advancing once per outer step.

    The inner optimizer's step runs once per chunk. Before every chunk the groups are restored to their values at
    the start of the outer step. After a chunk, each group whose values the inner changed remembers them (so a
    counter the inner advances for every group, even one with no params in the chunk, advances once; one it
    advances only for groups it steps advances once too). At the end every group gets the values it last
    remembered. A chunk that fails remembers nothing, so its groups keep the values of the committed chunks.

    Args:
        groups: the inner optimizer's ``param_groups``.
    """

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self._groups = groups
        self._start = [self._snapshot(g) for g in groups]
        self._final: list[dict[str, Any] | None] = [None] * len(groups)

    @staticmethod
    def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    @staticmethod
    def _restore(group: dict[str, Any], values: dict[str, Any]) -> None:
        for k in [k for k in group if k != "params" and k not in values]:
            del group[k]
        group.update(values)

    def before_chunk(self) -> None:
        for group, values in zip(self._groups, self._start, strict=True):
            self._restore(group, values)

    def after_chunk(self) -> None:
        for gi, group in enumerate(self._groups):
            values = self._snapshot(group)
            if not _same_values(values, self._start[gi]):
                self._final[gi] = values

    def finish(self) -> None:
        for gi, group in enumerate(self._groups):
            final = self._final[gi]
            self._restore(group, final if final is not None else self._start[gi])

    def changed(self) -> bool:
        """Whether a chunk so far changed a group's values (the inner keeps a counter there)."""
        return any(final is not None for final in self._final)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Around chunks stepped after ``step()`` returned: they see the step's values, the caller keeps its own.

        The caller may have changed the groups since (a scheduler's next ``lr``). Each chunk inside still runs
        with the values of the step's start, and afterwards the groups get the caller's values back, with any
        value the inner changed on top.
        """
        callers = [self._snapshot(g) for g in self._groups]
        try:
            yield
        finally:
            for group, caller, start in zip(self._groups, callers, self._start, strict=True):
                now = self._snapshot(group)
                changed = {k: v for k, v in now.items() if k not in start or not _same_values({k: v}, {k: start[k]})}
                self._restore(group, {**caller, **changed})


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if v is w:
            continue
        if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
            return False
        try:
            if not bool(v == w):
                return False
        except Exception:
            return False
    return True


@dataclass
class OpenStep:
    """One outer step between its opening and its closing.

    Attributes:
        counters: the group counters, snapshot after the hyperparameter copies went in.
        record: the step's telemetry.
        stack: what the closing undoes (GradScaler's forwarded tensors, the hyperparameter copies).
        coupled: the groups whose updates may depend on which of their params have grads ([Note: Coupled params]).
        grads_final: tells the adapter that every grad of a step in the backward is final.
    """

    counters: GroupCounters
    record: StepRecord
    stack: ExitStack
    coupled: frozenset[int] = frozenset()
    grads_final: Callable[[], None] = lambda: None

    def close(self) -> None:
        """Give the groups their final values, then the caller's own tensors back (once)."""
        try:
            self.counters.finish()
        finally:
            self.stack.close()


class StepContext:
    """Opens and closes an outer step; ``step()`` and the in-backward step share it.

    [Note: Opening a step]
    Before anything is modified: refuse CUDA-graph capture, bring the layout in line with the inner optimizer
    (``Placement.sync``: a re-plan, or a refusal). Then, in this order: GradScaler's ``grad_scale`` / ``found_inf``
    are forwarded to the inner (as copies, when the step overlaps the caller), tensor hyperparameters are swapped for
    copies ([Note: Overlapped step]), the adapter makes its once-per-step decisions, and the group counters snapshot
    the groups, copies included. Closing restores the groups' final values and the caller's own tensors. The inner
    optimizer's own step hooks run once per outer step (``run_inner_hooks``).

    Args:
        inner: the wrapped optimizer.
        adapter: its adapter.
        placement: the layout's owner.
        gate: the step stream (hyperparameter copies).
        engine: the copy streams (telemetry).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        adapter: Adapter,
        placement: Placement,
        gate: StepGate,
        engine: TransferEngine,
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.placement = placement
        self.gate = gate
        self.engine = engine

    def prepare(self) -> None:
        """Checks and re-planning that come before anything of the step is modified."""
        device = self.placement.device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "ChunkedOffloadOptimizer.step() cannot be captured in a CUDA graph: it rebinds state tensors to "
                "staging memory on every step. Capture the forward/backward only"
            )
        self.placement.sync()

    def open(self, scaler: Mapping[str, torch.Tensor]) -> OpenStep:
        """Open a step (after ``prepare``); ``scaler`` holds GradScaler's tensors set on the wrapper, if any."""
        groups = self.inner.param_groups
        stack = ExitStack()
        try:
            stack.enter_context(self._scaler_forwarded(scaler))
            stack.enter_context(self.gate.hyperparameter_copies(groups))
            self.adapter.begin_step(self.placement.stepped_dtype)
            counters = GroupCounters(groups)  # after the copies went in: they are what the inner is to see
        except BaseException:
            stack.close()
            raise
        layout = self.placement.layout
        io = [] if layout is None else [s.io for s in layout.stores.values() if s.io is not None]
        record = StepRecord(self.engine, self.placement.device, io)
        coupled = frozenset(gi for gi in range(len(groups)) if self.adapter.couples(gi))
        grads_final = partial(self.adapter.grads_final, self.placement.stepped_dtype)
        return OpenStep(counters, record, stack, coupled, grads_final)

    def has_post_hooks(self, own: Mapping[int, Any]) -> bool:
        """Whether a step post-hook is registered: the wrapper's (``own``), the inner's, or a global one."""
        inner = getattr(self.inner, "_optimizer_step_post_hooks", {})
        return bool(own or inner or torch_optimizer._global_optimizer_post_hooks)

    def run_inner_hooks(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run the inner optimizer's own step hooks once per outer step; pre-hooks may replace the arguments."""
        for hook in list(getattr(self.inner, name, {}).values()):
            out = hook(self.inner, args, kwargs)
            if name.endswith("pre_hooks") and out is not None:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise RuntimeError(f"a step pre-hook must return None or (args, kwargs), got {out!r}")
                args, kwargs = out
        return args, kwargs

    @contextmanager
    def _scaler_forwarded(self, scaler: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Hand GradScaler's tensors (set on the wrapper) to the inner optimizer for the step."""
        inner_attrs = self.inner.__dict__
        saved = {n: inner_attrs[n] for n in scaler if n in inner_attrs}
        for name, value in scaler.items():
            # scaler.update() rewrites its scale in place while an overlapped step may still read it.
            setattr(self.inner, name, self.gate.private_copy(value))
        try:
            yield
        finally:
            for name in scaler:
                if name in saved:
                    setattr(self.inner, name, saved[name])
                else:
                    delattr(self.inner, name)


def scaler_tensors(attrs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """GradScaler's tensors among an optimizer's attributes (its ``__dict__``)."""
    return {n: attrs[n] for n in GRAD_SCALER_ATTRS if n in attrs}


def skipped_by_scaler(scaler: Mapping[str, torch.Tensor]) -> bool:
    """Whether GradScaler found an inf: a fused inner's kernels would change nothing staged.

    Reading it waits for the device; it spares the step moving every chunk both ways for nothing. Chunks without
    state still run, since the inner creates their (zero) state even on a skipped step.
    """
    found_inf = scaler.get("found_inf")
    return isinstance(found_inf, torch.Tensor) and bool(found_inf.item())
