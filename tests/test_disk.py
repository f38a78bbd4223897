"""The disk tier ([Note: Disk tier]): with ``spill_dir`` the chunks beyond ``host_budget_mb`` live in files, and every
mode stays bitwise equal to the plain loop; a failed read, write or rename rolls the chunk back; bad directories and
full disks are refused before anything is allocated; checkpoints move between disk-tier, host-only and plain
optimizers."""

from __future__ import annotations

import copy
import errno
import gc
import io
import mmap
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import chunked_offload.disk as disk_module
import chunked_offload.spill as spill_module
import chunked_offload.sums as sums_module
from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.planner import ChunkPlan, Home
from reference import (
    assert_equal,
    assert_states_equal,
    internals,
    make_grads,
    make_params,
    run_steps,
    set_grads,
    spill_budget,
)
from test_faults import _assert_same, _committed
from test_loops import assert_same, build, train

SHARES = [0.0, 0.5, 0.9]
MASTERS = ["none", "fp32", "remainder"]
MODES = ["sync", "overlap", "backward"]
SHAPES = [(7, 5), (33,), (4, 4, 3), (9, 8), (30,), (16, 3), (5,), (12, 6)]


def budget_for(plan: ChunkPlan, share: float) -> float:
    """``host_budget_mb`` for ``share`` of ``plan``'s offloaded bytes on disk (``reference.spill_budget``)."""
    return spill_budget(plan, share) / 2**20


def disk_share(opt: ChunkedOffloadOptimizer) -> float:
    plan = opt.plan
    return plan.disk_nbytes / (plan.disk_nbytes + plan.host_nbytes)


def spill_files(directory: Path) -> list[Path]:
    """The chunk files of the tiers under ``directory`` (not their owner marks: [Note: Tier directories])."""
    return sorted(p for sub in directory.iterdir() for p in sub.iterdir() if p.name != "owner.json")


# ------------------------------------------------------------------------------------------------ bitwise in every mode
@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_bitwise_with_state_on_disk(tmp_path: Path, mode: str, master: str, share: float) -> None:
    plain = build("plain", master)
    train(*plain, range(4))
    budget = budget_for(build(mode, master)[1].plan, share)
    model, opt = build(mode, master, spill_dir=tmp_path, host_budget_mb=budget)
    assert abs(disk_share(opt) - share) < 0.25, opt.plan.summary()
    train(model, opt, range(4))
    assert_same(plain[0], model)
    stats = opt.stats
    assert stats is not None
    assert stats.disk_read_bytes == stats.disk_written_bytes == opt.plan.disk_nbytes  # every chunk stepped
    files = spill_files(tmp_path)
    assert [f.suffix for f in files] == [".bin"] * len(opt.plan.disk_chunks)  # no stray .tmp


