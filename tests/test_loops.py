"""The loops users write between backward(), step() and the next forward: each is bitwise equal to the plain loop in
the fast modes, or refused (before any update where the loop shows it on its first iteration) with the call to make
instead ([Note: Inputs of a step], [Note: Observed backward])."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, ChunkedOffloadWarning
from reference import assert_equal, internals

_KIB = 1 / 1024  # MiB
FAST = ["overlap", "backward"]
MASTERS = ["none", "fp32"]

Hook = Callable[[int, torch.nn.Module, Any], None]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h))
        return self.head(h)


def build(mode: str, master: str = "none", *, attach: bool = True, **options: Any) -> tuple[Net, Any]:
    """The model and its optimizer: plain torch (or the synchronous wrapper, with masters) for ``mode="plain"``."""
    torch.manual_seed(0)
    model = Net()
    if master != "none":
        model = model.to(torch.bfloat16)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mode == "plain" and master == "none":
        return model, inner
    opt = ChunkedOffloadOptimizer(
        inner,
        chunk_size_mb=options.pop("chunk_size_mb", 2 * _KIB),
        master_weights=master,
        overlap=mode == "overlap",
        step_in_backward=mode == "backward",
        **options,
    )
    if mode in FAST and attach:
        opt.attach(model)
    return model, opt


def batch(i: int) -> torch.Tensor:
    return torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(100 + i))


def loss_of(model: torch.nn.Module, i: int) -> torch.Tensor:
    x = batch(i)
    return torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())


def train(
    model: torch.nn.Module,
    opt: Any,
    steps: range,
    *,
    after_backward: Hook | None = None,
    after_step: Hook | None = None,
    zero: bool = True,
) -> None:
    for i in steps:
        loss_of(model, i).backward()
        if after_backward is not None:
            after_backward(i, model, opt)
        opt.step()
        if after_step is not None:
            after_step(i, model, opt)
        if zero:
            opt.zero_grad()
    if hasattr(opt, "wait_step"):
        opt.wait_step()


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_equal(pa, pb, name)


def assert_untouched(model: torch.nn.Module, before: list[torch.Tensor]) -> None:
    for (name, p), b in zip(model.named_parameters(), before, strict=True):
        assert_equal(p, b, f"{name} was updated")


def same_loop(mode: str, master: str, steps: int = 4, **hooks: Any) -> None:
    """The loop with ``hooks`` gives the same params in ``mode`` as in the plain loop."""
    plain, wrapped = build("plain", master), build(mode, master)
    train(*plain, range(steps), **hooks)
    train(*wrapped, range(steps), **hooks)
    assert_same(plain[0], wrapped[0])


def each_grad(fn: Callable[[torch.nn.Parameter], None]) -> Hook:
    def hook(i: int, model: torch.nn.Module, opt: Any) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    fn(p)

    return hook


# ---------------------------------------------------------------------------------------------------------- case 1
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("mode", FAST)
@pytest.mark.parametrize(
    "write",
    ["model.zero_grad(set_to_none=False)", "p.grad.zero_()", "p.grad.mul_(0.5)", "opt.zero_grad(set_to_none=False)"],
)
def test_grads_written_in_place_after_step_do_not_reach_the_step(mode: str, master: str, write: str) -> None:
    """The overlapped step owns copies of the grads it reads after step() returned."""
    hooks: dict[str, Hook] = {
        "model.zero_grad(set_to_none=False)": lambda i, m, o: m.zero_grad(set_to_none=False),
        "p.grad.zero_()": each_grad(lambda p: p.grad.zero_()),  # type: ignore[union-attr]
        "p.grad.mul_(0.5)": each_grad(lambda p: p.grad.mul_(0.5)),  # type: ignore[union-attr]
        "opt.zero_grad(set_to_none=False)": lambda i, m, o: o.zero_grad(set_to_none=False),
    }
    same_loop(mode, master, after_step=hooks[write])


@pytest.mark.parametrize("mode", FAST)
def test_a_loop_that_never_zeroes_its_grads_accumulates_as_plain_torch(mode: str) -> None:
    same_loop(mode, "none", zero=False)


@pytest.mark.parametrize("master", MASTERS)
def test_params_written_in_place_between_step_and_forward_are_refused(master: str) -> None:
    """Weight clipping after an overlapped step would be updated over; opt.wait_step() first makes it exact."""
    model, opt = build("overlap", master)
    train(model, opt, range(2))
    loss_of(model, 2).backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.1, 0.1)
    with pytest.raises(RuntimeError, match=r"written in place after step\(\) returned .* opt.wait_step\(\)"):
        loss_of(model, 3)

    def clip(i: int, m: torch.nn.Module, o: Any) -> None:
        if hasattr(o, "wait_step"):
            o.wait_step()
        with torch.no_grad():
            for p in m.parameters():
                p.clamp_(-0.1, 0.1)

    same_loop("overlap", master, after_step=clip)


@pytest.mark.parametrize("master", MASTERS)
def test_resident_params_written_right_after_an_overlapped_step_follow_its_update(master: str) -> None:
    """Resident chunks step inside step() ([Note: Deferred chunks]), so weight clipping of their params needs no
    wait_step(): it comes after their update, as in the plain loop."""
    probe = build("overlap", master, offload_fraction=0.5)[1]
    chunks = probe.plan.all_chunks
    resident = {i for c in chunks if c.home.value == "device" for i in c.params}
    assert resident and sum(c.home.value == "host" for c in chunks) > probe.num_slots  # and deferred ones

    def clip(i: int, m: torch.nn.Module, o: Any) -> None:
        with torch.no_grad():
            for k, p in enumerate(m.parameters()):
                if k in resident:
                    p.clamp_(-0.1, 0.1)

    plain, wrapped = build("plain", master), build("overlap", master, offload_fraction=0.5)
    train(*plain, range(4), after_step=clip)
    train(*wrapped, range(4), after_step=clip)
    assert_same(plain[0], wrapped[0])


# ---------------------------------------------------------------------------------------------- cases 3, 4 and 14
def _replace(i: int, model: torch.nn.Module, opt: Any) -> None:
    for p in model.parameters():
        p.grad = p.grad * 0.5  # type: ignore[operator]


def _warmup(i: int, model: torch.nn.Module, opt: Any) -> None:
    for g in opt.param_groups:
        g["lr"] = 1e-2 * (i + 1) / 4


def _clip(i: int, model: torch.nn.Module, opt: Any) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


CHANGES = {"replaced grads": _replace, "lr warmup": _warmup, "clipping": _clip}


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_backward_and_step_is_refused_before_any_update(change: str, master: str) -> None:
    """[Note: Observed backward]: the loop shows it on its first iteration, which steps nothing in the backward."""
    model, opt = build("backward", master)
    before = params_of(model)
    with pytest.raises(RuntimeError, match="Nothing was updated"):
        train(model, opt, range(1), after_backward=CHANGES[change])
    assert_untouched(model, before)
    # overlap=True runs the same loop bitwise
    same_loop("overlap", master, after_backward=CHANGES[change])


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_backwards_that_stepped_is_refused_at_step(change: str) -> None:
    model, opt = build("backward")
    train(model, opt, range(2))
    loss_of(model, 2).backward()
    CHANGES[change](2, model, opt)
    with pytest.raises(RuntimeError, match="already updated the params"):
        opt.step()


@pytest.mark.parametrize("then", ["next backward", "wait_step", "step"])
def test_a_change_found_after_step_returned_is_refused_before_the_next_update(
    then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: Checks off the host]: on a GPU the comparison is read once the device has computed it; here it never
    has by the time step() returns, so the first call that must not run on the change refuses it."""
    from chunked_offload import inputs

    monkeypatch.setattr(inputs.GradComparison, "ready", lambda self: False)
    model, opt = build("backward")
    train(model, opt, range(2))
    loss_of(model, 2).backward()
    _clip(2, model, opt)
    opt.step()  # returns: the outcome is not read yet
    after = params_of(model)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="already updated the params .* found after that step"):
        if then == "next backward":
            loss_of(model, 3).backward()
        elif then == "wait_step":
            opt.wait_step()
        else:
            opt.step()
    assert_untouched(model, after)
    assert internals(opt).runner.loop.observing  # the next backward observes the loop again
    opt.zero_grad()
    train(model, opt, range(3, 4))  # and the loop goes on


