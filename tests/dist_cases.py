"""Worker functions for tests/test_distributed.py, run in spawned processes (one per rank)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from chunked_offload import ChunkedOffloadOptimizer, Phase

STEPS = 20


def _init(rank: int, world: int, port: int, backend: str) -> torch.device:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _model(device: torch.device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Odd sizes: FSDP2's Shard(0) splits 33 and 17 rows unevenly between two ranks.
    return torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 17), torch.nn.GELU(), torch.nn.Linear(17, 4)
    ).to(device)


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=gen).to(device), torch.randn(8, 4, generator=gen).to(device)


def _train(model: torch.nn.Module, opt: Any, steps: range, rank: int, device: torch.device) -> None:
    for step in steps:
        x, y = _batch(step, rank, device)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _assert_same(a: torch.nn.Module, b: torch.nn.Module, opt_a: Any, opt_b: Any) -> None:
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(_local(pa.detach()), _local(pb.detach())), "params differ"
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert set(sa) == set(sb)
        for key in sa:
            va, vb = _local(sa[key]), _local(sb[key])
            assert torch.equal(va.cpu(), vb.cpu()), f"state {key} differs"
            assert type(sa[key]) is type(sb[key]), f"state {key}: {type(sa[key])} vs {type(sb[key])}"


INNERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
}


def _parity(engine: Callable[[torch.nn.Module], torch.nn.Module], inner: str, rank: int, device: torch.device) -> Any:
    """Train the same model under ``engine`` with the unwrapped and the wrapped optimizer; both must end equal."""
    plain_model, wrapped_model = engine(_model(device)), engine(_model(device))
    plain = INNERS[inner](plain_model.parameters())
    wrapped = ChunkedOffloadOptimizer(INNERS[inner](wrapped_model.parameters()), chunk_size_mb=0.002)
    _train(plain_model, plain, range(STEPS), rank, device)
    _train(wrapped_model, wrapped, range(STEPS), rank, device)
    wrapped.synchronize()
    _assert_same(plain_model, wrapped_model, plain, wrapped)
    return wrapped_model, wrapped


def fsdp2_parity(rank: int, world: int, port: int, backend: str, inner: str, result: Any) -> None:
    """FSDP2 training with the wrapper equals FSDP2 with the unwrapped optimizer, shard by shard; the plans agree."""
    device = _init(rank, world, port, backend)
    try:
        model, wrapped = _parity(_shard, inner, rank, device)
        membership = [chunk.params for chunk in wrapped.plan.all_chunks]
        fingerprint = hashlib.sha256(repr(membership).encode()).hexdigest()
        fingerprints: list[str | None] = [None] * world
        dist.all_gather_object(fingerprints, fingerprint)
        assert len(set(fingerprints)) == 1, f"chunk plans differ across ranks: {fingerprints}"
        result[rank] = (len(membership), [tuple(_local(p).shape) for p in model.parameters()])
    finally:
        dist.destroy_process_group()


def ddp_parity(rank: int, world: int, port: int, backend: str, inner: str, result: Any) -> None:
    """DDP training with the wrapper equals DDP with the unwrapped optimizer on every rank."""
    device = _init(rank, world, port, backend)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        _parity(DDP, inner, rank, device)
        result[rank] = True
    finally:
        dist.destroy_process_group()


def fsdp2_dcp_roundtrip(rank: int, world: int, port: int, backend: str, path: str, result: Any) -> None:
    """DCP save/load of the wrapper under FSDP2, into a wrapper and from a plain optimizer's checkpoint, exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    device = _init(rank, world, port, backend)
    make = INNERS["adamw-foreach"]
    try:
        reference = _shard(_model(device))
        ref_opt = make(reference.parameters())
        _train(reference, ref_opt, range(12), rank, device)

        for saved_wrapped in (True, False):
            first = _shard(_model(device))
            opt = make(first.parameters())
            if saved_wrapped:
                opt = ChunkedOffloadOptimizer(opt, chunk_size_mb=0.002)
            _train(first, opt, range(5), rank, device)
            checkpoint = f"{path}/{saved_wrapped}"
            dcp.save(
                {"model": get_model_state_dict(first), "optim": get_optimizer_state_dict(first, opt)},
                checkpoint_id=checkpoint,
            )
            resumed = _shard(_model(device, seed=1))
            resumed_opt = ChunkedOffloadOptimizer(make(resumed.parameters()), chunk_size_mb=0.002)
            target = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
            dcp.load(target, checkpoint_id=checkpoint)
            set_model_state_dict(resumed, target["model"])
            set_optimizer_state_dict(resumed, resumed_opt, target["optim"])
            _train(resumed, resumed_opt, range(5, 12), rank, device)
            resumed_opt.synchronize()
            _assert_same(reference, resumed, ref_opt, resumed_opt)

            # And back: the wrapper's checkpoint loads into the plain FSDP2 optimizer.
            back = f"{path}/back-{saved_wrapped}"
            dcp.save({"optim": get_optimizer_state_dict(resumed, resumed_opt)}, checkpoint_id=back)
            plain_target = {"optim": get_optimizer_state_dict(reference, make(reference.parameters()))}
            dcp.load(plain_target, checkpoint_id=back)
        result[rank] = True
    finally:
        dist.destroy_process_group()


