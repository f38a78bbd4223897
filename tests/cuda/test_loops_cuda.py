"""The loops of tests/test_loops.py where a GPU can race: every chunk's step is slowed on its stream, so that a read
or write of the caller's that does not wait for it overtakes it (issue 32: cases 1, 2 and 7)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import dist_cases
from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, slowed_chunk_steps
from test_distributed import _free_port

pytestmark = pytest.mark.cuda


class _Mlp(torch.nn.Module):
    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def _each_grad(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.nn.Module], None]:
    def write(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    fn(p.grad)

    return write


WRITES: dict[str, Callable[[torch.nn.Module], None]] = {
    "model.zero_grad(set_to_none=False)": lambda m: m.zero_grad(set_to_none=False),
    "p.grad.zero_()": _each_grad(lambda g: g.zero_()),
    "p.grad.mul_(0.5)": _each_grad(lambda g: g.mul_(0.5)),
}


def _train(mode: str, master: str, write: Callable[[torch.nn.Module], None]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if master != "none" else torch.float32
    model = _Mlp().to("cuda", dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt: Any = inner
    if mode != "plain" or master != "none":
        opt = ChunkedOffloadOptimizer(
            inner, chunk_size_mb=4, master_weights=master, overlap=mode == "overlap",
            step_in_backward=mode == "backward",
        )  # fmt: skip
    if mode in ("overlap", "backward"):
        opt.attach(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(5):
        x = torch.randn(256, 1024, device="cuda", generator=gen, dtype=dtype)
        model(x).float().square().mean().backward()
        opt.step()
        write(model)  # right after step(): the slowed chunks have not read the grads yet
        opt.zero_grad()
    if isinstance(opt, ChunkedOffloadOptimizer):
        opt.wait_step()  # the last step's deferred chunks: params read outside a forward need it (docs/faults.md)
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["overlap", "backward"])
@pytest.mark.parametrize("master", ["none", "fp32"])
@pytest.mark.parametrize("write", list(WRITES))
def test_grads_written_in_place_after_an_overlapped_step_do_not_race_it(write: str, master: str, mode: str) -> None:
    """Case 1: the overlapped step owns copies of the grads it reads after step() returned ([Note: Inputs of a
    step]); in the backward, the comparison of the grads reads them before the caller's stream goes on ([Note:
    Checks off the host])."""
    reference = _train("plain", master, WRITES[write])
    with slowed_chunk_steps():
        got = _train(mode, master, WRITES[write])
    for i, (a, b) in enumerate(zip(reference, got, strict=True)):
        assert_equal(a, b, f"param {i}")


def test_fsdp2_clipping_on_one_gpu_is_bitwise_or_refused() -> None:
    """Case 2: torchtitan's clip (foreach, on DTensor grads) after a step in the backward is refused; sync and overlap
    with it are bitwise, with every chunk's step slowed."""
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(dist_cases.fsdp2_clipping, args=(1, _free_port(), "nccl", result, True), nprocs=1, join=True)
        outcome = dict(result[0])
    for clip in dist_cases.CLIPS:
        assert outcome[f"{clip}/sync"] == outcome[f"{clip}/overlap"] == "bitwise"
        assert outcome[f"{clip}/backward"] == "refused before any update"
        # [Note: Checks off the host]: with the chunks slowed the comparison is read after step() returned
        assert outcome[f"{clip}/backward/late"] in ("refused at step()", "refused before the next update")


def test_ddp_on_one_gpu_steps_in_the_backward_bitwise_and_refuses_attach() -> None:
    """Case 7: at world size 1 DDP's all-reduce changes no grad, so the content check lets the step in the backward
    through, bitwise; attach() of a DDP model is refused whatever the world size."""
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(dist_cases.ddp_in_backward_one_gpu, args=(1, _free_port(), "nccl", result), nprocs=1, join=True)
        message = result[0]
    assert "DistributedDataParallel model with step_in_backward=True" in message


def _train_on_a_grad_buffer(overlap: bool) -> list[torch.Tensor]:
    """Grads accumulated in place into one buffer, zeroed as each iteration starts (Megatron's loop); with
    ``overlap`` the zeroing goes through the attach handle, and the step reads the buffer in place."""
    torch.manual_seed(0)
    model = _Mlp().to("cuda")
    buffer = torch.zeros(sum(p.numel() for p in model.parameters()), device="cuda")
    start = 0
    for p in model.parameters():
        p.grad, start = buffer[start : start + p.numel()].view_as(p), start + p.numel()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt: Any = inner
    zero: Callable[[], Any] = buffer.zero_
    if overlap:
        opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=4, overlap=True)
        zero = opt.attach(model).zero_grads_with(buffer.zero_)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(5):
        zero()  # right after step(): the slowed chunks have not read the grads yet
        x = torch.randn(256, 1024, device="cuda", generator=gen)
        model(x).float().square().mean().backward()
        end = buffer.data_ptr() + buffer.nbytes  # the grads were accumulated in place
        assert all(buffer.data_ptr() <= p.grad.data_ptr() < end for p in model.parameters())
        opt.step()
    if overlap:
        opt.wait_step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()]


def test_grads_read_in_place_are_zeroed_only_after_the_overlapped_step_read_them() -> None:
    """[Note: Inputs of a step]: with ``AttachHandle.zero_grads_with`` the step keeps no copy of the grads; the zeroing
    of the buffer waits for the forward's end, after every chunk's step (each slowed by about 10 ms)."""
    reference = _train_on_a_grad_buffer(False)
    with slowed_chunk_steps():
        got = _train_on_a_grad_buffer(True)
    for i, (a, b) in enumerate(zip(reference, got, strict=True)):
        assert_equal(a, b, f"param {i}")
