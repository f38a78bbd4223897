"""FSDP2 units as torchtitan builds them, trained with overlap=True: the race cases of tests/test_fsdp_overlap.py (CPU,
emulated step stream) and tests/cuda/test_fsdp_overlap_cuda.py (GPU, each chunk's step slowed)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chunked_offload import ChunkedOffloadOptimizer
from reference import ResidentMasters, assert_equal

VOCAB, DIM, LAYERS = 96, 32, 3


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """An embedding, blocks, and a head of a norm and an output projection, as torchtitan's Llama."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


@dataclass(frozen=True)
class Case:
    """One configuration: FSDP2's resharding and prefetching, how the model is attached, and the params' dtype."""

    reshard: bool = True  # reshard_after_forward: the backward all-gathers again
    prefetch: bool = False  # explicit forward prefetch of the next unit
    blocks: bool = False  # attach(model, blocks=True)
    masters: bool = False  # bf16 shards with fp32 masters

    @property
    def name(self) -> str:
        return "-".join(
            [
                "reshard" if self.reshard else "keep",
                "prefetch" if self.prefetch else "implicit",
                "blocks" if self.blocks else "modules",
                "masters" if self.masters else "fp32",
            ]
        )


CASES = [
    Case(),
    Case(reshard=False),
    Case(prefetch=True),
    Case(reshard=False, prefetch=True),
    Case(blocks=True),
    Case(prefetch=True, blocks=True),
    Case(masters=True),
    Case(reshard=False, prefetch=True, masters=True),
]


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A process group of one rank (gloo on the CPU, NCCL on a GPU) for the block, unless one exists."""
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(case: Case, device: torch.device, dims: tuple[int, int, int] = (VOCAB, DIM, LAYERS)) -> Net:
    """The model sharded as torchtitan shards it: the embedding, each block, [norm, output] as one unit, the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    dtype = torch.bfloat16 if case.masters else torch.float32
    model = Net(*dims).to(device=device, dtype=dtype)
    kw: dict[str, Any] = {"reshard_after_forward": case.reshard}
    fully_shard(model.embed, **kw)
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard([model.norm, model.output], **kw)  # one unit of two modules: the norm's pre-hook all-gathers both
    fully_shard(model, **kw)
    if case.prefetch:
        units: list[Any] = [model.embed, *model.layers, model.norm]
        for unit, after in zip(units, units[1:], strict=False):
            unit.set_modules_to_forward_prefetch([after])
    return model


def make_inner(params: list[torch.Tensor], device: torch.device) -> torch.optim.Optimizer:
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)


def reference(case: Case, model: Net, device: torch.device) -> Any:
    """The plain loop's optimizer: AdamW, over fp32 masters kept beside bf16 params when ``case.masters``."""
    if case.masters:
        return ResidentMasters(list(model.parameters()), lambda ps: make_inner(ps, device))
    return make_inner(list(model.parameters()), device)


def wrapped(case: Case, model: Net, device: torch.device, chunk_size_mb: float) -> ChunkedOffloadOptimizer:
    opt = ChunkedOffloadOptimizer(
        make_inner(list(model.parameters()), device),
        chunk_size_mb=chunk_size_mb,
        overlap=True,
        master_weights="fp32" if case.masters else "none",
    )
    opt.attach(model, blocks=case.blocks)
    return opt


def train(model: Net, opt: Any, steps: int, device: torch.device, batch: tuple[int, int] = (4, 16)) -> torch.Tensor:
    """torchtitan's step: forward, backward, ``clip_grad_norm_(foreach=True)``, step, zero_grad; the losses."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.output.out_features
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, batch, generator=gen).to(device)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).cpu()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def assert_same_run(a: tuple[Net, torch.Tensor], b: tuple[Net, torch.Tensor]) -> None:
    """Losses and params bitwise equal."""
    assert_equal(a[1], b[1], "losses")
    for (name, pa), pb in zip(a[0].named_parameters(), b[0].parameters(), strict=True):
        assert_equal(local(pa.detach()), local(pb.detach()), name)


def overlap_cases_on_ranks(rank: int, world: int, port: int, backend: str, result: Any) -> None:
    """Every case on ``world`` ranks (spawned by tests/test_distributed.py): at world size > 1 FSDP2 copies the shards
    into its all-gather input inside ``unshard()``, the read the unshard hook orders. Each rank trains on its own
    batches; the wrapped run must equal the plain one on every rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cpu")
    try:
        for case in CASES:
            plain = build(case, device)
            plain_losses = train(plain, reference(case, plain, device), 3, device, batch=(2 + rank, 8))
            model = build(case, device)
            opt = wrapped(case, model, device, 1 / 1024)
            losses = train(model, opt, 3, device, batch=(2 + rank, 8))
            opt.wait_step()
            assert_same_run((plain, plain_losses), (model, losses))
        result[rank] = True
    finally:
        dist.destroy_process_group()
