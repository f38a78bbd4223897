"""Step in backward: each chunk steps as soon as its grads are final, bitwise the plain loop without clipping."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, ChunkedOffloadWarning, Phase
from reference import adamw_pair, assert_equal, assert_pair_equal, assert_states_equal, internals, run_steps

_KIB = 1 / 1024  # MiB


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.unused = torch.nn.Linear(16, 16)  # never in the graph: no grad, no step, as with plain torch
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h))
        return self.head(self.frozen(h))


def _train(
    mode: str,
    *,
    steps: int = 5,
    micro: int = 1,
    master: str = "none",
    inner: str = "adamw",
    chunk_kib: float = 2,
    **kwargs: Any,
) -> tuple[_Net, ChunkedOffloadOptimizer]:
    torch.manual_seed(0)
    model = _Net()
    if master != "none":
        model = model.to(torch.bfloat16)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }[inner]
    opt = ChunkedOffloadOptimizer(
        make(model.parameters()),
        chunk_size_mb=chunk_kib * _KIB,
        master_weights=master,
        step_in_backward=mode == "backward",
        **kwargs,
    )
    opt.attach(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for m in range(micro):
            x = torch.randint(0, 40, (3, 5), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten()) / micro
            if mode == "backward" and m < micro - 1:
                with opt.accumulating():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    opt.wait_step()
    return model, opt


def _adamw_run(
    make_model: Callable[[], torch.nn.Module], mode: str, **kwargs: Any
) -> tuple[Any, ChunkedOffloadOptimizer]:
    """A model made after seeding 0 and a wrapped AdamW (lr 1e-2) that steps in the backward in mode "backward"."""
    torch.manual_seed(0)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, ChunkedOffloadOptimizer(inner, step_in_backward=mode == "backward", **kwargs)


def _assert_same(a: tuple[_Net, ChunkedOffloadOptimizer], b: tuple[_Net, ChunkedOffloadOptimizer]) -> None:
    for (name, pa), pb in zip(a[0].named_parameters(), b[0].parameters(), strict=True):
        assert_equal(pa, pb, name)
    assert_states_equal(a[1], list(a[0].parameters()), b[1], list(b[0].parameters()))


@pytest.mark.parametrize("chunk_kib", [2, 12])  # a param per chunk; several params per chunk
@pytest.mark.parametrize("inner", ["adamw", "sgd"])
@pytest.mark.parametrize("master", ["none", "fp32", "remainder"])
def test_stepping_in_backward_matches_the_plain_loop(inner: str, master: str, chunk_kib: float) -> None:
    plain = _train("plain", inner=inner, master=master, chunk_kib=chunk_kib)
    backward = _train("backward", inner=inner, master=master, chunk_kib=chunk_kib)
    _assert_same(plain, backward)
    assert len(backward[1].plan.all_chunks) >= 3
    if chunk_kib > 2:
        assert any(len(c.params) >= 2 for c in backward[1].plan.all_chunks)
    assert backward[1].stats is not None and backward[1].stats.chunks >= 3
    assert not internals(backward[1]).pool.allocated  # the slots went back at the end of the backward


def _raw_state(opt: ChunkedOffloadOptimizer, model: _Net) -> list[dict[str, Any]]:
    """The inner's state entries read straight from its table (not through ``opt.state``, which lands them)."""
    table = opt.inner.state
    return [dict(dict.get(table, p, {})) for p in model.parameters()]


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("reader", ["synchronize", "state_dict", "write", "load", "offload", "replan"])
def test_the_last_chunks_write_backs_are_held_until_the_host_copies_are_used(reader: str, slots: int) -> None:
    """[Note: Held write-back]: the chunks the backward finishes last (the embedding's last) keep their write-backs
    in their slots after the step, one with two slots and two with more; whatever reads or writes the host copies
    lands them first, and training stays bitwise."""
    plain, backward = _train("plain", steps=3), _train("backward", steps=3, num_slots=slots)
    model, opt = backward[0], backward[1]
    pipeline = internals(opt).pipeline
    held = pipeline.held.chunks
    assert len(held) == slots - 1 and 0 in held[-1].params  # the embedding: its grad is final last
    assert [s for s in internals(opt).pool.slots if s.buffer is not None] == sorted(
        pipeline.held.slots, key=lambda s: s.index
    )
    if reader == "synchronize":
        opt.synchronize()
    elif reader == "state_dict":
        opt.state_dict()
    elif reader == "write":  # into the inner's table: the held write-back must not land over it later
        for m, o in (plain, backward):
            o.inner.state[m.embed.weight]["exp_avg"] = torch.full_like(m.embed.weight, 0.5)
    elif reader == "load":
        opt.load_state_dict(plain[1].state_dict())
    elif reader == "offload":
        opt.offload()
    else:
        opt.replan()
    assert not pipeline.held.slots and not internals(opt).pool.allocated
    for got, want in zip(_raw_state(opt, model), _raw_state(plain[1], plain[0]), strict=True):
        assert got.keys() == want.keys()
        for key in got:
            assert_equal(got[key], want[key], key)
    if reader == "offload":
        opt.reload()
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):  # the next steps start from the landed copies
        x = torch.randint(0, 40, (3, 5), generator=gen)
        for m, o in (plain, backward):
            torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
            o.step()
            o.zero_grad()
    _assert_same(plain, backward)


