"""Inside the training iteration: the GPU budget, overlap and attach, prefetch, async offload/reload, telemetry.

On the CPU the overlapped step runs synchronously through the same code; these tests prove the logic, the
bitwise results and the refusals. The stream races are in tests/cuda/test_iteration_cuda.py.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, Home, Phase
from reference import ODD_SHAPES, assert_equal, assert_states_equal, make_grads, make_params, run_steps, set_grads

_KIB = 1 / 1024  # MiB


def _pair(**kwargs: Any) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], ChunkedOffloadOptimizer, list]:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    kwargs.setdefault("chunk_size_mb", 4 * _KIB)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), **kwargs)
    return ref, ref_params, opt, params


def _assert_same(ref: torch.optim.Optimizer, ref_params: list, opt: ChunkedOffloadOptimizer, params: list) -> None:
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)


# ---------------------------------------------------------------------- gpu_budget_mb
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


def test_a_budget_below_the_window_names_both_numbers() -> None:
    window = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), chunk_size_mb=0.05).plan
    expected = (
        rf"2 slots x {window.slot_nbytes / 2**20:.2f} MiB.*chunk 0.05 MiB.* = {window.window_bound_nbytes / 2**20:.2f}"
    )
    with pytest.raises(ValueError, match=r"gpu_budget_mb=0.00 is below the staging window .*" + expected):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), chunk_size_mb=0.05, gpu_budget_mb=0)


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
        assert all(c.home is Home.DEVICE for c in plan.all_chunks[: len(plan.resident_chunks)])
        del opt


@pytest.mark.parametrize("share", [0.0, 0.3, 0.7, 1.0])
def test_every_budget_is_bitwise_and_moves_fewer_bytes_as_it_grows(share: float) -> None:
    full = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), chunk_size_mb=4 * _KIB)
    window, state = full.plan.window_bound_nbytes, full.plan.host_nbytes
    del full
    budget = (window + share * (state + 4096 * len(ODD_SHAPES))) / 2**20
    ref, ref_params, opt, params = _pair(gpu_budget_mb=budget)
    run_steps(ref, ref_params, 4)
    run_steps(opt, params, 4)
    _assert_same(ref, ref_params, opt, params)
    stats = opt.stats
    assert stats is not None
    assert stats.h2d_bytes == sum(c.transfer_nbytes for c in opt.plan.chunks)
    assert stats.d2d_bytes == sum(c.transfer_nbytes for c in opt.plan.resident_chunks)
    if share == 0.0:
        assert stats.d2d_bytes == 0
    if share == 1.0:
        assert stats.h2d_bytes == 0


def test_the_budget_survives_a_replan() -> None:
    ref, ref_params, opt, params = _pair(gpu_budget_mb=1.0)
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 2)
    extra_ref, extra = make_params([(9, 9)], seed=5), make_params([(9, 9)], seed=5)
    ref.add_param_group({"params": extra_ref, "lr": 3e-3})
    opt.add_param_group({"params": extra, "lr": 3e-3})
    assert "gpu_budget_mb=1.0" in repr(opt)
    run_steps(ref, ref_params + extra_ref, 2, first_step=2)
    run_steps(opt, params + extra, 2, first_step=2)
    _assert_same(ref, ref_params + extra_ref, opt, params + extra)


# ---------------------------------------------------------------------- overlap and attach
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: read by two modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def _train(overlap: bool, attach: bool, clip: bool, steps: int = 6) -> tuple[_Net, ChunkedOffloadOptimizer]:
    torch.manual_seed(0)
    model = _Net()
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_size_mb=4 * _KIB, overlap=overlap
    )
    if attach:
        opt.attach(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 7), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.prefetch()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    opt.wait_step()
    return model, opt


@pytest.mark.parametrize("clip", [False, True])
def test_overlap_with_attach_matches_the_plain_loop(clip: bool) -> None:
    plain_model, plain = _train(overlap=False, attach=False, clip=clip)
    model, opt = _train(overlap=True, attach=True, clip=clip)
    for (name, a), b in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)
    assert_states_equal(plain, list(plain_model.parameters()), opt, list(model.parameters()))
    assert opt.stats is not None and opt.stats.exposed_seconds is not None  # on the CPU the step is synchronous


def test_overlap_without_an_attached_model_warns_once_and_stays_exact() -> None:
    from chunked_offload import ChunkedOffloadWarning

    plain_model, plain = _train(overlap=False, attach=False, clip=False)
    with pytest.warns(ChunkedOffloadWarning, match="without an attached model.*opt.attach") as record:
        model, opt = _train(overlap=True, attach=False, clip=False)
    assert sum(issubclass(w.category, ChunkedOffloadWarning) for w in record) == 1  # six steps, one warning
    for (name, a), b in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)


def test_an_attached_models_state_dict_joins_the_step() -> None:
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap=True)
    joined: list[int] = []
    opt._gate.join = lambda: joined.append(1)  # type: ignore[method-assign]
    handle = opt.attach(model)
    model.state_dict()
    assert joined, "state_dict() of an attached model did not join the step"
    joined.clear()
    model.load_state_dict(model.state_dict())
    assert joined
    handle.remove()
    joined.clear()
    model.state_dict()
    assert not joined  # the hooks go with the handle


def test_attach_hooks_every_module_with_params_once_and_can_be_removed() -> None:
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap=True)
    handle = opt.attach(model)
    with_params = [m for m in model.modules() if list(m.parameters(recurse=False))]
    assert len(handle) == len(with_params) == 4  # embed, two Linear, head (tied weight)
    assert all(len(m._forward_pre_hooks) == 1 for m in with_params)
    handle.remove()
    assert all(len(m._forward_pre_hooks) == 0 for m in with_params)
    with pytest.raises(TypeError, match="attach\\(\\) takes a torch.nn.Module, got list"):
        opt.attach([model])  # type: ignore[arg-type]


def test_overlap_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="overlap must be True or False, got 'yes'"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), overlap="yes")  # type: ignore[arg-type]


class _SeesLr(torch.optim.AdamW):
    """AdamW that records which ``lr`` object each call of its step reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_an_overlapped_step_reads_copies_of_tensor_hyperparameters() -> None:
    """A scheduler updates a tensor lr in place right after step(), while an overlapped step may still read it."""
    params, ref_params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    lr = torch.tensor(1e-2)
    inner = _SeesLr(params, lr=lr)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=4 * _KIB, overlap=True)
    ref = torch.optim.AdamW(ref_params, lr=torch.tensor(1e-2))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (opt, ref)]
    for step in range(3):
        for o, ps in ((opt, params), (ref, ref_params)):
            set_grads(ps, make_grads(ps, step))
            o.step()
            o.zero_grad()
        for sched in scheds:
            sched.step()
    assert len(inner.seen) >= 3 * len(opt.plan.chunks)
    assert all(seen is not lr for seen in inner.seen)  # every chunk read a copy, never the scheduler's tensor
    assert opt.param_groups[0]["lr"] is lr  # and the group holds the user's tensor again
    _assert_same(ref, ref_params, opt, params)


