"""Fault injection at every point of a step: a chunk commits whole or not at all, and the wrapper stays usable."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, Phase
from chunked_offload.pipeline import ChunkPipeline
from chunked_offload.staging import StagingPool
from chunked_offload.stepping import ChunkStepper
from chunked_offload.transfer import TransferEngine
from reference import (
    ODD_SHAPES,
    assert_equal,
    assert_states_equal,
    internals,
    make_grads,
    make_params,
    run_steps,
    set_grads,
)

SHAPES = [*ODD_SHAPES, (9, 8), (30,)]

CONFIGS: dict[str, dict[str, Any]] = {
    "adamw": {},
    "adamw-resident": {"offload_fraction": 0.5},
    "adamw-resident-masters": {"offload_fraction": 0.5, "master_weights": "fp32"},
    "adamw-resident-remainder": {"offload_fraction": 0.5, "master_weights": "remainder"},
    "adamw-fp32-masters": {"master_weights": "fp32"},
    "adamw-remainder": {"master_weights": "remainder"},
    "sgd-momentum": {},
    # Fused AdamW updates a resident chunk in one op: no copy of its homes ([Note: One-op updates]).
    "adamw-fused-resident": {"offload_fraction": 0.0},
    "adamw-fused-resident-masters": {"offload_fraction": 0.5, "master_weights": "fp32"},
}


def _inner(config: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if config.startswith("sgd"):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    if "fused" in config:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _dtype(config: str) -> torch.dtype:
    return torch.bfloat16 if "masters" in config or "remainder" in config else torch.float32


def _wrap(config: str, params: list[torch.nn.Parameter]) -> ChunkedOffloadOptimizer:
    return ChunkedOffloadOptimizer(_inner(config, params), chunk_size_mb=0.002, **CONFIGS[config])


class Injected(RuntimeError):
    pass


def _raiser(kind: str) -> Callable[[], None]:
    def fire() -> None:
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        raise Injected("injected")

    return fire


@contextmanager
def _fault(monkeypatch: pytest.MonkeyPatch, point: str, target: int) -> Iterator[None]:
    """Make the ``target``-th chunk of the next step fail at ``point``; every other call runs as usual."""
    calls = {"n": 0}

    def wrap(cls: Any, name: str, kind: str, after: bool = False, counted: bool = True) -> None:
        """Patch ``cls.name`` so that its ``target``-th call raises ``kind``, before running or ``after`` it."""
        original = getattr(cls, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            hit = calls["n"] == target
            if counted:
                calls["n"] += 1
            if hit and not after:
                _raiser(kind)()
            out = original(*args, **kwargs)
            if hit and after:
                _raiser(kind)()
            return out

        monkeypatch.setattr(cls, name, patched)

    if point == "inner-before":
        wrap(ChunkStepper, "inner_step", "error")
    elif point == "inner-after":
        wrap(ChunkStepper, "inner_step", "error", after=True)
    elif point == "inner-interrupt":
        wrap(ChunkStepper, "inner_step", "interrupt", after=True)
    elif point == "before-write-back":
        wrap(ChunkStepper, "rescan", "interrupt")
    elif point == "update-before":  # inside the inner's step, just before its update op
        wrap(torch, "_fused_adamw_", "interrupt")
    elif point == "update-after":  # inside the inner's step, right after its update op returned
        wrap(torch, "_fused_adamw_", "interrupt", after=True)
    elif point == "write-back":
        wrap(TransferEngine, "write_back", "interrupt")
    elif point == "h2d":
        wrap(ChunkPipeline, "stage", "oom")
    elif point == "fresh-alloc":
        wrap(ChunkPipeline, "step_fresh", "oom")
    elif point == "slots":

        def acquire(self: StagingPool, nbytes: int) -> None:
            self.slots[0].buffer = torch.empty(nbytes, dtype=torch.uint8)  # one slot allocated, then OOM
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        monkeypatch.setattr(StagingPool, "acquire", acquire)
    try:
        yield
    finally:
        monkeypatch.undo()


def _committed(exc: BaseException, n_chunks: int) -> int:
    """How many chunks (in step order) the exception's note says were committed."""
    note = "".join(getattr(exc, "__notes__", []))
    if "before any chunk was stepped" in note:
        return 0
    match = re.search(r"chunk (\d+) of the (\d+) with grads: the (\d+) before it were committed, it (was \w+)", note)
    match = match or re.search(  # a step in the backward: in the order its chunks ran
        r"chunk (\d+) of the (\d+) of the plan: the (\d+) stepped before it were committed, it (was \w+)", note
    )
    assert match, f"no commit note on {exc!r}: {note!r}"
    position, total, before, fate = int(match[1]) - 1, int(match[2]), int(match[3]), match[4]
    assert total == n_chunks and before == position
    return before + (1 if fate == "was committed" else 0)


