"""Reading a part's raw bytes from ``trunk.bin`` into a buffer: a raw and a coded strategy.

A streamed trunk reads raw ``[start, start + nbytes)`` of a layer's run (a part, a piece of
one, a resident range) through one :class:`PartReader`, chosen by the manifest:

* :class:`RawPartReader` (a trunk packed without a codec): one aligned read; a read ahead of
  the walk goes in pieces, each after the routed experts' reads in flight
  (:func:`k3core.trunk.part_io.read_ahead`);
* :class:`CodedPartReader` (a trunk packed with a codec): the encoded windows that meet the
  range, read in aligned chunks and decoded into the buffer. A buffer with the room (a ring
  slot, larger than its part by :attr:`PartReader.slack`) takes the encoded bytes in its own
  tail and decodes in place (:func:`~k3core.trunk.windows.in_place_windows`); any other is
  staged, two chunks on the reading thread (:func:`~k3core.trunk.windows.prefetched_windows`).
  Either way a prefetch thread reads the next chunks while this one decodes. A window that
  straddles the range's edge decodes into a scratch window and its share is copied; the
  alignment padding between tensors is zeroed.

A failed read is the run's error naming the layer (:func:`k3core.trunk.part_io.read_error`);
a window that does not decode is a ``CheckpointError`` naming the layer and the window.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from k3core.api.daemon_executor import DaemonExecutor
from k3core.api.errors import K3Error
from k3core.api.read_priority import DEMAND
from k3core.api.storage import StorageFile, aligned_empty
from k3core.api.units import ALIGN
from k3core.trunk.codec import codec_for_manifest
from k3core.trunk.manifest import TrunkLayer, TrunkManifest
from k3core.trunk.part_io import read_ahead, read_error, windows_in, zero_padding
from k3core.trunk.stats import TrunkStats
from k3core.trunk.windows import (
    CodedWindows,
    Window,
    in_place_offset,
    in_place_windows,
    prefetched_windows,
    staging_bytes,
)


class PartReader(ABC):
    """How raw bytes of a layer's run come off ``trunk.bin`` into a buffer."""

    #: bytes a ring slot needs beyond its largest unit (room for an in-place decode)
    slack: int = 0
    #: whether a buffer of exactly a range's size is read through a ring slot, in pieces of
    #: the slot's room, rather than into itself (it has no room for the encoded bytes)
    needs_room: bool = False

    def read_part(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int,
                  nbytes: int, ahead: bool = False) -> None:
        """Raw ``[start, start + nbytes)`` of ``lay`` into ``buf[:nbytes]``. ``ahead``: a
        reader thread reads it ahead of the walk, so its reads yield to the routed experts'
        demand reads (k3core/api/read_priority.py). A failed read is a ``K3Error`` naming
        the layer."""
        try:
            self._read(f, lay, buf, start, nbytes, ahead)
        except (K3Error, OSError, ValueError, BufferError) as exc:
            raise read_error(lay.layer, exc) from None

    @abstractmethod
    def _read(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int, nbytes: int,
              ahead: bool) -> None: ...

    @abstractmethod
    def disk_bytes(self, lay: TrunkLayer, start: int, nbytes: int) -> int:
        """Bytes a read of raw ``[start, start + nbytes)`` of ``lay`` takes from the file."""

    def piece(self, slot: np.ndarray) -> int:
        """The aligned bytes of a slot one piece of a larger read may take (the slack stays
        free for the encoded bytes of an in-place decode)."""
        room = slot.nbytes - self.slack
        return room - room % ALIGN

    def drop_buffers(self) -> None:  # noqa: B027 - a raw reader keeps none
        """Free this thread's staging and scratch (the opening reads' are not needed again)."""

    def close(self) -> None:  # noqa: B027 - a raw reader has none
        """Stop the reader's own threads."""


class RawPartReader(PartReader):
    """A trunk packed without a codec: the raw bytes as they lie in ``trunk.bin``."""

    def _read(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int, nbytes: int,
              ahead: bool) -> None:
        if ahead:
            read_ahead(f, lay.file_off + start, buf[:nbytes])
        else:
            f.read_into(lay.file_off + start, buf[:nbytes])

    def disk_bytes(self, lay: TrunkLayer, start: int, nbytes: int) -> int:
        return nbytes