def test_the_disk_reports_how_long_it_waited_for_its_checksums(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``disk_checksum_seconds`` is the checksums' cost on the disk's path (bench_disk's "sum waits"): a read sums
    its last piece itself, after the bytes are in."""
    model, opt = build("sync", "fp32", spill_dir=tmp_path, host_budget_mb=budget_for(build("sync")[1].plan, 0.9))
    train(model, opt, range(2))
    assert opt.stats is not None
    fast = opt.stats.disk_checksum_seconds
    real, delay = sums_module.checksum, 0.01

    def slow(data: torch.Tensor) -> int:
        time.sleep(delay)
        return real(data)

    monkeypatch.setattr(sums_module, "checksum", slow)
    train(model, opt, range(2, 3))
    assert opt.stats.disk_read_bytes == opt.plan.disk_nbytes
    assert fast < len(opt.plan.disk_chunks) * delay <= opt.stats.disk_checksum_seconds


def _takes_o_direct(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        (directory / "probe").unlink(missing_ok=True)
    return True


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("refused", ["nothing", "open", "write"])
def test_writes_go_through_o_direct_where_the_filesystem_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """A filesystem that refuses O_DIRECT when the file is opened (tmpfs) or written (blocks larger than a page) gets
    buffered writes instead; the files, and the training, are the same."""
    direct_fds: set[int] = set()
    opened = {"direct": 0, "buffered": 0}
    real_open, real_write = os.open, os.write

    def fake_open(path: Any, flags: int, *args: Any) -> int:
        direct = bool(flags & os.O_DIRECT)
        if direct and refused == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args)
        if direct:
            direct_fds.add(fd)
        else:
            direct_fds.discard(fd)
        if flags & os.O_WRONLY:
            opened["direct" if direct else "buffered"] += 1
        return fd

    def fake_write(fd: int, data: Any) -> int:
        if fd in direct_fds and refused == "write":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    takes_o_direct = _takes_o_direct(tmp_path)  # not a tmpfs
    monkeypatch.setattr(disk_module.os, "open", fake_open)
    monkeypatch.setattr(disk_module.os, "write", fake_write)
    plain = build("plain", "fp32")
    train(*plain, range(3))
    model, opt = build("sync", "fp32", spill_dir=tmp_path, host_budget_mb=budget_for(build("sync")[1].plan, 0.9))
    train(model, opt, range(3))
    assert_same(plain[0], model)
    writes = 3 * len(opt.plan.disk_chunks)
    if refused == "nothing" and takes_o_direct:
        assert opened == {"direct": writes, "buffered": 0}
    else:
        assert opened["buffered"] == writes
    assert [f.stat().st_size for f in spill_files(tmp_path)] == [c.transfer_nbytes for c in opt.plan.disk_chunks]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("direct", [True, False])
def test_write_new_file_takes_o_direct_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """``direct=False`` is bench_disk's buffered side of its A/B: the same file, never through O_DIRECT."""
    flags: list[int] = []
    real_open = os.open
    monkeypatch.setattr(disk_module.os, "open", lambda path, f, *a: flags.append(f) or real_open(path, f, *a))
    bounce = torch.frombuffer(mmap.mmap(-1, 3 * disk_module.ALIGN), dtype=torch.uint8)  # page-aligned, as a bounce
    bounce.random_(0, 255)
    disk_module.write_new_file(tmp_path / "f.bin", bounce, 5000, direct=direct)
    assert (tmp_path / "f.bin").read_bytes() == bytes(bounce[:5000].numpy())
    assert any(f & os.O_DIRECT for f in flags) == direct  # tried first when asked (a tmpfs then refuses it)


def test_the_optimizer_state_on_disk_equals_the_plain_optimizers(tmp_path: Path) -> None:
    params, ref_params = make_params(SHAPES), make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    probe = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(SHAPES)), chunk_size_mb=0.002)
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        chunk_size_mb=0.002,
        spill_dir=tmp_path,
        host_budget_mb=budget_for(probe.plan, 0.9),
    )
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 3)
    assert_states_equal(ref, ref_params, opt, params)
    assert opt.plan.disk_chunks
    summary = opt.plan.summary()
    assert "chunks on disk" in summary and f"x {opt.num_slots + 1}" in summary
    store = internals(opt).placement.layout.stores[Home.DISK]
    assert store.bounce_nbytes == (opt.num_slots + 1) * opt.plan.bounce_nbytes  # the tier's host window
    directory = store.directory
    del opt, store
    gc.collect()
    assert not directory.exists()  # the files go with the wrapper


def _disk_opt(tmp_path: Path, params: list[torch.nn.Parameter]) -> ChunkedOffloadOptimizer:
    probe = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(SHAPES)), chunk_size_mb=0.002)
    return ChunkedOffloadOptimizer(
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        chunk_size_mb=0.002,
        spill_dir=tmp_path,
        host_budget_mb=budget_for(probe.plan, 0.9),
    )


def test_a_step_writes_each_chunk_into_the_blocks_of_the_generation_before(tmp_path: Path) -> None:
    """[Note: Spare generation]: the first chunk of a step gets a new file, each later one the file the rename before
    it replaced; between steps the directory holds the chunks' files alone."""
    params = make_params(SHAPES)
    opt = _disk_opt(tmp_path, params)
    run_steps(opt, params, 2)
    files = spill_files(tmp_path)
    assert [f.name for f in files] == [f"chunk{c.index:05d}.bin" for c in opt.plan.disk_chunks]
    before = [f.stat().st_ino for f in files]
    run_steps(opt, params, 1, first_step=2)
    after = [f.stat().st_ino for f in spill_files(tmp_path)]
    assert after[1:] == before[:-1] and after[0] not in before  # in step order, which is the files' order here


