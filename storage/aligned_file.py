"""What the unbuffered backends (``direct`` and ``unbuffered``) share: the read loop and
the backend around it.

:class:`AlignedFile` is one open file. A subclass supplies two primitives,
:meth:`AlignedFile._pread` (a single positioned read into an aligned buffer at an aligned
offset, returning the byte count, 0 at end of file) and :meth:`AlignedFile.release` (close
the OS handle). Everything else lives here:

* range checks against the file size taken at open;
* when the destination address and the file offset are congruent modulo the alignment,
  the aligned body goes straight into the caller's buffer and only the unaligned head and
  tail blocks go through the bounce buffer;
* otherwise each chunk of the payload is widened to its aligned window
  (:func:`k3_storage.alignment.aligned_window`), read into a per-thread aligned bounce
  buffer and the payload copied out;
* every syscall is capped at ``max_chunk`` (64 MiB by default, never above 1 GiB);
* short reads are retried to completion (from the last aligned position), ``EINTR`` is
  retried, and a zero-byte read before the payload is complete is a ``StorageError``
  naming the file and offset; a short last window past end-of-file is fine only if the
  payload itself arrived.

:class:`AlignedStorage` is the backend: the ``alignment=`` and ``max_chunk=`` options and
their checks, the bounce buffers, and :meth:`AlignedStorage.open` (the OS handle from the
subclass, the file's alignment, the per-file support check: one aligned block read through
the widened path before the file is handed out; a failed open holds nothing), and
:meth:`AlignedStorage.probe_path` (one file of a directory opened that way).
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from abc import abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
from k3_storage.alignment import (
    DEFAULT_CHUNK_BYTES,
    align_down,
    aligned_window,
    chunk_limit,
    chunks,
    is_pow2,
    split_payload,
)

from k3.plugin import (
    ALIGN,
    Availability,
    Buffer,
    IOStats,
    IOTimer,
    StorageBackend,
    StorageError,
    StorageFile,
    aligned_empty,
    checked_destination,
)

#: the smallest alignment a caller may fix (a 512-byte sector); the default is never below
#: :data:`ALIGN`
MIN_FIXED_ALIGN = 512

_MAX_STALLS = 8


class BounceBuffers:
    """One aligned scratch buffer per thread, grown on demand and reused."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int, align: int) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes or buf.ctypes.data % align:
            buf = aligned_empty(max(nbytes, align), max(align, ALIGN))
            self._local.buf = buf
        return buf[:nbytes]


class AlignedFile(StorageFile):
    """An open file read through an unbuffered handle (see the module docstring)."""

    #: what the user should do when the OS refuses unbuffered reads on this file
    refusal_hint = ""

    def __init__(
        self,
        path: Path,
        size: int,
        align: int,
        max_chunk: int,
        stats: IOStats,
        bounce: BounceBuffers,
        handle: Any = None,
    ) -> None:
        self.path = path
        self.size = size
        self.alignment = align
        self.max_chunk = chunk_limit(max_chunk, align)
        self._stats = stats
        self._bounce = bounce
        self._handle = handle  # the OS handle _pread reads and release closes
        self._closed = False

    # ---- the primitives a subclass supplies ------------------------------------------
    @abstractmethod
    def _pread(self, buf: np.ndarray, offset: int) -> int:
        """One positioned read of ``buf.size`` bytes at ``offset`` (both aligned, as is
        ``buf``'s address). Returns the count, 0 at end of file; raises ``OSError``."""

    @staticmethod
    def release(handle: Any) -> None:
        """Close one OS handle this kind of file reads through (also one whose file was
        never built: :meth:`AlignedStorage.open` calls it when building fails)."""
        raise NotImplementedError

    def _close_handle(self) -> None:
        self.release(self._handle)

    # ---- StorageFile -----------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close_handle()

    def read_into(self, offset: int, out: Buffer) -> None:
        dst = checked_destination(self.path, self.size, self._closed, offset, out)
        n = dst.size
        with IOTimer(self._stats) as t:
            if n:
                self._read(offset, dst)
            t.nbytes = n

    # ---- the read plan ---------------------------------------------------------------
    def _read(self, offset: int, dst: np.ndarray) -> None:
        align = self.alignment
        if (dst.ctypes.data - offset) % align == 0:
            sp = split_payload(offset, dst.size, align)
            if sp.body_len:
                b0 = sp.body_offset - offset
                self._fill(dst[b0 : b0 + sp.body_len], sp.body_offset, sp.body_len)
            for piece_off, piece_len in (sp.head, sp.tail):
                if piece_len:
                    lo = piece_off - offset
                    self._bounce_read(piece_off, dst[lo : lo + piece_len])
            return
        for piece_off, piece_len in chunks(offset, dst.size, self.max_chunk):
            lo = piece_off - offset
            self._bounce_read(piece_off, dst[lo : lo + piece_len])

    def _bounce_read(self, offset: int, dst: np.ndarray) -> None:
        w = aligned_window(offset, dst.size, self.size, self.alignment)
        buf = self._bounce.get(w.length, self.alignment)
        self._fill(buf, w.start, w.required, w.expected)
        dst[:] = buf[w.payload_offset : w.payload_offset + w.nbytes]

    def _fill(self, buf: np.ndarray, start: int, required: int, expected: int = -1) -> None:
        """Read ``buf.size`` (aligned) bytes at aligned ``start`` into aligned ``buf``.

        Stops at ``expected`` bytes (default: all of ``buf``); fails unless at least
        ``required`` bytes arrived.
        """
        if expected < 0:
            expected = buf.size
        got = 0
        stalls = 0
        while got < expected:
            pos = align_down(got, self.alignment)  # a short read may end unaligned
            n = min(self.max_chunk, buf.size - pos)
            try:
                r = self._pread(buf[pos : pos + n], start + pos)
            except InterruptedError:
                continue
            except OSError as exc:
                raise self._os_error(exc, start + pos, n) from exc
            if r == 0:
                break
            if pos + r <= got:
                stalls += 1
                if stalls > _MAX_STALLS:
                    break
                continue
            got = pos + r
        if got < required:
            raise StorageError(
                f"{self.path}: short read at offset {start + got}: the file ended or the "
                f"device returned nothing after {got} of {required} bytes of the read at "
                f"offset {start} (was the file truncated or replaced?)"
            )

    def _os_error(self, exc: OSError, offset: int, n: int) -> StorageError:
        what = f"{self.path}: read of {n} bytes at offset {offset} failed: {exc.strerror or exc}"
        if exc.errno == errno.EINVAL and self.refusal_hint:
            return StorageError(
                f"{what} (the filesystem refuses unbuffered reads here)", hint=self.refusal_hint
            )
        return StorageError(what)


