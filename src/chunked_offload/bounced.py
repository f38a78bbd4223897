"""BouncedStore: a store behind the host whose chunks a step reads ahead into page-locked bounce buffers, over a small
backend (``read_into`` / ``write_from``), with a checksum of every generation it writes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .disk_io import aligned_buffer
from .host_arena import typed_view
from .planner import Chunk, Home, TensorSpec
from .storage import IOStats
from .sums import SUM_THREADS, PieceSums

__all__ = ["BouncedStore", "ChunkIntegrityError"]

# [Note: Chunk integrity]
# A store behind the host keeps, for each chunk, the CRC-32 of the bytes it last wrote (or read and accepted), and
# the version counter of the chunk's homes at that time. A step verifies every chunk it reads against it, on the
# reader thread, before the chunk's bytes reach its slot: a mismatch fails the chunk before its update (it rolls back
# as any failed chunk), with a ChunkIntegrityError that names the chunk and where its bytes are. The homes are the
# state's own tensors (``opt.state``, a state dict's views, the masters), which the host may write between steps; such
# a write bumps their version counter, and the next read then takes the bytes as they are and records their sum. A
# write that bypasses the tensors (another process, a flipped block, an older copy put in place) is what it catches.
# After a failed check the store refuses to hand out its homes (``check``): a state dict of them would be wrong.
# The sums run on threads of their own, in pieces at once, beside the I/O (sums.py): a read waits only for the sum of
# its last piece. A write's sum runs beside it and seals the new generation before it replaces the old
# (``write_from``'s ``seal``): a write or a sum that fails leaves the old generation the chunk's, and after the
# replacement nothing can fail. Reads and writes sum on pools of their own: a write submits its whole chunk at once
# and has the write's duration to finish; in one pool a read's pieces, which the step waits for, queued behind them.


class ChunkIntegrityError(RuntimeError):
    """A chunk's stored bytes are not what the wrapper wrote."""


class _Bounce:
    def __init__(self, nbytes: int, pin: bool) -> None:
        self.buffer = aligned_buffer(nbytes, pin)  # O_DIRECT writes from it
        self.chunk: int | None = None  # the chunk whose bytes it holds (or is reading)
        self.read: Future[tuple[float, int, float]] | None = None
        self.version = 0  # of the chunk's homes when its read began: a write into them after makes the read stale
        self.staged = False  # a stage copies from it: its write-back lands in it; not evicted


