"""The routed-expert cache: fixed slots of packed experts, batched parallel reads, a policy.

Mechanics (the policy plugin only decides *what stays resident*):

* the arena is ``slots`` fixed-size, 4096-aligned slots; a slot is EMPTY, INFLIGHT (a read
  into it is under way) or holds a key (``layer << 20 | expert``);
* each MoE layer visit is served in batches: requests are walked in order, the policy is
  told of every hit and every miss (``on_hit``/``admit``/``choose_victim``), slots are
  reserved serially in the calling thread, then the misses are read in parallel by a pool of
  reader threads (the storage backends release the GIL) in file-offset order, and only a
  read that completed in full is published; the batch's keys are protected from eviction
  until the MoE has used them;
* ``prefetch`` schedules the first batch as soon as the routing is known, so the reads
  overlap the shared experts and the latent down-projection; ``run_layer`` multiplies the
  resident experts first and every other one as soon as its read completes, so the reads
  still in flight overlap the experts already in; it waits only for what is still missing
  (the *exposed* wait). Each expert writes only its own outputs and the MoE sums them in
  routing order afterwards, so the order of use cannot change a bit;
* ``use`` is called once per distinct expert of a visit: a request of an expert an earlier
  batch of the same visit already served is counted as reuse and not read or used again;
* a failed or short read is never served: the slot goes back to EMPTY, the drop is counted
  and the forward pass fails with ``ExpertDropError`` (exit 4: the result would be corrupt);
* ``lookahead`` hands a *guess* of a later layer's experts to the router lookahead's guessed
  reads (:mod:`k3core.experts.lookahead`), which take slots through this cache's
  :class:`~k3core.experts.lookahead.GuessSlots` face; a guessed read the real request wants
  is adopted by the walk and waited for like its own read.

Honest metrics: a *hit* is a request served from a slot whose bytes were resident before the
current step began; an expert read earlier in the same step (by the prefetcher or an earlier
batch) counts as *reuse*, not as a hit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import numpy as np

from k3core.api.cache_policy import CachePolicy, key_layer, make_key
from k3core.api.errors import ExpertDropError, K3Error, PluginError
from k3core.api.experts import ExpertSource, ExpertStats, ExpertWeights
from k3core.api.prefault import hugepage_buffer, prefault
from k3core.api.read_priority import DEMAND
from k3core.api.storage import aligned_empty
from k3core.api.units import ALIGN
from k3core.checkpoint.index import CheckpointIndex
from k3core.experts.locator import ExpertLocator, ExpertRef
from k3core.experts.lookahead import GuessedReads
from k3core.model import sizes


def _skew(ref: ExpertRef) -> int:
    return ref.offset % ALIGN if ref.contiguous else 0


@dataclass
class _Member:
    expert: int
    ref: ExpertRef
    #: where its bytes are read to; None for a resident expert served as it is (its slot's
    #: bytes, ``ExpertCache._slot_buf``, taken only if its views must be built again)
    buf: np.ndarray | None
    slot: int | None  # None: transient (not retained)
    future: Future[float] | None = None  # a read in flight for this batch
    #: a transient expert's buffer (``buf`` lies in it at the expert's offset modulo ALIGN),
    #: large enough for the whole blocks around it: one read, as into a slot
    blocks: np.ndarray | None = None


@dataclass
class _Visit:
    layer: int
    keys: list[int]
    experts: list[int]
    pos: int = 0
    batch: dict[int, _Member] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # keys already used by an earlier batch


class ExpertCache(ExpertSource):
    """Serves routed experts from a slot arena filled through the checkpoint's storage."""

    def __init__(
        self,
        index: CheckpointIndex,
        locator: ExpertLocator,
        policy: CachePolicy,
        slots: int,
        slot_bytes: int,
        *,
        readers: int = 4,
        recorder: object | None = None,
    ):
        self.index = index
        self.locator = locator
        self.policy = policy
        self.capacity = slots
        self.stride = sizes.slot_bytes(slot_bytes)  # the memory plan counts the same stride
        self.slot_bytes = slot_bytes
        # over huge pages where the kernel gives them: an O_DIRECT read pins its
        # destination's pages, 2.5x less CPU into huge ones (k3core/api/prefault.py)
        self.arena = hugepage_buffer(slots * self.stride)[: slots * self.stride]
        self._arena_at = int(self.arena.ctypes.data) if self.arena.size else 0
        self.slot_of: dict[int, int] = {}
        self.key_of: list[int | None] = [None] * slots
        self.free = list(range(slots - 1, -1, -1))
        # the weights last served from each slot, with their key: views over the arena stay
        # valid for a key in its slot whatever bytes are read in later (same layout, same
        # buffer), so a hit reuses them instead of building and checking them again
        self._slot_views: list[tuple[int, ExpertWeights] | None] = [None] * slots
        self.published: dict[int, int] = {}  # key -> step its bytes became valid
        self.step = 0
        self.stats = ExpertStats()
        self.stats.extra.update({"reuse": 0, "transient": 0, "read_wall_seconds": 0.0})
        self.recorder = recorder
        self._lock = threading.Lock()
        self.readers = max(1, readers)
        self.readers_why = "asked"  # build_expert_cache says how the count was chosen
        self._pool = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="k3-expert")
        self._visit: _Visit | None = None
        #: the router lookahead's guessed reads, in this cache's slots
        self.guesses = GuessedReads(self, self.stats.extra, recorder)
        # the arena's pages are faulted in on a thread of their own while the engine loads;
        # the first read (and ``await_arena``) joins it, so nothing writes the arena sooner
        self.arena_seconds = 0.0
        self._prefault_stop = threading.Event()
        self._prefaulter: threading.Thread | None = threading.Thread(
            target=self._prefault_arena, name="k3-expert-arena", daemon=True)
        self._prefaulter.start()

    def _prefault_arena(self) -> None:
        t0 = time.perf_counter()
        prefault(self.arena, self._prefault_stop)
        self.arena_seconds = time.perf_counter() - t0

    def await_arena(self) -> float:
        """Wait until the arena's pages are mapped (docs/expert-cache.md, "The arena is
        faulted in at load"); returns the seconds waited here."""
        t = self._prefaulter
        if t is None:
            return 0.0
        t0 = time.perf_counter()
        t.join()
        self._prefaulter = None
        return time.perf_counter() - t0

    # ---- ExpertSource ------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.guesses.settle(final=True)
        self.step += 1
        self.policy.begin_token()

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        raise K3Error("ExpertCache serves through run_layer (weights live only inside a batch)")

    def prefetch(self, layer: int, requests: Sequence[int]) -> None:
        if self._visit is not None:
            self._finish_visit()
        experts = [int(e) for e in requests]
        keys = [make_key(layer, e) for e in experts]
        if self.recorder is not None:
            self.recorder.record_many(layer, experts)  # type: ignore[attr-defined]
        self.guesses.resolve(layer, set(keys))
        self.stats.requests += len(keys)
        # the visit serves each key once, all of its rows with one use: the policy hears the
        # distinct keys in the order of their first request (repeats are reuse, never misses)
        self.policy.begin_layer(layer, list(dict.fromkeys(keys)))
        self._visit = _Visit(layer, keys, experts)
        self._schedule(self._visit)

    def run_layer(
        self, layer: int, requests: Sequence[int], use: Callable[[int, ExpertWeights], None]
    ) -> None:
        def each(group: list[tuple[int, ExpertWeights]]) -> None:
            for e, w in group:
                use(e, w)

        self.run_layer_many(layer, requests, each)

    def run_layer_many(
        self, layer: int, requests: Sequence[int],
        use_many: Callable[[list[tuple[int, ExpertWeights]]], None],
    ) -> None:
        """Per batch: the resident experts in one ``use_many`` call, then the experts whose
        reads complete together in one call each (``_serve``); a failed read is never used."""
        v = self._visit
        if v is None or v.layer != layer:
            self.prefetch(layer, requests)
            v = self._visit
        assert v is not None
        try:
            while True:
                self._serve(v, use_many)
                v.batch.clear()
                if v.pos >= len(v.keys):
                    break
                self._schedule(v)
        except BaseException:  # an error or Ctrl-C mid-layer: no unfinished read stays mapped
            self._abandon(v)
            raise
        finally:
            self._visit = None

    def close(self) -> None:
        self._prefault_stop.set()
        self.await_arena()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.guesses.clear()

    # ---- batches -----------------------------------------------------------------------------
    def _schedule(self, v: _Visit) -> None:
        """Walk requests from ``v.pos``: policy events, slot reservation, reads submitted.

        If the walk is refused part way (a policy's invalid victim, an oversized expert), the
        slots it reserved are handed back EMPTY before the error goes on: a reserved slot
        whose read was never submitted must not be served later as a hit.
        """
        misses: list[_Member] = []
        try:
            self._walk(v, misses)
        except BaseException:
            for m in misses:
                self._drop(make_key(v.layer, m.expert), m)
                v.batch.pop(make_key(v.layer, m.expert), None)
            raise
        if misses:
            self.await_arena()  # no read may land in the arena while it is being faulted in
        for m in sorted(misses, key=lambda m: (str(m.ref.path), m.ref.offset)):
            assert m.buf is not None  # a miss always has its destination
            m.future = _submit_demand(self._pool, self._read, m.ref, m.buf, m.blocks)

    def _walk(self, v: _Visit, misses: list[_Member]) -> None:
        batch = v.batch
        protected = set(batch) | self.guesses.keys()
        while v.pos < len(v.keys) and len(batch) < self.capacity:
            key, e = v.keys[v.pos], v.experts[v.pos]
            v.pos += 1
            if key in batch:
                if batch[key].slot is not None:  # a transient one is not resident
                    self.policy.on_hit(key)
                self.stats.extra["reuse"] += 1
                continue
            if key in v.done:
                # served by an earlier batch of this visit: ``use`` has all its positions, so
                # it is neither read nor used again (the policy hears of it while resident)
                if key in self.slot_of:
                    self.policy.on_hit(key)
                self.stats.extra["reuse"] += 1
                continue
            guess = self.guesses.claim(key)  # one never read, or failed, is read for real
            slot = self.slot_of.get(key)
            if slot is not None:
                self.policy.on_hit(key)
                if guess is not None:  # a guessed read, adopted: waited for like our own
                    self.stats.extra["reuse"] += 1
                    m = _Member(e, guess.ref, self._slot_buf(slot, guess.ref), slot, guess.future)
                    batch[key] = m
                    protected.add(key)
                    continue
                if self.published.get(key, self.step) < self.step:
                    self.stats.hits += 1
                else:
                    self.stats.extra["reuse"] += 1
                batch[key] = _Member(e, self.locator.ref(v.layer, e), None, slot)
                protected.add(key)
                continue
            self.stats.misses += 1
            ref = self.locator.ref(v.layer, e)
            if ref.nbytes > self.slot_bytes:
                raise K3Error(f"expert {v.layer}/{e} is {ref.nbytes} bytes, larger than a cache slot")
            slot = self._reserve(key, protected)
            if slot is None:
                self.stats.extra["transient"] += 1
                blocks = aligned_empty(self.stride, ALIGN)
                m = _Member(e, ref, blocks[_skew(ref) : _skew(ref) + ref.nbytes], slot,
                            blocks=blocks)
            else:
                m = _Member(e, ref, self._slot_buf(slot, ref), slot)
            batch[key] = m
            protected.add(key)
            misses.append(m)

    def _reserve(self, key: int, protected: set[int]) -> int | None:
        if not self.policy.admit(key, protected):
            return None
        return self._place(key, protected)

    def _place(self, key: int, protected: set[int]) -> int | None:
        """A slot for ``key``: a free one, else the policy's victim (never a protected key)."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = self.policy.choose_victim(protected)
            if victim is None:
                return None
            if victim in protected or victim not in self.slot_of:
                what = "protected (in use by this batch)" if victim in protected else "not resident"
                raise PluginError(
                    f"cache policy '{self.policy.name}' chose victim {victim:#x}, which is {what}; "
                    "refusing to evict it"
                )
            slot = self.slot_of.pop(victim)
            self.published.pop(victim, None)
            self.policy.on_evict(victim)
            self.stats.evictions += 1
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.policy.on_insert(key)
        return slot

    def _slot_buf(self, slot: int, ref: ExpertRef) -> np.ndarray:
        start = slot * self.stride + _skew(ref)
        return self.arena[start : start + ref.nbytes]

    def _read(self, ref: ExpertRef, buf: np.ndarray, blocks: np.ndarray | None = None) -> float:
        """Reader thread: fill ``buf`` completely or raise. Returns the seconds spent."""
        t0 = time.perf_counter()
        what = f"routed expert {ref.layer}/{ref.expert}"
        if ref.contiguous:
            self.index.read_at(ref.path, *self._window(ref, buf, blocks), what)
        else:
            for p in ref.parts:
                self.index.read_at(p.path, p.file_off, buf[p.slot_off : p.slot_off + p.nbytes], what)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.bytes_read += ref.nbytes
            self.stats.read_seconds += dt
        return dt

    def _window(self, ref: ExpertRef, buf: np.ndarray, blocks: np.ndarray | None = None
                ) -> tuple[int, np.ndarray]:
        """Where to read a contiguous expert from and into what: its bytes exactly, or, on a
        shard read in aligned blocks (O_DIRECT) with ``buf`` in a slot (or in the ``blocks``
        of a transient expert), the whole blocks around them: one request where the exact
        read is three (its middle, then each unaligned end through a bounce buffer; on the
        medium model 84 us of CPU per expert, a 128-id first prefill reads 1,480; streamed
        at ``--cache-gb 0.2`` half the misses are transient). The blocks fit the slot (its
        stride is a whole ALIGN past the largest expert); the bytes on either side of the
        expert's are the shard's neighbours, never served."""
        align = self.index.read_alignment(ref.path)
        if align <= 1 or ALIGN % align:
            return ref.offset, buf
        if blocks is not None:  # buf is blocks[_skew(ref):]
            home, pos, room = blocks, _skew(ref), (0, blocks.size)
        else:
            pos = buf.ctypes.data - self._arena_at
            if not 0 <= pos < self.arena.size:
                return ref.offset, buf
            home = self.arena
            first = pos // self.stride * self.stride
            room = (first, first + self.stride)
        head = ref.offset % align
        lo = ref.offset - head
        hi = min(-(-(ref.offset + ref.nbytes) // align) * align, self.index.shard_size(ref.path))
        start = pos - head
        if start < room[0] or start + hi - lo > room[1]:
            return ref.offset, buf  # not inside its slot: the exact read
        return lo, home[start : start + hi - lo]

    def _serve(self, v: _Visit,
               use_many: Callable[[list[tuple[int, ExpertWeights]]], None]) -> None:
        """Use every expert of the batch as soon as its bytes are in: the resident ones in
        one ``use_many`` call first, then the reads that complete together in one call each,
        in the order they complete (``use_many`` writes only those experts' own outputs, so
        neither the grouping nor the order can change the MoE sum). A failed read is never
        used; the batch still waits for every read before the drop is raised."""
        pending: dict[Future[float], int] = {}
        ready: list[tuple[int, ExpertWeights]] = []
        for key, m in v.batch.items():
            if m.future is None:
                ready.append((m.expert, self._weights(key, m)))
                v.done.add(key)
            else:
                pending[m.future] = key
        if ready:
            use_many(ready)
        failed: list[tuple[_Member, Exception]] = []
        while pending:
            t0 = time.perf_counter()
            try:
                done, _ = futures_wait(pending, return_when=FIRST_COMPLETED)
            finally:
                self.stats.exposed_wait_seconds += time.perf_counter() - t0
            landed: list[tuple[int, ExpertWeights]] = []
            for fut in sorted(done, key=lambda f: pending[f]):  # a fixed order within a wake
                key = pending.pop(fut)
                m = v.batch[key]
                try:
                    fut.result()
                except Exception as exc:  # a failed read is never served
                    failed.append((m, exc))
                    self._drop(key, m)
                    m.future = None
                    continue
                m.future = None
                if m.slot is not None:  # a transient buffer is never looked up again
                    self.published[key] = self.step
                if not failed:
                    landed.append((m.expert, self._weights(key, m)))
                    v.done.add(key)
            if landed:
                use_many(landed)
        if failed:
            self._raise_drops(v, failed)

    def _weights(self, key: int, m: _Member) -> ExpertWeights:
        """The expert's weights over its bytes: built once per key and slot."""
        if m.slot is None:  # a transient buffer: never served again
            assert m.buf is not None
            return self.locator.views(m.ref, m.buf)
        got = self._slot_views[m.slot]
        if got is not None and got[0] == key:
            return got[1]
        w = self.locator.views(m.ref, m.buf if m.buf is not None else self._slot_buf(m.slot, m.ref))
        self._slot_views[m.slot] = (key, w)
        return w

    def _raise_drops(self, v: _Visit, failed: list[tuple[_Member, Exception]]) -> None:
        self.stats.drops += len(failed)
        m, err = failed[0]
        v.batch.clear()
        what = f"routed expert {v.layer}/{m.expert}"
        why = err.message if isinstance(err, K3Error) else repr(err)
        why = why.removeprefix(f"{what}: ")
        raise ExpertDropError(
            f"{what} could not be read ({why}); refusing a partial MoE sum: "
            f"{len(failed)} expert(s) dropped, the run is invalid"
        )

    def _wait(self, v: _Visit) -> None:
        """Wait for the batch's reads; publish complete ones; fail on any failed one."""
        t0 = time.perf_counter()
        failed: list[tuple[_Member, Exception]] = []
        for key, m in v.batch.items():
            if m.future is None:
                continue
            try:
                m.future.result()
            except Exception as exc:  # a failed read is never served
                failed.append((m, exc))
                self._drop(key, m)
            except BaseException:  # Ctrl-C while waiting: an interrupt, not a failed read
                self._abandon(v)
                raise
            else:
                if m.slot is not None:  # a transient buffer is never looked up again
                    self.published[key] = self.step
            m.future = None
        self.stats.exposed_wait_seconds += time.perf_counter() - t0
        if failed:
            self._raise_drops(v, failed)

    def _abandon(self, v: _Visit) -> None:
        """Give up a batch: no slot keeps a read that has not completed (nor is counted)."""
        for key, m in v.batch.items():
            if m.future is not None:
                # a read already under way still writes into its slot: retire the slot
                self._drop(key, m, reuse=m.future.cancel() or m.future.done())
                m.future = None
        v.batch.clear()

    def _drop(self, key: int, m: _Member, reuse: bool = True) -> None:
        if m.slot is not None:
            self._free(key, m.slot, reuse)

    def _free(self, key: int, slot: int, reuse: bool = True) -> None:
        """``key``'s ``slot`` goes back EMPTY (``reuse`` False: retired, a read still under
        way writes into it) and the policy hears ``on_evict``."""
        if self.slot_of.get(key) == slot:
            del self.slot_of[key]
            self.key_of[slot] = None
            if reuse:
                self.free.append(slot)
            self.published.pop(key, None)
            self.policy.on_evict(key)

    def _finish_visit(self) -> None:
        v = self._visit
        self._visit = None
        if v is not None:
            try:
                self._wait(v)
            finally:
                v.batch.clear()

    # ---- the router lookahead (k3core/experts/lookahead.py) ---------------------------------
    def lookahead(self, layer: int, guess: Sequence[int]) -> None:
        """A guess of ``layer``'s experts: read at low priority (:class:`GuessedReads`)."""
        self.guesses.guess(layer, guess)

    # GuessSlots: what the guessed reads may ask of the slots
    def is_resident(self, key: int) -> bool:
        return key in self.slot_of

    def kept_from(self, layer: int) -> set[int]:
        keep = {k for k in self.slot_of if key_layer(k) >= layer}
        if self._visit is not None:
            keep |= set(self._visit.keys) | set(self._visit.batch)
        return keep

    def guess_ref(self, layer: int, expert: int) -> ExpertRef | None:
        ref = self.locator.ref(layer, expert)
        return ref if ref.nbytes <= self.slot_bytes else None

    def reserve_guess(self, key: int, keep: set[int]) -> int | None:
        if not self.free and all(k in keep for k in self.slot_of):
            return None  # nothing a guess may evict
        return self._place(key, keep)  # a prefetch: placed, not announced as a request

    def read_slot(self, ref: ExpertRef, slot: int) -> float:
        return self._read(ref, self._slot_buf(slot, ref))

    def submit_read(self, fn: Callable[[ExpertRef, int], float], ref: ExpertRef,
                    slot: int) -> Future[float]:
        self.await_arena()  # no read may land in the arena while it is being faulted in
        return self._pool.submit(fn, ref, slot)

    def publish(self, key: int, step: int) -> None:
        self.published[key] = step

    def release(self, key: int, slot: int) -> None:
        self._free(key, slot)

    # ---- reporting ---------------------------------------------------------------------------
    @property
    def resident(self) -> int:
        return len(self.slot_of)


def _submit_demand(pool: ThreadPoolExecutor,
                   read: Callable[[ExpertRef, np.ndarray, np.ndarray | None], float],
                   ref: ExpertRef, buf: np.ndarray, blocks: np.ndarray | None = None
                   ) -> Future[float]:
    """Submit a miss's read as a demand read (k3core/api/read_priority.py): counted from
    submission until its future is done, failed or cancelled, so the trunk's read-ahead
    yields to it while it waits for a reader thread too."""
    DEMAND.begin()
    try:
        fut = pool.submit(read, ref, buf, blocks)
    except BaseException:
        DEMAND.end()
        raise
    fut.add_done_callback(lambda _f: DEMAND.end())
    return fut
