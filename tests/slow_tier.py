"""A tier for the tests only, and the storage seam's proof ([Note: Storage seam]): a store behind the host that keeps
its chunks in memory behind a deliberately slow copy, and the planner rule that gives it chunks. It is this file and
nothing else: no edit to the pipeline, the placement or the wrapper."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from chunked_offload.bounced import BouncedStore
from chunked_offload.planner import Chunk, ChunkPlan, Home

SLOW = Home("slow-memory")


class SlowMemoryStore(BouncedStore):
    """Each chunk's bytes in a host tensor of its own; a read and a write sleep ``delay`` seconds first."""

    home = SLOW

    def __init__(self, chunks: Sequence[Chunk], bounces: int, bounce_nbytes: int, delay: float) -> None:
        super().__init__(chunks, bounces, bounce_nbytes, pin=False)
        self.memory = {c.index: torch.zeros(c.transfer_nbytes, dtype=torch.uint8) for c in chunks}
        self.delay = delay
        self.reads = self.writes = 0

    def homes_of(self, index: int) -> torch.Tensor:
        return self.memory[index]

    def read_into(self, index: int, out: torch.Tensor, progress: Callable[[int], None]) -> None:
        time.sleep(self.delay)
        out.copy_(self.memory[index])
        self.reads += 1

    def write_from(self, index: int, bounce: torch.Tensor, nbytes: int, seal: Callable[[], None]) -> None:
        time.sleep(self.delay)
        seal()
        self.memory[index].copy_(bounce[:nbytes])
        self.writes += 1

    def where(self, index: int) -> str:
        return f"chunk {index}'s bytes in the slow memory tier"


class SlowTier:
    """The planner rule: the offloaded chunks after the first ``keep_on_host`` go to the slow memory tier."""

    home = SLOW

    def __init__(self, keep_on_host: int, delay: float = 0.002) -> None:
        self.keep_on_host, self.delay = keep_on_host, delay
        self.stores: list[SlowMemoryStore] = []

    def assign(self, plan: ChunkPlan) -> ChunkPlan:
        host = [c for c in plan.chunks if c.home == Home.HOST]
        moved = host[self.keep_on_host :]
        if not moved:
            return plan
        base = moved[0].home_offset
        new = {c.index: replace(c, home=SLOW, home_offset=c.home_offset - base) for c in moved}
        return replace(plan, chunks=tuple(new.get(c.index, c) for c in plan.chunks))

    def check_room(self, plan: ChunkPlan) -> None:
        pass

    def open(self, plan: ChunkPlan, pin: bool) -> SlowMemoryStore:
        chunks = [c for c in plan.chunks if c.home == SLOW]
        self.stores.append(SlowMemoryStore(chunks, plan.num_slots + 1, plan.bounce_nbytes, self.delay))
        return self.stores[-1]
