"""CRC-32 arithmetic without the bytes: zero runs and pieces read at different times.

Two uses, one operator. A layer of the packed trunk is checksummed whole (``trunk.json``),
but a streamed layer arrives in parts: :func:`crc32_combine` gives ``crc32(a + b)`` from
``crc32(a)``, ``crc32(b)`` and ``len(b)``, so the CRCs of the pieces, each taken from the
buffer that holds it, combine into the layer's without holding the layer in one buffer. And
``k3 pack-trunk`` copies only a sparse checkpoint's data extents: :func:`crc32_zeros`
extends a CRC-32 over ``n`` zero bytes without touching them. Both apply the CRC register's
"advance over 2**k zero bytes" operators (zlib's GF(2) matrix method), built once, in
O(log n).
"""

from __future__ import annotations

from functools import cache

_POLY = 0xEDB88320
_MASK = 0xFFFFFFFF


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


def _advance(reg: int, n: int) -> int:
    """The raw CRC register after ``n`` more zero bytes."""
    ops = _zero_bytes_ops()
    k = 0
    while n:
        if n & 1:
            reg = _times(ops[k], reg)
        n >>= 1
        k += 1
    return reg


def crc32_zeros(crc: int, n: int) -> int:
    """``zlib.crc32(bytes(n), crc)`` without the bytes."""
    if n < 0:
        raise ValueError("n must not be negative")
    return _advance(crc ^ _MASK, n) ^ _MASK


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)``, ``len2 = len(b)``."""
    if len2 <= 0:
        return crc1
    return (_advance(crc1, len2) ^ crc2) & _MASK
