"""fp32 masters for 16-bit params: bitwise equal to a resident master-weights loop; remainder equal to fp32."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import (
    MATRIX_SHAPES,
    ODD_SHAPES,
    assert_equal,
    assert_states_equal,
    make_grads,
    make_params,
    run_master_reference,
    run_steps,
    set_grads,
)

MAKERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "muon": lambda ps: torch.optim.Muon(ps, lr=1e-2, weight_decay=0.1),
}


def _mixed_params(name: str, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """16-bit params, plus one fp32 param that needs no master (stepped directly)."""
    shapes = MATRIX_SHAPES if name == "muon" else ODD_SHAPES
    params = make_params(shapes, dtype)
    params[1] = torch.nn.Parameter(params[1].detach().float())
    return params


def _masters_of(opt: ChunkedOffloadOptimizer) -> dict[int, torch.Tensor]:
    return {id(p): m.clone() for p, m in opt.master_params()}


@pytest.mark.parametrize("chunk_mb", [0.004, 1024.0])
@pytest.mark.parametrize("mode", ["fp32", "remainder"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_masters_match_resident_master_loop(name: str, mode: str, chunk_mb: float) -> None:
    params, ref_params = _mixed_params(name, torch.bfloat16), _mixed_params(name, torch.bfloat16)
    masters, ref = run_master_reference(MAKERS[name], ref_params, 50, none_every=3)
    opt = ChunkedOffloadOptimizer(MAKERS[name](params), chunk_size_mb=chunk_mb, master_weights=mode)
    run_steps(opt, params, 50, none_every=3)

    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    got = _masters_of(opt)
    assert set(got) == {id(p) for p in params if p.dtype == torch.bfloat16}
    for i, (p, m) in enumerate(zip(params, masters, strict=True)):
        if id(p) in got:
            assert_equal(m, got[id(p)], f"master {i}")
    assert_states_equal(ref, masters, opt, params)
    for p in params:  # the inner steps the fp32 master, so its state is fp32
        assert all(v.dtype == torch.float32 for v in opt.state[p].values() if v.dim() > 0)


def test_fp16_params_get_fp32_masters() -> None:
    params, ref_params = make_params(ODD_SHAPES, torch.float16), make_params(ODD_SHAPES, torch.float16)
    masters, ref = run_master_reference(MAKERS["adamw-foreach"], ref_params, 30)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-foreach"](params), chunk_size_mb=0.004, master_weights="fp32")
    run_steps(opt, params, 30)
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, masters, opt, params)


@pytest.mark.parametrize("name", ["adamw-fused", "muon"])
def test_remainder_matches_fp32_mode_bitwise(name: str) -> None:
    runs = {}
    for mode in ("fp32", "remainder"):
        params = _mixed_params(name, torch.bfloat16)
        opt = ChunkedOffloadOptimizer(MAKERS[name](params), chunk_size_mb=0.004, master_weights=mode)
        run_steps(opt, params, 50, none_every=4)
        runs[mode] = (params, opt)
    (p32, o32), (prem, orem) = runs["fp32"], runs["remainder"]
    for a, b in zip(p32, prem, strict=True):
        assert_equal(a, b)
    m32, mrem = list(o32.master_params()), list(orem.master_params())
    for (_, a), (_, b) in zip(m32, mrem, strict=True):
        assert_equal(a, b)
    assert_states_equal(o32, p32, orem, prem)
    # 2 bytes of remainder + 1/8 byte of tie bits instead of 4 bytes of master, per element.
    assert orem.plan.host_nbytes < o32.plan.host_nbytes


def test_clipping_and_unscaling_act_on_the_model_grads() -> None:
    params, ref_params = make_params(ODD_SHAPES, torch.bfloat16), make_params(ODD_SHAPES, torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref_params]
    ref = MAKERS["adamw-foreach"](masters)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-foreach"](params), chunk_size_mb=0.004, master_weights="fp32")
    for step in range(10):
        for ps in (ref_params, params):
            set_grads(ps, [g * 64 for g in make_grads(ps, step)])
            for p in ps:
                p.grad.div_(64)  # what GradScaler.unscale_ does, in the grad's dtype
            torch.nn.utils.clip_grad_norm_(ps, max_norm=0.5)
        for m, p in zip(masters, ref_params, strict=True):
            m.grad = p.grad.float()
        ref.step()
        for m, p in zip(masters, ref_params, strict=True):
            p.data.copy_(m)
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)


def test_master_params_reads_host_copies() -> None:
    params = make_params(ODD_SHAPES, torch.bfloat16)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-fused"](params), master_weights="fp32")
    masters = dict((id(p), m) for p, m in opt.master_params())
    for p in params:  # before any step the master is the exact upcast of the param
        assert_equal(masters[id(p)], p.detach().float())
        assert masters[id(p)].device.type == "cpu"


class FusedAdam(torch.optim.Adam):
    """Stands in for Transformer Engine's FusedAdam(master_weights=True), which keeps its own masters."""

    def __init__(self, params: Any, master_weights: bool = False) -> None:
        super().__init__(params)
        self.master_weights = master_weights


@pytest.mark.parametrize(
    "make_params_, make_inner, mode, match",
    [
        (lambda: make_params(ODD_SHAPES, torch.float16), MAKERS["sgd"], "remainder", "encodes bf16 params only"),
        (lambda: make_params(ODD_SHAPES, torch.float32), MAKERS["sgd"], "remainder", "fp32 params need no master"),
        (lambda: make_params(ODD_SHAPES, torch.bfloat16), lambda ps: FusedAdam(ps, True), "fp32", "stored twice"),
    ],
)
def test_master_modes_reject_what_they_cannot_do(make_params_: Any, make_inner: Any, mode: str, match: str) -> None:
    params = make_params_()
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=match):
        ChunkedOffloadOptimizer(make_inner(params), master_weights=mode)
    for a, b in zip(before, params, strict=True):
        assert_equal(a, b)  # nothing modified


def test_non_floating_params_are_rejected_with_masters() -> None:
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)]
    with pytest.raises(ValueError, match="needs floating-point params, got params of dtype"):
        ChunkedOffloadOptimizer(torch.optim.SGD(params, lr=0.1), master_weights="fp32")
