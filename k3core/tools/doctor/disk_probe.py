"""Disk read bandwidth for ``k3 doctor``, measured the way the engine reads.

The interface ``k3 doctor`` codes against is one callable::

    measure(path: Path) -> list[tuple[str, int, float]]   # (mode, queue depth, MB/s)

:func:`default_measure` prefers ``k3core.tools.bench.io.measure`` (large O_DIRECT random reads at
queue depths 1, 4 and 16 against buffered reads), imported lazily; it is passed
``max_bytes=`` when its signature accepts it. When that module is not installed the
fallback :func:`pread_qd1` does what it can with the standard library: random reads of one
expert's size (17,547,264 bytes) at queue depth 1 through ``os.pread``, after asking the
kernel to drop the file from the page cache before every read (``posix_fadvise(DONTNEED)``,
Linux; elsewhere the figure may be memory's), so the figure is the device's. It is a lower bound for what QD16 would reach.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from k3core.api.units import ALIGN
from k3core.model.sizes import EXPERT_BYTES

DiskResult = tuple[str, int, float]
DiskMeasure = Callable[[Path], list[DiskResult]]

DEFAULT_PROBE_BYTES = 256 << 20


def default_measure(max_bytes: int = DEFAULT_PROBE_BYTES) -> tuple[DiskMeasure, str]:
    """``(measure, description)``: the diskbench probe (O_DIRECT and buffered, QD 1/4/16)."""
    return (lambda p: diskbench_measure(p, max_bytes=max_bytes),
            "random expert-sized reads, O_DIRECT vs buffered (page cache dropped), QD 1/4/16")


def diskbench_measure(path: str | Path, *, max_bytes: int = DEFAULT_PROBE_BYTES) -> list[DiskResult]:
    """Rows ``(mode, depth, MB/s)`` from :func:`k3core.tools.bench.io.raw_bandwidth`."""
    from k3core.api.errors import StorageError
    from k3core.tools.bench.io import raw_bandwidth

    size = Path(path).stat().st_size
    read_size = max(ALIGN, min(EXPERT_BYTES, size // 4) // ALIGN * ALIGN)  # an expert-sized read
    if size < read_size:
        return []
    reads = max(1, min(40, max_bytes // read_size))
    out: list[DiskResult] = []
    for mode, direct in (("O_DIRECT", True), ("buffered", False)):
        for depth in (1, 4, 16):
            try:
                s = raw_bandwidth(path, read_size, depth, direct=direct, reads=reads)
            except StorageError:
                if direct:
                    break
                raise
            out.append((mode, depth, s.mb_per_s))
    return out


def pread_qd1(path: str | Path, *, max_bytes: int = DEFAULT_PROBE_BYTES,
              block: int = EXPERT_BYTES, seed: int = 0) -> list[DiskResult]:
    """Random ``block``-sized reads at QD1 over ``path`` until ``max_bytes`` are read."""
    p = Path(path)
    size = p.stat().st_size
    block = max(ALIGN, min(block, size, max_bytes))
    if size < ALIGN:
        return []
    fd = os.open(p, os.O_RDONLY)
    try:
        rng = random.Random(seed)
        buf = bytearray(block)
        view = memoryview(buf)
        done = 0
        t0 = time.perf_counter()
        while done < max_bytes:
            off = rng.randrange(0, max(size - block, 0) + 1) // ALIGN * ALIGN
            _drop_cache(fd)  # every read from the device, not from memory
            got = os.preadv(fd, [view], off) if hasattr(os, "preadv") else _pread(fd, view, off)
            if got <= 0:
                break
            done += got
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return [("buffered", 1, done / seconds / 1e6)] if seconds > 0 and done else []


def _pread(fd: int, view: memoryview, off: int) -> int:
    data = os.pread(fd, len(view), off)
    view[: len(data)] = data
    return len(data)


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def write_probe_file(folder: Path, nbytes: int) -> Path:
    """A scratch file of ``nbytes`` random bytes in ``folder``, flushed to the device."""
    path = folder / f".k3-doctor-probe-{os.getpid()}"
    chunk = os.urandom(min(nbytes, 8 << 20))
    with open(path, "wb") as fh:
        left = nbytes
        while left > 0:
            fh.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    return path
