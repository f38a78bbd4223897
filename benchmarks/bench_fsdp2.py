"""FSDP2 with offload across GPUs: parity with the unwrapped optimizer, per-rank memory and link throughput, DCP.

Command (one process per GPU, NCCL; on a CPU it runs a tiny model with gloo to check the wiring):
    PYTHONPATH=src python3 benchmarks/bench_fsdp2.py                     # every GPU of the host, ~2e9 params
    PYTHONPATH=src python3 benchmarks/bench_fsdp2.py --world 2 --layers 36 --steps 50

What it does, on every rank:
1. builds a Llama-shaped model (fp32 sharded params, bf16 compute: FSDP2's MixedPrecisionPolicy, whose sharded
   fp32 params are the masters), fully_shard per block;
2. trains it --steps steps with fused AdamW unwrapped, then again from the same init with the wrapper, on the same
   tokens, and compares the loss curves and the final local shards bitwise;
3. reports the step time of the wrapped optimizer against the per-rank duplex floor, measured with every rank
   copying at once (so the host's shared memory bandwidth counts), and the peak GPU memory of the step against the
   window bound;
4. saves a DCP checkpoint (model and optimizer) half way through the wrapped run, loads it into a fresh wrapped
   model on the same ranks and continues to the end, which must equal the uninterrupted run bitwise;
5. loads the same checkpoint on a single rank (resharded), wrapped and unwrapped, and checks that both continue
   identically.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from chunked_offload import ChunkedOffloadOptimizer
from common import ROOT, Recorder, measure_link
from reference import internals

MiB = 2**20


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(hidden)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(torch.nn.Module):
    """A Llama-shaped decoder: embedding, blocks of attention and gated MLP, RMSNorm, untied head."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, inter: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads, inter) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build(args: Any, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with device:
        model = Llama(args.vocab, args.hidden, args.layers, args.heads, args.inter)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def inner(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)


def wrap(opt: torch.optim.Optimizer, args: Any) -> ChunkedOffloadOptimizer:
    return ChunkedOffloadOptimizer(opt, chunk_size_mb=args.chunk_mb)


def tokens(step: int, rank: int, args: Any, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)


def train(model: Any, opt: Any, steps: range, rank: int, args: Any, device: torch.device) -> dict[str, list[float]]:
    """Train; per step: the loss, the seconds of opt.step() to its last byte, and its peak extra GPU memory."""
    out: dict[str, list[float]] = {"loss": [], "step_s": [], "peak": []}
    cuda = device.type == "cuda"
    for step in steps:
        loss = model(tokens(step, rank, args, device))
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        opt.step()
        engine = internals(opt).engine if isinstance(opt, ChunkedOffloadOptimizer) else None
        if cuda:
            if engine is not None and engine.d2h_stream is not None:
                torch.cuda.current_stream().wait_stream(engine.d2h_stream)  # timed to the last byte written back
            end.record()
            torch.cuda.synchronize()
            out["step_s"].append(start.elapsed_time(end) / 1e3)
            out["peak"].append(torch.cuda.max_memory_allocated() - base)
        else:
            out["step_s"].append(time.perf_counter() - t0)
            out["peak"].append(0)
        opt.zero_grad(set_to_none=True)
        out["loss"].append(loss.item())
    return out


def local_state(model: torch.nn.Module, opt: Any) -> list[torch.Tensor]:
    """Copies of the local shards: a wrapper's state tensors are its host memory itself, which later steps update."""
    tensors = []
    for p in model.parameters():
        tensors.append(p.to_local().detach().to("cpu", copy=True))
        for key in ("exp_avg", "exp_avg_sq"):
            tensors.append(opt.state[p][key].to_local().to("cpu", copy=True))
    return tensors