def test_a_state_dict_of_an_earlier_step_is_never_overwritten(tmp_path: Path) -> None:
    """Its state tensors read the files of that step: no later write reuses their blocks (the step counts are the
    live tensors, as in plain torch)."""
    params, ref_params = make_params(SHAPES), make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    opt = _disk_opt(tmp_path, params)
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 2)
    held, expected = opt.state_dict(), copy.deepcopy(ref.state_dict())
    run_steps(opt, params, 3, first_step=2)
    for k, entry in expected["state"].items():
        for key, value in entry.items():
            if value.dim():
                assert_equal(held["state"][k][key], value)


# ------------------------------------------------------------------------------------------------ faults
class Injected(OSError):
    pass


@contextmanager
def disk_fault(monkeypatch: pytest.MonkeyPatch, point: str, index: int, store: Any = None) -> Iterator[None]:
    """Make the disk operation ``point`` of chunk ``index``'s file fail (the others run as usual); ``"seal"`` needs
    the ``store``."""
    name = f"chunk{index:05d}"

    def failing(original: Callable[..., Any], which: int) -> Callable[..., Any]:
        def patched(*args: Any) -> Any:
            if Path(args[which]).stem == name:
                raise Injected(errno.ENOSPC if point == "write" else errno.EIO, f"injected {point} failure")
            return original(*args)

        return patched

    if point == "seal":  # the sum of the new file, which the store waits for before the rename, failed
        assert store is not None
        real_write = store.write_from

        def write_from(index: int, bounce: torch.Tensor, nbytes: int, seal: Callable[[], None]) -> Any:
            def failing_seal() -> None:
                seal()
                if store.path(index).stem == name:
                    raise Injected(errno.EIO, "injected checksum failure")

            return real_write(index, bounce, nbytes, failing_seal)

        monkeypatch.setattr(store, "write_from", write_from)
    elif point == "map":  # the map of the new file (the homes' memory from then on), found by its descriptor
        real_mmap = mmap.mmap

        def mapping(fd: int, *args: Any, **kwargs: Any) -> mmap.mmap:
            if fd >= 0 and Path(os.readlink(f"/proc/self/fd/{fd}")).stem == name:
                raise Injected(errno.ENOMEM, "injected map failure")
            return real_mmap(fd, *args, **kwargs)

        monkeypatch.setattr(disk_module.mmap, "mmap", mapping)
    else:
        targets = {
            "read": ("read_file_into", 0),
            "write": ("write_new_file", 0),
            "rename": ("replace_file", 1),
        }
        attr, which = targets[point]
        monkeypatch.setattr(disk_module, attr, failing(getattr(disk_module, attr), which))
    try:
        yield
    finally:
        monkeypatch.undo()


CONFIGS = {"adamw": "none", "adamw-fp32-masters": "fp32", "adamw-remainder": "remainder"}


def _pair(config: str, tmp_path: Path) -> tuple[Any, list[torch.nn.Parameter], Any, list[torch.nn.Parameter]]:
    """A disk-tier wrapper (90% of the state on disk) and its oracle: plain AdamW, or a host-only wrapper."""
    master = CONFIGS[config]
    dtype = torch.float32 if master == "none" else torch.bfloat16

    def inner(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)

    params, twin_params = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    options: dict[str, Any] = dict(chunk_size_mb=0.002, master_weights=master)
    probe = ChunkedOffloadOptimizer(inner(make_params(SHAPES, dtype)), **options)
    opt = ChunkedOffloadOptimizer(
        inner(params), **options, spill_dir=tmp_path, host_budget_mb=budget_for(probe.plan, 0.9)
    )
    twin = inner(twin_params) if master == "none" else ChunkedOffloadOptimizer(inner(twin_params), **options)
    return opt, params, twin, twin_params


