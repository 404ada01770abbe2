"""Storage backends broken one way each, for proving the shipped suite catches them (tests only).

:class:`GoodStorage` is a correct positional-read backend written against ``k3.plugin`` alone;
every other class changes one thing, the way a plugin author might get it wrong:

| name | what is wrong |
|---|---|
| ``short-at-eof`` | a read past the end returns the bytes there are, silently |
| ``drop-low-bits`` | reads over 1 MiB drop the offset's low 12 bits (``DropLowBitsSmall``: over 16 KiB) |
| ``shared-position`` | ``lseek`` then ``read`` on one descriptor shared by every thread |
| ``stale-cache`` | a read cache by path, never invalidated (a replaced file reads old bytes) |
| ``leaky`` | every open leaks its descriptor (``close`` forgets to close it) |
| ``plain-exception`` | a missing file raises a plain ``Exception`` |
| ``keeps-resident`` | keeps a copy of every range it read while the file is open |
| ``uncounted`` | reads are not counted in ``stats`` |
| ``thread-crash`` | a helper thread of its own dies with an exception nobody sees |

:data:`VARIANTS` maps each name to its class.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np

from k3.plugin import StorageBackend, StorageError, StorageFile, byte_view

MiB = 1 << 20


class GoodFile(StorageFile):
    def __init__(self, backend: GoodStorage, path: Path) -> None:
        self.path = path
        self._backend = backend
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise self._open_error(path, exc) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise StorageError(f"{path}: not a regular file")
        self._fd: int | None = fd
        self.size = st.st_size

    @staticmethod
    def _open_error(path: Path, exc: OSError) -> Exception:
        return StorageError(f"{path}: cannot open: {exc.strerror}")

    def _range(self, offset: int, n: int) -> None:
        if offset < 0 or offset + n > self.size:
            raise StorageError(f"{self.path}: [{offset}, {offset + n}) is outside the file")

    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        view = byte_view(out)
        n = view.nbytes
        self._range(offset, n)
        fd = self._fd
        if fd is None:
            raise StorageError(f"{self.path}: read after close")
        with self._backend.timed() as t:
            self._fill(fd, offset, view)
            t.nbytes = n

    def _fill(self, fd: int, offset: int, view: np.ndarray) -> None:
        done = 0
        while done < view.nbytes:
            got = self._pread(fd, view[done:], offset + done)
            if got == 0:
                raise StorageError(f"{self.path}: the file ended at {offset + done}")
            done += got

    def _pread(self, fd: int, dest: np.ndarray, pos: int) -> int:
        return os.preadv(fd, [dest.data], pos)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class GoodStorage(StorageBackend):
    name = "good"
    file_class: type[GoodFile] = GoodFile

    def open(self, path: str | Path) -> StorageFile:
        return self.file_class(self, Path(path))


# ---- one thing wrong each -------------------------------------------------------------------
class _ShortAtEofFile(GoodFile):
    def _range(self, offset: int, n: int) -> None:
        if offset < 0 or offset > self.size:  # the end of the range is never checked
            raise StorageError(f"{self.path}: offset {offset} is outside the file")

    def _fill(self, fd: int, offset: int, view: np.ndarray) -> None:
        done = 0
        while done < view.nbytes:
            got = self._pread(fd, view[done:], offset + done)
            if got == 0:
                return  # end of file: what arrived is what there is
            done += got


class ShortAtEof(GoodStorage):
    file_class = _ShortAtEofFile


class _DropLowBitsFile(GoodFile):
    above = MiB

    def _fill(self, fd: int, offset: int, view: np.ndarray) -> None:
        if view.nbytes > self.above:
            offset &= ~4095  # "large reads go page-aligned" (and land at the wrong place)
        super()._fill(fd, offset, view)


class DropLowBits(GoodStorage):
    file_class = _DropLowBitsFile


class _DropLowBitsSmallFile(_DropLowBitsFile):
    above = 16384


class DropLowBitsSmall(GoodStorage):
    """``drop-low-bits`` from 16 KiB up (the tiny test model's reads are small)."""

    file_class = _DropLowBitsSmallFile


class _SharedPositionFile(GoodFile):
    def _pread(self, fd: int, dest: np.ndarray, pos: int) -> int:
        os.lseek(fd, pos, os.SEEK_SET)  # one position, shared by every thread
        return os.readv(fd, [dest.data])


class SharedPosition(GoodStorage):
    file_class = _SharedPositionFile


class StaleCache(GoodStorage):
    """Whole files cached by path on first open, for ever."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, bytes] = {}

    def open(self, path: str | Path) -> StorageFile:
        f = GoodFile(self, Path(path))
        key = str(path)
        if key not in self.cache:
            data = np.empty(f.size, dtype=np.uint8)
            f.read_into(0, data)
            self.cache[key] = data.tobytes()
        f.close()
        return _CachedFile(self, Path(path), self.cache[key])


class _CachedFile(StorageFile):
    def __init__(self, backend: StaleCache, path: Path, data: bytes) -> None:
        self.path, self.size = path, len(data)
        self._backend, self._data, self._closed = backend, data, False

    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        view = byte_view(out)
        if self._closed:
            raise StorageError(f"{self.path}: read after close")
        if offset < 0 or offset + view.nbytes > self.size:
            raise StorageError(f"{self.path}: outside the file")
        with self._backend.timed() as t:
            view[:] = np.frombuffer(self._data, np.uint8, view.nbytes, offset)
            t.nbytes = view.nbytes

    def close(self) -> None:
        self._closed = True


class _LeakyFile(GoodFile):
    def close(self) -> None:
        self._fd = None  # forgets to os.close() it


class Leaky(GoodStorage):
    file_class = _LeakyFile


class _PlainExceptionFile(GoodFile):
    @staticmethod
    def _open_error(path: Path, exc: OSError) -> Exception:
        return Exception(f"{path}: {exc.strerror}")


class PlainException(GoodStorage):
    file_class = _PlainExceptionFile


class _KeepsResidentFile(GoodFile):
    def __init__(self, backend: GoodStorage, path: Path) -> None:
        super().__init__(backend, path)
        self.kept: list[bytes] = []

    def _fill(self, fd: int, offset: int, view: np.ndarray) -> None:
        super()._fill(fd, offset, view)
        self.kept.append(view.tobytes())  # "for the next read of the same range"


class KeepsResident(GoodStorage):
    file_class = _KeepsResidentFile


class _UncountedFile(GoodFile):
    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        view = byte_view(out)
        self._range(offset, view.nbytes)
        if self._fd is None:
            raise StorageError(f"{self.path}: read after close")
        self._fill(self._fd, offset, view)


class Uncounted(GoodStorage):
    file_class = _UncountedFile


class _ThreadCrashFile(GoodFile):
    def __init__(self, backend: GoodStorage, path: Path) -> None:
        super().__init__(backend, path)

        def warm() -> None:  # a "read-ahead" thread with a bug
            os.posix_fadvise(self._fd, 0, self.size, "WILLNEED")  # type: ignore[arg-type]

        self._helper = threading.Thread(target=warm, name="read-ahead")
        self._helper.start()

    def close(self) -> None:
        self._helper.join()
        super().close()


class ThreadCrash(GoodStorage):
    file_class = _ThreadCrashFile


VARIANTS: dict[str, type[StorageBackend]] = {
    "good": GoodStorage,
    "short-at-eof": ShortAtEof,
    "drop-low-bits": DropLowBits,
    "shared-position": SharedPosition,
    "stale-cache": StaleCache,
    "leaky": Leaky,
    "plain-exception": PlainException,
    "keeps-resident": KeepsResident,
    "uncounted": Uncounted,
    "thread-crash": ThreadCrash,
}
