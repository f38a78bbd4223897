"""Worker functions for tests/test_megatron.py, run in spawned processes (one per rank): Megatron-Core's own DDP and
DistributedOptimizer on gloo, resident against ``wrap_megatron_optimizer``.

Megatron has no CPU training path: ``cuda_on_cpu`` (test-only) stands in where it insists on CUDA. It answers
``torch.cuda.current_device()`` with the CPU, gives no-op streams and events, maps ``device="cuda"`` and ``.cuda()``
to the CPU, and names CPU tensors as ``torch.cuda.*Tensor`` where Megatron checks a param's ``type()``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import te_standin


class _Inert:
    """A CUDA stream or event on the CPU: every wait, record and synchronize is done already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _nothing(self, *args: Any) -> None:
        pass

    wait_stream = wait_event = synchronize = record = wait = _nothing

    def record_event(self, *args: Any) -> _Inert:
        return _Inert()

    def query(self) -> bool:
        return True


def _cpu(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if name == "to":
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Megatron's CUDA calls answered on the CPU, in this process, until the block ends."""
    names = ("current_device", "current_stream", "default_stream", "Stream", "Event", "synchronize", "stream")
    saved = {n: getattr(torch.cuda, n) for n in names}
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.current_stream = lambda *a, **k: _Inert()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _Inert()  # type: ignore[assignment]
    torch.cuda.Stream = _Inert  # type: ignore[assignment,misc]
    torch.cuda.Event = _Inert  # type: ignore[assignment,misc]
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.stream = lambda s: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        with _CudaOnCpu():
            yield
    finally:
        for n, v in saved.items():
            setattr(torch.cuda, n, v)


def _te_if(te: bool) -> contextlib.AbstractContextManager[None]:
    return te_standin.standing_in() if te else contextlib.nullcontext()


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()


def _config(**overrides: Any) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    options = {"optimizer": "adam", "lr": 1e-2, "min_lr": 1e-4, "weight_decay": 0.1, "bf16": True, "clip_grad": 0.1}
    return OptimizerConfig(**{**options, "use_distributed_optimizer": True, **overrides})


def build(
    wrap: bool | dict[str, Any],
    *,
    grad_reduce_in_fp32: bool = True,
    overlap_param_gather: bool = False,
    te: bool = False,
    **overrides: Any,
) -> tuple[Any, Any, Any]:
    """A small bf16 Megatron module under Megatron's DDP, its ``get_megatron_optimizer``, wrapped (with the options
    ``wrap`` names, if a dict) or not. With ``te``, on Megatron's precision-aware path with TE's FusedAdam (inside
    ``te_standin.standing_in()``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import MegatronModule, TransformerConfig

    from chunked_offload.integrations.megatron import wrap_megatron_optimizer

    fp16 = bool(overrides.get("fp16"))
    dtype = torch.float16 if fp16 else torch.bfloat16
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, bf16=not fp16, fp16=fp16)

    class Net(MegatronModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(config)
            self.a = torch.nn.Linear(16, 40, dtype=dtype)
            self.b = torch.nn.Linear(40, 16, dtype=dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    net = Net()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=overrides.get("use_distributed_optimizer", True),
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_param_gather,
        overlap_param_gather=overlap_param_gather,
    )  # fmt: skip
    ddp = DistributedDataParallel(config, ddp_config, net)
    if te:
        overrides = {"use_precision_aware_optimizer": True, "store_param_remainders": False, **overrides}
    opt = get_megatron_optimizer(_config(**overrides), [ddp])
    if wrap is not False:  # True, or the options (an empty dict too)
        wrap_megatron_optimizer(opt, chunk_size_mb=0.001, **(wrap if isinstance(wrap, dict) else {}))
    return net, ddp, opt


def scheduler(opt: Any) -> Any:
    """Megatron's ``OptimizerParamScheduler``: lr and weight decay change after every ``step()`` (warmup, then
    cosine; a linear weight-decay ramp)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        opt, init_lr=1e-3, max_lr=1e-2, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=6, lr_decay_style="cosine",
        start_wd=0.05, end_wd=0.1, wd_incr_steps=6, wd_incr_style="linear",
    )  # fmt: skip


