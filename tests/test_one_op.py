"""Resident chunks that the inner updates in one op take no copy of their homes ([Note: One-op updates])."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, ChunkedOffloadWarning
from chunked_offload.transfer import TransferEngine
from reference import (
    ODD_SHAPES,
    assert_equal,
    assert_pair_equal,
    assert_runs_match,
    internals,
    make_grads,
    make_params,
    run_master_reference,
    run_steps,
    set_grads,
)

CHUNK_MB = 0.002
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@contextmanager
def _staged_bytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The bytes each ``stage_in`` copies, in call order."""
    seen: list[int] = []
    original = TransferEngine.stage_in

    def spy(self: TransferEngine, slot: Any, pairs: Any, **kwargs: Any) -> Any:
        seen.append(sum(dev.numel() for dev, _ in pairs))
        return original(self, slot, pairs, **kwargs)

    monkeypatch.setattr(TransferEngine, "stage_in", spy)
    yield seen
    monkeypatch.undo()


def _split_update(monkeypatch: pytest.MonkeyPatch, fail_between: bool = False) -> None:
    """torch._fused_adamw_ in two calls over halves of its lists: the same bits, but two ops per chunk."""
    original = torch._fused_adamw_

    def halves(*lists: Any, **kwargs: Any) -> None:
        n = len(lists[0])
        original(*[ts[: n // 2] for ts in lists], **kwargs)
        if fail_between and n > 1:
            raise RuntimeError("failed between the two halves (injected)")
        original(*[ts[n // 2 :] for ts in lists], **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", halves)


def _resident_fused_pair(
    chunk_mb: float = 1.0, device: str = "cpu"
) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], ChunkedOffloadOptimizer, list[torch.nn.Parameter]]:
    """Plain fused AdamW, and the wrapper of another over equal params with all state resident."""
    ref_params, params = make_params(ODD_SHAPES, device=device), make_params(ODD_SHAPES, device=device)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    inner = torch.optim.AdamW(params, lr=1e-2, fused=True)
    return ref, ref_params, ChunkedOffloadOptimizer(inner, chunk_size_mb=chunk_mb, offload_fraction=0.0), params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_resident_fused_adamw_matches_plain_and_copies_nothing_only_when_fused(
    monkeypatch: pytest.MonkeyPatch, fused: bool, device: str
) -> None:
    ref_params, params = make_params(ODD_SHAPES, device=device), make_params(ODD_SHAPES, device=device)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)
    inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=CHUNK_MB, offload_fraction=0.0)
    run_steps(ref, ref_params, 1)
    run_steps(opt, params, 1)  # the first step creates the state: nothing to stage
    stepper = internals(opt).placement.pipeline.require_stepper()
    assert all(stepper.in_one_op(c) == fused for c in opt.plan.all_chunks)
    with _staged_bytes(monkeypatch) as staged:
        assert_runs_match(ref, ref_params, opt, params, 3, first_step=1)
    assert staged and (sum(staged) == 0) == fused


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_masters_resident_in_one_op_match_the_resident_master_loop(device: str) -> None:
    shapes = [*ODD_SHAPES, (40, 8)]
    params = make_params(shapes, torch.bfloat16, device)
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
        chunk_size_mb=CHUNK_MB,
        offload_fraction=0.0,
        master_weights="fp32",
    )
    run_steps(opt, params, 4)
    masters, inner = run_master_reference(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        make_params(shapes, torch.bfloat16, device),
        4,
    )
    opt.synchronize()
    for i, ((_, got), want) in enumerate(zip(opt.master_params(), masters, strict=True)):
        assert_equal(want, got, f"master {i}")
        assert_equal(want.to(torch.bfloat16), params[i], f"param {i}")


def test_a_chunk_across_two_param_groups_takes_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused AdamW runs one op per group: a chunk holding params of two groups is not updated in one op."""

    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0}]

    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, weight_decay=0.1, fused=True)
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(groups(params), lr=1e-2, weight_decay=0.1, fused=True), chunk_size_mb=1, offload_fraction=0
    )
    stepper = internals(opt).placement.pipeline.require_stepper()
    assert [stepper.in_one_op(c) for c in opt.plan.all_chunks] == [False]  # one chunk of both groups
    assert_runs_match(ref, ref_params, opt, params, 3)


def test_an_update_in_two_ops_warns_and_later_steps_take_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ref_params, opt, params = _resident_fused_pair()
    run_steps(ref, ref_params, 2)
    run_steps(opt, params, 1)
    _split_update(monkeypatch)
    with pytest.warns(ChunkedOffloadWarning, match="2 op\\(s\\) wrote"):
        run_steps(opt, params, 1, first_step=1)
    monkeypatch.undo()
    assert not internals(opt).placement.pipeline.require_stepper().in_one_op(opt.plan.all_chunks[0])
    with _staged_bytes(monkeypatch) as staged:
        assert_runs_match(ref, ref_params, opt, params, 2, first_step=2)
    assert staged and all(n > 0 for n in staged)


def test_a_failure_between_two_update_ops_is_reported_and_leaves_what_plain_torch_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An inner that breaks the one-op promise and fails halfway: the chunk holds what plain torch would."""
    ref, ref_params, opt, params = _resident_fused_pair()
    run_steps(ref, ref_params, 1)
    run_steps(opt, params, 1)
    _split_update(monkeypatch, fail_between=True)
    set_grads(params, make_grads(params, 1))
    with (
        pytest.raises(RuntimeError, match="injected") as info,
        pytest.warns(ChunkedOffloadWarning, match="1 op\\(s\\) wrote"),
    ):
        opt.step()
    note = "".join(info.value.__notes__)
    assert "holds what the inner optimizer left" in note and "was committed" in note
    set_grads(ref_params, make_grads(ref_params, 1))
    with pytest.raises(RuntimeError, match="injected"):
        ref.step()
    monkeypatch.undo()
    assert_pair_equal(ref, ref_params, opt, params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("after", [False, True], ids=["before-update", "after-update"])
def test_a_failure_around_the_update_op_rolls_the_chunk_back_or_forward(
    monkeypatch: pytest.MonkeyPatch, after: bool, device: str
) -> None:
    """An interrupt just before the second chunk's update op rolls it back; just after, rolls it forward."""
    ref, ref_params, opt, params = _resident_fused_pair(CHUNK_MB, device)
    chunks = opt.plan.all_chunks
    assert len(chunks) >= 3
    run_steps(ref, ref_params, 1)
    run_steps(opt, params, 1)
    original, calls = torch._fused_adamw_, []

    def interrupted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2 and not after:
            raise KeyboardInterrupt
        original(*args, **kwargs)
        if len(calls) == 2 and after:
            raise KeyboardInterrupt

    monkeypatch.setattr(torch, "_fused_adamw_", interrupted)
    set_grads(params, make_grads(params, 1))
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    monkeypatch.undo()
    note = "".join(info.value.__notes__)
    assert ("it was committed too" in note) == after and ("it was rolled back" in note) != after
    stepped = {i for c in chunks[: 2 if after else 1] for i in c.params}
    grads = make_grads(ref_params, 1)
    set_grads(ref_params, [g if i in stepped else None for i, g in enumerate(grads)])
    ref.step()
    ref.zero_grad()
    assert_pair_equal(ref, ref_params, opt, params)
    assert_runs_match(ref, ref_params, opt, params, 2, first_step=2)  # usable, and exact from there


def test_the_watch_counts_writes_to_the_chunk_and_its_memory_only() -> None:
    from chunked_offload.transaction import UpdateWatch

    p, m, empty, other = torch.zeros(6), torch.zeros(6), torch.zeros(0), torch.zeros(6)
    with UpdateWatch([p, m, empty]) as watch:
        other.add_(1)  # not the chunk's
        torch.zeros(0).add_(1)  # an empty tensor owns no memory, as the chunk's empty one
        p.sum()  # reads only
    assert not watch.updated
    with UpdateWatch([p, m]) as watch:
        p.view(2, 3).add_(1)  # a view the inner made of a watched tensor
    assert watch.updated and not watch.in_one_op  # m was not written
    q = torch.nn.Parameter(torch.zeros(6))
    adamw = torch.optim.AdamW([q], fused=True)
    for _ in range(2):  # the first step creates the state, the second updates q and its moments in one op
        q.grad = torch.ones(6)
        with UpdateWatch([q, *(v for v in adamw.state[q].values() if v.dim())]) as watch:
            adamw.step()
    assert watch.in_one_op


def _te_pair(
    dtype: torch.dtype = torch.bfloat16, **kw: Any
) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], ChunkedOffloadOptimizer, list[torch.nn.Parameter]]:
    """The stand-in for TE's FusedAdam, plain and wrapped with all state resident, over equal params."""
    from te_standin import FusedAdam

    ref_params, params = make_params(ODD_SHAPES, dtype), make_params(ODD_SHAPES, dtype)
    ref = FusedAdam(ref_params, lr=1e-2, weight_decay=0.1, **kw)
    inner = FusedAdam(params, lr=1e-2, weight_decay=0.1, **kw)
    return ref, ref_params, ChunkedOffloadOptimizer(inner, chunk_size_mb=CHUNK_MB, offload_fraction=0.0), params


