"""``attach(model, views=...)`` and ``wait_step(params)``: a model whose params the optimizer steps through views of
their memory (as Megatron's DistributedOptimizer steps shards of its param buffer) overlaps the step with the next
forward, bitwise; the emulated step stream ([Note: Emulated step stream]) shows a read that did not wait."""

from __future__ import annotations

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer

_KIB = 1 / 1024  # MiB


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _run(wrapped: bool, steps: int = 5) -> tuple[_Net, ChunkedOffloadOptimizer | None, dict]:
    """Train ``_Net``: the plain loop (AdamW on the params), or the wrapper with overlap=True over flat views."""
    torch.manual_seed(0)
    model = _Net()
    views = {p: torch.nn.Parameter(p.detach().view(-1)) for p in model.parameters()}
    if wrapped:
        opt = ChunkedOffloadOptimizer(torch.optim.AdamW(views.values(), lr=1e-2), chunk_size_mb=_KIB, overlap=True)
        opt.attach(model, views=views)
        inner: torch.optim.Optimizer = opt
    else:
        opt, inner = None, torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        for p, view in views.items():
            view.grad = p.grad.view(-1) if wrapped else None  # type: ignore[union-attr]
        inner.step()
        model.zero_grad(set_to_none=True)
        for view in views.values():
            view.grad = None
    return model, opt, views


def test_a_model_stepped_through_views_overlaps_bitwise() -> None:
    plain, _, _ = _run(False)
    model, opt, _ = _run(True)
    assert opt is not None and len(opt.plan.chunks) > 1
    opt.wait_step()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_wait_step_with_params_orders_only_their_updates() -> None:
    plain, _, _ = _run(False, steps=5)
    model, opt, views = _run(True, steps=5)
    assert opt is not None
    first = model.a.weight
    assert not torch.equal(first, plain.a.weight)  # the last step's chunks wait for the next forward
    opt.wait_step([views[first]])
    assert torch.equal(first, plain.a.weight)


def test_views_that_are_not_views_of_the_models_params_are_refused() -> None:
    model = _Net()
    views = {p: torch.nn.Parameter(p.detach().view(-1)) for p in model.parameters()}
    stranger = torch.nn.Parameter(torch.zeros(3))
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW([*views.values(), stranger]), overlap=True)
    with pytest.raises(ValueError, match="holds none of this optimizer's params"):
        opt.attach(model)
    weight = model.a.weight
    cases = {
        "a key is not a param of the model": {torch.nn.Parameter(torch.zeros(3)): stranger},
        "a value is not a param of this optimizer": {weight: torch.nn.Parameter(weight.detach().view(-1))},
        "a value is not a view of its key's memory": {weight: stranger},
    }
    for needle, bad in cases.items():
        with pytest.raises(ValueError, match=needle):
            opt.attach(model, views=bad)
    with pytest.raises(TypeError, match="views must map"):
        opt.attach(model, views=[weight])  # type: ignore[arg-type]
    assert not any(m._forward_pre_hooks for m in model.modules())  # nothing was hooked
