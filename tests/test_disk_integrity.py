"""The disk tier keeps a run's state as a checkpoint file would ([Note: Chunk integrity] in bounced.py): a file changed
outside the wrapper fails the step before that chunk's update, names the file and the chunk, and no state dict is
read from it afterwards; the wrapper's own writes never trip it. Also the tier's lifecycle: blocks reserved at
construction, open files bounded, re-plans and loads of its own checkpoint on a disk sized for one copy, and state
dict views of their own storage."""

from __future__ import annotations

import errno
import io
import os
import re
import resource
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import chunked_offload.disk as disk_module
import chunked_offload.disk_io as disk_io_module
import chunked_offload.spill as spill_module
from chunked_offload.bounced import ChunkIntegrityError
from chunked_offload.planner import Home
from reference import internals
from test_disk import budget_for, spill_files
from test_loops import assert_same, build, params_of, train


def disk_run(tmp_path: Path, mode: str = "sync", master: str = "none", share: float = 0.9) -> tuple[Any, Any]:
    model, opt = build(mode, master, spill_dir=tmp_path, host_budget_mb=budget_for(build(mode, master)[1].plan, share))
    assert opt.plan.disk_chunks, opt.plan.summary()
    return model, opt


def chunk_file(opt: Any, tmp_path: Path, position: int = 0) -> tuple[int, Path]:
    """The index and file of a disk chunk with state (``position`` among them)."""
    chunk = opt.plan.disk_chunks[position]
    path = next(p for p in spill_files(tmp_path) if p.name == f"chunk{chunk.index:05d}.bin")
    return chunk.index, path


