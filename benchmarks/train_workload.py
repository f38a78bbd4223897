"""The training workload of bench_train.py: the Llama model, each variant's optimizer, one iteration, the timed run
of a variant, its profiler trace, and the bitwise check of every variant against the resident run."""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from chunked_offload import ChunkedOffloadOptimizer
from chunked_offload.budget import DEFAULT_HEADROOM_MB
from common import progress, synchronize
from peers import DeepSpeedZeroOffload, TorchaoOffload
from reference import ResidentMasters

VARIANTS = ("resident", "sync", "overlap", "backward")
AUTO = ("sync-auto", "overlap-auto", "backward-auto")
# backward without the content checks of step() ([Note: Inputs of a step]): what those cost (issue 32).
UNCHECKED = ("backward-unchecked",)
RESERVED: dict[str, int] = {}  # each variant's reserved peak in the last batch (--auto-spare caps from it)
NO_CLIP = {"backward", "backward-auto", "backward-unchecked", "resident-noclip", "sync-noclip", "torchao"}


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    if args.fsdp2:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def make_optimizer(variant: str, model: torch.nn.Module, args: argparse.Namespace, batch: int = 1) -> Any:
    if variant.startswith("resident"):
        fused = next(model.parameters()).device.type == "cuda"
        params = [p for p in model.parameters() if p.requires_grad]
        return ResidentMasters(params, lambda ms: torch.optim.AdamW(ms, lr=args.lr, weight_decay=0.01, fused=fused))
    if variant == "torchao":
        return TorchaoOffload(model, args.lr)
    if variant == "deepspeed":
        return DeepSpeedZeroOffload(model, args.lr, batch)
    fused = next(model.parameters()).device.type == "cuda"
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=fused)
    mode = variant.removesuffix("-auto").removesuffix("-unchecked")
    opt = ChunkedOffloadOptimizer(
        inner,
        chunk_size_mb=args.chunk_mb,
        num_slots=args.num_slots,
        master_weights=args.master_weights,
        overlap=mode == "overlap",
        step_in_backward=mode == "backward",
        gpu_budget_mb="auto" if variant in AUTO else None,
    )
    if mode in ("overlap", "backward"):
        opt.attach(model, blocks=args.blocks)
    return opt


def compiled(model: torch.nn.Module, args: argparse.Namespace) -> Any:
    """The forward an iteration calls: the model, or (--compile) a fresh torch.compile of it."""
    if not args.compile:
        return model
    torch._dynamo.reset()
    return torch.compile(model, mode=args.compile)


def batches_of(seed: int, count: int, batch: int, args: argparse.Namespace, device: torch.device) -> list:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(0, args.vocab, (batch, args.seq), generator=gen, device=device) for _ in range(count)]


def iterate(model: torch.nn.Module, opt: Any, ids: torch.Tensor, clip: bool = True, forward: Any = None) -> float:
    """One training iteration; returns the host seconds ``opt.step()`` took to return."""
    loss = (model if forward is None else forward)(input_ids=ids, labels=ids).loss
    if isinstance(opt, DeepSpeedZeroOffload):
        opt.backward(loss)  # the engine reduces the grads into its partitions
    else:
        loss.backward()
    if clip:
        opt.prefetch()  # ours: the first chunk's H2D overlaps the clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    t0 = time.perf_counter()
    opt.step()
    host = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    return host


@contextlib.contextmanager
def checks_off(variant: str) -> Iterator[None]:
    """For ``*-unchecked``: step() compares no grads ([Note: Inputs of a step]), to time what the checks cost."""
    from chunked_offload import inputs

    if not variant.endswith("-unchecked"):
        yield
        return
    record, compare = inputs.GradRecord.record, inputs.GradRecord.compare
    inputs.GradRecord.record = lambda self, items: None  # type: ignore[method-assign]
    inputs.GradRecord.compare = lambda self, grad_of, indices: inputs.GradComparison([])  # type: ignore[method-assign]
    try:
        yield
    finally:
        inputs.GradRecord.record, inputs.GradRecord.compare = record, compare  # type: ignore[method-assign]


def run_variant(
    variant: str, model: torch.nn.Module, initial: dict[str, torch.Tensor], batch: int, args: argparse.Namespace
) -> tuple[list[float], int, Any, float, float]:
    with checks_off(variant):
        return _run_variant(variant, model, initial, batch, args)


