"""The ring's reader threads: the parts the walk is about to reach, read while one computes.

With two or more ring slots a streamed trunk reads ahead of the walk (the wanted units of
:class:`~k3core.trunk.slots.SlotRing`):

* :class:`PartReadAhead` (a raw trunk): one thread (``k3-trunk-reader``) claims the nearest
  wanted unit missing from the ring and fills its slot (``fill``: read, checked,
  published), part after part;
* :class:`CodedReadAhead` (a coded trunk): two threads. The I/O thread (``k3-trunk-io``)
  claims the next part as soon as a slot is free and reads its encoded chunks back to back
  into the slot's tail; the reader thread (``k3-trunk-reader``) decodes each chunk in place
  once it has landed, checks the part when ``--verify-trunk`` asks, and publishes it. So
  the disk goes from one part to the next without waiting for the last chunk's decode, the
  hand-off between threads or the publishing. A layer's first read (its checksum covers
  all its parts), or a part that cannot decode in place, is filled whole on the I/O thread,
  the prefetch thread reading its next chunk meanwhile. A part is READING from the moment
  the I/O thread claims its slot until the reader thread publishes it, or empties the slot
  on an error once the I/O thread no longer writes into it (its ``acquire`` then raises the
  error); the chunks go after the routed experts' reads in flight.

Both end with the ring's stop flag; :meth:`CodedReadAhead.stop` also ends a part's read job
before its next chunk. Their threads are daemons, joined by the trunk's ``close`` with a
bound (:data:`JOIN_SECONDS`), so an exception or Ctrl-C never hangs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from k3core.api.errors import StorageError
from k3core.api.read_priority import DEMAND
from k3core.api.storage import StorageFile
from k3core.trunk import windows as window_table
from k3core.trunk.checks import LayerChecks
from k3core.trunk.part_io import read_error, windows_in, zero_padding
from k3core.trunk.part_readers import CodedPartReader
from k3core.trunk.slots import POLL_SECONDS, Slot, SlotRing
from k3core.trunk.stats import TrunkStats
from k3core.trunk.units import TrunkUnits
from k3core.trunk.windows import (
    CodedWindows,
    Landing,
    Window,
    decode_chunk,
    in_place_offset,
    linear_base,
    linear_reader,
)

#: how long ``close`` waits for each reader thread (they are daemon threads either way)
JOIN_SECONDS = 5.0

#: read unit ``u`` into ``slot`` (claimed, READING), check it, then publish it or fail it
Fill = Callable[[Slot, int], None]


class PartReadAhead:
    """One reader thread filling the ring's slots, part after part."""

    def __init__(self, ring: SlotRing, fill: Fill):
        self._ring = ring
        self._fill = fill
        self.threads = (threading.Thread(target=self._run, name="k3-trunk-reader", daemon=True),)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """Called after the ring's stop flag is set: nothing more to end."""

    def _run(self) -> None:
        while not self._ring.stop.is_set():
            job = self._ring.claim()
            if job is not None:
                self._fill(*job)


@dataclass
class RingJob:
    """A coded ring part in flight: its encoded chunks read into the tail of ``slot`` by the
    I/O thread (``landing``), decoded in place by the reader thread."""

    slot: Slot
    unit: int
    windows: tuple[Window, ...]
    chunks: list[tuple[int, int]]  # the windows' read chunks, the same for both threads
    at: int  # where in the slot the encoded bytes land (``in_place_offset``)
    disk: int  # encoded bytes it reads
    landing: Landing


