"""ChunkPipeline: the operations on one chunk (stage, step, commit, abort) that both step drivers share."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .dtensor import local
from .gate import StepGate
from .held import HeldWriteBacks
from .layout import Layout, Views, chunk_views
from .planner import Chunk, Home, Role
from .prefetch import Prefetcher
from .staging import Slot, SlotState, StagingPool, fit_slots
from .stepping import ChunkHooks, ChunkStepper
from .storage import Store
from .transaction import Pending
from .transfer import TransferEngine

__all__ = ["ChunkPipeline", "Pending"]

_NON_STATE = (Role.MASTER, Role.REMAINDER, Role.TIE_BITS, Role.SCRATCH)

Event = torch.cuda.Event | None


class ChunkPipeline:
    """The per-chunk operations of a step, over the staging slots and the copy streams.

    [Note: Chunk pipeline]
    A step driver (``StepSchedule``: chunks in parameter order, some deferred to the forward; ``BackwardSchedule``:
    chunks as the backward finishes their grads) calls, for one outer step:
    1. ``start``: the slots take their memory if any chunk is staged, and the H2D copies are ordered after the last
       step's write-back;
    2. per chunk: ``stage`` (the H2D of a chunk that has state, into its slot), ``step`` (the inner optimizer's step
       on it as a transaction: [Note: Chunk transactions]) and ``commit`` (its write-back is enqueued; from then on
       it is committed and readers of its params wait for it);
    3. ``finish``: fresh tensors and the slots' memory go back to the allocator, recorded on the D2H stream.
    On failure ``abort`` rolls the failing chunk back (or forward, if its write-back was being enqueued), lets the
    committed write-backs land and frees every slot. The waits between the streams are those of
    [Note: Two-slot staging] (staging.py), made in transfer.py.

    Args:
        engine: the copy streams.
        pool: the staging slots.
        gate: the stream the chunks step on, and the events readers of the params wait for.
    """

    def __init__(self, engine: TransferEngine, pool: StagingPool, gate: StepGate) -> None:
        self.engine = engine
        self.pool = pool
        self.gate = gate
        self.layout: Layout | None = None
        self.stepper: ChunkStepper | None = None
        self.ahead = Prefetcher(self)  # what ``opt.prefetch()`` staged for the next step
        self.held = HeldWriteBacks(engine, pool)  # [Note: Held write-back] in held.py
        self._swaps: dict[int, Slot] = {}  # chunk index -> the slot that swaps its spare in to stage it

    def bind(self, layout: Layout, stepper: ChunkStepper) -> None:
        """Step the chunks of a newly installed layout from now on."""
        self.layout, self.stepper = layout, stepper

    @property
    def lookahead(self) -> int:
        """How many chunks' H2D run ahead of the chunk being stepped."""
        return len(self.pool.slots) - 1

    def slot_for(self, position: int) -> Slot:
        return self.pool.slot_for(position)

    def grad_of(self, index: int) -> torch.Tensor | None:
        """The grad the inner optimizer reads for param ``index`` (the adapter's rule)."""
        layout, stepper = self._require()
        return stepper.adapter.grad_of(layout.infos[index].param)

    def grads(self, chunk: Chunk) -> list[tuple[int, torch.Tensor]]:
        """``(param index, grad)`` of the chunk's params that have one."""
        return [(i, g) for i in chunk.params if (g := self.grad_of(i)) is not None]

    def has_state(self, chunk: Chunk) -> bool:
        """Whether the chunk is staged (its state exists) rather than fresh (its first step creates it)."""
        if chunk.state_nbytes == 0:
            return True
        layout, stepper = self._require()
        state = stepper.inner.state
        for i in chunk.params:
            info = layout.infos[i]
            entry = state.get(info.param)
            if entry and any(key in entry for key in info.state_keys):
                return True
        return False

    def state_versions(self, chunks: Sequence[Chunk]) -> list[int]:
        """The version counters of the state tensors the inner holds for ``chunks``: a write into one bumps it."""
        layout, stepper = self._require()
        state = stepper.inner.state
        entries = [state.get(layout.infos[i].param, {}) for c in chunks for i in c.params]
        return [local(t)._version for entry in entries for t in entry.values() if isinstance(t, torch.Tensor)]

    def start(
        self, chunks: Sequence[Chunk], fresh: Sequence[bool], depth: int, *, in_order: bool = False
    ) -> dict[int, Event]:
        """Take the slots' memory when any chunk is staged, order this step's H2D after the last write-back, and
        start the H2D of the first ``depth`` chunks; returns their events by position. ``in_order``: the chunks
        stage in this order, position ``i`` in slot ``i % num_slots``: the slots fit them.

        Runs on the caller's stream: the slots' blocks come from its pool, so that forward and backward reuse them
        between steps ([Note: Slot memory between steps]).
        """
        layout = self._require()[0]
        self._swaps = {}
        if not all(fresh):
            fitted = None
            if in_order and not any(fresh) and not self.held.slots:  # [Note: Slots fit their chunks]
                slots = len(self.pool.slots)
                sizes = [c.device_nbytes for c in chunks]
                fitted, swaps = fit_slots(sizes, slots, slots * layout.plan.slot_nbytes)
                self._swaps = {chunks[p].index: self.pool.slots[k] for p, k in swaps.items()}
            self.pool.fitted = fitted
            self.pool.acquire(layout.plan.slot_nbytes)
        staged = [c for c, f in zip(chunks, fresh, strict=True) if not f]
        for store in layout.stores.values():  # a store behind the host reads the chunks staged first ahead
            store.begin_step(staged)
        self.held.active = True
        self.engine.begin_step()
        self.flush_write_back()  # after begin_step: only this chunk's own H2D waits for it (``stage``)
        return {
            pos: self.stage(chunks[pos], self.slot_for(pos)) for pos in range(min(depth, len(chunks))) if not fresh[pos]
        }

    def stage(self, chunk: Chunk, slot: Slot) -> Event:
        """The H2D of a chunk that has state (a D2D for resident chunks, nothing for one-op ones); see [Note: Two-slot
        staging]."""
        n = 0 if self.require_stepper().in_one_op(chunk) else chunk.transfer_nbytes  # [Note: One-op updates]
        if self._swaps.get(chunk.index) is slot and slot.state in (SlotState.FREE, SlotState.DRAINING):
            del self._swaps[chunk.index]
            self.pool.shrink(slot, self.engine.d2h_stream)  # [Note: Slots fit their chunks]
        buffer = self._buffer(slot)
        if chunk.index in self.held.landing:
            self.engine.h2d_after(
                self.held.landing[chunk.index]
            )  # its home is still being written by its held write-back
        source = self.store(chunk).source(chunk)  # a tier behind the host: a buffer of its own
        event = self.engine.stage_in(slot, [(buffer[:n], source[:n])] if n else [])
        slot.homes_copied = chunk.home == Home.DEVICE and n > 0
        return event

    def release_staged(self, slot: Slot, chunk: Chunk, event: Event) -> None:
        """``chunk`` was staged in ``slot`` but another takes the slot: its H2D queues behind the one it replaces.

        A new H2D on the same stream keeps the waits the slot already has, so the slot goes back to where it was
        before that H2D. A chunk whose store lands it apart gives its buffer back once that H2D has read it.
        """
        slot.advance((SlotState.LOADING,), SlotState.DRAINING)
        store = self.store(chunk)
        if store.lands_apart:
            if event is not None:
                event.synchronize()
            store.release(chunk)

    def step(self, chunk: Chunk, slot: Slot, fresh: bool, h2d_event: Event, hooks: ChunkHooks) -> Pending:
        """Step one chunk in ``slot``: a fresh one in memory of its own, a staged one after its H2D (started)."""
        infos = self.require_layout().infos
        self.gate.before_update({i: local(infos[i].param) for i in chunk.params})
        if fresh:
            return self.step_fresh(chunk, slot, hooks)
        return self.step_staged(chunk, slot, h2d_event, hooks)

    def commit(self, chunk: Chunk, pending: Pending, *, hold: bool = False) -> None:
        """Enqueue a stepped chunk's write-back: from here on it is committed, and its params count as updated.

        ``hold``: one of the last ``held.limit`` chunks of a step in the backward; a host chunk with state keeps its
        write-back in its slot until ``flush_write_back`` ([Note: Held write-back] in held.py).
        """
        pending.committing = True
        if pending.txn.failure is not None:
            raise pending.txn.failure  # rolled forward ([Note: One-op updates]): abort() enqueues the write-back
        if self.store(chunk).lands_apart:
            self._commit_landed(chunk, pending)
            return
        if hold and self.store(chunk).crosses_link and pending.pairs and not pending.retain:
            self.flush_write_back(keep=self.held.limit - 1)  # at most held.limit are held
            stepped = self.engine.step_done()
            self.gate.mark_ready(chunk.params, stepped)
            self.held.hold(chunk, pending, stepped)
            return
        self.gate.mark_ready(chunk.params, self.engine.write_back(pending.slot, pending.pairs, pending.retain))

    def _commit_landed(self, chunk: Chunk, pending: Pending) -> None:
        """The write-back of a chunk whose store lands it apart (in a buffer of its own) is committed once it has
        landed and the store has made it the chunk's state ([Note: Storage seam])."""
        layout = self.require_layout()
        try:
            stepped = self.engine.write_back(pending.slot, pending.pairs, pending.retain)
            if pending.slot.free_event is not None:
                pending.slot.free_event.synchronize()
            layout.commit(chunk, self.require_stepper().inner.state)
        except BaseException:
            pending.committing = False  # the store's old bytes are still the chunk's: abort() rolls it back
            raise
        self.gate.mark_ready(chunk.params, stepped)

    def flush_write_back(self, keep: int = 0) -> None:
        """Enqueue held write-backs, oldest first, until ``keep`` are left ([Note: Held write-back] in held.py)."""
        self.held.flush(keep)

    def finish(self) -> None:
        """The step is done: fresh tensors and the slots' memory go back once the D2H stream has read them (all but
        a slot that holds a write-back)."""
        self.engine.end_step(self.pool.slots)
        self.pool.release(self.engine.d2h_stream, keep=self.held.slots)
        self._end_store_steps()
        self.held.end_step()

    def _end_store_steps(self) -> None:
        """Every chunk is written or was not stepped: the stores' step buffers are free (their reads end first)."""
        if self.layout is not None:
            for store in self.layout.stores.values():
                store.end_step()

    def synchronize(self) -> None:
        """Block until every write-back, the held one too, has landed in the homes."""
        self.flush_write_back()
        self.engine.synchronize()

    def before_home_write(self) -> None:
        """The host is about to write into a home: every write-back lands first, and staged bytes go stale."""
        self.flush_write_back()
        self.engine.before_home_write()

    def drain(self) -> None:
        """Enqueue the held write-back, wait for every copy; the slots return to FREE (their memory stays)."""
        self.flush_write_back()
        self.engine.drain(self.pool.slots)
        self._end_store_steps()

    def drain_and_release(self) -> None:
        """Wait for every copy, then free the slots (after a failure, or when staged bytes are dropped)."""
        self.drain()
        self.pool.release(None)
        self.held.end_step()

    def abort(self, pending: Pending | None) -> bool:
        """Roll the failing chunk back (or forward: returns True), let committed write-backs land, free every slot."""
        self.gate.join()  # the rollback below runs on the caller's stream, after what the step stream enqueued
        forward = pending is not None and pending.committing
        if pending is not None:
            if forward:
                # Its write-back was being enqueued: the slot holds the committed bytes, so enqueue it in full.
                pending.slot.advance((SlotState.READY, SlotState.DRAINING), SlotState.READY)
                self.engine.write_back(pending.slot, pending.pairs, pending.retain)
            else:
                pending.txn.rollback()
        self.drain_and_release()
        return forward

    # ------------------------------------------------------------------ one chunk
    def _require(self) -> tuple[Layout, ChunkStepper]:
        if self.layout is None or self.stepper is None:
            raise RuntimeError("the chunk plan has not been built")
        return self.layout, self.stepper

    def require_layout(self) -> Layout:
        return self._require()[0]

    def require_stepper(self) -> ChunkStepper:
        return self._require()[1]

    def _buffer(self, slot: Slot) -> torch.Tensor:
        if slot.buffer is None:
            raise RuntimeError("the staging slots have no memory while a chunk is staged")
        return slot.buffer

    def store(self, chunk: Chunk) -> Store:
        """Where the chunk's moving bytes live between steps ([Note: Storage seam])."""
        return self.require_layout().store(chunk)

    def _home_region(self, chunk: Chunk, nbytes: int, offset: int = 0) -> torch.Tensor:
        """``nbytes`` of the chunk's moving bytes in its home, from chunk byte ``offset``."""
        return self.store(chunk).region(chunk.home_offset + offset, nbytes)

    def step_staged(self, chunk: Chunk, slot: Slot, h2d_event: Event, hooks: ChunkHooks) -> Pending:
        """Step a chunk that has state after its H2D.

        [Note: Resident chunks step in place]
        A resident chunk's state and masters step in their homes, device memory already. Its slot holds scratch
        and the copy of the homes that a rollback puts back ([Note: Chunk transactions]; none where the inner
        updates it in one op: [Note: One-op updates]); its commit copies nothing (the D2H stream records the slot's
        ``free_event`` after the step, for the next H2D into the slot).
        """
        layout, stepper = self._require()
        self.engine.wait_staged(slot, h2d_event)
        buffer = self._buffer(slot)
        n = chunk.transfer_nbytes
        if chunk.home == Home.DEVICE:
            views = chunk_views(chunk, layout.infos, buffer, roles=(Role.SCRATCH,))
            for i in chunk.params:
                views[i].update(layout.homes[i])
            home = self._home_region(chunk, n)
            if n and not slot.homes_copied and not stepper.in_one_op(chunk):
                buffer[:n].copy_(home)  # staged as one-op by a prefetch, before the groups changed
                slot.homes_copied = True
            restores = [(home, buffer[:n])] if slot.homes_copied else []
            _, txn = stepper.run(chunk, views, hooks, fresh=False, restores=restores, one_op=n > 0 and not restores)
            return Pending(slot, txn, [])
        _, txn = stepper.run(chunk, chunk_views(chunk, layout.infos, buffer), hooks, fresh=False)
        landing = self.store(chunk).landing(chunk)  # its homes, or a buffer of its store
        return Pending(slot, txn, [(landing[:n], buffer[:n])] if n else [])

    def step_fresh(self, chunk: Chunk, slot: Slot, hooks: ChunkHooks) -> Pending:
        """First step of a chunk: the inner optimizer creates its state on the device; D2H reads it directly."""
        layout, stepper = self._require()
        engine = self.engine
        engine.reclaim(slot)  # bound: at most num_slots chunks of fresh tensors exist at once
        wrapper_nbytes = chunk.region_nbytes[1]
        extra = wrapper_nbytes + chunk.region_nbytes[2]
        temp = torch.empty(extra, dtype=torch.uint8, device=self.pool.device) if extra else None
        store = self.store(chunk)
        if store.lands_apart:
            store.source(chunk)  # its first step reads and writes the store's buffer, as a later one does
        wrapper_home = store.in_landing(chunk, self._home_region(chunk, wrapper_nbytes, offset=chunk.state_nbytes))
        h2d = [(temp[:wrapper_nbytes], wrapper_home)] if temp is not None and wrapper_nbytes else []
        event = engine.stage_in(slot, h2d, fresh_memory=True)
        engine.wait_staged(slot, event)
        if temp is None:
            views: Views = {i: {} for i in chunk.params}
        else:
            views = chunk_views(chunk, layout.infos, temp, shift=chunk.state_nbytes, roles=_NON_STATE)
        fresh_pairs, txn = stepper.run(chunk, views, hooks, fresh=True)
        pairs = [(store.in_landing(chunk, h), t) for h, t in fresh_pairs]
        retain = [t for _, t in fresh_pairs]
        if temp is not None:
            if wrapper_nbytes:
                pairs.append((wrapper_home, temp[:wrapper_nbytes]))
            retain.append(temp)
        return Pending(slot, txn, pairs, retain)
