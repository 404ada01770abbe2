"""This process's open handles and resident memory, as the storage suite measures them.

:func:`open_handles` counts the descriptors (POSIX) or handles (Windows) this process holds,
so a test can see what many open/close cycles left behind; :func:`resident_bytes` is the
resident set the memory plan is held to. Both through ``psutil`` (a k3 dependency).
"""

from __future__ import annotations

import sys

import psutil


def open_handles() -> int | None:
    """Open file descriptors (POSIX) or handles (Windows) of this process; ``None`` where the
    platform does not say."""
    proc = psutil.Process()
    try:
        if sys.platform == "win32":
            return int(proc.num_handles())
        return int(proc.num_fds())
    except (AttributeError, NotImplementedError, psutil.Error):
        return None


def resident_bytes() -> int:
    """This process's resident set size in bytes."""
    return int(psutil.Process().memory_info().rss)