# ---------------------------------------------------------------------- deferred chunks
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


def _deferring_pair() -> tuple[torch.optim.Optimizer, list, ChunkedOffloadOptimizer, list, Chain]:
    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB, overlap=True)
    chain = Chain(params)
    opt.attach(chain)
    assert len(opt.plan.all_chunks) > opt.num_slots + 1
    return ref, ref_params, opt, params, chain


def test_a_deferred_step_enqueues_its_later_chunks_as_the_forward_reaches_them() -> None:
    ref, ref_params, opt, params, chain = _deferring_pair()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 1)  # a first step creates state on the device: it never defers
    assert opt._schedule is not None and opt._schedule.deferred is None
    set_grads(params, make_grads(params, 1))
    opt.step()
    run = opt._schedule.deferred
    assert run is not None and run.next == opt.num_slots  # only the head is enqueued
    opt.zero_grad(set_to_none=True)  # the deferred chunks keep the grads of the step
    first_deferred = run.chunks[run.next].params[0]
    for link in chain.links[: first_deferred + 1]:
        link()
    assert opt._schedule.deferred is run and run.next == opt.num_slots + 1 + opt.num_slots
    chain()  # the rest of the forward; its end enqueues whatever is left
    assert opt._schedule.deferred is None and opt.phase is not Phase.DEFERRED and not opt._pool.allocated
    set_grads(params, make_grads(params, 2))
    opt.step()
    chain()
    opt.zero_grad()
    _assert_same(ref, ref_params, opt, params)