def fsdp2_refusals(rank: int, world: int, port: int, backend: str, result: Any) -> None:
    """Muon over sharded matrices is refused with a clear error."""
    device = _init(rank, world, port, backend)
    try:
        model = _shard(_model(device))
        messages = []
        matrices = [p for p in model.parameters() if p.dim() == 2]
        for make, kw in ((lambda: torch.optim.Muon(matrices, lr=1e-2), {}),):
            try:
                ChunkedOffloadOptimizer(make(), **kw)
            except (TypeError, ValueError) as exc:
                messages.append(str(exc))
        result[rank] = messages
    finally:
        dist.destroy_process_group()


def fsdp2_gpu_window(rank: int, world: int, port: int, backend: str, result: Any) -> None:
    """FSDP2 on a GPU: parity with the unwrapped optimizer, and the step's peak within the window bound."""
    device = _init(rank, world, port, backend)
    try:
        from torch.distributed.fsdp import fully_shard

        def model() -> torch.nn.Module:
            torch.manual_seed(0)
            m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(device)
            for layer in m:
                fully_shard(layer)
            return fully_shard(m)

        plain_model, wrapped_model = model(), model()
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, fused=True)
        wrapped = ChunkedOffloadOptimizer(
            torch.optim.AdamW(wrapped_model.parameters(), lr=1e-3, fused=True), chunk_size_mb=32
        )
        peaks = []
        for step in range(6):
            for m, o in ((plain_model, plain), (wrapped_model, wrapped)):
                gen = torch.Generator(device=device).manual_seed(step)
                x = torch.randn(64, 2048, generator=gen, device=device)
                m(x).square().mean().backward()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                o.step()
                torch.cuda.synchronize()
                if o is wrapped:
                    peaks.append(torch.cuda.max_memory_allocated() - base)
                o.zero_grad()
        wrapped.synchronize()
        _assert_same(plain_model, wrapped_model, plain, wrapped)
        result[rank] = (max(peaks), wrapped.plan.window_bound_nbytes)
    finally:
        dist.destroy_process_group()


