"""Pure chunk planning: parameter bundles and a byte budget in, a deterministic ChunkPlan out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .chunks import Chunk, ChunkPlan, Home
from .specs import ALIGNMENT, PAGE, Bundle, Role, TensorSpec, align, dense_spec

__all__ = [
    "ALIGNMENT",
    "MIN_AUTO_CHUNK_BYTES",
    "PAGE",
    "PIPELINE_DEPTH",
    "Bundle",
    "Chunk",
    "ChunkPlan",
    "Home",
    "Role",
    "TensorSpec",
    "align",
    "dense_spec",
    "plan_chunks",
]

# [Note: Pipeline depth]
# The first H2D and the last D2H of a step overlap nothing, so a step costs about one chunk more than its bytes
# over the duplex bandwidth. With few, large chunks that is a large share (8 GB of Adam state in 2 GB chunks:
# +20% on an H200). chunk_bytes is a budget, not a target: the planner packs to at most
# max(MIN_AUTO_CHUNK_BYTES, total / PIPELINE_DEPTH) so the pipeline stays at least PIPELINE_DEPTH chunks deep,
# never below MIN_AUTO_CHUNK_BYTES per chunk (small chunks pay per-chunk launch and event costs). The window bound
# is the plan's own (its largest chunk), not the requested budget's.
PIPELINE_DEPTH = 32
MIN_AUTO_CHUNK_BYTES = 64 * 2**20

# [Note: Resident chunk size]
# Resident chunks never cross the link, so the pipeline depth above does not apply to them, while every chunk costs
# the host a fixed amount per step (its copies in and out, its events, its inner-step call: about 0.7 ms on the
# H200). Packed by the offloaded chunks' budget, a fully resident plan (``gpu_budget_mb="auto"`` on a model that
# fits) got the 64 MiB minimum: one chunk per param, 130 chunks for a 1 B Llama, whose host time left the GPU idle
# in the backward. They are packed up to the largest bundle instead (at most ``chunk_bytes``): the slots hold that
# bundle already, so they do not grow; the step's workspace ([Note: Window bound]) can, by the state a larger chunk
# creates in its first step, and a budgeted plan counts it (1 B Llama: 18 chunks, the same window).

# A chunk's slot bytes are laid out region by region, so that the bytes that cross the link are one contiguous
# range [0, transfer_nbytes) and the per-role regions can be handled as blocks:
#   [ STATE tensors | MASTER / REMAINDER / TIE_BITS tensors | SCRATCH tensors ]
_REGION_OF = {Role.STATE: 0, Role.MASTER: 1, Role.REMAINDER: 1, Role.TIE_BITS: 1, Role.SCRATCH: 2}


def _layout_chunk(index: int, bundles: Sequence[Bundle], home: Home, home_offset: int) -> Chunk:
    sizes = [0, 0, 0]
    for b in bundles:
        for s in b.specs:
            sizes[_REGION_OF[s.role]] += s.padded_nbytes
    cursor = [0, sizes[0], sizes[0] + sizes[1]]
    offsets: dict[tuple[int, str], int] = {}
    for b in bundles:
        for s in b.specs:
            region = _REGION_OF[s.role]
            offsets[(b.index, s.key)] = cursor[region]
            cursor[region] += s.padded_nbytes
    return Chunk(index, tuple(b.index for b in bundles), home, home_offset, (sizes[0], sizes[1], sizes[2]), offsets)


def plan_chunks(
    bundles: Sequence[Bundle],
    *,
    chunk_bytes: int,
    num_slots: int = 2,
    offload_fraction: float = 1.0,
    resident_budget: int | None = None,
) -> ChunkPlan:
    """Pack whole bundles, in parameter order, into chunks of at most ``chunk_bytes`` slot bytes.

    Chunks may be smaller than ``chunk_bytes`` to keep the pipeline deep (see [Note: Pipeline depth]). The
    first ``offload_fraction`` of the bytes (whole bundles, in parameter order) is offloaded; the rest is packed
    the same way into resident chunks, whose home is a device buffer. With ``resident_budget`` instead, the longest
    run of bundles from the *first* parameter whose resident buffer fits the budget stays resident
    ([Note: What stays resident]). A bundle larger than ``chunk_bytes`` forms a chunk of its own. The result
    depends on the arguments alone, so every rank and every run gets the same plan.

    Args:
        bundles: one bundle per parameter, in ``param_groups`` order.
        chunk_bytes: the chunk budget in bytes (> 0).
        num_slots: staging slots (>= 1); only used for the published bound.
        offload_fraction: share of bundle bytes to offload, in [0, 1].
        resident_budget: bytes of device memory the resident chunks' moving bytes may take (>= 0); excludes
            ``offload_fraction < 1``.

    Returns:
        The plan.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
    if resident_budget is not None and (resident_budget < 0 or offload_fraction < 1.0):
        raise ValueError(
            f"resident_budget must be >= 0 and excludes offload_fraction < 1, got {resident_budget} and "
            f"{offload_fraction}"
        )
    indices = [b.index for b in bundles]
    if indices != sorted(indices) or len(set(indices)) != len(indices):
        raise ValueError(f"bundles must be in strictly increasing parameter order, got indices {indices}")

    if resident_budget is not None:
        return _plan_resident_prefix(bundles, chunk_bytes, num_slots, resident_budget)
    total = sum(b.packing_nbytes for b in bundles)
    n_offloaded = len(bundles)
    if offload_fraction < 1.0:
        budget, running, n_offloaded = offload_fraction * total, 0, 0
        for b in bundles:
            if running + b.packing_nbytes > budget:
                break
            running += b.packing_nbytes
            n_offloaded += 1
    return _plan_split(bundles[:n_offloaded], bundles[n_offloaded:], bundles, chunk_bytes, num_slots)


