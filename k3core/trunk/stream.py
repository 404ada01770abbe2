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
* a trunk packed with a codec is read as encoded windows in aligned chunks, decoded into
  the slot (or pinned buffer) by the thread that reads it, with a daemon prefetch thread
  reading the next chunk meanwhile (:mod:`k3core.trunk.windows`); the checksum is that of
  the decoded bytes, checked as above, and a window that does not decode fails the read
  the same way (``CheckpointError`` naming layer and window, never served).

``acquire`` returns :class:`~k3core.model.layer_params.LayerParams` built by ``prepare_layer`` over
read-only zero-copy views into the slot (bf16 matrices stay views, small vectors are
widened copies); they are valid until ``release``. ``close`` stops the (daemon) reader
thread with a stop event and a bounded join, so an exception or Ctrl-C never hangs.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from k3core.api.errors import CheckpointError, K3Error, StorageError
from k3core.api.storage import StorageBackend, StorageFile, aligned_empty
from k3core.api.units import ALIGN, align_up, human
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams, prepare_layer
from k3core.model.sources import TrunkSource
from k3core.trunk.codec import codec_for_manifest
from k3core.trunk.manifest import TrunkLayer, TrunkManifest, checksum_problem
from k3core.trunk.plan import DEFAULT_RING, TrunkPlan, plan_trunk
from k3core.trunk.windows import Prefetcher, decoded_windows, staging_bytes

EMPTY, READING, READY = "empty", "reading", "ready"
HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14
#: how long ``close`` waits for the reader thread (it is a daemon thread either way)
JOIN_SECONDS = 5.0


def slot_buffer(nbytes: int) -> np.ndarray:
    """An aligned buffer of at least ``nbytes``; 2 MiB aligned with MADV_HUGEPAGE if large."""
    if nbytes >= HUGE_PAGE:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        buf = aligned_empty(size, HUGE_PAGE)
        _advise_hugepages(buf)
        return buf
    return aligned_empty(max(ALIGN, align_up(nbytes)), ALIGN)


