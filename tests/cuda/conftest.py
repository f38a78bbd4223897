"""Fixtures of the cuda tier."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic kernels for a bitwise check on the GPU (with a control: the reference run twice)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when a handle is made
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