def worker(rank: int, world: int, port: int, args: Any, ckpt: str, result: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cuda = torch.cuda.is_available()
    # Bitwise comparisons need deterministic kernels: the embedding's backward and fused attention's backward
    # accumulate with atomics otherwise, so two runs of the same unwrapped model would already differ.
    torch.use_deterministic_algorithms(True)
    if cuda:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        report: dict[str, Any] = {}
        half = args.steps // 2
        if world > 1 or not args.resharded_from:
            model = build(args, device)
            numel = sum(p.to_local().numel() for p in model.parameters())
            report["local_params"] = numel
            plain = inner(model, device)
            ref = train(model, plain, range(args.steps), rank, args, device)
            ref_state = local_state(model, plain)
            del model, plain
            if cuda:
                torch.cuda.empty_cache()

            model = build(args, device)
            opt = wrap(inner(model, device), args)
            first = train(model, opt, range(half), rank, args, device)
            dcp.save(
                {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                checkpoint_id=ckpt,
            )
            second = train(model, opt, range(half, args.steps), rank, args, device)
            opt.synchronize()
            got = {k: first[k] + second[k] for k in first}
            report["loss_bitwise"] = got["loss"] == ref["loss"]
            now = local_state(model, opt)
            report["state_bitwise"] = all(torch.equal(a, b) for a, b in zip(ref_state, now, strict=True))
            report["step_s"] = got["step_s"]
            report["peak"] = max(got["peak"][1:])
            report["first_peak"] = got["peak"][0]
            report["bound"] = opt.plan.window_bound_nbytes
            report["host_bytes"] = opt.plan.host_nbytes
            final = local_state(model, opt)
            del model, opt
            if cuda:
                torch.cuda.empty_cache()

            dist.barrier()  # the link, measured while every rank copies at once
            link = measure_link(device, 1024 * MiB if cuda else 16 * MiB)
            report["duplex"] = link.duplex

            model = build(args, device)  # resume the checkpoint on the same ranks
            opt = wrap(inner(model, device), args)
            target = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(target, checkpoint_id=ckpt)
            set_model_state_dict(model, target["model"])
            set_optimizer_state_dict(model, opt, target["optim"])
            train(model, opt, range(half, args.steps), rank, args, device)
            opt.synchronize()
            resumed = local_state(model, opt)
            report["resume_bitwise"] = all(torch.equal(a, b) for a, b in zip(final, resumed, strict=True))
        else:  # one rank: load the multi-rank checkpoint resharded, wrapped and unwrapped, and continue both
            finals = []
            for wrapped in (True, False):
                model = build(args, device)
                opt = inner(model, device)
                if wrapped:
                    opt = wrap(opt, args)
                target = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
                dcp.load(target, checkpoint_id=ckpt)
                set_model_state_dict(model, target["model"])
                set_optimizer_state_dict(model, opt, target["optim"])
                train(model, opt, range(half, half + args.resharded_steps), rank, args, device)
                if wrapped:
                    opt.synchronize()
                finals.append(local_state(model, opt))
                del model, opt
                if cuda:
                    torch.cuda.empty_cache()
            report["resharded_bitwise"] = all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
        result[rank] = report
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, args: Any, ckpt: str) -> dict[int, Any]:
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(worker, args=(world, _free_port(), args, ckpt, result), nprocs=world, join=True)
        return dict(result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--world", type=int, default=torch.cuda.device_count() if gpu else 2)
    parser.add_argument("--layers", type=int, default=36 if gpu else 2)
    parser.add_argument("--hidden", type=int, default=2048 if gpu else 64)
    parser.add_argument("--heads", type=int, default=16 if gpu else 4)
    parser.add_argument("--inter", type=int, default=5632 if gpu else 160)
    parser.add_argument("--vocab", type=int, default=32000 if gpu else 256)
    parser.add_argument("--seq", type=int, default=1024 if gpu else 32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50 if gpu else 6)
    parser.add_argument("--resharded-steps", type=int, default=5 if gpu else 2)
    parser.add_argument("--chunk-mb", type=float, default=256.0 if gpu else 0.05)
    parser.add_argument("--csv", type=Path, default=ROOT / "out" / "bench_fsdp2.csv")
    args = parser.parse_args()
    args.resharded_from = None
    device = torch.device("cuda" if gpu else "cpu")
    rec = Recorder(device)
    total = args.vocab * args.hidden * 2 + args.layers * (
        4 * args.hidden**2 + 3 * args.hidden * args.inter + 2 * args.hidden
    )
    print(f"# {rec.meta['gpu']} x {args.world}, torch {rec.meta['torch']}, commit {rec.meta['sha']}")
    print(f"# Llama-shaped model: {total / 1e9:.2f}e9 params, {args.layers} layers, hidden {args.hidden}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        ckpt = str(Path(tmp) / "dcp")
        t0 = time.perf_counter()
        reports = run(args.world, args, ckpt)
        print(f"# {args.world}-rank runs took {time.perf_counter() - t0:.0f} s", flush=True)
        args.resharded_from = ckpt
        resharded = run(1, args, ckpt)[0]

    ok = True
    print(
        f"\n{'rank':>4} {'local params':>13} {'step s':>8} {'floor s':>8} {'x floor':>8} {'peak MiB':>9} "
        f"{'bound MiB':>9} {'loss':>6} {'state':>6} {'resume':>7}"
    )
    for rank, r in sorted(reports.items()):
        steps = sorted(r["step_s"][2:])  # the first steps create the state and warm up
        median = steps[len(steps) // 2]
        floor = r["host_bytes"] / r["duplex"]
        for name, value in (
            ("step_s", median),
            ("floor_s", floor),
            ("x_duplex_floor", median / floor),
            ("peak_extra_MiB", r["peak"] / MiB),
            ("window_bound_MiB", r["bound"] / MiB),
            ("duplex_GBps", r["duplex"] / 1e9),
            ("loss_bitwise", float(r["loss_bitwise"])),
            ("state_bitwise", float(r["state_bitwise"])),
            ("resume_bitwise", float(r["resume_bitwise"])),
        ):
            rec.add(f"fsdp2-{args.world}gpu", f"rank{rank}", name, value)
        ok = ok and r["loss_bitwise"] and r["state_bitwise"] and r["resume_bitwise"]
        print(
            f"{rank:>4} {r['local_params'] / 1e9:>12.3f}e9 {median:>8.4f} {floor:>8.4f} {median / floor:>8.3f} "
            f"{r['peak'] / MiB:>9.0f} {r['bound'] / MiB:>9.0f} {str(r['loss_bitwise']):>6} "
            f"{str(r['state_bitwise']):>6} {str(r['resume_bitwise']):>7}"
        )
    print(f"# duplex GB/s per rank with all ranks copying: {[round(r['duplex'] / 1e9, 1) for r in reports.values()]}")
    print(
        f"# resharded to 1 rank, wrapped == unwrapped after {args.resharded_steps} steps: "
        f"{resharded['resharded_bitwise']}"
    )
    rec.add(f"fsdp2-{args.world}gpu", "resharded-1rank", "bitwise", float(resharded["resharded_bitwise"]))
    ok = ok and resharded["resharded_bitwise"]
    rec.write(args.csv)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
