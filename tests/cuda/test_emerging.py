"""Emerging-Optimizers Muon, wrapped, and Muon + AdamW sharing one GPU window."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, assert_runs_match, assert_states_equal, make_params, run_master_reference, run_steps

pytestmark = pytest.mark.cuda
MiB = 2**20
MATRICES = [(256, 384), (33, 17), (512, 512), (129, 64), (64, 1024)]


@pytest.mark.parametrize("weight_decay_method", ["decoupled", "l2"])
def test_emerging_muon_matches_unwrapped(weight_decay_method: str) -> None:
    eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers")

    def make(params: Any) -> torch.optim.Optimizer:
        return eo.Muon(params, lr=1e-2, weight_decay=0.1, weight_decay_method=weight_decay_method, nesterov=True)

    ref_params, params = make_params(MATRICES, torch.float32, "cuda"), make_params(MATRICES, torch.float32, "cuda")
    opt = ChunkedOffloadOptimizer(make(params), chunk_size_mb=0.5)
    assert opt.adapter.name == "emerging_optimizers.Muon" and len(opt.plan.chunks) > 2
    assert_runs_match(make(ref_params), ref_params, opt, params, 50, none_every=4)


def test_emerging_muon_with_fp32_masters_matches_the_resident_master_loop() -> None:
    eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers")

    def make(params: Any) -> torch.optim.Optimizer:
        return eo.Muon(params, lr=1e-2, weight_decay=0.1, weight_decay_method="l2")

    params = make_params(MATRICES, torch.bfloat16, "cuda")
    ref_params = make_params(MATRICES, torch.bfloat16, "cuda")
    masters, ref = run_master_reference(make, ref_params, 30, none_every=4)
    opt = ChunkedOffloadOptimizer(make(params), chunk_size_mb=0.5, master_weights="fp32")
    run_steps(opt, params, 30, none_every=4)
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, masters, opt, params)


def _llama_like(seed: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """A Llama-shaped parameter set: matrices for Muon; embedding, norms and head for AdamW."""
    hidden, inter, vocab, layers = 1024, 2816, 8192, 4
    shapes = []
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden), (inter, hidden), (hidden, inter)]
    matrices = make_params(shapes, torch.float32, "cuda", seed=seed)
    others = make_params(
        [(vocab, hidden)] + [(hidden,)] * (2 * layers + 1) + [(vocab, hidden)], torch.float32, "cuda", seed=seed + 1
    )
    return matrices, others


@pytest.mark.timing
def test_muon_and_adamw_wrappers_share_one_window() -> None:
    ref_m, ref_o = _llama_like(0)
    mat, oth = _llama_like(0)
    ref_muon = torch.optim.Muon(ref_m, lr=1e-2, weight_decay=0.1)
    ref_adamw = torch.optim.AdamW(ref_o, lr=1e-3, fused=True)
    muon = ChunkedOffloadOptimizer(torch.optim.Muon(mat, lr=1e-2, weight_decay=0.1), chunk_size_mb=64)
    adamw = ChunkedOffloadOptimizer(torch.optim.AdamW(oth, lr=1e-3, fused=True), chunk_size_mb=64)
    bound = max(muon.plan.window_bound_nbytes, adamw.plan.window_bound_nbytes)
    peaks = []
    for step in range(4):
        for opts, params in (((ref_muon, ref_adamw), ref_m + ref_o), ((muon, adamw), mat + oth)):
            gen = torch.Generator(device="cuda").manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, device="cuda")
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            for o in opts:
                o.step()
                o.zero_grad()
            torch.cuda.synchronize()
            if opts[0] is muon:
                peaks.append(torch.cuda.max_memory_allocated() - base)
    # One window, not two; Muon's Newton-Schulz temporaries (bf16, a few MiB here) fit the 64 MiB allowance.
    assert max(peaks) <= bound + 64 * MiB, f"{[p / MiB for p in peaks]} MiB, bound {bound / MiB:.0f} MiB"
    for a, b in zip(ref_m + ref_o, mat + oth, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref_muon, ref_m, muon, mat)
    assert_states_equal(ref_adamw, ref_o, adamw, oth)
