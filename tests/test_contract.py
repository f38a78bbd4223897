"""The Optimizer contract, hardened: one regression test per finding of the contract issue, on the CPU."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, IncompatibleStateError
from chunked_offload.host_arena import HostArena
from reference import (
    ODD_SHAPES,
    assert_equal,
    assert_runs_match,
    assert_states_equal,
    internals,
    make_grads,
    make_params,
    run_steps,
    set_grads,
)


def _pair(make: Any, shapes: list[tuple[int, ...]] = ODD_SHAPES, dtype: torch.dtype = torch.float32, **kw: Any) -> Any:
    ref_params, params = make_params(shapes, dtype), make_params(shapes, dtype)
    return make(ref_params), ref_params, ChunkedOffloadOptimizer(make(params), **kw), params


def _assert_same(ref: Any, ref_params: Any, opt: Any, params: Any) -> None:
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)


# 1 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1}, {"momentum": 0.0, "nesterov": False}])
def test_optimizer_without_state_matches_unwrapped(kw: dict[str, Any]) -> None:
    ref, ref_params, opt, params = _pair(lambda ps: torch.optim.SGD(ps, lr=0.1, **kw), chunk_size_mb=0.001)
    assert all(c.state_nbytes == 0 for c in opt.plan.chunks)  # every chunk moves 0 bytes
    assert_runs_match(ref, ref_params, opt, params, 10, none_every=3)


# 2, 3 --------------------------------------------------------------------------------------------------------------
class _FailOnce(torch.optim.AdamW):
    """AdamW whose step raises once, on its first call (a chunk's first step), after or before updating."""

    def __init__(self, params: Any, *, after: bool = False, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.armed, self.after = False, after

    def step(self, closure: Any = None) -> Any:
        if self.armed and not self.after:
            self.armed = False
            raise RuntimeError("injected")
        out = super().step(closure)
        if self.armed:
            self.armed = False
            raise RuntimeError("injected")
        return out


@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["offloaded", "resident"])
@pytest.mark.parametrize("after", [False, True], ids=["before-update", "after-update"])
def test_failed_first_step_leaves_no_state_and_a_usable_wrapper(after: bool, fraction: float) -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    inner = _FailOnce(params, after=after, lr=1e-2)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=1024, offload_fraction=fraction)
    set_grads(params, make_grads(params, 0))
    inner.armed = True
    with pytest.raises(RuntimeError, match="injected") as info:
        opt.step()
    assert "was rolled back" in "".join(getattr(info.value, "__notes__", []))
    assert len(opt.state) == 0  # no half-initialised entries (plain torch: zeros; garbage would be 3.4e38)
    assert all(s.state.value == "free" for s in internals(opt).pool.slots)
    _assert_same(ref, ref_params, opt, params)  # nothing stepped
    assert_runs_match(ref, ref_params, opt, params, 5)  # the retry and later steps match plain torch


# 4 ---------------------------------------------------------------------------------------------------------------
def test_interrupt_between_inner_step_and_write_back_rolls_the_chunk_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunked_offload import stepping

    ref, ref_params, opt, params = _pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), chunk_size_mb=1024)
    assert_runs_match(ref, ref_params, opt, params, 3)
    rescan = stepping.ChunkStepper.rescan

    def interrupted(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(stepping.ChunkStepper, "rescan", interrupted)
    set_grads(params, make_grads(params, 3))
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.setattr(stepping.ChunkStepper, "rescan", rescan)
    _assert_same(ref, ref_params, opt, params)  # params, step counters and moments: none advanced
    assert_runs_match(ref, ref_params, opt, params, 3, first_step=3)


# 5 ---------------------------------------------------------------------------------------------------------------
def test_writes_into_state_take_effect_as_with_plain_torch() -> None:
    ref, ref_params, opt, params = _pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), chunk_size_mb=0.001)
    assert_runs_match(ref, ref_params, opt, params, 2)
    t = torch.randn(params[2].shape)
    for o, ps in ((ref, ref_params), (opt, params)):
        o.state[ps[2]]["exp_avg"] = t.clone()  # one key
        o.state[ps[3]] = {k: v.clone() * (2 if v.dim() else 1) for k, v in o.state[ps[3]].items()}  # a whole entry
    assert opt.state[params[2]]["exp_avg"].data_ptr() != t.data_ptr()  # copied into its host home at once
    assert_runs_match(ref, ref_params, opt, params, 2, first_step=2)
    sd = ref.state_dict()
    ref.load_state_dict(copy.deepcopy(sd))
    opt.inner.load_state_dict(copy.deepcopy(sd))  # the inner's own load swaps its whole state container
    assert_runs_match(ref, ref_params, opt, params, 2, first_step=4)


