"""Reliability on the GPU: every stream wait proven by a race, soaks, leaks, OOM recovery, registration pieces."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, host_arena
from chunked_offload.host_arena import is_page_locked, registered_bytes
from chunked_offload.staging import SlotState
from chunked_offload.stepping import ChunkStepper
from chunked_offload.transfer import TransferEngine
from reference import (
    UNDER_SANITIZER,
    WRAPPER_CALLS,
    assert_equal,
    assert_runs_match,
    assert_states_equal,
    internals,
    make_grads,
    make_params,
    partly_resident_adamw,
    run_steps,
    settled_cuda_memory,
)

pytestmark = pytest.mark.cuda
MiB = 2**20
SLEEP = 2_000_000  # GPU cycles, about a millisecond: far longer than any copy or step here
SHAPES = [(1024, 1024)] * 6 + [(3000,)]


def _sleep_on(stream: torch.cuda.Stream | None, cycles: int = SLEEP) -> None:
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(cycles)


def _inject(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Slow one stream at one point of every chunk."""

    def before(cls: Any, name: str, stream_of: Callable[[Any], torch.cuda.Stream | None], cycles: int) -> None:
        original = getattr(cls, name)

        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            _sleep_on(stream_of(self), cycles)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, patched)

    if where == "compute-before-chunk-step":
        before(ChunkStepper, "inner_step", lambda self: None, SLEEP)
    elif where == "h2d":
        before(TransferEngine, "stage_in", lambda self: self.h2d_stream, SLEEP)
    elif where.startswith("one-chunk"):  # longer than the host's work between two steps (making the grads)
        before(TransferEngine, "write_back", lambda self: self.d2h_stream, 100 * SLEEP)
    else:  # every write-back starts late: the next step, state_dict() and offload() follow at once
        before(TransferEngine, "write_back", lambda self: self.d2h_stream, 10 * SLEEP)


SCENARIOS = ["compute-before-chunk-step", "h2d", "d2h-then-next-step", "d2h-then-read", "one-chunk-d2h-then-next-step"]


@pytest.mark.parametrize("where", SCENARIOS)
@pytest.mark.parametrize("mode", ["none", "remainder"])
def test_slowed_streams_stay_exact(monkeypatch: pytest.MonkeyPatch, where: str, mode: str) -> None:
    _race(monkeypatch, where, mode)


def _race(monkeypatch: pytest.MonkeyPatch, where: str, mode: str) -> None:
    dtype = torch.float32 if mode == "none" else torch.bfloat16
    ref_params, params = make_params(SHAPES, dtype, "cuda"), make_params(SHAPES, dtype, "cuda")
    # With one chunk no step waits on any write-back, so only the next step's own wait orders it after them.
    chunk_mb = 1024 if where.startswith("one-chunk") else 8

    def wrap(ps: list[torch.nn.Parameter]) -> ChunkedOffloadOptimizer:
        inner = torch.optim.AdamW(ps, lr=1e-2, fused=True)
        return ChunkedOffloadOptimizer(inner, chunk_size_mb=chunk_mb, master_weights=mode)

    opt, twin = wrap(params), wrap(ref_params)
    assert len(opt.plan.chunks) >= 4 or chunk_mb == 1024
    for step in range(6):
        run_steps(twin, ref_params, 1, first_step=step)
        twin.synchronize()
        with monkeypatch.context() as patch:
            _inject(patch, where)
            run_steps(opt, params, 1, first_step=step)
            if where == "d2h-then-read":
                sd = opt.state_dict(snapshot=True)  # must wait for the slowed write-backs before copying
                for pid, entry in twin.state_dict()["state"].items():
                    for key, value in entry.items():
                        assert_equal(value, sd["state"][pid][key], f"{pid}/{key}")
                opt.offload()  # likewise before moving anything
    opt.synchronize()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(twin, ref_params, opt, params)


@pytest.mark.parametrize(
    "wait, where",
    [
        ("h2d-before-step", "h2d"),
        ("last-d2h-before-next-h2d", "one-chunk-d2h-then-next-step"),
        ("write-backs-before-state-dict", "d2h-then-read"),
    ],
)
@pytest.mark.timing
def test_removing_a_wait_makes_its_race_test_fail(monkeypatch: pytest.MonkeyPatch, wait: str, where: str) -> None:
    if wait == "h2d-before-step":

        def wait_staged(self: TransferEngine, slot: Any, h2d_event: Any) -> None:
            slot.advance((SlotState.LOADING,), SlotState.READY)  # no compute.wait_event(h2d_event)

        monkeypatch.setattr(TransferEngine, "wait_staged", wait_staged)
    elif wait == "last-d2h-before-next-h2d":
        monkeypatch.setattr(TransferEngine, "begin_step", lambda self: None)
    else:
        from chunked_offload.placement import Placement

        monkeypatch.setattr(Placement, "synchronize", lambda self: None)
    with pytest.raises(AssertionError):
        _race(monkeypatch, where, "none")


