"""Warnings the wrapper gives: one category users can filter, each given once per wrapper."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

__all__ = ["NOT_ACCUMULATING", "NO_GRAD_HOOKS", "UNATTACHED", "ChunkedOffloadWarning", "Notices", "warn"]

# What the step runner warns of, once per wrapper.
UNATTACHED = (
    "overlap=True without an attached model: step() makes the caller's stream wait for the whole step, so nothing "
    "overlaps it. Call opt.attach(model) so that each module's forward waits for its own params"
)

NO_GRAD_HOOKS = (
    "step_in_backward=True, but no param of this optimizer got its grad from autograd in the backward before this "
    "step() (their post-accumulate-grad hooks never ran: params that do not require grad, or grads assigned after "
    "the backward, as Megatron's fp32 main params), so step() stepped every chunk itself, as step_in_backward=False "
    "does. Use overlap=True with opt.attach(model) to hide the step under the next forward, or step_in_backward=False "
    "(docs/modes.md)"
)

NOT_ACCUMULATING = (
    "opt.accumulating() does nothing without step_in_backward=True: backward passes never step then, and step() "
    "steps with the accumulated grads. Leave the block out"
)


class ChunkedOffloadWarning(UserWarning):
    """A setting or call that does less than it says (``warnings.filterwarnings("ignore", category=...)``)."""


class Notices:
    """Warnings one wrapper gives at most once each, whatever the warnings filter."""

    def __init__(self) -> None:
        self._given: set[str] = set()

    def warn(self, key: str, message: str) -> None:
        if key not in self._given:
            self._given.add(key)
            warnings.warn(message, ChunkedOffloadWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package, torch and contextlib: the user's line."""
    inside = (os.path.dirname(__file__), os.path.dirname(torch.__file__), contextlib.__file__)
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level


def warn(message: str) -> None:
    """Warn at the user's line (not once per wrapper: for warnings given before a wrapper exists)."""
    warnings.warn(message, ChunkedOffloadWarning, stacklevel=_caller_level())
