"""``prefault`` maps a buffer's pages without changing a byte, and stops when asked."""

from __future__ import annotations

import threading

import numpy as np

from k3core.api import prefault as pf
from k3core.api.storage import aligned_empty


def test_prefault_keeps_every_byte_at_any_offset_and_length() -> None:
    rng = np.random.default_rng(3)
    base = aligned_empty(5 * pf.PAGE + 123)
    base[:] = rng.integers(0, 256, base.size, dtype=np.uint8)
    want = base.copy()
    for start, stop in ((0, base.size), (1, base.size - 1), (pf.PAGE - 1, pf.PAGE + 2), (7, 9), (0, 0)):
        assert pf.prefault(base[start:stop]) is True
        assert np.array_equal(base, want)


def test_fresh_memory_stays_zero_and_is_mapped() -> None:
    buf = np.zeros(3 * pf.CHUNK // 2 + 77, dtype=np.uint8)[77:]  # calloc: fresh, unaligned
    assert pf.prefault(buf) is True
    assert not buf.any()


def test_the_touch_fallback_keeps_bytes_too(monkeypatch) -> None:
    monkeypatch.setattr(pf, "_madvise", None)
    buf = aligned_empty(4 * pf.PAGE + 5)
    buf[:] = np.arange(buf.size) % 251
    want = buf.copy()
    assert pf.prefault(buf[3:]) is True
    assert np.array_equal(buf, want)


def test_a_stop_request_ends_it_between_chunks() -> None:
    stop = threading.Event()
    stop.set()
    buf = np.zeros(2 * pf.CHUNK, dtype=np.uint8)
    if pf._madvise is not None:
        assert pf.prefault(buf, stop) is False
    assert not buf.any()


def _vm_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping holding ``addr`` (Linux ``/proc/self/smaps``), or None."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_hugepage_buffers_are_aligned_sized_and_advised() -> None:
    """Large buffers are 2 MiB aligned and their whole huge pages advised MADV_HUGEPAGE
    (VmFlags ``hg``), the partial last one not (``nh``); small ones are ALIGN-aligned."""
    small = pf.hugepage_buffer(5000)
    assert small.ctypes.data % pf.ALIGN == 0 and small.size >= 5000
    n = 2 * pf.HUGE_PAGE + 12345
    buf = pf.hugepage_buffer(n)
    assert buf.ctypes.data % pf.HUGE_PAGE == 0 and buf.size >= n and buf.size % pf.HUGE_PAGE == 0
    buf[:n] = 97
    assert pf.prefault(buf[:n]) is True and bool((buf[:n] == 97).all())
    import os

    if not os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        return  # no transparent huge pages in this kernel: the advice is ignored
    head, tail = _vm_flags(buf.ctypes.data), _vm_flags(buf.ctypes.data + 2 * pf.HUGE_PAGE)
    if head is None or tail is None:
        return
    assert "hg" in head and "nh" in tail