# 6 (the CPU half: the GPU half with Lightning and accelerate is in tests/cuda) --------------------------------------
def test_tensors_moved_one_by_one_are_absorbed_into_their_homes() -> None:
    ref, ref_params, opt, params = _pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), chunk_size_mb=0.001)
    assert_runs_match(ref, ref_params, opt, params, 2)
    homes = {(id(p), k): v for p in params for k, v in opt.state[p].items()}
    for entry in opt.state.values():  # what Lightning's _optimizer_to_device does on resume
        for key, value in entry.items():
            if key != "step":
                entry[key] = value.clone()
    assert all(opt.state[p][k] is v for (pid, k), v in homes.items() for p in params if id(p) == pid)
    sd = opt.state_dict()
    moved = {pid: type(e)({k: v.clone() for k, v in e.items()}) for pid, e in sd["state"].items()}  # accelerate
    assert all(type(e) is type(sd["state"][0]) for e in moved.values())
    opt.load_state_dict({"state": moved, "param_groups": sd["param_groups"]})
    assert_runs_match(ref, ref_params, opt, params, 2, first_step=2)


# 7 ---------------------------------------------------------------------------------------------------------------
def test_hooks_registered_on_the_inner_before_wrapping_fire_once() -> None:
    params = make_params(ODD_SHAPES)
    inner = torch.optim.AdamW(params, lr=1e-2)
    calls: dict[str, int] = {}

    def count(name: str) -> Any:
        return lambda *args: calls.__setitem__(name, calls.get(name, 0) + 1)

    inner.register_step_pre_hook(count("step_pre"))
    inner.register_step_post_hook(count("step_post"))
    inner.register_state_dict_pre_hook(count("sd_pre"))
    inner.register_state_dict_post_hook(count("sd_post"))
    inner.register_load_state_dict_pre_hook(count("load_pre"))
    inner.register_load_state_dict_post_hook(count("load_post"))
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=0.001)
    assert len(opt.plan.chunks) > 1
    run_steps(opt, params, 2)
    opt.load_state_dict(opt.state_dict())
    assert calls == {"step_pre": 2, "step_post": 2, "sd_pre": 1, "sd_post": 1, "load_pre": 1, "load_post": 1}


# 8 ---------------------------------------------------------------------------------------------------------------
def test_a_shallow_copy_is_refused_and_points_to_deepcopy() -> None:
    """deepcopy, pickle and torch.save make a new wrapper (tests/test_copy.py); a shallow copy would share the arena."""
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)))
    with pytest.raises(TypeError, match=r"copy.deepcopy\(opt\)"):
        copy.copy(opt)


# 9 ---------------------------------------------------------------------------------------------------------------
def test_duplicate_params_and_double_wrapping_are_refused() -> None:
    params = make_params(ODD_SHAPES)
    with pytest.warns(UserWarning, match="duplicate"), pytest.raises(ValueError, match="is also param 0 of group 0"):
        ChunkedOffloadOptimizer(torch.optim.AdamW([params[0], params[1], params[0]]))
    inner = torch.optim.AdamW(params)
    opt = ChunkedOffloadOptimizer(inner)
    with pytest.raises(ValueError, match="already wrapped by a live ChunkedOffloadOptimizer"):
        ChunkedOffloadOptimizer(inner)
    with pytest.raises(ValueError, match="appear in more than one parameter group"):
        opt.add_param_group({"params": [make_params([(3,)])[0], params[1]]})
    assert len(opt.param_groups) == 1
    del opt
    ChunkedOffloadOptimizer(inner)  # once the first wrapper is gone, wrapping again is fine


