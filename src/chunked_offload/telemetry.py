"""Step telemetry: what the last ``step()`` moved, how long it took, and what it held."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import fields

import torch

from .planner import Chunk
from .staging import StagingPool
from .step_stats import StepStats, io_figures
from .storage import IOStats, Store
from .transfer import TransferEngine

# The profiler scope of the host's work for one chunk of a step (``benchmarks/trace_summary.py`` reads it).
CHUNK_SCOPE = "chunked_offload::chunk"

__all__ = ["CHUNK_SCOPE", "StepRecord", "StepStats"]

logger = logging.getLogger(__name__)

_MIB = 2**20


class StepRecord:
    """Counts bytes while a step runs and keeps the events that time it; ``stats()`` resolves them.

    On a GPU the times come from CUDA events, read only when ``stats()`` is called (which waits for them); on
    the CPU every copy is synchronous and wall-clock time is the step's time.
    """

    def __init__(self, engine: TransferEngine, device: torch.device, io: Sequence[IOStats] = ()) -> None:
        self.chunks = 0
        self._io = list(io)  # the stores' I/O, cumulative: the step's share is read at its start and end
        self._io_start = self._io_end = _total(self._io)
        self.h2d = self.d2h = self.d2d = 0
        self.window = 0
        self.overlapped = False
        self._timed = engine.uses_streams
        self._engine = engine
        self._device = device
        self._t0 = time.perf_counter()
        self._t_compute = self._t_end = self._t0
        self._start: torch.cuda.Event | None = None
        self._compute: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None
        if self._timed:
            self._start = self._event(torch.cuda.current_stream(device))

    @staticmethod
    def _event(stream: torch.cuda.Stream | None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def add_chunk(self, chunk: Chunk, store: Store, fresh: bool, pool: StagingPool) -> None:
        """A chunk of ``store`` was stepped (``fresh``: it had no state to bring in)."""
        self.chunks += 1
        n = chunk.transfer_nbytes
        if not store.crosses_link:
            self.d2d += n
        elif fresh:
            self.d2h += n
        else:
            self.h2d += n
            self.d2h += n
        held = pool.nbytes
        held += sum(t.untyped_storage().nbytes() for s in pool.slots for t in s.retained)
        self.window = max(self.window, held)

    def add_dropped_stage(self, chunk: Chunk, store: Store) -> None:
        """A chunk was staged but never stepped in that slot (another took it): its H2D crossed the link for nothing."""
        if store.crosses_link:
            self.h2d += chunk.transfer_nbytes

    def log(self, total_chunks: int) -> None:
        """The step's transfers at DEBUG level (``logging.getLogger("chunked_offload")``)."""
        logger.debug(
            "step: %d of %d chunks, %.1f MiB H2D, %.1f MiB D2H, %.1f MiB D2D, window %.1f MiB",
            self.chunks, total_chunks, self.h2d / _MIB, self.d2h / _MIB, self.d2d / _MIB, self.window / _MIB,
        )  # fmt: skip

    def compute_done(self) -> None:
        """Called on the compute stream after the last chunk's step."""
        if self._timed:
            self._compute = self._event(torch.cuda.current_stream(self._device))
        self._t_compute = time.perf_counter()

    def transfers_done(self) -> None:
        """Called once the last write-back is enqueued."""
        if self._timed:
            self._end = self._event(self._engine.d2h_stream)
        self._t_end = time.perf_counter()
        self._io_end = _total(self._io)

    def stats(self, resident_bytes: int, resident_share: float, pinned_host_bytes: int) -> StepStats:
        seconds, exposed = self._t_end - self._t0, self._t_compute - self._t0
        if self._start is not None and self._compute is not None and self._end is not None:
            self._end.synchronize()
            self._compute.synchronize()
            seconds = self._start.elapsed_time(self._end) / 1e3
            exposed = self._start.elapsed_time(self._compute) / 1e3
        moved = self.h2d + self.d2h
        return StepStats(
            chunks=self.chunks,
            h2d_bytes=self.h2d,
            d2h_bytes=self.d2h,
            d2d_bytes=self.d2d,
            seconds=seconds,
            link_gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
            exposed_seconds=None if self.overlapped else exposed,
            window_bytes=self.window,
            resident_bytes=resident_bytes,
            resident_share=resident_share,
            pinned_host_bytes=pinned_host_bytes,
            **io_figures(self._io_start, self._io_end),
        )


def _total(io: Sequence[IOStats]) -> IOStats:
    total = IOStats()
    for stats in io:
        for f in fields(IOStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
    return total
