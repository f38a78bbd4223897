"""overlap=True with an attached model: bitwise equal to the plain loop, the forward waits for its own params, and the
step runs its chunks in the order the forward reads them. On the CPU the overlapped step runs synchronously through
the same code; the stream races are in tests/cuda/test_iteration_cuda.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, Phase
from reference import (
    ODD_SHAPES,
    assert_equal,
    assert_pair_equal,
    assert_states_equal,
    internals,
    make_grads,
    make_params,
    set_grads,
)

_KIB = 1 / 1024  # MiB


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: read by two modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def _train(overlap: bool, attach: bool, clip: bool, steps: int = 6) -> tuple[_Net, ChunkedOffloadOptimizer]:
    torch.manual_seed(0)
    model = _Net()
    opt = ChunkedOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_size_mb=4 * _KIB, overlap=overlap
    )
    if attach:
        opt.attach(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 7), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.prefetch()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    opt.wait_step()
    return model, opt


@pytest.mark.parametrize("clip", [False, True])
def test_overlap_with_attach_matches_the_plain_loop(clip: bool) -> None:
    plain_model, plain = _train(overlap=False, attach=False, clip=clip)
    model, opt = _train(overlap=True, attach=True, clip=clip)
    for (name, a), b in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)
    assert_states_equal(plain, list(plain_model.parameters()), opt, list(model.parameters()))
    assert opt.stats is not None and opt.stats.exposed_seconds is not None  # on the CPU the step is synchronous


def test_overlap_without_an_attached_model_warns_once_and_stays_exact() -> None:
    from chunked_offload import ChunkedOffloadWarning

    plain_model, plain = _train(overlap=False, attach=False, clip=False)
    with pytest.warns(ChunkedOffloadWarning, match="without an attached model.*opt.attach") as record:
        model, opt = _train(overlap=True, attach=False, clip=False)
    assert sum(issubclass(w.category, ChunkedOffloadWarning) for w in record) == 1  # six steps, one warning
    for (name, a), b in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert_equal(a, b, name)


def test_an_attached_models_state_dict_joins_the_step() -> None:
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap=True)
    joined: list[int] = []
    internals(opt).gate.join = lambda: joined.append(1)  # type: ignore[method-assign]
    handle = opt.attach(model)
    model.state_dict()
    assert joined, "state_dict() of an attached model did not join the step"
    joined.clear()
    model.load_state_dict(model.state_dict())
    assert joined
    handle.remove()
    joined.clear()
    model.state_dict()
    assert not joined  # the hooks go with the handle


def test_attach_hooks_every_module_with_params_once_and_can_be_removed() -> None:
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap=True)
    handle = opt.attach(model)
    with_params = [m for m in model.modules() if list(m.parameters(recurse=False))]
    assert len(handle) == len(with_params) == 4  # embed, two Linear, head (tied weight)
    assert all(len(m._forward_pre_hooks) == 1 for m in with_params)
    handle.remove()
    assert all(len(m._forward_pre_hooks) == 0 for m in with_params)
    with pytest.raises(TypeError, match="attach\\(\\) takes a torch.nn.Module, got list"):
        opt.attach([model])  # type: ignore[arg-type]


def test_overlap_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="overlap must be True or False, got 'yes'"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(make_params(ODD_SHAPES)), overlap="yes")  # type: ignore[arg-type]


class _SeesLr(torch.optim.AdamW):
    """AdamW that records which ``lr`` object each call of its step reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_an_overlapped_step_reads_copies_of_tensor_hyperparameters() -> None:
    """A scheduler updates a tensor lr in place right after step(), while an overlapped step may still read it."""
    params, ref_params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    lr = torch.tensor(1e-2)
    inner = _SeesLr(params, lr=lr)
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=4 * _KIB, overlap=True)
    ref = torch.optim.AdamW(ref_params, lr=torch.tensor(1e-2))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (opt, ref)]
    for step in range(3):
        for o, ps in ((opt, params), (ref, ref_params)):
            set_grads(ps, make_grads(ps, step))
            o.step()
            o.zero_grad()
        for sched in scheds:
            sched.step()
    assert len(inner.seen) >= 3 * len(opt.plan.chunks)
    assert all(seen is not lr for seen in inner.seen)  # every chunk read a copy, never the scheduler's tensor
    assert opt.param_groups[0]["lr"] is lr  # and the group holds the user's tensor again
    assert_pair_equal(ref, ref_params, opt, params)


class Chain(torch.nn.Module):
    """One module per param, run in param order: the forward reads each param inside its own module."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.links = torch.nn.ModuleList(torch.nn.Module() for _ in params)
        for link, p in zip(self.links, params, strict=True):
            link.w = p
            link.forward = lambda link=link: link.w.sum()  # type: ignore[method-assign]

    def forward(self) -> torch.Tensor:
        return torch.stack([link() for link in self.links]).sum()


def _deferringadamw_pair() -> tuple[torch.optim.Optimizer, list, ChunkedOffloadOptimizer, list, Chain]:
    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB, overlap=True)
    chain = Chain(params)
    opt.attach(chain)
    assert len(opt.plan.all_chunks) > opt.num_slots + 1
    return ref, ref_params, opt, params, chain


class _Backwards(Chain):
    """Reads its last params first, as FSDP2's root unit all-gathers the LM head before the first layer runs."""

    def forward(self) -> torch.Tensor:
        first = [self.links[-1], self.links[-2]]
        return torch.stack([link() for link in [*first, *self.links[:-2]]]).sum()


