"""Bytes as k3 counts and writes them: one alignment, one rounding rule, one spelling.

* :data:`ALIGN` (4096) is the one alignment: O_DIRECT reads, aligned buffers, the offsets
  and lengths of packed-trunk layers and expert-cache slots are all multiples of it.
* :func:`align_up` rounds a byte count up to a multiple of it.
* Sizes a user types or reads are decimal: 1 kB = 10^3 B, 1 MB = 10^6 B, 1 GB = 10^9 B,
  1 TB = 10^12 B (``--trunk-gb``, ``--cache-gb``, every report line). :func:`gb_bytes` turns
  a GB figure into whole bytes; :func:`human` writes a byte count with two decimals.
* :func:`check_gb` is the one check of a size a person gives in GB (every ``--*-gb`` flag,
  the same keywords of the Python API and the server's command line): finite, not
  negative (or positive where zero means nothing), and at most :data:`MAX_GB` (1 PB).
  :func:`check_mb` is the same for the ``--*-mb`` flags.
"""

from __future__ import annotations

import math

from k3core.api.errors import UsageError

ALIGN = 4096
GB = 10**9
#: the largest size in GB any flag takes: 1 PB, far past any machine, far below overflow
MAX_GB = 1e6

_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_UNIT_BYTES = dict(_UNITS)


def align_up(n: int, align: int = ALIGN) -> int:
    """The least multiple of ``align`` that is at least ``n``."""
    return -(-n // align) * align


def gb_bytes(gb: float) -> int:
    """``gb`` decimal gigabytes as whole bytes (rounded to the nearest byte, not truncated:
    ``0.3 * 1e9`` is 299999999.99999994 in binary floating point). A size that is not a
    finite number of bytes is refused (:func:`check_gb` names the flag earlier)."""
    if not math.isfinite(gb):
        raise UsageError(f"a size of {gb} GB is not a number of bytes")
    return int(round(gb * GB))


def check_gb(value: float | None, flag: str, *, positive: bool = False,
             most: float = MAX_GB) -> float | None:
    """``value`` (``None``: not given) if it is a usable size in GB, else a ``UsageError``
    naming ``flag``: NaN, infinity, a negative size (or zero where ``positive``) and a size
    above ``most`` (1 PB) are refused rather than overflowing or clamped."""
    return _check_size(value, flag, "GB", positive, most)


def check_mb(value: float | None, flag: str, *, positive: bool = True,
             most: float = MAX_GB * 1e3) -> float | None:
    """:func:`check_gb` for a size in MB (1 MB = 10^6 B)."""
    return _check_size(value, flag, "MB", positive, most)


def _check_size(value: float | None, flag: str, unit: str, positive: bool,
                most: float) -> float | None:
    if value is None:
        return None
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= most
    if not ok:
        kind = "a positive" if positive else "a non-negative"
        limit = f"{most:.0f}" + (" (1 PB)" if most * _UNIT_BYTES[unit] == 1e15 else "")
        raise UsageError(f"{flag} must be {kind} number of {unit} no larger than {limit}, "
                         f"got {value}")
    return value


def human(n: float) -> str:
    """Decimal units, two places: ``2.37 MB``, ``4.70 GB``, ``1.56 TB``; below 1 kB, ``12 B``."""
    for unit, div in _UNITS:
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
