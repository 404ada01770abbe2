"""A streamed trunk's opening reads: the resident ranges and the pinned parts, read once.

:func:`load_pinned` reads every walked layer's resident ranges (the pages outside its
parts, which hold small tensors only) and every pinned part into a buffer of its own, and
feeds each to the layer's checks (:class:`~k3core.trunk.checks.LayerChecks`). A layer with
a pinned part has its other parts read through the first ring slot, so that its checksum
is checked at open, before any of its bytes is served; a mismatch fails the open. The
pinned parts' matrices are then bound once, for the whole run.

A coded trunk's opening reads go through the first ring slot in pieces of its room, each
decoded in place and copied out, so opening needs no staging buffer; with no ring
(everything pinned) they are staged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from k3core.api.storage import StorageFile
from k3core.trunk.checks import LayerChecks
from k3core.trunk.manifest import TrunkLayer
from k3core.trunk.part_io import slot_buffer
from k3core.trunk.part_readers import PartReader
from k3core.trunk.stats import TrunkStats
from k3core.trunk.units import TrunkUnits


def load_pinned(f: StorageFile, units: TrunkUnits, checks: LayerChecks, reader: PartReader,
                pinned: Sequence[int], room: np.ndarray | None, stats: TrunkStats,
                progress: Callable[[int, int], None] | None = None
                ) -> dict[int, dict[str, np.ndarray]]:
    """Read the resident ranges and the ``pinned`` units, check every layer they touch, and
    bind the pinned units: their matrices by unit. ``room`` is the first ring slot (``None``
    with no ring); ``progress(done, total)`` follows the pinned units."""
    t0 = time.perf_counter()
    man = units.manifest
    most = max((b - a for sp in units.splits for a, b in sp.resident), default=0)
    scratch = slot_buffer(most) if most else None
    for L, sp in enumerate(units.splits):
        lay = man.layers[L]
        for a, b in sp.resident:
            assert scratch is not None
            _read_exact(f, reader, lay, scratch, a, b - a, room)
            stats.pin_bytes += reader.disk_bytes(lay, a, b - a)
            checks.feed(L, -1, scratch[: b - a], a)
    del scratch
    bufs: dict[int, np.ndarray] = {}
    for i, u in enumerate(pinned):
        part = units.units[u]
        lay = man.layers[part.layer]
        buf = slot_buffer(part.nbytes)
        _read_exact(f, reader, lay, buf, part.start, part.nbytes, room)
        stats.pin_bytes += reader.disk_bytes(lay, part.start, part.nbytes)
        checks.feed(part.layer, units.index(u), buf[: part.nbytes], part.start)
        bufs[u] = buf
        if progress:
            progress(i + 1, len(pinned))
    for L in sorted({units.units[u].layer for u in pinned}):
        lay = man.layers[L]
        for k, part in enumerate(units.splits[L].parts):  # the layer's parts not pinned
            if not checks.fed(L, k):
                assert room is not None  # an unpinned part: there is a ring
                reader.read_part(f, lay, room, part.start, part.nbytes)
                stats.pin_bytes += reader.disk_bytes(lay, part.start, part.nbytes)
                checks.feed(L, k, room[: part.nbytes], part.start)
        checks.finish(L)
    out = {u: units.bind(u, buf) for u, buf in bufs.items()}
    stats.pin_seconds += time.perf_counter() - t0
    return out


def _read_exact(f: StorageFile, reader: PartReader, lay: TrunkLayer, buf: np.ndarray,
                start: int, nbytes: int, room: np.ndarray | None) -> None:
    """A read into a buffer of its exact size (a pinned part, a resident range): straight,
    or through ``room`` in pieces where the reader needs the room."""
    if not reader.needs_room or room is None:
        reader.read_part(f, lay, buf, start, nbytes)
        return
    step = reader.piece(room)
    for a in range(start, start + nbytes, step):
        n = min(step, start + nbytes - a)
        reader.read_part(f, lay, room, a, n)
        buf[a - start : a - start + n] = room[:n]
