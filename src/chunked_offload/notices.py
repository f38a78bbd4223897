"""Warnings the wrapper gives: one category users can filter, each given once per wrapper."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

__all__ = ["ChunkedOffloadWarning", "Notices", "warn"]


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
