"""Phase: what the wrapper is doing, one value with legal transitions, checked where it changes."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Phase", "PhaseMachine"]


class Phase(enum.Enum):
    """What the wrapper is doing.

    [Note: Phases]
    One value says what the wrapper is doing, and every change goes through ``PhaseMachine.to``, which refuses the
    illegal ones. Each public method states the phases it runs in (``require``), and a joining call (state_dict,
    offload, ...) first brings a DEFERRED step to IDLE::

        IDLE ──step()──> STEPPING ──> IDLE
          │                  └──────> DEFERRED ──(forward hooks, or any joining call)──> IDLE
          ├──first final grad (step_in_backward)──> IN_BACKWARD ──step()──> IDLE
          ├──offload()──> OFFLOADED ──reload(), step()──> IDLE
          └──accumulating()──> ACCUMULATING ──(end of the block)──> back where it came from

    A failure in any phase leads back to IDLE (or OFFLOADED), with the chunks before the failing one committed.
    """

    IDLE = "idle"  # between steps: every state tensor is in its home
    OFFLOADED = "offloaded"  # between steps, with the resident state moved to the host by offload()
    STEPPING = "stepping"  # the inner optimizer's step runs on chunks (step(), or a deferred chunk)
    DEFERRED = "deferred"  # step() returned; its later chunks wait for the forward hooks that read their params
    ACCUMULATING = "accumulating"  # inside opt.accumulating(): backward passes do not step
    IN_BACKWARD = "in backward"  # a backward pass steps chunks as their grads become final, until step()


_LEGAL: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.STEPPING, Phase.IN_BACKWARD, Phase.OFFLOADED, Phase.ACCUMULATING}),
    Phase.OFFLOADED: frozenset({Phase.IDLE, Phase.ACCUMULATING}),
    Phase.STEPPING: frozenset({Phase.IDLE, Phase.DEFERRED}),
    Phase.DEFERRED: frozenset({Phase.STEPPING, Phase.IDLE}),
    Phase.ACCUMULATING: frozenset({Phase.IDLE, Phase.OFFLOADED, Phase.IN_BACKWARD, Phase.STEPPING}),
    Phase.IN_BACKWARD: frozenset({Phase.IDLE, Phase.ACCUMULATING}),
}


class PhaseMachine:
    """Holds the wrapper's :class:`Phase`; every change goes through :meth:`to`, which refuses illegal ones.

    ``opt.accumulating()`` is a phase of its own that remembers where it came from: the block ends there, or where
    ``offload()``/``reload()`` inside the block moved it. Only the step runner changes the phase
    (``tests/test_layering.py`` checks it).
    """

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self._resume = Phase.IDLE  # where ACCUMULATING goes back to

    def to(self, new: Phase) -> None:
        if new is not self.phase and new not in _LEGAL[self.phase]:
            raise RuntimeError(f"chunked_offload: the wrapper cannot go from {self.phase.value} to {new.value}")
        self.phase = new

    def rest(self, new: Phase) -> None:
        """Go to IDLE or OFFLOADED; inside ``accumulating()`` the block ends there instead."""
        if self.phase is Phase.ACCUMULATING:
            self._resume = new
        else:
            self.to(new)

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """ACCUMULATING for the block, then back where it was (or where :meth:`rest` moved it meanwhile)."""
        resume = self.phase
        self.to(Phase.ACCUMULATING)
        self._resume = resume
        try:
            yield
        finally:
            self.to(self._resume)

    @property
    def resting(self) -> Phase:
        """IDLE or OFFLOADED (or IN_BACKWARD): where the wrapper is, or returns to after ``accumulating()``."""
        return self._resume if self.phase is Phase.ACCUMULATING else self.phase

    def require(self, what: str, *allowed: Phase) -> None:
        """Refuse ``what`` unless the wrapper is in one of ``allowed``."""
        if self.phase not in allowed:
            names = ", ".join(p.value for p in allowed)
            raise RuntimeError(
                f"{what} cannot run while the wrapper is {self.phase.value} (it runs when {names}); "
                f"{_ADVICE.get(self.phase, '')}"
            )

    @property
    def stepping(self) -> bool:
        """Whether the inner optimizer's step code runs now (state assignments pass through to it)."""
        return self.phase in (Phase.STEPPING, Phase.IN_BACKWARD)


_ADVICE = {
    Phase.STEPPING: "call it after step() has returned, not from inside the inner optimizer or a hook it runs",
    Phase.IN_BACKWARD: "call step() after the backward pass first",
}
