"""The window table of a compressed trunk layer, and reading a layer through it.

A layer packed with a codec (:mod:`k3core.trunk.codec`) is cut into *windows*: each lies
inside one tensor (a tensor of more than :data:`WINDOW_BYTES` is several windows), the
windows tile the layer's run ``[0, span)`` in order, and each is encoded on its own, so any
window (and so any tensor, or any part of a layer made of whole tensors) decodes without
the others. The encoded windows follow one another from the layer's 4096-aligned
``file_off``; the run of ``stored`` bytes is padded to ``file_nbytes``. In ``trunk.json``
a window is ``[raw_len, stored_len]``; the offsets are the running sums, and
``stored_len == raw_len`` means the window is stored raw (its encoding was not smaller).

:func:`staged_windows`, :func:`prefetched_windows` and :func:`in_place_windows` read a
layer's encoded bytes (:class:`CodedWindows`) in aligned chunks of about :data:`READ_CHUNK`
(whole windows; O_DIRECT needs no fix-up because a layer's run is aligned and padded) and
decode each window into the destination the caller gives (the ring slot, a pinned buffer,
or a scratch window for ``--verify-trunk``): one chunk at a time through a staging buffer,
the next chunk read on a prefetch thread while this one decodes, or every chunk read in
place in the destination's tail by one job while this thread decodes those that landed.
A window that does not decode is a ``CheckpointError`` naming the layer and the window; a
window that decodes to wrong bytes is caught by the layer's CRC-32 of its raw bytes, which
the caller checks exactly as for an uncompressed trunk.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3core.api.errors import CheckpointError
from k3core.api.storage import StorageFile
from k3core.api.units import ALIGN, align_up
from k3core.trunk.codec import Codec, CodecError

#: raw bytes per window at pack time (a tensor's last window may be shorter)
WINDOW_BYTES = 1 << 20
#: the largest raw window a manifest may describe (bounds one decode's output)
MAX_WINDOW_BYTES = 64 << 20
MAX_WINDOWS_PER_LAYER = 1 << 22
#: encoded bytes read per chunk (whole windows; one window larger than this is one chunk)
READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class Window:
    raw_off: int  # relative to the layer's run
    raw_len: int
    off: int  # relative to the layer's file_off
    nbytes: int  # stored (encoded) bytes
    itemsize: int  # of the tensor it lies in

    @property
    def stored_raw(self) -> bool:
        return self.nbytes == self.raw_len


def plan_windows(tensors: list[tuple[int, int, int]], window: int = WINDOW_BYTES
                 ) -> list[tuple[int, int, int]]:
    """``(raw_off, raw_len, itemsize)`` windows over ``(off, nbytes, itemsize)`` tensors
    sorted by offset and tiling the run."""
    out = []
    for off, nbytes, itemsize in tensors:
        step = max(itemsize, window // itemsize * itemsize)
        for a in range(off, off + nbytes, step):
            out.append((a, min(step, off + nbytes - a), itemsize))
    return out


class WindowTableError(ValueError):
    """A window table that does not describe the layer (the manifest parser names it)."""


def parse_windows(raw: object, span: int, stored: int,
                  tensors: list[tuple[int, int, int]]) -> tuple[Window, ...]:
    """Check a manifest's ``windows`` list against the layer's ``span``, ``stored`` bytes
    and its ``(off, nbytes, itemsize)`` tensors; ``WindowTableError`` names the problem."""
    if not isinstance(raw, list) or not raw:
        raise WindowTableError("windows must be a non-empty list")
    if len(raw) > MAX_WINDOWS_PER_LAYER:
        raise WindowTableError(f"{len(raw)} windows is more than {MAX_WINDOWS_PER_LAYER}")
    spans = sorted(tensors)
    out: list[Window] = []
    raw_off = off = 0
    k = 0  # the tensor the current window starts in
    for i, w in enumerate(raw):
        if (not isinstance(w, list) or len(w) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in w)):
            raise WindowTableError(f"windows[{i}] must be [raw_len, stored_len] integers")
        rl, sl = w
        if not 1 <= rl <= MAX_WINDOW_BYTES:
            raise WindowTableError(f"windows[{i}]: raw_len {rl} is out of range "
                                   f"1..{MAX_WINDOW_BYTES}")
        if not 1 <= sl <= rl:
            raise WindowTableError(f"windows[{i}]: stored_len {sl} is out of range 1..{rl}")
        while k < len(spans) and spans[k][0] + spans[k][1] <= raw_off:
            k += 1
        if k == len(spans) or not spans[k][0] <= raw_off < raw_off + rl <= sum(spans[k][:2]):
            raise WindowTableError(f"windows[{i}] (raw bytes [{raw_off}, {raw_off + rl})) "
                                   "does not lie inside one tensor")
        out.append(Window(raw_off, rl, off, sl, spans[k][2]))
        raw_off += rl
        off += sl
    if raw_off != span:
        raise WindowTableError(f"windows cover {raw_off} raw bytes, not the span {span}")
    if off != stored:
        raise WindowTableError(f"windows hold {off} stored bytes, not {stored}")
    return tuple(out)


def chunks(windows: tuple[Window, ...], limit: int = READ_CHUNK) -> list[tuple[int, int]]:
    """``[first, last)`` index ranges of consecutive windows, each about ``limit`` stored bytes."""
    out = []
    i = 0
    while i < len(windows):
        j, size = i, 0
        while j < len(windows) and (j == i or size + windows[j].nbytes <= limit):
            size += windows[j].nbytes
            j += 1
        out.append((i, j))
        i = j
    return out


def _aligned_range(windows: tuple[Window, ...], a: int, b: int) -> tuple[int, int]:
    start = windows[a].off // ALIGN * ALIGN
    return start, align_up(windows[b - 1].off + windows[b - 1].nbytes) - start


def staging_bytes(windows: tuple[Window, ...], limit: int = READ_CHUNK) -> int:
    """The staging buffer one layer's chunked reads need."""
    return max((_aligned_range(windows, a, b)[1] for a, b in chunks(windows, limit)),
               default=ALIGN)