def test_an_unchanged_loop_whose_checks_are_read_late_steps_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunked_offload import inputs

    monkeypatch.setattr(inputs.GradComparison, "ready", lambda self: False)
    same_loop("backward", "fp32")


def test_a_grad_replaced_by_an_equal_one_steps_bitwise() -> None:
    """The check compares contents: a copy of the same grad changes nothing the update reads."""

    def clone(i: int, model: torch.nn.Module, opt: Any) -> None:
        for p in model.parameters():
            p.grad = p.grad.clone()  # type: ignore[union-attr]

    same_loop("backward", "none", after_backward=clone)


FINGERPRINTED = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", FINGERPRINTED)
@pytest.mark.parametrize("layout", ["contiguous", "odd bytes", "offset", "transposed", "scalar"])
def test_a_fingerprint_shows_a_change_to_any_one_number(dtype: torch.dtype, layout: str) -> None:
    """[Note: Inputs of a step]: 64-bit words where the bytes allow, one integer per element where they do not."""
    from chunked_offload.inputs import fingerprints

    wide = torch.complex128 if dtype.is_complex else torch.float64
    shape = {"odd bytes": (7, 5), "scalar": ()}.get(layout, (8, 6))
    base = torch.randn(shape, dtype=wide).to(dtype)
    view = {"offset": lambda t: t.view(-1)[1:], "transposed": lambda t: t.t()}.get(layout, lambda t: t)
    before = fingerprints([view(base)])
    assert torch.equal(before, fingerprints([view(base.clone())]))
    numbers = view(base).numel() * (2 if dtype.is_complex else 1)
    for k in range(numbers):
        changed = base.clone()
        target = torch.view_as_real(view(changed)) if dtype.is_complex else view(changed)
        at = torch.unravel_index(torch.tensor(k), target.shape)
        target[at] = target[at] * 0.5 if k % 2 else -target[at]
        assert not torch.equal(fingerprints([view(changed)]), before), f"number {k} changed unseen"


