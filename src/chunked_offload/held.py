"""HeldWriteBacks: the write-backs of the last chunks a backward steps, kept in their slots until the next step."""

from __future__ import annotations

import torch

from .planner import Chunk
from .staging import Slot, SlotState, StagingPool
from .transaction import Pending
from .transfer import TransferEngine

__all__ = ["HeldWriteBacks"]

Event = torch.cuda.Event | None


class HeldWriteBacks:
    """The write-backs a step in the backward holds, oldest first.

    [Note: Held write-back]
    The GPU's copy engine runs the device-to-host copies of every stream in the order they were enqueued (measured
    on the H200: a 4-byte ``.item()`` waits 14.4 ms behind a 768 MiB write-back, from any stream, in pieces or not).
    The write-backs of the chunks a backward steps last would be enqueued just before the next device-to-host read
    on the caller's stream (``step()``'s grad check, a check in HF's Llama forward, a logged loss), which would wait
    for them. So ``ChunkPipeline.commit(hold=True)`` keeps the write-backs of the last ``limit`` chunks of a step in the
    backward in their slots (two, where a slot is left to stage into; the embedding's last): their params are
    updated, the slots keep their memory through the forward (inside the window; the training's peak grows by a slot
    each), and the copies are enqueued when the next step starts, or as soon as anything reads or writes the host
    copies: ``synchronize()``, ``state_dict()``, ``opt.state``, a write into it, ``load_state_dict()``, ``offload()``,
    a re-plan (``flush_write_back``). The next step's H2D of such a chunk waits for its copy. Only host chunks with
    state are held. With one held, the caller's read waited 5 ms per iteration behind the write-back of the chunk
    before it (H100, in-backward at 16 x 2048, 1 GiB chunks, 3 slots: 98.2% of resident kept; with two, 98.7-99.0%).

    Args:
        engine: the copy streams (a flushed write-back is enqueued on the D2H stream).
        pool: the staging slots (a held write-back keeps its slot).
    """

    def __init__(self, engine: TransferEngine, pool: StagingPool) -> None:
        self.engine = engine
        self.pool = pool
        self._held: list[tuple[Chunk, Pending, Event]] = []  # event: its step's
        self.landing: dict[int, Event] = {}  # chunk index -> the event of its held write-back this step enqueued
        self.active = False  # between the pipeline's start() and finish(): the slots belong to a step

    @property
    def limit(self) -> int:
        """The write-backs a step may hold: two, and always a slot left to stage into."""
        return max(1, min(2, len(self.pool.slots) - 1))

    @property
    def slots(self) -> list[Slot]:
        """The slots of the held write-backs, oldest first."""
        return [pending.slot for _, pending, _ in self._held]

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks whose write-backs are held, oldest first."""
        return [chunk for chunk, _, _ in self._held]

    def hold(self, chunk: Chunk, pending: Pending, stepped: Event) -> None:
        """Keep ``chunk``'s write-back in its slot; ``stepped``: recorded after its step."""
        self._held.append((chunk, pending, stepped))

    def flush(self, keep: int = 0) -> None:
        """Enqueue held write-backs, oldest first, until ``keep`` are left (between steps their slots are freed)."""
        while len(self._held) > keep:
            chunk, pending, stepped = self._held[0]
            pending.slot.advance((SlotState.READY, SlotState.DRAINING), SlotState.READY)  # a retry after a failure
            self.engine.write_back(pending.slot, pending.pairs, after=stepped)
            del self._held[0]
            if self.active:
                self.landing[chunk.index] = pending.slot.free_event
            else:
                self.pool.release_slot(pending.slot, self.engine.d2h_stream)

    def end_step(self) -> None:
        """The step's slots are given back: no write-back of this step is landing any more."""
        self.active, self.landing = False, {}