def test_a_step_with_fewer_chunks_than_slots_enqueues_them_all() -> None:
    params, ref_params = make_params([(16, 16)] * 3), make_params([(16, 16)] * 3)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=1.0, overlap=True, num_slots=3)
    opt.attach(Chain(params))
    assert len(opt.plan.all_chunks) == 1
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 3)
    assert opt._schedule is not None and opt._schedule.deferred is None
    _assert_same(ref, ref_params, opt, params)


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
    ref, ref_params, opt, params, chain = _deferring_pair()
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
                assert opt._schedule is not None and opt._schedule.deferred is not None
            if o is opt or between in ("state_dict", "load_state_dict", "state_write", "zero_in_place"):
                BETWEEN[between](o, ps, snapshot)
            if o is opt and between not in ("nothing", "step_again"):
                assert opt._schedule.deferred is None
            if o is opt and between != "step_again":
                chain()
    opt.wait_step()
    _assert_same(ref, ref_params, opt, params)


def test_removing_the_attach_handle_enqueues_a_deferred_step() -> None:
    ref, ref_params, opt, params, _ = _deferring_pair()
    first = next(iter(opt._gate.gated))
    handle = opt.attach(Chain(params))  # a second model over the same params
    del opt._gate.gated[first]  # count only this one (the first handle is never removed here)
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 2)
    set_grads(params, make_grads(params, 2))
    opt.step()
    opt.zero_grad()
    assert opt._schedule is not None and opt._schedule.deferred is not None
    handle.remove()
    assert opt._schedule.deferred is None and opt._gate.attached == 0
    _assert_same(ref, ref_params, opt, params)


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
    assert opt._schedule is not None and opt._schedule.deferred is None
    if why == "counters":
        assert opt.param_groups[0]["calls"] == 2  # once per outer step, as a plain step would count
    if why.endswith("post_hook"):
        assert seen and seen[-1] != before  # the hook saw the last param updated


# ---------------------------------------------------------------------- prefetch
def test_prefetch_before_the_first_step_is_a_no_op() -> None:
    ref, ref_params, opt, params = _pair()
    set_grads(params, make_grads(params, 0))
    opt.prefetch()
    assert not opt._pool.allocated  # a first step creates its state on the device: nothing to bring in
    opt.zero_grad()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 3)
    _assert_same(ref, ref_params, opt, params)


def test_prefetch_is_taken_over_by_the_step() -> None:
    ref, ref_params, opt, params = _pair()
    run_steps(ref, ref_params, 5)
    run_steps(opt, params, 1)
    for step in range(1, 5):
        set_grads(params, make_grads(params, step))
        opt.prefetch()
        assert opt._pool.allocated and opt._pipeline._prefetched is not None
        opt.step()
        assert opt._pipeline._prefetched is None and not opt._pool.allocated
        opt.zero_grad()
    _assert_same(ref, ref_params, opt, params)


@pytest.mark.parametrize("between", ["grads_change", "state_write", "load_state_dict", "offload", "replan"])
def test_a_stale_prefetch_is_dropped_and_the_step_stays_exact(between: str) -> None:
    ref, ref_params, opt, params = _pair(offload_fraction=0.6)
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
    _assert_same(ref, ref_params, opt, params)
    assert not opt._pool.allocated


def test_a_prefetch_that_fails_frees_the_slots_and_the_step_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunked_offload.transfer import TransferEngine

    ref, ref_params, opt, params = _pair()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 2)
    set_grads(params, make_grads(params, 2))
    with monkeypatch.context() as patch:

        def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected H2D failure")

        patch.setattr(TransferEngine, "stage_in", failing)
        with pytest.raises(RuntimeError, match="injected H2D failure"):
            opt.prefetch()
    assert not opt._pool.allocated and opt._schedule is not None and opt._pipeline._prefetched is None
    opt.step()
    opt.zero_grad()
    _assert_same(ref, ref_params, opt, params)


# ---------------------------------------------------------------------- offload / reload handles
@pytest.mark.parametrize("non_blocking", [False, True])
def test_offload_and_reload_return_handles_and_repeat_as_no_ops(non_blocking: bool) -> None:
    ref, ref_params, opt, params = _pair(offload_fraction=0.5)
    run_steps(ref, ref_params, 4)
    run_steps(opt, params, 2)
    handle = opt.offload(non_blocking=non_blocking)
    assert opt.offload(non_blocking=non_blocking) is handle  # a second call changes nothing
    assert handle.wait().done()
    assert opt._placement.layout is not None and opt._placement.layout.resident_flat is not None
    assert opt._placement.layout.resident_flat.device.type == "cpu"
    _ = opt.state_dict()  # readable while offloaded
    again = opt.reload(non_blocking=non_blocking)
    assert opt.reload() is again
    again.wait()
    run_steps(opt, params, 2, first_step=2)
    _assert_same(ref, ref_params, opt, params)