POINTS = [
    "inner-before",
    "inner-after",
    "inner-interrupt",
    "update-before",
    "update-after",
    "before-write-back",
    "write-back",
    "h2d",
    "fresh-alloc",
    "slots",
]


def _skip_where_the_point_is_not_reached(config: str, point: str, step: str) -> None:
    if (point == "fresh-alloc") != (step == "first") and point in ("fresh-alloc", "h2d", "slots"):
        pytest.skip("fresh chunks allocate their own memory; staged chunks take slots and an H2D")
    if point.startswith("update") and "fused" not in config:
        pytest.skip("only fused AdamW calls torch._fused_adamw_")


@pytest.mark.parametrize("target", [0, 2, -1], ids=["first", "middle", "last"])
@pytest.mark.parametrize("step", ["first", "later"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failed_step_commits_whole_chunks_and_a_retry_matches(
    monkeypatch: pytest.MonkeyPatch, config: str, point: str, step: str, target: int
) -> None:
    _skip_where_the_point_is_not_reached(config, point, step)
    dtype = _dtype(config)
    params = make_params(SHAPES, dtype)
    opt = _wrap(config, params)
    chunks = opt.plan.all_chunks
    assert len(chunks) >= 4
    # The oracle: a clean twin (or plain torch, without masters) stepped with grads only on committed chunks.
    twin_params = make_params(SHAPES, dtype)
    twin: Any = _wrap(config, twin_params) if dtype == torch.bfloat16 else _inner(config, twin_params)
    first = 0 if step == "first" else 2
    if first:
        run_steps(opt, params, first)
        run_steps(twin, twin_params, first)
    target = target % len(chunks)
    if point == "h2d":
        target = max(target, 1)  # the H2D of chunk i starts while chunk i - 1 steps
    set_grads(params, make_grads(params, first))
    with (
        _fault(monkeypatch, point, target),
        pytest.raises((Injected, KeyboardInterrupt, torch.OutOfMemoryError)) as info,
    ):
        opt.step()

    assert all(slot.state.value == "free" and slot.buffer is None for slot in internals(opt).pool.slots)
    assert not internals(opt).binding.stepping
    committed = _committed(info.value, len(chunks))
    stepped = {i for c in chunks[:committed] for i in c.params}
    grads = make_grads(twin_params, first)
    set_grads(twin_params, [g if i in stepped else None for i, g in enumerate(grads)])
    twin.step()
    twin.zero_grad()
    _assert_same(twin, twin_params, opt, params)

    run_steps(opt, params, 3, first_step=first + 1)  # the wrapper is usable, and goes on exactly
    run_steps(twin, twin_params, 3, first_step=first + 1)
    _assert_same(twin, twin_params, opt, params)


def _assert_same(ref: Any, ref_params: list[torch.nn.Parameter], opt: Any, params: list[torch.nn.Parameter]) -> None:
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)
    if isinstance(ref, ChunkedOffloadOptimizer):
        masters = [m for _, m in ref.master_params()]
        for i, (_, m) in enumerate(opt.master_params()):
            assert_equal(masters[i], m, f"master {i}")


@pytest.mark.parametrize("target", [2, -1], ids=["first-deferred", "last"])
@pytest.mark.parametrize("point", [p for p in POINTS if p not in ("fresh-alloc", "slots") and "update" not in p])
@pytest.mark.parametrize("config", ["adamw", "adamw-fp32-masters", "sgd-momentum"])
def test_a_deferred_chunk_that_fails_in_the_forward_commits_whole_chunks(
    monkeypatch: pytest.MonkeyPatch, config: str, point: str, target: int
) -> None:
    """With overlap and attach, chunks after the first ``num_slots`` run from the next forward's hooks."""
    from test_deferred import Chain

    dtype = _dtype(config)
    params = make_params(SHAPES, dtype)
    opt = ChunkedOffloadOptimizer(_inner(config, params), chunk_size_mb=0.002, overlap=True, **CONFIGS[config])
    chain = Chain(params)
    opt.attach(chain)
    chunks = opt.plan.all_chunks
    twin_params = make_params(SHAPES, dtype)
    twin: Any = _wrap(config, twin_params) if dtype == torch.bfloat16 else _inner(config, twin_params)
    run_steps(opt, params, 2)
    run_steps(twin, twin_params, 2)
    chain()
    target = target % len(chunks)
    if point == "h2d" and target == opt.num_slots:
        target += 1  # the H2D of chunk i starts while chunk i - 1 steps: the first deferred H2D is chunk 3's
    assert target >= opt.num_slots  # the failing chunk is deferred
    set_grads(params, make_grads(params, 2))
    with _fault(monkeypatch, point, target):
        opt.step()  # enqueues the first chunks only
        opt.zero_grad(set_to_none=True)
        assert internals(opt).schedule is not None and internals(opt).schedule.deferred is not None
        with pytest.raises((Injected, KeyboardInterrupt, torch.OutOfMemoryError)) as info:
            chain()

    assert internals(opt).schedule.deferred is None and opt.phase is not Phase.DEFERRED
    assert all(slot.state.value == "free" and slot.buffer is None for slot in internals(opt).pool.slots)
    assert not internals(opt).binding.stepping
    assert all(p.grad is None for p in params)  # the step's grads were put back to what the caller left
    committed = _committed(info.value, len(chunks))
    assert committed >= opt.num_slots
    stepped = {i for c in chunks[:committed] for i in c.params}
    grads = make_grads(twin_params, 2)
    set_grads(twin_params, [g if i in stepped else None for i, g in enumerate(grads)])
    twin.step()
    twin.zero_grad()
    _assert_same(twin, twin_params, opt, params)

    run_steps(opt, params, 3, first_step=3)  # the wrapper is usable, and goes on exactly
    run_steps(twin, twin_params, 3, first_step=3)
    _assert_same(twin, twin_params, opt, params)


def _iterate(mode: str, chain: torch.nn.Module, params: list[torch.nn.Parameter], opt: Any, step: int) -> None:
    """One iteration whose grads are ``make_grads(params, step)``: in the backward (final param by param, the last
    param's first), or set by hand, with the next forward after the step (it runs an overlapped step's deferred
    chunks)."""
    grads = make_grads(params, step)
    if mode == "backward":
        loss = sum((p * g).sum() for p, g in zip(params, grads, strict=True) if g is not None)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
    else:
        set_grads(params, grads)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if mode == "overlap":
        chain()


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("target", [0, 2, -2, -1], ids=["first", "third", "second-last", "last"])
@pytest.mark.parametrize("step", ["first", "later"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("config", ["adamw", "adamw-fp32-masters", "adamw-fused-resident-masters"])
@pytest.mark.parametrize("mode", ["backward", "overlap"])
def test_a_failed_fast_step_commits_whole_chunks_in_the_order_they_ran_and_goes_on_exactly(
    monkeypatch: pytest.MonkeyPatch, mode: str, config: str, point: str, step: str, target: int, slots: int
) -> None:
    """With ``step_in_backward=True`` or ``overlap=True`` the failure's note says what was committed, in the order
    the chunks ran (an overlapped step runs its resident chunks first). It can come before any chunk steps (the
    slots, the first H2Ds, a write-back held from the last step: [Note: Held write-back]), in any chunk (the held
    ones, the deferred ones), in the backward, in ``step()`` or in the next forward."""
    from test_deferred import Chain

    _skip_where_the_point_is_not_reached(config, point, step)
    dtype = _dtype(config)
    params = make_params(SHAPES, dtype)
    fast = {"step_in_backward": True} if mode == "backward" else {"overlap": True}
    opt = ChunkedOffloadOptimizer(
        _inner(config, params), chunk_size_mb=0.002, num_slots=slots, **fast, **CONFIGS[config]
    )
    chain = Chain(params)
    opt.attach(chain)
    chunks = opt.plan.all_chunks
    twin_params = make_params(SHAPES, dtype)
    twin: Any = _wrap(config, twin_params) if dtype == torch.bfloat16 else _inner(config, twin_params)
    first = 0 if step == "first" else 2
    for k in range(first):  # in the backward, the first step learns the order; from the second, chunks step in it
        _iterate(mode, chain, params, opt, k)
    run_steps(twin, twin_params, first)
    order: list[int] = []  # chunk indices in the order this iteration stepped them
    run = ChunkPipeline.step
    monkeypatch.setattr(ChunkPipeline, "step", lambda self, c, *a: order.append(c.index) or run(self, c, *a))
    with (
        _fault(monkeypatch, point, target % len(chunks)),
        pytest.raises((Injected, KeyboardInterrupt, torch.OutOfMemoryError)) as info,
    ):
        _iterate(mode, chain, params, opt, first)

    assert all(slot.state.value == "free" and slot.buffer is None for slot in internals(opt).pool.slots)
    committed = _committed(info.value, len(chunks))
    stepped = {i for c in order[:committed] for i in chunks[c].params}
    grads = make_grads(twin_params, first)
    set_grads(twin_params, [g if i in stepped else None for i, g in enumerate(grads)])
    twin.step()
    twin.zero_grad()
    _assert_same(twin, twin_params, opt, params)

    opt.zero_grad(set_to_none=True)
    for k in range(first + 1, first + 4):  # the wrapper is usable, and goes on exactly
        _iterate(mode, chain, params, opt, k)
    run_steps(twin, twin_params, 3, first_step=first + 1)
    _assert_same(twin, twin_params, opt, params)