def test_a_thousand_random_steps_and_calls_match_plain_and_leak_nothing() -> None:
    rng = random.Random(0)
    shapes = [(rng.randint(1, 300), rng.randint(1, 300)) for _ in range(40)]
    ref_params, params = make_params(shapes, torch.float32, "cuda"), make_params(shapes, torch.float32, "cuda")
    ref = torch.optim.AdamW(ref_params, lr=1e-3, fused=True)
    # Part of the state resident (the first params), so that offload() and reload() move something.
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3, fused=True), chunk_size_mb=0.2, gpu_budget_mb=4)
    assert opt.plan.resident_chunks and opt.plan.chunks
    all_ref, all_params = list(ref_params), list(params)
    samples: list[tuple[int, int, int]] = []
    groups_added = 0
    for step in range(1000):
        ops = ["step"] * 6 + ["skip", "zero_grad", "offload", "reload", "state_dict", "add_group"]
        op = rng.choice(ops + ["prefetch_step", "prefetch_step", "offload_async", "reload_async"])
        if op in ("step", "skip", "prefetch_step"):
            grads = make_grads(all_params, step, none_every=rng.choice([0, 3, 5]))
            for p, q, g in zip(all_params, all_ref, grads, strict=True):
                p.grad, q.grad = (None, None) if g is None else (g.clone(), g.clone())
            if op == "prefetch_step":
                opt.prefetch()  # right after backward: the first chunk's H2D starts before the step
            if op != "skip":
                opt.step()
                ref.step()
        elif op == "zero_grad":
            opt.zero_grad()
            ref.zero_grad()
        elif op in WRAPPER_CALLS:
            WRAPPER_CALLS[op](opt)
        elif op == "state_dict":
            opt.load_state_dict(opt.state_dict())
        elif op == "add_group" and groups_added < 3 and step < 500:
            groups_added += 1
            new, new_ref = (
                make_params([(64, 32)], torch.float32, "cuda", seed=step),
                make_params([(64, 32)], torch.float32, "cuda", seed=step),
            )
            opt.add_param_group({"params": new})
            ref.add_param_group({"params": new_ref})
            all_params += new
            all_ref += new_ref
        if step >= 500 and step % 50 == 0:  # steady state: the leak check, not counting the grads of this moment
            opt.reload()  # the resident state on the device, whatever the last call was
            opt.synchronize()
            gc.collect()  # an earlier test's tensors held in reference cycles go at a collection, not at a sample
            torch.cuda.synchronize()
            grads = sum(p.grad.nbytes for p in all_params + all_ref if p.grad is not None)
            samples.append((torch.cuda.memory_allocated() - grads, torch.cuda.memory_reserved(), registered_bytes()))
    opt.synchronize()
    for a, b in zip(all_ref, all_params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, all_ref, opt, all_params)
    if UNDER_SANITIZER:
        return  # the tool keeps every step's grads alive (see reference.UNDER_SANITIZER); the sequence still ran
    allocated, reserved, pinned = zip(*samples, strict=True)
    assert max(allocated) - min(allocated) <= 1 * MiB, allocated
    assert max(reserved) - min(reserved) <= 64 * MiB, reserved
    assert len(set(pinned)) == 1, pinned


@pytest.mark.timing
def test_offload_reload_cycles_leave_memory_flat() -> None:
    params = make_params(SHAPES, torch.float32, "cuda")
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=8, offload_fraction=0.5)
    run_steps(opt, params, 2)
    samples = []
    for cycle in range(100):
        opt.offload()
        gc.collect()  # an earlier test's tensors held in reference cycles go at a collection, not at a sample
        torch.cuda.synchronize()
        low = torch.cuda.memory_allocated()
        opt.reload()
        run_steps(opt, params, 1, first_step=2 + cycle)
        torch.cuda.synchronize()
        samples.append((low, torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), registered_bytes()))
    for column in zip(*samples, strict=True):
        assert len(set(column[10:])) == 1, column[:20]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timing
