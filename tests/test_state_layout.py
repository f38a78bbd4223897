"""State whose layout follows the grad: inner optimizers that create state with the grad's strides (SGD's and Muon's
``momentum_buffer`` is a clone of the grad) keep it, values and strides, bitwise as with plain torch."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal

_KIB = 1 / 1024  # MiB


class _CloneMomentum(torch.optim.Optimizer):
    """An optimizer the wrapper does not know (the generic adapter) whose state is a clone of the first grad."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.clone(p.grad).detach()
                else:
                    state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])
        return None


INNERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "generic": lambda ps: _CloneMomentum(ps),
}
if hasattr(torch.optim, "Muon"):
    INNERS["muon"] = lambda ps: torch.optim.Muon(ps, lr=0.02)


def _params(layout: str, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    if layout == "channels_last":
        w = torch.randn(6, 8, 4, 4, generator=gen).to(memory_format=torch.channels_last)
        return [torch.nn.Parameter(w), torch.nn.Parameter(torch.randn(6, 8, 4, 4, generator=gen))]
    return [
        torch.nn.Parameter(torch.randn(20, 30, generator=gen)),
        torch.nn.Parameter(torch.randn(7, 5, generator=gen)),
    ]


def _grads(params: list[torch.nn.Parameter], layout: str, step: int) -> list[torch.Tensor]:
    """Grads in another layout than their params: transposed, or channels_last for every 4-D param."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        if layout == "channels_last":
            g = g.contiguous(memory_format=torch.channels_last)
        else:
            g = g.t().contiguous().t()  # the values of g, with strides (1, rows)
        grads.append(g)
    return grads


def _run(opt: Any, params: list[torch.nn.Parameter], layout: str, steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(params, layout, step), strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()


def _assert_same(ref: Any, ref_params: list, opt: Any, params: list) -> None:
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
        rs, gs = ref.state[a], opt.state[b]
        assert set(rs) == set(gs), (sorted(rs), sorted(gs))
        for key, value in rs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert_equal(value, gs[key], f"param {i} state {key!r}")
                assert gs[key].stride() == value.stride(), (key, gs[key].stride(), value.stride())


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
@pytest.mark.parametrize("inner", list(INNERS))
def test_state_in_the_grads_layout_matches_plain_torch(inner: str, layout: str) -> None:
    if inner == "muon" and layout == "channels_last":
        pytest.skip("Muon takes 2-D params only")
    ref_params, params = _params(layout, 0), _params(layout, 0)
    ref = INNERS[inner](ref_params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic adapter says it probes
        opt = ChunkedOffloadOptimizer(INNERS[inner](params), chunk_size_mb=4 * _KIB)
    _run(ref, ref_params, layout, range(4))
    _run(opt, params, layout, range(4))
    opt.synchronize()
    _assert_same(ref, ref_params, opt, params)

    # Through a checkpoint, into a new wrapper and into a plain optimizer, and on.
    saved = copy.deepcopy(opt.state_dict())
    again_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = ChunkedOffloadOptimizer(INNERS[inner](again_params), chunk_size_mb=4 * _KIB)
    again.load_state_dict(copy.deepcopy(saved))
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = INNERS[inner](plain_params)
    plain.load_state_dict(copy.deepcopy(saved))
    for o, ps in ((ref, ref_params), (opt, params), (again, again_params), (plain, plain_params)):
        _run(o, ps, layout, range(4, 7))
    for o, ps in ((opt, params), (again, again_params), (plain, plain_params)):
        if isinstance(o, ChunkedOffloadOptimizer):
            o.synchronize()
        _assert_same(ref, ref_params, o, ps)


def test_state_that_is_not_dense_is_still_refused() -> None:
    """A state tensor with gaps (a slice) cannot live in a dense home: the error says what was given."""

    class Gappy(_CloneMomentum):
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and "buf" not in self.state[p]:
                        self.state[p]["buf"] = torch.zeros(p.shape[0], p.shape[1] * 2)[:, ::2]
            return None

    params = _params("transposed", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = ChunkedOffloadOptimizer(Gappy(params), chunk_size_mb=4 * _KIB)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"state 'buf' for param 0 .*strides \(60, 2\)"):
        opt.step()


@pytest.mark.parametrize("fail_on", ["first", "later"])
def test_a_step_that_fails_after_taking_the_grads_layout_rolls_back_and_retries_exactly(fail_on: str) -> None:
    """The first chunk fails after the inner made its state in the grad's layout (before its write-back): nothing is
    committed, the layout re-plans from what is left, and the same step again equals plain torch."""
    from chunked_offload.stepping import ChunkStepper

    ref_params, params = _params("transposed", 0), _params("transposed", 0)
    ref = INNERS["sgd-foreach"](ref_params)
    opt = ChunkedOffloadOptimizer(INNERS["sgd-foreach"](params), chunk_size_mb=4 * _KIB)
    first = 0 if fail_on == "first" else 2
    _run(ref, ref_params, "transposed", range(4))
    _run(opt, params, "transposed", range(first))
    for p, g in zip(params, _grads(params, "transposed", first), strict=True):
        p.grad = g
    original = ChunkStepper.rescan

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)  # the state is rebound (and re-laid out) ...
        raise KeyboardInterrupt  # ... and the chunk fails before its write-back

    ChunkStepper.rescan = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.step()
    finally:
        ChunkStepper.rescan = original  # type: ignore[method-assign]
    opt.step()  # the same grads: the failed chunk was rolled back, nothing else had run
    opt.zero_grad()
    _run(opt, params, "transposed", range(first + 1, 4))
    opt.synchronize()
    _assert_same(ref, ref_params, opt, params)
