"""The ``mmap`` storage backend: map a window of the file read-only, copy it out, unmap.

Works on every platform and filesystem. A read maps only the range it wants, in windows of
at most :data:`WINDOW_BYTES`, copies each into the caller's buffer with numpy ``copyto``
(which releases the GIL, so several threads fault pages in at once) and unmaps it before
the next. So the mapped pages count against this process's resident set only while they
are being copied (at most one window per reading thread); the page cache keeps them for the
next read, but RSS stays what the memory plan says (the caller's buffers), as with the
other backends. Mapping a whole shard and keeping it mapped instead let every page ever
read stay resident: a run planned at 0.6 GB peaked at 2.7 GB.

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

#: reads at least this large first tell the kernel the whole window is wanted
#: (``MADV_WILLNEED``), so it is read in large requests instead of fault by fault
WILLNEED_BYTES = 1 << 20
_WILLNEED: int | None = getattr(mmap, "MADV_WILLNEED", None)
#: the most bytes one read has mapped at a time (a multiple of every allocation granularity)
WINDOW_BYTES = 16 << 20


class MmapFile(StorageFile):
    """One open file; each read maps, copies and unmaps its own windows."""

    def __init__(self, path: Path, fd: int, size: int, stats: IOStats) -> None:
        self.path = path
        self.size = size
        self._fd = fd
        self._stats = stats
        self._closed = False
        if size:  # refuse at open what cannot be mapped at all (as the whole-file map did)
            mmap.mmap(fd, min(size, mmap.ALLOCATIONGRANULARITY), access=mmap.ACCESS_READ).close()

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
        gran = mmap.ALLOCATIONGRANULARITY
        done = 0
        while done < dst.size:
            pos = offset + done
            start = pos - pos % gran
            n = min(dst.size - done, WINDOW_BYTES - (pos - start))
            try:
                mm = mmap.mmap(self._fd, pos - start + n, access=mmap.ACCESS_READ, offset=start)
            except (OSError, ValueError) as exc:
                raise StorageError(f"{self.path}: read [{pos}, {pos + n}) failed: cannot map: "
                                   f"{getattr(exc, 'strerror', None) or exc}") from None
            try:
                if n >= WILLNEED_BYTES and _WILLNEED is not None:
                    try:
                        mm.madvise(_WILLNEED)
                    except OSError:
                        pass  # advisory only
                src = np.frombuffer(mm, dtype=np.uint8, count=n, offset=pos - start)
                try:
                    np.copyto(dst[done : done + n], src)
                finally:
                    del src  # release the export now, so the window can be unmapped
            finally:
                mm.close()  # unmapped: its pages leave this process's resident set
            done += n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
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