@pytest.mark.parametrize("target", [0, -1], ids=["first-on-disk", "last"])
@pytest.mark.parametrize("step", ["first", "later"])
@pytest.mark.parametrize("point", ["read", "write", "rename", "map"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failed_disk_operation_rolls_the_chunk_back_and_the_files_resume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str, point: str, step: str, target: int
) -> None:
    """A read (EIO), the write of the new file (ENOSPC: a full disk), its rename, or its map (ENOMEM) fails, in a
    chunk's first step (which reads its masters from the file) or a later one."""
    _fails_and_resumes(monkeypatch, tmp_path, config, point, step, target)


@pytest.mark.parametrize("step", ["first", "later"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failed_checksum_of_a_new_generation_leaves_the_old_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str, step: str
) -> None:
    """The sum of a chunk's new file runs beside its write, and seals it before the rename; a sum that fails (here
    the seal) fails the write, and the old file stays the chunk's."""
    _fails_and_resumes(monkeypatch, tmp_path, config, "seal", step, 0)


def _fails_and_resumes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str, point: str, step: str, target: int
) -> None:
    opt, params, twin, twin_params = _pair(config, tmp_path)
    chunks = opt.plan.all_chunks
    on_disk = opt.plan.disk_chunks
    assert len(on_disk) >= 3
    first = 0 if step == "first" else 2
    run_steps(opt, params, first)
    run_steps(twin, twin_params, first)
    set_grads(params, make_grads(params, first))
    store = internals(opt).placement.layout.stores[Home.DISK]
    with disk_fault(monkeypatch, point, on_disk[target].index, store), pytest.raises(Injected) as info:
        opt.step()

    assert all(slot.state.value == "free" and slot.buffer is None for slot in internals(opt).pool.slots)
    assert not any(f.suffix == ".tmp" for f in spill_files(tmp_path))  # the old file is still the chunk's
    committed = _committed(info.value, len(chunks))
    failing = on_disk[target].index
    # Rolled back: the failing chunk, or for a read the chunk stepping while the read's chunk is staged.
    assert chunks[committed].index in ((failing - 1, failing) if point == "read" else (failing,))
    stepped = {i for c in chunks[:committed] for i in c.params}
    grads = make_grads(twin_params, first)
    set_grads(twin_params, [g if i in stepped else None for i, g in enumerate(grads)])
    twin.step()
    twin.zero_grad()
    _assert_same(twin, twin_params, opt, params)  # opt.state reads the files

    run_steps(opt, params, 3, first_step=first + 1)  # and training from them goes on exactly
    run_steps(twin, twin_params, 3, first_step=first + 1)
    _assert_same(twin, twin_params, opt, params)


# ------------------------------------------------------------------------------------------------ refused directories
def _refused(tmp_path: Path, spill_dir: Any, match: str, error: type[Exception] = ValueError, **options: Any) -> None:
    params = make_params(SHAPES)
    before = [p.detach().clone() for p in params]
    inner = torch.optim.AdamW(params, lr=1e-2)
    with pytest.raises(error, match=match):
        ChunkedOffloadOptimizer(inner, chunk_size_mb=0.002, spill_dir=spill_dir, **options)
    assert not inner.state  # nothing was modified
    for p, b in zip(params, before, strict=True):
        assert_equal(p, b)


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, tmp_path / "nope", "does not exist: create it")


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _refused(tmp_path, tmp_path / "file", "is not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0500 directory")
def test_a_directory_without_write_permission_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _refused(tmp_path, locked, "is not writable")


def test_a_read_only_filesystem_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(spill_module.tempfile, "mkstemp", read_only)  # what a read-only mount answers
    _refused(tmp_path, tmp_path, "is not writable by this process \\(Read-only file system\\)")


def test_a_disk_without_room_for_the_state_and_a_generation_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = spill_module.shutil.disk_usage

    def small(path: Any) -> Any:
        usage = real(path)
        return type(usage)(usage.total, usage.used, 1000)

    monkeypatch.setattr(spill_module.shutil, "disk_usage", small)
    _refused(tmp_path, tmp_path, "MiB free, but the disk tier needs", host_budget_mb=0.015)
    assert not list(tmp_path.iterdir())  # no file was made


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"host_budget_mb": 100}, ValueError, "host_budget_mb=100 needs spill_dir"),
        ({"spill_dir": 3}, TypeError, "spill_dir must be a path"),
        ({"spill_dir": ".", "host_budget_mb": "lots"}, TypeError, "host_budget_mb must be a number of MiB or 'auto'"),
        ({"spill_dir": ".", "host_budget_mb": -1}, ValueError, "host_budget_mb must be a finite number >= 0"),
        ({"spill_dir": ".", "host_budget_mb": 0}, ValueError, "holds not even the 3 bounce buffers"),
    ],
)
def test_bad_disk_options_say_what_to_do(options: dict[str, Any], error: type[Exception], match: str) -> None:
    inner = torch.optim.AdamW(make_params(SHAPES), lr=1e-2)
    with pytest.raises(error, match=match):
        ChunkedOffloadOptimizer(inner, chunk_size_mb=0.002, **options)
    assert not inner.state


