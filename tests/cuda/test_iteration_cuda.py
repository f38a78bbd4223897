"""Inside the iteration on the GPU: the overlapped step is raced against the next forward, async offload/reload,
prefetch, the budget and the telemetry."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.stepping import ChunkStepper
from reference import (
    UNDER_SANITIZER,
    assert_equal,
    assert_states_equal,
    internals,
    make_params,
    partly_resident_adamw,
    run_steps,
    settled_cuda_memory,
)

pytestmark = pytest.mark.cuda
MiB = 2**20
SLEEP = 20_000_000  # GPU cycles, about 10 ms per chunk: the next forward would overtake the step without its waits


class _Mlp(torch.nn.Module):
    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def _slow_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk's step starts late on whatever stream runs it (the gate's stream when overlapped)."""
    original = ChunkStepper.inner_step

    def slowed(self: Any, *args: Any, **kwargs: Any) -> Any:
        torch.cuda._sleep(SLEEP)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChunkStepper, "inner_step", slowed)


def _train(
    *,
    overlap: bool,
    attach: bool,
    scaler: bool = False,
    master: str = "none",
    steps: int = 5,
    clip: bool = True,
    **kwargs: Any,
) -> tuple[_Mlp, ChunkedOffloadOptimizer, list[float]]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if master != "none" else torch.float32
    model = _Mlp().to("cuda", dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=8, overlap=overlap, master_weights=master, **kwargs)
    if attach:
        opt.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # updates the tensor lr in place
    grad_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if scaler else None
    gen = torch.Generator(device="cuda").manual_seed(1)
    host_seconds = []
    for _ in range(steps):
        x = torch.randn(64, 1024, device="cuda", generator=gen, dtype=dtype)
        loss = model(x).float().square().mean()
        if grad_scaler is not None:
            grad_scaler.scale(loss).backward()
            grad_scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            t0 = time.perf_counter()
            grad_scaler.step(opt)
            host_seconds.append(time.perf_counter() - t0)
            grad_scaler.update()
        else:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.prefetch()
            t0 = time.perf_counter()
            opt.step()
            host_seconds.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        sched.step()
    opt.wait_step()
    torch.cuda.synchronize()
    return model, opt, host_seconds


def _assert_models_equal(
    a: tuple[_Mlp, ChunkedOffloadOptimizer, Any], b: tuple[_Mlp, ChunkedOffloadOptimizer, Any]
) -> None:  # noqa: E501
    for (name, pa), pb in zip(a[0].named_parameters(), b[0].parameters(), strict=True):
        assert_equal(pa, pb, name)
    assert_states_equal(a[1], list(a[0].parameters()), b[1], list(b[0].parameters()))


@pytest.mark.parametrize(
    "scaler, master", [(False, "none"), (True, "none"), (False, "fp32")], ids=["fp32", "fp32-scaler", "bf16-masters"]
)  # GradScaler cannot unscale bf16 grads
def test_an_overlapped_step_raced_by_the_next_forward_stays_exact(
    monkeypatch: pytest.MonkeyPatch, scaler: bool, master: str
) -> None:
    plain = _train(overlap=False, attach=False, scaler=scaler, master=master)
    with monkeypatch.context() as patch:
        _slow_chunks(patch)
        overlapped = _train(overlap=True, attach=True, scaler=scaler, master=master)
    _assert_models_equal(plain, overlapped)
    stats = overlapped[1].stats
    assert stats is not None and stats.exposed_seconds is None and stats.chunks >= 8
    # The step returned long before its slowed chunks ran: the host did not wait for them (the sanitizer's
    # instrumented launches make the host wait).
    assert UNDER_SANITIZER or min(overlapped[2]) < stats.chunks * SLEEP / 2e9


@pytest.mark.timing
def test_without_the_forward_gate_the_race_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation check: with attached modules that do not wait for their chunks, the slowed step is overtaken."""
    from chunked_offload.gate import StepGate

    plain = _train(overlap=False, attach=False)
    with monkeypatch.context() as patch:
        _slow_chunks(patch)
        patch.setattr(StepGate, "wait_params", lambda self, indices, streams=(): None)
        ungated = _train(overlap=True, attach=True)
    with pytest.raises(AssertionError):
        _assert_models_equal(plain, ungated)


def test_an_overlapped_step_without_attach_waits_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """No module waits for its params: step() makes the caller's stream wait for the whole (slowed) step."""
    from chunked_offload import ChunkedOffloadWarning

    plain = _train(overlap=False, attach=False)
    with monkeypatch.context() as patch:
        _slow_chunks(patch)
        with pytest.warns(ChunkedOffloadWarning, match="overlap=True without an attached model") as record:
            unattached = _train(overlap=True, attach=False)
    assert len([w for w in record if issubclass(w.category, ChunkedOffloadWarning)]) == 1
    _assert_models_equal(plain, unattached)


