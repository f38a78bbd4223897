"""opt.prefetch(): the next step takes its copies over; a stale or failed prefetch is dropped and the step stays
exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from reference import (
    adamw_pair,
    assert_pair_equal,
    internals,
    make_grads,
    run_steps,
    set_grads,
)

_KIB = 1 / 1024  # MiB


def test_prefetch_before_the_first_step_is_a_no_op() -> None:
    ref, ref_params, opt, params = adamw_pair()
    set_grads(params, make_grads(params, 0))
    opt.prefetch()
    assert not internals(opt).pool.allocated  # a first step creates its state on the device: nothing to bring in
    opt.zero_grad()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 3)
    assert_pair_equal(ref, ref_params, opt, params)


def test_prefetch_is_taken_over_by_the_step() -> None:
    ref, ref_params, opt, params = adamw_pair()
    run_steps(ref, ref_params, 5)
    run_steps(opt, params, 1)
    for step in range(1, 5):
        set_grads(params, make_grads(params, step))
        opt.prefetch()
        assert internals(opt).pool.allocated and internals(opt).pipeline.ahead.active
        opt.step()
        assert not internals(opt).pipeline.ahead.active and not internals(opt).pool.allocated
        opt.zero_grad()
    assert_pair_equal(ref, ref_params, opt, params)


@pytest.mark.parametrize(
    "between", ["grads_change", "state_write", "state_write_in_place", "load_state_dict", "offload", "replan"]
)
def test_a_stale_prefetch_is_dropped_and_the_step_stays_exact(between: str) -> None:
    ref, ref_params, opt, params = adamw_pair(offload_fraction=0.6)
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 2)
    saved = opt.state_dict(snapshot=True)
    grads = make_grads(params, 2)
    set_grads(params, grads)
    opt.prefetch()
    if between == "grads_change":
        grads[0] = None
        params[0].grad = None
    elif between == "state_write":
        for p, rp in ((params[0], ref_params[0]), (params[-1], ref_params[-1])):
            opt.state[p]["exp_avg"] = torch.full_like(p, 0.25)
            ref.state[rp]["exp_avg"] = torch.full_like(rp, 0.25)
    elif between == "state_write_in_place":  # into the host copy the prefetch has already read
        for p, rp in ((params[0], ref_params[0]), (params[-1], ref_params[-1])):
            opt.state[p]["exp_avg"].mul_(0.5)
            ref.state[rp]["exp_avg"].mul_(0.5)
    elif between == "load_state_dict":
        opt.load_state_dict(saved)
    elif between == "offload":
        opt.offload()
    elif between == "replan":
        opt.replan()
    set_grads(ref_params, grads)
    ref.step()
    opt.step()
    ref.zero_grad()
    opt.zero_grad()
    assert_pair_equal(ref, ref_params, opt, params)
    assert not internals(opt).pool.allocated


def test_a_prefetch_that_fails_frees_the_slots_and_the_step_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunked_offload.transfer import TransferEngine

    ref, ref_params, opt, params = adamw_pair()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 2)
    set_grads(params, make_grads(params, 2))
    with monkeypatch.context() as patch:

        def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected H2D failure")

        patch.setattr(TransferEngine, "stage_in", failing)
        with pytest.raises(RuntimeError, match="injected H2D failure"):
            opt.prefetch()
    assert (
        not internals(opt).pool.allocated
        and internals(opt).schedule is not None
        and not internals(opt).pipeline.ahead.active
    )
    opt.step()
    opt.zero_grad()
    assert_pair_equal(ref, ref_params, opt, params)
