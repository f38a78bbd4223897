"""GPU tier: parity on the device, the bounded GPU window, pinned host copies, overlap and race checks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, KeyedAdapter
from chunked_offload.host_arena import is_page_locked
from chunked_offload.transfer import TransferEngine
from reference import (
    MATRIX_SHAPES,
    ODD_SHAPES,
    assert_equal,
    assert_runs_match,
    assert_states_equal,
    internals,
    make_params,
    run_master_reference,
    run_steps,
    settled_cuda_memory,
)

pytestmark = pytest.mark.cuda
MiB = 2**20


def _fused_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("chunk_mb", [0.004, 0.064, 1024.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_adamw_matches_unwrapped_on_gpu(dtype: torch.dtype, chunk_mb: float) -> None:
    shapes = [*ODD_SHAPES, (257, 513)]
    ref_params, params = make_params(shapes, dtype, "cuda"), make_params(shapes, dtype, "cuda")
    ref = _fused_adamw(ref_params)
    opt = ChunkedOffloadOptimizer(_fused_adamw(params), chunk_size_mb=chunk_mb)
    assert_runs_match(ref, ref_params, opt, params, 50, none_every=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_muon_matches_unwrapped_on_gpu(dtype: torch.dtype) -> None:
    shapes = [*MATRIX_SHAPES, (256, 384)]
    ref_params, params = make_params(shapes, dtype, "cuda"), make_params(shapes, dtype, "cuda")
    ref = torch.optim.Muon(ref_params, lr=1e-2, weight_decay=0.1)
    opt = ChunkedOffloadOptimizer(torch.optim.Muon(params, lr=1e-2, weight_decay=0.1), chunk_size_mb=0.05)
    assert_runs_match(ref, ref_params, opt, params, 50, none_every=3)


@pytest.mark.parametrize("mode", ["fp32", "remainder"])
def test_masters_match_reference_on_gpu(mode: str) -> None:
    shapes = [*ODD_SHAPES, (257, 513)]
    params = make_params(shapes, torch.bfloat16, "cuda")
    ref_params = make_params(shapes, torch.bfloat16, "cuda")
    masters, ref = run_master_reference(_fused_adamw, ref_params, 50, none_every=3)
    opt = ChunkedOffloadOptimizer(_fused_adamw(params), chunk_size_mb=0.05, master_weights=mode)
    run_steps(opt, params, 50, none_every=3)
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b, "param")
    got = dict((id(p), m) for p, m in opt.master_params())
    for i, (p, m) in enumerate(zip(params, masters, strict=True)):
        assert_equal(m, got[id(p)], f"master {i}")
    assert_states_equal(ref, masters, opt, params)


def _window_case(mode: str) -> tuple[ChunkedOffloadOptimizer, list[torch.nn.Parameter]]:
    dtype = torch.float32 if mode == "none" else torch.bfloat16
    params = make_params([(2048, 2048)] * 24 + [(1000,)], dtype, "cuda")
    inner = _fused_adamw(params)
    return ChunkedOffloadOptimizer(inner, chunk_size_mb=64, master_weights=mode), params


@pytest.mark.timing
@pytest.mark.parametrize("mode", ["none", "fp32", "remainder"])
def test_step_window_is_bounded(mode: str) -> None:
    opt, params = _window_case(mode)
    bound = opt.plan.window_bound_nbytes
    gen = torch.Generator(device="cuda").manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device="cuda").to(p.dtype)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for step in range(3):  # the first step (state created in the window) and steady-state steps
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        print(f"\n{mode} step {step}: peak {peak / MiB:.1f} MiB, bound {bound / MiB:.1f} MiB")
        assert peak <= bound, f"step {step}: peak {peak / MiB:.2f} MiB > bound {bound / MiB:.2f} MiB"
        # Between steps only the staging slots (if allocated) and fused Adam's 0-dim step counters stay.
        resident = torch.cuda.memory_allocated() - base
        assert resident <= opt.plan.slot_nbytes * opt.num_slots + 1 * MiB
    opt.offload()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base <= 1 * MiB  # no state bytes left on the GPU
    for p in params:
        for key, value in opt.state[p].items():
            if value.dim() > 0:
                assert value.device.type == "cpu" and is_page_locked(value), key


class _SleepyAdamW(torch.optim.AdamW):
    """AdamW whose step first keeps the compute stream busy, to expose missing waits on the side streams."""

    cycles = 2_000_000

    def step(self, closure: Any = None) -> Any:
        torch.cuda._sleep(self.cycles)
        return super().step(closure)


def _sleepy(params: Any) -> torch.optim.Optimizer:
    return _SleepyAdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _adam_keys(group: dict[str, Any]) -> list[str]:
    return ["exp_avg", "exp_avg_sq"]


@pytest.mark.timing
def test_transfers_overlap_compute() -> None:
    shapes = [(1024, 1024)] * 16
    timings = {}
    for slots in (1, 2):
        params = make_params(shapes, torch.float32, "cuda")
        inner = _sleepy(params)
        opt = ChunkedOffloadOptimizer(
            inner, chunk_size_mb=8, num_slots=slots, adapter=KeyedAdapter(inner, _adam_keys, "sleepy")
        )
        run_steps(opt, params, 2)
        for p in params:
            p.grad = torch.ones_like(p)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            opt.step()
        opt.synchronize()
        torch.cuda.synchronize()
        timings[slots] = time.perf_counter() - t0
    assert timings[2] < 0.85 * timings[1], timings


class _SlowSideStreams(TransferEngine):
    """Sleeps on a side stream before every event it records (each H2D and D2H piece): an H2D that overtook the
    D2H reading the same slot bytes, or a step that overtook its H2D, would corrupt the result."""

    def _record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        if stream is not torch.cuda.current_stream():
            with torch.cuda.stream(stream):
                torch.cuda._sleep(300_000)
        return super()._record(stream)


@pytest.mark.parametrize("chunk_mb", [2, 100])  # one piece per chunk; several 32 MiB pieces per chunk
def test_slow_side_streams_do_not_race(chunk_mb: int) -> None:
    shapes = [(2048, 2048)] * 8
    ref_params, params = make_params(shapes, torch.float32, "cuda"), make_params(shapes, torch.float32, "cuda")
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    inner = _sleepy(params)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=chunk_mb, adapter=KeyedAdapter(inner, _adam_keys, "sleepy"))
    internals(opt).engine.__class__ = _SlowSideStreams
    run_steps(ref, ref_params, 6)
    run_steps(opt, params, 6)
    sd = opt.state_dict()  # must wait for the slow D2H before handing out host views
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    for i, p in enumerate(ref_params):
        assert_equal(ref.state[p]["exp_avg"], sd["state"][i]["exp_avg"], f"exp_avg {i}")


def test_state_dict_and_load_allocate_no_gpu_memory() -> None:
    # 0.5e9 fp32 params: 4 GB of Adam state in the host arena.
    params = make_params([(8192, 8192)] * 8, torch.float32, "cuda")
    opt = ChunkedOffloadOptimizer(_fused_adamw(params), chunk_size_mb=256)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    sd = opt.state_dict()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() <= before + 1 * MiB
    for p in params:
        assert is_page_locked(opt.state[p]["exp_avg"]) and is_page_locked(opt.state[p]["exp_avg_sq"])


def test_plain_gpu_checkpoint_loads_without_gpu_spike_and_resumes_exactly() -> None:
    shapes = [(1024, 1024)] * 6
    ref_params, params = make_params(shapes, torch.float32, "cuda"), make_params(shapes, torch.float32, "cuda")
    ref = _fused_adamw(ref_params)
    run_steps(ref, ref_params, 5)
    sd = ref.state_dict()  # CUDA tensors
    with torch.no_grad():
        for p, q in zip(params, ref_params, strict=True):
            p.copy_(q)
    opt = ChunkedOffloadOptimizer(_fused_adamw(params), chunk_size_mb=4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.load_state_dict(sd)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() <= before + 1 * MiB  # only fused Adam's 0-dim step counters
    assert_runs_match(ref, ref_params, opt, params, 5, first_step=5)


def test_host_arena_is_page_locked_and_exact_size() -> None:
    from chunked_offload import HostArena

    arena = HostArena(3 * MiB + 123, pin=True)
    assert arena.nbytes == 3 * MiB + 123
    assert is_page_locked(arena.region(0, arena.nbytes))
    assert is_page_locked(arena.region(arena.nbytes - 1, 1))
    assert not is_page_locked(torch.empty(MiB, dtype=torch.uint8))
    assert is_page_locked(torch.empty(MiB, dtype=torch.uint8, pin_memory=True))


def test_resume_with_state_many_times_the_free_gpu_memory() -> None:
    # 0.54e9 fp32 params in 64 bundles of 64 MiB: 4.3 GB of Adam state, loaded and stepped while only 512 MiB
    # beyond params and grads may be allocated (the window is 2 x 128 MiB).
    shapes = [(2048, 4096)] * 64
    params = make_params(shapes, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(3)
    groups = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True).param_groups
    sd = {
        "state": {
            i: {
                "step": torch.tensor(7.0),
                "exp_avg": torch.randn(s, generator=gen) * 1e-3,
                "exp_avg_sq": torch.rand(s, generator=gen) * 1e-6,
            }
            for i, s in enumerate(shapes)
        },
        "param_groups": [{**groups[0], "params": list(range(len(shapes)))}],
    }
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    # The reference: the resident optimizer loads the same checkpoint and steps once.
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for rp, p in zip(ref_params, params, strict=True):
        rp.grad = p.grad.clone()
    ref = _fused_adamw(ref_params)
    ref.load_state_dict(copy_state(sd))
    ref.step()
    expected = [p.detach().cpu() for p in ref_params]
    del ref, ref_params, rp
    torch.cuda.empty_cache()

    total = torch.cuda.get_device_properties(0).total_memory
    # The window bound (2 x 128 MiB) plus 256 MiB for the allocator's rounding. The limit applies to reserved
    # memory, so it starts from what is reserved now (free holes in segments that earlier tests left split).
    allowed = torch.cuda.memory_reserved() + 512 * MiB
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        opt = ChunkedOffloadOptimizer(_fused_adamw(params), chunk_size_mb=128)
        assert opt.plan.host_nbytes >= 8 * 512 * MiB
        opt.load_state_dict(sd)
        opt.step()
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    for a, b in zip(expected, params, strict=True):
        assert_equal(a, b)


def copy_state(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "state": {i: {k: v.clone() for k, v in e.items()} for i, e in sd["state"].items()},
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


@pytest.mark.parametrize("num_slots", [1, 2])
@pytest.mark.parametrize("mode", ["fp32", "remainder"])
def test_first_steps_with_large_chunks_match_reference(mode: str, num_slots: int) -> None:
    # Regression: fresh first-step scratch reused blocks still read by an earlier chunk's D2H.
    shapes = [(2048, 2048)] * 8
    params = make_params(shapes, torch.bfloat16, "cuda")
    ref_params = make_params(shapes, torch.bfloat16, "cuda")
    masters, ref = run_master_reference(_fused_adamw, ref_params, 4)
    opt = ChunkedOffloadOptimizer(_fused_adamw(params), chunk_size_mb=16, master_weights=mode, num_slots=num_slots)
    run_steps(opt, params, 4)
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b, "param")
    assert_states_equal(ref, masters, opt, params)


@pytest.mark.parametrize("impl", [{"fused": True}, {"foreach": True}])
def test_capturable_adamw_matches_unwrapped_on_gpu(impl: dict[str, bool]) -> None:
    shapes = [*ODD_SHAPES, (257, 513)]
    ref_params, params = make_params(shapes, torch.float32, "cuda"), make_params(shapes, torch.float32, "cuda")

    def make(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, capturable=True, **impl)

    opt = ChunkedOffloadOptimizer(make(params), chunk_size_mb=0.064)
    assert_runs_match(make(ref_params), ref_params, opt, params, 50, none_every=3)
    assert all(opt.state[p]["step"].device.type == "cuda" for p in params)  # kept where capturable keeps it


@pytest.mark.timing
def test_memory_between_steps_returns_to_the_allocator() -> None:
    params = make_params([(2048, 2048)] * 8, torch.float32, "cuda")
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=32)
    for p in params:
        p.grad = torch.ones_like(p)

    before = settled_cuda_memory()
    for _ in range(3):
        opt.step()
        opt.synchronize()
        assert settled_cuda_memory() == before  # non-fused AdamW keeps its step counters on the host
    # In a training loop the forward and backward between two steps let the last D2H land, so each step finds the
    # slots of the one before cached: no new cudaMalloc. (Back to back without a sync, the host can run steps ahead of
    # their D2H, and a step may then take a new generation of slots: 520 -> 620 MB measured on the H200.)
    opt.step()
    opt.synchronize()
    reserved = torch.cuda.memory_reserved()
    for _ in range(5):
        opt.step()
        opt.synchronize()
    assert torch.cuda.memory_reserved() == reserved


def _triton_momentum() -> type[torch.optim.Optimizer]:
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")

    @triton.jit
    def momentum_kernel(p_ptr, g_ptr, m_ptr, n, lr, beta, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        m = beta * tl.load(m_ptr + offs, mask=mask) + tl.load(g_ptr + offs, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(p_ptr + offs, tl.load(p_ptr + offs, mask=mask) - lr * m, mask=mask)

    class TritonMomentum(torch.optim.Optimizer):
        """A CUDA-only optimizer whose kernel reads raw pointers, as apex or Transformer Engine kernels do."""

        def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
            super().__init__(params, {"lr": lr, "beta": beta})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.dtype != torch.float32:
                        raise TypeError(f"TritonMomentum steps fp32 params only, got {p.dtype}")
                    state = self.state[p]
                    if not state:
                        state["m"] = torch.zeros_like(p)
                    n = p.numel()
                    momentum_kernel[(triton.cdiv(n, 1024),)](
                        p, p.grad, state["m"], n, group["lr"], group["beta"], BLOCK=1024
                    )

    return TritonMomentum


def test_generic_probe_of_a_cuda_only_optimizer_runs_on_the_gpu() -> None:
    cls = _triton_momentum()
    shapes = [(257, 513), (1000,), (64, 64)]
    ref_params, params = make_params(shapes, torch.float32, "cuda"), make_params(shapes, torch.float32, "cuda")
    opt = ChunkedOffloadOptimizer(cls(params), chunk_size_mb=0.6)
    assert opt.adapter.name == "generic"
    assert_runs_match(cls(ref_params), ref_params, opt, params, 10, none_every=3)


def test_a_failed_probe_leaves_the_cuda_context_healthy() -> None:
    cls = _triton_momentum()
    params = make_params([(64, 64)], torch.bfloat16, "cuda")
    with pytest.raises(TypeError, match="one step of a fresh instance on a cuda tensor"):
        ChunkedOffloadOptimizer(cls(params))
    torch.cuda.synchronize()
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8.0
