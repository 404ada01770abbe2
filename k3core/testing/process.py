"""This process's open handles and resident memory, as the storage suite measures them.

:func:`open_handles` counts the descriptors (POSIX) or handles (Windows) this process holds,
so a test can see what many open/close cycles left behind. :class:`MemoryWatch` measures
what a stretch of work left resident: the growth of the resident set (mappings, and heap
the C allocator had to take from the OS; its free pages are handed back first, where glibc
allows, so reuse of earlier garbage does not hide growth) and of the memory Python objects
hold (``tracemalloc``: a cache of ``bytes`` or arrays shows even when it fits in old heap).
Through ``psutil`` (a k3 dependency) and the standard library.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import tracemalloc

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


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


class MemoryWatch:
    """``with MemoryWatch() as w: ...; w.grown()``: bytes this process holds more than at
    entry, as ``(resident set growth, Python objects' growth)``."""

    def __enter__(self) -> MemoryWatch:
        gc.collect()
        release_free_heap()
        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        self._traced0 = tracemalloc.get_traced_memory()[0]
        self._rss0 = resident_bytes()
        return self

    def grown(self) -> tuple[int, int]:
        return resident_bytes() - self._rss0, tracemalloc.get_traced_memory()[0] - self._traced0

    def __exit__(self, *exc: object) -> None:
        if self._started:
            tracemalloc.stop()
