"""A CPU stand-in for the step stream: a chunk's update of its params shows only once a reader waits for it."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable

import torch

__all__ = ["ENV", "EmulatedEvent", "EmulatedStream", "enabled"]

ENV = "CHUNKED_OFFLOAD_EMULATE_STREAMS"

# [Note: Emulated step stream]
# On the CPU every kernel runs when it is called, so a reader that lacks its wait for the step stream still reads the
# updated params, and a missing wait cannot show. With ``CHUNKED_OFFLOAD_EMULATE_STREAMS=1`` (the test suite's
# default: tests/conftest.py) the step stream of ``overlap`` and ``step_in_backward`` on the CPU is an
# ``EmulatedStream``. Its chunks still compute when they are enqueued, but at its commit each chunk's update of its
# params is *held back*: the params show their bytes from before the chunk again, and the update lands only when
# - a reader waits on an event recorded after it (``wait_event`` of the caller's stream or any other, ``synchronize``
#   of the event, ``wait_stream`` on the step stream), in the order the stream ran the updates; or
# - the step stream itself steps those params again (a stream sees its own earlier work).
# A reader that lacks its wait then reads the old bytes, deterministically, and a bitwise comparison with the plain
# loop fails. Version counters are kept across the swaps, so no write is seen where there was none.
# What it does not model (the GPU tests cover these, with the side stream slowed): the state and masters (they are
# read by the wrapper's own code, which joins before it reads them), the copy streams (every copy is synchronous on
# the CPU), a step stream that would read what the caller writes after it (the grads: the step reads copies of them),
# and other libraries' own streams (FSDP2's all-gather streams, NCCL's): only the waits the wrapper makes are seen.


def enabled() -> bool:
    """Whether a wrapper built now on the CPU emulates its step stream ([Note: Emulated step stream])."""
    return os.environ.get(ENV, "") not in ("", "0")


class EmulatedStream:
    """A stream on the CPU: with ``holds``, the step stream whose updates wait for a reader; else the caller's.

    Args:
        device: the CPU device it stands for.
        holds: hold the updates enqueued on it until something waits for them.
    """

    def __init__(self, device: torch.device, holds: bool) -> None:
        self.device = device
        self.holds = holds
        self.enqueued = 0  # updates enqueued so far
        self._held: deque[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = deque()  # (mark, (param, update))

    def hold(self, updates: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Hold back ``(param, old bytes)``: the params show the old bytes until the update lands; returns its mark."""
        held = []
        for param, old in updates:
            target = param.detach()
            held.append((target, target.clone()))
            _copy_keeping_version(target, old)
        self.enqueued += 1
        self._held.append((self.enqueued, held))
        return self.enqueued

    def land(self, mark: int | None = None) -> None:
        """Land the held updates up to ``mark`` (None: all), oldest first."""
        while self._held and (mark is None or self._held[0][0] <= mark):
            _, updates = self._held.popleft()
            for target, update in updates:
                _copy_keeping_version(target, update)

    def land_for(self, params: Iterable[torch.Tensor]) -> None:
        """The stream steps ``params`` again: their earlier updates, and all before them, land first."""
        where = {p.data_ptr() for p in params}
        last = max((mark for mark, updates in self._held for t, _ in updates if t.data_ptr() in where), default=None)
        if last is not None:
            self.land(last)

    # torch.cuda.Stream's API, as the wrapper uses it
    def wait_event(self, event: EmulatedEvent) -> None:
        if event.stream is not None and event.stream is not self:
            event.stream.land(event.mark)

    def wait_stream(self, stream: EmulatedStream) -> None:
        if stream is not self:
            stream.land()

    def synchronize(self) -> None:
        self.land()


class EmulatedEvent:
    """An event on an ``EmulatedStream``: done once the updates enqueued before it have landed."""

    def __init__(self) -> None:
        self.stream: EmulatedStream | None = None
        self.mark = 0

    def record(self, stream: EmulatedStream | None = None) -> None:
        if stream is not None and stream.holds:
            self.stream, self.mark = stream, stream.enqueued
        else:
            self.stream = None  # the caller's work has run when it is recorded

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.land(self.mark)

    def query(self) -> bool:
        return self.stream is None or not any(m <= self.mark for m, _ in self.stream._held)


def _copy_keeping_version(target: torch.Tensor, source: torch.Tensor) -> None:
    """Swap bytes in without counting a write: the params' version counters are what the step watches."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
        target.copy_(source)