# 10 --------------------------------------------------------------------------------------------------------------
def test_params_that_are_slices_with_gaps_match_unwrapped() -> None:
    def sliced(seed: int) -> list[torch.nn.Parameter]:
        w = torch.randn(9, 10, generator=torch.Generator().manual_seed(seed))
        return [torch.nn.Parameter(w[:, :4]), torch.nn.Parameter(w[:, 4:]), torch.nn.Parameter(w.t()[2:5])]

    ref_params, params = sliced(0), sliced(0)
    assert not params[0].is_contiguous()
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=1024)
    assert_runs_match(ref, ref_params, opt, params, 10)
    for spec in opt.plan.bundles[0].specs:  # planned dense, as zeros_like makes the state
        assert spec.stride in ((4, 1), (1,))


# 11 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("master_weights", ["none", "fp32"])
def test_zero_dim_params_round_trip_checkpoints(master_weights: str) -> None:
    dtype = torch.float32 if master_weights == "none" else torch.bfloat16
    shapes = [(), (3, 4), ()]
    params = make_params(shapes, dtype)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), master_weights=master_weights)
    run_steps(opt, params, 3)
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    again = make_params(shapes, dtype)
    with torch.no_grad():
        for a, b in zip(again, params, strict=True):
            a.copy_(b)
    plain_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    torch.optim.AdamW(plain_params, lr=1e-2).load_state_dict(sd)  # and a plain optimizer takes it
    other = ChunkedOffloadOptimizer(torch.optim.AdamW(again, lr=1e-2), master_weights=master_weights)
    other.load_state_dict(sd)
    run_steps(opt, params, 2, first_step=3)
    run_steps(other, again, 2, first_step=3)
    for a, b in zip(params, again, strict=True):
        assert_equal(a, b)


# 12 --------------------------------------------------------------------------------------------------------------
def _unchanged(opt: ChunkedOffloadOptimizer, params: list[torch.nn.Parameter]) -> Any:
    before = ([p.detach().clone() for p in params], opt.state_dict(snapshot=True))

    def check() -> None:
        for a, b in zip(before[0], params, strict=True):
            assert_equal(a, b)
        now = opt.state_dict(snapshot=True)
        for pid, entry in before[1]["state"].items():
            for k, v in entry.items():
                assert_equal(v, now["state"][pid][k], f"{pid}/{k}")

    return check


@pytest.mark.parametrize("change", ["amsgrad", "resize", "to-bf16", "rmsprop-centered"])
def test_changes_that_plain_torch_cannot_step_are_refused_before_anything_moves(change: str) -> None:
    make = (lambda ps: torch.optim.RMSprop(ps, lr=1e-2)) if change.startswith("rmsprop") else None
    make = make or (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    ref, ref_params, opt, params = _pair(make, chunk_size_mb=0.001)
    assert_runs_match(ref, ref_params, opt, params, 2)
    for o, ps in ((ref, ref_params), (opt, params)):
        if change == "amsgrad":
            o.param_groups[0]["amsgrad"] = True
        elif change == "rmsprop-centered":
            o.param_groups[0]["centered"] = True
        elif change == "resize":
            ps[4].data = torch.zeros(65, 129)
        else:
            ps[4].data = ps[4].data.bfloat16()  # what model.to(torch.bfloat16) does to each param
        set_grads(ps, [g.to(p.dtype).expand(p.shape).clone() for g, p in zip(make_grads(ps, 2), ps, strict=True)])
    check = _unchanged(opt, params)
    with pytest.raises((KeyError, RuntimeError)) as plain:  # plain torch fails on this too
        ref.step()
    with pytest.raises(IncompatibleStateError) as wrapped:
        opt.step()
    if isinstance(plain.value, KeyError):
        assert isinstance(wrapped.value, KeyError)  # code that catches torch's KeyError still does
    check()  # nothing stepped: no double step after the user fixes the cause and retries


def test_amsgrad_switched_off_keeps_its_state_as_plain_torch_does() -> None:
    ref, ref_params, opt, params = _pair(lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True), chunk_size_mb=0.001)
    assert_runs_match(ref, ref_params, opt, params, 3)
    for o in (ref, opt):
        o.param_groups[0]["amsgrad"] = False
    assert_runs_match(ref, ref_params, opt, params, 3, first_step=3)
    assert "max_exp_avg_sq" in opt.state[params[0]]


