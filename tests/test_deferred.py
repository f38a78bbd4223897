"""Deferred chunks ([Note: Deferred chunks]): an overlapped step with an attached model leaves its later chunks to the
forward hooks that read their params, and every call that reads what the step changes enqueues them first."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, Phase
from reference import (
    assert_equal,
    assert_pair_equal,
    internals,
    make_grads,
    make_params,
    run_steps,
    set_grads,
)

_KIB = 1 / 1024  # MiB


class Chain(torch.nn.Module):
    """One module per param, run in param order: the forward reads each param inside its own module."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.links = torch.nn.ModuleList(torch.nn.Module() for _ in params)
        for link, p in zip(self.links, params, strict=True):
            link.w = p
            link.forward = lambda link=link: link.w.sum()  # type: ignore[method-assign]

    def forward(self) -> torch.Tensor:
        return torch.stack([link() for link in self.links]).sum()


def _deferringadamw_pair() -> tuple[torch.optim.Optimizer, list, ChunkedOffloadOptimizer, list, Chain]:
    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB, overlap=True)
    chain = Chain(params)
    opt.attach(chain)
    assert len(opt.plan.all_chunks) > opt.num_slots + 1
    return ref, ref_params, opt, params, chain


class _MatmulMomentum(torch.optim.Optimizer):
    """Momentum through a matmul: autocast would run it in bf16, so it shows whether a step ran under autocast."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                eye = torch.eye(p.shape[-1], dtype=p.dtype)
                state["buf"].mul_(0.9).add_(p.grad @ eye)
                p.add_(state["buf"], alpha=-group["lr"])
        return None


def test_a_deferred_step_enqueues_its_later_chunks_as_the_forward_reaches_them() -> None:
    ref, ref_params, opt, params, chain = _deferringadamw_pair()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 1)  # a first step creates state on the device: it never defers
    assert internals(opt).schedule is not None and internals(opt).schedule.deferred is None
    set_grads(params, make_grads(params, 1))
    opt.step()
    run = internals(opt).schedule.deferred
    assert run is not None and run.next == opt.num_slots  # only the head is enqueued
    opt.zero_grad(set_to_none=True)  # the deferred chunks keep the grads of the step
    first_deferred = run.chunks[run.next].params[0]
    for link in chain.links[: first_deferred + 1]:
        link()
    assert internals(opt).schedule.deferred is run and run.next == opt.num_slots + 1 + opt.num_slots
    chain()  # the rest of the forward; its end enqueues whatever is left
    assert (
        internals(opt).schedule.deferred is None
        and opt.phase is not Phase.DEFERRED
        and not internals(opt).pool.allocated
    )
    set_grads(params, make_grads(params, 2))
    opt.step()
    chain()
    opt.zero_grad()
    assert_pair_equal(ref, ref_params, opt, params)


def test_resident_chunks_step_inside_step_and_only_offloaded_ones_are_deferred() -> None:
    """Resident chunks have no transfer for the forward to hide: step() runs them all, before any offloaded one."""
    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    inner = torch.optim.AdamW(params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=4 * _KIB, overlap=True, offload_fraction=0.25)
    chain = Chain(params)
    opt.attach(chain)
    homes = [c.home.value for c in opt.plan.all_chunks]
    resident = [i for c in opt.plan.all_chunks if c.home.value == "device" for i in c.params]
    assert homes.count("device") > opt.num_slots and "host" in homes
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 1)
    chain()
    set_grads(params, make_grads(params, 1))
    opt.step()
    run = internals(opt).schedule.deferred
    assert run is not None and all(c.home.value == "host" for c in run.chunks[run.next :])
    for i in resident:  # updated when step() returns, before the forward asks for them
        assert_equal(ref_params[i], params[i], f"param {i}")
    opt.zero_grad(set_to_none=True)
    chain()
    run_steps(ref, ref_params, 1, first_step=2)
    set_grads(params, make_grads(params, 2))
    opt.step()
    chain()
    opt.zero_grad()
    assert_pair_equal(ref, ref_params, opt, params)


def test_a_step_with_fewer_chunks_than_slots_enqueues_them_all() -> None:
    params, ref_params = make_params([(16, 16)] * 3), make_params([(16, 16)] * 3)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=1.0, overlap=True, num_slots=3)
    opt.attach(Chain(params))
    assert len(opt.plan.all_chunks) == 1
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 3)
    assert internals(opt).schedule is not None and internals(opt).schedule.deferred is None
    assert_pair_equal(ref, ref_params, opt, params)


def _write_state(o: Any, ps: list) -> None:
    o.state[ps[-1]]["exp_avg"] = torch.full_like(ps[-1], 0.25)


BETWEEN: dict[str, Any] = {
    "nothing": lambda o, ps, saved: None,
    "wait_step": lambda o, ps, saved: o.wait_step(),
    "synchronize": lambda o, ps, saved: o.synchronize(),
    "stats": lambda o, ps, saved: o.stats,
    "state_dict": lambda o, ps, saved: o.state_dict(),
    "load_state_dict": lambda o, ps, saved: o.load_state_dict(copy.deepcopy(saved)),  # torch keeps its tensors
    "state_write": lambda o, ps, saved: _write_state(o, ps),
    "offload_reload": lambda o, ps, saved: (o.offload(), o.reload()),
    "prefetch": lambda o, ps, saved: o.prefetch(),
    "zero_in_place": lambda o, ps, saved: o.zero_grad(set_to_none=False),
    "step_again": lambda o, ps, saved: None,  # the next step() comes before any forward
}


@pytest.mark.parametrize("between", list(BETWEEN))
def test_a_deferred_step_is_finished_by_whatever_comes_before_the_forward(between: str) -> None:
    """Every call that reads or writes what the step changes enqueues the deferred chunks first."""
    ref, ref_params, opt, params, chain = _deferringadamw_pair()
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ref, opt)]
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 2)
    saved_ref, saved = copy.deepcopy(ref.state_dict()), opt.state_dict(snapshot=True)
    for step in range(2, 5):
        for o, ps, sched, snapshot in ((ref, ref_params, scheds[0], saved_ref), (opt, params, scheds[1], saved)):
            set_grads(ps, make_grads(ps, step))
            o.step()
            o.zero_grad(set_to_none=True)
            sched.step()  # the deferred chunks still step with the lr of their step
            if o is opt:
                assert internals(opt).schedule is not None and internals(opt).schedule.deferred is not None
            if o is opt or between in ("state_dict", "load_state_dict", "state_write", "zero_in_place"):
                BETWEEN[between](o, ps, snapshot)
            if o is opt and between not in ("nothing", "step_again"):
                assert internals(opt).schedule.deferred is None
            if o is opt and between != "step_again":
                chain()
    opt.wait_step()
    assert_pair_equal(ref, ref_params, opt, params)


def test_removing_the_attach_handle_enqueues_a_deferred_step() -> None:
    ref, ref_params, opt, params, _ = _deferringadamw_pair()
    first = next(iter(internals(opt).gate.gated))
    handle = opt.attach(Chain(params))  # a second model over the same params
    del internals(opt).gate.gated[first]  # count only this one (the first handle is never removed here)
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 2)
    set_grads(params, make_grads(params, 2))
    opt.step()
    opt.zero_grad()
    assert internals(opt).schedule is not None and internals(opt).schedule.deferred is not None
    handle.remove()
    assert internals(opt).schedule.deferred is None and internals(opt).gate.attached == 0
    assert_pair_equal(ref, ref_params, opt, params)


class _CountingAdamW(torch.optim.AdamW):
    """Keeps a counter in its groups, as Transformer Engine's FusedAdam keeps ``group["step"]``."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["calls"] = group.get("calls", 0) + 1
        return super().step(closure)


