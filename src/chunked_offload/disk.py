"""DiskStore: the chunks whose state does not fit the host budget, one file each, read through page-locked bounces."""

from __future__ import annotations

import mmap
import os
import shutil
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .disk_io import ALIGN, read_file_into, replace_file, write_new_file
from .host_arena import typed_view
from .planner import Chunk, Home, TensorSpec
from .tier_dirs import make_tier_dir

__all__ = ["ALIGN", "SPARE", "DiskStats", "DiskStore", "read_file_into", "replace_file", "write_new_file"]

SPARE = "spare.bin"  # [Note: Spare generation]

# [Note: Disk tier]
# With ``spill_dir`` the planner keeps on the host the offloaded chunks from the first that fit ``host_budget_mb``
# (with the bounce buffers below); the rest live in files, one per chunk, in a directory of their own under
# ``spill_dir`` (removed with the store). A file holds the chunk's moving bytes as its host home would.
# - A step of such a chunk reads its file into one of ``num_slots + 1`` page-locked bounce buffers, on a reader
#   thread and ahead of the step (the store reads the disk chunks in the order the step will stage them), then
#   copies the bounce to its slot as from the host. Its write-back lands in the bounce, which is written to a file
#   beside the old one (the spare of [Note: Spare generation], else a new one; through O_DIRECT where the
#   filesystem takes it: a bounce is whole pages from a page boundary), flushed to the disk (``fsync``), and
#   renamed over it. Only then is the chunk committed:
#   a failure before the rename (a full disk, an I/O error) rolls it back as any failed chunk, and the old file is
#   still the chunk's. A crash mid-write leaves the old file and a stray ``.tmp`` that no load reads. A first step
#   goes the same way: the bounce holds the file's masters (and zeros), and its write-back lands there too.
# - Between steps the homes of the chunk's tensors are a shared memory map of its current file, so ``opt.state``,
#   ``state_dict()``, loads and re-plans read and write the files through the page cache, never all of them in RAM.
#   After a rename the chunk's homes move to the new file's map; a ``state_dict()`` taken before keeps the old
#   file's map, a snapshot of that step (its blocks stay on the disk until the tensors are gone). Steps read and
#   write the files, not the maps; what a placement wrote into them (the seeded masters) is flushed and dropped
#   from memory (``trim``), so the pages the maps hold are those the caller reads.
# The host memory the tier takes is the bounces: ``(num_slots + 1) * plan.bounce_nbytes``, in the plan's summary.
#
# [Note: Spare generation]
# A new file costs the filesystem its blocks, and the one it replaces costs their release: on the CPU machine's
# ext4, reading and rewriting eight 256 MiB files took 1.16-1.20 s with their blocks reused, 1.51-1.56 s in new
# files (bench_disk.py's tier_pattern times it). So the generation a rename replaces stays as
# ``spare.bin`` (a hard link made before the rename), and the next chunk's write renames the spare to its ``.tmp``
# and overwrites it in place (no ``O_TRUNC``; cut to size at the end). One spare at most, and only within a step
# (its end removes it): the disk holds the state and one more file of at most the largest chunk, as before, and
# between steps the directory holds the chunks' files and its owner mark alone. A spare whose map is still read (a
# ``state_dict()`` of its step, seen through a weak reference to the map) is never overwritten: its name goes,
# and its blocks stay until its tensors are gone, as without a spare.


@dataclass
class DiskStats:
    """What the disk tier did (cumulative; ``StepStats`` reports a step's share)."""

    read_nbytes: int = 0
    written_nbytes: int = 0
    read_seconds: float = 0.0  # on the reader threads
    write_seconds: float = 0.0
    wait_seconds: float = 0.0  # the step waited for a read: the disk's exposed time


class _Bounce:
    def __init__(self, nbytes: int, pin: bool) -> None:
        # Whole pages from a page boundary (page-locked memory starts on one), so that O_DIRECT can write it.
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        if self.buffer.data_ptr() % ALIGN:
            raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
            start = -raw.data_ptr() % ALIGN
            self.buffer = raw[start : start + nbytes]
        self.chunk: int | None = None  # the chunk whose file it holds (or is reading)
        self.read: Future[float] | None = None
        self.staged = False  # a stage copies from it: its write-back lands in it; not evicted


