"""overlap=True under FSDP2 on one GPU (NCCL, one rank), each chunk's step slowed so that a read of a deferred chunk's
params that does not wait overtakes its update ([Note: FSDP2 reads deferred params]): bitwise against the plain
loop, with deterministic kernels and the plain loop run twice as the control. The CPU tier runs the same cases with
the step stream emulated (tests/test_fsdp_overlap.py); this one has FSDP2's own streams and real timing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import fsdp_cases
from fsdp_cases import CASES, Case
from reference import slowed_chunk_steps

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic")]
DIMS = (4096, 512, 4)  # vocab, width, blocks: the output projection and the embedding are 8 MiB each
CHUNK_MB = 4.0
STEPS = 5


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    with fsdp_cases.world_of_one(torch.device("cuda", torch.cuda.current_device())):
        yield


def _plain(case: Case, device: torch.device) -> tuple[fsdp_cases.Net, torch.Tensor]:
    model = fsdp_cases.build(case, device, DIMS)
    return model, fsdp_cases.train(model, fsdp_cases.reference(case, model, device), STEPS, device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fsdp2_overlap_raced_by_the_forward_matches_the_plain_loop(case: Case) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    plain = _plain(case, device)
    fsdp_cases.assert_same_run(plain, _plain(case, device))  # the control: the plain loop equals itself
    model = fsdp_cases.build(case, device, DIMS)
    opt = fsdp_cases.wrapped(case, model, device, CHUNK_MB)
    with slowed_chunk_steps():
        losses = fsdp_cases.train(model, opt, STEPS, device)
        opt.wait_step()
    assert opt.stats is not None and opt.stats.chunks > 4
    fsdp_cases.assert_same_run(plain, (model, losses))


def test_overlap_refuses_to_attach_an_fsdp1_model() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from chunked_offload import ChunkedOffloadOptimizer

    model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda())
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap=True)
    with pytest.raises(ValueError, match=r"FSDP1 \(FullyShardedDataParallel\) with overlap=True"):
        opt.attach(model)