# ---------------------------------------------------------------------- telemetry
def test_stats_count_the_bytes_of_each_step() -> None:
    ref, ref_params, opt, params = _pair(master_weights="none")
    assert opt.stats is None
    run_steps(opt, params, 1)
    first = opt.stats
    assert first is not None
    state = sum(c.transfer_nbytes for c in opt.plan.chunks)
    assert (first.chunks, first.h2d_bytes, first.d2h_bytes) == (len(opt.plan.chunks), 0, state)
    run_steps(opt, params, 1, first_step=1)
    later = opt.stats
    assert later is not None
    assert (later.h2d_bytes, later.d2h_bytes, later.d2d_bytes) == (state, state, 0)
    assert 0 < later.window_bytes <= opt.plan.window_bound_nbytes
    assert later.seconds > 0 and later.link_gbps > 0
    assert later.resident_bytes == 0 and later.pinned_host_bytes == 0  # the CPU arena is not page-locked
    set_grads(params, [None] * len(params))
    opt.step()
    assert opt.stats is not None and opt.stats.chunks == 0


def test_construction_logs_one_info_line_the_plan_at_debug_and_each_step_a_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="chunked_offload"):
        _, _, opt, params = _pair()
        run_steps(opt, params, 2)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "window bound" in infos[0] and "\n" not in infos[0]
    assert any("ChunkPlan:" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    steps = [
        r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.getMessage().startswith("step:")
    ]
    assert len(steps) == 2 and "MiB H2D" in steps[1]


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
        assert opt._schedule is not None and opt._schedule.deferred is not None
        if context == "autocast":
            ctx: Any = torch.autocast("cpu", dtype=torch.bfloat16)
        else:
            ctx = torch.inference_mode() if context == "inference_mode" else torch.no_grad()
        with ctx:
            chain()
        assert opt._schedule.deferred is None
    opt.synchronize()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)


def test_a_wrapper_dropped_with_deferred_chunks_still_updates_its_params() -> None:
    ref, ref_params, opt, params, chain = _deferring_pair()
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 2)
    set_grads(params, make_grads(params, 2))
    opt.step()
    assert opt.phase is Phase.DEFERRED
    del opt, chain  # nothing will ask for the deferred chunks: the wrapper's finalizer enqueues them
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")


class _Backwards(Chain):
    """Reads its last params first, as FSDP2's root unit all-gathers the LM head before the first layer runs."""

    def forward(self) -> torch.Tensor:
        first = [self.links[-1], self.links[-2]]
        return torch.stack([link() for link in [*first, *self.links[:-2]]]).sum()


def test_an_overlapped_step_runs_its_chunks_in_the_order_the_forward_reads_them() -> None:
    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB, overlap=True)
    model = _Backwards(params)
    opt.attach(model)
    last, second_last = len(params) - 1, len(params) - 2
    for k in range(4):
        ref.zero_grad()
        set_grads(ref_params, make_grads(ref_params, k))
        ref.step()
        model()
        set_grads(params, make_grads(params, k))
        opt.step()
        run = opt._schedule.deferred if opt._schedule is not None else None
        if k > 0:  # the first step creates state and never defers
            assert run is not None
            assert run.chunks[0].params[-1] == last and second_last in run.chunks[0].params + run.chunks[1].params
            assert opt.phase is Phase.DEFERRED
            model.links[-1]()  # the first read asks only for the head: nothing after it is enqueued yet
            assert opt._schedule.deferred is run and run.next < len(run.chunks)
        opt.zero_grad()
    model()
    _assert_same(ref, ref_params, opt, params)


def test_a_plain_step_keeps_parameter_order_whatever_the_forward_read() -> None:
    params = make_params([(16, 16)] * 12)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB)
    model = _Backwards(params)
    opt.attach(model)  # warns: nothing to gate without overlap
    for k in range(2):
        model()
        set_grads(params, make_grads(params, k))
        assert [c.index for c in opt._runner.chunks_to_step()] == sorted(c.index for c in opt.plan.all_chunks)
        opt.step()