def test_fifty_wrappers_return_their_host_arena() -> None:
    gc.collect()
    pinned0, rss0 = registered_bytes(), _rss()
    for i in range(50):
        params = make_params([(4096, 4096)] * 2, torch.float32, "cuda", seed=i)  # 256 MiB of AdamW state
        opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=64)
        run_steps(opt, params, 1)
        assert registered_bytes() >= pinned0 + 256 * MiB
        del opt, params
        assert registered_bytes() == pinned0  # dropped with the wrapper: reference counting, no GC cycle
    gc.collect()
    assert _rss() - rss0 <= 300 * MiB, f"RSS grew by {(_rss() - rss0) / MiB:.0f} MiB over 50 wrappers"


@pytest.mark.timing
def test_slot_views_held_past_the_step_do_not_pin_its_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frames of a kept traceback hold the views each chunk stepped on; the slots go back to the allocator anyway.

    Under compute-sanitizer every step's frames stay alive this way; in a notebook, a failed step's traceback does.
    """
    held: list[torch.Tensor] = []
    step_chunk = ChunkStepper.inner_step

    def holding(self: ChunkStepper, chunk: Any, infos: Any, txn: Any) -> None:
        # What a kept frame of the inner step would hold: the state views each chunk is stepped on.
        held.extend(v for info in infos for v in self.inner.state.get(info.param, {}).values() if v.dim() > 0)
        step_chunk(self, chunk, infos, txn)

    ref_params, params, ref, opt = partly_resident_adamw()
    assert opt.plan.resident_nbytes >= 4 * 32 * MiB and opt.plan.chunks
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 1)
    opt.synchronize()
    before = settled_cuda_memory()
    monkeypatch.setattr(ChunkStepper, "inner_step", holding)
    run_steps(opt, params, 1, first_step=1)
    monkeypatch.undo()
    # All 8 params' exp_avg and exp_avg_sq: an offloaded chunk's are views of its slot, freed; a resident chunk steps
    # in its homes ([Note: Resident chunks step in place]), the device buffer its state lives in between steps.
    homes = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values() if t.is_cuda and t.dim()}
    freed = [t for t in held if t.untyped_storage().nbytes() == 0]
    in_homes = [t for t in held if t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() in homes]
    assert len(held) == 2 * 8 and len(freed) + len(in_homes) == len(held) and freed and in_homes
    opt.synchronize()
    assert settled_cuda_memory() == before  # the slots went back although views of them are held
    run_steps(opt, params, 1, first_step=2)
    opt.synchronize()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params, opt, params)


@pytest.mark.parametrize("stage", ["slots", "fresh-state"])
def test_gpu_oom_mid_step_leaves_a_usable_wrapper(stage: str) -> None:
    shapes = [(2048, 2048)] * 8
    ref_params, params = make_params(shapes, torch.float32, "cuda"), make_params(shapes, torch.float32, "cuda")
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), chunk_size_mb=64)
    if stage == "slots":
        assert_runs_match(ref, ref_params, opt, params, 2)
    for p in params:
        p.grad = torch.ones_like(p)
    # The cap binds only on new segments. Earlier tests leave free blocks cached in segments still partly in use, and
    # wrappers in reference cycles that a collection during the step would free: collect them, then occupy every
    # cached free block a state tensor could use, so that the step's allocations must grow the pool.
    settled_cuda_memory()
    fillers = [
        torch.empty(block["size"], dtype=torch.uint8, device="cuda")
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "inactive" and block["size"] >= MiB
    ]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 8 * MiB) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            opt.step()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del fillers
    assert not internals(opt).pool.allocated
    opt.zero_grad()
    first = 0 if stage == "fresh-state" else 2
    assert_runs_match(ref, ref_params, opt, params, 3, first_step=first)  # host copies intact, nothing stepped


def test_arena_registered_in_many_pieces_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_arena, "MAX_REGISTER_BYTES", 64 * MiB)
    shapes = [(2048, 2048)] * 16  # 512 MiB of AdamW state in 64 MiB chunks: 8 registrations
    ref_params, params = make_params(shapes, torch.float32, "cuda"), make_params(shapes, torch.float32, "cuda")
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), chunk_size_mb=64)
    arena = internals(opt).placement.layout.host.arena
    assert len(arena.pieces) >= 4
    for lo, hi in arena.pieces:
        assert is_page_locked(arena.region(lo, 1)) and is_page_locked(arena.region(hi - 1, 1))
    assert_runs_match(torch.optim.AdamW(ref_params, lr=1e-2, fused=True), ref_params, opt, params, 3)
