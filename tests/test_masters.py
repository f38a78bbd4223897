"""fp32 masters for 16-bit params: bitwise equal to a resident master-weights loop; remainder equal to fp32."""

from __future__ import annotations

import math
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


def _edit_rule(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """[Note: Edited params] element by element, in int64 arithmetic: the master's low 16 bits under the param's high
    bits (``bits(x) - round(x) * 65536 + P * 65536`` as a 32-bit pattern), or the param itself where that does not
    round to the param."""
    x = master.reshape(-1).view(torch.int32).long()
    p = param.reshape(-1)
    if param.dtype == torch.bfloat16:
        r = master.reshape(-1).to(torch.bfloat16).view(torch.int16).long()
        x = (x - r * 65536 + p.view(torch.int16).long() * 65536 + 2**31) % 2**32 - 2**31
    out = x.int().view(torch.float32)
    keep = out.to(param.dtype).view(torch.int16) == p.view(torch.int16)
    return torch.where(keep, out, p.float()).view(master.shape)


def _edited_pairs(dtype: torch.dtype, per_param: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Every 16-bit pattern as a param, each with masters that round to it, sit on its ties, or are unrelated."""
    g = torch.Generator().manual_seed(0)
    p = torch.arange(-(2**15), 2**15, dtype=torch.int32).repeat_interleave(per_param)
    param = p.to(torch.int16).view(dtype)
    near = param.float().view(torch.int32)  # the param's value as an fp32 bit pattern
    low = torch.randint(-(2**15), 2**15, p.shape, generator=g, dtype=torch.int32)
    unrelated = torch.randint(-(2**31), 2**31 - 1, p.shape, generator=g, dtype=torch.int32)
    kind = torch.arange(p.numel()) % 4
    masters = torch.where(kind == 0, near + (low if dtype == torch.bfloat16 else low % 64), unrelated)
    masters = torch.where(kind == 1, near + 32768, masters)  # a bf16 tie above P (and below P + 1)
    masters = torch.where(kind == 2, (p ^ 1) * 65536 + low % 64, masters)  # a neighbour of P: an edit
    return param, masters.view(torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reconcile_master_follows_the_edited_params_rule_on_every_bit_pattern(dtype: torch.dtype, device: str) -> None:
    from chunked_offload.masters import reconcile_master

    param, master = (t.to(device) for t in _edited_pairs(dtype))
    expected = _edit_rule(param, master)  # on the same device: a NaN rounds to another 16-bit NaN on CUDA
    got = master.clone()
    reconcile_master(param, got, rounded=torch.empty_like(param))
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    number = ~param.isnan()
    assert torch.equal(got.to(dtype).view(torch.int16)[number], param.view(torch.int16)[number])
    unedited = master.to(dtype).view(torch.int16) == param.view(torch.int16)
    assert torch.equal(got.view(torch.int32)[unedited], master.view(torch.int32)[unedited])  # x itself


@pytest.mark.parametrize(
    "shape, permute",
    [((64, 48), (1, 0)), ((4, 6, 8), (2, 0, 1)), ((5, 1), (1, 0)), ((1, 1), (1, 0)), ((), ())],
)
def test_reconcile_master_in_any_dense_layout(shape: tuple[int, ...], permute: tuple[int, ...]) -> None:
    from chunked_offload.masters import reconcile_master

    param, master = _edited_pairs(torch.bfloat16, per_param=1)
    n, start = math.prod(shape), 12345
    param, master = param[start : start + n].reshape(shape), master[start : start + n].reshape(shape)
    expected = _edit_rule(param, master)
    strided = master.permute(permute).contiguous().permute(_inverse(permute))  # the same values, laid out otherwise
    reconcile_master(param, strided, rounded=torch.empty_like(param))
    assert torch.equal(strided.contiguous().view(torch.int32), expected.view(torch.int32))


def test_reconcile_masters_applies_the_rule_to_each_of_a_mixed_list() -> None:
    """One call over bf16 and fp16 params of several layouts (the stepper's call for a chunk) equals the rule per
    param: the foreach passes pair each param with its own master."""
    from chunked_offload.masters import reconcile_masters

    cases = []
    for k, (dtype, shape, permute) in enumerate(
        [(torch.bfloat16, (64, 48), (1, 0)), (torch.float16, (300,), (0,)), (torch.bfloat16, (), ()),
         (torch.bfloat16, (0, 3), (1, 0)), (torch.bfloat16, (4, 6, 8), (2, 0, 1)), (torch.float16, (5, 7), (1, 0))]
    ):  # fmt: skip
        param, master = _edited_pairs(dtype, per_param=1)
        n, start = math.prod(shape), 977 * k
        param, master = param[start : start + n].reshape(shape), master[start : start + n].reshape(shape)
        cases.append(
            (param, master.permute(permute).contiguous().permute(_inverse(permute)), _edit_rule(param, master))
        )
    reconcile_masters([p for p, _, _ in cases], [m for _, m, _ in cases], [torch.empty_like(p) for p, _, _ in cases])
    for param, got, expected in cases:
        assert torch.equal(got.contiguous().view(torch.int32), expected.view(torch.int32)), (param.dtype, param.shape)


@pytest.mark.parametrize("back_up", [True, False], ids=["back-up", "no-back-up"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch-ops"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_reconcile_and_back_up_applies_the_rule_and_copies_each_param(
    device: str, fused: bool, back_up: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the stepper runs before each chunk's step (on CUDA the one-pass kernel where the layouts match): every
    bit pattern of both dtypes, in several dense layouts, with backups in the param's layout and in another."""
    from chunked_offload import masters

    monkeypatch.setattr(masters, "FUSED_RECONCILE", fused)
    monkeypatch.setattr(masters, "FUSED_MIN_NUMEL", 0)  # the kernel for every size
    cases = []
    for dtype, shape, permute, backup_permuted in [
        (torch.bfloat16, (2**19,), (0,), False), (torch.float16, (2**19,), (0,), False),
        (torch.bfloat16, (64, 48), (1, 0), False), (torch.bfloat16, (64, 48), (1, 0), True),
        (torch.float16, (4, 6, 8), (2, 0, 1), False), (torch.bfloat16, (), (), False),
        (torch.bfloat16, (0, 3), (1, 0), False), (torch.bfloat16, (1, 5), (1, 0), False),
    ]:  # fmt: skip
        param, master = (t.to(device) for t in _edited_pairs(dtype))
        n = math.prod(shape)
        param, master = param[:n].reshape(shape), master[:n].reshape(shape)
        expected = _edit_rule(param, master)
        param, master = _laid_out(param, permute), _laid_out(master, permute)
        backup = torch.empty_like(param.contiguous() if backup_permuted else param)
        cases.append((param, master, backup, expected))
    untouched = [backup.clone() for _, _, backup, _ in cases]
    masters.reconcile_and_back_up(*([c[k] for c in cases] for k in range(3)), back_up=back_up)
    for (param, got, backup, expected), before in zip(cases, untouched, strict=True):
        assert torch.equal(got.contiguous().view(torch.int32), expected.view(torch.int32)), (param.dtype, param.shape)
        if back_up:
            assert torch.equal(backup.view(torch.int16), param.view(torch.int16))
        elif fused and device == "cuda" and backup.stride() == param.stride():  # the torch operations use it as scratch
            assert torch.equal(backup.view(torch.int16), before.view(torch.int16))


def _laid_out(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t``'s values in the dense layout whose memory order is ``order`` (``t`` itself for a 0-dim tensor)."""
    return t.permute(order).contiguous().permute(_inverse(order)) if order else t


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


@pytest.mark.cuda
def test_small_masters_take_the_torch_operations_and_large_ones_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``FUSED_MIN_NUMEL`` elements the kernel's launch would cost more host time than its passes save. Told
    apart without a backup: the torch operations write their scratch there, the kernel leaves it alone."""
    from chunked_offload import masters

    pytest.importorskip("triton")
    monkeypatch.setattr(masters, "FUSED_MIN_NUMEL", 1024)
    params = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in (1023, 1024, 4096)]
    mains = [p.float() + 1e-3 for p in params]
    expected = [_edit_rule(p, m) for p, m in zip(params, mains, strict=True)]
    backups = [torch.empty_like(p).view(torch.int16).fill_(0x1234).view(torch.bfloat16) for p in params]
    masters.reconcile_and_back_up(params, mains, backups, back_up=False)
    untouched = [bool((b.view(torch.int16) == 0x1234).all()) for b in backups]
    assert untouched == [False, True, True]
    for got, want in zip(mains, expected, strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
