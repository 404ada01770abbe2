"""How much of a file sits in the OS page cache, and asking the OS to drop it.

Buffered bandwidth figures mean nothing unless one says whether the bytes came from the
disk or from memory. :func:`cached_fraction` asks the kernel (``mincore`` over a shared
read-only mapping; Linux and other POSIX systems with a C library ctypes can load) and
:func:`drop_cached` asks it to forget the file's clean pages (``posix_fadvise`` with
``POSIX_FADV_DONTNEED``; no privileges needed, dirty pages are kept, so flush first).
Both answer ``None``/``False`` where the OS offers no such call, never guess.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np


@cache
def _libc() -> Any:
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]  # fmt: skip
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


def cached_fraction(path: str | Path) -> float | None:
    """The fraction (0..1) of ``path``'s pages resident in the page cache, or ``None``."""
    libc = _libc()
    if libc is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0.0
        page = mmap.PAGESIZE
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            npages = (size + page - 1) // page
            vec = np.zeros(npages, dtype=np.uint8)
            if libc.mincore(ctypes.c_void_p(addr), size, ctypes.c_void_p(vec.ctypes.data)) != 0:
                return None
            resident = int((vec & 1).sum())
            return resident / npages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def drop_cached(path: str | Path) -> bool:
    """Ask the OS to drop ``path``'s clean cached pages. True if the request was accepted."""
    advise = getattr(os, "posix_fadvise", None)
    dontneed = getattr(os, "POSIX_FADV_DONTNEED", None)
    if advise is None or dontneed is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        advise(fd, 0, 0, dontneed)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def describe_cache(before: float | None, after: float | None, dropped: bool) -> str:
    """A short honest note: what was cached before measuring and what was done about it."""
    if before is None:
        return "page cache state unknown" + ("; drop requested" if dropped else "")
    was = f"{before:.0%} cached"
    if not dropped:
        return f"{was}; could not drop"
    if after is None:
        return f"{was}; drop requested"
    return f"{was} -> {after:.0%} after drop"
