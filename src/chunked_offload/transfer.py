"""TransferEngine: H2D and D2H streams, and the events that order them against the compute stream."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.profiler import record_function

from .staging import Slot, SlotState
from .streams import StreamContext

__all__ = ["PIECE_BYTES", "MoveHandle", "TransferEngine"]

# [Note: Piecewise copies]
# With two slots, the H2D of chunk i+1 reuses the slot that chunk i-1 is draining from. If it waited for the whole
# D2H of chunk i-1 (which itself waits for chunk i-1's step), every chunk would cost one transfer plus half a step
# on the link: the link idles while steps run. So copies of a slot's bytes go in pieces of about PIECE_BYTES, the
# D2H records an event after each piece, and each H2D piece waits only for the D2H piece that read the same bytes.
# The step then hides under the link, at no extra memory. 32 MiB copies still run at full link speed.
PIECE_BYTES = 32 * 2**20


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    count = max(1, -(-nbytes // PIECE_BYTES))
    bounds = [nbytes * k // count for k in range(count + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(count) if bounds[k + 1] > bounds[k]]


def _slot_offset(slot: Slot, t: torch.Tensor) -> int | None:
    """Byte offset of ``t`` in the slot's buffer, or None when ``t`` lives elsewhere (a fresh chunk's memory)."""
    if slot.buffer is None:
        return None
    offset = t.data_ptr() - slot.buffer.data_ptr()
    return offset if 0 <= offset < slot.buffer.numel() else None


class MoveHandle:
    """What ``offload()`` and ``reload()`` return: ``wait()`` blocks until the copy has landed.

    Args:
        event: completes when the copy has landed; None when it already has (CPU, or nothing to move).
        keep: host tensors the copy reads or writes, kept alive until it has landed.
    """

    def __init__(self, event: torch.cuda.Event | None = None, keep: Sequence[torch.Tensor] = ()) -> None:
        self._event = event
        self._keep = list(keep)

    def done(self) -> bool:
        """Whether the copy has landed (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> MoveHandle:
        """Block until the copy has landed; returns the handle."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._keep.clear()
        return self

    def __repr__(self) -> str:
        return f"MoveHandle(done={self.done()})"


class TransferEngine:
    """Moves chunk bytes between the host arena and staging slots, on two side streams.

    The ordering rules are those of ``[Note: Two-slot staging]`` in staging.py. On a device without streams (the
    CPU) every copy is synchronous and every event is None, so the same calls run the same logic.

    Args:
        streams: the wrapper's streams ([Note: Streams] in streams.py).
    """

    def __init__(self, streams: StreamContext) -> None:
        self.streams = streams
        self.device = streams.device
        self.uses_streams = streams.uses_streams
        self.h2d_stream = streams.h2d
        self.d2h_stream = streams.d2h
        # The last D2H enqueued: every host view is current once it completes (the D2H stream is in order).
        self.last_d2h_event: torch.cuda.Event | None = None
        # Bumped whenever the homes may have been written or the slots reset: bytes staged before it are stale.
        self.home_version = 0

    def _record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def before_home_write(self) -> None:
        """Called before the host writes into a home: in-flight write-backs land, and staged copies go stale."""
        self.synchronize()
        self.home_version += 1

    def begin_step(self) -> None:
        """Order this step's H2D copies after the previous step's write-back of the same host bytes."""
        if self.h2d_stream is not None and self.last_d2h_event is not None:
            # Without this wait an H2D could read a host region that last step's D2H is still writing.
            self.h2d_stream.wait_event(self.last_d2h_event)

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> MoveHandle:
        """Copy ``src`` into ``dst`` (one on the host, one on the device) on a copy stream; return its handle.

        The copy runs after what the caller's stream has enqueued (which allocated ``dst`` or wrote ``src``), and
        after the last write-back into host memory. The caller's stream and later steps are ordered after a copy
        to the device; host readers wait for a copy to the host through :meth:`synchronize`. Device memory that is
        dropped afterwards is reused only once the copy has read it (``record_stream``).
        """
        if not self.uses_streams or self.d2h_stream is None or self.h2d_stream is None:
            dst.copy_(src)
            return MoveHandle()
        to_host = dst.device.type == "cpu"
        stream = self.d2h_stream if to_host else self.h2d_stream
        compute = torch.cuda.current_stream(self.device)
        # Without this wait the copy could read bytes the caller's stream is still writing (or write a block the
        # allocator just recycled from its work).
        stream.wait_stream(compute)
        if not to_host:
            self.begin_step()  # an H2D reads host bytes the last write-back may still be writing (a D2H is in order)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.device.type == "cuda":
                # Without record_stream the allocator could hand this block out while the copy still uses it.
                t.record_stream(stream)
        event = self._record(stream)
        if to_host:
            self.last_d2h_event = event  # the D2H stream is in order: readers of the host copies wait on this
        else:
            # Without this wait the caller's stream could read the device copy before it has landed.
            compute.wait_event(event)
        return MoveHandle(event, [t for t in (dst, src) if t.device.type == "cpu"])  # device memory: record_stream

    def reclaim(self, slot: Slot) -> None:
        """Drop the fresh tensors a slot retained, once the compute stream is ordered after their D2H."""
        if not slot.retained:
            return
        if self.uses_streams and slot.free_event is not None:
            # Without this wait the allocator could hand these blocks to the next step while the D2H reads them.
            torch.cuda.current_stream(self.device).wait_event(slot.free_event)
        slot.retained.clear()

    def stage_in(
        self, slot: Slot, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, fresh_memory: bool = False
    ) -> torch.cuda.Event | None:
        """Copy each ``(device, host)`` pair host -> device; return the event the step must wait on.

        Args:
            slot: the slot the chunk will run in.
            pairs: destination device tensors and source host views.
            fresh_memory: the destinations were just allocated on the compute stream (a fresh chunk's scratch).
        """
        slot.advance((SlotState.FREE, SlotState.DRAINING), SlotState.LOADING)
        if not pairs:
            return None
        with record_function("chunked_offload::h2d"):
            if not self.uses_streams or self.h2d_stream is None:
                for dev, host in pairs:
                    dev.copy_(host)
                return None
            compute = torch.cuda.current_stream(self.device)  # read before entering the H2D stream's context
            with torch.cuda.stream(self.h2d_stream):
                if fresh_memory or slot.needs_fence:
                    # Without this wait the H2D could write a block that the allocator just recycled from
                    # compute-stream work (or a D2H the compute stream waited for) that has not finished yet.
                    self.h2d_stream.wait_stream(compute)
                    slot.needs_fence = False
                marks = list(slot.read_marks)
                for dev, host in pairs:
                    base = _slot_offset(slot, dev)
                    if base is None:  # a fresh chunk's own memory: ordered by fresh_memory above
                        dev.copy_(host, non_blocking=True)
                        continue
                    # A copy on the device (a resident chunk's homes) goes whole: its pieces would cost host time only.
                    for lo, hi in _pieces(dev.numel()) if host.device.type == "cpu" else [(0, dev.numel())]:
                        while marks and marks[0][0] < base + hi:
                            marks.pop(0)  # a later mark covers these bytes
                        if marks:
                            # Without this wait the H2D overwrites bytes the previous chunk's D2H has not read yet.
                            self.h2d_stream.wait_event(marks[0][1])
                        elif slot.free_event is not None:
                            # Without this wait the H2D overwrites the slot while the previous D2H still reads it.
                            self.h2d_stream.wait_event(slot.free_event)
                        # non_blocking: the source is page-locked, so this is an async DMA beside the compute stream.
                        dev[lo:hi].copy_(host[lo:hi], non_blocking=True)
                return self._record(self.h2d_stream)

    def wait_staged(self, slot: Slot, h2d_event: torch.cuda.Event | None) -> None:
        """Order the compute stream after the slot's H2D."""
        slot.advance((SlotState.LOADING,), SlotState.READY)
        self.reclaim(slot)
        compute = torch.cuda.current_stream(self.device) if self.uses_streams else None
        if compute is not None and slot.free_event is not None:
            # Without this wait the step's scratch writes (past its own H2D bytes) could land on slot bytes that
            # the previous chunk's D2H has not read yet, when that chunk moved more bytes than this one.
            compute.wait_event(slot.free_event)
        if compute is not None and h2d_event is not None:
            # Without this wait the step reads the slot before its bytes have arrived.
            compute.wait_event(h2d_event)

    def write_back(
        self,
        slot: Slot,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        retain: Sequence[torch.Tensor] = (),
        after: torch.cuda.Event | None = None,
    ) -> torch.cuda.Event | None:
        """After the step, copy each ``(host, device)`` pair device -> host on the D2H stream.

        Args:
            slot: the slot the chunk ran in; its ``free_event`` is re-recorded.
            pairs: destination host views and source device tensors.
            retain: device tensors to keep alive until the D2H has read them (fresh state).
            after: the event of the chunk's step, when it was recorded earlier (a held write-back); by default the
                copy waits for what the current stream has enqueued so far.

        Returns:
            The event that completes when the chunk's step has run on the compute stream (None on the CPU).
        """
        slot.advance((SlotState.READY,), SlotState.DRAINING)
        with record_function("chunked_offload::d2h"):
            if not self.uses_streams or self.d2h_stream is None:
                for host, dev in pairs:
                    host.copy_(dev)
                return None
            step_done = after if after is not None else self._record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                # Without this wait the D2H copies the slot before the step's kernels have updated it.
                self.d2h_stream.wait_event(step_done)
                marks: list[tuple[int, torch.cuda.Event]] = []
                for host, dev in pairs:
                    base = _slot_offset(slot, dev)
                    if base is None:  # fresh state tensors: kept alive through `retain`
                        # non_blocking: the destination is page-locked; readers wait on free_event / last_d2h_event.
                        host.copy_(dev, non_blocking=True)
                        continue
                    for lo, hi in _pieces(dev.numel()):
                        host[lo:hi].copy_(dev[lo:hi], non_blocking=True)
                        marks.append((base + hi, self._record(self.d2h_stream)))
                slot.read_marks = sorted(marks, key=lambda m: m[0])
                slot.free_event = self._record(self.d2h_stream)
            self.last_d2h_event = slot.free_event
            slot.retained.extend(retain)
            return step_done

    def step_done(self) -> torch.cuda.Event | None:
        """An event after what the compute stream has enqueued so far (a chunk's step); None on the CPU."""
        return self._record(torch.cuda.current_stream(self.device)) if self.uses_streams else None

    def h2d_after(self, event: torch.cuda.Event | None) -> None:
        """Order the H2D copies enqueued from now on after ``event``."""
        if self.h2d_stream is not None and event is not None:
            self.h2d_stream.wait_event(event)

    def end_step(self, slots: Sequence[Slot]) -> None:
        """Hand still-retained fresh tensors to the allocator without waiting for their D2H."""
        for slot in slots:
            if self.d2h_stream is not None:
                for t in slot.retained:
                    # Without record_stream the allocator could give this block to the next forward while the
                    # D2H stream still reads it.
                    t.record_stream(self.d2h_stream)
            slot.retained.clear()

    def synchronize(self) -> None:
        """Block the host until every enqueued D2H has landed in the host arena."""
        if self.last_d2h_event is not None:
            # Without this the host could read (or a caller could save) host views a D2H is still writing.
            self.last_d2h_event.synchronize()
            self.last_d2h_event = None

    def drain(self, slots: Sequence[Slot]) -> None:
        """Wait for every transfer and return every slot to FREE (used before releasing memory)."""
        for stream in (self.h2d_stream, self.d2h_stream):
            if stream is not None:
                # Without this the slots could be freed while a copy on a side stream still uses them.
                stream.synchronize()
        self.last_d2h_event = None
        self.home_version += 1
        for slot in slots:
            slot.retained.clear()
            slot.reset()