def test_gradient_accumulation_steps_only_in_the_last_backward() -> None:
    _assert_same(_train("plain", micro=3), _train("backward", micro=3))


@pytest.mark.parametrize("budget", [False, True])
def test_resident_chunks_and_a_fraction_step_in_backward_too(budget: bool) -> None:
    kwargs: dict[str, Any] = {"gpu_budget_mb": 0.05} if budget else {"offload_fraction": 0.5}
    plain = _train("plain", **kwargs)
    backward = _train("backward", **kwargs)
    assert backward[1].plan.resident_chunks
    _assert_same(plain, backward)


def test_clipping_after_the_first_backward_is_refused_before_any_update() -> None:
    """[Note: Observed backward]: the first backward steps nothing, so a loop that clips is refused untouched."""
    torch.manual_seed(0)
    model = _Net()
    before = [p.detach().clone() for p in model.parameters()]
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=2 * _KIB, step_in_backward=True)
    x = torch.randint(0, 40, (3, 5))
    model(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="changed between the backward pass and step.*Nothing was updated"):
        opt.step()
    for p, b in zip(model.parameters(), before, strict=True):
        assert_equal(p, b)
    assert not opt.state
    opt.zero_grad()
    model(x).square().mean().backward()  # the wrapper goes on: this backward observes again
    opt.step()
    assert opt.state


def test_clipping_after_a_backward_that_stepped_is_refused() -> None:
    torch.manual_seed(0)
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=2 * _KIB, step_in_backward=True)
    x = torch.randint(0, 40, (3, 5))
    for clip in (False, False, True):
        model(x).square().mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            with pytest.raises(RuntimeError, match="has already updated the params .* did not see the change"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    assert internals(opt).runner.loop.observing  # after a refusal the next backward observes the loop again


def test_a_second_backward_without_step_is_refused() -> None:
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=2 * _KIB, step_in_backward=True)
    x = torch.randint(0, 40, (3, 5))
    model(x).square().mean().backward()  # observed
    opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    assert opt.phase is Phase.IN_BACKWARD
    with pytest.raises(RuntimeError, match="a second backward pass would step again"):
        model(x).square().mean().backward()


def test_grad_scaler_is_refused() -> None:
    """Seen through the scale GradScaler hands a fused inner (a non-fused one only gets unscaled grads: see docs)."""
    model = _Net()
    inner = torch.optim.AdamW(model.parameters(), fused=True)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=2 * _KIB, step_in_backward=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randint(0, 40, (3, 5))).square().mean()).backward()
    with pytest.raises(RuntimeError, match="GradScaler with step_in_backward=True"):
        scaler.step(opt)


def test_set_grads_by_hand_step_as_usual() -> None:
    """Without a backward pass (grads assigned), step() steps as in the plain mode."""
    torch.manual_seed(0)
    a, b = _Net(), _Net()
    b.load_state_dict(a.state_dict())
    plain = ChunkedOffloadOptimizer(torch.optim.AdamW(a.parameters()), chunk_size_mb=2 * _KIB)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(b.parameters()), chunk_size_mb=2 * _KIB, step_in_backward=True)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        if pa.requires_grad:
            pa.grad = torch.full_like(pa, 0.5)
            pb.grad = torch.full_like(pb, 0.5)
    plain.step()
    opt.step()
    _assert_same((a, plain), (b, opt))