class CodedPartReader(PartReader):
    """A trunk packed with a codec: encoded windows read in chunks and decoded (the decodes
    counted in ``stats``). Its first ``n_layers`` layers are read."""

    needs_room = True

    def __init__(self, manifest: TrunkManifest, n_layers: int, stats: TrunkStats):
        self.manifest = manifest
        self.codec = codec_for_manifest(manifest.codec)
        layers = manifest.layers[:n_layers]
        self._staging_bytes = max((staging_bytes(lay.windows) for lay in layers), default=0)
        #: a ring slot this much larger than its part holds the part's encoded windows in
        #: its tail, each decoding in place (``in_place_offset``): no staging beside it
        self.slack = max((w.nbytes for lay in layers for w in lay.windows), default=0) + 3 * ALIGN
        #: reads the next chunk of encoded windows while the current one decodes
        self.prefetch = DaemonExecutor("k3-trunk-prefetch")
        self._stats = stats
        self._local = threading.local()  # a staging buffer and a scratch per reading thread

    def _read(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int, nbytes: int,
              ahead: bool) -> None:
        wins = windows_in(lay, start, nbytes)
        src = CodedWindows(f, self.manifest.bin_path, lay.layer, lay.file_off, wins, self.codec)
        at = in_place_offset(wins, start, buf.size)
        dest, land = self.sink(buf, start, nbytes, wins)
        gate = DEMAND.wait_for_demand if ahead else None
        t0 = time.perf_counter()
        if at is not None:  # a ring slot (it has the room): the encoded bytes read into its tail
            decoded = in_place_windows(src, buf[at:], dest, self.prefetch, gate)
        else:
            decoded = prefetched_windows(src, self._staging(), dest, self.prefetch, gate)
        for w in decoded:
            land(w)
        zero_padding(buf, start, nbytes, wins)
        with self._stats.lock:
            self._stats.decoded_bytes += nbytes
            self._stats.decode_seconds += time.perf_counter() - t0

    def disk_bytes(self, lay: TrunkLayer, start: int, nbytes: int) -> int:
        return sum(w.nbytes for w in windows_in(lay, start, nbytes))

    def sink(self, buf: np.ndarray, start: int, nbytes: int, wins: tuple[Window, ...]
             ) -> tuple[Callable[[Window], np.ndarray], Callable[[Window], None]]:
        """Where each window of raw ``[start, start + nbytes)`` of a layer decodes (``dest``),
        and what follows its decode (``land``): a window inside the range decodes straight
        into ``buf``; one that straddles its edge decodes into this thread's scratch (one
        window at a time: the windows are yielded one by one) and ``land`` copies its share."""
        end = start + nbytes
        aside = getattr(self._local, "aside", None)
        widest = max((w.raw_len for w in wins), default=0)
        if aside is None or aside.size < widest:
            aside = self._local.aside = np.empty(widest, dtype=np.uint8)
        scratch = aside

        def inside(w: Window) -> bool:
            return w.raw_off >= start and w.raw_off + w.raw_len <= end

        def dest(w: Window) -> np.ndarray:
            if inside(w):
                return buf[w.raw_off - start : w.raw_off - start + w.raw_len]
            return scratch[: w.raw_len]

        def land(w: Window) -> None:
            if not inside(w):
                a, b = max(start, w.raw_off), min(end, w.raw_off + w.raw_len)
                buf[a - start : b - start] = scratch[a - w.raw_off : b - w.raw_off]

        return dest, land

    def has_staging(self) -> bool:
        """Whether this thread holds a staging buffer (a read that could not decode in place)."""
        return getattr(self._local, "staging", None) is not None

    def drop_buffers(self) -> None:
        self._local.__dict__.clear()

    def close(self) -> None:
        self.prefetch.shutdown()

    def _staging(self) -> np.ndarray:
        """This thread's staging for reads that cannot decode in place (two chunks)."""
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = aligned_empty(2 * self._staging_bytes, ALIGN)
        return staging
