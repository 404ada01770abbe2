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
* a trunk packed with a codec is read as encoded windows in aligned chunks
  (:mod:`k3core.trunk.windows`) and decoded into the slot (or pinned buffer); the checksum
  is that of the decoded bytes, checked as above, and a window that does not decode fails
  the read the same way (``CheckpointError`` naming layer and window, never served). With
  two or more slots the ring is read by two threads: the I/O thread (``k3-trunk-io``)
  takes the next part as soon as a slot is free and reads its chunks back to back into the
  slot's tail, and the reader thread decodes each chunk in place once it has landed and
  publishes the part. So the disk goes from one part to the next without waiting for the
  last chunk's decode, the hand-off between threads, or the publishing (measured on the
  medium model's ``bp-nib`` trunk, streamed at ``--trunk-gb 0.2 --cache-gb 0.2``: the disk
  had nothing in flight 12 % of the time with one thread reading and decoding a part, 5 %
  now). A layer's first read (its checksum covers all its parts) is read and decoded whole
  on the I/O thread, a daemon prefetch thread (k3core/api/daemon_executor.py) reading its
  next chunk meanwhile. A part is READING from the moment the I/O thread takes its slot
  until the reader thread publishes it (or empties the slot on an error, once the I/O
  thread no longer writes into it); the chunks, like the raw reader's pieces, go after the
  routed experts' reads in flight.

``acquire`` returns :class:`~k3core.model.layer_params.LayerParams` built by ``prepare_layer`` over
read-only zero-copy views into the slot (bf16 matrices stay views, small vectors are
widened copies); they are valid until ``release``. ``close`` stops the (daemon) reader
thread with a stop event and a bounded join, so an exception or Ctrl-C never hangs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3core.api.daemon_executor import DaemonExecutor
from k3core.api.errors import CheckpointError, K3Error, StorageError
from k3core.api.read_priority import DEMAND
from k3core.api.storage import StorageBackend, StorageFile, aligned_empty
from k3core.api.units import ALIGN
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams
from k3core.model.sources import TrunkSource
from k3core.trunk import windows as window_table
from k3core.trunk.assembly import LayerAssembly
from k3core.trunk.bind import bind_matrices, bind_small
from k3core.trunk.codec import codec_for_manifest
from k3core.trunk.manifest import TrunkLayer, TrunkManifest
from k3core.trunk.part_io import (
    open_trunk_file,
    read_ahead,
    read_error,
    slot_buffer,
    windows_in,
    zero_padding,
)
from k3core.trunk.parts import LayerPart, LayerSplit, split_layer
from k3core.trunk.plan import DEFAULT_RING, TrunkPlan, plan_trunk
from k3core.trunk.stats import TrunkStats
from k3core.trunk.windows import (
    CodedWindows,
    Landing,
    Window,
    decode_chunk,
    in_place_offset,
    in_place_windows,
    linear_base,
    linear_reader,
    prefetched_windows,
    staging_bytes,
)

EMPTY, READING, READY = "empty", "reading", "ready"
#: how long ``close`` waits for the reader thread (it is a daemon thread either way)
JOIN_SECONDS = 5.0


class _Slot:
    def __init__(self, index: int, buf: np.ndarray):
        self.index = index
        self.buf = buf
        self.unit: int | None = None
        self.state = EMPTY


