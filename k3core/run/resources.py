"""Measured resource use of this process (the figure to quote, not the plan's forecast)."""

from __future__ import annotations

import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes."""
    if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
        import psutil

        return int(getattr(psutil.Process().memory_info(), "peak_wset", 0))
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)
