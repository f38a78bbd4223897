"""What a failed step did: the note its exception carries, chunk by chunk of the plan."""

from __future__ import annotations

import logging

from .planner import Chunk

__all__ = ["add_note", "note_failure"]

logger = logging.getLogger(__name__)


def note_failure(
    exc: BaseException,
    chunk: Chunk | None,
    position: int,
    committed: int,
    total: int,
    with_grads: int | None = None,
) -> None:
    """Log and note on ``exc`` what a failed step did to every chunk of the plan.

    ``chunk`` failed as the ``position``-th chunk the step ran (None: before any), ``committed`` chunks are committed
    (it among them if it was rolled forward), ``total`` chunks are in the plan, ``with_grads`` of them had grads in
    this step (None where that is not known yet: a step in the backward).
    """
    if chunk is None:
        what = "the step in the backward" if with_grads is None else "step()"
        note = f"chunked_offload: {what} failed before any chunk was stepped; nothing was modified (of {total} chunks)"
    else:
        forward = committed > position
        fate = "was committed too (the failure came after its update)" if forward else "was rolled back"
        untouched = total - committed - (0 if forward else 1)
        where = f"chunk {chunk.index} (params {chunk.params[0]}..{chunk.params[-1]})"
        if with_grads is None:  # a step in the backward: which chunks get grads is not known yet
            note = (
                f"chunked_offload: the step in the backward failed in {where}, chunk {position + 1} of the {total} "
                f"of the plan: the {position} stepped before it were committed, it {fate}, and the other "
                f"{untouched} are untouched"
            )
        else:
            note = (
                f"chunked_offload: step() failed in {where}, chunk {position + 1} of the {with_grads} with grads: the "
                f"{position} before it were committed, it {fate}, and the {with_grads - position - 1} after it are "
                f"untouched. Of all {total} chunks of the plan, {committed} are committed, {0 if forward else 1} "
                f"rolled back and {untouched} untouched ({total - with_grads} had no grads in this step)"
            )
    logger.warning("%s (%s: %s)", note, type(exc).__name__, exc)
    add_note(exc, note)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11 and later)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
