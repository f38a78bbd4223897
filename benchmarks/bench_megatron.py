"""Megatron-Core: its GPTModel under its DDP and DistributedOptimizer, resident against ``wrap_megatron_optimizer`` and
Megatron's own offloads.

Question: inside Megatron's own training step, what does keeping the fp32 mains and the moments in host memory
cost, against what Megatron offers (``HybridDeviceOptimizer``, ``offload_to_cpu()``)?

Workload: megatron-core's ``GPTModel`` with the local layer spec (no Transformer Engine), bf16, ``--layers`` x
``--hidden`` (0.96 B params at 16 x 2048), Megatron's DDP with ``use_distributed_optimizer=True`` and fp32 grad
reduction, ``get_megatron_optimizer`` (Adam, clip 1.0), world size 1, ``--micro-batches`` of ``--micro-batch`` x
``--seq`` through ``forward_backward_no_pipelining``. Variants, each on a fresh model from the same seed:
    resident          Megatron as it is (run twice: the control)
    wrapped           wrap_megatron_optimizer(optimizer): mains and moments in host memory
    wrapped-auto      the same with gpu_budget_mb="auto" (what the GPU has room for stays resident)
    overlap           wrapped with overlap=True: the step runs beside the next forward
    overlap-auto      the same with gpu_budget_mb="auto"
    overlap-remainder overlap with master_weights="remainder": a 16-bit remainder of each fp32 main (10 B/param)
    overlap-slowed    overlap with every chunk's step started 10 ms late on its stream (GPU only), so that a reader
                      of the params that does not wait for the step overtakes it: bitwise only, its time is not kept
    hybrid            Megatron's HybridDeviceOptimizer (optimizer_cpu_offload, fraction 1.0, precision-aware): CPU step
    offload-restore   Megatron's offload_to_cpu() / restore_from_cpu() around each step
    megatron-chunked  (named only; GPU) Megatron-LM dev's ChunkedOptimizerStateOffloader (#6244, not in a release):
                      --megatron-path to a tree of that branch (scripts/megatron_dev.sh), fraction 1.0, --chunk-mb,
                      its lifecycle called where dev's train_step calls it; the other variants then run on dev too
Every variant runs ``--iters`` iterations in deterministic mode; its losses, params, fp32 mains and moments at the
end are compared bitwise with the resident run's. Reported: s/iter (median of the iterations after ``--warmup``),
the share of resident iterations/s kept, the peak GPU memory, the memory allocated once the variant is built (what
an earlier variant left would show here), and whether it is bitwise.

Commands:
    PYTHONPATH=src:tests:benchmarks python3 benchmarks/bench_megatron.py          # GPU: 0.96 B; CPU: a tiny model
    ... bench_megatron.py --variants wrapped-auto --profile 15    # GPU: where one more iteration's GPU time goes
    ... bench_megatron.py --variants wrapped-auto --host-profile 30   # where 3 more iterations' host time goes
    ... bench_megatron.py --fused    # Megatron's inner as torch's fused AdamW (one op: resident chunks need no copy)
    ... bench_megatron.py --te       # Megatron's precision-aware path: TE's FusedAdam keeps bf16-remainder masters
    ... bench_megatron.py --megatron-path .megatron_dev --variants megatron-chunked   # Megatron's dev branch
megatron-core 0.19.2 on the GPU: its wheel in .whl/ (``pip download --no-deps megatron-core==0.19.2``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, git_sha  # noqa: E402  (it puts src/ and tests/ on the path)

VARIANTS = (
    "resident", "wrapped", "wrapped-auto", "overlap", "overlap-auto", "overlap-remainder", "overlap-slowed", "hybrid",
    "offload-restore",
)  # fmt: skip
DEV_VARIANTS = ("megatron-chunked",)  # on Megatron-LM's dev branch only (--megatron-path); run when named


def build(variant: str, args: argparse.Namespace) -> tuple[Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from chunked_offload.integrations.megatron import wrap_megatron_optimizer

    torch.manual_seed(0)
    if args.device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    heads = max(1, args.hidden // 128)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads, bf16=True,
        params_dtype=torch.bfloat16, deterministic_mode=True, use_cpu_initialization=args.device.type == "cpu",
    )  # fmt: skip
    from megatron.core.transformer.module import Float16Module

    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq)
    model = Float16Module(config, model.to(args.device))  # as Megatron's get_model wraps it for bf16
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    options: dict[str, Any] = {}
    if args.te:  # Megatron's precision-aware path: TE's FusedAdam(master_weights=True) keeps the masters
        options = {"use_precision_aware_optimizer": True, "store_param_remainders": args.device.type == "cuda"}
    if variant == "hybrid":
        options = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
        options |= {"use_precision_aware_optimizer": True, "main_params_dtype": torch.float32}
    if variant == "megatron-chunked":  # Megatron-LM dev's ChunkedOptimizerStateOffloader (#6244), all state
        options |= {"chunked_optimizer_state_offload": True, "optimizer_state_offload_fraction": 1.0}
        options["optimizer_state_offload_chunk_size_mb"] = max(1, round(args.chunk_mb))
    cfg = OptimizerConfig(
        optimizer="adam", lr=1e-4, weight_decay=0.1, bf16=True, clip_grad=1.0, use_distributed_optimizer=True,
        **options,
    )  # fmt: skip
    opt = get_megatron_optimizer(cfg, [ddp])
    if variant == "megatron-chunked":  # as dev's train_step: the state comes back while the grads are finalized
        ddp.config.finalize_model_grads_func = lambda *a, **k: opt.prefetch_optimizer_state_for_gradient_finalization()
    if args.fused and variant != "hybrid":  # torch's fused AdamW in every variant: one op per step, no rollback copy
        for d in getattr(opt, "chained_optimizers", [opt]):
            for group in d.optimizer.param_groups:
                group.update(fused=True, foreach=False)
    if variant.startswith(("wrapped", "overlap")):
        wrap: dict[str, Any] = {"overlap": variant.startswith("overlap")}
        if variant.endswith("-auto"):
            wrap["gpu_budget_mb"] = "auto"
        if variant.endswith("-remainder"):
            wrap["master_weights"] = "remainder"
        wrap_megatron_optimizer(opt, chunk_size_mb=args.chunk_mb, **wrap)
    return ddp, opt


def iteration(ddp: Any, opt: Any, it: int, args: argparse.Namespace) -> float:
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    gen = torch.Generator(device=args.device).manual_seed(it)
    batches = iter(
        torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen, device=args.device)
        for _ in range(args.micro_batches)
    )
    position = torch.arange(args.seq, device=args.device).unsqueeze(0).expand(args.micro_batch, -1)

    def forward_step(data: Any, model: Any) -> Any:
        tokens = next(data)
        output = model(tokens[:, :-1], position, None, labels=tokens[:, 1:])

        def loss(out: torch.Tensor) -> Any:
            value = out.float().mean()
            return value, {"loss": value.detach()}

        return output, loss

    dev_offload = getattr(getattr(opt, "config", None), "chunked_optimizer_state_offload", False)
    if dev_offload:  # as dev's train_step: the state goes to the host first
        opt.offload_optimizer_state_for_forward()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=batches, model=[ddp], num_microbatches=args.micro_batches,
        seq_length=args.seq, micro_batch_size=args.micro_batch,
    )  # fmt: skip
    opt.step()
    return float(sum(entry["loss"] for entry in losses))


def snapshot(ddp: Any, opt: Any) -> list[torch.Tensor]:
    """The params, and each shard's fp32 main param and moments in Megatron's checkpoint form (on the host)."""
    out = [p.detach().to("cpu", copy=True) for p in ddp.parameters()]
    for d in getattr(opt, "chained_optimizers", [opt]):
        for group in (*d.model_float16_groups, *d.model_fp32_groups):
            for model_param in group:
                tensors = d._get_main_param_and_optimizer_states(model_param)
                # copies: the wrapper's are its host tensors themselves, which a later iteration (--profile) updates
                out += [tensors[k].detach().to("cpu", torch.float32, copy=True) for k in sorted(tensors) if k != "step"]
    return out


def run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from reference import slowed_chunk_steps

    ddp, opt = build(variant.removesuffix("-slowed"), args)
    synchronize(args.device)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    built = torch.cuda.memory_allocated() if args.device.type == "cuda" else 0
    losses, seconds = [], []
    with slowed_chunk_steps() if variant.endswith("-slowed") else contextlib.nullcontext():
        for it in range(args.iters):
            start = time.perf_counter()
            losses.append(iteration(ddp, opt, it, args))
            if variant == "offload-restore":
                opt.offload_to_cpu()
                opt.restore_from_cpu()
            synchronize(args.device)
            seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if args.device.type == "cuda" else 0
    result = {"losses": losses, "s": statistics.median(seconds[args.warmup :]), "peak": peak, "built": built}
    try:
        result["snapshot"] = snapshot(ddp, opt)
    except Exception as e:  # HybridDeviceOptimizer keeps another form
        result["snapshot"] = None
        result["why"] = f"{type(e).__name__}: {e}"
    if args.profile and args.device.type == "cuda":  # one more iteration, after the snapshot: where its time goes
        result["profile"] = profile(functools.partial(iteration, ddp, opt, args.iters, args), args.profile)
    if args.memory_trace and args.device.type == "cuda" and variant == args.trace_variant:  # after the snapshot
        calls = [functools.partial(iteration, ddp, opt, it, args) for it in (args.iters, args.iters + 1)]
        result["profile"] = memory_trace(lambda: [c() for c in calls], args.memory_trace)
    if args.host_profile:  # more iterations, after the snapshot: where their host time goes
        result["profile"] = result.get("profile", "") + host_profile(ddp, opt, args)
    del ddp, opt
    free()
    return result


def profile(call: Any, rows: int) -> str:
    """The ``rows`` ops with the most GPU time in one ``call()``; the table ends with the total ("Self CUDA time
    total"; a sum over its rows would count the wrapper's profiler scopes as well as the kernels inside them)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows))


def memory_trace(call: Any, rows: int) -> str:
    """What is allocated at the peak of ``call()`` (two iterations: an overlapped step's leftovers show in the second),
    above what was before it: the ``rows`` places (the innermost
    frame in this library, Megatron or the benchmark) that allocated the most of it, and how much of that was freed by
    the host but not yet by the allocator (a block another stream still reads)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(context="all", stacks="python", max_entries=2_000_000)
    try:
        call()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    def replay(until: int) -> tuple[int, int, dict[int, dict[str, Any]], set[int]]:
        """Replay the first ``until`` events: the index of the highest level in them, that level, and at the end the
        blocks still allocated and those of them the host has freed."""
        live: dict[int, dict[str, Any]] = {}
        requested: set[int] = set()
        level = top = top_at = 0
        for k, event in enumerate(trace[:until]):
            action, addr = event["action"], event["addr"]
            if action == "alloc":
                live[addr] = event
                level += event["size"]
                if level > top:
                    top, top_at = level, k + 1
            elif action == "free_requested":
                requested.add(addr)
            elif action == "free_completed":  # also of blocks allocated before the trace
                level -= event["size"]
                live.pop(addr, None)
                requested.discard(addr)
        return top_at, top, live, requested & live.keys()

    top_at, top, _, _ = replay(len(trace))
    _, _, live, pending = replay(top_at)
    places: dict[str, list[int]] = {}
    marks = ("chunked_offload", "megatron", "bench_megatron")
    for event in live.values():
        frames = event.get("frames", [])
        frame = next((f for f in frames if any(m in f["filename"] for m in marks)), frames[0] if frames else None)
        key = f"{frame['filename'].rsplit('/', 2)[-1]}:{frame['line']} {frame['name']}" if frame else "?"
        entry = places.setdefault(key, [0, 0])
        entry[0] += event["size"]
        entry[1] += event["size"] if event["addr"] in pending else 0
    lines = [f"peak of two iterations: {before / 2**30:.2f} GiB before + {top / 2**30:.2f} GiB; allocated in them:"]
    for key, (size, freed) in sorted(places.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"  {size / 2**30:7.3f} GiB ({freed / 2**30:.3f} freed by the host, pending)  {key}")
    return "\n".join(lines)


def host_profile(ddp: Any, opt: Any, args: argparse.Namespace, iters: int = 3) -> str:
    """Host time: ``opt.step()``'s (returned to the caller) against the iteration's, over ``iters`` more iterations;
    then, over as many under cProfile, the ``args.host_profile`` functions with the most time of their own, and the
    library's with the most in all."""
    import cProfile
    import io
    import pstats

    step, spent = opt.step, []

    def timed_step(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            spent.append(time.perf_counter() - start)

    def iterations(first: int) -> float:
        synchronize(args.device)
        start = time.perf_counter()
        for it in range(first, first + iters):
            iteration(ddp, opt, it, args)
        synchronize(args.device)
        return (time.perf_counter() - start) / iters

    opt.step = timed_step
    try:
        total = iterations(args.iters + 1)
        prof = cProfile.Profile()
        with prof:
            iterations(args.iters + 1 + iters)
    finally:
        del opt.step
    out = io.StringIO()
    step_ms = statistics.mean(spent[:iters]) * 1e3
    out.write(f"host: {total * 1e3:.1f} ms/iter, of which opt.step() {step_ms:.1f} ms (without cProfile)\n")
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(args.host_profile)
    stats.sort_stats("cumulative").print_stats("chunked_offload", args.host_profile)
    return out.getvalue()


def free() -> None:
    """Free what a variant left: Megatron's modules are in reference cycles, and a wrapper's finalizer (it takes its
    hooks off the model) runs in the first collection, so the model goes only in a second one."""
    gc.collect()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def same(a: dict[str, Any], b: dict[str, Any]) -> str:
    if a["snapshot"] is None or b["snapshot"] is None:
        return "n/a"
    if len(a["snapshot"]) != len(b["snapshot"]):
        return "NO"
    pairs = zip(a["snapshot"], b["snapshot"], strict=True)
    return "yes" if a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in pairs) else "NO"


def commit(tree: Path) -> str:
    """`` at <commit>`` of a tree scripts/megatron_dev.sh made, else nothing."""
    recorded = tree / "COMMIT"
    return f" at {recorded.read_text().strip()[:10]}" if recorded.is_file() else ""


def main() -> int:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16 if gpu else 2)
    parser.add_argument("--hidden", type=int, default=2048 if gpu else 64)
    parser.add_argument("--vocab", type=int, default=32000 if gpu else 512)
    parser.add_argument("--seq", type=int, default=2048 if gpu else 32)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk-mb", type=float, default=1024.0 if gpu else 1.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--fused", action="store_true", help="torch's fused AdamW as Megatron's inner, every variant")
    parser.add_argument("--profile", type=int, default=0, help="GPU: the N ops with most GPU time, one more iteration")
    parser.add_argument("--host-profile", type=int, default=0, help="the N functions with most host time")
    parser.add_argument(
        "--memory-trace", type=int, default=0,
        help="GPU: two more iterations of --trace-variant under the allocator's history; the N places with most "
        "memory live at their peak",
    )  # fmt: skip
    parser.add_argument("--trace-variant", default="overlap", help="the variant --memory-trace traces")
    parser.add_argument("--te", action="store_true", help="Megatron's precision-aware path with TE's FusedAdam")
    parser.add_argument(
        "--megatron-path", type=Path, default=None,
        help="import Megatron from this tree (a Megatron-LM checkout, or its megatron/core: scripts/megatron_dev.sh) "
        "instead of the installed megatron-core; megatron-chunked needs Megatron-LM's dev branch",
    )  # fmt: skip
    args = parser.parse_args()
    if args.megatron_path is not None:
        if not (args.megatron_path / "megatron" / "core" / "__init__.py").is_file():
            parser.error(f"--megatron-path {args.megatron_path} holds no megatron/core/__init__.py")
        sys.path.insert(0, str(args.megatron_path.resolve()))
    unknown = set(args.variants.split(",")) - {"", *VARIANTS, *DEV_VARIANTS}
    if unknown:
        parser.error(f"unknown variants {', '.join(sorted(unknown))}: choose from {', '.join(VARIANTS + DEV_VARIANTS)}")
    if args.te and gpu and importlib.util.find_spec("transformer_engine") is None:
        parser.error("--te needs Transformer Engine installed (pip install transformer-engine[pytorch])")
    args.device = torch.device("cuda" if gpu else "cpu")
    variants = ["resident", "resident", *[v for v in args.variants.split(",") if v and v != "resident"]]
    if not gpu:  # HybridDeviceOptimizer maps CPU copies to GPU params, streams sleep, and Megatron's chunked offload
        # tells its host copies from the device's by is_cuda: none of them on the CPU
        gpu_only = [v for v in variants if v in ("hybrid", "overlap-slowed", "megatron-chunked")]
        variants = [v for v in variants if v not in gpu_only]
        if gpu_only:
            print(f"on the GPU only, not run: {', '.join(gpu_only)}")
    if args.te:  # TE's FusedAdam keeps the masters on that path (with --store-param-remainders: remainders)
        variants = [v for v in variants if not v.endswith("-remainder")]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    stack = contextlib.ExitStack()
    if not gpu:  # Megatron has no CPU path: the tests' stand-in for CUDA
        from megatron_cases import cuda_on_cpu

        stack.enter_context(cuda_on_cpu())
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # torch's CPU generator instead
        if args.te:  # the tests' stand-in for TE's FusedAdam (fp32 masters; no remainders)
            from te_standin import standing_in

            stack.enter_context(standing_in())
    with stack:
        from megatron.core import package_info
        from megatron.core.optimizer import OptimizerConfig

        if "megatron-chunked" in args.variants.split(",") and not hasattr(
            OptimizerConfig, "chunked_optimizer_state_offload"
        ):
            parser.error(
                "megatron-chunked needs Megatron's ChunkedOptimizerStateOffloader, on Megatron-LM's dev branch only: "
                "pass --megatron-path to a tree of it (scripts/megatron_dev.sh makes one)"
            )
        torch.distributed.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        model, opt = build("resident", args)
        params = sum(p.numel() for p in model.parameters())
        inner = type(getattr(opt, "chained_optimizers", [opt])[0].optimizer)
        del model, opt
        free()  # that model must not count in the first variant's peak
        print(
            f"{device_name(args.device)}, torch {torch.__version__}, commit {git_sha()}: GPTModel {params / 1e9:.3f} B "
            f"params ({args.layers} layers, hidden {args.hidden}), {args.micro_batches} x {args.micro_batch} x "
            f"{args.seq} tokens, chunk {args.chunk_mb:g} MB; inner {inner.__module__}.{inner.__name__}; megatron-core "
            f"{package_info.__version__}"
            + (f" from {args.megatron_path}{commit(args.megatron_path)}" if args.megatron_path else "")
            + (" (fused)" if args.fused else "")
            + (", precision-aware path" if args.te else "")
        )
        results, failed = [], []
        for v in variants:
            try:
                results.append((v, run(v, args)))
            except Exception as e:  # the other variants still run (the resident ones are needed: they raise)
                if v == "resident":
                    raise
                failed.append(f"{v} ({type(e).__name__}: {e})")
                print(f"  {v} failed: {failed[-1]}", flush=True)
                free()
                continue
            print(f"  ran {v}: {results[-1][1]['s']:.4f} s/iter", flush=True)
            if "profile" in results[-1][1]:
                print(results[-1][1]["profile"], flush=True)
    base, control = results[0][1], results[1][1]
    print(f"control: resident against itself: {'bitwise' if same(base, control) == 'yes' else 'DIFFERS'}")
    print(f"{'variant':18s} {'s/iter':>8s} {'kept':>7s} {'peak GiB':>9s} {'B/param below':>13s} {'built GiB':>9s} "
          f"{'bitwise':>8s}")  # fmt: skip
    below = min(base["peak"], control["peak"])  # the first run may hold what main() built before it
    ok = True
    for k, (v, r) in enumerate(results[1:]):
        v = "control" if k == 0 else v
        bitwise = same(base, r)
        ok = ok and (bitwise != "NO" or v in ("hybrid", "megatron-chunked"))  # Megatron's own: reported, not ours
        print(f"{v:18s} {r['s']:8.4f} {base['s'] / r['s']:7.1%} {r['peak'] / 2**30:9.2f} "
              f"{(below - r['peak']) / params:13.2f} {r['built'] / 2**30:9.2f} {bitwise:>8s}"
              + (f"  ({r['why']})" if "why" in r else ""))  # fmt: skip
    print(f"{'resident':18s} {base['s']:8.4f} {1:7.1%} {base['peak'] / 2**30:9.2f} {base['built'] / 2**30:9.2f}")
    for line in failed:
        print(f"FAILED: {line}")
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
