"""The generic adapter's probe: on the params' own device, once per class and configuration, and refusing to guess."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, GenericAdapter
from chunked_offload.adapters import generic
from reference import ODD_SHAPES, assert_runs_match, make_params


class _Recorder(torch.optim.Optimizer):
    """A per-parameter momentum optimizer that records the device of every tensor it steps, and refuses any
    device other than the one its params were built on (as a CUDA-only kernel would)."""

    devices: list[torch.device] = []
    instances = 0

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        type(self).instances += 1
        self.home = next(p.device for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.device != self.home:
                    raise RuntimeError(f"foreign device {p.device}")
                type(self).devices.append(p.device)
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["n"] = torch.tensor(0.0)
                state["m"].mul_(group["beta"]).add_(p.grad)
                state["n"] += 1
                p.add_(state["m"], alpha=-group["lr"])


@pytest.fixture(autouse=True)
def _fresh_probe_cache() -> Any:
    generic.forget_probes()
    _Recorder.devices, _Recorder.instances = [], 0
    yield
    generic.forget_probes()


def test_probe_runs_on_the_params_device_once_per_configuration() -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    opt = ChunkedOffloadOptimizer(_Recorder(params), chunk_size_mb=0.002)
    assert isinstance(opt.adapter, GenericAdapter)
    probes = _Recorder.instances - 1  # the wrapped one itself
    assert probes == len({len(s) for s in ODD_SHAPES})  # one per ndim: the layout is mapped, not guessed
    assert set(_Recorder.devices) == {params[0].device}
    ChunkedOffloadOptimizer(_Recorder(make_params(ODD_SHAPES)), chunk_size_mb=0.002)
    assert _Recorder.instances - 2 == probes  # a second wrapper of the same class and configuration: cached
    assert_runs_match(_Recorder(ref_params), ref_params, opt, params, 10, none_every=3)


class _Factored(_Recorder):
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p]["row"] = p.grad.sum(dim=-1, keepdim=True)


class _ScalesOutside(_Recorder):
    """Keeps per-param scales outside `state`, as Transformer Engine does for fp16/fp8 moments."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self._scales = {p: torch.ones(()) for g in self.param_groups for p in g["params"]}
        super().step(closure)


class _SharedMap(_Recorder):
    """Points every param's state at one shared quantization map, as bitsandbytes does."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.qmap = torch.linspace(-1, 1, 256)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p]["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                    self.state[p]["qmap1"] = self.qmap


class _NeedsArgument(_Recorder):
    def __init__(self, params: Any, scale: float) -> None:
        super().__init__(params)


@pytest.mark.parametrize(
    "make, match",
    [
        (_Factored, r"keeps state 'row' of shape \(3, 1\) for a param of shape \(3, 3\)"),
        (_ScalesOutside, "keeps per-parameter data outside `state` \\(attribute '_scales'\\)"),
        (_SharedMap, "shares with its attribute 'qmap'|of shape \\(256,\\)"),
        (lambda ps: _NeedsArgument(ps, 2.0), "one step of a fresh instance on a cpu tensor .* failed"),
    ],
)
def test_what_the_probe_cannot_map_is_refused(make: Any, match: str) -> None:
    params = make_params([(7, 3)])
    before = params[0].detach().clone()
    with pytest.raises(TypeError, match=match) as info:
        ChunkedOffloadOptimizer(make(params))
    assert "Pass adapter=" in str(info.value)
    assert torch.equal(before, params[0])
