"""Host arena: registration pieces that never split a chunk, and a preflight that fails before allocating."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.host_arena import HostArena, registration_pieces
from reference import ODD_SHAPES, assert_runs_match, internals, make_params


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 20_000))
def test_registration_pieces_cover_whole_chunks_within_the_limit(sizes: list[int], limit: int) -> None:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    pieces = registration_pieces(total, starts, limit)
    assert pieces[0][0] == 0 and pieces[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))  # they tile the arena
    chunk_starts = set(starts)
    for lo, hi in pieces:
        assert lo in chunk_starts  # a piece begins where a chunk begins: no chunk is split
        one_chunk = len([s for s in starts if lo <= s < hi]) == 1
        assert hi - lo <= limit or one_chunk  # only a chunk larger than the limit exceeds it


def test_many_pieces_keep_the_run_exact(monkeypatch: object) -> None:
    from chunked_offload import host_arena

    monkeypatch.setattr(host_arena, "MAX_REGISTER_BYTES", 10_000)  # type: ignore[attr-defined]
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=0.004)
    assert len(internals(opt).placement.layout.host.arena.pieces) > 2
    assert_runs_match(torch.optim.AdamW(ref_params, lr=1e-2), ref_params, opt, params, 5)


def test_arena_larger_than_the_locked_memory_limit_fails_before_allocating() -> None:
    code = textwrap.dedent(
        """
        import resource
        from chunked_offload import host_arena
        _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, hard))
        host_arena._can_lock_without_limit = lambda: False  # as an unprivileged process
        try:
            host_arena.HostArena(1 << 30, pin=True)
        except RuntimeError as exc:
            print(exc)
        print("registered", host_arena.registered_bytes())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "needs 1073741824 bytes (1.00 GiB) of page-locked memory but RLIMIT_MEMLOCK (ulimit -l) is 1048576" in out
    assert "ulimit -l unlimited" in out and "pin_memory=False" in out
    assert "registered 0" in out


def test_arena_larger_than_available_ram_fails_before_allocating() -> None:
    from chunked_offload.host_arena import available_host_bytes

    available = available_host_bytes()
    assert available is not None
    try:
        HostArena(available + 2**30, pin=False)
    except RuntimeError as exc:
        assert "of host RAM but only" in str(exc) and "MemAvailable" in str(exc)
    else:
        raise AssertionError("no error")
