"""[Note: Slots fit their chunks] on a GPU: the larger memory a slot hands back during a step is not reused while
the write-back that last read it still runs (every chunk's step slowed on its stream), bitwise with the plain loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, recorded_shrinks, slowed_chunk_steps

pytestmark = pytest.mark.cuda

VOCAB = 16384


class _Net(torch.nn.Module):
    """An embedding far larger than the layers after it, stepped first: Megatron's GPTModel in small; with ``head``
    also an output layer as large, read last."""

    def __init__(self, head: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 1024)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(12))
        self.head = torch.nn.Linear(1024, VOCAB, bias=False) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h))
        return h if self.head is None else self.head(h)


def _train(mode: str, head: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Net(head).cuda()
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if mode != "plain":
        opt = ChunkedOffloadOptimizer(opt, chunk_size_mb=24, overlap=mode == "overlap")
        if mode == "overlap":
            opt.attach(model)
    for i in range(4):
        x = torch.randint(0, VOCAB, (8, 512), generator=torch.Generator().manual_seed(i)).cuda()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    if mode == "overlap":
        opt.wait_step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["sync", "overlap"])
@pytest.mark.usefixtures("deterministic")
def test_slot_memory_handed_back_during_a_step_is_not_reused_under_its_write_back(mode: str) -> None:
    expected = _train("plain")
    for i, (a, b) in enumerate(zip(expected, _train("plain"), strict=True)):
        assert_equal(a, b, f"control: param {i}")
    with slowed_chunk_steps(), recorded_shrinks(lambda slot: slot.buffer.numel() - slot.spare.numel()) as shrunk:
        got = _train(mode)
    assert shrunk and all(n > 0 for n in shrunk)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert_equal(a, b, f"param {i}")


@pytest.mark.usefixtures("deterministic")
def test_an_overlapped_step_with_an_output_layer_as_large_as_the_embedding_shrinks_their_slot() -> None:
    """The output layer, read last, steps early in the embedding's slot (``fit_order``), which then swaps in its
    spare while the write-backs of both may still read the larger memory; bitwise with every chunk's step slowed."""
    expected = _train("plain", head=True)
    for i, (a, b) in enumerate(zip(expected, _train("plain", head=True), strict=True)):
        assert_equal(a, b, f"control: param {i}")
    with slowed_chunk_steps(), recorded_shrinks(lambda slot: slot.buffer.numel()) as shrunk:
        got = _train("overlap", head=True)
    assert len(shrunk) == 3 and len(set(shrunk)) == 1  # the same slot, in every step after the first
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert_equal(a, b, f"param {i}")
