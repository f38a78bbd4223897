"""StepMode: how a wrapper's steps run beside the caller's code, parsed once from the constructor's options."""

from __future__ import annotations

import enum

__all__ = ["StepMode"]


class StepMode(enum.Enum):
    """How a step runs beside the caller's code ([Note: Step modes] in runner.py).

    ``SYNC``: ``step()`` returns once its chunks are stepped on the caller's timeline. ``OVERLAP``: the chunks run on
    a stream of their own and the next forward overlaps them. ``IN_BACKWARD``: the backward pass steps each chunk
    once its grads are final.
    """

    SYNC = "sync"
    OVERLAP = "overlap"
    IN_BACKWARD = "in backward"

    @classmethod
    def of(cls, *, overlap: bool, step_in_backward: bool) -> StepMode:
        """The mode of the public options (checked already: two bools, not both True)."""
        if step_in_backward:
            return cls.IN_BACKWARD
        return cls.OVERLAP if overlap else cls.SYNC

    @property
    def own_stream(self) -> bool:
        """Whether chunks step on a stream of their own (on a GPU)."""
        return self is not StepMode.SYNC
