"""[Note: Slots fit their chunks]: a step's slots take the size of the chunks they will hold, and a slot whose first
chunk is larger than the rest hands that memory back once it is done, bitwise with the plain loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.staging import StagingPool, fit_slots
from reference import assert_equal, internals


def test_uniform_chunks_take_slots_of_their_size_and_no_spare() -> None:
    assert fit_slots([5, 5, 5, 5], 2, window=20) == ([(5, 0), (5, 0)], {})


def test_a_larger_first_chunk_gives_its_slot_a_spare_that_the_slots_next_chunk_swaps_in() -> None:
    fitted, swaps = fit_slots([10, 4, 4, 4, 3], 2, window=20)
    assert fitted == [(10, 4), (4, 0)] and swaps == {2: 0}


def test_a_slot_keeps_the_size_of_a_larger_chunk_still_to_come() -> None:
    fitted, swaps = fit_slots([4, 4, 4, 4, 10], 2, window=20)
    assert fitted == [(10, 0), (4, 0)] and swaps == {}


def test_no_spare_where_it_would_not_fit_in_the_window() -> None:
    assert fit_slots([10, 9, 6, 6], 2, window=20) == ([(10, 0), (9, 0)], {})  # 10 + 6 + 9 > 20


def test_a_slot_without_chunks_takes_nothing() -> None:
    assert fit_slots([7], 2, window=14) == ([(7, 0), (0, 0)], {})


class _Net(torch.nn.Module):
    """An embedding larger than the rest, whose chunk steps first (Megatron's GPTModel in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h))
        return self.head(h)


def _loop(mode: str) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = _Net()
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mode != "plain":
        opt = ChunkedOffloadOptimizer(
            opt, chunk_size_mb=2 / 1024, overlap=mode == "overlap", step_in_backward=mode == "backward"
        )
        if mode != "sync":
            opt.attach(model)
    for i in range(4):
        x = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(i))
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    if mode in ("overlap", "backward"):
        opt.wait_step()  # the chunks deferred to a next forward
    return model, opt


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_step_hands_back_the_larger_slot_memory_and_stays_bitwise(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedding's chunk, the largest, steps first: its slot swaps in a spare for the layers after it."""
    shrunk: list[tuple[int, int]] = []
    real = StagingPool.shrink

    def recording(pool: StagingPool, slot: Any, stream: Any) -> None:
        before, spare = slot.buffer.numel(), slot.spare.numel()
        real(pool, slot, stream)
        assert slot.buffer.numel() == spare and slot.spare is None
        shrunk.append((before, spare))

    monkeypatch.setattr(StagingPool, "shrink", recording)
    plain, _ = _loop("plain")
    model, opt = _loop(mode)
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)
    plan = internals(opt).placement.layout.plan
    assert len(shrunk) == 6  # both slots, in every step but the first (which creates the state on the device)
    assert all(before > spare for before, spare in shrunk) and max(b for b, _ in shrunk) == plan.slot_nbytes
    assert opt.stats is not None and opt.stats.window_bytes < plan.num_slots * plan.slot_nbytes


def test_a_step_in_the_backward_keeps_its_slots_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its chunks step in the order the grads come, and its last write-backs stay in their slots: no spare."""
    shrunk: list[Any] = []
    monkeypatch.setattr(StagingPool, "shrink", lambda pool, slot, stream: shrunk.append(slot))
    plain, _ = _loop("plain")
    model, _ = _loop("backward")
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)
    assert shrunk == []
