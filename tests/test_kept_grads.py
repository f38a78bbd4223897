"""Grads read in place ([Note: Inputs of a step]): where the loop zeroes its grads in place through
``AttachHandle.zero_grads_with`` (as Megatron resets its grad buffer), an overlapped step keeps no copy of them; the
zeroing waits for the step, and any other write to them before the step has read them is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, internals, make_grads, make_params
from test_deferred import Chain

_KIB = 1 / 1024  # MiB


_Pair = tuple[torch.optim.Optimizer, list, torch.Tensor, ChunkedOffloadOptimizer, list, Chain, Callable[[], None]]


def _on_a_buffer(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Point the params' grads into one zeroed buffer, as Megatron's grad buffer holds its params' grads."""
    buffer = torch.zeros(sum(p.numel() for p in params))
    for p, start in zip(params, range(0, buffer.numel(), 256), strict=True):
        p.grad = buffer[start : start + 256].view(16, 16)
    return buffer


def _buffered_pair() -> _Pair:
    """A plain AdamW (its grads on a buffer) and a deferring wrapper whose params' grads live in another, zeroed in
    place through its attach handle."""
    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref_buffer, buffer = _on_a_buffer(ref_params), _on_a_buffer(params)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB, overlap=True)
    chain = Chain(params)
    zero = opt.attach(chain).zero_grads_with(buffer.zero_)
    assert len(opt.plan.all_chunks) > opt.num_slots + 1
    return ref, ref_params, ref_buffer, opt, params, chain, zero


def _accumulate(params: list[torch.Tensor], it: int) -> None:
    """The backward: grads added into the buffer."""
    for p, g in zip(params, make_grads(params, it), strict=True):
        assert g is not None
        p.grad.add_(g)


def test_a_step_reads_the_grads_in_place_and_the_zeroing_waits_for_the_forward_end() -> None:
    ref, ref_params, ref_buffer, opt, params, chain, zero = _buffered_pair()
    for it in range(5):
        ref_buffer.zero_()
        _accumulate(ref_params, it)
        ref.step()
        zero()
        chain()  # the forward end joins the step: the held zeroing runs after it
        _accumulate(params, it)
        opt.step()
        if it > 0:  # from the second step on the step defers, reading the grads themselves
            run = internals(opt).schedule.deferred
            assert run is not None and run.owned.grads
            assert all(g is params[i].grad for i, g in run.owned.grads.items())
    opt.wait_step()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b, "param")


def test_a_zeroing_without_a_forward_runs_before_the_next_step_reads_the_grads() -> None:
    ref, ref_params, ref_buffer, opt, params, chain, zero = _buffered_pair()
    for it in range(3):
        _accumulate(ref_params, it)
        ref.step()
        chain()
        _accumulate(params, it)
        opt.step()
    ref_buffer.zero_()
    ref.step()  # a step of zero grads (the moments decay)
    zero()
    opt.step()
    opt.wait_step()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b, "param")


@pytest.mark.parametrize("when", ["before its chunk", "after every chunk is enqueued"])
def test_a_grad_written_before_the_step_has_read_it_is_refused(when: str) -> None:
    _, _, _, opt, params, chain, zero = _buffered_pair()
    for it in range(3):
        zero()
        chain()
        _accumulate(params, it)
        opt.step()
    before = params[-1].detach().clone()
    if when == "after every chunk is enqueued":
        internals(opt).runner.flush()
    params[-1].grad.mul_(2)  # the loop scales a grad after step(), not through the held zeroing
    with pytest.raises(RuntimeError, match="was written after step\\(\\) returned and before the step had read it"):
        chain() if when == "before its chunk" else opt.wait_step()
    if when == "before its chunk":  # refused before its chunk read the scaled grad
        assert_equal(params[-1].detach(), before, "param")
