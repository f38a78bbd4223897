"""CRC-32s of large buffers, summed in pieces on several threads at once and joined into the CRC-32 of the whole
(the sums of a store behind the host: [Note: Chunk integrity] in bounced.py)."""

from __future__ import annotations

import functools
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

__all__ = ["SUM_PIECE", "SUM_THREADS", "PieceSums", "checksum", "crc32_join"]

SUM_PIECE = 8 * 2**20  # the bytes one thread sums at a time: the last piece of a read is what a reader waits for
SUM_THREADS = 4  # the threads a store sums on, beside its I/O

_POLY = 0xEDB88320  # the CRC-32 polynomial without its x^32 term, in zlib's reflected bit order (bit 31 is x^0)


def checksum(data: torch.Tensor) -> int:
    """CRC-32 of the bytes of the uint8 CPU tensor ``data`` (zlib lets other threads run meanwhile)."""
    return zlib.crc32(memoryview(data.numpy()).cast("B")) if data.numel() else 0  # type: ignore[arg-type]


def _times(a: int, b: int) -> int:
    """a(x) b(x) modulo the polynomial, both in the reflected bit order."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1  # b(x) x: x^31 turns into x^32, which the polynomial reduces
    return product


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial: what ``nbytes`` more bytes multiply the sum of the bytes before them by."""
    result, power = 1 << 31, 1 << 23  # x^0, and x^8 (one byte)
    while nbytes:
        if nbytes & 1:
            result = _times(result, power)
        power, nbytes = _times(power, power), nbytes >> 1
    return result


def crc32_join(first: int, second: int, second_nbytes: int) -> int:
    """The CRC-32 of two byte strings one after the other, from the CRC-32 of each and the second's length."""
    return _times(_shift(second_nbytes), first) ^ second


class PieceSums:
    """The CRC-32 of bytes that come in order, each piece summed on ``pool`` as it comes, the pieces at once, then
    joined: ``zlib.crc32`` of the whole, from several threads.

    Args:
        pool: the threads that sum.
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._pieces: list[tuple[Future[int], int]] = []

    def add(self, data: torch.Tensor) -> None:
        """Sum the next bytes, ``data`` (uint8, CPU), in pieces of at most SUM_PIECE. They must not change until
        :meth:`result` or :meth:`settle` returns."""
        for start in range(0, data.numel(), SUM_PIECE):
            piece = data[start : start + SUM_PIECE]
            self._pieces.append((self._pool.submit(checksum, piece), piece.numel()))

    def result(self) -> int:
        """The CRC-32 of every byte added, in order: waits for the pieces' sums (a sum that failed raises)."""
        crc = 0
        for future, nbytes in self._pieces:
            crc = crc32_join(crc, future.result(), nbytes)
        return crc

    def settle(self) -> None:
        """Drop the sums not yet started and wait for the rest (the bytes may then change): after a failure."""
        for future, _ in self._pieces:
            future.cancel()
        wait([f for f, _ in self._pieces])
