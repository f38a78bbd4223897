"""Where the state lives: gpu_budget_mb (the first params resident, the window inside the budget) and the
handles of offload()/reload()."""

from __future__ import annotations

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, Home
from reference import (
    ODD_SHAPES,
    adamw_pair,
    assert_pair_equal,
    internals,
    make_params,
    run_steps,
)

_KIB = 1 / 1024  # MiB


def test_budget_and_fraction_together_are_refused() -> None:
    params = make_params(ODD_SHAPES)
    inner = torch.optim.AdamW(params)
    with pytest.raises(ValueError, match=r"offload_fraction \(0.5\) or gpu_budget_mb \(64\), not both"):
        ChunkedOffloadOptimizer(inner, offload_fraction=0.5, gpu_budget_mb=64)
    assert not inner.state  # nothing was modified


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_budgets_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="gpu_budget_mb must be a finite number >= 0"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), gpu_budget_mb=bad)
    with pytest.raises(TypeError, match="gpu_budget_mb must be a number"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), gpu_budget_mb="64")  # type: ignore[arg-type]


def test_a_budget_below_the_window_names_both_numbers_and_what_sets_the_slot() -> None:
    window = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), chunk_size_mb=0.05).plan
    expected = rf"2 slots x {window.slot_nbytes / 2**20:.2f} MiB.* = {window.window_bound_nbytes / 2**20:.2f} MiB"
    with pytest.raises(ValueError, match=r"gpu_budget_mb=0.00 is below the staging window .*" + expected):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), chunk_size_mb=0.05, gpu_budget_mb=0)
    # One param larger than the chunk sets the slot: a smaller chunk_size_mb would not help, and the message says so.
    big = [(8, 8), (256, 256), (8, 8)]  # param 1: 2 x 256 KiB of AdamW state + a 256 KiB backup
    with pytest.raises(ValueError, match=r"set by param 1 \(shape \(256, 256\), torch.float32\).*same window"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(big)), chunk_size_mb=0.1, gpu_budget_mb=0.5)
    # Many small params fill the chunks: the chunk size sets the slot.
    small = [(32, 32)] * 16
    with pytest.raises(ValueError, match=r"set by chunk_size_mb=0.10: raise gpu_budget_mb to at least .*lower chunk"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(small)), chunk_size_mb=0.1, gpu_budget_mb=0.1)


def test_the_window_bound_is_the_plans_own() -> None:
    """An 8 MiB model under a 100 MiB budget fits: its slots are its largest chunk, not the requested 256 MiB."""
    params = make_params([(512, 512)] * 8)  # AdamW: 8 x (2 x 1 MiB of state + a 1 MiB backup)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, fused=True), gpu_budget_mb=100)
    plan = opt.plan
    assert plan.slot_nbytes == 24 * 2**20 and plan.window_bound_nbytes < 3 * 24 * 2**20
    assert plan.window_bound_nbytes + plan.resident_nbytes <= 100 * 2**20 and plan.resident_chunks
    tiny = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params([(7, 3)])))
    assert f"window bound {tiny.plan.window_bound_nbytes / 2**20:.1f} MiB" in tiny.plan.summary()
    assert tiny.plan.window_bound_nbytes < 2**20


def test_the_budget_keeps_the_first_params_resident_and_the_window_inside_it() -> None:
    params = make_params([(64, 64)] * 8)  # AdamW: 2 x 16 KiB of state per param, plus a 16 KiB backup
    window = ChunkedOffloadOptimizer(torch.optim.AdamW(params), chunk_size_mb=48 * _KIB).plan.window_bound_nbytes
    for extra_kib, n_resident in [(0, 0), (40, 1), (100, 3), (1000, 8)]:
        budget = (window + extra_kib * 1024) / 2**20
        opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params), chunk_size_mb=48 * _KIB, gpu_budget_mb=budget)
        plan = opt.plan
        assert plan.window_bound_nbytes == window and plan.slot_nbytes == 48 * 1024
        resident = [i for c in plan.resident_chunks for i in c.params]
        assert resident == list(range(n_resident)), (extra_kib, resident)
        assert plan.window_bound_nbytes + plan.resident_nbytes <= budget * 2**20
        assert [c.index for c in plan.all_chunks] == list(range(len(plan.all_chunks)))
        assert [i for c in plan.all_chunks for i in c.params] == list(range(8))  # steps run in param order
        assert all(c.home == Home.DEVICE for c in plan.all_chunks[: len(plan.resident_chunks)])
        del opt