class AlignedStorage(StorageBackend):
    """A backend whose files are :class:`AlignedFile` (see the module docstring).

    A subclass sets ``name``, ``file_class`` and ``refusal_hint`` and supplies
    :meth:`_check_platform`, :meth:`_open_handle` and, where the device says,
    :meth:`native_alignment`. ``alignment=None`` asks the device for each file (never below
    :data:`ALIGN`); a fixed alignment is a power of two of at least 512 bytes.
    """

    alignment = ALIGN
    file_class: type[AlignedFile]
    #: the fix to show when this backend cannot read a file (or a filesystem)
    refusal_hint = ""

    def __init__(self, alignment: int | None = None, max_chunk: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__()
        self._check_platform()
        if alignment is not None:
            if not is_pow2(alignment) or alignment < MIN_FIXED_ALIGN:
                raise StorageError(f"{self.name} storage: alignment {alignment} is not a power "
                                   f"of two of at least {MIN_FIXED_ALIGN}")
            self.alignment = alignment
        if max_chunk <= 0:
            raise StorageError(f"{self.name} storage: max_chunk must be positive, got {max_chunk}")
        self._fixed_align = alignment
        self.max_chunk = max_chunk
        self._bounce = BounceBuffers()

    # ---- what a subclass supplies ----------------------------------------------------
    @abstractmethod
    def _check_platform(self) -> None:
        """Raise ``StorageError`` (with the fix) where this backend cannot run at all."""

    @abstractmethod
    def _open_handle(self, path: Path) -> tuple[Any, int]:
        """Open ``path`` unbuffered: ``(handle, size in bytes)``, or ``StorageError`` holding
        nothing (missing, a directory, not a regular file, no permission, refused)."""

    def native_alignment(self, path: Path) -> int:
        """The alignment the device holding ``path`` needs (never below :data:`ALIGN`)."""
        return ALIGN

    # ---- StorageBackend ----------------------------------------------------------------
    def open(self, path: str | Path) -> AlignedFile:
        p = Path(path)
        handle, size = self._open_handle(p)
        try:
            align = self._fixed_align or self.native_alignment(p)
            f = self.file_class(p, size, align, self.max_chunk, self.stats, self._bounce, handle)
        except BaseException:
            self.file_class.release(handle)
            raise
        try:
            if size:  # the per-file support check: one aligned block, the widened path
                f._bounce_read(0, np.empty(1, dtype=np.uint8))
        except BaseException:
            f.close()
            raise
        return f

    @classmethod
    def probe_path(cls, path: Path) -> Availability:
        """Can this backend read ``path`` (a file, or a directory: one of its files is tried,
        ``.safetensors`` first; one without a non-empty regular file is tried with a small
        temporary file, removed again)?"""
        try:
            backend = cls()
        except StorageError as exc:
            return Availability.no(exc.message, exc.hint or cls.refusal_hint)
        p = Path(path)
        if p.is_dir():
            try:
                files = sorted(
                    (c for c in p.iterdir() if c.is_file() and c.stat().st_size > 0),
                    key=lambda c: (c.suffix != ".safetensors", c.name),
                )
            except OSError as exc:
                return Availability.no(f"cannot list {p}: {exc.strerror or exc}",
                                       cls.refusal_hint)
            if not files:
                return backend._probe_temp(p)
            p = files[0]
        try:
            backend.open(p).close()
        except StorageError as exc:
            return Availability.no(exc.message, exc.hint or cls.refusal_hint)
        return Availability.yes()

    def _probe_temp(self, directory: Path) -> Availability:
        try:
            fd, name = tempfile.mkstemp(prefix=f".k3-{self.name}-", dir=directory)
        except OSError as exc:
            return Availability.no(
                f"cannot test {self.name} reads in {directory}: no file to read and not "
                f"writable ({exc})", self.refusal_hint)
        try:
            try:
                os.write(fd, b"\0" * ALIGN)
            finally:
                os.close(fd)
            return self.probe_path(Path(name))
        finally:
            os.unlink(name)