def test_auto_host_budget_is_what_is_available_less_a_headroom_shared_by_the_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gib = 2**30
    monkeypatch.setattr(spill_module, "meminfo", lambda: {"MemTotal": 100 * gib, "MemAvailable": 70 * gib})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert spill_module.auto_host_budget() == 60 * gib  # the headroom: 10% of the total
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert spill_module.auto_host_budget() == 15 * gib


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("source", ["disk", "host", "plain"])
@pytest.mark.parametrize("target", ["disk", "host", "plain"])
def test_checkpoints_move_between_disk_tier_host_only_and_plain(tmp_path: Path, source: str, target: str) -> None:
    def make(kind: str, where: Path) -> tuple[list[torch.nn.Parameter], Any]:
        params = make_params(SHAPES)
        inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if kind == "plain":
            return params, inner
        options: dict[str, Any] = {"chunk_size_mb": 0.002}
        if kind == "disk":
            where.mkdir()
            probe = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(SHAPES)), **options)
            options.update(spill_dir=where, host_budget_mb=budget_for(probe.plan, 0.5))
        return params, ChunkedOffloadOptimizer(inner, **options)

    ref_params, ref = make("plain", tmp_path / "ref")
    run_steps(ref, ref_params, 5)
    params, opt = make(source, tmp_path / "source")
    run_steps(opt, params, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded_params, loaded = make(target, tmp_path / "target")
    with torch.no_grad():
        for a, b in zip(loaded_params, params, strict=True):
            a.copy_(b)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    run_steps(loaded, loaded_params, 2, first_step=3)
    for i, (a, b) in enumerate(zip(ref_params, loaded_params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, loaded, loaded_params)


# ------------------------------------------------------------------------------------------------ host memory
def _mapped_rss(t: torch.Tensor) -> int:
    """Bytes of the mapping under ``t`` that this process holds in RAM (its ``Rss`` in /proc/self/smaps)."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="/proc/self/smaps: Linux")
def test_the_files_pages_leave_memory_once_placed_and_stepped(tmp_path: Path) -> None:
    """Seeding masters writes through the maps one chunk at a time, and each is flushed and dropped; steps read and
    write the files, not the maps: between steps no map holds its pages in RAM ([Note: Disk tier])."""
    params = make_params([(256, 256)] * 6, torch.bfloat16)
    options: dict[str, Any] = dict(chunk_size_mb=0.5, master_weights="fp32")
    probe = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params([(256, 256)] * 6, torch.bfloat16)), **options)
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(params, lr=1e-3), **options, spill_dir=tmp_path, host_budget_mb=budget_for(probe.plan, 0.7)
    )
    store = internals(opt).placement.layout.stores[Home.DISK]
    on_disk = opt.plan.disk_chunks
    assert on_disk and all(c.transfer_nbytes >= 4 * mmap.PAGESIZE for c in on_disk)

    def resident() -> int:
        return sum(_mapped_rss(internals(opt).placement.layout.stores[Home.DISK].homes_of(c.index)) for c in on_disk)

    assert resident() == 0  # the seeded masters are on the disk, not in memory
    run_steps(opt, params, 2)
    assert resident() == 0
    assert store is internals(opt).placement.layout.stores[Home.DISK]
    state = opt.state_dict()["state"]
    assert sum(float(t.float().abs().sum()) for e in state.values() for t in e.values() if t.dim()) > 0
    assert resident() > 0  # a reader maps the pages it reads, as with any file map; the test can see them


def test_spill_dir_alone_budgets_what_the_host_has_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without host_budget_mb the budget is "auto": a host with little available memory spills, bitwise."""
    gib, kib = 2**30, 2**10
    monkeypatch.setattr(spill_module, "meminfo", lambda: {"MemTotal": 16 * gib, "MemAvailable": 4 * gib + 24 * kib})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    plain = build("plain", "none")
    train(*plain, range(3))
    model, opt = build("sync", "none", spill_dir=tmp_path)
    assert opt.plan.disk_chunks and opt.plan.host_nbytes + 3 * opt.plan.bounce_nbytes <= 24 * kib
    train(model, opt, range(3))
    assert_same(plain[0], model)


def test_a_filesystem_that_is_not_a_local_disk_is_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chunked_offload import ChunkedOffloadWarning

    monkeypatch.setattr(spill_module, "filesystem_of", lambda path: "tmpfs")
    with pytest.warns(ChunkedOffloadWarning, match="is on a tmpfs filesystem: a disk tier there") as caught:
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(SHAPES)), spill_dir=tmp_path, host_budget_mb=1)
    assert [w.filename for w in caught] == [__file__]  # the caller's line


