"""PyTorch's own optimizer test database: every optimizer and CPU input, wrapped, is bitwise the unwrapped one.

Each case runs 12 steps in fp32 and bf16, with every implementation flag (single-tensor, foreach, fused where the
CPU has it), one and two param groups, params whose first grad comes late, a step with no grads at all, and
closures. Optimizers that cannot be chunked (LBFGS, SparseAdam) and ``differentiable=True`` must be refused with a
clear error. Where plain torch itself raises (fused SGD when only some params have momentum buffers) the wrapper
must raise too, before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, assert_states_equal, make_params

pytest.importorskip("expecttest")  # torch.testing._internal needs it
from torch.testing._internal.common_optimizers import optim_db  # noqa: E402

SHAPES = [(7, 3), (101,), (33, 17), (5,), (1, 1), (40, 8), ()]
MATRIX_SHAPES = [(7, 3), (33, 17), (1, 1), (40, 8)]
STEPS = 12  # past the late first grads (steps 3 and 6) and the step without grads (5)
LATE = {1: 3, 3: 6}  # param index -> the step of its first grad
NO_GRAD_STEP = 5
REFUSED = {"LBFGS": "keeps one history", "SparseAdam": "needs sparse gradients"}


@dataclass(frozen=True)
class Case:
    info: Any
    kwargs: dict[str, Any]
    dtype: torch.dtype
    groups: int
    name: str


def _cases() -> list[Case]:
    cases = []
    for info in optim_db:
        impls: list[dict[str, Any]] = [{}]
        if "foreach" in info.supported_impls:
            impls += [{"foreach": False}, {"foreach": True}]
        if "fused" in info.supported_impls and "cpu" in info.supports_fused_on:
            impls.append({"fused": True})
        if "differentiable" in info.supported_impls:
            impls.append({"differentiable": True})
        for dtype in (torch.float32, torch.bfloat16):
            for oi in info.optim_inputs_func(device="cpu", dtype=dtype):
                for impl in impls:
                    for groups in (1, 2):
                        cls = info.optim_cls.__name__
                        impl_name = ",".join(f"{k}={v}" for k, v in impl.items()) or "default"
                        name = f"{cls}-{oi.desc}-{impl_name}-{str(dtype)[6:]}-{groups}g".replace(" ", "_")
                        cases.append(Case(info, {**oi.kwargs, **impl}, dtype, groups, name))
    return cases


CASES = _cases()


def _make(case: Case, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cls = case.info.optim_cls
    if case.groups == 1:
        return cls(params, **case.kwargs)
    lr = case.kwargs.get("lr", 1e-3)
    second_lr = lr * 0.5  # a tensor lr stays a tensor
    return cls([{"params": params[:3]}, {"params": params[3:], "lr": second_lr}], **case.kwargs)


def _grads(params: list[torch.nn.Parameter], step: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 + step)
    grads: list[torch.Tensor | None] = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        grads.append(None if step == NO_GRAD_STEP or step < LATE.get(i, 0) else g)
    return grads


def _run(opt: Any, params: list[torch.nn.Parameter], step: int) -> None:
    for p, g in zip(params, _grads(params, step), strict=True):
        p.grad = None if g is None else g.clone()
    if step % 7 == 3:
        opt.step(lambda: torch.tensor(float(step)))
    else:
        opt.step()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_optim_db_case_matches_unwrapped(case: Case) -> None:
    cls_name = case.info.optim_cls.__name__
    shapes = MATRIX_SHAPES if cls_name == "Muon" else SHAPES
    ref_params, params = make_params(shapes, case.dtype), make_params(shapes, case.dtype)
    if cls_name in REFUSED:
        if case.groups == 2:
            pytest.skip(f"{cls_name} itself refuses param groups")
        with pytest.raises(TypeError, match=REFUSED[cls_name]):
            ChunkedOffloadOptimizer(_make(case, params))
        return
    if case.kwargs.get("differentiable"):
        with pytest.raises(ValueError, match="differentiable=True"):
            ChunkedOffloadOptimizer(_make(case, params))
        return
    ref = _make(case, ref_params)
    opt = ChunkedOffloadOptimizer(_make(case, params), chunk_size_mb=0.002)
    assert len(opt.plan.all_chunks) >= 2
    for step in range(STEPS):
        try:
            _run(ref, ref_params, step)
        except Exception as plain:  # torch itself cannot step this: the wrapper must refuse it, unmodified
            before = [p.detach().clone() for p in params]
            with pytest.raises(type(plain)):
                _run(opt, params, step)
            for a, b in zip(before, params, strict=True):
                assert_equal(a, b)
            return
        _run(opt, params, step)
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)


FAST_CASES = [c for c in CASES if c.info.optim_cls.__name__ not in REFUSED and not c.kwargs.get("differentiable")]


def _run_fast(mode: str, opt: ChunkedOffloadOptimizer, chain: torch.nn.Module, params: list, step: int) -> None:
    """``_run``'s grads from a backward that steps, or set by hand for an overlapped step that the next forward
    finishes (with its closure: a closure after a backward that stepped is refused)."""
    grads = _grads(params, step)
    if mode == "backward":
        terms = [(p * g).sum() for p, g in zip(params, grads, strict=True) if g is not None]
        if terms:
            torch.stack(terms).sum().backward()
        opt.step()
    else:
        _run(opt, params, step)
        chain()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["backward", "overlap"])
@pytest.mark.parametrize("case", FAST_CASES, ids=[c.name for c in FAST_CASES])
def test_optim_db_case_in_a_fast_mode_matches_unwrapped(case: Case, mode: str) -> None:
    """Each case with ``step_in_backward=True`` (3 slots: the last two chunks' write-backs are held) or
    ``overlap=True`` and an attached model. In the backward a param's first grad can come after its group's other
    chunks are final, which decides torch SGD's code path for the group ([Note: Coupled params])."""
    from test_deferred import Chain

    shapes = MATRIX_SHAPES if case.info.optim_cls.__name__ == "Muon" else SHAPES
    ref_params, params = make_params(shapes, case.dtype), make_params(shapes, case.dtype)
    ref = _make(case, ref_params)
    fast = {"step_in_backward": True, "num_slots": 3} if mode == "backward" else {"overlap": True}
    opt = ChunkedOffloadOptimizer(_make(case, params), chunk_size_mb=0.002, **fast)
    chain = Chain(params)
    opt.attach(chain)
    for step in range(STEPS):
        try:
            _run(ref, ref_params, step)
        except Exception as plain:  # torch itself cannot step this: nor can the wrapper
            with pytest.raises(type(plain)):
                _run_fast(mode, opt, chain, params, step)
            return
        for p in ref_params:
            p.grad = None
        _run_fast(mode, opt, chain, params, step)
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)
