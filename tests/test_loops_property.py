"""Random loops of what users do between backward(), step(), zero_grad() and the next forward, run against the plain
loop: in both fast modes the params are bitwise equal, or the wrapper refused the loop with an error of its own;
never different params without an error ([Note: Inputs of a step])."""

from __future__ import annotations

import copy
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunked_offload import ChunkedOffloadOptimizer, ChunkedOffloadWarning
from test_loops import batch, build

_PACKAGE = os.path.dirname(__import__("chunked_offload").__file__)

# What a loop may do right after backward() and right after step() (before zero_grad and the next forward).
AFTER_BACKWARD = [
    "nothing", "clip", "clip-value", "replace-grads", "scale-grads", "lr", "weight-decay", "opt.zero_grad-skip",
    "model.zero_grad-skip", "state_dict", "deepcopy-model",
]  # fmt: skip
AFTER_STEP = [
    "nothing", "zero-in-place", "model.zero_grad", "opt.zero_grad-keep", "scale-grads", "lr", "state_dict",
    "load_state_dict", "deepcopy-model", "write-params", "wait-then-write-params", "rebuild-wrapper", "raise-forward",
]  # fmt: skip


class Refused(Exception):
    """The wrapper refused the loop: the run stops there."""


def _ours(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the wrapper itself (a refusal), not by torch or the loop."""
    frames = traceback.extract_tb(exc.__traceback__)
    return isinstance(exc, (RuntimeError, ValueError)) and bool(frames) and frames[-1].filename.startswith(_PACKAGE)


class Loop:
    """One model and its optimizer, driven through the same random program as its twin."""

    def __init__(self, mode: str, master: str) -> None:
        self.mode, self.master = mode, master
        self.model, self.opt = build(mode, master)
        self.wrapped = mode != "plain"

    def forward_loss(self, i: int, raise_in_forward: bool = False, raise_in_backward: bool = False) -> torch.Tensor:
        x = batch(i)
        if raise_in_forward:
            self.model.embed(x)  # part of the forward runs (its hooks too), then the loop's code raises
            raise KeyError("the loop's forward raised")
        logits = self.model(x).float()
        if raise_in_backward:  # a tensor hook of the loop's that raises once the head's grads are done
            logits.register_hook(lambda g: (_ for _ in ()).throw(KeyError("the loop's backward hook raised")))
            logits = logits * 1.0
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())

    def grads(self, fn: Callable[[torch.nn.Parameter], None]) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    fn(p)

    def act(self, op: str, i: int) -> bool:
        """Run ``op``; returns False when the loop skips this iteration's step."""
        model, opt = self.model, self.opt
        if op == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif op == "clip-value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        elif op == "replace-grads":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad * 0.5
        elif op == "scale-grads":
            self.grads(lambda p: p.grad.mul_(0.25))  # type: ignore[union-attr]
        elif op == "lr":
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (i + 2)
        elif op == "weight-decay":
            opt.param_groups[0]["weight_decay"] = 0.01 * i
        elif op == "opt.zero_grad-skip":
            opt.zero_grad()
            return False
        elif op == "model.zero_grad-skip":
            model.zero_grad()
            return False
        elif op == "zero-in-place":
            self.grads(lambda p: p.grad.zero_())  # type: ignore[union-attr]
        elif op == "model.zero_grad":
            model.zero_grad(set_to_none=False)
        elif op == "opt.zero_grad-keep":
            opt.zero_grad(set_to_none=False)
        elif op == "state_dict":
            opt.state_dict()
        elif op == "load_state_dict":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif op == "deepcopy-model":
            copy.deepcopy(model)(batch(0))
        elif op in ("write-params", "wait-then-write-params"):
            if op.startswith("wait") and hasattr(opt, "wait_step"):
                opt.wait_step()
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.3, 0.3)
        elif op == "rebuild-wrapper":  # a new optimizer from the old one's checkpoint; the old one is dropped
            saved = opt.state_dict()
            self.opt = opt = None
            fresh: Any = torch.optim.AdamW(model.parameters())
            if self.wrapped:
                fresh = ChunkedOffloadOptimizer(
                    fresh, chunk_size_mb=2 / 1024, master_weights=self.master, overlap=self.mode == "overlap",
                    step_in_backward=self.mode == "backward",
                )  # fmt: skip
                if self.mode in ("overlap", "backward"):
                    fresh.attach(model)
            fresh.load_state_dict(saved)
            self.opt = fresh
        elif op == "raise-forward":
            try:
                self.forward_loss(i, raise_in_forward=True)
            except KeyError:
                pass
        return True


def run_program(mode: str, master: str, program: list[tuple[str, str, bool]]) -> None:
    ref, got = Loop("plain" if master == "none" else "sync", master), Loop(mode, master)
    for i, (after_backward, after_step, raising) in enumerate(program):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", ChunkedOffloadWarning)
            try:
                for loop in (ref, got):
                    try:
                        loop.forward_loss(i, raise_in_backward=raising).backward()
                    except KeyError:
                        loop.opt.zero_grad()
                        continue  # the loop skips the batch
                    if loop.act(after_backward, i):
                        loop.opt.step()
                        loop.act(after_step, i)
                        loop.opt.zero_grad()
            except Exception as exc:
                if _ours(exc):
                    return  # refused: the run stops, as the user's would
                raise
        if any("raised after" in str(w.message) for w in seen):
            return  # a backward that stepped raised: the wrapper said which chunks it had committed
    if hasattr(got.opt, "wait_step"):
        got.opt.wait_step()
    for (name, a), b in zip(ref.model.named_parameters(), got.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs without an error from the wrapper (program {program})"


programs = st.lists(
    st.tuples(st.sampled_from(AFTER_BACKWARD), st.sampled_from(AFTER_STEP), st.booleans()), min_size=1, max_size=5
)


@pytest.mark.parametrize("master", ["none", "fp32"])
@pytest.mark.parametrize("mode", ["overlap", "backward"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(program=programs)
def test_random_loops_are_bitwise_or_refused(mode: str, master: str, program: list[tuple[str, str, bool]]) -> None:
    run_program(mode, master, program)
