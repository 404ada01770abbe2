"""Serving the trunk from ``trunk.bin``: a pinned set plus a ring of streaming slots.

:class:`StreamedTrunk` is a :class:`~k3core.model.sources.TrunkSource`. It composes the
trunk room's pieces:

* the units it serves, every walked layer's parts in walk order (:mod:`k3core.trunk.units`),
  and the budget's split into pinned units and a ring (:func:`k3core.trunk.plan.plan_trunk`);
* a part reader, raw or coded, chosen by the manifest (:mod:`k3core.trunk.part_readers`);
* every layer's checksum check before first use (:mod:`k3core.trunk.checks`): no layer's
  bytes are used before they matched the manifest's CRC-32 (a mismatch is a
  ``CheckpointError``, exit 1, naming the layer, raised by the open or by the ``acquire``
  of that layer); with ``verify_every`` (``--verify-trunk``) every ring read is checked;
* the opening reads of the resident ranges and the pinned parts (:mod:`k3core.trunk.pinned`);
* the ring's slots and their state machine (:mod:`k3core.trunk.slots`), filled ahead of
  the walk by reader threads with two or more slots (:mod:`k3core.trunk.read_ahead`), on
  demand in ``acquire`` with one.

A ring slot is filled by reading its unit; a layer's first read also reads its other parts
through the same slot, so that the layer's checksum is checked before any of its bytes is
served. A failed read (``StorageError``, a short read, a truncated ``trunk.bin``, a window
that does not decode) empties the slot and records the error, and the ``acquire`` of that
layer raises it (the forward pass fails, exit 1); it is never served.

``acquire`` returns :class:`~k3core.model.layer_params.LayerParams` built over read-only
zero-copy views into the slot (bf16 matrices stay views, small vectors are widened
copies); they are valid until ``release``. ``close`` stops the (daemon) reader threads
with the ring's stop flag and a bounded join, so an exception or Ctrl-C never hangs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from k3core.api.errors import K3Error, StorageError
from k3core.api.storage import StorageBackend, StorageFile
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams
from k3core.model.sources import TrunkSource
from k3core.trunk.checks import LayerChecks
from k3core.trunk.manifest import TrunkManifest
from k3core.trunk.part_io import open_trunk_file, slot_buffer
from k3core.trunk.part_readers import CodedPartReader, PartReader, RawPartReader
from k3core.trunk.parts import LayerPart, LayerSplit
from k3core.trunk.pinned import load_pinned
from k3core.trunk.plan import DEFAULT_RING, TrunkPlan, plan_trunk
from k3core.trunk.read_ahead import JOIN_SECONDS, CodedReadAhead, PartReadAhead
from k3core.trunk.slots import Slot, SlotRing
from k3core.trunk.stats import TrunkStats
from k3core.trunk.units import TrunkUnits


class StreamedTrunk(TrunkSource):
    """Pinned parts plus a ring of slots over ``trunk.bin`` (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        manifest: TrunkManifest,
        storage: StorageBackend,
        budget_bytes: int,
        n_layers: int | None = None,
        ring: int = DEFAULT_RING,
        progress: Callable[[int, int], None] | None = None,
        verify_every: bool = False,
        split: bool = False,
    ):
        self.cfg = cfg
        self.verify_every = verify_every
        self.manifest = manifest
        n = n_layers or cfg.n_layers
        self.table = TrunkUnits(cfg, manifest, n, split)
        self.plan: TrunkPlan = plan_trunk([u.nbytes for u in self.units], budget_bytes, ring,
                                          small_slot=split)
        self.stats = TrunkStats(n, len(self.pinned_layers), self.plan.ring,
                                self.plan.slot_bytes, self.plan.pinned_bytes,
                                verify_every=verify_every, codec=manifest.codec,
                                n_units=len(self.units),
                                pinned_units=len(self.plan.pinned),
                                small_slot_bytes=self.plan.small_slot_bytes)
        self.reader: PartReader = (CodedPartReader(manifest, n, self.stats) if manifest.compressed
                                   else RawPartReader())
        self._checks = LayerChecks(self.table, self.stats)
        self._live: dict[int, tuple[LayerParams, int]] = {}
        self._read_ahead: PartReadAhead | CodedReadAhead | None = None
        try:
            f = open_trunk_file(storage, manifest)
        except BaseException:
            self.reader.close()
            raise
        self._file: StorageFile | None = f
        try:
            self._ring = SlotRing([slot_buffer(b + self.reader.slack)
                                   for b in self.plan.slot_sizes],
                                  self.units, self.plan.streamed, self.plan.ring)
            room = self._ring.slots[0].buf if self._ring.slots else None
            self._pinned = load_pinned(f, self.table, self._checks, self.reader, self.plan.pinned,
                                       room, self.stats, progress)
            # the opening reads' staging is not needed again: the slots decode in place
            self.reader.drop_buffers()
        except BaseException:
            self.reader.close()
            self._file = None
            f.close()
            raise
        if self.plan.ring >= 2:
            if isinstance(self.reader, CodedPartReader):
                self._read_ahead = CodedReadAhead(self._ring, self.table, self._checks,
                                                  self.reader, lambda: self._file, self._fill_ahead,
                                                  verify_every, self.stats)
            else:
                self._read_ahead = PartReadAhead(self._ring, self._fill_ahead)
            self._read_ahead.start()

    # ---- the TrunkSource interface ------------------------------------------------------
    def acquire(self, layer: int) -> LayerParams:
        if not 0 <= layer < self.table.n_layers:
            raise K3Error(f"trunk: layer {layer} is not part of this run's walk "
                          f"(0..{self.stats.n_layers - 1})")
        if layer in self._live:
            raise K3Error(f"trunk: layer {layer} acquired twice without a release")
        u = self.table.first[layer]
        mats = self._acquire_unit(u)
        t = dict(self._checks.small[layer])
        t.update(mats)
        p = LayerParams(layer, self.cfg.is_mla(layer), self.cfg.is_dense(layer), t)
        self._live[layer] = (p, u)
        return p

    def begin_mlp(self, layer: int) -> None:
        live = self._live.get(layer)
        if live is None:
            raise K3Error(f"trunk: begin_mlp({layer}) before acquire({layer})")
        p, u = live
        if u >= self.table.last(layer):
            return  # one part: the MLP tensors are already bound
        for s in self.units[u].matrices:  # the attention views die with their slot
            p.t.pop(s, None)
        self._release_unit(u)
        self._live[layer] = (p, u + 1)
        p.t.update(self._acquire_unit(u + 1))

    def release(self, layer: int) -> None:
        live = self._live.pop(layer, None)
        if live is not None:
            self._release_unit(live[1])

    def peek(self, layer: int) -> LayerParams | None:
        """``layer``'s small tensors and the matrices of its last part (the MLP/MoE part, which
        holds the router), if that part is pinned or its slot is already READY (never waits).
        Only the router lookahead uses it: a guess never changes the bits."""
        if not 0 <= layer < self.table.n_layers or not self._checks.passed(layer):
            return None
        u = self.table.last(layer)
        mats = self._pinned.get(u)
        if mats is None:
            buf = self._ring.ready_buf(u)
            if buf is None:
                return None
            mats = self.table.bind(u, buf)
        t = dict(self._checks.small[layer])
        t.update(mats)
        return LayerParams(layer, self.cfg.is_mla(layer), self.cfg.is_dense(layer), t)

    def close(self) -> None:
        self._ring.close()
        if self._read_ahead is not None:
            self._read_ahead.stop()
            for t in self._read_ahead.threads:
                if t is not threading.current_thread():
                    t.join(JOIN_SECONDS)
                    if t.is_alive():  # a read is stuck in the kernel: leave the file to it
                        return
        self.reader.close()
        f, self._file = self._file, None
        if f is not None:
            f.close()

    # ---- state queries (tests and reports) -----------------------------------------------
    @property
    def splits(self) -> list[LayerSplit]:
        return self.table.splits

    @property
    def units(self) -> list[LayerPart]:
        return self.table.units

    @property
    def slots(self) -> list[Slot]:
        return self._ring.slots

    @property
    def pinned_layers(self) -> tuple[int, ...]:
        """Layers every part of which is pinned."""
        return self.table.whole_layers(set(self.plan.pinned))

    @property
    def unit_labels(self) -> list[str]:
        return self.table.labels

    @property
    def has_reader(self) -> bool:
        return self._read_ahead is not None

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The reader threads (none with fewer than two slots)."""
        return () if self._read_ahead is None else self._read_ahead.threads

    def slot_states(self) -> list[tuple[int | None, str]]:
        """``(layer, state)`` of every ring slot (the layer whose part it holds)."""
        return [(None if u is None else self.units[u].layer, state)
                for u, state in self._ring.states()]

    def held_layers(self) -> list[int]:
        return sorted({self.units[u].layer for u in self._ring.held_units()})

    # ---- internals ----------------------------------------------------------------------
    def _acquire_unit(self, u: int) -> dict[str, np.ndarray]:
        pinned = self._pinned.get(u)
        if pinned is not None:
            self.stats.binds += 1
            self.stats.hits += 1
            return pinned
        t0 = time.perf_counter()
        on_demand = self._fill_on_demand if self._read_ahead is None else None
        slot = self._ring.wait_ready(u, on_demand)
        self.stats.exposed_wait_seconds += time.perf_counter() - t0
        try:
            mats = self.table.bind(u, slot.buf)
        except BaseException:
            self._release_unit(u)
            raise
        self.stats.binds += 1
        return mats

    def _release_unit(self, u: int) -> None:
        if u not in self._pinned:
            self._ring.release(u)

    def _fill_on_demand(self, slot: Slot, u: int) -> None:
        self._fill(slot, u, ahead=False)

    def _fill_ahead(self, slot: Slot, u: int) -> None:
        self._fill(slot, u, ahead=True)

    def _fill(self, slot: Slot, u: int, ahead: bool) -> None:
        """Read unit ``u`` into ``slot`` (claimed, READING), then publish or fail it.

        The first read of a layer also reads its other parts through the slot (before this
        one, in pieces if the slot is smaller), so the layer's checksum is checked before
        any of its bytes is served.
        """
        part = self.units[u]
        L = part.layer
        k = self.table.index(u)
        lay = self.manifest.layers[L]
        f = self._file
        t0 = time.perf_counter()
        disk = 0
        try:
            if f is None:
                raise StorageError(f"trunk layer {L}: the trunk is closed")
            fresh = not self._checks.passed(L)
            if fresh:  # the other parts through this slot, in pieces if it is the smaller
                step = self.reader.piece(slot.buf)
                for j, other in enumerate(self.splits[L].parts):
                    if j != k and not self._checks.fed(L, j):
                        for a in range(other.start, other.end, step):
                            n = min(step, other.end - a)
                            self.reader.read_part(f, lay, slot.buf, a, n, ahead)
                            disk += self.reader.disk_bytes(lay, a, n)
                            self._checks.feed(L, j, slot.buf[:n], a)
            self.reader.read_part(f, lay, slot.buf, part.start, part.nbytes, ahead)
            disk += self.reader.disk_bytes(lay, part.start, part.nbytes)
            if fresh:
                self._checks.feed(L, k, slot.buf[: part.nbytes], part.start)
                self._checks.finish(L)
            elif self.verify_every:
                self._checks.verify_part(L, k, slot.buf)
        except BaseException as exc:  # anything: the slot must never stay READING
            err = exc if isinstance(exc, K3Error) else StorageError(
                f"trunk layer {L}: read failed: {exc!r}")
            with self.stats.lock:
                self.stats.failed_reads += 1
            self._ring.fail(slot, u, err)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt / SystemExit in the caller's thread
            return
        dt = time.perf_counter() - t0
        with self.stats.lock:
            self.stats.reads += 1
            self.stats.bytes_read += disk
            self.stats.read_seconds += dt
        self._ring.publish(slot)