def linear_bytes(windows: tuple[Window, ...]) -> int:
    """The staging a *linear* read of ``windows`` needs (each chunk read where it lies, as
    :func:`in_place_windows` and the ring's I/O thread read): all their aligned bytes."""
    return _aligned_range(windows, 0, len(windows))[1] if windows else 0


def in_place_offset(windows: tuple[Window, ...], start: int, size: int) -> int | None:
    """Where in a destination of ``size`` bytes, which receives raw ``[start, ...)`` of the
    layer, the encoded ``windows`` can be read so that each decodes in place: the
    4096-aligned offset at the end of the buffer, provided every window's decoded bytes end
    at or before its encoded bytes begin (then no decode overwrites input not yet decoded,
    and no read of a later chunk lands on decoded bytes). ``None`` when that does not hold;
    the caller then stages the reads elsewhere.

    Since no window's encoding is longer than its raw bytes, ``size`` of the raw bytes plus
    the largest window's stored bytes plus three pages always suffices."""
    if not windows:
        return None
    base, need = _aligned_range(windows, 0, len(windows))
    if need > size:
        return None
    at = (size - need) // ALIGN * ALIGN
    for w in windows:
        if w.raw_off + w.raw_len - start > at + w.off - base:
            return None
    return at


@dataclass(frozen=True)
class CodedWindows:
    """Encoded windows of one layer (all of them, or those meeting a raw range) in
    ``trunk.bin``: what reading and decoding them needs, the file and codec, and what a
    refusal names."""

    f: StorageFile
    bin_path: Path
    layer: int
    file_off: int  # the layer's, which the windows' ``off`` is relative to
    windows: tuple[Window, ...]
    codec: Codec

    def decode(self, buf: np.ndarray, start: int, a: int, b: int,
               dest: Callable[[Window], np.ndarray]) -> Iterator[Window]:
        """:func:`decode_chunk` of ``windows[a:b]``, whose encoded bytes lie in ``buf`` from
        the stored offset ``start``."""
        return decode_chunk(buf, start, self.windows, a, b, self.codec, dest, self.bin_path,
                            self.layer)


