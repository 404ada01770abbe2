"""CRC-32 of a byte run assembled from pieces read at different times.

A layer of the packed trunk is checksummed whole (``trunk.json``), but a streamed layer
arrives in parts. :func:`crc32_combine` gives ``crc32(a + b)`` from ``crc32(a)``,
``crc32(b)`` and ``len(b)`` (zlib's GF(2) matrix method), so the CRCs of the pieces, each
taken from the buffer that holds it, combine into the layer's CRC without holding the
layer in one buffer.
"""

from __future__ import annotations

_POLY = 0xEDB88320


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)``, ``len2 = len(b)``."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    while True:
        even = _square(odd)
        if len2 & 1:
            crc1 = _times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _square(even)
        if len2 & 1:
            crc1 = _times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return (crc1 ^ crc2) & 0xFFFFFFFF
