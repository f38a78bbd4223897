"""FSDP2 with NCCL on one GPU (world size 1): parity with the unwrapped optimizer, and the GPU window."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

import dist_cases
from test_distributed import _free_port

pytestmark = pytest.mark.cuda


@pytest.mark.timing
def test_fsdp2_on_one_gpu_matches_unwrapped_within_the_window() -> None:
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(dist_cases.fsdp2_gpu_window, args=(1, _free_port(), "nccl", result), nprocs=1, join=True)
        peak, bound = result[0]
    print(f"\nFSDP2 ws=1 step: peak {peak / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB")
    assert peak <= bound, f"peak {peak / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB"


@pytest.mark.parametrize("gating", ["none", "overlap", "backward"])
def test_fsdp2_bf16_params_with_offloaded_masters_on_one_gpu_match_a_resident_master_loop(gating: str) -> None:
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(dist_cases.fsdp2_gpu_masters, args=(1, _free_port(), "nccl", gating, result), nprocs=1, join=True)
        peaks = dict(result[0])
    mib = 2**20
    print(
        f"\nFSDP2 ws=1 bf16 + fp32 masters ({gating}): peak {peaks['wrapped'] / mib:.0f} MiB wrapped, "
        f"{peaks['resident'] / mib:.0f} MiB resident"
    )
    assert peaks["wrapped"] < peaks["resident"]