@pytest.mark.parametrize("dtype", FINGERPRINTED)
@pytest.mark.parametrize("scale", [0.5, 0.25, 2.0**-16, 0.3])
def test_a_fingerprint_shows_a_scaled_grad(dtype: torch.dtype, scale: float) -> None:
    """A scaling by 2**-k changes only exponent bits: 4096 elements of 8 bytes, summed as whole words, would cancel
    modulo 2**64."""
    from chunked_offload.inputs import fingerprints

    wide = torch.complex128 if dtype.is_complex else torch.float64
    grad = (torch.rand(64, 64, dtype=wide) + 1).to(dtype)
    assert not torch.equal(fingerprints([grad * scale]), fingerprints([grad]))


def test_an_fp64_grad_halved_after_a_backward_that_stepped_is_refused() -> None:
    """A 64 x 64 fp64 grad times 0.5 changes each 64-bit word by -2**52: its word sum comes back modulo 2**64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).double()
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), step_in_backward=True)
    x = torch.randn(8, 64, dtype=torch.float64)
    for _ in range(2):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    model(x).square().sum().backward()
    model[0].weight.grad.mul_(0.5)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="already updated the params"):
        opt.step()


def test_clipping_that_does_not_clip_steps_bitwise() -> None:
    """clip_grad_norm_ with a large max_norm multiplies by exactly 1: the grads are unchanged, so is the result."""
    same_loop("backward", "none", after_backward=lambda i, m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))


def test_a_grad_set_by_hand_after_the_backward_is_refused() -> None:
    def extra(i: int, model: torch.nn.Module, opt: Any) -> None:
        model.head.bias.grad = None

    model, opt = build("backward")
    before = params_of(model)
    with pytest.raises(RuntimeError, match="Nothing was updated"):
        train(model, opt, range(1), after_backward=extra)
    assert_untouched(model, before)


@pytest.mark.parametrize("call", ["zero_grad", "load_state_dict", "state_dict", "add_param_group", "master_params"])
def test_optimizer_calls_between_a_backward_that_stepped_and_step_are_refused(call: str) -> None:
    model, opt = build("backward")
    train(model, opt, range(2))
    saved = opt.state_dict()
    loss_of(model, 2).backward()
    calls = {
        "zero_grad": lambda: opt.zero_grad(),
        "load_state_dict": lambda: opt.load_state_dict(saved),
        "state_dict": lambda: opt.state_dict(),
        "add_param_group": lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}),
        "master_params": lambda: list(opt.master_params()),
    }
    with pytest.raises(RuntimeError, match=rf"opt.{call}\(\) between a backward pass that stepped and step\(\)"):
        calls[call]()
    opt.step()  # the wrapper goes on
    opt.zero_grad()
    train(model, opt, range(3, 4))


def test_skipping_a_step_on_the_observed_backward_is_the_plain_loop() -> None:
    """The NaN-loss pattern: zero_grad() instead of step(); on the observed (first) backward it is plain torch."""

    def run(model: torch.nn.Module, opt: Any) -> None:
        for i in range(3):
            loss_of(model, i).backward()
            if i == 0:
                opt.zero_grad()  # "skip this step"
                continue
            opt.step()
            opt.zero_grad()

    plain, wrapped = build("plain"), build("backward")
    run(*plain)
    run(*wrapped)
    assert_same(plain[0], wrapped[0])


def test_grad_scaler_with_a_non_fused_inner_is_refused_before_any_update() -> None:
    model, opt = build("backward")
    before = params_of(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with pytest.raises(RuntimeError, match="Nothing was updated"):
        for i in range(2):  # an inf in the first iteration skips step(): the second backward is seen too
            scaler.scale(loss_of(model, i)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert_untouched(model, before)


def test_two_backwards_before_step_are_refused_before_any_update() -> None:
    model, opt = build("backward")
    before = params_of(model)
    loss_of(model, 0).backward()
    loss_of(model, 1).backward()
    with pytest.raises(RuntimeError, match="2 backward passes ran before step.*opt.accumulating"):
        opt.step()
    assert_untouched(model, before)


# ---------------------------------------------------------------------------------------------------------- case 5
def _raising_forward(model: Net, x: torch.Tensor, raise_in_backward: bool) -> torch.Tensor:
    h = model.embed(x)
    for k, layer in enumerate(model.layers):
        h = torch.nn.functional.gelu(layer(h))
        if k == 1 and raise_in_backward:
            h.register_hook(lambda g: (_ for _ in ()).throw(ValueError("a hook raised")))
    return model.head(h)


def test_an_exception_inside_a_backward_that_stepped_closes_the_step() -> None:
    """The chunks stepped before the exception stay committed (a note says so); the next backward steps them all."""
    model, opt = build("backward")
    train(model, opt, range(2))
    steps_before = {p: int(opt.state[p]["step"]) for p in model.parameters()}
    x = batch(2)
    with pytest.raises(ValueError, match="a hook raised"):
        torch.nn.functional.cross_entropy(_raising_forward(model, x, True).flatten(0, 1), x.flatten()).backward()
    with pytest.warns(ChunkedOffloadWarning, match=r"raised after (\d+) of the (\d+) chunks had stepped"):
        opt.zero_grad()
    stepped = [p for p in model.parameters() if int(opt.state[p]["step"]) > steps_before[p]]
    assert 0 < len(stepped) < len(steps_before)

    # The oracle: plain AdamW that stepped just those params in the failed iteration.
    ref_model, ref = build("plain")
    train(ref_model, ref, range(2))
    torch.nn.functional.cross_entropy(ref_model(x).flatten(0, 1), x.flatten()).backward()
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in ref_model.named_parameters():
        if all(names[id(q)] != n for q in stepped):
            p.grad = None
    ref.step()
    ref.zero_grad()
    train(ref_model, ref, range(3, 5))
    train(model, opt, range(3, 5))
    assert_same(ref_model, model)


# ---------------------------------------------------------------------------------------------------- cases 6, 12
@pytest.mark.parametrize("mode", ["sync", *FAST])
def test_a_dropped_wrapper_leaves_nothing_behind(mode: str) -> None:
    """No hook stays on the model or its params, and no part stays alive, without the garbage collector."""
    gc.disable()
    try:
        model, opt = build(mode)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        train(model, opt, range(2))
        refs = [
            weakref.ref(opt),
            weakref.ref(internals(opt).runner),
            weakref.ref(internals(opt).placement.layout.host.arena),
        ]
        del opt, sched
        assert all(r() is None for r in refs)
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
        assert all(not m._state_dict_pre_hooks for m in model.modules())
        assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    finally:
        gc.enable()


def test_a_new_wrapper_over_the_params_of_a_dropped_one_steps_once() -> None:
    """A re-run notebook cell: the first wrapper is dropped, a second one over the same params takes over."""

    def run(wrap: bool) -> Net:
        torch.manual_seed(0)
        model = Net()
        for _ in range(2):  # two stages, each with a fresh optimizer
            inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
            opt: Any = ChunkedOffloadOptimizer(inner, chunk_size_mb=2 * _KIB, step_in_backward=True) if wrap else inner
            if wrap:
                opt.attach(model)
            train(model, opt, range(3))
            del opt, inner
        return model

    gc.disable()
    try:
        assert_same(run(False), run(True))
    finally:
        gc.enable()


def test_two_live_wrappers_stepping_the_same_params_in_backward_are_refused() -> None:
    model = Net()
    first = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), step_in_backward=True)
    with pytest.raises(ValueError, match="already stepped in the backward by another live"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), step_in_backward=True)
    del first


# ---------------------------------------------------------------------------------------------------- cases 9, 11
def _only_inert_hooks(model: torch.nn.Module) -> bool:
    from chunked_offload.callbacks import inert as _inert

    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks, m._state_dict_pre_hooks, m._load_state_dict_pre_hooks):
            if any(getattr(h, "hook", h) is not _inert for h in hooks.values()):  # torch's _WrappedHook holds one
                return False
    return True


@pytest.mark.parametrize("how", ["AveragedModel", "deepcopy", "torch.save", "pickle"])
@pytest.mark.parametrize("mode", FAST)
def test_copies_of_an_attached_model_are_updated_and_carry_no_live_hooks(mode: str, how: str) -> None:
    """Made between step() and the next forward (when an overlapped step is still deferred)."""
    plain, wrapped = build("plain"), build(mode)
    train(*plain, range(2))
    train(*wrapped, range(2))
    for model, opt in (plain, wrapped):
        loss_of(model, 2).backward()
        opt.step()
        opt.zero_grad()
    copies = {}
    for name, model in (("plain", plain[0]), ("wrapped", wrapped[0])):
        if how == "AveragedModel":
            copies[name] = torch.optim.swa_utils.AveragedModel(model).module
        elif how == "deepcopy":
            copies[name] = copy.deepcopy(model)
        elif how == "torch.save":
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            copies[name] = torch.load(buffer, weights_only=False)
        else:
            copies[name] = pickle.loads(pickle.dumps(model))
    assert_same(copies["plain"], copies["wrapped"])
    assert _only_inert_hooks(copies["wrapped"])
    copies["wrapped"](batch(0)).sum().backward()  # its forward and backward run, and touch nothing of the wrapper
    train(*plain, range(3, 5))
    train(*wrapped, range(3, 5))
    assert_same(plain[0], wrapped[0])


# ---------------------------------------------------------------------------------------------------------- case 10
def test_step_with_a_closure_steps_as_plain_torch_with_step_in_backward() -> None:
    def run(model: torch.nn.Module, opt: Any) -> None:
        for i in range(4):

            def closure(i: int = i) -> torch.Tensor:
                opt.zero_grad()
                loss = loss_of(model, i)
                loss.backward()
                return loss

            opt.step(closure)

    plain, wrapped = build("plain"), build("backward")
    run(*plain)
    run(*wrapped)
    assert_same(plain[0], wrapped[0])
    assert wrapped[1].phase.value == "idle"


# ---------------------------------------------------------------------------------------------------------- case 13
def test_attach_refuses_what_it_cannot_gate() -> None:
    model, opt = build("overlap", attach=False)
    with pytest.raises(ValueError, match="holds none of this optimizer's params"):
        opt.attach(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="whose own forward never runs.*Attach the module whose forward calls it"):
        opt.attach(model.layers)


class _Scaled(torch.nn.Module):
    """The parent reads a child's weight without calling the child, and a param outside the model scales the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.pos = torch.nn.Embedding(5, 16)  # never called: its weight is read by the forward below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.head(self.net.embed(x) + self.pos.weight)


