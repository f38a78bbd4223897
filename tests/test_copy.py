"""copy.deepcopy, pickle and torch.save of the wrapper work as with a plain optimizer: the copy is a new wrapper with
an arena of its own, it continues bitwise like the original, and the original is untouched."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import ODD_SHAPES, assert_equal, assert_states_equal, internals, make_params, run_steps

CONFIGS: dict[str, dict[str, Any]] = {
    "adamw": {},
    "resident-half": {"offload_fraction": 0.5},
    "fp32-masters": {"master_weights": "fp32"},
    "remainder": {"master_weights": "remainder"},
    "overlap": {"overlap": True},
    "budget": {"gpu_budget_mb": 0.4},
}


def _dtype(config: str) -> torch.dtype:
    return torch.bfloat16 if "master" in config or config == "remainder" else torch.float32


def _copy(opt: ChunkedOffloadOptimizer, how: str) -> ChunkedOffloadOptimizer:
    if how == "deepcopy":
        return copy.deepcopy(opt)
    if how == "pickle":
        return pickle.loads(pickle.dumps(opt))
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _params(opt: ChunkedOffloadOptimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_copy_continues_bitwise_like_the_original(config: str, how: str) -> None:
    dtype = _dtype(config)
    ref_params, params = make_params(ODD_SHAPES, dtype), make_params(ODD_SHAPES, dtype)
    ref = ChunkedOffloadOptimizer(torch.optim.AdamW(ref_params, lr=1e-2), chunk_size_mb=0.004, **CONFIGS[config])
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=0.004, **CONFIGS[config])
    run_steps(ref, ref_params, 6, none_every=3)
    run_steps(opt, params, 3, none_every=3)
    before = {k: v.clone() for k, v in opt.state_dict(snapshot=True)["state"][0].items()}

    twin = _copy(opt, how)
    assert isinstance(twin, ChunkedOffloadOptimizer) and twin is not opt
    assert twin.plan == opt.plan and repr(twin) == repr(opt)
    twin_arena, arena = internals(twin).placement.require().host.arena, internals(opt).placement.require().host.arena
    assert twin_arena is not arena and twin_arena.nbytes == arena.nbytes
    twin_params = _params(twin)
    assert all(a is not b for a, b in zip(twin_params, params, strict=True))  # as a plain optimizer's copy

    run_steps(twin, twin_params, 3, none_every=3, first_step=3)
    for key, value in opt.state_dict()["state"][0].items():  # the original is untouched by the copy's steps
        assert_equal(before[key], value, f"original state {key!r}")
    run_steps(opt, params, 3, none_every=3, first_step=3)
    for other, other_params in ((opt, params), (twin, twin_params)):
        other.synchronize()
        for i, (a, b) in enumerate(zip(ref_params, other_params, strict=True)):
            assert_equal(a, b, f"param {i}")
        assert_states_equal(ref, ref_params, other, other_params)
        if ref.master_weights != "none":
            for (_, a), (_, b) in zip(ref.master_params(), other.master_params(), strict=True):
                assert_equal(a, b, "master")


def test_deepcopy_of_a_model_and_its_wrapper_together_keeps_them_connected() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_size_mb=0.001)
    model(torch.ones(3, 8)).sum().backward()
    opt.step()
    model2, opt2 = copy.deepcopy((model, opt))
    assert [id(p) for p in _params(opt2)] == [id(p) for p in model2.parameters()]
    for o, m in ((opt, model), (opt2, model2)):
        o.zero_grad()
        m(torch.ones(3, 8)).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert_equal(a, b)


def test_a_copy_of_a_wrapper_with_an_explicit_adapter_keeps_it() -> None:
    from chunked_offload import KeyedAdapter

    params = make_params(ODD_SHAPES)
    inner = torch.optim.AdamW(params)
    adapter = KeyedAdapter(inner, lambda group: ["exp_avg", "exp_avg_sq"], "mine", strict=True)
    opt = ChunkedOffloadOptimizer(inner, adapter=adapter, chunk_size_mb=0.004)
    run_steps(opt, params, 2)
    twin = copy.deepcopy(opt)
    assert twin.adapter.name == "mine" and twin.adapter.inner is twin.inner and twin.adapter is not adapter
    assert adapter.inner is inner  # the original's adapter is untouched