@pytest.mark.parametrize("master_weights", [False, True], ids=["params", "te-masters"])
def test_te_fused_adam_steps_resident_chunks_in_its_one_kernel_with_no_copy(
    monkeypatch: pytest.MonkeyPatch, master_weights: bool
) -> None:
    """TE's kernel is an extension's call the dispatcher does not see: the adapter reports it as the one op."""
    ref, ref_params, opt, params = _te_pair(master_weights=master_weights)
    run_steps(ref, ref_params, 1)
    run_steps(opt, params, 1)
    stepper = internals(opt).placement.pipeline.require_stepper()
    assert len(opt.plan.all_chunks) >= 3 and all(stepper.in_one_op(c) for c in opt.plan.all_chunks)
    with _staged_bytes(monkeypatch) as staged, warnings.catch_warnings():
        warnings.simplefilter("error", ChunkedOffloadWarning)  # no chunk refutes the promise
        assert_runs_match(ref, ref_params, opt, params, 3, first_step=1)
    assert staged and sum(staged) == 0


def test_te_fused_adam_with_masters_of_fp32_params_takes_the_copy() -> None:
    """With masters, TE keeps an fp32 param's ``master_param`` but steps the param: that state is not updated."""
    ref, ref_params, opt, params = _te_pair(torch.float32, master_weights=True)
    stepper = internals(opt).placement.pipeline.require_stepper()
    assert not any(stepper.in_one_op(c) for c in opt.plan.all_chunks)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChunkedOffloadWarning)
        assert_runs_match(ref, ref_params, opt, params, 3)