def fsdp2_masters(rank: int, world: int, port: int, backend: str, mode: str, gating: str, result: Any) -> None:
    """bf16 sharded params with the wrapper's offloaded masters equal FSDP2 with a resident fp32-master loop, in
    every iteration mode (``gating``: none, overlap with an attached model, step_in_backward)."""
    device = _init(rank, world, port, backend)
    try:
        plain_model = _shard(_model(device).to(torch.bfloat16))
        wrapped_model = _shard(_model(device).to(torch.bfloat16))
        masters = [torch.nn.Parameter(p.detach().float()) for p in plain_model.parameters()]
        ref = INNERS["adamw-foreach"](masters)
        wrapped = ChunkedOffloadOptimizer(
            INNERS["adamw-foreach"](wrapped_model.parameters()),
            chunk_size_mb=0.002,
            master_weights=mode,
            overlap=gating == "overlap",
            step_in_backward=gating == "backward",
        )
        if gating != "none":
            wrapped.attach(wrapped_model)
        for step in range(STEPS):
            x, y = (t.to(torch.bfloat16) for t in _batch(step, rank, device))
            for model in (plain_model, wrapped_model):
                torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            for m, p in zip(masters, plain_model.parameters(), strict=True):
                m.grad = p.grad.float()
            ref.step()
            for m, p in zip(masters, plain_model.parameters(), strict=True):
                p.detach().copy_(m.detach())  # round to nearest even
            ref.zero_grad()
            plain_model.zero_grad()
            if gating == "backward" and step > 0:  # the first backward observes ([Note: Observed backward])
                assert wrapped.phase is Phase.IN_BACKWARD  # FSDP2's reduce-scatter ran the grad hooks
            wrapped.step()
            if gating == "overlap" and step > 0:
                assert wrapped.phase is Phase.DEFERRED  # the next forward's hooks enqueue the rest
            wrapped.zero_grad()
        wrapped.synchronize()
        assert wrapped.stats is not None and wrapped.stats.chunks > 2
        for pa, pb in zip(plain_model.parameters(), wrapped_model.parameters(), strict=True):
            assert torch.equal(_local(pa.detach()), _local(pb.detach())), "params differ"
        got = dict(wrapped.master_params())
        for m, p in zip(masters, wrapped_model.parameters(), strict=True):
            assert torch.equal(_local(m.detach()).cpu(), got[p].cpu()), "masters differ"
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_local(ref.state[m][key]).cpu(), _local(wrapped.state[p][key]).cpu()), key
                assert type(wrapped.state[p][key]) is type(ref.state[m][key])
        result[rank] = sum(_local(p).numel() for p in wrapped_model.parameters())
    finally:
        dist.destroy_process_group()


def fsdp2_gpu_masters(rank: int, world: int, port: int, backend: str, gating: str, result: Any) -> None:
    """FSDP2 on GPUs, bf16 params and offloaded fp32 masters, each chunk's step slowed so that a missing wait shows:
    bitwise against a resident fp32-master loop; returns the peak memory of an iteration, wrapped and resident."""
    device = _init(rank, world, port, backend)
    try:
        from torch.distributed.fsdp import fully_shard

        from reference import slowed_chunk_steps

        with slowed_chunk_steps():  # every chunk's step starts about 10 ms late

            def model() -> torch.nn.Module:
                torch.manual_seed(0)
                m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(device, torch.bfloat16)
                for layer in m:
                    fully_shard(layer)
                return fully_shard(m)

            def batch(step: int) -> torch.Tensor:
                gen = torch.Generator(device=device).manual_seed(step)
                return torch.randn(256, 2048, generator=gen, device=device, dtype=torch.bfloat16)

            def peak_of(run: Any) -> int:  # each loop alone on the GPU: its own peak
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                run()
                torch.cuda.synchronize()
                return torch.cuda.max_memory_allocated()

            def resident() -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
                """The resident fp32-master loop alone on the GPU: its peak, final params and masters (on the host)."""
                plain_model = model()
                masters = [torch.nn.Parameter(p.detach().float()) for p in plain_model.parameters()]
                ref = torch.optim.AdamW(masters, lr=1e-3, fused=True)

                def loop() -> None:
                    for step in range(5):
                        plain_model(batch(step)).float().square().mean().backward()
                        for m, p in zip(masters, plain_model.parameters(), strict=True):
                            m.grad = p.grad.float()
                        ref.step()
                        for m, p in zip(masters, plain_model.parameters(), strict=True):
                            p.detach().copy_(m.detach())
                        ref.zero_grad()
                        plain_model.zero_grad()

                peak = peak_of(loop)
                return (
                    peak,
                    [_local(p.detach()).cpu() for p in plain_model.parameters()],
                    [_local(m.detach()).cpu() for m in masters],
                )

            resident_peak, expected, expected_masters = resident()
            peaks = {"resident": resident_peak}

            wrapped_model = model()
            wrapped = ChunkedOffloadOptimizer(
                torch.optim.AdamW(wrapped_model.parameters(), lr=1e-3, fused=True),
                chunk_size_mb=16,
                master_weights="fp32",
                overlap=gating == "overlap",
                step_in_backward=gating == "backward",
            )
            wrapped.attach(wrapped_model)

            def wrapped_loop() -> None:
                for step in range(5):
                    wrapped_model(batch(step)).float().square().mean().backward()
                    wrapped.step()
                    wrapped.zero_grad()
                wrapped.synchronize()

            peaks["wrapped"] = peak_of(wrapped_loop)
            for a, b in zip(expected, wrapped_model.parameters(), strict=True):
                assert torch.equal(a, _local(b.detach()).cpu()), "params differ"
            got = dict(wrapped.master_params())
            for m, p in zip(expected_masters, wrapped_model.parameters(), strict=True):
                assert torch.equal(m, got[p].cpu()), "masters differ"
            result[rank] = peaks
    finally:
        dist.destroy_process_group()


