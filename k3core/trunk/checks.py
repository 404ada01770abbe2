"""Every streamed layer checked before first use, and its small tensors bound once it passes.

A layer arrives in pieces: its resident ranges at open, then each part's first read (a
pinned part at open, a ring part through a slot). :class:`LayerChecks` feeds each piece to
the layer's :class:`~k3core.trunk.assembly.LayerAssembly`; once every piece is in,
:meth:`LayerChecks.finish` compares the layer's CRC-32 with the manifest's and binds its
small tensors (:func:`k3core.trunk.bind.bind_small`). A layer that fails is a
``CheckpointError`` naming it and none of its bytes is served. With ``--verify-trunk``
every later read of a part is checked against the pieces the first check trusted
(:meth:`LayerChecks.verify_part`).
"""

from __future__ import annotations

import time

import numpy as np

from k3core.api.errors import CheckpointError
from k3core.trunk.assembly import LayerAssembly
from k3core.trunk.bind import bind_small
from k3core.trunk.stats import TrunkStats
from k3core.trunk.units import TrunkUnits


class LayerChecks:
    """The checks of every layer of ``units`` (counted in ``stats``)."""

    def __init__(self, units: TrunkUnits, stats: TrunkStats):
        self.cfg = units.cfg
        self.manifest = units.manifest
        self.stats = stats
        self._asm = {L: LayerAssembly(self.manifest.layers[L], units.splits[L])
                     for L in range(units.n_layers)}
        #: the small tensors of every layer that passed its check, bound
        self.small: dict[int, dict[str, np.ndarray]] = {}

    def passed(self, layer: int) -> bool:
        """Whether ``layer`` passed its check (its bytes may be served)."""
        return layer in self.small

    def fed(self, layer: int, k: int) -> bool:
        """Whether part ``k`` of ``layer`` (-1: its resident ranges) is in."""
        return self._asm[layer].fed(k)

    def feed(self, layer: int, k: int, buf: np.ndarray, start: int) -> None:
        """Part ``k`` of ``layer`` (-1: its resident ranges), or a piece of it: raw bytes
        from ``start`` of the layer's run, held by ``buf``."""
        self._asm[layer].feed(k, buf, start)

    def finish(self, layer: int) -> None:
        """Every piece of ``layer`` is in: check its CRC, bind its small tensors."""
        asm = self._asm[layer]
        t0 = time.perf_counter()
        problem = asm.problem(self.manifest)
        if problem is not None:
            raise CheckpointError(problem)
        small = bind_small(self.cfg, layer, asm.small_raw())
        asm.drop_raw()
        with self.stats.lock:
            self.stats.verify_seconds += time.perf_counter() - t0
            self.stats.verified += 1
        self.small[layer] = small

    def verify_part(self, layer: int, k: int, buf: np.ndarray) -> None:
        """``--verify-trunk`` on a ring read: part ``k`` of ``layer`` in ``buf`` against its
        checksum segments, or ``CheckpointError``."""
        c0 = time.perf_counter()
        problem = self._asm[layer].part_problem(self.manifest, k, buf)
        with self.stats.lock:
            self.stats.verify_seconds += time.perf_counter() - c0
        if problem is not None:
            raise CheckpointError(problem)
        with self.stats.lock:
            self.stats.verified += 1
