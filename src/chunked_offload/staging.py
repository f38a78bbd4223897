"""StagingPool: a fixed number of device slots that chunks pass through during ``step()``."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

import torch

__all__ = ["Slot", "SlotState", "StagingPool", "fit_order", "fit_slots"]

SHRINK = 0.75  # a slot takes a smaller spare where its chunks' size falls to this share of its first ones, or below


def free_storage(t: torch.Tensor) -> None:
    """Hand ``t``'s device memory back to the allocator now, whatever else still references it.

    Dropping the last reference is not enough: a view held elsewhere (the frames of a kept traceback) would keep the
    whole block alive. Emptying the storage frees it at once. The views are left with an empty storage: never use
    one again (only the wrapper's own step code and frames it left behind hold slot views). Streams recorded with
    ``record_stream`` still hold the block until their work is done.

    Device memory only: the CPU allocator hands out a non-null pointer for zero bytes, so a view of an emptied CPU
    storage would read out of bounds instead of failing. On the CPU the references are dropped as before.
    """
    if t.device.type != "cpu":
        t.untyped_storage().resize_(0)


def hand_back(buffer: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """Give ``buffer``'s memory back to the allocator, which reuses it once ``stream``'s work so far is done.

    Without ``record_stream`` the allocator could give the block to the next forward while the D2H stream still reads
    the last chunk from it.
    """
    if stream is not None:
        buffer.record_stream(stream)
    free_storage(buffer)


class SlotState(enum.Enum):
    """Host-side lifecycle of a slot, in enqueue order (the device catches up through events)."""

    FREE = "free"  # holds nothing; its free_event (if any) marks the end of the last D2H that read it
    LOADING = "loading"  # the H2D of a chunk is enqueued
    READY = "ready"  # the chunk's step is enqueued on the compute stream
    DRAINING = "draining"  # the D2H of the chunk is enqueued; the slot is FREE once free_event completes


class Slot:
    """One staging slot: a flat device buffer plus the event that says when it may be overwritten.

    Attributes:
        index: slot number.
        buffer: flat uint8 device memory during a step that stages chunks; None between steps (see
            [Note: Slot memory between steps]), but for a slot that holds a write-back.
        state: lifecycle state.
        free_event: recorded on the D2H stream after the slot's last read; None before first use or on CPU.
        read_marks: ``(end, event)`` pairs of the last write-back, in order: once ``event`` completes, the D2H has
            read every slot byte below ``end``, so an H2D may overwrite them (see [Note: Piecewise copies]).
        retained: device tensors (freshly created state) that an in-flight D2H still reads.
        homes_copied: the staged chunk is resident and the slot holds a copy of its homes, for its rollback.
        spare: smaller memory the slot swaps in once its larger chunks are done ([Note: Slots fit their chunks]).
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffer: torch.Tensor | None = None
        self.state = SlotState.FREE
        self.free_event: torch.cuda.Event | None = None
        self.read_marks: list[tuple[int, torch.cuda.Event]] = []
        self.retained: list[torch.Tensor] = []
        # Set when the buffer is (re)allocated on the compute stream: the next H2D must first wait for that stream.
        self.needs_fence = False
        self.homes_copied = False
        self.spare: torch.Tensor | None = None

    def advance(self, expected: tuple[SlotState, ...], to: SlotState) -> None:
        """Move to ``to``, asserting the slot is in one of ``expected`` states."""
        if self.state not in expected:
            names = ", ".join(s.value for s in expected)
            raise RuntimeError(f"staging slot {self.index} is {self.state.value}; expected one of: {names}")
        self.state = to

    def reset(self) -> None:
        """Back to FREE from any state: every copy that touched the slot has been waited for, or never ran."""
        self.advance(tuple(SlotState), SlotState.FREE)
        self.homes_copied = False


class StagingPool:
    """``num_slots`` device slots whose memory is taken for each step and handed back after it.

    [Note: Two-slot staging]
    Chunk ``i`` uses slot ``i % num_slots``. The H2D of chunk ``i`` waits on the slot's ``free_event`` (the D2H of
    chunk ``i - num_slots``), the step of chunk ``i`` waits on its H2D, and the D2H of chunk ``i`` waits on the step.
    With two slots the link carries the H2D of chunk ``i + 1`` and the D2H of chunk ``i - 1`` while chunk ``i``
    steps, and no more than two chunks are ever on the device: the GPU window is
    ``num_slots * max(chunk, largest bundle)``. The first step has no state to bring in, so its chunks run
    "fresh": the inner optimizer creates the state on the device, the D2H reads those tensors directly, and the
    slot only bounds how many chunks are in flight (their tensors sit in ``retained``).

    [Note: Slot memory between steps]
    The slots take their memory from torch's caching allocator at the start of every step that stages a chunk and
    hand it back at the end (``record_stream`` on the D2H stream, then the buffers' storage is emptied), so forward and
    backward can use it between steps. In steady state the allocator hands out cached blocks: no ``cudaMalloc``.
    One exception: after a step in the backward, the slot of the last chunk keeps its memory until its write-back
    is enqueued, and the next step reuses it as it is ([Note: Held write-back] in held.py).
    Views of a slot live for one step only: the release empties the buffers' storage (``free_storage``), so a view
    still held after the step (by a kept traceback's frames) does not pin the block. Freshly taken memory may still
    be in use by work queued on the compute stream before it was freed, so the first H2D into it waits for that
    stream (``needs_fence``).

    [Note: Slots fit their chunks]
    A step whose chunks all have state and run in an order known at its start (``StepSchedule``, no held
    write-back) gives slot ``k`` the bytes of the largest chunk it will hold (positions ``k``, ``k + num_slots``, ...),
    not the plan's largest. Where that size falls to ``SHRINK`` of it or below after the slot's first chunks (a param
    larger than the chunk size, such as Megatron's embedding, stepped first), the slot also takes a spare of the
    smaller size, when both fit in ``num_slots * slot_nbytes``. The stage of the first smaller chunk swaps the spare
    in (``shrink``): the larger memory goes back to the allocator, recorded on the D2H stream after the write-back
    that last read it. The spare was taken with the slots, on the caller's stream, before the step stream waited for
    it, so its first H2D needs only the fence of fresh memory. The slots stay within the window, and the step's last
    chunks hold memory of their own size: with ``overlap=True`` that is what the next forward shares the GPU with.
    So an overlapped step puts its chunks larger than the rest in one slot, early (``fit_order``): Megatron's
    GPTModel has two, the embedding read first and the output layer read last, and in read order each kept a slot
    large, one of them to the step's end (measured: 2.2 GiB of slots beside the next forward on an H100).

    Args:
        num_slots: number of slots (>= 1).
        device: the device the slots live on.
    """

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.slots = [Slot(i) for i in range(num_slots)]
        self.device = device
        self.fitted: Sequence[tuple[int, int]] | None = None  # the next acquire's sizes, from fit_slots

    @property
    def allocated(self) -> bool:
        """Whether the slots hold device memory now."""
        return any(s.buffer is not None or s.spare is not None for s in self.slots)

    def slot_for(self, position: int) -> Slot:
        """The slot used by the ``position``-th chunk of a step."""
        return self.slots[position % len(self.slots)]

    def acquire(self, slot_nbytes: int) -> None:
        """Give every slot ``slot_nbytes`` bytes of device memory, or, where ``fitted`` is set (for this acquire
        only), slot ``k`` ``fitted[k]``: its bytes and its spare's ([Note: Slots fit their chunks]). On an allocation
        failure release what it took.

        A slot that still has memory of that size keeps it, with its events: it holds a write-back from the last
        step ([Note: Held write-back] in held.py).
        """
        fitted, self.fitted = self.fitted, None
        taken = []
        try:
            for k, slot in enumerate(self.slots):
                nbytes, spare = fitted[k] if fitted is not None else (slot_nbytes, 0)
                if slot.buffer is not None and slot.buffer.numel() == nbytes and not spare:
                    continue
                taken.append(slot)
                slot.buffer = slot.spare = None
                slot.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                if spare:
                    slot.spare = torch.empty(spare, dtype=torch.uint8, device=self.device)
                slot.needs_fence = True
                slot.free_event = None
                slot.read_marks = []
        except BaseException:
            for slot in taken:
                self.release_slot(slot, None)
            raise

    def shrink(self, slot: Slot, stream: torch.cuda.Stream | None) -> None:
        """Swap the slot's spare in ([Note: Slots fit their chunks]): its larger memory goes back to the allocator,
        which reuses it once ``stream``'s work so far is done (there the write-back that last read it is enqueued).
        The slot is FREE or DRAINING: no chunk is staged in it."""
        spare, slot.spare = slot.spare, None
        if spare is None or slot.buffer is None:
            return
        hand_back(slot.buffer, stream)
        slot.buffer = spare
        slot.needs_fence = True  # taken before the step stream waited for the caller's: that wait covers it
        slot.free_event = None  # no write-back has read it
        slot.read_marks = []

    @property
    def nbytes(self) -> int:
        """Device memory the slots hold now, their spares included."""
        return sum(t.numel() for s in self.slots for t in (s.buffer, s.spare) if t is not None)

    def release(self, stream: torch.cuda.Stream | None, keep: Sequence[Slot] = ()) -> None:
        """Hand the slots' memory back to the allocator, which reuses it once ``stream``'s work so far is done.

        Every slot but those in ``keep`` returns to FREE. The caller has ordered ``stream`` after every copy that
        touches the slots.
        """
        for slot in self.slots:
            if not any(slot is k for k in keep):
                self.release_slot(slot, stream)

    def release_slot(self, slot: Slot, stream: torch.cuda.Stream | None) -> None:
        """Hand one slot's memory back (see ``release``)."""
        if slot.buffer is not None:
            hand_back(slot.buffer, stream)
        if slot.spare is not None:
            free_storage(slot.spare)  # never used: no stream read it
        slot.buffer = slot.spare = None
        slot.retained.clear()
        slot.free_event = None
        slot.read_marks = []
        slot.reset()


def fit_slots(nbytes: Sequence[int], num_slots: int, window: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """For the chunks of a step, their slot bytes in step order: each slot's ``(bytes, spare bytes)`` and, by
    position, the slot that swaps its spare in before staging that chunk ([Note: Slots fit their chunks]). No spares
    where they would not fit in ``window`` beside the slots."""
    fitted: list[tuple[int, int]] = []
    swaps: dict[int, int] = {}
    for k in range(num_slots):
        positions = range(k, len(nbytes), num_slots)
        largest_from = list(itertools.accumulate((nbytes[p] for p in reversed(positions)), max))[::-1]
        size = largest_from[0] if largest_from else 0
        later = next((j for j in range(1, len(largest_from)) if largest_from[j] <= SHRINK * size), None)
        if later is None:
            fitted.append((size, 0))
        else:
            fitted.append((size, largest_from[later]))
            swaps[positions[later]] = k
    if sum(a + b for a, b in fitted) > window:
        return [(a, 0) for a, _ in fitted], {}
    return fitted, swaps


def fit_order(nbytes: Sequence[int], num_slots: int, window: int, start: int = 0) -> list[int]:
    """The positions of a step's chunks, in an order whose slots fit them better ([Note: Slots fit their chunks]).

    Of the chunks from ``start`` on, those larger than ``SHRINK`` of the largest (Megatron's embedding and output
    layer) take the first one's position and the next ones of its slot; the others keep their order in the rest.
    So one slot holds all of them, and swaps in a spare after the last; a larger chunk left at the end in another
    slot would keep that slot large beside the next forward. The order is kept where that gives no spare.
    """
    keep = list(range(len(nbytes)))
    largest = max(nbytes[start:], default=0)
    big = [p for p in keep[start:] if nbytes[p] > SHRINK * largest]
    targets = range(big[0], big[0] + len(big) * num_slots, num_slots) if big else range(0)
    if len(big) < 2 or targets[-1] >= len(nbytes):
        return keep
    rest = iter(p for p in keep[start:] if nbytes[p] <= SHRINK * largest)
    placed = dict(zip(targets, big, strict=True))
    order = keep[:start] + [placed[q] if q in placed else next(rest) for q in keep[start:]]
    swaps = fit_slots([nbytes[p] for p in order], num_slots, window)[1]
    return order if any(q > targets[-1] and k == big[0] % num_slots for q, k in swaps.items()) else keep
