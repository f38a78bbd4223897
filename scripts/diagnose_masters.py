"""Diagnose: are fp32/remainder master runs deterministic, and which one leaves the resident reference?"""
import sys

import torch

sys.path[:0] = ["src", "tests", "benchmarks"]
from chunked_offload import ChunkedOffloadOptimizer  # noqa: E402
from common import make_matrices, set_random_grads  # noqa: E402


def make(n):
    params = make_matrices(n * 4096**2, 4096, torch.bfloat16, torch.device("cuda"))
    set_random_grads(params)
    return params


def wrapped(mode, n, steps, chunk=256, slots=2):
    params = make(n)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True),
                                  chunk_size_mb=chunk, master_weights=mode, num_slots=slots)
    hist = []
    for _ in range(steps):
        opt.step()
        torch.cuda.synchronize()
        hist.append([p.detach().cpu() for p in params])
    masters = [m.clone() for _, m in opt.master_params()]
    return hist, masters


def reference(n, steps):
    params = make(n)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    for m, p in zip(masters, params):
        m.grad = p.grad.float()
    opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, fused=True)
    hist = []
    for _ in range(steps):
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        torch.cuda.synchronize()
        hist.append([p.detach().cpu() for p in params])
    return hist, [m.detach().cpu() for m in masters]


def first_diff(h1, h2):
    for s, (a, b) in enumerate(zip(h1, h2)):
        for i, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                idx = (x != y).nonzero()
                return f"step {s} param {i}: {idx.shape[0]} elems differ, first {idx[0].tolist()} {x[tuple(idx[0])].item()} vs {y[tuple(idx[0])].item()}"
    return "identical"


n, steps = 4, 6
ref_h, ref_m = reference(n, steps)
for mode in ("fp32", "remainder"):
    for slots in (2, 1):
        h1, m1 = wrapped(mode, n, steps, slots=slots)
        h2, m2 = wrapped(mode, n, steps, slots=slots)
        print(f"{mode} slots={slots}: run1 vs run2: {first_diff(h1, h2)}; run1 vs reference: {first_diff(h1, ref_h)}", flush=True)
# one bundle per chunk vs everything in one chunk
h, m = wrapped("fp32", n, steps, chunk=4096)
print("fp32 one chunk vs reference:", first_diff(h, ref_h), flush=True)
h, m = wrapped("remainder", n, steps, chunk=4096)
print("remainder one chunk vs reference:", first_diff(h, ref_h), flush=True)
