"""gpu_budget_mb="auto": the resident share follows the device memory the training leaves unused.

The device's memory is read through ``AutoBudget.read``; these tests give it readings of a device whose training
peak and capacity they choose, and check the plan, the refusals and that every step stays bitwise.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.budget import DEFAULT_HEADROOM_MB, MemoryReading
from reference import assert_equal, assert_states_equal, internals, make_grads, make_params, set_grads

_KIB = 1 / 1024  # MiB
_MIB = 2**20
SHAPES = [(16, 16)] * 12


class FakeDevice:
    """A device whose training peaks at ``usage`` bytes beside what the wrapper holds, of ``capacity`` bytes."""

    def __init__(self, opt: ChunkedOffloadOptimizer, capacity: int, usage: int) -> None:
        self.opt, self.capacity, self.usage = opt, capacity, usage
        self.peak = 0
        internals(opt).runner.budget.read = self.read  # type: ignore[union-attr]

    def read(self, device: torch.device) -> MemoryReading:
        plan = self.opt.plan
        self.peak = max(self.peak, self.usage + plan.resident_nbytes + plan.window_bound_nbytes)
        return MemoryReading(self.capacity, self.peak)


def _auto(**kwargs: float) -> tuple[torch.optim.Optimizer, list, ChunkedOffloadOptimizer, list]:
    ref_params, params = make_params(SHAPES), make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB, gpu_budget_mb="auto", **kwargs
    )
    return ref, ref_params, opt, params


def _step_both(
    ref: torch.optim.Optimizer, ref_params: list, opt: ChunkedOffloadOptimizer, params: list, k: int
) -> None:
    for o, ps in ((ref, ref_params), (opt, params)):
        set_grads(ps, make_grads(ps, k))
        o.step()
        o.zero_grad()


def _assert_same(ref: torch.optim.Optimizer, ref_params: list, opt: ChunkedOffloadOptimizer, params: list) -> None:
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)


def _state_bytes(opt: ChunkedOffloadOptimizer) -> int:
    return opt.plan.host_nbytes + opt.plan.resident_nbytes


def test_the_budget_fills_what_the_training_leaves_and_stays_bitwise(caplog: pytest.LogCaptureFixture) -> None:
    ref, ref_params, opt, params = _auto(gpu_headroom_mb=0)
    state = _state_bytes(opt)
    window = opt.plan.window_bound_nbytes
    device = FakeDevice(opt, capacity=10 * _MIB + window + state // 2, usage=10 * _MIB)
    _step_both(ref, ref_params, opt, params, 0)
    assert opt.plan.resident_nbytes == 0  # the first step runs fully offloaded
    with caplog.at_level(logging.INFO, logger="chunked_offload.budget"):
        _step_both(ref, ref_params, opt, params, 1)
    assert 0 < opt.plan.resident_nbytes <= state // 2
    assert opt.plan.resident_chunks[0].params[0] == 0  # the first params stay resident
    assert opt.stats is not None and 0.3 < opt.stats.resident_share <= 0.5
    assert any("gpu_budget_mb='auto'" in r.message for r in caplog.records)
    assert device.peak <= device.capacity
    for k in range(2, 6):
        _step_both(ref, ref_params, opt, params, k)
    assert device.peak <= device.capacity
    _assert_same(ref, ref_params, opt, params)


def test_a_model_that_fits_keeps_all_its_state_resident() -> None:
    ref, ref_params, opt, params = _auto(gpu_headroom_mb=1)
    FakeDevice(opt, capacity=64 * _MIB, usage=10 * _MIB)
    for k in range(4):
        _step_both(ref, ref_params, opt, params, k)
    assert not opt.plan.chunks and opt.stats is not None and opt.stats.resident_share == 1.0
    _assert_same(ref, ref_params, opt, params)


def test_a_training_peak_that_grows_moves_state_back_to_the_host_and_never_below_the_window() -> None:
    ref, ref_params, opt, params = _auto(gpu_headroom_mb=0)
    state, window = _state_bytes(opt), opt.plan.window_bound_nbytes
    device = FakeDevice(opt, capacity=10 * _MIB + window + state, usage=10 * _MIB)
    for k in range(3):
        _step_both(ref, ref_params, opt, params, k)
    full = opt.plan.resident_nbytes
    assert full > 0
    device.usage += state // 2  # the training grew by half the state: the next step moves that much back
    _step_both(ref, ref_params, opt, params, 3)
    assert 0 < opt.plan.resident_nbytes <= full - state // 2 + 4096
    device.usage += 4 * state  # more than everything: nothing resident, the window kept
    _step_both(ref, ref_params, opt, params, 4)
    assert opt.plan.resident_nbytes == 0 and opt.plan.window_bound_nbytes == window
    device.usage -= 5 * state  # memory freed later does not bring the state back: the peak cannot tell any more
    for k in range(5, 7):
        _step_both(ref, ref_params, opt, params, k)
    assert opt.plan.resident_nbytes == 0
    _assert_same(ref, ref_params, opt, params)


def test_the_headroom_is_left_free() -> None:
    _, _, opt, _ = _auto()
    assert opt.gpu_headroom_mb == DEFAULT_HEADROOM_MB
    params = opt.param_groups[0]["params"]
    state, window = _state_bytes(opt), opt.plan.window_bound_nbytes
    headroom = int(DEFAULT_HEADROOM_MB * _MIB)
    device = FakeDevice(opt, capacity=headroom + 10 * _MIB + window + state // 2, usage=10 * _MIB)
    for k in range(3):
        set_grads(params, make_grads(params, k))
        opt.step()
    assert 0 < opt.plan.resident_nbytes <= state // 2
    assert device.peak <= device.capacity - headroom


def test_on_the_cpu_auto_stays_offloaded_and_exact() -> None:
    ref, ref_params, opt, params = _auto()
    for k in range(3):
        _step_both(ref, ref_params, opt, params, k)
    assert opt.plan.resident_nbytes == 0
    _assert_same(ref, ref_params, opt, params)


def test_a_copy_keeps_auto_and_its_headroom() -> None:
    _, _, opt, _ = _auto(gpu_headroom_mb=512)
    clone = copy.deepcopy(opt)
    assert clone.gpu_budget_mb == "auto" and clone.gpu_headroom_mb == 512.0
    assert "gpu_budget_mb='auto'" in repr(opt)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"gpu_budget_mb": "max"}, TypeError, "a number of MiB or 'auto', got 'max'"),
        ({"gpu_budget_mb": 512, "gpu_headroom_mb": 64}, ValueError, "applies to gpu_budget_mb='auto' only"),
        ({"gpu_headroom_mb": 64}, ValueError, "applies to gpu_budget_mb='auto' only"),
        ({"gpu_budget_mb": "auto", "gpu_headroom_mb": -1}, ValueError, "finite number >= 0, got -1"),
        ({"gpu_budget_mb": "auto", "gpu_headroom_mb": "1G"}, TypeError, "a number of MiB, got str"),
        ({"gpu_budget_mb": "auto", "offload_fraction": 0.5}, ValueError, "not both"),
    ],
)
def test_bad_auto_options_are_refused(kwargs: dict, error: type, match: str) -> None:
    params = make_params(SHAPES)
    inner = torch.optim.AdamW(params, lr=1e-2)
    with pytest.raises(error, match=match):
        ChunkedOffloadOptimizer(inner, **kwargs)
    assert not inner.state


@pytest.mark.parametrize("mode", ["sync", "overlap", "backward"])
def test_every_iteration_mode_replans_between_steps_and_stays_bitwise(mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = ChunkedOffloadOptimizer(
        inner, chunk_size_mb=2 * _KIB, gpu_budget_mb="auto", gpu_headroom_mb=0,
        overlap=mode == "overlap", step_in_backward=mode == "backward",
    )  # fmt: skip
    if mode != "sync":
        opt.attach(model)
    state, window = _state_bytes(opt), opt.plan.window_bound_nbytes
    device = FakeDevice(opt, capacity=_MIB + window + state // 2, usage=_MIB)
    residents = []
    for k in range(6):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k))
        if k == 4:
            device.usage += state // 4  # the training grows: the next step moves state back
        for m, o in ((ref_model, ref), (model, opt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
        residents.append(opt.plan.resident_nbytes)
    assert residents[0] == 0 and residents[3] > 0 and residents[5] < residents[3]
    # The first reading follows a step run as the later ones: the second in sync, the third in the fast modes (whose
    # first step runs as a synchronous one, [Note: Auto budget]).
    assert (residents[1] > 0) is (mode == "sync") and residents[2] > 0
    model(torch.zeros(1, 16))  # the forward that waits for (or enqueues) the last step
    opt.synchronize()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert_equal(a, b)


def test_a_replan_gives_the_allocators_cache_back_before_and_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached blocks that no request of the new layout fits must not count as the training's next peak: the cache
    is emptied before the new homes are built and after the old ones are freed, and only where the plan moves."""
    ref, ref_params, opt, params = _auto(gpu_headroom_mb=0)
    state, window = _state_bytes(opt), opt.plan.window_bound_nbytes
    FakeDevice(opt, capacity=_MIB + window + state, usage=_MIB)
    placement = internals(opt).placement
    events: list[tuple[str, int]] = []
    internals(opt).runner.budget.release = lambda device: events.append(("release", opt.plan.resident_nbytes))
    original = placement.sync

    def sync(*, force: bool = False, strict: bool = True) -> None:
        original(force=force, strict=strict)
        if force:
            events.append(("sync", opt.plan.resident_nbytes))

    monkeypatch.setattr(placement, "sync", sync)
    for k in range(5):
        _step_both(ref, ref_params, opt, params, k)
    assert events == [("release", 0), ("sync", state), ("release", state)]  # one growth, then nothing moves
    _assert_same(ref, ref_params, opt, params)