def fsdp2_masters_dcp(rank: int, world: int, port: int, backend: str, path: str, result: Any) -> None:
    """DCP save and load of a wrapper with offloaded masters under FSDP2: the resumed run continues bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    device = _init(rank, world, port, backend)
    try:

        def wrapped(seed: int) -> tuple[torch.nn.Module, ChunkedOffloadOptimizer]:
            model = _shard(_model(device, seed).to(torch.bfloat16))
            inner = INNERS["adamw-foreach"](model.parameters())
            return model, ChunkedOffloadOptimizer(inner, chunk_size_mb=0.002, master_weights="fp32")

        def train(model: torch.nn.Module, opt: Any, steps: range) -> None:
            for step in steps:
                x, y = (t.to(torch.bfloat16) for t in _batch(step, rank, device))
                torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
                opt.step()
                opt.zero_grad()

        reference, ref_opt = wrapped(0)
        train(reference, ref_opt, range(10))
        first, opt = wrapped(0)
        train(first, opt, range(5))
        dcp.save(
            {"model": get_model_state_dict(first), "optim": get_optimizer_state_dict(first, opt)}, checkpoint_id=path
        )
        resumed, resumed_opt = wrapped(1)  # other weights: the checkpoint restores them, masters included
        target = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(resumed, target["model"])
        set_optimizer_state_dict(resumed, resumed_opt, target["optim"])
        train(resumed, resumed_opt, range(5, 10))
        ref_opt.synchronize()
        resumed_opt.synchronize()
        _assert_same(reference, resumed, ref_opt, resumed_opt)
        masters = dict(resumed_opt.master_params())
        for (_, m), q in zip(ref_opt.master_params(), resumed.parameters(), strict=True):
            assert torch.equal(m, masters[q]), "masters differ"
        result[rank] = True
    finally:
        dist.destroy_process_group()


def _clip(variant: str, params: list[torch.nn.Parameter]) -> None:
    """The clipping variants users (and torchtitan) run on FSDP2's DTensor grads."""
    if variant == "norm-foreach":
        torch.nn.utils.clip_grad_norm_(params, 1e-2, foreach=True)
    elif variant == "norm":
        torch.nn.utils.clip_grad_norm_(params, 1e-2, foreach=False)
    elif variant == "with-norm":  # torchtitan's: the total norm made whole, then the grads scaled by it
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        torch.nn.utils.clip_grads_with_norm_(params, 1e-2, total, foreach=True)
    else:
        torch.nn.utils.clip_grad_value_(params, 1e-3)


CLIPS = ["norm-foreach", "norm", "with-norm", "value"]


def fsdp2_clipping(rank: int, world: int, port: int, backend: str, result: Any, slow: bool = False) -> None:
    """Every clipping variant on FSDP2's grads: sync and overlap are bitwise with the plain loop; step_in_backward is
    refused before any update when the loop clips from its first iteration, and at step() (or, on a GPU, before
    the next update) when it starts later.
    ``slow``: every chunk's step starts about 10 ms late on its stream (a GPU), so that a missing wait shows."""
    from reference import slowed_chunk_steps

    device = _init(rank, world, port, backend)
    try:
        with slowed_chunk_steps() if slow else contextlib.nullcontext():
            result[rank] = _clipping_outcomes(rank, device)
    finally:
        dist.destroy_process_group()


