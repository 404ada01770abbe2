"""Holes: where a sparse file holds data, and the CRC-32 of a run of zero bytes.

``k3 pack-trunk`` copies only the data extents of a layer's run (``SEEK_DATA`` /
``SEEK_HOLE``), so a sparse checkpoint packs into a sparse ``trunk.bin``; the checksum is
still of every raw byte: ``k3core.trunk.crc.crc32_zeros`` extends a CRC-32 over ``n`` zero
bytes in O(log n) without touching them. On a filesystem or platform without ``SEEK_DATA`` the whole
range is data and the copy is the dense one.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


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