def flip_a_byte(path: Path, offset: int = 0) -> None:
    """Another process writes the file: not through the wrapper's tensors."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("mode", ["sync", "overlap", "backward"])
def test_a_flipped_byte_fails_the_chunk_before_its_update_and_names_the_file(tmp_path: Path, mode: str) -> None:
    model, opt = disk_run(tmp_path, mode)
    train(model, opt, range(2))
    index, path = chunk_file(opt, tmp_path, position=-1)
    flip_a_byte(path, offset=5)
    before = [p.detach().clone() for p in params_of(model)]
    chunk = next(c for c in opt.plan.chunks if c.index == index)
    with pytest.raises(ChunkIntegrityError, match=rf"chunk {index} \({re.escape(str(path))}\)") as caught:
        train(model, opt, range(2, 3))
    assert "CRC-32" in str(caught.value) and "load a checkpoint into a new wrapper" in str(caught.value)
    for i in chunk.params:  # rolled back: its params are as they were
        assert torch.equal(params_of(model)[i], before[i])
    with pytest.raises(RuntimeError, match=f"the optimizer state cannot be read: .*chunk {index}"):
        opt.state_dict()
    with pytest.raises(ChunkIntegrityError):  # and the next step is refused before any update
        train(model, opt, range(3, 4))


@pytest.mark.parametrize("change", ["older copy", "truncated", "removed"])
def test_a_replaced_or_truncated_file_fails_the_step_before_any_update(tmp_path: Path, change: str) -> None:
    model, opt = disk_run(tmp_path)
    train(model, opt, range(1))
    index, path = chunk_file(opt, tmp_path, position=-1)
    older = path.read_bytes()
    train(model, opt, range(1, 2))
    if change == "older copy":
        copy = path.with_suffix(".old")
        copy.write_bytes(older)
        os.replace(copy, path)
    elif change == "truncated":
        os.truncate(path, 100)
    else:
        path.unlink()
    before = [p.detach().clone() for p in params_of(model)]
    with pytest.raises(ChunkIntegrityError, match=rf"chunk {index} \(.*\) (is another file|is gone)"):
        train(model, opt, range(2, 3))
    for p, b in zip(params_of(model), before, strict=True):
        assert torch.equal(p, b)  # before any update
    with pytest.raises(RuntimeError, match="the optimizer state cannot be read"):
        opt.state_dict()  # never a SIGBUS from a truncated map
    with pytest.raises(RuntimeError, match="the optimizer state cannot be read"):
        opt.load_state_dict(build("plain")[1].state_dict())


@pytest.mark.parametrize("write", ["opt.state", "state_dict view", "load_state_dict"])
def test_the_hosts_own_writes_into_the_state_are_the_state_not_a_corruption(tmp_path: Path, write: str) -> None:
    plain = build("plain")
    model, opt = disk_run(tmp_path)
    for m, o in (plain, (model, opt)):
        train(m, o, range(2))
        if write == "opt.state":
            for entry in o.state.values():
                entry["exp_avg"].mul_(0.5)
        elif write == "state_dict view":
            for entry in o.state_dict()["state"].values():
                entry["exp_avg_sq"].add_(1e-3)
        else:
            sd = o.state_dict()
            o.load_state_dict(
                {**sd, "state": {k: {**v, "exp_avg": v["exp_avg"] * 0.25} for k, v in sd["state"].items()}}
            )
        train(m, o, range(2, 4))
    assert_same(plain[0], model)


def test_a_reference_held_across_steps_reads_the_state_after_the_step(tmp_path: Path) -> None:
    """docs/state-dict.md: a tensor of opt.state held across a step of a chunk on disk is its state before the step
    (the step writes a new generation); one read again from opt.state is the current state."""
    plain = build("plain")
    model, opt = disk_run(tmp_path, share=1.0)
    train(*plain, range(2))
    train(model, opt, range(1))
    index = next(i for i, p in enumerate(model.parameters()) if "exp_avg" in opt.state[p])
    param = list(model.parameters())[index]
    held = opt.state[param]["exp_avg"]
    snapshot = held.clone()
    train(model, opt, range(1, 2))
    assert torch.equal(held, snapshot)
    assert torch.equal(opt.state[param]["exp_avg"], plain[1].state[list(plain[0].parameters())[index]]["exp_avg"])


def test_torch_save_of_the_state_dict_writes_the_state_and_nothing_else(tmp_path: Path) -> None:
    model, opt = disk_run(tmp_path, master="remainder", share=1.0)
    train(model, opt, range(2))
    sd = opt.state_dict()
    state = sum(t.numel() * t.element_size() for e in sd["state"].values() for t in e.values() if torch.is_tensor(t))
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    overhead = 48 * 1024  # pickled structure of a small model's state dict
    assert len(buffer.getvalue()) <= 1.01 * state + overhead, (len(buffer.getvalue()), state)


def test_a_replan_and_a_load_of_its_own_checkpoint_need_no_second_copy_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = build("plain")
    model, opt = disk_run(tmp_path)
    train(*plain, range(3))
    train(model, opt, range(2))
    sd = opt.state_dict()
    usage = shutil.disk_usage(tmp_path)
    short = type(usage)(usage.total, usage.used, opt.plan.bounce_nbytes // 2)
    # The disk now has room for what the tier holds and nothing more: a second copy would not fit.
    monkeypatch.setattr(spill_module.shutil, "disk_usage", lambda p: short)
    files = [p.stat().st_ino for p in spill_files(tmp_path)]
    opt.load_state_dict(sd)
    opt.replan()
    assert [p.stat().st_ino for p in spill_files(tmp_path)] == files  # the same files, not a second set
    train(model, opt, range(2, 3))
    assert_same(plain[0], model)


def test_the_files_blocks_are_reserved_when_they_are_made(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, 1 << 16)
        except OSError:
            pytest.skip("this filesystem does not reserve blocks (fallocate)")
    probe.unlink()
    _, opt = disk_run(tmp_path)
    for path in spill_files(tmp_path):
        st = path.stat()
        assert st.st_blocks * 512 >= st.st_size > 0, path  # not sparse: another wrapper sees the space taken


def test_a_full_disk_at_reservation_names_the_tier_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="another wrapper or rank took the space; free space there"):
        disk_run(tmp_path)
    assert not spill_files(tmp_path)  # nothing left behind


def test_open_files_are_bounded_and_the_error_names_rlimit_nofile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_module.resource, "getrlimit", lambda which: (8, 8))
    with pytest.raises(OSError, match=r"RLIMIT_NOFILE.*ulimit -n \d+.*raise chunk_size_mb"):
        disk_run(tmp_path)
    raised: list[tuple[int, int]] = []
    monkeypatch.setattr(disk_module.resource, "getrlimit", lambda which: (8, resource.RLIM_INFINITY))
    monkeypatch.setattr(disk_module.resource, "setrlimit", lambda which, limits: raised.append(limits))
    disk_run(tmp_path)  # the soft limit is raised as far as the hard one lets
    assert raised and raised[0][0] > 8


def test_a_store_behind_the_host_is_the_planners_disk_home(tmp_path: Path) -> None:
    _, opt = disk_run(tmp_path)
    stores = internals(opt).placement.layout.stores
    assert set(stores) == {Home.HOST, Home.DEVICE, Home.DISK}


def test_the_sum_of_a_read_in_pieces_is_the_sum_of_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each piece's sum runs beside the next piece's read: with pieces of 512 bytes, a step is still bitwise and a
    flipped byte in the last piece is still found."""
    monkeypatch.setattr(disk_io_module, "PIECE", 512)
    plain = build("plain")
    model, opt = disk_run(tmp_path, share=1.0)
    train(*plain, range(3))
    train(model, opt, range(3))
    assert_same(plain[0], model)
    index, path = chunk_file(opt, tmp_path, position=0)
    assert path.stat().st_size > 3 * 512, path.stat().st_size
    flip_a_byte(path, offset=path.stat().st_size - 1)
    with pytest.raises(ChunkIntegrityError, match=f"chunk {index}"):
        train(model, opt, range(3, 4))
