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
    sync-auto, overlap-auto, backward-auto
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
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunked_offload import ChunkedOffloadOptimizer  # noqa: E402
from common import Recorder, Stats, device_name, git_sha, measure_link  # noqa: E402
from peers import PEERS, peer_missing  # noqa: E402
from train_workload import AUTO, UNCHECKED, VARIANTS, auto_cap, build_model, exact_check, run_variant  # noqa: E402


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
    parser.add_argument("--trace-stack", action="store_true", help="the traces record Python calls too")
    parser.add_argument(
        "--torch-reconcile", action="store_true", help="the masters' reconcile as torch operations, not one kernel"
    )
    parser.add_argument(
        "--rollback-copy",
        action="store_true",
        help="resident chunks copy their homes for rollback, as before one-op updates",
    )
    args = parser.parse_args()
    if args.rollback_copy:
        import chunked_offload.stepping

        chunked_offload.stepping.ONE_OP_UPDATES = False
    if args.torch_reconcile:
        import chunked_offload.masters

        chunked_offload.masters.FUSED_RECONCILE = False
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
        f"chunk {args.chunk_mb:g} MB x {args.num_slots} slots, fused AdamW, clip 1.0, reconcile "
        f"{'torch operations' if args.torch_reconcile else 'fused where Triton is present'}, resident chunks "
        f"{'copied for rollback' if args.rollback_copy else 'updated in one op without a copy where they can be'}"
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
                    if floor is None and opt.plan.host_nbytes:  # not an "auto" plan that kept all on the GPU
                        state_nbytes = opt.plan.host_nbytes
                        floor = state_nbytes / link.duplex
                times[variant], peaks[variant], hosts[variant] = Stats.of(seconds), peak, (host_s, step_s, share)
            del opt
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        if not times:
            continue
        tokens = batch * args.seq
        base = times["resident"].median if "resident" in times else None  # None: the resident loop did not fit
        for variant in (v for v in variants if v in times):
            added = None if base is None else times[variant].median - base
            kept = None if base is None else base / times[variant].median
            ratio = added / floor if added is not None and floor else None
            rec.add(workload, variant, f"iter_s@{tokens}", times[variant])
            rec.add(workload, variant, f"peak_gib@{tokens}", peaks[variant] / 2**30)
            host_s, step_s, share = hosts[variant]
            rec.add(workload, variant, f"step_host_s@{tokens}", host_s)
            if variant != "resident":
                if ratio is not None:
                    rec.add(workload, variant, f"exposed_x_floor@{tokens}", ratio)
                if kept is not None:
                    rec.add(workload, variant, f"kept@{tokens}", kept)
                if variant not in PEERS:
                    rec.add(workload, variant, f"step_s@{tokens}", step_s)
                if share is not None:
                    rec.add(workload, variant, f"resident_share@{tokens}", share)
            rows.append((tokens, variant, times[variant].median, added, ratio, kept,
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
        relative = variant != "resident" and added is not None
        x_floor = f"{ratio:.3f}" if relative and ratio is not None else "-"
        print(
            f"{tokens:>7} {variant:>13} {it:>8.4f} {f'{added:.4f}' if relative else '-':>8} "
            f"{x_floor:>8} {'-' if kept is None else f'{100 * kept:.1f}%':>6} {peak:>9.2f} "
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