def step(ddp: Any, opt: Any, it: int, rank: int = 0, sched: Any = None) -> tuple[float, Any]:
    dtype = next(ddp.module.parameters()).dtype  # not through the chunk, whose parameters() waits for the step
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * it + rank), dtype=dtype)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(x).float().square().mean()
    scaled = loss * opt.get_loss_scale() if opt.get_loss_scale() is not None else loss
    scaled.backward()
    ddp.finish_grad_sync()
    ok, norm, _ = opt.step()
    if sched is not None:
        sched.step(increment=1)  # after step(), as Megatron's train_step: an overlapped step's chunks run later
    return loss.item(), (ok, norm)


def snapshot(ddp: Any, opt: Any) -> list[torch.Tensor]:
    """The params (read as Megatron reads them outside the forward: through the model chunk, as
    ``calc_params_l2_norm`` does), and each shard's fp32 main param and state in Megatron's checkpoint form."""
    out = [p.detach().clone() for p in ddp.parameters()]
    for d in opt.chained_optimizers:
        for group in (*d.model_float16_groups, *d.model_fp32_groups):
            for model_param in group:
                tensors = d._get_main_param_and_optimizer_states(model_param)
                out += [tensors[k].detach().clone() for k in sorted(tensors)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def parity(rank: int, world: int, port: int, backend: str, steps: int, overrides: dict[str, Any], result: Any) -> None:
    """Losses, grad norms, params, mains and moments of a wrapped run (with the options ``overrides["wrap"]``)
    equal the resident run's, bitwise."""
    overrides = dict(overrides)
    options = overrides.pop("wrap", {})
    with cuda_on_cpu(), _te_if(overrides.get("te", False)):
        _init(rank, world, port)
        runs = []
        for wrap in (False, options):
            net, ddp, opt = build(wrap, **overrides)
            sched = scheduler(opt)
            trace = [step(ddp, opt, it, rank, sched) for it in range(steps)]
            runs.append((trace, snapshot(ddp, opt)))
        (trace_a, snap_a), (trace_b, snap_b) = runs
        result[rank] = (trace_a == trace_b and same(snap_a, snap_b), trace_b)


def resume(
    rank: int, world: int, port: int, backend: str, options: dict[str, Any], sharding: str, te: bool, result: Any
) -> None:
    """A wrapped run (with the wrapper's ``options``) saved with dist-checkpointing (torch_dist) after 2 steps and
    loaded into a new wrapped run continues bitwise as the run that was not interrupted (4 steps); with ``overlap``,
    saved while the last step's chunks wait for the next forward. With TE the new run has not stepped (without TE or
    Apex, Megatron needs a step first); Megatron finds the wrapper with state when it loads, so it makes none of the
    placeholder state it makes on the GPU for an optimizer without any."""
    from megatron.core import dist_checkpointing

    overlap = bool(options.get("overlap"))
    with cuda_on_cpu(), _te_if(te):
        _init(rank, world, port)
        net, ddp, opt = build(options, overlap_param_gather=overlap, te=te)
        trace = [step(ddp, opt, it, rank) for it in range(4)]
        straight = snapshot(ddp, opt)
        net, ddp, opt = build(options, overlap_param_gather=overlap, te=te)
        for it in range(2):
            step(ddp, opt, it, rank)
        directory = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(directory)
        metadata = {"distrib_optim_sharding_type": sharding}
        saved = {"optimizer": opt.sharded_state_dict(ddp.sharded_state_dict(), metadata=metadata)}
        dist_checkpointing.save(saved, directory[0])
        model_state = net.state_dict()
        net, ddp, opt = build(options, overlap_param_gather=overlap, te=te)
        handed: list[int] = []
        for d in opt.chained_optimizers:
            wrapper = d.optimizer
            load = wrapper.load_state_dict
            wrapper.load_state_dict = lambda sd, w=wrapper, load=load: (handed.append(len(w.state)), load(sd))[1]
        if not te:  # Megatron without TE or Apex saves and loads a stepped optimizer only (it reads its "step")
            step(ddp, opt, 99, rank)
        net.load_state_dict(model_state)
        template = {"optimizer": opt.sharded_state_dict(ddp.sharded_state_dict(), is_loading=True, metadata=metadata)}
        opt.load_state_dict(dist_checkpointing.load(template, directory[0])["optimizer"])
        resumed = [step(ddp, opt, it, rank) for it in range(2, 4)]
        result[rank] = resumed == trace[2:] and same(straight, snapshot(ddp, opt)) and bool(handed) and all(handed)


def rl_offload(rank: int, world: int, port: int, backend: str, te: bool, result: Any) -> None:
    """``offload_to_cpu()`` / ``restore_from_cpu()`` between steps (the RL path) keep a wrapped run bitwise."""
    with cuda_on_cpu(), _te_if(te):
        _init(rank, world, port)
        snaps = []
        for wrap in (False, True):
            net, ddp, opt = build(wrap, te=te)
            for it in range(3):
                step(ddp, opt, it, rank)
                opt.offload_to_cpu()
                opt.restore_from_cpu()
            snaps.append(snapshot(ddp, opt))
        result[rank] = same(*snaps)


def refusals(rank: int, world: int, port: int, backend: str, result: Any) -> None:
    """What cannot be wrapped is refused before anything is modified, with what to do instead."""
    from chunked_offload.integrations.megatron import wrap_megatron_optimizer

    messages = {}
    with cuda_on_cpu(), _te_if(True):
        _init(rank, world, port)
        cases = {
            "in backward": (lambda: build(False), {"step_in_backward": True}),
            "overlap without param gather": (lambda: build(False), {"overlap": True}),
            "masters": (lambda: build(False), {"master_weights": "none"}),
            "remainder of fp16": (lambda: build(False, bf16=False, fp16=True), {"master_weights": "remainder"}),
            "masters on te's path": (lambda: build(False, te=True), {"master_weights": "remainder"}),
            "bf16 grads": (lambda: build(False, grad_reduce_in_fp32=False), {}),
            "wrapped": (lambda: build(True), {}),
            "cpu offload": (lambda: build(False, optimizer_cpu_offload=True, te=True), {}),
            "te without masters": (lambda: _without_masters(build(False, te=True)), {}),
            "not distributed": (lambda: build(False, use_distributed_optimizer=False), {}),
        }
        for name, (make, options) in cases.items():
            opt = make()[2]
            before = [id(d.optimizer) for d in opt.chained_optimizers]
            try:
                wrap_megatron_optimizer(opt, **options)
            except (TypeError, ValueError) as e:
                unchanged = before == [id(d.optimizer) for d in opt.chained_optimizers]
                messages[name] = (str(e), unchanged)
            else:
                messages[name] = ("", False)
        result[rank] = messages


def _without_masters(built: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    for d in built[2].chained_optimizers:
        d.optimizer.master_weights = False  # TE's FusedAdam on the precision-aware path, keeping no masters
    return built


def wrap_midway(rank: int, world: int, port: int, backend: str, te: bool, result: Any) -> None:
    """Wrapping after resident steps (mains no longer the params' upcast, moments on the GPU) carries them over: the
    run continues bitwise as the resident one, and the GPU's mains and moments are freed (nothing of Megatron's
    still holds them). With ``te``, TE's masters and moments on the precision-aware path."""
    from chunked_offload.integrations.megatron import wrap_megatron_optimizer

    with cuda_on_cpu(), _te_if(te):
        _init(rank, world, port)
        runs = []
        for wrap in (False, True):
            net, ddp, opt = build(False, te=te)
            trace = [step(ddp, opt, it, rank) for it in range(3)]
            freed = True
            if wrap:
                gone = [weakref.ref(t) for t in _mains_and_moments(opt)]
                wrap_megatron_optimizer(opt, chunk_size_mb=0.001)
                gc.collect()
                freed = bool(gone) and all(ref() is None for ref in gone)
            trace += [step(ddp, opt, it, rank) for it in range(3, 6)]
            runs.append((trace, snapshot(ddp, opt), freed))
        result[rank] = runs[0][0] == runs[1][0] and same(runs[0][1], runs[1][1]) and runs[1][2]


def _mains_and_moments(opt: Any) -> list[torch.Tensor]:
    """The fp32 main shards of the 16-bit params (on the default path) and the inner's state tensors (the moments;
    TE's masters on the precision-aware path), as Megatron's resident optimizer holds them."""
    found = []
    for d in opt.chained_optimizers:
        found += [main for group in d.shard_fp32_from_float16_groups for main in group if main is not None]
        found += [v for entry in d.optimizer.state.values() for v in entry.values() if v.dim() > 0]
    return found


def reload_params(
    rank: int, world: int, port: int, backend: str, overlap: bool, fp32_source: bool, result: Any
) -> None:
    """Model params loaded from elsewhere after some steps, then ``reload_model_params()`` (Megatron's load without
    the optimizer's state: ``--no-load-optim``, ``--finetune``): the mains become those params (with
    ``fp32_source``, fp32 tensors of a state dict that round to them), as in the resident run, and the runs continue
    bitwise. A state dict whose tensors do not round to the params is refused, the masters untouched."""
    options = {"overlap": True} if overlap else {}
    with cuda_on_cpu():
        _init(rank, world, port)
        _, donor_ddp, donor_opt = build(False, overlap_param_gather=overlap)
        for it in range(3):
            step(donor_ddp, donor_opt, 50 + it, rank)
        loaded = donor_ddp.module.state_dict()
        runs = []
        for wrap in (False, options):
            net, ddp, opt = build(wrap, overlap_param_gather=overlap)
            trace = [step(ddp, opt, it, rank) for it in range(2)]
            net.load_state_dict(loaded)
            if fp32_source:  # within half a bf16 ulp of the params: the mains differ from their upcast
                close = {k: v.float() * (1 + 2.0**-12) for k, v in loaded.items() if v.is_floating_point()}
                far = {k: v.float() * 1.01 for k, v in close.items()}
                before = snapshot(ddp, opt)
                refused = wrap is False or _raises(opt.reload_model_params, {"model": far}, "does not round")
                refused = refused and same(before, snapshot(ddp, opt))
                opt.reload_model_params({"model": close})
            else:
                refused = True
                opt.reload_model_params()
            trace += [step(ddp, opt, it, rank) for it in range(2, 4)]
            runs.append((trace, snapshot(ddp, opt), refused))
        result[rank] = runs[0][0] == runs[1][0] and same(runs[0][1], runs[1][1]) and runs[1][2]


def _raises(call: Any, argument: Any, needle: str) -> bool:
    try:
        call(argument)
    except ValueError as e:
        return needle in str(e)
    return False


def held_zeroing(rank: int, world: int, port: int, backend: str, result: Any) -> None:
    """With overlap the step reads Megatron's grad buffer in place ([Note: Megatron overlapped step]): a zeroing of
    the buffer with no forward after it (a step of zero grads) still runs before Megatron's next read, bitwise with
    the resident run, and so does a free of the buffer right after ``step()`` (``offload_grad_buffers()``, the RL
    path); a write to the grads after ``step()`` and before the next forward's end is refused there."""
    options = {"overlap": True}
    with cuda_on_cpu():
        _init(rank, world, port)
        runs = []
        for wrap in (False, options):
            net, ddp, opt = build(wrap, overlap_param_gather=world > 1)
            trace = [step(ddp, opt, it, rank) for it in range(3)]
            ddp.zero_grad_buffer()
            opt.zero_grad()
            trace.append(opt.step())
            trace.append(step(ddp, opt, 3, rank))
            ddp.offload_grad_buffers(synchronize=False)  # the RL path, right after step(): the buffer is freed
            ddp.restore_grad_buffers(synchronize=False)
            trace += [step(ddp, opt, it, rank) for it in range(4, 6)]
            runs.append((trace, snapshot(ddp, opt)))
        net, ddp, opt = build(options, overlap_param_gather=world > 1)
        for it in range(3):
            step(ddp, opt, it, rank)
        for p in ddp.module.parameters():
            p.main_grad.mul_(2)  # after step(): the step has still to read them
        try:
            step(ddp, opt, 3, rank)
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        result[rank] = (runs[0][0] == runs[1][0] and same(runs[0][1], runs[1][1]), refused)
