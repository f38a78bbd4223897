"""StreamContext: the side streams of one wrapper, made once and shared by the parts that enqueue work on them."""

from __future__ import annotations

import torch

from .mode import StepMode

__all__ = ["StreamContext"]


class StreamContext:
    """The streams a wrapper uses beside the caller's, in one place (as FSDP2's ``FSDPCommContext``).

    [Note: Streams]
    Copies into the slots run on ``h2d``, write-backs on ``d2h`` (the copy engines run each direction beside the
    other), and in the fast modes the chunks step on ``step``, at high priority: the next forward waits for its
    kernels, so they go first when both have work. On the CPU there are no streams: every attribute is None, every
    copy is synchronous, and the same calls run the same logic. The ordering rules between the streams are
    [Note: Two-slot staging] (staging.py) and [Note: Overlapped step] (gate.py).

    Args:
        device: the params' device.
        mode: the wrapper's step mode.
    """

    def __init__(self, device: torch.device, mode: StepMode) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.h2d: torch.cuda.Stream | None = torch.cuda.Stream(device) if cuda else None
        self.d2h: torch.cuda.Stream | None = torch.cuda.Stream(device) if cuda else None
        step = cuda and mode.own_stream
        self.step: torch.cuda.Stream | None = torch.cuda.Stream(device, priority=-1) if step else None

    @property
    def uses_streams(self) -> bool:
        return self.h2d is not None

    def current(self) -> torch.cuda.Stream:
        """The caller's stream on the device (a GPU only)."""
        return torch.cuda.current_stream(self.device)
