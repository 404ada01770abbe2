"""Holes: where a sparse file holds data, and the CRC-32 of a run of zero bytes.

``k3 pack-trunk`` copies only the data extents of a layer's run (``SEEK_DATA`` /
``SEEK_HOLE``), so a sparse checkpoint packs into a sparse ``trunk.bin``; the checksum is
still of every raw byte: :func:`crc32_zeros` extends a CRC-32 over ``n`` zero bytes in
O(log n) without touching them (the zero-byte operator of zlib's ``crc32_combine``, its
powers of two built once). On a filesystem or platform without ``SEEK_DATA`` the whole
range is data and the copy is the dense one.
"""

from __future__ import annotations

import errno
import os
from functools import cache
from pathlib import Path

_POLY = 0xEDB88320


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


@cache
def _zero_bytes_ops() -> tuple[tuple[int, ...], ...]:
    """The register operators for 2**k zero bytes, k = 0..63."""
    op: tuple[int, ...] = (_POLY, *(1 << i for i in range(31)))  # one zero bit
    for _ in range(3):
        op = _square(op)  # 8 bits: one byte
    ops = [op]
    for _ in range(63):
        ops.append(_square(ops[-1]))
    return tuple(ops)


def crc32_zeros(crc: int, n: int) -> int:
    """``zlib.crc32(bytes(n), crc)`` without the bytes."""
    if n < 0:
        raise ValueError("n must not be negative")
    reg = crc ^ 0xFFFFFFFF
    ops = _zero_bytes_ops()
    k = 0
    while n:
        if n & 1:
            reg = _times(ops[k], reg)
        n >>= 1
        k += 1
    return reg ^ 0xFFFFFFFF


def data_segments(path: Path, start: int, length: int) -> list[tuple[int, int]]:
    """``(offset, length)`` extents of ``[start, start + length)`` that may hold data.

    Everything outside them is a hole (reads as zeros). Without ``SEEK_DATA`` support the
    whole range is one extent.
    """
    if length <= 0:
        return []
    seek_data, seek_hole = getattr(os, "SEEK_DATA", None), getattr(os, "SEEK_HOLE", None)
    if seek_data is None or seek_hole is None:
        return [(start, length)]
    end = start + length
    out: list[tuple[int, int]] = []
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        pos = start
        while pos < end:
            try:
                d = os.lseek(fd, pos, seek_data)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but hole to the end of the file
                    break
                return [(start, length)]  # EINVAL: this filesystem cannot tell
            if d >= end:
                break
            h = min(os.lseek(fd, d, seek_hole), end)
            out.append((d, h - d))
            pos = h
    finally:
        os.close(fd)
    return out
