"""StreamContext: the side streams of one wrapper, made once and shared by the parts that enqueue work on them."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import emulated
from .mode import StepMode

__all__ = ["StreamContext"]


class StreamContext:
    """The streams a wrapper uses beside the caller's, in one place (as FSDP2's ``FSDPCommContext``).

    [Note: Streams]
    Copies into the slots run on ``h2d``, write-backs on ``d2h`` (the copy engines run each direction beside the
    other), and in the fast modes the chunks step on ``step``, at high priority: the next forward waits for its
    kernels, so they go first when both have work. On the CPU there are no copy streams: every copy is synchronous,
    and the same calls run the same logic; the step stream is None, or, for the tests, an emulated one that holds
    each chunk's update back until a reader waits for it ([Note: Emulated step stream] in emulated.py). The ordering
    rules between the streams are [Note: Two-slot staging] (staging.py) and [Note: Overlapped step] (gate.py).

    Args:
        device: the params' device.
        mode: the wrapper's step mode.
    """

    def __init__(self, device: torch.device, mode: StepMode) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.h2d: torch.cuda.Stream | None = torch.cuda.Stream(device) if cuda else None
        self.d2h: torch.cuda.Stream | None = torch.cuda.Stream(device) if cuda else None
        self.step: Any = None  # a torch.cuda.Stream, or an EmulatedStream
        self._caller: emulated.EmulatedStream | None = None
        if mode.own_stream and cuda:
            self.step = torch.cuda.Stream(device, priority=-1)
        elif mode.own_stream and device.type == "cpu" and emulated.enabled():
            self.step = emulated.EmulatedStream(device, holds=True)
            self._caller = emulated.EmulatedStream(device, holds=False)

    @property
    def uses_streams(self) -> bool:
        return self.h2d is not None

    @property
    def emulated(self) -> bool:
        """Whether the step stream is the CPU's stand-in ([Note: Emulated step stream])."""
        return self._caller is not None

    def current(self) -> Any:
        """The caller's stream on the device (with a step stream only)."""
        return self._caller if self._caller is not None else torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` the current one for the block."""
        return contextlib.nullcontext() if self._caller is not None else torch.cuda.stream(stream)

    def event(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now."""
        event = emulated.EmulatedEvent() if self._caller is not None else torch.cuda.Event()
        event.record(stream)
        return event
