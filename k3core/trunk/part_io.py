"""Reading a trunk layer's bytes for the ring: the file, the buffers, the reads, the errors.

Helpers of :mod:`k3core.trunk.stream`: opening ``trunk.bin`` (its size checked against the
manifest), the ring slots' prefaulted aligned buffers, the read-ahead of a raw part in
pieces that yield to the routed experts' demand reads, the windows of a coded layer that
meet a raw range and the zeros of the alignment padding between them, and a failed read as
the run's error naming the layer.
"""

from __future__ import annotations

import numpy as np

from k3core.api.errors import CheckpointError, K3Error, StorageError
from k3core.api.prefault import hugepage_buffer, prefault
from k3core.api.read_priority import AHEAD_PIECE_BYTES, DEMAND
from k3core.api.storage import StorageBackend, StorageFile
from k3core.trunk.manifest import TrunkLayer, TrunkManifest
from k3core.trunk.windows import Window


def slot_buffer(nbytes: int) -> np.ndarray:
    """An aligned buffer of at least ``nbytes`` (``hugepage_buffer``: 2 MiB aligned with
    MADV_HUGEPAGE if large). Its pages are faulted in here, before any read into it is
    submitted, so a ring slot's first fill does not pay the page faults on the reader thread
    (k3core/api/prefault.py)."""
    buf = hugepage_buffer(nbytes)
    prefault(buf[:nbytes])  # the rounding's tail is never read into: it stays unmapped
    return buf


def open_trunk_file(storage: StorageBackend, man: TrunkManifest) -> StorageFile:
    """``trunk.bin`` through ``storage``, refused (``CheckpointError``, exit 1) when it cannot
    be opened or its size is not the manifest's."""
    try:
        f = storage.open(man.bin_path)
    except K3Error as exc:
        raise CheckpointError(f"{man.bin_path}: cannot open the packed trunk: "
                              f"{exc.message}") from None
    except OSError as exc:
        raise CheckpointError(f"{man.bin_path}: cannot open the packed trunk: "
                              f"{exc.strerror or exc}") from None
    if f.size != man.total_bytes:
        f.close()
        raise CheckpointError(f"{man.bin_path} is {f.size} bytes but the manifest says "
                              f"{man.total_bytes}; truncated or replaced, repack the trunk")
    return f


def read_ahead(f: StorageFile, offset: int, out: np.ndarray) -> None:
    """The reader thread's read of a raw ring part: in pieces, each after the expert reads in
    flight (demand reads, k3core/api/read_priority.py) have gone but the last, so that a
    routed expert the MoE waits for is not queued behind a part needed only later."""
    for a in range(0, out.size, AHEAD_PIECE_BYTES):
        DEMAND.wait_for_demand()
        f.read_into(offset + a, out[a : a + AHEAD_PIECE_BYTES])


def read_error(layer: int, exc: BaseException) -> K3Error:
    """A failed trunk read as the run's error, naming the layer (a window that does not
    decode is already a ``CheckpointError`` naming it)."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, K3Error):
        return StorageError(f"trunk layer {layer}: {exc.message}")
    if isinstance(exc, (OSError, ValueError, BufferError)):
        return StorageError(f"trunk layer {layer}: read failed: {exc}")
    return StorageError(f"trunk layer {layer}: read failed: {exc!r}")


def zero_padding(buf: np.ndarray, start: int, nbytes: int, wins: tuple[Window, ...]) -> None:
    """Zero the bytes of raw ``[start, start + nbytes)`` in ``buf`` that no window holds
    (the alignment padding between tensors)."""
    end = start + nbytes
    covered = sum(min(end, w.raw_off + w.raw_len) - max(start, w.raw_off) for w in wins)
    if covered < nbytes:
        _zero_gaps(buf, start, end, wins)


def windows_in(lay: TrunkLayer, start: int, nbytes: int) -> tuple[Window, ...]:
    """The windows of ``lay`` whose raw bytes meet ``[start, start + nbytes)``."""
    end = start + nbytes
    return tuple(w for w in lay.windows if w.raw_off < end and w.raw_off + w.raw_len > start)


def _zero_gaps(buf: np.ndarray, start: int, end: int, wins: tuple[Window, ...]) -> None:
    """Zero the bytes of ``buf`` (raw ``[start, end)``) that no window covers."""
    pos = start
    for w in sorted(wins, key=lambda w: w.raw_off):
        if w.raw_off > pos:
            buf[pos - start : w.raw_off - start] = 0
        pos = max(pos, w.raw_off + w.raw_len)
    if pos < end:
        buf[pos - start : end - start] = 0
