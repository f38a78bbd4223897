"""A training loop with ChunkedOffloadOptimizer: bf16 model, fp32 masters, LR schedule, checkpoint, offload hooks.

Run:  PYTHONPATH=src python3 examples/train_loop.py            # GPU when present, else CPU
      PYTHONPATH=src python3 examples/train_loop.py --master-weights remainder --steps 50
"""

from __future__ import annotations

import argparse
import io

import torch

from chunked_offload import ChunkedOffloadOptimizer


def make_model(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--width", type=int, default=None, help="default 2048 on a GPU, 256 on the CPU")
    parser.add_argument("--depth", type=int, default=8, help="hidden layers of the MLP")
    parser.add_argument("--chunk-size-mb", type=float, default=64.0, help="the wrapper's chunk_size_mb")
    parser.add_argument(
        "--master-weights", default="fp32", choices=["none", "fp32", "remainder"], help="the wrapper's master_weights"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    width = args.width or (2048 if device.type == "cuda" else 256)
    torch.manual_seed(0)

    model = make_model(width, args.depth, device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=device.type == "cuda")
    opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=args.chunk_size_mb, master_weights=args.master_weights)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=args.steps)
    print(opt)
    print(opt.plan.summary().splitlines()[0])

    target = torch.nn.Linear(width, 1).to(device)  # a fixed random teacher to regress onto
    for step in range(args.steps):
        x = torch.randn(64, width, device=device)
        with torch.no_grad():
            y = target(x)
        loss = (model(x.to(torch.bfloat16)).float() - y).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.5f}  lr {schedule.get_last_lr()[0]:.2e}")
        if step == args.steps // 2:
            # Checkpoint: the inner optimizer's native format, read from host memory.
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            opt.load_state_dict(ckpt["optim"])
            print(f"step {step:4d}  checkpoint round trip: {buf.getbuffer().nbytes / 2**20:.1f} MiB")
            # An RL-style phase that needs the whole GPU: free the optimizer's device memory, then continue.
            opt.offload()
            opt.reload()


if __name__ == "__main__":
    main()
