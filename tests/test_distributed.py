"""Distributed: FSDP2 (DTensor params) and DDP with the wrapper, two processes on the CPU (gloo), and DCP.

tests/cuda/test_distributed_cuda.py runs FSDP2 with NCCL on one GPU.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import dist_cases
import fsdp_cases

WORLD = 2
_TEARDOWN_S = 30.0  # after every rank reported
_HUNG_S = 600.0

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Any, *args: Any, world: int = WORLD) -> dict[int, Any]:
    """Run ``fn`` in ``world`` ranks; each reports into the returned dict before it tears its process group down.

    gloo's teardown can deadlock in torch: the process group's destructor joins its worker thread while holding
    the GIL, and that thread waits for the GIL to release the last work it ran. A rank that has reported and is
    still alive ``_TEARDOWN_S`` later is stuck there and is killed; a rank that has not reported by ``_HUNG_S``
    fails the test.
    """
    with mp.Manager() as manager:
        result = manager.dict()
        ctx = mp.start_processes(
            fn, args=(world, _free_port(), "gloo", *args, result), nprocs=world, join=False, start_method="spawn"
        )
        start, reported = time.monotonic(), None
        while not ctx.join(timeout=1.0):
            now = time.monotonic()
            if reported is None and len(result) == world:
                reported = now
            stuck = reported is not None and now - reported > _TEARDOWN_S
            if stuck or now - start > _HUNG_S:
                for process in ctx.processes:
                    process.kill()
                    process.join()
                if not stuck:
                    pytest.fail(f"{fn.__name__}: ranks {sorted(set(range(world)) - set(result))} hung")
                break
        return dict(result)


@pytest.mark.parametrize("inner", ["adamw-foreach", "adamw-fused", "sgd-momentum"])
def test_fsdp2_matches_unwrapped_and_every_rank_has_the_same_plan(inner: str) -> None:
    result = _spawn(dist_cases.fsdp2_parity, inner)
    (chunks0, shapes0), (chunks1, shapes1) = result[0], result[1]
    assert chunks0 == chunks1 and chunks0 > 2
    assert shapes0 != shapes1  # uneven shards: the ranks hold different bytes, and still plan the same chunks


@pytest.mark.parametrize("inner", ["adamw-foreach", "sgd-momentum"])
def test_ddp_matches_unwrapped(inner: str) -> None:
    assert _spawn(dist_cases.ddp_parity, inner) == {0: True, 1: True}


def test_fsdp2_dcp_checkpoints_round_trip_with_plain_and_wrapped(tmp_path: Path) -> None:
    assert _spawn(dist_cases.fsdp2_dcp_roundtrip, str(tmp_path)) == {0: True, 1: True}


def test_fsdp2_refuses_sharded_muon() -> None:
    messages = _spawn(dist_cases.fsdp2_refusals)[0]
    assert len(messages) == 1
    assert "updates whole matrices" in messages[0] and "sharded across ranks" in messages[0]


@pytest.mark.parametrize(
    "mode, gating", [("fp32", "none"), ("remainder", "none"), ("fp32", "overlap"), ("fp32", "backward")]
)
def test_fsdp2_bf16_params_with_offloaded_masters_match_a_resident_master_loop(mode: str, gating: str) -> None:
    result = _spawn(dist_cases.fsdp2_masters, mode, gating)
    assert result[0] != result[1]  # uneven shards: each rank keeps the masters of its own shards


def test_fsdp2_dcp_round_trip_keeps_the_offloaded_masters(tmp_path: Path) -> None:
    assert _spawn(dist_cases.fsdp2_masters_dcp, str(tmp_path)) == {0: True, 1: True}


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_every_clipping_variant_is_bitwise_or_refused(world: int) -> None:
    """Sync and overlap with each clipping variant equal the plain loop; step_in_backward refuses it (issue 32)."""
    result = _spawn(dist_cases.fsdp2_clipping, world=world)
    for rank in range(world):
        outcome = result[rank]
        assert len(outcome) == 4 * len(dist_cases.CLIPS)
        for clip in dist_cases.CLIPS:
            assert outcome[f"{clip}/sync"] == outcome[f"{clip}/overlap"] == "bitwise"
            assert outcome[f"{clip}/backward"] == "refused before any update"
            assert outcome[f"{clip}/backward/late"] == "refused at step()"


def test_ddp_with_step_in_backward_is_refused_before_any_update() -> None:
    result = _spawn(dist_cases.ddp_in_backward)
    for messages in result.values():
        assert "DistributedDataParallel model with step_in_backward=True" in messages[0]
        assert "Nothing was updated" in messages[1]


def test_fsdp2_overlap_on_two_ranks_matches_the_plain_loop_in_every_case() -> None:
    """tests/test_fsdp_overlap.py's cases at world size 2, the step stream emulated (the ranks inherit it)."""
    assert _spawn(fsdp_cases.overlap_cases_on_ranks) == {0: True, 1: True}