def test_a_failing_chunk_raises_from_backward_and_leaves_the_wrapper_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunked_offload.stepping import ChunkStepper

    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=2 * _KIB, step_in_backward=True)
    x = torch.randint(0, 40, (3, 5))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    calls = {"n": 0}
    original = ChunkStepper.inner_step

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure in the inner step")
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ChunkStepper, "inner_step", failing)
        with pytest.raises(RuntimeError, match="injected failure") as info:
            model(x).square().mean().backward()
    assert "chunk 2 of the" in str(info.value.__notes__)
    assert not internals(opt).pool.allocated and opt.phase is Phase.IDLE
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_the_mode_must_be_a_bool_and_prefetch_is_a_no_op() -> None:
    with pytest.raises(TypeError, match="step_in_backward must be True or False"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(_Net().parameters()), step_in_backward=1)  # type: ignore[arg-type]
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), step_in_backward=True)
    model(torch.randint(0, 40, (3, 5))).square().mean().backward()
    opt.prefetch()
    assert not internals(opt).pool.allocated
    opt.step()


def test_dropping_the_wrapper_frees_it_although_params_hold_its_hooks() -> None:
    import gc
    import weakref

    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), step_in_backward=True)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    model(torch.randint(0, 40, (3, 5))).square().mean().backward()  # the orphaned hooks do nothing


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleavings_match_the_plain_loop(seed: int) -> None:
    """Iterations that step in backward, accumulate, or are skipped, mixed with offload/reload, checkpoints and
    state writes, against the same sequence on a plain wrapper."""
    import random

    rng = random.Random(seed)
    runs = []
    for mode in ("plain", "backward"):
        model, opt = _adamw_run(_Net, mode, chunk_size_mb=rng.choice([2, 12]) * _KIB, offload_fraction=0.6)
        opt.attach(model)
        runs.append((model, opt))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        op = rng.choice(["iterate"] * 4 + ["accumulate", "offload", "reload", "checkpoint", "write", "forward_only"])
        x = torch.randint(0, 40, (3, 5), generator=gen)
        for model, opt in runs:
            loss = lambda m=model, x=x: torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())  # noqa: E731
            if op == "iterate":
                loss().backward()
                opt.step()
                opt.zero_grad()
            elif op == "accumulate":
                with opt.accumulating() if opt.step_in_backward else contextlib.nullcontext():
                    loss().backward()
                loss().backward()
                opt.step()
                opt.zero_grad()
            elif op == "offload":
                opt.offload(non_blocking=True)
            elif op == "reload":
                opt.reload()
            elif op == "checkpoint":
                opt.load_state_dict(opt.state_dict(snapshot=True))
            elif op == "write":
                p = next(iter(model.parameters()))
                if p in opt.state and "exp_avg" in opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.full_like(p, 0.01)
            else:
                with torch.no_grad():
                    loss()
    _assert_same(runs[0], runs[1])