class BouncedStore:
    """The reads ahead, bounces, checksums and statistics of a store behind the host; a backend adds where the bytes
    live: ``homes_of`` (the memory of a chunk's homes between steps), ``read_into`` (on a reader thread),
    ``write_from`` (a chunk's new generation; its homes' new memory, or None) and ``where`` (for messages).

    Args:
        chunks: the plan's chunks of this store (``home_offset`` is the offset in this store's address space).
        bounces: page-locked bounce buffers (``num_slots + 1``).
        bounce_nbytes: the size of each (``plan.bounce_nbytes``: the largest chunk, in whole pages).
        pin: page-lock the bounces (a GPU host).
    """

    home: Home
    crosses_link = True
    lands_apart = True

    def __init__(self, chunks: Sequence[Chunk], bounces: int, bounce_nbytes: int, pin: bool) -> None:
        self.chunks = {c.index: c for c in chunks}
        self._by_offset = sorted((c.home_offset, c.index) for c in chunks)
        self.io = IOStats()
        self._sums: dict[int, tuple[int, int] | None] = {c.index: None for c in chunks}  # (crc, homes version)
        # Empty views of the tensors ``export`` handed out: they share their version counters, and outlive them.
        self._exported: dict[int, list[torch.Tensor]] = {c.index: [] for c in chunks}
        self.failed: dict[int, str] = {}
        self._bounces = [_Bounce(bounce_nbytes, pin) for _ in range(bounces)]
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunked_offload-store")
        self._summer = ThreadPoolExecutor(max_workers=SUM_THREADS, thread_name_prefix="chunked_offload-sum")
        self._write_summer = ThreadPoolExecutor(max_workers=SUM_THREADS, thread_name_prefix="chunked_offload-wsum")
        self._expected: list[int] = []  # chunks a step will stage, in order, not yet read

    # ------------------------------------------------------------------ the backend
    def homes_of(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, index: int, out: torch.Tensor, progress: Callable[[int], None]) -> None:
        """On a reader thread: chunk ``index``'s bytes into ``out``; ``progress(n)`` whenever the first ``n`` are in
        (optional: the sum of what is in runs on another thread meanwhile)."""
        raise NotImplementedError

    def write_from(
        self, index: int, bounce: torch.Tensor, nbytes: int, seal: Callable[[], None]
    ) -> torch.Tensor | None:
        """Store the first ``nbytes`` of ``bounce`` (a whole bounce buffer) as chunk ``index``'s new generation; its
        homes' new memory, or None. Call ``seal()`` once the bytes are stored, before they replace the old
        generation: if it (or anything before the replacement) raises, the old generation stays the chunk's. Nothing
        after the replacement may fail."""
        raise NotImplementedError

    def where(self, index: int) -> str:
        return f"chunk {index}'s bytes"

    def trim(self, index: int | None = None) -> None:
        """What the host wrote into the homes (of chunk ``index``, or all) goes where the backend keeps them."""

    def identity_error(self, index: int) -> str | None:
        """Why the stored generation of chunk ``index`` is not the one written (checked before a step), or None."""
        return None

    # ------------------------------------------------------------------ between steps
    @property
    def nbytes(self) -> int:
        return sum(c.transfer_nbytes for c in self.chunks.values())

    @property
    def bounce_nbytes(self) -> int:
        return sum(b.buffer.numel() for b in self._bounces)

    def _locate(self, offset: int) -> tuple[int, int]:
        """The chunk at store offset ``offset`` and the offset inside it."""
        for start, index in reversed(self._by_offset):
            if start <= offset:
                return index, offset - start
        raise IndexError(f"offset {offset} is in no chunk of the {self.home} store")

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        index, inner = self._locate(offset)
        return self.homes_of(index)[inner : inner + nbytes]

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        index, inner = self._locate(offset)
        return typed_view(self.homes_of(index), inner, spec)  # a view: it shares the homes' version counter

    def export(self, home: torch.Tensor) -> torch.Tensor:
        """``home`` on a storage of exactly its bytes (``torch.save`` writes nothing else of the chunk); writes through
        it count as writes of the homes ([Note: Chunk integrity])."""
        if home.numel() == 0:
            return home
        for index in self.chunks:
            flat = self.homes_of(index)
            offset = home.data_ptr() - flat.data_ptr()
            if 0 <= offset < flat.numel():
                span = _extent(home)
                storage = flat.untyped_storage()[flat.storage_offset() + offset : flat.storage_offset() + offset + span]
                own = torch.empty(0, dtype=torch.uint8).set_(storage).view(home.dtype)
                own = own.as_strided(home.shape, home.stride())
                self._exported[index].append(own.as_strided((0,), (1,)))
                return own
        return home

    def _homes_version(self, index: int) -> int:
        return self.homes_of(index)._version + sum(t._version for t in self._exported[index])

    def check(self) -> str | None:
        return next((why for index in self.chunks if (why := self._failure(index)) is not None), None)

    def _failure(self, index: int) -> str | None:
        """Why chunk ``index`` cannot be read: an earlier failed check, or a stored generation that is not the one
        written (a truncated file is SIGBUS to read through a map); recorded in ``failed``."""
        why = self.failed.get(index) or self.identity_error(index)
        if why is not None:
            self.failed[index] = why
        return why

    # ------------------------------------------------------------------ reads into the bounces
    def begin_step(self, chunks: Sequence[Chunk]) -> None:
        """The chunks a step will stage, in order: check that each is the generation written (before any update),
        then read them ahead into the free bounces."""
        self._expected = [c.index for c in chunks if c.index in self.chunks]
        for index in self._expected:
            if (why := self._failure(index)) is not None:
                self._expected = []
                raise ChunkIntegrityError(why)
        self._read_ahead()

    def _read_ahead(self) -> None:
        held = {b.chunk for b in self._bounces}
        for index in self._expected:
            if index in held:
                continue
            bounce = next((b for b in self._bounces if b.chunk is None), None)
            if bounce is None:
                return
            self._start_read(bounce, index)

    def _start_read(self, bounce: _Bounce, index: int) -> None:
        bounce.chunk, bounce.staged = index, False
        out = bounce.buffer[: self.chunks[index].transfer_nbytes]
        recorded, bounce.version = self._sums[index], self._homes_version(index)
        expected = recorded[0] if recorded is not None and recorded[1] == bounce.version else None
        bounce.read = self._pool.submit(self._verified_read, index, out, expected)

    def _verified_read(self, index: int, out: torch.Tensor, expected: int | None) -> tuple[float, int, float]:
        """On a reader thread: read chunk ``index`` into ``out`` and check its sum; (seconds, sum, seconds this
        thread waited for sums). The pieces read are summed on other threads while the next are read."""
        start = time.perf_counter()
        sums, summed = PieceSums(self._summer), 0

        def progress(upto: int) -> None:
            nonlocal summed
            sums.add(out[summed:upto])
            summed = upto

        try:
            if out.numel():
                self.read_into(index, out, progress)
            seconds = time.perf_counter() - start
            sums.add(out[summed:])
            crc = sums.result()
        except BaseException:
            sums.settle()  # the bounce may be read into again once this returns
            raise
        waited = time.perf_counter() - start - seconds
        if expected is not None and crc != expected:
            raise ChunkIntegrityError(
                f"{self.where(index)} do not hold what the wrapper wrote there (CRC-32 {crc:#010x}, written "
                f"{expected:#010x}): they were changed outside the wrapper (a flipped block, another process, an "
                "older copy put in place). The chunk was not stepped; the state in this wrapper is lost: load a "
                "checkpoint into a new wrapper"
            )
        return seconds, crc, waited

    def source(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's bytes in a bounce (read now if no read is under way), which its stage copies from and its
        write-back lands in."""
        bounce = next((b for b in self._bounces if b.chunk == chunk.index), None)
        if bounce is not None and bounce.version != self._homes_version(chunk.index):
            self._settle(bounce)  # read ahead before the host wrote into the homes: read again
            self._start_read(bounce, chunk.index)
        if bounce is None:
            bounce = self._free_bounce(chunk.index)
            self._start_read(bounce, chunk.index)
        assert bounce.read is not None
        start = time.perf_counter()
        try:
            seconds, crc, summing = bounce.read.result()
        except BaseException as e:
            if bounce.read.done():  # the read failed: the bounce is free
                bounce.chunk, bounce.read = None, None
                if isinstance(e, ChunkIntegrityError):
                    self.failed[chunk.index] = str(e)
            # Else the wait was interrupted (a KeyboardInterrupt) and the read still lands in the bounce: it keeps
            # the read, so that a retry waits for it and no other chunk is given the bounce before it has ended.
            raise
        finally:
            self.io.wait_seconds += time.perf_counter() - start
        self.io.read_seconds += seconds
        self.io.checksum_seconds += summing
        self.io.read_nbytes += chunk.transfer_nbytes
        self._sums[chunk.index] = (crc, bounce.version)
        bounce.staged = True
        if chunk.index in self._expected:
            self._expected.remove(chunk.index)
        return bounce.buffer[: chunk.transfer_nbytes]

    def in_landing(self, chunk: Chunk, home: torch.Tensor) -> torch.Tensor:
        """The bytes of ``home`` (a contiguous view of the chunk's homes) in its bounce, with its dtype and shape."""
        nbytes = home.numel() * home.element_size()
        if nbytes == 0:
            return home
        offset = home.data_ptr() - self.homes_of(chunk.index).data_ptr()
        assert home.is_contiguous() and 0 <= offset <= chunk.transfer_nbytes - nbytes
        return self.landing(chunk)[offset : offset + nbytes].view(home.dtype).view(home.shape)

    def landing(self, chunk: Chunk) -> torch.Tensor:
        """The bounce a staged chunk's write-back lands in."""
        return self._staged(chunk).buffer[: chunk.transfer_nbytes]

    def _staged(self, chunk: Chunk) -> _Bounce:
        return next(b for b in self._bounces if b.chunk == chunk.index and b.staged)

    def _free_bounce(self, index: int) -> _Bounce:
        """A bounce for chunk ``index``: a free one, else one read ahead for a chunk expected later (dropped)."""
        free = next((b for b in self._bounces if b.chunk is None), None)
        if free is not None:
            return free
        ahead = [b for b in self._bounces if not b.staged]
        if not ahead:
            raise RuntimeError(
                f"the {self.home} store has no free bounce buffer: more chunks are staged at once than num_slots + 1"
            )
        order = {c: k for k, c in enumerate(self._expected)}
        victim = max(ahead, key=lambda b: order.get(b.chunk, len(order)))  # type: ignore[arg-type]
        self._settle(victim)
        return victim

    def _settle(self, bounce: _Bounce) -> None:
        """Wait for the bounce's read (its outcome no longer matters) and free it."""
        if bounce.read is not None:
            try:
                bounce.read.result()
            except Exception:  # a failed read; an interrupted wait propagates, and the bounce keeps its read
                pass
        bounce.chunk, bounce.read, bounce.staged = None, None, False

    def release(self, chunk: Chunk) -> None:
        """The chunk's bounce is no longer needed (its stage was dropped, or its step failed): free it. The caller
        has waited for any copy that reads it."""
        for b in self._bounces:
            if b.chunk == chunk.index:
                self._settle(b)
        self._read_ahead()

    def end_step(self) -> None:
        """The step is over: every bounce is free (the caller has waited for the copies)."""
        for b in self._bounces:
            self._settle(b)
        self._expected = []

    # ------------------------------------------------------------------ writes
    def commit(self, chunk: Chunk) -> torch.Tensor | None:
        """Write the chunk's bounce (its write-back has landed) as its new generation, with its sum; the homes' new
        memory, or None. A failure (of the write, or of its sum) leaves the old generation the chunk's."""
        bounce = self._staged(chunk)
        data = bounce.buffer[: chunk.transfer_nbytes]
        start = time.perf_counter()
        sums = PieceSums(self._write_summer)
        sums.add(data)  # on other threads while this one writes
        sealed: list[int] = []

        def seal() -> None:  # a sum that failed fails the write: the old generation stays the chunk's
            written = time.perf_counter()
            sealed.append(sums.result())
            self.io.checksum_seconds += time.perf_counter() - written

        try:
            flat = self.write_from(chunk.index, bounce.buffer, chunk.transfer_nbytes, seal)
        finally:
            sums.settle()
        assert sealed, f"{type(self).__name__}.write_from() did not seal the generation it wrote"
        self.io.write_seconds += time.perf_counter() - start
        self.io.written_nbytes += chunk.transfer_nbytes
        if flat is not None:
            self._exported[chunk.index] = []  # views of the old generation: a snapshot, not the chunk's homes
        self._sums[chunk.index] = (sealed[0], self._homes_version(chunk.index))
        self._settle(bounce)
        self._read_ahead()
        return flat

    def close(self) -> None:
        for name in ("_pool", "_summer", "_write_summer"):
            if (pool := getattr(self, name, None)) is not None:
                pool.shutdown(wait=True)


def _extent(t: torch.Tensor) -> int:
    """Bytes from a strided tensor's first element to just past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()