@dataclass
class _RingJob:
    """A coded ring part in flight: its encoded chunks read into the tail of ``slot`` by the
    I/O thread (``landing``), decoded in place by the reader thread."""

    slot: _Slot
    unit: int
    windows: tuple[Window, ...]
    chunks: list[tuple[int, int]]  # the windows' read chunks, the same for both threads
    at: int  # where in the slot the encoded bytes land (``in_place_offset``)
    disk: int  # encoded bytes it reads
    landing: Landing


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
        self._file: StorageFile | None = open_trunk_file(storage, manifest)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: a coded ring's I/O thread and the parts it has started, oldest first
        self._io: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[_RingJob | None] = queue.SimpleQueue()
        self._in_flight: list[_RingJob] = []
        self._errors: dict[int, K3Error] = {}
        self._held: dict[int, _Slot] = {}
        self._live: dict[int, tuple[LayerParams, int]] = {}
        self._stream = self.plan.streamed
        self._pos = {u: i for i, u in enumerate(self._stream)}
        self._cur = -1  # the streamed unit last acquired (-1: none yet)
        self._cur_released = False  # ... and released since (the walk is past it)
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
            coded = self._codec is not None
            self._thread = threading.Thread(target=self._decoder if coded else self._reader,
                                            name="k3-trunk-reader", daemon=True)
            self._thread.start()
            if coded:
                self._io = threading.Thread(target=self._io_loop, name="k3-trunk-io",
                                            daemon=True)
                self._io.start()

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
            for job in self._in_flight:
                job.landing.stop()
            self._cond.notify_all()
        self._jobs.put(None)
        for t in (self._io, self._thread):
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
            if u == self._cur:
                self._cur_released = True
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
            elif self._reading_ahead():
                read_ahead(f, lay.file_off + start, buf[:nbytes])
            else:
                f.read_into(lay.file_off + start, buf[:nbytes])
        except (K3Error, OSError, ValueError, BufferError) as exc:
            raise read_error(lay.layer, exc) from None

    def _disk_bytes(self, lay: TrunkLayer, start: int, nbytes: int) -> int:
        """Bytes a read of raw ``[start, start + nbytes)`` of ``lay`` takes from the file."""
        if self._codec is None:
            return nbytes
        return sum(w.nbytes for w in windows_in(lay, start, nbytes))

    def _read_coded(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray, start: int,
                    nbytes: int) -> None:
        """Read the encoded windows that cover raw ``[start, start + nbytes)`` of ``lay`` in
        aligned chunks and decode them into ``buf[:nbytes]`` (a window that straddles the
        range is decoded aside and its share copied)."""
        assert self._codec is not None
        wins = windows_in(lay, start, nbytes)
        at = in_place_offset(wins, start, buf.size)
        staging: np.ndarray
        if at is not None:  # a ring slot (it has the room): the encoded bytes read into its tail
            staging = buf[at:]
        else:
            held = getattr(self._local, "staging", None)
            staging = held if held is not None else self._new_staging()
        dest, land = self._sink(buf, start, nbytes, wins)
        # the reader threads' chunks go after the demand reads in flight, as _read_ahead's
        gate = DEMAND.wait_for_demand if self._reading_ahead() else None
        t0 = time.perf_counter()
        src = CodedWindows(f, self.manifest.bin_path, lay.layer, lay.file_off, wins, self._codec)
        assert self._prefetch is not None
        read = in_place_windows if at is not None else prefetched_windows
        for w in read(src, staging, dest, self._prefetch, gate):
            land(w)
        zero_padding(buf, start, nbytes, wins)
        with self._cond:
            self.stats.decoded_bytes += nbytes
            self.stats.decode_seconds += time.perf_counter() - t0

    def _sink(self, buf: np.ndarray, start: int, nbytes: int, wins: tuple[Window, ...]
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

    def _new_staging(self) -> np.ndarray:
        """This thread's staging for reads that cannot decode in place (two chunks)."""
        staging: np.ndarray = aligned_empty(2 * self._staging_bytes, ALIGN)
        self._local.staging = staging
        return staging

    def _wanted(self) -> list[int]:
        """The held unit and the next ``ring - 1`` streamed units, nearest first. Once the
        unit last acquired is released, the walk is past it (it computes pinned parts, or
        the head and the next token's embedding, before it acquires the next streamed
        unit), so the window moves on: its slot may take the unit after the next meanwhile.
        On the medium model streamed at ``--trunk-gb 0.2`` the walk spends about 8 ms a token
        between the last layer's MoE part and layer 1's, with the ring's two slots holding
        both and the disk idle, until this."""
        m = len(self._stream)
        p = self._pos[self._cur] + self._cur_released if self._cur >= 0 else 0
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
                self._verify_part(L, k, slot.buf)
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

    def _verify_part(self, layer: int, k: int, buf: np.ndarray) -> None:
        """``--verify-trunk`` on a ring read: part ``k`` of ``layer`` in ``buf`` against its
        checksum segments, or ``CheckpointError``."""
        c0 = time.perf_counter()
        problem = self._asm[layer].part_problem(self.manifest, k, buf)
        with self._cond:
            self.stats.verify_seconds += time.perf_counter() - c0
        if problem is not None:
            raise CheckpointError(problem)
        with self._cond:
            self.stats.verified += 1

    def _wait_ready(self, u: int) -> _Slot:
        with self._cond:
            if u in self._held:
                raise K3Error(f"trunk: layer {self.units[u].layer} acquired twice without a "
                              "release")
            self._cur = u
            self._cur_released = False
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

    def _reading_ahead(self) -> bool:
        """Whether this is a thread that reads ahead of the walk (its reads yield to the
        routed experts' demand reads)."""
        me = threading.current_thread()
        return me is self._thread or me is self._io

    # ---- a coded ring: one thread reads, one decodes --------------------------------------
    def _io_loop(self) -> None:
        """The coded ring's reads, part after part: a part's encoded chunks are read back to
        back into the tail of its slot while the reader thread decodes the chunks that have
        landed, and the next part's reads start as soon as a slot is free, whatever the
        decoder is doing (see the module docstring). A layer's first read (its checksum is
        taken over all its parts) is read and decoded here, whole, as ``_fill`` does it."""
        while not self._stop.is_set():
            with self._cond:
                picked = self._next_job()
                if picked is None:
                    self._cond.wait(0.25)
                    continue
                job = self._ring_job(*picked)
                if job is not None:
                    if self._stop.is_set():
                        return
                    self._in_flight.append(job)
            if job is None:
                self._fill(*picked)
                continue
            self._jobs.put(job)
            job.landing.read_all(self._chunk_read(job), len(job.chunks))

    def _ring_job(self, slot: _Slot, u: int) -> _RingJob | None:
        """``u`` as a part the two threads share, or ``None`` when the I/O thread fills it
        alone (its layer's first read, or a part that cannot decode in place)."""
        part = self.units[u]
        if part.layer not in self._small:
            return None
        lay = self.manifest.layers[part.layer]
        wins = windows_in(lay, part.start, part.nbytes)
        at = in_place_offset(wins, part.start, slot.buf.size)
        if at is None:
            return None
        return _RingJob(slot, u, wins, window_table.chunks(wins), at,
                        self._disk_bytes(lay, part.start, part.nbytes), Landing())

    def _chunk_read(self, job: _RingJob) -> Callable[[int], None]:
        """The read of chunk ``k`` of ``job`` into its slot's tail, after the demand reads in
        flight (a closed trunk's read fails, on the I/O thread, like any other)."""
        lay = self.manifest.layers[self.units[job.unit].layer]
        f = self._file
        if f is None:
            def closed(k: int) -> None:
                raise StorageError(f"trunk layer {lay.layer}: the trunk is closed")
            return closed
        assert self._codec is not None
        src = CodedWindows(f, self.manifest.bin_path, lay.layer, lay.file_off, job.windows,
                           self._codec)
        return linear_reader(src, job.slot.buf[job.at :], job.chunks, DEMAND.wait_for_demand)

    def _decoder(self) -> None:
        """The coded ring's reader thread: decode the parts the I/O thread started, in
        order, and publish each (or its error)."""
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.25)
            except queue.Empty:
                continue
            if job is None:
                return
            self._decode_job(job)

    def _decode_job(self, job: _RingJob) -> None:
        part = self.units[job.unit]
        L = part.layer
        buf = job.slot.buf
        assert self._codec is not None
        t0 = time.perf_counter()
        waited = 0.0
        try:
            staging = buf[job.at :]
            base = linear_base(job.windows)
            dest, land = self._sink(buf, part.start, part.nbytes, job.windows)
            for k, (a, b) in enumerate(job.chunks):
                w0 = time.perf_counter()
                job.landing.wait_for(k)
                waited += time.perf_counter() - w0
                for w in decode_chunk(staging, base, job.windows, a, b, self._codec, dest,
                                      self.manifest.bin_path, L):
                    land(w)
            zero_padding(buf, part.start, part.nbytes, job.windows)
            if self.verify_every:
                self._verify_part(L, job.unit - self._first[L], buf)
        except BaseException as exc:  # anything: the slot must never stay READING
            job.landing.stop()
            done = job.landing.wait_done(JOIN_SECONDS)
            err = read_error(L, exc)
            with self._cond:
                self._in_flight.remove(job)
                if done:  # else a read still lands in the slot: it stays READING, unused
                    job.slot.unit, job.slot.state = None, EMPTY
                self._errors[job.unit] = err
                self.stats.failed_reads += 1
                self._cond.notify_all()
            if not isinstance(exc, Exception):
                raise
            return
        job.landing.wait_done()
        with self._cond:
            self._in_flight.remove(job)
            job.slot.state = READY
            self.stats.reads += 1
            self.stats.bytes_read += job.disk
            self.stats.read_seconds += job.landing.seconds
            self.stats.decoded_bytes += part.nbytes
            self.stats.decode_seconds += time.perf_counter() - t0 - waited
            self._cond.notify_all()