def test_a_plain_loop_with_overlap_and_no_attach_matches_the_unwrapped_loop() -> None:
    """The case that raced before: 16 x Linear(4096, 4096), fused AdamW, 64 MB chunks, a plain loop."""
    import warnings

    def train(wrap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(16))).cuda()
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        if wrap:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = ChunkedOffloadOptimizer(opt, chunk_size_mb=64, overlap=True)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(6):
            model(torch.randn(256, 4096, device="cuda", generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in model.parameters()]

    for i, (a, b) in enumerate(zip(train(False), train(True), strict=True)):
        assert_equal(a, b, f"param {i}")


def test_an_attached_models_state_dict_waits_for_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _train(overlap=False, attach=False, steps=3)
    x = torch.randn(64, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    with monkeypatch.context() as patch:
        _slow_chunks(patch)
        model, opt, _ = _train(overlap=True, attach=True, steps=3)
        model(x).square().mean().backward()
        opt.step()  # slowed; the model's state_dict() must wait for it without opt.wait_step()
        saved = {k: v.to("cpu", copy=True) for k, v in model.state_dict().items()}
    plain[0](x).square().mean().backward()
    plain[1].step()
    for k, v in plain[0].state_dict().items():
        assert_equal(v, saved[k], k)


def test_state_dict_and_offload_after_an_overlapped_step_wait_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _train(overlap=False, attach=False, offload_fraction=0.5, steps=4)
    with monkeypatch.context() as patch:
        _slow_chunks(patch)
        model, opt, _ = _train(overlap=True, attach=True, offload_fraction=0.5, steps=4)
        x = torch.randn(64, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
        model(x).square().mean().backward()
        opt.step()  # slowed; nothing below waits on the host before the wrapper does
        got = opt.state_dict(snapshot=True)
        opt.offload()
    plain_model, plain_opt = plain[0], plain[1]
    plain_model(x).square().mean().backward()
    plain_opt.step()
    expected = plain_opt.state_dict(snapshot=True)
    for pid, entry in expected["state"].items():
        for key, value in entry.items():
            assert_equal(value, got["state"][pid][key], f"{pid}/{key}")


@pytest.mark.timing
def test_non_blocking_offload_frees_the_resident_state_at_once_and_reload_is_exact() -> None:
    ref_params, params, ref, opt = partly_resident_adamw()
    resident = opt.plan.resident_nbytes
    assert resident >= 4 * 32 * MiB
    run_steps(ref, ref_params, 4)
    run_steps(opt, params, 2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = opt.offload(non_blocking=True)
    freed = before - torch.cuda.memory_allocated()
    handle.wait()
    assert freed >= resident, (freed, resident)
    assert opt.offload(non_blocking=True) is handle
    # A rollout may take the memory now: once the copy has read it, the allocator reuses it.
    rollout = torch.empty(resident, dtype=torch.uint8, device="cuda").fill_(7)
    del rollout
    opt.reload(non_blocking=True)  # the next step is ordered after the copy without a host wait
    run_steps(opt, params, 2, first_step=2)
    opt.synchronize()
    for a, b in zip(ref_params, params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params, opt, params)


def test_stats_report_the_link_and_the_memory() -> None:
    params = make_params([(4096, 4096)] * 8, torch.float32, "cuda")
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3, fused=True), chunk_size_mb=64)
    run_steps(opt, params, 3)
    stats = opt.stats
    assert stats is not None
    moved = sum(c.transfer_nbytes for c in opt.plan.chunks)
    assert stats.h2d_bytes == stats.d2h_bytes == moved
    assert stats.link_gbps > 5, stats
    assert stats.exposed_seconds is not None and 0 < stats.exposed_seconds <= stats.seconds
    assert stats.pinned_host_bytes == opt.plan.host_nbytes
    assert stats.window_bytes <= opt.plan.window_bound_nbytes
    print(f"\n{stats}")


@pytest.mark.parametrize("master,num_slots", [("none", 2), ("fp32", 2), ("fp32", 3)])
def test_stepping_in_backward_raced_by_the_rest_of_the_backward_stays_exact(
    monkeypatch: pytest.MonkeyPatch, master: str, num_slots: int
) -> None:
    """Chunks step on the gate's stream while the backward goes on; each waits for its grads, and the next forward
    waits for its own params' chunk. With 3 slots the last two chunks' write-backs are held into the next step,
    whose H2D of each waits for its own copy ([Note: Held write-back])."""
    plain = _train(overlap=False, attach=False, master=master, clip=False)
    with monkeypatch.context() as patch:
        _slow_chunks(patch)
        in_backward = _train(
            overlap=False, attach=True, master=master, clip=False, step_in_backward=True, num_slots=num_slots
        )
    _assert_models_equal(plain, in_backward)
    stats = in_backward[1].stats
    assert stats is not None and stats.chunks >= 8
    assert internals(in_backward[1]).runner.pipeline.held.limit == num_slots - 1


def _auto_loop(mode: str, width: int, headroom_share: float | None = None) -> tuple[_Mlp, ChunkedOffloadOptimizer]:
    """5 steps of an MLP with gpu_budget_mb="auto" (mode overlap/backward) or the synchronous wrapper ("sync").

    ``headroom_share``: before the step that first reads the memory (the third, [Note: Auto budget]), set the
    headroom so that the spare holds that share of the state.
    """
    from chunked_offload.budget import read_device_memory

    # The budget reads the process's reserved peak: what the loops before this one reserved is not this loop's.
    settled_cuda_memory()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = _Mlp(width=width).to("cuda")
    inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True)
    opt = ChunkedOffloadOptimizer(
        inner, chunk_size_mb=8, gpu_budget_mb=None if mode == "sync" else "auto", overlap=mode == "overlap",
        step_in_backward=mode == "backward",
    )  # fmt: skip
    if mode != "sync":
        opt.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        x = torch.randn(64, width, device="cuda", generator=gen)
        model(x).float().square().mean().backward()
        if step == 2 and headroom_share is not None:
            reading = read_device_memory(torch.device("cuda"))
            budget = internals(opt).runner.budget
            assert reading is not None and budget is not None
            state, resident = opt.plan.host_nbytes + opt.plan.resident_nbytes, opt.plan.resident_nbytes
            # backward: the step of this iteration already made it all resident; the next one shrinks it
            usage = max(budget.usage, reading.peak - resident)  # the training's own peak
            budget.headroom = reading.capacity - usage - int(headroom_share * state)
        opt.prefetch()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    opt.wait_step()
    torch.cuda.synchronize()
    return model, opt


@pytest.mark.timing  # under compute-sanitizer the tool's own device memory is in the budget's reading
@pytest.mark.parametrize("mode", ["overlap", "backward"])
def test_the_auto_budget_keeps_what_fits_resident_and_stays_exact(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A model whose state fits is all resident from the second step; with a headroom that leaves room for half of
    it, about half is (the allocator's reserved peak moves by some MiB: the state is 1 GiB); the chunks still race
    the forward (slowed), and both end bitwise equal to the synchronous wrapper."""
    width = 4096
    reference = _auto_loop("sync", width)
    _slow_chunks(monkeypatch)
    model, opt = _auto_loop(mode, width)
    assert opt.stats is not None and opt.stats.resident_share == 1.0 and not opt.plan.chunks
    _assert_models_equal((*reference, None), (model, opt, None))
    del model, opt
    model, opt = _auto_loop(mode, width, headroom_share=0.5)
    assert opt.stats is not None and 0.3 < opt.stats.resident_share < 0.7, opt.stats.resident_share
    _assert_models_equal((*reference, None), (model, opt, None))


@pytest.mark.parametrize("resident", [True, False], ids=["all-resident", "staged"])
def test_an_overlapped_step_of_eager_chunks_only_runs_on_the_callers_stream(resident: bool) -> None:
    """With every chunk resident the caller's stream waits for all of them right after ``step()``: the step runs on
    that stream, as a synchronous one, and its own stream gets no work; with staged chunks it does. Both exact."""
    plain = _train(overlap=False, attach=False)
    budget = 1024 if resident else None
    model, opt, _ = overlapped = _train(overlap=True, attach=True, gpu_budget_mb=budget)
    _assert_models_equal(plain, overlapped)
    assert (opt.plan.host_nbytes == 0) if resident else (opt.plan.resident_nbytes == 0)
    stream = internals(opt).runner.gate.stream
    assert stream is not None
    model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
    torch.cuda._sleep(SLEEP)  # the caller's stream is busy: work on the step stream waits for it
    opt.step()
    assert stream.query() is resident  # nothing pending there, or the step waiting behind the sleep
    opt.synchronize()