def _clipping_outcomes(rank: int, device: torch.device) -> dict[str, str]:
    """Each clipping variant in sync, overlap and step_in_backward mode (early and late): what came of it."""
    outcome = {}
    for clip in CLIPS:
        plain_model = _shard(_model(device))
        plain = INNERS["adamw-foreach"](plain_model.parameters())
        for step in range(4):
            x, y = _batch(step, rank, device)
            torch.nn.functional.mse_loss(plain_model(x), y).backward()
            _clip(clip, list(plain_model.parameters()))
            plain.step()
            plain.zero_grad()
        for mode in ("sync", "overlap", "backward"):
            for late in (False, True) if mode == "backward" else (False,):
                model = _shard(_model(device))
                before = [_local(p.detach()).clone() for p in model.parameters()]
                opt = ChunkedOffloadOptimizer(
                    INNERS["adamw-foreach"](model.parameters()),
                    chunk_size_mb=0.002,
                    overlap=mode == "overlap",
                    step_in_backward=mode == "backward",
                )
                if mode != "sync":
                    opt.attach(model)
                refused = None
                try:
                    for step in range(4):
                        x, y = _batch(step, rank, device)
                        torch.nn.functional.mse_loss(model(x), y).backward()
                        if not late or step == 2:
                            _clip(clip, list(model.parameters()))
                        opt.step()
                        opt.zero_grad()
                    opt.wait_step()
                except RuntimeError as exc:  # a GPU may find a late change only after step() returned
                    refused = str(exc)
                key = f"{clip}/{mode}{'/late' if late else ''}"
                if mode != "backward":
                    opt.synchronize()
                    _assert_same(plain_model, model, plain, opt)
                    outcome[key] = "bitwise"
                elif not late:
                    assert refused is not None and "Nothing was updated" in refused, refused
                    for p, b in zip(model.parameters(), before, strict=True):
                        assert torch.equal(_local(p.detach()), b), "updated before the refusal"
                    outcome[key] = "refused before any update"
                else:
                    assert refused is not None and "already updated the params" in refused, refused
                    late_found = "found after that step() had returned" in refused
                    outcome[key] = "refused before the next update" if late_found else "refused at step()"
    return outcome


def ddp_in_backward(rank: int, world: int, port: int, backend: str, result: Any) -> None:
    """DDP with step_in_backward=True: refused at attach(), or without attach() before any update."""
    device = _init(rank, world, port, backend)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(_model(device))
        opt = ChunkedOffloadOptimizer(
            INNERS["adamw-foreach"](model.parameters()), chunk_size_mb=0.002, step_in_backward=True
        )
        messages = []
        try:
            opt.attach(model)
        except ValueError as exc:
            messages.append(str(exc))
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0, rank, device)  # other data on each rank: the all-reduce changes every grad
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except RuntimeError as exc:
            messages.append(str(exc))
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
        result[rank] = messages
    finally:
        dist.destroy_process_group()


def ddp_in_backward_one_gpu(rank: int, world: int, port: int, backend: str, result: Any) -> None:
    """DDP at world size 1 on a GPU: its all-reduce leaves each grad as it is, so a step in the backward (each chunk
    slowed) is bitwise the plain DDP loop; attach() of the DDP model is refused all the same."""
    device = _init(rank, world, port, backend)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from reference import slowed_chunk_steps

        models = [DDP(_model(device)) for _ in range(2)]
        opts = [
            INNERS["adamw-fused"](models[0].parameters()),
            ChunkedOffloadOptimizer(INNERS["adamw-fused"](models[1].parameters()), step_in_backward=True),
        ]
        with slowed_chunk_steps():
            for model, opt in zip(models, opts, strict=True):
                _train(model, opt, range(6), rank, device)
        opts[1].synchronize()
        _assert_same(models[0], models[1], opts[0], opts[1])
        try:
            opts[1].attach(models[1])
            result[rank] = "attached"
        except ValueError as exc:
            result[rank] = str(exc)
    finally:
        dist.destroy_process_group()