def _advise_hugepages(buf: np.ndarray) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(buf.nbytes),
                     ctypes.c_int(MADV_HUGEPAGE))
    except (OSError, AttributeError):  # advisory only
        pass


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

    @property
    def overlapped_seconds(self) -> float:
        return max(0.0, self.read_seconds - self.exposed_wait_seconds)

    def report_lines(self) -> list[str]:
        binds = max(self.binds, 1)
        rate = self.bytes_read / self.read_seconds / 1e6 if self.read_seconds > 0 else 0.0
        lines = [
            f"trunk [final]: pinned {self.pinned}/{self.n_layers} layers, ring {self.ring} "
            f"slots x {human(self.slot_bytes)}",
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
            "trunk_ring_slots": self.ring,
            "trunk_slot_bytes": self.slot_bytes,
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
        self.layer: int | None = None
        self.state = EMPTY


class StreamedTrunk(TrunkSource):
    """Pinned layers plus a ring of slots over ``trunk.bin`` (see the module docstring)."""

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
    ):
        self.cfg = cfg
        self.verify_every = verify_every
        self._verified: set[int] = set()
        self.manifest = manifest
        n = n_layers or cfg.n_layers
        self.plan: TrunkPlan = plan_trunk([manifest.layers[L].nbytes for L in range(n)],
                                          budget_bytes, ring)
        self.stats = TrunkStats(n, len(self.plan.pinned), self.plan.ring,
                                self.plan.slot_bytes, self.plan.pinned_bytes,
                                verify_every=verify_every, codec=manifest.codec)
        self._codec = codec_for_manifest(manifest.codec) if manifest.compressed else None
        self._staging_bytes = max((staging_bytes(manifest.layers[L].windows) for L in range(n)),
                                  default=0) if manifest.compressed else 0
        self._local = threading.local()  # a staging buffer per reading thread
        #: reads the next chunk of encoded windows while the current one decodes
        self._prefetch = Prefetcher() if manifest.compressed else None
        self._file: StorageFile | None = _open(storage, manifest)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors: dict[int, K3Error] = {}
        self._held: dict[int, _Slot] = {}
        self._stream = self.plan.streamed
        self._pos = {L: i for i, L in enumerate(self._stream)}
        self._cur = -1  # the streamed layer last acquired (-1: none yet)
        self._pinned: dict[int, LayerParams] = {}
        try:
            self._load_pinned(progress)
            self.slots = [_Slot(i, slot_buffer(self.plan.slot_bytes))
                          for i in range(self.plan.ring)]
        except BaseException:
            self.close()
            raise
        if self.plan.ring >= 2:
            self._thread = threading.Thread(target=self._reader, name="k3-trunk-reader",
                                            daemon=True)
            self._thread.start()

    # ---- the TrunkSource interface ------------------------------------------------------
    def acquire(self, layer: int) -> LayerParams:
        pinned = self._pinned.get(layer)
        if pinned is not None:
            self.stats.binds += 1
            self.stats.hits += 1
            return pinned
        if layer not in self._pos:
            raise K3Error(f"trunk: layer {layer} is not part of this run's walk "
                          f"(0..{self.stats.n_layers - 1})")
        t0 = time.perf_counter()
        slot = self._wait_ready(layer)
        self.stats.exposed_wait_seconds += time.perf_counter() - t0
        try:
            params = self._bind(layer, slot.buf)
        except BaseException:
            self.release(layer)
            raise
        self.stats.binds += 1
        return params

    def release(self, layer: int) -> None:
        if layer in self._pinned:
            return
        with self._cond:
            self._held.pop(layer, None)
            self._cond.notify_all()

    def peek(self, layer: int) -> LayerParams | None:
        """A pinned layer, or a streamed one whose slot is already READY (never waits).

        While the caller holds the layer before it, the reader keeps that slot: it is one of
        the layers the ring wants next."""
        pinned = self._pinned.get(layer)
        if pinned is not None:
            return pinned
        with self._cond:
            slot = self._slot_of(layer) if layer in self._pos else None
            if slot is None or slot.state != READY:
                return None
            buf = slot.buf
        return self._bind(layer, buf)

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
        return self.plan.pinned

    @property
    def has_reader(self) -> bool:
        return self._thread is not None

    def slot_states(self) -> list[tuple[int | None, str]]:
        with self._cond:
            return [(s.layer, s.state) for s in self.slots]

    def held_layers(self) -> list[int]:
        with self._cond:
            return sorted(self._held)

    # ---- internals ----------------------------------------------------------------------
    def _load_pinned(self, progress: Callable[[int, int], None] | None) -> None:
        f = self._file
        assert f is not None
        total = len(self.plan.pinned)
        checks: list[Future[str | None]] = []
        with ThreadPoolExecutor(1, thread_name_prefix="k3-trunk-crc") as pool:
            try:
                for i, L in enumerate(self.plan.pinned):
                    lay = self.manifest.layers[L]
                    buf = slot_buffer(lay.nbytes)
                    t0 = time.perf_counter()
                    self._read(f, lay, buf)
                    self.stats.pin_seconds += time.perf_counter() - t0
                    self.stats.pin_bytes += lay.disk_nbytes
                    checks.append(pool.submit(self._check, lay, buf))  # zlib drops the GIL
                    self._pinned[L] = self._bind(L, buf)
                    if progress:
                        progress(i + 1, total)
            except BaseException:
                for c in checks:
                    c.cancel()
                raise
            for c in checks:
                problem = c.result()
                if problem is not None:
                    raise CheckpointError(problem)

    def _check(self, lay: TrunkLayer, buf: np.ndarray) -> str | None:
        """The checksum problem of ``lay``'s bytes in ``buf`` (``None``: they match)."""
        t0 = time.perf_counter()
        problem = checksum_problem(self.manifest, lay, buf)
        with self._cond:
            self.stats.verify_seconds += time.perf_counter() - t0
            if problem is None:
                self.stats.verified += 1
                self._verified.add(lay.layer)
        return problem

    def _bind(self, layer: int, buf: np.ndarray) -> LayerParams:
        lay = self.manifest.layers[layer]
        raw: dict[str, np.ndarray] = {}
        for t in lay.tensors.values():
            split = names.split_layer_name(t.name)
            assert split is not None  # checked by the manifest reader
            view = buf[t.off : t.off + t.nbytes].view(t.np_dtype).reshape(t.shape)
            view.flags.writeable = False
            raw[split[1]] = view
        return prepare_layer(self.cfg, layer, raw)

    def _read(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray) -> None:
        try:
            if self._codec is not None:
                self._read_coded(f, lay, buf)
            else:
                f.read_into(lay.file_off, buf[: lay.nbytes])
        except CheckpointError:
            raise  # a window that does not decode: named by decoded_windows
        except K3Error as exc:
            raise StorageError(f"trunk layer {lay.layer}: {exc.message}") from None
        except (OSError, ValueError, BufferError) as exc:
            raise StorageError(f"trunk layer {lay.layer}: read failed: {exc}") from None

    def _read_coded(self, f: StorageFile, lay: TrunkLayer, buf: np.ndarray) -> None:
        """Read ``lay``'s encoded windows in aligned chunks and decode them into ``buf``."""
        assert self._codec is not None
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = aligned_empty(2 * self._staging_bytes, ALIGN)
        t0 = time.perf_counter()
        for _ in decoded_windows(f, self.manifest.bin_path, lay.layer, lay.file_off, lay.windows,
                                 self._codec, staging,
                                 lambda w: buf[w.raw_off : w.raw_off + w.raw_len],
                                 self._prefetch):
            pass
        with self._cond:
            self.stats.decoded_bytes += lay.span
            self.stats.decode_seconds += time.perf_counter() - t0

    def _wanted(self) -> list[int]:
        """The held layer and the next ``ring - 1`` streamed layers, nearest first."""
        m = len(self._stream)
        p = self._pos[self._cur] if self._cur >= 0 else 0
        return [self._stream[(p + k) % m] for k in range(min(self.plan.ring, m))]

    def _slot_of(self, layer: int) -> _Slot | None:
        for s in self.slots:
            if s.layer == layer and s.state != EMPTY:
                return s
        return None

    def _victim(self, wanted: list[int]) -> _Slot | None:
        held = {id(s) for s in self._held.values()}
        for s in self.slots:
            if s.state == EMPTY:
                return s
        for s in self.slots:
            if s.state == READY and id(s) not in held and s.layer not in wanted:
                return s
        return None

    def _next_job(self) -> tuple[_Slot, int] | None:
        wanted = self._wanted()
        for L in wanted:
            if self._slot_of(L) is not None or L in self._errors:
                continue
            slot = self._victim(wanted)
            if slot is None:
                return None
            slot.layer, slot.state = L, READING
            return slot, L
        return None

    def _fill(self, slot: _Slot, layer: int) -> None:
        """Read ``layer`` into ``slot`` (marked READING by the caller), then publish or fail."""
        lay = self.manifest.layers[layer]
        f = self._file
        t0 = time.perf_counter()
        try:
            if f is None:
                raise StorageError(f"trunk layer {layer}: the trunk is closed")
            self._read(f, lay, slot.buf)
            if self.verify_every or layer not in self._verified:
                problem = self._check(lay, slot.buf)
                if problem is not None:
                    raise CheckpointError(problem)
        except BaseException as exc:  # anything: the slot must never stay READING
            err = exc if isinstance(exc, K3Error) else StorageError(
                f"trunk layer {layer}: read failed: {exc!r}")
            with self._cond:
                slot.layer, slot.state = None, EMPTY
                self._errors[layer] = err
                self.stats.failed_reads += 1
                self._cond.notify_all()
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt / SystemExit in the caller's thread
            return
        dt = time.perf_counter() - t0
        with self._cond:
            slot.state = READY
            self.stats.reads += 1
            self.stats.bytes_read += lay.disk_nbytes
            self.stats.read_seconds += dt
            self._cond.notify_all()

    def _wait_ready(self, layer: int) -> _Slot:
        with self._cond:
            if layer in self._held:
                raise K3Error(f"trunk: layer {layer} acquired twice without a release")
            self._cur = layer
            self._cond.notify_all()
            while True:
                if self._stop.is_set():
                    raise K3Error("trunk: closed while a layer was being acquired")
                err = self._errors.pop(layer, None)
                if err is not None:
                    raise err
                slot = self._slot_of(layer)
                if slot is not None and slot.state == READY:
                    self._held[layer] = slot
                    return slot
                if self._thread is None and slot is None:
                    victim = self._victim([layer])
                    if victim is None:
                        raise K3Error(f"trunk: no free ring slot for layer {layer}; release "
                                      "the layer in use first")
                    victim.layer, victim.state = layer, READING
                    self._cond.release()
                    try:
                        self._fill(victim, layer)
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
