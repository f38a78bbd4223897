"""Probe: how cudaHostRegister'd memory behaves under torch (is_pinned, bandwidth, copies across registrations)."""
import time
import torch

cr = torch.cuda.cudart()
G = 2**30
dev = torch.empty(G, dtype=torch.uint8, device="cuda")


def bw(host, label):
    n = host.numel()
    for direction in ("h2d", "d2h"):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            if direction == "h2d":
                dev[:n].copy_(host, non_blocking=True)
            else:
                host.copy_(dev[:n], non_blocking=True)
        torch.cuda.synchronize()
        print(f"{label} {direction}: {3 * n / (time.perf_counter() - t) / 1e9:.1f} GB/s", flush=True)


def reg(ptr, n):
    t = time.perf_counter()
    err = cr.cudaHostRegister(ptr, n, 0)
    return err, time.perf_counter() - t


raw = torch.empty(G + 2**21, dtype=torch.uint8)
off = (-raw.data_ptr()) % 2**21
a = raw[off:off + G]
err, dt = reg(a.data_ptr(), G)
print("single register:", err, type(err), int(err), f"{dt:.3f}s/GiB", "is_pinned:", a.is_pinned(), flush=True)
bw(a, "registered-single")
print("unregister:", cr.cudaHostUnregister(a.data_ptr()))

raw2 = torch.empty(G + 2**21, dtype=torch.uint8)
off = (-raw2.data_ptr()) % 2**21
b = raw2[off:off + G]
half = G // 2
print("two registers:", reg(b.data_ptr(), half)[0], reg(b.data_ptr() + half, half)[0], "is_pinned:", b.is_pinned())
try:
    bw(b[half - 2**20: half + 2**20], "spanning-two")
except Exception as e:
    print("spanning-two failed:", type(e).__name__, str(e)[:80])
    torch.cuda.synchronize()
bw(b[:half], "within-one")

p = torch.empty(G, dtype=torch.uint8, pin_memory=True)
print("caching pinned is_pinned:", p.is_pinned())
bw(p, "pin_memory=True")

t = time.perf_counter()
big = torch.empty(8 * G, dtype=torch.uint8)
big.fill_(0)
print(f"touch 8GiB: {time.perf_counter() - t:.2f}s", flush=True)
err, dt = reg(big.data_ptr(), 8 * G)
print(f"register 8GiB (touched) single call: {dt:.2f}s err={err}", flush=True)
cr.cudaHostUnregister(big.data_ptr())
big2 = torch.empty(8 * G, dtype=torch.uint8)
err, dt = reg(big2.data_ptr(), 8 * G)
print(f"register 8GiB (untouched) single call: {dt:.2f}s err={err}", flush=True)
t = time.perf_counter()
x = torch.empty(4 * G, dtype=torch.uint8, pin_memory=True)
print(f"pin_memory=True 4GiB: {time.perf_counter() - t:.2f}s", flush=True)
