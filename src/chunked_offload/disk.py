"""The disk tier: DiskStore (the chunks whose state does not fit the host budget, one file each, read through
page-locked bounces) and DiskTier (its planner rule and room checks)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import resource
import shutil
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .bounced import BouncedStore
from .disk_io import ALIGN, read_file_into, replace_file, write_new_file
from .planner import Chunk, ChunkPlan, Home
from .spill import check_free_space, spill
from .tier_dirs import make_tier_dir

__all__ = ["ALIGN", "SPARE", "DiskStore", "DiskTier", "read_file_into", "replace_file", "write_new_file"]

logger = logging.getLogger(__name__)

SPARE = "spare.bin"  # [Note: Spare generation]

# [Note: Disk tier]
# With ``spill_dir`` the planner keeps on the host the offloaded chunks from the first that fit ``host_budget_mb``
# (with the bounce buffers below); the rest live in files, one per chunk, in a directory of their own under
# ``spill_dir`` (removed with the store). A file holds the chunk's moving bytes as its host home would; its blocks are
# reserved when it is made (``fallocate``), so that a second wrapper or rank finds the disk full at construction.
# - A step of such a chunk reads its file into one of ``num_slots + 1`` page-locked bounce buffers, on a reader
#   thread and ahead of the step (the store reads the disk chunks in the order the step will stage them), then
#   copies the bounce to its slot as from the host. Its write-back lands in the bounce, which is written to a file
#   beside the old one (the spare of [Note: Spare generation], else a new one; through O_DIRECT where the
#   filesystem takes it: a bounce is whole pages from a page boundary), flushed to the disk (``fsync``), and
#   renamed over it. Only then is the chunk committed (its sum recorded: [Note: Chunk integrity] in bounced.py):
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


class DiskStore(BouncedStore):
    """The disk chunks' files under a directory of their own in ``spill_dir`` ([Note: Disk tier]).

    Args:
        spill_dir: where the directory goes (checked by ``spill.check_spill_dir`` and ``spill.check_free_space``).
        chunks: the plan's disk chunks (``home_offset`` is the offset in this store's address space).
        bounces: page-locked bounce buffers (``num_slots + 1``).
        bounce_nbytes: the size of each (``plan.bounce_nbytes``: the largest chunk, in whole pages).
        pin: page-lock the bounces (a GPU host).
    """

    home = Home.DISK

    def __init__(self, spill_dir: Path, chunks: Sequence[Chunk], bounces: int, bounce_nbytes: int, pin: bool) -> None:
        _check_open_files(len(chunks))  # each file's map holds a descriptor
        self.directory = make_tier_dir(spill_dir)  # [Note: Tier directories]
        # Only the process that made the directory removes it: a fork's child exiting must not take the parent's files.
        self._cleanup = weakref.finalize(self, _remove_if_owner, self.directory, os.getpid())
        self._maps: dict[int, torch.Tensor] = {}
        self._mmaps: dict[int, mmap.mmap] = {}  # the current files' maps, under ``_maps``
        self._ids: dict[int, tuple[int, int]] = {}  # (inode, size) of each chunk's current file
        try:
            super().__init__(chunks, bounces, bounce_nbytes, pin)
            for c in chunks:
                _reserve(self.path(c.index), c.transfer_nbytes, self.directory)  # zeros until a step writes the state
                self._adopt(c.index, *_map_file(self.path(c.index), c.transfer_nbytes))
        except BaseException:
            self.close()
            raise
        # The previous generation of the last chunk written, and its map (dead once nothing outside reads it).
        self._spare: weakref.ref[mmap.mmap] | None = None

    def path(self, index: int) -> Path:
        return self.directory / f"chunk{index:05d}.bin"

    def where(self, index: int) -> str:
        return f"the file of chunk {index} ({self.path(index)})"

    def _adopt(self, index: int, homes: torch.Tensor, mapped: mmap.mmap | None, ids: tuple[int, int]) -> torch.Tensor:
        """Make a file's map (``_map_file``) chunk ``index``'s homes: assignments alone, which cannot fail once the
        file is the chunk's."""
        if mapped is not None:
            self._mmaps[index] = mapped
        self._ids[index], self._maps[index] = ids, homes
        return homes

    def homes_of(self, index: int) -> torch.Tensor:
        """The map of chunk ``index``'s current file."""
        return self._maps[index]

    def identity_error(self, index: int) -> str | None:
        try:
            st = os.stat(self.path(index))
        except OSError as e:
            found = f"is gone ({e.strerror or e})"
        else:
            if (st.st_ino, st.st_size) == self._ids[index]:
                return None
            inode, size = self._ids[index]
            found = (
                f"is another file (inode {st.st_ino}, {st.st_size} bytes; written: inode {inode}, {size} bytes): "
                "replaced, truncated or rewritten outside the wrapper"
            )
        return (
            f"{self.where(index)} {found}. The chunk was not stepped; the state in this wrapper is lost: load a "
            "checkpoint into a new wrapper"
        )

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

    def read_into(self, index: int, out: torch.Tensor, progress: Callable[[int], None]) -> None:
        read_file_into(self.path(index), out, progress)

    def end_step(self) -> None:
        """The step is over: every bounce is free, and no spare is kept."""
        super().end_step()
        (self.directory / SPARE).unlink(missing_ok=True)
        self._spare = None

    def write_from(self, index: int, bounce: torch.Tensor, nbytes: int, seal: Callable[[], None]) -> torch.Tensor:
        """Write ``nbytes`` of ``bounce`` to the spare or a new file, flush and map it, seal it, rename it over the old
        one (which becomes the spare); return the new file's map. A failure before the rename leaves the old file the
        chunk's; after it, only assignments run."""
        path = self.path(index)
        tmp, spare = path.with_suffix(".tmp"), self.directory / SPARE
        try:
            self._recycle(spare, tmp)
            write_new_file(tmp, bounce, nbytes)  # O_DIRECT: the bounce is whole pages
            new = _map_file(tmp, nbytes)  # before the rename: after it, nothing may fail
            seal()
            os.link(path, spare)  # the generation the rename replaces stays, as the next spare
            replace_file(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            if spare.exists() and spare.samefile(path):
                spare.unlink()
            raise
        old = self._mmaps.pop(index, None)
        self._spare = None if old is None else weakref.ref(old)
        return self._adopt(index, *new)

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
        super().close()
        self._maps, self._mmaps = {}, {}
        self._cleanup()


class DiskTier:
    """The disk tier's planner rule and room checks ([Note: Disk tier]): ``spill_dir`` holds the offloaded chunks
    beyond ``host_budget`` bytes."""

    home = Home.DISK

    def __init__(self, spill_dir: Path, host_budget: int) -> None:
        self.spill_dir, self.host_budget = spill_dir, host_budget

    def assign(self, plan: ChunkPlan) -> ChunkPlan:
        return spill(plan, self.host_budget)

    def check_room(self, plan: ChunkPlan) -> None:
        """Before the files of ``plan`` are made (a store the layout reuses needs none): room for them and one more
        generation of the largest."""
        check_free_space(self.spill_dir, plan)

    def open(self, plan: ChunkPlan, pin: bool) -> DiskStore:
        chunks = [c for c in plan.chunks if c.home == self.home]
        return DiskStore(self.spill_dir, chunks, plan.num_slots + 1, plan.bounce_nbytes, pin=pin)  # its own dir


def _map_file(path: Path, nbytes: int) -> tuple[torch.Tensor, mmap.mmap | None, tuple[int, int]]:
    """The first ``nbytes`` of ``path`` as a tensor over a shared map (None: no bytes), and the file's (inode, size).
    The map follows the file through a rename; the tensor keeps the map (and the file) alive."""
    with open(path, "r+b") as f:
        st = os.fstat(f.fileno())
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8), None, (st.st_ino, st.st_size)
        mapped = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
    return torch.frombuffer(mapped, dtype=torch.uint8), mapped, (st.st_ino, st.st_size)


