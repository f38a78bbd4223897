"""The examples run on the CPU, and their overlapped or offloading loops are bitwise those of the plain loop."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_train_llama_overlapped_matches_the_synchronous_loop() -> None:
    pytest.importorskip("transformers")
    example = _load("train_llama")
    common = dict(size="tiny", steps=4, batch=2, seq=16, log_every=100, step_in_backward=False, clip=True)
    losses_sync, model_sync, _ = example.train(argparse.Namespace(overlap=False, **common))
    losses, model, opt = example.train(argparse.Namespace(overlap=True, **common))
    assert losses == losses_sync and all(torch.isfinite(torch.tensor(losses)))
    for (name, a), b in zip(model_sync.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert opt.stats is not None and opt.stats.h2d_bytes > 0


def test_train_llama_stepping_in_backward_matches_the_loop_without_clipping() -> None:
    pytest.importorskip("transformers")
    example = _load("train_llama")
    common = dict(size="tiny", steps=4, batch=2, seq=16, log_every=100, overlap=False, clip=False)
    losses_plain, model_plain, _ = example.train(argparse.Namespace(step_in_backward=False, **common))
    losses, model, _ = example.train(argparse.Namespace(step_in_backward=True, **common))
    assert losses == losses_plain
    for (name, a), b in zip(model_plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_rl_loop_with_offload_matches_the_loop_without() -> None:
    example = _load("rl_offload_loop")
    args = argparse.Namespace(iterations=4, width=64, depth=3, actions=8, rollout=16, chunk_mb=0.05, resident_mb=0.1)
    with_offload, freed = example.run(args, offload=True)
    without, _ = example.run(args, offload=False)
    assert len(freed) == 4
    for a, b in zip(with_offload, without, strict=True):
        assert torch.equal(a, b)
