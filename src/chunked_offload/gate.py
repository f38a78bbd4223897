"""StepGate: the stream an overlapped step runs on, and the events that let the next forward start early."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .mode import StepMode
from .streams import StreamContext

__all__ = ["StepGate"]


class StepGate:
    """Orders readers of the params after the chunks that update them.

    [Note: Overlapped step]
    With ``overlap=True`` the chunk loop of ``step()`` runs on a stream of its own, which first waits for the
    caller's stream (the grads are ready). ``step()`` returns once its chunks are enqueued; the caller's stream goes
    on at once. With an attached model only the first chunks are: the rest wait until a forward hook asks for them
    ([Note: Deferred chunks] in schedule.py). After each chunk's update the gate records an event, and a module
    attached with ``opt.attach(model)`` makes the stream that runs its forward wait for the events of its own params,
    just before the forward reads them (hooks.py). The next forward therefore runs while later chunks are
    still being stepped, and reads each param only after its update: the result is bitwise that of the synchronous
    loop, because every kernel is the same and runs on the same bytes in the same order. A step that the caller's
    stream waits for whole as soon as ``step()`` returns (every chunk eager, or no gated forward) runs on the
    caller's stream instead (``stepping(own=False)``): a stream of its own adds only waits there. Measured on an H100
    with all state resident at 8 x 2048: 98.7-98.9% of resident iterations/s kept on the step's own stream, 99.3%
    on the caller's (the synchronous wrapper 99.2-99.6%).

    What else reads or writes what the step stream uses:
    - grads and GradScaler's tensors: ``record_stream`` keeps their memory from being reused while the step stream
      reads them, so ``zero_grad(set_to_none=True)`` and ``scaler.update()`` may follow at once (the scaler's
      tensors are copied for the step);
    - hyperparameters held as device tensors (a capturable ``lr``) are copied for the step, so that a scheduler's
      in-place update after ``step()`` does not race it;
    - every other method of the wrapper, ``zero_grad(set_to_none=False)`` and ``wait_step()`` order the caller's
      stream after the whole step (``join``); ``synchronize()`` waits on the host.

    On the CPU, or with ``overlap=False``, there is no stream of its own and every wait is a no-op.

    Args:
        streams: the wrapper's streams ([Note: Streams] in streams.py).
        mode: the wrapper's step mode.
    """

    def __init__(self, streams: StreamContext, mode: StepMode) -> None:
        self.mode = mode
        self.streams = streams
        self.stream = streams.step
        self._on_step_stream = False  # inside ``stepping()`` on the step stream
        self._before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # emulated: param index -> (param, old bytes)
        # param index -> the event after its last update; kept across steps: a param without a grad in this step
        # was last updated by an earlier one.
        self.ready: dict[int, torch.cuda.Event] = {}
        self.end: torch.cuda.Event | None = None  # after the last chunk's update, on the step stream
        self.gated: dict[int, list[torch.Tensor]] = {}  # attach handle -> the params its forward hooks wait for
        self.compiled_forward = False  # a gate was traced: steps wait for all their chunks ([Note: Gates in compiled
        # graphs] in compiled.py)

    @property
    def attached(self) -> int:
        """Models whose forward waits for their params (attach handles not removed)."""
        return len(self.gated)

    @property
    def detaches(self) -> bool:
        """Whether chunks stepped on the step stream run beside the caller's code (a GPU's stream, not emulated)."""
        return self.stream is not None and not self.streams.emulated

    @property
    def gating(self) -> bool:
        """Whether the forwards of attached models wait for their own params (no gate was traced instead)."""
        return bool(self.gated) and not self.compiled_forward

    @contextmanager
    def stepping(self, wait_caller: bool = True, own: bool = True) -> Iterator[None]:
        """Run the block on the step stream, after what the caller's stream has enqueued so far.

        ``wait_caller=False`` for the deferred chunks of a step that already waited: what the caller has enqueued
        since (the next forward) waits for them, not the other way round. ``own=False`` runs the block on the
        caller's stream, after what the step stream has enqueued: for a step the caller's stream waits for whole
        right after (every chunk eager, or nothing attached), where a stream of its own would only add waits.
        """
        if self.stream is None:
            yield
            return
        caller = self.streams.current()
        stream = self.stream if own else caller
        if not own:
            self.join()  # the last step's deferred chunks, enqueued by the flush before this step
        elif wait_caller:
            # Without this wait the step could read grads the caller's backward has not finished writing.
            self.stream.wait_stream(caller)
        try:
            self._on_step_stream = own
            with self.streams.use(stream):
                yield
        finally:
            self._on_step_stream = False
            self._before.clear()  # a chunk that failed before its commit was rolled back
            self.end = self.streams.event(stream)

    def clear(self) -> None:
        """Forget the events (the layout changed; the caller has drained every stream)."""
        self.ready.clear()
        self.end = None

    def before_update(self, params: Mapping[int, torch.Tensor]) -> None:
        """A chunk is about to update ``params`` (param index -> its local tensor) on the current stream.

        Only the emulated step stream needs to know: it sees its own earlier updates of them, and keeps their bytes
        from before this one to show until a reader waits ([Note: Emulated step stream] in emulated.py).
        """
        if self._on_step_stream and self.streams.emulated:
            self.stream.land_for(params.values())
            self._before = {i: (p, p.detach().clone()) for i, p in params.items()}

    def mark_ready(self, params: Iterable[int], event: torch.cuda.Event | None) -> None:
        """``event`` completes once the updates of ``params`` (param indices) are enqueued work that has run."""
        if self._before:  # emulated: the update is held back until a reader waits for this event
            held = [self._before.pop(i) for i in params if i in self._before]
            self.stream.hold(held)
            event = self.streams.event(self.stream)
        if self.stream is not None and event is not None:
            for i in params:
                self.ready[i] = event

    def keep_alive(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep the memory of tensors the step stream reads from being reused before it has read them."""
        if self.stream is not None:
            for t in tensors:
                if t.device.type == "cuda":
                    t.record_stream(self.stream)

    def private_copy(self, value: Any) -> Any:
        """A tensor the step may read while the caller rewrites the original in place; other values as they are."""
        if not (self.mode.own_stream and isinstance(value, torch.Tensor)):
            return value
        copy = value.clone()
        self.keep_alive([copy])
        return copy

    @contextmanager
    def hyperparameter_copies(self, groups: list[dict[str, Any]]) -> Iterator[None]:
        """For an overlapped step, put copies of the hyperparameters held as tensors into ``groups``.

        A scheduler may update ``group["lr"]`` in place on the caller's stream right after ``step()`` returns,
        while the step stream still reads it. The inner is assumed to only read them, as ``torch.optim`` does.
        """
        saved = []
        if self.mode.own_stream:
            for group in groups:
                for key, value in group.items():
                    if key != "params" and isinstance(value, torch.Tensor):
                        saved.append((group, key, value, self.private_copy(value)))
        for group, key, _, copy in saved:
            group[key] = copy
        try:
            yield
        finally:
            for group, key, value, copy in saved:
                if group.get(key) is copy:
                    group[key] = value

    def wait_params(self, indices: Iterable[int], streams: Sequence[torch.cuda.Stream] = ()) -> None:
        """Order the current stream (and ``streams``: FSDP2's all-gather streams) after the given params' updates."""
        if not self.ready or self.stream is None:
            return
        readers = [self.streams.current(), *streams]
        waited: set[int] = set()
        for i in indices:
            event = self.ready.get(i)
            if event is not None and id(event) not in waited:
                for reader in readers:
                    # Without this wait the forward (or an all-gather) reads the param before its chunk is stepped.
                    reader.wait_event(event)
                waited.add(id(event))

    def join(self) -> None:
        """Order the current stream after the whole last step (its enqueued chunks)."""
        if self.end is not None and self.stream is not None:
            # Without this wait the caller could read (or free) what the step stream still uses.
            self.streams.current().wait_event(self.end)

    def synchronize(self) -> None:
        """Block the host until the last step's enqueued updates have run."""
        if self.end is not None:
            self.end.synchronize()