class _Recording(torch.optim.AdamW):
    """AdamW that records where each param's ``exp_avg`` was when it stepped."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params)
        self.stepped_at: dict[int, int] = {}

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                self.stepped_at[id(p)] = self.state[p]["exp_avg"].data_ptr()


@pytest.mark.filterwarnings("ignore:no explicit adapter")
def test_resident_chunks_step_in_their_homes_and_offloaded_ones_in_a_slot() -> None:
    """[Note: Resident chunks step in place]: the inner steps a resident param's state where it lives between steps."""
    params = make_params([(64, 64)] * 8)
    window = ChunkedOffloadOptimizer(torch.optim.AdamW(params), chunk_size_mb=48 * _KIB).plan.window_bound_nbytes
    inner = _Recording(params)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=48 * _KIB, gpu_budget_mb=(window + 100 * 1024) / 2**20)
    assert [i for c in opt.plan.resident_chunks for i in c.params] == [0, 1, 2]
    run_steps(opt, params, 3)
    in_home = [inner.stepped_at[id(p)] == opt.state[p]["exp_avg"].data_ptr() for p in params]
    assert in_home == [True] * 3 + [False] * 5


@pytest.mark.parametrize("share", [0.0, 0.3, 0.7, 1.0])
def test_every_budget_is_bitwise_and_moves_fewer_bytes_as_it_grows(share: float) -> None:
    full = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), chunk_size_mb=4 * _KIB)
    window, state = full.plan.window_bound_nbytes, full.plan.host_nbytes
    del full
    budget = (window + share * (state + 4096 * len(ODD_SHAPES))) / 2**20
    ref, ref_params, opt, params = adamw_pair(gpu_budget_mb=budget)
    run_steps(ref, ref_params, 4)
    run_steps(opt, params, 4)
    assert_pair_equal(ref, ref_params, opt, params)
    stats = opt.stats
    assert stats is not None
    assert stats.h2d_bytes == sum(c.transfer_nbytes for c in opt.plan.chunks)
    assert stats.d2d_bytes == sum(c.transfer_nbytes for c in opt.plan.resident_chunks)
    if share == 0.0:
        assert stats.d2d_bytes == 0
    if share == 1.0:
        assert stats.h2d_bytes == 0


def test_the_budget_survives_a_replan() -> None:
    ref, ref_params, opt, params = adamw_pair(gpu_budget_mb=1.0)
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 2)
    extra_ref, extra = make_params([(9, 9)], seed=5), make_params([(9, 9)], seed=5)
    ref.add_param_group({"params": extra_ref, "lr": 3e-3})
    opt.add_param_group({"params": extra, "lr": 3e-3})
    assert "gpu_budget_mb=1.0" in repr(opt)
    run_steps(ref, ref_params + extra_ref, 2, first_step=2)
    run_steps(opt, params + extra, 2, first_step=2)
    assert_pair_equal(ref, ref_params + extra_ref, opt, params + extra)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_offload_and_reload_return_handles_and_repeat_as_no_ops(non_blocking: bool) -> None:
    ref, ref_params, opt, params = adamw_pair(offload_fraction=0.5)
    run_steps(ref, ref_params, 4)
    run_steps(opt, params, 2)
    handle = opt.offload(non_blocking=non_blocking)
    assert opt.offload(non_blocking=non_blocking) is handle  # a second call changes nothing
    assert handle.wait().done()
    assert internals(opt).placement.layout is not None and internals(opt).placement.layout.resident.flat is not None
    assert internals(opt).placement.layout.resident.flat.device.type == "cpu"
    _ = opt.state_dict()  # readable while offloaded
    again = opt.reload(non_blocking=non_blocking)
    assert opt.reload() is again
    again.wait()
    run_steps(opt, params, 2, first_step=2)
    assert_pair_equal(ref, ref_params, opt, params)
