"""Prefetcher: the H2D copies ``opt.prefetch()`` starts before a step, and their hand-over to that step."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .planner import Chunk
from .transfer import TransferEngine

__all__ = ["Prefetcher"]

Event = torch.cuda.Event | None


class _Stager(Protocol):
    """What the prefetcher needs of the pipeline (``ChunkPipeline``)."""

    engine: TransferEngine

    @property
    def lookahead(self) -> int: ...

    def has_state(self, chunk: Chunk) -> bool: ...

    def state_versions(self, chunks: Sequence[Chunk]) -> list[int]: ...

    def start(self, chunks: Sequence[Chunk], fresh: Sequence[bool], depth: int) -> dict[int, Event]: ...

    def drain_and_release(self) -> None: ...


@dataclass
class _Prefetch:
    """The H2D copies ``prefetch()`` started: which chunks, and the versions of the homes and the state they read."""

    chunk_indices: list[int]
    fresh: list[bool]
    events: dict[int, Event]
    home_version: int  # bumped by the wrapper's own writes into the homes (an assignment, a load, a re-plan)
    state_versions: list[int]  # bumped by an in-place write into a state tensor (``opt.state[p][k].mul_(0.5)``)


class Prefetcher:
    """Stages the first chunks of the next step early, and hands them to that step if it still wants them."""

    def __init__(self, stager: _Stager) -> None:
        self._stager_ref = weakref.ref(stager)  # the pipeline holds this: a cycle would outlive a dropped wrapper
        self._prefetched: _Prefetch | None = None

    @property
    def _stager(self) -> _Stager:
        stager = self._stager_ref()
        if stager is None:
            raise RuntimeError("the pipeline of this prefetcher is gone")
        return stager

    @property
    def active(self) -> bool:
        """Whether a ``prefetch()`` has staged chunks that the next step takes over."""
        return self._prefetched is not None

    def prefetch(self, chunks: Sequence[Chunk]) -> None:
        """Start the H2D of the first chunks a step of ``chunks`` will stage; ``take`` hands them over.

        The slots hold their memory from now until that step. If the step turns out to need other chunks, or the
        homes or the chunks' state tensors are written in between (in place too), the staged bytes are dropped and
        the step stages them again.
        """
        self.drop()
        stager = self._stager
        fresh = [not stager.has_state(c) for c in chunks]
        if not chunks or fresh[0]:
            return  # a first step creates its state on the device: nothing to bring in early
        depth = max(1, stager.lookahead)
        try:
            events = stager.start(chunks, fresh, depth)
        except BaseException:
            stager.drain_and_release()  # nothing was modified (an H2D only reads the homes); the step stages again
            raise
        indices = [c.index for c in chunks[:depth]]
        versions = stager.state_versions(chunks[:depth])
        self._prefetched = _Prefetch(indices, fresh[:depth], events, stager.engine.home_version, versions)

    def take(self, chunks: Sequence[Chunk], fresh: Sequence[bool]) -> dict[int, Event] | None:
        """The H2D events of a prefetch that matches this step's first chunks, or None (after dropping any other)."""
        taken = self._prefetched
        if taken is None:
            return None
        n = len(taken.chunk_indices)
        if (
            taken.home_version == self._stager.engine.home_version
            and [c.index for c in chunks[:n]] == taken.chunk_indices
            and list(fresh[:n]) == taken.fresh
            and self._stager.state_versions(chunks[:n]) == taken.state_versions
        ):
            self._prefetched = None
            return taken.events
        self.drop()
        return None

    def drop(self) -> None:
        """Give back what ``prefetch`` took: wait for its copies, free the slots."""
        if self._prefetched is not None:
            self._prefetched = None
            self._stager.drain_and_release()