def _run_variant(
    variant: str, model: torch.nn.Module, initial: dict[str, torch.Tensor], batch: int, args: argparse.Namespace
) -> tuple[list[float], int, Any, float, float]:
    """Per-iteration seconds (steady state), the peak memory, the optimizer (to read its plan), the median host
    seconds of ``step()``, and the last step's own seconds (ours: to its last byte written back, but for a write-back
    held for the next step ([Note: Held write-back]); else 0)."""
    device = next(model.parameters()).device
    model.load_state_dict(initial)
    if variant == "deepspeed":
        model = copy.deepcopy(model)  # the engine keeps its hooks on the model it wraps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # "auto" reads this variant's peak, not the last one's
    opt = make_optimizer(variant, model, args, batch)
    forward = opt.engine if isinstance(opt, DeepSpeedZeroOffload) else compiled(model, args)
    data = batches_of(batch, args.warmup + args.iters, batch, args, device)
    clip = variant not in NO_CLIP
    for ids in data[: args.warmup]:
        iterate(model, opt, ids, clip, forward)
    opt.wait_step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    marks: list[Any] = []
    hosts = []
    for ids in progress(data[args.warmup :], f"{variant} b={batch}"):
        marks.append(_mark(device))
        hosts.append(iterate(model, opt, ids, clip, forward))
    opt.wait_step()  # the last step's updates are part of its iteration
    marks.append(_mark(device))
    synchronize(device)
    seconds = [_elapsed(a, b) for a, b in zip(marks, marks[1:], strict=False)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    RESERVED[variant] = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0  # what "auto" reads
    step_s = opt.stats.seconds if isinstance(opt, ChunkedOffloadOptimizer) and opt.stats is not None else 0.0
    if args.trace is not None:
        path = args.trace / f"{variant}_{batch * args.seq}.json.gz"
        trace(model, opt, data[-2:], clip, forward, path, stack=args.trace_stack)
    return seconds, peak, opt, statistics.median(hosts), step_s


def trace(
    model: torch.nn.Module, opt: Any, data: list, clip: bool, forward: Any, path: Path, stack: bool = False
) -> None:
    """A profiler trace (Chrome format, gzipped) of a few more iterations, after the timed ones.

    ``stack``: record Python calls too (trace_summary.py --ops then names the functions the host time goes to).
    """
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=stack) as prof:
        for ids in data:
            iterate(model, opt, ids, clip, forward)
        opt.wait_step()
        synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    print(f"trace: {path}")


def auto_cap(
    variant: str, peaks: dict[str, int], state_nbytes: int | None, device: torch.device, args: argparse.Namespace
) -> int | None:
    """With --auto-spare, cap an -auto variant's device memory so that the spare holds that share of the state."""
    if variant not in AUTO or args.auto_spare is None or device.type != "cuda":
        return None
    offloaded = RESERVED.get(variant.removesuffix("-auto")) if variant.removesuffix("-auto") in peaks else None
    if offloaded is None or state_nbytes is None:
        raise SystemExit(f"--auto-spare: run {variant.removesuffix('-auto')} before {variant} in --variants")
    headroom = int(DEFAULT_HEADROOM_MB * 2**20)
    cap = offloaded + int(args.auto_spare * state_nbytes) + headroom
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), torch.cuda.current_device())
    return cap


def _mark(device: torch.device) -> Any:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def exact_check(model: torch.nn.Module, initial: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, bool]:
    """Every variant against the resident run, bitwise, over ``args.exact_steps`` steps in deterministic mode."""
    device = next(model.parameters()).device
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    finals: dict[str, list[torch.Tensor]] = {}
    references = ("resident", "resident-noclip")  # compiled too: the wrapper adds nothing to the graphs
    try:
        for variant in dict.fromkeys((*args.variants, *references)):
            model.load_state_dict(initial)
            opt = make_optimizer(variant, model, args)
            forward = compiled(model, args)
            with checks_off(variant):
                for ids in batches_of(7, args.exact_steps, args.exact_batch, args, device):
                    iterate(model, opt, ids, variant not in NO_CLIP, forward)
                opt.wait_step()
            finals[variant] = [_local(p.detach()).cpu() for p in model.parameters()]
            del opt
            gc.collect()
    finally:
        torch.use_deterministic_algorithms(False)
        if device.type == "cuda":
            torch.backends.cuda.enable_flash_sdp(True)
            torch.backends.cuda.enable_mem_efficient_sdp(True)
            torch.backends.cuda.enable_cudnn_sdp(True)

    def same(v: str) -> bool:
        ref = finals[references[1] if v in NO_CLIP else references[0]]
        return all(torch.equal(a, b) for a, b in zip(ref, finals[v], strict=True))

    return {v: same(v) for v in args.variants if v not in references}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
