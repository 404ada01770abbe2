"""The read loop shared by the unbuffered backends (``direct`` and ``unbuffered``).

A subclass supplies one primitive, :meth:`AlignedFile._pread`: a single positioned read
into an aligned buffer at an aligned offset, returning the byte count (0 at end of file).
Everything else lives here:

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
"""

from __future__ import annotations

import errno
import threading
from abc import abstractmethod
from pathlib import Path

import numpy as np
from k3_storage.alignment import (
    align_down,
    aligned_window,
    chunk_limit,
    chunks,
    split_payload,
)

from k3.plugin import (
    Buffer,
    IOStats,
    IOTimer,
    StorageError,
    StorageFile,
    aligned_empty,
    checked_destination,
)

_MAX_STALLS = 8


class BounceBuffers:
    """One aligned scratch buffer per thread, grown on demand and reused."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int, align: int) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes or buf.ctypes.data % align:
            buf = aligned_empty(max(nbytes, align), max(align, 4096))
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
    ) -> None:
        self.path = path
        self.size = size
        self.alignment = align
        self.max_chunk = chunk_limit(max_chunk, align)
        self._stats = stats
        self._bounce = bounce
        self._closed = False

    # ---- the primitive a subclass supplies -------------------------------------------
    @abstractmethod
    def _pread(self, buf: np.ndarray, offset: int) -> int:
        """One positioned read of ``buf.size`` bytes at ``offset`` (both aligned, as is
        ``buf``'s address). Returns the count, 0 at end of file; raises ``OSError``."""

    @abstractmethod
    def _close_handle(self) -> None: ...

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