def _plan_split(
    offloaded: Sequence[Bundle], resident: Sequence[Bundle], bundles: Sequence[Bundle], chunk_bytes: int, num_slots: int
) -> ChunkPlan:
    """Pack the offloaded and the resident bundles (one of them a prefix of ``bundles``); index chunks in order."""
    offloaded_nbytes = sum(b.packing_nbytes for b in offloaded)
    budget_bytes = min(chunk_bytes, max(MIN_AUTO_CHUNK_BYTES, -(-offloaded_nbytes // PIPELINE_DEPTH)))
    largest = max((b.packing_nbytes for b in bundles), default=0)
    resident_bytes = max(budget_bytes, min(chunk_bytes, largest))  # [Note: Resident chunk size]
    resident_first = bool(resident) and (not offloaded or resident[0].index < offloaded[0].index)
    if resident_first:
        resident_chunks = _pack(resident, resident_bytes, Home.DEVICE, first_index=0)
        chunks = _pack(offloaded, budget_bytes, Home.HOST, first_index=len(resident_chunks))
    else:
        chunks = _pack(offloaded, budget_bytes, Home.HOST, first_index=0)
        resident_chunks = _pack(resident, resident_bytes, Home.DEVICE, first_index=len(chunks))
    return ChunkPlan(tuple(chunks), tuple(resident_chunks), tuple(bundles), chunk_bytes, num_slots)


def _plan_resident_prefix(
    bundles: Sequence[Bundle], chunk_bytes: int, num_slots: int, resident_budget: int
) -> ChunkPlan:
    """The plan whose resident chunks are the longest prefix of ``bundles`` that fits ``resident_budget``.

    [Note: What stays resident]
    Every resident byte spares the link the same time in a synchronous step, so the budget is filled as fully as
    whole bundles allow. Which bundles matters once the step overlaps the next forward (``overlap=True``): the
    forward reads the parameters in order, and the first ones are needed at once. Resident bundles step in device
    time, so keeping the first parameters resident lets the forward start while the offloaded ones stream in.
    """
    n_resident, running = 0, 0
    for b in bundles:
        running += align(b.host_nbytes)
        if running > resident_budget:
            break
        n_resident += 1
    while True:  # the count above ignores the page padding between chunks: shrink while the packed buffer is larger
        plan = _plan_split(bundles[n_resident:], bundles[:n_resident], bundles, chunk_bytes, num_slots)
        if plan.resident_nbytes <= resident_budget or n_resident == 0:
            return plan
        n_resident -= 1


def _pack(bundles: Sequence[Bundle], budget_bytes: int, home: Home, first_index: int) -> list[Chunk]:
    """Greedy packing of whole bundles, in order; each chunk's moving bytes follow the previous chunk's."""
    chunks: list[Chunk] = []
    current: list[Bundle] = []
    current_nbytes = 0
    home_offset = 0

    def close() -> None:
        nonlocal current, current_nbytes, home_offset
        chunk = _layout_chunk(first_index + len(chunks), current, home, home_offset)
        if chunk.transfer_nbytes:
            chunk = dataclasses.replace(chunk, home_offset=-(-home_offset // PAGE) * PAGE)
        chunks.append(chunk)
        home_offset = chunk.home_offset + chunk.transfer_nbytes
        current, current_nbytes = [], 0

    for b in bundles:
        if current and current_nbytes + b.packing_nbytes > budget_bytes:
            close()
        current.append(b)
        current_nbytes += b.packing_nbytes
    if current:
        close()
    return chunks
