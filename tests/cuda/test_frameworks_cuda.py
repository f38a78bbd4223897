"""GPU memory of framework flows that move optimizer state to the GPU: Lightning resume, accelerate prepare().

Each uses 2.1 GB of AdamW state (268M fp32 params in 16 layers of 4096 x 4096). The peak extra GPU memory of the
flow must stay within the window bound plus the largest state tensor, and the results must be bitwise those of the
plain optimizer driven the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal

pytestmark = pytest.mark.cuda
MiB = 2**20
SLACK = 64 * MiB  # allocator rounding and small temporaries
WIDTH, DEPTH, CHUNK_MB = 4096, 16, 256


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)]).cuda()


def _inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)) for _ in range(n)]


def _limit(opt: Any) -> int:
    """The allowance: the window bound plus the largest state tensor, plus allocator slack."""
    return opt.plan.window_bound_nbytes + WIDTH * WIDTH * 4 + SLACK


def test_lightning_resume_keeps_state_off_the_gpu(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    peaks: dict[str, int] = {}

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self, seed: int, wrapped: bool) -> None:
            super().__init__()
            self.net, self.wrapped, self.opt = _model(seed), wrapped, None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            inner = _inner(self.net)
            self.opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=CHUNK_MB) if self.wrapped else inner
            return self.opt

        def on_train_start(self) -> None:  # after the checkpoint (and _optimizer_to_device) restored the state
            torch.cuda.synchronize()
            if "params" in peaks:  # only the resumed fit is measured
                peaks["restore"] = torch.cuda.max_memory_allocated() - peaks["params"]

    def fit(module: Any, steps: int, ckpt: Path | None = None) -> Any:
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, torch.utils.data.DataLoader(_batches(2), batch_size=None), ckpt_path=ckpt)
        return trainer

    finals = {}
    for wrapped in (False, True):
        first = Module(0, wrapped)
        fit(first, 2).save_checkpoint(tmp_path / f"{wrapped}.ckpt")
        del first
        torch.cuda.empty_cache()
        resumed = Module(1, wrapped)
        torch.cuda.synchronize()
        peaks["params"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fit(resumed, 4, tmp_path / f"{wrapped}.ckpt")
        if wrapped:
            assert peaks["restore"] <= _limit(resumed.opt), f"{peaks['restore'] / MiB:.0f} MiB during restore"
            assert resumed.opt.plan.host_nbytes >= 2 * 2**30
        finals[wrapped] = [p.detach().cpu() for p in resumed.parameters()]
        del resumed
        torch.cuda.empty_cache()
    for a, b in zip(finals[False], finals[True], strict=True):
        assert_equal(a, b)


def test_accelerate_prepare_of_an_optimizer_with_state_keeps_it_off_the_gpu() -> None:
    accelerate = pytest.importorskip("accelerate")
    finals = {}
    for wrapped in (False, True):
        model = _model(0)
        inner = _inner(model)
        opt: Any = ChunkedOffloadOptimizer(inner, chunk_size_mb=CHUNK_MB) if wrapped else inner
        batches = [(x.cuda(), y.cuda()) for x, y in _batches(4)]
        for x, y in batches[:2]:  # state exists before prepare()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        accelerator = accelerate.Accelerator()
        model, prepared = accelerator.prepare(model, opt)
        torch.cuda.synchronize()
        if wrapped:
            extra = torch.cuda.max_memory_allocated() - base
            assert extra <= _limit(opt), f"{extra / MiB:.0f} MiB during prepare()"
        for x, y in batches[2:]:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            prepared.step()
            prepared.zero_grad()
        finals[wrapped] = [p.detach().cpu() for p in model.parameters()]
        accelerate.state.AcceleratorState._reset_state(True)
        del model, prepared, opt, inner
        torch.cuda.empty_cache()
    for a, b in zip(finals[False], finals[True], strict=True):
        assert_equal(a, b)
