"""torch.compile and activation checkpointing: every mode is bitwise the same compiled (or checkpointed) plain loop.

The forward hooks of ``attach()`` and the wrapper's ``step()`` are opaque to dynamo ([Note: Opaque to dynamo]):
traced, they were specialised to what they did at trace time (a compiled forward skipped their waits, or ran a
deferred chunk's inner step as a graph of other arithmetic).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal

_KIB = 1 / 1024  # MiB
MODES = ["overlap", "backward"]
CHECKPOINTING = ["none", "reentrant", "non-reentrant"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(24, 24)
        self.act = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class _Net(torch.nn.Module):
    """Blocks and a head; with checkpointing every param, the head's too, is inside a checkpointed segment, so the
    first grads of a backward arrive inside a nested (reentrant) backward."""

    def __init__(self, checkpointing: str) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.head = torch.nn.Linear(24, 8)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in [*self.blocks, self.head]:
            if self.checkpointing == "none":
                x = module(x)
            else:
                x = checkpoint(module, x, use_reentrant=self.checkpointing == "reentrant")
        return x


def _train(mode: str, compiled: bool, checkpointing: str, steps: int = 4, blocks: bool = False) -> list[torch.Tensor]:
    """bf16 params, fp32 masters in the wrapper, AdamW; the synchronous wrapper is the reference ("sync")."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(checkpointing).to(torch.bfloat16)
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_size_mb=4 * _KIB,
        master_weights="fp32",
        overlap=mode == "overlap",
        step_in_backward=mode == "backward",
    )
    if mode != "sync":
        opt.attach(model, blocks=blocks)
    forward: Any = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 24, generator=gen).to(torch.bfloat16).requires_grad_(checkpointing == "reentrant")
        forward(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.wait_step()
    return [p.detach().clone() for p in model.parameters()]


@functools.cache
def _reference(compiled: bool, checkpointing: str) -> tuple[torch.Tensor, ...]:
    return tuple(_train("sync", compiled, checkpointing))


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_matches_the_same_synchronous_loop(mode: str, compiled: bool, checkpointing: str) -> None:
    got = _train(mode, compiled, checkpointing)
    for i, (a, b) in enumerate(zip(_reference(compiled, checkpointing), got, strict=True)):
        assert_equal(a, b, f"param {i}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", MODES)
def test_gating_whole_blocks_matches_the_same_synchronous_loop(mode: str, compiled: bool) -> None:
    got = _train(mode, compiled, "none", blocks=True)
    for i, (a, b) in enumerate(zip(_reference(compiled, "none"), got, strict=True)):
        assert_equal(a, b, f"param {i}")


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(24, 48), torch.nn.Linear(48, 24)
        self.norm = torch.nn.LayerNorm(24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 24)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))
        self.head = torch.nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_gating_whole_blocks_breaks_the_graph_once_per_block() -> None:
    torch._dynamo.reset()
    model = _Stack()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=4 * _KIB, overlap=True)
    per_module = opt.attach(model)
    assert len(per_module) == 2 + 3 * 3
    per_module.remove()
    handle = opt.attach(model, blocks=True)
    assert len(handle) == 2 + 3  # embed, the three layers, head
    x = torch.randn(3, 8)
    model(x).sum().backward()
    opt.step()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count <= len(handle), explained.break_reasons
    waited: list[list[int]] = []
    original = opt._gate.wait_params
    opt._gate.wait_params = lambda indices, streams=(): (waited.append(list(indices)), original(indices))[1]  # type: ignore
    model(x)
    assert [len(w) for w in waited] == [2, 6, 6, 6, 2]  # a layer waits for its six params at once
    assert sorted(i for w in waited for i in w) == list(range(len(opt.plan.bundles)))
    with pytest.raises(TypeError, match="blocks must be True or False"):
        opt.attach(model, blocks="yes")  # type: ignore[arg-type]


def test_the_forward_hooks_add_at_most_one_graph_break_per_attached_module_and_all_run() -> None:
    torch._dynamo.reset()
    model = _Net("none")
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=4 * _KIB, overlap=True)
    handle = opt.attach(model)
    x = torch.randn(3, 24)
    model(x).sum().backward()
    opt.step()  # a deferring step: the compiled forward's hooks enqueue its chunks
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count <= len(handle) == 5, explained.break_reasons
    waited: list[list[int]] = []
    original = opt._gate.wait_params
    opt._gate.wait_params = lambda indices, streams=(): (waited.append(list(indices)), original(indices))[1]  # type: ignore
    torch.compile(model)(x)
    assert sorted(i for w in waited for i in w) == list(range(len(opt.plan.bundles)))  # every hook ran, at run time


def test_compiling_the_wrapped_step_runs_it_eagerly_and_bitwise() -> None:
    """The "compile the optimizer step" recipe: the wrapper's step is opaque, so it equals the eager plain step."""

    def run(wrap: bool, compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(33, 17), (101,), (7, 3)]]
        opt: Any = torch.optim.AdamW(params, lr=1e-2)
        if wrap:
            opt = ChunkedOffloadOptimizer(opt, chunk_size_mb=1 * _KIB)
        step = torch.compile(lambda: opt.step()) if compiled else opt.step
        for s in range(3):
            gen = torch.Generator().manual_seed(s)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            step()
            opt.zero_grad()
        return params

    eager = run(wrap=False, compiled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo notes the profiler ranges it skips
        wrapped = run(wrap=True, compiled=True)
    for i, (a, b) in enumerate(zip(eager, wrapped, strict=True)):
        assert_equal(a, b, f"param {i}")
