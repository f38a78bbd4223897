"""Test tiers: tests marked `cuda` run only where a CUDA device is present."""

from __future__ import annotations

import pytest
import torch

from reference import UNDER_SANITIZER


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
