"""The disk tier on the GPU ([Note: Disk tier]): page-locked bounces, copies on the streams, every chunk's step
slowed so that a write of a file that does not wait for its write-back would read stale bytes; bitwise equal to
the plain loop in every mode, with the masters too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_loops_cuda import _Mlp

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, slowed_chunk_steps

pytestmark = pytest.mark.cuda


def _train(mode: str, master: str, spill_dir: Path | None) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = _Mlp().to("cuda", torch.bfloat16 if master != "none" else torch.float32)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt: Any = inner
    if mode != "plain" or master != "none":
        disk: dict[str, Any] = {} if spill_dir is None else {"spill_dir": spill_dir, "host_budget_mb": 64}
        opt = ChunkedOffloadOptimizer(
            inner, chunk_size_mb=4, master_weights=master, overlap=mode == "overlap",
            step_in_backward=mode == "backward", **disk,
        )  # fmt: skip
        if mode != "sync":
            opt.attach(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with slowed_chunk_steps():
        for _ in range(4):
            x = torch.randn(64, 1024, device="cuda", generator=gen).to(next(model.parameters()).dtype)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    if mode != "plain":
        opt.wait_step()  # an overlapped step's last chunks run at the next forward, or here
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("master", ["none", "fp32", "remainder"])
@pytest.mark.parametrize("mode", ["sync", "overlap", "backward"])
def test_the_disk_tier_is_bitwise_on_the_gpu(tmp_path: Path, mode: str, master: str) -> None:
    reference, _ = _train("plain" if master == "none" else "sync", master, None)
    got, opt = _train(mode, master, tmp_path)
    assert opt.plan.disk_chunks and opt.plan.host_nbytes, opt.plan.summary()  # some chunks on each tier
    stats = opt.stats
    assert stats.disk_read_bytes == stats.disk_written_bytes == opt.plan.disk_nbytes
    for i, (a, b) in enumerate(zip(reference, got, strict=True)):
        assert_equal(a, b, f"param {i}")
