"""Fault a fresh buffer's pages in before its first use, without changing its bytes; and
the other page advice a large buffer gets (``advise_hugepages``).

Fresh anonymous memory is mapped on first touch: the kernel zeroes every page, and in a
virtual machine the host may first have to back it. For a buffer that storage reads fill (the
expert cache's arena, the trunk ring's slots) that cost otherwise lands on the reader
threads in the middle of a forward pass, where the cores are busy with kernels: seconds of
CPU for an arena of a GB or so (docs/expert-cache.md, "The arena is faulted in at load").

``prefault`` maps the pages writable now. On Linux 5.14 and later it asks the kernel
(``madvise(MADV_POPULATE_WRITE)``, one call per chunk, no byte changed); elsewhere it writes
each page's first byte back to itself. Neither is safe against a concurrent writer, so a
caller prefaults before any read into the buffer is submitted (``ExpertCache`` joins its
prefault thread before its first read).
"""

from __future__ import annotations

import ctypes
import sys
import threading

import numpy as np

from k3core.api.storage import aligned_empty
from k3core.api.units import ALIGN, align_up

PAGE = 4096
#: a transparent huge page (x86-64, arm64 with 4 kB base pages)
HUGE_PAGE = 2 * 1024 * 1024
#: madvise advice: back the range with transparent huge pages where possible
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
#: madvise advice: populate (prefault) page tables writable, Linux 5.14+
MADV_POPULATE_WRITE = 23
#: bytes per madvise call, so a stop request is seen within one chunk
CHUNK = 64 << 20

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no libc symbol: the touch fallback
        _madvise = None


def advise_hugepages(buf: np.ndarray, on: bool = True) -> None:
    """Ask for transparent huge pages over ``buf``, or with ``on=False`` for none (advisory:
    ignored where unsupported)."""
    if _madvise is not None and buf.nbytes:
        _madvise(ctypes.c_void_p(buf.ctypes.data), buf.nbytes,
                 MADV_HUGEPAGE if on else MADV_NOHUGEPAGE)


def hugepage_buffer(nbytes: int) -> np.ndarray:
    """A ``uint8`` buffer of at least ``nbytes`` (rounded up to ALIGN, or from HUGE_PAGE on
    to HUGE_PAGE), ALIGN-aligned; from HUGE_PAGE on, HUGE_PAGE-aligned with MADV_HUGEPAGE
    over the whole huge pages ``nbytes`` fills (the partial last one is left to small pages,
    so prefaulting its first ``nbytes`` maps them rounded to 4 kB, not to 2 MiB). Not faulted
    in: ``prefault`` what will be read into before the first read.

    Storage reads land in these buffers (the trunk ring's slots, the expert cache's arena).
    An O_DIRECT read pins the destination's pages; over huge pages that is one page per
    2 MiB instead of 512. On the 2-vCPU Zen 4 development guest (virtio disk), reads of
    823 kB at queue depth 1 took 148-151 us of CPU and 850-870 us each into small pages,
    53-59 us and 427-430 us into huge pages."""
    if nbytes < HUGE_PAGE:
        return aligned_empty(max(ALIGN, align_up(nbytes)), ALIGN)
    buf = aligned_empty(-(-nbytes // HUGE_PAGE) * HUGE_PAGE, HUGE_PAGE)
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    advise_hugepages(buf[:whole])
    advise_hugepages(buf[whole:], on=False)
    return buf


def hugepage_zeros(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """A zeroed array, from HUGE_PAGE bytes on HUGE_PAGE-aligned with MADV_HUGEPAGE over its
    whole huge pages, advised before anything touches them, so its pages come as huge pages
    on first touch (zero pages are mapped lazily, as ``np.zeros`` maps them: nothing is
    faulted in here). For arrays read down strides much larger than a page: the latent KV
    cache (``k3core/model/state.py``), whose attention reads rows 32 apart, one small page
    each."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if nbytes < HUGE_PAGE:
        return np.zeros(shape, dtype=dt)
    buf = aligned_empty(nbytes, HUGE_PAGE, zeroed=True)
    advise_hugepages(buf[: nbytes // HUGE_PAGE * HUGE_PAGE])
    out: np.ndarray = buf.view(dt).reshape(shape)
    return out


def _touch(buf: np.ndarray) -> None:
    """Write each page's first byte (and the last byte) back to itself."""
    if buf.size:
        head = buf[::PAGE]
        head[...] = head.copy()
        buf[-1] = buf[-1]


def prefault(buf: np.ndarray, stop: threading.Event | None = None) -> bool:
    """Map every page of the 1-D ``uint8`` array ``buf``; ``False`` if ``stop`` cut it short.

    The contents are unchanged (fresh memory stays zero). Call it before anything else
    writes into ``buf``: the fallback path reads and rewrites bytes.
    """
    flat = buf.reshape(-1).view(np.uint8)
    start = flat.ctypes.data
    lo = -start % PAGE  # the first whole page
    n = flat.nbytes
    whole = max(0, (n - lo) // PAGE * PAGE)
    kernel = _madvise is not None and whole > 0
    if lo or not kernel:
        _touch(flat[: lo or n])
    if not kernel:
        return True
    assert _madvise is not None
    for off in range(lo, lo + whole, CHUNK):
        if stop is not None and stop.is_set():
            return False
        size = min(CHUNK, lo + whole - off)
        if _madvise(ctypes.c_void_p(start + off), size, MADV_POPULATE_WRITE) != 0:
            _touch(flat[off:])  # an older kernel (EINVAL): touch the rest
            return True
    if lo + whole < n:
        _touch(flat[lo + whole :])
    return True
