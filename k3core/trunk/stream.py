"""Serving the trunk from ``trunk.bin``: a pinned set plus a ring of streaming slots.

:class:`StreamedTrunk` is a :class:`~k3core.model.sources.TrunkSource`. At open it plans the
budget (:func:`k3core.trunk.plan.plan_trunk`), reads the pinned layers once into their own
buffers and keeps them bound, and allocates ``ring`` aligned slots of the largest unpinned
run. With two or more slots a reader thread reads the layers the walk is about to reach
while the current one computes: after ``acquire(L)`` the *wanted* set is ``L`` and the next
``ring - 1`` streamed layers in walk order (wrapping to layer 0 for the next token,
skipping pinned ones), and the reader fills free slots with them, nearest first.

Invariants, all under one condition variable:

* a slot being read into (READING) is never handed out and never chosen as a victim;
* the slot the caller holds (acquired, not yet released) is never evicted;
* a slot holding a wanted layer is never evicted (so nothing is read twice per walk);
* a layer is published (READY) only after its read returned every byte; a failed read
  (``StorageError``, a short read, a truncated ``trunk.bin``) empties the slot and records
  the error, and the ``acquire`` of that layer raises it (the forward pass fails, exit 1);
  it is never served;
* with one slot there is no reader thread: a layer is read on demand in ``acquire``, never
  over the slot in use;
* no layer's bytes are used before they matched the manifest's CRC-32: pinned layers are
  checked at open (on a helper thread, overlapping the next layer's read), ring layers the
  first time they are read in a run (with ``verify_every``, which ``--verify-trunk`` sets,
  on every read). A mismatch is a ``CheckpointError`` (exit 1) naming the layer, raised by
  the open or by the ``acquire`` of that layer, and the bytes are never served;
* the reader thread reads a raw part in pieces and lets the routed experts' reads in flight
  go first (k3core/api/read_priority.py);
* a trunk packed with a codec is read as encoded windows in aligned chunks, decoded into
  the slot (or pinned buffer) by the thread that reads it, with a daemon prefetch thread
  (k3core/api/daemon_executor.py) reading the next chunk meanwhile
  (:mod:`k3core.trunk.windows`); the reader thread's chunks,
  like its raw pieces, go after the routed experts' reads in flight; the checksum is that of
  the decoded bytes, checked as above, and a window that does not decode fails the read
  the same way (``CheckpointError`` naming layer and window, never served).

``acquire`` returns :class:`~k3core.model.layer_params.LayerParams` built by ``prepare_layer`` over
read-only zero-copy views into the slot (bf16 matrices stay views, small vectors are
widened copies); they are valid until ``release``. ``close`` stops the (daemon) reader
thread with a stop event and a bounded join, so an exception or Ctrl-C never hangs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3core.api.daemon_executor import DaemonExecutor
from k3core.api.errors import CheckpointError, K3Error, StorageError
from k3core.api.prefault import hugepage_buffer, prefault
from k3core.api.read_priority import AHEAD_PIECE_BYTES, DEMAND
from k3core.api.storage import StorageBackend, StorageFile, aligned_empty
from k3core.api.units import ALIGN, human
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams
from k3core.model.sources import TrunkSource
from k3core.trunk.assembly import LayerAssembly
from k3core.trunk.bind import bind_matrices, bind_small
from k3core.trunk.codec import codec_for_manifest
from k3core.trunk.manifest import TrunkLayer, TrunkManifest
from k3core.trunk.parts import LayerPart, LayerSplit, split_layer
from k3core.trunk.plan import DEFAULT_RING, TrunkPlan, plan_trunk
from k3core.trunk.windows import (
    Window,
    decoded_windows,
    in_place_offset,
    staging_bytes,
)

EMPTY, READING, READY = "empty", "reading", "ready"
#: how long ``close`` waits for the reader thread (it is a daemon thread either way)
JOIN_SECONDS = 5.0


def slot_buffer(nbytes: int) -> np.ndarray:
    """An aligned buffer of at least ``nbytes`` (``hugepage_buffer``: 2 MiB aligned with
    MADV_HUGEPAGE if large). Its pages are faulted in here, before any read into it is
    submitted, so a ring slot's first fill does not pay the page faults on the reader thread
    (k3core/api/prefault.py)."""
    buf = hugepage_buffer(nbytes)
    prefault(buf[:nbytes])  # the rounding's tail is never read into: it stays unmapped
    return buf


@dataclass
class TrunkStats:
    """Whole-run trunk counters (docs/engine-behaviours.md §3)."""

    n_layers: int
    pinned: int
    ring: int
    slot_bytes: int
    pinned_bytes: int
    binds: int = 0
    hits: int = 0  # binds served by a pinned layer
    reads: int = 0  # completed ring reads
    bytes_read: int = 0  # ring bytes
    read_seconds: float = 0.0  # device time inside ring reads
    exposed_wait_seconds: float = 0.0  # acquire blocked on a read
    failed_reads: int = 0
    pin_bytes: int = 0  # read once at open
    pin_seconds: float = 0.0
    verified: int = 0  # checksum checks passed (pinned at open, ring reads)
    verify_seconds: float = 0.0  # CPU time inside those checks
    verify_every: bool = False
    codec: str = "none"
    decoded_bytes: int = 0  # raw bytes decoded from a compressed trunk (ring and pinned)
    decode_seconds: float = 0.0  # time inside those reads and decodes, on their threads
    n_units: int = 0  # streaming units (a layer's parts, or whole layers)
    pinned_units: int = 0
    small_slot_bytes: int = 0  # the second, smaller slot of an unequal ring (0: none)

    @property
    def overlapped_seconds(self) -> float:
        return max(0.0, self.read_seconds - self.exposed_wait_seconds)

    def report_lines(self) -> list[str]:
        binds = max(self.binds, 1)
        rate = self.bytes_read / self.read_seconds / 1e6 if self.read_seconds > 0 else 0.0
        lines = [
            f"trunk [final]: pinned {self.pinned}/{self.n_layers} layers"
            + (f" ({self.pinned_units}/{self.n_units} parts)" if self.n_units > self.n_layers
               else "")
            + (f", ring 2 slots ({human(self.slot_bytes)} + {human(self.small_slot_bytes)})"
               if self.small_slot_bytes else
               f", ring {self.ring} slots x {human(self.slot_bytes)}"),
            f"  binds {self.binds}, hits {self.hits} ({100 * self.hits / binds:.1f} %), "
            f"reads {self.reads}" + (f", FAILED reads {self.failed_reads}"
                                     if self.failed_reads else ""),
            f"  read {human(self.bytes_read)} in {self.read_seconds:.2f} s "
            f"({rate:.0f} MB/s); pinned load {human(self.pin_bytes)} in "
            f"{self.pin_seconds:.2f} s",
        ]
        if self.codec != "none":
            rate = self.decoded_bytes / self.decode_seconds / 1e9 if self.decode_seconds else 0.0
            lines.append(f"  codec {self.codec}: decoded {human(self.decoded_bytes)} from "
                         f"{human(self.bytes_read + self.pin_bytes)} read, "
                         f"{self.decode_seconds:.2f} s reading and decoding "
                         f"({rate:.2f} GB/s of raw bytes)")
        when = "on every read" if self.verify_every else "before first use"
        lines.append(f"  checksums: {self.verified} layer checks passed ({when}) in "
                     f"{self.verify_seconds:.2f} s")
        if self.read_seconds > 0:
            share = 100 * self.overlapped_seconds / self.read_seconds
            lines.append(f"  read = {self.read_seconds:.2f} s of device work, of which "
                         f"{self.overlapped_seconds:.2f} s ({share:.0f} %) overlapped compute "
                         f"on the reader thread; {self.exposed_wait_seconds:.2f} s exposed "
                         "waiting in acquire")
        return lines

    def to_json(self) -> dict[str, float | int | str]:
        return {
            "trunk_bytes_read": self.bytes_read + self.pin_bytes,
            "trunk_ring_bytes_read": self.bytes_read,
            "trunk_pin_bytes_read": self.pin_bytes,
            "trunk_pinned_layers": self.pinned,
            "trunk_layers": self.n_layers,
            "trunk_units": self.n_units,
            "trunk_pinned_units": self.pinned_units,
            "trunk_ring_slots": self.ring,
            "trunk_slot_bytes": self.slot_bytes,
            "trunk_small_slot_bytes": self.small_slot_bytes,
            "trunk_pinned_bytes": self.pinned_bytes,
            "trunk_binds": self.binds,
            "trunk_hits": self.hits,
            "trunk_reads": self.reads,
            "trunk_read_seconds": self.read_seconds,
            "trunk_exposed_wait_seconds": self.exposed_wait_seconds,
            "trunk_overlapped_seconds": self.overlapped_seconds,
            "trunk_pin_seconds": self.pin_seconds,
            "trunk_checksums_verified": self.verified,
            "trunk_verify_seconds": self.verify_seconds,
            "trunk_verify_every_read": self.verify_every,
            "trunk_codec": self.codec,
            "trunk_decoded_bytes": self.decoded_bytes,
            "trunk_decode_seconds": self.decode_seconds,
        }


class _Slot:
    def __init__(self, index: int, buf: np.ndarray):
        self.index = index
        self.buf = buf
        self.unit: int | None = None
        self.state = EMPTY


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
        self.splits: list[LayerSplit] = [split_layer(manifest.layers[L], split) for L in range(n)]
        self.units: list[LayerPart] = [p for sp in self.splits for p in sp.parts]
        self._first: list[int] = []  # unit index of each layer's first part
        acc = 0
        for sp in self.splits:
            self._first.append(acc)
            acc += len(sp.parts)
        self._views = [self._unit_views(u) for u in range(len(self.units))]
        self.plan: TrunkPlan = plan_trunk([u.nbytes for u in self.units], budget_bytes, ring,
                                          small_slot=split)
        self.stats = TrunkStats(n, len(self.pinned_layers), self.plan.ring,
                                self.plan.slot_bytes, self.plan.pinned_bytes,
                                verify_every=verify_every, codec=manifest.codec,
                                n_units=len(self.units),
                                pinned_units=len(self.plan.pinned),
                                small_slot_bytes=self.plan.small_slot_bytes)
        self._codec = codec_for_manifest(manifest.codec) if manifest.compressed else None
        self._staging_bytes = max((staging_bytes(manifest.layers[L].windows) for L in range(n)),
                                  default=0) if manifest.compressed else 0
        self._local = threading.local()  # a staging buffer per reading thread
        #: a compressed trunk's ring slots are this much larger, so that a unit's encoded
        #: windows read into the slot's tail and decode in place (``in_place_offset``): the
        #: ring then needs no staging buffer beside it
        self._slack = (max((w.nbytes for L in range(n) for w in manifest.layers[L].windows),
                           default=0) + 3 * ALIGN) if manifest.compressed else 0
        #: reads the next chunk of encoded windows while the current one decodes
        self._prefetch = DaemonExecutor("k3-trunk-prefetch") if manifest.compressed else None
        self._file: StorageFile | None = _open(storage, manifest)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors: dict[int, K3Error] = {}
        self._held: dict[int, _Slot] = {}
        self._live: dict[int, tuple[LayerParams, int]] = {}
        self._stream = self.plan.streamed
        self._pos = {u: i for i, u in enumerate(self._stream)}
        self._cur = -1  # the streamed unit last acquired (-1: none yet)
        self._asm = {L: LayerAssembly(manifest.layers[L], self.splits[L]) for L in range(n)}
        self._small: dict[int, dict[str, np.ndarray]] = {}
        self._pinned: dict[int, dict[str, np.ndarray]] = {}
        self.slots: list[_Slot] = []
        try:
            self.slots = [_Slot(i, slot_buffer(n + self._slack))
                          for i, n in enumerate(self.plan.slot_sizes)]
            self._load_open(progress)
            # the opening reads' staging is not needed again: the slots decode in place
            self._local.__dict__.clear()
        except BaseException:
            self.close()
            raise
        if self.plan.ring >= 2:
            self._thread = threading.Thread(target=self._reader, name="k3-trunk-reader",
                                            daemon=True)
            self._thread.start()

    # ---- the TrunkSource interface ------------------------------------------------------
    def acquire(self, layer: int) -> LayerParams:
        if not 0 <= layer < len(self.splits):
            raise K3Error(f"trunk: layer {layer} is not part of this run's walk "
                          f"(0..{self.stats.n_layers - 1})")
        if layer in self._live:
            raise K3Error(f"trunk: layer {layer} acquired twice without a release")
        u = self._first[layer]
        mats = self._acquire_unit(u)
        t = dict(self._small[layer])
        t.update(mats)
        p = LayerParams(layer, self.cfg.is_mla(layer), self.cfg.is_dense(layer), t)
        self._live[layer] = (p, u)
        return p

    def begin_mlp(self, layer: int) -> None:
        live = self._live.get(layer)
        if live is None:
            raise K3Error(f"trunk: begin_mlp({layer}) before acquire({layer})")
        p, u = live
        if u + 1 >= self._first[layer] + len(self.splits[layer].parts):
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
        if not 0 <= layer < len(self.splits) or layer not in self._small:
            return None
        u = self._first[layer] + len(self.splits[layer].parts) - 1
        mats = self._pinned.get(u)
        if mats is None:
            with self._cond:
                slot = self._slot_of(u) if u in self._pos else None
                if slot is None or slot.state != READY:
                    return None
                buf = slot.buf
            mats = self._bind(u, buf)
        t = dict(self._small[layer])
        t.update(mats)
        return LayerParams(layer, self.cfg.is_mla(layer), self.cfg.is_dense(layer), t)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(JOIN_SECONDS)
            if t.is_alive():  # a read is stuck in the kernel: leave the file to the daemon
                return
        if self._prefetch is not None:
            self._prefetch.shutdown()
        f, self._file = self._file, None
        if f is not None:
            f.close()

    # ---- state queries (tests and reports) -----------------------------------------------
    @property
    def pinned_layers(self) -> tuple[int, ...]:
        """Layers every part of which is pinned."""
        pinned = set(self.plan.pinned)
        return tuple(L for L, sp in enumerate(self.splits)
                     if all(self._first[L] + k in pinned for k in range(len(sp.parts))))

    @property
    def unit_labels(self) -> list[str]:
        return [u.label for u in self.units]

    @property
    def has_reader(self) -> bool:
        return self._thread is not None

    def slot_states(self) -> list[tuple[int | None, str]]:
        """``(layer, state)`` of every ring slot (the layer whose part it holds)."""
        with self._cond:
            return [(None if s.unit is None else self.units[s.unit].layer, s.state)
                    for s in self.slots]

    def held_layers(self) -> list[int]:
        with self._cond:
            return sorted({self.units[u].layer for u in self._held})

    # ---- internals ----------------------------------------------------------------------
    def _unit_views(self, u: int) -> list[tuple[str, int, int, np.dtype, tuple[int, ...]]]:
        part = self.units[u]
        lay = self.manifest.layers[part.layer]
        want = set(part.matrices)
        out = []
        for t in lay.tensors.values():
            split = names.split_layer_name(t.name)
            assert split is not None  # checked by the manifest reader
            if split[1] in want:
                out.append((split[1], t.off - part.start, t.nbytes, t.np_dtype, t.shape))
        return out

    def _acquire_unit(self, u: int) -> dict[str, np.ndarray]:
        pinned = self._pinned.get(u)
        if pinned is not None:
            self.stats.binds += 1
            self.stats.hits += 1
            return pinned
        t0 = time.perf_counter()
        slot = self._wait_ready(u)
        self.stats.exposed_wait_seconds += time.perf_counter() - t0
        try:
            mats = self._bind(u, slot.buf)
        except BaseException:
            self._release_unit(u)
            raise
        self.stats.binds += 1
        return mats

    def _release_unit(self, u: int) -> None:
        if u in self._pinned:
            return
        with self._cond:
            self._held.pop(u, None)
            self._cond.notify_all()

    def _load_open(self, progress: Callable[[int, int], None] | None) -> None:
        """Resident ranges and pinned parts, read once; layers with a pinned part verified."""
        f = self._file
        assert f is not None
        t0 = time.perf_counter()
        most = max((b - a for sp in self.splits for a, b in sp.resident), default=0)
        scratch = slot_buffer(most) if most else None
        for L, sp in enumerate(self.splits):
            lay = self.manifest.layers[L]
            for a, b in sp.resident:
                assert scratch is not None
                self._read_open(f, lay, scratch, a, b - a)
                self.stats.pin_bytes += self._disk_bytes(lay, a, b - a)
                self._asm[L].feed(-1, scratch[: b - a], a)
        del scratch
        bufs: dict[int, np.ndarray] = {}
        total = len(self.plan.pinned)
        for i, u in enumerate(self.plan.pinned):
            part = self.units[u]
            buf = slot_buffer(part.nbytes)
            self._read_open(f, self.manifest.layers[part.layer], buf, part.start, part.nbytes)
            self.stats.pin_bytes += self._disk_bytes(self.manifest.layers[part.layer], part.start,
                                                     part.nbytes)
            self._asm[part.layer].feed(u - self._first[part.layer], buf[: part.nbytes], part.start)
            bufs[u] = buf
            if progress:
                progress(i + 1, total)
        touched = sorted({self.units[u].layer for u in self.plan.pinned})
        for L in touched:  # finish the layers pinned in part through a ring slot
            for k, part in enumerate(self.splits[L].parts):
                if not self._asm[L].fed(k):
                    buf = self.slots[0].buf
                    self._read(f, self.manifest.layers[L], buf, part.start, part.nbytes)
                    self.stats.pin_bytes += self._disk_bytes(self.manifest.layers[L], part.start,
                                                             part.nbytes)
                    self._asm[L].feed(k, buf[: part.nbytes], part.start)
            self._finish(L)
        for u, buf in bufs.items():
            self._pinned[u] = self._bind(u, buf)
        self.stats.pin_seconds += time.perf_counter() - t0

    def _read_open(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int,
                   nbytes: int) -> None:
        """An opening read into a buffer of its exact size (a pinned part, the resident
        ranges). A compressed trunk's goes through the first ring slot in pieces of its room,
        each decoded in place and copied out, so opening needs no staging buffer either; with
        no ring (everything pinned) it is staged."""
        if self._codec is None or not self.slots:
            self._read(f, lay, buf, start, nbytes)
            return
        slot = self.slots[0].buf
        step = self._piece(slot)
        for a in range(start, start + nbytes, step):
            n = min(step, start + nbytes - a)
            self._read(f, lay, slot, a, n)
            buf[a - start : a - start + n] = slot[:n]

    def _piece(self, slot: np.ndarray) -> int:
        """The aligned bytes of a slot one piece of a larger read may take (the slack stays
        free for the encoded bytes of an in-place decode)."""
        room = slot.nbytes - self._slack
        return room - room % ALIGN

    def _finish(self, layer: int) -> None:
        """Every piece of ``layer`` is in: check its CRC, bind its small tensors."""
        asm = self._asm[layer]
        t0 = time.perf_counter()
        problem = asm.problem(self.manifest)
        if problem is not None:
            raise CheckpointError(problem)
        small = bind_small(self.cfg, layer, asm.small_raw())
        asm.drop_raw()
        with self._cond:
            self.stats.verify_seconds += time.perf_counter() - t0
            self.stats.verified += 1
            self._small[layer] = small

    def _bind(self, u: int, buf: np.ndarray) -> dict[str, np.ndarray]:
        raw: dict[str, np.ndarray] = {}
        for suffix, off, nbytes, dtype, shape in self._views[u]:
            view = buf[off : off + nbytes].view(dtype).reshape(shape)
            view.flags.writeable = False
            raw[suffix] = view
        return bind_matrices(self.cfg, self.units[u].layer, raw)

    def _read(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int,
              nbytes: int) -> None:
        try:
            if self._codec is not None:
                self._read_coded(f, lay, buf, start, nbytes)
            elif threading.current_thread() is self._thread:
                _read_ahead(f, lay.file_off + start, buf[:nbytes])
            else:
                f.read_into(lay.file_off + start, buf[:nbytes])
        except CheckpointError:
            raise  # a window that does not decode: named by decoded_windows
        except K3Error as exc:
            raise StorageError(f"trunk layer {lay.layer}: {exc.message}") from None
        except (OSError, ValueError, BufferError) as exc:
            raise StorageError(f"trunk layer {lay.layer}: read failed: {exc}") from None

    def _disk_bytes(self, lay: TrunkLayer, start: int, nbytes: int) -> int:
        """Bytes a read of raw ``[start, start + nbytes)`` of ``lay`` takes from the file."""
        if self._codec is None:
            return nbytes
        return sum(w.nbytes for w in _windows_in(lay, start, nbytes))

    def _read_coded(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int,
                    nbytes: int) -> None:
        """Read the encoded windows that cover raw ``[start, start + nbytes)`` of ``lay`` in
        aligned chunks and decode them into ``buf[:nbytes]`` (a window that straddles the
        range is decoded aside and its share copied)."""
        assert self._codec is not None
        wins = _windows_in(lay, start, nbytes)
        at = in_place_offset(wins, start, buf.size)
        staging: np.ndarray
        if at is not None:  # a ring slot (it has the room): the encoded bytes read into its tail
            staging = buf[at:]
        else:
            held = getattr(self._local, "staging", None)
            staging = held if held is not None else self._new_staging()
        end = start + nbytes
        # a straddling window decodes into this thread's scratch (one window at a time:
        # decoded_windows yields each window before it decodes the next)
        aside = getattr(self._local, "aside", None)
        widest = max((w.raw_len for w in wins), default=0)
        if aside is None or aside.size < widest:
            aside = self._local.aside = np.empty(widest, dtype=np.uint8)

        def inside(w: Window) -> bool:
            return w.raw_off >= start and w.raw_off + w.raw_len <= end

        def dest(w: Window) -> np.ndarray:
            if inside(w):
                return buf[w.raw_off - start : w.raw_off - start + w.raw_len]
            return aside[: w.raw_len]

        # the reader thread's chunks go after the demand reads in flight, as _read_ahead's
        gate = DEMAND.wait_for_demand if threading.current_thread() is self._thread else None
        t0 = time.perf_counter()
        for w in decoded_windows(f, self.manifest.bin_path, lay.layer, lay.file_off, wins,
                                 self._codec, staging, dest, self._prefetch,
                                 linear=at is not None, gate=gate):
            if not inside(w):
                a, b = max(start, w.raw_off), min(end, w.raw_off + w.raw_len)
                buf[a - start : b - start] = aside[a - w.raw_off : b - w.raw_off]
        covered = sum(min(end, w.raw_off + w.raw_len) - max(start, w.raw_off) for w in wins)
        if covered < nbytes:  # bytes no window holds (the alignment padding) read as zeros
            _zero_gaps(buf, start, end, wins)
        with self._cond:
            self.stats.decoded_bytes += nbytes
            self.stats.decode_seconds += time.perf_counter() - t0

    def _new_staging(self) -> np.ndarray:
        """This thread's staging for reads that cannot decode in place (two chunks)."""
        staging: np.ndarray = aligned_empty(2 * self._staging_bytes, ALIGN)
        self._local.staging = staging
        return staging

    def _wanted(self) -> list[int]:
        """The held unit and the next ``ring - 1`` streamed units, nearest first."""
        m = len(self._stream)
        p = self._pos[self._cur] if self._cur >= 0 else 0
        return [self._stream[(p + k) % m] for k in range(min(self.plan.ring, m))]

    def _slot_of(self, u: int) -> _Slot | None:
        for s in self.slots:
            if s.unit == u and s.state != EMPTY:
                return s
        return None

    def _victim(self, wanted: list[int], need: int = 0, spare: int | None = None) -> _Slot | None:
        """A slot of at least ``need`` bytes to read into, the smallest that fits: an empty
        one, else a ready one neither held nor wanted (nor, when ``spare`` is given, one
        holding a wanted unit farther than ``spare``: see ``_next_job``)."""
        held = {id(s) for s in self._held.values()}
        fits = sorted((s for s in self.slots if s.buf.nbytes >= need), key=lambda s: s.buf.nbytes)
        for s in fits:
            if s.state == EMPTY:
                return s
        for s in fits:
            if s.state == READY and id(s) not in held and s.unit not in wanted:
                return s
        if spare is not None:
            farther = wanted[wanted.index(spare) + 1 :]
            for s in fits:
                if s.state == READY and id(s) not in held and s.unit in farther:
                    return s
        return None

    def _next_job(self) -> tuple[_Slot, int] | None:
        wanted = self._wanted()
        for k, u in enumerate(wanted):
            if self._slot_of(u) is not None or u in self._errors:
                continue
            # the nearest unit still missing may take a farther wanted unit's slot (unequal
            # slots: the only one it fits may hold it); a farther one never evicts
            slot = self._victim(wanted, self.units[u].nbytes, spare=u if k == 0 else None)
            if slot is None:
                return None
            slot.unit, slot.state = u, READING
            return slot, u
        return None

    def _fill(self, slot: _Slot, u: int) -> None:
        """Read unit ``u`` into ``slot`` (marked READING by the caller), then publish or fail.

        The first read of a layer also reads its other parts through the slot (before this
        one), so the layer's checksum is checked before any of its bytes is served.
        """
        part = self.units[u]
        L = part.layer
        k = u - self._first[L]
        lay = self.manifest.layers[L]
        f = self._file
        t0 = time.perf_counter()
        nbytes = disk = 0
        try:
            if f is None:
                raise StorageError(f"trunk layer {L}: the trunk is closed")
            fresh = L not in self._small
            if fresh:  # the other parts through this slot, in pieces if it is the smaller
                step = self._piece(slot.buf)
                for j, other in enumerate(self.splits[L].parts):
                    if j != k and not self._asm[L].fed(j):
                        for a in range(other.start, other.end, step):
                            n = min(step, other.end - a)
                            self._read(f, lay, slot.buf, a, n)
                            nbytes += n
                            disk += self._disk_bytes(lay, a, n)
                            self._asm[L].feed(j, slot.buf[:n], a)
            self._read(f, lay, slot.buf, part.start, part.nbytes)
            nbytes += part.nbytes
            disk += self._disk_bytes(lay, part.start, part.nbytes)
            if fresh:
                self._asm[L].feed(k, slot.buf[: part.nbytes], part.start)
                self._finish(L)
            elif self.verify_every:
                c0 = time.perf_counter()
                problem = self._asm[L].part_problem(self.manifest, k, slot.buf)
                with self._cond:
                    self.stats.verify_seconds += time.perf_counter() - c0
                if problem is not None:
                    raise CheckpointError(problem)
                with self._cond:
                    self.stats.verified += 1
        except BaseException as exc:  # anything: the slot must never stay READING
            err = exc if isinstance(exc, K3Error) else StorageError(
                f"trunk layer {L}: read failed: {exc!r}")
            with self._cond:
                slot.unit, slot.state = None, EMPTY
                self._errors[u] = err
                self.stats.failed_reads += 1
                self._cond.notify_all()
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt / SystemExit in the caller's thread
            return
        dt = time.perf_counter() - t0
        with self._cond:
            slot.state = READY
            self.stats.reads += 1
            self.stats.bytes_read += disk
            self.stats.read_seconds += dt
            self._cond.notify_all()

    def _wait_ready(self, u: int) -> _Slot:
        with self._cond:
            if u in self._held:
                raise K3Error(f"trunk: layer {self.units[u].layer} acquired twice without a "
                              "release")
            self._cur = u
            self._cond.notify_all()
            while True:
                if self._stop.is_set():
                    raise K3Error("trunk: closed while a layer was being acquired")
                err = self._errors.pop(u, None)
                if err is not None:
                    raise err
                slot = self._slot_of(u)
                if slot is not None and slot.state == READY:
                    self._held[u] = slot
                    return slot
                if self._thread is None and slot is None:
                    victim = self._victim([u], self.units[u].nbytes)
                    if victim is None:
                        raise K3Error(f"trunk: no free ring slot for layer "
                                      f"{self.units[u].layer}; release the layer in use first")
                    victim.unit, victim.state = u, READING
                    self._cond.release()
                    try:
                        self._fill(victim, u)
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(0.25)

    def _reader(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                job = self._next_job()
                if job is None:
                    self._cond.wait(0.25)
                    continue
            self._fill(*job)


def _open(storage: StorageBackend, man: TrunkManifest) -> StorageFile:
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


def _read_ahead(f: StorageFile, offset: int, out: np.ndarray) -> None:
    """The reader thread's read of a ring part: in pieces, each after the expert reads in
    flight (demand reads, k3core/api/read_priority.py) have gone, so that a routed expert
    the MoE waits for is not queued behind a part needed only later."""
    for a in range(0, out.size, AHEAD_PIECE_BYTES):
        DEMAND.wait_for_demand()
        f.read_into(offset + a, out[a : a + AHEAD_PIECE_BYTES])


def _windows_in(lay: TrunkLayer, start: int, nbytes: int) -> tuple[Window, ...]:
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
