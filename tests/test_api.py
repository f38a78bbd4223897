"""The wrapper's API: it is an Optimizer, it shares the inner's objects, and bad input gets a clear error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, KeyedAdapter
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


def _opt(**kwargs: Any) -> tuple[ChunkedOffloadOptimizer, list[torch.nn.Parameter]]:
    params = make_params(ODD_SHAPES)
    return ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), **kwargs), params


def test_is_an_optimizer_sharing_the_inner_objects() -> None:
    opt, params = _opt()
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.inner.param_groups
    assert opt.state is opt.inner.state
    assert opt.defaults is opt.inner.defaults
    assert "ChunkedOffloadOptimizer(inner=AdamW" in repr(opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run_steps(opt, params, 1)
    scheduler.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_step_hooks_run_once_per_step_and_closure_is_evaluated() -> None:
    opt, params = _opt(chunk_size_mb=0.004)
    calls = {"pre": 0, "post": 0, "inner": 0}
    opt.register_step_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda *a: calls.__setitem__("post", calls["post"] + 1))
    opt.inner.register_step_pre_hook(lambda *a: calls.__setitem__("inner", calls["inner"] + 1))
    assert len(opt.plan.chunks) > 1

    def closure() -> torch.Tensor:
        set_grads(params, make_grads(params, 0))
        return torch.tensor(3.0)

    assert opt.step(closure).item() == 3.0
    assert calls == {"pre": 1, "post": 1, "inner": 1}  # the inner's own hooks fire once per step, not per chunk


def test_zero_grad_and_add_param_group_act_on_the_inner() -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    extra_ref, extra = make_params([(9, 4), (6,)], seed=5), make_params([(9, 4), (6,)], seed=5)
    ref = torch.optim.Adam(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.Adam(params, lr=1e-2), chunk_size_mb=0.004)
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 3)
    ref.add_param_group({"params": extra_ref, "lr": 3e-3})
    opt.add_param_group({"params": extra, "lr": 3e-3})
    assert len(opt.inner.param_groups) == 2
    run_steps(ref, ref_params + extra_ref, 5, first_step=3)
    run_steps(opt, params + extra, 5, first_step=3)
    for a, b in zip(ref_params + extra_ref, params + extra, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params + extra_ref, opt, params + extra)
    set_grads(params, make_grads(params, 0))
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_offload_and_reload_keep_the_run_exact() -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=0.004, offload_fraction=0.5)
    run_steps(ref, ref_params, 4)
    run_steps(opt, params, 2)
    opt.offload()
    assert not internals(opt).pool.allocated
    run_steps(opt, params, 1, first_step=2)  # steps reload on their own
    opt.offload()
    opt.reload()
    run_steps(opt, params, 1, first_step=3)
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params, opt, params)


def test_grad_scaler_forwarding_matches_unwrapped_fused() -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), chunk_size_mb=0.004)
    assert opt._step_supports_amp_scaling
    scalers = {id(o): torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2) for o in (ref, opt)}
    for step in range(8):
        for o, ps in ((ref, ref_params), (opt, params)):
            scaler = scalers[id(o)]
            scale = scaler.scale(torch.ones(())).item()  # what the loss would be multiplied by
            grads = make_grads(ps, step)
            if step == 3:  # an overflow: the fused kernels must skip the update and leave the state as it was
                grads[0] = torch.full_like(ps[0], float("inf"))
            set_grads(ps, [g * scale for g in grads])
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        assert not hasattr(opt.inner, "grad_scale") and not hasattr(opt.inner, "found_inf")
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params, opt, params)


class _NotAnOptimizer:
    pass


@pytest.mark.parametrize(
    "inner, error, match",
    [
        ("params", TypeError, "wraps an optimizer instance, got list"),
        (_NotAnOptimizer(), TypeError, "must be a torch.optim.Optimizer instance, got _NotAnOptimizer"),
    ],
)
def test_non_optimizers_are_rejected(inner: Any, error: type, match: str) -> None:
    if inner == "params":
        inner = make_params(ODD_SHAPES)
    with pytest.raises(error, match=match):
        ChunkedOffloadOptimizer(inner)


def test_wrapping_a_wrapper_is_rejected() -> None:
    opt, _ = _opt()
    with pytest.raises(TypeError, match="already a ChunkedOffloadOptimizer"):
        ChunkedOffloadOptimizer(opt)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"chunk_size_mb": 0}, ValueError, "chunk_size_mb must be a finite number > 0, got 0"),
        ({"chunk_size_mb": float("inf")}, ValueError, "chunk_size_mb must be a finite number > 0"),
        ({"chunk_size_mb": "64"}, TypeError, "chunk_size_mb must be a number of MiB, got str"),
        ({"offload_fraction": 1.5}, ValueError, r"offload_fraction must be in \[0, 1\], got 1.5"),
        ({"offload_fraction": -0.1}, ValueError, r"offload_fraction must be in \[0, 1\]"),
        ({"num_slots": 0}, ValueError, "num_slots must be an int >= 1, got 0"),
        ({"num_slots": 2.0}, ValueError, "num_slots must be an int >= 1, got 2.0"),
        ({"pin_memory": "yes"}, TypeError, "pin_memory must be True, False or None"),
        ({"pin_memory": True}, ValueError, "pin_memory=True needs params on a CUDA device"),
        ({"master_weights": "fp16"}, ValueError, "master_weights must be one of"),
    ],
)
def test_bad_options_are_rejected(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _opt(**kwargs)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ps: torch.optim.LBFGS(ps), "keeps one history over the flattened gradient"),
        (lambda ps: torch.optim.SparseAdam(ps), "needs sparse gradients"),
    ],
)
def test_unchunkable_optimizers_are_refused(make: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        ChunkedOffloadOptimizer(make(make_params(ODD_SHAPES)))


def test_lamb_like_names_are_refused() -> None:
    class FusedLAMB(torch.optim.Adam):
        pass

    with pytest.raises(TypeError, match="global gradient norm"):
        ChunkedOffloadOptimizer(FusedLAMB(make_params(ODD_SHAPES)))


def test_sparse_gradients_are_rejected_at_step() -> None:
    opt, params = _opt()
    params[1].grad = torch.randn(params[1].shape).to_sparse()
    with pytest.raises(RuntimeError, match=r"param 1 \(shape \(101,\).*\) has a torch.sparse_coo gradient"):
        opt.step()


def test_params_on_two_devices_are_rejected() -> None:
    params = make_params(ODD_SHAPES)
    params[0] = torch.nn.Parameter(params[0].detach().to("meta"))
    with pytest.raises(ValueError, match="all params must be on one device"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(params))


def test_editing_param_groups_by_hand_matches_unwrapped() -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    extra_ref, extra = make_params([(4, 6)], seed=3), make_params([(4, 6)], seed=3)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=0.004)
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 2)
    for o, e in ((ref, extra_ref), (opt, extra)):  # as plain torch carries on, so does the wrapper (it re-plans)
        o.param_groups[0]["params"].append(e[0])
    run_steps(ref, ref_params + extra_ref, 3, first_step=2)
    run_steps(opt, params + extra, 3, first_step=2)
    for a, b in zip(ref_params + extra_ref, params + extra, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params + extra_ref, opt, params + extra)


def test_unknown_optimizers_use_the_probing_adapter_with_a_warning() -> None:
    from chunked_offload import ChunkedOffloadWarning

    class MyAdam(torch.optim.Adam):
        pass

    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    with pytest.warns(ChunkedOffloadWarning, match="probing its state layout") as record:
        opt = ChunkedOffloadOptimizer(MyAdam(params, lr=1e-2), chunk_size_mb=0.004)
    assert record[0].filename == __file__  # the warning points at the line that built the wrapper
    assert opt.adapter.name == "generic"
    ref = torch.optim.Adam(ref_params, lr=1e-2)
    run_steps(ref, ref_params, 5)
    run_steps(opt, params, 5)
    assert_states_equal(ref, ref_params, opt, params)


def test_an_adapter_that_mispredicts_the_state_fails_loudly() -> None:
    params = make_params(ODD_SHAPES)
    inner = torch.optim.Adam(params)
    opt = ChunkedOffloadOptimizer(inner, adapter=KeyedAdapter(inner, lambda g: ["exp_avg"], "wrong"))
    with pytest.raises(RuntimeError, match=r"created state \['exp_avg_sq'\] for param 0, which the chunk plan"):
        run_steps(opt, params, 1)


def test_adapter_for_another_optimizer_is_rejected() -> None:
    params = make_params(ODD_SHAPES)
    other = torch.optim.Adam(make_params(ODD_SHAPES))
    with pytest.raises(ValueError, match="adapter was built for a different optimizer"):
        ChunkedOffloadOptimizer(torch.optim.Adam(params), adapter=KeyedAdapter(other, lambda g: [], "x"))


def test_amsgrad_switched_on_for_fresh_state_is_planned_automatically() -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=0.004)
    for o, ps in ((ref, ref_params), (opt, params)):
        run_steps(o, ps, 1)
        for g in o.param_groups:
            g["amsgrad"] = True
        o.state.clear()  # a fresh start with amsgrad: state gains max_exp_avg_sq
        run_steps(o, ps, 3, first_step=1)
    assert "max_exp_avg_sq" in opt.state[params[0]]
    assert_states_equal(ref, ref_params, opt, params)


def test_settings_that_do_nothing_say_so_once_with_a_filterable_category() -> None:
    import warnings

    from chunked_offload import ChunkedOffloadWarning

    model = torch.nn.Linear(4, 4)
    with pytest.warns(ChunkedOffloadWarning, match="master_weights='fp32' does nothing here.*float32"):
        opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), master_weights="fp32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.attach(model)
        opt.attach(model)
        with opt.accumulating():
            model(torch.ones(2, 4)).sum().backward()
        with opt.accumulating():
            pass
    messages = [str(w.message) for w in record if issubclass(w.category, ChunkedOffloadWarning)]
    assert len(messages) == 2, messages  # each once per wrapper, even under "always"
    assert "attach(model) does nothing without overlap=True" in messages[0]
    assert "accumulating() does nothing without step_in_backward=True" in messages[1]
    assert all(w.filename == __file__ for w in record)  # they point at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=ChunkedOffloadWarning)  # users can silence them
        ChunkedOffloadOptimizer(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), master_weights="fp32")
