"""Resident reference loops and exact comparison helpers, shared by the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

# Odd shapes: a scalar-like vector, primes, a matrix wider than tall, one larger than the others.
ODD_SHAPES: list[tuple[int, ...]] = [(7, 3), (101,), (33, 17), (5,), (64, 129), (1, 1), (3, 5, 7)]
MATRIX_SHAPES: list[tuple[int, ...]] = [(7, 3), (33, 17), (64, 129), (1, 1), (40, 8)]

# Set by scripts/gpu_check.sh --sanitize. Under compute-sanitizer every kernel and copy is instrumented (streams no
# longer race as they do on the hardware), and the frames of each fused-optimizer call stay alive, holding the
# caller's grads (docs/design.md, [Note: Slot memory between steps]). Tests marked `timing` skip there.
UNDER_SANITIZER = os.environ.get("CHUNKED_OFFLOAD_UNDER_SANITIZER") == "1"


def internals(opt: Any) -> Any:
    """A wrapper's parts (``chunked_offload.wiring.Parts``: ``schedule``, ``pool``, ``placement``, ``runner``...).

    The one place where tests and benchmarks reach inside a wrapper (``tests/test_layering.py`` checks that no other
    test reads the package's private names).
    """
    return opt._parts


def make_params(
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[torch.nn.Parameter]:
    """Deterministic params: the same seed gives bitwise-equal params."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in shapes]


def make_grads(
    params: Sequence[torch.Tensor], step: int, seed: int = 1, none_every: int = 0
) -> list[torch.Tensor | None]:
    """Deterministic grads for one step; with ``none_every=k`` param ``i`` gets None when ``(i + step) % k == 0``."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    grads: list[torch.Tensor | None] = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)
        grads.append(None if none_every and (i + step) % none_every == 0 else g)
    return grads


def set_grads(params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def run_steps(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    steps: int,
    *,
    none_every: int = 0,
    scheduler: Any = None,
    first_step: int = 0,
) -> None:
    """The resident reference loop: set grads, step, zero_grad (optionally an LR scheduler)."""
    for step in range(first_step, first_step + steps):
        set_grads(params, make_grads(params, step, none_every=none_every))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


class ResidentMasters:
    """Resident fp32-master training, the loop ``master_weights="fp32"`` reproduces bitwise: a fresh inner optimizer
    steps fp32 copies of the 16-bit params (others directly), and the params take the rounded result.

    Optimizer-like (``step``, ``zero_grad``), over the params' grads; the tests' master references and
    benchmarks/bench_train.py's resident variant run it.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    ) -> None:
        self.params = list(params)
        self.masters = [
            torch.nn.Parameter(p.detach().float().clone()) if p.dtype in (torch.bfloat16, torch.float16) else p
            for p in self.params
        ]
        self.inner = make_inner(list(self.masters))

    @torch.no_grad()
    def step(self) -> None:
        pairs = [(p, m) for p, m in zip(self.params, self.masters, strict=True) if m is not p]
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
        self.inner.step()
        if pairs:
            torch._foreach_copy_([_local(p.detach()) for p, _ in pairs], [_local(m.detach()) for _, m in pairs])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in (*self.params, *self.masters):
            t.grad = None

    def wait_step(self) -> None:  # the wrapper's calls, for loops that run either
        pass

    def prefetch(self) -> None:
        pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run_master_reference(
    make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    params: Sequence[torch.nn.Parameter],
    steps: int,
    *,
    none_every: int = 0,
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """``steps`` of :class:`ResidentMasters` with the reference grads; returns the masters and the inner optimizer."""
    reference = ResidentMasters(params, make_inner)
    run_steps(reference, params, steps, none_every=none_every)  # type: ignore[arg-type]
    return reference.masters, reference.inner


# Calls the soaks interleave that only the wrapper has (a plain optimizer does nothing in their place).
WRAPPER_CALLS: dict[str, Callable[[Any], object]] = {
    "offload": lambda opt: opt.offload(),
    "reload": lambda opt: opt.reload(),
    "offload_async": lambda opt: opt.offload(non_blocking=True),
    "reload_async": lambda opt: opt.reload(non_blocking=True),
    # Taken over by the next step, or dropped if anything in between makes it stale.
    "prefetch": lambda opt: opt.prefetch(),
}


def assert_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bitwise equality (NaNs equal to NaNs): offloading moves bytes and must not change them."""
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def assert_states_equal(
    ref: torch.optim.Optimizer, ref_params: Sequence[torch.Tensor], got: Any, got_params: Sequence[torch.Tensor]
) -> None:
    """Every state entry of every param is present in both and bitwise equal."""
    for i, (rp, gp) in enumerate(zip(ref_params, got_params, strict=True)):
        rs, gs = ref.state.get(rp, {}), got.state.get(gp, {})
        assert set(rs) == set(gs), f"param {i}: state keys {sorted(rs)} vs {sorted(gs)}"
        for k in rs:
            if isinstance(rs[k], torch.Tensor):
                assert_equal(rs[k], gs[k], f"param {i} state {k!r}")
            else:
                assert rs[k] == gs[k], f"param {i} state {k!r}: {rs[k]!r} vs {gs[k]!r}"


def assert_runs_match(
    ref: torch.optim.Optimizer,
    ref_params: Sequence[torch.Tensor],
    opt: Any,
    params: Sequence[torch.Tensor],
    steps: int,
    **kwargs: Any,
) -> None:
    """Run the reference and the wrapped optimizer through the same steps; params and state must match bitwise."""
    run_steps(ref, ref_params, steps, **kwargs)
    run_steps(opt, params, steps, **kwargs)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)


def adamw_pair(
    **kwargs: Any,
) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """A plain AdamW over ``ODD_SHAPES`` and a wrapper of another one over equal params (``kwargs``: its options;
    ``chunk_size_mb`` 4 KiB unless given)."""
    from chunked_offload import ChunkedOffloadOptimizer

    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    kwargs.setdefault("chunk_size_mb", 4 / 1024)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), **kwargs)
    return ref, ref_params, opt, params


def assert_pair_equal(
    ref: torch.optim.Optimizer, ref_params: Sequence[torch.Tensor], opt: Any, params: Sequence[torch.Tensor]
) -> None:
    """The wrapper's params and state equal the plain optimizer's, bitwise (after its step has landed)."""
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)


def partly_resident_adamw() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], torch.optim.Optimizer, Any]:
    """Eight 2048² fp32 params twice on the GPU: fused AdamW over the first copy, and the wrapper over fused AdamW on
    the second, 16 MB chunks and a budget of the plan's window plus four params' 32 MiB of state (the first four
    params' state resident, the rest staged)."""
    from chunked_offload import ChunkedOffloadOptimizer

    ref_params = make_params([(2048, 2048)] * 8, torch.float32, "cuda")
    params = make_params([(2048, 2048)] * 8, torch.float32, "cuda")
    ref = torch.optim.AdamW(ref_params, lr=1e-3, fused=True)
    probe = torch.optim.AdamW(make_params([(2048, 2048)] * 8), fused=True)  # the same plan, on the host
    window = ChunkedOffloadOptimizer(probe, chunk_size_mb=16).plan.window_bound_nbytes
    budget_mb = (window + 4 * 32 * 2**20) / 2**20 + 1
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(params, lr=1e-3, fused=True), chunk_size_mb=16, gpu_budget_mb=budget_mb
    )
    return ref_params, params, ref, opt


@contextlib.contextmanager
def slowed_chunk_steps(cycles: int = 20_000_000) -> Iterator[None]:
    """Every chunk's step starts ``cycles`` GPU cycles late (20M: about 10 ms) on whatever stream runs it, so that a
    reader that does not wait for the step overtakes it."""
    from chunked_offload.stepping import ChunkStepper

    original = ChunkStepper.inner_step

    def slowed(self: Any, *args: Any, **kwargs: Any) -> Any:
        torch.cuda._sleep(cycles)
        return original(self, *args, **kwargs)

    ChunkStepper.inner_step = slowed  # type: ignore[method-assign]
    try:
        yield
    finally:
        ChunkStepper.inner_step = original  # type: ignore[method-assign]


@contextlib.contextmanager
def recorded_shrinks(record: Callable[[Any], Any]) -> Iterator[list[Any]]:
    """``record(slot)`` of each slot about to swap its spare in (``StagingPool.shrink``), in order, until the block
    ends; the swaps run as they would."""
    from chunked_offload.staging import StagingPool

    seen: list[Any] = []
    original = StagingPool.shrink

    def shrink(pool: Any, slot: Any, stream: Any) -> None:
        seen.append(record(slot))
        original(pool, slot, stream)

    StagingPool.shrink = shrink  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        StagingPool.shrink = original  # type: ignore[method-assign]


def settled_cuda_memory() -> int:
    """``memory_allocated()`` once queued work has run and freed blocks are settled.

    empty_cache() makes the allocator process the events of blocks freed with record_stream; gc.collect() frees
    tensors of earlier tests held in reference cycles.
    """
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def spill_budget(plan: Any, share: float) -> int:
    """Host bytes (``host_budget_mb`` x 2**20) that put the share of ``plan``'s offloaded bytes nearest ``share`` on
    disk: the host arena of the chunks kept, plus ``num_slots + 1`` bounces of the largest chunk on disk (whole
    pages), as
    ``chunked_offload.spill.spill`` counts them (``plan``: one without a disk tier)."""
    from chunked_offload.planner import Home
    from chunked_offload.specs import whole_pages

    host = [c for c in plan.chunks if c.home == Home.HOST]
    total = sum(c.transfer_nbytes for c in host)
    best = (2.0, 0)
    for keep in range(len(host) + 1):
        on_disk = host[keep:]
        arena = max((c.home_offset + c.transfer_nbytes for c in host[:keep]), default=0)
        bounces = (plan.num_slots + 1) * whole_pages(max((c.transfer_nbytes for c in on_disk), default=0))
        best = min(best, (abs(sum(c.transfer_nbytes for c in on_disk) / total - share), arena + bounces))
    return best[1]
