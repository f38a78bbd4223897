"""Diagnose: remainder vs fp32 exactness and step time against the piece size (one device call)."""
import sys
import time

import torch

sys.path[:0] = ["src", "tests", "benchmarks"]
import chunked_offload.transfer as transfer  # noqa: E402
from chunked_offload import ChunkedOffloadOptimizer  # noqa: E402
from common import make_matrices, set_random_grads  # noqa: E402


def run(mode, piece, n=16, dtype=torch.bfloat16, steps=8, chunk=256):
    transfer.PIECE_BYTES = piece
    params = make_matrices(n * 4096**2, 4096, dtype, torch.device("cuda"))
    set_random_grads(params)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True),
                                  chunk_size_mb=chunk, master_weights=mode)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    d2h = opt._engine.d2h_stream
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    torch.cuda.current_stream().wait_stream(d2h)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    out = [p.detach().cpu() for p in params]
    masters = [m.clone() for _, m in opt.master_params()] if mode != "none" else []
    del opt, params
    torch.cuda.empty_cache()
    return dt, out, masters


INF = 2**62
for piece in (INF, 32 * 2**20):
    t32, p32, m32 = run("fp32", piece)
    trem, prem, mrem = run("remainder", piece)
    same_p = all(torch.equal(a, b) for a, b in zip(p32, prem))
    same_m = all(torch.equal(a, b) for a, b in zip(m32, mrem))
    print(f"piece={piece if piece < INF else 'none'}: fp32 {t32:.4f}s remainder {trem:.4f}s params equal {same_p} masters equal {same_m}", flush=True)
for piece in (INF, 32 * 2**20, 64 * 2**20, 128 * 2**20):
    for chunk in (64, 256):
        dt, _, _ = run("none", piece, n=60, dtype=torch.float32, chunk=chunk)
        print(f"adamw 1e9 chunk {chunk}MB piece {piece // 2**20 if piece < INF else 'none'}: {dt:.4f} s", flush=True)
