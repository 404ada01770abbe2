"""The storage interface: read a byte range of a file into a caller-provided buffer.

Every byte k3 takes from disk (checkpoint tensors, packed trunk layers, routed experts)
goes through a :class:`StorageBackend`. A read either fills the whole buffer with the
file's bytes or raises :class:`k3core.api.errors.StorageError`; short reads are retried to
completion, and a failed read is never handed on. Backends keep :class:`IOStats`.

The memory plan counts the caller's buffers, not the backend's: a backend must not keep what
it read resident in this process once the read returned (the page cache is the kernel's, not
the process's; a memory-mapping backend unmaps or advises away each range it copied out).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from k3core.api.errors import StorageError
from k3core.api.units import ALIGN

Buffer = np.ndarray | memoryview


@dataclass
class IOStats:
    """Bytes, seconds and calls, accumulated from any number of threads."""

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.seconds += seconds
            self.calls += 1

    def snapshot(self) -> tuple[int, float, int]:
        with self._lock:
            return self.bytes, self.seconds, self.calls

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


class StorageFile(ABC):
    """One open file. ``read_into`` may be called from several threads at once."""

    path: Path
    size: int
    #: the block size this file reads natively: a read of whole blocks at an aligned offset
    #: into a buffer aligned to it is one request, any other read may cost more (unbuffered
    #: files read each unaligned end through a bounce buffer: a request of its own). 1: every
    #: range is as cheap
    alignment: int = 1

    @abstractmethod
    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        """Fill ``out`` (a writable contiguous byte buffer) with bytes ``[offset, offset+len)``.

        Raises ``StorageError`` if the range lies outside the file or the read fails or
        comes back short after retries; ``out`` must then be considered garbage.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the file. Idempotent; a later ``read_into`` raises ``StorageError``.

        Must not race reads in flight on other threads.
        """

    def read_many(self, reads: Sequence[tuple[int, Buffer]], depth: int = 4) -> list[StorageError | None]:
        """Do several ``read_into(offset, out)`` with up to ``depth`` reads in flight.

        This is the queue-depth-N read (one thread per slot, each a blocking read that
        releases the GIL). Reads are issued in file-offset order. Returns, in request order,
        ``None`` for a read that filled its buffer and the ``StorageError`` for one that did
        not (its buffer is garbage), so a caller can publish exactly what arrived. Anything
        other than a ``StorageError`` is a bug and is re-raised after every read has ended.
        Backends may override this with a native batch (io_uring, overlapped I/O).
        """
        if depth < 1:
            raise StorageError(f"read queue depth must be >= 1, got {depth}")
        order = sorted(range(len(reads)), key=lambda i: reads[i][0])
        results: list[StorageError | None] = [None] * len(reads)
        bugs: list[BaseException] = []

        def one(i: int) -> None:
            offset, out = reads[i]
            try:
                self.read_into(offset, out)
            except StorageError as exc:
                results[i] = exc
            except BaseException as exc:  # re-raised below, after the other reads end
                bugs.append(exc)

        if depth == 1 or len(reads) <= 1:
            for i in order:
                one(i)
        else:
            with ThreadPoolExecutor(max_workers=min(depth, len(reads))) as pool:
                list(pool.map(one, order))
        if bugs:
            raise bugs[0]
        return results

    def __enter__(self) -> StorageFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StorageBackend(ABC):
    """A way of reading files (mmap, O_DIRECT, Windows unbuffered, ...)."""

    name: str = "?"
    #: buffer alignment this backend prefers for destination buffers (bytes)
    alignment: int = 64

    def __init__(self) -> None:
        self.stats = IOStats()

    @abstractmethod
    def open(self, path: str | Path) -> StorageFile: ...

    def timed(self) -> _Timer:
        return _Timer(self.stats)


class _Timer:
    def __init__(self, stats: IOStats):
        self.stats = stats
        self.nbytes = 0

    def __enter__(self) -> _Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.stats.add(self.nbytes, time.perf_counter() - self.t0)


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A ``uint8`` array of ``nbytes`` whose data pointer is a multiple of ``align``."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


def byte_view(out: Buffer) -> np.ndarray:
    """``out`` as a writable 1-D ``uint8`` array over the same memory.

    Accepts a C-contiguous numpy array of any dtype, a memoryview or anything else with
    the buffer protocol; raises ``StorageError`` for a read-only or non-contiguous buffer.
    """
    if isinstance(out, np.ndarray):
        arr = out
    else:
        try:
            arr = np.frombuffer(out, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as exc:
            raise StorageError(f"read destination is not a contiguous byte buffer: {exc}") from exc
    if not arr.flags.c_contiguous:
        raise StorageError("read destination is not C-contiguous")
    if not arr.flags.writeable:
        raise StorageError("read destination is read-only")
    return arr.reshape(-1).view(np.uint8)


def checked_destination(path: Path, size: int, closed: bool, offset: int, out: Buffer) -> np.ndarray:
    """The byte view of ``out`` for a read of it at ``offset``, or ``StorageError`` when the
    file is closed or the range is outside it (the checks every backend makes first)."""
    if closed:
        raise StorageError(f"{path}: read after close")
    dst = byte_view(out)
    n = dst.size
    if offset < 0 or offset + n > size:
        raise StorageError(f"{path}: read [{offset}, {offset + n}) is outside the file ({size} bytes)")
    return dst
