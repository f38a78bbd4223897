"""Train a HF transformers Llama with ChunkedOffloadOptimizer: fp32 masters, clipping, a schedule, overlapped step.

Run:  PYTHONPATH=src python3 examples/train_llama.py                  # ~1 B params on a GPU, a tiny model on the CPU
      PYTHONPATH=src python3 examples/train_llama.py --no-overlap --steps 20
      PYTHONPATH=src python3 examples/train_llama.py --step-in-backward      # steps under the backward; no clipping
Needs `transformers`. The loop is a plain PyTorch loop; the wrapper adds three lines: wrap, attach, prefetch.
"""

from __future__ import annotations

import argparse
import math

import torch

from chunked_offload import ChunkedOffloadOptimizer

SIZES = {  # hidden, layers, intermediate, heads, vocab
    "tiny": (64, 2, 128, 4, 256),
    "1b": (2048, 16, 5632, 16, 32000),
}


def build(size: str, seq: int, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, intermediate, heads, vocab = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=seq,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.bfloat16()
    model.config.use_cache = False
    return model


def train(args: argparse.Namespace) -> tuple[list[float], torch.nn.Module, ChunkedOffloadOptimizer]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("1b" if device.type == "cuda" else "tiny")
    seq = args.seq or (2048 if device.type == "cuda" else 32)
    model = build(size, seq, device)
    lr = getattr(args, "lr", None) or (3e-4 if device.type == "cuda" else 1e-2)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=device.type == "cuda")
    opt = ChunkedOffloadOptimizer(
        inner,
        chunk_size_mb=256,
        master_weights="fp32",
        overlap=args.overlap,
        step_in_backward=args.step_in_backward,
    )
    if args.overlap or args.step_in_backward:
        opt.attach(model)  # each module waits for its own params' update
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    vocab = SIZES[size][4]
    gen = torch.Generator(device=device).manual_seed(1)
    losses = []
    positions = torch.arange(seq, device=device)
    for step in range(args.steps):
        # A task the model can learn, so that the loss falls: sequences that count up from a random token.
        starts = torch.randint(0, vocab, (args.batch, 1), generator=gen, device=device)
        ids = (starts + positions) % vocab
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # with step_in_backward=True, the chunks step in here
        if args.clip:
            opt.prefetch()  # the first chunk's copy overlaps the clipping below
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            stats = opt.stats
            link = f", link {stats.link_gbps:.1f} GB/s" if stats is not None else ""
            print(f"step {step:4d}  loss {losses[-1]:.4f}  lr {schedule.get_last_lr()[0]:.2e}{link}")
    opt.wait_step()  # params are read below, outside an attached module's forward
    return losses, model, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), help="model size; default 1b on a GPU, tiny on the CPU")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, help="tokens per sequence; default 2048 on a GPU, 32 on the CPU")
    parser.add_argument(
        "--overlap", action=argparse.BooleanOptionalAction, default=True, help="overlap the step with the next forward"
    )
    parser.add_argument("--step-in-backward", action="store_true", help="step under the backward (turns clipping off)")
    parser.add_argument("--log-every", type=int, default=5, help="print a line every this many steps")
    parser.add_argument("--lr", type=float, help="peak learning rate; default 3e-4 on a GPU, 1e-2 on the CPU")
    args = parser.parse_args()
    args.batch = args.batch or 8
    args.clip = not args.step_in_backward  # clipping would change the grads after the backward has stepped
    losses, model, opt = train(args)
    print(opt)
    print(f"final loss {losses[-1]:.4f} after {len(losses)} steps; last step: {opt.stats}")


if __name__ == "__main__":
    main()
