"""Test tiers: tests marked `cuda` run only where a CUDA device is present; `make test-fast` leaves out `slow`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from reference import UNDER_SANITIZER

# Every test on the CPU runs the fast modes' step stream emulated: a chunk's update of its params shows only once a
# reader waits for it, so a missing wait fails a bitwise comparison ([Note: Emulated step stream]). Spawned ranks
# inherit it. A test that compares with and without sets or clears it itself.
os.environ.setdefault("CHUNKED_OFFLOAD_EMULATE_STREAMS", "1")

# Modules whose tests spawn processes, compile, build packages, train real models or inject faults exhaustively.
SLOW_MODULES = {
    "test_compile", "test_distributed", "test_docs", "test_examples", "test_faults", "test_frameworks", "test_layering",
    "test_loops_property", "test_optim_db", "test_packaging", "test_soak", "test_torchtitan",
}  # fmt: skip


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m "not slow"`` the slow modules are not even imported (their imports cost seconds per worker)."""
    if config.option.markexpr == "not slow" and collection_path.stem in SLOW_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    if UNDER_SANITIZER:
        timing = pytest.mark.skip(reason="measures races, time or memory, which compute-sanitizer changes")
        for item in items:
            if "timing" in item.keywords:
                item.add_marker(timing)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
