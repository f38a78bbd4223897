"""The examples run on the CPU, and their overlapped or offloading loops are bitwise those of the plain loop."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _train_llama_twice(switch: str, **fixed: object) -> tuple[tuple, tuple]:
    """Two tiny runs of the example, with ``switch`` off then on; losses and params must be bitwise equal."""
    pytest.importorskip("transformers")
    example = _load("train_llama")
    common = dict(size="tiny", steps=4, batch=2, seq=16, log_every=100, **fixed)
    off = example.train(argparse.Namespace(**{switch: False}, **common))
    on = example.train(argparse.Namespace(**{switch: True}, **common))
    assert on[0] == off[0] and all(torch.isfinite(torch.tensor(on[0])))
    for (name, a), b in zip(off[1].named_parameters(), on[1].parameters(), strict=True):
        assert torch.equal(a, b), name
    return off, on


def test_train_llama_overlapped_matches_the_synchronous_loop() -> None:
    _, (_, _, opt) = _train_llama_twice("overlap", step_in_backward=False, clip=True)
    assert opt.stats is not None and opt.stats.h2d_bytes > 0


def test_train_llama_stepping_in_backward_matches_the_loop_without_clipping() -> None:
    _train_llama_twice("step_in_backward", overlap=False, clip=False)


def test_rl_loop_with_offload_matches_the_loop_without() -> None:
    example = _load("rl_offload_loop")
    args = argparse.Namespace(iterations=4, width=64, depth=3, actions=8, rollout=16, chunk_mb=0.05, resident_mb=0.1)
    with_offload, freed = example.run(args, offload=True)
    without, _ = example.run(args, offload=False)
    assert len(freed) == 4
    for a, b in zip(with_offload, without, strict=True):
        assert torch.equal(a, b)


def test_train_llama_learns_on_the_cpu() -> None:
    """The CPU default trains on sequences that count up, so a newcomer sees the loss fall."""
    pytest.importorskip("transformers")
    example = _load("train_llama")
    args = argparse.Namespace(size="tiny", steps=30, batch=8, seq=None, log_every=100, overlap=True)
    losses, _, _ = example.train(argparse.Namespace(**vars(args), step_in_backward=False, clip=True))
    assert losses[-1] < losses[0] / 3, losses


def test_train_torchtitan_overlapped_matches_torchtitans_own_loop() -> None:
    pytest.importorskip("torchtitan.models.llama3", reason="torchtitan (0.3) is not installed")
    example = _load("train_torchtitan")
    common = dict(auto=False, flavor="debugmodel", steps=3, batch=2, seq=16, lr=8e-4, chunk_mb=0.5, log_every=100)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        runs = [example.train(argparse.Namespace(mode=m, no_compile=True, **common)) for m in ("plain", "overlap")]
    finally:
        dist.destroy_process_group()
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1].parameters(), runs[1][1].parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