def test_an_in_place_state_write_after_prefetch_is_staged_again_from_disk(tmp_path: Path) -> None:
    """prefetch() has read the chunks' files; a write into their state in place afterwards reaches the step."""

    def write_after_prefetch(i: int, model: torch.nn.Module, opt: Any) -> None:
        if i >= 2:
            if hasattr(opt, "prefetch"):
                opt.prefetch()
            for p in list(model.parameters())[:3]:
                opt.state[p]["exp_avg"].mul_(0.5)
                opt.state[p]["exp_avg_sq"].add_(1.0)

    plain = build("plain")
    train(*plain, range(4), after_backward=write_after_prefetch)
    model, opt = build("sync", spill_dir=tmp_path, host_budget_mb=budget_for(build("sync")[1].plan, 0.9))
    train(model, opt, range(4), after_backward=write_after_prefetch)
    assert opt.plan.disk_nbytes > 0
    assert_same(plain[0], model)


def test_a_read_interrupted_by_ctrl_c_is_waited_for_before_its_bounce_is_used_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A SIGINT while step() waits on a slow read: the read still lands in its bounce after the step has raised. The
    bounce is given to no other read until it has (a late read landing in a reused bounce was persisted as the
    chunk's state), and the retried step is bitwise."""
    import signal
    import threading
    import time

    opt, params, twin, twin_params = _pair("adamw", tmp_path)
    run_steps(twin, twin_params, 2)
    run_steps(opt, params, 2)
    original = disk_module.read_file_into
    log: list[tuple[bool, int, float, float]] = []  # (stalled, bounce address, start, end) of each read
    stall = {"armed": True}

    def slow_read(path: Path, out: torch.Tensor, progress: Any = None) -> None:
        start, stalled = time.monotonic(), stall.pop("armed", False)
        if stalled:  # the first read: stalled, and Ctrl-C 0.3 s into the stall
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            time.sleep(1.0)
        original(path, out, progress)
        log.append((stalled, out.data_ptr(), start, time.monotonic()))

    monkeypatch.setattr(disk_module, "read_file_into", slow_read)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        set_grads(params, make_grads(params, 2))
        with pytest.raises(KeyboardInterrupt):
            opt.step()
    finally:
        signal.signal(signal.SIGINT, previous)
    run_steps(opt, params, 3, first_step=2)
    run_steps(twin, twin_params, 3, first_step=2)
    deadline = time.monotonic() + 10
    while not any(entry[0] for entry in log) and time.monotonic() < deadline:
        time.sleep(0.05)  # without the wait for it, the stalled read is still running here
    (_, address, began, ended) = next(entry for entry in log if entry[0])
    later = [start for _, at, start, _ in log if at == address and start > began]
    assert later, "the stalled read's bounce was not used again"
    assert all(start >= ended for start in later), "a read reused the bounce before the stalled one had ended"
    for p, q in zip(params, twin_params, strict=True):
        assert_equal(p, q)
    assert_states_equal(twin, twin_params, opt, params)


def test_an_empty_spill_dir_is_refused() -> None:
    with pytest.raises(ValueError, match="spill_dir='' names no directory"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(SHAPES)), spill_dir="")


