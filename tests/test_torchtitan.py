"""torchtitan's own model, parallelize functions, optimizer container, LR schedule, loss and clip with the wrapper
(``chunked_offload.torchtitan.wrap_optimizers``), FSDP2 on 1 and 2 gloo ranks: each mode bitwise with torchtitan's
own loop, or (in-backward with torchtitan's clip) refused before any update."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3", reason="torchtitan (0.3) is not installed")

import titan_cases  # noqa: E402
from test_distributed import _spawn  # noqa: E402

BITWISE = [
    "sync/clip",
    "overlap/clip",
    "overlap/clip/compiled",  # torchtitan compiles each block in place
    "overlap/clip/masters",  # bf16 shards, fp32 masters
    "overlap/clip/masters/compiled",
    "backward",
    "backward/compiled",
]
REFUSED = ["backward/clip", "backward/clip/compiled"]


@pytest.mark.parametrize("world", [1, 2])
def test_torchtitan_loops_are_bitwise_or_refused(world: int) -> None:
    """The compiled variants run at world size 1 (compiling is most of this test's time); FSDP2 is the same there."""
    variants = [v for v in BITWISE + REFUSED if world == 1 or "compiled" not in v]
    result = _spawn(titan_cases.titan_parity, variants, world=world)
    for rank in range(world):
        outcomes = result[rank]
        for variant in (v for v in BITWISE if v in variants):
            assert outcomes[variant] == "bitwise", (variant, outcomes[variant])
        for variant in (v for v in REFUSED if v in variants):
            assert outcomes[variant].startswith("refused:") and "Nothing was updated" in outcomes[variant], variant