# Three ways to read and decode a layer's windows, each yielding every window once it is
# decoded into ``dest(window)``. Storage errors propagate; a window that does not decode is
# a ``CheckpointError``. ``gate``, when given, is called before each chunk's read (the
# ring's reader threads pass the demand gate,
# :meth:`k3core.api.read_priority.ReadPriority.wait_for_demand`, so a routed expert the MoE
# waits for is not queued behind a chunk read ahead).
def staged_windows(src: CodedWindows, staging: np.ndarray, dest: Callable[[Window], np.ndarray],
                   gate: Callable[[], object] | None = None) -> Iterator[Window]:
    """One chunk at a time: each read into ``staging`` (:func:`staging_bytes`), then decoded."""
    parts = chunks(src.windows)
    read = _staged_reader(src, (staging,), parts, gate)
    for k, (a, b) in enumerate(parts):
        read(k)
        yield from src.decode(staging, _aligned_range(src.windows, a, b)[0], a, b, dest)


def prefetched_windows(src: CodedWindows, staging: np.ndarray,
                       dest: Callable[[Window], np.ndarray], prefetch: Executor,
                       gate: Callable[[], object] | None = None) -> Iterator[Window]:
    """The next chunk read on ``prefetch`` (one thread) into the other half of ``staging``
    (two chunks, twice :func:`staging_bytes`) while this one decodes, so a layer costs about
    the larger of its read and its decode rather than their sum."""
    parts = chunks(src.windows)
    half = staging.size // 2
    bufs = (staging[:half], staging[half : 2 * half])
    read = _staged_reader(src, bufs, parts, gate)
    pending: Future[None] | None = None
    try:
        read(0)  # the first chunk here: a one-chunk layer never waits on another thread
        for k, (a, b) in enumerate(parts):
            if pending is not None:
                done, pending = pending, None
                done.result()
            if k + 1 < len(parts):
                pending = prefetch.submit(read, k + 1)
            yield from src.decode(bufs[k % 2], _aligned_range(src.windows, a, b)[0], a, b, dest)
    finally:
        if pending is not None:  # never leave a read running into a buffer we hand back
            with contextlib.suppress(BaseException):
                pending.result()


def in_place_windows(src: CodedWindows, staging: np.ndarray,
                     dest: Callable[[Window], np.ndarray], prefetch: Executor,
                     gate: Callable[[], object] | None = None) -> Iterator[Window]:
    """Every chunk read where it lies in ``staging``, which holds all of the windows'
    aligned bytes at once (:func:`linear_bytes`) and is never reread, so it may be the tail
    of the destination itself when every window decodes below its own input
    (:func:`in_place_offset`). Every chunk has a place of its own, so one job on
    ``prefetch`` reads all chunks after the first back to back (:class:`Landing`) while
    this thread decodes the ones that have landed: the disk never waits for a decode or for
    a hand-off between two threads."""
    parts = chunks(src.windows)
    base = linear_base(src.windows)
    read = linear_reader(src, staging, parts, gate)
    pending: Future[None] | None = None
    landing: Landing | None = None
    try:
        read(0)  # the first chunk here: a one-chunk layer never waits on another thread
        if len(parts) > 1:
            landing = Landing(first=1)
            pending = prefetch.submit(landing.read_all, read, len(parts))
        for k, (a, b) in enumerate(parts):
            if landing is not None and k:
                landing.wait_for(k)
            yield from src.decode(staging, base, a, b, dest)
    finally:
        if landing is not None:  # no further chunk is started once we stop early
            landing.stop()
        if pending is not None:  # never leave a read running into a buffer we hand back
            with contextlib.suppress(BaseException):
                pending.result()


def _staged_reader(src: CodedWindows, bufs: tuple[np.ndarray, ...], parts: list[tuple[int, int]],
                   gate: Callable[[], object] | None) -> Callable[[int], None]:
    """The read of chunk ``k`` (its aligned range) into ``bufs[k % len(bufs)]``."""

    def read(k: int) -> None:
        if gate is not None:
            gate()
        start, length = _aligned_range(src.windows, *parts[k])
        src.f.read_into(src.file_off + start, bufs[k % len(bufs)][:length])

    return read


