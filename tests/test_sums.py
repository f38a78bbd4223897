"""sums.py: the CRC-32 of a buffer summed in pieces on several threads is zlib's CRC-32 of the whole."""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from chunked_offload import sums


@pytest.mark.parametrize(("first", "second"), [(b"", b""), (b"abc", b""), (b"", b"xyz"), (b"hello", b" world")])
def test_joined_sums_are_the_sum_of_the_joined_bytes(first: bytes, second: bytes) -> None:
    joined = sums.crc32_join(zlib.crc32(first), zlib.crc32(second), len(second))
    assert joined == zlib.crc32(first + second)


@pytest.mark.parametrize("seed", range(4))
def test_bytes_summed_in_pieces_of_any_size_give_the_crc_of_the_whole(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sums, "SUM_PIECE", 4096)  # many pieces from a small buffer
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (50_000,), dtype=torch.uint8, generator=g)
    cuts = sorted(torch.randint(0, data.numel() + 1, (6,), generator=g).tolist())
    with ThreadPoolExecutor(4) as pool:
        pieces = sums.PieceSums(pool)
        for start, end in zip([0, *cuts], [*cuts, data.numel()], strict=True):
            pieces.add(data[start:end])  # some empty
        assert pieces.result() == zlib.crc32(data.numpy().tobytes())


def test_pieces_are_summed_on_several_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four pieces on four threads: each sum waits until all four have started (a chain of sums would never)."""
    monkeypatch.setattr(sums, "SUM_PIECE", 1024)
    started = threading.Barrier(4, timeout=10)
    real = sums.checksum

    def meeting(data: torch.Tensor) -> int:
        started.wait()
        return real(data)

    monkeypatch.setattr(sums, "checksum", meeting)
    data = torch.arange(4096).to(torch.uint8)
    with ThreadPoolExecutor(4) as pool:
        pieces = sums.PieceSums(pool)
        pieces.add(data)
        assert pieces.result() == zlib.crc32(data.numpy().tobytes())


def test_a_failed_sum_fails_the_result_and_settle_leaves_no_sum_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sums, "SUM_PIECE", 1024)
    running = [0]
    real = sums.checksum

    def slow_or_failing(data: torch.Tensor) -> int:
        if data.numel() == 1:
            raise OSError("injected")
        running[0] += 1
        time.sleep(0.05)
        running[0] -= 1
        return real(data)

    monkeypatch.setattr(sums, "checksum", slow_or_failing)
    with ThreadPoolExecutor(2) as pool:
        pieces = sums.PieceSums(pool)
        pieces.add(torch.zeros(1, dtype=torch.uint8))
        pieces.add(torch.zeros(8 * 1024, dtype=torch.uint8))
        with pytest.raises(OSError, match="injected"):
            pieces.result()
        pieces.settle()  # the next pieces' sums (50 ms each) were under way
        assert running[0] == 0
