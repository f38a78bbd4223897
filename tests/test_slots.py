"""[Note: Slots fit their chunks]: a step's slots take the size of the chunks they will hold, and a slot whose first
chunk is larger than the rest hands that memory back once it is done, bitwise with the plain loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.staging import StagingPool, fit_order, fit_slots
from reference import assert_equal, internals, recorded_shrinks


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


def test_chunks_larger_than_the_rest_step_early_in_the_first_ones_slot() -> None:
    """Megatron's GPTModel in read order: the embedding first, the output layer last (each a slot's 45)."""
    sizes = [45, 1, 1, 5, 3, 5, 3, 5, 3, 5, 3, 45]
    order = fit_order(sizes, 2, window=90)
    assert order == [0, 1, 11, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert fit_slots([sizes[p] for p in order], 2, window=90) == ([(45, 5), (3, 0)], {4: 0})
    assert fit_slots(sizes, 2, window=90) == ([(45, 0), (45, 0)], {})  # the read order: two large slots to the end


def test_fit_order_keeps_the_eager_chunks_and_moves_the_larger_ones_after_them() -> None:
    sizes = [2, 45, 1, 3, 3, 3, 45, 3]  # position 0 steps eagerly (resident); 1 and 6 are larger than the rest
    assert fit_order(sizes, 2, window=90, start=1) == [0, 1, 2, 6, 3, 4, 5, 7]


@pytest.mark.parametrize(
    "sizes, window",
    [
        ([5, 5, 5, 5], 10),  # none larger than the rest
        ([4, 4, 4, 10], 20),  # one: it keeps its place in the read order
        ([10, 4, 4, 10], 20),  # in one slot, no chunk is left after them for a spare
        ([10, 9, 9, 10, 9, 9], 20),  # all larger than SHRINK of the largest: nothing to fit
        ([10, 1, 6, 6, 6, 10], 20),  # in one slot they would leave no room for a spare (10 + 6 + 6 > 20)
    ],
)
def test_fit_order_keeps_the_read_order_where_it_gains_no_spare(sizes: list[int], window: int) -> None:
    assert fit_order(sizes, 2, window) == list(range(len(sizes)))


class _Net(torch.nn.Module):
    """An embedding larger than the rest, whose chunk steps first (Megatron's GPTModel in small); with ``head=64``,
    an output layer read last as large as the embedding."""

    def __init__(self, layers: int, head: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(layers))
        self.head = torch.nn.Linear(16, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h))
        return self.head(h)


def _loop(mode: str, layers: int = 4, head: int = 8, chunk_kb: float = 2) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = _Net(layers, head)
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mode != "plain":
        opt = ChunkedOffloadOptimizer(
            opt, chunk_size_mb=chunk_kb / 1024, overlap=mode == "overlap", step_in_backward=mode == "backward"
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


@pytest.mark.parametrize("fitted", [True, False])
def test_an_overlapped_step_puts_the_larger_chunks_at_both_ends_in_one_slot(
    fitted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In read order the output layer's chunk steps last, in the other slot than the embedding's: both slots stay
    large to the step's end. Stepped early in the embedding's slot, that slot swaps in a spare after it."""
    if not fitted:
        monkeypatch.setattr("chunked_offload.schedule.fit_order", lambda nbytes, *a, **k: list(range(len(nbytes))))
    plain, _ = _loop("plain", layers=5, head=64)
    with recorded_shrinks(lambda slot: slot.buffer.numel()) as shrunk:
        model, opt = _loop("overlap", layers=5, head=64, chunk_kb=4)
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)
    plan = internals(opt).placement.layout.plan
    larger = [n for n in shrunk if n == plan.slot_nbytes]  # the head's bias, last, lets the other slot shrink too
    assert larger == ([plan.slot_nbytes] * 3 if fitted else [])  # every step but the first, which makes the state
