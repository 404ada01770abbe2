"""The storage interface: read a byte range of a file into a caller-provided buffer.

Every byte k3 takes from disk (checkpoint tensors, packed trunk layers, routed experts)
goes through a :class:`StorageBackend`. This module is the storage contract; a plugin reaches
the same classes as :mod:`k3.plugin` names them (``StorageBackend``, ``StorageFile``,
``IOStats``, ``IOTimer``). The whole contract is the docstring of :class:`StorageBackend`
(``help(k3.plugin.StorageBackend)``), each method's its own part; the shipped suite
:class:`k3.testing.StorageConformance` checks every rule of it that a test can observe.
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
from k3core.api.specs import Availability
from k3core.api.units import ALIGN

Buffer = np.ndarray | memoryview


@dataclass
class IOStats:
    """Bytes, seconds and calls, accumulated from any number of threads.

    ``calls`` counts ``read_into`` calls that returned (not system calls), ``bytes`` their
    buffers' lengths, ``seconds`` the wall time spent inside them (summed over threads, so
    it can exceed the elapsed time). Add to it through :class:`IOTimer` or :meth:`add`.
    """

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, seconds: float) -> None:
        """Count one call of ``nbytes`` that took ``seconds`` (thread-safe)."""
        with self._lock:
            self.bytes += nbytes
            self.seconds += seconds
            self.calls += 1

    def snapshot(self) -> tuple[int, float, int]:
        """``(bytes, seconds, calls)`` read together."""
        with self._lock:
            return self.bytes, self.seconds, self.calls

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


class IOTimer:
    """Times one read into an :class:`IOStats`: ``with IOTimer(stats) as t: ...; t.nbytes = n``.

    On a normal exit it adds one call of ``t.nbytes`` bytes and the elapsed seconds; when
    the block raises it adds nothing (a failed read is not counted). Set ``nbytes`` to the
    buffer's length once the read is complete. :meth:`StorageBackend.timed` is the same
    over the backend's own ``stats``.
    """

    def __init__(self, stats: IOStats):
        self.stats = stats
        self.nbytes = 0
        self.t0 = 0.0

    def __enter__(self) -> IOTimer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.stats.add(self.nbytes, time.perf_counter() - self.t0)


class StorageFile(ABC):
    """One open file (the whole contract is :class:`StorageBackend`'s docstring).

    ``path`` is the path it was opened as, ``size`` its length in bytes when it was opened:
    every range check is against ``size``. ``read_into`` and ``read_many`` may be called
    from several threads at once; ``close`` is never called while a read is in flight (the
    caller guarantees it). A ``StorageFile`` is a context manager that closes it.
    """

    path: Path
    size: int
    #: the block size this file reads natively: a read of whole blocks at an aligned offset
    #: into a buffer aligned to it is one request, any other read may cost more (unbuffered
    #: files read each unaligned end through a bounce buffer: a request of its own). 1: every
    #: range is as cheap. A hint for callers placing buffers, never a requirement
    alignment: int = 1

    @abstractmethod
    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        """Fill ``out`` (a writable contiguous byte buffer) with bytes ``[offset, offset+len)``.

        ``out`` may be a numpy array of any dtype or a ``memoryview``, at any address and of
        any length (0 too); :func:`byte_view` turns it into bytes and refuses a read-only or
        non-contiguous one. Safe to call from several threads at once on this file: no
        shared file position.

        Raises ``StorageError`` (naming the file, the offset and the length) when the range
        lies outside ``[0, size]``, after ``close``, when the OS fails the read, or when the
        file ends before the range is complete (it was truncated after open); short reads
        are retried to completion, never returned. After a ``StorageError`` ``out`` is
        garbage. A read that returns counts one call and ``len(out)`` bytes in the backend's
        ``stats`` (use :class:`IOTimer`); one that raises counts nothing.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the file's OS handles. Idempotent; a later ``read_into`` raises ``StorageError``.

        The caller serialises ``close`` against reads: k3 never closes a file while a read of
        it is in flight on another thread (its readers are joined first), so ``close`` need
        not wait for reads. Whatever happens, every descriptor or handle ``open`` took is
        released exactly once.
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
    """A way of reading files (positional reads, mmap, O_DIRECT, Windows unbuffered, ...).

    The registry builds one with no arguments (its spec's ``factory``) and the engine opens
    every shard and the packed trunk through it; ``stats`` accumulates every file's reads.
    The contract, checked by :class:`k3.testing.StorageConformance`:

    * **open.** :meth:`open` returns a :class:`StorageFile` for an existing regular file,
      with ``path`` and ``size`` (bytes at open), or raises ``StorageError`` (a missing
      file, a directory, anything not a regular file, no permission, any ``OSError``),
      holding nothing afterwards. Every open reads the file as it is now: a file replaced
      at the same path since an earlier open reads the new bytes (nothing cached by path).
    * **read.** :meth:`StorageFile.read_into` fills the **whole** caller buffer with bytes
      ``[offset, offset + len(out))`` or raises ``StorageError``: a range outside the file
      as opened, a read after ``close``, a failed read, end of file before the range is
      complete (a file truncated after open). Short reads are retried to completion; a
      failed read is never handed on (the buffer is then garbage). Any length (0 up to the
      whole file in one call: the engine reads whole trunk parts of hundreds of MB) at any
      offset, into any writable C-contiguous buffer (a numpy array of any dtype, or a
      ``memoryview`` of a ``bytearray`` or any other writable buffer) at any address; a
      read-only or non-contiguous buffer is refused with ``StorageError``. ``alignment``
      is a speed hint, never a requirement.
    * **threads.** ``read_into`` (and ``read_many``) may be called from many threads at
      once on one open file: reads share no file position (positional reads, or a lock
      around a seek and its read). ``open`` may be called from any thread.
    * **close.** :meth:`StorageFile.close` releases every OS handle of the file; it is
      idempotent, and a later ``read_into`` raises ``StorageError``. **The caller
      serialises close against reads**: k3 never calls ``close`` while a read of that file
      is in flight (its reader threads are joined first), so a backend need not wait for
      reads; one that does (a guard against a misbehaving caller) is welcome.
    * **residency.** The memory plan counts the caller's buffers, not the backend's: once
      a read returned, the backend keeps nothing it read resident in this process (no read
      cache, no mapping left in place; a memory-mapping backend unmaps or advises away
      each range it copied out). Bounded scratch (a bounce buffer per reading thread) is
      fine. The page cache is the kernel's, not the process's.
    * **stats.** ``stats`` is an :class:`IOStats`; every ``read_into`` that returns adds
      one *call* (however many system calls it took; a zero-length read too) and its
      buffer's length in *bytes*, and a read that raised adds nothing: exactly what
      ``with backend.timed() as t: ...; t.nbytes = n`` around the read does
      (:class:`IOTimer`). A wrapping backend may share its inner backend's ``stats``.
    * **path probe (optional).** :meth:`probe_path` says whether the backend can read the
      files at a path (a model directory or one file) on the filesystem they live on; the
      default says yes. When the storage choice is ``auto``, the engine's plan asks each
      candidate, best first, for the model directory, and skips one that says no (with its
      reason in the plan's notes). An explicit choice is never probed: it fails at
      :meth:`open` with its own ``StorageError``.
    """

    name: str = "?"
    #: buffer alignment this backend prefers for destination buffers (bytes); a hint
    alignment: int = 64

    def __init__(self) -> None:
        self.stats = IOStats()

    @abstractmethod
    def open(self, path: str | Path) -> StorageFile:
        """Open ``path`` for reading: a :class:`StorageFile` with ``path`` and ``size`` set.

        Raises ``StorageError`` with a message naming the path when it cannot be read: it
        does not exist, is a directory or anything but a regular file, permission is
        denied, or the OS refuses it for another reason (never a bare ``OSError``); a
        failed open holds no descriptor afterwards. Each open reads the file as it is now
        (a file replaced at the same path since an earlier open reads the new bytes). May
        be called from any thread.
        """

    @classmethod
    def probe_path(cls, path: Path) -> Availability:
        """Can this backend read the files at ``path`` (a directory: the files in it)?

        Optional; the default says yes. Override it where the answer depends on the
        filesystem (``direct``: the filesystem must accept ``O_DIRECT``): open one file
        there, never read a whole model. Called on the class, with no instance built;
        ``Availability.no(reason, hint)`` when it cannot, never an exception.
        """
        return Availability.yes()

    def timed(self) -> IOTimer:
        """An :class:`IOTimer` over this backend's ``stats``: wrap one whole ``read_into``
        in it and set ``nbytes`` when the read is complete."""
        return IOTimer(self.stats)


def aligned_empty(nbytes: int, align: int = ALIGN, zeroed: bool = False) -> np.ndarray:
    """A ``uint8`` array of ``nbytes`` whose data pointer is a multiple of ``align``; with
    ``zeroed`` its bytes are zero (``np.zeros``: zero pages mapped lazily, nothing touched)."""
    raw = (np.zeros if zeroed else np.empty)(nbytes + align, dtype=np.uint8)
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