@pytest.mark.parametrize("change", ["resize-fresh", "momentum-on", "new-param"])
def test_changes_that_plain_torch_carries_on_with_are_replanned(change: str) -> None:
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True)  # noqa: E731
    ref, ref_params, opt, params = _pair(make, chunk_size_mb=0.001)
    assert_runs_match(ref, ref_params, opt, params, 2)
    extra_ref, extra = make_params([(5, 5)], seed=9), make_params([(5, 5)], seed=9)
    for o, ps, ex in ((ref, ref_params, extra_ref), (opt, params, extra)):
        if change == "resize-fresh":
            ps[1].data = torch.randn(103, generator=torch.Generator().manual_seed(4))
        elif change == "momentum-on":
            o.param_groups[0]["momentum"] = 0.9
        else:
            o.param_groups[0]["params"].append(ex[0])
            ps.append(ex[0])
    assert_runs_match(ref, ref_params, opt, params, 4, first_step=2)


def test_wrong_grad_is_refused_before_any_chunk_steps() -> None:
    ref, ref_params, opt, params = _pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), chunk_size_mb=0.001)
    assert_runs_match(ref, ref_params, opt, params, 2)
    check = _unchanged(opt, params)
    set_grads(params, make_grads(params, 2))
    params[5].grad.data = torch.zeros(3, dtype=torch.float64)  # .data bypasses autograd's own check
    with pytest.raises(RuntimeError, match=r"param 5 .* has a grad of shape \(3,\), dtype torch.float64"):
        opt.step()
    check()


# 13 --------------------------------------------------------------------------------------------------------------
def test_load_that_fails_to_replan_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    params = make_params(ODD_SHAPES)
    opt = ChunkedOffloadOptimizer(torch.optim.Adam(params, lr=1e-2), chunk_size_mb=0.001)
    run_steps(opt, params, 2)
    donor = torch.optim.Adam(make_params(ODD_SHAPES), lr=0.5, amsgrad=True)  # adds state: a new layout
    run_steps(donor, donor.param_groups[0]["params"], 2)
    check = _unchanged(opt, params)

    def no_memory(self: Any, nbytes: int, **kwargs: Any) -> None:
        raise RuntimeError("the host arena needs more host RAM (injected)")

    monkeypatch.setattr(HostArena, "__init__", no_memory)
    with pytest.raises(RuntimeError, match="injected"):
        opt.load_state_dict(donor.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-2 and not opt.param_groups[0]["amsgrad"]
    check()  # no foreign tensor adopted


# 14 --------------------------------------------------------------------------------------------------------------
def test_params_edited_after_wrapping_rule_both_master_modes_alike() -> None:
    runs = {}
    for mode in ("fp32", "remainder"):
        params = make_params(ODD_SHAPES, torch.bfloat16)
        opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=0.001, master_weights=mode)
        pretrained = make_params(ODD_SHAPES, torch.bfloat16, seed=5)
        with torch.no_grad():  # loading pretrained weights after wrapping, before the first step
            for p, q in zip(params, pretrained, strict=True):
                p.copy_(q)
        for p, m in opt.master_params():
            assert_equal(m, p.detach().float())  # the master is the edited param exactly
        run_steps(opt, params, 4)
        with torch.no_grad():  # an edit mid-training: a row zeroed by hand
            params[4][0].zero_()
        run_steps(opt, params, 4, first_step=4)
        runs[mode] = (params, dict((id(p), m.clone()) for p, m in opt.master_params()))
    (p32, m32), (prem, mrem) = runs["fp32"], runs["remainder"]
    for a, b in zip(p32, prem, strict=True):
        assert_equal(a, b)
        assert_equal(m32[id(a)], mrem[id(b)])


