"""torch.compile on the GPU: a compiled model with the overlapped and the in-backward step, each chunk's step slowed
so that a missing wait shows, bitwise the same compiled loop with the synchronous step."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, slowed_chunk_steps

pytestmark = pytest.mark.cuda
SLEEP = 20_000_000  # GPU cycles, about 10 ms per chunk


class _Net(torch.nn.Module):
    """16 x (Linear(1024) + GELU), the shape of the case that gave NaN params when dynamo traced the hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def _train(mode: str, compile_mode: str, attach_first: bool, slow: bool, steps: int = 6) -> list[torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net().to("cuda", torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # attach() without overlap says it does nothing
        opt = ChunkedOffloadOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
            chunk_size_mb=8,
            master_weights="fp32",
            overlap=mode == "overlap",
            step_in_backward=mode == "backward",
        )
        if attach_first:
            opt.attach(model)
        forward: Any = torch.compile(model, mode=compile_mode)
        if not attach_first:
            opt.attach(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with slowed_chunk_steps(SLEEP) if slow else contextlib.nullcontext():
        for _ in range(steps):
            x = torch.randn(64, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)
            forward(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    opt.wait_step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("compile_mode", ["default", "max-autotune-no-cudagraphs"])
def test_compiled_overlap_and_in_backward_match_the_compiled_synchronous_loop(compile_mode: str) -> None:
    reference = _train("sync", compile_mode, attach_first=True, slow=False)
    for mode in ("overlap", "backward"):
        for attach_first in (True, False):
            got = _train(mode, compile_mode, attach_first=attach_first, slow=True)
            for i, (a, b) in enumerate(zip(reference, got, strict=True)):
                assert_equal(a, b, f"{mode}, attached {'before' if attach_first else 'after'} compiling: param {i}")


def test_reduce_overhead_compiles_to_cuda_graphs_and_stays_exact_or_is_refused() -> None:
    reference = _train("sync", "reduce-overhead", attach_first=True, slow=False)
    for mode in ("overlap", "backward"):
        try:
            got = _train(mode, "reduce-overhead", attach_first=True, slow=True)
        except RuntimeError as exc:
            assert "reduce-overhead" in str(exc) or "CUDA graph" in str(exc), exc
            continue
        for i, (a, b) in enumerate(zip(reference, got, strict=True)):
            assert_equal(a, b, f"{mode} under reduce-overhead: param {i}")


# The CPU matrix of tests/test_compile.py, at sizes where inductor's fusion choices differ (width 4096, batch 8192),
# each chunk's step slowed, with deterministic kernels, against the plain compiled loop run twice (the control).
GPU_CASES = ["base", "structure=sequential", "scope=blocks", "scope=inplace", "attach=after-another",
             "wrappers=muon+adamw", "fullgraph=False-checkpointing=reentrant-no-grad-input",
             "structure=dict-scope=inplace-attach=after-checkpointing=non-reentrant"]  # fmt: skip


@pytest.mark.parametrize("name", GPU_CASES)
def test_the_compile_matrix_matches_the_plain_compiled_loop_at_gpu_sizes(name: str, deterministic: Any) -> None:
    import test_compile as matrix

    case = next(c for c in matrix.CASES if str(c) == name)
    sizes: dict[str, Any] = dict(steps=3, device="cuda", width=4096, batch=8192, chunk_mb=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, graphs, breaks, _ = matrix._train(case, "plain", **sizes)
        control, _, _, _ = matrix._train(case, "plain", **sizes)
        for i, (a, b) in enumerate(zip(plain, control, strict=True)):
            assert_equal(a, b, f"control (the plain loop twice): param {i}")
        for mode in ("overlap", "backward"):
            with slowed_chunk_steps(SLEEP):
                got, got_graphs, got_breaks, _ = matrix._train(case, mode, **sizes)
            assert (got_graphs, got_breaks) == (graphs, breaks), mode
            for i, (a, b) in enumerate(zip(plain, got, strict=True)):
                assert_equal(a, b, f"{mode}: param {i}")