class CodedReadAhead:
    """The coded ring's two threads: one reads, one decodes (see the module docstring).
    ``file`` gives the open ``trunk.bin`` (``None`` once the trunk is closed)."""

    def __init__(self, ring: SlotRing, units: TrunkUnits, checks: LayerChecks,
                 reader: CodedPartReader, file: Callable[[], StorageFile | None], fill: Fill,
                 verify_every: bool, stats: TrunkStats):
        self._ring = ring
        self._units = units
        self._checks = checks
        self._reader = reader
        self._file = file
        self._fill = fill
        self._verify_every = verify_every
        self._stats = stats
        self._jobs: queue.SimpleQueue[RingJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight: list[RingJob] = []  # the parts the I/O thread started, oldest first
        self.threads = (threading.Thread(target=self._io_loop, name="k3-trunk-io", daemon=True),
                        threading.Thread(target=self._decoder, name="k3-trunk-reader",
                                         daemon=True))

    def start(self) -> None:
        io, decoder = self.threads
        decoder.start()
        io.start()

    def stop(self) -> None:
        """Called after the ring's stop flag is set: the read jobs in flight end before
        their next chunk, and the reader thread stops waiting for parts."""
        with self._lock:
            for job in self._in_flight:
                job.landing.stop()
        self._jobs.put(None)

    # ---- the I/O thread ------------------------------------------------------------------
    def _io_loop(self) -> None:
        """Part after part: a part's encoded chunks are read back to back into the tail of
        its slot while the reader thread decodes the chunks that have landed, and the next
        part's reads start as soon as a slot is free, whatever the decoder is doing."""
        while not self._ring.stop.is_set():
            picked = self._ring.claim()
            if picked is None:
                continue
            job = self._job(*picked)
            if job is None:
                self._fill(*picked)
                continue
            with self._lock:
                if self._ring.stop.is_set():
                    return
                self._in_flight.append(job)
            self._jobs.put(job)
            job.landing.read_all(self._chunk_read(job), len(job.chunks))

    def _job(self, slot: Slot, u: int) -> RingJob | None:
        """``u`` as a part the two threads share, or ``None`` when the I/O thread fills it
        alone (its layer's first read, or a part that cannot decode in place)."""
        part = self._units.units[u]
        if not self._checks.passed(part.layer):
            return None
        lay = self._units.manifest.layers[part.layer]
        wins = windows_in(lay, part.start, part.nbytes)
        at = in_place_offset(wins, part.start, slot.buf.size)
        if at is None:
            return None
        return RingJob(slot, u, wins, window_table.chunks(wins), at,
                       self._reader.disk_bytes(lay, part.start, part.nbytes), Landing())

    def _chunk_read(self, job: RingJob) -> Callable[[int], None]:
        """The read of chunk ``k`` of ``job`` into its slot's tail, after the demand reads in
        flight (a closed trunk's read fails, on the I/O thread, like any other)."""
        lay = self._units.manifest.layers[self._units.units[job.unit].layer]
        f = self._file()
        if f is None:
            def closed(k: int) -> None:
                raise StorageError(f"trunk layer {lay.layer}: the trunk is closed")
            return closed
        src = CodedWindows(f, self._units.manifest.bin_path, lay.layer, lay.file_off,
                           job.windows, self._reader.codec)
        return linear_reader(src, job.slot.buf[job.at :], job.chunks, DEMAND.wait_for_demand)

    # ---- the reader thread -----------------------------------------------------------------
    def _decoder(self) -> None:
        """Decode the parts the I/O thread started, in order, and publish each (or fail it)."""
        while not self._ring.stop.is_set():
            try:
                job = self._jobs.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if job is None:
                return
            self._decode(job)

    def _decode(self, job: RingJob) -> None:
        part = self._units.units[job.unit]
        L = part.layer
        buf = job.slot.buf
        t0 = time.perf_counter()
        waited = 0.0
        try:
            staging = buf[job.at :]
            base = linear_base(job.windows)
            dest, land = self._reader.sink(buf, part.start, part.nbytes, job.windows)
            for k, (a, b) in enumerate(job.chunks):
                w0 = time.perf_counter()
                job.landing.wait_for(k)
                waited += time.perf_counter() - w0
                for w in decode_chunk(staging, base, job.windows, a, b, self._reader.codec, dest,
                                      self._units.manifest.bin_path, L):
                    land(w)
            zero_padding(buf, part.start, part.nbytes, job.windows)
            if self._verify_every:
                self._checks.verify_part(L, self._units.index(job.unit), buf)
        except BaseException as exc:  # anything: the slot must never stay READING
            job.landing.stop()
            done = job.landing.wait_done(JOIN_SECONDS)
            err = read_error(L, exc)
            with self._lock:
                self._in_flight.remove(job)
            with self._stats.lock:
                self._stats.failed_reads += 1
            # else a read still lands in the slot: it stays READING, unused
            self._ring.fail(job.slot, job.unit, err, empty=done)
            if not isinstance(exc, Exception):
                raise
            return
        job.landing.wait_done()
        with self._lock:
            self._in_flight.remove(job)
        with self._stats.lock:
            self._stats.reads += 1
            self._stats.bytes_read += job.disk
            self._stats.read_seconds += job.landing.seconds
            self._stats.decoded_bytes += part.nbytes
            self._stats.decode_seconds += time.perf_counter() - t0 - waited
        self._ring.publish(job.slot)