@pytest.mark.parametrize("head_outside", [False, True])
def test_reentrant_checkpointing_steps_every_chunk_once(head_outside: bool) -> None:
    """Each checkpointed segment's grads arrive in a nested backward; the step closes at the end of the outermost
    one, or at step() when no hook ran there (every param inside a segment)."""
    from torch.utils.checkpoint import checkpoint

    def train(mode: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(5))
        opt = ChunkedOffloadOptimizer(
            torch.optim.AdamW(layers.parameters(), lr=1e-2), chunk_size_mb=2 * _KIB, step_in_backward=mode == "backward"
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(3, 16, generator=gen, requires_grad=True)
            for i, layer in enumerate(layers):
                outside = head_outside and i == len(layers) - 1
                x = layer(x) if outside else checkpoint(layer, x, use_reentrant=True)
                x = torch.nn.functional.gelu(x)
            x.square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.wait_step()
        held = internals(opt).pipeline.held.slots
        assert [s for s in internals(opt).pool.slots if s.buffer is not None] == held  # [Note: Held write-back]
        assert bool(held) is (mode == "backward")
        opt.synchronize()
        assert not internals(opt).pool.allocated
        return [p.detach().clone() for p in layers.parameters()]

    for i, (a, b) in enumerate(zip(train("plain"), train("backward"), strict=True)):
        assert_equal(a, b, f"param {i}")


class _NormLast(torch.nn.Module):
    """Declares its norm after the linear it feeds, as an HF decoder layer declares its norms after its MLP: the
    backward finishes the norm's grads after the linear's, against reverse parameter order."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(self.norm(h)))


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(_NormLast() for _ in range(4)))
        self.unused = torch.nn.Linear(16, 16)  # no grad: never brought in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_the_backward_order_is_learned_so_that_no_chunk_is_staged_twice() -> None:
    """[Note: Backward order]: from the second backward on, each chunk with grads is staged once, and a chunk whose
    params got no grad is not staged at all."""
    runs = []
    for mode in ("plain", "backward"):
        # A chunk per bundle, but a norm's weight and bias go together.
        model, opt = _adamw_run(_Blocks, mode, chunk_size_mb=_KIB / 4)
        opt.attach(model)
        gen = torch.Generator().manual_seed(1)
        h2d = []
        for _ in range(4):
            model(torch.randn(3, 16, generator=gen)).square().mean().backward()
            opt.step()
            assert opt.stats is not None
            h2d.append(opt.stats.h2d_bytes)
            opt.zero_grad()
        runs.append((model, opt))
        if mode == "backward":
            assert len(opt.plan.all_chunks) >= 8
            unused = {internals(opt).placement.binding.index_of(p) for p in model.unused.parameters()}
            staged = sum(c.transfer_nbytes for c in opt.plan.all_chunks if not unused.issuperset(c.params))
            assert h2d == [0, staged, staged, staged]  # the first step creates the state; none is brought in twice
    _assert_same(runs[0], runs[1])


def test_the_backward_stages_a_chunk_per_slot_ahead() -> None:
    """[Note: Backward order]: each slot takes the next expected chunk as soon as it holds none, so the H2D of the
    chunk after next starts before the next one steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_size_mb=2 * _KIB, num_slots=2, step_in_backward=True
    )
    opt.attach(model)
    events: list[tuple[str, int]] = []
    pipeline = internals(opt).runner.pipeline
    stage, step = pipeline.stage, pipeline.step
    pipeline.stage = lambda chunk, slot: events.append(("stage", chunk.index)) or stage(chunk, slot)  # type: ignore[method-assign]
    pipeline.step = lambda chunk, *a: events.append(("step", chunk.index)) or step(chunk, *a)  # type: ignore[method-assign]
    for _ in range(2):
        events.clear()
        model(torch.randn(3, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    n = len(opt.plan.all_chunks)
    assert n >= 4
    last_two = [("stage", n - 1), ("stage", n - 2)]
    assert events[:3] == [*last_two, ("step", n - 1)]  # two chunks in flight before the first steps
    assert sorted(i for kind, i in events if kind == "stage") == list(range(n))  # each once


class _Detour(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.detour = torch.nn.Linear(16, 16)  # in the graph only on some iterations: its grads come last then
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(5)))

    def forward(self, x: torch.Tensor, detour: bool) -> torch.Tensor:
        return self.layers(torch.nn.functional.gelu(self.detour(x)) if detour else x)


@pytest.mark.parametrize("slots", [2, 3])
def test_chunks_held_as_the_last_ones_that_were_not_still_land_and_stay_bitwise(slots: int) -> None:
    """[Note: Held write-back]: when a chunk the last backward gave no grad gets one after the chunks held as the
    last, those are flushed and their slots reused; at most ``hold_limit`` stay held, and training stays bitwise."""
    runs = []
    for mode in ("plain", "backward"):
        model, opt = _adamw_run(_Detour, mode, chunk_size_mb=2 * _KIB, num_slots=slots)
        gen = torch.Generator().manual_seed(1)
        for k in range(5):
            model(torch.randn(3, 16, generator=gen), detour=k in (2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if mode == "backward":
                pipeline = internals(opt).pipeline
                assert len(pipeline.held.slots) <= pipeline.held.limit == max(1, min(2, slots - 1))
                if k == 4:  # the detour (with state now) got grads after the chunks expected last: held, last
                    detour = internals(opt).placement.binding.index_of(model.detour.weight)
                    assert detour in pipeline.held.chunks[-1].params
                assert [s for s in internals(opt).pool.slots if s.buffer is not None] == sorted(
                    pipeline.held.slots, key=lambda s: s.index
                )
        opt.synchronize()
        runs.append((model, opt))
    _assert_same(runs[0], runs[1])


@pytest.mark.parametrize("slots", [2, 3])
def test_a_group_whose_code_path_depends_on_every_grad_steps_at_the_end_of_the_backward(slots: int) -> None:
    """[Note: Coupled params]: torch SGD (momentum, foreach) picks one code path per (dtype, device) group, the
    per-tensor one if any param with a grad has no momentum buffer. The detour's first grad comes on the third step,
    last in its backward, after its group's other chunks are final: while the detour has no buffer its group steps
    at the end of the backward, the other group as its grads arrive, and both stay bitwise."""
    import copy

    from chunked_offload.in_backward import BackwardSchedule
    from chunked_offload.pipeline import ChunkPipeline

    def groups(m: _Detour) -> list[dict[str, Any]]:  # group 0: params 0..5 (the detour's first), group 1: 6..11
        return [
            {"params": [*m.detour.parameters(), *m.layers[:2].parameters()]},
            {"params": [*m.layers[2:].parameters()]},
        ]

    torch.manual_seed(0)
    plain_model = _Detour().to(torch.bfloat16)
    model = copy.deepcopy(plain_model)
    plain = torch.optim.SGD(groups(plain_model), lr=0.1, momentum=0.9, foreach=True)
    inner = torch.optim.SGD(groups(model), lr=0.1, momentum=0.9, foreach=True)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=2 * _KIB, num_slots=slots, step_in_backward=True)
    events: list[Any] = []
    step, close = ChunkPipeline.step, BackwardSchedule.close
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChunkPipeline, "step", lambda self, c, *a: events.append(c.params) or step(self, c, *a))
        patch.setattr(BackwardSchedule, "close", lambda self: events.append("end") or close(self))
        gen = torch.Generator().manual_seed(1)
        for k in range(4):
            x = torch.randn(3, 16, generator=gen).to(torch.bfloat16)
            events.clear()
            for m, o in ((plain_model, plain), (model, opt)):
                m(x, detour=k == 2).float().square().mean().backward()
                o.step()
                o.zero_grad()
            if k in (1, 2, 3):
                end = events.index("end")
                coupled = [min(params) < 6 for params in events[:end] + events[end + 1 :]]
                if k < 3:  # the detour has no buffer yet: its group waits for every grad
                    assert not any(coupled[:end]) and all(coupled[end:]) and end > 0, events
                else:
                    assert any(coupled[:end]), events
    opt.synchronize()
    for (name, a), b in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)
    assert_states_equal(plain, list(plain_model.parameters()), opt, list(model.parameters()))


def test_step_in_backward_where_no_grad_hook_fires_warns_once_and_stays_exact() -> None:
    """Grads assigned by hand (as Megatron assigns its fp32 main grads) reach no post-accumulate-grad hook: every
    chunk steps in step(), bitwise, and the wrapper says so once, from the second step on (the first backward only
    observes)."""
    ref, ref_params, opt, params = adamw_pair(step_in_backward=True)
    run_steps(ref, ref_params, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(opt, params, 1)
        assert not caught
        run_steps(opt, params, 3, first_step=1)
    messages = [str(w.message) for w in caught if issubclass(w.category, ChunkedOffloadWarning)]
    assert len(messages) == 1 and "got its grad from autograd" in messages[0] and "overlap=True" in messages[0]
    assert_pair_equal(ref, ref_params, opt, params)


def test_step_in_backward_whose_backward_steps_never_warns_that_no_hook_fired() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=1 / 1024, step_in_backward=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChunkedOffloadWarning)
        for _ in range(4):
            model(torch.randn(3, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
