"""The storage suite's test files: random bytes, and a pattern that says where each byte is.

* :func:`write_random_file`: seeded random bytes (the small file every range is read from);
* :func:`pattern_bytes` / :func:`write_pattern_file`: bytes computed from their own file
  offset (a 64-bit mix of the offset of each 8-byte word), so a file of any size needs no
  copy in memory, and a read that lands even one byte off, or at an offset that lost some
  bits, differs from what it should have read;
* :func:`write_sparse_pattern_file`: a file of holes with the pattern only in chosen
  *islands*, so a read of more than a GiB costs next to no disk;
* :func:`first_difference` and :func:`describe_difference`: where two byte strings part,
  and the sentence a failure prints (the operation, offset, length, the first differing
  byte and, where it can tell, which file offset the wrong bytes came from).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)
_MIX3 = np.uint64(0x94D049BB133111EB)
#: pattern bytes generated per piece while writing a file
_PIECE = 8 << 20


def write_random_file(path: Path, size: int, seed: int = 0) -> bytes:
    """Write ``size`` seeded random bytes to ``path``; returns them."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def python_read(path: Path, offset: int, nbytes: int) -> bytes:
    """Bytes ``[offset, offset + nbytes)`` of ``path`` by plain Python reads (the truth)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def pattern_bytes(offset: int, nbytes: int, seed: int = 0) -> np.ndarray:
    """The pattern file's bytes ``[offset, offset + nbytes)`` as a new ``uint8`` array.

    Word ``i`` (bytes ``8i .. 8i+7``, little-endian) is a splitmix64 finalisation of
    ``i + seed * 2**40``: every word differs from every other, so no shift aliases.
    """
    if nbytes <= 0:
        return np.zeros(0, dtype=np.uint8)
    w0, w1 = offset // 8, (offset + nbytes + 7) // 8
    x = np.arange(w0, w1, dtype=np.uint64) + np.uint64(seed << 40)
    with np.errstate(over="ignore"):
        x = x * _MIX1
        x ^= x >> np.uint64(30)
        x *= _MIX2
        x ^= x >> np.uint64(27)
        x *= _MIX3
        x ^= x >> np.uint64(31)
    raw = x.astype("<u8").view(np.uint8)
    start = offset - 8 * w0
    return raw[start : start + nbytes].copy()


def write_pattern_file(path: Path, size: int, seed: int = 0) -> None:
    """Write ``size`` pattern bytes to ``path`` (generated piece by piece)."""
    with open(path, "wb") as f:
        for off in range(0, size, _PIECE):
            f.write(pattern_bytes(off, min(_PIECE, size - off), seed).data)


def write_sparse_pattern_file(path: Path, size: int, islands: Sequence[tuple[int, int]],
                              seed: int = 0) -> None:
    """A ``size``-byte file of holes with the pattern in ``islands`` (``(offset, nbytes)``):
    zeros everywhere else, and next to no disk where the filesystem keeps holes."""
    with open(path, "wb") as f:
        f.truncate(size)
        for off, n in islands:
            f.seek(off)
            f.write(pattern_bytes(off, n, seed).data)
        f.flush()
        os.fsync(f.fileno())


def first_difference(got: np.ndarray, want: np.ndarray) -> tuple[int, int]:
    """``(count, first)``: how many bytes differ and the index of the first (-1: none)."""
    bad = np.flatnonzero(got != want)
    return int(bad.size), int(bad[0]) if bad.size else -1


def describe_difference(op: str, offset: int, got: np.ndarray, want: np.ndarray,
                        *, whole: bytes | None = None, old: bytes | None = None) -> str | None:
    """``None`` when ``got`` equals ``want`` (both ``uint8``); else the failure sentence.

    ``op`` names the operation and where (``read_into(offset=..., n bytes) of FILE into
    ...``); ``whole`` (the file's bytes, when known) lets it say which offset the wrong bytes
    are from, ``old`` (a replaced file's earlier bytes) that they are the old file's.
    """
    if got.size != want.size:
        return f"{op}: {got.size} bytes arrived, {want.size} expected"
    count, i = first_difference(got, want)
    if count == 0:
        return None
    n = want.size
    text = (f"{op}: {count} of {n} bytes differ; first at +{i} (file offset {offset + i}): "
            f"got 0x{int(got[i]):02x}, want 0x{int(want[i]):02x}")
    if old is not None and got.tobytes() == old[offset : offset + n]:
        return text + " (these are the bytes of the file that was at this path before: stale)"
    if not np.any(got[i:]):
        return text + f" (every byte from +{i} on is zero: never filled?)"
    probe = got[i : i + 64].tobytes()
    if whole is not None and len(probe) >= 16:
        at = whole.find(probe)
        if at >= 0:
            return (text + f" (the bytes from +{i} on are the file's bytes at offset {at}, "
                    f"{at - offset - i:+d} from where they belong: read at the wrong position)")
    return text