@pytest.mark.parametrize(
    "why", ["not_attached", "grad_scaler", "first_step", "counters", "post_hook", "inner_post_hook"]
)
def test_steps_that_cannot_defer_enqueue_every_chunk(why: str) -> None:
    params = make_params([(16, 16)] * 12)
    inner_type = _CountingAdamW if why == "counters" else torch.optim.AdamW
    inner = inner_type(params, lr=1e-2, fused=why == "grad_scaler")
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=4 * _KIB, overlap=True)
    if why != "not_attached":
        opt.attach(Chain(params))
    if why != "first_step":
        run_steps(opt, params, 1)
    seen: list[float] = []
    if why == "post_hook":
        opt.register_step_post_hook(lambda o, args, kwargs: seen.append(float(params[-1].detach().sum())))
    if why == "inner_post_hook":
        inner.register_step_post_hook(lambda o, args, kwargs: seen.append(float(params[-1].detach().sum())))
    before = float(params[-1].detach().sum())
    set_grads(params, make_grads(params, 1))
    if why == "grad_scaler":
        opt.grad_scale = torch.ones(())  # what GradScaler sets on a fused optimizer before step()
        opt.found_inf = torch.zeros(())
    opt.step()
    assert internals(opt).schedule is not None and internals(opt).schedule.deferred is None
    if why == "counters":
        assert opt.param_groups[0]["calls"] == 2  # once per outer step, as a plain step would count
    if why.endswith("post_hook"):
        assert seen and seen[-1] != before  # the hook saw the last param updated


@pytest.mark.parametrize("context", ["autocast", "inference_mode", "no_grad"])
def test_deferred_chunks_step_as_inside_step_whatever_the_forward_runs_under(context: str) -> None:
    """An evaluation or autocast forward right after step() runs deferred chunks: they see step()'s own context."""
    import warnings

    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref = _MatmulMomentum(ref_params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic adapter says it probed the state layout
        opt = ChunkedOffloadOptimizer(_MatmulMomentum(params), chunk_size_mb=2 * _KIB, overlap=True)
    chain = Chain(params)
    opt.attach(chain)
    run_steps(ref, ref_params, 5)
    run_steps(opt, params, 2)
    for step in range(2, 5):
        set_grads(params, make_grads(params, step))
        opt.step()
        opt.zero_grad()
        assert internals(opt).schedule is not None and internals(opt).schedule.deferred is not None
        if context == "autocast":
            ctx: Any = torch.autocast("cpu", dtype=torch.bfloat16)
        else:
            ctx = torch.inference_mode() if context == "inference_mode" else torch.no_grad()
        with ctx:
            chain()
        assert internals(opt).schedule.deferred is None
    opt.synchronize()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)


def test_a_wrapper_dropped_with_deferred_chunks_still_updates_its_params() -> None:
    ref, ref_params, opt, params, chain = _deferringadamw_pair()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 2)
    set_grads(params, make_grads(params, 2))
    opt.step()
    assert opt.phase is Phase.DEFERRED
    del opt, chain  # nothing will ask for the deferred chunks: the wrapper's finalizer enqueues them
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
