"""StepMode: how a wrapper's steps run beside the caller's code, parsed once from the constructor's options."""

from __future__ import annotations

import enum

__all__ = ["StepMode"]


class StepMode(enum.Enum):
    """How a step runs beside the caller's code.

    [Note: Step modes]
    - ``SYNC``: ``step()`` opens a step (``StepContext``), and the ordered schedule (``StepSchedule``) steps the
      chunks with a grad in parameter order; the caller's stream waits for the whole step.
    - ``OVERLAP``: the chunks run on the gate's stream, in the order the forward reads them ([Note: Read order]).
      With an attached model only the first ``num_slots`` are enqueued and the rest are *deferred* to the forward
      hooks that read their params (phase DEFERRED); without one the caller's stream waits for the whole step.
    - ``IN_BACKWARD``: the first backward observes the loop and its ``step()`` is a plain one ([Note: Observed
      backward]). In the backward passes after it the first final grad opens the step, and the event-driven schedule
      (``BackwardSchedule``) steps each chunk once its grads are final (phase IN_BACKWARD); ``step()`` then compares
      the grads and groups with what the chunks read ([Note: Inputs of a step]).
    The step runner (runner.py) drives all three, and is the only code that moves the phase ([Note: Phases]).
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
    def defers(self) -> bool:
        """Whether a step may leave chunks to the next forward's hooks (``overlap=True``)."""
        return self is StepMode.OVERLAP

    @property
    def in_backward(self) -> bool:
        """Whether chunks step in the backward pass (``step_in_backward=True``)."""
        return self is StepMode.IN_BACKWARD

    @property
    def own_stream(self) -> bool:
        """Whether chunks step on a stream of their own (on a GPU)."""
        return self is not StepMode.SYNC
