"""The ``mmap`` storage backend: memory-map each file read-only, copy ranges out.

Works on every platform and filesystem. The copy is a numpy ``copyto`` (which releases the
GIL), so several threads fault pages in at once. Each read takes a short-lived view of the
map and drops it before returning, so ``close`` never meets a live export.

Touching a mapped page past the end of a file that shrank after it was mapped kills the
process with SIGBUS, so every read first checks the file's current size (``fstat``) and
refuses with ``StorageError`` if the range is gone. A truncation racing that check by
microseconds is not caught; use ``direct`` where files may change under a running engine.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
from k3_storage.open_errors import open_failure, regular_size

from k3.plugin import (
    Availability,
    Buffer,
    IOStats,
    IOTimer,
    StorageBackend,
    StorageBackendSpec,
    StorageError,
    StorageFile,
    checked_destination,
    hookimpl,
)

#: reads at least this large first tell the kernel the whole range is wanted
#: (``MADV_WILLNEED``), so it is read in large requests instead of fault by fault
WILLNEED_BYTES = 1 << 20
_WILLNEED: int | None = getattr(mmap, "MADV_WILLNEED", None)


class MmapFile(StorageFile):
    """One file mapped read-only for its whole size at open."""

    def __init__(self, path: Path, fd: int, size: int, stats: IOStats) -> None:
        self.path = path
        self.size = size
        self._fd = fd
        self._stats = stats
        self._closed = False
        self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None

    def read_into(self, offset: int, out: Buffer) -> None:
        dst = checked_destination(self.path, self.size, self._closed, offset, out)
        n = dst.size
        with IOTimer(self._stats) as t:
            if n:
                self._copy(offset, dst)
            t.nbytes = n

    def _copy(self, offset: int, dst: np.ndarray) -> None:
        now = os.fstat(self._fd).st_size
        if offset + dst.size > now:
            raise StorageError(
                f"{self.path}: read [{offset}, {offset + dst.size}) failed: the file shrank "
                f"from {self.size} to {now} bytes after it was opened"
            )
        assert self._mm is not None  # size > 0 here
        if dst.size >= WILLNEED_BYTES and _WILLNEED is not None:
            start = offset - offset % mmap.PAGESIZE  # ask for the whole range up front
            try:
                self._mm.madvise(_WILLNEED, start, offset + dst.size - start)
            except OSError:
                pass  # advisory only
        src = np.frombuffer(self._mm, dtype=np.uint8, count=dst.size, offset=offset)
        try:
            np.copyto(dst, src)
        finally:
            del src  # release the export on the map now, not at the next GC

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._mm is not None:
                self._mm.close()
        except BufferError as exc:
            raise StorageError(f"{self.path}: closed while reads were in flight") from exc
        finally:
            os.close(self._fd)


class MmapStorage(StorageBackend):
    """Memory-mapped reads (page cache, any filesystem)."""

    name = "mmap"
    alignment = 64

    def open(self, path: str | Path) -> MmapFile:
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise open_failure(p, exc) from exc
        try:
            return MmapFile(p, fd, regular_size(p, fd), self.stats)
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"{p}: cannot map: {exc.strerror or exc}") from exc
        except BaseException:
            os.close(fd)
            raise


def probe() -> Availability:
    return Availability.yes()


@hookimpl
def k3_storage_backends() -> list[StorageBackendSpec]:
    return [
        StorageBackendSpec(
            name="mmap",
            factory="k3_storage.mmap_backend:MmapStorage",
            priority=10,
            probe=probe,
            description="memory-mapped reads through the page cache (any OS, any filesystem)",
        )
    ]
