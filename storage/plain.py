"""The ``plain`` storage backend: positional reads (``pread``) into the caller's buffer.

No mmap, no O_DIRECT, no alignment rules: the portable baseline every other backend is
compared against. Each call to :meth:`PlainFile.read_into` loops until the whole range has
arrived (a short read is retried at the right offset, at most 1 GiB per system call because
macOS refuses larger ones); end of file or an OS error before that raises ``StorageError``.
Positional reads share no file offset, so one open file serves many threads. Where the OS
has no ``pread`` (Windows) the file offset is moved under a lock instead.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np

from k3.plugin import StorageBackend, StorageBackendSpec, StorageError, StorageFile, hookimpl

#: the most one system call is asked for (macOS pread fails with EINVAL at 2 GiB)
MAX_CALL = 1 << 30


class PlainFile(StorageFile):
    """One file opened read-only; ``read_into`` is safe from several threads at once."""

    def __init__(self, backend: PlainStorage, path: Path):
        self.path = path
        self._backend = backend
        self._lock = threading.Lock()
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as exc:
            raise StorageError(f"{path}: cannot open: {exc.strerror or exc}") from None
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            os.close(self._fd)
            raise StorageError(f"{path}: cannot stat: {exc.strerror or exc}") from None
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            raise StorageError(f"{path}: not a regular file")
        self.size = st.st_size

    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        view = _byte_view(out, self.path)
        n = view.nbytes
        if offset < 0 or offset + n > self.size:
            raise StorageError(f"{self.path}: read of {n} bytes at offset {offset} is outside "
                               f"the file ({self.size} bytes)")
        fd = self._fd
        if fd is None:
            raise StorageError(f"{self.path}: read after close")
        with self._backend.timed() as timer:
            done = 0
            while done < n:
                want = min(n - done, MAX_CALL)
                try:
                    got = self._read_once(fd, view[done : done + want], offset + done)
                except OSError as exc:
                    raise StorageError(f"{self.path}: read of {n} bytes at offset {offset} "
                                       f"failed after {done}: {exc.strerror or exc}") from None
                if got <= 0:
                    raise StorageError(f"{self.path}: short read: {done} of {n} bytes at "
                                       f"offset {offset} (the file ended early)")
                done += got
            timer.nbytes = n

    def _read_once(self, fd: int, dest: memoryview, offset: int) -> int:
        if hasattr(os, "preadv"):
            return os.preadv(fd, [dest], offset)
        if hasattr(os, "pread"):
            data = os.pread(fd, len(dest), offset)
            dest[: len(data)] = data
            return len(data)
        with self._lock:  # no positional read (Windows): seek and read under a lock
            os.lseek(fd, offset, os.SEEK_SET)
            data = os.read(fd, len(dest))
        dest[: len(data)] = data
        return len(data)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class PlainStorage(StorageBackend):
    """Plain positional reads; no alignment requirement."""

    name = "plain"
    alignment = 64

    def open(self, path: str | Path) -> PlainFile:
        return PlainFile(self, Path(path))


def _byte_view(out: np.ndarray | memoryview, path: Path) -> memoryview:
    try:
        view = out.data if isinstance(out, np.ndarray) else memoryview(out)
    except TypeError:
        raise StorageError(f"{path}: destination is not a buffer") from None
    if view.readonly:
        raise StorageError(f"{path}: destination buffer is read-only")
    if not view.c_contiguous:
        raise StorageError(f"{path}: destination buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


@hookimpl
def k3_storage_backends() -> list[StorageBackendSpec]:
    return [
        StorageBackendSpec(
            name="plain",
            factory="k3_storage.plain:PlainStorage",
            description="positional reads (pread) into the caller's buffer; portable baseline",
            priority=0,
        )
    ]