def _reserve(path: Path, nbytes: int, directory: Path) -> None:
    """Make the file ``path`` of ``nbytes`` with its blocks reserved (``fallocate``) where the filesystem can."""
    with open(path, "xb") as f:
        try:
            if nbytes:
                os.posix_fallocate(f.fileno(), 0, nbytes)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise OSError(
                    errno.ENOSPC,
                    f"the disk of spill_dir has no room for the {nbytes}-byte file of a chunk ({directory} holds the "
                    "tier's files): another wrapper or rank took the space; free space there, pass another "
                    "spill_dir, or raise host_budget_mb",
                ) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        f.truncate(nbytes)  # sparse where nothing was reserved


def _check_open_files(files: int, spare: int = 64) -> None:
    """Each chunk's file map holds a descriptor: raise the soft ``RLIMIT_NOFILE`` as far as the hard one lets, or
    say what to raise."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:
        held = 0
    need = held + files + spare
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard == resource.RLIM_INFINITY or need <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        logger.info("raised the soft RLIMIT_NOFILE from %d to %d: the disk tier maps %d files", soft, need, files)
        return
    raise OSError(
        errno.EMFILE,
        f"the disk tier keeps {files} chunk files mapped, and this process may open {hard} files (RLIMIT_NOFILE, "
        f"{held} open now): raise the limit (ulimit -n {need}, or a higher hard limit), or raise chunk_size_mb",
    )


def _remove_if_owner(directory: Path, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)