def test_a_relative_spill_dir_stays_where_it_was_after_a_chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "spill").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    plain = build("plain")
    train(*plain, range(3))
    model, opt = build("sync", spill_dir="spill", host_budget_mb=budget_for(build("sync")[1].plan, 0.9))
    train(model, opt, range(1))
    monkeypatch.chdir(tmp_path / "elsewhere")
    train(model, opt, range(1, 3))
    assert_same(plain[0], model)
    assert spill_files(tmp_path / "spill") and not list((tmp_path / "elsewhere").iterdir())


def test_the_minimum_host_budget_in_the_refusal_is_enough_when_passed_back(tmp_path: Path) -> None:
    import re

    with pytest.raises(ValueError, match="raise host_budget_mb to at least") as refused:
        train(*build("sync", spill_dir=tmp_path, host_budget_mb=0.0001), range(1))
    found = re.search(r"at least ([0-9.]+)", str(refused.value))
    assert found is not None
    model, opt = build("sync", spill_dir=tmp_path, host_budget_mb=float(found.group(1)))
    train(model, opt, range(2))
    assert opt.plan.disk_chunks


def test_a_forked_child_that_exits_leaves_the_parents_spill_files(tmp_path: Path) -> None:
    import weakref

    model, opt = build("sync", spill_dir=tmp_path, host_budget_mb=budget_for(build("sync")[1].plan, 0.9))
    train(model, opt, range(2))
    directory = internals(opt).placement.require().stores[Home.DISK].directory
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the wrapper and runs the finalizers a normal exit runs at atexit
        try:
            del opt
            gc.collect()
            weakref.finalize._exitfunc()  # type: ignore[attr-defined]  (not the test runner's own atexit handlers)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert directory.is_dir() and spill_files(tmp_path), "the child removed the parent's spill directory"
    train(model, opt, range(2, 3))


def _tier_dir_of(tmp_path: Path, name: str, pid: int, host: str | None = None, boot: str | None = None) -> Path:
    import json
    import socket

    from chunked_offload import tier_dirs

    directory = tmp_path / f"{tier_dirs.PREFIX}{name}"
    directory.mkdir()
    (directory / "chunk00000.bin").write_bytes(b"\x01" * 4096)
    mark = {"host": host or socket.gethostname(), "boot": tier_dirs.boot_id() if boot is None else boot, "pid": pid}
    mark["started"] = tier_dirs.start_time(pid) or "1"  # a dead pid: the start time it had while it ran
    (directory / tier_dirs.OWNER).write_text(json.dumps(mark))
    return directory


def test_a_killed_runs_tier_directory_is_reclaimed_and_the_others_are_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run killed with SIGKILL left its directory; a run on the same spill_dir removes it (and logs it), never one
    of a live process, of another host, or without an owner mark."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = _tier_dir_of(tmp_path, "killed", int(dead.stdout))
    rebooted = _tier_dir_of(tmp_path, "rebooted", os.getpid(), boot="an-earlier-boot")
    live = _tier_dir_of(tmp_path, "live", os.getpid())
    remote = _tier_dir_of(tmp_path, "remote", int(dead.stdout), host="another-host")
    unmarked = tmp_path / "chunked_offload-unmarked"
    unmarked.mkdir()
    with caplog.at_level("WARNING", logger="chunked_offload.tier_dirs"):
        model, opt = build("sync", spill_dir=tmp_path, host_budget_mb=budget_for(build("sync")[1].plan, 0.9))
    assert not killed.exists() and not rebooted.exists()
    assert live.exists() and remote.exists() and unmarked.exists()
    assert sum("no longer runs" in r.getMessage() for r in caplog.records) == 2
    train(model, opt, range(2))


def test_a_full_disk_names_the_tier_directories_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tier_dir_of(tmp_path, "live", os.getpid())
    real = spill_module.shutil.disk_usage

    def small(path: Any) -> Any:
        usage = real(path)
        return type(usage)(usage.total, usage.used, 1000)

    monkeypatch.setattr(spill_module.shutil, "disk_usage", small)
    _refused(
        tmp_path, tmp_path, "1 tier directories there hold 0.0 MiB \\(chunked_offload-live\\)", host_budget_mb=0.015
    )