def _failing_replans(opt: ChunkedOffloadOptimizer, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list:
    """Every forced re-plan raises ``error`` (before anything is installed) while the returned list is non-empty."""
    placement = internals(opt).placement
    original = placement.sync
    armed = [True]

    def sync(*, force: bool = False, strict: bool = True) -> None:
        if force and armed:
            raise error
        original(force=force, strict=strict)

    monkeypatch.setattr(placement, "sync", sync)
    return armed


def test_a_growth_without_device_memory_stays_put_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ref, ref_params, opt, params = _auto(gpu_headroom_mb=0)
    state, window = _state_bytes(opt), opt.plan.window_bound_nbytes
    FakeDevice(opt, capacity=_MIB + window + state, usage=_MIB)
    _failing_replans(opt, monkeypatch, torch.OutOfMemoryError("CUDA out of memory"))
    with caplog.at_level(logging.WARNING, logger="chunked_offload.budget"):
        for k in range(4):
            _step_both(ref, ref_params, opt, params, k)
    assert opt.plan.resident_nbytes == 0 and internals(opt).placement.options.gpu_budget is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]  # tried once, then no more
    _assert_same(ref, ref_params, opt, params)


def test_a_replan_that_fails_otherwise_propagates_and_the_next_step_tries_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref, ref_params, opt, params = _auto(gpu_headroom_mb=0)
    state, window = _state_bytes(opt), opt.plan.window_bound_nbytes
    FakeDevice(opt, capacity=_MIB + window + state, usage=_MIB)
    armed = _failing_replans(opt, monkeypatch, RuntimeError("injected"))
    _step_both(ref, ref_params, opt, params, 0)
    set_grads(params, make_grads(params, 1))
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()  # before anything of the step: the params and state are as after step 0
    assert opt.plan.resident_nbytes == 0 and internals(opt).placement.options.gpu_budget is None
    armed.clear()
    opt.step()  # the same grads again: re-plans, then steps
    opt.zero_grad()
    ref.zero_grad()
    set_grads(ref_params, make_grads(ref_params, 1))
    ref.step()
    assert opt.plan.resident_nbytes > 0
    _assert_same(ref, ref_params, opt, params)


def test_a_shrink_without_memory_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, opt, params = _auto(gpu_headroom_mb=0)
    state, window = _state_bytes(opt), opt.plan.window_bound_nbytes
    device = FakeDevice(opt, capacity=_MIB + window + state, usage=_MIB)
    for k in range(3):
        set_grads(params, make_grads(params, k))
        opt.step()
    assert opt.plan.resident_nbytes > 0
    _failing_replans(opt, monkeypatch, torch.OutOfMemoryError("no memory"))
    device.usage += state
    set_grads(params, make_grads(params, 3))
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert opt.plan.resident_nbytes > 0
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()  # tried again, before anything else
