"""Seeded soaks: many params, random chunk sizes and None grads, random interleavings of the API, bitwise exact."""

from __future__ import annotations

import copy
import io
import random
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import WRAPPER_CALLS, assert_equal, assert_states_equal

MAKERS = {
    "adamw-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam-fused-amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True, fused=True),
    "sgd-nesterov": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
}
OPS = ["step"] * 8 + ["skip", "zero_grad", "state_dict", "offload", "reload", "write", "lr", "add_group"]
OPS += ["prefetch", "prefetch", "offload_async", "reload_async"]


def _params(rng: random.Random, n: int, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3))) for _ in range(n)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _roundtrip(sd: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(MAKERS))
def test_random_interleavings_match_unwrapped(name: str, seed: int) -> None:
    rng = random.Random(seed)
    params = _params(rng, 150, seed)
    ref_params = _clone(params)
    make = MAKERS[name]
    ref = make([{"params": ref_params[:100]}, {"params": ref_params[100:], "lr": 3e-3}])
    opt = ChunkedOffloadOptimizer(
        make([{"params": params[:100]}, {"params": params[100:], "lr": 3e-3}]),
        chunk_size_mb=rng.choice([0.01, 0.05, 0.2]),
        offload_fraction=rng.choice([1.0, 0.7]),
        overlap=rng.choice([False, True]),
    )
    all_params, all_ref = list(params), list(ref_params)
    for step in range(100):
        op = rng.choice(OPS)
        if op in ("step", "skip"):
            gen = torch.Generator().manual_seed(seed * 7919 + step)
            none_p = rng.random() * 0.4
            for p, q in zip(all_params, all_ref, strict=True):
                g = torch.randn(p.shape, generator=gen)
                grad = None if rng.random() < none_p else g
                p.grad, q.grad = (None, None) if grad is None else (grad.clone(), grad.clone())
            if op == "step":  # a skipped step (GradScaler found an inf) steps neither
                opt.step()
                ref.step()
        elif op == "zero_grad":
            opt.zero_grad()
            ref.zero_grad()
        elif op == "state_dict":
            opt.load_state_dict(_roundtrip(opt.state_dict()))
            ref.load_state_dict(copy.deepcopy(ref.state_dict()))
        elif op in WRAPPER_CALLS:
            WRAPPER_CALLS[op](opt)
        elif op == "write":  # a hand-written state value, as a user or a framework would assign it
            i = rng.randrange(len(all_params))
            entry, ref_entry = opt.state.get(all_params[i]), ref.state.get(all_ref[i])
            if entry:
                key = rng.choice(sorted(k for k, v in ref_entry.items() if v.dim() > 0))
                value = torch.rand(ref_entry[key].shape, generator=torch.Generator().manual_seed(step))
                entry[key] = value.clone()
                ref_entry[key] = value.clone()
        elif op == "lr":
            factor = rng.choice([0.5, 2.0])
            for g, h in zip(opt.param_groups, ref.param_groups, strict=True):
                g["lr"] = h["lr"] = h["lr"] * factor
        elif op == "add_group" and len(opt.param_groups) < 5:
            new = _params(rng, rng.randint(1, 10), seed + step)
            new_ref = _clone(new)
            opt.add_param_group({"params": new, "lr": 1e-3})
            ref.add_param_group({"params": new_ref, "lr": 1e-3})
            all_params += new
            all_ref += new_ref
    opt.synchronize()
    for i, (a, b) in enumerate(zip(all_ref, all_params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, all_ref, opt, all_params)
