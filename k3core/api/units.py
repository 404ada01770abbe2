"""Bytes as k3 counts and writes them: one alignment, one rounding rule, one spelling.

* :data:`ALIGN` (4096) is the one alignment: O_DIRECT reads, aligned buffers, the offsets
  and lengths of packed-trunk layers and expert-cache slots are all multiples of it.
* :func:`align_up` rounds a byte count up to a multiple of it.
* Sizes a user types or reads are decimal: 1 kB = 10^3 B, 1 MB = 10^6 B, 1 GB = 10^9 B,
  1 TB = 10^12 B (``--trunk-gb``, ``--cache-gb``, every report line). :func:`gb_bytes` turns
  a GB figure into whole bytes; :func:`human` writes a byte count with two decimals.
"""

from __future__ import annotations

ALIGN = 4096
GB = 10**9

_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def align_up(n: int, align: int = ALIGN) -> int:
    """The least multiple of ``align`` that is at least ``n``."""
    return -(-n // align) * align


def gb_bytes(gb: float) -> int:
    """``gb`` decimal gigabytes as whole bytes (rounded to the nearest byte, not truncated:
    ``0.3 * 1e9`` is 299999999.99999994 in binary floating point)."""
    return int(round(gb * GB))


def human(n: float) -> str:
    """Decimal units, two places: ``2.37 MB``, ``4.70 GB``, ``1.56 TB``; below 1 kB, ``12 B``."""
    for unit, div in _UNITS:
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