# 15 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("foreach", [True, False])
def test_bf16_sgd_momentum_with_late_first_grads_matches_unwrapped(foreach: bool) -> None:
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=foreach)  # noqa: E731
    ref, ref_params, opt, params = _pair(make, dtype=torch.bfloat16, chunk_size_mb=0.001)
    assert len(opt.plan.chunks) > 2
    for step in range(8):
        for o, ps in ((ref, ref_params), (opt, params)):
            grads = make_grads(ps, step)
            set_grads(ps, [None if (i % 3 == 1 and step < 2 + i) else g for i, g in enumerate(grads)])
            o.step()
    _assert_same(ref, ref_params, opt, params)


def test_fused_sgd_with_mixed_buffers_fails_like_plain_torch_before_anything_moves() -> None:
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)  # noqa: E731
    ref, ref_params, opt, params = _pair(make, chunk_size_mb=0.001)
    for o, ps in ((ref, ref_params), (opt, params)):
        set_grads(ps, [None if i == 2 else g for i, g in enumerate(make_grads(ps, 0))])
        o.step()
        set_grads(ps, make_grads(ps, 1))
    with pytest.raises(TypeError):
        ref.step()
    check = _unchanged(opt, params)
    with pytest.raises(TypeError, match="fused SGD cannot step param group 0"):
        opt.step()
    check()


# 16 --------------------------------------------------------------------------------------------------------------
def test_differentiable_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="differentiable=True"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES), differentiable=True))


# 17 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "fp32", "remainder"])
def test_a_saved_checkpoint_holds_the_state_and_nothing_else(mode: str) -> None:
    dtype = torch.float32 if mode == "none" else torch.bfloat16
    params = make_params([(256, 256)] * 6 + [(1000,)], dtype)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=0.6, master_weights=mode)
    run_steps(opt, params, 2)
    sd = opt.state_dict()
    payload = sum(v.numel() * v.element_size() for e in sd["state"].values() for v in e.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    assert len(buf.getvalue()) <= 1.01 * payload
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert loaded["state"][0].keys() == sd["state"][0].keys()


# Group-level counters (Transformer Engine keeps its step in param_groups) ----------------------------------------
class _GroupStepAdam(torch.optim.Adam):
    """Advances ``group["step"]`` for every group on every call, params or not, as TE 2.20's FusedAdam does."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        return super().step(closure)


def test_group_counters_advance_once_per_step_for_every_group() -> None:
    from chunked_offload import KeyedAdapter

    def make(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return _GroupStepAdam([{"params": ps[:4]}, {"params": []}, {"params": ps[4:], "lr": 3e-3}], lr=1e-2)

    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref, inner = make(ref_params), make(params)
    adapter = KeyedAdapter(inner, lambda g: ["exp_avg", "exp_avg_sq"], "group-step")
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=0.001, adapter=adapter)
    assert len(opt.plan.chunks) > 3
    for step in range(6):
        for o, ps in ((ref, ref_params), (opt, params)):
            grads = make_grads(ps, step)
            if step == 2:
                grads = [None] * len(grads)  # no grads at all: the inner is still called, as plain torch would be
            elif step == 4:
                grads = [g if i >= 4 else None for i, g in enumerate(grads)]  # one group without grads
            set_grads(ps, grads)
            o.step()
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in ref.param_groups] == [6, 6, 6]
    _assert_same(ref, ref_params, opt, params)


def test_a_param_replaced_in_place_in_param_groups_is_replanned() -> None:
    ref, ref_params, opt, params = _pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), chunk_size_mb=0.001)
    assert_runs_match(ref, ref_params, opt, params, 2)
    for o, ps in ((ref, ref_params), (opt, params)):
        ps[2] = make_params([ps[2].shape], seed=11)[0]  # same shape and position, another tensor
        o.param_groups[0]["params"][2] = ps[2]
    assert_runs_match(ref, ref_params, opt, params, 3, first_step=2)