def test_an_overlapped_step_runs_its_chunks_in_the_order_the_forward_reads_them() -> None:
    ref_params, params = make_params([(16, 16)] * 12), make_params([(16, 16)] * 12)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB, overlap=True)
    model = _Backwards(params)
    opt.attach(model)
    last, second_last = len(params) - 1, len(params) - 2
    for k in range(4):
        ref.zero_grad()
        set_grads(ref_params, make_grads(ref_params, k))
        ref.step()
        model()
        set_grads(params, make_grads(params, k))
        opt.step()
        run = internals(opt).schedule.deferred if internals(opt).schedule is not None else None
        if k > 0:  # the first step creates state and never defers
            assert run is not None
            assert run.chunks[0].params[-1] == last and second_last in run.chunks[0].params + run.chunks[1].params
            assert opt.phase is Phase.DEFERRED
            model.links[-1]()  # the first read asks only for the head: nothing after it is enqueued yet
            assert internals(opt).schedule.deferred is run and run.next < len(run.chunks)
        opt.zero_grad()
    model()
    assert_pair_equal(ref, ref_params, opt, params)


def test_a_plain_step_keeps_parameter_order_whatever_the_forward_read() -> None:
    params = make_params([(16, 16)] * 12)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-2), chunk_size_mb=4 * _KIB)
    model = _Backwards(params)
    opt.attach(model)  # warns: nothing to gate without overlap
    for k in range(2):
        model()
        set_grads(params, make_grads(params, k))
        assert [c.index for c in internals(opt).runner.chunks_to_step()] == sorted(c.index for c in opt.plan.all_chunks)
        opt.step()


def _enqueue_only(self: Any, indices: list[int], streams: Any = ()) -> None:
    """A mutant of ``StepWaits.wait_for``: the gates still enqueue the deferred chunks but do not wait for them."""
    self.runner.advance(indices)


def test_the_emulated_step_stream_catches_a_wait_removed_from_the_forward_gates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mutation: without their waits the gates pass on the CPU's synchronous step, and fail with the step stream
    emulated ([Note: Emulated step stream]), where the forward reads params whose update nobody waited for."""
    from chunked_offload.waits import StepWaits

    plain_model, _ = _train(overlap=False, attach=False, clip=True)
    monkeypatch.setattr(StepWaits, "wait_for", _enqueue_only)
    monkeypatch.setenv("CHUNKED_OFFLOAD_EMULATE_STREAMS", "0")
    model, _ = _train(overlap=True, attach=True, clip=True)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert_equal(a, b)
    monkeypatch.setenv("CHUNKED_OFFLOAD_EMULATE_STREAMS", "1")
    model, _ = _train(overlap=True, attach=True, clip=True)
    assert any(not torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters(), strict=True))


@pytest.mark.parametrize("emulated", [False, True])
def test_a_pre_hook_that_runs_before_the_gate_reads_params_the_step_has_not_updated(
    monkeypatch: pytest.MonkeyPatch, emulated: bool
) -> None:
    """A forward pre-hook put before attach()'s gate (prepended after attach) reads the params before their update
    is waited for: on a GPU it races the step. With the step stream emulated it reads the old bytes every time."""
    monkeypatch.setenv("CHUNKED_OFFLOAD_EMULATE_STREAMS", "1" if emulated else "0")
    torch.manual_seed(0)
    model = _Net()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_size_mb=4 * _KIB, overlap=True)
    opt.attach(model)
    layer = model.body[0]
    early: list[torch.Tensor] = []
    late: list[torch.Tensor] = []
    layer.register_forward_pre_hook(lambda m, args: early.append(m.weight.detach().clone()), prepend=True)
    layer.register_forward_pre_hook(lambda m, args: late.append(m.weight.detach().clone()))
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randint(0, 50, (4, 7), generator=gen)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    stale = [not torch.equal(before, after) for before, after in zip(early, late, strict=True)]
    assert any(stale) == emulated, stale


def test_a_model_in_a_reference_cycle_goes_with_its_wrapper_in_one_collection() -> None:
    """Megatron's modules and optimizers sit in reference cycles (hook closures): dropping the wrapper and the model
    frees the model in the same collection; the wrapper's finalizer (which takes the hooks off) holds it only weakly."""
    import gc
    import weakref

    model = _Net()
    model.loop = [model]  # type: ignore[assignment]  # a cycle, as a closure over the module makes one
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap=True)
    opt.attach(model, blocks=True)
    model(torch.randint(0, 50, (2, 3))).sum().backward()
    opt.step()
    holder: dict = {"opt": opt}
    holder["self"] = holder  # the wrapper too goes only in a collection (Megatron's optimizer holds it so)
    dead = weakref.ref(model)
    del model, opt, holder
    gc.collect()
    assert dead() is None
