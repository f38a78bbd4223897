"""The memory planner (``plan_memory``, ``python -m chunked_offload plan``) gives what the wrapper then allocates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.memory import plan_memory
from reference import internals


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(96, 96) for _ in range(6)] + [torch.nn.Linear(96, 10)]
    return torch.nn.Sequential(*layers).to(dtype)


CONFIGS: dict[str, dict[str, Any]] = {
    "fp32-all-on-host": dict(dtype=torch.float32, chunk_size_mb=0.1),
    "bf16-fp32-masters-half-resident": dict(dtype=torch.bfloat16, master_weights="fp32", gpu_budget_mb=0.6),
    "bf16-remainder-on-disk": dict(dtype=torch.bfloat16, master_weights="remainder", host_budget_mb=0.4),
}


def _within(planned: int, allocated: int, what: str) -> None:
    assert abs(planned - allocated) <= 0.05 * max(allocated, 1), f"{what}: planned {planned}, allocated {allocated}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_plan_is_within_5_percent_of_what_the_wrapper_allocates(tmp_path: Path, name: str) -> None:
    config = dict(CONFIGS[name])
    dtype = config.pop("dtype")
    chunk = config.pop("chunk_size_mb", 0.05)
    spill = {"spill_dir": tmp_path} if "host_budget_mb" in config else {}
    model = _model(dtype)
    planned = plan_memory(model.to("meta"), chunk_size_mb=chunk, **config, **spill)
    model = _model(dtype)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=chunk, **config, **spill)
    for _ in range(2):
        model(torch.randn(4, 96, dtype=dtype)).float().square().mean().backward()
        opt.step()
    placement = internals(opt).placement
    layout = placement.require()
    host = layout.host.nbytes + sum(getattr(s, "bounce_nbytes", 0) for s in layout.stores.values())  # pinned on a GPU
    _within(planned.pinned_host, host, "host arena and bounces")
    flat = layout.resident.flat
    _within(planned.resident_gpu, 0 if flat is None else flat.numel(), "resident")  # on the GPU on a GPU host
    files = sum(f.stat().st_size for f in tmp_path.rglob("*.bin"))
    largest = max((c.transfer_nbytes for c in opt.plan.disk_chunks), default=0)
    _within(planned.disk, files + (largest if files else 0), "disk, with one more generation")
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    _within(planned.model_gpu, sum(p.numel() * p.element_size() for p in model.parameters()) + grads, "model")
    slots = sum(s.buffer.numel() for s in internals(opt).pool.slots if s.buffer is not None)
    assert slots <= planned.window_gpu
    assert (planned.resident_gpu > 0) == ("gpu_budget_mb" in config)
    assert (planned.disk > 0) == bool(spill)


def test_a_param_count_plans_square_matrices_and_the_command_reports_it() -> None:
    memory = plan_memory(10 * 64 * 64 + 7, width=64, master_weights="fp32", chunk_size_mb=0.05)
    assert memory.params == 10 * 64 * 64 + 7
    assert memory.pinned_host == memory.plan.host_nbytes >= 12 * memory.params  # AdamW moments and fp32 masters
    overlapped = plan_memory(10 * 64 * 64 + 7, width=64, master_weights="fp32", chunk_size_mb=0.05, mode="overlap")
    assert overlapped.grad_copies_gpu == 2 * memory.params  # bf16 grads of every offloaded param
    assert overlapped.gpu == memory.gpu + overlapped.grad_copies_gpu
    out = subprocess.run(
        [sys.executable, "-m", "chunked_offload", "plan", "--params", "7e9", "--master-weights", "fp32"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "7 B params" in out and "pinned host: needs 78.2" in out, out


def test_bad_input_is_refused_with_what_was_given() -> None:
    with pytest.raises(ValueError, match="optimizer='lamb' is not one of"):
        plan_memory(1000, optimizer="lamb")
    with pytest.raises(ValueError, match="mode='fast' is not one of"):
        plan_memory(1000, mode="fast")
    with pytest.raises(ValueError, match="takes a model or a positive param count, got -3"):
        plan_memory(-3)
    with pytest.raises(ValueError, match="gpu_budget_mb=0.00 is below the staging window"):
        plan_memory(64 * 64 * 4, width=64, gpu_budget_mb=0.001, chunk_size_mb=0.01)


def test_a_batch_on_the_meta_device_measures_the_activations_a_forward_saves() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    batch = [torch.empty(32, 256, device="meta")]
    memory = plan_memory(model, inputs=batch, chunk_size_mb=1)
    assert memory.activations_gpu == 4 * 32 * (256 + 2 * 1024)  # the input, the first output, the GELU's output
    assert memory.gpu == plan_memory(model, chunk_size_mb=1).gpu + memory.activations_gpu
    real = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="build it on the meta device"):
        plan_memory(real, inputs=[torch.empty(2, 4, device="meta")])
    assert real.weight.device.type == "cpu"  # left as it was
