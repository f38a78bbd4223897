"""How much of a training iteration the offloaded step costs: resident AdamW against ours, synchronous and overlapped.

Question: with the optimizer state and fp32 masters in host memory, how much longer is an iteration of a real model
than with everything resident, and how much of the step's transfer time does the overlapped mode hide?

Workload: HF ``transformers`` LlamaForCausalLM built from a config (random init), bf16 params, fp32 masters, fused
AdamW, gradient clipping at 1.0, sequence 2048 on the GPU; a sweep over the batch size (tokens per iteration).
Variants, each timed on the same iterations in one run:
    resident   the fp32 masters and AdamW state on the GPU (the loop the wrapper reproduces bitwise);
    sync       ChunkedOffloadOptimizer(master_weights="fp32"), the step blocks the next forward;
    overlap    the same with overlap=True and opt.attach(model): the next forward overlaps the step;
    backward   step_in_backward=True and opt.attach(model): each chunk steps as soon as its grads are final, under
               the backward. This mode cannot clip (it steps before clipping could run), so its loop does not clip,
               and it is checked against a resident run without clipping; its exposed time is against the resident
               iteration with clipping (which costs the resident loop a few ms).
    backward-auto, overlap-auto
               the same with gpu_budget_mb="auto": from the second step on, the state of the first params stays
               resident in the device memory the training leaves unused. --auto-spare F caps the device memory of
               these variants (torch.cuda.set_per_process_memory_fraction) so that what is left beside the fully
               offloaded variant's peak holds the share F of the state (a model whose spare memory holds part of it).
Peers (not bitwise; they are left out of the exact check and need their package, else they are skipped with why):
    deepspeed  DeepSpeed ZeRO stage 2 with offload_optimizer {device: cpu, pin_memory: true} (DeepSpeedCPUAdam, AdamW
               on the host with fp32 masters there), bf16, gradient clipping 1.0 in its config; on a copy of the model.
               Wheels: scripts/peers-prepare.sh. Its CPU Adam op is compiled at the first deepspeed.initialize.
    torchao    torchao.optim.CPUOffloadOptimizer(fused AdamW): the step on the host CPU, on the bf16 params as they are
               (no fp32 masters: it keeps each param's dtype on the host), no clipping (its grad hooks copy the grads
               to the host during the backward, before clipping could run).
Exposed optimizer time = our iteration - the resident iteration ("added"), reported as a multiple of the step's
transfer floor (the bytes each way over the measured duplex bandwidth), and "kept" = resident iterations/s over the
variant's (the figure ZeRO-Offload and its successors publish).

--compile MODE runs every variant's forward and backward through torch.compile(model, mode=MODE) (the whole model:
the wrapper adds nothing to its graph, and each step finishes before it returns; [Note: Gates in compiled graphs]).
--blocks attaches with blocks=True: one gate per decoder layer.
--fsdp2 shards the model with FSDP2 (each decoder layer and the root, one process, NCCL) before any optimizer.

Exactness: two unwrapped runs of the model differ unless the kernels are deterministic (attention's and the
embedding's backward use atomics), so the bitwise check runs separately, in deterministic mode with math attention
at the smallest batch, for every variant against the resident run. The timed sweep uses the fast kernels.

Commands:
    python3 benchmarks/bench_train.py                       # ~1 B params on a GPU, a tiny model on the CPU
    python3 benchmarks/bench_train.py --batches 8,16 --csv benchmarks/results/bench_train_h200.csv
    python3 benchmarks/bench_train.py --batches 16 --compile default
    python3 benchmarks/bench_train.py --batches 16 --fsdp2 --variants resident,sync,overlap
    python3 benchmarks/bench_train.py --batches 8,16,32 --peers                    # + deepspeed, torchao
    python3 benchmarks/bench_train.py --batches 8 --variants resident,backward,backward-auto --auto-spare 0.5
Exits nonzero if any variant is not bitwise equal to the resident run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunked_offload import ChunkedOffloadOptimizer  # noqa: E402
from chunked_offload.budget import DEFAULT_HEADROOM_MB  # noqa: E402
from common import Recorder, Stats, device_name, git_sha, measure_link, progress, synchronize  # noqa: E402

VARIANTS = ("resident", "sync", "overlap", "backward")
AUTO = ("overlap-auto", "backward-auto")
# backward without the content checks of step() ([Note: Inputs of a step]): what those cost (issue 32).
UNCHECKED = ("backward-unchecked",)
PEERS = ("torchao", "deepspeed")  # run after ours: DeepSpeed leaves its hooks on the model it wraps (a copy)
RESERVED: dict[str, int] = {}  # each variant's reserved peak in the last batch (--auto-spare caps from it)
NO_CLIP = {"backward", "backward-auto", "backward-unchecked", "resident-noclip", "sync-noclip", "torchao"}


class ResidentMasters:
    """The resident fp32-master loop: AdamW steps fp32 copies of the bf16 params, which take the rounded result."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        fused = self.params[0].device.type == "cuda"
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.01, fused=fused)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        torch._foreach_copy_([_local(p.detach()) for p in self.params], [_local(m) for m in self.masters])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def wait_step(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class TorchaoOffload:
    """torchao's CPUOffloadOptimizer: fused AdamW on the host CPU over host copies of the (bf16) params."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        from torchao.optim import CPUOffloadOptimizer

        self.inner = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.01, fused=True)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def wait_step(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class DeepSpeedZeroOffload:
    """DeepSpeed ZeRO stage 2 with the optimizer on the host (DeepSpeedCPUAdam, fp32 masters there), bf16, one rank."""

    def __init__(self, model: torch.nn.Module, lr: float, batch: int) -> None:
        import deepspeed

        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", "29518")
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "betas": [0.9, 0.999]}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "contiguous_gradients": True,
                "overlap_comm": True,
            },
            "steps_per_print": 2**31,
        }
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine clears its gradient buffers in step()

    def wait_step(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


def peer_missing(variant: str) -> str | None:
    """Why a peer variant cannot run here, or None."""
    module = {"torchao": "torchao.optim", "deepspeed": "deepspeed"}[variant]
    if not torch.cuda.is_available():
        return "needs a GPU"
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or an incompatible build
        return f"{module} is not importable ({type(exc).__name__}: {str(exc)[:80]}); see scripts/peers-prepare.sh"
    return None


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
        return ResidentMasters(model, args.lr)
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
    record, changed = inputs.GradRecord.record, inputs.GradRecord.changed
    inputs.GradRecord.record = lambda self, items: None  # type: ignore[method-assign]
    inputs.GradRecord.changed = lambda self, grad_of, indices: []  # type: ignore[method-assign]
    try:
        yield
    finally:
        inputs.GradRecord.record, inputs.GradRecord.changed = record, changed  # type: ignore[method-assign]


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
        trace(model, opt, data[-2:], clip, forward, args.trace / f"{variant}_{batch * args.seq}.json.gz")
    return seconds, peak, opt, statistics.median(hosts), step_s


def trace(model: torch.nn.Module, opt: Any, data: list, clip: bool, forward: Any, path: Path) -> None:
    """A profiler trace (Chrome format, gzipped) of a few more iterations, after the timed ones."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batches", type=str, help="comma-separated batch sizes (sequences per iteration)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--exact-steps", type=int, default=3)
    parser.add_argument("--exact-batch", type=int, default=1)
    parser.add_argument("--skip-exact", action="store_true", help="timing only (exploration); exits 0")
    parser.add_argument("--chunk-mb", type=float, default=1024.0)
    parser.add_argument("--num-slots", type=int, default=2)
    parser.add_argument("--master-weights", default="fp32", choices=["fp32", "remainder"])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--csv", type=Path)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join((*VARIANTS, *AUTO, *PEERS))}"
    )
    parser.add_argument("--peers", action="store_true", help="add the peers (deepspeed, torchao) to --variants")
    parser.add_argument(
        "--auto-spare", type=float, metavar="F",
        help="cap the -auto variants' device memory: the offloaded variant's reserved peak + F x the state + headroom",
    )  # fmt: skip
    parser.add_argument("--compile", metavar="MODE", help="torch.compile mode: default, max-autotune-no-cudagraphs")
    parser.add_argument("--fsdp2", action="store_true", help="shard the model with FSDP2 (world size 1)")
    parser.add_argument("--blocks", action="store_true", help="attach(model, blocks=True): a hook per decoder layer")
    parser.add_argument("--trace", type=Path, metavar="DIR", help="write a profiler trace of each variant to DIR")
    args = parser.parse_args()
    args.variants = tuple(v for v in args.variants.split(",") if v) + (PEERS if args.peers else ())
    known = (*VARIANTS, *AUTO, *UNCHECKED, *PEERS)
    unknown = [v for v in args.variants if v not in known]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(known)}")
    if "resident" not in args.variants:
        parser.error("--variants must include resident: every other variant's time is against it")
    if (args.compile or args.fsdp2) and any(v in PEERS for v in args.variants):
        parser.error("the peers run eager and unsharded: leave --compile and --fsdp2 out with deepspeed or torchao")
    args.variants = tuple(sorted(dict.fromkeys(args.variants), key=lambda v: v in PEERS))  # peers last
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    # The calibration model on a GPU (0.95 B params); a tiny one on the CPU.
    defaults = dict(hidden=2048, layers=16, intermediate=5632, heads=16, vocab=32000, seq=2048, batches="4,8,16,24,32")
    if not gpu:
        defaults = dict(hidden=64, layers=2, intermediate=128, heads=4, vocab=256, seq=32, batches="1,2")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if gpu:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the exact check

    model = build_model(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    link = measure_link(device, 512 * 2**20 if gpu else 16 * 2**20)
    print(
        f"{device_name(device)}, torch {torch.__version__}, commit {git_sha()}: Llama {n_params / 1e9:.3f} B params "
        f"(hidden {args.hidden}, {args.layers} layers), seq {args.seq}, bf16 params, masters {args.master_weights}, "
        f"chunk {args.chunk_mb:g} MB x {args.num_slots} slots, fused AdamW, clip 1.0"
    )
    print(f"link: H2D {link.h2d / 1e9:.1f} GB/s, D2H {link.d2h / 1e9:.1f} GB/s, duplex {link.duplex / 1e9:.1f} GB/s")

    variants = list(args.variants)
    for peer in [v for v in variants if v in PEERS]:
        why = peer_missing(peer)
        if why is not None:
            print(f"{peer}: skipped, {why}")
            variants.remove(peer)
    args.variants = tuple(v for v in variants if v not in PEERS)  # the exact check: ours, against resident
    exact = {} if args.skip_exact else exact_check(model, initial, args)
    print(
        "bitwise check skipped (--skip-exact)"
        if args.skip_exact
        else f"bitwise equal to the resident run (deterministic kernels, "
        f"batch {args.exact_batch}, {args.exact_steps} steps): "
        + ", ".join(f"{v} {'yes' if ok else 'NO'}" for v, ok in exact.items())
    )

    rec = Recorder(device)
    workload = f"llama-{n_params / 1e9:.2f}B-seq{args.seq}"
    workload += (f"-compile-{args.compile}" if args.compile else "") + ("-fsdp2" if args.fsdp2 else "")
    workload += "-blocks" if args.blocks else ""
    floor = state_nbytes = None
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, Stats] = {}
        peaks: dict[str, int] = {}
        hosts: dict[str, tuple[float, float, float | None]] = {}
        for variant in variants:
            cap = auto_cap(variant, peaks, state_nbytes, device, args)
            try:
                seconds, peak, opt, host_s, step_s = run_variant(variant, model, initial, batch, args)
            except torch.OutOfMemoryError:
                print(
                    f"batch {batch}: {variant} does not fit" + (f" in its cap of {cap / 2**30:.1f} GiB" if cap else "")
                )
                opt = None
            except Exception as exc:  # a peer's own failure is reported and the run goes on; ours propagate
                if variant not in PEERS:
                    raise
                print(f"batch {batch}: {variant} failed: {type(exc).__name__}: {str(exc)[:300]}")
                opt = None
            finally:
                if cap:
                    torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
            if opt is not None:
                share = None
                if isinstance(opt, ChunkedOffloadOptimizer):
                    share = opt.stats.resident_share if opt.stats is not None else None
                    if floor is None:
                        state_nbytes = opt.plan.host_nbytes
                        floor = state_nbytes / link.duplex
                times[variant], peaks[variant], hosts[variant] = Stats.of(seconds), peak, (host_s, step_s, share)
            del opt
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        if floor is None or not times:
            continue
        tokens = batch * args.seq
        base = times["resident"].median if "resident" in times else None  # None: the resident loop did not fit
        for variant in (v for v in variants if v in times):
            added = None if base is None else times[variant].median - base
            kept = None if base is None else base / times[variant].median
            rec.add(workload, variant, f"iter_s@{tokens}", times[variant])
            rec.add(workload, variant, f"peak_gib@{tokens}", peaks[variant] / 2**30)
            host_s, step_s, share = hosts[variant]
            rec.add(workload, variant, f"step_host_s@{tokens}", host_s)
            if variant != "resident":
                if added is not None and kept is not None:
                    rec.add(workload, variant, f"exposed_x_floor@{tokens}", added / floor)
                    rec.add(workload, variant, f"kept@{tokens}", kept)
                if variant not in PEERS:
                    rec.add(workload, variant, f"step_s@{tokens}", step_s)
                if share is not None:
                    rec.add(workload, variant, f"resident_share@{tokens}", share)
            rows.append((tokens, variant, times[variant].median, added, None if added is None else added / floor, kept,
                         peaks[variant] / 2**30, host_s, step_s, share))  # fmt: skip
    if floor is not None:
        rec.add(workload, "floor", "step_floor_s", floor)
    for variant, ok in exact.items():
        rec.add(workload, variant, "exact", float(ok))

    print(f"\nstep transfer floor: {floor or 0:.4f} s (the host arena's bytes each way over the duplex link)")
    print(
        f"{'tokens':>7} {'variant':>13} {'iter s':>8} {'added s':>8} {'x floor':>8} {'kept':>6} {'peak GiB':>9} "
        f"{'step() host s':>14} {'step s':>8} {'resident':>8}"
    )
    for tokens, variant, it, added, ratio, kept, peak, host_s, step_s, share in rows:
        ours = variant not in ("resident", *PEERS)
        relative = variant != "resident" and added is not None and ratio is not None
        print(
            f"{tokens:>7} {variant:>13} {it:>8.4f} {f'{added:.4f}' if relative else '-':>8} "
            f"{f'{ratio:.3f}' if relative else '-':>8} {'-' if kept is None else f'{100 * kept:.1f}%':>6} {peak:>9.2f} "
            f"{host_s:>14.4f} {f'{step_s:.4f}' if ours else '-':>8} {'-' if share is None else f'{share:.0%}':>8}"
        )
    if any(row[3] is None for row in rows):
        print("(-: the resident loop did not fit at that size, so nothing is relative to it)")
    added_by: dict[int, dict[str, float]] = {}
    for row in rows:
        if row[3] is not None:
            added_by.setdefault(row[0], {})[row[1]] = row[3]
    for tokens, of in sorted(added_by.items()):
        if "deepspeed" in of:
            ratios = [
                f"{v} {of['deepspeed'] / of[v]:.1f}x" for v in of if v not in ("resident", "deepspeed") and of[v] > 0
            ]
            print(f"{tokens} tokens: the time ZeRO-Offload adds over the time added by " + ", ".join(ratios))
    if args.csv:
        rec.write(args.csv)
        print(f"wrote {args.csv}")
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
