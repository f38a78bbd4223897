"""An RL-style loop: free the optimizer's GPU memory for each rollout phase, and train on the rollouts after it.

Run:  PYTHONPATH=src python3 examples/rl_offload_loop.py            # GPU when present, else CPU
The policy is a bf16 MLP with fp32 masters; part of its optimizer state stays resident on the GPU (gpu_budget_mb).
Before each rollout ``opt.offload(non_blocking=True)`` hands that memory back to torch's allocator, the rollout
uses it (a KV-cache-like buffer), and ``opt.reload(non_blocking=True)`` brings the state back before training. The
same loop runs a second time without the offload calls; the final params must match bitwise.
"""

from __future__ import annotations

import argparse

import torch

from chunked_offload import ChunkedOffloadOptimizer

MiB = 2**20


def policy(width: int, depth: int, actions: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, actions))
    return torch.nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)


def run(args: argparse.Namespace, offload: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Train; return the final params and, per rollout, the device bytes the offload freed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = policy(args.width, args.depth, args.actions, device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    # The staging window: 2 slots x max(chunk, the largest param's bundle: fp32 master, two moments, fp32 grad, bf16
    # backup = 18 bytes per element), plus 1 MiB for alignment. What the budget has beyond it stays resident.
    window = 2 * max(args.chunk_mb, 18 * args.width**2 / MiB) + 1
    opt = ChunkedOffloadOptimizer(
        inner, chunk_size_mb=args.chunk_mb, master_weights="fp32", gpu_budget_mb=window + args.resident_mb
    )
    gen = torch.Generator(device=device).manual_seed(1)
    freed = []
    for _ in range(args.iterations):
        # Rollout phase: the optimizer's device memory goes back to the allocator for the rollout to use.
        if offload:
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            opt.offload(non_blocking=True)
            freed.append(before - torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
        with torch.no_grad():
            obs = torch.randn(args.rollout, args.width, device=device, generator=gen, dtype=torch.bfloat16)
            cache = torch.empty(max(freed[-1] if freed else 0, 1), dtype=torch.uint8, device=device)  # the rollout's
            probs = model(obs).float().softmax(-1)
            actions = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            rewards = torch.randn(args.rollout, device=device, generator=gen)
            del cache
        if offload:
            opt.reload(non_blocking=True)  # the next step is ordered after the copy; no host wait
        # Training phase: a policy-gradient step on the rollouts.
        logp = model(obs).float().log_softmax(-1).gather(1, actions[:, None]).squeeze(1)
        loss = -(logp * (rewards - rewards.mean())).mean()
        loss.backward()
        opt.prefetch()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    return [p.detach().cpu() for p in model.parameters()], freed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=8, help="rollout + update iterations")
    parser.add_argument("--width", type=int, default=None, help="default 4096 on a GPU, 128 on the CPU")
    parser.add_argument("--depth", type=int, default=6, help="hidden layers of the policy")
    parser.add_argument("--actions", type=int, default=64, help="size of the action space")
    parser.add_argument("--rollout", type=int, default=256, help="episodes sampled per rollout phase")
    parser.add_argument(
        "--chunk-mb", type=float, default=64.0, help="chunk_size_mb of the wrapper (0.25 at most on the CPU)"
    )
    parser.add_argument(
        "--resident-mb",
        type=float,
        default=None,
        help="gpu_budget_mb: what stays resident until offload(); default 512 on a GPU, 0.5 on the CPU",
    )
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    args.width = args.width or (4096 if gpu else 128)
    args.resident_mb = args.resident_mb if args.resident_mb is not None else (512.0 if gpu else 0.5)
    if not gpu:
        args.chunk_mb = min(args.chunk_mb, 0.25)
    with_offload, freed = run(args, offload=True)
    without, _ = run(args, offload=False)
    exact = all(torch.equal(a, b) for a, b in zip(with_offload, without, strict=True))
    where = "GPU" if gpu else "CPU (no device memory to free)"
    print(f"{where}: each rollout phase had {min(freed) / MiB:.1f} MiB of freed optimizer memory to use")
    print(f"final params bitwise equal to the loop without offload: {'yes' if exact else 'NO'}")
    raise SystemExit(0 if exact else 1)


if __name__ == "__main__":
    main()