def linear_reader(src: CodedWindows, staging: np.ndarray, parts: list[tuple[int, int]],
                  gate: Callable[[], object] | None = None) -> Callable[[int], None]:
    """The read of chunk ``k`` of a *linear* read (``parts``: :func:`chunks` of the windows,
    the same chunks the decoder cuts): ``staging`` holds all of the windows' aligned bytes
    (:func:`linear_bytes`), each chunk is read where it lies, from where the previous
    chunk's read ended (no page is read twice). ``gate`` is called before each read."""
    windows = src.windows
    base = linear_base(windows)

    def read(k: int) -> None:
        if gate is not None:
            gate()
        start, length = _aligned_range(windows, *parts[k])
        lo = max(start, sum(_aligned_range(windows, *parts[k - 1]))) if k else start
        src.f.read_into(src.file_off + lo, staging[lo - base : start + length - base])

    return read


def decode_chunk(buf: np.ndarray, start: int, windows: tuple[Window, ...], a: int, b: int,
                 codec: Codec, dest: Callable[[Window], np.ndarray], bin_path: Path,
                 layer: int) -> Iterator[Window]:
    """Decode ``windows[a:b]``, whose encoded bytes lie in ``buf`` from the layer's stored
    offset ``start``, each into ``dest(window)``, yielding each once it is decoded; a
    window that does not decode is a ``CheckpointError`` naming the layer and window."""
    for i in range(a, b):
        w = windows[i]
        src = buf[w.off - start : w.off - start + w.nbytes]
        out = dest(w)
        if w.stored_raw:
            out[:] = src
        else:
            try:
                codec.decode_into(src, out, w.itemsize)
            except CodecError as exc:
                raise CheckpointError(
                    f"{bin_path}: layer {layer} window {i} (raw bytes [{w.raw_off}, "
                    f"{w.raw_off + w.raw_len})) does not decode: {exc}; the file is "
                    "damaged, repack the trunk") from None
        yield w


def linear_base(windows: tuple[Window, ...]) -> int:
    """The stored offset the staging of a linear read of ``windows`` starts at."""
    return _aligned_range(windows, 0, len(windows))[0] if windows else 0


class LandingStopped(Exception):
    """A chunk waited for that will never land: its read job was stopped first."""


class Landing:
    """The chunks of a linear read that have landed, read in order by one job
    (:meth:`read_all`) while the decoding thread waits for each (:meth:`wait_for`). A read
    that fails ends the job; the error is raised to the decoding thread when it waits for
    that chunk. :meth:`stop` ends the job before its next chunk (the decoder stopped early,
    or the trunk closes): a wait for a chunk that has not landed then raises
    :class:`LandingStopped`, and :meth:`wait_done` returns once the job no longer writes.
    ``first`` chunks are already in (read by the decoding thread itself)."""

    def __init__(self, first: int = 0) -> None:
        self._cond = threading.Condition()
        self._landed = first
        self._error: BaseException | None = None
        self._stopped = False
        self._running = True
        self.seconds = 0.0  # the job's time, its reads and the gate before each

    def read_all(self, read: Callable[[int], None], n: int) -> None:
        t0 = time.perf_counter()
        try:
            for k in range(self._landed, n):
                with self._cond:
                    if self._stopped:
                        return
                try:
                    read(k)
                except BaseException as exc:  # raised where chunk k is awaited
                    with self._cond:
                        self._error = exc
                    return
                with self._cond:
                    self._landed = k + 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self.seconds = time.perf_counter() - t0
                self._running = False
                self._cond.notify_all()

    def wait_for(self, k: int) -> None:
        """Return once chunk ``k`` has landed; raise the error of the read that failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._landed > k or self._error is not None
                                or self._stopped)
            if self._landed > k:
                return
            if self._error is not None:
                raise self._error
            raise LandingStopped(f"chunk {k} was never read: the read job was stopped")

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`read_all` has returned (after :meth:`stop`, a job not started
        yet returns at once when it starts); whether it has within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)
