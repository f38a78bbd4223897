"""Bitwise parity of the wrapper with the unwrapped optimizer, for every adapter, over 50 steps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import (
    MATRIX_SHAPES,
    ODD_SHAPES,
    assert_equal,
    assert_runs_match,
    assert_states_equal,
    internals,
    make_params,
    run_steps,
)

Factory = Callable[[list[dict]], torch.optim.Optimizer]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Two groups with different hyperparameters (the second overrides lr and weight decay)."""
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], "lr": 3e-3, "weight_decay": 0.05}]


OPTIMIZERS: dict[str, tuple[Factory, list[tuple[int, ...]]]] = {
    "adamw-single": (lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, foreach=False), ODD_SHAPES),
    "adamw-foreach": (lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, foreach=True), ODD_SHAPES),
    "adamw-fused": (lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, fused=True), ODD_SHAPES),
    "adam-amsgrad": (lambda g: torch.optim.Adam(g, lr=1e-2, amsgrad=True, weight_decay=0.01), ODD_SHAPES),
    "sgd-nesterov": (lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4), ODD_SHAPES),
    "rmsprop-centered": (lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5, centered=True), ODD_SHAPES),
    "adagrad": (lambda g: torch.optim.Adagrad(g, lr=0.1, weight_decay=0.01), ODD_SHAPES),
    "muon": (lambda g: torch.optim.Muon(g, lr=1e-2, weight_decay=0.1), MATRIX_SHAPES),
    "generic-nadam": (lambda g: torch.optim.NAdam(g, lr=1e-2, weight_decay=0.01), ODD_SHAPES),
}


def _chunk_mb(kind: str, make: Factory, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> float:
    if kind == "exceeds-all":
        return 1024.0
    if kind == "splits":
        return 0.004  # ~4 KiB: small params share chunks, large ones get their own
    # "equals-one": exactly the bundle of the largest param, so that chunk holds it alone and nothing more.
    probe = ChunkedOffloadOptimizer(make(_groups(make_params(shapes, dtype))), chunk_size_mb=1024.0)
    return max(b.device_nbytes for b in probe.plan.bundles) / 2**20


@pytest.mark.parametrize("chunking", ["splits", "equals-one", "exceeds-all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_matches_unwrapped(name: str, dtype: torch.dtype, chunking: str) -> None:
    make, shapes = OPTIMIZERS[name]
    ref_params, params = make_params(shapes, dtype), make_params(shapes, dtype)
    ref = make(_groups(ref_params))
    opt = ChunkedOffloadOptimizer(make(_groups(params)), chunk_size_mb=_chunk_mb(chunking, make, shapes, dtype))
    if chunking == "splits":
        assert len(opt.plan.chunks) > 1
    if chunking == "exceeds-all":
        assert len(opt.plan.chunks) == 1

    assert_runs_match(ref, ref_params, opt, params, 50, none_every=3)


@pytest.mark.parametrize("name", ["adamw-fused", "sgd-nesterov", "muon"])
def test_lr_scheduler_matches_unwrapped(name: str) -> None:
    make, shapes = OPTIMIZERS[name]
    ref_params, params = make_params(shapes), make_params(shapes)
    ref = make(_groups(ref_params))
    opt = ChunkedOffloadOptimizer(make(_groups(params)), chunk_size_mb=0.004)

    def schedule(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=60)

    run_steps(ref, ref_params, 50, scheduler=schedule(ref))
    run_steps(opt, params, 50, scheduler=schedule(opt))
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params, opt, params)


@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
def test_offload_fraction_matches_unwrapped(fraction: float) -> None:
    make, shapes = OPTIMIZERS["adamw-foreach"]
    ref_params, params = make_params(shapes), make_params(shapes)
    ref = make(_groups(ref_params))
    opt = ChunkedOffloadOptimizer(make(_groups(params)), chunk_size_mb=0.004, offload_fraction=fraction)
    n_offloaded = sum(len(c.params) for c in opt.plan.chunks)
    assert n_offloaded == {0.0: 0, 1.0: len(shapes)}.get(fraction, n_offloaded)
    assert_runs_match(ref, ref_params, opt, params, 50, none_every=4)


@pytest.mark.parametrize("num_slots", [1, 3])
def test_slot_counts_match_unwrapped(num_slots: int) -> None:
    make, shapes = OPTIMIZERS["rmsprop-centered"]
    ref_params, params = make_params(shapes), make_params(shapes)
    ref = make(_groups(ref_params))
    opt = ChunkedOffloadOptimizer(make(_groups(params)), chunk_size_mb=0.004, num_slots=num_slots)
    assert_runs_match(ref, ref_params, opt, params, 20, none_every=3)


def test_state_between_steps_is_host_views_of_the_arena() -> None:
    params = make_params(ODD_SHAPES)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, fused=True), chunk_size_mb=0.004)
    run_steps(opt, params, 2)
    arena = internals(opt).placement.layout.host.arena
    assert arena is not None
    lo = arena.region(0, arena.nbytes).data_ptr()
    hi = lo + arena.nbytes
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            t = opt.state[p][key]
            assert t.device.type == "cpu" and lo <= t.data_ptr() < hi, key
            assert t.shape == p.shape and t.dtype == p.dtype
        assert opt.state[p]["step"].dim() == 0  # the scalar stays where the inner keeps it
