"""overlap=True under FSDP2 (one rank, gloo), with the step stream emulated: every read of a deferred chunk's params
waits for its update, whichever FSDP2 hook, prefetch or unshard reads it ([Note: FSDP2 reads deferred params]).

Under the emulator ([Note: Emulated step stream]) a chunk's update shows only once a reader waits for it, so a read
that lacks its wait reads the old bytes and the run differs from the plain loop. What it cannot model: FSDP2's own
streams at world size > 1 (the copy-in and all-gather streams; at world size 1 FSDP2 copies on the caller's stream)
and timing. tests/cuda/test_fsdp_overlap_cuda.py runs the same cases on a GPU with each chunk's step slowed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import fsdp_cases
from fsdp_cases import CASES, Case

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

CPU = torch.device("cpu")
STEPS = 4
CHUNK_MB = 2 / 1024  # a few params a chunk: the output projection has a chunk of its own


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    with fsdp_cases.world_of_one(CPU):
        yield


def _plain(case: Case) -> tuple[fsdp_cases.Net, torch.Tensor]:
    model = fsdp_cases.build(case, CPU)
    return model, fsdp_cases.train(model, fsdp_cases.reference(case, model, CPU), STEPS, CPU)


def _overlapped(case: Case) -> tuple[fsdp_cases.Net, torch.Tensor]:
    model = fsdp_cases.build(case, CPU)
    opt = fsdp_cases.wrapped(case, model, CPU, CHUNK_MB)
    losses = fsdp_cases.train(model, opt, STEPS, CPU)
    opt.wait_step()
    return model, losses


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fsdp2_overlap_matches_the_plain_loop(case: Case) -> None:
    fsdp_cases.assert_same_run(_plain(case), _overlapped(case))


def test_the_emulator_catches_a_wait_removed_from_the_unshard_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: the unshard hooks still enqueue the deferred chunks but no longer wait for them. With the step stream
    emulated the all-gathers read the old params; without it the CPU runs every chunk when it is enqueued."""
    from chunked_offload.waits import StepWaits

    def enqueue_only(self: StepWaits, indices: list[int], streams: object = ()) -> None:
        self.runner.advance(indices)

    case = Case(prefetch=True)
    plain = _plain(case)
    monkeypatch.setattr(StepWaits, "wait_for", enqueue_only)
    monkeypatch.setenv("CHUNKED_OFFLOAD_EMULATE_STREAMS", "0")
    fsdp_cases.assert_same_run(plain, _overlapped(case))
    monkeypatch.setenv("CHUNKED_OFFLOAD_EMULATE_STREAMS", "1")
    with pytest.raises(AssertionError):
        fsdp_cases.assert_same_run(plain, _overlapped(case))