class DiskStore:
    """The disk chunks' files under a directory of their own in ``spill_dir`` ([Note: Disk tier]).

    Args:
        spill_dir: where the directory goes (checked by ``spill.check_spill_dir`` and ``spill.check_free_space``).
        chunks: the plan's disk chunks (``home_offset`` is the offset in this store's address space).
        bounces: page-locked bounce buffers (``num_slots + 1``).
        bounce_nbytes: the size of each (``plan.bounce_nbytes``: the largest chunk, in whole pages).
        pin: page-lock the bounces (a GPU host).
    """

    home = Home.DISK
    crosses_link = True

    def __init__(self, spill_dir: Path, chunks: Sequence[Chunk], bounces: int, bounce_nbytes: int, pin: bool) -> None:
        self.directory = make_tier_dir(spill_dir)  # [Note: Tier directories]
        # Only the process that made the directory removes it: a fork's child exiting must not take the parent's files.
        self._cleanup = weakref.finalize(self, _remove_if_owner, self.directory, os.getpid())
        self.chunks = {c.index: c for c in chunks}
        self._by_offset = sorted((c.home_offset, c.index) for c in chunks)
        self.stats = DiskStats()
        self._maps: dict[int, torch.Tensor] = {}
        self._mmaps: dict[int, mmap.mmap] = {}  # the current files' maps, under ``_maps``
        try:
            for c in chunks:
                path = self.path(c.index)
                with open(path, "xb") as f:
                    f.truncate(c.transfer_nbytes)  # sparse: zeros until the first step writes the state
                self._maps[c.index] = self._map(c.index)
            self._bounces = [_Bounce(bounce_nbytes, pin) for _ in range(bounces)]
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunked_offload-disk")
        self._expected: list[int] = []  # disk chunks a step will stage, in order, not yet read
        # The previous generation of the last chunk written, and its map (dead once nothing outside reads it).
        self._spare: weakref.ref[mmap.mmap] | None = None

    # ------------------------------------------------------------------ the Store interface
    @property
    def nbytes(self) -> int:
        return sum(c.transfer_nbytes for c in self.chunks.values())

    @property
    def bounce_nbytes(self) -> int:
        return sum(b.buffer.numel() for b in self._bounces)

    def path(self, index: int) -> Path:
        return self.directory / f"chunk{index:05d}.bin"

    def _map(self, index: int) -> torch.Tensor:
        n = self.chunks[index].transfer_nbytes
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        with open(self.path(index), "r+b") as f:
            mapped = mmap.mmap(f.fileno(), n, flags=mmap.MAP_SHARED)  # the tensor keeps it (and the file) alive
        self._mmaps[index] = mapped
        return torch.frombuffer(mapped, dtype=torch.uint8)

    def trim(self, index: int | None = None) -> None:
        """Flush what was written into the maps (of chunk ``index``, or all) to the files and drop their pages from
        memory (they are read again from the page cache or the disk when touched)."""
        if index is None:
            maps = list(self._mmaps.values())
        else:
            maps = [self._mmaps[index]] if index in self._mmaps else []
        for mapped in maps:
            mapped.flush()
            mapped.madvise(mmap.MADV_DONTNEED)

    def _locate(self, offset: int) -> tuple[int, int]:
        """The chunk at store offset ``offset`` and the offset inside it."""
        for start, index in reversed(self._by_offset):
            if start <= offset:
                return index, offset - start
        raise IndexError(f"offset {offset} is in no disk chunk")

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of a chunk's file map from store ``offset`` (a first step writes its state there)."""
        index, inner = self._locate(offset)
        return self._maps[index][inner : inner + nbytes]

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        index, inner = self._locate(offset)
        return typed_view(self._maps[index], inner, spec)

    def flat(self, index: int) -> torch.Tensor:
        """The map of chunk ``index``'s current file."""
        return self._maps[index]

    # ------------------------------------------------------------------ reads into the bounces
    def expect(self, chunks: Sequence[Chunk]) -> None:
        """The disk chunks a step will stage, in order: read them ahead into the free bounces."""
        self._expected = [c.index for c in chunks if c.index in self.chunks]
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
        path, out = self.path(index), bounce.buffer[: self.chunks[index].transfer_nbytes]
        bounce.read = self._pool.submit(_timed_read, path, out)

    def load(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's file bytes in a bounce (read now if no read is under way), which its stage copies from and its
        write-back lands in."""
        bounce = next((b for b in self._bounces if b.chunk == chunk.index), None)
        if bounce is None:
            bounce = self._free_bounce(chunk.index)
            self._start_read(bounce, chunk.index)
        assert bounce.read is not None
        start = time.perf_counter()
        try:
            self.stats.read_seconds += bounce.read.result()
        except BaseException:
            if bounce.read.done():  # the read failed: the bounce is free
                bounce.chunk, bounce.read = None, None
            # Else the wait was interrupted (a KeyboardInterrupt) and the read still lands in the bounce: it keeps
            # the read, so that a retry waits for it and no other chunk is given the bounce before it has ended.
            raise
        finally:
            self.stats.wait_seconds += time.perf_counter() - start
        self.stats.read_nbytes += chunk.transfer_nbytes
        bounce.staged = True
        if chunk.index in self._expected:
            self._expected.remove(chunk.index)
        return bounce.buffer[: chunk.transfer_nbytes]

    def in_bounce(self, chunk: Chunk, home: torch.Tensor) -> torch.Tensor:
        """The bytes of ``home`` (a contiguous view of the chunk's file map) in its bounce, with its dtype and shape."""
        nbytes = home.numel() * home.element_size()
        if nbytes == 0:
            return home
        offset = home.data_ptr() - self._maps[chunk.index].data_ptr()
        assert home.is_contiguous() and 0 <= offset <= chunk.transfer_nbytes - nbytes
        return self.bounce_of(chunk)[offset : offset + nbytes].view(home.dtype).view(home.shape)

    def bounce_of(self, chunk: Chunk) -> torch.Tensor:
        """The bounce a staged chunk's write-back lands in."""
        bounce = next(b for b in self._bounces if b.chunk == chunk.index and b.staged)
        return bounce.buffer[: chunk.transfer_nbytes]

    def _free_bounce(self, index: int) -> _Bounce:
        """A bounce for chunk ``index``: a free one, else one read ahead for a chunk expected later (dropped)."""
        free = next((b for b in self._bounces if b.chunk is None), None)
        if free is not None:
            return free
        ahead = [b for b in self._bounces if not b.staged]
        if not ahead:
            raise RuntimeError(
                "the disk tier has no free bounce buffer: more chunks are staged at once than num_slots + 1"
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

    def release_all(self) -> None:
        """The step is over: every bounce is free (the caller has waited for the copies), and no spare is kept."""
        for b in self._bounces:
            self._settle(b)
        self._expected = []
        (self.directory / SPARE).unlink(missing_ok=True)
        self._spare = None

    # ------------------------------------------------------------------ writes
    def persist(self, chunk: Chunk) -> torch.Tensor:
        """Write the chunk's bounce (its write-back has landed) to the spare or a new file, flush it, rename it over
        the old one (which becomes the spare);
        return the new file's map. A failure before the rename leaves the old file the chunk's."""
        bounce = next(b for b in self._bounces if b.chunk == chunk.index and b.staged)
        path = self.path(chunk.index)
        tmp, spare = path.with_suffix(".tmp"), self.directory / SPARE
        start = time.perf_counter()
        try:
            self._recycle(spare, tmp)
            write_new_file(tmp, bounce.buffer, chunk.transfer_nbytes)
            os.link(path, spare)  # the generation the rename replaces stays, as the next spare
            replace_file(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            if spare.exists() and spare.samefile(path):
                spare.unlink()
            raise
        self.stats.write_seconds += time.perf_counter() - start
        self.stats.written_nbytes += chunk.transfer_nbytes
        self._settle(bounce)
        old = self._mmaps.pop(chunk.index, None)
        self._spare = None if old is None else weakref.ref(old)
        self._maps[chunk.index] = self._map(chunk.index)
        self._read_ahead()
        return self._maps[chunk.index]

    def _recycle(self, spare: Path, tmp: Path) -> None:
        """[Note: Spare generation]: the spare becomes ``tmp``, for its blocks, unless a map of it is still read."""
        if not spare.exists():
            return
        if self._spare is not None and self._spare() is not None:
            spare.unlink()  # a state_dict() of that step still reads it: its blocks stay until its tensors are gone
        else:
            os.replace(spare, tmp)
        self._spare = None

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        self._maps, self._mmaps = {}, {}
        self._cleanup()


def _remove_if_owner(directory: Path, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)


def _timed_read(path: Path, out: torch.Tensor) -> float:
    start = time.perf_counter()
    if out.numel():
        read_file_into(path, out)
    return time.perf_counter() - start
