"""``python -m chunked_offload plan``: the memory a configuration needs, before anything is allocated."""

from __future__ import annotations

import argparse
import sys

import torch

from .memory import OPTIMIZERS, free_bytes, plan_memory

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunked_offload", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="what a configuration needs on the GPU, the host and the disk")
    plan.add_argument("--params", type=float, required=True, help="the param count (7e9)")
    plan.add_argument("--width", type=int, default=4096, help="the side of the model's square matrices")
    plan.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    plan.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    plan.add_argument("--master-weights", choices=["none", "fp32", "remainder"], default="none")
    plan.add_argument("--mode", choices=["sync", "overlap", "backward"], default="sync")
    plan.add_argument("--chunk-size-mb", type=float, default=256.0)
    plan.add_argument("--num-slots", type=int, default=2)
    plan.add_argument("--gpu-budget-mb", type=float)
    plan.add_argument("--spill-dir")
    plan.add_argument("--host-budget-mb", type=float, help="with --spill-dir; default: this machine's 'auto'")
    args = parser.parse_args(argv)
    try:
        memory = plan_memory(
            int(args.params),
            dtype=_DTYPES[args.dtype],
            optimizer=args.optimizer,
            master_weights=args.master_weights,
            mode=args.mode,
            chunk_size_mb=args.chunk_size_mb,
            num_slots=args.num_slots,
            gpu_budget_mb=args.gpu_budget_mb,
            spill_dir=args.spill_dir,
            host_budget_mb=args.host_budget_mb,
            width=args.width,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(memory.report(*free_bytes(args.spill_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