@pytest.mark.parametrize("after", [False, True], ids=["before-kernel", "after-kernel"])
def test_a_failure_around_te_s_kernel_rolls_the_chunk_back_or_forward(after: bool) -> None:
    ref, ref_params, opt, params = _te_pair(master_weights=True)
    chunks = opt.plan.all_chunks
    run_steps(ref, ref_params, 1)
    run_steps(opt, params, 1)
    inner: Any = opt.inner
    kernel, calls = inner.multi_tensor_adam, []

    def interrupted(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 2 and not after:
            raise KeyboardInterrupt
        kernel(*args)
        if len(calls) == 2 and after:
            raise KeyboardInterrupt

    inner.multi_tensor_adam = interrupted
    set_grads(params, make_grads(params, 1))
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    inner.multi_tensor_adam = kernel
    note = "".join(info.value.__notes__)
    assert ("it was committed too" in note) == after and ("it was rolled back" in note) != after
    stepped = {i for c in chunks[: 2 if after else 1] for i in c.params}
    grads = make_grads(ref_params, 1)
    set_grads(ref_params, [g if i in stepped else None for i, g in enumerate(grads)])
    ref.step()  # TE's counter advances once, in both: the failed step committed chunks
    ref.zero_grad()
    assert_pair_equal(ref, ref_params, opt, params)
    assert_runs_match(ref, ref_params, opt, params, 2, first_step=2)  # usable, and exact from there
