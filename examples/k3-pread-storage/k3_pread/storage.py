"""The ``pread`` storage backend: positional reads straight into the caller's buffer.

Where each part of the storage contract (``help(k3.plugin.StorageBackend)``) is met:

* **opening and sizing** (:class:`PreadFile`): ``os.open`` read-only, ``fstat`` for the size
  every range is checked against; a directory or anything but a regular file is refused, and
  every ``OSError`` becomes a ``StorageError`` naming the path. A failed open closes what it
  opened.
* **range checks** (:meth:`PreadFile.read_into`): against the size at open, before any read;
  :func:`k3.plugin.byte_view` takes any writable contiguous buffer as bytes and refuses the
  rest.
* **the short-read loop** (:meth:`PreadFile._fill`): ``os.preadv`` may return fewer bytes than
  asked; the loop goes on from where it stopped, at most :data:`MAX_CALL` bytes a call, and a
  read that returns nothing before the range is complete (the file was truncated) is a
  ``StorageError``. ``EINTR`` is retried by Python itself.
* **threads**: positional reads share no file position, so one open file serves every
  thread; nothing read is kept, so nothing stays resident.
* **stats**: ``with backend.timed() as t: ...; t.nbytes = n`` around each whole read: one
  call and its bytes for a read that returned, nothing for one that raised.
* **a safe close** (:meth:`PreadFile.close`): idempotent; the caller never closes a file with
  reads in flight (the contract), but this one still waits for them, so no read can use a
  descriptor number the OS has since given to another file.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np

from k3.plugin import Buffer, StorageBackend, StorageError, StorageFile, byte_view

#: the most one system call is asked for (macOS refuses 2 GiB and more in one pread)
MAX_CALL = 1 << 30


class PreadFile(StorageFile):
    """One file opened read-only; ``read_into`` is safe from any number of threads."""

    def __init__(self, backend: PreadStorage, path: Path) -> None:
        self.path = path
        self._backend = backend
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise StorageError(f"{path}: cannot open: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise StorageError(f"{path}: is a directory, not a file")
            if not stat.S_ISREG(st.st_mode):
                raise StorageError(f"{path}: not a regular file")
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"{path}: cannot stat: {exc.strerror or exc}") from None
        except BaseException:
            os.close(fd)
            raise
        self.size = st.st_size
        self._fd: int | None = fd
        self._reads = 0  # reads in flight
        self._idle = threading.Condition()

    def read_into(self, offset: int, out: Buffer) -> None:
        view = byte_view(out)  # any writable contiguous buffer, as bytes
        n = view.nbytes
        if offset < 0 or offset + n > self.size:
            raise StorageError(f"{self.path}: read of {n} bytes at offset {offset} is outside "
                               f"the file ({self.size} bytes)")
        fd = self._enter()
        try:
            with self._backend.timed() as t:
                self._fill(fd, offset, view)
                t.nbytes = n
        finally:
            self._leave()

    def _fill(self, fd: int, offset: int, view: np.ndarray) -> None:
        n, done = view.nbytes, 0
        while done < n:
            want = min(n - done, MAX_CALL)
            try:
                got = os.preadv(fd, [view[done : done + want].data], offset + done)
            except OSError as exc:
                raise StorageError(f"{self.path}: read of {n} bytes at offset {offset} failed "
                                   f"after {done}: {exc.strerror or exc}") from None
            if got == 0:
                raise StorageError(f"{self.path}: short read: the file ended after {done} of "
                                   f"{n} bytes at offset {offset} (truncated since it was "
                                   "opened?)")
            done += got

    def _enter(self) -> int:
        with self._idle:
            if self._fd is None:
                raise StorageError(f"{self.path}: read after close")
            self._reads += 1
            return self._fd

    def _leave(self) -> None:
        with self._idle:
            self._reads -= 1
            if not self._reads:
                self._idle.notify_all()

    def close(self) -> None:
        with self._idle:
            fd, self._fd = self._fd, None  # new reads are refused from here on
            while self._reads:
                self._idle.wait()
        if fd is not None:
            os.close(fd)


class PreadStorage(StorageBackend):
    """Positional reads; no alignment rules (``alignment`` is only a hint for callers)."""

    name = "pread"
    alignment = 64

    def open(self, path: str | Path) -> PreadFile:
        return PreadFile(self, Path(path))