@pytest.mark.parametrize("master", MASTERS)
def test_params_no_attached_forward_waits_for_are_never_left_to_the_forward(master: str) -> None:
    def run(mode: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model, temperature = _Scaled(), torch.nn.Parameter(torch.ones(1))
        if master != "none":
            model, temperature = model.to(torch.bfloat16), torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        inner = torch.optim.AdamW([*model.parameters(), temperature], lr=1e-2)
        opt: Any = inner
        if mode != "plain" or master != "none":
            opt = ChunkedOffloadOptimizer(
                inner, chunk_size_mb=2 * _KIB, master_weights=master, overlap=mode == "overlap"
            )
        if mode == "overlap":
            opt.attach(model)
        for i in range(4):
            x = batch(i)
            out = model(x).float() * temperature.float()
            torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
        if mode == "overlap":
            opt.wait_step()
        return [*params_of(model), temperature.detach().clone()]

    for i, (a, b) in enumerate(zip(run("plain"), run("overlap"), strict=True)):
        assert_equal(a, b, f"param {i}")


# ---------------------------------------------------------------------------------------------------- cases 15, 16
def test_an_auto_budget_without_a_gpu_says_so_once() -> None:
    with pytest.warns(ChunkedOffloadWarning, match="gpu_budget_mb='auto' does nothing"):
        ChunkedOffloadOptimizer(torch.optim.AdamW(Net().parameters()), gpu_budget_mb="auto")


def test_a_failure_note_counts_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunked_offload.stepping import ChunkStepper

    model, opt = build("plain", "fp32")
    train(model, opt, range(1))
    original, calls = ChunkStepper.inner_step, {"n": 0}

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("injected")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChunkStepper, "inner_step", failing)
    loss_of(model, 1).backward()
    for p in model.layers.parameters():
        p.grad = None  # these chunks have no grads in this step
    params = list(model.parameters())
    with_grads = sum(1 for c in opt.plan.all_chunks if any(params[i].grad is not None for i in c.params))
    total = len(opt.plan.all_chunks)
    assert with_grads < total
    with pytest.raises(ValueError) as info:
        opt.step()
    note = "".join(info.value.__notes__)
    assert f"chunk 2 of the {with_grads} with grads" in note
    assert f"Of all {total} chunks of the plan, 1 are committed, 1 rolled back and {total - 2} untouched" in note


# ---------------------------------------------------------------------------------------------------------- case 8
class _Shared(torch.nn.Module):
    """One layer used by two reentrant-checkpointed segments: its grad accumulates in two nested backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.other = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        h = checkpoint(lambda t: torch.nn.functional.gelu(self.shared(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.nn.functional.gelu(self.other(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.nn.functional.gelu(self.shared(t)), h, use_reentrant=True)
        return self.head(h)


@pytest.mark.parametrize("master", MASTERS)
def test_a_layer_shared_by_two_checkpointed_segments_steps_with_its_whole_grad(master: str) -> None:
    def run(mode: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Shared()
        if master != "none":
            model = model.to(torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt: Any = inner
        if mode != "plain" or master != "none":
            opt = ChunkedOffloadOptimizer(
                inner, chunk_size_mb=2 * _KIB, master_weights=master, step_in_backward=mode == "backward"
            )
        train(model, opt, range(4))
        return params_of(model)

    for i, (a, b) in enumerate(zip(run("plain"), run("backward"), strict=True)):
        assert_equal(a, b, f"param {i}")
